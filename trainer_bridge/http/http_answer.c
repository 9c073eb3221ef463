/* The JSON the HTTP API answers with (docs/http.md): SGLang's /generate
 * objects (text, output_ids, meta_info), OpenAI's completions and their
 * stream chunks, and the errors. Log-probs as JSON numbers: %.9g reads back
 * as the same float; -inf (a token the model gives no chance) as -9999.0,
 * which every JSON reader takes, since JSON has no infinity. */
#include "trainer_bridge/http/http_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char rep[] = "\xEF\xBF\xBD";

/* Length of the well-formed UTF-8 character at s[0, n), 0 when there is none. */
static size_t utf8_char(const unsigned char *s, size_t n)
{
    const unsigned char c = s[0];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || len > n) return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if (len == 2 && c < 0xC2) return 0;                                  /* overlong */
    if (len == 3 && ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] >= 0xA0))) return 0;   /* overlong, surrogate */
    if (len == 4 && ((c == 0xF0 && s[1] < 0x90) || c > 0xF4 || (c == 0xF4 && s[1] >= 0x90))) return 0;
    return len;
}

void http_json_str(fr_buf *out, const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    fr_buf_put(out, "\"", 1);
    for (size_t i = 0; i < n;) {
        const unsigned char c = s[i];
        if (c == '"' || c == '\\') {
            fr_buf_put(out, "\\", 1);
            fr_buf_put(out, &c, 1);
            i++;
        } else if (c < 0x20) {
            fr_buf_printf(out, "\\u%04x", c);
            i++;
        } else if (c < 0x80) {
            fr_buf_put(out, &c, 1);
            i++;
        } else {
            size_t len = utf8_char(s + i, n - i);
            if (len) fr_buf_put(out, s + i, len);
            else fr_buf_put(out, rep, 3);   /* bytes that are not UTF-8 (half a character of a token) */
            i += len ? len : 1;
        }
    }
    fr_buf_put(out, "\"", 1);
}

static void json_lp(fr_buf *b, float x)
{
    if (isfinite(x)) fr_buf_printf(b, "%.9g", (double)x);
    else if (x < 0) fr_buf_printf(b, "-9999.0");
    else fr_buf_printf(b, "null");
}

const char *http_finish_name(fr_wire_finish f)
{
    return fr_wire_finish_name(f);
}

void http_error_json(fr_buf *out, unsigned status, const char *type, const char *msg)
{
    fr_buf_printf(out, "{\"error\":{\"message\":");
    http_json_str(out, msg, strlen(msg));
    fr_buf_printf(out, ",\"type\":\"%s\",\"code\":%u}}", type, status);
}

void http_sample_free(http_sample *s)
{
    if (!s) return;
    fr_buf_free(&s->tokb);
    fr_buf_free(&s->lpb);
    fr_buf_free(&s->wvb);
    fr_buf_free(&s->text);
    free(s->matched);
    free(s->top_ids);
    free(s->top_lps);
    if (s->sample == 0) free(s->plp);
    free(s->routes);
    memset(s, 0, sizeof *s);
}

int http_sample_append(http_sample *s, const int *tok, const float *lp, const uint64_t *wv, int n)
{
    const size_t k = (size_t)n;
    if (fr_buf_reserve(&s->tokb, sizeof *tok * k) || fr_buf_reserve(&s->lpb, sizeof *lp * k) ||
        fr_buf_reserve(&s->wvb, sizeof *wv * k))
        return -1;
    fr_buf_put(&s->tokb, tok, sizeof *tok * k);
    fr_buf_put(&s->lpb, lp, sizeof *lp * k);
    fr_buf_put(&s->wvb, wv, sizeof *wv * k);
    /* malloc'd, so aligned for any of the three */
    s->tok = (int *)(void *)s->tokb.data;
    s->lp = (float *)(void *)s->lpb.data;
    s->wv = (uint64_t *)(void *)s->wvb.data;
    s->n += n;
    return 0;
}

/* One token's own text (OpenAI's logprobs.tokens), special tokens
 * written out; appended to out (nothing without a tokenizer). */
