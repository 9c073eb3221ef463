/* msgpack frame 0 -> fr_msg, strictly (trainer_bridge/protocol/protocol.h): each
 * message type's keys, read with the getters of proto_get.c. */
#include <limits.h>
#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_decode.h"

enum { I_MAX = INT_MAX };

/* generate's text keys (docs/protocol.md): prompt_text instead of prompt,
 * add_special_tokens, stop, include_stop_str_in_output, return_text,
 * skip_special_tokens. */
static fr_status dec_generate_text(const fr_dec_ctx *c, fr_msg_generate *g)
{
    const msgpack_object *pr = fr_dec_find(c->map, "prompt");
    int has_text = 0, has_prompt = pr && pr->type != MSGPACK_OBJECT_NIL;
    const msgpack_object *pt = fr_dec_find(c->map, "prompt_text");
    if (pt && pt->type != MSGPACK_OBJECT_NIL && has_prompt)
        return BAD("generate: give \"prompt\" or \"prompt_text\", not both");
    TRY(fr_dec_get_text(c, "prompt_text", 0, FR_PROTO_MAX_TEXT, &g->prompt_text, &g->prompt_text_len, &has_text));
    if (has_text && g->prompt_text_len == 0) return BAD("generate: \"prompt_text\" is empty");
    if (!has_text) TRY(fr_dec_get_ints(c, "prompt", 1, 0, I_MAX, &g->prompt, &g->n_prompt, NULL));
    const msgpack_object *as = fr_dec_find(c->map, "add_special_tokens");
    g->has_add_special_tokens = as && as->type != MSGPACK_OBJECT_NIL;
    TRY(fr_dec_get_bool(c, "add_special_tokens", 0, &g->add_special_tokens));
    TRY(fr_dec_get_strs(c, "stop", FR_PROTO_MAX_STOP, FR_PROTO_MAX_STOP_BYTES, &g->stop, &g->n_stop));
    TRY(fr_dec_get_bool(c, "include_stop_str_in_output", 0, &g->include_stop_str_in_output));
    TRY(fr_dec_get_bool(c, "return_text", 0, &g->return_text));
    int skip = 1;   /* absent: skipped, as vLLM's default */
    TRY(fr_dec_get_bool(c, "skip_special_tokens", 0, &skip));
    g->keep_special_tokens = !skip;
    return FR_OK;
}

static fr_status dec_generate(const fr_dec_ctx *c, fr_msg_generate *g)
{
    KEYS(c, "type", "v", "request_id", "prompt", "n", "group_id", "temperature", "top_k", "top_p", "max_tokens",
         "stop_token_ids", "seed", "monitor_divergence", "per_token_kl", "forced_tokens", "first_sample",
         "min_tokens", "logprobs", "prompt_logprobs", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "continue_tokens", "prompt_text", "add_special_tokens", "stop",
         "include_stop_str_in_output", "return_text", "return_routed_experts", "skip_special_tokens");
    int has_n = 0;
    TRY(fr_dec_get_u64(c, "request_id", 1, &g->request_id, NULL));
    TRY(dec_generate_text(c, g));
    TRY(fr_dec_get_int(c, "n", 0, 1, FR_PROTO_MAX_SAMPLES, &g->n, &has_n));
    if (!has_n) g->n = 1;
    TRY(fr_dec_get_int(c, "first_sample", 0, 0, I_MAX - g->n, &g->first_sample, NULL));
    TRY(fr_dec_get_u64(c, "group_id", 0, &g->group_id, &g->has_group_id));
    TRY(fr_dec_get_double(c, "temperature", 0, &g->temperature, &g->has_temperature));
    TRY(fr_dec_get_int(c, "top_k", 0, 0, I_MAX, &g->top_k, &g->has_top_k));
    TRY(fr_dec_get_double(c, "top_p", 0, &g->top_p, &g->has_top_p));
    TRY(fr_dec_get_int(c, "max_tokens", 0, 1, I_MAX, &g->max_tokens, &g->has_max_tokens));
    TRY(fr_dec_get_ints(c, "stop_token_ids", 0, 0, I_MAX, &g->stop_token_ids, &g->n_stop_token_ids,
                 &g->has_stop_token_ids));
    TRY(fr_dec_get_u64(c, "seed", 0, &g->seed, &g->has_seed));
    TRY(fr_dec_get_bool(c, "monitor_divergence", 0, &g->monitor_divergence));
    TRY(fr_dec_get_bool(c, "per_token_kl", 0, &g->per_token_kl));
    int has_forced = 0;
    TRY(fr_dec_get_ints(c, "forced_tokens", 0, 0, I_MAX, &g->forced_tokens, &g->n_forced_tokens, &has_forced));
    TRY(fr_dec_get_int(c, "min_tokens", 0, 0, I_MAX, &g->min_tokens, NULL));
    if (g->has_max_tokens && g->min_tokens > g->max_tokens)
        return BAD("generate: \"min_tokens\" (%d) must not exceed \"max_tokens\" (%d)", g->min_tokens, g->max_tokens);
    TRY(fr_dec_get_int(c, "logprobs", 0, 0, FR_PROTO_MAX_LOGPROBS, &g->logprobs, NULL));
    TRY(fr_dec_get_bool(c, "prompt_logprobs", 0, &g->prompt_logprobs));
    TRY(fr_dec_get_bool(c, "return_routed_experts", 0, &g->return_routed_experts));
    TRY(fr_dec_get_double(c, "min_p", 0, &g->min_p, NULL));
    TRY(fr_dec_get_double(c, "presence_penalty", 0, &g->presence_penalty, NULL));
    TRY(fr_dec_get_double(c, "frequency_penalty", 0, &g->frequency_penalty, NULL));
    int has_rp = 0;
    TRY(fr_dec_get_double(c, "repetition_penalty", 0, &g->repetition_penalty, &has_rp));
    if (has_rp && !(g->repetition_penalty > 0))
        return BAD("generate: \"repetition_penalty\" must be in (0, 2] (1 = off), got %g", g->repetition_penalty);
    TRY(fr_dec_get_ints(c, "continue_tokens", 0, 0, I_MAX, &g->continue_tokens, &g->n_continue_tokens, NULL));
    if (g->n_continue_tokens == 0) {   /* an empty array continues nothing: a sample from its start */
        free(g->continue_tokens);
        g->continue_tokens = NULL;
    }
    return FR_OK;
}

