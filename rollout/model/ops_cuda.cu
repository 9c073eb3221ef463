/* The CUDA ops of the Qwen3 forward pass: see ops_cuda.h for the contract.
 *
 * Kernel shapes:
 *   embed, rmsnorm   one block per row; each thread moves chunks of 8 values
 *                    (16-byte loads of BF16, 2 x 16-byte float32 accesses);
 *                    rmsnorm keeps its chunks in registers between the sum of
 *                    squares and the scaling, so x is read once.
 *   qk_norm_rope     one warp per head vector; lane l holds pairs l + 32*t.
 *   swiglu, convert  grid-stride loops over chunks of 8.
 * Sums of squares are taken in double (float32 squares, as the CPU op) with
 * warp shuffles, so a norm's scale is the CPU's up to the order of a double
 * sum. The float32 products use __fmul_rn / __fadd_rn / __fsub_rn where the CPU
 * rounds each operation, so the compiler cannot fuse them into FMAs.
 */
#include "rollout/model/ops_cuda.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention/cuda_check.h"

extern "C" {
#include "rollout/model/ops_cpu.h"
}

namespace {

constexpr int kChunk = 8;          /* values per vector chunk */
constexpr int kThreads = 256;      /* block size of the grid-stride kernels */
constexpr int kVecMaxThreads = 512;/* most threads of a vector RMSNorm block */
constexpr unsigned kFull = 0xffffffffu;

/* ---- BF16, exactly as attention/fp_formats.c --------------------------- */

__device__ __forceinline__ float bf16_decode(uint32_t h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ uint32_t bf16_encode(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

/* Two floats as two BF16 in one 32-bit word, the first in the low half. */
__device__ __forceinline__ uint32_t bf16_pack2(float lo, float hi)
{
    return bf16_encode(lo) | (bf16_encode(hi) << 16);
}

__device__ __forceinline__ void bf16_unpack8(uint4 p, float *f)
{
    uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = bf16_decode(w[i] & 0xffffu);
        f[2 * i + 1] = bf16_decode(w[i] >> 16);
    }
}

__device__ __forceinline__ uint4 bf16_pack8(const float *f)
{
    return make_uint4(bf16_pack2(f[0], f[1]), bf16_pack2(f[2], f[3]), bf16_pack2(f[4], f[5]),
                      bf16_pack2(f[6], f[7]));
}

__device__ __forceinline__ void load8(const float *p, float *f)
{
    float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

__device__ __forceinline__ void store8(float *p, const float *f)
{
    reinterpret_cast<float4 *>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4 *>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

/* Output element writers for the two output types of the norms. */
__device__ __forceinline__ void put1(uint16_t *p, float v) { *p = (uint16_t)bf16_encode(v); }
__device__ __forceinline__ void put1(float *p, float v) { *p = v; }
__device__ __forceinline__ void put8(uint16_t *p, const float *f) { *reinterpret_cast<uint4 *>(p) = bf16_pack8(f); }
__device__ __forceinline__ void put8(float *p, const float *f) { store8(p, f); }

/* ---- reductions ---------------------------------------------------------- */

__device__ __forceinline__ double warp_sum(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32), returned to every thread.
 * Every warp reduces the per-warp partials itself, in the same order, so all
 * threads get the same value without a second barrier. Once per kernel. */
__device__ __forceinline__ double block_sum(double v)
{
    __shared__ double part[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[wid] = v;
    __syncthreads();
    return warp_sum(lane < nw ? part[lane] : 0.0);
}

/* inv = 1 / sqrtf(mean + eps) from the double sum of squares, as fr_rmsnorm. */
__device__ __forceinline__ float rms_inv(double sumsq, int n, float eps)
{
    float var = __fdiv_rn((float)sumsq, (float)n);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
}

__device__ __forceinline__ float sq(float v) { return __fmul_rn(v, v); }

/* ---- embedding ----------------------------------------------------------- */

__global__ void embed_vec_kernel(float *x, const uint16_t *table, const int *ids, int hidden, int vocab)
{
    const size_t row = blockIdx.x;
    const int id = ids[row], chunks = hidden / kChunk;
    float *dst = x + row * (size_t)hidden;
    const uint16_t *src = table + (size_t)(id < 0 ? 0 : id) * (size_t)hidden;
    const bool ok = id >= 0 && id < vocab;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float f[kChunk];
        if (ok) {
            bf16_unpack8(reinterpret_cast<const uint4 *>(src)[c], f);
        } else {
#pragma unroll
            for (int i = 0; i < kChunk; i++) f[i] = 0.0f;
        }
        store8(dst + (size_t)c * kChunk, f);
    }
}

__global__ void embed_scalar_kernel(float *x, const uint16_t *table, const int *ids, int hidden, int vocab)
{
    const size_t row = blockIdx.x;
    const int id = ids[row];
    float *dst = x + row * (size_t)hidden;
    const bool ok = id >= 0 && id < vocab;
    const uint16_t *src = table + (size_t)(ok ? id : 0) * (size_t)hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = ok ? bf16_decode(src[i]) : 0.0f;
}

/* ---- RMSNorm ------------------------------------------------------------- */

/* One block per output row, VPT chunks of 8 per thread kept in registers.
 * Row source: row_ids ? row_ids[row] (out of [0, x_rows) -> zero row) : row.
 * With delta, x += delta is written back (never together with row_ids). */
template <typename OutT, int VPT>
__global__ void __launch_bounds__(kVecMaxThreads)
    rmsnorm_vec_kernel(OutT *out, float *x, const float *delta, const uint16_t *w, const int *row_ids, int x_rows,
                       int n, float eps)
{
    const size_t row = blockIdx.x;
    const int chunks = n / kChunk;
    OutT *orow = out + row * (size_t)n;
    size_t src = row;
    if (row_ids) {
        const int id = row_ids[row];
        if (id < 0 || id >= x_rows) {   /* uniform over the block: no barrier is skipped unevenly */
            float z[kChunk] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int c = threadIdx.x; c < chunks; c += blockDim.x) put8(orow + (size_t)c * kChunk, z);
            return;
        }
        src = (size_t)id;
    }
    float *xr = x + src * (size_t)n;
    const float *dr = delta ? delta + src * (size_t)n : nullptr;
    float v[VPT][kChunk];
    double ss = 0.0;
#pragma unroll
    for (int t = 0; t < VPT; t++) {
        const int c = threadIdx.x + t * blockDim.x;
        if (c < chunks) {
            load8(xr + (size_t)c * kChunk, v[t]);
            if (dr) {
                float d[kChunk];
                load8(dr + (size_t)c * kChunk, d);
#pragma unroll
                for (int i = 0; i < kChunk; i++) v[t][i] = __fadd_rn(v[t][i], d[i]);
                store8(xr + (size_t)c * kChunk, v[t]);
            }
#pragma unroll
            for (int i = 0; i < kChunk; i++) ss += (double)sq(v[t][i]);
        }
    }
    const float inv = rms_inv(block_sum(ss), n, eps);
#pragma unroll
    for (int t = 0; t < VPT; t++) {
        const int c = threadIdx.x + t * blockDim.x;
        if (c < chunks) {
            float wf[kChunk], o[kChunk];
            bf16_unpack8(reinterpret_cast<const uint4 *>(w)[c], wf);
#pragma unroll
            for (int i = 0; i < kChunk; i++) o[i] = __fmul_rn(__fmul_rn(v[t][i], inv), wf[i]);
            put8(orow + (size_t)c * kChunk, o);
        }
    }
}

/* Any n and alignment: two passes over the row in global memory. Each thread
 * reads back only the elements it wrote, so x += delta and out == x are safe. */
template <typename OutT>
__global__ void rmsnorm_scalar_kernel(OutT *out, float *x, const float *delta, const uint16_t *w,
                                      const int *row_ids, int x_rows, int n, float eps)
{
    const size_t row = blockIdx.x;
    OutT *orow = out + row * (size_t)n;
    size_t src = row;
    if (row_ids) {
        const int id = row_ids[row];
        if (id < 0 || id >= x_rows) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) put1(orow + i, 0.0f);
            return;
        }
        src = (size_t)id;
    }
    float *xr = x + src * (size_t)n;
    const float *dr = delta ? delta + src * (size_t)n : nullptr;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (dr) {
            v = __fadd_rn(v, dr[i]);
            xr[i] = v;
        }
        ss += (double)sq(v);
    }
    const float inv = rms_inv(block_sum(ss), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        put1(orow + i, __fmul_rn(__fmul_rn(xr[i], inv), bf16_decode(w[i])));
}

/* ---- q/k norm + RoPE ---------------------------------------------------- */

/* One warp per head vector (row, head), q heads first then k heads of each
 * row. Lane l holds the pairs j = l + 32*t (t < T), j < h = head_dim/2. */
template <int T>
__global__ void qk_norm_rope_kernel(float *q, size_t q_stride, float *k, size_t k_stride,
                                    const uint16_t *qw, const uint16_t *kw, const int *pos, int rows,
                                    int n_heads, int n_kv_heads, int head_dim, float eps,
                                    const float *cos_t, const float *sin_t, int max_pos)
{
    const size_t gwarp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31, heads = n_heads + n_kv_heads, h = head_dim / 2;
    if (gwarp >= (size_t)rows * (size_t)heads) return;   /* uniform over the warp */
    const size_t row = gwarp / (size_t)heads;
    const int hd = (int)(gwarp % (size_t)heads);
    float *xh;
    const uint16_t *w;
    if (hd < n_heads) {
        xh = q + row * q_stride + (size_t)hd * head_dim;
        w = qw;
    } else {
        xh = k + row * k_stride + (size_t)(hd - n_heads) * head_dim;
        w = kw;
    }
    const int p = pos[row];
    if (p < 0 || p >= max_pos) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            const int j = lane + 32 * t;
            if (j < h) xh[j] = xh[j + h] = 0.0f;
        }
        return;
    }
    float a[T] = {}, b[T] = {};
    double ss = 0.0;
