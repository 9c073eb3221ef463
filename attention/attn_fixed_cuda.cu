/* Deterministic-mode attention over a BF16 paged cache: see attn_fixed.h.
 *
 * Split kernel: a block of 128 threads per (row block, KV head, split). A row block
 * is up to R consecutive tokens of one sequence (R = 1 for a decode step, 32 / G for
 * steps with prefill chunks), so the R x G query rows share each key and value the
 * block loads. Per tile of 128 keys: thread i loads value row i into shared memory
 * and key row i into registers and scores key i against every query row (dot products
 * in increasing dimension); a warp per query row takes the tile maximum and sums the
 * weights in a fixed tree; for the values each thread owns a pair of dimensions of a
 * share of the query rows and accumulates the keys in order. A query row's operations
 * are the same whichever R its block has and whichever rows share it: the threads
 * that run them differ, the operations do not.
 *
 * The arithmetic is scalar FP32: every rounding is an explicit operation in a fixed
 * order, so the argument above can be checked by reading the code. It is slow: with a
 * BF16 cache a decode step costs 1.1-2.6x the default's and a 4K prefill 29x
 * (bench/RESULTS.md, "Deterministic mode on the GPU", which lists tensor-core QK^T
 * and PV as the next step). Each launch covers a range of the step's rows (as many as
 * the workspace holds) with two kernels, the splits and then their combine, which
 * stream order serializes. */
#include "attention/attn_fixed.h"

#include <cuda_bf16.h>
#include <math.h>

namespace {

/* A tile is 128 keys, one per thread. Splits of 256 keys are aligned to position 0,
 * so a token's splits depend on its position alone. A block holds at most 32 query
 * rows (R x G), which bounds its shared memory; each (row block, KV head) gets up to
 * 64 blocks, each taking every 64th split (bench/RESULTS.md, "Deterministic mode on
 * the GPU", earlier revisions: 16 blocks cost 2.41x and 2.59x the default at BF16 4K
 * batch 64 and 32K batch 16, 64 blocks 2.64x and 2.40x). */
constexpr int kThreads = 128, kTile = 128, kSplitKeys = FR_ATTN_FIXED_SPLIT_KEYS;
constexpr int kTilesPerSplit = kSplitKeys / kTile, kMaxQueryRows = 32;
constexpr int kMaxGroup = 16;   /* query heads per KV head: every G up to this one is built */
constexpr int kBlocksPerRow = 64;   /* blocks per (row block, KV head); each takes every 64th split */
constexpr unsigned kFull = 0xffffffffu;

/* A BF16 value widened to float, exactly. */
__device__ __forceinline__ float bf(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }

/* Where the sequence's token t lies (paged_kv.h), K or V. A token has the same BF16
 * bits in each place (page, recent slot, staging row), so a key reads the same
 * whichever place holds it in a given step: the reason a token's result does not
 * depend on how its prompt was chunked. */
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

/* Row block b of the step: sequences in order, ceil(n_new / R) blocks each. Warp 0
 * walks the sequences 32 at a time with a prefix sum over lanes; the block gets the
 * sequence and the block's first row, or -1. The lengths live on the device (a
 * captured step replays with new ones), so the host sizes the grid by an upper bound
 * and every block finds its own rows; blocks past the real count get -1 and exit. The
 * ballot takes the first lane whose range holds b; base carries the sum of the 32
 * sequences before. */
template <int R> __device__ void find_block(const fr_paged_seq *seqs, int n_seqs, int b, int *seq, int *first)
{
    __shared__ int found_seq, found_first;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int base = 0, fs = -1, ff = 0;
        for (int i0 = 0; i0 < n_seqs && fs < 0; i0 += 32) {
            const int i = i0 + lane;
            const int n_new = i < n_seqs ? seqs[i].n_new : 0;
            const int nb = n_new > 0 ? (n_new + R - 1) / R : 0;
            int incl = nb;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(kFull, incl, o);
                if (lane >= o) incl += up;
            }
            const int start = base + incl - nb;
            const unsigned hit = __ballot_sync(kFull, nb > 0 && b >= start && b < start + nb);
            if (hit) {
                const int l = __ffs(hit) - 1;
                fs = i0 + l;
                ff = __shfl_sync(kFull, b - start, l) * R;
            }
            base += __shfl_sync(kFull, incl, 31);
        }
        if (lane == 0) {
            found_seq = fs;
            found_first = ff;
        }
    }
    __syncthreads();
    *seq = found_seq;
    *first = found_first;
}

