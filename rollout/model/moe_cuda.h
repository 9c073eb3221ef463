/* moe_cuda: the routed-expert MLP of a Qwen3-MoE or DeepSeek layer on the
 * GPU, the same arithmetic as rollout/model/moe_cpu.h at BF16 weight
 * precision (DeepSeek's shared experts run as a dense MLP in the runner).
 *
 * One layer is six launches, all of fixed shape for a given token count, so a
 * decode step stays one CUDA graph:
 *   router   logits[M][E] = xn . router^T (cuBLASLt, FP32 out);
 *   route    one warp per token: FP32 softmax or sigmoid scores, the router
 *            bias added for the choice under noaux_tc, the groups not kept
 *            masked to 0.0 (group_limited_greedy, noaux_tc), top-k of the
 *            choices (ties to the lower expert, and group), the unbiased
 *            scores as weights, renormalized when norm_topk_prob, times
 *            routed_scaling_factor; each layer's choices kept until the next
 *            step (routed-expert replay reads them);
 *   group    one block: the token-expert pairs counted per expert and given
 *            slots, expert by expert (offsets[E + 1] on the device);
 *   gate|up  grid (Im / 32, E): a block reads 32 gate and 32 up rows of its
 *            expert once for all of the expert's tokens (tensor-core MMAs with
 *            the tokens as the narrow dimension), SwiGLU in registers, BF16 h;
 *   down     grid (hidden / 64, E): the same for down_proj, FP32 out per slot;
 *   combine  one block per token: its experts' outputs times their weights,
 *            added in increasing expert index as transformers does, into y.
 * An expert no token chose costs one block that exits at once; the weights
 * read are those of the experts the step selected. A token's numbers depend
 * on its own row only, never on the slots its pairs were given. */
#ifndef FR_MOE_CUDA_H
#define FR_MOE_CUDA_H

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/model_config.h"
#include "rollout/model/weights_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_moe_gpu fr_moe_gpu;

/* Device scratch for steps of up to max_tokens rows of a model with config c
 * (the local config of a tensor-parallel shard). FR_EUNSUPPORTED when the
 * shape is outside what the kernels take: at most 256 experts in at most 32
 * groups and top-16, hidden a multiple of 64, the expert intermediate size a
 * multiple of 32. */
fr_status fr_moe_gpu_new(const fr_model_config *c, int max_tokens, fr_moe_gpu **out);
void fr_moe_gpu_destroy(fr_moe_gpu **s);

/* y[M][hidden] (FP32) = the MoE block of lw on xn (BF16 [M][hidden]), added
 * to y when accumulate (the residual stream), else written. Asynchronous on
 * stream. */
fr_status fr_moe_gpu_forward(fr_moe_gpu *s, fr_gemm *g, const fr_layer_weights_gpu *lw, int layer, const uint16_t *xn,
                             int M, float *y, int accumulate, cudaStream_t stream);

/* Per layer, how many experts at least one token chose in the last forward
 * of that layer: per_layer[num_layers], copied to the host (synchronizes the
 * stream). What a step's expert weight traffic is made of (benchmarks). */
fr_status fr_moe_gpu_active(const fr_moe_gpu *s, int *per_layer, cudaStream_t stream);

/* How many token-expert pairs each expert received in the last forward (of
 * the last layer run):
 * counts[E], copied to the host (synchronizes the stream). For benchmarks. */
fr_status fr_moe_gpu_counts(const fr_moe_gpu *s, int *counts, cudaStream_t stream);

/* Routed-expert replay: out[i][m][k] = the experts MoE layer m (in layer
 * order) chose for token row rows[i] of the last step, best first, copied
 * to the host (synchronizes the stream). Nothing of the forward pass
 * changes for it: the choices are kept per layer anyway. */
fr_status fr_moe_gpu_routes(fr_moe_gpu *s, const int *rows, int n, uint16_t *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
