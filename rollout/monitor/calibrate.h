/* One-time calibration of the FP4 KV cache recipe (paper Appendices B and C):
 * the post-RoPE key mean mu_k and the probability-scale threshold tau, plus
 * per-head FP8 scales, measured on the model's own continuation of a few seed
 * texts (docs/eval.md describes the procedure step by step).
 *
 *  1. Each seed text's first seed_tokens bytes (after BOS) are continued
 *     greedily for continue_tokens tokens, all texts in one batch.
 *  2. Seeds and continuations are joined and tiled into one sequence that
 *     fills the window: BOS, then the joined text repeated, context - tau_steps
 *     tokens in all.
 *  3. One (chunked) prefill of that sequence, then tau_steps greedy decode
 *     steps continuing it, so the sequence covers every position of the window.
 *     mu_k is the mean of the post-RoPE keys of every token of it, per layer,
 *     KV head and channel; the FP8 scales are amax / 448 of its keys and
 *     values per layer and KV head.
 *  4. Every decode step's queries replay online softmax over the BF16 logits
 *     of the pages an FP4 cache would quantize (tiles of 128 keys from token
 *     0, running maximum, NVFP4 probability blocks of 16 with c = 8, the sink
 *     masked); tau is the candidate threshold with the least total squared
 *     error of c p over all those blocks.
 *
 * Texts are token ids, BOS first (fr_text_file_read makes them from files).
 *
 * A multi-head latent attention model (paper Appendix G) caches one row per
 * token, [latent | RoPE key]: key_mean is then the latent mean (the RoPE
 * part zero, as it is never smoothed), both FP8 scales are the latent's
 * amax / 448 per layer, and tau keeps its default (latent attention
 * quantizes no probability, so step 4 measures nothing).
 */
#ifndef FR_CALIBRATE_H
#define FR_CALIBRATE_H

#include "attention/kv_numerics.h"
#include "attention/ref_attention.h"
#include "kvcache/calib_file.h"
#include "rollout/model/model.h"
#include "tokenizer/tokenizer.h"

/* ---- byte texts ---- */

/* Reads a file as token ids for a byte-level model: BOS (cfg->bos_id) followed
 * by one id per byte (id = byte value), at most max_tokens ids (0: the
 * model's context window). Fails when the model has no BOS id or a vocabulary
 * smaller than 256. */
fr_status fr_byte_text_read(const fr_model_config *cfg, const char *path, int max_tokens, int **ids,
                            int *n);
/* Reads a file as the model's token ids through tok: its special tokens
 * added, and the model's BOS first when the tokenizer adds none (the
 * tiling of step 2 and eval-kl start every sequence with it); at most
 * max_tokens ids (0: the model's context window). tok NULL: as
 * fr_byte_text_read (byte-level models, and models without a tokenizer,
 * keep reading bytes). FR_EINVAL for text that is not UTF-8 (the
 * tokenizer's message) or encodes to no token. */
fr_status fr_text_file_read(const fr_model_config *cfg, const fr_tokenizer *tok, const char *path, int max_tokens,
                            int **ids, int *n);

/* ---- tau: the probability-scale threshold (Appendix C) ---- */

/* Candidate thresholds lie on the E4M3 grid: candidate k (k = 0..FR_TAU_CODES-1)
 * sits midway between the E4M3 values of codes k and k+1, so the default
 * 21/1024 is candidate 10 (between 20/1024 and 22/1024). Blocks with
 * c p_max <= tau use kappa 2. The last candidate lies just below 6. */
#define FR_TAU_CODES 76
#define FR_TAU_DEFAULT_CODE 10

float fr_tau_candidate(int code);

/* Squared-error totals for every candidate, accumulated block by block. */
typedef struct {
    double err6;                      /* every block with kappa 6 */
    double diff[FR_TAU_CODES + 1];    /* sum of err2 - err6 of the blocks in bin k: the
                                         smallest candidate k with c p_max <= tau_k
                                         (bin FR_TAU_CODES: above every candidate) */
    long count[FR_TAU_CODES + 1];     /* blocks per bin */
    long blocks;                      /* blocks added (all-zero blocks are skipped) */
} fr_tau_stats;

