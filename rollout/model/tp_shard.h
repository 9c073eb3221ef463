/* Tensor-parallel sharding of a Qwen3 model for the CPU runner
 * (docs/tensor_parallel.md).
 *
 * An engine of tp ranks serves one model: rank t holds
 *  - query heads [t * H/tp, (t + 1) * H/tp) (rows of q_proj, columns of
 *    o_proj),
 *  - the KV heads those query heads read: KVH/tp of them when tp <= KVH,
 *    else the one KV head of its query heads (replicated on tp/KVH ranks),
 *  - intermediate rows [t * I/tp, (t + 1) * I/tp) (rows of gate_proj and
 *    up_proj, columns of down_proj),
 *  - in a Mixture-of-Experts layer, rows [t * Im/tp, (t + 1) * Im/tp) of every
 *    expert's intermediate dimension (gate and up rows, down columns), and
 *    rows [t * Is/tp, (t + 1) * Is/tp) of the shared experts' MLP (DeepSeek,
 *    Is = n_shared_experts * Im); the router and its bias are replicated,
 *    so every rank routes every token alike,
 *  - vocabulary rows [t * V/tp, (t + 1) * V/tp) of lm_head.
 * Embedding and norms are replicated. o_proj and down_proj (and the experts'
 * weighted sum) produce partial
 * sums of the hidden state that an all-reduce adds up; the logits' vocabulary
 * slices are gathered to every rank.
 *
 * The layout arithmetic is pure (no MPI); fr_tp_shard_new builds the local
 * weights a runner reads. */
#ifndef FR_TP_SHARD_H
#define FR_TP_SHARD_H

#include "comm/engine_group.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* This rank's place in its engine. size 1 (group NULL) is the single-rank
 * engine: no sharding, no collectives. */
typedef struct {
    int rank, size;
    const fr_engine_group *group;   /* not owned; NULL when size == 1 */
} fr_tp;

/* What rank `rank` of `size` holds of a model (pure arithmetic). */
typedef struct {
    int rank, size;
    int n_heads, head0;         /* local query heads: [head0, head0 + n_heads) */
    int n_kv_heads, kv_head0;   /* local KV heads: [kv_head0, kv_head0 + n_kv_heads) */
    int inter, inter0;          /* local intermediate rows: [inter0, inter0 + inter) */
    int moe_inter, moe_inter0;  /* local rows of each expert (0 for a dense model) */
    int shared_inter, shared_inter0; /* local rows of the shared experts' MLP (0: none) */
    int vocab, vocab0;          /* local vocabulary rows: [vocab0, vocab0 + vocab) */
} fr_tp_layout;

/* Checks that the model splits over `size` ranks and fills *out for `rank`.
 * FR_EINVAL naming the sizes when size < 1, rank outside [0, size), or when
 * num_heads, intermediate_size or vocab_size is not a multiple of size, or
 * when the KV heads do not split: size must divide num_kv_heads, or be a
 * multiple of it (each rank's query heads then share one KV head). */
fr_status fr_tp_layout_of(const fr_model_config *cfg, int rank, int size, fr_tp_layout *out);

/* The model config a rank computes with: num_heads, num_kv_heads,
 * intermediate_size, moe_intermediate_size and vocab_size replaced by the
 * local counts (n_shared_experts stays: the shared MLP's local rows are
 * n_shared_experts times the local moe_intermediate_size). */
void fr_tp_local_config(const fr_model_config *cfg, const fr_tp_layout *l, fr_model_config *out);

/* Copies the local KV heads' rows of a per-(layer, KV head) table
 * src[layers][n_kv_heads][per] into dst[layers][l->n_kv_heads][per] (the
 * calibrated key mean, per = head_dim; FP8 scales, per = 2). */
void fr_tp_slice_kv_table(const float *src, int layers, int n_kv_heads, int per, const fr_tp_layout *l,
                          float *dst);

/* The weights of one rank. Column-parallel tensors (q/k/v_proj, gate/up_proj,
 * lm_head) are contiguous row ranges of the model's tensors and point into
 * them; row-parallel ones (o_proj, down_proj) are column ranges and are
 * copied into a block the shard owns, as are the experts' slices (a slice of
 * every expert is not one range of the stacked tensors). Embedding and norms point at the
 * model's. The model must outlive the shard. */
typedef struct {
    fr_tp_layout layout;
    fr_model_config cfg;        /* fr_tp_local_config */
    fr_weights w;               /* local weights (embed and final_norm full) */
    float *owned_;              /* private: the copied row-parallel slices */
} fr_tp_shard;

fr_status fr_tp_shard_new(const fr_model *m, int rank, int size, fr_tp_shard **out);
/* Sets *s = NULL; NULL-safe. */
void fr_tp_shard_destroy(fr_tp_shard **s);

#ifdef __cplusplus
}
#endif

#endif
