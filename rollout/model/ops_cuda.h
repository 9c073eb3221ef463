/* ops_cuda: the CUDA ops of the Qwen3 forward pass (everything but attention
 * and the matrix products, which are in gemm_cuda.h).
 *
 * Numbers on the GPU: weights in BF16, the residual stream in float32, matrix
 * product inputs in BF16 (accumulated in FP32). So the ops below read BF16
 * weights, keep the residual stream and q/k in float32, and write BF16 where
 * the result feeds a matrix product. BF16 is stored as uint16_t bit patterns
 * and rounded exactly as fr_bf16_encode (attention/fp_formats.h): round to
 * nearest even, NaN stays a quiet NaN with the same sign and payload top bits.
 *
 * Each op reproduces the float32 arithmetic of its CPU counterpart in
 * rollout/model/ops_cpu.h (same operation order, no fused multiply-adds where the CPU
 * has none), so results differ from the CPU only through summation order and
 * expf: see each function. tests/gpu/test_ops.c checks every op against the
 * CPU op.
 *
 * Conventions: all pointers except the host-side arguments of
 * fr_cuda_rope_table_new are device pointers. Every op enqueues one kernel on
 * `stream` and returns at once: no allocation, no synchronization, so every op
 * may be recorded into a CUDA graph. A bad size or a NULL pointer is FR_EINVAL
 * with a message (nothing is launched); a launch failure is FR_EINTERNAL.
 * Errors inside a kernel surface at the next synchronizing call, as usual.
 * Sizes of zero rows are a no-op.
 *
 * Vectorized paths (16-byte loads and stores) are taken when the row length is
 * a multiple of 8 and the pointers are 16-byte aligned (cudaMalloc gives 256);
 * other sizes and alignments take a scalar path with the same results.
 *
 * Weight layouts the engine builds for these ops (and for gemm_cuda.h):
 *   - gate|up: one [2*inter][hidden] BF16 matrix, rows [0, inter) gate_proj,
 *     rows [inter, 2*inter) up_proj (per tensor-parallel rank: that rank's
 *     gate shard then its up shard). One GEMM then gives [rows][2*inter] with
 *     gate in columns [0, inter) and up in [inter, 2*inter): the input of
 *     fr_cuda_swiglu_rows.
 *   - q|k|v (optional): one [(H + 2*KVH)*head_dim][hidden] matrix, rows q_proj,
 *     then k_proj, then v_proj. The GEMM output [rows][(H + 2*KVH)*head_dim]
 *     feeds fr_cuda_qk_norm_rope_strided with q = out, k = out + H*head_dim,
 *     both with row stride (H + 2*KVH)*head_dim.
 */
#ifndef FR_OPS_CUDA_H
#define FR_OPS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "base/fr_status.h"
#include "rollout/model/model_config.h"

/* Largest head_dim fr_cuda_qk_norm_rope and the RoPE table accept. */
#define FR_CUDA_MAX_HEAD_DIM 512

/* ---- embedding ---------------------------------------------------------- */

/* x[t][:] = float32(table_bf16[ids[t]][:]) for t < n, rows of `hidden`;
 * table_bf16 is [vocab][hidden]. ids are device ints; an id outside
 * [0, vocab) writes a zero row (as fr_embed does for a negative id), which also
 * makes a vocabulary-sharded embedding work: each shard writes zeros for the
 * ids it does not hold, and a sum over shards gives the full embedding.
 * Bit-exact with fr_embed on the decoded table. */
fr_status fr_cuda_embed(float *x, const uint16_t *table_bf16, const int *ids, int n, int hidden,
                        int vocab, cudaStream_t stream);

/* ---- RMSNorm ------------------------------------------------------------ */

/* Per row r < rows of n values:
 *   if delta_or_null:  x += delta            (float32, written back to x:
 *                                              the residual add, in place)
 *   var = mean(x*x)                          (squares rounded to float32,
 *                                              summed in double, the sum
 *                                              rounded to float32, / n in
 *                                              float32: as fr_rmsnorm)
 *   inv = 1 / sqrtf(var + eps)
 *   out = BF16((x * inv) * w)                (float32 products in this order)
 * w_bf16 is [n]. Only the order of the double sum differs from fr_rmsnorm, so
 * the float32 value before the BF16 rounding is the CPU's to within an ulp.
 * out_bf16 may not alias x or delta. Used for the input and post-attention
 * norms of each layer: the result is the BF16 input of the next GEMM. */
fr_status fr_cuda_rmsnorm(uint16_t *out_bf16, float *x, const float *delta_or_null,
                          const uint16_t *w_bf16, int rows, int n, float eps, cudaStream_t stream);

/* The same with a float32 output (for a consumer that wants the normed rows
 * in float32, e.g. hidden states handed out of the engine). out may alias x:
 * then x holds the normed rows (after the residual add, when delta is given). */
fr_status fr_cuda_rmsnorm_f32(float *out, float *x, const float *delta_or_null,
                              const uint16_t *w_bf16, int rows, int n, float eps, cudaStream_t stream);

