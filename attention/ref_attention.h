/* Reference decode attention: paper Algorithm 1 in plain C, for one query
 * token and the G query heads that share one KV head.
 *
 * Two layers:
 *  - fr_ref_attn_partial / fr_ref_attn_combine work on keys and values as
 *    the cache stores them (dequantized to float) and follow lines 6-17 of
 *    Algorithm 1 tile by tile: online softmax in base 2 with a running maximum,
 *    P blocks quantized against the running maximum, split-KV partial outputs
 *    with their log-sum-exp, and the combine. GPU kernels are checked against
 *    these split by split.
 *  - fr_ref_decode runs all of Algorithm 1 from raw post-RoPE q, K, V:
 *    smoothing, rotation, K and V quantization (lines 1-5), then the splits.
 *
 * Logits are S = gamma * q.k with gamma = log2(e) / sqrt(d), so exp2 gives the
 * softmax; every log-sum-exp here is base 2: lse = log2(sum_i 2^S_i).
 */
#ifndef FR_REF_ATTENTION_H
#define FR_REF_ATTENTION_H

#include "kv_numerics.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The widest cache row: DeepSeek-V3's latent row, 512 + 64 (an MLA model's
 * "head" is its latent row: rollout/model/model_config.h). */
#define FR_MAX_HEAD_DIM 576
#define FR_MAX_GROUP 16

typedef enum { FR_Q_UNQUANTIZED = 0, FR_Q_SINGLE, FR_Q_DUAL } fr_qquant_mode;

/* How the quantized-math tokens (the FP4 pages) are computed. Tokens outside
 * them (BF16 sink and recent, or every token of a BF16/FP8 cache) always use
 * the unquantized query and unquantized probabilities. */
typedef struct {
    int head_dim;            /* d, at most 256 */
    int group;               /* G, 1..16 */
    int tile;                /* B_k keys per online-softmax step, a multiple of 32 */
    fr_fp4_format fmt;       /* format of the quantized query and P */
    fr_qquant_mode q_mode;
    int q_search;            /* scale search for the query terms */
    int quantize_p;          /* 0: P stays unquantized */
    fr_pquant_params p;      /* c, tau, rule (when quantize_p) */
    /* Analysis only (recipe switch rowmax): fr_ref_attn_decode quantizes P
     * blocks against each row's final maximum over every split (the
     * quantized splits' logits with the quantized query, the others' with
     * the plain one) instead of the running maximum; fr_ref_attn_partial
     * alone ignores it. Smaller p, more underflow: the worst case. */
    int p_row_max;
} fr_attn_params;

/* Keys and values of one KV head as stored, and which tokens are where:
 * [0, n_sink) BF16 sink, [n_sink, fp4_end) quantized pages, [fp4_end, n) BF16
 * recent. The pages start at token 0, so the sink's quantized copy in the
 * first page is masked. BF16 and FP8 caches use n_sink = fp4_end = 0. */
typedef struct {
    int n_tokens;
    const float *k;          /* [n_tokens][d], mean-subtracted and rotated as stored */
    const float *v;          /* [n_tokens][d] */
    int n_sink;
    int fp4_end;
} fr_kv_view;

/* Attention over tokens [t0, t1) except the masked window [x0, x1).
 * quantized != 0 applies the quantized query and P of p (Algorithm 1); q is
 * the unquantized query [G][d] (already rotated when the keys are). Writes
 * the normalized partial output o[G][d] and lse[G]; a split with no token
 * gives o = 0 and lse = -inf. t0 must be a multiple of p->tile. */
fr_status fr_ref_attn_partial(const fr_attn_params *p, const float *q, const fr_kv_view *kv,
                              int t0, int t1, int x0, int x1, int quantized, float *o,
                              float *lse);

/* Joins n partial outputs: o = sum_i 2^(lse_i - L) o_i with L = log2 sum 2^lse_i. */
fr_status fr_ref_attn_combine(int n, int group, int head_dim, const float *o_parts,
                              const float *lse_parts, float *o, float *lse);

/* The split plan the engine's kernels share: the quantized region
 * [0, fp4_end) is cut into n_splits tile-aligned ranges (some may be empty),
 * and one more split covers the unquantized tokens. fr_ref_split_range gives
 * split i's token range and masked window; i == n_splits is that last split. */
void fr_ref_split_range(const fr_kv_view *kv, int tile, int n_splits, int i, int *t0, int *t1,
                        int *x0, int *x1);

/* All splits of the plan, then the combine. */
fr_status fr_ref_attn_decode(const fr_attn_params *p, const float *q, const fr_kv_view *kv,
                             int n_splits, float *o, float *lse);

/* ---- Algorithm 1 from raw tensors ---- */

typedef struct {
    fr_kv_dtype kv_dtype;
    fr_fp4_compute compute;
    fr_recipe recipe;
    float tau;               /* P threshold, FR_P_TAU unless calibrated */
    float fp8_k_scale;       /* FP8 per-head scales (value = scale * E4M3) */
    float fp8_v_scale;
    int tile;                /* B_k */
} fr_ref_config;

/* Sensible defaults for a dtype: full recipe, exact compute, tile 128,
 * FP8 scales 1. */
fr_ref_config fr_ref_config_default(fr_kv_dtype t);

/* The attention parameters the config implies for head_dim d and group G. */
fr_attn_params fr_ref_attn_params(const fr_ref_config *cfg, int head_dim, int group);

/* Lines 1-5 of Algorithm 1 for a cache of n tokens: keys minus mu (when
 * smoothing; mu may be NULL for zero), rotated (when rotating), then stored
 * as the dtype says: FP4 tokens per token along d, values per block of
 * B tokens along the token axis (a trailing partial block padded with
 * zeros), sink and recent tokens rounded to BF16, FP8 with the per-head
 * scales. k_out and v_out receive the dequantized stored values; view is
 * filled to match (its k/v point at k_out/v_out). */
fr_status fr_ref_prepare_kv(const fr_ref_config *cfg, int head_dim, int n, const float *k,
                            const float *v, const float *mu, float *k_out, float *v_out,
                            fr_kv_view *view);

/* The query as the kernel receives it: rotated when the recipe rotates
 * (q[G][d] -> q_out), unquantized; fr_ref_attn_partial quantizes it. */
fr_status fr_ref_prepare_query(const fr_ref_config *cfg, int head_dim, int group, const float *q,
                               float *q_out);

#ifdef __cplusplus
}
#endif

#endif
