/* Weight updates (rollout/engine/weight_update.h): the bookkeeping of what
 * arrived, over a stage that holds the values (weight_stage.h). */
#include "rollout/engine/weight_update.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/weight_stage.h"
#include "rollout/model/tensor_table.h"
#include "rollout/model/weights_cuda.h"

enum { NAME_CAP = FR_TENSOR_NAME_CAP };

/* One tensor of the model: its shape, and which of its bytes (in the
 * sender's dtype) have arrived. */
typedef struct {
    char name[NAME_CAP];
    int ndim;
    int64_t shape[2];
    size_t count;                 /* elements */
    fr_dtype dtype;               /* fixed by the first piece */
    int have_dtype;
    size_t received;              /* elements received */
    /* received element ranges, kept sorted and disjoint */
    size_t (*ranges)[2];
    int n_ranges, cap_ranges;
} tensor;

struct fr_weight_update {
    fr_weight_stage *stage;
    int spent;           /* committed by move: the stage holds the previous weights */
    int partial;         /* tensors never sent keep their serving values */
    uint64_t version;
    tensor *t;
    int n;
    unsigned char *touched;   /* commit scratch: tensors with bytes received */
};

fr_status fr_weight_dtype_parse(const char *s, fr_dtype *out)
{
    fr_dtype t;
    if (!s || !fr_dtype_from_file_name(s, strlen(s), &t) || !fr_dtype_is_weight(t))
        return fr_fail(FR_EINVAL, "weight dtype '%s' (expected F32, BF16 or F16)", s ? s : "(null)");
    *out = t;
    return FR_OK;
}

static fr_status add_tensor(void *user, const fr_model_tensor *m)
{
    fr_weight_update *u = user;
    tensor *x = &u->t[u->n++];
    snprintf(x->name, sizeof x->name, "%s", m->name);
    x->ndim = m->ndim;
    x->shape[0] = m->rows;
    x->shape[1] = m->ndim == 2 ? m->cols : 1;
    x->count = (size_t)x->shape[0] * (size_t)x->shape[1];
    return FR_OK;
}

/* The bookkeeping for cfg's tensors around a stage made by the caller. */
static fr_status begin(const fr_model_config *cfg, uint64_t version, fr_weight_stage *stage, fr_weight_update **out)
{
    fr_weight_update *u = calloc(1, sizeof *u);
    const size_t n = fr_model_tensor_count(cfg);
    if (u) u->stage = stage;
    if (!u || !(u->t = calloc(n, sizeof *u->t)) || !(u->touched = calloc(n, 1))) {
        if (u) fr_weight_update_free(&u);
        else stage->ops->destroy(stage);
        return fr_fail(FR_ENOMEM, "weight update: out of memory");
    }
    const fr_weights none = {0};
    fr_model_tensors_each(cfg, &none, add_tensor, u);
    u->version = version;
    *out = u;
    return FR_OK;
}

