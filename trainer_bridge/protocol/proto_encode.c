/* fr_msg -> msgpack frame 0 (docs/protocol.md gives every key and type). */
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_internal.h"

#include "base/buf.h"

/* Every string goes out as UTF-8: bytes that are not (a client's bytes
 * quoted in an error, a message cut inside a character) are escaped. */
static void put_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    if (!fr_utf8_valid(s, n)) {
        char esc[4 * FR_PROTO_TEXT_MAX];
        n = fr_utf8_escape(s, n, esc, sizeof esc);
        msgpack_pack_str(pk, n);
        msgpack_pack_str_body(pk, esc, n);
        return;
    }
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void key(msgpack_packer *pk, const char *k) { put_str(pk, k); }

static void kv_u64(msgpack_packer *pk, const char *k, uint64_t v)
{
    key(pk, k);
    msgpack_pack_uint64(pk, v);
}

static void kv_int(msgpack_packer *pk, const char *k, int v)
{
    key(pk, k);
    msgpack_pack_int64(pk, v);
}

static void kv_str(msgpack_packer *pk, const char *k, const char *v)
{
    key(pk, k);
    put_str(pk, v);
}

static void kv_double(msgpack_packer *pk, const char *k, double v)
{
    key(pk, k);
    msgpack_pack_double(pk, v);
}

static void kv_nil(msgpack_packer *pk, const char *k)
{
    key(pk, k);
    msgpack_pack_nil(pk);
}

static void kv_bool(msgpack_packer *pk, const char *k, int v)
{
    key(pk, k);
    if (v) msgpack_pack_true(pk);
    else msgpack_pack_false(pk);
}

static void kv_ints(msgpack_packer *pk, const char *k, const int *v, int n)
{
    key(pk, k);
    msgpack_pack_array(pk, (size_t)n);
    for (int i = 0; i < n; i++) msgpack_pack_int64(pk, v[i]);
}

/* len bytes of text as they are (fr_proto_check made sure they are UTF-8). */
static void kv_text(msgpack_packer *pk, const char *k, const char *s, size_t len)
{
    key(pk, k);
    msgpack_pack_str(pk, len);
    msgpack_pack_str_body(pk, s ? s : "", len);
}

static void kv_u64s(msgpack_packer *pk, const char *k, const uint64_t *v, int n)
{
    key(pk, k);
    msgpack_pack_array(pk, (size_t)n);
    for (int i = 0; i < n; i++) msgpack_pack_uint64(pk, v[i]);
}

/* The map header with "type" and "v"; n_fields counts the other keys. */
static void head(msgpack_packer *pk, fr_msg_type t, int n_fields)
{
    msgpack_pack_map(pk, (size_t)n_fields + 2);
    kv_str(pk, "type", fr_msg_type_name(t));
    kv_u64(pk, "v", FR_PROTO_VERSION);
}

/* generate's text keys, each sent only when it says something (docs/protocol.md, "Versioning"). */
static int n_generate_text(const fr_msg_generate *g)
{
    return (g->has_add_special_tokens != 0) + (g->stop != NULL) + g->include_stop_str_in_output + g->return_text +
           g->keep_special_tokens;
}

static void enc_generate_text(msgpack_packer *pk, const fr_msg_generate *g)
{
    if (g->has_add_special_tokens) kv_bool(pk, "add_special_tokens", g->add_special_tokens);
    if (g->stop) {
        key(pk, "stop");
        msgpack_pack_array(pk, (size_t)g->n_stop);
        for (int i = 0; i < g->n_stop; i++) put_str(pk, g->stop[i]);
    }
    if (g->include_stop_str_in_output) kv_bool(pk, "include_stop_str_in_output", 1);
    if (g->return_text) kv_bool(pk, "return_text", 1);
    if (g->keep_special_tokens) kv_bool(pk, "skip_special_tokens", 0);
}

