#include "rollout/engine/request.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/model_config.h"

const char *fr_finish_reason_name(fr_finish_reason r)
{
    switch (r) {
    case FR_FINISH_STOP: return "stop";
    case FR_FINISH_LENGTH: return "length";
    case FR_FINISH_ABORT: return "abort";
    case FR_FINISH_ERROR: return "error";
    default: return "none";
    }
}

void fr_sample_result_free(fr_sample_result *r)
{
    if (!r) return;
    free(r->tokens);
    free(r->logprobs);
    free(r->versions);
    free(r->kl);
    free(r->top_ids);
    free(r->top_logprobs);
    free(r->prompt_logprobs);
    free(r->routed_experts);
    free(r->text);
    memset(r, 0, sizeof *r);
}

/* Flags of a record's optional parts. */
enum { REC_TOKENS = 1, REC_KL = 2, REC_TOP = 4, REC_PROMPT = 8, REC_ROUTES = 16, REC_TEXT = 32 };

void fr_sample_result_put(fr_rank_buf *b, const fr_sample_result *r, int with_tokens)
{
    const unsigned parts = (with_tokens ? REC_TOKENS : 0) | (r->kl && r->n_tokens > 0 ? REC_KL : 0) |
                           (r->top_n > 0 && r->top_ids && r->top_logprobs ? REC_TOP : 0) |
                           (r->prompt_logprobs ? REC_PROMPT : 0) | (fr_sample_route_bytes(r) ? REC_ROUTES : 0) |
                           (r->text ? REC_TEXT : 0);
    fr_rank_put_u64(b, r->request_id);
    fr_rank_put_u64(b, r->group);
    fr_rank_put_i32(b, r->sample);
    fr_rank_put_i32(b, r->start);
    fr_rank_put_i32(b, (int)r->finish);
    fr_rank_put_i32(b, r->n_tokens);
    fr_rank_put_i32(b, r->preemptions);
    fr_rank_put_u8(b, (unsigned)(r->monitored != 0));
    fr_rank_put(b, &r->div, sizeof r->div);
    fr_rank_put_u8(b, parts);
    if (parts & REC_TOKENS) {
        fr_rank_put(b, r->tokens, sizeof(int) * (size_t)r->n_tokens);
        fr_rank_put(b, r->logprobs, sizeof(float) * (size_t)r->n_tokens);
        for (int i = 0; i < r->n_tokens; i++) fr_rank_put_u64(b, r->versions ? r->versions[i] : 0);
    }
    if (parts & REC_KL) fr_rank_put(b, r->kl, sizeof(float) * (size_t)r->n_tokens);
    if (parts & REC_TOP) {
        fr_rank_put_i32(b, r->top_n);
        fr_rank_put(b, r->top_ids, sizeof(int) * (size_t)r->n_tokens * (size_t)r->top_n);
        fr_rank_put(b, r->top_logprobs, sizeof(float) * (size_t)r->n_tokens * (size_t)r->top_n);
    }
    if (parts & REC_PROMPT) {
        fr_rank_put_i32(b, r->n_prompt_logprobs);
        fr_rank_put(b, r->prompt_logprobs, sizeof(float) * (size_t)r->n_prompt_logprobs);
    }
    if (parts & REC_ROUTES) {
        fr_rank_put_i32(b, r->route_layers);
        fr_rank_put_i32(b, r->route_k);
        fr_rank_put_i32(b, r->route_width);
        fr_rank_put(b, r->routed_experts, fr_sample_route_bytes(r) * (size_t)r->n_tokens);
    }
    if (parts & REC_TEXT) {
        fr_rank_put_i32(b, r->stop_string);
        fr_rank_put_bytes(b, r->text, r->text_len);
    }
}

/* The text part of a record: its bytes and the stop string that ended it. */
static void get_text(fr_rank_reader *r, fr_sample_result *out, fr_status *st)
{
    out->stop_string = fr_rank_get_i32(r);
    size_t n = 0;
    const void *p = fr_rank_get_bytes(r, &n);
    if (r->bad || out->stop_string < 0 || out->stop_string > FR_MAX_STOP_STRINGS) {
        if (!*st) *st = fr_fail(FR_EFORMAT, "sample record: truncated or malformed text");
        return;
    }
    out->text = malloc(n + 1);
    if (!out->text) {
        if (!*st) *st = fr_fail(FR_ENOMEM, "sample record: out of memory");
        return;
    }
    if (n) memcpy(out->text, p, n);
    out->text[n] = '\0';
    out->text_len = n;
}

/* n elements of `size` bytes from the reader into a new array. NULL when
 * truncated (*st FR_EFORMAT) or out of memory (*st FR_ENOMEM: the bytes are
 * skipped, so the rest of the record and the next records stay readable). */