static void token_piece(const fr_tokenizer *tok, int id, fr_buf *out)
{
    char *t = NULL;
    size_t n = 0;
    if (tok && !fr_tokenizer_decode(tok, &id, 1, 0, &t, &n)) fr_buf_put(out, t, n);
    free(t);
}

/* ---- SGLang ------------------------------------------------------------------ */

static void sglang_finish(fr_buf *b, const http_sample *s)
{
    if (!s->ended) {
        fr_buf_printf(b, "null");
        return;
    }
    switch (s->finish) {
    case FR_WIRE_STOP:
        if (s->matched) {
            fr_buf_printf(b, "{\"type\":\"stop\",\"matched\":");
            http_json_str(b, s->matched, strlen(s->matched));
            fr_buf_printf(b, "}");
        } else {
            fr_buf_printf(b, "{\"type\":\"stop\",\"matched\":%d}", s->n ? s->tok[s->n - 1] : -1);
        }
        return;
    case FR_WIRE_LENGTH: fr_buf_printf(b, "{\"type\":\"length\",\"length\":%d}", s->n); return;
    default:
        fr_buf_printf(b, "{\"type\":\"abort\",\"message\":");
        http_json_str(b, s->why, strlen(s->why));
        fr_buf_printf(b, "}");
    }
}

/* SGLang's log-prob entries: [logprob, token_id, null] (the text is null:
 * return_text_in_logprobs is not done). */
static void sglang_logprobs(fr_buf *b, const http_view *v, const http_sample *s, int p, int final)
{
    const http_gen *g = v->gen;
    fr_buf_printf(b, ",\"output_token_logprobs\":[");
    for (int i = 0; i < s->n; i++) {
        fr_buf_printf(b, "%s[", i ? "," : "");
        json_lp(b, s->lp[i]);
        fr_buf_printf(b, ",%d,null]", s->tok[i]);
    }
    fr_buf_printf(b, "],\"input_token_logprobs\":[");
    /* entry i is prompt token i from logprob_start_len on: the first token has none */
    for (int i = g->logprob_start_len; s->plp && i >= 0 && i < g->n_prompt[p]; i++) {
        fr_buf_printf(b, "%s[", i > g->logprob_start_len ? "," : "");
        if (i == 0) fr_buf_printf(b, "null");
        else json_lp(b, s->plp[i - 1]);
        fr_buf_printf(b, ",%d,null]", g->prompt[p][i]);
    }
    fr_buf_printf(b, "]");
    if (g->top_logprobs_num > 0) {
        fr_buf_printf(b, ",\"output_top_logprobs\":[");
        for (int i = 0; final && s->top_k > 0 && i < s->n; i++) {
            fr_buf_printf(b, "%s[", i ? "," : "");
            for (int k = 0; k < s->top_k; k++) {
                fr_buf_printf(b, "%s[", k ? "," : "");
                json_lp(b, s->top_lps[(size_t)i * s->top_k + k]);
                fr_buf_printf(b, ",%d,null]", s->top_ids[(size_t)i * s->top_k + k]);
            }
            fr_buf_printf(b, "]");
        }
        fr_buf_printf(b, "]");
    }
}

/* SGLang's meta_info.routed_experts: the ids as little-endian int32 in
 * base64 (token, layer, slot order), with their shape beside them. */
static void sglang_routes(fr_buf *b, const http_sample *s)
{
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const size_t ids = (size_t)s->n * (size_t)s->route_layers * (size_t)s->route_k, len = 4 * ids;
    fr_buf_printf(b, ",\"routed_experts\":\"");
    uint8_t q[3];
    size_t nq = 0;
    for (size_t at = 0; at < len; at++) {
        const uint8_t *p = s->routes + (at / 4) * (size_t)s->route_width;
        const size_t byte = at % 4;
        q[nq++] = byte == 0 ? p[0] : byte == 1 && s->route_width == 2 ? p[1] : 0;
        if (nq < 3 && at + 1 < len) continue;
        const unsigned w = (unsigned)q[0] << 16 | (nq > 1 ? (unsigned)q[1] << 8 : 0) | (nq > 2 ? q[2] : 0);
        char out[5] = {abc[w >> 18], abc[w >> 12 & 63], nq > 1 ? abc[w >> 6 & 63] : '=', nq > 2 ? abc[w & 63] : '=', 0};
        fr_buf_put(b, out, 4);
        nq = 0;
    }
    fr_buf_printf(b, "\",\"routed_experts_shape\":[%d,%d,%d]", s->n, s->route_layers, s->route_k);
}

