#include "rollout/engine/weight_update.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/runner_cpu.h"
#include "rollout/model/tensor_table.h"
#include "base/safetensors.h"
#ifdef FR_HAVE_CUDA
#include "rollout/model/weights_cuda.h"
#endif

enum { NAME_CAP = FR_TENSOR_NAME_CAP };

/* One tensor of the model: where its floats go in the staging model, its
 * shape, and which of its bytes (in the sender's dtype) have arrived. */
typedef struct {
    char name[NAME_CAP];
    float *dst;
    int ndim;
    int64_t shape[2];
    size_t count;                 /* elements */
    fr_dtype dtype;        /* fixed by the first piece */
    int have_dtype;
    size_t received;              /* elements received */
    /* received element ranges, kept sorted and disjoint */
    size_t (*ranges)[2];
    int n_ranges, cap_ranges;
} tensor;

struct fr_weight_update {
    fr_model *staged;
    int spent;           /* committed by move: staged holds the previous weights */
    uint64_t version;
    tensor *t;
    int n;
};

fr_status fr_weight_dtype_parse(const char *s, fr_dtype *out)
{
    fr_dtype t;
    if (!s || !fr_dtype_from_file_name(s, strlen(s), &t) || !fr_dtype_is_weight(t))
        return fr_fail(FR_EINVAL, "weight dtype '%s' (expected F32, BF16 or F16)", s ? s : "(null)");
    *out = t;
    return FR_OK;
}

static void add(fr_weight_update *u, const char *name, float *dst, int ndim, int64_t d0, int64_t d1)
{
    tensor *x = &u->t[u->n++];
    snprintf(x->name, sizeof x->name, "%s", name);
    x->dst = dst;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = ndim == 2 ? d1 : 1;
    x->count = (size_t)d0 * (size_t)x->shape[1];
}

static void table(fr_weight_update *u);

fr_status fr_weight_update_begin(const fr_model_config *cfg, uint64_t version, fr_weight_update **out)
{
    if (!cfg || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin: NULL argument");
    *out = NULL;
    fr_weight_update *u = calloc(1, sizeof *u);
    if (!u) return fr_fail(FR_ENOMEM, "weight update: out of memory");
    fr_status st = fr_model_alloc(cfg, "weight update", &u->staged);
    if (!st && !(u->t = calloc(fr_model_tensor_count(cfg), sizeof *u->t)))
        st = fr_fail(FR_ENOMEM, "weight update: out of memory");
    if (st) {
        fr_weight_update_free(&u);
        return st;
    }
    u->version = version;
    table(u);
    *out = u;
    return FR_OK;
}

static fr_status add_tensor(void *user, const fr_model_tensor *t)
{
    add(user, t->name, t->data, t->ndim, t->rows, t->cols);
    return FR_OK;
}

/* The tensor table over the staged model's current weight pointers (names,
 * shapes, destinations); what was received is left to the caller. */
static void table(fr_weight_update *u)
{
    u->n = 0;
    fr_model_tensors_each(&u->staged->cfg, &u->staged->w, add_tensor, u);
}

fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_restart: NULL update");
    for (int i = 0; i < u->n; i++) {
        u->t[i].n_ranges = 0;
        u->t[i].received = 0;
        u->t[i].have_dtype = 0;
    }
    table(u);   /* a move commit exchanged the staged block: point at the one held now */
    u->version = version;
    u->spent = 0;
    return FR_OK;
}

void fr_weight_update_free(fr_weight_update **pu)
{
    fr_weight_update *u = pu ? *pu : NULL;
    if (!u) return;
    for (int i = 0; u->t && i < u->n; i++) free(u->t[i].ranges);
    free(u->t);
    fr_model_destroy(&u->staged);
    free(u);
    *pu = NULL;
}

uint64_t fr_weight_update_version(const fr_weight_update *u) { return u ? u->version : 0; }

static tensor *find(fr_weight_update *u, const char *name)
{
    for (int i = 0; i < u->n; i++)
        if (strcmp(u->t[i].name, name) == 0) return &u->t[i];
    return NULL;
}

/* Converts n elements of dtype t (little-endian bytes, as safetensors stores
 * them) to float32 at out, in one pass that also looks for NaN and infinity
 * (an all-ones exponent field). Returns the index of the first non-finite
 * element, or -1. Blocks of 4096 elements keep the inner loops free of
 * branches (so they vectorize); only a block that has one is scanned again.
 * out may hold part of the converted block past a non-finite element. */
