/* The CUDA model runner: one forward step of the Qwen3 model (dense or
 * Mixture-of-Experts; or DeepSeek-V3's latent attention with dense MLPs,
 * through mla_cuda.h) over a batch of sequences on the GPU, with the same contract as the CPU runner
 * (runner_cpu.h): a step takes, for each sequence, its n new tokens, and
 * appends their keys and values to the cache.
 *
 * Weights are BF16 on the device (weights_cuda.h); the residual stream is
 * float32; matrix products take BF16 and accumulate in FP32 (gemm_cuda.h).
 * Keys and values live in the device cache (kvcache/kv_store_cuda.h), whose
 * sequences and block tables are kept by a bookkeeping-only fr_kv_cache on the
 * host. Every buffer is allocated at creation; a step allocates nothing.
 * docs/gpu_engine.md describes the step, the buffers and the CUDA graphs.
 * Sessions reach it through the runner interface (runner.h,
 * runner_batch_cuda.c); its code is runner_cuda.c (creation, modes),
 * runner_forward_cuda.c (the forward pass, eager steps) and
 * runner_decode_cuda.c (decode graphs, launch and wait, riders). */
#ifndef FR_RUNNER_CUDA_H
#define FR_RUNNER_CUDA_H

#include "kvcache/kv_cache.h"
#include "rollout/model/runner.h"
#include "rollout/model/sampler_cuda.h"
#include "rollout/model/weights_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_runner_cuda fr_runner_cuda;

/* The CUDA runner under a runner of runner.h (fr_runner_cuda_open), for
 * what only it has (its device logits, its stream, expert use); NULL when r
 * is another backend's. */
fr_runner_cuda *fr_runner_cuda_of(fr_runner *r);

/* Decode graphs are kept per batch bucket: 1, 2, 4, ... up to max_seqs. */
#define FR_CUDA_GRAPH_BUCKETS 16

/* book: the bookkeeping-only cache (cfg.bookkeeping_only = 1) whose config
 * also sizes the device cache; max_step_tokens bounds the tokens of a step. */
fr_status fr_runner_cuda_new(const fr_weights_gpu *w, fr_kv_cache *book, int max_step_tokens,
                             fr_runner_cuda **out);
/* The same for one rank of a tensor-parallel engine: w is this rank's shard
 * (fr_weights_gpu_shard), book holds its KV heads, nccl is the engine's
 * group (comm/nccl_group.h; NULL when w is the whole model). Every step and
 * decode is then collective over the engine: each rank makes the same calls
 * in the same order, and each gets the full logits and the same tokens. */
struct fr_nccl_group;
fr_status fr_runner_cuda_new_tp(const fr_weights_gpu *w, fr_kv_cache *book, int max_step_tokens,
                                struct fr_nccl_group *nccl, fr_runner_cuda **out);
void fr_runner_cuda_destroy(fr_runner_cuda **r);

/* Runs one step; logits (host) receives fr_step_logit_rows() rows of vocab
 * floats. Blocks for the new tokens are reserved here; on FR_ENOMEM nothing
 * changed. */
fr_status fr_runner_cuda_step(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, float *logits);

/* fr_runner_cpu_fill's step on the GPU: the tokens' keys and values
 * projected from their embeddings and written to the cache, no attention,
 * no MLP, no logits (a long context filled fast for benchmarks). */
fr_status fr_runner_cuda_fill(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs);

/* A step like fr_runner_cuda_step whose logits stay on the device but for
 * the rows asked for: draw i samples logit row draw_rows[i] (rows numbered as
 * fr_step_logit_rows numbers them) with draw_params[i] into tokens[i] and
 * logprobs[i] (may be NULL); several draws may read one row (the n samples of
 * a prompt). The logits of rows keep[0..n_keep) go to kept_logits
 * [n_keep][vocab] on the host. A scheduler's mixed steps (prefill chunks
 * beside decodes) take this path; decode-only ones take the graphs below. */
fr_status fr_runner_cuda_step_draw(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, const int *draw_rows,
                                   const fr_sample_row *draw_params, int n_draws, int *tokens, float *logprobs,
                                   const int *keep, int n_keep, float *kept_logits);

/* A decode step (one new token per sequence) with sampling on the GPU:
 * tokens[i] and logprobs[i] (may be NULL) receive the token sampled for
 * seqs[i] with params[i] and its log-prob; only these come back to the host.
 * The batch is padded to its bucket and replayed from a CUDA graph captured
 * on the bucket's first use (FR_CUDA_GRAPHS=0 runs the kernels directly). */
fr_status fr_runner_cuda_decode(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                int n_seqs, int *tokens, float *logprobs);
/* The same decode, also copying the logits of rows keep[0..n_keep) (row
 * indices into seqs, in any order) to kept_logits [n_keep][vocab] on the host:
 * what a scheduler needs for the few rows it measures or teacher-forces while
 * the rest are sampled on the device. tokens may be NULL (logits only). */
fr_status fr_runner_cuda_decode_keep(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                     int n_seqs, int *tokens, float *logprobs, const int *keep, int n_keep,
                                     float *kept_logits);