static void enc_generate(msgpack_packer *pk, const fr_msg_generate *g)
{
    int n = 3 + (g->first_sample > 0) + (g->min_tokens > 0) + (g->logprobs > 0) + g->prompt_logprobs +
            (g->monitor_divergence >= 0) + g->per_token_kl + (g->forced_tokens != NULL) + g->has_group_id +
            g->has_temperature + g->has_top_k + g->has_top_p + g->has_max_tokens + g->has_stop_token_ids + g->has_seed +
            (g->min_p != 0) + (g->presence_penalty != 0) + (g->frequency_penalty != 0) + (g->repetition_penalty != 0) +
            (g->n_continue_tokens > 0) + g->return_routed_experts + n_generate_text(g);
    head(pk, FR_MSG_GENERATE, n);
    kv_u64(pk, "request_id", g->request_id);
    if (g->prompt_text) kv_text(pk, "prompt_text", g->prompt_text, g->prompt_text_len);
    else kv_ints(pk, "prompt", g->prompt, g->n_prompt);
    kv_int(pk, "n", g->n);
    enc_generate_text(pk, g);
    if (g->first_sample > 0) kv_int(pk, "first_sample", g->first_sample);
    if (g->min_tokens > 0) kv_int(pk, "min_tokens", g->min_tokens);
    if (g->logprobs > 0) kv_int(pk, "logprobs", g->logprobs);
    if (g->prompt_logprobs) kv_bool(pk, "prompt_logprobs", 1);
    if (g->return_routed_experts) kv_bool(pk, "return_routed_experts", 1);
    if (g->min_p != 0) kv_double(pk, "min_p", g->min_p);
    if (g->presence_penalty != 0) kv_double(pk, "presence_penalty", g->presence_penalty);
    if (g->frequency_penalty != 0) kv_double(pk, "frequency_penalty", g->frequency_penalty);
    if (g->repetition_penalty != 0) kv_double(pk, "repetition_penalty", g->repetition_penalty);
    if (g->monitor_divergence >= 0) kv_bool(pk, "monitor_divergence", g->monitor_divergence);
    if (g->per_token_kl) kv_bool(pk, "per_token_kl", 1);
    if (g->forced_tokens) kv_ints(pk, "forced_tokens", g->forced_tokens, g->n_forced_tokens);
    if (g->has_group_id) kv_u64(pk, "group_id", g->group_id);
    if (g->has_temperature) kv_double(pk, "temperature", g->temperature);
    if (g->has_top_k) kv_int(pk, "top_k", g->top_k);
    if (g->has_top_p) kv_double(pk, "top_p", g->top_p);
    if (g->has_max_tokens) kv_int(pk, "max_tokens", g->max_tokens);
    if (g->has_stop_token_ids) kv_ints(pk, "stop_token_ids", g->stop_token_ids, g->n_stop_token_ids);
    if (g->has_seed) kv_u64(pk, "seed", g->seed);
    if (g->n_continue_tokens > 0) kv_ints(pk, "continue_tokens", g->continue_tokens, g->n_continue_tokens);
}

static void enc_hello_reply(msgpack_packer *pk, const fr_msg_hello_reply *h)
{
    head(pk, FR_MSG_HELLO_REPLY, 14 + (h->tokenizer[0] != '\0'));
    if (h->tokenizer[0]) kv_str(pk, "tokenizer", h->tokenizer);
    kv_str(pk, "server", h->server);
    kv_str(pk, "model", h->model);
    kv_str(pk, "backend", h->backend);
    kv_str(pk, "kv_dtype", h->kv_dtype);
    kv_int(pk, "tp", h->tp);
    kv_int(pk, "engines", h->engines);
    kv_u64(pk, "weight_version", h->weight_version);
    kv_int(pk, "max_seqs", h->max_seqs);
    kv_int(pk, "kv_blocks", h->kv_blocks);
    kv_int(pk, "kv_block_tokens", h->kv_block_tokens);
    kv_int(pk, "max_model_len", h->max_model_len);
    kv_int(pk, "vocab_size", h->vocab_size);
    kv_ints(pk, "eos_token_ids", h->eos_token_ids, h->n_eos_token_ids);
    kv_int(pk, "chunk", h->chunk);
}

