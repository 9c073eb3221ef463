/* Protocol names, message init/free, and the value checks shared by the
 * encoder and the decoder (trainer_bridge/protocol/protocol.h). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_internal.h"

static const char *const type_names[FR_MSG_TYPE_COUNT] = {
    [FR_MSG_NONE] = "none",
    [FR_MSG_HELLO] = "hello",
    [FR_MSG_GENERATE] = "generate",
    [FR_MSG_ABORT] = "abort",
    [FR_MSG_PAUSE] = "pause",
    [FR_MSG_RESUME] = "resume",
    [FR_MSG_STATS] = "stats",
    [FR_MSG_UPDATE_BEGIN] = "update_weights_begin",
    [FR_MSG_UPDATE_BUCKET] = "update_weights_bucket",
    [FR_MSG_UPDATE_COMMIT] = "update_weights_commit",
    [FR_MSG_UPDATE_ABORT] = "update_weights_abort",
    [FR_MSG_NCCL_INIT] = "nccl_group_init",
    [FR_MSG_NCCL_BUCKET] = "update_weights_nccl_bucket",
    [FR_MSG_NCCL_CLOSE] = "nccl_group_close",
    [FR_MSG_HELLO_REPLY] = "hello_reply",
    [FR_MSG_TOKENS] = "tokens",
    [FR_MSG_DONE] = "done",
    [FR_MSG_ABORT_REPLY] = "abort_reply",
    [FR_MSG_PAUSE_REPLY] = "pause_reply",
    [FR_MSG_RESUME_REPLY] = "resume_reply",
    [FR_MSG_STATS_REPLY] = "stats_reply",
    [FR_MSG_ERROR] = "error",
    [FR_MSG_UPDATE_REPLY] = "update_weights_reply",
    [FR_MSG_NCCL_REPLY] = "nccl_group_reply",
};

const char *fr_msg_type_name(fr_msg_type t)
{
    if ((int)t <= FR_MSG_NONE || t >= FR_MSG_TYPE_COUNT) return "none";
    return type_names[t];
}

/* The index of the name of `len` bytes at s in names[first, n), or -1
 * (names arrive unterminated from msgpack). */
static int name_index(const char *const *names, int first, int n, const char *s, size_t len)
{
    for (int i = first; i < n; i++)
        if (names[i] && strlen(names[i]) == len && memcmp(names[i], s, len) == 0) return i;
    return -1;
}

fr_msg_type fr_proto_type_from_name(const char *s, size_t len)
{
    const int t = name_index(type_names, FR_MSG_NONE + 1, FR_MSG_TYPE_COUNT, s, len);
    return t < 0 ? FR_MSG_NONE : (fr_msg_type)t;
}

int fr_msg_type_from_client(fr_msg_type t) { return t >= FR_MSG_HELLO && t <= FR_MSG_NCCL_CLOSE; }

static const char *const nccl_state_names[] = {"joining", "closed"};

const char *fr_nccl_state_name(fr_nccl_state s)
{
    if ((int)s < 0 || s > FR_NCCL_CLOSED) return "none";
    return nccl_state_names[s];
}

int fr_proto_nccl_state_from_name(const char *s, size_t len, fr_nccl_state *out)
{
    const int i = name_index(nccl_state_names, 0, FR_NCCL_CLOSED + 1, s, len);
    if (i >= 0) *out = (fr_nccl_state)i;
    return i >= 0;
}

int fr_proto_dtype_from_name(const char *s, size_t len, fr_dtype *out)
{
    for (int i = 0; i < FR_DTYPE_COUNT; i++) {
        const char *n = fr_dtype_name((fr_dtype)i);
        if (fr_dtype_is_weight((fr_dtype)i) && strlen(n) == len && memcmp(n, s, len) == 0) {
            *out = (fr_dtype)i;
            return 1;
        }
    }
    return 0;
}

static const char *const stage_names[] = {"begin", "bucket", "commit", "abort"};

/* names[i] of a table of n, "none" outside it. */
static const char *name_at(const char *const *names, int n, int i) { return i >= 0 && i < n ? names[i] : "none"; }

const char *fr_update_stage_name(fr_update_stage s) { return name_at(stage_names, FR_UPD_ABORT + 1, (int)s); }

