/* The deterministic mode's GEMM: see gemm_fixed_cuda.h. */
#include "rollout/model/gemm_fixed_cuda.h"

#include <cuda_bf16.h>

#include "attention/attn_fp4_ptx.cuh"

namespace {

constexpr int kWarps = 4;        /* warps per block; a warp owns 16 output columns */
constexpr int kChunk = 32;       /* k values per step of a lane's loads (two MMAs) */
constexpr int kBlocksTarget = 256;
constexpr int kMaxSlices = 16;

__device__ __forceinline__ uint4 load16(const uint16_t *p, bool ok)
{
    return ok ? __ldg(reinterpret_cast<const uint4 *>(p)) : make_uint4(0, 0, 0, 0);
}

/* A lane loads 8 contiguous k values (16 bytes) of its two weight rows and of
 * its token; the first MMA of a 32-wide chunk takes values 0-3 of those 8, the
 * second 4-7. The k order inside the MMAs is then a permutation of memory
 * order, the same for weights and tokens, and the same for every call. */
__device__ __forceinline__ void mma_chunk(float (&c)[4], const uint4 &lo, const uint4 &hi, const uint4 &b)
{
    fr_fp4_ptx::mma_bf16(c, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
    fr_fp4_ptx::mma_bf16(c, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

struct Args {
    const uint16_t *w, *x;
    int M, N, K, slices, chunks;
    float beta;
    int out_bf16;
    void *y;         /* the output when slices == 1 */
    float *part;     /* [slices][M][N] otherwise */
};

__device__ __forceinline__ void epilogue(const Args &a, int m, int n, float acc)
{
    const size_t i = (size_t)m * a.N + n;
    if (a.out_bf16) {
        uint16_t *y = static_cast<uint16_t *>(a.y) + i;
        const float prev = a.beta != 0.0f ? __fmul_rn(a.beta, __bfloat162float(__ushort_as_bfloat16(*y))) : 0.0f;
        *y = __bfloat16_as_ushort(__float2bfloat16_rn(a.beta != 0.0f ? __fadd_rn(acc, prev) : acc));
    } else {
        float *y = static_cast<float *>(a.y) + i;
        *y = a.beta != 0.0f ? __fadd_rn(acc, __fmul_rn(a.beta, *y)) : acc;
    }
}

/* Warp w of block x owns output columns n0 = (x * kWarps + w) * 16 .. + 15
 * (MMA rows g and g + 8 of lane g * 4 + q) and slice blockIdx.y of the
 * chunks; it runs over the tokens NT x 8 at a time. */
template <int NT, int U>
__global__ void __launch_bounds__(kWarps * 32) fixed_kernel(Args a)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int n0 = (blockIdx.x * kWarps + warp) * 16;
    if (n0 >= a.N) return;
    const int s = blockIdx.y;
    const int c0 = (int)((long)a.chunks * s / a.slices), c1 = (int)((long)a.chunks * (s + 1) / a.slices);
    const bool lo_ok = n0 + g < a.N, hi_ok = n0 + g + 8 < a.N;
    const uint16_t *w_lo = a.w + (size_t)(lo_ok ? n0 + g : 0) * a.K;
    const uint16_t *w_hi = a.w + (size_t)(hi_ok ? n0 + g + 8 : 0) * a.K;
    for (int m0 = 0; m0 < a.M; m0 += NT * 8) {
        const uint16_t *xr[NT];
        bool x_ok[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int m = m0 + t * 8 + g;
            x_ok[t] = m < a.M;
            xr[t] = a.x + (size_t)(x_ok[t] ? m : 0) * a.K;
        }
        float c[NT][4];
#pragma unroll
        for (int t = 0; t < NT; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
        for (int ch = c0; ch < c1; ch += U) {
            /* U chunks of weights in flight; the tokens' values (a few KB,
             * cached) are loaded chunk by chunk. */
            uint4 lo[U], hi[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int k = (ch + u) * kChunk + q * 8;
                const bool in = ch + u < c1 && k < a.K;
                lo[u] = load16(w_lo + k, in && lo_ok);
                hi[u] = load16(w_hi + k, in && hi_ok);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int k = (ch + u) * kChunk + q * 8;
                const bool in = ch + u < c1 && k < a.K;
                uint4 b[NT];
#pragma unroll
                for (int t = 0; t < NT; t++) b[t] = load16(xr[t] + k, in && x_ok[t]);
#pragma unroll
                for (int t = 0; t < NT; t++) mma_chunk(c[t], lo[u], hi[u], b[t]);
            }
        }
        /* Lane (g, q) holds, for n-tile t, columns n0 + g (c[t][0..1]) and
         * n0 + g + 8 (c[t][2..3]) of tokens m0 + t * 8 + 2q and + 1. */
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int m = m0 + t * 8 + 2 * q + j;
                if (m >= a.M) continue;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int n = n0 + g + 8 * h;
                    if (n >= a.N) continue;
                    const float v = c[t][2 * h + j];
                    if (a.slices == 1) epilogue(a, m, n, v);
                    else a.part[((size_t)s * a.M + m) * a.N + n] = v;
                }
            }
    }
}

/* The slices' partial sums added in slice order, then the epilogue. */
__global__ void reduce_kernel(Args a)
{
    const size_t total = (size_t)a.M * a.N;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        float acc = a.part[i];
        for (int s = 1; s < a.slices; s++) acc = __fadd_rn(acc, a.part[(size_t)s * total + i]);
        epilogue(a, (int)(i / a.N), (int)(i % a.N), acc);
    }
}

void launch(const Args &a, cudaStream_t stream)
{
    const dim3 grid((a.N + 16 * kWarps - 1) / (16 * kWarps), a.slices);
    /* Only the registers change with M: a token's operations do not. */
    if (a.M <= 8) fixed_kernel<1, 8><<<grid, kWarps * 32, 0, stream>>>(a);
    else if (a.M <= 16) fixed_kernel<2, 8><<<grid, kWarps * 32, 0, stream>>>(a);
    else if (a.M <= 32) fixed_kernel<4, 4><<<grid, kWarps * 32, 0, stream>>>(a);
    else fixed_kernel<8, 4><<<grid, kWarps * 32, 0, stream>>>(a);
    if (a.slices > 1) {
        const size_t total = (size_t)a.M * a.N;
        const int blocks = (int)((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
        reduce_kernel<<<blocks, 256, 0, stream>>>(a);
    }
}

}  // namespace

extern "C" int fr_gemm_fixed_slices(int N, int K)
{
    if (N < 1 || K < 1) return 1;
    const int blocks = (N + 16 * kWarps - 1) / (16 * kWarps), chunks = (K + kChunk - 1) / kChunk;
    int s = (kBlocksTarget + blocks - 1) / blocks;
    if (s > kMaxSlices) s = kMaxSlices;
    if (s > chunks / 4) s = chunks / 4;   /* at least 128 values of k a slice */
    return s < 1 ? 1 : s;
}

extern "C" fr_status fr_gemm_fixed_bf16(void *y, int out_bf16, const uint16_t *x, const uint16_t *w, int M, int N,
                                        int K, float beta, void *ws, size_t ws_bytes, cudaStream_t stream)
{
    if (M < 0 || N < 0 || K < 1)
        return fr_fail(FR_EINVAL, "fixed-order gemm: bad size: M %d, N %d, K %d", M, N, K);
    if (M == 0 || N == 0) return FR_OK;
    if (!y || !x || !w) return fr_fail(FR_EINVAL, "fixed-order gemm: NULL matrix pointer");
    if (K % 8 || ((uintptr_t)x & 15) || ((uintptr_t)w & 15))
        return fr_fail(FR_EINVAL, "fixed-order gemm: K (%d) must be a multiple of 8 and x, w 16-byte aligned", K);
    if (beta != beta) return fr_fail(FR_EINVAL, "fixed-order gemm: beta is NaN");
    Args a = {w, x, M, N, K, fr_gemm_fixed_slices(N, K), (K + kChunk - 1) / kChunk, beta, out_bf16 ? 1 : 0, y, NULL};
    int rows = M;
    if (a.slices > 1) {
        const size_t per_row = (size_t)a.slices * N * sizeof(float);
        if (!ws || ws_bytes < per_row)
            return fr_fail(FR_EINVAL, "fixed-order gemm: a workspace of %zu bytes is below the %zu one row needs",
                           ws_bytes, per_row);
        a.part = static_cast<float *>(ws);
        if ((size_t)rows > ws_bytes / per_row) rows = (int)(ws_bytes / per_row);
    }
    const size_t y_elem = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int m0 = 0; m0 < M; m0 += rows) {   /* rows are independent: slicing them changes no bit */
        Args b = a;
        b.M = M - m0 < rows ? M - m0 : rows;
        b.x = x + (size_t)m0 * K;
        b.y = static_cast<char *>(y) + (size_t)m0 * N * y_elem;
        launch(b, stream);
    }
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FR_OK
                            : fr_fail(FR_EINTERNAL, "fixed-order gemm: launch failed: %s", cudaGetErrorString(e));
}
