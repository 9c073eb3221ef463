/* Decode attention over an FP4 (NVFP4, MXFP4) or FP8 paged KV cache on
 * Hopper: paper Algorithm 1 at the memory-bandwidth limit.
 *
 * Numerics (docs/formats.md; the CPU reference is attention/ref_attention.h,
 * and these kernels match it split by split up to summation order):
 *  - keys and values are read as the cache stores them (kvcache/page_layout.h,
 *    attention/paged_kv.h): full pages in the dtype's format; with the full
 *    recipe (sink_recent) tokens 0..15 from the BF16 sink slot (their FP4
 *    copy in page 0 masked), the partial page from the BF16 recent slot and
 *    the step's own token from the staging rows, all with the unquantized
 *    query and probabilities; without it (vanilla FP4, and FP8) the partial
 *    page and the step token are quantized on the fly as a page would hold
 *    them (keys per token, values per block of B tokens from the page start,
 *    zero padded);
 *  - on FP4 tokens with fp4_compute exact: the dual-residual (or single) FP4
 *    query, online softmax in base 2 over 128-token tiles (one page), P
 *    quantized per block against the running maximum with the underflow-aware
 *    scale (c folded into exp2), block-scaled P.V; with fp4_compute bf16 the
 *    query and P stay unquantized;
 *  - the quantized region is cut into tile-aligned splits (the plan of
 *    fr_ref_split_range), plus one split for the unquantized tokens; split
 *    outputs carry a base-2 log-sum-exp and a combine kernel joins them.
 *
 * Inputs: q, the post-RoPE query [rows][n_heads][d] float32, NOT rotated: the
 * kernels rotate it when the recipe rotates keys. Output: BF16
 * [rows][n_heads][d] for the o_proj matrix product. Per-sequence lengths and
 * block tables are read from device memory, so a decode step can be
 * captured in a CUDA graph and replayed with new lengths. No allocation, no
 * host synchronization. */
#ifndef FR_ATTN_FP4_H
#define FR_ATTN_FP4_H

#include <stddef.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "paged_kv.h"
#include "ref_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    fr_kv_dtype dtype;        /* FR_KV_NVFP4, FR_KV_MXFP4 or FR_KV_FP8 */
    fr_attn_params p;         /* quantized-math parameters (fr_kv_attn_params); p.tile must be 128 */
    int rotate;               /* keys are Hadamard-rotated: rotate the query too */
    int sink_recent;          /* FP4 only: BF16 sink and recent tokens (full recipe) */
    const float *fp8_scales;  /* FP8 only: device [layers][kv_heads][2] (K, V) */
    int fixed_splits;         /* > 0: decode always cuts a sequence's pages into this many splits (at most
                               * FR_ATTN_FP4_MAX_SPLITS and the pages of max_ctx), so a split's range depends on
                               * the sequence's own length, never on the batch (deterministic mode); a workspace
                               * too small for it is an error instead of a smaller plan */
} fr_attn_fp4_config;

/* The split count of fixed_splits in deterministic mode. */
#define FR_ATTN_FP4_DETERMINISTIC_SPLITS 32

/* Most quantized splits one sequence's pages are cut into. */
#define FR_ATTN_FP4_MAX_SPLITS 256

/* The decode plan of one call, as fr_attn_fp4_decode computes it: the split
 * count (fitted to the workspace) and where the split partials lie in the
 * workspace (for tests that compare split by split):
 *   o   float [n_seqs][n_kv_heads][n_splits + 1][G][head_dim] at o_part_offset,
 *   lse float [n_seqs][n_kv_heads][n_splits + 1][G]           at lse_part_offset;
 * slot i < n_splits is quantized split i of fr_ref_split_range's plan, slot
 * n_splits the BF16 tokens (-inf / 0 without sink_recent). */
typedef struct {
    int n_splits;
    size_t o_part_offset, lse_part_offset;
    size_t bytes;   /* workspace the call uses */
} fr_attn_fp4_plan;

fr_status fr_attn_fp4_plan_for(const fr_attn_fp4_config *cfg, int n_seqs, int n_heads, int n_kv_heads,
                               int head_dim, int max_ctx, size_t workspace_bytes, fr_attn_fp4_plan *plan);

/* Workspace for the split partials and the prepared queries. */
fr_status fr_attn_fp4_workspace_bytes(const fr_attn_fp4_config *cfg, int max_seqs, int n_heads, int n_kv_heads,
                                      int max_ctx, size_t *bytes);

/* Decode attention for n_seqs sequences of one new token each (n_new 0:
 * skipped). max_ctx sizes the split count only. */
fr_status fr_attn_fp4_decode(const fr_attn_fp4_config *cfg, const fr_paged_kv *kv, const fr_paged_seq *seqs_dev,
                             int n_seqs, int max_ctx, const float *q, uint16_t *out, int n_heads, void *workspace,
                             size_t workspace_bytes, cudaStream_t stream);

/* Prefill (chunked) attention over the same cache, for sequences with
 * n_new > 1 (others skipped): causal, GQA, query and probabilities
 * unquantized, keys and values exactly as decode reads them (pages
 * dequantized, sink/recent BF16 or, without sink_recent, the unpaged tokens
 * and the chunk's own rows quantized on the fly) — what the CPU runner's
 * chunk attention computes over fr_kv_gather's view. */
fr_status fr_attn_fp4_prefill(const fr_attn_fp4_config *cfg, const fr_paged_kv *kv, const fr_paged_seq *seqs_dev,
                              int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, int n_heads,
                              void *workspace, size_t workspace_bytes, cudaStream_t stream);
/* Workspace of the prefill path (scratch for on-the-fly tokens). */
fr_status fr_attn_fp4_prefill_workspace_bytes(const fr_attn_fp4_config *cfg, int max_seqs, int max_step_tokens,
                                              int n_heads, int n_kv_heads, size_t *bytes);

#ifdef __cplusplus
}
#endif

#endif
