/* The FP8 split kernel body of the decode attention: one CTA walks the pages of its
 * split; warps share the keys of a page (QK^T on 32 keys a warp, E4M3 codes converted
 * exactly to FP16), exchange P through shared memory and multiply it by the values on
 * 32 dims each. Included by attn_fp4_cuda.cu only (docs/attention_gpu.md, "The FP8
 * split").
 *
 * Unlike the FP4 split, a warp's P.V needs the P of all four warps (it owns dims, not
 * tokens), so the four warps keep one running maximum per head, exchanged per page,
 * and P goes through a shared buffer, with one barrier per page. E4M3 needs no
 * unpacking beyond one conversion per pair, and the per-head K and V scales are
 * applied outside the MMAs (the query factor and the output factor). */
#ifndef FR_ATTN_FP4_SPLIT_FP8_CUH
#define FR_ATTN_FP4_SPLIT_FP8_CUH

#include <stdint.h>

#include "attn_fp4_common.cuh"

namespace fr_fp4 {

/* The bit reversal of a 3-bit index: position p of a P row holds token (p & ~7) |
 * rev3(p & 7) (see "P exchange" in the split kernel). It is the order an FP4 code
 * word unpacks in (elements 0, 4, 2, 6, 1, 5, 3, 7): FP4 pages took this page-walking
 * plan before the token split (docs/attention_gpu.md, "Instructions per page"), and
 * FP8 keeps the order. FP8 values are read one token row at a time, so any order
 * inside an 8-token group would do; what matters is that the scores (tok[][] in
 * fp8_split), the P buffer and the value loads (pv_page_fp8) use the same one. */
FR_K int rev3(int x) { return ((x & 1) << 2) | (x & 2) | ((x >> 2) & 1); }

/* Shared memory of an FP8 CTA (offsets in bytes): the K ring (two key halves of 16
 * KiB), the V ring (two value halves) and two P buffers (page parity: page k's P is
 * written while page k - 1's is read), then the page maxima (also by page parity) and
 * the l reduction; K two pages ahead of use, V one. A P buffer has a row of 128 FP16
 * per head of the P.V n-tiles (8 NP rows); rows of padding heads stay zero. About 69
 * KiB (NP 1) or 73 KiB (NP 2). */
template <int NP, int D> struct Smem8 {
    using Gm = Geom<kFP8, D>;
    static constexpr int prow = 256;   /* one P row: 128 FP16 */
    static constexpr int kring = 0, vring = 2 * Gm::k_half;
    static constexpr int pbuf = vring + 2 * Gm::v_half;
    static constexpr int pbuf_bytes = 2 * 8 * NP * prow;
    static constexpr int maxbuf = pbuf + pbuf_bytes;
    static constexpr int lred = maxbuf + 2 * kWarps * kMaxGroup * 4;
    static constexpr int bars = lred + kWarps * kMaxGroup * 4;   /* K ring 0, 1, V ring 0, 1 */
    static constexpr int total = bars + 4 * 8;
};

/* Byte offset of P position p (0..127) of row r in a P buffer: 16-byte
 * chunks XOR-swizzled so the P.V B-fragment loads (lane 4g + t reads chunk
 * 4t + q of row g) hit 8 distinct bank groups per quarter warp. */
FR_K int pbuf_off(int r, int p)
{
    const int c = p >> 3;
    return r * 256 + ((c ^ ((c >> 3) << 1) ^ (r & 1)) << 4) + (p & 7) * 2;
}

/* FP8 scores of this lane's 4 keys (m-tile j, row half r8: token-in-page tok[j][r8])
 * for the heads 4u + t, in base-2 logit units, unmasked. Here the keys are the A
 * operand (16 keys x 16 dims per m-tile) and the query the B operand (n-tile u: heads
 * 4u .. 4u + 3, two columns each, its two FP16 terms), so C's row g / g + 8 is a key
 * and its columns 2t, 2t + 1 the two terms of head 4u + t: c0 + c1 is that head's
 * score. Lane t reads dims [32t, 32t + 32) of both its key rows (two 16-byte loads
 * each); qk_dim_slot puts the query's dims in the matching slots. qs = gamma 2^ex
 * k_scale, applied in FP32. */
template <int NQ, int D>
FR_K void score_page_fp8(const uint8_t *pg, const uint2 (&qf)[NQ][D / 16], const float (&qs)[NQ], const int (&tok)[2][2],
                     float (&sc)[2][2][NQ])
{
    constexpr int KS = D / 16;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float acc[NQ][4];
#pragma unroll
        for (int u = 0; u < NQ; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
        uint32_t a[2][KS][2];   /* [row half][k-step][a0/a2 or a1/a3] */
#pragma unroll
        for (int r8 = 0; r8 < 2; r8++) {
            const int row = tok[j][r8];
            const uint32_t *kw = reinterpret_cast<const uint32_t *>(pg + row * D + t * (D / 4));
#pragma unroll
            for (int i = 0; i < KS; i += 4) {
                const uint4 w = *reinterpret_cast<const uint4 *>(kw + i);
                const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    a[r8][i + k][0] = e4m3x2_to_f16x2(ws[k] & 0xFFFFu);
                    a[r8][i + k][1] = e4m3x2_to_f16x2(ws[k] >> 16);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < KS; i++)
#pragma unroll
            for (int u = 0; u < NQ; u++)
                mma_f16(acc[u], a[0][i][0], a[1][i][0], a[0][i][1], a[1][i][1], qf[u][i].x, qf[u][i].y);
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            sc[j][0][u] = __fadd_rn(acc[u][0], acc[u][1]) * qs[u];
            sc[j][1][u] = __fadd_rn(acc[u][2], acc[u][3]) * qs[u];
        }
    }
}

/* O^T (this warp's 32 dims) += V^T (dims x 128 tokens) P^T (tokens x heads) for one
 * FP8 page, from its value half vh (E4M3 [tokens][dims]); P^T comes from the P
 * buffer, positions in the bit-reversed token order of the byte pairing below.
 *
 * V is stored token-major but A = V^T needs dims as rows and tokens along k: lane (g,
 * t) loads one 32-bit word (dims 32w + 4g .. + 3) of each of its four tokens of a
 * k-step, and byte permutes pair the same dim of two tokens (0x5140: dims + 0 and +
 * 1; 0x7362: dims + 2 and + 3). So one load feeds both m-tiles: m-tile 0 holds dims +
 * 0 (row g) and + 1 (row g + 8), m-tile 1 dims + 2 and + 3 (out_dim_fp8). */
template <int NP, int D>
FR_K void pv_page_fp8(const uint8_t *vh, const uint8_t *pb, float (&o)[2][NP][4])
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    /* B fragments: row 8u + g of the P buffer, chunk 4t + q gives k-steps 2q (b0, b1)
     * and 2q + 1 (b0, b1). Both operands map k index 2t, 2t + 1, 2t + 8, 2t + 9 of
     * k-step j to positions 32t + 4j + 0, 1, 2, 3, so one 16-byte load serves two
     * k-steps and the value side loads four whole token rows per k-step. */
    uint32_t b[NP][8][2];
#pragma unroll
    for (int u = 0; u < NP; u++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint4 x = *reinterpret_cast<const uint4 *>(pb + pbuf_off(8 * u + g, 32 * t + 8 * q));
            b[u][2 * q][0] = x.x;
            b[u][2 * q][1] = x.y;
            b[u][2 * q + 1][0] = x.z;
            b[u][2 * q + 1][1] = x.w;
        }
    /* rows g, g + 8 of m-tiles 0, 1 = dims 32w + 4g + {0, 1, 2, 3}: one
     * word per token; byte pairs of two tokens -> FP16x2 */
    const uint8_t *vb = vh + 32 * warp + 4 * g;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int p0 = 32 * t + 4 * j;   /* positions p0 .. p0 + 3 */
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int p = p0 + e, tok = (p & ~7) | rev3(p & 7);
            w[e] = *reinterpret_cast<const uint32_t *>(vb + tok * D);
        }
        const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
        const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
        const uint32_t a00 = e4m3x2_to_f16x2(lo01 & 0xFFFFu), a01 = e4m3x2_to_f16x2(lo01 >> 16);
        const uint32_t a02 = e4m3x2_to_f16x2(lo23 & 0xFFFFu), a03 = e4m3x2_to_f16x2(lo23 >> 16);
        const uint32_t a10 = e4m3x2_to_f16x2(hi01 & 0xFFFFu), a11 = e4m3x2_to_f16x2(hi01 >> 16);
        const uint32_t a12 = e4m3x2_to_f16x2(hi23 & 0xFFFFu), a13 = e4m3x2_to_f16x2(hi23 >> 16);
