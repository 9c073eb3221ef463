/* The FP4 (NVFP4, MXFP4) split kernel body of the decode attention:
 * tokens split over the warps, P kept in registers. Included by
 * attn_fp4_cuda.cu only (docs/attention_gpu.md). */
#ifndef FR_ATTN_FP4_SPLIT_FP4_CUH
#define FR_ATTN_FP4_SPLIT_FP4_CUH

#include <stdint.h>

#include "attn_fp4_common.cuh"

namespace fr_fp4 {

/* Pages in the ring. Two stages at five CTAs per SM against three at four: up to 10%
 * faster at batch 64 on one layer, 1-2% slower at batch 16, within 2% in whole 64K
 * decode steps (bench/RESULTS.md, "FP4 decode at the bandwidth limit", the paragraph
 * after the step-by-step table). */
constexpr int kStages = 2;   /* pages in flight per CTA (bench/RESULTS.md: 2 stages x 5 CTAs beat 3 x 4) */

/* Shared memory of the FP4 split CTAs: a ring of whole pages with their full (bytes
 * landed) and empty (every thread done) barriers, the exact mode's page maxima, the
 * warps' final (m, l); after the loop the ring's bytes hold the warps' partial
 * outputs for the merge. NVFP4: 2 x 18,432 + 1,056 bytes; the BF16 CTA of the same
 * launch needs a little more (attn_fp4_cuda.cu sizes the launch for the larger). The page
 * maxima are double-buffered by page parity, so one barrier per page orders their
 * writes and reads (see the exact-mode exchange). MT, the m-tiles of 8 heads, does
 * not change the layout: the arrays are sized for 16 heads. */
template <int FMT, int MT, int D> struct SmemTok {
    using Gm = Geom<FMT, D>;
    static constexpr int pmax = kStages * Gm::page_bytes;             /* [2][warps][16] */
    static constexpr int stat = pmax + 2 * kWarps * kMaxGroup * 4;   /* m [warps][16], l [warps][16] */
    static constexpr int bars = stat + 2 * kWarps * kMaxGroup * 4;   /* full[kStages], empty[kStages] */
    static constexpr int total = bars + 2 * kStages * 8;
    static_assert(kWarps * kMaxGroup * D * 4 <= kStages * Gm::page_bytes, "the merge fits in the ring");
};

/* One split of an FP4 cache (Algorithm 1 over pages [pa, pb)). Warp w
 * takes tokens 32w .. 32w + 31 of every page through the whole step:
 *  - S^T = Q K^T: A = 16 query rows (row r < 8: head 8 mt + r, first term;
 *    row 8 + r: its second term), B = 16 dims x 8 keys; the two terms of a
 *    head meet in one lane (c0 + c2, c1 + c3). Key column c of n-tile j is
 *    token 8 (c / 2) + 2 j + c % 2 of the warp, so lane (g, t) ends with
 *    the scores of tokens 8t .. 8t + 7 for head 8 mt + g: exactly the
 *    tokens of the value code word it multiplies next.
 *  - online softmax per warp (bf16 compute: the warp's own running
 *    maximum; exact: the page maximum over all four warps, Algorithm 1's
 *    tile, shared through one barrier per page);
 *  - O^T += V^T P^T for all dims over the warp's 32 tokens, P straight from
 *    registers (k-step 0 takes tokens 8t + {0, 4, 2, 6}, k-step 1 8t + {1,
 *    5, 3, 7}: the order a code word unpacks in), O rescaled only when a
 *    maximum grew (otherwise alpha is exactly 1);
 * then the four warps' (m, l, O) merge through shared memory. One thread
 * keeps the page ring full: a slot is refilled once every thread has
 * released it (empty barrier), kStages pages ahead. */
template <int FMT, bool EXACT, int MT, int D>
__device__ void fp4_split_tok(const Params &P, uint8_t *smem, int seq, int head, int split, const fr_paged_seq &s)
{
    using Gm = Geom<FMT, D>;
    using Sm = SmemTok<FMT, MT, D>;
    constexpr int KS = D / 16, MI = D / 16;
    static_assert(D == 128, "the lane's 16-byte key load covers D / 4 = 32 dims");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int G = P.group;
    SplitCtx c;
    if (!split_open(P, s, seq, head, split, c)) return;
    const int pa = c.r.pa, x1 = c.r.x1, t1 = c.r.t1, npages = c.npages;
    const size_t sh = c.sh, slot = c.slot;
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Sm::bars), *empty = full + kStages;
    float *pmax = reinterpret_cast<float *>(smem + Sm::pmax);

