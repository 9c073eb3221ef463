/* BF16-KV attention kernels for Hopper (sm_90a): split-KV flash-decoding with
 * a combine kernel, and a flash-attention prefill kernel, both reading the
 * paged cache in place (attention/paged_kv.h). docs/attention_gpu.md has the
 * plan; attention/attn_bf16.h the contract.
 *
 * Both kernels run 4 warps and compute with mma.sync m16n8k16 (BF16 inputs,
 * FP32 accumulation). The rows of the MMA are query heads: in decode the G
 * heads of one KV head (padded to 16 with zero queries), in prefill the
 * flattened (token, head) pairs of a chunk, 16 per warp. Keys and values go
 * global -> shared with 16-byte cp.async in a 3-stage pipeline, into an
 * XOR-swizzled layout (16-byte piece c of row r at c ^ (r & 7)) that ldmatrix
 * reads without bank conflicts. Softmax runs in base 2 on the scaled logits
 * S = log2(e)/sqrt(d) q.k, so every log-sum-exp here is base 2.
 */
#include "attn_bf16.h"

#include <atomic>
#include <climits>
#include <stdint.h>

#include "attn_prefill_common.cuh"
#include "cuda_check.h"

namespace {

constexpr int kPage = 128;                    /* tokens per page */
constexpr int kThreads = 128;                 /* 4 warps in both kernels */
constexpr int kWarps = kThreads / 32;
constexpr int kDecChunk = 16;                 /* decode: tokens per warp per stage */
constexpr int kDecStages = 3;
constexpr int kDecUnit = kWarps * kDecChunk;  /* 64: the split granularity */
constexpr int kPfRows = 64;                   /* prefill: flattened query rows per block */
constexpr int kPfKeys = 64;                   /* prefill: keys per tile */
constexpr int kPfStages = 3;
constexpr int kMaxSplits = FR_ATTN_BF16_MAX_SPLITS;
constexpr int kMaxGroup = 16;
constexpr float kNegInf = -__builtin_huge_valf();

template <int D> constexpr int dec_smem_bytes() { return kWarps * kDecStages * 2 * kDecChunk * D * 2; }
template <int D> constexpr int pf_smem_bytes() { return kPfStages * 2 * kPfKeys * D * 2; }

static_assert(kWarps * 16 * 128 * 4 + 4 * kWarps * 16 * 4 + 16 * 4 <= dec_smem_bytes<128>(),
              "decode reduction must fit in the pipeline buffers");
static_assert(kWarps * 16 * 64 * 4 + 4 * kWarps * 16 * 4 + 16 * 4 <= dec_smem_bytes<64>(),
              "decode reduction must fit in the pipeline buffers");

/* PTX wrappers, the swizzled tile layout and the online-softmax step over a
 * key tile are shared with the FP4/FP8 prefill: attn_prefill_common.cuh. */
using namespace fr_pf;

/* ---- where a token's K and V are --------------------------------------- */

/* One (sequence, KV head) of the layer. */
struct SeqView {
    const uint8_t *page_k, *page_v;   /* pool + head page + K/V offset, for block 0 */
    const uint16_t *rec_k, *rec_v;    /* the recent slot rows of this head */
    const uint16_t *stg_k, *stg_v;    /* the staging row of token len, this head */
    const int *bt;
    size_t block_bytes;
    int stg_stride;                   /* elements from one staging row to the next */
    int len, full_end;                /* tokens cached; tokens in full pages */
};

template <int D>
__device__ __forceinline__ SeqView seq_view(const fr_paged_kv &kv, const fr_paged_seq &s, int head)
{
    SeqView v;
    const size_t lh = (size_t)kv.layer * kv.n_kv_heads + head;
    const uint8_t *hp = kv.pool + lh * kv.head_page_bytes;
    v.page_k = hp + kv.k_codes;
    v.page_v = hp + kv.v_codes;
    const uint16_t *rk = kv.recent + (size_t)s.slot * 2 * kv.slot_elems + lh * kPage * D;
    v.rec_k = rk;
    v.rec_v = rk + kv.slot_elems;
    const size_t so = ((size_t)s.q_row * kv.n_kv_heads + head) * D;
    v.stg_k = kv.step_k + so;
    v.stg_v = kv.step_v + so;
    v.bt = s.block_table;
    v.block_bytes = kv.block_bytes;
    v.stg_stride = kv.n_kv_heads * D;
    v.len = s.len;
    v.full_end = s.len / kPage * kPage;
    return v;
}

/* Queues row r (token tb + r, not in a full page) of a K/V tile; tokens at
 * or past kend become zeros, so masked keys never carry NaN into P.V. */
template <int D, int P>
__device__ __forceinline__ void issue_loose_row(const SeqView &v, int tb, int r, int col, int kend,
                                                uint32_t sk, uint32_t sv)
{
    const int t = tb + r;
    const uint16_t *k = v.rec_k, *vv = v.rec_v;
    uint32_t n = 16;
    if (t < v.len) {
        k += (size_t)(t - v.full_end) * D;
        vv += (size_t)(t - v.full_end) * D;
    } else if (t < kend) {
        const size_t o = (size_t)(t - v.len) * v.stg_stride;
        k = v.stg_k + o;
        vv = v.stg_v + o;
    } else {
        k = vv = reinterpret_cast<const uint16_t *>(v.page_k);
        n = 0;
    }
    cp_async16(sk + swz<P>(r, col), k + col * 8, n);
    cp_async16(sv + swz<P>(r, col), vv + col * 8, n);
}

/* Queues a tile of ROWS tokens starting at tb (a multiple of ROWS, so a tile
 * is inside one page or wholly past the full pages) with NT threads; blk is
 * the tile's block when it is in a full page. */
template <int D, int ROWS, int NT>
__device__ __forceinline__ void issue_tile(const SeqView &v, int tb, int kend, int blk, uint32_t sk,
                                           uint32_t sv, int tid)
{
    constexpr int P = D / 8, RS = NT / P, NR = ROWS / RS;
    static_assert(NT % P == 0 && ROWS % RS == 0, "tile shape");
    const int col = tid % P, r0 = tid / P;
    if (tb + ROWS <= v.full_end) {
        const size_t off = (size_t)blk * v.block_bytes + (size_t)(tb % kPage) * D * 2 + col * 16;
        const uint8_t *k = v.page_k + off, *vv = v.page_v + off;
#pragma unroll
        for (int i = 0; i < NR; i++) {
            const int r = r0 + i * RS;
            cp_async16(sk + swz<P>(r, col), k + (size_t)r * D * 2, 16);
            cp_async16(sv + swz<P>(r, col), vv + (size_t)r * D * 2, 16);
        }
    } else {
#pragma unroll
        for (int i = 0; i < NR; i++) issue_loose_row<D, P>(v, tb, r0 + i * RS, col, kend, sk, sv);
    }
}

/* ---- one warp, 16 query rows, one tile of keys ------------------------- */

/* A fragments of the 16 query rows (rows g and g + 8 of this lane; NULL: a
 * padding row of zeros), rounded to BF16. */
template <int D>
__device__ __forceinline__ void load_q(uint32_t (&qa)[D / 16][4], const float *ra, const float *rb,
                                       int lane)
{
    const int c2 = (lane & 3) * 2;
    const float2 z = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const float2 x0 = ra ? __ldg(reinterpret_cast<const float2 *>(ra + kk * 16 + c2)) : z;
        const float2 x1 = rb ? __ldg(reinterpret_cast<const float2 *>(rb + kk * 16 + c2)) : z;
        const float2 x2 = ra ? __ldg(reinterpret_cast<const float2 *>(ra + kk * 16 + 8 + c2)) : z;
        const float2 x3 = rb ? __ldg(reinterpret_cast<const float2 *>(rb + kk * 16 + 8 + c2)) : z;
        qa[kk][0] = pack_bf16(x0.x, x0.y);
        qa[kk][1] = pack_bf16(x1.x, x1.y);
        qa[kk][2] = pack_bf16(x2.x, x2.y);
        qa[kk][3] = pack_bf16(x3.x, x3.y);
    }
}


