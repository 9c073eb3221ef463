/* Deterministic-mode attention over a BF16 paged cache: see attn_fixed.h.
 *
 * Split kernel: a block of 128 threads per (split, KV head, row). Per tile of
 * 128 keys: thread i loads value row i into shared memory and key row i into
 * registers and scores key i against the G query heads (dot products in
 * increasing dimension), a warp per head takes the tile maximum and sums the
 * weights in a fixed tree, and for the values each thread owns a pair of
 * dimensions of a share of the heads and accumulates the keys in order. No reduction depends on the warp schedule. */
#include "attention/attn_fixed.h"

#include <cuda_bf16.h>
#include <math.h>

namespace {

constexpr int kThreads = 128, kTile = 128, kSplits = FR_ATTN_FIXED_SPLITS;

__device__ __forceinline__ float bf(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }

/* Where the sequence's token t lies (paged_kv.h), K or V. */
__device__ __forceinline__ const uint16_t *token_row(const fr_paged_kv &kv, const fr_paged_seq &s, int h, int t,
                                                     bool value)
{
    const int d = kv.head_dim, lh = kv.layer * kv.n_kv_heads + h;
    if (t < s.len / kTile * kTile) {
        const uint8_t *page = kv.pool + (size_t)s.block_table[t / kTile] * kv.block_bytes +
                              (size_t)lh * kv.head_page_bytes + (value ? kv.v_codes : kv.k_codes);
        return reinterpret_cast<const uint16_t *>(page) + (size_t)(t % kTile) * d;
    }
    if (t < s.len)
        return kv.recent + (size_t)s.slot * 2 * kv.slot_elems + (value ? kv.slot_elems : 0) +
               ((size_t)lh * kTile + t % kTile) * d;
    return (value ? kv.step_v : kv.step_k) + ((size_t)(s.q_row + t - s.len) * kv.n_kv_heads + h) * d;
}

/* The sequence holding row r, or -1 (warp 0 scans, the block waits). */
__device__ int find_seq(const fr_paged_seq *seqs, int n_seqs, int r)
{
    __shared__ int found;
    if (threadIdx.x == 0) found = -1;
    __syncthreads();
    if (threadIdx.x < 32)
        for (int i = threadIdx.x; i < n_seqs; i += 32) {
            const fr_paged_seq s = seqs[i];
            if (s.n_new > 0 && r >= s.q_row && r < s.q_row + s.n_new) found = i;   /* at most one matches */
        }
    __syncthreads();
    return found;
}

__device__ __forceinline__ void split_tiles(int p, int j, int *a, int *b, int *ns)
{
    const int T = p / kTile + 1, n = T < kSplits ? T : kSplits;
    *ns = n;
    *a = (int)((long)T * j / n);
    *b = (int)((long)T * (j + 1) / n);
}

struct Part {
    float *o, *m, *l;   /* [rows][H][kSplits][d], [rows][H][kSplits] x 2 */
};

__device__ __forceinline__ Part part_of(void *ws, int rows, int H, int d)
{
    Part P;
    P.o = static_cast<float *>(ws);
    P.m = P.o + (size_t)rows * H * kSplits * d;
    P.l = P.m + (size_t)rows * H * kSplits;
    return P;
}

/* Shared memory of the split kernel: the tile's values (rows padded by 16
 * bytes, so that thread i writing row i meets no bank conflict), the
 * weights, the query, and per head the running maximum, sum and rescale. */
template <int D, int G> struct Smem {
    static constexpr int kRow = D + 8;
    uint16_t v[kTile][kRow];
    float sc[G][kTile];
    float q[G][D];
    float m[G], l[G], alpha[G];
};

template <int D, int G>
__global__ void __launch_bounds__(kThreads) split_kernel(fr_paged_kv kv, const fr_paged_seq *seqs, int n_seqs,
                                                         int row0, int rows, const float *q, int H, void *ws)
{
    constexpr int kVec = D / 8;                  /* 16-byte pieces of a row */
    constexpr int kDims = 2;                     /* dimensions a thread accumulates (a bf16 pair) */
    constexpr int kGroups = kThreads * kDims / D;   /* head groups the threads split into: 1 (d 128) or 2 */
    constexpr int kMine = G / kGroups > 0 ? G / kGroups : 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem<D, G> &S = *reinterpret_cast<Smem<D, G> *>(smem_raw);
    const int j = blockIdx.x, h = blockIdx.y, rl = blockIdx.z, r = row0 + rl, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int si = find_seq(seqs, n_seqs, r);
    if (si < 0) return;
    const fr_paged_seq s = seqs[si];
    const int p = s.len + (r - s.q_row);
    int a, b, ns;
    split_tiles(p, j, &a, &b, &ns);
    if (j >= ns) return;
    for (int i = tid; i < G * D; i += kThreads) {
        const float x = q[((size_t)r * H + h * G + i / D) * D + i % D];
        S.q[i / D][i % D] = __bfloat162float(__float2bfloat16_rn(x));
    }
    if (tid < G) {
        S.m[tid] = -INFINITY;
        S.l[tid] = 0.0f;
    }
    const float scale = (float)(1.4426950408889634 / sqrt((double)D));   /* log2(e) / sqrt(d) */
    const int dim = (tid % (D / kDims)) * kDims, grp = tid / (D / kDims);
    float acc[kMine][kDims];
#pragma unroll
    for (int u = 0; u < kMine; u++) acc[u][0] = acc[u][1] = 0.0f;
    for (int tile = a; tile < b; tile++) {
        const int n_keys = (tile + 1) * kTile <= p + 1 ? kTile : p + 1 - tile * kTile;
        const bool live = tid < n_keys;
        const int t = tile * kTile + tid;
        /* thread tid owns key tid: its value row into shared memory (16
         * loads in flight), then its key row straight into the dot products */
        {
            const uint4 *vr = live ? reinterpret_cast<const uint4 *>(token_row(kv, s, h, t, true)) : nullptr;
            uint4 buf[kVec];
#pragma unroll
            for (int c = 0; c < kVec; c++) buf[c] = live ? __ldg(vr + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int c = 0; c < kVec; c++) *reinterpret_cast<uint4 *>(&S.v[tid][c * 8]) = buf[c];
        }
        __syncthreads();   /* (also: the query is in place) */
        {
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; g++) dot[g] = 0.0f;
            if (live) {
                const uint4 *kr = reinterpret_cast<const uint4 *>(token_row(kv, s, h, t, false));
                uint4 buf[kVec];
#pragma unroll
                for (int c = 0; c < kVec; c++) buf[c] = __ldg(kr + c);
#pragma unroll
                for (int c = 0; c < kVec; c++) {
                    const uint16_t *e = reinterpret_cast<const uint16_t *>(&buf[c]);
#pragma unroll
                    for (int g = 0; g < G; g++) {
                        const float4 q0 = *reinterpret_cast<const float4 *>(&S.q[g][c * 8]);
                        const float4 q1 = *reinterpret_cast<const float4 *>(&S.q[g][c * 8 + 4]);
                        const float qq[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
                        for (int x = 0; x < 8; x++) dot[g] = __fmaf_rn(qq[x], bf(e[x]), dot[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++) S.sc[g][tid] = live ? __fmul_rn(dot[g], scale) : -INFINITY;
        }
        __syncthreads();
        /* warp w: heads w, w + 4, ...: the tile maximum, the weights, their
         * sum (each lane its 4 keys in order, then a butterfly over lanes,
         * whose result is the same in every lane and every run) */
        for (int g = warp; g < G; g += kThreads / 32) {
            float4 e4 = *reinterpret_cast<const float4 *>(&S.sc[g][lane * 4]);
            float mx = fmaxf(fmaxf(e4.x, e4.y), fmaxf(e4.z, e4.w));
#pragma unroll
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = S.m[g], m_new = fmaxf(m_old, mx);
            e4.x = exp2f(__fsub_rn(e4.x, m_new));
            e4.y = exp2f(__fsub_rn(e4.y, m_new));
            e4.z = exp2f(__fsub_rn(e4.z, m_new));
            e4.w = exp2f(__fsub_rn(e4.w, m_new));
            *reinterpret_cast<float4 *>(&S.sc[g][lane * 4]) = e4;
            float sum = __fadd_rn(__fadd_rn(__fadd_rn(e4.x, e4.y), e4.z), e4.w);
#pragma unroll
            for (int o = 16; o; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
            __syncwarp();
            if (lane == 0) {
                const float al = exp2f(__fsub_rn(m_old, m_new));   /* the first tile: exp2(-inf) = 0 */
                S.alpha[g] = al;
                S.m[g] = m_new;
                S.l[g] = __fadd_rn(__fmul_rn(S.l[g], al), sum);
            }
        }
        __syncthreads();
        /* the values: thread (dim pair, group) accumulates its heads over
         * the keys in order, four keys' weights per shared-memory read */
#pragma unroll
        for (int u = 0; u < kMine; u++) {
            const int g = u * kGroups + grp;
            if (g >= G) continue;
            const float al = S.alpha[g];
            float o0 = __fmul_rn(acc[u][0], al), o1 = __fmul_rn(acc[u][1], al);
            int i = 0;
            for (; i + 4 <= n_keys; i += 4) {
                const float4 w = *reinterpret_cast<const float4 *>(&S.sc[g][i]);
                const float ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const uint32_t pr = *reinterpret_cast<const uint32_t *>(&S.v[i + k][dim]);
                    o0 = __fmaf_rn(ww[k], bf((uint16_t)(pr & 0xffffu)), o0);
                    o1 = __fmaf_rn(ww[k], bf((uint16_t)(pr >> 16)), o1);
                }
            }
            for (; i < n_keys; i++) {
                const uint32_t pr = *reinterpret_cast<const uint32_t *>(&S.v[i][dim]);
                o0 = __fmaf_rn(S.sc[g][i], bf((uint16_t)(pr & 0xffffu)), o0);
                o1 = __fmaf_rn(S.sc[g][i], bf((uint16_t)(pr >> 16)), o1);
            }
            acc[u][0] = o0;
            acc[u][1] = o1;
        }
        __syncthreads();
    }
    const Part P = part_of(ws, rows, H, D);
#pragma unroll
    for (int u = 0; u < kMine; u++) {
        const int g = u * kGroups + grp;
        if (g >= G) continue;
        float *o = P.o + (((size_t)rl * H + h * G + g) * kSplits + j) * D + dim;
        o[0] = acc[u][0];
        o[1] = acc[u][1];
    }
    if (tid < G) {
        const size_t i = ((size_t)rl * H + h * G + tid) * kSplits + j;
        P.m[i] = S.m[tid];
        P.l[i] = S.l[tid];
    }
}

/* One block per (row, head): the splits joined in split order. */
template <int D>
__global__ void __launch_bounds__(D) combine_kernel(const fr_paged_seq *seqs, int n_seqs, int row0, int rows, int H,
                                                    const void *ws, uint16_t *out)
{
    const int rl = blockIdx.x, head = blockIdx.y, r = row0 + rl, dim = threadIdx.x;
    const int si = find_seq(seqs, n_seqs, r);
    if (si < 0) return;
    const fr_paged_seq s = seqs[si];
    const int p = s.len + (r - s.q_row);
    int a, b, ns;
    split_tiles(p, 0, &a, &b, &ns);
    const Part P = part_of(const_cast<void *>(ws), rows, H, D);
    const size_t base = ((size_t)rl * H + head) * kSplits;
    float mx = -INFINITY;
    for (int j = 0; j < ns; j++) mx = fmaxf(mx, P.m[base + j]);
    float L = 0.0f, O = 0.0f;
    for (int j = 0; j < ns; j++) {
        const float w = exp2f(__fsub_rn(P.m[base + j], mx));
        L = __fadd_rn(L, __fmul_rn(P.l[base + j], w));
        O = __fadd_rn(O, __fmul_rn(P.o[(base + j) * D + dim], w));
    }
    out[((size_t)r * H + head) * D + dim] = __bfloat16_as_ushort(__float2bfloat16_rn(__fdiv_rn(O, L)));
}

template <int D, int G>
void launch_one(dim3 grid, cudaStream_t st, const fr_paged_kv &kv, const fr_paged_seq *seqs, int n_seqs, int row0,
                int rows, const float *q, int H, void *ws)
{
    split_kernel<D, G><<<grid, kThreads, sizeof(Smem<D, G>), st>>>(kv, seqs, n_seqs, row0, rows, q, H, ws);
}

/* The kernels' shared-memory opt-in (above 48 KB), made outside any graph
 * capture: fr_attn_fixed_workspace_bytes calls it. */
template <int D, int G> cudaError_t opt_in()
{
    return cudaFuncSetAttribute(split_kernel<D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)sizeof(Smem<D, G>));
}

cudaError_t opt_in_all()
{
    const cudaError_t e[] = {opt_in<128, 1>(), opt_in<128, 2>(), opt_in<128, 4>(), opt_in<128, 8>(),
                             opt_in<128, 16>(), opt_in<64, 1>(), opt_in<64, 2>(), opt_in<64, 4>(),
                             opt_in<64, 8>(), opt_in<64, 16>()};
    for (cudaError_t x : e)
        if (x != cudaSuccess) return x;
    return cudaSuccess;
}

template <int D>
void launch_split(int G, dim3 grid, cudaStream_t st, const fr_paged_kv &kv, const fr_paged_seq *seqs, int n_seqs,
                  int row0, int rows, const float *q, int H, void *ws)
{
    switch (G) {
    case 1: launch_one<D, 1>(grid, st, kv, seqs, n_seqs, row0, rows, q, H, ws); break;
    case 2: launch_one<D, 2>(grid, st, kv, seqs, n_seqs, row0, rows, q, H, ws); break;
    case 4: launch_one<D, 4>(grid, st, kv, seqs, n_seqs, row0, rows, q, H, ws); break;
    case 8: launch_one<D, 8>(grid, st, kv, seqs, n_seqs, row0, rows, q, H, ws); break;
    default: launch_one<D, 16>(grid, st, kv, seqs, n_seqs, row0, rows, q, H, ws); break;
    }
}

size_t per_row_bytes(int H, int d) { return (size_t)H * kSplits * ((size_t)d + 2) * sizeof(float); }

}  // namespace

extern "C" fr_status fr_attn_fixed_workspace_bytes(int n_heads, int head_dim, int rows_per_launch, size_t *bytes)
{
    if (!bytes) return fr_fail(FR_EINVAL, "attn_fixed_workspace_bytes: NULL result");
    if (n_heads < 1 || (head_dim != 64 && head_dim != 128) || rows_per_launch < 1)
        return fr_fail(FR_EINVAL, "attn_fixed_workspace_bytes: %d heads, head_dim %d, %d rows", n_heads, head_dim,
                       rows_per_launch);
    *bytes = per_row_bytes(n_heads, head_dim) * (size_t)rows_per_launch;
    const cudaError_t e = opt_in_all();
    return e == cudaSuccess ? FR_OK
                            : fr_fail(FR_EINTERNAL, "attn_fixed: cannot raise the kernels' shared memory: %s",
                                      cudaGetErrorString(e));
}

extern "C" fr_status fr_attn_fixed(const fr_paged_kv *kv, const fr_paged_seq *seqs_dev, int n_seqs, int n_rows,
                                   const float *q, uint16_t *out, int n_heads, void *ws, size_t ws_bytes,
                                   cudaStream_t stream)
{
    if (!kv || !seqs_dev || !q || !out) return fr_fail(FR_EINVAL, "attn_fixed: NULL argument");
    if (n_seqs < 0 || n_rows < 0) return fr_fail(FR_EINVAL, "attn_fixed: %d sequences, %d rows", n_seqs, n_rows);
    if (n_seqs == 0 || n_rows == 0) return FR_OK;
    const int d = kv->head_dim, KVH = kv->n_kv_heads;
    if (d != 64 && d != 128) return fr_fail(FR_EUNSUPPORTED, "attn_fixed: head_dim %d (64 or 128)", d);
    if (KVH < 1 || n_heads % KVH)
        return fr_fail(FR_EINVAL, "attn_fixed: %d heads over %d KV heads", n_heads, KVH);
    const int G = n_heads / KVH;
    if (G != 1 && G != 2 && G != 4 && G != 8 && G != 16)
        return fr_fail(FR_EUNSUPPORTED, "attn_fixed: a group of %d query heads (1, 2, 4, 8 or 16)", G);
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_fixed: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    const size_t per_row = per_row_bytes(n_heads, d);
    if (!ws || ws_bytes < per_row)
        return fr_fail(FR_EINVAL, "attn_fixed: a workspace of %zu bytes is below the %zu one row needs", ws_bytes,
                       per_row);
    const int chunk = ws_bytes / per_row < (size_t)n_rows ? (int)(ws_bytes / per_row) : n_rows;
    for (int row0 = 0; row0 < n_rows; row0 += chunk) {
        const int rows = n_rows - row0 < chunk ? n_rows - row0 : chunk;
        const dim3 grid(kSplits, KVH, rows);
        if (d == 128) {
            launch_split<128>(G, grid, stream, *kv, seqs_dev, n_seqs, row0, rows, q, n_heads, ws);
            combine_kernel<128><<<dim3(rows, n_heads), 128, 0, stream>>>(seqs_dev, n_seqs, row0, rows, n_heads, ws,
                                                                         out);
        } else {
            launch_split<64>(G, grid, stream, *kv, seqs_dev, n_seqs, row0, rows, q, n_heads, ws);
            combine_kernel<64><<<dim3(rows, n_heads), 64, 0, stream>>>(seqs_dev, n_seqs, row0, rows, n_heads, ws,
                                                                       out);
        }
    }
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "attn_fixed: launch failed: %s", cudaGetErrorString(e));
}
