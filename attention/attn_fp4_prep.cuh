/* Query preparation of the FP4/FP8 decode kernels: the query of every
 * (sequence, KV head) rotated, quantized (dual-residual FP4 in exact mode)
 * or split into FP16 hi/lo halves, laid out as the split kernels' MMA
 * fragments; and, without sink/recent, the partial last page quantized on
 * the fly as a promoted page would hold it. Included by attn_fp4_cuda.cu only. */
#ifndef FR_ATTN_FP4_PREP_CUH
#define FR_ATTN_FP4_PREP_CUH

#include <stdint.h>

#include "attn_fp4_common.cuh"

namespace fr_fp4 {

/* Where query element `dim` goes in the QK^T fragments: k-step i, lane t of the
 * lane's quad (lane 4 g + t, g the row or column), register reg of the pair that
 * holds k indices 2t, 2t+1 (reg 0) or 2t+8, 2t+9 (reg 1), and half. The key side
 * fixes the order: lane t of a key reads dims [t D/4, (t + 1) D/4) with one 16-byte
 * (FP4) or two 16-byte (FP8) loads, and the MMA sums over k, so the query only has to
 * put each dim where the key's unpacking puts it (attn_fp4_ptx.cuh, "Fragment
 * ownership"):
 * - FP4 (keys are the B operand, the query the A operand): element e of code word q
 *   of the lane unpacks into k-step 2q + (e & 1), b0 for e in {0, 1, 4, 5} and b1 for
 *   {2, 3, 6, 7}, the low half for e < 4 (fr_dev_fp4_word_to_f16x2's pairs (0, 4),
 *   (2, 6), (1, 5), (3, 7));
 * - FP8 (keys are A, the query B): bytes 2 reg and 2 reg + 1 of the lane's 32-bit
 *   word i are k-step i, register reg, the lower byte the low half (e4m3x2_to_f16x2
 *   of bytes 0-1, then 2-3). */
template <int FMT, int D> FR_K void qk_dim_slot(int dim, int &i, int &t, int &reg, int &half)
{
    t = dim / (D / 4);
    const int rem = dim % (D / 4);
    if (FMT == kFP8) {
        i = rem / 4;
        reg = (rem >> 1) & 1;
        half = rem & 1;
    } else {
        const int o8 = rem & 7;
        i = 2 * (rem >> 3) + (o8 & 1);
        reg = (o8 >> 1) & 1;
        half = o8 >> 2;
    }
}

/* The natural m16n8k16 B-fragment slot of dim (for BF16 keys via ldmatrix): k-step
 * dim / 16, k index dim % 16. The BF16 CTA's keys come from ldmatrix in natural
 * order, so its query does too. */
FR_K void natural_dim_slot(int dim, int &i, int &t, int &reg, int &half)
{
    i = dim >> 4;
    const int r = dim & 15;
    t = (r & 7) >> 1;
    reg = r >> 3;
    half = r & 1;
}

/* fr_dev_fp4_fake_quant_warp (fp4_device.cuh) for the kernels' format constants. */
template <int F> FR_K float fake_quant_warp(float x, bool search, uint8_t &code, uint8_t &scode)
{
    return fr_dev_fp4_fake_quant_warp<F == kMXFP4 ? FR_MXFP4 : FR_NVFP4>(x, search, code, scode);
}

/* prep_query's second half for head h, warp `part` of its wph: the head's scale
 * exponent from the warps' maxima in red[], then this warp's registers as MMA
 * fragments in shared memory, and the head's factor.
 *
 * The terms enter the MMA times 2^-ex, and the head's factor qscale = gamma 2^ex kfac
 * puts everything back on the FP32 sum:
 * - NVFP4 terms: ex = 0. E2M1 x E4M3 lies in [2^-10, 6 x 448] with at most 6
 *   significant bits, an FP16 number as it is;
 * - MXFP4 terms: E2M1 x 2^e spans E8M0's range, far beyond FP16's; ex is the largest
 *   first-term block exponent, so the largest value is at most 6 and blocks up to
 *   2^23 below it stay exact (further down they round in FP16's subnormals:
 *   docs/attention_gpu.md, "Precision");
 * - unquantized (bf16 compute, FP8): ex = floor(log2 amax), so every value is below 2
 *   and its FP16 hi + lo split keeps 22 significant bits.
 * The clamps to [-100, 100] keep 2^ex and 2^-ex normal floats (pow2f is exact only
 * there); an MXFP4 exponent needs no upper clamp, a finite query's largest scale
 * being 2^126. kfac undoes what the key side leaves on its products: 2^7 for NVFP4
 * (the key scales enter times 2^7, then the code words' 2^-14), the per-head K scale
 * for FP8, 1 for MXFP4 (its 2^e_max is applied per key in the split). */
template <int FMT, int D>
__device__ void write_query_frags(const Params &P, size_t sh, int head, int h, int part, int wph, const int *red,
                                  const float (&v0)[D / 32], const float (&v1)[D / 32], const float *xh,
                                  uint16_t *frag, uint16_t *frag_bf, bool quant, uint32_t top)
{
    constexpr int E = D / 32, KS = D / 16;
    const int lane = threadIdx.x & 31;
    for (int p = 0; p < wph; p++) top = max(top, (uint32_t)red[h * wph + p]);

    int ex = 0;   /* values enter the MMA times 2^-ex */
    if (quant) {
        if (FMT == kMXFP4) {
            ex = top ? (int)top - 127 : 0;
            if (ex < -100) ex = -100;
        }
    } else {
        const float amax = __uint_as_float(top);
        ex = amax > 0.0f ? fr_dev_floor_log2(amax) : 0;
        ex = ex < -100 ? -100 : (ex > 100 ? 100 : ex);
    }
    const float down = pow2f(-ex);
#pragma unroll
    for (int e = 0; e < E; e++) {
        if (e % wph != part) continue;
        const int dim = 32 * e + lane;
        uint16_t h0, h1;
        if (quant) {   /* exact in FP16 (or below 2^-24 of the largest block) */
            h0 = f32_to_f16(__fmul_rn(v0[e], down));
            h1 = f32_to_f16(__fmul_rn(v1[e], down));
        } else {       /* hi + lo: 22 significant bits */
            const float xn = __fmul_rn(v0[e], down);
            h0 = f32_to_f16(xn);
            h1 = f32_to_f16(__fsub_rn(xn, f16_to_f32(h0)));
        }
        int i, t, reg, half;
        qk_dim_slot<FMT, D>(dim, i, t, reg, half);
        /* FP8: B fragment [u][i][lane][reg][half], column col of n-tile u = col / 8
         * held by lane 4 (col % 8) + t. FP4: A fragment [mt][i][lane][a0..a3][half],
         * register 2 reg + term: a0 (row g, low k) and a2 (row g, high k) for the
         * first term, a1 and a3 (row g + 8) for the second, so the split gets all
         * four with one 16-byte load per lane and k-step. */
        if (FMT == kFP8) {   /* B fragments: columns 2h, 2h + 1 are head h's two terms */
#pragma unroll
            for (int term = 0; term < 2; term++) {
                const int col = 2 * h + term, u = col >> 3, ln = 4 * (col & 7) + t;
                frag[(((u * KS + i) * 32 + ln) * 2 + reg) * 2 + half] = term ? h1 : h0;
            }
        } else {             /* A fragments: row h & 7 (term 0) and row 8 + (h & 7) (term 1) of m-tile h / 8 */
            const int mt = h >> 3, ln = 4 * (h & 7) + t;
#pragma unroll
            for (int term = 0; term < 2; term++)
                frag[(((mt * KS + i) * 32 + ln) * 4 + 2 * reg + term) * 2 + half] = term ? h1 : h0;
        }
        /* The BF16 CTA's query: BF16 hi + lo (16 significant bits) in natural order,
         * unscaled (BF16 has FP32's range), columns 2h and 2h + 1 of the same B
         * layout as FP8's. */
        if (P.sink_recent) {   /* BF16 tokens: the unquantized (rotated) query */
            const float xe = xh[dim];
            const uint16_t b0 = fr_dev_bf16_encode(xe);
            const uint16_t b1 = fr_dev_bf16_encode(__fsub_rn(xe, fr_dev_bf16_decode(b0)));
            natural_dim_slot(dim, i, t, reg, half);
#pragma unroll
            for (int term = 0; term < 2; term++) {
                const int col = 2 * h + term, u = col >> 3, ln = 4 * (col & 7) + t;
                frag_bf[(((u * KS + i) * 32 + ln) * 2 + reg) * 2 + half] = term ? b1 : b0;
            }
        }
    }
    if (part == 0 && lane == 0) {
        float kfac = 1.0f;
        if (FMT == kNVFP4) kfac = 128.0f;   /* keys enter the MMA times 2^-7 */
        if (FMT == kFP8 && P.fp8_scales) kfac = P.fp8_scales[((size_t)P.kv.layer * P.kv.n_kv_heads + head) * 2];
        P.qscale[sh * kMaxGroup + h] = P.gamma * pow2f(ex) * kfac;
    }
}

/* Query of (sequence, KV head). The exact mode's FP4 quantization of a head is a long
 * chain of dependent instructions (the scale search sums squared errors in element
 * order), and a decode step at batch 1 waits for it; so the 16 warps share the heads:
 * wph warps per head (4 for G <= 4, 2 for G <= 8, 1 above; 1 without FP4 query), warp
 * p of a head quantizing registers e = p, p + wph, ... of the head's 128 dims (32 per
 * register). A register holds whole FP4 blocks (32 dims: two NVFP4 blocks or one
 * MXFP4 block), so the warps never share a block. The head's first warp rotates the
 * whole head first (the Hadamard spans all its dims) and leaves it in shared memory.
 * Writes the FP16 fragments the split reads (FP4: A fragments, rows h % 8 and 8 + h %
 * 8 of m-tile h / 8 holding the two query terms of head h; FP8: B fragments, columns
 * 2h and 2h + 1), the BF16 hi/lo fragments for the BF16 tokens (sink_recent) and the
 * per-head factor S = (sum of the two terms' products) * qscale. */
template <int FMT, int D> __device__ void prep_query(const Params &P, int seq, int head, const fr_paged_seq &s)
{
    constexpr int E = D / 32, KS = D / 16;
    constexpr int kPrepWarps = kPrepThreads / 32;
    /* Staging of the fragments: FP4's 2 m-tiles x 4 registers and FP8's 4 n-tiles x 2
     * registers take the same 4 x KS x 32 x 4 halves. The warps scatter 16-bit halves
     * here; the block then writes them out as whole 32-bit words in order. */
    __shared__ uint16_t frag[4 * KS * 32 * 4];   /* B [u][i][lane][reg][half] or A [mt][i][lane][4][half] */
    __shared__ uint16_t frag_bf[4 * KS * 32 * 4];
    __shared__ float xs[kMaxGroup][D];           /* the rotated query of every head */
    __shared__ int red[kPrepWarps];              /* per warp: MXFP4 top scale code, or amax bits */
    const int nwords = P.qwords, nwords_bf = P.nq * KS * 32 * 2;
    uint32_t *f32 = reinterpret_cast<uint32_t *>(frag), *fb32 = reinterpret_cast<uint32_t *>(frag_bf);
    /* Zero first: the padding heads (h >= G), and the second term of a single FP4
     * query, stay zero in the fragments, so the split's MMAs multiply zeros rather
     * than stale workspace. */
    for (int k = threadIdx.x; k < 2 * KS * 32 * 4; k += kPrepThreads) f32[k] = fb32[k] = 0u;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = P.group;
    const bool quant = FMT != kFP8 && P.q_mode != FR_Q_UNQUANTIZED;
    const int wph = !quant ? 1 : G <= 4 ? 4 : G <= 8 ? 2 : 1;   /* warps per head; the hi/lo split is short */
    const int h = warp / wph, part = warp % wph;
    const bool mine = h < G;
    const size_t sh = (size_t)seq * P.kv.n_kv_heads + head;
    if (mine && part == 0) {
        const float *qh = P.q + ((size_t)s.q_row * P.n_heads + (size_t)head * G + h) * D;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = qh[32 * e + lane];
        if (P.rotate) fr_dev_hadamard_warp<E>(x, D);
#pragma unroll
        for (int e = 0; e < E; e++) xs[h][32 * e + lane] = x[e];
    }
    __syncthreads();

    float v0[E], v1[E];
    uint32_t top = 0;   /* MXFP4: the largest scale code of the first term; otherwise amax's bits */
    if (mine) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            v0[e] = v1[e] = 0.0f;
            if (e % wph != part) continue;
            const float xv = xs[h][32 * e + lane];
            if (quant) {
                uint8_t code, sc;
                v0[e] = fake_quant_warp<FMT == kMXFP4 ? kMXFP4 : kNVFP4>(xv, P.q_search != 0, code, sc);
                top = max(top, (uint32_t)sc);
                if (P.q_mode == FR_Q_DUAL) {
                    const float r = __fsub_rn(fr_dev_isnan(xv) ? 0.0f : xv, v0[e]);
                    v1[e] = fake_quant_warp<FMT == kMXFP4 ? kMXFP4 : kNVFP4>(r, P.q_search != 0, code, sc);
                }
            } else {
                v0[e] = xv;
                if (!fr_dev_isnan(xv)) top = max(top, __float_as_uint(fabsf(xv)));   /* bits order as values */
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) top = max(top, __shfl_xor_sync(0xFFFFFFFFu, top, o));
        if (lane == 0) red[warp] = (int)top;
    }
    __syncthreads();
    /* After the barrier red[] holds every warp's maximum: the head's scale exponent
     * needs all its warps'. */
    if (mine) write_query_frags<FMT, D>(P, sh, head, h, part, wph, red, v0, v1, xs[h], frag, frag_bf, quant, top);
    __syncthreads();
    /* Every warp's halves are in place (barrier above): copy the (sequence, KV
     * head)'s fragments to the workspace, where the split CTAs read them after
     * griddep_wait. */
    uint32_t *dst = P.qfrag + sh * nwords, *dst_bf = P.qfrag_bf + sh * nwords_bf;
    for (int k = threadIdx.x; k < nwords; k += kPrepThreads) dst[k] = f32[k];
    if (P.sink_recent)
        for (int k = threadIdx.x; k < nwords_bf; k += kPrepThreads) dst_bf[k] = fb32[k];
}