/* Where the partial outputs of the launch's rows [row0, row0 + rows) go: per (row,
 * head, split) an unnormalized output row, the running maximum m and the sum l,
 * indexed by the row's offset in the launch. ns_max is the split count of max_ctx; a
 * row uses the first pos / 256 + 1 of its slots. */
struct Part {
    float *o, *m, *l;   /* [rows][H][ns_max][d], [rows][H][ns_max] x 2 */
    int ns_max;
};

__device__ __forceinline__ Part part_of(void *ws, int rows, int H, int d, int ns_max)
{
    Part P;
    P.o = static_cast<float *>(ws);
    P.m = P.o + (size_t)rows * H * ns_max * d;
    P.l = P.m + (size_t)rows * H * ns_max;
    P.ns_max = ns_max;
    return P;
}

/* Shared memory of the split kernel: the tile's values (rows padded by 16 bytes, so
 * that thread i writing row i meets no bank conflict), the query rows, their scores
 * and running outputs, and per query row the running maximum, sum and rescale and its
 * number of live keys in the tile. The padding moves each row by 4 banks: the 8
 * threads of a 16-byte store phase hit 8 different bank quadruples. The query rows
 * are floats holding BF16 values; sc holds a row's scores, then its weights. */
template <int D, int QR> struct Smem {
    static constexpr int kRow = D + 8;
    uint16_t v[kTile][kRow];
    float q[QR][D];
    float sc[QR][kTile];
    float acc[QR][D];
    float m[QR], l[QR], alpha[QR];
    int keys[QR];
};

/* What both kernels read, by value: the cache view, the sequences (device-resident),
 * this launch's rows [row0, row0 + rows) of the step, the query heads H, the
 * workspace's split capacity per row, the query and the workspace. */
struct Args {
    fr_paged_kv kv;
    const fr_paged_seq *seqs;
    int n_seqs, row0, rows, H, ns_max;
    const float *q;
    void *ws;
};

/* Query row qr = (row k of the block, head g of the group): qr = k * G + g. Template
 * parameters: D the head dim, G the group and R the rows of a block, so that QR = G R
 * sizes the shared arrays and the per-thread loops at compile time. A thread (pair,
 * share) owns dims 2 pair, 2 pair + 1 of the rows share, share + kShares, ... in the
 * value phase (kMine of them). Four block barriers per tile separate the phases
 * (loads, scores, softmax, values), each phase reading what the one before wrote. */
