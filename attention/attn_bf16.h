/* Attention over a BF16 KV cache on the GPU (sm_90a): paged, grouped-query,
 * causal, for decode steps and chunked prefill. docs/attention_gpu.md
 * describes the kernels, the split plan and the workspace.
 *
 * Inputs of one layer:
 *  - kv: where the layer's keys and values are (attention/paged_kv.h): full
 *    pages in blocks (BF16 head page K [128][d] then V [128][d] at k_codes and
 *    v_codes), the partial last page in the sequence's recent slot, and the
 *    step's own tokens in the staging rows step_k / step_v [rows][n_kv_heads][d].
 *  - seqs_dev: n_seqs fr_paged_seq in DEVICE memory (len, n_new, q_row, slot,
 *    block table). Kernels read them, so a captured CUDA graph can be replayed
 *    with new lengths and block tables; a sequence with n_new == 0 is skipped.
 *  - q: float32 [rows][n_heads][d], post-RoPE; query head h uses KV head
 *    h / G, G = n_heads / n_kv_heads (1..16). Rounded to BF16 on load.
 * Output: BF16 [rows][n_heads][d]: token len + i of a sequence (row q_row + i)
 * attends to its tokens [0, len + i] with softmax scale 1/sqrt(d).
 *
 * Sequences with n_new == 1 go through split-KV flash-decoding (partials in
 * the workspace, then a combine kernel); sequences with n_new > 1 through a
 * flash-attention prefill kernel. Both kernels are launched when max_new > 1,
 * so one call serves a mixed step. Everything is asynchronous on `stream`:
 * no allocation, no synchronization, safe to capture in a CUDA graph.
 *
 * head_dim: 64 or 128. All device pointers 16-byte aligned (q and out 8-byte),
 * block and page offsets multiples of 16 bytes.
 *
 * The first call on a device (any of the three functions) sets the kernels'
 * shared-memory limits and reads the SM count; make it before capturing a
 * graph (fr_attn_bf16_workspace_bytes at start-up does it).
 */
#ifndef FR_ATTN_BF16_H
#define FR_ATTN_BF16_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "paged_kv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most splits the decode plan cuts one sequence's context into. */
#define FR_ATTN_BF16_MAX_SPLITS 256

/* The split count the decode kernels use for a call with these bounds on the
 * current device (the same rule fr_attn_bf16 applies before it fits the plan
 * to the workspace): enough (sequence, KV head, split) blocks to fill the GPU,
 * no more than the context needs. 1 means no workspace and no combine. */
fr_status fr_attn_bf16_splits(int n_seqs, int n_kv_heads, int head_dim, int max_ctx, int *n_splits);

/* Workspace bytes that let every call with n_seqs <= max_seqs and the given
 * heads, head_dim and max_ctx run its full split plan on the current device. */
fr_status fr_attn_bf16_workspace_bytes(int max_seqs, int n_heads, int n_kv_heads, int head_dim,
                                       int max_ctx, size_t *bytes);

/* One layer's attention for a step of n_seqs sequences.
 *   max_new  bound on n_new over the sequences (1: a decode step; kernels skip
 *            tokens beyond it, so it must hold);
 *   max_ctx  bound on len + n_new, used only to size the split count: a replay
 *            with longer contexts stays correct, just less parallel.
 * The workspace holds the split partials; when it is smaller than the plan
 * needs, fewer splits are used (down to one, which needs none: workspace may
 * be NULL). Returns FR_EINVAL / FR_EUNSUPPORTED on bad shapes, FR_EINTERNAL on
 * a launch failure. */
fr_status fr_attn_bf16(const fr_paged_kv *kv, const fr_paged_seq *seqs_dev, int n_seqs,
                       int max_new, int max_ctx, const float *q, uint16_t *out, int n_heads,
                       void *workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