static void enc_tokens(msgpack_packer *pk, const fr_msg_tokens *k)
{
    head(pk, FR_MSG_TOKENS, 6 + (k->has_text != 0));
    if (k->has_text) kv_text(pk, "text", k->text, k->text_len);
    kv_u64(pk, "request_id", k->request_id);
    kv_int(pk, "sample", k->sample);
    kv_int(pk, "start", k->start);
    kv_ints(pk, "token_ids", k->token_ids, k->n);
    key(pk, "logprobs");
    msgpack_pack_array(pk, (size_t)k->n);
    for (int i = 0; i < k->n; i++) msgpack_pack_float(pk, k->logprobs[i]);
    kv_u64s(pk, "weight_versions", k->weight_versions, k->n);
}

/* done's routed experts: the ids as bytes, their shape per token and width. */
static void enc_routes(msgpack_packer *pk, const fr_msg_done *d)
{
    const size_t n = (size_t)fr_proto_route_bytes(d);
    key(pk, "routed_experts");
    msgpack_pack_bin(pk, n);
    msgpack_pack_bin_body(pk, d->routed_experts, n);
    key(pk, "routed_experts_shape");
    msgpack_pack_array(pk, 2);
    msgpack_pack_int64(pk, d->route_layers);
    msgpack_pack_int64(pk, d->route_k);
    kv_str(pk, "routed_experts_dtype", d->route_width == 1 ? "u8" : "u16");
}

static void enc_done(msgpack_packer *pk, const fr_msg_done *d)
{
    head(pk, FR_MSG_DONE, 10 + (d->has_seed ? 1 : 0) + (d->top_k > 0) + (d->prompt_logprobs != NULL) + (d->start > 0) +
                              (d->has_text != 0) + (d->stop_str != NULL) + (d->prompt_token_ids != NULL) +
                              (d->routed_experts != NULL) * 3);
    if (d->routed_experts) enc_routes(pk, d);
    if (d->has_text) kv_text(pk, "text", d->text, d->text_len);
    if (d->stop_str) kv_str(pk, "stop_str", d->stop_str);
    if (d->prompt_token_ids) kv_ints(pk, "prompt_token_ids", d->prompt_token_ids, d->n_prompt_token_ids);
    kv_u64(pk, "request_id", d->request_id);
    kv_u64(pk, "group_id", d->group_id);
    kv_int(pk, "sample", d->sample);
    kv_str(pk, "finish_reason", fr_wire_finish_name(d->finish_reason));
    if (d->start > 0) kv_int(pk, "start", d->start);
    kv_int(pk, "n_tokens", d->n_tokens);
    kv_int(pk, "n_prompt", d->n_prompt);
    kv_int(pk, "preemptions", d->preemptions);
    if (d->has_ttft) kv_double(pk, "ttft_ms", d->ttft_ms);
    else kv_nil(pk, "ttft_ms");
    kv_double(pk, "total_ms", d->total_ms);
    if (d->has_seed) kv_u64(pk, "seed", d->seed);
    if (d->top_k > 0) {
        const size_t n = (size_t)d->n_tokens * (size_t)d->top_k;
        key(pk, "top_logprobs");
        msgpack_pack_map(pk, 3);
        kv_int(pk, "k", d->top_k);
        kv_ints(pk, "token_ids", d->top_token_ids, (int)n);
        key(pk, "logprobs");
        msgpack_pack_array(pk, n);
        for (size_t i = 0; i < n; i++) msgpack_pack_float(pk, d->top_logprobs[i]);
    }
    if (d->prompt_logprobs) {
        key(pk, "prompt_logprobs");
        msgpack_pack_array(pk, (size_t)d->n_prompt_logprobs);
        for (int i = 0; i < d->n_prompt_logprobs; i++) msgpack_pack_float(pk, d->prompt_logprobs[i]);
    }
    key(pk, "divergence");
    const fr_msg_divergence *v = &d->divergence;
    msgpack_pack_map(pk, 6);
    if (v->has_values) {
        kv_double(pk, "kl_mean", v->kl_mean);
        kv_double(pk, "kl_max", v->kl_max);
        kv_double(pk, "top1_agreement", v->top1_agreement);
        kv_double(pk, "logprob_diff_mean", v->logprob_diff_mean);
        kv_int(pk, "positions", v->positions);
    } else {
        kv_nil(pk, "kl_mean");
        kv_nil(pk, "kl_max");
        kv_nil(pk, "top1_agreement");
        kv_nil(pk, "logprob_diff_mean");
        kv_nil(pk, "positions");
    }
    if (v->kl) {
        key(pk, "per_token_kl");
        msgpack_pack_array(pk, (size_t)v->n_kl);
        for (int i = 0; i < v->n_kl; i++) msgpack_pack_float(pk, v->kl[i]);
    } else {
        kv_nil(pk, "per_token_kl");
    }
}