template <int D, int G, int R>
__global__ void __launch_bounds__(kThreads) split_kernel(Args A)
{
    constexpr int QR = G * R;
    constexpr int kVec = D / 8;                    /* 16-byte pieces of a row */
    constexpr int kPairs = D / 2;                  /* dimension pairs */
    constexpr int kShares = kThreads / kPairs;     /* query-row shares: 2 (d 128) or 4 (d 64) */
    constexpr int kMine = (QR + kShares - 1) / kShares;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem<D, QR> &S = *reinterpret_cast<Smem<D, QR> *>(smem_raw);
    const int h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int si, first;
    find_block<R>(A.seqs, A.n_seqs, blockIdx.z, &si, &first);
    if (si < 0) return;
    const fr_paged_seq s = A.seqs[si];
    /* the block's rows in this launch: [k0, k1) of the block */
    const int n_rows = s.n_new - first < R ? s.n_new - first : R;
    const int r_first = s.q_row + first;
    const int k0 = A.row0 > r_first ? A.row0 - r_first : 0;
    const int k1 = A.row0 + A.rows - r_first < n_rows ? A.row0 + A.rows - r_first : n_rows;
    if (k0 >= k1) return;
    /* p_last: the position of the block's last row in this launch, the last key any
     * of its rows sees. A block whose first split starts past it has nothing to do. */
    const int p_last = s.len + first + k1 - 1;                 /* the last row's position */
    if ((int)blockIdx.x * kSplitKeys > p_last) return;
    /* The block's query rows, rounded to BF16 as attn_bf16 rounds them, zero for rows
     * outside [k0, k1) (their results are never written). */
    for (int i = tid; i < QR * D; i += kThreads) {
        const int qr = i / D, k = qr / G, g = qr % G, r = r_first + k;
        const bool ok = k >= k0 && k < k1;
        const float x = ok ? A.q[((size_t)r * A.H + h * G + g) * D + i % D] : 0.0f;
        S.q[qr][i % D] = __bfloat162float(__float2bfloat16_rn(x));
    }
    const float scale = (float)(1.4426950408889634 / sqrt((double)D));   /* log2(e) / sqrt(d) */
    const int pair = tid % kPairs, share = tid / kPairs, dim = pair * 2;
    const Part P = part_of(A.ws, A.rows, A.H, D, A.ns_max);
    /* the block's splits: blockIdx.x, + gridDim.x, ... (each split's partial stands
     * alone, so which block computes it changes nothing). Every split restarts the
     * online softmax: acc, m and l are per split, and the combine joins them. */
    for (int j = blockIdx.x; j * kSplitKeys <= p_last; j += gridDim.x) {
        const int tile_end = min((j + 1) * kTilesPerSplit, p_last / kTile + 1);
        for (int i = tid; i < QR * D; i += kThreads) S.acc[i / D][i % D] = 0.0f;
        if (tid < QR) {
            S.m[tid] = -INFINITY;
            S.l[tid] = 0.0f;
        }
        for (int tile = j * kTilesPerSplit; tile < tile_end; tile++) {
            const int t = tile * kTile + tid;
            const bool live = t <= p_last;
            /* thread tid owns key tid: its value row into shared memory (16 loads in
             * flight), then its key row into registers. Keys past the block's last
             * row are not loaded (zeros); per query row, S.keys counts the tile's
             * keys the row sees, which is what the masks and the value loop use. */
            {
                const uint4 *vr = live ? reinterpret_cast<const uint4 *>(token_row(A.kv, s, h, t, true)) : nullptr;
                uint4 buf[kVec];
    #pragma unroll
                for (int c = 0; c < kVec; c++) buf[c] = live ? __ldg(vr + c) : make_uint4(0, 0, 0, 0);
    #pragma unroll
                for (int c = 0; c < kVec; c++) *reinterpret_cast<uint4 *>(&S.v[tid][c * 8]) = buf[c];
            }
            if (tid < QR) {   /* live keys of the query row in this tile: position p sees keys 0..p */
                const int k = tid / G, p = s.len + first + k;
                const int n = p + 1 - tile * kTile;
                S.keys[tid] = k < k0 || k >= k1 || n <= 0 ? 0 : n < kTile ? n : kTile;
            }
            /* The tile's values and the rows' live-key counts are visible to all
             * threads (and, at the first tile, the query rows). */
            __syncthreads();   /* (also: the query rows are in place) */
            {
                uint4 kb[kVec];
                const uint4 *kr = live ? reinterpret_cast<const uint4 *>(token_row(A.kv, s, h, t, false)) : nullptr;
    #pragma unroll
                for (int c = 0; c < kVec; c++) kb[c] = live ? __ldg(kr + c) : make_uint4(0, 0, 0, 0);
                /* Key tid against every query row. The dot product runs in increasing
                 * dimension with explicit fused multiply-adds (__fmaf_rn), so the
                 * compiler has no contraction choice to make; the query reads are
                 * broadcasts (every thread reads the same row). */
                for (int qr = 0; qr < QR; qr++) {
                    float dot = 0.0f;
    #pragma unroll
                    for (int c = 0; c < kVec; c++) {
                        const uint16_t *e = reinterpret_cast<const uint16_t *>(&kb[c]);
                        const float4 q0 = *reinterpret_cast<const float4 *>(&S.q[qr][c * 8]);
                        const float4 q1 = *reinterpret_cast<const float4 *>(&S.q[qr][c * 8 + 4]);
                        dot = __fmaf_rn(q0.x, bf(e[0]), dot);
                        dot = __fmaf_rn(q0.y, bf(e[1]), dot);
                        dot = __fmaf_rn(q0.z, bf(e[2]), dot);
                        dot = __fmaf_rn(q0.w, bf(e[3]), dot);
                        dot = __fmaf_rn(q1.x, bf(e[4]), dot);
                        dot = __fmaf_rn(q1.y, bf(e[5]), dot);
                        dot = __fmaf_rn(q1.z, bf(e[6]), dot);
                        dot = __fmaf_rn(q1.w, bf(e[7]), dot);
                    }
                    S.sc[qr][tid] = tid < S.keys[qr] ? __fmul_rn(dot, scale) : -INFINITY;
                }
            }
            /* Every key's score is in S.sc for the warps that own the rows. */
            __syncthreads();
            /* warp w: query rows w, w + 4, ...: the tile maximum, the weights, their
             * sum (each lane its 4 keys in order, then a butterfly over the lanes,
             * the same in every lane and every run). Each butterfly step adds a and b
             * in one lane and b and a in its partner, equal in IEEE arithmetic, so
             * every lane ends with the same bits. The maximum is exact in any order. */
            for (int qr = warp; qr < QR; qr += kThreads / 32) {
                if (S.keys[qr] == 0) continue;   /* no live key: the row skips the tile */
                float4 e4 = *reinterpret_cast<const float4 *>(&S.sc[qr][lane * 4]);
                float mx = fmaxf(fmaxf(e4.x, e4.y), fmaxf(e4.z, e4.w));
    #pragma unroll
                for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
                const float m_old = S.m[qr], m_new = fmaxf(m_old, mx);
                e4.x = exp2f(__fsub_rn(e4.x, m_new));
                e4.y = exp2f(__fsub_rn(e4.y, m_new));
                e4.z = exp2f(__fsub_rn(e4.z, m_new));
                e4.w = exp2f(__fsub_rn(e4.w, m_new));
                *reinterpret_cast<float4 *>(&S.sc[qr][lane * 4]) = e4;
                float sum = __fadd_rn(__fadd_rn(__fadd_rn(e4.x, e4.y), e4.z), e4.w);
    #pragma unroll
                for (int o = 16; o; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(kFull, sum, o));
                /* Every lane has read m_old before lane 0 overwrites it. */
                __syncwarp();
                if (lane == 0) {
                    const float al = exp2f(__fsub_rn(m_old, m_new));   /* the row's first tile: exp2(-inf) = 0 */
                    S.alpha[qr] = al;
                    S.m[qr] = m_new;
                    S.l[qr] = __fadd_rn(__fmul_rn(S.l[qr], al), sum);
                }
            }
            /* The weights, alpha, m and l of every row are in place for the value
             * phase. */
            __syncthreads();
            /* the values: thread (pair, share) accumulates query rows share, share +
             * kShares, ... over the live keys in order. The old output is rescaled by
             * alpha first, then each key's weight times value added with one explicit
             * FMA, key 0 first: per row the same sequence whatever the block's rows.
             * Rows with no live key in the tile leave acc untouched (their alpha was
             * never set for this tile). */
            {
                float o0[kMine], o1[kMine];
                int nk[kMine];
    #pragma unroll
                for (int u = 0; u < kMine; u++) {
                    const int qr = share + u * kShares;
                    nk[u] = qr < QR ? S.keys[qr] : 0;
                    o0[u] = o1[u] = 0.0f;
                    if (nk[u]) {
                        o0[u] = __fmul_rn(S.acc[qr][dim], S.alpha[qr]);
                        o1[u] = __fmul_rn(S.acc[qr][dim + 1], S.alpha[qr]);
                    }
                }
                int n_any = 0;
    #pragma unroll
                for (int u = 0; u < kMine; u++) n_any = nk[u] > n_any ? nk[u] : n_any;
                for (int i = 0; i < n_any; i++) {
                    const uint32_t pr = *reinterpret_cast<const uint32_t *>(&S.v[i][dim]);
                    const float v0 = bf((uint16_t)(pr & 0xffffu)), v1 = bf((uint16_t)(pr >> 16));
    #pragma unroll
                    for (int u = 0; u < kMine; u++) {
                        if (i >= nk[u]) continue;
                        const float w = S.sc[share + u * kShares][i];
                        o0[u] = __fmaf_rn(w, v0, o0[u]);
                        o1[u] = __fmaf_rn(w, v1, o1[u]);
                    }
                }
    #pragma unroll
                for (int u = 0; u < kMine; u++) {
                    if (!nk[u]) continue;
                    const int qr = share + u * kShares;
                    S.acc[qr][dim] = o0[u];
                    S.acc[qr][dim + 1] = o1[u];
                }
            }
            /* Every row's acc is written back before the next tile's value phase
             * reads it, and every thread is done with S.v before the next tile's
             * loads overwrite it. */
            __syncthreads();
        }
        /* The split's partial for every row of the block inside this launch whose
         * position reaches the split (a row's combine reads splits 0 .. pos / 256). */
        for (int i = tid; i < QR * D; i += kThreads) {
            const int qr = i / D, k = qr / G, g = qr % G;
            if (k < k0 || k >= k1 || j * kSplitKeys > s.len + first + k) continue;   /* the row is not in this split */
            const size_t row = (size_t)(r_first + k - A.row0);
            P.o[((row * A.H + h * G + g) * A.ns_max + j) * D + i % D] = S.acc[qr][i % D];
            if (i % D == 0) {
                P.m[(row * A.H + h * G + g) * A.ns_max + j] = S.m[qr];
                P.l[(row * A.H + h * G + g) * A.ns_max + j] = S.l[qr];
            }
        }
        __syncthreads();   /* the next split overwrites acc, m and l */
    }
}