int fr_proto_stage_from_name(const char *s, size_t len, fr_update_stage *out)
{
    const int i = name_index(stage_names, 0, FR_UPD_ABORT + 1, s, len);
    if (i >= 0) *out = (fr_update_stage)i;
    return i >= 0;
}

uint64_t fr_msg_tensor_bytes(const fr_msg_tensor *t)
{
    if (!t || t->ndim < 1 || t->ndim > FR_PROTO_MAX_NDIM) return 0;
    uint64_t n = fr_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 1 || (uint64_t)t->shape[d] > (UINT64_C(1) << 62) / n) return 0;
        n *= (uint64_t)t->shape[d];
    }
    return n;
}

const char *fr_pause_mode_name(fr_pause_mode m)
{
    return m == FR_PAUSE_WAIT ? "wait" : m == FR_PAUSE_KEEP ? "keep" : "abort";
}

static const char *const finish_names[] = {"stop", "length", "abort", "error"};

const char *fr_wire_finish_name(fr_wire_finish f) { return name_at(finish_names, FR_WIRE_ERROR + 1, (int)f); }

int fr_proto_finish_from_name(const char *s, size_t len, fr_wire_finish *out)
{
    const int i = name_index(finish_names, 0, FR_WIRE_ERROR + 1, s, len);
    if (i >= 0) *out = (fr_wire_finish)i;
    return i >= 0;
}

void fr_msg_init(fr_msg *m, fr_msg_type t)
{
    if (!m) return;
    memset(m, 0, sizeof *m);
    m->type = t;
    if (t == FR_MSG_GENERATE) {
        m->u.generate.n = 1;
        m->u.generate.monitor_divergence = -1;
        m->u.generate.add_special_tokens = 1;
    }
    if (t == FR_MSG_UPDATE_REPLY) m->u.update_reply.bucket = -1;
}

void fr_msg_free(fr_msg *m)
{
    if (!m) return;
    switch (m->type) {
    case FR_MSG_GENERATE:
        free(m->u.generate.prompt);
        free(m->u.generate.stop_token_ids);
        free(m->u.generate.forced_tokens);
        free(m->u.generate.continue_tokens);
        free(m->u.generate.prompt_text);
        for (int i = 0; m->u.generate.stop && i < m->u.generate.n_stop; i++) free(m->u.generate.stop[i]);
        free(m->u.generate.stop);
        break;
    case FR_MSG_DONE:
        free(m->u.done.divergence.kl);
        free(m->u.done.top_token_ids);
        free(m->u.done.top_logprobs);
        free(m->u.done.prompt_logprobs);
        free(m->u.done.text);
        free(m->u.done.stop_str);
        free(m->u.done.prompt_token_ids);
        break;
    case FR_MSG_UPDATE_BEGIN:
        free(m->u.update_begin.tensors);
        break;
    case FR_MSG_UPDATE_BUCKET:
        free(m->u.update_bucket.pieces);
        break;
    case FR_MSG_NCCL_BUCKET:
        free(m->u.nccl_bucket.pieces);
        break;
    case FR_MSG_ABORT:
        free(m->u.abort.request_ids);
        break;
    case FR_MSG_TOKENS:
        free(m->u.tokens.token_ids);
        free(m->u.tokens.logprobs);
        free(m->u.tokens.weight_versions);
        free(m->u.tokens.text);
        break;
    case FR_MSG_ABORT_REPLY:
        free(m->u.abort_reply.not_found);
        break;
    default:
        break;
    }
    memset(m, 0, sizeof *m);
}

/* ---- value checks -------------------------------------------------------- */

#define BAD(...) fr_fail(FR_EFORMAT, __VA_ARGS__)

static fr_status check_ids(const char *type, const char *key, const int *ids, int n, int min_n)
{
    if (n < min_n || n > FR_PROTO_MAX_ARRAY)
        return BAD("%s: \"%s\" must hold %d to %d entries, got %d", type, key, min_n, FR_PROTO_MAX_ARRAY, n);
    if (n > 0 && !ids) return BAD("%s: \"%s\" has %d entries but no data", type, key, n);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0) return BAD("%s: \"%s\"[%d] must be a token id >= 0, got %d", type, key, i, ids[i]);
    return FR_OK;
}