#pragma unroll
        for (int u = 0; u < NP; u++) {
            mma_f16(o[0][u], a00, a01, a02, a03, b[u][j][0], b[u][j][1]);
            mma_f16(o[1][u], a10, a11, a12, a13, b[u][j][0], b[u][j][1]);
        }
    }
}
/* The dim of O^T row (m-tile i, row r) of warp w: rows g, g + 8 of m-tiles
 * 0, 1 are dims 32w + 4g + {0, 1, 2, 3}. */
FR_K int out_dim_fp8(int warp, int i, int r) { return 32 * warp + 4 * (r & 7) + 2 * i + (r >> 3); }

/* One split of an FP8 cache. NQ: the QK^T n-tiles of 4 heads (1, 2 or 4); NP: the P.V
 * n-tiles of 8 heads (1 or 2). Warp w scores the page's positions 32w .. 32w + 31 for
 * every head and, after the exchange, multiplies the whole page's P by the values of
 * dims 32w .. 32w + 31. */
template <int NQ, int D>
__device__ void fp8_split(const Params &P, uint8_t *smem, int seq, int head, int split, const fr_paged_seq &s)
{
    using Gm = Geom<kFP8, D>;
    constexpr int NP = NQ > 2 ? 2 : 1;
    constexpr int KS = D / 16;
    using Sm = Smem8<NP, D>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int G = P.group;
    SplitCtx c;
    if (!split_open(P, s, seq, head, split, c)) return;
    const int pa = c.r.pa, x1 = c.r.x1, t1 = c.r.t1, npages = c.npages;
    const size_t sh = c.sh, slot = c.slot, lh = c.lh;

    uint8_t *pbuf = smem + Sm::pbuf;
    float *maxbuf = reinterpret_cast<float *>(smem + Sm::maxbuf);   /* [2][warps][16] */
    float *lred = reinterpret_cast<float *>(smem + Sm::lred);       /* [warps][16] */
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem + Sm::bars);
    auto page_src = [&](int k) { return split_page<Gm::page_bytes>(P, s, c, k); };
    /* The pipeline (one thread issues): K of pages 0 and 1 before the
     * loop; at page k's barrier, when the keys of page k are scored and the
     * values of page k - 2 multiplied, K of page k + 2 and V of page k
     * replace them. K is read two pages after its issue, V one. */
    auto issue_k = [&](int k) {
        uint64_t *bar = bars + (k & 1);
        mbar_arrive_expect_tx(bar, Gm::k_half);
        bulk_copy_g2s(smem + Sm::kring + (k & 1) * Gm::k_half, page_src(k), Gm::k_half, bar);
    };
    auto issue_v = [&](int k) {
        uint64_t *bar = bars + 2 + (k & 1);
        mbar_arrive_expect_tx(bar, Gm::v_half);
        bulk_copy_g2s(smem + Sm::vring + (k & 1) * Gm::v_half, page_src(k) + Gm::v_codes, Gm::v_half, bar);
    };

    if (threadIdx.x == 0) {
        for (int k = 0; k < 4; k++) mbar_init(bars + k, 1);
        mbar_fence_init();
    }
    /* Four barriers of count 1 (K slots 0, 1, V slots 0, 1), each completed by thread
     * 0's arrive.expect_tx and the copy's bytes. The P buffers start zeroed: rows of
     * heads >= G are never written and feed only output columns that are dropped, but
     * zeros keep every MMA input finite. */
    for (int k = threadIdx.x; k < Sm::pbuf_bytes / 16; k += kThreads)
        reinterpret_cast<uint4 *>(pbuf)[k] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    split_prologue(c, 2, issue_k);

    /* The query, after split_prologue's griddep_wait: B fragments (one 8-byte load
     * per lane, n-tile and k-step) and the factor of this lane's head 4u + t (0 for
     * padding heads, whose scores are then 0). */
    uint2 qf[NQ][KS];
    float qs[NQ];
    const uint2 *qsrc = reinterpret_cast<const uint2 *>(P.qfrag) + sh * P.nq * KS * 32;
