/* The host stage of weight updates (rollout/engine/weight_stage.h): a
 * float32 copy of the model, the CPU backend's format, filled in one
 * converting and checking pass per piece. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "rollout/engine/weight_stage.h"
#include "rollout/model/runner.h"
#include "rollout/model/tensor_table.h"

typedef struct {
    fr_weight_stage base;
    fr_model *staged;
    fr_model_tensor *t;   /* the staged model's tensors (their data pointers) */
    size_t n;
} host_stage;

/* Converts n elements of dtype t (little-endian bytes, as safetensors stores
 * them) to float32 at out, in one pass that also looks for NaN and infinity
 * (an all-ones exponent field). Returns the index of the first non-finite
 * element, or -1. Blocks of 4096 elements keep the inner loops free of
 * branches (so they vectorize); only a block that has one is scanned again. */
static long long convert_checked(fr_dtype t, const unsigned char *in, size_t n, float *out, fr_status *st)
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
            fr_st_tensor v = {.name = "weight", .dtype = FR_DTYPE_F16, .ndim = 1, .shape = {(int64_t)m},
                              .nbytes = 2 * m, .data = in + 2 * b};
            if ((*st = fr_st_tensor_to_f32(&v, out + b, m))) return -1;
            for (size_t i = 0; i < m; i++) bad |= !isfinite(out[b + i]);
        }
        if (bad)
            for (size_t i = 0; i < m; i++)
                if (!isfinite(out[b + i])) return (long long)(b + i);
    }
    return -1;
}

static fr_status put(fr_weight_stage *st, int i, fr_dtype dtype, size_t first, const void *bytes, size_t n,
                     size_t *bad)
{
    host_stage *h = (host_stage *)st;
    fr_status s;
    const long long k = convert_checked(dtype, bytes, n, h->t[i].data + first, &s);
    if (s) return s;
    if (k >= 0) {
        *bad = (size_t)k;
        return FR_EFORMAT;
    }
    return FR_OK;
}

/* The tensor table over the staged model's current block. */
static fr_status relist(host_stage *h)
{
    free(h->t);
    h->t = NULL;
    fr_status st = fr_model_tensor_list(&h->staged->cfg, &h->staged->w, &h->t, &h->n);
    h->base.host = h->staged;
    return st;
}

/* After the host weights changed: a tensor-parallel rank's row-parallel
 * slices are copies, cut again. */
static fr_status weights_changed(fr_session *s)
{
    fr_status st = fr_runner_weights_changed(s->runner);
    if (st)
        return fr_fail(st, "the new weights are in, but this rank's tensor-parallel shard could not be cut again "
                           "(%s): its o_proj and down_proj are the old version's",
                       fr_last_error());
    return FR_OK;
}

/* Copies the touched tensors into the session's model. */
static fr_status copy_touched(host_stage *h, fr_session *s, const unsigned char *touched)
{
    fr_model_tensor *dst = NULL;
    size_t n = 0;
    fr_status st = fr_model_tensor_list(&s->model->cfg, &s->model->w, &dst, &n);
    if (!st && n != h->n) st = fr_fail(FR_EINTERNAL, "the session's model has %zu tensors, the update %zu", n, h->n);
    for (size_t i = 0; i < n && !st; i++)
        if (touched[i]) {
            const size_t count = (size_t)dst[i].rows * (size_t)(dst[i].ndim == 2 ? dst[i].cols : 1);
            memcpy(dst[i].data, h->t[i].data, sizeof(float) * count);
        }
    free(dst);
    return st;
}

static fr_status commit(fr_weight_stage *st, fr_session *s, const unsigned char *touched, int all, int move)
{
    host_stage *h = (host_stage *)st;
    if (s->backend != FR_BACKEND_CPU || !fr_model_data(s->model, NULL))
        return fr_fail(FR_EINVAL, "the update was staged on the host, but the session serves from the %s backend's "
                                  "device weights (stage with fr_weight_update_begin_for)", fr_backend_name(s->backend));
    fr_status r;
    if (all && move) {
        /* The session's model keeps its address (runners and shadows hold
         * it); its weight pointers and block move. */
        if ((r = fr_model_swap_weights(s->model, h->staged))) return r;
        if ((r = relist(h))) return r;
    } else if (all) {
        size_t n_dst = 0, n_src = 0;
        float *dst = fr_model_data(s->model, &n_dst), *src = fr_model_data(h->staged, &n_src);
        if (n_dst != n_src) return fr_fail(FR_EINTERNAL, "the session's host weights do not match the update");
        memcpy(dst, src, sizeof(float) * n_dst);
    } else if ((r = copy_touched(h, s, touched))) {
        return r;
    }
    return weights_changed(s);
}

static fr_status restart(fr_weight_stage *st) { return relist((host_stage *)st); }

static void destroy(fr_weight_stage *st)
{
    host_stage *h = (host_stage *)st;
    free(h->t);
    fr_model_destroy(&h->staged);
    free(h);
}

static const fr_weight_stage_ops host_ops = {put, commit, restart, destroy};

fr_status fr_weight_stage_host_new(const fr_model_config *cfg, fr_weight_stage **out)
{
    *out = NULL;
    host_stage *h = calloc(1, sizeof *h);
    if (!h) return fr_fail(FR_ENOMEM, "weight update: out of memory");
    h->base.ops = &host_ops;
    fr_status st = fr_model_alloc(cfg, "weight update", &h->staged);
    if (!st) st = relist(h);
    if (st) {
        destroy(&h->base);
        return st;
    }
    *out = &h->base;
    return FR_OK;
}