static fr_status check_name(const char *type, const char *key, const char *s, int nonempty)
{
    size_t n = strnlen(s, FR_PROTO_NAME_MAX);
    if (n == FR_PROTO_NAME_MAX) return BAD("%s: \"%s\" is not terminated", type, key);
    if (nonempty && n == 0) return BAD("%s: \"%s\" is empty", type, key);
    return FR_OK;
}

/* v as the shortest decimal that reads back as the same double (1.0000001
 * stays 1.0000001, not "1"), for messages that quote a refused value. */
static const char *num(double v, char *buf, size_t cap)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

/* The text of a sample on the wire: bounded by the frame, not by this. */
#define MAX_RESULT_TEXT ((size_t)1 << 30)

/* A text key: len bytes of UTF-8 (NUL allowed), at most max. */
static fr_status check_text(const char *type, const char *key, const char *s, size_t len, size_t max)
{
    if (len > max) return BAD("%s: \"%s\" is %zu bytes, the limit is %zu", type, key, len, max);
    if (len > 0 && !s) return BAD("%s: \"%s\" has %zu bytes but no data", type, key, len);
    if (!fr_utf8_valid(s, len)) return BAD("%s: \"%s\" is not valid UTF-8", type, key);
    return FR_OK;
}

/* A stop string: 1 .. FR_PROTO_MAX_STOP_BYTES bytes of UTF-8 without NUL. */
static fr_status check_stop_str(const char *type, const char *key, const char *s)
{
    size_t n = s ? strnlen(s, FR_PROTO_MAX_STOP_BYTES + 1) : 0;
    if (n == 0) return BAD("%s: \"%s\" is empty", type, key);
    if (n > FR_PROTO_MAX_STOP_BYTES)
        return BAD("%s: \"%s\" is longer than %d bytes", type, key, FR_PROTO_MAX_STOP_BYTES);
    return check_text(type, key, s, n, FR_PROTO_MAX_STOP_BYTES);
}

/* generate's text keys: prompt_text (instead of prompt), add_special_tokens, stop, the flags. */
static fr_status check_generate_text(const fr_msg_generate *g)
{
    const char *t = "generate";
    fr_status st;
    if (g->prompt_text) {
        if (g->n_prompt > 0 || g->prompt) return BAD("%s: give \"prompt\" or \"prompt_text\", not both", t);
        if (g->prompt_text_len < 1) return BAD("%s: \"prompt_text\" is empty", t);
        if ((st = check_text(t, "prompt_text", g->prompt_text, g->prompt_text_len, FR_PROTO_MAX_TEXT))) return st;
    } else if ((st = check_ids(t, "prompt", g->prompt, g->n_prompt, 1))) {
        return st;
    }
    if (g->has_add_special_tokens && !g->prompt_text)
        return BAD("%s: \"add_special_tokens\" goes with \"prompt_text\" (token ids are sent as they are)", t);
    if (g->add_special_tokens != 0 && g->add_special_tokens != 1)
        return BAD("%s: \"add_special_tokens\" must be a boolean", t);
    if (g->stop && (g->n_stop < 1 || g->n_stop > FR_PROTO_MAX_STOP))
        return BAD("%s: \"stop\" must hold 1 to %d strings, got %d", t, FR_PROTO_MAX_STOP, g->n_stop);
    if (!g->stop && g->n_stop != 0) return BAD("%s: \"stop\" has %d strings but no data", t, g->n_stop);
    for (int i = 0; g->stop && i < g->n_stop; i++) {
        char k[24];
        snprintf(k, sizeof k, "stop[%d]", i);
        if ((st = check_stop_str(t, k, g->stop[i]))) return st;
    }
    if (g->include_stop_str_in_output != 0 && g->include_stop_str_in_output != 1)
        return BAD("%s: \"include_stop_str_in_output\" must be a boolean", t);
    if (g->return_text != 0 && g->return_text != 1) return BAD("%s: \"return_text\" must be a boolean", t);
    return FR_OK;
}

