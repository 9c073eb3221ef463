/* The model runner interface: what a session steps, whatever the backend.
 *
 * A runner runs one batch at a time over its KV cache (prefill chunks and
 * decodes, described by an fr_batch) and samples the batch's tokens where
 * its logits are: the CPU runner from host logits (runner_batch_cpu.c), the
 * CUDA runner on the device, decode-only batches replayed from CUDA graphs
 * (runner_batch_cuda.c). Callers (rollout/engine/session.c, calibration,
 * eval-kl) hold an fr_runner and never ask which backend it is; the build
 * picks the backend files, and a build without CUDA answers the CUDA
 * runner's entry points with FR_EUNSUPPORTED (runner_nocuda.c).
 * docs/architecture.md, "The path of one decode step", follows one call
 * from the scheduler to the kernels. */
#ifndef FR_RUNNER_H
#define FR_RUNNER_H

#include <stdint.h>

#include "kvcache/kv_cache.h"
#include "rollout/model/runner_cpu.h"
#include "rollout/model/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* auto: CUDA when a GPU is present and supports the configuration, else CPU. */
typedef enum { FR_BACKEND_AUTO = 0, FR_BACKEND_CPU, FR_BACKEND_CUDA } fr_backend;

/* Sampling parameters of one drawn token: the sample's parameters, its
 * stream (sequence) and the index of the token being drawn (step), the
 * Philox keys of rollout/model/sampler.h. */
typedef struct {
    fr_sampling_params params;
    uint64_t sequence, step;
} fr_decode_row;

/* One token to draw in a step of any shape: from logit row `row` of the
 * step (fr_step_logit_rows' numbering) with the sample's parameters and keys. */
typedef struct {
    int row;
    fr_decode_row d;
} fr_step_draw;

typedef enum {
    /* Any shape (prefill chunks beside decodes): with `logits`, every logit
     * row of the step goes there; without, tokens are drawn for `draws`
     * and the logits of logit rows `keep` go to kept_logits. */
    FR_BATCH_STEP = 0,
    /* Keys and values only, projected from the embeddings (no attention, no
     * MLP, no logits): long contexts filled fast for benchmarks
     * (fr_runner_cpu_fill). */
    FR_BATCH_FILL,
    /* One new token per sequence, rows[i] drawing seqs[i]'s next token; the
     * logits of batch rows `keep` go to kept_logits. tokens NULL: logits
     * only. On CUDA the batch replays a decode graph and may run in two
     * halves (phase) and carry a rider. */
    FR_BATCH_DECODE,
} fr_batch_kind;

typedef enum {
    FR_RUN_WHOLE = 0,  /* run the batch and hand out its outputs */
    FR_RUN_LAUNCH,     /* a decode enqueued on the device; returns at once (rows and rider read) */
    FR_RUN_WAIT,       /* finishes the launched decode (the same seqs) and hands out its outputs */
} fr_run_phase;

typedef struct fr_runner fr_runner;

/* A batch and where its outputs go. Arrays are the caller's and are read
 * during the call only, but for a launch's rider_seqs, which its wait reads
 * (the wait is given the launch's seqs again). */
typedef struct {
    fr_batch_kind kind;
    fr_run_phase phase;           /* FR_BATCH_DECODE only; other kinds run whole */
    const fr_step_seq *seqs;
    int n_seqs;
    const fr_decode_row *rows;    /* DECODE (whole and launch): [n_seqs] */
    const fr_step_draw *draws;    /* STEP: [n_draws] */
    int n_draws;
    const int *keep;              /* logit rows (STEP) or batch rows (DECODE) whose logits come to the host */
    int n_keep;
    /* DECODE launch: a runner over the same weights with a BF16 cache (the
     * BF16-KV shadow) whose decode of rider_seqs rides in this batch, so
     * the weights are read once; the wait finishes both (runner_cuda.h). */
    fr_runner *rider;
    const fr_step_seq *rider_seqs;
    int n_rider;
    float *logits;                /* STEP: every logit row, [fr_step_logit_rows][vocab] */
    int *tokens;                  /* one per draw (STEP) or row (DECODE) */
    float *logprobs;              /* may be NULL */
    float *kept_logits;           /* [n_keep][vocab] */
} fr_batch;

/* A backend's implementation. Every entry is set but fork, set_key_mean,
 * capture_stats and memory, NULL where the backend has nothing to do (the
 * CPU, whose cache is the runner's own and which captures no graphs). */