#pragma unroll
    for (int t = 0; t < T; t++) {
        const int j = lane + 32 * t;
        if (j < h) {
            a[t] = xh[j];
            b[t] = xh[j + h];
            ss += (double)sq(a[t]) + (double)sq(b[t]);
        }
    }
    const float inv = rms_inv(warp_sum(ss), head_dim, eps);
    const float *cr = cos_t + (size_t)p * (size_t)h, *sr = sin_t + (size_t)p * (size_t)h;
#pragma unroll
    for (int t = 0; t < T; t++) {
        const int j = lane + 32 * t;
        if (j < h) {
            const float an = __fmul_rn(__fmul_rn(a[t], inv), bf16_decode(w[j]));
            const float bn = __fmul_rn(__fmul_rn(b[t], inv), bf16_decode(w[j + h]));
            const float c = cr[j], s = sr[j];
            xh[j] = __fsub_rn(__fmul_rn(an, c), __fmul_rn(bn, s));
            xh[j + h] = __fadd_rn(__fmul_rn(bn, c), __fmul_rn(an, s));
        }
    }
}

/* ---- SwiGLU and conversion ---------------------------------------------- */

__device__ __forceinline__ float swiglu1(float g, float u)
{
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    return __fmul_rn(silu, u);
}

/* Rows of `inter` outputs; gate at g + r*gstride, up at u + r*ustride. The
 * flat op is one row. */