static fr_status check_generate(const fr_msg_generate *g)
{
    const char *t = "generate";
    char nb[32];
    fr_status st = check_generate_text(g);
    if (st) return st;
    if (g->n < 1 || g->n > FR_PROTO_MAX_SAMPLES)
        return BAD("%s: \"n\" must be in [1, %d], got %d", t, FR_PROTO_MAX_SAMPLES, g->n);
    if (g->first_sample < 0 || g->first_sample > INT_MAX - g->n)
        return BAD("%s: \"first_sample\" must be in [0, %d] for n = %d, got %d", t, INT_MAX - g->n, g->n,
                   g->first_sample);
    if (g->has_temperature && !(isfinite(g->temperature) && g->temperature >= 0))
        return BAD("%s: \"temperature\" must be a finite number >= 0 (0 = greedy), got %s", t, num(g->temperature, nb, sizeof nb));
    if (g->has_top_k && g->top_k < 0) return BAD("%s: \"top_k\" must be >= 0 (0 = off), got %d", t, g->top_k);
    if (g->has_top_p && !(g->top_p > 0 && g->top_p <= 1))
        return BAD("%s: \"top_p\" must be in (0, 1], got %s", t, num(g->top_p, nb, sizeof nb));
    if (g->has_max_tokens && g->max_tokens < 1)
        return BAD("%s: \"max_tokens\" must be >= 1, got %d", t, g->max_tokens);
    if (g->has_stop_token_ids &&
        (st = check_ids(t, "stop_token_ids", g->stop_token_ids, g->n_stop_token_ids, 0)))
        return st;
    if (g->monitor_divergence < -1 || g->monitor_divergence > 1)
        return BAD("%s: \"monitor_divergence\" must be a boolean", t);
    if (g->per_token_kl != 0 && g->per_token_kl != 1) return BAD("%s: \"per_token_kl\" must be a boolean", t);
    if (g->forced_tokens && (st = check_ids(t, "forced_tokens", g->forced_tokens, g->n_forced_tokens, 1)))
        return st;
    if (g->min_tokens < 0) return BAD("%s: \"min_tokens\" must be >= 0, got %d", t, g->min_tokens);
    if (g->has_max_tokens && g->min_tokens > g->max_tokens)
        return BAD("%s: \"min_tokens\" (%d) must not exceed \"max_tokens\" (%d)", t, g->min_tokens, g->max_tokens);
    if (g->logprobs < 0 || g->logprobs > FR_PROTO_MAX_LOGPROBS)
        return BAD("%s: \"logprobs\" must be in [0, %d] (top log-probs per token), got %d", t, FR_PROTO_MAX_LOGPROBS,
                   g->logprobs);
    if (g->prompt_logprobs != 0 && g->prompt_logprobs != 1) return BAD("%s: \"prompt_logprobs\" must be a boolean", t);
    if (!(g->min_p >= 0 && g->min_p <= 1)) return BAD("%s: \"min_p\" must be in [0, 1], got %s", t, num(g->min_p, nb, sizeof nb));
    if (!(g->presence_penalty >= -2 && g->presence_penalty <= 2))
        return BAD("%s: \"presence_penalty\" must be in [-2, 2], got %s", t, num(g->presence_penalty, nb, sizeof nb));
    if (!(g->frequency_penalty >= -2 && g->frequency_penalty <= 2))
        return BAD("%s: \"frequency_penalty\" must be in [-2, 2], got %s", t, num(g->frequency_penalty, nb, sizeof nb));
    if (!(g->repetition_penalty >= 0 && g->repetition_penalty <= 2))
        return BAD("%s: \"repetition_penalty\" must be in (0, 2] (1 = off), got %s", t,
                   num(g->repetition_penalty, nb, sizeof nb));
    if (g->n_continue_tokens < 0 || (g->n_continue_tokens > 0 && !g->continue_tokens))
        return BAD("%s: \"continue_tokens\" must be an array of token ids", t);
    if (g->n_continue_tokens > 0 &&
        (st = check_ids(t, "continue_tokens", g->continue_tokens, g->n_continue_tokens, 0)))
        return st;
    return FR_OK;
}

