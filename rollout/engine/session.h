/* An inference session: a model, its KV cache configured from the
 * command-line numerics options, and a runner on the chosen backend (the CPU
 * reference, or CUDA; rollout/model/runner.h). Shared by generate, score, the
 * scheduler and the evaluation commands so they all build the engine the
 * same way. Every step call below describes a batch (fr_batch) and hands it
 * to the runner, which steps and samples where its logits are. */
#ifndef FR_SESSION_H
#define FR_SESSION_H

#include "kvcache/calib_file.h"
#include "rollout/model/runner.h"
#include "rollout/model/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* KV pages per sequence slot of a cache sized neither by a block count nor by
 * memory: a session sized by kv_memory_fraction that falls back to the CPU
 * (--backend auto, a configuration the GPU does not run), and serve's kv_blocks
 * 0 on the CPU. 16 x 128 = 2048 tokens a slot. */
#define FR_SESSION_PAGES_PER_SEQ 16

typedef struct {
    const char *model;          /* DIR or synthetic:NAME[:SEED] */
    fr_backend backend;
    fr_kv_dtype kv;
    fr_fp4_compute compute;
    fr_recipe recipe;
    const char *calib;          /* calibration file or NULL */
    int chunk;                  /* prefill chunk (tokens per step) */
    int tp;                     /* ranks per engine (--tp, default 1); > 1 needs group
                                 * (docs/tensor_parallel.md); auto then picks the CPU,
                                 * --backend cuda runs one GPU per rank over NCCL */
    const fr_engine_group *group; /* this rank's engine when tp > 1 (app/tp_launch.h),
                                 * not owned; NULL for tp 1 */
    int max_model_len;          /* > 0: the context window capped at this many tokens */
    int deterministic;          /* --deterministic: a sample's numbers independent of the
                                 * batch, chunking, preemption, engine, thread count and
                                 * CPU (docs/determinism.md); CPU backend only */
    double kv_memory_fraction;  /* > 0, with n_blocks 0 on the GPU and tp 1: the share of the
                                 * device's memory that may be in use once the KV cache is
                                 * made (SGLang's mem_fraction_static); the cache gets what is
                                 * left of it once the weights are loaded */
    double kv_shadow_share;     /* with kv_memory_fraction: the share of samples expected to run
                                 * a BF16-KV shadow (kl_sample_rate), whose cache takes its part
                                 * of the memory (fr_kv_sizing) */
} fr_engine_opts;

void fr_engine_opts_default(fr_engine_opts *o);

/* The compute mode a cache on backend b (CPU or CUDA) is built with: c,
 * or for auto BF16 on CUDA and exact on the CPU (attention/kv_numerics.h). */
fr_fp4_compute fr_fp4_compute_for(fr_fp4_compute c, fr_backend b);

typedef struct {
    fr_model *model;            /* config always; host weights on the CPU backend only */
    fr_kv_cache *kv;            /* the cache (CPU) or its bookkeeping (CUDA) */
    fr_backend backend;         /* CPU or CUDA once open */
    fr_runner *runner;          /* steps and samples on the backend (rollout/model/runner.h) */
    struct fr_weights_gpu *gpu_weights; /* CUDA backend: the device weights the runner reads */
    struct fr_nccl_group *nccl; /* CUDA backend with tp > 1: the engine's NCCL group */
    int borrowed;               /* a shadow session: model, weights and NCCL group are
                                 * another session's (fr_session_open_shadow) */
    fr_calib calib;
    int has_calib;
    int deterministic;          /* the options' deterministic mode (a shadow: main's) */
    int released;               /* fr_session_release_memory: 1 the KV cache, 2 the weights too */
    int shadow_blocks;          /* cache sized by memory: the blocks left for a BF16 shadow's
                                 * cache (fr_kv_sizing); 0: as many as this cache */
    fr_tp tp;                   /* this rank in its engine; size 1 without tensor parallelism.
                                 * With size > 1 every session call that steps the model is
                                 * collective over the engine and the KV cache holds this
                                 * rank's KV heads only. */
} fr_session;

/* n_blocks 0 with o->kv_memory_fraction > 0 on the GPU: as many blocks as that
 * share of the device's memory holds after the weights (fr_kv_blocks_for_memory);
 * the opened cache's config (fr_kv_cache_config_of) says how many. */