#pragma unroll
    for (int u = 0; u < NQ; u++) {
#pragma unroll
        for (int i = 0; i < KS; i++) qf[u][i] = qsrc[(u * KS + i) * 32 + lane];
        qs[u] = 4 * u + t < G ? P.qscale[sh * kMaxGroup + 4 * u + t] : 0.0f;
    }

    /* This lane's keys in a page: (m-tile j, row half r8) -> token. A lane
     * holds the tokens of P positions 32w + 4g + (2j + r8); position p is
     * token (p & ~7) | rev3(p & 7), the order the V unpacking gives. */
    int tok[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int r8 = 0; r8 < 2; r8++) {
            const int p = 32 * warp + 4 * g + 2 * j + r8;
            tok[j][r8] = (p & ~7) | rev3(p & 7);
        }

    /* Two copies of each head's running maximum: mq in the QK^T layout (head 4u + t
     * of this lane) for P, mp in the P.V layout (heads 8u + 2t + e of O's columns)
     * for rescaling O. Both come from the same page maxima by the same operations, so
     * they stay equal. */
    float mq[NQ], lq[NQ], mp[NP][2];
#pragma unroll
    for (int u = 0; u < NQ; u++) mq[u] = kNegInf, lq[u] = 0.0f;
#pragma unroll
    for (int u = 0; u < NP; u++) mp[u][0] = mp[u][1] = kNegInf;
    float o[2][NP][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int u = 0; u < NP; u++) o[i][u][0] = o[i][u][1] = o[i][u][2] = o[i][u][3] = 0.0f;
    bool pending = false;   /* P of the previous page waits for its P.V */
    /* P.V of page k once its values are in; every issued value half is
     * waited for, also of a page whose keys were all masked (no P.V), so
     * that no copy is still landing when its slot is issued again */
    auto pv_wait = [&](int k, bool pv, float (&acc)[2][NP][4]) {
        mbar_wait(bars + 2 + (k & 1), (uint32_t)(k >> 1) & 1u);
        if (pv)
            pv_page_fp8<NP, D>(smem + Sm::vring + (k & 1) * Gm::v_half, pbuf + (k & 1) * (Sm::pbuf_bytes / 2), acc);
    };

    /* Page k: its keys were issued at iteration k - 2 (pages 0 and 1 in the prologue)
     * into K slot k & 1, whose use number is k / 2, hence the parity (k >> 1) & 1;
     * the values follow the same rule on the V barriers. Scores and maxima come
     * first, then the one barrier, then the previous page's P.V, then this page's P. */
    for (int k = 0; k < npages; k++) {
        const int p = pa + k;
        mbar_wait(bars + (k & 1), (uint32_t)(k >> 1) & 1u);

        float sc[2][2][NQ];
        score_page_fp8<NQ, D>(smem + Sm::kring + (k & 1) * Gm::k_half, qf, qs, tok, sc);
        const bool edge = p * kPage < x1 || (p + 1) * kPage > t1;   /* masks only on the first and last pages */
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            float mx = kNegInf;
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int r8 = 0; r8 < 2; r8++) {
                    const int tk = p * kPage + tok[j][r8];
                    if (edge && (tk < x1 || tk >= t1)) sc[j][r8][u] = kNegInf;
                    mx = fmaxf(mx, sc[j][r8][u]);
                }
            /* The eight lanes of one t (g = 0..7) hold the warp's 32 positions for
             * head 4u + t: three xor steps over g give the warp's maximum, which goes
             * to maxbuf (FP8 does not quantize P, so no block maximum is needed). */
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
            if (g == 0 && 4 * u + t < kMaxGroup) maxbuf[((k & 1) * kWarps + warp) * kMaxGroup + 4 * u + t] = mx;
        }
        /* The page's barrier. Before it every warp has written its maxima of page k
         * and its P of page k - 1, and read page k's keys and page k - 2's values; so
         * after it thread 0 may refill K slot k & 1 with page k + 2 and V slot k & 1
         * with page k. The fence orders those generic-proxy reads, which the barrier
         * made visible to thread 0, before the copy engine's writes to the same
         * bytes. */
        __syncthreads();   /* maxima of page k; P of page k - 1; K of page k and V of page k - 2 free */
        if (threadIdx.x == 0) {
            fence_proxy_async();
            if (k + 2 < npages) issue_k(k + 2);
            issue_v(k);
        }
        /* P.V of the previous page, now that all four warps' P of it is in the
         * buffer. It overlaps the copies just issued. */
        if (k > 0) pv_wait(k - 1, pending, o);

        /* Page k's maximum per head over the four warps: one running maximum for the
         * CTA, since every warp multiplies all of the page's P. */
        const float *mb = maxbuf + (k & 1) * kWarps * kMaxGroup;
        auto tile_max = [&](int h) {
            float x = mb[h];
#pragma unroll
            for (int w = 1; w < kWarps; w++) x = fmaxf(x, mb[w * kMaxGroup + h]);
            return x;
        };
        if (tile_max(0) == kNegInf) {   /* every key masked (masks are per token) */
            pending = false;
            continue;
        }
        /* running maxima: alpha rescales O (P.V layout heads) and l */