/* A tensor's name, dtype and shape; what names it in messages. */
static fr_status check_tensor(const char *type, const char *what, const fr_msg_tensor *x)
{
    fr_status st = check_name(type, what, x->name, 1);
    if (st) return st;
    if (!fr_dtype_is_weight(x->dtype))
        return BAD("%s: %s \"%s\": \"dtype\" must be f32, bf16 or f16", type, what, x->name);
    if (x->ndim < 1 || x->ndim > FR_PROTO_MAX_NDIM)
        return BAD("%s: %s \"%s\": \"shape\" must have 1 to %d dimensions, got %d", type, what, x->name,
                   FR_PROTO_MAX_NDIM, x->ndim);
    for (int d = 0; d < x->ndim; d++)
        if (x->shape[d] < 1)
            return BAD("%s: %s \"%s\": \"shape\"[%d] must be >= 1, got %lld", type, what, x->name, d,
                       (long long)x->shape[d]);
    if (fr_msg_tensor_bytes(x) == 0) return BAD("%s: %s \"%s\": the shape is too large", type, what, x->name);
    return FR_OK;
}

static fr_status check_update_begin(const fr_msg_update_begin *b)
{
    const char *t = "update_weights_begin";
    if (b->n_tensors < 1 || b->n_tensors > FR_PROTO_MAX_TENSORS || !b->tensors)
        return BAD("%s: \"tensors\" must list 1 to %d tensors, got %d", t, FR_PROTO_MAX_TENSORS, b->n_tensors);
    if (b->bucket_bytes < 1) return BAD("%s: \"bucket_bytes\" must be >= 1", t);
    uint64_t sum = 0;
    for (int i = 0; i < b->n_tensors; i++) {
        fr_status st = check_tensor(t, "tensor", &b->tensors[i]);
        if (st) return st;
        uint64_t n = fr_msg_tensor_bytes(&b->tensors[i]);
        if (sum > UINT64_MAX - n) return BAD("%s: the tensors' sizes overflow", t);
        sum += n;
    }
    if (sum != b->total_bytes)
        return BAD("%s: \"total_bytes\" is %llu but the tensors listed hold %llu bytes", t,
                   (unsigned long long)b->total_bytes, (unsigned long long)sum);
    return FR_OK;
}

static fr_status check_update_bucket(const fr_msg_update_bucket *b)
{
    const char *t = "update_weights_bucket";
    if (b->bucket < 0) return BAD("%s: \"bucket\" must be >= 0", t);
    if (b->n_pieces < 1 || b->n_pieces > FR_PROTO_MAX_ARRAY || !b->pieces)
        return BAD("%s: \"pieces\" must hold at least one piece", t);
    for (int i = 0; i < b->n_pieces; i++) {
        const fr_msg_piece *p = &b->pieces[i];
        fr_status st = check_tensor(t, "piece of", &p->t);
        if (st) return st;
        uint64_t total = fr_msg_tensor_bytes(&p->t), es = fr_dtype_size(p->t.dtype);
        if (p->nbytes < 1 || p->offset % es || p->nbytes % es)
            return BAD("%s: piece of \"%s\": \"offset\" (%llu) and \"nbytes\" (%llu) must be multiples of the "
                       "%s element size %llu, nbytes >= 1",
                       t, p->t.name, (unsigned long long)p->offset, (unsigned long long)p->nbytes,
                       fr_dtype_name(p->t.dtype), (unsigned long long)es);
        if (p->offset > total || p->nbytes > total - p->offset)
            return BAD("%s: piece of \"%s\": bytes [%llu, %llu) run past the tensor's %llu bytes", t, p->t.name,
                       (unsigned long long)p->offset, (unsigned long long)(p->offset + p->nbytes),
                       (unsigned long long)total);
    }
    return FR_OK;
}

/* The pieces of an NCCL bucket lie inside its nbytes and do not overlap
 * one another (the receiver unpacks them from one buffer). */