/* One block per (row, head): the splits joined in split order. Rows that belong to no
 * sequence are left alone. D threads, one per output dim. Warp 0 finds the row's
 * position by scanning the sequences (a row belongs to at most one, so one lane
 * writes pos); the row's splits are 0 .. pos / 256, the ones that hold keys <= pos.
 * The maximum, then L and O summed in split order with explicitly rounded operations
 * (no contraction into FMAs), then O / L rounded to BF16 once: a function of the
 * partials alone. */
template <int D>
__global__ void __launch_bounds__(D) combine_kernel(Args A, uint16_t *out)
{
    const int rl = blockIdx.x, head = blockIdx.y, r = A.row0 + rl, dim = threadIdx.x;
    __shared__ int pos;
    if (threadIdx.x == 0) pos = -1;
    __syncthreads();
    if (threadIdx.x < 32)
        for (int i = threadIdx.x; i < A.n_seqs; i += 32) {
            const fr_paged_seq s = A.seqs[i];
            if (s.n_new > 0 && r >= s.q_row && r < s.q_row + s.n_new) pos = s.len + (r - s.q_row);
        }
    __syncthreads();
    if (pos < 0) return;
    const int ns = pos / kSplitKeys + 1;
    const Part P = part_of(A.ws, A.rows, A.H, D, A.ns_max);
    const size_t base = ((size_t)rl * A.H + head) * A.ns_max;
    float mx = -INFINITY;
    for (int j = 0; j < ns; j++) mx = fmaxf(mx, P.m[base + j]);
    float L = 0.0f, O = 0.0f;
    for (int j = 0; j < ns; j++) {
        const float w = exp2f(__fsub_rn(P.m[base + j], mx));
        L = __fadd_rn(L, __fmul_rn(P.l[base + j], w));
        O = __fadd_rn(O, __fmul_rn(P.o[(base + j) * D + dim], w));
    }
    out[((size_t)r * A.H + head) * D + dim] = __bfloat16_as_ushort(__float2bfloat16_rn(__fdiv_rn(O, L)));
}