/* ---- decode: split-KV partials ----------------------------------------- */

/* Split `split` of a context of ctx tokens cut into at most n_splits ranges
 * of whole 64-token units: [t0, t1); active = the splits that get tokens. */
__host__ __device__ __forceinline__ void split_range(int ctx, int n_splits, int split, int *t0,
                                                     int *t1, int *active)
{
    const int units = (ctx + kDecUnit - 1) / kDecUnit;
    const int per = (units + n_splits - 1) / n_splits;
    *active = (units + per - 1) / per;
    *t0 = split * per * kDecUnit;
    const int end = (split + 1) * per * kDecUnit;
    *t1 = end < ctx ? end : ctx;
}

/* Grid (n_splits, n_kv_heads, n_seqs). Warp w of a split takes the 16-token
 * chunks w, w + 4, ... with its own 3-stage cp.async pipeline and online
 * softmax; the 4 warps merge through shared memory at the end. With o_part
 * NULL (one split) the block writes the BF16 output itself. */
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
decode_split_kernel(fr_paged_kv kv, const fr_paged_seq *__restrict__ seqs, const float *__restrict__ q,
                    uint16_t *__restrict__ out, float *__restrict__ o_part, float *__restrict__ lse_part,
                    int n_heads, int group, int n_splits, float gamma)
{
    extern __shared__ __align__(128) uint8_t smem[];
    const int split = blockIdx.x, head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = seqs[seq];
    if (s.n_new != 1) return;
    int t0, t1, active;
    split_range(s.len + 1, n_splits, split, &t0, &t1, &active);
    if (split >= active) return;

    const SeqView v = seq_view<D>(kv, s, head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_chunks = (t1 - t0 + kDecChunk - 1) / kDecChunk;
    const int my_chunks = n_chunks > warp ? (n_chunks - warp + kWarps - 1) / kWarps : 0;
    constexpr int kChunkBytes = kDecChunk * D * 2, kStageBytes = 2 * kChunkBytes;
    const uint32_t wbase = smem_addr(smem) + warp * kDecStages * kStageBytes;

    /* The lanes hold a window of 32 block-table entries; a chunk's block is
     * one shuffle away and the table is re-read every 32 pages. */
    const int n_pages = v.full_end / kPage;
    int pbase = -2 * 32, my_blk = 0;
    auto issue = [&](int k) {
        const int tb = t0 + (k * kWarps + warp) * kDecChunk;
        const uint32_t sk = wbase + (k % kDecStages) * kStageBytes;
        int blk = 0;
        if (tb + kDecChunk <= v.full_end) {     /* warp-uniform */
            const int page = tb / kPage;
            if (page < pbase || page >= pbase + 32) {
                pbase = page;
                my_blk = page + lane < n_pages ? __ldg(v.bt + page + lane) : 0;
            }
            blk = __shfl_sync(0xffffffffu, my_blk, page - pbase);
        }
        issue_tile<D, kDecChunk, 32>(v, tb, t1, blk, sk, sk + kChunkBytes, lane);
    };

#pragma unroll
    for (int k = 0; k < kDecStages - 1; k++) {
        if (k < my_chunks) issue(k);
        cp_async_commit();
    }

    const int g = lane >> 2;
    const float *qh = q + ((size_t)s.q_row * n_heads + (size_t)head * group) * D;
    uint32_t qa[D / 16][4];
    load_q<D>(qa, g < group ? qh + g * D : nullptr, g + 8 < group ? qh + (g + 8) * D : nullptr, lane);

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_a = kNegInf, m_b = kNegInf, l_a = 0.0f, l_b = 0.0f;

    for (int k = 0; k < my_chunks; k++) {
        cp_async_wait<kDecStages - 2>();
        __syncwarp();
        if (k + kDecStages - 1 < my_chunks) issue(k + kDecStages - 1);
        cp_async_commit();
        const int tb = t0 + (k * kWarps + warp) * kDecChunk;
        const uint32_t sk = wbase + (k % kDecStages) * kStageBytes;
        attend_tile<D, kDecChunk>(sk, sk + kChunkBytes, qa, o, m_a, m_b, l_a, l_b, tb, t1, t1,
                                  tb + kDecChunk > t1, gamma, lane);
    }
    cp_async_wait<0>();
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    __syncthreads();   /* every warp is done with its buffers */

    float *red_o = reinterpret_cast<float *>(smem);   /* [warps][16][D] */
    float *red_m = red_o + kWarps * 16 * D;            /* [warps][16] */
    float *red_l = red_m + kWarps * 16;
    float *wgt = red_l + kWarps * 16;
    float *lse_s = wgt + kWarps * 16;                  /* [16] */
    const int c2 = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        *reinterpret_cast<float2 *>(red_o + (warp * 16 + g) * D + j * 8 + c2) = make_float2(o[j][0], o[j][1]);
        *reinterpret_cast<float2 *>(red_o + (warp * 16 + g + 8) * D + j * 8 + c2) = make_float2(o[j][2], o[j][3]);
    }
    if ((lane & 3) == 0) {
        red_m[warp * 16 + g] = m_a;
        red_m[warp * 16 + g + 8] = m_b;
        red_l[warp * 16 + g] = l_a;
        red_l[warp * 16 + g + 8] = l_b;
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float mx = kNegInf;
#pragma unroll
        for (int w = 0; w < kWarps; w++) mx = fmaxf(mx, red_m[w * 16 + r]);
        float e[kWarps], sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            e[w] = mx == kNegInf ? 0.0f : exp2f(red_m[w * 16 + r] - mx);
            sum += red_l[w * 16 + r] * e[w];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) wgt[w * 16 + r] = e[w] * inv;
        lse_s[r] = sum > 0.0f ? mx + log2f(sum) : kNegInf;
    }
    __syncthreads();

    for (int idx = threadIdx.x; idx < group * (D / 4); idx += kThreads) {
        const int r = idx / (D / 4), j = (idx % (D / 4)) * 4;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            const float wv = wgt[w * 16 + r];
            const float4 x = *reinterpret_cast<const float4 *>(red_o + (w * 16 + r) * D + j);
            acc.x += wv * x.x;
            acc.y += wv * x.y;
            acc.z += wv * x.z;
            acc.w += wv * x.w;
        }
        if (!o_part) {
            uint16_t *dst = out + ((size_t)s.q_row * n_heads + (size_t)head * group + r) * D + j;
            *reinterpret_cast<uint2 *>(dst) = make_uint2(pack_bf16(acc.x, acc.y), pack_bf16(acc.z, acc.w));
        } else {
            const size_t prow = (((size_t)seq * kv.n_kv_heads + head) * n_splits + split) * group + r;
            *reinterpret_cast<float4 *>(o_part + prow * D + j) = acc;
            if (j == 0) lse_part[prow] = lse_s[r];
        }
    }
}

