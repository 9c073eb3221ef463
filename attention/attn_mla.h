/* Multi-head latent attention (DeepSeek-V3) over a paged latent cache on
 * Hopper: decode and prefill rows in one kernel (paper Appendix G,
 * Algorithm 2; docs/mla.md and docs/formats.md, "Latent pages").
 *
 * What it computes, for every query row (a token of a sequence and a head):
 *   s_t = scale * (q_c . c'_t + q_r . r_t)   over the row's visible tokens
 *   o   = sum_t softmax(s)_t c'_t, rotated back (Hadamard) and the latent
 *         mean added when the cache stores c' = H (c - mean)
 * where q_c is the absorbed content query (W_UK^T q_nope, computed by the
 * caller, NOT rotated: the kernel rotates it when the cache's latents are
 * rotated) and q_r the RoPE query. The caller applies W_UV to o.
 *
 * Every latent page is read once per group of 64 query rows (all heads of a
 * token up to 64; DeepSeek-V3's 128 heads make two groups, which read the
 * same page close together in time, so the second read is an L2 hit); the
 * same dequantized tile serves both products (no V half). Products run on
 * BF16 tensor cores with FP32 accumulation:
 *  - FP4 pages' tokens (paged, past the sink with sink_recent): the content
 *    query as the recipe's terms, each exact in BF16 (dual-residual: two
 *    terms, two products; single; or BF16-rounded in bf16 compute), the RoPE
 *    query rounded to BF16; FP4 codes times their block scales are exact in
 *    BF16, so only the summation order differs from the CPU's float32;
 *  - every other token (BF16 pages and slots, FP8, sink, recent, the step's
 *    own rows): the query rounded to BF16; without sink_recent (vanilla FP4,
 *    FP8) the unpaged tokens are quantized on the fly as a page would hold
 *    them, and FP4 ones meet the FP4 query terms (kv_cache.c's view);
 *  - FP8 latents enter as their E4M3 values (exact in BF16) with the layer's
 *    scale applied to the scores and to the output;
 *  - probabilities in BF16 for the context product (never FP4-quantized).
 * The paged tokens are cut into page-aligned splits and the last split also
 * takes the unpaged tokens; split outputs carry a log-sum-exp and a combine
 * kernel joins them, rotates back, adds the mean and writes BF16.
 *
 * Per-sequence lengths and block tables come from device memory and the
 * launch shape only from (n_seqs, max_new, max_ctx), so a decode step can be
 * captured in a CUDA graph and replayed. No allocation, no host sync. */
#ifndef FR_ATTN_MLA_H
#define FR_ATTN_MLA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "paged_kv.h"
#include "ref_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One layer's latent cache as the kernel reads it (device pointers).
 * Token t of a sequence (fr_paged_seq: len cached, n_new in this step):
 *   t < len / 128 * 128   page t / 128 in block block_table[t / 128], at
 *                         layer * page_bytes inside the block
 *                         (sink_recent: tokens 0..15 from the sink slot)
 *   then t < len          recent slot row t % 128
 *   then t < len + n_new  the step's staging row q_row + (t - len)
 * Rows everywhere are [latent_dim | rope_dim] BF16 in store form. The
 * slots of sequence slot s, layer l:
 *   recent + s * slot_elems + l * 128 * row   ([128][row] BF16)
 *   sink   + s * sink_elems + l * 16 * row    ([16][row] BF16)
 * with row = latent_dim + rope_dim (one half: a latent has no V). */
typedef struct {
    const uint8_t *pool;
    size_t block_bytes;          /* page_bytes * n_layers */
    size_t page_bytes;           /* one layer's latent page (kvcache/page_layout.h) */
    size_t codes, scales, rope;  /* offsets inside a page (fr_page_layout_latent's k_codes, k_scales, rope) */
    const uint16_t *recent, *sink;
    size_t slot_elems, sink_elems;
    const uint16_t *step_rows;   /* [rows][row] BF16, this layer's step tokens */
    int layer;
} fr_latent_kv;

typedef struct {
    fr_kv_dtype dtype;        /* FR_KV_BF16, FR_KV_FP8, FR_KV_NVFP4 or FR_KV_MXFP4 */
    int n_heads;              /* query heads of this rank */
    int latent_dim, rope_dim; /* d_c (a multiple of 64 from 128 to 512; a power of two to rotate) and d_r (64) */
    float scale;              /* softmax scale, 1 / sqrt(qk_nope + qk_rope) */
    int rotate;               /* latents stored Hadamard-rotated (FP4 recipe) */
    const float *mean;        /* device [latent_dim]: the latent mean subtracted before storing, or NULL */
    int sink_recent;          /* FP4 full recipe: sink and recent tokens BF16 */
    fr_qquant_mode q_mode;    /* FP4 pages: the content query's terms (exact compute) */
    int q_search;             /* scale search for the query terms */
    int q_bf16;               /* FP4 pages: the content query rounded to BF16 (bf16 compute) */
    float fp8_scale;          /* FP8: the layer's latent scale (1 without calibration) */
} fr_attn_mla_config;

/* Most paged splits one sequence is cut into. */
#define FR_ATTN_MLA_MAX_SPLITS 64

typedef struct {
    int n_splits;       /* paged splits (the unpaged split comes on top) */
    int row_groups;     /* groups of 64 query rows per sequence: ceil(max_new * n_heads / 64) */
    size_t bytes;       /* workspace the call uses */
} fr_attn_mla_plan;

/* The plan of one call: split count fitted to the workspace (and to the
 * parallelism the call already has). */
fr_status fr_attn_mla_plan_for(const fr_attn_mla_config *cfg, int n_seqs, int max_new, int max_ctx,
                               size_t workspace_bytes, fr_attn_mla_plan *plan);

/* Workspace for up to max_seqs sequences of max_new rows each (the split
 * partials; the queries are prepared in shared memory) at the largest useful
 * split count for max_ctx. */
fr_status fr_attn_mla_workspace_bytes(const fr_attn_mla_config *cfg, int max_seqs, int max_new, int max_ctx,
                                      size_t *bytes);

/* Attention of every row of n_seqs sequences (n_new tokens each, up to
 * max_new; n_new 0: skipped): decode (n_new 1) and chunked prefill alike,
 * causal. q: float32 [step rows][n_heads][latent_dim + rope_dim] (absorbed
 * content query, then RoPE query); out: BF16 [step rows][n_heads][latent_dim].
 * max_ctx bounds len + n_new of every sequence. */
fr_status fr_attn_mla(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs_dev,
                      int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, void *workspace,
                      size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