fr_status fr_weight_update_begin(const fr_model_config *cfg, uint64_t version, fr_weight_update **out)
{
    if (!cfg || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin: NULL argument");
    *out = NULL;
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_host_new(cfg, &stage);
    return st ? st : begin(cfg, version, stage, out);
}

fr_status fr_weight_update_begin_for(const fr_session *s, uint64_t version, fr_weight_update **out)
{
    if (!s || !s->model || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin_for: NULL argument");
    *out = NULL;
    if (s->backend != FR_BACKEND_CUDA) return fr_weight_update_begin(&s->model->cfg, version, out);
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_device_new(s, &stage);
    return st ? st : begin(&s->model->cfg, version, stage, out);
}

fr_status fr_weight_update_begin_shard_for(const fr_session *s, uint64_t version, fr_weight_update **out)
{
    if (!s || !s->model || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin_shard_for: NULL argument");
    *out = NULL;
    if (s->backend != FR_BACKEND_CUDA || !s->gpu_weights || s->gpu_weights->tp_size <= 1)
        return fr_weight_update_begin_for(s, version, out);
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_device_shard_new(s, &stage);
    return st ? st : begin(&s->model->cfg, version, stage, out);
}

int fr_weight_update_is_shard(const fr_weight_update *u) { return u && u->stage->shard; }

fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_restart: NULL update");
    for (int i = 0; i < u->n; i++) {
        u->t[i].n_ranges = 0;
        u->t[i].received = 0;
        u->t[i].have_dtype = 0;
    }
    fr_status st = u->stage->ops->restart(u->stage);
    if (st) return st;
    u->version = version;
    u->spent = 0;
    u->partial = 0;
    return FR_OK;
}

fr_status fr_weight_update_set_partial(fr_weight_update *u, int partial)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_set_partial: NULL update");
    u->partial = partial != 0;
    return FR_OK;
}

int fr_weight_update_is_partial(const fr_weight_update *u) { return u && u->partial; }
int fr_weight_update_on_device(const fr_weight_update *u) { return u && u->stage->on_device; }

void fr_weight_update_free(fr_weight_update **pu)
{
    fr_weight_update *u = pu ? *pu : NULL;
    if (!u) return;
    for (int i = 0; u->t && i < u->n; i++) free(u->t[i].ranges);
    free(u->t);
    free(u->touched);
    if (u->stage) u->stage->ops->destroy(u->stage);
    free(u);
    *pu = NULL;
}

uint64_t fr_weight_update_version(const fr_weight_update *u) { return u ? u->version : 0; }

int fr_weight_update_find(const fr_weight_update *u, const char *name)
{
    for (int i = 0; u && name && i < u->n; i++)
        if (strcmp(u->t[i].name, name) == 0) return i;
    return -1;
}

/* Whether [a, b) overlaps a range of x already received. */
static int overlaps(const tensor *x, size_t a, size_t b)
{
    int i = 0;
    while (i < x->n_ranges && x->ranges[i][1] <= a) i++;
    return i < x->n_ranges && x->ranges[i][0] < b;
}

/* Inserts [a, b), which overlaps no range, into the sorted disjoint list. */
static fr_status claim(tensor *x, size_t a, size_t b)
{
    int i = 0;
    while (i < x->n_ranges && x->ranges[i][1] <= a) i++;
    if (x->n_ranges == x->cap_ranges) {
        int cap = x->cap_ranges ? 2 * x->cap_ranges : 8;
        size_t (*r)[2] = realloc(x->ranges, sizeof *r * (size_t)cap);
        if (!r) return fr_fail(FR_ENOMEM, "weight update: out of memory");
        x->ranges = r;
        x->cap_ranges = cap;
    }
    memmove(&x->ranges[i + 1], &x->ranges[i], sizeof x->ranges[0] * (size_t)(x->n_ranges - i));
    x->ranges[i][0] = a;
    x->ranges[i][1] = b;
    x->n_ranges++;
    return FR_OK;
}

/* The checks every piece passes, whoever stores its values: the update
 * usable, dtype, element alignment, inside the tensor, no byte twice. On
 * success *first and *n are its element range. */
static fr_status check_range(const fr_weight_update *u, const tensor *x, fr_dtype dtype, uint64_t offset,
                             size_t n_bytes, size_t *first, size_t *n)
{
    if (dtype != FR_DTYPE_F32 && dtype != FR_DTYPE_BF16 && dtype != FR_DTYPE_F16)
        return fr_fail(FR_EINVAL, "%s: unknown dtype %d", x->name, (int)dtype);
    if (u->spent) return fr_fail(FR_EINVAL, "%s: the update to version %llu was committed already", x->name,
                                 (unsigned long long)u->version);
    if (x->have_dtype && dtype != x->dtype)
        return fr_fail(FR_EINVAL, "%s: piece in %s after pieces in %s", x->name, fr_dtype_file_name(dtype),
                       fr_dtype_file_name(x->dtype));
    const size_t es = fr_dtype_size(dtype);
    if (offset % es || n_bytes % es)
        return fr_fail(FR_EINVAL, "%s: offset %llu and length %zu must be multiples of the %s size %zu", x->name,
                       (unsigned long long)offset, n_bytes, fr_dtype_file_name(dtype), es);
    *first = (size_t)(offset / es);
    *n = n_bytes / es;
    if (offset / es > x->count || *n > x->count - *first)
        return fr_fail(FR_EINVAL, "%s: bytes [%llu, %llu) run past the tensor's %zu bytes", x->name,
                       (unsigned long long)offset, (unsigned long long)offset + n_bytes, x->count * es);
    if (*n && overlaps(x, *first, *first + *n))
        return fr_fail(FR_EINVAL, "%s: bytes [%llu, %llu) overlap bytes already received", x->name,
                       (unsigned long long)offset, (unsigned long long)offset + n_bytes);
    return FR_OK;
}

static fr_status received(tensor *x, fr_dtype dtype, size_t first, size_t n)
{
    fr_status st = claim(x, first, first + n);
    if (st) return st;
    x->received += n;
    x->dtype = dtype;
    x->have_dtype = 1;
    return FR_OK;
}

static fr_status check_shape(const tensor *x, const int64_t *shape, int ndim)
{
    if (ndim == x->ndim && shape[0] == x->shape[0] && (ndim != 2 || shape[1] == x->shape[1])) return FR_OK;
    char want[64], got[64];
    snprintf(want, sizeof want, x->ndim == 2 ? "[%lld, %lld]" : "[%lld]", (long long)x->shape[0],
             (long long)x->shape[1]);
    if (ndim == 1) snprintf(got, sizeof got, "[%lld]", (long long)shape[0]);
    else if (ndim == 2) snprintf(got, sizeof got, "[%lld, %lld]", (long long)shape[0], (long long)shape[1]);
    else snprintf(got, sizeof got, "%d dimensions", ndim);
    return fr_fail(FR_EINVAL, "%s: shape %s, the model's is %s", x->name, got, want);
}

/* Whether the element at p (little-endian) is a NaN: all-ones exponent,
 * nonzero mantissa. */
static int is_nan(fr_dtype t, const unsigned char *p)
{
    uint32_t v = 0;
    memcpy(&v, p, fr_dtype_size(t));
    if (t == FR_DTYPE_F32) return (v & 0x7f800000u) == 0x7f800000u && (v & 0x7fffffu);
    if (t == FR_DTYPE_BF16) return (v & 0x7f80u) == 0x7f80u && (v & 0x7fu);
    return (v & 0x7c00u) == 0x7c00u && (v & 0x3ffu);
}

fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes)
{
    if (!u || !name || !shape || (n_bytes && !bytes))
        return fr_fail(FR_EINVAL, "fr_weight_update_put: NULL argument");
    const int i = fr_weight_update_find(u, name);
    if (i < 0) return fr_fail(FR_EINVAL, "unknown tensor '%s' (not a weight of this model)", name);
    tensor *x = &u->t[i];
    size_t first, n, bad = 0;
    fr_status st = check_shape(x, shape, ndim);
    if (!st) st = check_range(u, x, dtype, offset, n_bytes, &first, &n);
    if (st || n == 0) return st;
    /* Straight into the stage: the range holds nothing received yet, so a
     * piece refused halfway leaves the staged tensor as it was (its
     * unreceived bytes are not part of it). */
    st = u->stage->ops->put(u->stage, i, dtype, first, bytes, n, &bad);
    if (st == FR_EFORMAT)
        return fr_fail(FR_EFORMAT, "%s: element %zu is %s", x->name, first + bad,
                       is_nan(dtype, (const unsigned char *)bytes + bad * fr_dtype_size(dtype))
                           ? "NaN" : "infinite (or rounds to infinity in BF16)");
    return st ? st : received(x, dtype, first, n);
}