    /* Page k of the split into slot k % kStages: one bulk copy of the contiguous head
     * page (18 KiB NVFP4, 17 KiB MXFP4), announced on the slot's full barrier. Only
     * thread 0 issues. */
    auto issue = [&](int k) {
        uint64_t *bar = full + k % kStages;
        mbar_arrive_expect_tx(bar, Gm::page_bytes);
        bulk_copy_g2s(smem + (k % kStages) * Gm::page_bytes, split_page<Gm::page_bytes>(P, s, c, k), Gm::page_bytes,
                      bar);
    };
    /* Full barriers complete on the one arrive.expect_tx plus the page's bytes, empty
     * barriers on one arrival from each of the 128 threads. The fence hands the
     * initialized barriers to the copy engine and the __syncthreads to the other
     * threads, before the first copy is issued. */
    if (threadIdx.x == 0) {
        for (int k = 0; k < kStages; k++) {
            mbar_init(full + k, 1);
            mbar_init(empty + k, kThreads);   /* every thread releases a slot: see the end of the loop */
        }
        mbar_fence_init();
    }
    __syncthreads();
    split_prologue(c, kStages, issue);

    /* The query, read only after split_prologue's griddep_wait: A fragments (one
     * 16-byte load per lane, m-tile and k-step) and the per-head factor of this
     * lane's row g. A padding head (8 mt + g >= G) has zero fragments and factor 0:
     * its scores are 0, finite, and its output is never written. */
    uint4 qa[MT][KS];
    const uint4 *qsrc = reinterpret_cast<const uint4 *>(P.qfrag) + sh * (size_t)(P.qwords / 4);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < KS; i++) qa[mt][i] = qsrc[(mt * KS + i) * 32 + lane];
    float qs[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) qs[mt] = 8 * mt + g < G ? P.qscale[sh * kMaxGroup + 8 * mt + g] : 0.0f;

    /* As the B operand a lane supplies key column g of n-tile j, the key it loads and
     * unpacks: token 8 (g / 2) + 2 j + g % 2 of the warp's 32. Its C fragment then
     * holds columns 2t and 2t + 1 of row g, i.e. tokens 8t + 2j and 8t + 2j + 1: over
     * the four n-tiles, tokens 8t .. 8t + 7 of head 8 mt + g, the eight tokens of one
     * value code word. */
    const int tb0 = 32 * warp + 8 * (g >> 1) + (g & 1);   /* this lane's key of n-tile j: tb0 + 2j */
    const int tc0 = 32 * warp + 8 * t;                     /* its scores' tokens: tc0 + 2j + e */

    float m[MT], l[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt] = kNegInf, l[mt] = 0.0f;
    float o[MI][MT][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int u = 0; u < MT; u++) o[mi][u][0] = o[mi][u][1] = o[mi][u][2] = o[mi][u][3] = 0.0f;

    /* The page loop. At the top of page k thread 0 refills the slot page k - 1 used,
     * once every thread has released it, with page k - 1 + kStages: the copy of page
     * k + 1 is then in flight while page k is computed. Slot uses alternate parity,
     * so the n-th use of a slot (n = k / kStages) waits on parity n & 1. */
    for (int k = 0; k < npages; k++) {
        const int p = pa + k, st = k % kStages;
        if (threadIdx.x == 0 && k > 0 && k - 1 + kStages < npages) {
            mbar_wait(empty + (k - 1) % kStages, (uint32_t)((k - 1) / kStages) & 1u);
            issue(k - 1 + kStages);
        }
        mbar_wait(full + st, (uint32_t)(k / kStages) & 1u);
        const uint8_t *pg = smem + st * Gm::page_bytes;

        /* ---- scores ---- */
        /* A lane reads 16 bytes of its key row: code words 4t .. 4t + 3, dims 32t ..
         * 32t + 31 (D = 128); the query's A fragments hold the same dims in the same
         * slots (qk_dim_slot). */
        float sc[MT][4][2];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int row = tb0 + 2 * j;
            const uint4 w = *reinterpret_cast<const uint4 *>(pg + row * (D / 2) + t * 16);
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
            uint32_t f[4];
            float kf = 1.0f;
            if (FMT == kNVFP4) {   /* words 0, 1: block 2t; 2, 3: block 2t + 1; scale x 2^7 keeps products normal */
                const uint32_t sb = *reinterpret_cast<const uint16_t *>(pg + Gm::k_scales + row * 8 + 2 * t);
                const uint32_t s2 = hmul2(e4m3x2_to_f16x2(sb), 0x58005800u);
                f[0] = f[1] = bcast_lo(s2);
                f[2] = f[3] = bcast_hi(s2);
            } else {               /* MXFP4: 2^(e_block - e_max) here, 2^e_max on the score */
                const uint32_t all = *reinterpret_cast<const uint32_t *>(pg + Gm::k_scales + row * 4);
                const uint32_t top = max_byte4(all), mine = (all >> (8 * t)) & 0xFFu;
                const uint32_t h = f16_pow2((int)mine - (int)top + 14);
                f[0] = f[1] = f[2] = f[3] = h | (h << 16);
                kf = fr_dev_e8m0_decode((uint8_t)top);
            }
            /* NVFP4: the code words' value * 2^-14 times scale * 2^7 is value * scale
             * * 2^-7: at most 6 significant bits, in [2^-17, 6 x 448 x 2^-7 = 21], so
             * HMUL2 rounds nothing (FP16 subnormals reach 2^-24); qscale carries the
             * 2^7 back. MXFP4: value * 2^(e_block - e_max), exact while the block is
             * within 2^23 of the key's largest (f16_pow2 flushes to 0 more than 2^38
             * below; docs/attention_gpu.md, "Precision"). Word q fills k-steps 2q and
             * 2q + 1. */
            uint32_t b[KS][2];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                uint32_t r[4];
                unpack_e2m1(ws[q], r);
                b[2 * q][0] = hmul2(r[0], f[q]);
                b[2 * q][1] = hmul2(r[1], f[q]);
                b[2 * q + 1][0] = hmul2(r[2], f[q]);
                b[2 * q + 1][1] = hmul2(r[3], f[q]);
            }
            /* the keys of this lane's score columns 2t, 2t + 1 were loaded by lanes 8t and 8t + 4 */
            const float kc0 = FMT == kMXFP4 ? __shfl_sync(0xFFFFFFFFu, kf, 8 * t) : 1.0f;
            const float kc1 = FMT == kMXFP4 ? __shfl_sync(0xFFFFFFFFu, kf, 8 * t + 4) : 1.0f;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int i = 0; i < KS; i++)
                    mma_f16(acc, qa[mt][i].x, qa[mt][i].y, qa[mt][i].z, qa[mt][i].w, b[i][0], b[i][1]);
                /* c0, c1 are row g (the head's first term), c2, c3 row g + 8 (its
                 * second term) of the same key columns: the two terms' products meet
                 * here, added in FP32 as the reference adds them. */
                sc[mt][j][0] = __fadd_rn(acc[0], acc[2]) * (qs[mt] * kc0);
                sc[mt][j][1] = __fadd_rn(acc[1], acc[3]) * (qs[mt] * kc1);
            }
        }
        if (p * kPage < x1 || (p + 1) * kPage > t1) {   /* masks only on the first and last pages */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int tk = p * kPage + tc0 + 2 * j + e;
                        if (tk < x1 || tk >= t1) sc[mt][j][e] = kNegInf;
                    }
        }

        /* ---- maxima: the P block (NVFP4: 16 tokens, lanes t and t ^ 1; MXFP4: the warp's 32) ---- */
        /* The blocks are aligned in token position, as the value blocks are: tokens
         * 16 (t / 2) .. + 15, and the warp's 32. bm is the block maximum for P's
         * scale, pm the warp's page maximum for the running maximum. */
        float bm[MT], pm[MT];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float mx = kNegInf;
