/* Request bodies of /generate (SGLang's GenerateReqInput and
 * SamplingParams) and /v1/completions (OpenAI's completions request, with
 * vLLM's extra sampling keys) into one parsed request (http_internal.h).
 * Strict where a mistake would change what is generated: a sampling key
 * this server does not know, or knows and does not do, is refused naming
 * it; keys of the request around the sampling that only other servers use
 * (lora_path, return_hidden_states, user, ...) are left alone, so a
 * framework's requests pass unchanged. docs/http.md lists both. */
#include "trainer_bridge/http/http_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BAD(...) fr_fail(FR_EINVAL, __VA_ARGS__)

void http_gen_free(http_gen *g)
{
    if (!g) return;
    for (int i = 0; i < g->n_prompts; i++) {
        if (g->prompt) free(g->prompt[i]);
        if (g->prompt_text) free(g->prompt_text[i]);
        if (g->rid) free(g->rid[i]);
    }
    free(g->prompt);
    free(g->n_prompt);
    free(g->prompt_text);
    free(g->rid);
    free(g->g.stop_token_ids);
    for (int i = 0; g->g.stop && i < g->g.n_stop; i++) free(g->g.stop[i]);
    free(g->g.stop);
    memset(g, 0, sizeof *g);
}

static int is_null(const cJSON *x) { return !x || cJSON_IsNull(x); }

/* A JSON number that is a whole number in [lo, hi]. */
static fr_status get_int(const cJSON *x, const char *name, long long lo, long long hi, int *out)
{
    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < (double)lo ||
        x->valuedouble > (double)hi)
        return BAD("%s: must be a whole number in [%lld, %lld]", name, lo, hi);
    *out = (int)x->valuedouble;
    return FR_OK;
}

static fr_status get_num(const cJSON *x, const char *name, double lo, double hi, double *out)
{
    if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || x->valuedouble < lo || x->valuedouble > hi)
        return BAD("%s: must be a number in [%g, %g]", name, lo, hi);
    *out = x->valuedouble;
    return FR_OK;
}

static fr_status get_bool(const cJSON *x, const char *name, int *out)
{
    if (!cJSON_IsBool(x)) return BAD("%s: must be true or false", name);
    *out = cJSON_IsTrue(x);
    return FR_OK;
}

/* A list of token ids (>= 0, at most 2^24 of them). */
static fr_status get_ids(const cJSON *x, const char *name, int min_len, int **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    if (!cJSON_IsArray(x)) return BAD("%s: must be a list of token ids", name);
    const int len = cJSON_GetArraySize(x);
    if (len < min_len || len > (1 << 24)) return BAD("%s: must hold %d to %d token ids, got %d", name, min_len, 1 << 24, len);
    int *v = malloc(sizeof(int) * (size_t)(len ? len : 1));
    if (!v) return fr_fail(FR_ENOMEM, "http: out of memory");
    int i = 0;
    for (const cJSON *e = x->child; e; e = e->next, i++) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble > 2147483647.0) {
            free(v);
            return BAD("%s[%d]: must be a token id (a whole number >= 0)", name, i);
        }
        v[i] = (int)e->valuedouble;
    }
    *ids = v;
    *n = len;
    return FR_OK;
}

/* Room for n prompts. */
static fr_status alloc_prompts(http_gen *g, int n)
{
    g->n_prompts = n;
    g->prompt = calloc((size_t)n, sizeof *g->prompt);
    g->n_prompt = calloc((size_t)n, sizeof *g->n_prompt);
    g->prompt_text = calloc((size_t)n, sizeof *g->prompt_text);
    g->rid = calloc((size_t)n, sizeof *g->rid);
    if (!g->prompt || !g->n_prompt || !g->prompt_text || !g->rid) return fr_fail(FR_ENOMEM, "http: out of memory");
    return FR_OK;
}

/* A text prompt: encoded as the server encodes a generate's prompt_text,
 * with the tokenizer's special tokens (SGLang's and vLLM's default). */
