/* BF16-KV attention kernels for Hopper (sm_90a): split-KV flash-decoding with a
 * combine kernel, and a flash-attention prefill kernel, both reading the paged cache
 * in place (attention/paged_kv.h). docs/attention_gpu.md has the plan;
 * attention/attn_bf16.h the contract.
 *
 * Both kernels run 4 warps and compute with mma.sync m16n8k16 (BF16 inputs, FP32
 * accumulation). The rows of the MMA are query heads: in decode the G heads of one KV
 * head (padded to 16 with zero queries), in prefill the flattened (token, head) pairs
 * of a chunk, 16 per warp. Keys and values go global -> shared with 16-byte cp.async
 * in a 3-stage pipeline, into an XOR-swizzled layout (16-byte piece c of row r at c ^
 * (r & 7)) that ldmatrix reads without bank conflicts. Softmax runs in base 2 on the
 * scaled logits S = log2(e)/sqrt(d) q.k, so every log-sum-exp here is base 2.
 *
 * One call serves a mixed step: the prefill kernel takes the sequences with n_new >
 * 1, the decode kernels those with n_new == 1, and each skips the others', so the
 * host launches both without looking at the (device-resident) lengths. The host sizes
 * grids from bounds only (n_seqs, max_new, max_ctx), which is what lets a captured
 * step replay with new lengths and block tables. */
#include "attn_bf16.h"

#include <atomic>
#include <climits>
#include <stdint.h>

#include "attn_prefill_common.cuh"
#include "cuda_check.h"