static void sglang_meta(fr_buf *b, const http_view *v, int i)
{
    const http_sample *s = &v->s[i];
    const http_gen *g = v->gen;
    const int p = i / g->n;
    fr_buf_printf(b, "\"meta_info\":{\"id\":");
    if (g->rid[p]) http_json_str(b, g->rid[p], strlen(g->rid[p]));
    else fr_buf_printf(b, "\"%s-%d\"", v->id, p);
    fr_buf_printf(b, ",\"prompt_tokens\":%d,\"completion_tokens\":%d,\"cached_tokens\":0,\"finish_reason\":",
                  g->n_prompt[p], s->n);
    sglang_finish(b, s);
    if (s->ended) fr_buf_printf(b, ",\"e2e_latency\":%.6f", s->total_ms / 1000.0);
    if (g->return_logprob) sglang_logprobs(b, v, s, p, s->ended);
    fr_buf_printf(b, ",\"weight_version\":%llu,\"weight_versions\":[",
                  (unsigned long long)(s->n ? s->wv[s->n - 1] : 0));
    for (int k = 0; k < s->n; k++) fr_buf_printf(b, "%s%llu", k ? "," : "", (unsigned long long)s->wv[k]);
    fr_buf_printf(b, "],\"sample\":%d", s->sample);
    if (s->has_seed) fr_buf_printf(b, ",\"seed\":%llu", (unsigned long long)s->seed);
    if (s->ended && s->div.has_values)
        fr_buf_printf(b, ",\"kl\":{\"mean\":%.9g,\"max\":%.9g,\"top1_agreement\":%.9g,\"logprob_diff_mean\":%.9g,"
                         "\"positions\":%d}",
                      s->div.kl_mean, s->div.kl_max, s->div.top1_agreement, s->div.logprob_diff_mean, s->div.positions);
    if (s->ended && s->routes) sglang_routes(b, s);
    fr_buf_printf(b, "}");
}

static void sglang_object(fr_buf *b, const http_view *v, int i, int index)
{
    const http_sample *s = &v->s[i];
    fr_buf_printf(b, "{");
    if (v->tok) {
        fr_buf_printf(b, "\"text\":");
        http_json_str(b, s->text.data ? s->text.data : "", s->text.len);
        fr_buf_printf(b, ",");
    }
    fr_buf_printf(b, "\"output_ids\":[");
    for (int k = 0; k < s->n; k++) fr_buf_printf(b, "%s%d", k ? "," : "", s->tok[k]);
    fr_buf_printf(b, "],");
    if (index) fr_buf_printf(b, "\"index\":%d,", i);
    sglang_meta(b, v, i);
    fr_buf_printf(b, "}");
}

void http_answer_generate(const http_view *v, fr_buf *out)
{
    const int list = v->gen->batch || v->gen->n > 1;
    if (list) fr_buf_printf(out, "[");
    for (int i = 0; i < v->n_samples; i++) {
        if (i) fr_buf_printf(out, ",");
        sglang_object(out, v, i, 0);
    }
    if (list) fr_buf_printf(out, "]");
}

void http_chunk_generate(const http_view *v, int i, fr_buf *out)
{
    fr_buf_printf(out, "data: ");
    sglang_object(out, v, i, 1);
    fr_buf_printf(out, "\n\n");
    v->s[i].tok_sent = v->s[i].n;
    v->s[i].text_sent = v->s[i].text.len;
    v->s[i].final_sent = v->s[i].ended;
}

/* ---- OpenAI ------------------------------------------------------------------ */