/* The name, dtype and shape keys of a tensor map (the caller checks the
 * key set). */
static fr_status get_tensor(const fr_dec_ctx *c, fr_msg_tensor *t)
{
    char dt[16];
    TRY(fr_dec_get_str(c, "name", 1, t->name, sizeof t->name));
    TRY(fr_dec_get_str(c, "dtype", 1, dt, sizeof dt));
    if (!fr_proto_dtype_from_name(dt, strlen(dt), &t->dtype))
        return BAD("%s: \"%sdtype\" must be f32, bf16 or f16, got \"%s\"", c->type, c->prefix, dt);
    const msgpack_object_array *a;
    TRY(fr_dec_get_array(c, "shape", 1, &a));
    if (a->size < 1 || a->size > FR_PROTO_MAX_NDIM)
        return BAD("%s: \"%sshape\" must have 1 to %d dimensions, got %u", c->type, c->prefix, FR_PROTO_MAX_NDIM,
                   a->size);
    t->ndim = (int)a->size;
    for (uint32_t d = 0; d < a->size; d++) {
        long long v;
        char elem[32];
        snprintf(elem, sizeof elem, "shape[%u]", d);
        TRY(fr_dec_as_i64(c, elem, &a->ptr[d], 1, (long long)1 << 40, &v));
        t->shape[d] = v;
    }
    return FR_OK;
}

/* Element i of an array of maps, as a context whose prefix names it. */
static fr_status map_elem(const fr_dec_ctx *c, const char *name, const msgpack_object_array *a, uint32_t i, char *prefix,
                          size_t cap, fr_dec_ctx *sub)
{
    snprintf(prefix, cap, "%s[%u].", name, i);
    if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
        return BAD("%s: \"%s[%u]\" must be a map, got %s", c->type, name, i, fr_dec_kind(&a->ptr[i]));
    *sub = (fr_dec_ctx){.type = c->type, .prefix = prefix, .map = &a->ptr[i].via.map};
    return FR_OK;
}

static fr_status dec_update_begin(const fr_dec_ctx *c, fr_msg_update_begin *b)
{
    KEYS(c, "type", "v", "version", "tensors", "total_bytes", "bucket_bytes", "transport", "partial");
    char transport[16] = "zmq";
    TRY(fr_dec_get_str(c, "transport", 0, transport, sizeof transport));
    if (strcmp(transport, "nccl") == 0) b->nccl = 1;
    else if (strcmp(transport, "zmq") != 0)
        return BAD("%s: \"transport\" must be \"zmq\" or \"nccl\", got \"%s\"", c->type, transport);
    TRY(fr_dec_get_bool(c, "partial", 0, &b->partial));
    TRY(fr_dec_get_u64(c, "version", 1, &b->version, NULL));
    TRY(fr_dec_get_u64(c, "total_bytes", 1, &b->total_bytes, NULL));
    TRY(fr_dec_get_u64(c, "bucket_bytes", 1, &b->bucket_bytes, NULL));
    const msgpack_object_array *a;
    TRY(fr_dec_get_array(c, "tensors", 1, &a));
    if (a->size < 1 || a->size > FR_PROTO_MAX_TENSORS)
        return BAD("%s: \"tensors\" must list 1 to %d tensors, got %u", c->type, FR_PROTO_MAX_TENSORS, a->size);
    b->tensors = calloc(a->size, sizeof *b->tensors);
    if (!b->tensors) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"tensors\"", c->type);
    b->n_tensors = (int)a->size;
    for (uint32_t i = 0; i < a->size; i++) {
        char prefix[48];
        fr_dec_ctx e;
        TRY(map_elem(c, "tensors", a, i, prefix, sizeof prefix, &e));
        KEYS(&e, "name", "dtype", "shape");
        TRY(get_tensor(&e, &b->tensors[i]));
    }
    for (int i = 0; i < b->n_tensors; i++)   /* names distinct (sizes are small: a model's tensors) */
        for (int j = 0; j < i; j++)
            if (strcmp(b->tensors[i].name, b->tensors[j].name) == 0)
                return BAD("%s: tensor \"%s\" is listed twice", c->type, b->tensors[i].name);
    return FR_OK;
}

/* The "pieces" array of a bucket (ZeroMQ: name, dtype, shape, offset,
 * nbytes; NCCL also "at", the piece's place in the broadcast buffer). */