#pragma unroll
        for (int u = 0; u < NP; u++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int h = 8 * u + 2 * t + e;
                const float mn = h < G ? fmaxf(mp[u][e], tile_max(h)) : 0.0f;
                const float al = (h < G && mp[u][e] != kNegInf) ? ex2(mp[u][e] - mn) : 0.0f;
                mp[u][e] = mn;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    o[i][u][e] *= al;
                    o[i][u][2 + e] *= al;
                }
            }
        /* P of page k: 2^(S - m) times 2^11 (c is 1 for FP8), written as FP16 at this
         * lane's four positions (one 8-byte store) of head row h, for the P.V of the
         * next iteration. l sums the FP32 values. */
        uint8_t *pbk = pbuf + (k & 1) * (Sm::pbuf_bytes / 2);
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            const int h = 4 * u + t;
            const float mn = h < G ? fmaxf(mq[u], tile_max(h < kMaxGroup ? h : 0)) : 0.0f;
            const float al = (h < G && mq[u] != kNegInf) ? ex2(mq[u] - mn) : 0.0f;
            mq[u] = mn;
            const float mc = mn - P.log2c;   /* c folded into exp2 */
            float pv[2][2], sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int r8 = 0; r8 < 2; r8++) {
                    const float cp = ex2(sc[j][r8][u] - mc);
                    sum += cp;
                    pv[j][r8] = cp * kPShift;
                }
            lq[u] = lq[u] * al + sum;
            if (h < G)
                *reinterpret_cast<uint2 *>(pbk + pbuf_off(h, 32 * warp + 4 * g)) =
                    make_uint2(pack_f16x2(pv[0][0], pv[0][1]), pack_f16x2(pv[1][0], pv[1][1]));
        }
        pending = true;
    }
    __syncthreads();
    /* The last page's P.V: the barrier makes every warp's P of it visible; V of the
     * last page was issued at its own iteration. Then the combine's launch is
     * released (it waits for the whole grid anyway). */
    pv_wait(npages - 1, pending, o);
    griddep_launch_dependents();

    /* l over the warp's keys, then over the warps in warp order: every warp used the
     * same maxima, so the sums add without rescaling, and the partial's LSE is m +
     * log2 l with the shared m. */
#pragma unroll
    for (int u = 0; u < NQ; u++) {
        float x = lq[u];
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 4);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 8);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 16);
        if (g == 0 && 4 * u + t < kMaxGroup) lred[warp * kMaxGroup + 4 * u + t] = x;
    }
    __syncthreads();
    /* The output factor: 2^-11 for P's shift and the per-head V scale; the K scale
     * went into the scores through qscale. */
    float of = kPUnshift;   /* O = sum P V * 2^11 * v_scale */
    if (P.fp8_scales) of *= P.fp8_scales[lh * 2 + 1];
#pragma unroll
    for (int u = 0; u < NP; u++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * u + 2 * t + e;
            if (h >= G) continue;
            const float l = warp_sum(lred, h);
            const float inv = l > 0.0f ? of / l : 0.0f;
            float *dst = partial_row<D>(P, slot, h);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                dst[out_dim_fp8(warp, i, g)] = o[i][u][e] * inv;
                dst[out_dim_fp8(warp, i, g + 8)] = o[i][u][2 + e] * inv;
            }
            if (warp == 0 && g == 0) store_lse(P, slot, h, mp[u][e], l, P.log2c);
        }
}

} // namespace fr_fp4

#endif