__global__ void swiglu_vec_kernel(uint16_t *out, const float *g, const float *u, size_t gstride,
                                  size_t ustride, size_t rows, size_t inter)
{
    const size_t cpr = inter / kChunk, total = rows * cpr;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < total;
         c += (size_t)gridDim.x * blockDim.x) {
        const size_t r = c / cpr, i = (c - r * cpr) * kChunk;
        float gf[kChunk], uf[kChunk], o[kChunk];
        load8(g + r * gstride + i, gf);
        load8(u + r * ustride + i, uf);
#pragma unroll
        for (int e = 0; e < kChunk; e++) o[e] = swiglu1(gf[e], uf[e]);
        *reinterpret_cast<uint4 *>(out + r * inter + i) = bf16_pack8(o);
    }
}

__global__ void swiglu_scalar_kernel(uint16_t *out, const float *g, const float *u, size_t gstride,
                                     size_t ustride, size_t rows, size_t inter)
{
    const size_t total = rows * inter;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / inter, i = e - r * inter;
        out[e] = (uint16_t)bf16_encode(swiglu1(g[r * gstride + i], u[r * ustride + i]));
    }
}

/* Chunks of 8 while `vec`, then the tail (or everything, when not vec)
 * element by element. */
__global__ void f32_to_bf16_kernel(uint16_t *out, const float *in, size_t n, bool vec)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t done = 0;
    if (vec) {
        const size_t chunks = n / kChunk;
        for (size_t c = first; c < chunks; c += stride) {
            float f[kChunk];
            load8(in + c * kChunk, f);
            *reinterpret_cast<uint4 *>(out + c * kChunk) = bf16_pack8(f);
        }
        done = chunks * kChunk;
    }
    for (size_t i = done + first; i < n; i += stride) out[i] = (uint16_t)bf16_encode(in[i]);
}