static fr_status check_nccl_bucket(const fr_msg_nccl_bucket *b)
{
    const char *t = "update_weights_nccl_bucket";
    if (b->bucket < 0) return BAD("%s: \"bucket\" must be >= 0", t);
    if (b->nbytes < 1) return BAD("%s: \"nbytes\" must be >= 1", t);
    if (b->n_pieces < 1 || b->n_pieces > FR_PROTO_MAX_ARRAY || !b->pieces)
        return BAD("%s: \"pieces\" must hold at least one piece", t);
    uint64_t end_prev = 0;
    for (int i = 0; i < b->n_pieces; i++) {
        const fr_msg_piece *p = &b->pieces[i];
        fr_status st = check_tensor(t, "piece of", &p->t);
        if (st) return st;
        uint64_t total = fr_msg_tensor_bytes(&p->t), es = fr_dtype_size(p->t.dtype);
        if (p->nbytes < 1 || p->offset % es || p->nbytes % es || p->at % es)
            return BAD("%s: piece of \"%s\": \"offset\" (%llu), \"nbytes\" (%llu) and \"at\" (%llu) must be "
                       "multiples of the %s element size %llu, nbytes >= 1",
                       t, p->t.name, (unsigned long long)p->offset, (unsigned long long)p->nbytes,
                       (unsigned long long)p->at, fr_dtype_name(p->t.dtype), (unsigned long long)es);
        if (p->offset > total || p->nbytes > total - p->offset)
            return BAD("%s: piece of \"%s\": bytes [%llu, %llu) run past the tensor's %llu bytes", t, p->t.name,
                       (unsigned long long)p->offset, (unsigned long long)(p->offset + p->nbytes),
                       (unsigned long long)total);
        if (p->at > b->nbytes || p->nbytes > b->nbytes - p->at)
            return BAD("%s: piece of \"%s\": bucket bytes [%llu, %llu) run past the bucket's %llu bytes", t,
                       p->t.name, (unsigned long long)p->at, (unsigned long long)(p->at + p->nbytes),
                       (unsigned long long)b->nbytes);
        if (p->at < end_prev)
            return BAD("%s: piece of \"%s\": pieces must be in bucket order without overlapping (\"at\" %llu, the "
                       "previous piece ends at %llu)", t, p->t.name, (unsigned long long)p->at,
                       (unsigned long long)end_prev);
        end_prev = p->at + p->nbytes;
    }
    return FR_OK;
}

static fr_status check_hello_reply(const fr_msg_hello_reply *h)
{
    const char *t = "hello_reply";
    fr_status st;
    if ((st = check_name(t, "server", h->server, 1)) || (st = check_name(t, "model", h->model, 1)) ||
        (st = check_name(t, "backend", h->backend, 1)) || (st = check_name(t, "kv_dtype", h->kv_dtype, 1)))
        return st;
    if (h->tp < 1 || h->engines < 1 || h->max_seqs < 1 || h->kv_blocks < 1 || h->kv_block_tokens < 1 ||
        h->max_model_len < 1 || h->vocab_size < 1 || h->chunk < 1)
        return BAD("hello_reply: tp, engines, max_seqs, kv_blocks, kv_block_tokens, max_model_len, vocab_size "
                   "and chunk must be >= 1");
    if (h->n_eos_token_ids < 0 || h->n_eos_token_ids > FR_PROTO_MAX_EOS)
        return BAD("hello_reply: \"eos_token_ids\" holds at most %d ids", FR_PROTO_MAX_EOS);
    if ((st = check_name(t, "tokenizer", h->tokenizer, 0))) return st;
    return check_ids(t, "eos_token_ids", h->eos_token_ids, h->n_eos_token_ids, 0);
}

static fr_status check_tokens(const fr_msg_tokens *k)
{
    const char *t = "tokens";
    if (k->sample < 0 || k->start < 0) return BAD("tokens: \"sample\" and \"start\" must be >= 0");
    fr_status st = check_ids(t, "token_ids", k->token_ids, k->n, 1);
    if (st) return st;
    if (!k->logprobs || !k->weight_versions) return BAD("tokens: \"logprobs\" or \"weight_versions\" missing");
    for (int i = 0; i < k->n; i++)
        if (!(k->logprobs[i] <= 0) && !isnan(k->logprobs[i]))
            return BAD("tokens: \"logprobs\"[%d] must be <= 0, got %g", i, (double)k->logprobs[i]);
    if (!k->has_text && (k->text || k->text_len)) return BAD("tokens: \"text\" given without has_text");
    return k->has_text ? check_text(t, "text", k->text, k->text_len, MAX_RESULT_TEXT) : FR_OK;
}