fr_status fr_session_open(const fr_engine_opts *o, int n_blocks, int max_seqs, fr_session *s);

/* How a share of device memory is cut into KV blocks (fr_kv_blocks_for_memory). */
typedef struct {
    int n_blocks;              /* the cache's */
    int shadow_blocks;         /* a divergence shadow's (BF16 KV) */
    size_t block_bytes;        /* one block of the cache: every layer's page of the rank's KV heads */
    size_t shadow_block_bytes; /* one BF16 block */
} fr_kv_sizing;

/* The KV blocks a share of device memory holds: fraction x total, less what is in
 * use already (total - free: the weights, the context, everything else), cut
 * between the cache (n_blocks, in dtype kv) and a BF16 shadow's cache holding
 * shadow_share of the cache's blocks (kl_sample_rate: the share of samples that run
 * a shadow), so that n_blocks x block + shadow_blocks x BF16 block fills it. With
 * shadow_share 0 the share is the cache's alone, and shadow_blocks is max_seqs (one
 * block a slot, for requests that ask to be monitored), outside the share. The
 * shadow never gets fewer than max_seqs blocks. A block is every layer's page of
 * this rank's n_kv_heads KV heads, or its latent row (kvcache/page_layout.h).
 * Fails, naming the figures, when the cache would get fewer blocks than sequence
 * slots. Pure arithmetic: the caller reads the device's free and total memory. */
fr_status fr_kv_blocks_for_memory(const fr_model_config *c, int n_kv_heads, fr_kv_dtype kv, size_t free_bytes,
                                  size_t total_bytes, double fraction, double shadow_share, int max_seqs,
                                  fr_kv_sizing *out);
/* Opens a session on an already loaded model, which it owns on success. */
fr_status fr_session_open_model(const fr_engine_opts *o, fr_model *m, int n_blocks, int max_seqs,
                                fr_session *s);
void fr_session_close(fr_session *s);
/* A second session over main's model and weights (not copied; main must
 * outlive it) with its own BF16 KV cache of n_blocks blocks and max_seqs
 * sequences, on main's backend and tensor-parallel rank: the BF16 shadow of
 * divergence monitoring (rollout/engine/divergence.h). With tp > 1 its steps are
 * collective like main's; every rank steps both in the same order. */
fr_status fr_session_open_shadow(const fr_session *main, int n_blocks, int max_seqs, int step_tokens,
                                 fr_session *out);
/* Decode graphs the session's runner captured, and the seconds their first
 * uses took (fr_runner_capture_stats); 0 on the CPU backend. */
void fr_session_capture_stats(const fr_session *s, int *captures, double *seconds);
const char *fr_backend_name(fr_backend b);
/* The backend `want` runs on here: auto becomes cuda when a CUDA device is
 * usable, else cpu; cuda fails (FR_EUNSUPPORTED, with the reason) without a
 * device or without CUDA in the build. */
fr_status fr_backend_pick(fr_backend want, fr_backend *out);

/* Replaces the key mean of the session's FP4 cache (host and device) and of
 * its calibration (s->calib; made, with the cache's tau, when the session
 * had none), for keys written from now on: the caller has freed or will
 * recompute every sequence (kvcache/kv_cache.h). One rank per engine only
 * (tp 1): a tensor-parallel engine would need every rank to agree. */
fr_status fr_session_set_key_mean(fr_session *s, const float *key_mean);

/* Gives the KV cache's memory back while no sequence is live (the host
 * pages on the CPU, the device pages and slots on CUDA; with weights, on
 * CUDA the device weights too, kept in host memory meanwhile), for a
 * trainer that shares the machine; the session must not step until
 * fr_session_resume_memory has taken it again (the cache then empty). The
 * CPU backend's weights stay (they are the host's). Idempotent. One rank
 * per engine (tp 1). */
fr_status fr_session_release_memory(fr_session *s, int weights);
fr_status fr_session_resume_memory(fr_session *s);

/* One forward step on the session's backend (fr_runner_cpu_step's contract):
 * every logit row to logits. */
fr_status fr_session_step(fr_session *s, const fr_step_seq *seqs, int n_seqs, float *logits);
/* The sampling parameters of a drawn token (fr_decode_row) and a draw from a
 * step's logit row (fr_step_draw) are rollout/model/runner.h's. */