/* logprobs of tokens [from, to) of s (to the prompt's when echo put it first). */
static void openai_logprobs(fr_buf *b, const http_view *v, const http_sample *s, int from, int to, int with_prompt,
                            size_t offset0)
{
    const http_gen *g = v->gen;
    fr_buf tokens = {0}, lps = {0}, tops = {0}, offs = {0}, piece = {0};
    size_t off = offset0;
    int first = 1;
    const int p = (int)(s - v->s) / g->n;
    for (int i = with_prompt ? 0 : -1; with_prompt && i < g->n_prompt[p]; i++) {
        fr_buf_printf(&tokens, "%s", first ? "" : ",");
        fr_buf_printf(&lps, "%s", first ? "" : ",");
        fr_buf_printf(&tops, "%snull", first ? "" : ",");
        fr_buf_printf(&offs, "%s%zu", first ? "" : ",", off);
        piece.len = 0;
        token_piece(v->tok, g->prompt[p][i], &piece);
        http_json_str(&tokens, piece.data ? piece.data : "", piece.len);
        off += piece.len;
        if (i == 0 || !s->plp) fr_buf_printf(&lps, "null");
        else json_lp(&lps, s->plp[i - 1]);
        first = 0;
    }
    for (int i = from; i < to; i++) {
        fr_buf_printf(&tokens, "%s", first ? "" : ",");
        fr_buf_printf(&lps, "%s", first ? "" : ",");
        fr_buf_printf(&offs, "%s%zu", first ? "" : ",", off);
        piece.len = 0;
        token_piece(v->tok, s->tok[i], &piece);
        http_json_str(&tokens, piece.data ? piece.data : "", piece.len);
        off += piece.len;
        json_lp(&lps, s->lp[i]);
        fr_buf_printf(&tops, "%s", first ? "" : ",");
        if (g->top_logprobs_num > 0 && s->top_k > 0) {
            fr_buf_printf(&tops, "{");
            for (int k = 0; k < s->top_k; k++) {
                piece.len = 0;
                token_piece(v->tok, s->top_ids[(size_t)i * s->top_k + k], &piece);
                if (k) fr_buf_printf(&tops, ",");
                http_json_str(&tops, piece.data ? piece.data : "", piece.len);
                fr_buf_printf(&tops, ":");
                json_lp(&tops, s->top_lps[(size_t)i * s->top_k + k]);
            }
            fr_buf_printf(&tops, "}");
        } else {
            fr_buf_printf(&tops, "null");
        }
        first = 0;
    }
    fr_buf_printf(b, "{\"tokens\":[%s],\"token_logprobs\":[%s],\"top_logprobs\":[%s],\"text_offset\":[%s]}",
                  tokens.data ? tokens.data : "", lps.data ? lps.data : "", tops.data ? tops.data : "",
                  offs.data ? offs.data : "");
    fr_buf_free(&tokens);
    fr_buf_free(&lps);
    fr_buf_free(&tops);
    fr_buf_free(&offs);
    fr_buf_free(&piece);
}

static void openai_finish(fr_buf *b, const http_sample *s)
{
    if (!s->ended) fr_buf_printf(b, "null");
    else fr_buf_printf(b, "\"%s\"", http_finish_name(s->finish));
}