/* Token t of the partial page's row r (t = full + r): key and value rows, BF16 store
 * form, from the recent slot (row t % 128) or, for t == len, the step's staging row,
 * which is where the step's own token lives until commit writes it to the slot. */
template <int D>
FR_K void loose_rows(const Params &P, const fr_paged_seq &s, int head, int t, const uint16_t *&k, const uint16_t *&v)
{
    const size_t lh = (size_t)P.kv.layer * P.kv.n_kv_heads + head;
    if (t < s.len) {
        k = P.kv.recent + (size_t)s.slot * 2 * P.kv.slot_elems + lh * kPage * D + (size_t)(t % kPage) * D;
        v = k + P.kv.slot_elems;
    } else {
        const size_t o = ((size_t)s.q_row * P.kv.n_kv_heads + head) * D;
        k = P.kv.step_k + o;
        v = P.kv.step_v + o;
    }
}

/* The partial last page quantized as a promoted page would hold it (kv_cache.c
 * quantize_on_the_fly): keys per token with the recipe's search, values per block of
 * B tokens from the page start, zero padded, FP8 element-wise against the per-head
 * scales. Block z of the grid takes one value block (FP4) or 16 tokens (FP8). The
 * result lands in the workspace in the page layout, so the split CTAs read it as one
 * more page (split_page). Rows past the step's token are zero codes with zero scales:
 * they dequantize to 0, and the split masks them anyway; a value block's zero padding
 * matters, since it is part of the block's amax as on the CPU. */