typedef struct {
    fr_status (*run)(fr_runner *r, const fr_batch *b);
    /* After fr_kv_seq_fork(kv, src, &dst): the backend's own copy of src's
     * slots (the device cache's; nothing on the CPU, whose cache is kv). */
    fr_status (*fork)(fr_runner *r, int src_seq, int dst_seq);
    /* After fr_kv_cache_set_key_mean: the backend's copy of the key mean. */
    fr_status (*set_key_mean)(fr_runner *r, const float *key_mean);
    fr_status (*set_observer)(fr_runner *r, const fr_forward_observer *obs);
    fr_status (*set_deterministic)(fr_runner *r, int on);
    fr_status (*weights_changed)(fr_runner *r);
    /* Routed-expert replay: keep (on) the experts every MoE layer chose for
     * each token row of the steps from now on; read after a step. */
    fr_status (*capture_routes)(fr_runner *r, int on);
    fr_status (*routes)(fr_runner *r, const int *rows, int n, uint16_t *out);
    void (*capture_stats)(const fr_runner *r, int *captures, double *seconds);
    /* release 1: give back the backend's own KV memory (the device cache;
     * nothing on the CPU, whose cache is kv), 0: allocate it again
     * (fr_session_release_memory) */
    fr_status (*memory)(fr_runner *r, int release);
    void (*destroy)(fr_runner *r);
} fr_runner_ops;

/* The head of every backend's runner (its first member). */
struct fr_runner {
    const fr_runner_ops *ops;
    /* Logits and KV cache live on a device: decodes run in two halves and
     * carry riders, and their logits can be measured where they are. */
    int on_device;
};

/* What a runner is built from. */
typedef struct {
    const fr_model *model;            /* config always; the CPU runner's host weights */
    const struct fr_weights_gpu *gpu; /* device weights (rollout/model/weights_cuda.h): the CUDA
                                       * runner; NULL: the CPU runner */
    fr_kv_cache *kv;                  /* the CPU's pages, or the CUDA runner's bookkeeping-only cache */
    int max_step_tokens;              /* tokens of one step (sum of n), at least the cache's sequences */
    const fr_tp *tp;                  /* this rank's engine on the CPU (NULL: tp 1; runner_cpu.h) */
    struct fr_nccl_group *nccl;       /* the engine's NCCL group on the GPU when gpu is a shard */
    int deterministic;                /* docs/determinism.md; refused where the backend lacks it */
} fr_runner_config;

/* For a backend's open (who names it in messages): sets *out to NULL,
 * checks out and c (a KV cache, and device weights when on_device, else the
 * host model) and allocates *out, a zeroed runner of size bytes whose head
 * holds ops and on_device. */
fr_status fr_runner_backend_new(const char *who, const fr_runner_config *c, const fr_runner_ops *ops, int on_device,
                                size_t size, fr_runner **out);

/* The runner c asks for: CUDA with device weights, else the CPU. */
fr_status fr_runner_open(const fr_runner_config *c, fr_runner **out);
fr_status fr_runner_cpu_open(const fr_runner_config *c, fr_runner **out);
/* FR_EUNSUPPORTED in a build without CUDA. */
fr_status fr_runner_cuda_open(const fr_runner_config *c, fr_runner **out);
/* NULL-safe; sets *r to NULL. */
void fr_runner_destroy(fr_runner **r);

/* Runs b (the backend checks what it reads). A step that fails with
 * FR_ENOMEM for want of KV blocks changed nothing. With tensor parallelism
 * every rank of the engine makes the same calls in the same order. */
fr_status fr_runner_run(fr_runner *r, const fr_batch *b);
fr_status fr_runner_fork(fr_runner *r, int src_seq, int dst_seq);
fr_status fr_runner_set_key_mean(fr_runner *r, const float *key_mean);
/* The forward taps of runner_cpu.h (copied; NULL removes them). The CUDA
 * runner shows layer_kv and layer_q of STEP batches and refuses
 * decode_query. */
fr_status fr_runner_set_observer(fr_runner *r, const fr_forward_observer *obs);
fr_status fr_runner_set_deterministic(fr_runner *r, int on);
/* After the model's host weights changed in place (a weight update). */
fr_status fr_runner_weights_changed(fr_runner *r);
/* Routed-expert replay (docs/deepseek_moe.md, "Routed-expert replay"). With
 * capture on, the experts each MoE layer chose for every token row of a
 * step stay readable until the next step; off (the default) costs nothing
 * (the CUDA runner keeps each layer's choices in any case; the CPU runner
 * copies them only while on). FR_EINVAL for a model without MoE layers. */
fr_status fr_runner_capture_routes(fr_runner *r, int on);
/* out[i][m][k] = the experts MoE layer m (in layer order) chose for token
 * row rows[i] of the last step (token rows in step order, seqs[0]'s first;
 * a decode's row i is sequence i), best first. After a launched decode,
 * only once it has been waited for. */
fr_status fr_runner_routes(fr_runner *r, const int *rows, int n, uint16_t *out);
/* Decode graphs captured and the seconds their first uses took; 0 where
 * there are none (the CPU, NULL). */
void fr_runner_capture_stats(const fr_runner *r, int *captures, double *seconds);
int fr_runner_on_device(const fr_runner *r);
/* The backend's memory op (above); the runner must be idle. */
fr_status fr_runner_memory(fr_runner *r, int release);

/* Whether this build has the CUDA backend (nvcc was present). */
int fr_cuda_built(void);
/* Whether a CUDA device is usable (for --backend auto); 0 in a build
 * without CUDA. */
int fr_cuda_available(void);
/* Why --backend cuda cannot run here: no usable device, or a build
 * without CUDA. */
const char *fr_cuda_absence(void);

#ifdef __cplusplus
}
#endif

#endif