void fr_tau_stats_init(fr_tau_stats *s);
/* One NVFP4 probability block: cp[16] holds c p_i (c = FR_P_SCALE_C folded
 * in), p_max the block maximum without c. Both kappas are tried through
 * fr_pquant_block; the error is sum_i (deq_i - cp_i)^2. */
void fr_tau_stats_add_block(fr_tau_stats *s, const float *cp, float p_max);
/* Total squared error of c p when tau is candidate `code`. */
double fr_tau_stats_error(const fr_tau_stats *s, int code);
/* The candidate with the least total error; ties go to the candidate nearest
 * FR_TAU_DEFAULT_CODE (the lower one at equal distance). With no block,
 * FR_TAU_DEFAULT_CODE. */
int fr_tau_stats_select(const fr_tau_stats *s);

/* Replays online softmax for one query head q[d] over keys k[n][d]: tiles of
 * `tile` keys from token 0 with a running maximum, logits S = log2(e)/sqrt(d)
 * q.k, keys [0, n_sink) masked (the sink's FP4 copy), blocks of 16 aligned to
 * token multiples of 16; every block with an unmasked key is added to s.
 * scratch holds n floats. */
fr_status fr_tau_replay_query(fr_tau_stats *s, const float *q, const float *k, int n, int d, int n_sink,
                              int tile, float *scratch);

/* ---- the whole calibration ---- */

/* The default window: a full window is what the paper uses, but one prefill of
 * a long window costs minutes on the CPU backend. */
#define FR_CALIB_DEFAULT_CONTEXT 4096

typedef struct {
    int context;          /* calibration window in tokens; 0: the model's window; negative
                             (the default): FR_CALIB_DEFAULT_CONTEXT or the model's window
                             when that is smaller */
    int seed_tokens;      /* bytes of each seed text used as its prompt */
    int continue_tokens;  /* greedy tokens appended to each seed (0: none) */
    int tau_steps;        /* decode steps whose queries calibrate tau (0: keep the default) */
    int chunk;            /* prefill chunk in tokens */
    fr_kv_dtype kv;       /* the cache the passes run with: bf16 or f32 */
    int deterministic;    /* the passes in deterministic mode (docs/determinism.md), on the runner they run on */
    int verbose;          /* progress on stderr */
    /* Non-NULL: the passes run on the CUDA backend with these device weights
     * (rollout/model/weights_cuda.h); NULL: the CPU backend. Both give the same
     * procedure; the taps copy each layer's rows to the host. */
    const struct fr_weights_gpu *gpu;
} fr_calib_opts;

void fr_calib_opts_default(fr_calib_opts *o);

typedef struct {
    int *tokens;          /* the calibration sequence, context tokens: tiled text, then
                             the tau decode tokens */
    int n_tokens;
    int prefill_tokens;   /* the first prefill_tokens of them were prefilled */
    int tau_code;         /* chosen candidate (FR_TAU_DEFAULT_CODE when tau_steps is 0) */
    long tau_blocks;      /* probability blocks the choice saw */
    double tau_err;       /* total squared error of c p at the chosen tau */
    double tau_err_default; /* ... at the default tau */
    double tau_err_by_code[FR_TAU_CODES]; /* ... at every candidate */
    long tau_blocks_by_bin[FR_TAU_CODES + 1]; /* blocks per bin (fr_tau_stats.count) */
    double seconds_seed, seconds_prefill, seconds_tau;
} fr_calib_report;

void fr_calib_report_free(fr_calib_report *r);

/* Runs the calibration on model m with seed texts texts[i][lens[i]] (BOS
 * first). out receives key_mean, tau (has_tau set) and fp8_scales; free it
 * with fr_calib_free. rep (may be NULL) receives the details. */
fr_status fr_calibrate(const fr_model *m, const fr_calib_opts *o, int n_texts, const int *const *texts,
                       const int *lens, fr_calib *out, fr_calib_report *rep);

#endif