static fr_status check_done(const fr_msg_done *d)
{
    if (d->sample < 0 || d->n_tokens < 0 || d->n_prompt < 0 || d->preemptions < 0 || d->start < 0)
        return BAD("done: \"sample\", \"start\", \"n_tokens\", \"n_prompt\" and \"preemptions\" must be >= 0");
    if ((int)d->finish_reason < 0 || d->finish_reason > FR_WIRE_ERROR)
        return BAD("done: \"finish_reason\" must be stop, length, abort or error");
    if (!(d->total_ms >= 0) || (d->has_ttft && !(d->ttft_ms >= 0)))
        return BAD("done: timings must be >= 0 milliseconds");
    if (d->divergence.has_values && d->divergence.positions < 0)
        return BAD("done: \"divergence.positions\" must be >= 0");
    if (d->divergence.n_kl < 0 || d->divergence.n_kl > FR_PROTO_MAX_ARRAY ||
        (d->divergence.n_kl > 0 && !d->divergence.kl) || (d->divergence.kl && !d->divergence.has_values))
        return BAD("done: \"divergence.per_token_kl\" comes only with the other divergence figures");
    if (d->top_k < 0 || d->top_k > FR_PROTO_MAX_LOGPROBS || (d->top_k > 0 && (!d->top_token_ids || !d->top_logprobs)))
        return BAD("done: \"top_logprobs.k\" must be in [1, %d] with its arrays", FR_PROTO_MAX_LOGPROBS);
    if (d->n_prompt_logprobs < 0 || (d->n_prompt_logprobs > 0 && !d->prompt_logprobs) ||
        (d->prompt_logprobs && d->n_prompt_logprobs != (d->n_prompt > 0 ? d->n_prompt - 1 : 0)))
        return BAD("done: \"prompt_logprobs\" must hold n_prompt - 1 = %d entries, got %d",
                   d->n_prompt > 0 ? d->n_prompt - 1 : 0, d->n_prompt_logprobs);
    fr_status st;
    if (!d->has_text && (d->text || d->text_len)) return BAD("done: \"text\" given without has_text");
    if (d->has_text && (st = check_text("done", "text", d->text, d->text_len, MAX_RESULT_TEXT))) return st;
    if (d->stop_str && (st = check_stop_str("done", "stop_str", d->stop_str))) return st;
    if (d->stop_str && d->finish_reason != FR_WIRE_STOP)
        return BAD("done: \"stop_str\" comes only with finish_reason stop");
    if (d->prompt_token_ids && (st = check_ids("done", "prompt_token_ids", d->prompt_token_ids,
                                               d->n_prompt_token_ids, 1)))
        return st;
    if (d->prompt_token_ids && d->n_prompt_token_ids != d->n_prompt)
        return BAD("done: \"prompt_token_ids\" must hold n_prompt = %d ids, got %d", d->n_prompt,
                   d->n_prompt_token_ids);
    return FR_OK;
}

