/* msgpack frame 0 -> fr_msg, strictly (trainer_bridge/protocol/protocol.h). */
#include <limits.h>
#include <math.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_internal.h"

#define BAD(...) fr_fail(FR_EFORMAT, __VA_ARGS__)

/* Where a value sits, for messages: the message type and, inside a nested
 * map, the map's key ("stats_reply: scheduler.steps: ..."). */
typedef struct {
    const char *type;
    const char *prefix;          /* "" or "scheduler." */
    const msgpack_object_map *map;
} ctx;

static const char *kind(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "a boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "an integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "a negative integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "a float";
    case MSGPACK_OBJECT_STR: return "a string";
    case MSGPACK_OBJECT_ARRAY: return "an array";
    case MSGPACK_OBJECT_MAP: return "a map";
    case MSGPACK_OBJECT_BIN: return "binary data";
    case MSGPACK_OBJECT_EXT: return "an extension value";
    default: return "an unknown value";
    }
}

static int key_is(const msgpack_object *k, const char *name)
{
    size_t n = strlen(name);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, name, n) == 0;
}

static const msgpack_object *find(const msgpack_object_map *m, const char *name)
{
    for (uint32_t i = 0; i < m->size; i++)
        if (key_is(&m->ptr[i].key, name)) return &m->ptr[i].val;
    return NULL;
}

/* Every key a string, listed in `allowed`, and given once. */
static fr_status check_keys(const ctx *c, const char *const *allowed, int n_allowed)
{
    const msgpack_object_map *m = c->map;
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return BAD("%s: %skeys must be strings, found %s", c->type, c->prefix, kind(k));
        int known = 0;
        for (int a = 0; a < n_allowed && !known; a++) known = key_is(k, allowed[a]);
        char shown[4 * 64 + 1];   /* the key as text, cut to 64 bytes, non-UTF-8 bytes escaped */
        fr_utf8_escape(k->via.str.ptr, k->via.str.size > 64 ? 64 : k->via.str.size, shown, sizeof shown);
        if (!fr_utf8_valid(k->via.str.ptr, k->via.str.size))
            return BAD("%s: key \"%s%s\" is not valid UTF-8", c->type, c->prefix, shown);
        if (!known)
            return BAD("%s: unknown key \"%s%s\"", c->type, c->prefix, shown);
        for (uint32_t j = 0; j < i; j++)
            if (m->ptr[j].key.type == MSGPACK_OBJECT_STR && m->ptr[j].key.via.str.size == k->via.str.size &&
                memcmp(m->ptr[j].key.via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
                return BAD("%s: key \"%s%s\" given twice", c->type, c->prefix, shown);
    }
    return FR_OK;
}

/* The value of key, or NULL when absent (nil counts as absent where the key
 * is optional); a missing required key fails. */
static fr_status get(const ctx *c, const char *name, int required, const msgpack_object **out)
{
    *out = NULL;
    const msgpack_object *o = find(c->map, name);
    if (o && o->type == MSGPACK_OBJECT_NIL && !required) o = NULL;
    if (!o && required) return BAD("%s: missing key \"%s%s\"", c->type, c->prefix, name);
    *out = o;
    return FR_OK;
}

static fr_status as_i64(const ctx *c, const char *name, const msgpack_object *o, long long lo, long long hi,
                        long long *out)
{
    long long v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)LLONG_MAX)   /* above every range: say the value as sent */
            return BAD("%s: \"%s%s\" must be in [%lld, %lld], got %llu", c->type, c->prefix, name, lo, hi,
                       (unsigned long long)o->via.u64);
        v = (long long)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        v = (long long)o->via.i64;
    } else {
        return BAD("%s: \"%s%s\" must be an integer, got %s", c->type, c->prefix, name, kind(o));
    }
    if (v < lo || v > hi)
        return BAD("%s: \"%s%s\" must be in [%lld, %lld], got %lld", c->type, c->prefix, name, lo, hi, v);
    *out = v;
    return FR_OK;
}

static fr_status get_int(const ctx *c, const char *name, int required, long long lo, long long hi, int *out,
                         int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    long long v = 0;
    if ((st = as_i64(c, name, o, lo, hi, &v))) return st;
    *out = (int)v;
    return FR_OK;
}

static fr_status get_u64(const ctx *c, const char *name, int required, uint64_t *out, int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return BAD("%s: \"%s%s\" must be an integer >= 0, got %s", c->type, c->prefix, name,
                   o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? "a negative integer" : kind(o));
    *out = o->via.u64;
    return FR_OK;
}

static fr_status as_double(const ctx *c, const char *name, const msgpack_object *o, double *out)
{
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)o->via.u64; return FR_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)o->via.i64; return FR_OK;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *out = o->via.f64; return FR_OK;
    default: return BAD("%s: \"%s%s\" must be a number, got %s", c->type, c->prefix, name, kind(o));
    }
}

static fr_status get_double(const ctx *c, const char *name, int required, double *out, int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    return as_double(c, name, o, out);
}

static fr_status get_bool(const ctx *c, const char *name, int required, int *out)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return BAD("%s: \"%s%s\" must be a boolean, got %s", c->type, c->prefix, name, kind(o));
    *out = o->via.boolean ? 1 : 0;
    return FR_OK;
}