static fr_status text_prompt(http_gen *g, int i, const cJSON *x, const char *name, const fr_tokenizer *tok)
{
    if (!cJSON_IsString(x)) return BAD("%s: must be a string", name);
    size_t len = strlen(x->valuestring);
    if (len == 0) return BAD("%s: is empty", name);
    if (!tok)
        return BAD("%s: text needs the server's tokenizer, and this server has none (serve --tokenizer PATH, or a "
                   "checkpoint folder holding a tokenizer.json): send token ids",
                   name);
    fr_status st = fr_bridge_encode_prompt(tok, x->valuestring, len, 1, &g->prompt[i], &g->n_prompt[i]);
    if (st) return fr_fail(st, "%s: %s", name, fr_last_error());
    if (!(g->prompt_text[i] = strdup(x->valuestring))) return fr_fail(FR_ENOMEM, "http: out of memory");
    g->text_in = 1;
    return FR_OK;
}

/* A prompt that is text, ids, or a list of either (batch). */
static fr_status read_prompts(http_gen *g, const cJSON *x, const char *name, int ids_only, const fr_tokenizer *tok)
{
    char item[64];
    if (cJSON_IsString(x) && !ids_only) {
        fr_status st = alloc_prompts(g, 1);
        return st ? st : text_prompt(g, 0, x, name, tok);
    }
    if (!cJSON_IsArray(x) || cJSON_GetArraySize(x) == 0)
        return BAD("%s: must be %s", name, ids_only ? "a list of token ids or a list of such lists"
                                                    : "a string, a list of strings, a list of token ids or a list of such lists");
    const cJSON *first = x->child;
    if (cJSON_IsNumber(first)) {   /* one prompt of ids */
        fr_status st = alloc_prompts(g, 1);
        return st ? st : get_ids(x, name, 1, &g->prompt[0], &g->n_prompt[0]);
    }
    const int n = cJSON_GetArraySize(x);
    if (n > 65536) return BAD("%s: a batch of %d prompts; at most 65536", name, n);
    fr_status st = alloc_prompts(g, n);
    g->batch = 1;
    int i = 0;
    for (const cJSON *e = x->child; !st && e; e = e->next, i++) {
        snprintf(item, sizeof item, "%s[%d]", name, i);
        if (cJSON_IsString(e) && !ids_only) st = text_prompt(g, i, e, item, tok);
        else if (cJSON_IsArray(e)) st = get_ids(e, item, 1, &g->prompt[i], &g->n_prompt[i]);
        else st = BAD("%s: must be %s", item, ids_only ? "a list of token ids" : "a string or a list of token ids");
    }
    return st;
}

/* One stop string, within the engine's bounds (docs/sampling.md, "Stop
 * strings"; the engine refuses what is not UTF-8). */
static fr_status add_stop(http_gen *g, const cJSON *e, const char *name)
{
    if (!cJSON_IsString(e) || !e->valuestring[0]) return BAD("%s: must be a non-empty string", name);
    if (strlen(e->valuestring) > FR_PROTO_MAX_STOP_BYTES)
        return BAD("%s: longer than %d bytes", name, FR_PROTO_MAX_STOP_BYTES);
    if (!(g->g.stop[g->g.n_stop] = strdup(e->valuestring))) return fr_fail(FR_ENOMEM, "http: out of memory");
    g->g.n_stop++;
    return FR_OK;
}

/* Stop strings go to the engine, which matches them (the protocol's stop). */
static fr_status read_stop(http_gen *g, const cJSON *x, const char *name)
{
    if (is_null(x) || (cJSON_IsArray(x) && !x->child)) return FR_OK;
    if (!cJSON_IsString(x) && !cJSON_IsArray(x)) return BAD("%s: must be a string or a list of strings", name);
    const int n = cJSON_IsString(x) ? 1 : cJSON_GetArraySize(x);
    if (n > FR_PROTO_MAX_STOP) return BAD("%s: at most %d stop strings", name, FR_PROTO_MAX_STOP);
    if (g->g.stop) return BAD("%s: given twice", name);
    if (!(g->g.stop = calloc((size_t)n, sizeof *g->g.stop))) return fr_fail(FR_ENOMEM, "http: out of memory");
    if (cJSON_IsString(x)) return add_stop(g, x, name);
    char item[160];
    fr_status st = FR_OK;
    int i = 0;
    for (const cJSON *e = x->child; !st && e; e = e->next, i++) {
        snprintf(item, sizeof item, "%s[%d]", name, i);
        st = add_stop(g, e, item);
    }
    return st;
}