static fr_status dec_piece(const fr_dec_ctx *e, int with_at, fr_msg_piece *p)
{
    if (with_at)
        KEYS(e, "name", "dtype", "shape", "offset", "nbytes", "at");
    else
        KEYS(e, "name", "dtype", "shape", "offset", "nbytes");
    TRY(get_tensor(e, &p->t));
    TRY(fr_dec_get_u64(e, "offset", 1, &p->offset, NULL));
    TRY(fr_dec_get_u64(e, "nbytes", 1, &p->nbytes, NULL));
    return with_at ? fr_dec_get_u64(e, "at", 1, &p->at, NULL) : FR_OK;
}

static fr_status dec_pieces(const fr_dec_ctx *c, int with_at, fr_msg_piece **pieces, int *n_pieces)
{
    const msgpack_object_array *a;
    TRY(fr_dec_get_array(c, "pieces", 1, &a));
    if (a->size < 1) return BAD("%s: \"pieces\" must hold at least one piece", c->type);
    *pieces = calloc(a->size, sizeof **pieces);
    if (!*pieces) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"pieces\"", c->type);
    *n_pieces = (int)a->size;
    for (uint32_t i = 0; i < a->size; i++) {
        char prefix[48];
        fr_dec_ctx e;
        TRY(map_elem(c, "pieces", a, i, prefix, sizeof prefix, &e));
        TRY(dec_piece(&e, with_at, &(*pieces)[i]));
    }
    return FR_OK;
}

static fr_status dec_update_bucket(const fr_dec_ctx *c, fr_msg_update_bucket *b)
{
    KEYS(c, "type", "v", "version", "bucket", "xxh64", "pieces");
    TRY(fr_dec_get_u64(c, "version", 1, &b->version, NULL));
    TRY(fr_dec_get_int(c, "bucket", 1, 0, I_MAX, &b->bucket, NULL));
    TRY(fr_dec_get_u64(c, "xxh64", 1, &b->xxh64, NULL));
    return dec_pieces(c, 0, &b->pieces, &b->n_pieces);
}

static fr_status dec_nccl_bucket(const fr_dec_ctx *c, fr_msg_nccl_bucket *b)
{
    KEYS(c, "type", "v", "version", "bucket", "nbytes", "checksum", "pieces");
    TRY(fr_dec_get_u64(c, "version", 1, &b->version, NULL));
    TRY(fr_dec_get_int(c, "bucket", 1, 0, I_MAX, &b->bucket, NULL));
    TRY(fr_dec_get_u64(c, "nbytes", 1, &b->nbytes, NULL));
    TRY(fr_dec_get_u64(c, "checksum", 1, &b->checksum, NULL));
    return dec_pieces(c, 1, &b->pieces, &b->n_pieces);
}

/* The NCCL unique id: a msgpack bin of exactly FR_PROTO_NCCL_ID_BYTES. */
static fr_status dec_nccl_init(const fr_dec_ctx *c, fr_msg_nccl_init *n)
{
    KEYS(c, "type", "v", "unique_id");
    const msgpack_object *o;
    TRY(fr_dec_get(c, "unique_id", 1, &o));
    if (o->type != MSGPACK_OBJECT_BIN || o->via.bin.size != FR_PROTO_NCCL_ID_BYTES)
        return BAD("%s: \"unique_id\" must be binary of %d bytes, got %s", c->type, FR_PROTO_NCCL_ID_BYTES,
                   o->type == MSGPACK_OBJECT_BIN ? "binary of another length" : fr_dec_kind(o));
    memcpy(n->unique_id, o->via.bin.ptr, FR_PROTO_NCCL_ID_BYTES);
    return FR_OK;
}

static fr_status dec_nccl_reply(const fr_dec_ctx *c, fr_msg_nccl_reply *r)
{
    KEYS(c, "type", "v", "state", "nranks", "rank", "timeout_s");
    char state[16];
    TRY(fr_dec_get_str(c, "state", 1, state, sizeof state));
    if (!fr_proto_nccl_state_from_name(state, strlen(state), &r->state))
        return BAD("%s: \"state\" must be joining or closed, got \"%s\"", c->type, state);
    TRY(fr_dec_get_int(c, "nranks", 1, 0, I_MAX, &r->nranks, NULL));
    TRY(fr_dec_get_int(c, "rank", 1, 0, I_MAX, &r->rank, NULL));
    TRY(fr_dec_get_double(c, "timeout_s", 1, &r->timeout_s, NULL));
    return FR_OK;
}

static fr_status dec_update_reply(const fr_dec_ctx *c, fr_msg_update_reply *r)
{
    KEYS(c, "type", "v", "version", "stage", "bucket", "bytes", "weight_version");
    char stage[16];
    int has_bucket = 0;
    TRY(fr_dec_get_u64(c, "version", 1, &r->version, NULL));
    TRY(fr_dec_get_str(c, "stage", 1, stage, sizeof stage));
    if (!fr_proto_stage_from_name(stage, strlen(stage), &r->stage))
        return BAD("%s: \"stage\" must be begin, bucket, commit or abort, got \"%s\"", c->type, stage);
    if (!fr_dec_find(c->map, "bucket")) return BAD("%s: missing key \"bucket\" (nil when none)", c->type);
    TRY(fr_dec_get_int(c, "bucket", 0, 0, I_MAX, &r->bucket, &has_bucket));
    if (!has_bucket) r->bucket = -1;
    TRY(fr_dec_get_u64(c, "bytes", 1, &r->bytes, NULL));
    TRY(fr_dec_get_u64(c, "weight_version", 1, &r->weight_version, NULL));
    return FR_OK;
}