/* One choice: tokens [from, to) and text [tfrom, tto) of sample i. */
static void openai_choice(fr_buf *b, const http_view *v, int i, int from, int to, size_t tfrom, size_t tto, int echo)
{
    const http_sample *s = &v->s[i];
    const http_gen *g = v->gen;
    const int p = i / g->n;
    const char *pt = echo ? g->prompt_text[p] : NULL;
    fr_buf_printf(b, "{\"index\":%d,\"text\":", i);
    fr_buf t = {0};
    if (pt) {
        fr_buf_put(&t, pt, strlen(pt));
    } else if (echo && v->tok) {   /* a prompt of ids, as the engine's text would read it */
        char *d = NULL;
        size_t dn = 0;
        if (!fr_tokenizer_decode(v->tok, g->prompt[p], (size_t)g->n_prompt[p], 1, &d, &dn)) fr_buf_put(&t, d, dn);
        free(d);
    }
    if (tto > tfrom) fr_buf_put(&t, s->text.data + tfrom, tto - tfrom);
    http_json_str(b, t.data ? t.data : "", t.len);
    fr_buf_free(&t);
    fr_buf_printf(b, ",\"logprobs\":");
    if (g->openai_logprobs) openai_logprobs(b, v, s, from, to, echo, echo ? 0 : tfrom);
    else fr_buf_printf(b, "null");
    fr_buf_printf(b, ",\"finish_reason\":");
    openai_finish(b, s);
    /* vLLM's stop_reason and SGLang's matched_stop: the stop string or stop token */
    for (int k = 0; k < 2; k++) {
        fr_buf_printf(b, k ? ",\"matched_stop\":" : ",\"stop_reason\":");
        if (s->ended && s->matched) http_json_str(b, s->matched, strlen(s->matched));
        else if (s->ended && s->finish == FR_WIRE_STOP && s->n) fr_buf_printf(b, "%d", s->tok[s->n - 1]);
        else fr_buf_printf(b, "null");
    }
    fr_buf_printf(b, ",\"token_ids\":[");
    for (int k = from; k < to; k++) fr_buf_printf(b, "%s%d", k > from ? "," : "", s->tok[k]);
    fr_buf_printf(b, "]");
    if (s->has_seed) fr_buf_printf(b, ",\"seed\":%llu", (unsigned long long)s->seed);
    fr_buf_printf(b, "}");
}

static void openai_head(fr_buf *b, const http_view *v)
{
    fr_buf_printf(b, "{\"id\":\"%s\",\"object\":\"text_completion\",\"created\":%ld,\"model\":", v->id, v->created);
    http_json_str(b, v->model, strlen(v->model));
}

static void usage(fr_buf *b, const http_view *v)
{
    long long prompt = 0, done = 0;
    for (int p = 0; p < v->gen->n_prompts; p++) prompt += v->gen->n_prompt[p];
    for (int i = 0; i < v->n_samples; i++) done += v->s[i].n;
    fr_buf_printf(b, "\"usage\":{\"prompt_tokens\":%lld,\"completion_tokens\":%lld,\"total_tokens\":%lld}", prompt,
                  done, prompt + done);
}

void http_answer_completions(const http_view *v, fr_buf *out)
{
    openai_head(out, v);
    fr_buf_printf(out, ",\"choices\":[");
    for (int i = 0; i < v->n_samples; i++) {
        if (i) fr_buf_printf(out, ",");
        openai_choice(out, v, i, 0, v->s[i].n, 0, v->s[i].text.len, v->gen->echo);
    }
    fr_buf_printf(out, "],");
    usage(out, v);
    fr_buf_printf(out, "}");
}

void http_chunk_completions(const http_view *v, int i, fr_buf *out)
{
    http_sample *s = &v->s[i];
    /* top log-probs come with a sample's done: with them, its tokens wait for it */
    const int wait_top = v->gen->top_logprobs_num > 0 && !s->ended;
    const int to = wait_top ? s->tok_sent : s->n;
    const size_t tto = wait_top ? s->text_sent : s->text.len;
    const int first = s->tok_sent == 0 && s->text_sent == 0;
    if (s->final_sent || (to == s->tok_sent && tto <= s->text_sent && !s->ended)) return;
    fr_buf_printf(out, "data: ");
    openai_head(out, v);
    fr_buf_printf(out, ",\"choices\":[");
    openai_choice(out, v, i, s->tok_sent, to, s->text_sent, tto > s->text_sent ? tto : s->text_sent,
                  first && v->gen->echo);
    fr_buf_printf(out, "]}\n\n");
    s->tok_sent = to;
    if (tto > s->text_sent) s->text_sent = tto;
    s->final_sent = s->ended;
}

void http_chunk_usage(const http_view *v, fr_buf *out)
{
    fr_buf_printf(out, "data: ");
    openai_head(out, v);
    fr_buf_printf(out, ",\"choices\":[],");
    usage(out, v);
    fr_buf_printf(out, "}\n\n");
}