/* Keys other servers know and this one does not do: refused when they ask
 * for something (a value other than null, false or empty). */
static fr_status refuse_unsupported(const cJSON *obj, const char *where, const char *const *keys)
{
    for (int i = 0; keys[i]; i++) {
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(obj, keys[i]);
        if (is_null(x) || cJSON_IsFalse(x) || (cJSON_IsObject(x) && !x->child) || (cJSON_IsArray(x) && !x->child) ||
            (cJSON_IsString(x) && !x->valuestring[0]))
            continue;
        return BAD("%s%s: not supported by this server (docs/http.md)", where, keys[i]);
    }
    return FR_OK;
}

/* One sampling key shared by both APIs; 1 when `key` was one of them. */
static fr_status common_key(http_gen *g, const cJSON *x, const char *key, const char *name, int *known)
{
    fr_msg_generate *m = &g->g;
    *known = 1;
    if (is_null(x)) return FR_OK;
    if (!strcmp(key, "temperature")) {
        m->has_temperature = 1;
        return get_num(x, name, 0, 1e6, &m->temperature);
    }
    if (!strcmp(key, "top_p")) {
        m->has_top_p = 1;
        fr_status st = get_num(x, name, 0, 1, &m->top_p);
        return st ? st : m->top_p > 0 ? FR_OK : BAD("%s: must be in (0, 1]", name);
    }
    if (!strcmp(key, "top_k")) {   /* -1 (SGLang, vLLM) and 0 are off */
        fr_status st = get_int(x, name, -1, 1 << 30, &m->top_k);
        if (m->top_k < 0) m->top_k = 0;
        m->has_top_k = 1;
        return st;
    }
    if (!strcmp(key, "min_p")) return get_num(x, name, 0, 1, &m->min_p);
    if (!strcmp(key, "presence_penalty")) return get_num(x, name, -2, 2, &m->presence_penalty);
    if (!strcmp(key, "frequency_penalty")) return get_num(x, name, -2, 2, &m->frequency_penalty);
    if (!strcmp(key, "repetition_penalty")) {
        fr_status st = get_num(x, name, 0, 2, &m->repetition_penalty);
        return st ? st : m->repetition_penalty > 0 ? FR_OK : BAD("%s: must be in (0, 2]", name);
    }
    if (!strcmp(key, "stop")) return read_stop(g, x, name);
    if (!strcmp(key, "stop_token_ids")) {
        m->has_stop_token_ids = 1;
        return get_ids(x, name, 0, &m->stop_token_ids, &m->n_stop_token_ids);
    }
    if (!strcmp(key, "ignore_eos")) return get_bool(x, name, &g->ignore_eos);
    if (!strcmp(key, "skip_special_tokens")) {
        int skip = 1;
        fr_status st = get_bool(x, name, &skip);
        m->keep_special_tokens = !skip;
        return st;
    }
    if (!strcmp(key, "n")) return get_int(x, name, 1, 65536, &g->n);
    if (!strcmp(key, "seed") || !strcmp(key, "sampling_seed")) {
        if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 9007199254740992.0 ||
            x->valuedouble != floor(x->valuedouble))
            return BAD("%s: must be a whole number in [0, 2^53]", name);
        m->has_seed = 1;
        m->seed = (uint64_t)x->valuedouble;
        return FR_OK;
    }
    *known = 0;
    return FR_OK;
}

static const char *const sglang_unsupported[] = {"json_schema", "regex", "ebnf", "structural_tag", "custom_params",
                                                 "logit_bias", NULL};
/* Keys SGLang knows that change nothing here. */
static const char *const sglang_ignored[] = {"spaces_between_special_tokens", "stream_interval", NULL};