uint16_t *fr_weight_update_device_dst(fr_weight_update *u, int i)
{
    if (!u || !u->stage->on_device || i < 0 || i >= u->n || u->spent) return NULL;
    return u->stage->dev_dst[i];
}

fr_status fr_weight_update_mark(fr_weight_update *u, int i, fr_dtype dtype, uint64_t offset, uint64_t n_bytes)
{
    if (!u || i < 0 || i >= u->n) return fr_fail(FR_EINVAL, "fr_weight_update_mark: bad argument");
    size_t first, n;
    fr_status st = check_range(u, &u->t[i], dtype, offset, (size_t)n_bytes, &first, &n);
    if (st || n == 0) return st;
    return received(&u->t[i], dtype, first, n);
}

fr_status fr_weight_update_complete(const fr_weight_update *u)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_complete: NULL update");
    if (u->spent)
        return fr_fail(FR_EINVAL, "the update to version %llu was committed already", (unsigned long long)u->version);
    int any = 0;
    for (int i = 0; i < u->n; i++) {
        const tensor *x = &u->t[i];
        any |= x->received > 0;
        if (x->received != x->count && (!u->partial || x->received))
            return fr_fail(FR_EINVAL, "incomplete update to version %llu: %s has %zu of %zu elements",
                           (unsigned long long)u->version, x->name, x->received, x->count);
    }
    if (!any) return fr_fail(FR_EINVAL, "update to version %llu: no tensor arrived", (unsigned long long)u->version);
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

const fr_model *fr_weight_update_model(const fr_weight_update *u) { return u ? u->stage->host : NULL; }

typedef struct {
    const fr_weight_update *u;
    int i;
} same_shape;

/* Whether the session's next tensor is the update's, name and shape. */
static fr_status compare(void *user, const fr_model_tensor *m)
{
    same_shape *k = user;
    const tensor *x = &k->u->t[k->i++];
    if (strcmp(x->name, m->name) != 0 || x->ndim != m->ndim || x->shape[0] != m->rows ||
        (m->ndim == 2 && x->shape[1] != m->cols))
        return FR_EINVAL;
    return FR_OK;
}

static fr_status commit(fr_session *s, fr_weight_update *u, int move)
{
    fr_status st = fr_weight_update_complete(u);
    if (st) return st;
    same_shape k = {u, 0};
    const fr_weights none = {0};
    if ((size_t)u->n != fr_model_tensor_count(&s->model->cfg) ||
        fr_model_tensors_each(&s->model->cfg, &none, compare, &k))
        return fr_fail(FR_EINVAL, "the update was staged for another model shape");
    int all = 1;
    for (int i = 0; i < u->n; i++) all &= (u->touched[i] = u->t[i].received > 0);
    return u->stage->ops->commit(u->stage, s, u->touched, all, move);
}

fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights: NULL argument");
    return commit(s, (fr_weight_update *)u, 0);
}

fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights_move: NULL argument");
    fr_status st = commit(s, u, 1);
    if (!st) u->spent = 1;
    return st;
}