/* ---- decode: combine ----------------------------------------------------- */

__device__ __forceinline__ float block_max(float x, float *sh)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = x;
    __syncthreads();
    x = sh[0];
#pragma unroll
    for (int w = 1; w < kWarps; w++) x = fmaxf(x, sh[w]);
    return x;
}

__device__ __forceinline__ float block_sum(float x, float *sh)
{
#pragma unroll
    for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = x;
    __syncthreads();
    x = sh[0];
#pragma unroll
    for (int w = 1; w < kWarps; w++) x += sh[w];
    return x;
}

/* Grid (n_heads, n_seqs): o = sum_i 2^(lse_i - L) o_i over the active splits
 * of the sequence, L = log2 sum_i 2^lse_i; written as BF16. */
template <int D>
__global__ void __launch_bounds__(kThreads)
decode_combine_kernel(const fr_paged_seq *__restrict__ seqs, const float *__restrict__ o_part,
                      const float *__restrict__ lse_part, uint16_t *__restrict__ out, int n_heads,
                      int n_kv_heads, int group, int n_splits)
{
    __shared__ float w[kMaxSplits];
    __shared__ float sh[kWarps];
    __shared__ float4 part[kThreads];
    const int h = blockIdx.x, seq = blockIdx.y;
    const fr_paged_seq s = seqs[seq];
    if (s.n_new != 1) return;
    int t0, t1, active;
    split_range(s.len + 1, n_splits, 0, &t0, &t1, &active);
    const int kvh = h / group, g = h % group;
    const size_t row0 = ((size_t)seq * n_kv_heads + kvh) * n_splits * group + g;

    float mx = kNegInf;
    for (int i = threadIdx.x; i < active; i += kThreads) mx = fmaxf(mx, lse_part[row0 + (size_t)i * group]);
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < active; i += kThreads) {
        const float e = mx == kNegInf ? 0.0f : exp2f(lse_part[row0 + (size_t)i * group] - mx);
        w[i] = e;
        sum += e;
    }
    sum = block_sum(sum, sh);   /* its barriers also publish w[] */

    constexpr int C4 = D / 4, GR = kThreads / C4;
    const int c = threadIdx.x % C4, grp = threadIdx.x / C4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i = grp; i < active; i += GR) {
        const float wi = w[i];
        const float4 x = __ldg(reinterpret_cast<const float4 *>(o_part + (row0 + (size_t)i * group) * D) + c);
        acc.x += wi * x.x;
        acc.y += wi * x.y;
        acc.z += wi * x.z;
        acc.w += wi * x.w;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    if (grp == 0) {
        for (int k = 1; k < GR; k++) {
            const float4 x = part[k * C4 + c];
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        uint16_t *dst = out + ((size_t)s.q_row * n_heads + h) * D + c * 4;
        *reinterpret_cast<uint2 *>(dst) =
            make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
    }
}

/* ---- prefill ------------------------------------------------------------- */

/* Grid (ceil(max_new * G / 64), n_kv_heads, n_seqs). A block takes 64
 * flattened query rows f = i * G + g (token i of the chunk, head g of the KV
 * head), 16 per warp, and walks keys [0, len + i_max] in 64-key tiles shared
 * by the 4 warps (3-stage cp.async pipeline, one barrier per tile). Tiles past
 * a warp's last visible key are skipped by that warp; only tiles that reach
 * past the diagonal of the warp's first row are masked. Blocks run heaviest
 * (latest rows) first. Sequences with n_new < 2 are left to the decode path. */
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
prefill_kernel(fr_paged_kv kv, const fr_paged_seq *__restrict__ seqs, const float *__restrict__ q,
               uint16_t *__restrict__ out, int n_heads, int group, float gamma)
{
    extern __shared__ __align__(128) uint8_t smem[];
    const int head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = seqs[seq];
    if (s.n_new < 2) return;
    const int rows = s.n_new * group;
    const int f0 = (gridDim.x - 1 - blockIdx.x) * kPfRows;
    if (f0 >= rows) return;
    const int i_max = (min(f0 + kPfRows, rows) - 1) / group;
    const int kend = s.len + i_max + 1;
    const int n_tiles = (kend + kPfKeys - 1) / kPfKeys;

    const SeqView v = seq_view<D>(kv, s, head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int fw = f0 + warp * 16;
    const bool warp_live = fw < rows;
    const int i_lo = min(fw, rows - 1) / group, i_hi = (min(fw + 16, rows) - 1) / group;
    const int fa = fw + g, fb = fa + 8;
    const int ia = min(fa, rows - 1) / group, ib = min(fb, rows - 1) / group;

    constexpr int kTileBytes = kPfKeys * D * 2, kStageBytes = 2 * kTileBytes;
    const uint32_t base = smem_addr(smem);
    auto issue = [&](int j) {
        const int tb = j * kPfKeys;
        const uint32_t sk = base + (j % kPfStages) * kStageBytes;
        const int blk = tb + kPfKeys <= v.full_end ? __ldg(v.bt + tb / kPage) : 0;
        issue_tile<D, kPfKeys, kThreads>(v, tb, kend, blk, sk, sk + kTileBytes, threadIdx.x);
    };
#pragma unroll
    for (int j = 0; j < kPfStages - 1; j++) {
        if (j < n_tiles) issue(j);
        cp_async_commit();
    }

    auto q_row = [&](int f) -> const float * {
        if (f >= rows) return nullptr;
        return q + ((size_t)(s.q_row + f / group) * n_heads + (size_t)head * group + f % group) * D;
    };
    uint32_t qa[D / 16][4];
    load_q<D>(qa, q_row(fa), q_row(fb), lane);

    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_a = kNegInf, m_b = kNegInf, l_a = 0.0f, l_b = 0.0f;

    for (int j = 0; j < n_tiles; j++) {
        cp_async_wait<kPfStages - 2>();
        __syncthreads();   /* tile j landed for all; tile j - 1's buffer is free */
        if (j + kPfStages - 1 < n_tiles) issue(j + kPfStages - 1);
        cp_async_commit();
        const int tb = j * kPfKeys;
        if (warp_live && tb <= s.len + i_hi) {
            const uint32_t sk = base + (j % kPfStages) * kStageBytes;
            attend_tile<D, kPfKeys>(sk, sk + kTileBytes, qa, o, m_a, m_b, l_a, l_b, tb, s.len + ia + 1,
                                    s.len + ib + 1, tb + kPfKeys - 1 > s.len + i_lo, gamma, lane);
        }
    }
    cp_async_wait<0>();
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);

    const int c2 = (lane & 3) * 2;
    auto store = [&](int f, float l, int hi) {
        if (f >= rows) return;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        uint16_t *dst = out + ((size_t)(s.q_row + f / group) * n_heads + (size_t)head * group + f % group) * D + c2;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *reinterpret_cast<uint32_t *>(dst + j * 8) = pack_bf16(o[j][hi] * inv, o[j][hi + 1] * inv);
    };
    store(fa, l_a, 0);
    store(fb, l_b, 2);
}

/* ---- host side ------------------------------------------------------------ */

/* Planner constants, in 64-token units of work: the fixed cost of a split
 * (pipeline fill, merge) and of the combine launch. */
constexpr long kSplitFixedUnits = 2;
constexpr long kCombineUnits = 2;
constexpr int kMaxDevices = 64;

struct DevInfo {
    std::atomic<int> ready;
    int sms;
    int dec_blocks[2];   /* decode blocks per SM, head_dim 64 and 128 */
};
DevInfo g_dev[kMaxDevices];

template <int D> fr_status setup_kernels(int *dec_blocks)
{
    FR_CUDA_TRY(cudaFuncSetAttribute(decode_split_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     dec_smem_bytes<D>()));
    FR_CUDA_TRY(cudaFuncSetAttribute(prefill_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     pf_smem_bytes<D>()));
    FR_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(dec_blocks, decode_split_kernel<D>, kThreads,
                                                              dec_smem_bytes<D>()));
    if (*dec_blocks < 1) *dec_blocks = 1;
    return FR_OK;
}