namespace {

/* Decode: a warp takes 16-token chunks, one k-step of P.V and two n-tiles of S,
 * through its own 3-stage pipeline (two chunks in flight while it computes the
 * third); 4 warps x 16 tokens = 64 is the unit splits are cut in. Prefill: 64 query
 * rows (4 warps x 16) against 64-key tiles, half a page, so a tile never straddles a
 * page. kMaxGroup: the decode MMA's 16 rows hold at most 16 heads of one KV head. */
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

/* Dynamic shared memory. Decode: per warp 3 stages of a K and a V chunk (16 x D BF16
 * each), 96 KiB at D = 128; prefill: 3 stages of a K and a V tile (64 x D BF16 each),
 * also 96 KiB. Two blocks fit an SM either way (the launch bounds ask for 2). After
 * its loop the decode kernel reuses its buffers for the warps' merge: partial outputs
 * [4][16][D] floats, the maxima, sums and weights [4][16] and the LSEs [16], which
 * the static_asserts check fit. */
template <int D> constexpr int dec_smem_bytes() { return kWarps * kDecStages * 2 * kDecChunk * D * 2; }
template <int D> constexpr int pf_smem_bytes() { return kPfStages * 2 * kPfKeys * D * 2; }

static_assert(kWarps * 16 * 128 * 4 + 4 * kWarps * 16 * 4 + 16 * 4 <= dec_smem_bytes<128>(),
              "decode reduction must fit in the pipeline buffers");
static_assert(kWarps * 16 * 64 * 4 + 4 * kWarps * 16 * 4 + 16 * 4 <= dec_smem_bytes<64>(),
              "decode reduction must fit in the pipeline buffers");

/* PTX wrappers, the swizzled tile layout and the online-softmax step over a key tile
 * are shared with the FP4/FP8 prefill: attn_prefill_common.cuh. */
using namespace fr_pf;

/* ---- where a token's K and V are --------------------------------------- */

/* One (sequence, KV head) of the layer: every address a tile needs, computed once per
 * block. The page pointers are for block 0; a tile in a full page adds its block's
 * offset (block_table[page] * block_bytes). Staging rows are [rows][n_kv_heads][D],
 * so consecutive tokens of a chunk are stg_stride elements apart. */
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

/* Queues row r (token tb + r, not in a full page) of a K/V tile; tokens at or past
 * kend become zeros, so masked keys never carry NaN into P.V. Tokens [full_end, len)
 * are the recent slot's rows t - full_end (= t % 128), tokens [len, kend) the step's
 * staging rows q_row + t - len (a prefill chunk, or decode's one token). The
 * zero-filled copy still needs a valid address: the head page's. */
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

/* Queues a tile of ROWS tokens starting at tb (a multiple of ROWS, so a tile is
 * inside one page or wholly past the full pages) with NT threads; blk is the tile's
 * block when it is in a full page. Thread tid copies 16-byte piece tid % P of rows
 * tid / P, + NT / P, ...: consecutive threads take consecutive pieces of a row, so
 * each row is read as contiguous bytes. */
template <int D, int ROWS, int NT>
__device__ __forceinline__ void issue_tile(const SeqView &v, int tb, int kend, int blk, uint32_t sk,
                                           uint32_t sv, int tid)
{
    constexpr int P = D / 8, RS = NT / P, NR = ROWS / RS;
    static_assert(NT % P == 0 && ROWS % RS == 0, "tile shape");
    const int col = tid % P, r0 = tid / P;
    if (tb + ROWS <= v.full_end) {
        /* Row tb % 128 of the head page in block blk, piece col: the tile's rows are
         * contiguous in the page. */
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

/* A fragments of the 16 query rows (rows g and g + 8 of this lane; NULL: a padding
 * row of zeros), rounded to BF16. For k-step kk the lane needs columns 2t, 2t + 1
 * (a0: row g, a1: row g + 8) and 2t + 8, 2t + 9 (a2, a3) of the k-step's 16 dims:
 * four float2 loads straight from the float32 query, no shared memory. The rounding
 * here is the query's only one. */
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

/* Split `split` of a context of ctx tokens cut into at most n_splits ranges of whole
 * 64-token units: [t0, t1); active = the splits that get tokens. The host plans
 * n_splits from max_ctx, so a shorter sequence leaves the last splits without tokens:
 * their blocks exit, and the combine, which calls this same function, reads only the
 * active splits' partials. */
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

/* Grid (n_splits, n_kv_heads, n_seqs). Warp w of a split takes the 16-token chunks w,
 * w + 4, ... with its own 3-stage cp.async pipeline and online softmax; the 4 warps
 * merge through shared memory at the end. With o_part NULL (one split) the block
 * writes the BF16 output itself.
 *
 * The warps never wait for each other inside the loop: each owns its stages (a
 * quarter of the shared memory) and its own softmax state, so a warp barrier orders
 * its pipeline and the only block barriers are at the merge. The MMA's 16 rows are the
 * group's heads g and g + 8 (load_q), so every lane's two rows see the same keys: the
 * masks use t1 for both. */
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
    /* Chunks (n_new > 1) are the prefill kernel's and idle graph entries (n_new 0)
     * nobody's. Splits past the active ones hold no tokens of this sequence; the
     * combine never reads their slots. */
    if (split >= active) return;

    const SeqView v = seq_view<D>(kv, s, head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    /* Chunks of the split, dealt to the warps round robin: warp w takes chunks w, w +
     * 4, ...; wbase is the warp's private region (kDecStages stages of a K chunk then
     * a V chunk). */
    const int n_chunks = (t1 - t0 + kDecChunk - 1) / kDecChunk;
    const int my_chunks = n_chunks > warp ? (n_chunks - warp + kWarps - 1) / kWarps : 0;
    constexpr int kChunkBytes = kDecChunk * D * 2, kStageBytes = 2 * kChunkBytes;
    const uint32_t wbase = smem_addr(smem) + warp * kDecStages * kStageBytes;

    /* The lanes hold a window of 32 block-table entries; a chunk's block is one
     * shuffle away and the table is re-read every 32 pages. A warp's chunks rise in
     * position, so the window only moves forward; pbase starts at -64, outside any
     * window, to force the first load. The branch depends on tb alone, so the whole
     * warp takes it and the shuffle has all 32 lanes. Only full pages have entries to
     * read (page + lane < n_pages). */
    const int n_pages = v.full_end / kPage;
    int pbase = -2 * 32, my_blk = 0;
    /* Chunk k of this warp: tokens tb .. tb + 15 with tb = t0 + 16 (4k + w), into
     * stage k % 3. Splits start on 64-token units, so a chunk lies in one page or
     * wholly past the full pages; a full-page chunk takes its block from the window. */
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

    /* Prologue: the warp's first two chunks in flight. A group is committed per stage
     * even when there is no chunk, so that cp_async_wait<kDecStages - 2> below always
     * means "chunk k has landed". */
#pragma unroll
    for (int k = 0; k < kDecStages - 1; k++) {
        if (k < my_chunks) issue(k);
        cp_async_commit();
    }

    /* The query rows load while the first chunks are in flight: lane (g, t) holds
     * heads g and g + 8 of the group, zero rows past the group. */
    const int g = lane >> 2;
    const float *qh = q + ((size_t)s.q_row * n_heads + (size_t)head * group) * D;
    uint32_t qa[D / 16][4];
    load_q<D>(qa, g < group ? qh + g * D : nullptr, g + 8 < group ? qh + (g + 8) * D : nullptr, lane);

    float o[D / 8][4], m_a, m_b, l_a, l_b;
    softmax_start<D>(o, m_a, m_b, l_a, l_b);

    /* Per chunk: wait for this lane's copies of chunk k, then __syncwarp, which makes
     * the other lanes' copies visible and guarantees that every lane is done with
     * chunk k - 1, whose stage the next issue refills (only this warp uses its
     * stages, so a warp barrier is enough). The chunk's keys end at the split's end
     * t1 for every row; only a chunk that crosses t1 needs the mask. */
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
    /* No copy may still be in flight when the buffers become the merge's. Each lane's
     * l covers its own two keys per n-tile: the quad's four lanes add up to the
     * row's. */
    cp_async_wait<0>();
    quad_sums(l_a, l_b);
    __syncthreads();   /* every warp is done with its buffers */

    /* The merge of the four warps, in the pipeline's bytes: each warp writes its
     * unnormalized O (C fragments: rows g, g + 8, dims 8j + 2t, + 1), m and l; then
     * the weights per row (below) and a sum over the warps in warp order, four dims
     * per thread. */
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
    /* The quad's lanes hold the same m, and after the xor sums the same l: lane t = 0
     * writes them. */
    if ((lane & 3) == 0) {
        red_m[warp * 16 + g] = m_a;
        red_m[warp * 16 + g + 8] = m_b;
        red_l[warp * 16 + g] = l_a;
        red_l[warp * 16 + g + 8] = l_b;
    }
    __syncthreads();
    /* Thread r < 16 merges row r: M = max of the warps' m, weights 2^(m_w - M) / L
     * with L = sum l_w 2^(m_w - M), and the row's LSE M + log2 L (base 2, nothing
     * folded in). */
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

    /* Rows past the group (padding heads) are never written. */
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
        /* One split: the block's result is final and is written as BF16 (no combine
         * is launched). Otherwise the normalized partial and its LSE go to the
         * workspace. */
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

/* Block-wide max and sum of the combine, over its 4 warps: a butterfly in the warp,
 * then the warps' values through sh. The first __syncthreads keeps a previous call's
 * readers of sh from seeing this call's writes; the second publishes them. */
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

/* Grid (n_heads, n_seqs): o = sum_i 2^(lse_i - L) o_i over the active splits of the
 * sequence, L = log2 sum_i 2^lse_i; written as BF16. The weights are taken relative
 * to the largest LSE (none above 1). The 128 threads form D / 4 columns of float4 by
 * 128 / (D / 4) groups; group k sums partials k, k + groups, ..., and group 0 adds
 * the groups in order: the result depends on the split count, not on timing. */
template <int D>
__global__ void __launch_bounds__(kThreads)
decode_combine_kernel(const fr_paged_seq *__restrict__ seqs, const float *__restrict__ o_part,
                      const float *__restrict__ lse_part, uint16_t *__restrict__ out, int n_heads,
                      int n_kv_heads, int group, int n_splits)
{
    /* w: one weight per active split (at most kMaxSplits); sh: the warps' partial max
     * or sum; part: every thread's float4 sum, for group 0 to add up. */
    __shared__ float w[kMaxSplits];
    __shared__ float sh[kWarps];
    __shared__ float4 part[kThreads];
    const int h = blockIdx.x, seq = blockIdx.y;
    const fr_paged_seq s = seqs[seq];
    if (s.n_new != 1) return;
    int t0, t1, active;
    /* Only the number of active splits matters here; any split's range call gives it. */
    split_range(s.len + 1, n_splits, 0, &t0, &t1, &active);
    const int kvh = h / group, g = h % group;
    /* Head h is row g of its KV head's partials [seq][kv head][split][G]: consecutive
     * splits are G rows apart. */
    const size_t row0 = ((size_t)seq * n_kv_heads + kvh) * n_splits * group + g;

    /* The largest LSE of the active splits, then the weights 2^(lse_i - max) and
     * their sum. */
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

    /* Thread (grp, c): float4 column c (dims 4c .. 4c + 3) of the partials grp, grp +
     * GR, ...; the partial rows are read through the read-only path (__ldg), each
     * once. */
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
    /* Decode tokens are the decode kernels', idle entries nobody's. */
    if (s.n_new < 2) return;
    /* The block's rows. x runs backwards so that block 0 takes the last row block,
     * the one with the most keys: the heaviest blocks start first and short ones fill
     * the tail (docs/attention_gpu.md). Blocks past this sequence's rows (other
     * sequences have longer chunks) exit; i_max is the block's last token, whose keys
     * [0, len + i_max] bound the tiles. */
    const int rows = s.n_new * group;
    const int f0 = (gridDim.x - 1 - blockIdx.x) * kPfRows;
    if (f0 >= rows) return;
    const int i_max = (min(f0 + kPfRows, rows) - 1) / group;
    const int kend = s.len + i_max + 1;
    const int n_tiles = (kend + kPfKeys - 1) / kPfKeys;

    const SeqView v = seq_view<D>(kv, s, head);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    /* Warp rows fw .. fw + 15; i_lo and i_hi are the tokens of its first and last
     * live row, ia and ib those of the lane's rows g and g + 8. A padding row (f >=
     * rows) takes the last row's token so its masks stay in range; it loads a zero
     * query and is never stored. */
    const int fw = f0 + warp * 16;
    const bool warp_live = fw < rows;
    const int i_lo = min(fw, rows - 1) / group, i_hi = (min(fw + 16, rows) - 1) / group;
    const int fa = fw + g, fb = fa + 8;
    const int ia = min(fa, rows - 1) / group, ib = min(fb, rows - 1) / group;

    constexpr int kTileBytes = kPfKeys * D * 2, kStageBytes = 2 * kTileBytes;
    const uint32_t base = smem_addr(smem);
    /* Tile j of keys [64 j, 64 j + 64): a full-page tile is copied from its block
     * (one table read: the tile is inside one page), any other from the recent slot
     * and the chunk's staging rows, zero past kend. */
    auto issue = [&](int j) {
        const int tb = j * kPfKeys;
        const uint32_t sk = base + (j % kPfStages) * kStageBytes;
        const int blk = tb + kPfKeys <= v.full_end ? __ldg(v.bt + tb / kPage) : 0;
        issue_tile<D, kPfKeys, kThreads>(v, tb, kend, blk, sk, sk + kTileBytes, threadIdx.x);
    };
    /* Prologue: tiles 0 and 1 in flight (a group per stage, empty or not, as in
     * decode), then the warp's query rows, which overlap them. */
#pragma unroll
    for (int j = 0; j < kPfStages - 1; j++) {
        if (j < n_tiles) issue(j);
        cp_async_commit();
    }

    /* Flattened row f is head f % G (of this KV head's group) of the chunk's token f
     * / G, step row q_row + f / G. */
    auto q_row = [&](int f) -> const float * {
        if (f >= rows) return nullptr;
        return q + ((size_t)(s.q_row + f / group) * n_heads + (size_t)head * group + f % group) * D;
    };
    uint32_t qa[D / 16][4];
    load_q<D>(qa, q_row(fa), q_row(fb), lane);

    float o[D / 8][4], m_a, m_b, l_a, l_b;
    softmax_start<D>(o, m_a, m_b, l_a, l_b);

    /* One barrier per tile: after it tile j has landed for every thread and every
     * warp has left tile j - 1, whose stage the issue below refills with tile j + 2.
     * A warp whose rows end before the tile (tb > len + i_hi, past its last row's
     * diagonal) skips the MMAs but not the barrier or the copies, which the whole
     * block shares. Masks are needed only where the tile reaches past the first row's
     * diagonal; row f sees keys up to len + (its token), hence lim = len + ia + 1. */
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
    quad_sums(l_a, l_b);

    /* The quad's lanes hold different keys of a row: their l add up to the row's sum.
     * Each lane then writes its C columns 8j + 2t, 8j + 2t + 1 of rows fa and fb,
     * normalized, as BF16. */
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

/* Per device, set once: the SM count and the decode blocks per SM (by occupancy, for
 * head_dim 64 and 128), which give the slots the split plan counts waves in; ready is
 * stored last (release), so a reader that sees it also sees the rest. */
struct DevInfo {
    std::atomic<int> ready;
    int sms;
    int dec_blocks[2];   /* decode blocks per SM, head_dim 64 and 128 */
};
DevInfo g_dev[kMaxDevices];

/* Both kernels take 96 KiB (D = 128) of dynamic shared memory, above the default 48
 * KB a kernel may use without opting in; the opt-in is per device and must precede
 * the first launch. The occupancy of the decode kernel at that size is the number of
 * its blocks that run at once on an SM. */
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

/* The split count minimizing (waves of blocks) x (units per split + fixed cost), plus
 * the combine's cost when splitting; ties keep fewer splits. At 132 SMs and 8 KV
 * heads this gives about 32 splits at batch 1, two at batch 16 and one at batch 64
 * (docs/attention_gpu.md, "Split plan"). A split gets at least one unit, and at most
 * kMaxSplits splits are planned (the combine's weight array). */
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

/* Workspace of a plan: per (sequence, KV head, split, head) a float32 output row and
 * its LSE; o_part [seq][kvh][split][G][d] first, then lse_part [seq][kvh][split][G]. */
size_t partial_bytes(int n_seqs, int n_kv_heads, int group, int head_dim, int n_splits)
{
    return (size_t)n_seqs * n_kv_heads * n_splits * group * ((size_t)head_dim + 1) * sizeof(float);
}

/* The kernels are instantiated for head_dim 64 and 128 (the swizzle also needs at
 * least 8 pieces a row); KV heads are the grid's y dimension (at most 65535); G <= 16 fits the
 * decode MMA's 16 rows. */
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
    /* gamma = log2(e) / sqrt(D) (sqrt(128) = 11.3137..., sqrt(64) = 8), the base-2
     * logit scale. The prefill kernel runs only when some sequence may have a chunk
     * (max_new > 1); the decode kernel always, skipping the chunks; the combine only
     * with more than one split. */
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

/* The plan's split count for a shape (tests and benchmarks report it). */
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

/* The largest workspace over 1 .. max_seqs sequences (the split count falls with the
 * batch, not in proportion, so the largest need can be at any batch); 0 when no batch
 * splits. Also the per-device setup, so calling it at start-up keeps that out of
 * graph capture. */
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
    /* max_new bounds every n_new and sizes the prefill grid; the sequences are the
     * grid's z dimension (65535 at most, checked above). */
    if (max_new < 1) return fr_fail(FR_EINVAL, "attn_bf16: max_new %d < 1", max_new);
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_bf16: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    if (!kv->pool || !kv->recent || !kv->step_k || !kv->step_v)
        return fr_fail(FR_EINVAL, "attn_bf16: the cache view lacks a pool, recent slots or staging rows");
    /* cp.async copies 16 bytes from every row it reads: pool, pages and their K/V
     * offsets, recent slots (slot_elems a multiple of 8 BF16) and staging rows must
     * be 16-byte aligned. The query is read as float2 and the decode outputs are
     * written as uint2 (4 BF16), hence 8 bytes for q and out. */
    if (misaligned(kv->pool, 16) || misaligned(kv->recent, 16) || misaligned(kv->step_k, 16) ||
        misaligned(kv->step_v, 16) || kv->block_bytes % 16 || kv->head_page_bytes % 16 || kv->k_codes % 16 ||
        kv->v_codes % 16 || kv->slot_elems % 8 || misaligned(q, 8) || misaligned(out, 8))
        return fr_fail(FR_EINVAL, "attn_bf16: pointers and page offsets must be 16-byte aligned "
                                  "(q and out 8-byte)");
    /* The kernels read K and V of a head page as [128][d] BF16 each at the view's
     * offsets: both must lie inside the head page. */
    const size_t page_bytes = (size_t)kPage * kv->head_dim * 2;
    if (kv->k_codes + page_bytes > kv->head_page_bytes || kv->v_codes + page_bytes > kv->head_page_bytes)
        return fr_fail(FR_EINVAL, "attn_bf16: a BF16 head page needs K and V of %zu bytes inside %zu",
                       page_bytes, kv->head_page_bytes);

    const DevInfo *d;
    if ((st = device_info(&d))) return st;
    const int group = n_heads / kv->n_kv_heads, D = kv->head_dim;
    /* The plan, fitted to the workspace: as many splits as it holds partials for,
     * down to one, which needs none (its blocks write the output directly). A
     * misaligned workspace counts as none. lse_part follows the partial outputs of
     * the chosen count. */
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
