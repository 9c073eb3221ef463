/* The BF16 CTA of the decode attention over an FP4 cache with the sink/recent recipe:
 * the sink, the recent slot and the step's own token, one 144-row tile with
 * unquantized query and P. Included by attn_fp4_cuda.cu only (docs/attention_gpu.md).
 *
 * These tokens are BF16 in the cache and meet the unquantized query in the reference,
 * so this CTA computes in BF16 with hi + lo pairs: the query and P as two BF16
 * columns each (16 significant bits), the keys and values as stored. At most 144 rows
 * (16 sink + 127 recent + the step's token) fit one tile, so there is no online
 * softmax: one maximum, one exponentiation, one P.V. Its partial is slot n_splits,
 * joined by the combine like any split's. */
#ifndef FR_ATTN_FP4_SPLIT_BF16_CUH
#define FR_ATTN_FP4_SPLIT_BF16_CUH

#include <stdint.h>

#include "attn_fp4_common.cuh"

namespace fr_fp4 {

/* Shared memory of the BF16 CTA: 144 rows of K (then V in their place), then P (hi/lo
 * rows of up to 2 NP groups of 4 query heads), then the maxima and the l reduction.
 * The rows take 36 KiB (144 x 128 BF16, swizzled); the P buffer holds one row of 144
 * BF16 per column of the P.V B operand, 8 NQ rows (columns 2h and 2h + 1: head h's hi
 * and lo), within the 16 NP rows sized here. With NQ 2 the whole is 41.25 KiB, the
 * largest CTA of the FP4 launch (attn_fp4_cuda.cu sizes the launch by it). */
template <int NQ, int D> struct SmemBf16 {
    static constexpr int NP = NQ > 2 ? 2 : 1;
    static constexpr int rows = kMaxBf16Rows * D * 2;
    static constexpr int maxbuf = rows + 8 * (2 * NP) * kMaxBf16Rows * 2;
    static constexpr int lred = maxbuf + 2 * kWarps * kMaxGroup * 4;
    static constexpr int total = lred + kWarps * kMaxGroup * 4;
};

/* Byte offset of 16-byte chunk c of row r in a swizzled [rows][D] BF16 tile. Chunk c
 * of row r sits at c ^ (r & 7): the eight rows an ldmatrix matrix reads (same chunk,
 * consecutive rows) land on eight different 16-byte bank groups, plain and
 * transposed. */
template <int D> FR_K int bf_off(int r, int c) { return (r * (D / 8) + (c ^ (r & 7))) * 16; }

template <int NQ, int D>
__device__ void bf16_split(const Params &P, uint8_t *smem, int seq, int head, const fr_paged_seq &s, float *maxbuf,
                           float *lred)
{
    constexpr int KS = D / 16, C = D / 8, PR = kMaxBf16Rows * 2;   /* P row: 144 BF16 */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int G = P.group, kvh = P.kv.n_kv_heads;
    const int len = s.len, n = len + 1, fp4_end = len / kPage * kPage;
    const int nsink = n < kSink ? n : kSink;
    /* Row r's token: with a full page (fp4_end > 0) rows 0 .. 15 are the sink, then
     * the recent tokens fp4_end .. len - 1, then the step's token len; before the
     * first page is full, the whole context 0 .. len is BF16 and row r is token r
     * (the first 16 from the sink slot, the rest from the recent slot, which hold the
     * same bits). */
    const int nb = fp4_end ? nsink + (n - fp4_end) : n;   /* <= 144 */
    const int ntiles = (nb + 15) / 16;
    const size_t sh = (size_t)seq * kvh + head, slot = sh * (P.n_splits + 1) + P.n_splits;
    const size_t lh = (size_t)P.kv.layer * kvh + head;
    /* The keys, then the values in their place (the shared memory of one
     * 144-row tile, so that this CTA takes no more than a page-walking one) */
    uint8_t *ks = smem, *vs = smem;

    /* rows: token of row r, from the sink slot, recent slot or staging. One pass of
     * 16-byte cp.async over the tile's rows, keys or values (the same bytes, one
     * after the other). Rows from nb up to the end of the last 16-row tile are
     * zero-filled (src_bytes 0): their scores are masked, and a zero value row keeps
     * the P.V sums finite. */
    auto load_rows = [&](bool values) {
        for (int k = threadIdx.x; k < ntiles * 16 * C; k += kThreads) {
            const int r = k / C, c = k % C;
            const uint16_t *row = values ? P.kv.step_v : P.kv.step_k;
            uint32_t bytes = 0;
            if (r < nb) {
                const int tk = fp4_end == 0 ? r : (r < nsink ? r : fp4_end + r - nsink);
                bytes = 16;
                if (tk == len) {
                    row += ((size_t)s.q_row * kvh + head) * D;
                } else if (tk < kSink) {
                    row = P.kv.sink + (size_t)s.slot * 2 * P.kv.sink_elems + lh * kSink * D + (size_t)tk * D +
                          (values ? P.kv.sink_elems : 0);
                } else {
                    row = P.kv.recent + (size_t)s.slot * 2 * P.kv.slot_elems + lh * kPage * D +
                          (size_t)(tk % kPage) * D + (values ? P.kv.slot_elems : 0);
                }
            }
            cp_async16(smem + bf_off<D>(r, c), row + c * 8, bytes);
        }
        cp_async_commit();
    };
    /* The keys are requested before griddep_wait: the slots and staging rows were
     * written before the preparation kernel started (it is launched without the
     * programmatic attribute, after the kernel that stages the step's rows), so only
     * the query fragments, prep_kernel's output, need the wait. */
    load_rows(false);
    griddep_wait();   /* the query fragments are the preparation kernel's output */

    /* The BF16 query's B fragments: columns 2h and 2h + 1 of n-tile u hold head h's
     * hi and lo halves, in natural dim order (natural_dim_slot), one 8-byte load per
     * lane, n-tile and k-step. */
    uint2 qf[NQ][KS];
    const uint2 *qsrc = reinterpret_cast<const uint2 *>(P.qfrag_bf) + sh * P.nq * KS * 32;
#pragma unroll
    for (int u = 0; u < NQ; u++)
#pragma unroll
        for (int i = 0; i < KS; i++) qf[u][i] = qsrc[(u * KS + i) * 32 + lane];
    /* Each thread waits for its own copies; the barrier then makes every thread's
     * keys visible to all. */
    cp_async_wait_all();
    __syncthreads();

    /* scores: warp w takes key tiles w, w + 4, w + 8 (144 rows are at most 9 tiles of
     * 16). A = 16 key rows by ldmatrix (lanes 0-15 give rows 0-15 of chunk 2i, lanes
     * 16-31 the same rows of chunk 2i + 1: matrices a0 .. a3), B = the query, so C's
     * row g / g + 8 is a key and its columns 2t, 2t + 1 head 4u + t's hi and lo
     * products: their sum is the score. Keys and the query are unscaled, so only
     * gamma remains; rows past nb score -inf. */
    constexpr int MT = (kMaxBf16Rows / 16 + kWarps - 1) / kWarps;   /* 3 */
    float sc[MT][2][NQ];
    float mx[NQ];
#pragma unroll
    for (int u = 0; u < NQ; u++) mx[u] = kNegInf;
#pragma unroll
    for (int m = 0; m < MT; m++) {
        const int tile = warp + kWarps * m;
#pragma unroll
        for (int u = 0; u < NQ; u++) sc[m][0][u] = sc[m][1][u] = kNegInf;
        if (tile >= ntiles) continue;
        float acc[NQ][4];
#pragma unroll
        for (int u = 0; u < NQ; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
#pragma unroll
        for (int i = 0; i < KS; i++) {
            uint32_t a[4];
            ldsm_x4(ks + bf_off<D>(16 * tile + (lane & 15), 2 * i + (lane >> 4)), a);
#pragma unroll
            for (int u = 0; u < NQ; u++) mma_bf16(acc[u], a[0], a[1], a[2], a[3], qf[u][i].x, qf[u][i].y);
        }
#pragma unroll
        for (int u = 0; u < NQ; u++)
#pragma unroll
            for (int r8 = 0; r8 < 2; r8++) {
                const int r = 16 * tile + g + 8 * r8;
                const float x = r < nb ? __fadd_rn(acc[u][2 * r8], acc[u][2 * r8 + 1]) * P.gamma : kNegInf;
                sc[m][r8][u] = x;
                mx[u] = fmaxf(mx[u], x);
            }
    }
#pragma unroll
    for (int u = 0; u < NQ; u++) {
        float x = mx[u];
        /* Over the lanes g of one t: the warp's maximum for head 4u + t, one value
         * per warp into maxbuf. */
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 16));
        if (g == 0 && 4 * u + t < kMaxGroup) maxbuf[warp * kMaxGroup + 4 * u + t] = x;
    }
    __syncthreads();   /* maxima visible; K no longer read: its space takes V */
    load_rows(true);