/* A decode step (one new token per sequence) and sampling: tokens[i] and
 * logprobs[i] receive the next token of seqs[i] drawn with rows[i]. On CUDA
 * the sampling runs on the GPU and the step replays a CUDA graph; the CPU
 * samples from the step's logits with the same rules and draws. */
fr_status fr_session_decode(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs,
                            int *tokens, float *logprobs);
/* The same decode, also handing out the logits of rows keep[0..n_keep)
 * (indices into seqs) as kept_logits [n_keep][vocab]: on CUDA only those
 * rows leave the device. tokens NULL: logits only (the CPU then samples
 * nothing; CUDA samples on the device and drops the tokens). */
fr_status fr_session_decode_keep(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs,
                                 int *tokens, float *logprobs, const int *keep, int n_keep, float *kept_logits);

/* fr_session_decode_keep in two halves (CUDA backend only; FR_EUNSUPPORTED
 * otherwise): launch returns once the decode is enqueued, so the host can
 * start other work on the device (a shadow's step) while it runs; wait (the
 * same seqs) finishes it. */
fr_status fr_session_decode_launch(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs);
fr_status fr_session_decode_wait(fr_session *s, const fr_step_seq *seqs, int n_seqs, int *tokens, float *logprobs,
                                 const int *keep, int n_keep, float *kept_logits);
/* A launch whose batch also carries rider's decode of rider_seqs (a session
 * over the same weights with a BF16 cache: the BF16-KV shadow), so the two
 * read the weights once (rollout/model/runner_cuda.h); CUDA only. The wait above
 * finishes both; rider_seqs must stay valid until then. */
fr_status fr_session_decode_launch_carrying(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows,
                                            int n_seqs, fr_session *rider, const fr_step_seq *rider_seqs, int n_rider);

/* A forward step of any shape (prefill chunks and decodes together) with
 * the sampling done where the logits are: tokens[i] and logprobs[i] (may be
 * NULL) receive draws[i]'s token, and kept_logits [n_keep][vocab] the logits
 * of rows keep[0..n_keep). On CUDA only those rows and the tokens cross to
 * the host; the CPU steps and samples as fr_session_step and fr_sample do. */
fr_status fr_session_step_draw(fr_session *s, const fr_step_seq *seqs, int n_seqs, const fr_step_draw *draws,
                               int n_draws, int *tokens, float *logprobs, const int *keep, int n_keep,
                               float *kept_logits);

/* Appends the tokens of seqs to their sequences' caches without attention
 * or the MLP (rollout/model/runner_cpu.h, fr_runner_cpu_fill): keys and values
 * projected from the embeddings, no logits. For filling long contexts in
 * benchmarks (bench/decode_step --fill); the tokens' positions and pages are
 * as a prefill's, their contents are not. */
fr_status fr_session_fill(fr_session *s, const fr_step_seq *seqs, int n_seqs);

/* Routed-expert replay (rollout/model/runner.h, fr_runner_capture_routes
 * and fr_runner_routes): with capture on, the experts every MoE layer chose
 * for each token row of the last step can be read, [n][moe layers][k]. */
fr_status fr_session_capture_routes(fr_session *s, int on);
fr_status fr_session_routes(fr_session *s, const int *rows, int n, uint16_t *out);

/* A new sequence holding src's tokens (shared full pages, copied slots). */
fr_status fr_session_fork(fr_session *s, int src, int *dst);

/* Prefills tokens into a new KV sequence in chunks; logits of the last token
 * go to last_logits (vocab floats) and, when all_logits is non-NULL, every
 * position's logits to all_logits [n][vocab]. */
fr_status fr_session_prefill(fr_session *s, const int *tokens, int n, int chunk, int *seq,
                             float *last_logits, float *all_logits);

/* Parses "1,2,3" (commas and/or whitespace) into a new array. */
fr_status fr_parse_ids(const char *text, int **ids, int *n);
/* Reads a file of ids in the same syntax. */
fr_status fr_read_ids_file(const char *path, int **ids, int *n);
/* Checks a prompt against the model: non-empty, ids in the vocabulary, fits
 * the context window together with extra tokens. */
fr_status fr_check_prompt(const fr_model_config *cfg, const int *ids, int n, int extra);

#ifdef __cplusplus
}
#endif

#endif