static long long convert_checked(const char *name, fr_dtype t, const unsigned char *in, size_t n, float *out,
                                 fr_status *st)
{
    enum { BLOCK = 4096 };
    *st = FR_OK;
    for (size_t b = 0; b < n; b += BLOCK) {
        const size_t m = n - b < BLOCK ? n - b : BLOCK;
        uint32_t bad = 0;
        if (t == FR_DTYPE_F32) {
            const unsigned char *p = in + 4 * b;
            memcpy(out + b, p, 4 * m);
            for (size_t i = 0; i < m; i++) {
                uint32_t v;
                memcpy(&v, p + 4 * i, 4);
                bad |= (v & 0x7f800000u) == 0x7f800000u;
            }
        } else if (t == FR_DTYPE_BF16) {
            const unsigned char *p = in + 2 * b;
            for (size_t i = 0; i < m; i++) {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                const uint32_t v = (uint32_t)h << 16;
                memcpy(&out[b + i], &v, 4);
                bad |= (h & 0x7f80u) == 0x7f80u;
            }
        } else {
            fr_st_tensor v = {.name = name, .dtype = FR_DTYPE_F16, .ndim = 1, .shape = {(int64_t)m}, .nbytes = 2 * m,
                           .data = in + 2 * b};
            if ((*st = fr_st_tensor_to_f32(&v, out + b, m))) return -1;
            for (size_t i = 0; i < m; i++) bad |= !isfinite(out[b + i]);
        }
        if (bad)
            for (size_t i = 0; i < m; i++)
                if (!isfinite(out[b + i])) return (long long)(b + i);
    }
    return -1;
}

/* Whether [a, b) overlaps a range of x already received. */
static int overlaps(const tensor *x, size_t a, size_t b)
{
    int i = 0;
    while (i < x->n_ranges && x->ranges[i][1] <= a) i++;
    return i < x->n_ranges && x->ranges[i][0] < b;
}

/* Inserts [a, b) into the sorted disjoint list; 0 when it overlaps one. */
static int claim(tensor *x, size_t a, size_t b)
{
    int i = 0;
    while (i < x->n_ranges && x->ranges[i][1] <= a) i++;
    if (i < x->n_ranges && x->ranges[i][0] < b) return 0;
    if (x->n_ranges == x->cap_ranges) {
        int cap = x->cap_ranges ? 2 * x->cap_ranges : 8;
        size_t (*r)[2] = realloc(x->ranges, sizeof *r * (size_t)cap);
        if (!r) return -1;
        x->ranges = r;
        x->cap_ranges = cap;
    }
    memmove(&x->ranges[i + 1], &x->ranges[i], sizeof x->ranges[0] * (size_t)(x->n_ranges - i));
    x->ranges[i][0] = a;
    x->ranges[i][1] = b;
    x->n_ranges++;
    return 1;
}

fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes)
{
    if (!u || !name || !shape || (n_bytes && !bytes))
        return fr_fail(FR_EINVAL, "fr_weight_update_put: NULL argument");
    if (dtype != FR_DTYPE_F32 && dtype != FR_DTYPE_BF16 && dtype != FR_DTYPE_F16)
        return fr_fail(FR_EINVAL, "%s: unknown dtype %d", name, (int)dtype);
    if (u->spent) return fr_fail(FR_EINVAL, "%s: the update to version %llu was committed already", name,
                                 (unsigned long long)u->version);
    tensor *x = find(u, name);
    if (!x) return fr_fail(FR_EINVAL, "unknown tensor '%s' (not a weight of this model)", name);
    if (ndim != x->ndim || shape[0] != x->shape[0] || (ndim == 2 && shape[1] != x->shape[1])) {
        char want[64], got[64];
        snprintf(want, sizeof want, x->ndim == 2 ? "[%lld, %lld]" : "[%lld]", (long long)x->shape[0],
                 (long long)x->shape[1]);
        if (ndim == 1) snprintf(got, sizeof got, "[%lld]", (long long)shape[0]);
        else if (ndim == 2) snprintf(got, sizeof got, "[%lld, %lld]", (long long)shape[0], (long long)shape[1]);
        else snprintf(got, sizeof got, "%d dimensions", ndim);
        return fr_fail(FR_EINVAL, "%s: shape %s, the model's is %s", name, got, want);
    }
    if (x->have_dtype && dtype != x->dtype)
        return fr_fail(FR_EINVAL, "%s: piece in %s after pieces in %s", name, fr_dtype_file_name(dtype), fr_dtype_file_name(x->dtype));
    const size_t es = fr_dtype_size(dtype);
    if (offset % es || n_bytes % es)
        return fr_fail(FR_EINVAL, "%s: offset %llu and length %zu must be multiples of the %s size %zu", name,
                       (unsigned long long)offset, n_bytes, fr_dtype_file_name(dtype), es);
    const size_t a = (size_t)(offset / es), n = n_bytes / es;
    if (offset / es > x->count || n > x->count - a)
        return fr_fail(FR_EINVAL, "%s: bytes [%llu, %llu) run past the tensor's %zu bytes", name,
                       (unsigned long long)offset, (unsigned long long)offset + n_bytes, x->count * es);
    if (n == 0) return FR_OK;
    if (overlaps(x, a, a + n))
        return fr_fail(FR_EINVAL, "%s: bytes [%llu, %llu) overlap bytes already received", name,
                       (unsigned long long)offset, (unsigned long long)offset + n_bytes);
    /* Straight into the staging copy: the range holds nothing received yet,
     * so a piece refused halfway leaves the staged tensor as it was (its
     * unreceived bytes are not part of it). */
    fr_status st;
    const long long bad = convert_checked(name, dtype, bytes, n, x->dst + a, &st);
    if (st) return st;
    if (bad >= 0)
        return fr_fail(FR_EFORMAT, "%s: element %zu is %s", name, a + (size_t)bad,
                       isnan(x->dst[a + (size_t)bad]) ? "NaN" : "infinite");
    if (claim(x, a, a + n) < 0) return fr_fail(FR_ENOMEM, "weight update: out of memory");
    x->received += n;
    x->dtype = dtype;
    x->have_dtype = 1;
    return FR_OK;
}

