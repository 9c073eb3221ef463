/* The CPU model runner: one forward step of the Qwen3 model over a batch of
 * sequences, reading and writing the paged KV cache. Plain float32 with
 * OpenBLAS matrix products; the numerical reference for the CUDA runner.
 *
 * A step takes, for each sequence, the n new tokens to run (a prefill chunk,
 * or one decode token). Attention of a step with one new token runs paper
 * Algorithm 1 through attention/ref_attention (FP4 exact math included);
 * a longer chunk runs causal attention with unquantized query and
 * probabilities over the same stored keys and values (what a prefill kernel
 * over dequantized pages computes). After the step the new tokens' K and V
 * are appended to the cache. */
#ifndef FR_RUNNER_CPU_H
#define FR_RUNNER_CPU_H

#include <stdint.h>

#include "kvcache/kv_cache.h"
#include "rollout/model/model.h"
#include "rollout/model/tp_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int seq;             /* KV cache sequence */
    int n;               /* new tokens this step */
    const int *tokens;   /* [n] */
    int all_logits;      /* 1: logits for every new token; 0: for the last one */
} fr_step_seq;

typedef struct fr_runner_cpu fr_runner_cpu;

/* max_step_tokens bounds the tokens of one step (sum of n). */
fr_status fr_runner_cpu_new(const fr_model *m, fr_kv_cache *kv, int max_step_tokens,
                            fr_runner_cpu **out);
/* The same for one rank of a tensor-parallel engine (tp NULL or size 1:
 * fr_runner_cpu_new). The runner shards m's weights at creation
 * (rollout/model/tp_shard.h; m must outlive it), kv holds this rank's KV heads
 * only (fr_tp_layout), and every step is collective over the engine: each
 * rank calls fr_runner_cpu_step with the same arguments, and each receives
 * the full logits. The observer then sees this rank's heads. */
fr_status fr_runner_cpu_new_tp(const fr_model *m, fr_kv_cache *kv, int max_step_tokens, const fr_tp *tp,
                               fr_runner_cpu **out);
void fr_runner_cpu_destroy(fr_runner_cpu **r);
/* After the model's weight values changed in place (a weight update): a
 * tensor-parallel rank cuts its shard again (its row-parallel slices are
 * copies). Nothing to do at tp 1. On failure the old shard stays. */
fr_status fr_runner_cpu_weights_changed(fr_runner_cpu *r);

/* Rows of logits the step produces (in sequence order). */
int fr_step_logit_rows(const fr_step_seq *seqs, int n_seqs);

/* The checks every backend makes before a step, and its block reservation:
 * tokens present and inside [0, vocab), sequences existing, the context
 * window and the step-token limit respected, then every block the step needs
 * reserved, all or nothing (a full cache fails with FR_ENOMEM before anything
 * changes). *n_tokens receives the step's token count. */
fr_status fr_step_admit(fr_kv_cache *kv, const fr_step_seq *seqs, int n_seqs, int vocab, int max_position,
                        int max_tokens, int *n_tokens);

/* Runs one step. logits receives fr_step_logit_rows() rows of vocab floats.
 * Blocks for the new tokens are reserved here; on FR_ENOMEM nothing changed. */
fr_status fr_runner_cpu_step(fr_runner_cpu *r, const fr_step_seq *seqs, int n_seqs, float *logits);
/* A step that only appends its tokens' keys and values to the cache, as the
 * model's projections of their embeddings make them (RMSNorm, k/v products,
 * q/k norm and RoPE of every layer; no attention, no MLP, so the residual
 * stream stays the embedding): a long context filled fast, with keys of
 * realistic shape, for benchmarks. No logits. */
fr_status fr_runner_cpu_fill(fr_runner_cpu *r, const fr_step_seq *seqs, int n_seqs);

/* Taps into the forward pass for calibration and analysis. Every callback is
 * optional (NULL: not called); a callback's non-OK status ends the step with
 * that status (the step's tokens then do not join the cache). The pointers
 * are valid during the call only. */
typedef struct {
    void *user;
    /* Post-RoPE keys and the values of layer `layer` for every token of the
     * step, before attention and before they join the cache: k and v are
     * [rows][kv_heads][head_dim], raw (no key mean, rotation or rounding),
     * rows in step order (the seqs[0] tokens first). */
    fr_status (*layer_kv)(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *k,
                          const float *v);
    /* The post-RoPE queries of layer `layer` for every token of the step,
     * q [rows][num_heads][head_dim], raw like layer_kv's keys (no rotation,
     * no rounding), called right after layer_kv. */
    fr_status (*layer_q)(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *q);
    /* A decode query (sequence seqs[s] of the step has one new token): the G
     * query heads of KV head `head` in layer `layer`, q [G][head_dim] as the
     * attention receives it (rotated when the cache rotates keys, unquantized),
     * and the keys and values it attends to, new token included. */
    fr_status (*decode_query)(void *user, int layer, int s, int head, const float *q, int group,
                              const fr_kv_view *view);
} fr_forward_observer;

/* Deterministic mode (docs/determinism.md), off by default: every matrix
 * product a fixed-order kernel (fr_matmul_fixed) instead of BLAS, and
 * attention of f32 and BF16 caches one fixed-order path for every query
 * token, with the step's own keys and values read as the cache stores them,
 * so a token's logits are bitwise the same whatever else is in the step,
 * however its prompt was chunked, and with any thread count or CPU. */
void fr_runner_cpu_set_deterministic(fr_runner_cpu *r, int on);

/* Routed-expert replay (docs/deepseek_moe.md, "Routed-expert replay"):
 * with on, every step keeps, until the next one, the experts each MoE layer
 * chose for each of its token rows (rows in step order: seqs[0]'s tokens
 * first); off (the default) keeps nothing and costs nothing. FR_EINVAL for
 * a model without MoE layers. */
fr_status fr_runner_cpu_capture_routes(fr_runner_cpu *r, int on);
/* out[i][m][k] = the experts MoE layer m (in layer order) chose for token
 * row rows[i] of the last step, best first; FR_EINVAL when capture is off
 * or a row is not in the last step. */
fr_status fr_runner_cpu_routes(const fr_runner_cpu *r, const int *rows, int n, uint16_t *out);

/* Installs obs (copied), or removes it with NULL. Without an observer the
 * step does no extra work. The CUDA runner takes the same observer for its
 * layer_kv and layer_q (fr_runner_cuda_set_observer). */
void fr_runner_cpu_set_observer(fr_runner_cpu *r, const fr_forward_observer *obs);

#ifdef __cplusplus
}
#endif

#endif