/* x[i] += d[i]: a tensor-parallel all-reduced partial sum joining the
 * residual stream. */
__global__ void add_f32_kernel(float *x, const float *d, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] += d[i];
}

/* ---- host helpers ------------------------------------------------------- */

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Grid for a grid-stride loop over `work` items of kThreads-thread blocks:
 * enough blocks to fill the GPU many times over, capped. */
unsigned grid_for(size_t work)
{
    size_t b = (work + kThreads - 1) / kThreads;
    if (b < 1) b = 1;
    if (b > 65536) b = 65536;
    return (unsigned)b;
}

/* Threads per block for `items` per-block work items: a multiple of 32, at
 * most 256 (and at least one warp). */
unsigned block_for(int items)
{
    int t = (items + 31) / 32 * 32;
    if (t < 32) t = 32;
    if (t > kThreads) t = kThreads;
    return (unsigned)t;
}

/* Launches the RMSNorm kernel fitting n and the pointers' alignment. */
template <typename OutT>
fr_status rmsnorm_launch(const char *what, OutT *out, float *x, const float *delta,
                         const uint16_t *w, const int *row_ids, int x_rows, int rows, int n, float eps,
                         cudaStream_t stream)
{
    if (rows < 0 || n < 1)
        return fr_fail(FR_EINVAL, "%s: bad size: %d rows of %d", what, rows, n);
    if (!(eps >= 0.0f) || isinf(eps)) return fr_fail(FR_EINVAL, "%s: eps %g is not a finite value >= 0", what, (double)eps);
    if (rows == 0) return FR_OK;
    if (!out || !x || !w) return fr_fail(FR_EINVAL, "%s: NULL pointer", what);
    const int chunks = n / kChunk;
    const bool vec = n % kChunk == 0 && aligned16(out) && aligned16(x) && aligned16(w) &&
                     (!delta || aligned16(delta));
    /* Smallest VPT giving at most 256 threads; up to kVecMaxThreads with VPT
     * 8 (n <= 32768); longer rows take the scalar kernel. */
    int vpt = 0;
    unsigned threads = 0;
    if (vec) {
        for (int v = 1; v <= 8; v *= 2) {
            int t = (chunks + v - 1) / v;
            if (t <= kThreads || (v == 8 && t <= kVecMaxThreads)) {
                vpt = v;
                threads = (unsigned)((t + 31) / 32 * 32);
                break;
            }
        }
    }
    const unsigned grid = (unsigned)rows;
    switch (vpt) {
    case 1: rmsnorm_vec_kernel<OutT, 1><<<grid, threads, 0, stream>>>(out, x, delta, w, row_ids, x_rows, n, eps); break;
    case 2: rmsnorm_vec_kernel<OutT, 2><<<grid, threads, 0, stream>>>(out, x, delta, w, row_ids, x_rows, n, eps); break;
    case 4: rmsnorm_vec_kernel<OutT, 4><<<grid, threads, 0, stream>>>(out, x, delta, w, row_ids, x_rows, n, eps); break;
    case 8: rmsnorm_vec_kernel<OutT, 8><<<grid, threads, 0, stream>>>(out, x, delta, w, row_ids, x_rows, n, eps); break;
    default:
        rmsnorm_scalar_kernel<OutT><<<grid, block_for(n), 0, stream>>>(out, x, delta, w, row_ids, x_rows, n, eps);
        break;
    }
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

}  // namespace

