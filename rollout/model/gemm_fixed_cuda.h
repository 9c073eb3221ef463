/* gemm_fixed_cuda: the deterministic mode's matrix product on the GPU
 * (docs/determinism.md): y[M][N] = x[M][K] . W[N][K]^T (+ beta * y), BF16 in,
 * FP32 accumulation, whose every output y[m][n] is computed by the same
 * sequence of operations whatever M is, which other rows share the call, and
 * which GPU of the same architecture runs it.
 *
 * How: tensor-core MMAs (m16n8k16) with the weight rows as the MMA's M side
 * and the tokens as its N side; an MMA's output element depends only on its
 * own row, column and accumulator, so a token's outputs do not depend on the
 * tokens beside it. K is cut into S slices, S a function of (N, K) only (never
 * of M or of the device's SM count); each slice is summed in increasing k, the
 * slices' partial sums are then added in slice order, and the epilogue is
 * always acc + beta * y, rounded once to the output type.
 *
 * Requirements: K a multiple of 8, x and w 16-byte aligned (rows then are
 * too). The partial sums use the caller's workspace (S x rows x N floats;
 * rows are processed in slices that fit, which changes nothing). Asynchronous,
 * no allocation, safe in CUDA graph capture. */
#ifndef FR_GEMM_FIXED_CUDA_H
#define FR_GEMM_FIXED_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The K slices a product with these N and K is cut into. */
int fr_gemm_fixed_slices(int N, int K);

/* y (float32, or BF16 when out_bf16) = x . w^T + beta * y. ws/ws_bytes: the
 * workspace for the slices' partial sums (at least S x N x 4 bytes when S > 1).
 * Errors: FR_EINVAL (sizes, alignment, a workspace too small for one row),
 * FR_EINTERNAL (launch). */
fr_status fr_gemm_fixed_bf16(void *y, int out_bf16, const uint16_t *x, const uint16_t *w, int M, int N, int K,
                             float beta, void *ws, size_t ws_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