template <int D, int G, int R>
/* One launch of the split kernel for a compile-time (D, G, R). */
void launch_one(dim3 grid, cudaStream_t st, const Args &a)
{
    split_kernel<D, G, R><<<grid, kThreads, sizeof(Smem<D, G * R>), st>>>(a);
}

/* Rows a block of a step with prefill chunks holds: 32 query rows. Consecutive tokens
 * of a chunk share the block's loads of keys and values, so a chunk does not read its
 * context once per token (docs/determinism.md); decode steps use R = 1, one token per
 * block, since their tokens belong to different sequences. */
template <int G> constexpr int chunk_rows() { return kMaxQueryRows / G; }

template <int D, int G>
void launch_group(bool decode, dim3 grid, cudaStream_t st, const Args &a)
{
    if (decode) launch_one<D, G, 1>(grid, st, a);
    else launch_one<D, G, chunk_rows<G>()>(grid, st, a);
}

/* G is a template argument (the query rows a block holds are G x R); every group from
 * 1 to kMaxGroup has its instances. The recursion walks G = 1, 2, ... up to the
 * runtime g and launches that instance. */
template <int D, int G = 1>
void launch_split(int g, bool decode, dim3 grid, cudaStream_t st, const Args &a)
{
    if constexpr (G <= kMaxGroup) {
        if (g == G) launch_group<D, G>(decode, grid, st, a);
        else launch_split<D, G + 1>(g, decode, grid, st, a);
    }
}

