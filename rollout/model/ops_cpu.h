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
 *   inv_freq_i = 1.0f / powf((float)theta, (float)(2*i) / (float)head_dim)
 *   angle      = (float)pos * inv_freq_i
 *   c = cosf(angle), s = sinf(angle)
 *   out[i]     = x[i] * c - x[i+h] * s
 *   out[i+h]   = x[i+h] * c + x[i] * s
 * (HF's x*cos + rotate_half(x)*sin; the negation in rotate_half is exact.)
 * Note: torch evaluates cos/sin with its own vectorized routines, which may
 * differ from libm's cosf/sinf by an ulp. */
void fr_rope(float *x, int n_heads, int head_dim, int pos, double theta);

/* The cos and sin fr_rope uses at position pos: head_dim/2 values each, so a
 * table or a GPU kernel can reuse exactly the same float32 numbers. */
void fr_rope_cos_sin(float *cos_out, float *sin_out, int head_dim, int pos, double theta);

/* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1.0f + expf(-g)) in float32
 * (torch's CPU SiLU). out may alias gate or up. */
void fr_swiglu(float *out, const float *gate, const float *up, int n);

/* y[M][N] = x[M][K] . W[N][K]^T (a Hugging Face Linear without bias: W is
 * [out_features][in_features], row-major). Through cblas_sgemm (row-major,
 * NoTrans x Trans); M == 1 goes through cblas_sgemv. BLAS does not promise that
 * a row's result is bitwise the same for M == 1 and M > 1. y must not alias x
 * or w. M <= 0 or N <= 0 does nothing; K <= 0 writes zeros. */
void fr_matmul(float *y, const float *x, const float *w, int M, int N, int K);

/* out[t][:] = table[ids[t]][:] for t < n (rows of `hidden` floats). An id
 * outside [0, rows of table) is the caller's bug; the caller validates ids
 * against the vocabulary before calling. A negative id writes a zero row
 * rather than reading out of bounds. */
void fr_embed(float *out, const float *table, const int *ids, int n, int hidden);

#ifdef __cplusplus
}
#endif

#endif