/* The decode above in two halves, so that the host can launch another
 * runner's work (a shadow's decode) while this one runs: launch enqueues
 * everything and returns; wait (the same seqs) finishes it as
 * fr_runner_cuda_decode_keep does. One launch at a time; nothing else may
 * step this runner in between. */
fr_status fr_runner_cuda_decode_launch(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                       int n_seqs);
fr_status fr_runner_cuda_decode_wait(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *tokens,
                                     float *logprobs, const int *keep, int n_keep, float *kept_logits);

/* A decode that carries another runner's decode in its batch: rider (a
 * runner over the same weights with a BF16 cache, no tensor parallelism)
 * steps rider_seqs[0..n_rider) one token each, its rows after ours in every
 * matrix product, with its own attention and cache. The two then cost about
 * one decode: the weights are read once. Wait with fr_runner_cuda_decode_wait,
 * which also advances the rider's bookkeeping (rider_seqs must stay valid
 * until then); the rider's logits are this runner's rows from
 * fr_runner_cuda_rider_first_row on. The BF16-KV shadow of the monitored
 * samples rides this way. */
fr_status fr_runner_cuda_decode_launch_carrying(fr_runner_cuda *r, const fr_step_seq *seqs,
                                                const fr_sample_row *params, int n_seqs, fr_runner_cuda *rider,
                                                const fr_step_seq *rider_seqs, int n_rider);
int fr_runner_cuda_rider_first_row(const fr_runner_cuda *r);

/* The device logits of the last decode, [batch rows][vocab] in batch order
 * (valid until the next step or decode): for measurements made on the
 * device beside another runner's. */
const float *fr_runner_cuda_decode_logits(const fr_runner_cuda *r);
/* The device tokens the last decode sampled ([batch rows], batch order; as
 * long as its logits) and the stream the runner's work runs on: device
 * work enqueued there after a launch reads them before the wait. */
const int *fr_runner_cuda_decode_tokens(const fr_runner_cuda *r);
cudaStream_t fr_runner_cuda_stream(const fr_runner_cuda *r);
/* Decode graphs captured so far, and the seconds their first uses took
 * (the direct run, the capture and the instantiation): to tell a graph
 * that is replayed from one captured again. */
void fr_runner_cuda_capture_stats(const fr_runner_cuda *r, int *captures, double *seconds);

/* Installs the forward taps of runner_cpu.h (copied; NULL removes them):
 * layer_kv and layer_q see every layer of fr_runner_cuda_step's steps, as
 * float32 host copies of the post-RoPE rows (the BF16 store form is made
 * from them afterwards). fr_runner_cuda_decode does not call them, and
 * decode_query is refused (FR_EUNSUPPORTED): the device cache has no float
 * view to hand out. */
fr_status fr_runner_cuda_set_observer(fr_runner_cuda *r, const fr_forward_observer *obs);

/* After fr_kv_seq_fork(book, src, &dst): gives dst a copy of src's device slots. */
/* The device cache's key mean (kvcache/kv_store_cuda.h), after the steps
 * in flight have finished. */
/* Deterministic mode (docs/determinism.md): matrix products with pinned
 * cuBLASLt algorithms (FR_DETERMINISTIC_GEMM=fixed: the fixed-order kernel of
 * gemm_fixed_cuda.h), and attention whose plan is fixed by
 * token position: with a BF16 cache one path for decode and prefill tokens
 * (attn_fixed.h), with FP4/FP8 caches decode splits fixed per sequence
 * (fr_attn_fp4_config.fixed_splits). A sample's tokens and log-probs are then
 * independent of the batch. Call between steps; captured graphs are dropped.
 * Refused with tensor parallelism (FR_EUNSUPPORTED). */
fr_status fr_runner_cuda_set_deterministic(fr_runner_cuda *r, int on);

fr_status fr_runner_cuda_set_key_mean(fr_runner_cuda *r, const float *key_mean);
fr_status fr_runner_cuda_fork(fr_runner_cuda *r, int src_seq, int dst_seq);
/* release 1: frees the device KV cache's pages and slots and drops the
 * decode graphs that captured them; 0: allocates them again (zeroed). The
 * runner must be idle (no live sequence, no decode in flight). */
fr_status fr_runner_cuda_memory(fr_runner_cuda *r, int release);

/* A Mixture-of-Experts model's expert use in the last step (what its expert
 * weight traffic was): per layer the number of experts at least one token
 * chose (active_per_layer[num_layers]), and the tokens each expert of the
 * last layer received (last_layer_counts[num_experts]); either may be NULL.
 * Synchronizes the runner's stream. FR_EINVAL for a dense model. */
fr_status fr_runner_cuda_moe_usage(fr_runner_cuda *r, int *active_per_layer, int *last_layer_counts);

/* Routed-expert replay (docs/deepseek_moe.md): out[i][m][k] = the experts MoE
 * layer m chose for token row rows[i] of the last step (finished: after its
 * wait), copied to the host; synchronizes the stream. The forward pass keeps
 * every layer's choices anyway, so steps cost nothing more for it. */
fr_status fr_runner_cuda_routes(fr_runner_cuda *r, const int *rows, int n, uint16_t *out);
/* The model config the runner computes with (its rank's local one). */
const fr_model_config *fr_runner_cuda_config(const fr_runner_cuda *r);

#ifdef __cplusplus
}
#endif

#endif