/* The final norm of the model on selected rows: out_bf16[r] = BF16(RMSNorm(
 * x[row_ids[r]]) * w) for r < n_out, x being [x_rows][n] (not modified).
 * row_ids are device ints; an id outside [0, x_rows) writes a zero row. This is
 * the LM head's BF16 input for the rows that want logits (the last token of
 * each sequence, or every token of a scoring request). */
fr_status fr_cuda_rmsnorm_rows(uint16_t *out_bf16, const float *x, int x_rows, const int *row_ids,
                               int n_out, const uint16_t *w_bf16, int n, float eps,
                               cudaStream_t stream);

/* ---- q/k norm and RoPE -------------------------------------------------- */

/* The RoPE table: cos and sin, each [max_pos][head_dim/2] float32 on the
 * device, row p being fr_rope_cos_sin(head_dim, p, theta, y) computed on the
 * host, so the GPU rotates by exactly the numbers fr_rope uses, YaRN's
 * frequencies and cos/sin factor included (y NULL: plain RoPE; the kernels
 * never compute a frequency). Built once (this one allocates and copies
 * synchronously; not for a captured stream). head_dim even,
 * 2..FR_CUDA_MAX_HEAD_DIM; max_pos >= 1; theta > 0. On failure both are NULL. */
fr_status fr_cuda_rope_table_new(int max_pos, int head_dim, double theta, const fr_rope_scaling *y, float **cos_dev,
                                 float **sin_dev);
/* Frees both and sets them to NULL; accepts NULL pointers. */
void fr_cuda_rope_table_free(float **cos_dev, float **sin_dev);

/* q is [rows][n_heads][head_dim], k is [rows][n_kv_heads][head_dim] (float32,
 * in place). For every head vector of q (weights q_norm_w) and of k (k_norm_w):
 *   RMSNorm over head_dim as fr_rmsnorm (weights BF16 [head_dim]), kept in
 *   float32, then RoPE at position pos[row] as fr_rope (rotate_half pairs i and
 *   i + head_dim/2, out[i] = x[i]*c - x[i+h]*s, out[i+h] = x[i+h]*c + x[i]*s,
 *   each product rounded separately) with c, s from the table of
 *   fr_cuda_rope_table_new (rope_cos, rope_sin, max_pos rows).
 * pos are device ints; a position outside [0, max_pos) writes zero q and k
 * rows for that token (a caller bug made visible, never an out-of-bounds
 * read). head_dim even, <= FR_CUDA_MAX_HEAD_DIM; n_heads, n_kv_heads >= 0 (k
 * and k_norm_w may be NULL when n_kv_heads is 0, likewise for q). */
fr_status fr_cuda_qk_norm_rope(float *q, float *k, const uint16_t *q_norm_w, const uint16_t *k_norm_w,
                               const int *pos, int rows, int n_heads, int n_kv_heads, int head_dim,
                               float eps, const float *rope_cos, const float *rope_sin, int max_pos,
                               cudaStream_t stream);

/* The same with explicit row strides in floats (>= n_heads*head_dim, resp.
 * n_kv_heads*head_dim), e.g. q and k inside the output of one fused q|k|v
 * GEMM (see the layouts at the top). Only the q and k heads are touched. */
fr_status fr_cuda_qk_norm_rope_strided(float *q, size_t q_stride, float *k, size_t k_stride,
                                       const uint16_t *q_norm_w, const uint16_t *k_norm_w,
                                       const int *pos, int rows, int n_heads, int n_kv_heads,
                                       int head_dim, float eps, const float *rope_cos,
                                       const float *rope_sin, int max_pos, cudaStream_t stream);

/* ---- SwiGLU ------------------------------------------------------------- */

/* out_bf16[i] = BF16(silu(gate[i]) * up[i]) for i < n, silu(g) = g / (1 + expf(-g))
 * in float32 as fr_swiglu. The device expf is within 2 ulps of libm's, so the
 * float32 value before rounding is the CPU's to within a few ulps. */
fr_status fr_cuda_swiglu(uint16_t *out_bf16, const float *gate, const float *up, size_t n,
                         cudaStream_t stream);

/* The fused layout: gate_up is [rows][2*inter] (gate in columns [0, inter), up
 * in [inter, 2*inter): the output of one GEMM over the gate|up weight), out_bf16
 * is [rows][inter] (the BF16 input of down_proj). Same arithmetic as above. */
fr_status fr_cuda_swiglu_rows(uint16_t *out_bf16, const float *gate_up, int rows, int inter,
                              cudaStream_t stream);

/* ---- conversion --------------------------------------------------------- */

/* out[i] = fr_bf16_encode(in[i]) for i < n, bit for bit (NaN and infinities
 * included). */
fr_status fr_cuda_f32_to_bf16(uint16_t *out, const float *in, size_t n, cudaStream_t stream);

/* x[i] += d[i] for n floats (the residual add of a tensor-parallel
 * all-reduced partial sum; the sum is exact float32 addition, as the CPU's). */
fr_status fr_cuda_add_f32(float *x, const float *d, size_t n, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