static fr_status sglang_sampling(http_gen *g, const cJSON *sp)
{
    if (is_null(sp)) return FR_OK;
    if (cJSON_IsArray(sp)) return BAD("sampling_params: one object for every prompt (a list is not supported)");
    if (!cJSON_IsObject(sp)) return BAD("sampling_params: must be an object");
    fr_status st = refuse_unsupported(sp, "sampling_params.", sglang_unsupported);
    char name[160];
    for (const cJSON *x = sp->child; !st && x; x = x->next) {
        const char *k = x->string;
        snprintf(name, sizeof name, "sampling_params.%s", k);
        int known = 0;
        if ((st = common_key(g, x, k, name, &known)) || known || is_null(x)) continue;
        if (!strcmp(k, "max_new_tokens")) {
            g->g.has_max_tokens = 1;
            st = get_int(x, name, 1, 1 << 30, &g->g.max_tokens);
        } else if (!strcmp(k, "min_new_tokens")) {
            st = get_int(x, name, 0, 1 << 30, &g->g.min_tokens);
        } else if (!strcmp(k, "no_stop_trim")) {   /* the text keeps the stop string, as vLLM's include */
            st = get_bool(x, name, &g->g.include_stop_str_in_output);
        } else {
            int ignored = 0;
            for (int i = 0; sglang_unsupported[i]; i++) ignored |= !strcmp(k, sglang_unsupported[i]);
            for (int i = 0; sglang_ignored[i]; i++) ignored |= !strcmp(k, sglang_ignored[i]);
            if (!ignored) st = BAD("%s: unknown sampling parameter", name);
        }
    }
    return st;
}

static fr_status sglang_rids(http_gen *g, const cJSON *rid)
{
    if (is_null(rid)) return FR_OK;
    if (cJSON_IsString(rid) && !g->batch) {
        if (strlen(rid->valuestring) >= HTTP_ID_MAX) return BAD("rid: longer than %d bytes", HTTP_ID_MAX - 1);
        return (g->rid[0] = strdup(rid->valuestring)) ? FR_OK : fr_fail(FR_ENOMEM, "http: out of memory");
    }
    if (!cJSON_IsArray(rid) || cJSON_GetArraySize(rid) != g->n_prompts)
        return BAD("rid: must be a string (one prompt) or a list of %d strings (one per prompt)", g->n_prompts);
    int i = 0;
    for (const cJSON *e = rid->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e) || strlen(e->valuestring) >= HTTP_ID_MAX)
            return BAD("rid[%d]: must be a string of at most %d bytes", i, HTTP_ID_MAX - 1);
        if (!(g->rid[i] = strdup(e->valuestring))) return fr_fail(FR_ENOMEM, "http: out of memory");
    }
    return FR_OK;
}

static void defaults(http_gen *g, int api)
{
    memset(g, 0, sizeof *g);
    g->api = api;
    g->n = 1;
    g->logprob_start_len = -1;
    g->g.monitor_divergence = -1;
}

static cJSON *parse_object(const char *body, size_t len)
{
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root) fr_fail(FR_EINVAL, "the body is not JSON");
    else if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        root = NULL;
        fr_fail(FR_EINVAL, "the body must be a JSON object");
    }
    return root;
}

static fr_status sglang_body(http_gen *g, const cJSON *root, const fr_tokenizer *tok)
{
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "text");
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(root, "input_ids");
    if (!is_null(cJSON_GetObjectItemCaseSensitive(root, "input_embeds")))
        return BAD("input_embeds: not supported by this server (send text or input_ids)");
    if (is_null(t) == is_null(ids)) return BAD("text, input_ids: give exactly one of them");
    fr_status st = is_null(t) ? read_prompts(g, ids, "input_ids", 1, tok) : read_prompts(g, t, "text", 0, tok);
    if (!st) st = sglang_sampling(g, cJSON_GetObjectItemCaseSensitive(root, "sampling_params"));
    if (!st) st = sglang_rids(g, cJSON_GetObjectItemCaseSensitive(root, "rid"));
    const cJSON *x;
    if (!st && !is_null(x = cJSON_GetObjectItemCaseSensitive(root, "return_logprob")))
        st = get_bool(x, "return_logprob", &g->return_logprob);
    if (!st && !is_null(x = cJSON_GetObjectItemCaseSensitive(root, "top_logprobs_num")))
        st = get_int(x, "top_logprobs_num", 0, FR_PROTO_MAX_LOGPROBS, &g->top_logprobs_num);
    if (!st && !is_null(x = cJSON_GetObjectItemCaseSensitive(root, "logprob_start_len")))
        st = get_int(x, "logprob_start_len", -1, 1 << 30, &g->logprob_start_len);
    if (!st && !is_null(x = cJSON_GetObjectItemCaseSensitive(root, "stream"))) st = get_bool(x, "stream", &g->stream);
    if (!st && !is_null(x = cJSON_GetObjectItemCaseSensitive(root, "return_routed_experts")))
        st = get_bool(x, "return_routed_experts", &g->g.return_routed_experts);
    if (!st && !g->return_logprob) {   /* SGLang reports log-probs only when asked */
        g->top_logprobs_num = 0;
        g->logprob_start_len = -1;
    }
    return st;
}