static fr_status get_str(const ctx *c, const char *name, int required, char *buf, size_t cap)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_STR)
        return BAD("%s: \"%s%s\" must be a string, got %s", c->type, c->prefix, name, kind(o));
    if (o->via.str.size >= cap)
        return BAD("%s: \"%s%s\" is %u bytes, the limit is %zu", c->type, c->prefix, name, o->via.str.size,
                   cap - 1);
    if (memchr(o->via.str.ptr, 0, o->via.str.size))
        return BAD("%s: \"%s%s\" holds a NUL byte", c->type, c->prefix, name);
    if (!fr_utf8_valid(o->via.str.ptr, o->via.str.size))
        return BAD("%s: \"%s%s\" is not valid UTF-8", c->type, c->prefix, name);
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = 0;
    return FR_OK;
}

static fr_status get_array(const ctx *c, const char *name, int required, const msgpack_object_array **out)
{
    const msgpack_object *o = NULL;
    fr_status st = get(c, name, required, &o);
    *out = NULL;
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return BAD("%s: \"%s%s\" must be an array, got %s", c->type, c->prefix, name, kind(o));
    if (o->via.array.size > FR_PROTO_MAX_ARRAY)
        return BAD("%s: \"%s%s\" holds %u entries, the limit is %d", c->type, c->prefix, name, o->via.array.size,
                   FR_PROTO_MAX_ARRAY);
    *out = &o->via.array;
    return FR_OK;
}

/* An array of integers in [lo, hi] into a new int array (a 1-entry
 * allocation for an empty array, so present arrays are never NULL). */
static fr_status get_ints(const ctx *c, const char *name, int required, long long lo, long long hi, int **out,
                          int *n, int *present)
{
    const msgpack_object_array *a;
    fr_status st = get_array(c, name, required, &a);
    if (present) *present = a != NULL;
    if (st || !a) return st;
    int *v = malloc(sizeof(int) * (a->size ? a->size : 1));
    if (!v) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *e = &a->ptr[i];
        long long x;
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER && e->type != MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be an integer, got %s", c->type, c->prefix, name, i, kind(e));
        }
        if (e->type == MSGPACK_OBJECT_POSITIVE_INTEGER && e->via.u64 > (uint64_t)LLONG_MAX) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be in [%lld, %lld], got %llu", c->type, c->prefix, name, i, lo, hi,
                       (unsigned long long)e->via.u64);
        }
        x = e->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? (long long)e->via.i64 : (long long)e->via.u64;
        if (x < lo || x > hi) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be in [%lld, %lld], got %lld", c->type, c->prefix, name, i, lo, hi, x);
        }
        v[i] = (int)x;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

