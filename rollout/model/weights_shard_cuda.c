/* Tensor-parallel shards of device weights (fr_weights_gpu_shard of
 * rollout/model/weights_cuda.h), cut on the device from the whole model with
 * the layout of rollout/model/tp_shard.h: each tensor of the shard's table
 * copies its part of the whole model's (fr_weights_gpu_copy_tensor), the
 * same copy a weight commit makes into a shard. */
#include <stdlib.h>

#include <cuda_runtime.h>

#include "rollout/model/tp_shard.h"
#include "rollout/model/weights_cuda.h"

fr_status fr_weights_gpu_shard(const fr_weights_gpu *full, int rank, int size, fr_weights_gpu **out)
{
    if (!full || !out) return fr_fail(FR_EINVAL, "fr_weights_gpu_shard: NULL argument");
    *out = NULL;
    if (full->tp_size > 1) return fr_fail(FR_EINVAL, "GPU weights: already a shard");
    fr_tp_layout l;
    fr_status st = fr_tp_layout_of(&full->cfg, rank, size, &l);
    if (st) return st;
    fr_model_config lc;
    fr_tp_local_config(&full->cfg, &l, &lc);
    if ((st = fr_weights_gpu_alloc(&lc, full->cfg.vocab_size, out))) return st;
    fr_weights_gpu *w = *out;
    w->tp_rank = rank;
    w->tp_size = size;
    if (full->cfg.tie_word_embeddings) w->lm_head = w->embed + (size_t)l.vocab0 * (size_t)full->cfg.hidden_size;
    fr_weights_gpu_tensor *src = NULL, *dst = NULL;
    int n_src = 0, n_dst = 0;
    st = fr_weights_gpu_tensors(full, NULL, &src, &n_src);
    if (!st) st = fr_weights_gpu_tensors(w, &full->cfg, &dst, &n_dst);
    if (!st && n_src != n_dst) st = fr_fail(FR_EINTERNAL, "GPU weights: the shard lists %d tensors, the model %d", n_dst, n_src);
    for (int i = 0; i < n_dst && !st; i++) st = fr_weights_gpu_copy_tensor(&dst[i], &src[i], NULL);
    if (!st) {
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess)
            st = fr_fail(FR_EINTERNAL, "GPU weights: copying rank %d's shard failed: %s", rank, cudaGetErrorString(e));
    }
    free(src);
    free(dst);
    if (st) fr_weights_gpu_destroy(out);
    return st;
}