template <int FMT, int D> __device__ void prep_page(const Params &P, int seq, int head, const fr_paged_seq &s, int z)
{
    using Gm = Geom<FMT, D>;
    constexpr int E = D / 32;
    const int full = s.len / kPage * kPage, cnt = s.len + 1 - full;
    uint8_t *pg = P.otf + ((size_t)seq * P.kv.n_kv_heads + head) * Gm::page_bytes;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (FMT == kFP8) {
        const float *sc = P.fp8_scales + ((size_t)P.kv.layer * P.kv.n_kv_heads + head) * 2;
        const float ks = P.fp8_scales ? sc[0] : 1.0f, vs = P.fp8_scales ? sc[1] : 1.0f;
        for (int k = threadIdx.x; k < 16 * D; k += kPrepThreads) {
            const int r = 16 * z + k / D, j = k % D;
            uint8_t kc = 0, vc = 0;
            if (r < cnt) {
                const uint16_t *kr, *vr;
                loose_rows<D>(P, s, head, full + r, kr, vr);
                kc = fr_dev_e4m3_encode(__fdiv_rn(fr_dev_bf16_decode(kr[j]), ks));
                vc = fr_dev_e4m3_encode(__fdiv_rn(fr_dev_bf16_decode(vr[j]), vs));
            }
            pg[(size_t)r * D + j] = kc;
            pg[Gm::v_codes + (size_t)r * D + j] = vc;
        }
        return;
    }
    constexpr int B = Gm::B;
    constexpr fr_fp4_format FF = FMT == kMXFP4 ? FR_MXFP4 : FR_NVFP4;
    /* Keys quantize per token along the dims, the direction fp4_device.cuh's warp
     * quantizer works in (element j in lane j % 32): a warp per row, every lane four
     * dims. */
    /* keys: one warp per token row of the slice */
    for (int rr = warp; rr < B; rr += kPrepThreads / 32) {
        const int r = z * B + rr;
        uint8_t *kc = pg + (size_t)r * (D / 2), *ks = pg + Gm::k_scales + (size_t)r * (D / B);
        if (r < cnt) {
            const uint16_t *kr, *vr;
            loose_rows<D>(P, s, head, full + r, kr, vr);
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int j = 32 * e + lane;
                uint8_t code, scode;
                fake_quant_warp<FMT>(fr_dev_bf16_decode(kr[j]), P.q_search != 0, code, scode);
                /* the eight lanes of a code word OR their placed codes together */
                uint32_t word = fr_dev_fp4_word_place(code, j & 7);
                word |= __shfl_xor_sync(0xFFFFFFFFu, word, 1);
                word |= __shfl_xor_sync(0xFFFFFFFFu, word, 2);
                word |= __shfl_xor_sync(0xFFFFFFFFu, word, 4);
                if (!(j & 7)) *reinterpret_cast<uint32_t *>(kc + j / 2) = word;
                if (!(j % B)) ks[j / B] = scode;
            }
        } else {
            for (int j = lane; j < D / 2; j += 32) kc[j] = 0;
            for (int j = lane; j < D / B; j += 32) ks[j] = 0;
        }
    }
    /* Values quantize along the tokens, across the rows the warps above hold, so they
     * go back to the BF16 rows: one thread per channel quantizes its B tokens as one
     * block (128 of the 512 threads work here). */
    /* values: one thread per channel, block z of B tokens */
    for (int j = threadIdx.x; j < D; j += kPrepThreads) {
        float col[B];
        uint8_t codes[B];
#pragma unroll
        for (int i = 0; i < B; i++) {
            const int r = z * B + i;
            col[i] = 0.0f;
            if (r < cnt) {
                const uint16_t *kr, *vr;
                loose_rows<D>(P, s, head, full + r, kr, vr);
                col[i] = fr_dev_bf16_decode(vr[j]);
            }
        }
        pg[Gm::v_scales + (size_t)j * (kPage / B) + z] = fr_dev_fp4_quantize_block<FF>(false, col, codes);
        uint32_t *vc = reinterpret_cast<uint32_t *>(pg + Gm::v_codes + (size_t)j * (kPage / 2) + z * (B / 2));
#pragma unroll
        for (int i = 0; i < B; i += 8) vc[i / 8] = fr_dev_fp4_word_pack(codes + i);
    }
}

/* Grid (n_seqs, n_kv_heads, 1 + slices): z = 0 the query, z >= 1 a slice of the
 * on-the-fly page (launched only without sink/recent). Launched without the
 * programmatic attribute, so it starts only when the previous kernel of the stream
 * (the stage kernel that writes the staging rows) has ended. */
template <int FMT, int D> __global__ void __launch_bounds__(kPrepThreads) prep_kernel(Params P)
{
    /* the split kernel may start at once: it loads cache pages while this
     * grid runs, and waits for it before reading what it writes */
    griddep_launch_dependents();
    const int seq = blockIdx.x, head = blockIdx.y, z = blockIdx.z;
    const fr_paged_seq s = P.seqs[seq];
    if (s.n_new != 1) return;
    if (z == 0) {
        prep_query<FMT, D>(P, seq, head, s);
    } else {
        prep_page<FMT, D>(P, seq, head, s, z - 1);
    }
}

} // namespace fr_fp4

#endif