/* ---- public functions ---------------------------------------------------- */

extern "C" fr_status fr_cuda_embed(float *x, const uint16_t *table_bf16, const int *ids, int n, int hidden,
                                   int vocab, cudaStream_t stream)
{
    if (n < 0 || hidden < 1 || vocab < 1)
        return fr_fail(FR_EINVAL, "cuda embed: bad size: %d tokens, hidden %d, vocab %d", n, hidden, vocab);
    if (n == 0) return FR_OK;
    if (!x || !table_bf16 || !ids) return fr_fail(FR_EINVAL, "cuda embed: NULL pointer");
    if (hidden % kChunk == 0 && aligned16(x) && aligned16(table_bf16))
        embed_vec_kernel<<<(unsigned)n, block_for(hidden / kChunk), 0, stream>>>(x, table_bf16, ids, hidden, vocab);
    else
        embed_scalar_kernel<<<(unsigned)n, block_for(hidden), 0, stream>>>(x, table_bf16, ids, hidden, vocab);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_cuda_rmsnorm(uint16_t *out_bf16, float *x, const float *delta_or_null,
                                     const uint16_t *w_bf16, int rows, int n, float eps, cudaStream_t stream)
{
    return rmsnorm_launch<uint16_t>("cuda rmsnorm", out_bf16, x, delta_or_null, w_bf16, nullptr, 0, rows, n,
                                    eps, stream);
}

extern "C" fr_status fr_cuda_rmsnorm_f32(float *out, float *x, const float *delta_or_null,
                                         const uint16_t *w_bf16, int rows, int n, float eps, cudaStream_t stream)
{
    return rmsnorm_launch<float>("cuda rmsnorm_f32", out, x, delta_or_null, w_bf16, nullptr, 0, rows, n, eps,
                                 stream);
}

extern "C" fr_status fr_cuda_rmsnorm_rows(uint16_t *out_bf16, const float *x, int x_rows, const int *row_ids,
                                          int n_out, const uint16_t *w_bf16, int n, float eps,
                                          cudaStream_t stream)
{
    if (x_rows < 0) return fr_fail(FR_EINVAL, "cuda rmsnorm_rows: bad size: %d source rows", x_rows);
    if (n_out > 0 && !row_ids) return fr_fail(FR_EINVAL, "cuda rmsnorm_rows: NULL row ids");
    /* x is only read: the kernels write x only when delta is given. */
    return rmsnorm_launch<uint16_t>("cuda rmsnorm_rows", out_bf16, const_cast<float *>(x), nullptr, w_bf16,
                                    row_ids, x_rows, n_out, n, eps, stream);
}

extern "C" fr_status fr_cuda_rope_table_new(int max_pos, int head_dim, double theta, const fr_rope_scaling *y,
                                            float **cos_dev, float **sin_dev)
{
    if (!cos_dev || !sin_dev) return fr_fail(FR_EINVAL, "rope table: NULL output pointer");
    *cos_dev = *sin_dev = nullptr;
    if (max_pos < 1 || head_dim < 2 || head_dim % 2 || head_dim > FR_CUDA_MAX_HEAD_DIM)
        return fr_fail(FR_EINVAL, "rope table: bad size: max_pos %d, head_dim %d (even, 2..%d)", max_pos,
                       head_dim, FR_CUDA_MAX_HEAD_DIM);
    if (!(theta > 0.0) || isinf(theta)) return fr_fail(FR_EINVAL, "rope table: theta %g is not > 0", theta);
    const size_t h = (size_t)head_dim / 2, count = (size_t)max_pos * h, bytes = count * sizeof(float);
    float *hc = (float *)malloc(bytes), *hs = (float *)malloc(bytes);
    if (!hc || !hs) {
        free(hc);
        free(hs);
        return fr_fail(FR_ENOMEM, "rope table: cannot allocate %zu bytes on the host", 2 * bytes);
    }
    for (int p = 0; p < max_pos; p++) fr_rope_cos_sin(hc + (size_t)p * h, hs + (size_t)p * h, head_dim, p, theta, y);
    float *dc = nullptr, *ds = nullptr;
    cudaError_t e = cudaMalloc((void **)&dc, bytes);
    if (e == cudaSuccess) e = cudaMalloc((void **)&ds, bytes);
    if (e == cudaSuccess) e = cudaMemcpy(dc, hc, bytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(ds, hs, bytes, cudaMemcpyHostToDevice);
    free(hc);
    free(hs);
    if (e != cudaSuccess) {
        cudaFree(dc);
        cudaFree(ds);
        return fr_fail(e == cudaErrorMemoryAllocation ? FR_ENOMEM : FR_EINTERNAL,
                       "rope table: cannot place %d x %zu cos/sin values on the device: %s", max_pos, h,
                       cudaGetErrorString(e));
    }
    *cos_dev = dc;
    *sin_dev = ds;
    return FR_OK;
}

extern "C" void fr_cuda_rope_table_free(float **cos_dev, float **sin_dev)
{
    if (cos_dev && *cos_dev) {
        cudaFree(*cos_dev);
        *cos_dev = nullptr;
    }
    if (sin_dev && *sin_dev) {
        cudaFree(*sin_dev);
        *sin_dev = nullptr;
    }
}

extern "C" fr_status fr_cuda_qk_norm_rope_strided(float *q, size_t q_stride, float *k, size_t k_stride,
                                                  const uint16_t *q_norm_w, const uint16_t *k_norm_w,
                                                  const int *pos, int rows, int n_heads, int n_kv_heads,
                                                  int head_dim, float eps, const float *rope_cos,
                                                  const float *rope_sin, int max_pos, cudaStream_t stream)
{
    static const char *what = "cuda qk_norm_rope";
    if (rows < 0 || n_heads < 0 || n_kv_heads < 0 || head_dim < 2 || head_dim % 2 ||
        head_dim > FR_CUDA_MAX_HEAD_DIM || max_pos < 1)
        return fr_fail(FR_EINVAL, "%s: bad size: %d rows, %d/%d heads, head_dim %d (even, 2..%d), max_pos %d",
                       what, rows, n_heads, n_kv_heads, head_dim, FR_CUDA_MAX_HEAD_DIM, max_pos);
    if (n_heads > 0 && q_stride < (size_t)n_heads * (size_t)head_dim)
        return fr_fail(FR_EINVAL, "%s: q row stride %zu < %d heads x %d", what, q_stride, n_heads, head_dim);
    if (n_kv_heads > 0 && k_stride < (size_t)n_kv_heads * (size_t)head_dim)
        return fr_fail(FR_EINVAL, "%s: k row stride %zu < %d heads x %d", what, k_stride, n_kv_heads, head_dim);
    if (!(eps >= 0.0f) || isinf(eps)) return fr_fail(FR_EINVAL, "%s: eps %g is not a finite value >= 0", what, (double)eps);
    const size_t warps = (size_t)rows * (size_t)(n_heads + n_kv_heads);
    if (warps == 0) return FR_OK;
    if (!pos || !rope_cos || !rope_sin || (n_heads > 0 && (!q || !q_norm_w)) ||
        (n_kv_heads > 0 && (!k || !k_norm_w)))
        return fr_fail(FR_EINVAL, "%s: NULL pointer", what);
    const int h = head_dim / 2;
    const size_t warps_per_block = kThreads / 32, blocks = (warps + warps_per_block - 1) / warps_per_block;
    if (blocks > 0x7fffffffu) return fr_fail(FR_EINVAL, "%s: %zu head vectors are too many", what, warps);
    const unsigned grid = (unsigned)blocks;
#define FR_QKR_LAUNCH(T)                                                                                   \
    qk_norm_rope_kernel<T><<<grid, kThreads, 0, stream>>>(q, q_stride, k, k_stride, q_norm_w, k_norm_w, pos, \
                                                         rows, n_heads, n_kv_heads, head_dim, eps, rope_cos, \
                                                         rope_sin, max_pos)
    if (h <= 32) FR_QKR_LAUNCH(1);
    else if (h <= 64) FR_QKR_LAUNCH(2);
    else if (h <= 128) FR_QKR_LAUNCH(4);
    else FR_QKR_LAUNCH(8);
#undef FR_QKR_LAUNCH
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_cuda_qk_norm_rope(float *q, float *k, const uint16_t *q_norm_w, const uint16_t *k_norm_w,
                                          const int *pos, int rows, int n_heads, int n_kv_heads, int head_dim,
                                          float eps, const float *rope_cos, const float *rope_sin, int max_pos,
                                          cudaStream_t stream)
{
    const size_t qs = n_heads > 0 && head_dim > 0 ? (size_t)n_heads * (size_t)head_dim : 0;
    const size_t ks = n_kv_heads > 0 && head_dim > 0 ? (size_t)n_kv_heads * (size_t)head_dim : 0;
    return fr_cuda_qk_norm_rope_strided(q, qs, k, ks, q_norm_w, k_norm_w, pos, rows, n_heads, n_kv_heads,
                                        head_dim, eps, rope_cos, rope_sin, max_pos, stream);
}

namespace {

fr_status swiglu_launch(const char *what, uint16_t *out, const float *g, const float *u, size_t gstride,
                        size_t ustride, size_t rows, size_t inter, cudaStream_t stream)
{
    if (rows == 0 || inter == 0) return FR_OK;
    if (!out || !g || !u) return fr_fail(FR_EINVAL, "%s: NULL pointer", what);
    const bool vec = inter % kChunk == 0 && gstride % kChunk == 0 && ustride % kChunk == 0 && aligned16(out) &&
                     aligned16(g) && aligned16(u);
    if (vec)
        swiglu_vec_kernel<<<grid_for(rows * (inter / kChunk)), kThreads, 0, stream>>>(out, g, u, gstride, ustride,
                                                                                      rows, inter);
    else
        swiglu_scalar_kernel<<<grid_for(rows * inter), kThreads, 0, stream>>>(out, g, u, gstride, ustride, rows,
                                                                              inter);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

}  // namespace

extern "C" fr_status fr_cuda_swiglu(uint16_t *out_bf16, const float *gate, const float *up, size_t n,
                                    cudaStream_t stream)
{
    return swiglu_launch("cuda swiglu", out_bf16, gate, up, 0, 0, 1, n, stream);
}

extern "C" fr_status fr_cuda_swiglu_rows(uint16_t *out_bf16, const float *gate_up, int rows, int inter,
                                         cudaStream_t stream)
{
    if (rows < 0 || inter < 1)
        return fr_fail(FR_EINVAL, "cuda swiglu_rows: bad size: %d rows of %d", rows, inter);
    if (rows == 0) return FR_OK;
    if (!gate_up) return fr_fail(FR_EINVAL, "cuda swiglu_rows: NULL pointer");
    const size_t I = (size_t)inter;
    return swiglu_launch("cuda swiglu_rows", out_bf16, gate_up, gate_up + I, 2 * I, 2 * I, (size_t)rows, I,
                         stream);
}

extern "C" fr_status fr_cuda_f32_to_bf16(uint16_t *out, const float *in, size_t n, cudaStream_t stream)
{
    if (n == 0) return FR_OK;
    if (!out || !in) return fr_fail(FR_EINVAL, "cuda f32_to_bf16: NULL pointer");
    const bool vec = aligned16(out) && aligned16(in);
    f32_to_bf16_kernel<<<grid_for(vec ? n / kChunk + kChunk : n), kThreads, 0, stream>>>(out, in, n, vec);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_cuda_add_f32(float *x, const float *d, size_t n, cudaStream_t stream)
{
    if (n == 0) return FR_OK;
    if (!x || !d) return fr_fail(FR_EINVAL, "cuda add_f32: NULL pointer");
    add_f32_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, d, n);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}