static fr_status dec_abort(const fr_dec_ctx *c, fr_msg_abort *a)
{
    KEYS(c, "type", "v", "all", "request_ids");
    int has_ids = 0;
    TRY(fr_dec_get_bool(c, "all", 0, &a->all));
    TRY(fr_dec_get_u64s(c, "request_ids", 0, &a->request_ids, &a->n_request_ids, &has_ids));
    if (a->all && has_ids) return BAD("abort: give either \"all\" or \"request_ids\", not both");
    return FR_OK;
}

static fr_status get_mode(const fr_dec_ctx *c, fr_pause_mode *mode)
{
    char s[16];
    TRY(fr_dec_get_str(c, "mode", 1, s, sizeof s));
    if (strcmp(s, "abort") == 0) *mode = FR_PAUSE_ABORT;
    else if (strcmp(s, "wait") == 0) *mode = FR_PAUSE_WAIT;
    else if (strcmp(s, "keep") == 0) *mode = FR_PAUSE_KEEP;
    else return BAD("%s: \"mode\" must be \"abort\", \"wait\" or \"keep\", got \"%s\"", c->type, s);
    return FR_OK;
}

static fr_status dec_hello_reply(const fr_dec_ctx *c, fr_msg_hello_reply *h)
{
    KEYS(c, "type", "v", "server", "model", "backend", "kv_dtype", "tp", "engines", "weight_version", "max_seqs",
         "kv_blocks", "kv_block_tokens", "max_model_len", "vocab_size", "eos_token_ids", "chunk", "tokenizer");
    TRY(fr_dec_get_str(c, "tokenizer", 0, h->tokenizer, sizeof h->tokenizer));
    TRY(fr_dec_get_str(c, "server", 1, h->server, sizeof h->server));
    TRY(fr_dec_get_str(c, "model", 1, h->model, sizeof h->model));
    TRY(fr_dec_get_str(c, "backend", 1, h->backend, sizeof h->backend));
    TRY(fr_dec_get_str(c, "kv_dtype", 1, h->kv_dtype, sizeof h->kv_dtype));
    TRY(fr_dec_get_int(c, "tp", 1, 1, I_MAX, &h->tp, NULL));
    TRY(fr_dec_get_int(c, "engines", 1, 1, I_MAX, &h->engines, NULL));
    TRY(fr_dec_get_u64(c, "weight_version", 1, &h->weight_version, NULL));
    TRY(fr_dec_get_int(c, "max_seqs", 1, 1, I_MAX, &h->max_seqs, NULL));
    TRY(fr_dec_get_int(c, "kv_blocks", 1, 1, I_MAX, &h->kv_blocks, NULL));
    TRY(fr_dec_get_int(c, "kv_block_tokens", 1, 1, I_MAX, &h->kv_block_tokens, NULL));
    TRY(fr_dec_get_int(c, "max_model_len", 1, 1, I_MAX, &h->max_model_len, NULL));
    TRY(fr_dec_get_int(c, "vocab_size", 1, 1, I_MAX, &h->vocab_size, NULL));
    TRY(fr_dec_get_int(c, "chunk", 1, 1, I_MAX, &h->chunk, NULL));
    int *eos = NULL, n_eos = 0;
    TRY(fr_dec_get_ints(c, "eos_token_ids", 1, 0, I_MAX, &eos, &n_eos, NULL));
    if (n_eos > FR_PROTO_MAX_EOS) {
        free(eos);
        return BAD("hello_reply: \"eos_token_ids\" holds %d ids, the limit is %d", n_eos, FR_PROTO_MAX_EOS);
    }
    if (n_eos) memcpy(h->eos_token_ids, eos, sizeof(int) * (size_t)n_eos);
    h->n_eos_token_ids = n_eos;
    free(eos);
    return FR_OK;
}

static fr_status dec_tokens(const fr_dec_ctx *c, fr_msg_tokens *k)
{
    KEYS(c, "type", "v", "request_id", "sample", "start", "token_ids", "logprobs", "weight_versions", "text");
    int n_lp = 0, n_wv = 0;
    TRY(fr_dec_get_text(c, "text", 0, (size_t)1 << 30, &k->text, &k->text_len, &k->has_text));
    TRY(fr_dec_get_u64(c, "request_id", 1, &k->request_id, NULL));
    TRY(fr_dec_get_int(c, "sample", 1, 0, I_MAX, &k->sample, NULL));
    TRY(fr_dec_get_int(c, "start", 1, 0, I_MAX, &k->start, NULL));
    TRY(fr_dec_get_ints(c, "token_ids", 1, 0, I_MAX, &k->token_ids, &k->n, NULL));
    TRY(fr_dec_get_floats(c, "logprobs", &k->logprobs, &n_lp));
    TRY(fr_dec_get_u64s(c, "weight_versions", 1, &k->weight_versions, &n_wv, NULL));
    if (n_lp != k->n || n_wv != k->n)
        return BAD("tokens: \"token_ids\", \"logprobs\" and \"weight_versions\" must have one length, got %d, %d, %d",
                   k->n, n_lp, n_wv);
    return FR_OK;
}

static fr_status get_nullable(const fr_dec_ctx *c, const char *name, double *out, int *present)
{
    const msgpack_object *o = fr_dec_find(c->map, name);
    if (!o) return BAD("%s: missing key \"%s%s\"", c->type, c->prefix, name);
    *present = o->type != MSGPACK_OBJECT_NIL;
    return *present ? fr_dec_as_double(c, name, o, out) : FR_OK;
}