fr_status http_parse_generate(const char *body, size_t len, const fr_tokenizer *tok, http_gen *g)
{
    defaults(g, API_SGLANG);
    cJSON *root = parse_object(body, len);
    if (!root) return FR_EINVAL;
    fr_status st = sglang_body(g, root, tok);
    cJSON_Delete(root);
    if (!st) {
        g->g.logprobs = g->top_logprobs_num;
        g->g.prompt_logprobs = g->logprob_start_len >= 0;
    }
    if (st) http_gen_free(g);
    return st;
}

static const char *const openai_unsupported[] = {"suffix", "logit_bias", "guided_json", "guided_regex",
                                                 "guided_choice", "guided_grammar", "response_format", NULL};

/* The OpenAI keys of a completions request that are not shared sampling keys. */
static fr_status openai_key(http_gen *g, const cJSON *x, const char *k)
{
    if (!strcmp(k, "max_tokens")) {
        g->g.has_max_tokens = 1;
        return get_int(x, k, 1, 1 << 30, &g->g.max_tokens);
    }
    if (!strcmp(k, "min_tokens")) return get_int(x, k, 0, 1 << 30, &g->g.min_tokens);
    if (!strcmp(k, "logprobs")) {
        g->openai_logprobs = 1;
        return get_int(x, k, 0, FR_PROTO_MAX_LOGPROBS, &g->top_logprobs_num);
    }
    if (!strcmp(k, "echo")) return get_bool(x, k, &g->echo);
    if (!strcmp(k, "include_stop_str_in_output")) return get_bool(x, k, &g->g.include_stop_str_in_output);
    if (!strcmp(k, "stream")) return get_bool(x, k, &g->stream);
    if (!strcmp(k, "stream_options")) {
        const cJSON *u = cJSON_IsObject(x) ? cJSON_GetObjectItemCaseSensitive(x, "include_usage") : NULL;
        if (!cJSON_IsObject(x)) return BAD("stream_options: must be an object");
        return is_null(u) ? FR_OK : get_bool(u, "stream_options.include_usage", &g->include_usage);
    }
    if (!strcmp(k, "model")) {
        if (!cJSON_IsString(x)) return BAD("model: must be a string");
        snprintf(g->model, sizeof g->model, "%s", x->valuestring);
        return FR_OK;
    }
    if (!strcmp(k, "best_of")) {
        int b;
        fr_status st = get_int(x, k, 1, 65536, &b);
        return st ? st : b <= 1 ? FR_OK : BAD("best_of: only 1 is supported (use n for several samples)");
    }
    return FR_OK;   /* user, and keys only other servers read */
}

fr_status http_parse_completions(const char *body, size_t len, const fr_tokenizer *tok, http_gen *g)
{
    defaults(g, API_OPENAI);
    g->g.has_max_tokens = 1;   /* OpenAI's default */
    g->g.max_tokens = 16;
    cJSON *root = parse_object(body, len);
    if (!root) return FR_EINVAL;
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    fr_status st = is_null(p) ? BAD("prompt: required") : read_prompts(g, p, "prompt", 0, tok);
    if (!st) st = refuse_unsupported(root, "", openai_unsupported);
    for (const cJSON *x = root->child; !st && x; x = x->next) {
        int known = 0;
        if (!strcmp(x->string, "prompt")) continue;
        if ((st = common_key(g, x, x->string, x->string, &known)) || known || is_null(x)) continue;
        st = openai_key(g, x, x->string);
    }
    cJSON_Delete(root);
    if (!st && g->echo && g->openai_logprobs) g->logprob_start_len = 0;   /* the prompt's log-probs come back too */
    if (!st) {
        g->g.logprobs = g->top_logprobs_num;
        g->g.prompt_logprobs = g->logprob_start_len >= 0;
    }
    if (st) http_gen_free(g);
    return st;
}