    /* one tile, unquantized: P = 2^(S - M), as BF16 hi + lo columns. M is the maximum
     * over the four warps: every warp's P.V reads every row's P, so there is one
     * maximum for the CTA and no rescaling. P row (column of B) 2h holds head h's hi,
     * 2h + 1 its lo, one BF16 per key row; the columns of padding heads are zeroed so
     * their MMA inputs are finite (their output is dropped). l sums the FP32 P, which
     * hi + lo carry to 16 bits. */
    uint8_t *pb = smem + kMaxBf16Rows * D * 2;
    for (int k = threadIdx.x; k < 8 * NQ * PR / 4; k += kThreads)
        if (k / (PR / 4) >= 2 * G) reinterpret_cast<uint32_t *>(pb)[k] = 0u;   /* padding columns */
    float l[NQ], M[NQ];
#pragma unroll
    for (int u = 0; u < NQ; u++) {
        const int h = 4 * u + t < kMaxGroup ? 4 * u + t : 0;
        M[u] = maxbuf[h];
#pragma unroll
        for (int w = 1; w < kWarps; w++) M[u] = fmaxf(M[u], maxbuf[w * kMaxGroup + h]);
        l[u] = 0.0f;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const int tile = warp + kWarps * m;
            if (tile >= ntiles) continue;
#pragma unroll
            for (int r8 = 0; r8 < 2; r8++) {
                const float pr = ex2(sc[m][r8][u] - M[u]);
                l[u] += pr;
                const uint16_t hi = fr_dev_bf16_encode(pr);
                const uint16_t lo = fr_dev_bf16_encode(__fsub_rn(pr, fr_dev_bf16_decode(hi)));
                const int r = 16 * tile + g + 8 * r8;
                if (4 * u + t < G) {
                    *reinterpret_cast<uint16_t *>(pb + (2 * (4 * u + t)) * PR + 2 * r) = hi;
                    *reinterpret_cast<uint16_t *>(pb + (2 * (4 * u + t) + 1) * PR + 2 * r) = lo;
                }
            }
        }
        float x = l[u];
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 4);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 8);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 16);
        if (g == 0 && 4 * u + t < kMaxGroup) lred[warp * kMaxGroup + 4 * u + t] = x;
    }
    /* After this barrier the values have landed in the keys' bytes and every warp's P
     * columns and l share are in shared memory. */
    cp_async_wait_all();
    __syncthreads();

    /* O^T for dims 32w .. 32w + 31 over all rows: A = V^T by transposed ldmatrix of
     * the [key][dim] rows (lanes 0-7: keys 0-7 of the dims' first chunk, 8-15: the
     * same keys, second chunk, 16-31: keys 8-15), B = P read from its rows as 32-bit
     * pairs of keys 2t, 2t + 1 and 2t + 8, 2t + 9. C's columns 2t and 2t + 1 are head
     * 4u + t's hi and lo parts: their sum is the head's output for dims g and g + 8
     * of the m-tile. */
    float o[2][NQ][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int u = 0; u < NQ; u++) o[i][u][0] = o[i][u][1] = o[i][u][2] = o[i][u][3] = 0.0f;
    if (32 * warp < D) {
        for (int j = 0; j < ntiles; j++) {
            uint32_t b[NQ][2];
#pragma unroll
            for (int u = 0; u < NQ; u++) {
                const uint8_t *row = pb + (8 * u + g) * PR;
                b[u][0] = *reinterpret_cast<const uint32_t *>(row + 2 * (16 * j + 2 * t));
                b[u][1] = *reinterpret_cast<const uint32_t *>(row + 2 * (16 * j + 8 + 2 * t));
            }
#pragma unroll
            for (int i = 0; i < 2; i++) {
                uint32_t a[4];
                const int mt = 2 * warp + i;   /* dims 16 mt .. 16 mt + 15 */
                const int key = 16 * j + (lane & 7) + ((lane >> 4) << 3);
                ldsm_x4_trans(vs + bf_off<D>(key, 2 * mt + ((lane >> 3) & 1)), a);
#pragma unroll
                for (int u = 0; u < NQ; u++) mma_bf16(o[i][u], a[0], a[1], a[2], a[3], b[u][0], b[u][1]);
            }
        }
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            const int h = 4 * u + t;
            if (h >= G) continue;
            /* The four warps' l in warp order; M is the CTA's maximum, so the LSE
             * carries no c (shift 0). */
            const float lt = warp_sum(lred, h);
            const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
            float *dst = partial_row<D>(P, slot, h);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int d0 = 32 * warp + 16 * i + g;
                dst[d0] = (o[i][u][0] + o[i][u][1]) * inv;
                dst[d0 + 8] = (o[i][u][2] + o[i][u][3]) * inv;
            }
            if (warp == 0 && g == 0) store_lse(P, slot, h, M[u], lt, 0.0f);
        }
    }
}

} // namespace fr_fp4

#endif