/* done's optional "top_logprobs": {k, token_ids, logprobs}, k per token. */
static fr_status get_top_logprobs(const fr_dec_ctx *c, fr_msg_done *d)
{
    const msgpack_object *o = fr_dec_find(c->map, "top_logprobs");
    if (!o || o->type == MSGPACK_OBJECT_NIL) return FR_OK;
    fr_dec_ctx t;
    TRY(fr_dec_get_map(c, "top_logprobs", "top_logprobs.", &t));
    KEYS(&t, "k", "token_ids", "logprobs");
    int n_ids = 0, n_lp = 0;
    TRY(fr_dec_get_int(&t, "k", 1, 1, FR_PROTO_MAX_LOGPROBS, &d->top_k, NULL));
    TRY(fr_dec_get_ints(&t, "token_ids", 1, 0, I_MAX, &d->top_token_ids, &n_ids, NULL));
    TRY(fr_dec_get_floats(&t, "logprobs", &d->top_logprobs, &n_lp));
    if ((long long)n_ids != (long long)d->n_tokens * d->top_k || n_lp != n_ids)
        return BAD("done: \"top_logprobs\" must hold n_tokens x k = %lld entries, got %d and %d",
                   (long long)d->n_tokens * d->top_k, n_ids, n_lp);
    return FR_OK;
}

/* done's optional routed experts: "routed_experts" (bin of n_tokens x
 * layers x k ids), "routed_experts_shape" ([layers, k]) and
 * "routed_experts_dtype" ("u8", "u16"), all three or none; after n_tokens. */
static fr_status get_routes(const fr_dec_ctx *c, fr_msg_done *d)
{
    const msgpack_object *o = fr_dec_find(c->map, "routed_experts");
    const msgpack_object *sh = fr_dec_find(c->map, "routed_experts_shape");
    const msgpack_object *dt = fr_dec_find(c->map, "routed_experts_dtype");
    const int has = o && o->type != MSGPACK_OBJECT_NIL;
    if (!has && !(sh && sh->type != MSGPACK_OBJECT_NIL) && !(dt && dt->type != MSGPACK_OBJECT_NIL)) return FR_OK;
    if (!has) return BAD("done: \"routed_experts_shape\" and \"routed_experts_dtype\" come only with \"routed_experts\"");
    if (o->type != MSGPACK_OBJECT_BIN) return BAD("done: \"routed_experts\" must be binary data, got %s", fr_dec_kind(o));
    const msgpack_object_array *a;
    TRY(fr_dec_get_array(c, "routed_experts_shape", 1, &a));
    long long dims[2];
    if (a->size != 2) return BAD("done: \"routed_experts_shape\" must be [layers, k], got %u entries", a->size);
    for (int i = 0; i < 2; i++)
        TRY(fr_dec_as_i64(c, "routed_experts_shape", &a->ptr[i], 1, FR_PROTO_MAX_ROUTE_DIM, &dims[i]));
    char dtype[8];
    TRY(fr_dec_get_str(c, "routed_experts_dtype", 1, dtype, sizeof dtype));
    if (strcmp(dtype, "u8") && strcmp(dtype, "u16"))
        return BAD("done: \"routed_experts_dtype\" must be \"u8\" or \"u16\", got \"%s\"", dtype);
    d->route_layers = (int)dims[0];
    d->route_k = (int)dims[1];
    d->route_width = dtype[1] == '8' ? 1 : 2;
    const uint64_t want = fr_proto_route_bytes(d);
    if (o->via.bin.size != want)
        return BAD("done: \"routed_experts\" must hold n_tokens x layers x k x width = %d x %d x %d x %d = %llu bytes, "
                   "got %u", d->n_tokens, d->route_layers, d->route_k, d->route_width, (unsigned long long)want,
                   o->via.bin.size);
    if (!(d->routed_experts = malloc(want ? (size_t)want : 1))) return fr_fail(FR_ENOMEM, "done: out of memory");
    if (want) memcpy(d->routed_experts, o->via.bin.ptr, (size_t)want);
    return FR_OK;
}