/* Per-device setup, once (the calls are idempotent, so a race only repeats them). */
fr_status device_info(const DevInfo **out)
{
    int dev = 0;
    FR_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices)
        return fr_fail(FR_EUNSUPPORTED, "attn_bf16: device %d beyond the %d supported", dev, kMaxDevices);
    DevInfo *d = &g_dev[dev];
    if (!d->ready.load(std::memory_order_acquire)) {
        FR_CUDA_TRY(cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, dev));
        fr_status st = setup_kernels<64>(&d->dec_blocks[0]);
        if (st) return st;
        if ((st = setup_kernels<128>(&d->dec_blocks[1]))) return st;
        d->ready.store(1, std::memory_order_release);
    }
    *out = d;
    return FR_OK;
}

/* The split count minimizing (waves of blocks) x (units per split + fixed
 * cost), plus the combine's cost when splitting; ties keep fewer splits. */
int plan_splits(int n_seqs, int n_kv_heads, int max_ctx, int slots)
{
    const long units = max_ctx > 0 ? ((long)max_ctx + kDecUnit - 1) / kDecUnit : 1;
    const long blocks = (long)(n_seqs > 0 ? n_seqs : 1) * n_kv_heads;
    const int n_max = units < kMaxSplits ? (int)units : kMaxSplits;
    int best = 1;
    long best_cost = LONG_MAX;
    for (int n = 1; n <= n_max; n++) {
        const long waves = (blocks * n + slots - 1) / slots;
        const long cost = waves * ((units + n - 1) / n + kSplitFixedUnits) + (n > 1 ? kCombineUnits : 0);
        if (cost < best_cost) {
            best_cost = cost;
            best = n;
        }
    }
    return best;
}

