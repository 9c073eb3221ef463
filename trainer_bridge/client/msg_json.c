/* Server replies as JSON text (trainer_bridge/client/client.h, fr_msg_to_json):
 * the keys of docs/protocol.md, for command lines and language bindings. */
#include <math.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/client/client.h"

#include "base/buf.h"

typedef fr_buf jbuf;

static void strn(jbuf *b, const char *s, size_t n)
{
    fr_buf_printf(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') fr_buf_printf(b, "\\%c", ch);
        else if (ch < 0x20) fr_buf_printf(b, "\\u%04x", ch);
        else fr_buf_printf(b, "%c", ch);
    }
    fr_buf_printf(b, "\"");
}

static void str(jbuf *b, const char *s) { strn(b, s, strlen(s)); }

static void u64(jbuf *b, const char *k, uint64_t v, int comma) { fr_buf_printf(b, "\"%s\":%llu%s", k, (unsigned long long)v, comma ? "," : ""); }
static void i32(jbuf *b, const char *k, int v, int comma) { fr_buf_printf(b, "\"%s\":%d%s", k, v, comma ? "," : ""); }

/* The counts of stats_reply, in the order of docs/protocol.md: name, where
 * it sits, and whether it is a uint64 (else an int). */
typedef struct {
    const char *name;
    size_t off;
    int wide;
} count_field;

#define I32(f) {#f, offsetof(fr_msg_stats_reply, f), 0}
#define U64(f) {#f, offsetof(fr_msg_stats_reply, f), 1}
static const count_field scheduler_counts[] = {
    I32(running), I32(prefilling), I32(waiting), U64(preemptions), U64(tokens_generated), U64(prefill_tokens),
    U64(steps), U64(finished), I32(kv_blocks_used), I32(kv_blocks_free)};
static const count_field server_counts[] = {
    U64(update_version), U64(updates_committed), U64(updates_failed), U64(weight_version), I32(clients),
    I32(open_requests), I32(held_requests), U64(messages_in), U64(messages_out), U64(bad_messages),
    U64(errors_sent), U64(requests_accepted), U64(requests_rejected), U64(samples_done), U64(tokens_streamed),
    U64(send_retries), U64(queued_messages), U64(undeliverable_messages), U64(clients_departed)};
#undef I32
#undef U64

static void counts(jbuf *b, const fr_msg_stats_reply *s, const count_field *f, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const char *at = (const char *)s + f[i].off;
        if (f[i].wide) u64(b, f[i].name, *(const uint64_t *)(const void *)at, i + 1 < n);
        else i32(b, f[i].name, *(const int *)(const void *)at, i + 1 < n);
    }
}

static void stats(jbuf *b, const fr_msg_stats_reply *s)
{
    fr_buf_printf(b, "\"scheduler\":{");
    counts(b, s, scheduler_counts, sizeof scheduler_counts / sizeof scheduler_counts[0]);
    fr_buf_printf(b, "},\"server\":{\"state\":");
    str(b, s->state);
    fr_buf_printf(b, ",\"updating\":%s,", s->updating ? "true" : "false");
    counts(b, s, server_counts, sizeof server_counts / sizeof server_counts[0]);
    fr_buf_printf(b, "}");
}

fr_status fr_msg_to_json(const fr_msg *m, char **out)
{
    if (!m || !out) return fr_fail(FR_EINVAL, "fr_msg_to_json: NULL argument");
    *out = NULL;
    jbuf b = {0};
    fr_buf_printf(&b, "{\"type\":");
    str(&b, fr_msg_type_name(m->type));
    fr_buf_printf(&b, ",");
    switch (m->type) {
    case FR_MSG_HELLO_REPLY: {
        const fr_msg_hello_reply *h = &m->u.hello_reply;
        fr_buf_printf(&b, "\"server\":");
        str(&b, h->server);
        fr_buf_printf(&b, ",\"model\":");
        str(&b, h->model);
        fr_buf_printf(&b, ",\"backend\":");
        str(&b, h->backend);
        fr_buf_printf(&b, ",\"kv_dtype\":");
        str(&b, h->kv_dtype);
        fr_buf_printf(&b, ",");
        i32(&b, "tp", h->tp, 1);
        i32(&b, "engines", h->engines, 1);
        u64(&b, "weight_version", h->weight_version, 1);
        i32(&b, "max_seqs", h->max_seqs, 1);
        i32(&b, "kv_blocks", h->kv_blocks, 1);
        i32(&b, "kv_block_tokens", h->kv_block_tokens, 1);
        i32(&b, "max_model_len", h->max_model_len, 1);
        i32(&b, "vocab_size", h->vocab_size, 1);
        i32(&b, "chunk", h->chunk, 1);
        fr_buf_printf(&b, "\"eos_token_ids\":[");
        for (int i = 0; i < h->n_eos_token_ids; i++) fr_buf_printf(&b, "%s%d", i ? "," : "", h->eos_token_ids[i]);
        fr_buf_printf(&b, "],\"tokenizer\":");
        if (h->tokenizer[0]) str(&b, h->tokenizer);
        else fr_buf_printf(&b, "null");
        break;
    }
    case FR_MSG_STATS_REPLY:
        stats(&b, &m->u.stats_reply);
        break;
    case FR_MSG_PAUSE_REPLY:
        fr_buf_printf(&b, "\"mode\":\"%s\",\"state\":\"paused\",", fr_pause_mode_name(m->u.pause_reply.mode));
        i32(&b, "aborted", m->u.pause_reply.aborted, 0);
        break;
    case FR_MSG_RESUME_REPLY:
        i32(&b, "released", m->u.resume_reply.released, 0);
        break;
    case FR_MSG_ABORT_REPLY:
        i32(&b, "samples", m->u.abort_reply.samples, 1);
        fr_buf_printf(&b, "\"not_found\":[");
        for (int i = 0; i < m->u.abort_reply.n_not_found; i++)
            fr_buf_printf(&b, "%s%llu", i ? "," : "", (unsigned long long)m->u.abort_reply.not_found[i]);
        fr_buf_printf(&b, "]");
        break;
    case FR_MSG_UPDATE_REPLY: {
        const fr_msg_update_reply *r = &m->u.update_reply;
        u64(&b, "version", r->version, 1);
        fr_buf_printf(&b, "\"stage\":\"%s\",", fr_update_stage_name(r->stage));
        if (r->bucket >= 0) i32(&b, "bucket", r->bucket, 1);
        else fr_buf_printf(&b, "\"bucket\":null,");
        u64(&b, "bytes", r->bytes, 1);
        u64(&b, "weight_version", r->weight_version, 0);
        break;
    }
    case FR_MSG_NCCL_REPLY: {
        const fr_msg_nccl_reply *r = &m->u.nccl_reply;
        fr_buf_printf(&b, "\"state\":\"%s\",", fr_nccl_state_name(r->state));
        i32(&b, "nranks", r->nranks, 1);
        i32(&b, "rank", r->rank, 1);
        fr_buf_printf(&b, "\"timeout_s\":%.17g", r->timeout_s);
        break;
    }
    case FR_MSG_ERROR:
        fr_buf_printf(&b, "\"code\":");
        str(&b, m->u.error.code);
        fr_buf_printf(&b, ",\"message\":");
        str(&b, m->u.error.message);
        if (m->u.error.has_request_id) fr_buf_printf(&b, ",\"request_id\":%llu", (unsigned long long)m->u.error.request_id);
        else fr_buf_printf(&b, ",\"request_id\":null");
        break;
    default:
        free(b.data);
        return fr_fail(FR_EINVAL, "fr_msg_to_json: %s is not a reply", fr_msg_type_name(m->type));
    }
    fr_buf_printf(&b, "}");
    if (b.failed) {
        free(b.data);
        return fr_fail(FR_ENOMEM, "fr_msg_to_json: out of memory");
    }
    *out = b.data;
    return FR_OK;
}

