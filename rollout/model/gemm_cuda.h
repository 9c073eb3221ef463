/* gemm_cuda: the matrix products of the forward pass on the GPU (cuBLASLt).
 *
 *   y[M][N] = x[M][K] . W[N][K]^T  (+ beta * y)
 *
 * row-major, as fr_matmul (a Hugging Face Linear without bias: W is
 * [out_features][in_features]); x and W in BF16 (uint16_t bit patterns), the
 * products exact in FP32 and summed in FP32 (CUBLAS_COMPUTE_32F: no reduced
 * precision modes), y in float32 (fr_gemm_bf16) or BF16 (fr_gemm_bf16_out, the
 * FP32 result rounded once to nearest even).
 *
 * beta = 1 adds the product to y in place: the residual add of o_proj and
 * down_proj fused into the GEMM (y is then the float32 residual stream).
 * beta = 0 overwrites y without reading it (y may hold garbage or NaN).
 *
 * An fr_gemm holds a cuBLASLt handle, a device workspace allocated once, and a
 * cache of prepared plans (matmul and layout descriptors plus the algorithm the
 * heuristic chose), one per (M, N, K, output type, pointer alignment). The first
 * call of a shape runs the heuristic on the host; later calls of that shape do
 * no search and no allocation, only the cuBLASLt launch, so they may be
 * recorded into a CUDA graph. fr_gemm_prepare() runs the first call's work
 * ahead of time (e.g. for every batch size a graph will be captured for).
 * Decode repeats the same few shapes every step; the cache holds
 * FR_GEMM_MAX_PLANS plans and is emptied wholesale when full.
 *
 * An fr_gemm is not thread-safe and its workspace is shared by its calls: use
 * one per stream (or order the streams that share it).
 *
 * Alignment: plans are chosen for the actual alignment of x, W and y (up to
 * 256 bytes, what cudaMalloc gives), so sub-views of larger buffers work.
 */
#ifndef FR_GEMM_CUDA_H
#define FR_GEMM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "base/fr_status.h"

typedef struct fr_gemm fr_gemm;

/* How a product's reduction order is chosen:
 *   FR_GEMM_FAST    cuBLASLt's heuristic per (M, N, K): the fastest plan, but
 *                   the kernel, its tiles and its split-K change with M, so a
 *                   row's bits depend on how many rows share the call;
 *   FR_GEMM_FIXED   the project's fixed-order kernel (gemm_fixed_cuda.h): a
 *                   row's bits do not depend on M (deterministic mode);
 *   FR_GEMM_PINNED  cuBLASLt with one algorithm per (N, K, output, alignment),
 *                   the heuristic's choice at M = FR_GEMM_PIN_M with split-K
 *                   forced off, used for every M: a fixed kernel and tile
 *                   shape, so a row's reduction order does not depend on M
 *                   (cuBLASLt does not document it; tests/gpu checks it on
 *                   the engine's shapes). Deterministic mode's default: as
 *                   fast as FR_GEMM_FAST (bench/RESULTS.md). The algorithm
 *                   depends on the GPU model and the cuBLAS version. */
typedef enum { FR_GEMM_FAST = 0, FR_GEMM_FIXED = 1, FR_GEMM_PINNED = 2 } fr_gemm_mode;
#define FR_GEMM_PIN_M 64

#define FR_GEMM_DEFAULT_WORKSPACE ((size_t)32 << 20)   /* 32 MiB */
#define FR_GEMM_MAX_PLANS 512

/* A GEMM context on the current device with a workspace of workspace_bytes
 * (0: FR_GEMM_DEFAULT_WORKSPACE). On failure *out is NULL. */
fr_status fr_gemm_new(size_t workspace_bytes, fr_gemm **out);

/* Frees the workspace, the plans and the handle (waits for the device as
 * cudaFree does); sets *g = NULL; accepts NULL and *g == NULL. */
void fr_gemm_destroy(fr_gemm **g);

/* Sets the mode of later calls (plans of other modes stay cached). */
fr_status fr_gemm_set_mode(fr_gemm *g, fr_gemm_mode mode);
fr_gemm_mode fr_gemm_get_mode(const fr_gemm *g);

/* y (float32 [M][N]) = x (BF16 [M][K]) . w (BF16 [N][K])^T + beta * y.
 * M, N >= 0 (0 is a no-op), K >= 1; y must not alias x or w. Asynchronous on
 * stream. Errors: bad sizes or NULL pointers FR_EINVAL; no algorithm for the
 * shape FR_EUNSUPPORTED; a cuBLASLt failure FR_EINTERNAL with its status name. */
fr_status fr_gemm_bf16(fr_gemm *g, float *y, const uint16_t *x_bf16, const uint16_t *w_bf16, int M, int N,
                       int K, float beta, cudaStream_t stream);

/* The same with a BF16 y (beta * y read in BF16, the sum rounded once). */
fr_status fr_gemm_bf16_out(fr_gemm *g, uint16_t *y_bf16, const uint16_t *x_bf16, const uint16_t *w_bf16, int M,
                           int N, int K, float beta, cudaStream_t stream);

/* A strided-batched product: for b < batch,
 *   y_b = x_b . op(w_b) + beta * y_b
 * with x_b = x + b * x_stride ([M][K], rows ldx apart), y_b = y + b * y_stride
 * ([M][N], rows ldy apart), w_b = w + b * w_stride, op(w_b) = w_b^T for w_b
 * [N][K] (w_trans 1, as fr_gemm_bf16) or w_b itself for w_b [K][N] (w_trans
 * 0), rows ldw apart. Leading dimensions and strides count elements; y is
 * float32 or, with y_bf16, BF16 (rounded once). Latent attention's per-head
 * products (the absorbed query, W_UV) run as one call this way. Plans are
 * cached as for the plain products (one per shape, strides and alignments),
 * so a repeated call may be captured into a graph. FR_EUNSUPPORTED in
 * FR_GEMM_FIXED mode. */
typedef struct {
    int M, N, K, batch;
    int w_trans;
    int y_bf16;
    long long ldx, ldw, ldy;
    long long x_stride, w_stride, y_stride;
} fr_gemm_batch;

fr_status fr_gemm_bf16_batched(fr_gemm *g, const fr_gemm_batch *b, void *y, const uint16_t *x_bf16,
                               const uint16_t *w_bf16, float beta, cudaStream_t stream);

/* Builds (or finds) the plan the call with these arguments would use, without
 * launching anything. Pointers only matter through their alignment; NULL means
 * 256-byte aligned (a cudaMalloc'ed buffer). */
fr_status fr_gemm_prepare(fr_gemm *g, int M, int N, int K, int bf16_out, const void *y, const void *x_bf16,
                          const void *w_bf16);

/* Counters for tests and logs: plans now cached, heuristic searches run since
 * fr_gemm_new, and times the cache was emptied because it was full. */
typedef struct {
    int plans;
    long searches;
    long flushes;
} fr_gemm_stats;
fr_gemm_stats fr_gemm_get_stats(const fr_gemm *g);

/* The name of a cublasStatus_t value ("CUBLAS_STATUS_NOT_SUPPORTED", ...; the
 * number for an unknown one). The argument is the status as an int so this
 * header does not need cuBLAS. */
const char *fr_cublas_status_str(int status);

#ifdef __cplusplus
}
#endif

#endif