static void *get_array(fr_rank_reader *r, int n, size_t size, fr_status *st)
{
    if (*st && *st != FR_ENOMEM) return NULL;
    if ((size_t)n > (r->len - r->pos) / size) {
        *st = fr_fail(FR_EFORMAT, "sample record: truncated array");
        return NULL;
    }
    const size_t len = (size_t)n * size;
    void *out = *st ? NULL : malloc(len ? len : 1);
    if (!out) {
        if (!*st) *st = fr_fail(FR_ENOMEM, "sample record: out of memory");
        r->pos += len;
        return NULL;
    }
    fr_rank_get(r, out, len);
    return out;
}

/* A record's routed experts: their shape, then n_tokens records. */
static void get_routes(fr_rank_reader *r, fr_sample_result *out, fr_status *st)
{
    out->route_layers = fr_rank_get_i32(r);
    out->route_k = fr_rank_get_i32(r);
    out->route_width = fr_rank_get_i32(r);
    const long long per = (long long)out->route_layers * out->route_k * out->route_width;
    if (out->route_layers < 1 || out->route_layers > FR_MAX_LAYERS || out->route_k < 1 ||
        out->route_k > FR_MAX_EXPERTS || (out->route_width != 1 && out->route_width != 2) ||
        per * out->n_tokens > INT_MAX) {
        if (!*st) *st = fr_fail(FR_EFORMAT, "sample record: bad routed experts (%d layers x %d x %d bytes)",
                                out->route_layers, out->route_k, out->route_width);
        out->route_layers = out->route_k = out->route_width = 0;
        return;
    }
    out->routed_experts = get_array(r, (int)(per * out->n_tokens), 1, st);
}

fr_status fr_sample_result_get(fr_rank_reader *r, fr_sample_result *out)
{
    memset(out, 0, sizeof *out);
    out->request_id = fr_rank_get_u64(r);
    out->group = fr_rank_get_u64(r);
    out->sample = fr_rank_get_i32(r);
    out->start = fr_rank_get_i32(r);
    out->finish = (fr_finish_reason)fr_rank_get_i32(r);
    out->n_tokens = fr_rank_get_i32(r);
    out->preemptions = fr_rank_get_i32(r);
    out->monitored = (int)fr_rank_get_u8(r);
    if (fr_rank_get(r, &out->div, sizeof out->div)) r->bad = 1;
    const unsigned parts = fr_rank_get_u8(r);
    fr_status st = r->bad || out->n_tokens < 0 || out->start < 0 ? fr_fail(FR_EFORMAT, "sample record: truncated or malformed") : FR_OK;
    if (parts & REC_TOKENS) {
        out->tokens = get_array(r, out->n_tokens, sizeof(int), &st);
        out->logprobs = get_array(r, out->n_tokens, sizeof(float), &st);
        out->versions = get_array(r, out->n_tokens, sizeof(uint64_t), &st);
    }
    if (parts & REC_KL) out->kl = get_array(r, out->n_tokens, sizeof(float), &st);
    if (parts & REC_TOP) {
        out->top_n = fr_rank_get_i32(r);
        if (out->top_n < 1 || out->top_n > FR_MAX_TOP_LOGPROBS) {
            if (!st) st = fr_fail(FR_EFORMAT, "sample record: %d top log-probs", out->top_n);
        } else {
            out->top_ids = get_array(r, out->n_tokens * out->top_n, sizeof(int), &st);
            out->top_logprobs = get_array(r, out->n_tokens * out->top_n, sizeof(float), &st);
        }
    }
    if (parts & REC_PROMPT) {
        out->n_prompt_logprobs = fr_rank_get_i32(r);
        if (out->n_prompt_logprobs < 0 && !st) st = fr_fail(FR_EFORMAT, "sample record: bad prompt log-probs");
        if (!st || st == FR_ENOMEM)
            out->prompt_logprobs = get_array(r, out->n_prompt_logprobs, sizeof(float), &st);
    }
    if (parts & REC_ROUTES) get_routes(r, out, &st);
    if ((parts & REC_TEXT) && (!st || st == FR_ENOMEM)) get_text(r, out, &st);
    if (st) {
        if (st != FR_ENOMEM) r->bad = 1;
        fr_sample_result_free(out);
    }
    return st;
}

