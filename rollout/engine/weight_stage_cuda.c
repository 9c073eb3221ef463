/* The device stage of weight updates (rollout/engine/weight_stage.h): a
 * BF16 copy of the whole model in device memory, in the layout of
 * rollout/model/weights_cuda.h.
 *
 * A piece in BF16 (what trainers send) is copied from the sender's bytes
 * straight to its place in the stage and checked there; F32 and F16 pieces
 * go through a device bounce buffer and are rounded to BF16 on the way in
 * (rollout/model/weights_unpack.h: one conversion for every transport). The
 * commit copies device to device into the serving weights, in place, so
 * captured CUDA graphs stay valid: one copy of the block when every tensor
 * came and the layouts agree, else tensor by tensor, a tensor-parallel rank
 * taking its part of each (fr_weights_gpu_copy_tensor). */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "rollout/engine/weight_stage.h"
#include "rollout/model/weights_cuda.h"
#include "rollout/model/weights_unpack.h"

enum { BOUNCE_BYTES = 64 << 20 };

typedef struct {
    fr_weight_stage base;
    fr_weights_gpu *buf;              /* the stage: whole model */
    fr_weights_gpu_tensor *tab, *live;
    int n;
    const fr_weights_gpu *live_w;     /* the serving weights the live table points into */
    uint16_t **dst;                   /* tab[i].dst, for base.dev_dst */
    cudaStream_t stream;
    void *bounce;                     /* F32 and F16 pieces on their way to BF16 */
    unsigned long long *dbad, *hbad;  /* the first bad element: device, pinned host */
} dev_stage;

static fr_status cuda_fail(cudaError_t e, const char *what)
{
    return fr_fail(e == cudaErrorMemoryAllocation ? FR_ENOMEM : FR_EINTERNAL, "weight staging on the device: %s "
                   "failed: %s", what, cudaGetErrorString(e));
}

/* Converts (or checks in place) n values at src on the device into dst,
 * then waits: FR_EFORMAT with *bad at the first non-finite one. */
