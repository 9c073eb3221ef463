/* ops_cpu: the float32 CPU reference ops of the Qwen3 forward pass.
 *
 * Each op reproduces the arithmetic of Hugging Face transformers' Qwen3 (run in
 * float32 on the CPU) as closely as float32 allows: same operation order, same
 * float32 roundings, no fused multiply-adds (the build uses -ffp-contract=off).
 * Where torch's exact summation order cannot be matched (reductions), the sum
 * is taken in double and rounded once, which lands within an ulp of torch.
 *
 * These are the ground truth the CUDA ops are checked against. The functions
 * trust their arguments (sizes positive, buffers large enough); the callers
 * validate requests at their own public boundary.
 */
#ifndef FR_OPS_CPU_H
#define FR_OPS_CPU_H

#include <stddef.h>

#include "rollout/model/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Qwen3RMSNorm, per row r < rows of n values:
 *   var = mean(x*x)          (squares rounded to float32, summed in double,
 *                             the sum rounded to float32, then / n in float32,
 *                             as torch's CPU mean = sum then divide)
 *   inv = 1 / sqrtf(var + eps)
 *   out = (x * inv) * w      (float32, in this order, as HF)
 * out may alias x (in place). */
void fr_rmsnorm(float *out, const float *x, const float *w, int rows, int n, float eps);

/* RoPE, Hugging Face "rotate_half" convention (the first and second halves of
 * a head are the pair), for n_heads rows of head_dim floats at position pos,
 * in place. head_dim must be even. For i < h = head_dim/2, in float32:
 *   inv_freq_i = rollout/model/rope_yarn.h's (plain RoPE:
 *                1.0f / powf((float)theta, (float)(2*i) / (float)head_dim))
 *   angle      = (float)pos * inv_freq_i
 *   c = cosf(angle), s = sinf(angle), each times (float)attention_factor
 *       with YaRN (transformers' attention_scaling; not multiplied at all
 *       for plain RoPE)
 *   out[i]     = x[i] * c - x[i+h] * s
 *   out[i+h]   = x[i+h] * c + x[i] * s
 * (HF's x*cos + rotate_half(x)*sin; the negation in rotate_half is exact.)
 * y is the model's RoPE scaling; NULL means plain RoPE.
 * Note: torch evaluates cos/sin with its own vectorized routines, which may
 * differ from a correctly rounded cos/sin by an ulp. cos and sin (and powf) are
 * the engine's own (base/fixed_math.h), the same bits on every CPU. */
void fr_rope(float *x, int n_heads, int head_dim, int pos, double theta, const fr_rope_scaling *y);

/* The cos and sin fr_rope uses at position pos: head_dim/2 values each, so a
 * table or a GPU kernel can reuse exactly the same float32 numbers. */
void fr_rope_cos_sin(float *cos_out, float *sin_out, int head_dim, int pos, double theta, const fr_rope_scaling *y);

/* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1.0f + expf(-g)) in float32
 * (torch's CPU SiLU), expf being base/fixed_math.h's. out may alias gate or
 * up. */
void fr_swiglu(float *out, const float *gate, const float *up, int n);

/* y[M][N] = x[M][K] . W[N][K]^T (a Hugging Face Linear without bias: W is
 * [out_features][in_features], row-major). Through cblas_sgemm (row-major,
 * NoTrans x Trans); M == 1 goes through cblas_sgemv. BLAS does not promise that
 * a row's result is bitwise the same for M == 1 and M > 1. y must not alias x
 * or w. M <= 0 or N <= 0 does nothing; K <= 0 writes zeros. */
void fr_matmul(float *y, const float *x, const float *w, int M, int N, int K);

/* The deterministic mode's matmul (docs/determinism.md): the same y as
 * fr_matmul up to rounding, but every y[m][n] is fr_dot_fixed(x[m], W[n], K),
 * a sum whose order depends on K alone, never on M, N, the blocking, the
 * thread count or the CPU: a row of x gives bitwise the same outputs alone or
 * inside any batch. Single-threaded; no CPU dispatch. */
void fr_matmul_fixed(float *y, const float *x, const float *w, int M, int N, int K);

/* sum_k x[k] * w[k] in the fixed order: eight lanes, lane j summing indices
 * k = j (mod 8) in increasing k (the K mod 8 trailing products added last to
 * lanes 0..), then ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). 0 for K <= 0. */
float fr_dot_fixed(const float *x, const float *w, int K);

/* out[i] = fr_dot_fixed(rows + i * ld, v, K) for i < n_rows, bitwise, four
 * rows at a time (attention's scores against a run of keys). */
void fr_dot_fixed_rows(float *out, const float *rows, size_t ld, int n_rows, const float *v, int K);

/* y[j] += a * x[j] for j < n: each element on its own (one rounding of the
 * product, one of the sum), so vector width does not change a bit. */
void fr_axpy(float *y, float a, const float *x, int n);

/* out[t][:] = table[ids[t]][:] for t < n (rows of `hidden` floats). An id
 * outside [0, rows of table) is the caller's bug; the caller validates ids
 * against the vocabulary before calling. A negative id writes a zero row
 * rather than reading out of bounds. */
void fr_embed(float *out, const float *table, const int *ids, int n, int hidden);

#ifdef __cplusplus
}
#endif

#endif