static fr_status dec_done(const fr_dec_ctx *c, fr_msg_done *d)
{
    KEYS(c, "type", "v", "request_id", "group_id", "sample", "finish_reason", "n_tokens", "n_prompt", "preemptions",
         "ttft_ms", "total_ms", "divergence", "seed", "top_logprobs", "prompt_logprobs", "start", "text", "stop_str",
         "prompt_token_ids", "routed_experts", "routed_experts_shape", "routed_experts_dtype");
    char reason[16];
    int has_stop = 0;
    TRY(fr_dec_get_text(c, "text", 0, (size_t)1 << 30, &d->text, &d->text_len, &d->has_text));
    TRY(fr_dec_get_text(c, "stop_str", 0, FR_PROTO_MAX_STOP_BYTES, &d->stop_str, &(size_t){0}, &has_stop));
    TRY(fr_dec_get_ints(c, "prompt_token_ids", 0, 0, I_MAX, &d->prompt_token_ids, &d->n_prompt_token_ids, NULL));
    TRY(fr_dec_get_u64(c, "request_id", 1, &d->request_id, NULL));
    TRY(fr_dec_get_u64(c, "group_id", 1, &d->group_id, NULL));
    TRY(fr_dec_get_int(c, "sample", 1, 0, I_MAX, &d->sample, NULL));
    TRY(fr_dec_get_str(c, "finish_reason", 1, reason, sizeof reason));
    if (!fr_proto_finish_from_name(reason, strlen(reason), &d->finish_reason))
        return BAD("done: \"finish_reason\" must be stop, length, abort or error, got \"%s\"", reason);
    TRY(fr_dec_get_int(c, "start", 0, 0, I_MAX, &d->start, NULL));
    TRY(fr_dec_get_int(c, "n_tokens", 1, 0, I_MAX, &d->n_tokens, NULL));
    TRY(fr_dec_get_int(c, "n_prompt", 1, 0, I_MAX, &d->n_prompt, NULL));
    TRY(fr_dec_get_int(c, "preemptions", 1, 0, I_MAX, &d->preemptions, NULL));
    TRY(get_nullable(c, "ttft_ms", &d->ttft_ms, &d->has_ttft));
    TRY(fr_dec_get_double(c, "total_ms", 1, &d->total_ms, NULL));
    TRY(fr_dec_get_u64(c, "seed", 0, &d->seed, &d->has_seed));
    TRY(get_top_logprobs(c, d));
    TRY(get_routes(c, d));
    const msgpack_object *plp = fr_dec_find(c->map, "prompt_logprobs");
    if (plp && plp->type != MSGPACK_OBJECT_NIL) {
        TRY(fr_dec_get_floats(c, "prompt_logprobs", &d->prompt_logprobs, &d->n_prompt_logprobs));
        if (d->n_prompt_logprobs != (d->n_prompt > 0 ? d->n_prompt - 1 : 0))
            return BAD("done: \"prompt_logprobs\" must hold n_prompt - 1 = %d entries, got %d",
                       d->n_prompt > 0 ? d->n_prompt - 1 : 0, d->n_prompt_logprobs);
    }
    fr_dec_ctx dv;
    TRY(fr_dec_get_map(c, "divergence", "divergence.", &dv));
    KEYS(&dv, "kl_mean", "kl_max", "top1_agreement", "logprob_diff_mean", "positions", "per_token_kl");
    int p[5];
    double pos = 0;
    fr_msg_divergence *v = &d->divergence;
    TRY(get_nullable(&dv, "kl_mean", &v->kl_mean, &p[0]));
    TRY(get_nullable(&dv, "kl_max", &v->kl_max, &p[1]));
    TRY(get_nullable(&dv, "top1_agreement", &v->top1_agreement, &p[2]));
    TRY(get_nullable(&dv, "logprob_diff_mean", &v->logprob_diff_mean, &p[3]));
    TRY(get_nullable(&dv, "positions", &pos, &p[4]));
    int all = p[0] && p[1] && p[2] && p[3] && p[4], none = !p[0] && !p[1] && !p[2] && !p[3] && !p[4];
    if (!all && !none) return BAD("done: the \"divergence\" fields must be all nil or all numbers");
    v->has_values = all;
    if (all) {
        if (!(pos >= 0 && pos <= I_MAX) || pos != floor(pos))
            return BAD("done: \"divergence.positions\" must be an integer >= 0");
        v->positions = (int)pos;
    }
    const msgpack_object *kl = fr_dec_find(dv.map, "per_token_kl");
    if (!kl) return BAD("done: missing key \"divergence.per_token_kl\" (nil when none)");
    if (kl->type != MSGPACK_OBJECT_NIL) {
        if (!all) return BAD("done: \"divergence.per_token_kl\" comes only with the other divergence figures");
        TRY(fr_dec_get_floats(&dv, "per_token_kl", &v->kl, &v->n_kl));
    }
    return FR_OK;
}