static fr_status unpack(dev_stage *d, const void *src, fr_dtype dtype, size_t n, uint16_t *dst, size_t *bad)
{
    cudaError_t e = cudaMemsetAsync(d->dbad, 0xff, sizeof *d->dbad, d->stream);
    if (e != cudaSuccess) return cuda_fail(e, "clearing the bad-value flag");
    fr_status st = fr_weights_unpack_launch(src, (int)dtype, n, dst, d->dbad, 0, d->stream);
    if (st) return st;
    if ((e = cudaMemcpyAsync(d->hbad, d->dbad, sizeof *d->hbad, cudaMemcpyDeviceToHost, d->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(d->stream)) != cudaSuccess)
        return cuda_fail(e, "checking staged values");
    if (*d->hbad == ~0ull) return FR_OK;
    *bad = (size_t)(*d->hbad & ((1ull << 40) - 1));
    return FR_EFORMAT;
}

static fr_status put(fr_weight_stage *st, int i, fr_dtype dtype, size_t first, const void *bytes, size_t n,
                     size_t *bad)
{
    dev_stage *d = (dev_stage *)st;
    if (st->shard)
        return fr_fail(FR_EINVAL, "weight staging: %s: a shard stage takes no whole-tensor ranges (its writer cuts "
                       "the rank's part)", d->tab[i].name);
    uint16_t *dst = d->tab[i].dst + first;
    cudaError_t e;
    if (dtype == FR_DTYPE_BF16) {
        if ((e = cudaMemcpyAsync(dst, bytes, 2 * n, cudaMemcpyHostToDevice, d->stream)) != cudaSuccess)
            return cuda_fail(e, "copying a piece to the device");
        return unpack(d, dst, dtype, n, dst, bad);
    }
    const size_t es = fr_dtype_size(dtype), per = BOUNCE_BYTES / es;
    for (size_t at = 0; at < n; at += per) {
        const size_t m = n - at < per ? n - at : per;
        if ((e = cudaMemcpyAsync(d->bounce, (const char *)bytes + at * es, m * es, cudaMemcpyHostToDevice,
                                 d->stream)) != cudaSuccess)
            return cuda_fail(e, "copying a piece to the device");
        fr_status s = unpack(d, d->bounce, dtype, m, dst + at, bad);
        if (s == FR_EFORMAT) *bad += at;
        if (s) return s;
    }
    return FR_OK;
}

static fr_status commit(fr_weight_stage *st, fr_session *s, const unsigned char *touched, int all, int move)
{
    (void)move;   /* the stage stays the stage: its block is not the serving layout of a shard */
    dev_stage *d = (dev_stage *)st;
    if (s->backend != FR_BACKEND_CUDA || s->gpu_weights != d->live_w)
        return fr_fail(FR_EINVAL, "the update was staged for another session's device weights");
    /* The engine is between steps; its streams may still be finishing the
     * last one's work, which reads the weights about to change. */
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return cuda_fail(e, "waiting for the engine before the commit");
    fr_status r = FR_OK;
    if (all && (d->live_w->tp_size <= 1 || st->shard) && d->live_w->bytes == d->buf->bytes) {
        e = cudaMemcpyAsync(d->live_w->block_, d->buf->block_, d->buf->bytes, cudaMemcpyDeviceToDevice, d->stream);
        if (e != cudaSuccess) r = cuda_fail(e, "copying the staged weights in");
    } else if (st->shard) {
        /* part to part: the stage and the serving weights share the shard's layout */
        for (int i = 0; i < d->n && !r; i++) {
            if (!touched[i]) continue;
            const size_t bytes = (size_t)d->tab[i].shape[0] * (size_t)d->tab[i].shape[1] * sizeof(uint16_t);
            e = cudaMemcpyAsync(d->live[i].dst, d->tab[i].dst, bytes, cudaMemcpyDeviceToDevice, d->stream);
            if (e != cudaSuccess) r = cuda_fail(e, "copying a staged tensor in");
        }
    } else {
        for (int i = 0; i < d->n && !r; i++)
            if (touched[i]) r = fr_weights_gpu_copy_tensor(&d->live[i], &d->tab[i], d->stream);
    }
    e = cudaStreamSynchronize(d->stream);
    if (!r && e != cudaSuccess) r = cuda_fail(e, "copying the staged weights in");
    if (r)
        return fr_fail(r, "%s; the device weights are now undefined", fr_last_error());
    return FR_OK;
}

static fr_status restart(fr_weight_stage *st)
{
    (void)st;
    return FR_OK;
}

static void destroy(fr_weight_stage *st)
{
    dev_stage *d = (dev_stage *)st;
    if (d->stream) cudaStreamSynchronize(d->stream);
    fr_weights_gpu_destroy(&d->buf);
    free(d->tab);
    free(d->live);
    free(d->dst);
    if (d->bounce) cudaFree(d->bounce);
    if (d->dbad) cudaFree(d->dbad);
    if (d->hbad) cudaFreeHost(d->hbad);
    if (d->stream) cudaStreamDestroy(d->stream);
    free(d);
}

static const fr_weight_stage_ops dev_ops = {put, commit, restart, destroy};

/* The stage's table and the serving weights' name the same tensors in the
 * same order (that of rollout/model/tensor_table.h). */
static fr_status tables(dev_stage *d, const fr_session *s)
{
    int n_live = 0;
    fr_status st = fr_weights_gpu_tensors(d->buf, d->base.shard ? &s->model->cfg : NULL, &d->tab, &d->n);
    if (!st) st = fr_weights_gpu_tensors(s->gpu_weights, &s->model->cfg, &d->live, &n_live);
    if (st) return st;
    if (n_live != d->n)
        return fr_fail(FR_EINTERNAL, "weight staging: the serving weights list %d tensors, the stage %d", n_live, d->n);
    for (int i = 0; i < d->n; i++)
        if (strcmp(d->tab[i].name, d->live[i].name) != 0)
            return fr_fail(FR_EINTERNAL, "weight staging: tensor %d is %s in the stage, %s in the serving weights", i,
                           d->tab[i].name, d->live[i].name);
    if (d->n < 1 || !(d->dst = calloc((size_t)d->n, sizeof *d->dst))) return fr_fail(FR_ENOMEM, "weight staging: out of memory");
    for (int i = 0; i < d->n; i++) d->dst[i] = d->tab[i].dst;
    d->base.dev_dst = d->dst;
    return FR_OK;
}

/* A whole-model stage, or (shard) one of the layout of s's serving shard. */
static fr_status stage_new(const fr_session *s, int shard, fr_weight_stage **out)
{
    *out = NULL;
    if (!s || s->backend != FR_BACKEND_CUDA || !s->gpu_weights || !s->model)
        return fr_fail(FR_EINVAL, "weight staging on the device needs a session on the cuda backend");
    dev_stage *d = calloc(1, sizeof *d);
    if (!d) return fr_fail(FR_ENOMEM, "weight staging: out of memory");
    d->base.ops = &dev_ops;
    d->base.on_device = 1;
    d->base.shard = shard && s->gpu_weights->tp_size > 1;
    d->live_w = s->gpu_weights;
    const fr_weights_gpu *lw = s->gpu_weights;
    fr_status st = d->base.shard ? fr_weights_gpu_alloc(&lw->cfg, lw->vocab_full, &d->buf)
                                 : fr_weights_gpu_alloc(&s->model->cfg, s->model->cfg.vocab_size, &d->buf);
    if (!st && d->base.shard) {
        d->buf->tp_rank = lw->tp_rank;
        d->buf->tp_size = lw->tp_size;
    }
    if (!st) st = tables(d, s);
    cudaError_t e = cudaSuccess;
    if (!st && ((e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking)) != cudaSuccess ||
                (e = cudaMalloc(&d->bounce, BOUNCE_BYTES)) != cudaSuccess ||
                (e = cudaMalloc((void **)&d->dbad, sizeof *d->dbad)) != cudaSuccess ||
                (e = cudaMallocHost((void **)&d->hbad, sizeof *d->hbad)) != cudaSuccess))
        st = cuda_fail(e, "allocating the stage");
    if (st) {
        destroy(&d->base);
        return st;
    }
    *out = &d->base;
    return FR_OK;
}

fr_status fr_weight_stage_device_new(const fr_session *s, fr_weight_stage **out) { return stage_new(s, 0, out); }

fr_status fr_weight_stage_device_shard_new(const fr_session *s, fr_weight_stage **out)
{
    return stage_new(s, 1, out);
}