static void put_tensor_keys(msgpack_packer *pk, const fr_msg_tensor *t)
{
    kv_str(pk, "name", t->name);
    kv_str(pk, "dtype", fr_dtype_name(t->dtype));
    key(pk, "shape");
    msgpack_pack_array(pk, (size_t)t->ndim);
    for (int d = 0; d < t->ndim; d++) msgpack_pack_int64(pk, t->shape[d]);
}

static void enc_update_begin(msgpack_packer *pk, const fr_msg_update_begin *b)
{
    head(pk, FR_MSG_UPDATE_BEGIN, 4 + (b->nccl != 0) + (b->partial != 0));
    if (b->nccl) kv_str(pk, "transport", "nccl");
    if (b->partial) kv_bool(pk, "partial", 1);
    kv_u64(pk, "version", b->version);
    kv_u64(pk, "total_bytes", b->total_bytes);
    kv_u64(pk, "bucket_bytes", b->bucket_bytes);
    key(pk, "tensors");
    msgpack_pack_array(pk, (size_t)b->n_tensors);
    for (int i = 0; i < b->n_tensors; i++) {
        msgpack_pack_map(pk, 3);
        put_tensor_keys(pk, &b->tensors[i]);
    }
}

/* A bucket's "pieces" (NCCL pieces also carry "at", their place in the
 * broadcast buffer). */
static void put_pieces(msgpack_packer *pk, const fr_msg_piece *pieces, int n, int with_at)
{
    key(pk, "pieces");
    msgpack_pack_array(pk, (size_t)n);
    for (int i = 0; i < n; i++) {
        msgpack_pack_map(pk, with_at ? 6 : 5);
        put_tensor_keys(pk, &pieces[i].t);
        kv_u64(pk, "offset", pieces[i].offset);
        kv_u64(pk, "nbytes", pieces[i].nbytes);
        if (with_at) kv_u64(pk, "at", pieces[i].at);
    }
}

static void enc_update_bucket(msgpack_packer *pk, const fr_msg_update_bucket *b)
{
    head(pk, FR_MSG_UPDATE_BUCKET, 4);
    kv_u64(pk, "version", b->version);
    kv_int(pk, "bucket", b->bucket);
    kv_u64(pk, "xxh64", b->xxh64);
    put_pieces(pk, b->pieces, b->n_pieces, 0);
}

static void enc_nccl_bucket(msgpack_packer *pk, const fr_msg_nccl_bucket *b)
{
    head(pk, FR_MSG_NCCL_BUCKET, 5);
    kv_u64(pk, "version", b->version);
    kv_int(pk, "bucket", b->bucket);
    kv_u64(pk, "nbytes", b->nbytes);
    kv_u64(pk, "checksum", b->checksum);
    put_pieces(pk, b->pieces, b->n_pieces, 1);
}