/* ---- any msgpack value -> JSON (metrics snapshots, trainer_bridge/client/metrics_sub.h) ---- */

static int object_json(jbuf *b, const msgpack_object *o, int depth)
{
    if (depth > 32) return -1;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: fr_buf_printf(b, "null"); return 0;
    case MSGPACK_OBJECT_BOOLEAN: fr_buf_printf(b, o->via.boolean ? "true" : "false"); return 0;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: fr_buf_printf(b, "%llu", (unsigned long long)o->via.u64); return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: fr_buf_printf(b, "%lld", (long long)o->via.i64); return 0;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (isfinite(o->via.f64)) {
            /* the shortest of %.15g..%.17g that reads back exactly */
            char t[32];
            for (int prec = 15; prec <= 17; prec++) {
                snprintf(t, sizeof t, "%.*g", prec, o->via.f64);
                if (strtod(t, NULL) == o->via.f64) break;
            }
            fr_buf_printf(b, "%s", t);
        } else {
            fr_buf_printf(b, "null");   /* JSON has no NaN or infinity */
        }
        return 0;
    case MSGPACK_OBJECT_STR: strn(b, o->via.str.ptr, o->via.str.size); return 0;
    case MSGPACK_OBJECT_ARRAY:
        fr_buf_printf(b, "[");
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            if (i) fr_buf_printf(b, ",");
            if (object_json(b, &o->via.array.ptr[i], depth + 1)) return -1;
        }
        fr_buf_printf(b, "]");
        return 0;
    case MSGPACK_OBJECT_MAP:
        fr_buf_printf(b, "{");
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (kv->key.type != MSGPACK_OBJECT_STR) return -1;
            if (i) fr_buf_printf(b, ",");
            strn(b, kv->key.via.str.ptr, kv->key.via.str.size);
            fr_buf_printf(b, ":");
            if (object_json(b, &kv->val, depth + 1)) return -1;
        }
        fr_buf_printf(b, "}");
        return 0;
    default: return -1;   /* bin, ext: never in a snapshot */
    }
}

fr_status fr_msgpack_to_json(const void *data, size_t len, char **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_msgpack_to_json: out is NULL");
    *out = NULL;
    if (!data) return fr_fail(FR_EINVAL, "fr_msgpack_to_json: data is NULL");
    msgpack_zone zone;
    if (!msgpack_zone_init(&zone, 4096)) return fr_fail(FR_ENOMEM, "fr_msgpack_to_json: out of memory");
    msgpack_object obj;
    size_t off = 0;
    msgpack_unpack_return r = msgpack_unpack((const char *)data, len, &off, &zone, &obj);
    jbuf b = {0};
    fr_status st = FR_OK;
    if (r != MSGPACK_UNPACK_SUCCESS || off != len)
        st = fr_fail(FR_EFORMAT, "fr_msgpack_to_json: not one whole msgpack value (%zu bytes)", len);
    else if (object_json(&b, &obj, 0))
        st = fr_fail(FR_EFORMAT, "fr_msgpack_to_json: a value JSON cannot hold (binary, extension, a non-string key, or too deep)");
    else if (b.failed || !b.data)
        st = fr_fail(FR_ENOMEM, "fr_msgpack_to_json: out of memory");
    msgpack_zone_destroy(&zone);
    if (st) {
        free(b.data);
        return st;
    }
    *out = b.data;
    return FR_OK;
}
