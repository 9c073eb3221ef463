/* Attention of the deterministic mode over a BF16 paged KV cache on the GPU
 * (docs/determinism.md): one path for decode tokens and prefill tokens, whose
 * result for a token depends on nothing but the token's position and the
 * keys and values before it.
 *
 * The token at position p (row r of the step: token len + i of its sequence,
 * r = q_row + i) attends to keys 0..p, wherever they are (paged_kv.h: pages,
 * the recent slot, the step's staging rows: all BF16, the same bits in each).
 * The keys are cut into splits of FR_ATTN_FIXED_SPLIT_KEYS aligned to
 * position 0, each split into tiles of 128: a plan fixed by p alone, never by
 * the batch or the GPU's occupancy. A split's partial output is the online
 * softmax over its tiles in order, each score a dot product summed in
 * increasing dimension, each tile's weights summed in a fixed tree, each
 * output element summed over the keys in increasing position; the combine
 * adds the splits in split order. Every operation is a plain float operation
 * in a fixed order, so a token's output is bitwise the same alone, in a
 * batch, in a prefill chunk of any size, or recomputed after preemption.
 * Tokens of one prefill chunk share the kernel's loads of keys and values
 * (up to 32 query rows a block), so a chunk costs what flash attention's
 * loads do, not one pass over the context per token.
 *
 * q: float32 [rows][n_heads][d], post-RoPE, rounded to BF16 on load (as
 * attn_bf16.h does); out: BF16 [rows][n_heads][d]. head_dim 64 or 128; the
 * group G = n_heads / n_kv_heads from 1 to 16. Rows that belong to
 * no sequence of seqs_dev (n_new == 0, padding) are left unwritten.
 * Asynchronous, no allocation, safe in CUDA graph capture. */
#ifndef FR_ATTN_FIXED_H
#define FR_ATTN_FIXED_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "paged_kv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_ATTN_FIXED_SPLIT_KEYS 256

/* Workspace for the split partials of rows_per_launch rows of contexts up
 * to max_ctx tokens; fr_attn_fixed runs a step's rows in launches of as many
 * rows as the workspace holds.
 * Also prepares the kernels on the current device (their shared-memory
 * limit): call it once before the first fr_attn_fixed and before capturing a
 * graph. */
fr_status fr_attn_fixed_workspace_bytes(int n_heads, int head_dim, int max_ctx, int rows_per_launch,
                                        size_t *bytes);

/* One layer's attention for rows [0, n_rows) of a step of n_seqs sequences;
 * max_new bounds n_new (1: a decode step), max_ctx bounds len + n_new (the
 * workspace's layout; a replay with longer contexts must stay below it). */
fr_status fr_attn_fixed(const fr_paged_kv *kv, const fr_paged_seq *seqs_dev, int n_seqs, int n_rows, int max_new,
                        int max_ctx, const float *q, uint16_t *out, int n_heads, void *workspace,
                        size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
