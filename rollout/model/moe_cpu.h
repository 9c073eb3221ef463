/* moe_cpu: the routed-expert MLP of a Qwen3-MoE layer, float32 on the CPU,
 * the readable reference the CUDA path is checked against.
 *
 * For each token row x (the post-attention normed hidden state):
 *   logits = x . router^T                  [E], float32
 *   p      = softmax(logits)               float32, as transformers
 *   top-k  the k largest p in descending order; of equal values the lower
 *          expert index comes first. (torch.topk, which transformers uses,
 *          promises no order among equal values, and its CPU and CUDA
 *          kernels differ: on [.1 .3 .3 0 .3 .2 .3 .3], k = 4, measured on an
 *          H200 (PyTorch) gives experts 4 7 6 1 on the CPU and 2 1 4 6 on CUDA;
 *          so there is no one rule to copy, and this one is deterministic.
 *          On tqm's real router logits no tie changed a token: the golden
 *          logits and greedy continuations match.)
 *   w      = p of the top-k, divided by their sum when norm_topk_prob
 *   y      = sum over the top-k experts e, in increasing e, of
 *            w_e * down_e(silu(gate_e(x)) * up_e(x))
 * which is transformers' Qwen3MoeSparseMoeBlock (it adds the experts' outputs
 * into a zeroed tensor expert by expert, in increasing index).
 *
 * Under tensor parallelism each rank holds a slice of every expert's
 * intermediate rows (rollout/model/tp_shard.h) and the same router; y is then
 * a partial sum that the caller all-reduces, like the dense MLP's. */
#ifndef FR_MOE_CPU_H
#define FR_MOE_CPU_H

#include "base/fr_status.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_moe_cpu fr_moe_cpu;

/* Scratch for steps of up to max_tokens rows of a model with config c (the
 * rank's local config under tensor parallelism). */
fr_status fr_moe_cpu_new(const fr_model_config *c, int max_tokens, fr_moe_cpu **out);
/* Sets *s = NULL; NULL-safe. */
void fr_moe_cpu_destroy(fr_moe_cpu **s);

/* y[M][hidden] = the MoE block of layer weights lw on x[M][hidden]
 * (M <= max_tokens). deterministic selects fr_matmul_fixed, whose rows do not
 * depend on the batch, so neither does y. */
void fr_moe_cpu_forward(fr_moe_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *x,
                        int M, float *y, int deterministic);

/* The routing of one row: probabilities p[E] (softmax of logits[E]), then
 * ids[k] and weights[k] as described above. */
void fr_moe_route(const float *logits, int E, int k, int norm_topk_prob, float *p, int *ids, float *weights);

#ifdef __cplusplus
}
#endif

#endif