size_t partial_bytes(int n_seqs, int n_kv_heads, int group, int head_dim, int n_splits)
{
    return (size_t)n_seqs * n_kv_heads * n_splits * group * ((size_t)head_dim + 1) * sizeof(float);
}

fr_status check_heads(int n_heads, int n_kv_heads, int head_dim)
{
    if (head_dim != 64 && head_dim != 128)
        return fr_fail(FR_EUNSUPPORTED, "attn_bf16: head_dim %d (64 and 128 are supported)", head_dim);
    if (n_kv_heads < 1 || n_kv_heads > 65535 || n_heads < n_kv_heads || n_heads % n_kv_heads)
        return fr_fail(FR_EINVAL, "attn_bf16: %d query heads do not group over %d KV heads", n_heads, n_kv_heads);
    if (n_heads / n_kv_heads > kMaxGroup)
        return fr_fail(FR_EINVAL, "attn_bf16: group %d above %d", n_heads / n_kv_heads, kMaxGroup);
    return FR_OK;
}

bool misaligned(const void *p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0; }

template <int D>
fr_status launch(const fr_paged_kv &kv, const fr_paged_seq *seqs, int n_seqs, int max_new, int group,
                 int n_splits, const float *q, uint16_t *out, int n_heads, float *o_part, float *lse_part,
                 cudaStream_t stream)
{
    const float gamma = (float)(1.4426950408889634 / (D == 128 ? 11.313708498984761 : 8.0));
    if (max_new > 1) {
        const long mblocks = ((long)max_new * group + kPfRows - 1) / kPfRows;
        if (mblocks > INT_MAX) return fr_fail(FR_EINVAL, "attn_bf16: max_new %d too large", max_new);
        prefill_kernel<D><<<dim3((unsigned)mblocks, kv.n_kv_heads, n_seqs), kThreads, pf_smem_bytes<D>(), stream>>>(
            kv, seqs, q, out, n_heads, group, gamma);
        FR_CUDA_LAUNCHED();
    }
    decode_split_kernel<D><<<dim3(n_splits, kv.n_kv_heads, n_seqs), kThreads, dec_smem_bytes<D>(), stream>>>(
        kv, seqs, q, out, n_splits > 1 ? o_part : nullptr, lse_part, n_heads, group, n_splits, gamma);
    FR_CUDA_LAUNCHED();
    if (n_splits > 1) {
        decode_combine_kernel<D><<<dim3(n_heads, n_seqs), kThreads, 0, stream>>>(
            seqs, o_part, lse_part, out, n_heads, kv.n_kv_heads, group, n_splits);
        FR_CUDA_LAUNCHED();
    }
    return FR_OK;
}

} // namespace