static fr_status dec_stats_reply(const fr_dec_ctx *c, fr_msg_stats_reply *s)
{
    KEYS(c, "type", "v", "scheduler", "server");
    fr_dec_ctx a, b;
    TRY(fr_dec_get_map(c, "scheduler", "scheduler.", &a));
    KEYS(&a, "running", "prefilling", "waiting", "preemptions", "tokens_generated", "prefill_tokens", "steps",
         "finished", "kv_blocks_used", "kv_blocks_free");
    TRY(fr_dec_get_int(&a, "running", 1, 0, I_MAX, &s->running, NULL));
    TRY(fr_dec_get_int(&a, "prefilling", 1, 0, I_MAX, &s->prefilling, NULL));
    TRY(fr_dec_get_int(&a, "waiting", 1, 0, I_MAX, &s->waiting, NULL));
    TRY(fr_dec_get_u64(&a, "preemptions", 1, &s->preemptions, NULL));
    TRY(fr_dec_get_u64(&a, "tokens_generated", 1, &s->tokens_generated, NULL));
    TRY(fr_dec_get_u64(&a, "prefill_tokens", 1, &s->prefill_tokens, NULL));
    TRY(fr_dec_get_u64(&a, "steps", 1, &s->steps, NULL));
    TRY(fr_dec_get_u64(&a, "finished", 1, &s->finished, NULL));
    TRY(fr_dec_get_int(&a, "kv_blocks_used", 1, 0, I_MAX, &s->kv_blocks_used, NULL));
    TRY(fr_dec_get_int(&a, "kv_blocks_free", 1, 0, I_MAX, &s->kv_blocks_free, NULL));
    TRY(fr_dec_get_map(c, "server", "server.", &b));
    KEYS(&b, "state", "updating", "update_version", "updates_committed", "updates_failed", "weight_version", "clients", "open_requests", "held_requests", "messages_in", "messages_out",
         "bad_messages", "errors_sent", "requests_accepted", "requests_rejected", "samples_done", "tokens_streamed",
         "send_retries", "queued_messages", "undeliverable_messages", "clients_departed");
    TRY(fr_dec_get_str(&b, "state", 1, s->state, sizeof s->state));
    TRY(fr_dec_get_bool(&b, "updating", 1, &s->updating));
    TRY(fr_dec_get_u64(&b, "update_version", 1, &s->update_version, NULL));
    TRY(fr_dec_get_u64(&b, "updates_committed", 1, &s->updates_committed, NULL));
    TRY(fr_dec_get_u64(&b, "updates_failed", 1, &s->updates_failed, NULL));
    TRY(fr_dec_get_u64(&b, "weight_version", 1, &s->weight_version, NULL));
    TRY(fr_dec_get_int(&b, "clients", 1, 0, I_MAX, &s->clients, NULL));
    TRY(fr_dec_get_int(&b, "open_requests", 1, 0, I_MAX, &s->open_requests, NULL));
    TRY(fr_dec_get_int(&b, "held_requests", 1, 0, I_MAX, &s->held_requests, NULL));
    TRY(fr_dec_get_u64(&b, "messages_in", 1, &s->messages_in, NULL));
    TRY(fr_dec_get_u64(&b, "messages_out", 1, &s->messages_out, NULL));
    TRY(fr_dec_get_u64(&b, "bad_messages", 1, &s->bad_messages, NULL));
    TRY(fr_dec_get_u64(&b, "errors_sent", 1, &s->errors_sent, NULL));
    TRY(fr_dec_get_u64(&b, "requests_accepted", 1, &s->requests_accepted, NULL));
    TRY(fr_dec_get_u64(&b, "requests_rejected", 1, &s->requests_rejected, NULL));
    TRY(fr_dec_get_u64(&b, "samples_done", 1, &s->samples_done, NULL));
    TRY(fr_dec_get_u64(&b, "tokens_streamed", 1, &s->tokens_streamed, NULL));
    TRY(fr_dec_get_u64(&b, "send_retries", 1, &s->send_retries, NULL));
    TRY(fr_dec_get_u64(&b, "queued_messages", 1, &s->queued_messages, NULL));
    TRY(fr_dec_get_u64(&b, "undeliverable_messages", 1, &s->undeliverable_messages, NULL));
    TRY(fr_dec_get_u64(&b, "clients_departed", 0, &s->clients_departed, NULL));
    return FR_OK;
}

static fr_status dec_body(const fr_dec_ctx *c, fr_msg *m)
{
    switch (m->type) {
    case FR_MSG_HELLO:
        KEYS(c, "type", "v", "client");
        return fr_dec_get_str(c, "client", 0, m->u.hello.client, sizeof m->u.hello.client);
    case FR_MSG_GENERATE:
        return dec_generate(c, &m->u.generate);
    case FR_MSG_ABORT:
        return dec_abort(c, &m->u.abort);
    case FR_MSG_PAUSE:
        KEYS(c, "type", "v", "mode", "recompute");
        TRY(get_mode(c, &m->u.pause.mode));
        TRY(fr_dec_get_bool(c, "recompute", 0, &m->u.pause.recompute));
        if (m->u.pause.recompute && m->u.pause.mode != FR_PAUSE_KEEP)
            return BAD("pause: \"recompute\" goes with mode \"keep\" (got mode \"%s\")",
                       fr_pause_mode_name(m->u.pause.mode));
        return FR_OK;
    case FR_MSG_RESUME:
        KEYS(c, "type", "v", "recompute");
        return fr_dec_get_bool(c, "recompute", 0, &m->u.resume.recompute);
    case FR_MSG_STATS:
        KEYS(c, "type", "v");
        return FR_OK;
    case FR_MSG_UPDATE_BEGIN:
        return dec_update_begin(c, &m->u.update_begin);
    case FR_MSG_UPDATE_BUCKET:
        return dec_update_bucket(c, &m->u.update_bucket);
    case FR_MSG_UPDATE_COMMIT:
    case FR_MSG_UPDATE_ABORT:
        KEYS(c, "type", "v", "version");
        return fr_dec_get_u64(c, "version", 1, &m->u.update_end.version, NULL);
    case FR_MSG_UPDATE_REPLY:
        return dec_update_reply(c, &m->u.update_reply);
    case FR_MSG_NCCL_INIT:
        return dec_nccl_init(c, &m->u.nccl_init);
    case FR_MSG_NCCL_BUCKET:
        return dec_nccl_bucket(c, &m->u.nccl_bucket);
    case FR_MSG_NCCL_CLOSE:
        KEYS(c, "type", "v");
        return FR_OK;
    case FR_MSG_NCCL_REPLY:
        return dec_nccl_reply(c, &m->u.nccl_reply);
    case FR_MSG_HELLO_REPLY:
        return dec_hello_reply(c, &m->u.hello_reply);
    case FR_MSG_TOKENS:
        return dec_tokens(c, &m->u.tokens);
    case FR_MSG_DONE:
        return dec_done(c, &m->u.done);
    case FR_MSG_ABORT_REPLY:
        KEYS(c, "type", "v", "samples", "not_found");
        TRY(fr_dec_get_int(c, "samples", 1, 0, I_MAX, &m->u.abort_reply.samples, NULL));
        return fr_dec_get_u64s(c, "not_found", 1, &m->u.abort_reply.not_found, &m->u.abort_reply.n_not_found, NULL);
    case FR_MSG_PAUSE_REPLY: {
        KEYS(c, "type", "v", "mode", "state", "aborted");
        char state[16];
        TRY(get_mode(c, &m->u.pause_reply.mode));
        TRY(fr_dec_get_str(c, "state", 1, state, sizeof state));
        if (strcmp(state, "paused") != 0) return BAD("pause_reply: \"state\" must be \"paused\", got \"%s\"", state);
        return fr_dec_get_int(c, "aborted", 1, 0, I_MAX, &m->u.pause_reply.aborted, NULL);
    }
    case FR_MSG_RESUME_REPLY:
        KEYS(c, "type", "v", "released");
        return fr_dec_get_int(c, "released", 1, 0, I_MAX, &m->u.resume_reply.released, NULL);
    case FR_MSG_STATS_REPLY:
        return dec_stats_reply(c, &m->u.stats_reply);
    case FR_MSG_ERROR: {
        KEYS(c, "type", "v", "code", "message", "request_id");
        fr_msg_error *e = &m->u.error;
        TRY(fr_dec_get_str(c, "code", 1, e->code, sizeof e->code));
        TRY(fr_dec_get_str(c, "message", 1, e->message, sizeof e->message));
        if (!fr_dec_find(c->map, "request_id")) return BAD("error: missing key \"request_id\" (nil when none)");
        return fr_dec_get_u64(c, "request_id", 0, &e->request_id, &e->has_request_id);
    }
    default:
        return BAD("unknown message type %d", (int)m->type);
    }
}