/* The kernels' shared-memory opt-in (above 48 KB), made outside any graph capture:
 * fr_attn_fixed_workspace_bytes calls it. sizeof(Smem) at QR = 32 and D = 128 is
 * about 82 KiB, mostly the tile's values and the rows' scores and outputs. opt_in_d
 * covers every G and both R of one D: 32 instances. */
template <int D, int G, int R> cudaError_t opt_in()
{
    return cudaFuncSetAttribute(split_kernel<D, G, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)sizeof(Smem<D, G * R>));
}

template <int D, int G = 1> cudaError_t opt_in_d()
{
    if constexpr (G > kMaxGroup) {
        return cudaSuccess;
    } else {
        cudaError_t e = opt_in<D, G, 1>();
        if (e == cudaSuccess) e = opt_in<D, G, chunk_rows<G>()>();
        return e == cudaSuccess ? opt_in_d<D, G + 1>() : e;
    }
}

/* Splits of the longest context a launch may see, and the workspace a row needs for
 * them: per head and split, D output floats plus m and l. */
int max_splits(int max_ctx) { return max_ctx > 0 ? (max_ctx + kSplitKeys - 1) / kSplitKeys : 1; }

size_t per_row_bytes(int H, int d, int max_ctx)
{
    return (size_t)H * max_splits(max_ctx) * ((size_t)d + 2) * sizeof(float);
}

}  // namespace

/* The workspace for rows_per_launch rows at max_ctx, and the opt-in of all 64 split
 * kernels (two head dims x 16 groups x decode and chunk R): attn_fixed.h asks for
 * this call once before the first fr_attn_fixed and before any graph capture. */
extern "C" fr_status fr_attn_fixed_workspace_bytes(int n_heads, int head_dim, int max_ctx, int rows_per_launch,
                                                   size_t *bytes)
{
    if (!bytes) return fr_fail(FR_EINVAL, "attn_fixed_workspace_bytes: NULL result");
    if (n_heads < 1 || (head_dim != 64 && head_dim != 128) || rows_per_launch < 1 || max_ctx < 1)
        return fr_fail(FR_EINVAL, "attn_fixed_workspace_bytes: %d heads, head_dim %d, context %d, %d rows", n_heads,
                       head_dim, max_ctx, rows_per_launch);
    *bytes = per_row_bytes(n_heads, head_dim, max_ctx) * (size_t)rows_per_launch;
    cudaError_t e = opt_in_d<128>();
    if (e == cudaSuccess) e = opt_in_d<64>();
    return e == cudaSuccess ? FR_OK
                            : fr_fail(FR_EINTERNAL, "attn_fixed: cannot raise the kernels' shared memory: %s",
                                      cudaGetErrorString(e));
}

