/* moe_cpu: the routed-expert MLP of a Qwen3-MoE or DeepSeek layer, float32
 * on the CPU, the readable reference the CUDA path is checked against.
 *
 * For each token row x (the post-attention normed hidden state):
 *   logits = x . router^T                  [E], float32
 *   scores = softmax(logits) or sigmoid(logits)   (scoring_func)
 *   choice = scores, plus e_score_correction_bias under noaux_tc
 *   groups (group_limited_greedy, noaux_tc): the E experts in n_group
 *          groups of consecutive indices; a group's rank is its best choice
 *          (group_limited_greedy) or the sum of its two best (noaux_tc); the
 *          topk_group best groups are kept and every other expert's choice
 *          becomes 0.0 (as transformers masks it: not -inf)
 *   top-k  the k largest choices in descending order; of equal values the
 *          lower expert index comes first (and the lower group index among
 *          groups). torch.topk, which transformers uses, promises no order
 *          among equal values, and its CPU and CUDA kernels differ: on
 *          [.1 .3 .3 0 .3 .2 .3 .3], k = 4, measured on an H200 (PyTorch) it
 *          gives experts 4 7 6 1 on the CPU and 2 1 4 6 on CUDA; so there is
 *          no one rule to copy, and this one is deterministic.
 *   w      = the scores (not the choices) of the top-k, divided by their sum
 *            plus 1e-20 when norm_topk_prob, then times routed_scaling_factor
 *   y      = sum over the top-k experts e, in increasing e, of
 *            w_e * down_e(silu(gate_e(x)) * up_e(x)),
 *            then + the shared experts' MLP of x (DeepSeek)
 * which is transformers' Qwen3MoeSparseMoeBlock, DeepseekV2Moe and
 * DeepseekV3MoE (the experts' outputs added into a zeroed tensor expert by
 * expert, in increasing index, then the shared experts'). The exact rules and
 * where each comes from: docs/deepseek_moe.md.
 *
 * Under tensor parallelism each rank holds a slice of every expert's
 * intermediate rows (rollout/model/tp_shard.h), of the shared experts' too,
 * and the same router; y is then a partial sum that the caller all-reduces,
 * like the dense MLP's. */
#ifndef FR_MOE_CPU_H
#define FR_MOE_CPU_H

#include "base/fr_status.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One router's rules, as the config gives them. */
typedef struct {
    int E, k;
    int scoring;         /* fr_moe_scoring */
    int method;          /* fr_moe_topk_method */
    int n_group, topk_group;
    int norm;            /* norm_topk_prob */
    float scale;         /* routed_scaling_factor */
    const float *bias;   /* [E]: NOAUX_TC's e_score_correction_bias; else unused */
} fr_moe_routing;

/* The routing of config c (the local config of a rank is the same), with the
 * layer's router bias (NULL unless noaux_tc). */
fr_moe_routing fr_moe_routing_of(const fr_model_config *c, const float *bias);

/* The routing of one row: scores[E] as the scoring function gives them,
 * choice[E] (scratch: what the top-k compared, the masked groups' 0.0
 * included), ids[k] best first and weights[k], as described above. */
void fr_moe_route_row(const fr_moe_routing *rt, const float *logits, float *scores, float *choice, int *ids,
                      float *weights);

/* Qwen3-MoE's routing (softmax, greedy, no scale) of one row: p[E] the
 * softmax, ids[k] and weights[k]. */
void fr_moe_route(const float *logits, int E, int k, int norm_topk_prob, float *p, int *ids, float *weights);

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

/* The experts the last forward chose: [M][k] ids, each row best first (valid
 * until the next forward). */
const int *fr_moe_cpu_ids(const fr_moe_cpu *s);

#ifdef __cplusplus
}
#endif

#endif