/* Unpacks exactly one msgpack object filling the frame; *u must be
 * destroyed by the caller whatever the result. */
static fr_status unpack_one(const void *data, size_t len, msgpack_unpacked *u)
{
    if (!data || len == 0) return BAD("message: frame 0 is empty (expected a msgpack map)");
    if (!fr_proto_lengths_fit(data, len))
        return BAD("message: frame 0 (%zu bytes) declares lengths far beyond its bytes, or nests deeper than 64", len);
    size_t off = 0;
    msgpack_unpack_return r = msgpack_unpack_next(u, data, len, &off);
    if (r == MSGPACK_UNPACK_CONTINUE) return BAD("message: frame 0 ends inside a msgpack value (%zu bytes)", len);
    if (r == MSGPACK_UNPACK_NOMEM_ERROR) return fr_fail(FR_ENOMEM, "message: out of memory unpacking %zu bytes", len);
    if (r != MSGPACK_UNPACK_SUCCESS) return BAD("message: frame 0 is not valid msgpack");
    if (off != len) return BAD("message: %zu bytes follow the msgpack map in frame 0", len - off);
    return FR_OK;
}

fr_status fr_msg_decode(const void *data, size_t len, fr_msg *out)
{
    if (!out) return fr_fail(FR_EINVAL, "protocol: decode needs out");
    memset(out, 0, sizeof *out);
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    fr_status st = unpack_one(data, len, &u);
    const msgpack_object *root = &u.data;
    if (!st && root->type != MSGPACK_OBJECT_MAP) st = BAD("message: frame 0 must be a msgpack map, got %s", fr_dec_kind(root));
    fr_dec_ctx c = {.type = "message", .prefix = "", .map = st ? NULL : &root->via.map};
    const msgpack_object *t = NULL, *v = NULL;
    if (!st && !(t = fr_dec_find(c.map, "type"))) st = BAD("message: missing key \"type\"");
    if (!st && t->type != MSGPACK_OBJECT_STR) st = BAD("message: \"type\" must be a string, got %s", fr_dec_kind(t));
    if (!st && !(v = fr_dec_find(c.map, "v")))   /* no version says no version this side speaks */
        st = fr_fail(FR_EUNSUPPORTED, "message: missing key \"v\" (the protocol version, %d)", FR_PROTO_VERSION);
    if (!st && v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        st = BAD("message: \"v\" must be an integer, got %s", fr_dec_kind(v));
    if (!st && v->via.u64 != FR_PROTO_VERSION)
        st = fr_fail(FR_EUNSUPPORTED, "message: protocol version %llu is not supported (this side speaks %d)",
                     (unsigned long long)v->via.u64, FR_PROTO_VERSION);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NONE);
    if (!st) {
        m.type = fr_proto_type_from_name(t->via.str.ptr, t->via.str.size);
        char shown[4 * 64 + 1];   /* cut to 64 bytes, non-UTF-8 bytes escaped */
        fr_utf8_escape(t->via.str.ptr, t->via.str.size > 64 ? 64 : t->via.str.size, shown, sizeof shown);
        if (m.type == FR_MSG_NONE)
            st = BAD("message: %s type \"%s\"", fr_utf8_valid(t->via.str.ptr, t->via.str.size) ? "unknown" : "non-UTF-8",
                     shown);
    }
    if (!st) {
        fr_msg_init(&m, m.type);
        c.type = fr_msg_type_name(m.type);
        st = dec_body(&c, &m);
    }
    if (!st) st = fr_proto_check(&m);
    msgpack_unpacked_destroy(&u);
    if (st) {
        fr_msg_free(&m);
        return st;
    }
    *out = m;
    return FR_OK;
}