fr_status fr_weight_update_complete(const fr_weight_update *u)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_complete: NULL update");
    if (u->spent)
        return fr_fail(FR_EINVAL, "the update to version %llu was committed already", (unsigned long long)u->version);
    for (int i = 0; i < u->n; i++)
        if (u->t[i].received != u->t[i].count)
            return fr_fail(FR_EINVAL, "incomplete update to version %llu: %s has %zu of %zu elements",
                           (unsigned long long)u->version, u->t[i].name, u->t[i].received, u->t[i].count);
    return FR_OK;
}

int fr_weight_update_tensor_count(const fr_weight_update *u) { return u ? u->n : 0; }

fr_status fr_weight_update_tensor(const fr_weight_update *u, int i, const char **name, int *ndim, int64_t shape[2])
{
    if (!u || i < 0 || i >= u->n) return fr_fail(FR_EINVAL, "weight update: no tensor %d", i);
    *name = u->t[i].name;
    *ndim = u->t[i].ndim;
    shape[0] = u->t[i].shape[0];
    shape[1] = u->t[i].shape[1];
    return FR_OK;
}

const fr_model *fr_weight_update_model(const fr_weight_update *u) { return u ? u->staged : NULL; }

static fr_status weights_changed(fr_session *s);

fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights: NULL argument");
    fr_status st = fr_weight_update_complete(u);
    if (st) return st;
    const fr_model_config *a = &s->model->cfg, *b = &u->staged->cfg;
    if (a->num_layers != b->num_layers || a->hidden_size != b->hidden_size || a->vocab_size != b->vocab_size ||
        a->num_heads != b->num_heads || a->num_kv_heads != b->num_kv_heads || a->head_dim != b->head_dim ||
        a->intermediate_size != b->intermediate_size || a->tie_word_embeddings != b->tie_word_embeddings)
        return fr_fail(FR_EINVAL, "the update was staged for another model shape");
#ifdef FR_HAVE_CUDA
    if (s->backend == FR_BACKEND_CUDA) return fr_weights_gpu_refill(s->gpu_weights, u->staged);
#endif
    size_t n_dst = 0, n_src = 0;
    float *dst = fr_model_data(s->model, &n_dst), *src = fr_model_data(u->staged, &n_src);
    if (!dst || n_dst != n_src) return fr_fail(FR_EINTERNAL, "the session's host weights do not match the update");
    memcpy(dst, src, sizeof(float) * n_dst);
    return weights_changed(s);
}

fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights_move: NULL argument");
#ifdef FR_HAVE_CUDA
    if (s->backend == FR_BACKEND_CUDA) {
        fr_status st = fr_session_commit_weights(s, u);
        if (!st) u->spent = 1;
        return st;
    }
#endif
    fr_status st = fr_weight_update_complete(u);
    if (st) return st;
    /* The session's model keeps its address (runners and shadows hold it);
     * its weight pointers and block move. */
    if ((st = fr_model_swap_weights(s->model, u->staged))) return st;
    u->spent = 1;
    return weights_changed(s);
}

/* After the host weights changed: a tensor-parallel rank's row-parallel
 * slices are copies, cut again. */
static fr_status weights_changed(fr_session *s)
{
    fr_status st = fr_runner_cpu_weights_changed(s->runner);
    if (st)
        return fr_fail(st, "the new weights are in, but this rank's tensor-parallel shard could not be cut again "
                           "(%s): its o_proj and down_proj are the old version's",
                       fr_last_error());
    return FR_OK;
}
