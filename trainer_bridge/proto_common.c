/* Protocol names, message init/free, and the value checks shared by the
 * encoder and the decoder (trainer_bridge/protocol.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "proto_internal.h"

static const char *const type_names[FR_MSG_TYPE_COUNT] = {
    [FR_MSG_NONE] = "none",
    [FR_MSG_HELLO] = "hello",
    [FR_MSG_GENERATE] = "generate",
    [FR_MSG_ABORT] = "abort",
    [FR_MSG_PAUSE] = "pause",
    [FR_MSG_RESUME] = "resume",
    [FR_MSG_STATS] = "stats",
    [FR_MSG_HELLO_REPLY] = "hello_reply",
    [FR_MSG_TOKENS] = "tokens",
    [FR_MSG_DONE] = "done",
    [FR_MSG_ABORT_REPLY] = "abort_reply",
    [FR_MSG_PAUSE_REPLY] = "pause_reply",
    [FR_MSG_RESUME_REPLY] = "resume_reply",
    [FR_MSG_STATS_REPLY] = "stats_reply",
    [FR_MSG_ERROR] = "error",
};

const char *fr_msg_type_name(fr_msg_type t)
{
    if ((int)t <= FR_MSG_NONE || t >= FR_MSG_TYPE_COUNT) return "none";
    return type_names[t];
}

fr_msg_type fr_proto_type_from_name(const char *s, size_t len)
{
    for (int t = FR_MSG_NONE + 1; t < FR_MSG_TYPE_COUNT; t++)
        if (strlen(type_names[t]) == len && memcmp(type_names[t], s, len) == 0) return (fr_msg_type)t;
    return FR_MSG_NONE;
}

int fr_msg_type_from_client(fr_msg_type t) { return t >= FR_MSG_HELLO && t <= FR_MSG_STATS; }

const char *fr_pause_mode_name(fr_pause_mode m) { return m == FR_PAUSE_WAIT ? "wait" : "abort"; }

static const char *const finish_names[] = {"stop", "length", "abort", "error"};

const char *fr_wire_finish_name(fr_wire_finish f)
{
    if ((int)f < 0 || (int)f > FR_WIRE_ERROR) return "none";
    return finish_names[f];
}

int fr_proto_finish_from_name(const char *s, size_t len, fr_wire_finish *out)
{
    for (int i = 0; i <= FR_WIRE_ERROR; i++)
        if (strlen(finish_names[i]) == len && memcmp(finish_names[i], s, len) == 0) {
            *out = (fr_wire_finish)i;
            return 1;
        }
    return 0;
}

void fr_msg_init(fr_msg *m, fr_msg_type t)
{
    if (!m) return;
    memset(m, 0, sizeof *m);
    m->type = t;
    if (t == FR_MSG_GENERATE) m->u.generate.n = 1;
}

void fr_msg_free(fr_msg *m)
{
    if (!m) return;
    switch (m->type) {
    case FR_MSG_GENERATE:
        free(m->u.generate.prompt);
        free(m->u.generate.stop_token_ids);
        break;
    case FR_MSG_ABORT:
        free(m->u.abort.request_ids);
        break;
    case FR_MSG_TOKENS:
        free(m->u.tokens.token_ids);
        free(m->u.tokens.logprobs);
        free(m->u.tokens.weight_versions);
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

static fr_status check_generate(const fr_msg_generate *g)
{
    const char *t = "generate";
    fr_status st = check_ids(t, "prompt", g->prompt, g->n_prompt, 1);
    if (st) return st;
    if (g->n < 1 || g->n > FR_PROTO_MAX_SAMPLES)
        return BAD("%s: \"n\" must be in [1, %d], got %d", t, FR_PROTO_MAX_SAMPLES, g->n);
    if (g->has_temperature && !(isfinite(g->temperature) && g->temperature >= 0))
        return BAD("%s: \"temperature\" must be a finite number >= 0 (0 = greedy), got %g", t, g->temperature);
    if (g->has_top_k && g->top_k < 0) return BAD("%s: \"top_k\" must be >= 0 (0 = off), got %d", t, g->top_k);
    if (g->has_top_p && !(g->top_p > 0 && g->top_p <= 1))
        return BAD("%s: \"top_p\" must be in (0, 1], got %g", t, g->top_p);
    if (g->has_max_tokens && g->max_tokens < 1)
        return BAD("%s: \"max_tokens\" must be >= 1, got %d", t, g->max_tokens);
    if (g->has_stop_token_ids &&
        (st = check_ids(t, "stop_token_ids", g->stop_token_ids, g->n_stop_token_ids, 0)))
        return st;
    if (g->monitor_divergence != 0 && g->monitor_divergence != 1)
        return BAD("%s: \"monitor_divergence\" must be a boolean", t);
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
        if (m->u.pause.mode != FR_PAUSE_ABORT && m->u.pause.mode != FR_PAUSE_WAIT)
            return BAD("pause: \"mode\" must be \"abort\" or \"wait\"");
        return FR_OK;
    case FR_MSG_RESUME:
    case FR_MSG_STATS:
        return FR_OK;
    case FR_MSG_HELLO_REPLY: {
        const fr_msg_hello_reply *h = &m->u.hello_reply;
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
        return check_ids(t, "eos_token_ids", h->eos_token_ids, h->n_eos_token_ids, 0);
    }
    case FR_MSG_TOKENS: {
        const fr_msg_tokens *k = &m->u.tokens;
        if (k->sample < 0 || k->start < 0) return BAD("tokens: \"sample\" and \"start\" must be >= 0");
        fr_status st = check_ids(t, "token_ids", k->token_ids, k->n, 1);
        if (st) return st;
        if (!k->logprobs || !k->weight_versions) return BAD("tokens: \"logprobs\" or \"weight_versions\" missing");
        for (int i = 0; i < k->n; i++)
            if (!(k->logprobs[i] <= 0) && !isnan(k->logprobs[i]))
                return BAD("tokens: \"logprobs\"[%d] must be <= 0, got %g", i, (double)k->logprobs[i]);
        return FR_OK;
    }
    case FR_MSG_DONE: {
        const fr_msg_done *d = &m->u.done;
        if (d->sample < 0 || d->n_tokens < 0 || d->n_prompt < 0 || d->preemptions < 0)
            return BAD("done: \"sample\", \"n_tokens\", \"n_prompt\" and \"preemptions\" must be >= 0");
        if ((int)d->finish_reason < 0 || d->finish_reason > FR_WIRE_ERROR)
            return BAD("done: \"finish_reason\" must be stop, length, abort or error");
        if (!(d->total_ms >= 0) || (d->has_ttft && !(d->ttft_ms >= 0)))
            return BAD("done: timings must be >= 0 milliseconds");
        if (d->divergence.has_values && d->divergence.positions < 0)
            return BAD("done: \"divergence.positions\" must be >= 0");
        return FR_OK;
    }
    case FR_MSG_ABORT_REPLY:
        if (m->u.abort_reply.samples < 0 || m->u.abort_reply.n_not_found < 0 ||
            m->u.abort_reply.n_not_found > FR_PROTO_MAX_ARRAY ||
            (m->u.abort_reply.n_not_found > 0 && !m->u.abort_reply.not_found))
            return BAD("abort_reply: counts must be >= 0");
        return FR_OK;
    case FR_MSG_PAUSE_REPLY:
        if (m->u.pause_reply.aborted < 0) return BAD("pause_reply: \"aborted\" must be >= 0");
        if (m->u.pause_reply.mode != FR_PAUSE_ABORT && m->u.pause_reply.mode != FR_PAUSE_WAIT)
            return BAD("pause_reply: \"mode\" must be \"abort\" or \"wait\"");
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