static fr_status get_u64s(const ctx *c, const char *name, int required, uint64_t **out, int *n, int *present)
{
    const msgpack_object_array *a;
    fr_status st = get_array(c, name, required, &a);
    if (present) *present = a != NULL;
    if (st || !a) return st;
    uint64_t *v = malloc(sizeof(uint64_t) * (a->size ? a->size : 1));
    if (!v) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    for (uint32_t i = 0; i < a->size; i++) {
        if (a->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be an integer >= 0, got %s", c->type, c->prefix, name, i,
                       kind(&a->ptr[i]));
        }
        v[i] = a->ptr[i].via.u64;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

static fr_status get_floats(const ctx *c, const char *name, float **out, int *n)
{
    const msgpack_object_array *a;
    fr_status st = get_array(c, name, 1, &a);
    if (st) return st;
    float *v = malloc(sizeof(float) * (a->size ? a->size : 1));
    if (!v) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    for (uint32_t i = 0; i < a->size; i++) {
        double x;
        char elem[96];
        snprintf(elem, sizeof elem, "%s[%u]", name, i);
        if ((st = as_double(c, elem, &a->ptr[i], &x))) {
            free(v);
            return st;
        }
        v[i] = (float)x;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

/* A nested map under key; *sub gets its context. */
static fr_status get_map(const ctx *c, const char *name, const char *prefix, ctx *sub)
{
    const msgpack_object *o;
    fr_status st = get(c, name, 1, &o);
    if (st) return st;
    if (o->type != MSGPACK_OBJECT_MAP)
        return BAD("%s: \"%s%s\" must be a map, got %s", c->type, c->prefix, name, kind(o));
    *sub = (ctx){.type = c->type, .prefix = prefix, .map = &o->via.map};
    return FR_OK;
}

#define KEYS(c, ...)                                                                                   \
    do {                                                                                               \
        static const char *const allowed_[] = {__VA_ARGS__};                                           \
        fr_status ks_ = check_keys((c), allowed_, (int)(sizeof allowed_ / sizeof allowed_[0]));       \
        if (ks_) return ks_;                                                                           \
    } while (0)

#define TRY(x)                       \
    do {                             \
        fr_status t_ = (x);          \
        if (t_) return t_;           \
    } while (0)

enum { I_MAX = INT_MAX };

static fr_status dec_generate(const ctx *c, fr_msg_generate *g)
{
    KEYS(c, "type", "v", "request_id", "prompt", "n", "group_id", "temperature", "top_k", "top_p", "max_tokens",
         "stop_token_ids", "seed", "monitor_divergence", "per_token_kl", "forced_tokens", "first_sample",
         "min_tokens", "logprobs", "prompt_logprobs");
    int has_n = 0;
    TRY(get_u64(c, "request_id", 1, &g->request_id, NULL));
    TRY(get_ints(c, "prompt", 1, 0, I_MAX, &g->prompt, &g->n_prompt, NULL));
    TRY(get_int(c, "n", 0, 1, FR_PROTO_MAX_SAMPLES, &g->n, &has_n));
    if (!has_n) g->n = 1;
    TRY(get_int(c, "first_sample", 0, 0, I_MAX - g->n, &g->first_sample, NULL));
    TRY(get_u64(c, "group_id", 0, &g->group_id, &g->has_group_id));
    TRY(get_double(c, "temperature", 0, &g->temperature, &g->has_temperature));
    TRY(get_int(c, "top_k", 0, 0, I_MAX, &g->top_k, &g->has_top_k));
    TRY(get_double(c, "top_p", 0, &g->top_p, &g->has_top_p));
    TRY(get_int(c, "max_tokens", 0, 1, I_MAX, &g->max_tokens, &g->has_max_tokens));
    TRY(get_ints(c, "stop_token_ids", 0, 0, I_MAX, &g->stop_token_ids, &g->n_stop_token_ids,
                 &g->has_stop_token_ids));
    TRY(get_u64(c, "seed", 0, &g->seed, &g->has_seed));
    TRY(get_bool(c, "monitor_divergence", 0, &g->monitor_divergence));
    TRY(get_bool(c, "per_token_kl", 0, &g->per_token_kl));
    int has_forced = 0;
    TRY(get_ints(c, "forced_tokens", 0, 0, I_MAX, &g->forced_tokens, &g->n_forced_tokens, &has_forced));
    TRY(get_int(c, "min_tokens", 0, 0, I_MAX, &g->min_tokens, NULL));
    if (g->has_max_tokens && g->min_tokens > g->max_tokens)
        return BAD("generate: \"min_tokens\" (%d) must not exceed \"max_tokens\" (%d)", g->min_tokens, g->max_tokens);
    TRY(get_int(c, "logprobs", 0, 0, FR_PROTO_MAX_LOGPROBS, &g->logprobs, NULL));
    TRY(get_bool(c, "prompt_logprobs", 0, &g->prompt_logprobs));
    return FR_OK;
}

/* The name, dtype and shape keys of a tensor map (the caller checks the
 * key set). */
static fr_status get_tensor(const ctx *c, fr_msg_tensor *t)
{
    char dt[16];
    TRY(get_str(c, "name", 1, t->name, sizeof t->name));
    TRY(get_str(c, "dtype", 1, dt, sizeof dt));
    if (!fr_proto_dtype_from_name(dt, strlen(dt), &t->dtype))
        return BAD("%s: \"%sdtype\" must be f32, bf16 or f16, got \"%s\"", c->type, c->prefix, dt);
    const msgpack_object_array *a;
    TRY(get_array(c, "shape", 1, &a));
    if (a->size < 1 || a->size > FR_PROTO_MAX_NDIM)
        return BAD("%s: \"%sshape\" must have 1 to %d dimensions, got %u", c->type, c->prefix, FR_PROTO_MAX_NDIM,
                   a->size);
    t->ndim = (int)a->size;
    for (uint32_t d = 0; d < a->size; d++) {
        long long v;
        char elem[32];
        snprintf(elem, sizeof elem, "shape[%u]", d);
        TRY(as_i64(c, elem, &a->ptr[d], 1, (long long)1 << 40, &v));
        t->shape[d] = v;
    }
    return FR_OK;
}

/* Element i of an array of maps, as a context whose prefix names it. */
static fr_status map_elem(const ctx *c, const char *name, const msgpack_object_array *a, uint32_t i, char *prefix,
                          size_t cap, ctx *sub)
{
    snprintf(prefix, cap, "%s[%u].", name, i);
    if (a->ptr[i].type != MSGPACK_OBJECT_MAP)
        return BAD("%s: \"%s[%u]\" must be a map, got %s", c->type, name, i, kind(&a->ptr[i]));
    *sub = (ctx){.type = c->type, .prefix = prefix, .map = &a->ptr[i].via.map};
    return FR_OK;
}

static fr_status dec_update_begin(const ctx *c, fr_msg_update_begin *b)
{
    KEYS(c, "type", "v", "version", "tensors", "total_bytes", "bucket_bytes", "transport", "partial");
    char transport[16] = "zmq";
    TRY(get_str(c, "transport", 0, transport, sizeof transport));
    if (strcmp(transport, "nccl") == 0) b->nccl = 1;
    else if (strcmp(transport, "zmq") != 0)
        return BAD("%s: \"transport\" must be \"zmq\" or \"nccl\", got \"%s\"", c->type, transport);
    TRY(get_bool(c, "partial", 0, &b->partial));
    TRY(get_u64(c, "version", 1, &b->version, NULL));
    TRY(get_u64(c, "total_bytes", 1, &b->total_bytes, NULL));
    TRY(get_u64(c, "bucket_bytes", 1, &b->bucket_bytes, NULL));
    const msgpack_object_array *a;
    TRY(get_array(c, "tensors", 1, &a));
    if (a->size < 1 || a->size > FR_PROTO_MAX_TENSORS)
        return BAD("%s: \"tensors\" must list 1 to %d tensors, got %u", c->type, FR_PROTO_MAX_TENSORS, a->size);
    b->tensors = calloc(a->size, sizeof *b->tensors);
    if (!b->tensors) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"tensors\"", c->type);
    b->n_tensors = (int)a->size;
    for (uint32_t i = 0; i < a->size; i++) {
        char prefix[48];
        ctx e;
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
static fr_status dec_piece(const ctx *e, int with_at, fr_msg_piece *p)
{
    if (with_at)
        KEYS(e, "name", "dtype", "shape", "offset", "nbytes", "at");
    else
        KEYS(e, "name", "dtype", "shape", "offset", "nbytes");
    TRY(get_tensor(e, &p->t));
    TRY(get_u64(e, "offset", 1, &p->offset, NULL));
    TRY(get_u64(e, "nbytes", 1, &p->nbytes, NULL));
    return with_at ? get_u64(e, "at", 1, &p->at, NULL) : FR_OK;
}

static fr_status dec_pieces(const ctx *c, int with_at, fr_msg_piece **pieces, int *n_pieces)
{
    const msgpack_object_array *a;
    TRY(get_array(c, "pieces", 1, &a));
    if (a->size < 1) return BAD("%s: \"pieces\" must hold at least one piece", c->type);
    *pieces = calloc(a->size, sizeof **pieces);
    if (!*pieces) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"pieces\"", c->type);
    *n_pieces = (int)a->size;
    for (uint32_t i = 0; i < a->size; i++) {
        char prefix[48];
        ctx e;
        TRY(map_elem(c, "pieces", a, i, prefix, sizeof prefix, &e));
        TRY(dec_piece(&e, with_at, &(*pieces)[i]));
    }
    return FR_OK;
}

static fr_status dec_update_bucket(const ctx *c, fr_msg_update_bucket *b)
{
    KEYS(c, "type", "v", "version", "bucket", "xxh64", "pieces");
    TRY(get_u64(c, "version", 1, &b->version, NULL));
    TRY(get_int(c, "bucket", 1, 0, I_MAX, &b->bucket, NULL));
    TRY(get_u64(c, "xxh64", 1, &b->xxh64, NULL));
    return dec_pieces(c, 0, &b->pieces, &b->n_pieces);
}

static fr_status dec_nccl_bucket(const ctx *c, fr_msg_nccl_bucket *b)
{
    KEYS(c, "type", "v", "version", "bucket", "nbytes", "checksum", "pieces");
    TRY(get_u64(c, "version", 1, &b->version, NULL));
    TRY(get_int(c, "bucket", 1, 0, I_MAX, &b->bucket, NULL));
    TRY(get_u64(c, "nbytes", 1, &b->nbytes, NULL));
    TRY(get_u64(c, "checksum", 1, &b->checksum, NULL));
    return dec_pieces(c, 1, &b->pieces, &b->n_pieces);
}

/* The NCCL unique id: a msgpack bin of exactly FR_PROTO_NCCL_ID_BYTES. */
static fr_status dec_nccl_init(const ctx *c, fr_msg_nccl_init *n)
{
    KEYS(c, "type", "v", "unique_id");
    const msgpack_object *o;
    TRY(get(c, "unique_id", 1, &o));
    if (o->type != MSGPACK_OBJECT_BIN || o->via.bin.size != FR_PROTO_NCCL_ID_BYTES)
        return BAD("%s: \"unique_id\" must be binary of %d bytes, got %s", c->type, FR_PROTO_NCCL_ID_BYTES,
                   o->type == MSGPACK_OBJECT_BIN ? "binary of another length" : kind(o));
    memcpy(n->unique_id, o->via.bin.ptr, FR_PROTO_NCCL_ID_BYTES);
    return FR_OK;
}

static fr_status dec_nccl_reply(const ctx *c, fr_msg_nccl_reply *r)
{
    KEYS(c, "type", "v", "state", "nranks", "rank", "timeout_s");
    char state[16];
    TRY(get_str(c, "state", 1, state, sizeof state));
    if (!fr_proto_nccl_state_from_name(state, strlen(state), &r->state))
        return BAD("%s: \"state\" must be joining or closed, got \"%s\"", c->type, state);
    TRY(get_int(c, "nranks", 1, 0, I_MAX, &r->nranks, NULL));
    TRY(get_int(c, "rank", 1, 0, I_MAX, &r->rank, NULL));
    TRY(get_double(c, "timeout_s", 1, &r->timeout_s, NULL));
    return FR_OK;
}

static fr_status dec_update_reply(const ctx *c, fr_msg_update_reply *r)
{
    KEYS(c, "type", "v", "version", "stage", "bucket", "bytes", "weight_version");
    char stage[16];
    int has_bucket = 0;
    TRY(get_u64(c, "version", 1, &r->version, NULL));
    TRY(get_str(c, "stage", 1, stage, sizeof stage));
    if (!fr_proto_stage_from_name(stage, strlen(stage), &r->stage))
        return BAD("%s: \"stage\" must be begin, bucket, commit or abort, got \"%s\"", c->type, stage);
    if (!find(c->map, "bucket")) return BAD("%s: missing key \"bucket\" (nil when none)", c->type);
    TRY(get_int(c, "bucket", 0, 0, I_MAX, &r->bucket, &has_bucket));
    if (!has_bucket) r->bucket = -1;
    TRY(get_u64(c, "bytes", 1, &r->bytes, NULL));
    TRY(get_u64(c, "weight_version", 1, &r->weight_version, NULL));
    return FR_OK;
}

static fr_status dec_abort(const ctx *c, fr_msg_abort *a)
{
    KEYS(c, "type", "v", "all", "request_ids");
    int has_ids = 0;
    TRY(get_bool(c, "all", 0, &a->all));
    TRY(get_u64s(c, "request_ids", 0, &a->request_ids, &a->n_request_ids, &has_ids));
    if (a->all && has_ids) return BAD("abort: give either \"all\" or \"request_ids\", not both");
    return FR_OK;
}

static fr_status get_mode(const ctx *c, fr_pause_mode *mode)
{
    char s[16];
    TRY(get_str(c, "mode", 1, s, sizeof s));
    if (strcmp(s, "abort") == 0) *mode = FR_PAUSE_ABORT;
    else if (strcmp(s, "wait") == 0) *mode = FR_PAUSE_WAIT;
    else return BAD("%s: \"mode\" must be \"abort\" or \"wait\", got \"%s\"", c->type, s);
    return FR_OK;
}

static fr_status dec_hello_reply(const ctx *c, fr_msg_hello_reply *h)
{
    KEYS(c, "type", "v", "server", "model", "backend", "kv_dtype", "tp", "engines", "weight_version", "max_seqs",
         "kv_blocks", "kv_block_tokens", "max_model_len", "vocab_size", "eos_token_ids", "chunk");
    TRY(get_str(c, "server", 1, h->server, sizeof h->server));
    TRY(get_str(c, "model", 1, h->model, sizeof h->model));
    TRY(get_str(c, "backend", 1, h->backend, sizeof h->backend));
    TRY(get_str(c, "kv_dtype", 1, h->kv_dtype, sizeof h->kv_dtype));
    TRY(get_int(c, "tp", 1, 1, I_MAX, &h->tp, NULL));
    TRY(get_int(c, "engines", 1, 1, I_MAX, &h->engines, NULL));
    TRY(get_u64(c, "weight_version", 1, &h->weight_version, NULL));
    TRY(get_int(c, "max_seqs", 1, 1, I_MAX, &h->max_seqs, NULL));
    TRY(get_int(c, "kv_blocks", 1, 1, I_MAX, &h->kv_blocks, NULL));
    TRY(get_int(c, "kv_block_tokens", 1, 1, I_MAX, &h->kv_block_tokens, NULL));
    TRY(get_int(c, "max_model_len", 1, 1, I_MAX, &h->max_model_len, NULL));
    TRY(get_int(c, "vocab_size", 1, 1, I_MAX, &h->vocab_size, NULL));
    TRY(get_int(c, "chunk", 1, 1, I_MAX, &h->chunk, NULL));
    int *eos = NULL, n_eos = 0;
    TRY(get_ints(c, "eos_token_ids", 1, 0, I_MAX, &eos, &n_eos, NULL));
    if (n_eos > FR_PROTO_MAX_EOS) {
        free(eos);
        return BAD("hello_reply: \"eos_token_ids\" holds %d ids, the limit is %d", n_eos, FR_PROTO_MAX_EOS);
    }
    if (n_eos) memcpy(h->eos_token_ids, eos, sizeof(int) * (size_t)n_eos);
    h->n_eos_token_ids = n_eos;
    free(eos);
    return FR_OK;
}

static fr_status dec_tokens(const ctx *c, fr_msg_tokens *k)
{
    KEYS(c, "type", "v", "request_id", "sample", "start", "token_ids", "logprobs", "weight_versions");
    int n_lp = 0, n_wv = 0;
    TRY(get_u64(c, "request_id", 1, &k->request_id, NULL));
    TRY(get_int(c, "sample", 1, 0, I_MAX, &k->sample, NULL));
    TRY(get_int(c, "start", 1, 0, I_MAX, &k->start, NULL));
    TRY(get_ints(c, "token_ids", 1, 0, I_MAX, &k->token_ids, &k->n, NULL));
    TRY(get_floats(c, "logprobs", &k->logprobs, &n_lp));
    TRY(get_u64s(c, "weight_versions", 1, &k->weight_versions, &n_wv, NULL));
    if (n_lp != k->n || n_wv != k->n)
        return BAD("tokens: \"token_ids\", \"logprobs\" and \"weight_versions\" must have one length, got %d, %d, %d",
                   k->n, n_lp, n_wv);
    return FR_OK;
}

static fr_status get_nullable(const ctx *c, const char *name, double *out, int *present)
{
    const msgpack_object *o = find(c->map, name);
    if (!o) return BAD("%s: missing key \"%s%s\"", c->type, c->prefix, name);
    *present = o->type != MSGPACK_OBJECT_NIL;
    return *present ? as_double(c, name, o, out) : FR_OK;
}

/* done's optional "top_logprobs": {k, token_ids, logprobs}, k per token. */
static fr_status get_top_logprobs(const ctx *c, fr_msg_done *d)
{
    const msgpack_object *o = find(c->map, "top_logprobs");
    if (!o || o->type == MSGPACK_OBJECT_NIL) return FR_OK;
    ctx t;
    TRY(get_map(c, "top_logprobs", "top_logprobs.", &t));
    KEYS(&t, "k", "token_ids", "logprobs");
    int n_ids = 0, n_lp = 0;
    TRY(get_int(&t, "k", 1, 1, FR_PROTO_MAX_LOGPROBS, &d->top_k, NULL));
    TRY(get_ints(&t, "token_ids", 1, 0, I_MAX, &d->top_token_ids, &n_ids, NULL));
    TRY(get_floats(&t, "logprobs", &d->top_logprobs, &n_lp));
    if ((long long)n_ids != (long long)d->n_tokens * d->top_k || n_lp != n_ids)
        return BAD("done: \"top_logprobs\" must hold n_tokens x k = %lld entries, got %d and %d",
                   (long long)d->n_tokens * d->top_k, n_ids, n_lp);
    return FR_OK;
}

static fr_status dec_done(const ctx *c, fr_msg_done *d)
{
    KEYS(c, "type", "v", "request_id", "group_id", "sample", "finish_reason", "n_tokens", "n_prompt", "preemptions",
         "ttft_ms", "total_ms", "divergence", "seed", "top_logprobs", "prompt_logprobs");
    char reason[16];
    TRY(get_u64(c, "request_id", 1, &d->request_id, NULL));
    TRY(get_u64(c, "group_id", 1, &d->group_id, NULL));
    TRY(get_int(c, "sample", 1, 0, I_MAX, &d->sample, NULL));
    TRY(get_str(c, "finish_reason", 1, reason, sizeof reason));
    if (!fr_proto_finish_from_name(reason, strlen(reason), &d->finish_reason))
        return BAD("done: \"finish_reason\" must be stop, length, abort or error, got \"%s\"", reason);
    TRY(get_int(c, "n_tokens", 1, 0, I_MAX, &d->n_tokens, NULL));
    TRY(get_int(c, "n_prompt", 1, 0, I_MAX, &d->n_prompt, NULL));
    TRY(get_int(c, "preemptions", 1, 0, I_MAX, &d->preemptions, NULL));
    TRY(get_nullable(c, "ttft_ms", &d->ttft_ms, &d->has_ttft));
    TRY(get_double(c, "total_ms", 1, &d->total_ms, NULL));
    TRY(get_u64(c, "seed", 0, &d->seed, &d->has_seed));
    TRY(get_top_logprobs(c, d));
    const msgpack_object *plp = find(c->map, "prompt_logprobs");
    if (plp && plp->type != MSGPACK_OBJECT_NIL) {
        TRY(get_floats(c, "prompt_logprobs", &d->prompt_logprobs, &d->n_prompt_logprobs));
        if (d->n_prompt_logprobs != (d->n_prompt > 0 ? d->n_prompt - 1 : 0))
            return BAD("done: \"prompt_logprobs\" must hold n_prompt - 1 = %d entries, got %d",
                       d->n_prompt > 0 ? d->n_prompt - 1 : 0, d->n_prompt_logprobs);
    }
    ctx dv;
    TRY(get_map(c, "divergence", "divergence.", &dv));
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
    const msgpack_object *kl = find(dv.map, "per_token_kl");
    if (!kl) return BAD("done: missing key \"divergence.per_token_kl\" (nil when none)");
    if (kl->type != MSGPACK_OBJECT_NIL) {
        if (!all) return BAD("done: \"divergence.per_token_kl\" comes only with the other divergence figures");
        TRY(get_floats(&dv, "per_token_kl", &v->kl, &v->n_kl));
    }
    return FR_OK;
}

static fr_status dec_stats_reply(const ctx *c, fr_msg_stats_reply *s)
{
    KEYS(c, "type", "v", "scheduler", "server");
    ctx a, b;
    TRY(get_map(c, "scheduler", "scheduler.", &a));
    KEYS(&a, "running", "prefilling", "waiting", "preemptions", "tokens_generated", "prefill_tokens", "steps",
         "finished", "kv_blocks_used", "kv_blocks_free");
    TRY(get_int(&a, "running", 1, 0, I_MAX, &s->running, NULL));
    TRY(get_int(&a, "prefilling", 1, 0, I_MAX, &s->prefilling, NULL));
    TRY(get_int(&a, "waiting", 1, 0, I_MAX, &s->waiting, NULL));
    TRY(get_u64(&a, "preemptions", 1, &s->preemptions, NULL));
    TRY(get_u64(&a, "tokens_generated", 1, &s->tokens_generated, NULL));
    TRY(get_u64(&a, "prefill_tokens", 1, &s->prefill_tokens, NULL));
    TRY(get_u64(&a, "steps", 1, &s->steps, NULL));
    TRY(get_u64(&a, "finished", 1, &s->finished, NULL));
    TRY(get_int(&a, "kv_blocks_used", 1, 0, I_MAX, &s->kv_blocks_used, NULL));
    TRY(get_int(&a, "kv_blocks_free", 1, 0, I_MAX, &s->kv_blocks_free, NULL));
    TRY(get_map(c, "server", "server.", &b));
    KEYS(&b, "state", "updating", "update_version", "updates_committed", "updates_failed", "weight_version", "clients", "open_requests", "held_requests", "messages_in", "messages_out",
         "bad_messages", "errors_sent", "requests_accepted", "requests_rejected", "samples_done", "tokens_streamed",
         "send_retries", "queued_messages", "undeliverable_messages", "clients_departed");
    TRY(get_str(&b, "state", 1, s->state, sizeof s->state));
    TRY(get_bool(&b, "updating", 1, &s->updating));
    TRY(get_u64(&b, "update_version", 1, &s->update_version, NULL));
    TRY(get_u64(&b, "updates_committed", 1, &s->updates_committed, NULL));
    TRY(get_u64(&b, "updates_failed", 1, &s->updates_failed, NULL));
    TRY(get_u64(&b, "weight_version", 1, &s->weight_version, NULL));
    TRY(get_int(&b, "clients", 1, 0, I_MAX, &s->clients, NULL));
    TRY(get_int(&b, "open_requests", 1, 0, I_MAX, &s->open_requests, NULL));
    TRY(get_int(&b, "held_requests", 1, 0, I_MAX, &s->held_requests, NULL));
    TRY(get_u64(&b, "messages_in", 1, &s->messages_in, NULL));
    TRY(get_u64(&b, "messages_out", 1, &s->messages_out, NULL));
    TRY(get_u64(&b, "bad_messages", 1, &s->bad_messages, NULL));
    TRY(get_u64(&b, "errors_sent", 1, &s->errors_sent, NULL));
    TRY(get_u64(&b, "requests_accepted", 1, &s->requests_accepted, NULL));
    TRY(get_u64(&b, "requests_rejected", 1, &s->requests_rejected, NULL));
    TRY(get_u64(&b, "samples_done", 1, &s->samples_done, NULL));
    TRY(get_u64(&b, "tokens_streamed", 1, &s->tokens_streamed, NULL));
    TRY(get_u64(&b, "send_retries", 1, &s->send_retries, NULL));
    TRY(get_u64(&b, "queued_messages", 1, &s->queued_messages, NULL));
    TRY(get_u64(&b, "undeliverable_messages", 1, &s->undeliverable_messages, NULL));
    TRY(get_u64(&b, "clients_departed", 0, &s->clients_departed, NULL));
    return FR_OK;
}

static fr_status dec_body(const ctx *c, fr_msg *m)
{
    switch (m->type) {
    case FR_MSG_HELLO:
        KEYS(c, "type", "v", "client");
        return get_str(c, "client", 0, m->u.hello.client, sizeof m->u.hello.client);
    case FR_MSG_GENERATE:
        return dec_generate(c, &m->u.generate);
    case FR_MSG_ABORT:
        return dec_abort(c, &m->u.abort);
    case FR_MSG_PAUSE:
        KEYS(c, "type", "v", "mode");
        return get_mode(c, &m->u.pause.mode);
    case FR_MSG_RESUME:
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
        return get_u64(c, "version", 1, &m->u.update_end.version, NULL);
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
        TRY(get_int(c, "samples", 1, 0, I_MAX, &m->u.abort_reply.samples, NULL));
        return get_u64s(c, "not_found", 1, &m->u.abort_reply.not_found, &m->u.abort_reply.n_not_found, NULL);
    case FR_MSG_PAUSE_REPLY: {
        KEYS(c, "type", "v", "mode", "state", "aborted");
        char state[16];
        TRY(get_mode(c, &m->u.pause_reply.mode));
        TRY(get_str(c, "state", 1, state, sizeof state));
        if (strcmp(state, "paused") != 0) return BAD("pause_reply: \"state\" must be \"paused\", got \"%s\"", state);
        return get_int(c, "aborted", 1, 0, I_MAX, &m->u.pause_reply.aborted, NULL);
    }
    case FR_MSG_RESUME_REPLY:
        KEYS(c, "type", "v", "released");
        return get_int(c, "released", 1, 0, I_MAX, &m->u.resume_reply.released, NULL);
    case FR_MSG_STATS_REPLY:
        return dec_stats_reply(c, &m->u.stats_reply);
    case FR_MSG_ERROR: {
        KEYS(c, "type", "v", "code", "message", "request_id");
        fr_msg_error *e = &m->u.error;
        TRY(get_str(c, "code", 1, e->code, sizeof e->code));
        TRY(get_str(c, "message", 1, e->message, sizeof e->message));
        if (!find(c->map, "request_id")) return BAD("error: missing key \"request_id\" (nil when none)");
        return get_u64(c, "request_id", 0, &e->request_id, &e->has_request_id);
    }
    default:
        return BAD("unknown message type %d", (int)m->type);
    }
}

/* Walks the msgpack value in data[0, len) without building it and says
 * whether its declared lengths are plausible: an array or map announcing far
 * more elements than bytes are left, or a string far longer than the frame,
 * would make msgpack-c reserve memory for it up front (8 bytes could ask for
 * gigabytes). "Far" is SLACK beyond the frame: a frame merely cut short is
 * left to the unpacker, which says so. Nesting deeper than 64 is refused.
 * 1: plausible (the unpacker still judges everything), 0: not. */
enum { SLACK = 1 << 20 };
static int lengths_fit_max(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *longest);
static int lengths_fit(const uint8_t *p, size_t len) { return lengths_fit_max(p, len, UINT64_MAX, NULL); }

/* lengths_fit, and no array declares more than max_array entries (*longest:
 * the longest one declared, when not NULL). */
static int lengths_fit_max(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *longest)
{
    size_t at = 0, pending[65];
    int depth = 0;
    pending[0] = 1;   /* the top-level value */
    while (depth >= 0) {
        if (pending[depth] == 0) {
            depth--;
            continue;
        }
        pending[depth]--;
        if (at >= len) return 1;   /* cut short: the unpacker reports it */
        const uint8_t b = p[at++];
        uint64_t n = 0, items = 0;   /* payload bytes to skip, child values to read */
        size_t w = 0;                /* bytes of the length field */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;        /* fixint, nil, bool */
        if ((b & 0xe0) == 0xa0) n = b & 0x1f;                                                /* fixstr */
        else if ((b & 0xf0) == 0x90) {                                                       /* fixarray */
            items = b & 0x0f;
            if (items > max_array) return 0;
        }
        else if ((b & 0xf0) == 0x80) items = 2 * (uint64_t)(b & 0x0f);                      /* fixmap */
        else {
            switch (b) {
            case 0xcc: case 0xd0: n = 1; break;
            case 0xcd: case 0xd1: n = 2; break;
            case 0xca: case 0xce: case 0xd2: n = 4; break;
            case 0xcb: case 0xcf: case 0xd3: n = 8; break;
            case 0xd4: n = 2; break;   /* fixext 1..16: type byte + data */
            case 0xd5: n = 3; break;
            case 0xd6: n = 5; break;
            case 0xd7: n = 9; break;
            case 0xd8: n = 17; break;
            case 0xc4: case 0xd9: w = 1; break;   /* bin8, str8 */
            case 0xc5: case 0xda: w = 2; break;
            case 0xc6: case 0xdb: w = 4; break;
            case 0xc7: w = 1; break;               /* ext8/16/32: length, then type byte */
            case 0xc8: w = 2; break;
            case 0xc9: w = 4; break;
            case 0xdc: case 0xde: w = 2; break;    /* array16, map16 */
            case 0xdd: case 0xdf: w = 4; break;    /* array32, map32 */
            default: return 1;                     /* 0xc1 (never used): the unpacker reports it */
            }
            if (w) {
                if (len - at < w) return 1;
                uint64_t v = 0;
                for (size_t i = 0; i < w; i++) v = v << 8 | p[at + i];
                at += w;
                if (b == 0xdc || b == 0xdd) {
                    items = v;
                    if (longest && v > *longest) *longest = v;
                    if (v > max_array) return 0;
                }
                else if (b == 0xde || b == 0xdf) items = 2 * v;
                else n = v + (b >= 0xc7 && b <= 0xc9 ? 1 : 0);
            }
        }
        if (n > len - at) return n - (len - at) <= SLACK;
        at += (size_t)n;
        if (items) {
            /* each element takes a byte at least; a container merely cut short
             * is walked on (its elements may still declare huge lengths) */
            if (items > len - at && items - (len - at) > SLACK) return 0;
            if (depth == 64) return 0;
            pending[++depth] = (size_t)items;
        }
    }
    return 1;
}

/* Unpacks exactly one msgpack object filling the frame; *u must be
 * destroyed by the caller whatever the result. */
static fr_status unpack_one(const void *data, size_t len, msgpack_unpacked *u)
{
    if (!data || len == 0) return BAD("message: frame 0 is empty (expected a msgpack map)");
    if (!lengths_fit(data, len))
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
    if (!st && root->type != MSGPACK_OBJECT_MAP) st = BAD("message: frame 0 must be a msgpack map, got %s", kind(root));
    ctx c = {.type = "message", .prefix = "", .map = st ? NULL : &root->via.map};
    const msgpack_object *t = NULL, *v = NULL;
    if (!st && !(t = find(c.map, "type"))) st = BAD("message: missing key \"type\"");
    if (!st && t->type != MSGPACK_OBJECT_STR) st = BAD("message: \"type\" must be a string, got %s", kind(t));
    if (!st && !(v = find(c.map, "v")))   /* no version says no version this side speaks */
        st = fr_fail(FR_EUNSUPPORTED, "message: missing key \"v\" (the protocol version, %d)", FR_PROTO_VERSION);
    if (!st && v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        st = BAD("message: \"v\" must be an integer, got %s", kind(v));
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

int fr_msg_peek_request_id(const void *data, size_t len, uint64_t *id)
{
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    int found = 0;
    size_t off = 0;
    if (data && len && lengths_fit(data, len) && msgpack_unpack_next(&u, data, len, &off) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object *o = find(&u.data.via.map, "request_id");
        if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
            if (id) *id = o->via.u64;
            found = 1;
        }
    }
    msgpack_unpacked_destroy(&u);
    return found;
}

fr_msg_type fr_msg_peek_type(const void *data, size_t len)
{
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    fr_msg_type t = FR_MSG_NONE;
    size_t off = 0;
    if (data && len && lengths_fit(data, len) && msgpack_unpack_next(&u, data, len, &off) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object *o = find(&u.data.via.map, "type");
        if (o && o->type == MSGPACK_OBJECT_STR) t = fr_proto_type_from_name(o->via.str.ptr, o->via.str.size);
    }
    msgpack_unpacked_destroy(&u);
    return t;
}

fr_status fr_msg_check_bounds(const void *data, size_t len, uint64_t max_array)
{
    uint64_t longest = 0;
    if (!data || len == 0) return FR_OK;   /* the decoder says what is wrong */
    if (lengths_fit_max(data, len, max_array, &longest)) return FR_OK;
    if (longest > max_array)
        return BAD("message: an array declares %llu entries; no message this server accepts holds more than %llu",
                   (unsigned long long)longest, (unsigned long long)max_array);
    return BAD("message: frame 0 (%zu bytes) declares lengths far beyond its bytes, or nests deeper than 64", len);
}