extern "C" fr_status fr_attn_fixed(const fr_paged_kv *kv, const fr_paged_seq *seqs_dev, int n_seqs, int n_rows,
                                   int max_new, int max_ctx, const float *q, uint16_t *out, int n_heads, void *ws,
                                   size_t ws_bytes, cudaStream_t stream)
{
    if (!kv || !seqs_dev || !q || !out) return fr_fail(FR_EINVAL, "attn_fixed: NULL argument");
    if (n_seqs < 0 || n_rows < 0 || max_new < 1 || max_ctx < 1)
        return fr_fail(FR_EINVAL, "attn_fixed: %d sequences, %d rows, max_new %d, context %d", n_seqs, n_rows,
                       max_new, max_ctx);
    if (n_seqs == 0 || n_rows == 0) return FR_OK;
    const int d = kv->head_dim, KVH = kv->n_kv_heads;
    if (d != 64 && d != 128) return fr_fail(FR_EUNSUPPORTED, "attn_fixed: head_dim %d (64 or 128)", d);
    if (KVH < 1 || n_heads % KVH)
        return fr_fail(FR_EINVAL, "attn_fixed: %d heads over %d KV heads", n_heads, KVH);
    const int G = n_heads / KVH;
    if (G > kMaxGroup)
        return fr_fail(FR_EUNSUPPORTED, "attn_fixed: a group of %d query heads (1 to %d)", G, kMaxGroup);
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_fixed: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    /* A workspace must hold at least one row's partials; more rows per launch mean
     * fewer launches, never other numbers (a row's result does not depend on its
     * launch). */
    const size_t per_row = per_row_bytes(n_heads, d, max_ctx);
    if (!ws || ws_bytes < per_row)
        return fr_fail(FR_EINVAL, "attn_fixed: a workspace of %zu bytes is below the %zu one row needs", ws_bytes,
                       per_row);
    /* A step with no chunk (max_new 1) runs blocks of one row, R = 1; otherwise R =
     * 32 / G rows of a sequence share a block. A token's operations do not depend on
     * R (see the kernel), so decode and chunked steps agree bitwise. */
    const bool decode = max_new == 1;
    const int R = decode ? 1 : kMaxQueryRows / G;
    const int chunk = ws_bytes / per_row < (size_t)n_rows ? (int)(ws_bytes / per_row) : n_rows;
    /* every sequence has ceil(n_new / R) <= n_new / R + 1 blocks, so n_seqs + n_rows
     * / R bounds the row blocks whatever the device-side lengths; surplus blocks find
     * no rows and exit. The rows go in launches of `chunk` rows (what the workspace
     * holds); each launch's combine follows its split kernel in stream order. */
    const int blocks = decode ? n_rows : n_seqs + n_rows / R;
    for (int row0 = 0; row0 < n_rows; row0 += chunk) {
        const Args a = {*kv, seqs_dev, n_seqs, row0, n_rows - row0 < chunk ? n_rows - row0 : chunk, n_heads,
                        max_splits(max_ctx), q, ws};
        const int ns = max_splits(max_ctx);
        /* x: up to 64 blocks per row block, each looping over every 64th split of
         * max_ctx's ns; y: the KV head; z: the row blocks (an upper bound). */
        const dim3 grid(ns < kBlocksPerRow ? ns : kBlocksPerRow, KVH, blocks);
        if (d == 128) {
            launch_split<128>(G, decode, grid, stream, a);
            combine_kernel<128><<<dim3(a.rows, n_heads), 128, 0, stream>>>(a, out);
        } else {
            launch_split<64>(G, decode, grid, stream, a);
            combine_kernel<64><<<dim3(a.rows, n_heads), 64, 0, stream>>>(a, out);
        }
    }
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "attn_fixed: launch failed: %s", cudaGetErrorString(e));
}
