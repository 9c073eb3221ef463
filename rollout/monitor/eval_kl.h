/* Teacher-forced KL against a BF16 KV cache (paper Appendix A), on the CPU
 * backend.
 *
 * A reference pass with a BF16 cache runs every text token by token through
 * the decode path (cache writes and decode attention, one token of every text
 * per step) and records its next-token logits at every position. Each
 * configuration then runs the same tokens the same way with its own cache and
 * numerics; at every position t, D_t = sum over the reference's top-128
 * tokens v of p(v) log(p(v) / q(v)) (fr_kl_topk, Eq. 9). Per text, D_t and
 * the top-1 mismatch are averaged over its positions; the figures of a
 * configuration are the means over texts (paper: steps, then trajectories).
 *
 * Paired t statistics compare each configuration with a baseline: the first
 * FP4 configuration of the list with the same FP4 format, else the first FP4
 * configuration of the list. t_text pairs per-text means (the paper's
 * statistic, n = texts); t_pos pairs D_t position by position (n = all
 * positions; neighbouring positions are correlated, so it overstates
 * significance and serves when there are few texts). docs/eval.md has more.
 */
#ifndef FR_EVAL_KL_H
#define FR_EVAL_KL_H

#include "attention/kv_numerics.h"
#include "kvcache/calib_file.h"
#include "rollout/model/model.h"
#include "rollout/model/tp_shard.h"

typedef struct {
    char name[48];
    fr_kv_dtype kv;
    fr_fp4_compute compute;
    fr_recipe recipe;
} fr_eval_config;

/* Names: bf16, f32, fp8; nvfp4 / mxfp4 (full recipe, exact compute) followed
 * by any of -vanilla (vanilla recipe), -kv (bf16 compute: query and P kept
 * BF16), -no-X with X one of smooth, rotate, search, dual, pscale, sink. */
fr_status fr_eval_config_parse(const char *name, fr_eval_config *out);
/* A one-line description ("NVFP4, full recipe without rotate, exact compute"). */
void fr_eval_config_describe(const fr_eval_config *c, char *buf, int len);
/* The same for a latent cache (multi-head latent attention: one FP8 scale
 * per layer, no probability quantization; docs/mla.md). */
void fr_eval_config_describe_latent(const fr_eval_config *c, char *buf, int len);
/* A comma-separated list (NULL: the default list). With ablation, every
 * plain nvfp4 / mxfp4 entry is followed by its six leave-one-out variants,
 * and a NULL list means "nvfp4". *out is malloc'ed. */
fr_status fr_eval_config_list(const char *list, int ablation, fr_eval_config **out, int *n);

#define FR_EVAL_DEFAULT_CONFIGS "f32,fp8,nvfp4,nvfp4-vanilla,nvfp4-kv,mxfp4,mxfp4-vanilla,mxfp4-kv"

typedef struct {
    fr_eval_config cfg;
    int baseline;          /* index of the baseline configuration, -1: none */
    double kl;             /* nats: mean over texts of the per-text mean D_t */
    double top1_mismatch;  /* fraction, mean over texts */
    double *text_kl;       /* [n_texts] per-text mean D_t, nats */
    double *text_mismatch; /* [n_texts] */
    double *pos_kl;        /* [positions] D_t, text after text */
    long positions;
    double t_text, t_pos;  /* against the baseline; NAN when undefined */
    double seconds;
} fr_eval_result;

typedef struct {
    int n_texts;
    const int *const *texts;   /* token ids, BOS first */
    const int *lens;
    const fr_eval_config *configs;
    int n_configs;
    const fr_calib *calib;     /* NULL: zero key mean, default tau, FP8 scales 1 */
    int verbose;               /* progress on stderr */
    /* Non-NULL: every pass runs on the CUDA backend with these device
     * weights (rollout/model/weights_cuda.h); NULL: the CPU backend. */
    const struct fr_weights_gpu *gpu;
    /* Tensor parallelism on the CPU backend (rollout/model/tp_shard.h): this rank
     * of its engine; NULL or size 1 for one process. Every rank of the engine
     * calls fr_eval_kl alike and gets the same report. */
    const fr_tp *tp;
    /* Deterministic mode (docs/determinism.md), CPU backend only: every
     * text's figures are bitwise the same whatever other texts run beside it
     * (each step batches one token of every text), and at any BLAS thread
     * count or x86-64 CPU. */
    int deterministic;
} fr_eval_kl_params;

typedef struct {
    fr_eval_result *results;   /* [n_configs] */
    int n_configs, n_texts;
    int latent;                /* the model caches latent rows (multi-head latent attention) */
    long positions;
    double seconds_reference;
} fr_eval_kl_report;

fr_status fr_eval_kl(const fr_model *m, const fr_eval_kl_params *p, fr_eval_kl_report *out);
void fr_eval_kl_report_free(fr_eval_kl_report *r);

/* Paired t statistic of a[i] - b[i] over n pairs: mean / (sd / sqrt(n)); NAN
 * when n < 2 or every difference is equal. */
double fr_paired_t(const double *a, const double *b, long n);

#endif