/* The continued tokens of a request (fr_request_spec.continue_tokens). */
static fr_status check_continue(const fr_request_spec *r, int vocab)
{
    const unsigned long long id = (unsigned long long)r->id;
    if (r->n_continue < 0 || (r->n_continue > 0 && !r->continue_tokens))
        return fr_fail(FR_EINVAL, "request %llu: bad continued tokens (%d)", id, r->n_continue);
    if (r->n_continue == 0) return FR_OK;
    if (r->n != 1)
        return fr_fail(FR_EINVAL, "request %llu: continue_tokens are one sample's tokens: n must be 1 (got %d)", id,
                       r->n);
    if (r->forced) return fr_fail(FR_EINVAL, "request %llu: continue_tokens and forced_tokens do not go together", id);
    if (r->prompt_logprobs)
        return fr_fail(FR_EINVAL, "request %llu: continue_tokens and prompt_logprobs do not go together (the prompt's "
                                  "log-probs come with the sample's first part)", id);
    if (r->n_continue >= r->max_tokens)
        return fr_fail(FR_EINVAL, "request %llu: %d continued tokens leave nothing to generate within max_tokens %d "
                                  "(max_tokens counts the continued tokens)", id, r->n_continue, r->max_tokens);
    for (int i = 0; i < r->n_continue; i++)
        if (r->continue_tokens[i] < 0 || r->continue_tokens[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: continued token %d is id %d, outside the vocabulary of %d", id, i,
                           r->continue_tokens[i], vocab);
    return FR_OK;
}

fr_status fr_request_spec_check(const fr_request_spec *r, int vocab)
{
    if (!r) return fr_fail(FR_EINVAL, "request: NULL");
    if (!r->prompt || r->n_prompt < 1) return fr_fail(FR_EINVAL, "request %llu: the prompt is empty",
                                                      (unsigned long long)r->id);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: prompt token %d is id %d, outside the vocabulary of %d",
                           (unsigned long long)r->id, i, r->prompt[i], vocab);
    if (r->n < 1) return fr_fail(FR_EINVAL, "request %llu: n must be >= 1 (got %d)", (unsigned long long)r->id, r->n);
    if (r->first_sample < 0 || r->first_sample > INT_MAX - r->n)
        return fr_fail(FR_EINVAL, "request %llu: first_sample must be in [0, %d] for n = %d (got %d)",
                       (unsigned long long)r->id, INT_MAX - r->n, r->n, r->first_sample);
    if (r->max_tokens < 1)
        return fr_fail(FR_EINVAL, "request %llu: max_tokens must be >= 1 (got %d)", (unsigned long long)r->id,
                       r->max_tokens);
    if (r->n_stop < 0 || (r->n_stop > 0 && !r->stop_ids))
        return fr_fail(FR_EINVAL, "request %llu: bad stop ids", (unsigned long long)r->id);
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids[i] < 0 || r->stop_ids[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: stop id %d is outside the vocabulary of %d",
                           (unsigned long long)r->id, r->stop_ids[i], vocab);
    if (r->forced && r->n_forced < 1)
        return fr_fail(FR_EINVAL, "request %llu: forced tokens given but n_forced is %d", (unsigned long long)r->id,
                       r->n_forced);
    for (int i = 0; r->forced && i < r->n_forced; i++)
        if (r->forced[i] < 0 || r->forced[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: forced token %d (%d) is outside the vocabulary of %d",
                           (unsigned long long)r->id, i, r->forced[i], vocab);
    if (r->min_tokens < 0 || r->min_tokens > r->max_tokens)
        return fr_fail(FR_EINVAL, "request %llu: min_tokens must be in [0, max_tokens = %d] (got %d)",
                       (unsigned long long)r->id, r->max_tokens, r->min_tokens);
    if (r->top_logprobs < 0 || r->top_logprobs > FR_MAX_TOP_LOGPROBS || r->top_logprobs > vocab)
        return fr_fail(FR_EINVAL, "request %llu: logprobs (top log-probs per token) must be in [0, %d] (got %d)",
                       (unsigned long long)r->id, FR_MAX_TOP_LOGPROBS < vocab ? FR_MAX_TOP_LOGPROBS : vocab,
                       r->top_logprobs);
    if (r->prompt_logprobs != 0 && r->prompt_logprobs != 1)
        return fr_fail(FR_EINVAL, "request %llu: prompt_logprobs must be 0 or 1 (got %d)", (unsigned long long)r->id,
                       r->prompt_logprobs);
    if (r->return_routed_experts != 0 && r->return_routed_experts != 1)
        return fr_fail(FR_EINVAL, "request %llu: return_routed_experts must be 0 or 1 (got %d)",
                       (unsigned long long)r->id, r->return_routed_experts);
    fr_status st = check_continue(r, vocab);
    if (st) return st;
    char what[48];
    snprintf(what, sizeof what, "request %llu", (unsigned long long)r->id);
    if ((st = fr_stop_strings_check(&r->stop_strings, what))) return st;
    if (r->stop_strings.include != 0 && r->stop_strings.include != 1)
        return fr_fail(FR_EINVAL, "%s: include (of the stop strings) must be 0 or 1", what);
    if (r->keep_special != 0 && r->keep_special != 1)
        return fr_fail(FR_EINVAL, "%s: keep_special must be 0 or 1", what);
    st = fr_sampling_params_check(&r->params, vocab);
    if (!st) st = fr_penalties_check(&r->penalties);
    if (st) {
        char msg[512];   /* the message is rewritten below: copy it first */
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return fr_fail(st, "request %llu: %s", (unsigned long long)r->id, msg);
    }
    return FR_OK;
}