fr_status fr_proto_check(const fr_msg *m)
{
    if (!m) return fr_fail(FR_EINVAL, "protocol: message is NULL");
    const char *t = fr_msg_type_name(m->type);
    switch (m->type) {
    case FR_MSG_HELLO:
        return check_name(t, "client", m->u.hello.client, 0);
    case FR_MSG_GENERATE:
        return check_generate(&m->u.generate);
    case FR_MSG_ABORT: {
        const fr_msg_abort *a = &m->u.abort;
        if (a->all && a->n_request_ids > 0) return BAD("abort: give either \"all\" or \"request_ids\", not both");
        if (!a->all && (a->n_request_ids < 1 || a->n_request_ids > FR_PROTO_MAX_ARRAY || !a->request_ids))
            return BAD("abort: \"request_ids\" must hold at least one id (or set \"all\")");
        return FR_OK;
    }
    case FR_MSG_PAUSE:
        if (m->u.pause.mode != FR_PAUSE_ABORT && m->u.pause.mode != FR_PAUSE_WAIT && m->u.pause.mode != FR_PAUSE_KEEP)
            return BAD("pause: \"mode\" must be \"abort\", \"wait\" or \"keep\"");
        if (m->u.pause.recompute != 0 && (m->u.pause.recompute != 1 || m->u.pause.mode != FR_PAUSE_KEEP))
            return BAD("pause: \"recompute\" is a boolean that goes with mode \"keep\"");
        return FR_OK;
    case FR_MSG_RESUME:
        if (m->u.resume.recompute != 0 && m->u.resume.recompute != 1)
            return BAD("resume: \"recompute\" must be a boolean");
        return FR_OK;
    case FR_MSG_STATS:
    case FR_MSG_UPDATE_COMMIT:
    case FR_MSG_UPDATE_ABORT:
    case FR_MSG_NCCL_INIT:
    case FR_MSG_NCCL_CLOSE:
        return FR_OK;
    case FR_MSG_NCCL_BUCKET:
        return check_nccl_bucket(&m->u.nccl_bucket);
    case FR_MSG_NCCL_REPLY: {
        const fr_msg_nccl_reply *r = &m->u.nccl_reply;
        if ((int)r->state < 0 || r->state > FR_NCCL_CLOSED)
            return BAD("nccl_group_reply: \"state\" must be joining or closed");
        if (r->state == FR_NCCL_JOINING && (r->nranks < 2 || r->rank < 0 || r->rank >= r->nranks))
            return BAD("nccl_group_reply: a joining group has \"nranks\" >= 2 and \"rank\" in [0, nranks), got %d "
                       "and %d", r->nranks, r->rank);
        if (!(r->timeout_s >= 0) || !isfinite(r->timeout_s))
            return BAD("nccl_group_reply: \"timeout_s\" must be a finite number >= 0");
        return FR_OK;
    }
    case FR_MSG_UPDATE_BEGIN:
        return check_update_begin(&m->u.update_begin);
    case FR_MSG_UPDATE_BUCKET:
        return check_update_bucket(&m->u.update_bucket);
    case FR_MSG_UPDATE_REPLY: {
        const fr_msg_update_reply *r = &m->u.update_reply;
        if ((int)r->stage < 0 || r->stage > FR_UPD_ABORT)
            return BAD("update_weights_reply: \"stage\" must be begin, bucket, commit or abort");
        if ((r->stage == FR_UPD_BUCKET) != (r->bucket >= 0))
            return BAD("update_weights_reply: \"bucket\" is a number >= 0 exactly when \"stage\" is bucket");
        return FR_OK;
    }
    case FR_MSG_HELLO_REPLY:
        return check_hello_reply(&m->u.hello_reply);
    case FR_MSG_TOKENS:
        return check_tokens(&m->u.tokens);
    case FR_MSG_DONE:
        return check_done(&m->u.done);
    case FR_MSG_ABORT_REPLY:
        if (m->u.abort_reply.samples < 0 || m->u.abort_reply.n_not_found < 0 ||
            m->u.abort_reply.n_not_found > FR_PROTO_MAX_ARRAY ||
            (m->u.abort_reply.n_not_found > 0 && !m->u.abort_reply.not_found))
            return BAD("abort_reply: counts must be >= 0");
        return FR_OK;
    case FR_MSG_PAUSE_REPLY:
        if (m->u.pause_reply.aborted < 0) return BAD("pause_reply: \"aborted\" must be >= 0");
        if (m->u.pause_reply.mode != FR_PAUSE_ABORT && m->u.pause_reply.mode != FR_PAUSE_WAIT &&
            m->u.pause_reply.mode != FR_PAUSE_KEEP)
            return BAD("pause_reply: \"mode\" must be \"abort\", \"wait\" or \"keep\"");
        return FR_OK;
    case FR_MSG_RESUME_REPLY:
        if (m->u.resume_reply.released < 0) return BAD("resume_reply: \"released\" must be >= 0");
        return FR_OK;
    case FR_MSG_STATS_REPLY: {
        const fr_msg_stats_reply *s = &m->u.stats_reply;
        if (s->running < 0 || s->prefilling < 0 || s->waiting < 0 || s->kv_blocks_used < 0 ||
            s->kv_blocks_free < 0 || s->clients < 0 || s->open_requests < 0 || s->held_requests < 0)
            return BAD("stats_reply: counts must be >= 0");
        return check_name(t, "state", s->state, 1);
    }
    case FR_MSG_ERROR: {
        fr_status st = check_name(t, "code", m->u.error.code, 1);
        if (st) return st;
        if (strnlen(m->u.error.message, FR_PROTO_TEXT_MAX) == FR_PROTO_TEXT_MAX)
            return BAD("error: \"message\" is not terminated");
        return FR_OK;
    }
    default:
        return BAD("unknown message type %d", (int)m->type);
    }
}
