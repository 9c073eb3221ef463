/* The device weights and NCCL group of a session on the CUDA backend
 * (session_device.h). Built only with CUDA. */
#include "rollout/engine/session_device.h"

#include <string.h>

#include <cuda_runtime.h>

#include "comm/nccl_group.h"
#include "rollout/model/weights_cuda.h"

fr_status fr_session_device_free_memory(size_t *free_bytes, size_t *total_bytes)
{
    const cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e == cudaSuccess) return FR_OK;
    *free_bytes = *total_bytes = 0;
    return fr_fail(FR_EINTERNAL, "kv_memory_fraction: cannot read the device's free memory: %s",
                   cudaGetErrorString(e));
}

/* Tensor parallel: replaces *wg by this rank's shard of it. */
static fr_status shard_weights(const fr_engine_opts *o, struct fr_weights_gpu **wg)
{
    if (o->tp <= 1) return FR_OK;
    struct fr_weights_gpu *shard = NULL;
    fr_status st = fr_weights_gpu_shard(*wg, o->group->layout.tp_rank, o->tp, &shard);
    fr_weights_gpu_destroy(wg);
    *wg = shard;
    return st;
}

/* Tensor parallel on the GPU: the engine's NCCL group, which also picks this
 * rank's GPU (so it comes before any device allocation). */
static fr_status open_nccl(const fr_engine_opts *o, fr_session *s)
{
    if (o->tp <= 1) return FR_OK;
    fr_comm_status cs = fr_nccl_group_new(o->group, &s->nccl);
    return cs ? fr_fail(FR_EINTERNAL, "--tp %d on the GPU: %s", o->tp, fr_last_error()) : FR_OK;
}

static fr_status weights_for(const fr_engine_opts *o, const char *spec, fr_model **m, struct fr_weights_gpu **wg)
{
    *m = NULL;
    *wg = NULL;
    size_t plen = strlen(FR_SYNTHETIC_PREFIX);
    fr_status st;
    if (strncmp(spec, FR_SYNTHETIC_PREFIX, plen) == 0 && !fr_synthetic_host_only(spec + plen)) {
        fr_model_config cfg;
        uint64_t seed;
        if ((st = fr_synthetic_parse(spec + plen, &cfg, &seed))) return st;
        if ((st = fr_model_config_only(&cfg, spec, m))) return st;
        st = fr_weights_gpu_synthetic(&cfg, seed, wg);
    } else {   /* a checkpoint, or a synthetic model built on the host (the same bits as the CPU's) */
        if ((st = fr_model_load(spec, m))) return st;
        st = fr_weights_gpu_from_model(*m, wg);
        if (!st) fr_model_drop_weights(*m);
    }
    if (!st) st = shard_weights(o, wg);
    if (st) fr_model_destroy(m);
    return st;
}

fr_status fr_session_device_load(const fr_engine_opts *o, fr_session *s, fr_model **m)
{
    fr_status st = open_nccl(o, s);
    if (st) return st;
    if ((st = weights_for(o, o->model, m, &s->gpu_weights))) fr_session_device_release(s);
    return st;
}

fr_status fr_session_device_adopt(const fr_engine_opts *o, fr_session *s, fr_model *m)
{
    fr_status st = open_nccl(o, s);
    if (st) return st;
    if (!(st = fr_weights_gpu_from_model(m, &s->gpu_weights))) st = shard_weights(o, &s->gpu_weights);
    if (st) fr_session_device_release(s);
    return st;
}

fr_status fr_session_device_memory(fr_session *s, int release)
{
    if (!s->gpu_weights) return FR_OK;
    return release ? fr_weights_gpu_release(s->gpu_weights) : fr_weights_gpu_restore(s->gpu_weights);
}

void fr_session_device_release(fr_session *s)
{
    fr_weights_gpu_destroy(&s->gpu_weights);
    fr_nccl_group_destroy(&s->nccl);
}