static void enc_update_reply(msgpack_packer *pk, const fr_msg_update_reply *r)
{
    head(pk, FR_MSG_UPDATE_REPLY, 5);
    kv_u64(pk, "version", r->version);
    kv_str(pk, "stage", fr_update_stage_name(r->stage));
    if (r->bucket >= 0) kv_int(pk, "bucket", r->bucket);
    else kv_nil(pk, "bucket");
    kv_u64(pk, "bytes", r->bytes);
    kv_u64(pk, "weight_version", r->weight_version);
}

static void enc_stats_reply(msgpack_packer *pk, const fr_msg_stats_reply *s)
{
    head(pk, FR_MSG_STATS_REPLY, 2);
    key(pk, "scheduler");
    msgpack_pack_map(pk, 10);
    kv_int(pk, "running", s->running);
    kv_int(pk, "prefilling", s->prefilling);
    kv_int(pk, "waiting", s->waiting);
    kv_u64(pk, "preemptions", s->preemptions);
    kv_u64(pk, "tokens_generated", s->tokens_generated);
    kv_u64(pk, "prefill_tokens", s->prefill_tokens);
    kv_u64(pk, "steps", s->steps);
    kv_u64(pk, "finished", s->finished);
    kv_int(pk, "kv_blocks_used", s->kv_blocks_used);
    kv_int(pk, "kv_blocks_free", s->kv_blocks_free);
    key(pk, "server");
    msgpack_pack_map(pk, 21);
    kv_str(pk, "state", s->state);
    kv_bool(pk, "updating", s->updating);
    kv_u64(pk, "update_version", s->update_version);
    kv_u64(pk, "updates_committed", s->updates_committed);
    kv_u64(pk, "updates_failed", s->updates_failed);
    kv_u64(pk, "weight_version", s->weight_version);
    kv_int(pk, "clients", s->clients);
    kv_int(pk, "open_requests", s->open_requests);
    kv_int(pk, "held_requests", s->held_requests);
    kv_u64(pk, "messages_in", s->messages_in);
    kv_u64(pk, "messages_out", s->messages_out);
    kv_u64(pk, "bad_messages", s->bad_messages);
    kv_u64(pk, "errors_sent", s->errors_sent);
    kv_u64(pk, "requests_accepted", s->requests_accepted);
    kv_u64(pk, "requests_rejected", s->requests_rejected);
    kv_u64(pk, "samples_done", s->samples_done);
    kv_u64(pk, "tokens_streamed", s->tokens_streamed);
    kv_u64(pk, "send_retries", s->send_retries);
    kv_u64(pk, "queued_messages", s->queued_messages);
    kv_u64(pk, "undeliverable_messages", s->undeliverable_messages);
    kv_u64(pk, "clients_departed", s->clients_departed);
}

/* The packer's output goes to a growable buffer that remembers a failed
 * allocation, so the encoder checks for memory once, at the end. */
static int out_write(void *user, const char *p, size_t n)
{
    fr_buf *b = user;
    fr_buf_put(b, p, n);
    return b->failed ? -1 : 0;
}