#pragma unroll
            for (int j = 0; j < 4; j++) mx = fmaxf(mx, fmaxf(sc[mt][j][0], sc[mt][j][1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
            bm[mt] = mx;
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
            if (FMT == kMXFP4) bm[mt] = mx;
            pm[mt] = mx;
        }
        /* Exact mode needs one running maximum for the four warps, Algorithm 1's tile
         * maximum, so that P's block scales are those of the reference. The maxima of
         * page k go to half k & 1 of pmax: a warp writes page k + 2's half only after
         * the barrier of page k + 1, which every warp passes after reading page k's.
         * bf16 compute skips this and its barrier: with P unquantized a per-warp
         * maximum changes only rounding, and the merge reconciles the warps' maxima. */
        if (EXACT) {   /* Algorithm 1's tile is the page: its maximum over the four warps */
            float *pmk = pmax + (k & 1) * kWarps * kMaxGroup;
            if (t == 0)
#pragma unroll
                for (int mt = 0; mt < MT; mt++) pmk[warp * kMaxGroup + 8 * mt + g] = pm[mt];
            __syncthreads();
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int h = 8 * mt + g;
                pm[mt] = fmaxf(fmaxf(pmk[h], pmk[kMaxGroup + h]), fmaxf(pmk[2 * kMaxGroup + h], pmk[3 * kMaxGroup + h]));
            }
        }

        /* ---- online softmax ---- */
        /* cp = 2^(S - m + log2 c): Algorithm 1's factor c is folded into the exponent
         * (c = 1 unless P is quantized). Exact: P = E2M1(cp / s) s with s the block's
         * scale; the quotient is taken as cp times the rounded reciprocal, one
         * multiply per element, which can differ from the reference's division only
         * at an E2M1 rounding threshold, like the FP32 score rounding
         * (docs/attention_gpu.md, "Precision"). l sums the unquantized cp, as the
         * reference does; P enters the MMA times 2^11 (kPShift). A row with every key
         * masked keeps m = -inf and mc = 0, so its cp are exp2(-inf) = 0. */
        bool grew = false;
        float al[MT];
        uint32_t pbf[MT][2][2];   /* P as B fragments: [n-tile][k-step][b0, b1] */
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const float mn = fmaxf(m[mt], pm[mt]);
            grew |= mn != m[mt];
            al[mt] = m[mt] == kNegInf ? 0.0f : ex2(m[mt] - mn);
            m[mt] = mn;
            const float mc = mn == kNegInf ? 0.0f : mn - P.log2c;   /* c folded into exp2 */
            float pv[4][2], sum = 0.0f, rs = 0.0f, ss = kPShift;
            if (EXACT) {   /* the block's scale; P = E2M1(cp / s) * s */
                const float sp = p_scale<FMT>(P, bm[mt], mn);
                rs = sp > 0.0f ? __frcp_rn(sp) : 0.0f;
                ss = sp * kPShift;
            }
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float cp = ex2(sc[mt][j][e] - mc);
                    sum += cp;
                    pv[j][e] = EXACT ? e2m1_round(cp * rs) * ss : cp * kPShift;
                }
            l[mt] = l[mt] * al[mt] + sum;
            /* P as the B operand of P.V, from this lane's own registers: pv[j][e] is
             * token 8t + 2j + e, and the k order of a k-step is the order the value
             * code words unpack in (elements (0, 4), (2, 6) for k-step 0, (1, 5), (3,
             * 7) for k-step 1), so V and P agree without any exchange. */
            pbf[mt][0][0] = pack_f16x2(pv[0][0], pv[2][0]);
            pbf[mt][0][1] = pack_f16x2(pv[1][0], pv[3][0]);
            pbf[mt][1][0] = pack_f16x2(pv[0][1], pv[2][1]);
            pbf[mt][1][1] = pack_f16x2(pv[1][1], pv[3][1]);
        }
        /* O is rescaled only when some maximum of the warp grew (alpha is exactly 1
         * otherwise). The test is warp-uniform so that every lane runs the shuffles:
         * the softmax state is held per row g (head 8u + g) while O's C columns are
         * heads 8u + 2t and 8u + 2t + 1. */
        if (__any_sync(0xFFFFFFFFu, grew)) {   /* O columns are heads 8u + 2t + e: their alphas sit in lanes 8t, 8t + 4 */
#pragma unroll
            for (int u = 0; u < MT; u++) {
                const float a0 = __shfl_sync(0xFFFFFFFFu, al[u], 8 * t), a1 = __shfl_sync(0xFFFFFFFFu, al[u], 8 * t + 4);
#pragma unroll
                for (int mi = 0; mi < MI; mi++) {
                    o[mi][u][0] *= a0;
                    o[mi][u][2] *= a0;
                    o[mi][u][1] *= a1;
                    o[mi][u][3] *= a1;
                }
            }
        }

        /* ---- O^T += V^T P^T over the warp's tokens: dims 16 mi + g and + 8 ---- */
        /* A = V^T, 16 dims x 16 tokens: rows g and g + 8 are dims d0 and d1, and the
         * lane's tokens 8t .. 8t + 7 are one code word per dim (values run along
         * tokens in the page). a0 / a1 are the (0, 4) pairs of d0 / d1, a2 / a3 the
         * (2, 6) pairs; the second k-step takes (1, 5) and (3, 7). The 4-byte code
         * loads are 4-way bank-conflicted (dims 16 words apart: bench/RESULTS.md,
         * "Profile: one split-kernel call"). */
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            const int d0 = 16 * mi + g, d1 = d0 + 8;
            uint32_t r0[4], r1[4];
            unpack_e2m1(*reinterpret_cast<const uint32_t *>(pg + Gm::v_codes + d0 * (kPage / 2) + 16 * warp + 4 * t), r0);
            unpack_e2m1(*reinterpret_cast<const uint32_t *>(pg + Gm::v_codes + d1 * (kPage / 2) + 16 * warp + 4 * t), r1);
            if (FMT == kNVFP4) {   /* the word's block: 16 tokens, (4w + t) / 2 of the page's 8 */
                const int blk = (4 * warp + t) >> 1;
                const uint32_t sb = (uint32_t)pg[Gm::v_scales + d0 * (kPage / 16) + blk] |
                                    ((uint32_t)pg[Gm::v_scales + d1 * (kPage / 16) + blk] << 8);
                const uint32_t s2 = hmul2(e4m3x2_to_f16x2(sb), 0x58005800u);
                const uint32_t f0 = bcast_lo(s2), f1 = bcast_hi(s2);
                const uint32_t a00 = hmul2(r0[0], f0), a01 = hmul2(r1[0], f1), a02 = hmul2(r0[1], f0),
                               a03 = hmul2(r1[1], f1);
                const uint32_t a10 = hmul2(r0[2], f0), a11 = hmul2(r1[2], f1), a12 = hmul2(r0[3], f0),
                               a13 = hmul2(r1[3], f1);
#pragma unroll
                for (int u = 0; u < MT; u++) {
                    mma_f16(o[mi][u], a00, a01, a02, a03, pbf[u][0][0], pbf[u][0][1]);
                    mma_f16(o[mi][u], a10, a11, a12, a13, pbf[u][1][0], pbf[u][1][1]);
                }
            } else {   /* MXFP4: the warp's 32 tokens are one block, so the scale of a dim applies after the MMA */
                const float pf0 = fr_dev_e8m0_decode(pg[Gm::v_scales + d0 * (kPage / 32) + warp]);
                const float pf1 = fr_dev_e8m0_decode(pg[Gm::v_scales + d1 * (kPage / 32) + warp]);
#pragma unroll
                for (int u = 0; u < MT; u++) {
                    float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_f16(tmp, r0[0], r1[0], r0[1], r1[1], pbf[u][0][0], pbf[u][0][1]);
                    mma_f16(tmp, r0[2], r1[2], r0[3], r1[3], pbf[u][1][0], pbf[u][1][1]);
                    o[mi][u][0] = fmaf(tmp[0], pf0, o[mi][u][0]);
                    o[mi][u][1] = fmaf(tmp[1], pf0, o[mi][u][1]);
                    o[mi][u][2] = fmaf(tmp[2], pf1, o[mi][u][2]);
                    o[mi][u][3] = fmaf(tmp[3], pf1, o[mi][u][3]);
                }
            }
        }
        /* every thread releases the slot after its own reads (a release per
         * thread, so no read can be reordered past the refill) */
        mbar_arrive(empty + st);
    }

    /* Every page is consumed and every copy issued was waited on, so nothing lands in
     * the ring any more and the merge may reuse its bytes. The combine's launch is
     * released here, before the merge: its CTAs can be scheduled while this grid's
     * last CTAs merge, and its griddep_wait still holds them until the whole grid has
     * ended. */
    griddep_launch_dependents();   /* the combine may be scheduled; it waits for this grid's end */

    /* ---- merge the four warps ---- */
    /* Each warp's (m, l) per head: l first summed over the quad (lanes t hold
     * different tokens of row g). The O entries are then written relative to the
     * CTA-wide maximum M, 2^(m_w - M), and a thread per (head, dim) adds the four
     * warps in warp order: the partial does not depend on timing. */
    float *mst = reinterpret_cast<float *>(smem + Sm::stat), *lst = mst + kWarps * kMaxGroup;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float x = l[mt];
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 1);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 2);
        if (t == 0) {
            mst[warp * kMaxGroup + 8 * mt + g] = m[mt];
            lst[warp * kMaxGroup + 8 * mt + g] = x;
        }
    }
    __syncthreads();   /* (m, l) of every warp; every page consumed, the ring is free */
    float *ob = reinterpret_cast<float *>(smem);   /* [warps][16][D] */