extern "C" fr_status fr_attn_bf16_splits(int n_seqs, int n_kv_heads, int head_dim, int max_ctx, int *n_splits)
{
    if (!n_splits || n_kv_heads < 1) return fr_fail(FR_EINVAL, "attn_bf16_splits: invalid arguments");
    fr_status st = check_heads(n_kv_heads, n_kv_heads, head_dim);
    if (st) return st;
    const DevInfo *d;
    if ((st = device_info(&d))) return st;
    *n_splits = plan_splits(n_seqs, n_kv_heads, max_ctx, d->sms * d->dec_blocks[head_dim == 128]);
    return FR_OK;
}

extern "C" fr_status fr_attn_bf16_workspace_bytes(int max_seqs, int n_heads, int n_kv_heads, int head_dim,
                                                  int max_ctx, size_t *bytes)
{
    if (!bytes) return fr_fail(FR_EINVAL, "attn_bf16_workspace_bytes: NULL result");
    *bytes = 0;
    fr_status st = check_heads(n_heads, n_kv_heads, head_dim);
    if (st) return st;
    if (max_seqs < 0) return fr_fail(FR_EINVAL, "attn_bf16_workspace_bytes: max_seqs %d < 0", max_seqs);
    const DevInfo *d;
    if ((st = device_info(&d))) return st;
    const int slots = d->sms * d->dec_blocks[head_dim == 128];
    const int group = n_heads / n_kv_heads;
    size_t need = 0;
    for (int n = 1; n <= max_seqs; n++) {
        const int sp = plan_splits(n, n_kv_heads, max_ctx, slots);
        const size_t b = sp > 1 ? partial_bytes(n, n_kv_heads, group, head_dim, sp) : 0;
        if (b > need) need = b;
    }
    *bytes = need;
    return FR_OK;
}