fr_status fr_msg_encode(const fr_msg *m, char **data, size_t *len)
{
    if (!data || !len) return fr_fail(FR_EINVAL, "protocol: encode needs data and len");
    *data = NULL;
    *len = 0;
    fr_status st = fr_proto_check(m);
    if (st) return st;
    fr_buf sb = {0};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, out_write);
    switch (m->type) {
    case FR_MSG_HELLO:
        head(&pk, m->type, m->u.hello.client[0] ? 1 : 0);
        if (m->u.hello.client[0]) kv_str(&pk, "client", m->u.hello.client);
        break;
    case FR_MSG_GENERATE:
        enc_generate(&pk, &m->u.generate);
        break;
    case FR_MSG_ABORT:
        head(&pk, m->type, 1);
        if (m->u.abort.all) kv_bool(&pk, "all", 1);
        else kv_u64s(&pk, "request_ids", m->u.abort.request_ids, m->u.abort.n_request_ids);
        break;
    case FR_MSG_PAUSE:
        head(&pk, m->type, 1 + (m->u.pause.recompute != 0));
        kv_str(&pk, "mode", fr_pause_mode_name(m->u.pause.mode));
        if (m->u.pause.recompute) kv_bool(&pk, "recompute", 1);
        break;
    case FR_MSG_RESUME:
        head(&pk, m->type, m->u.resume.recompute != 0);
        if (m->u.resume.recompute) kv_bool(&pk, "recompute", 1);
        break;
    case FR_MSG_STATS:
        head(&pk, m->type, 0);
        break;
    case FR_MSG_UPDATE_BEGIN:
        enc_update_begin(&pk, &m->u.update_begin);
        break;
    case FR_MSG_UPDATE_BUCKET:
        enc_update_bucket(&pk, &m->u.update_bucket);
        break;
    case FR_MSG_UPDATE_COMMIT:
    case FR_MSG_UPDATE_ABORT:
        head(&pk, m->type, 1);
        kv_u64(&pk, "version", m->u.update_end.version);
        break;
    case FR_MSG_UPDATE_REPLY:
        enc_update_reply(&pk, &m->u.update_reply);
        break;
    case FR_MSG_NCCL_INIT:
        head(&pk, m->type, 1);
        key(&pk, "unique_id");
        msgpack_pack_bin(&pk, FR_PROTO_NCCL_ID_BYTES);
        msgpack_pack_bin_body(&pk, m->u.nccl_init.unique_id, FR_PROTO_NCCL_ID_BYTES);
        break;
    case FR_MSG_NCCL_BUCKET:
        enc_nccl_bucket(&pk, &m->u.nccl_bucket);
        break;
    case FR_MSG_NCCL_CLOSE:
        head(&pk, m->type, 0);
        break;
    case FR_MSG_NCCL_REPLY:
        head(&pk, m->type, 4);
        kv_str(&pk, "state", fr_nccl_state_name(m->u.nccl_reply.state));
        kv_int(&pk, "nranks", m->u.nccl_reply.nranks);
        kv_int(&pk, "rank", m->u.nccl_reply.rank);
        kv_double(&pk, "timeout_s", m->u.nccl_reply.timeout_s);
        break;
    case FR_MSG_HELLO_REPLY:
        enc_hello_reply(&pk, &m->u.hello_reply);
        break;
    case FR_MSG_TOKENS:
        enc_tokens(&pk, &m->u.tokens);
        break;
    case FR_MSG_DONE:
        enc_done(&pk, &m->u.done);
        break;
    case FR_MSG_ABORT_REPLY:
        head(&pk, m->type, 2);
        kv_int(&pk, "samples", m->u.abort_reply.samples);
        kv_u64s(&pk, "not_found", m->u.abort_reply.not_found, m->u.abort_reply.n_not_found);
        break;
    case FR_MSG_PAUSE_REPLY:
        head(&pk, m->type, 3);
        kv_str(&pk, "mode", fr_pause_mode_name(m->u.pause_reply.mode));
        kv_str(&pk, "state", "paused");
        kv_int(&pk, "aborted", m->u.pause_reply.aborted);
        break;
    case FR_MSG_RESUME_REPLY:
        head(&pk, m->type, 1);
        kv_int(&pk, "released", m->u.resume_reply.released);
        break;
    case FR_MSG_STATS_REPLY:
        enc_stats_reply(&pk, &m->u.stats_reply);
        break;
    case FR_MSG_ERROR:
        head(&pk, m->type, 3);
        kv_str(&pk, "code", m->u.error.code);
        kv_str(&pk, "message", m->u.error.message);
        if (m->u.error.has_request_id) kv_u64(&pk, "request_id", m->u.error.request_id);
        else kv_nil(&pk, "request_id");
        break;
    default:
        free(sb.data);
        return fr_fail(FR_EINVAL, "protocol: cannot encode message type %d", (int)m->type);
    }
    if (sb.failed || !sb.data) {
        free(sb.data);
        return fr_fail(FR_ENOMEM, "protocol: out of memory encoding %s", fr_msg_type_name(m->type));
    }
    *data = sb.data;
    *len = sb.len;
    return FR_OK;
}