#pragma unroll
    for (int u = 0; u < MT; u++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * u + 2 * t + e;
            float M = kNegInf;
#pragma unroll
            for (int w = 0; w < kWarps; w++) M = fmaxf(M, mst[w * kMaxGroup + h]);
            const float mine = mst[warp * kMaxGroup + h];
            const float fw = mine == kNegInf ? 0.0f : ex2(mine - M);
            float *row = ob + (warp * kMaxGroup + h) * D;
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                row[16 * mi + g] = o[mi][u][e] * fw;
                row[16 * mi + g + 8] = o[mi][u][2 + e] * fw;
            }
        }
    __syncthreads();
    /* O = sum P V * 2^11 * (NVFP4: 2^-7 for the scales' 2^7; MXFP4: 2^14 for the codes' 2^-14) */
    const float of = kPUnshift * (FMT == kNVFP4 ? 128.0f : 16384.0f);
    for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
        const int h = idx / D, d = idx % D;
        float M = kNegInf;
#pragma unroll
        for (int w = 0; w < kWarps; w++) M = fmaxf(M, mst[w * kMaxGroup + h]);
        float L = 0.0f, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            const float mw = mst[w * kMaxGroup + h];
            if (mw != kNegInf) L += lst[w * kMaxGroup + h] * ex2(mw - M);
            sum += ob[(w * kMaxGroup + h) * D + d];
        }
        partial_row<D>(P, slot, h)[d] = L > 0.0f ? sum * (of / L) : 0.0f;
        if (d == 0) store_lse(P, slot, h, M, L, P.log2c);
    }
}

} // namespace fr_fp4

#endif