extern "C" fr_status fr_attn_bf16(const fr_paged_kv *kv, const fr_paged_seq *seqs_dev, int n_seqs, int max_new,
                                  int max_ctx, const float *q, uint16_t *out, int n_heads, void *workspace,
                                  size_t workspace_bytes, cudaStream_t stream)
{
    if (!kv || !seqs_dev || !q || !out)
        return fr_fail(FR_EINVAL, "attn_bf16: NULL argument");
    if (n_seqs < 0 || n_seqs > 65535)
        return fr_fail(FR_EINVAL, "attn_bf16: %d sequences outside [0, 65535]", n_seqs);
    if (n_seqs == 0) return FR_OK;
    fr_status st = check_heads(n_heads, kv->n_kv_heads, kv->head_dim);
    if (st) return st;
    if (max_new < 1) return fr_fail(FR_EINVAL, "attn_bf16: max_new %d < 1", max_new);
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_bf16: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    if (!kv->pool || !kv->recent || !kv->step_k || !kv->step_v)
        return fr_fail(FR_EINVAL, "attn_bf16: the cache view lacks a pool, recent slots or staging rows");
    if (misaligned(kv->pool, 16) || misaligned(kv->recent, 16) || misaligned(kv->step_k, 16) ||
        misaligned(kv->step_v, 16) || kv->block_bytes % 16 || kv->head_page_bytes % 16 || kv->k_codes % 16 ||
        kv->v_codes % 16 || kv->slot_elems % 8 || misaligned(q, 8) || misaligned(out, 8))
        return fr_fail(FR_EINVAL, "attn_bf16: pointers and page offsets must be 16-byte aligned "
                                  "(q and out 8-byte)");
    const size_t page_bytes = (size_t)kPage * kv->head_dim * 2;
    if (kv->k_codes + page_bytes > kv->head_page_bytes || kv->v_codes + page_bytes > kv->head_page_bytes)
        return fr_fail(FR_EINVAL, "attn_bf16: a BF16 head page needs K and V of %zu bytes inside %zu",
                       page_bytes, kv->head_page_bytes);

    const DevInfo *d;
    if ((st = device_info(&d))) return st;
    const int group = n_heads / kv->n_kv_heads, D = kv->head_dim;
    int n_splits = plan_splits(n_seqs, kv->n_kv_heads, max_ctx, d->sms * d->dec_blocks[D == 128]);
    if (n_splits > 1) {
        const size_t per_split = partial_bytes(n_seqs, kv->n_kv_heads, group, D, 1);
        const size_t fit = workspace && !misaligned(workspace, 16) ? workspace_bytes / per_split : 0;
        if ((size_t)n_splits > fit) n_splits = fit >= 2 ? (int)fit : 1;
    }
    float *o_part = static_cast<float *>(workspace);
    float *lse_part = n_splits > 1 ? o_part + (size_t)n_seqs * kv->n_kv_heads * n_splits * group * D : nullptr;
    return D == 128 ? launch<128>(*kv, seqs_dev, n_seqs, max_new, group, n_splits, q, out, n_heads, o_part,
                                  lse_part, stream)
                    : launch<64>(*kv, seqs_dev, n_seqs, max_new, group, n_splits, q, out, n_heads, o_part,
                                 lse_part, stream);
}
