/* Device side of the FP4/FP8 decode attention (attention/attn_fp4.h,
 * docs/attention_gpu.md "FP4 and FP8 KV: decode"). Three kernels per step:
 *
 *  prep_kernel     the query of every (sequence, KV head): rotated, quantized
 *                  (dual-residual FP4 in exact mode) or split into FP16 hi/lo
 *                  halves, laid out as MMA B fragments in the workspace; and,
 *                  without sink/recent (vanilla FP4, FP8), the partial last
 *                  page quantized on the fly into a page of the workspace;
 *  split_kernel    one CTA per (split, KV head, sequence) walks the split's
 *                  pages (CTA x = 0: the BF16 sink/recent/step tokens);
 *  combine_kernel  joins the split partials by their base-2 LSE.
 *
 * Included by attn_fp4.cu only. */
#ifndef FR_ATTN_FP4_KERNELS_CUH
#define FR_ATTN_FP4_KERNELS_CUH

#include <stdint.h>

#include "attn_fp4_ptx.cuh"
#include "fp4_device.cuh"
#include "paged_kv.h"

namespace fr_fp4 {

using namespace fr_fp4_ptx;

#define FR_K __device__ __forceinline__

constexpr int kPage = 128;          /* tokens per page = online-softmax tile */
constexpr int kWarps = 4, kThreads = 128;
constexpr int kMaxGroup = 16;
constexpr int kSink = 16;
constexpr int kMaxBf16Rows = 144;   /* sink 16 + recent 127 + step 1, in 16-row tiles */
constexpr int kPrepThreads = 512;   /* one warp per query head */
constexpr float kNegInf = -__builtin_huge_valf();
/* P enters the P.V MMA as FP16 times 2^11: an exact-mode P is at most
 * c * 6 * 4 / 6... <= 24, so 24 * 2^11 < 65504, and unquantized P keeps its
 * relative precision down to 2^-24 of the running maximum. */
constexpr float kPShift = 2048.0f;
constexpr float kPUnshift = 1.0f / 2048.0f;

enum { kNVFP4 = 0, kMXFP4 = 1, kFP8 = 2 };

/* Byte layout of one head page (kvcache/page_layout.h; the host checks the
 * offsets the view carries against these). */
template <int FMT, int D> struct Geom {
    static constexpr int B = FMT == kMXFP4 ? 32 : 16;
    static constexpr int k_scales = FMT == kFP8 ? 0 : kPage * D / 2;
    static constexpr int v_codes = FMT == kFP8 ? kPage * D : k_scales + kPage * D / B;
    static constexpr int v_scales = FMT == kFP8 ? 0 : v_codes + D * kPage / 2;
    static constexpr int page_bytes = FMT == kFP8 ? 2 * kPage * D : v_scales + D * kPage / B;
    /* A page is two halves, keys (codes and scales) then values, each
     * loaded on its own barrier into a ring of two (Smem): two pages of
     * shared memory keep K two pages ahead and V one page ahead of use. */
    static constexpr int k_half = v_codes, v_half = page_bytes - v_codes;
    static constexpr int ksteps = D / 16;
};

/* Everything the kernels read; plain data, passed by value. */
struct Params {
    fr_paged_kv kv;
    const fr_paged_seq *seqs;
    const float *q;            /* [rows][n_heads][D] */
    uint16_t *out;             /* [rows][n_heads][D] BF16 */
    const float *fp8_scales;   /* [layers][kv_heads][2] or NULL */
    int n_heads, group, n_splits, nq;
    int sink_recent, rotate;
    int q_mode, q_search, quantize_p, underflow_aware;
    float c, log2c, tau, gamma;
    /* workspace */
    uint32_t *qfrag;           /* [seq][kvh][nq][ksteps][32][2] FP16x2, FP4/FP8 dim order */
    uint32_t *qfrag_bf;        /* [seq][kvh][nq][ksteps][32][2] BF16x2 hi/lo, natural order */
    float *qscale;             /* [seq][kvh][16]: S = (hi + lo column sum) * qscale */
    uint8_t *otf;              /* [seq][kvh][page_bytes]: the partial page, quantized */
    float *o_part;             /* [seq][kvh][n_splits + 1][G][D] */
    float *lse_part;           /* [seq][kvh][n_splits + 1][G] */
};

/* ======================= small helpers ======================= */

FR_K uint32_t bcast_lo(uint32_t x) { return __byte_perm(x, 0, 0x1010); }
FR_K uint32_t bcast_hi(uint32_t x) { return __byte_perm(x, 0, 0x3232); }

/* The bit reversal of a 3-bit index: position p of a P row holds token
 * (p & ~7) | rev3(p & 7) (see "P exchange" in the split kernel). */
FR_K int rev3(int x) { return ((x & 1) << 2) | (x & 2) | ((x >> 2) & 1); }

/* Eight E2M1 codes (one 32-bit word, element 0 in the low nibble) to four
 * FP16x2 registers holding value * 2^-14, by bit placement alone: the sign
 * goes to bit 15 and the three magnitude bits to bits 11..9 of a half, which
 * makes exponent e1e0 and mantissa m, subnormal e = 0 included. Each output
 * is one LOP3 of two shifted copies of the even or odd nibbles (the other
 * nibbles land outside the mask). Pairs: r0 = elements (0, 4), r1 = (2, 6),
 * r2 = (1, 5), r3 = (3, 7), low half first. */
FR_K void unpack_e2m1(uint32_t w, uint32_t (&r)[4])
{
    const uint32_t xe = w & 0x0F0F0F0Fu, xo = w & 0xF0F0F0F0u;
    r[0] = or_and<0x8E008E00u>(xe << 12, xe << 9);
    r[1] = or_and<0x8E008E00u>(xe << 4, xe << 1);
    r[2] = or_and<0x8E008E00u>(xo << 8, xo << 5);
    r[3] = or_and<0x8E008E00u>(xo, xo >> 3);
}

/* FP16 bits of 2^d for d <= 15 (subnormal below -14, 0 below -24). */
FR_K uint32_t f16_pow2(int d)
{
    if (d >= -14) return (uint32_t)(d + 15) << 10;
    return d >= -24 ? 1u << (d + 24) : 0u;
}

/* The largest of the four bytes of w. */
FR_K uint32_t max_byte4(uint32_t w)
{
    const uint32_t x = __vmaxu4(w, w >> 8);
    return __vmaxu4(x, x >> 16) & 0xFFu;
}

/* E2M1 rounding of x >= 0 (ties to the even code, saturating at 6) as a
 * float: adding 2^22, 2^23 or 2^24 leaves the grid step 0.5, 1 or 2 as the
 * last mantissa bit of the sum, so the hardware's round-to-nearest-even
 * does the rounding (fr_e2m1_encode's thresholds exactly). */
FR_K float e2m1_round(float x)
{
    x = fminf(x, 6.0f);
    const float big = x < 2.0f ? 4194304.0f : (x < 4.0f ? 8388608.0f : 16777216.0f);
    return __fsub_rn(__fadd_rn(x, big), big);
}

FR_K float pow2f(int e) { return fr_dev_exp2i(e); }

/* ======================= query preparation ======================= */

/* Where query element `dim` of one column goes in the B fragments of the
 * QK^T MMA: k-step i, lane t (the lane's 4 * g + t for column g), register
 * reg (b0/b1) and half. The K A-fragments use the same permutation (lane t
 * owns dims [t * D/4, (t + 1) * D/4); unpack_e2m1's pairs for FP4, byte
 * pairs for FP8), so q.k is unchanged. */
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

/* The natural m16n8k16 B-fragment slot of dim (for BF16 keys via ldmatrix). */
FR_K void natural_dim_slot(int dim, int &i, int &t, int &reg, int &half)
{
    i = dim >> 4;
    const int r = dim & 15;
    t = (r & 7) >> 1;
    reg = r >> 3;
    half = r & 1;
}

/* The warp's lanes hold one row of values, element j in lane j % 32,
 * register j / 32. fake_quant_warp quantizes the blocks of B elements
 * (half-warps for NVFP4, whole registers for MXFP4) as
 * fr_fp4_quantize_block does, bit for bit: amax over the block, the
 * standard scale, with search the alternative and the squared errors
 * summed in element order. Returns this lane's dequantized value and its
 * code and scale code. Every lane of the warp must call it. */
template <int F> FR_K float fake_quant_warp(float x, bool search, uint8_t &code, uint8_t &scode)
{
    constexpr fr_fp4_format FF = F == kMXFP4 ? FR_MXFP4 : FR_NVFP4;
    constexpr int B = F == kMXFP4 ? 32 : 16;
    const int lane = threadIdx.x & 31, base = lane & ~(B - 1);
    float amax = fmaxf(0.0f, fabsf(x));
#pragma unroll
    for (int o = 1; o < B; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const uint8_t s0 = fr_dev_fp4_standard_scale<FF>(amax);
    const float v0 = fr_dev_fp4_scale_value<FF>(s0);
    const uint8_t c0 = v0 > 0.0f ? fr_dev_e2m1_encode(__fdiv_rn(x, v0)) : 0;
    code = c0;
    scode = s0;
    if (!search) return fr_dev_fp4_dequant(v0, c0);
    /* the two halves of a warp may hold different NVFP4 blocks: every lane
     * runs the error sums (they shuffle), the choice is per block */
    const uint8_t s1 = fr_dev_fp4_alternative_scale<FF>(amax, s0);
    const float v1 = fr_dev_fp4_scale_value<FF>(s1);
    const uint8_t c1 = v1 > 0.0f ? fr_dev_e2m1_encode(__fdiv_rn(x, v1)) : 0;
    const float xi = fr_dev_isnan(x) ? 0.0f : x;
    const float e0 = __fsub_rn(fr_dev_fp4_dequant(v0, c0), xi), e1 = __fsub_rn(fr_dev_fp4_dequant(v1, c1), xi);
    const float q0 = __fmul_rn(e0, e0), q1 = __fmul_rn(e1, e1);
    float sse0 = 0.0f, sse1 = 0.0f;
#pragma unroll
    for (int k = 0; k < B; k++) {   /* element order, as the C loop */
        sse0 = __fadd_rn(sse0, __shfl_sync(0xFFFFFFFFu, q0, base + k));
        sse1 = __fadd_rn(sse1, __shfl_sync(0xFFFFFFFFu, q1, base + k));
    }
    if (s1 != s0 && sse1 < sse0) {
        code = c1;
        scode = s1;
        return fr_dev_fp4_dequant(v1, c1);
    }
    return fr_dev_fp4_dequant(v0, c0);
}

/* Query of (sequence, KV head): warp h < G takes head h. Writes the FP16 B
 * fragments (columns 2h, 2h + 1: the two query terms of head h), the BF16
 * hi/lo fragments for the BF16 tokens (sink_recent) and the per-head
 * factor S = (column sum) * qscale. */
template <int FMT, int D> __device__ void prep_query(const Params &P, int seq, int head, const fr_paged_seq &s)
{
    constexpr int E = D / 32, KS = D / 16;
    __shared__ uint16_t frag[4 * KS * 32 * 4];   /* [u][i][lane][reg][half] */
    __shared__ uint16_t frag_bf[4 * KS * 32 * 4];
    const int nwords = P.nq * KS * 32 * 2;
    uint32_t *f32 = reinterpret_cast<uint32_t *>(frag), *fb32 = reinterpret_cast<uint32_t *>(frag_bf);
    for (int k = threadIdx.x; k < nwords; k += kPrepThreads) f32[k] = fb32[k] = 0u;
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = P.group;
    const size_t sh = (size_t)seq * P.kv.n_kv_heads + head;
    if (warp < G) {
        const float *qh = P.q + ((size_t)s.q_row * P.n_heads + (size_t)head * G + warp) * D;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = qh[32 * e + lane];
        if (P.rotate) fr_dev_hadamard_warp<E>(x, D);

        float v0[E], v1[E];
        int ex = 0;   /* values enter the MMA times 2^-ex */
        const bool quant = FMT != kFP8 && P.q_mode != FR_Q_UNQUANTIZED;
        if (quant) {
            uint32_t top = 0;   /* MXFP4: the largest scale code of the first term */
#pragma unroll
            for (int e = 0; e < E; e++) {
                uint8_t code, sc;
                const float xv = x[e];
                v0[e] = fake_quant_warp<FMT == kMXFP4 ? kMXFP4 : kNVFP4>(xv, P.q_search != 0, code, sc);
                top = max(top, (uint32_t)sc);
                if (P.q_mode == FR_Q_DUAL) {
                    const float r = __fsub_rn(fr_dev_isnan(xv) ? 0.0f : xv, v0[e]);
                    v1[e] = fake_quant_warp<FMT == kMXFP4 ? kMXFP4 : kNVFP4>(r, P.q_search != 0, code, sc);
                } else {
                    v1[e] = 0.0f;
                }
            }
            if (FMT == kMXFP4) {
#pragma unroll
                for (int o = 16; o; o >>= 1) top = max(top, __shfl_xor_sync(0xFFFFFFFFu, top, o));
                ex = top ? (int)top - 127 : 0;
                if (ex < -100) ex = -100;
            }
        } else {
            float amax = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
            for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
            ex = amax > 0.0f ? fr_dev_floor_log2(amax) : 0;
            ex = ex < -100 ? -100 : (ex > 100 ? 100 : ex);
#pragma unroll
            for (int e = 0; e < E; e++) v0[e] = x[e];
        }
        const float down = pow2f(-ex);
#pragma unroll
        for (int e = 0; e < E; e++) {
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
#pragma unroll
            for (int term = 0; term < 2; term++) {
                const int col = 2 * warp + term, u = col >> 3, ln = 4 * (col & 7) + t;
                frag[(((u * KS + i) * 32 + ln) * 2 + reg) * 2 + half] = term ? h1 : h0;
            }
            if (P.sink_recent) {   /* BF16 tokens: the unquantized (rotated) query */
                const uint16_t b0 = fr_dev_bf16_encode(x[e]);
                const uint16_t b1 = fr_dev_bf16_encode(__fsub_rn(x[e], fr_dev_bf16_decode(b0)));
                natural_dim_slot(dim, i, t, reg, half);
#pragma unroll
                for (int term = 0; term < 2; term++) {
                    const int col = 2 * warp + term, u = col >> 3, ln = 4 * (col & 7) + t;
                    frag_bf[(((u * KS + i) * 32 + ln) * 2 + reg) * 2 + half] = term ? b1 : b0;
                }
            }
        }
        if (lane == 0) {
            float kfac = 1.0f;
            if (FMT == kNVFP4) kfac = 128.0f;   /* keys enter the MMA times 2^-7 */
            if (FMT == kFP8 && P.fp8_scales)
                kfac = P.fp8_scales[((size_t)P.kv.layer * P.kv.n_kv_heads + head) * 2];
            P.qscale[sh * kMaxGroup + warp] = P.gamma * pow2f(ex) * kfac;
        }
    }
    __syncthreads();
    uint32_t *dst = P.qfrag + sh * nwords, *dst_bf = P.qfrag_bf + sh * nwords;
    for (int k = threadIdx.x; k < nwords; k += kPrepThreads) {
        dst[k] = f32[k];
        if (P.sink_recent) dst_bf[k] = fb32[k];
    }
}

/* Token t of the partial page's row r (t = full + r): key and value rows,
 * BF16 store form, from the recent slot or (t == len) the staging row. */
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

/* The partial last page quantized as a promoted page would hold it
 * (kv_cache.c quantize_on_the_fly): keys per token with the recipe's
 * search, values per block of B tokens from the page start, zero padded,
 * FP8 element-wise against the per-head scales. Block z of the grid takes
 * one value block (FP4) or 16 tokens (FP8). */
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
                const uint32_t next = __shfl_down_sync(0xFFFFFFFFu, (uint32_t)code, 1);
                if (!(j & 1)) kc[j / 2] = fr_dev_fp4_pack2(code, (uint8_t)next);
                if (!(j % B)) ks[j / B] = scode;
            }
        } else {
            for (int j = lane; j < D / 2; j += 32) kc[j] = 0;
            for (int j = lane; j < D / B; j += 32) ks[j] = 0;
        }
    }
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
        uint8_t *vc = pg + Gm::v_codes + (size_t)j * (kPage / 2) + z * (B / 2);
#pragma unroll
        for (int i = 0; i < B; i += 2) vc[i / 2] = fr_dev_fp4_pack2(codes[i], codes[i + 1]);
    }
}

/* Grid (n_seqs, n_kv_heads, 1 + slices): z = 0 the query, z >= 1 a slice of
 * the on-the-fly page (launched only without sink/recent). */
template <int FMT, int D> __global__ void __launch_bounds__(kPrepThreads) prep_kernel(Params P)
{
    const int seq = blockIdx.x, head = blockIdx.y, z = blockIdx.z;
    const fr_paged_seq s = P.seqs[seq];
    if (s.n_new != 1) return;
    if (z == 0)
        prep_query<FMT, D>(P, seq, head, s);
    else
        prep_page<FMT, D>(P, seq, head, s, z - 1);
}

/* ======================= the split kernel ======================= */

/* Shared memory of one CTA (offsets in bytes): the K ring (two key
 * halves), the V ring (two value halves) and two P buffers; the BF16 split
 * uses the same bytes for its rows (keys, then values in their place) and P.
 * An NVFP4 CTA then takes 42 KB where a three-page pipeline with a whole
 * 144-row BF16 tile took 75 KB: five CTAs fit an SM instead of three, and
 * the one-group kernels (NQ = 1) are held to the registers of five
 * (split_kernel's launch bounds; 64K decode steps 2-3% faster than with
 * four, bench/RESULTS.md). */
template <int FMT, int NP, int D> struct Smem {
    using Gm = Geom<FMT, D>;
    static constexpr int prow = 256;   /* one P row: 128 FP16 */
    static constexpr int kring = 0, vring = 2 * Gm::k_half;
    static constexpr int pbuf = vring + 2 * Gm::v_half;
    static constexpr int pbuf_bytes = 2 * 8 * NP * prow;
    /* BF16 split: 144 rows of K or V, then P (hi/lo rows of up to NQ = 2 NP
     * query-head groups of 4; NP = 1 serves NQ <= 2) */
    static constexpr int bf16_rows = kMaxBf16Rows * D * 2;
    static constexpr int bf16_bytes = bf16_rows + 8 * (2 * NP) * kMaxBf16Rows * 2;
    static constexpr int maxbuf = (pbuf + pbuf_bytes > bf16_bytes ? pbuf + pbuf_bytes : bf16_bytes);
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

FR_K void write_empty(const Params &P, size_t slot)
{
    const int G = P.group, D = P.kv.head_dim;
    for (int k = threadIdx.x; k < G * D; k += kThreads) P.o_part[slot * G * D + k] = 0.0f;
    for (int k = threadIdx.x; k < G; k += kThreads) P.lse_part[slot * G + k] = kNegInf;
}

/* Scores of this lane's 4 keys (m-tile j, row half r8: token-in-page
 * tok[j][r8]) for the heads 4u + t, in base-2 logit units, unmasked. */
template <int FMT, int NQ, int D>
FR_K void score_page(const uint8_t *pg, const uint2 (&qf)[NQ][D / 16], const float (&qs)[NQ], const int (&tok)[2][2],
                     float (&sc)[2][2][NQ])
{
    using Gm = Geom<FMT, D>;
    constexpr int KS = D / 16;
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float acc[NQ][4];
#pragma unroll
        for (int u = 0; u < NQ; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
        uint32_t a[2][KS][2];   /* [row half][k-step][a0/a2 or a1/a3] */
        float kf[2] = {1.0f, 1.0f};
#pragma unroll
        for (int r8 = 0; r8 < 2; r8++) {
            const int row = tok[j][r8];
            if (FMT == kFP8) {
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
            } else {
                constexpr int WPL = D / 32;   /* code words per lane per key */
                uint32_t ws[WPL];
                if (WPL == 4) {
                    const uint4 w = *reinterpret_cast<const uint4 *>(pg + row * (D / 2) + t * 16);
                    ws[0] = w.x; ws[1] = w.y; ws[WPL > 2 ? 2 : 0] = w.z; ws[WPL > 3 ? 3 : 0] = w.w;
                } else {
                    const uint2 w = *reinterpret_cast<const uint2 *>(pg + row * (D / 2) + t * 8);
                    ws[0] = w.x; ws[WPL > 1 ? 1 : 0] = w.y;
                }
                /* block-scale factors as FP16x2 {f, f}, one per word */
                uint32_t f[WPL];
                if (FMT == kNVFP4) {
                    if (D == 128) {
                        const uint32_t sb = *reinterpret_cast<const uint16_t *>(pg + Gm::k_scales + row * 8 + 2 * t);
                        const uint32_t s2 = hmul2(e4m3x2_to_f16x2(sb), 0x58005800u);   /* x 2^7 */
                        f[0] = f[1 % WPL] = bcast_lo(s2);
                        f[2 % WPL] = f[3 % WPL] = bcast_hi(s2);
                    } else {
                        const uint32_t sb = pg[Gm::k_scales + row * (D / 16) + t];
                        const uint32_t s2 = hmul2(e4m3x2_to_f16x2(sb), 0x58005800u);
#pragma unroll
                        for (int q = 0; q < WPL; q++) f[q] = bcast_lo(s2);
                    }
                } else {   /* MXFP4: 2^(e_b - e_max) here, 2^e_max on the score */
                    uint32_t all, mine;
                    if (D == 128) {
                        all = *reinterpret_cast<const uint32_t *>(pg + Gm::k_scales + row * 4);
                        mine = (all >> (8 * t)) & 0xFFu;
                    } else {
                        all = *reinterpret_cast<const uint16_t *>(pg + Gm::k_scales + row * 2);
                        mine = (all >> (8 * (t >> 1))) & 0xFFu;
                    }
                    const uint32_t top = max_byte4(all);
                    const uint32_t h = f16_pow2((int)mine - (int)top + 14);
#pragma unroll
                    for (int q = 0; q < WPL; q++) f[q] = h | (h << 16);
                    kf[r8] = fr_dev_e8m0_decode((uint8_t)top);
                }
#pragma unroll
                for (int q = 0; q < WPL; q++) {
                    uint32_t r[4];
                    unpack_e2m1(ws[q], r);
                    a[r8][2 * q][0] = hmul2(r[0], f[q]);
                    a[r8][2 * q][1] = hmul2(r[1], f[q]);
                    a[r8][2 * q + 1][0] = hmul2(r[2], f[q]);
                    a[r8][2 * q + 1][1] = hmul2(r[3], f[q]);
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
            sc[j][0][u] = __fadd_rn(acc[u][0], acc[u][1]) * (qs[u] * kf[0]);
            sc[j][1][u] = __fadd_rn(acc[u][2], acc[u][3]) * (qs[u] * kf[1]);
        }
    }
}

/* O^T (this warp's 32 dims) += V^T (dims x 128 tokens) P^T (tokens x heads)
 * for one page, from its value half vh; P^T comes from the P buffer
 * (positions in the bit-reversed token order the V unpacking produces). */
template <int FMT, int NP, int D>
FR_K void pv_page(const uint8_t *vh, const uint8_t *pb, float (&o)[2][NP][4])
{
    using Gm = Geom<FMT, D>;
    constexpr int v_scales = Gm::v_scales - Gm::v_codes;   /* within the half */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    /* B fragments: row 8u + g of the P buffer, chunk 4t + q gives k-steps
     * 2q (b0, b1) and 2q + 1 (b0, b1) */
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
    if constexpr (FMT == kFP8) {
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
    } else {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint32_t a[2][8][2];   /* [row half][k-step][a0/a2] */
        float pf[2] = {1.0f, 1.0f};
#pragma unroll
        for (int r8 = 0; r8 < 2; r8++) {
            const int dim = 32 * warp + 16 * i + 8 * r8 + g;
            const uint4 w = *reinterpret_cast<const uint4 *>(vh + dim * 64 + 16 * t);
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
            uint32_t f[4];
            if (FMT == kNVFP4) {
                const uint32_t sb = *reinterpret_cast<const uint16_t *>(vh + v_scales + dim * 8 + 2 * t);
                const uint32_t s2 = hmul2(e4m3x2_to_f16x2(sb), 0x58005800u);
                f[0] = f[1] = bcast_lo(s2);
                f[2] = f[3] = bcast_hi(s2);
            } else {
                const uint32_t all = *reinterpret_cast<const uint32_t *>(vh + v_scales + dim * 4);
                const uint32_t top = max_byte4(all), mine = (all >> (8 * t)) & 0xFFu;
                const uint32_t h = f16_pow2((int)mine - (int)top + 14);
                f[0] = f[1] = f[2] = f[3] = h | (h << 16);
                pf[r8] = fr_dev_e8m0_decode((uint8_t)top);
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                uint32_t r[4];
                unpack_e2m1(ws[q], r);
                a[r8][2 * q][0] = hmul2(r[0], f[q]);
                a[r8][2 * q][1] = hmul2(r[1], f[q]);
                a[r8][2 * q + 1][0] = hmul2(r[2], f[q]);
                a[r8][2 * q + 1][1] = hmul2(r[3], f[q]);
            }
        }
        if (FMT == kNVFP4) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int u = 0; u < NP; u++)
                    mma_f16(o[i][u], a[0][j][0], a[1][j][0], a[0][j][1], a[1][j][1], b[u][j][0], b[u][j][1]);
        } else {
            /* per-(dim, page) exponent: the page's product in a fresh
             * accumulator, scaled into O */
#pragma unroll
            for (int u = 0; u < NP; u++) {
                float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < 8; j++)
                    mma_f16(tmp, a[0][j][0], a[1][j][0], a[0][j][1], a[1][j][1], b[u][j][0], b[u][j][1]);
                o[i][u][0] = fmaf(tmp[0], pf[0], o[i][u][0]);
                o[i][u][1] = fmaf(tmp[1], pf[0], o[i][u][1]);
                o[i][u][2] = fmaf(tmp[2], pf[1], o[i][u][2]);
                o[i][u][3] = fmaf(tmp[3], pf[1], o[i][u][3]);
            }
        }
    }
    }
}

/* The dim of O^T row (m-tile i, row r) of warp w. */
template <int FMT> FR_K int out_dim(int warp, int i, int r)
{
    if (FMT == kFP8) return 32 * warp + 4 * (r & 7) + 2 * i + (r >> 3);
    return 32 * warp + 16 * i + r;
}

/* P quantization of one block against the running maximum (Algorithm 1
 * lines 12-14, fr_pquant_scale): the real scale s, 0 when the block is
 * empty or underflows. */
template <int FMT> FR_K float p_scale(const Params &P, float bmax, float m_new)
{
    const float pmax = bmax == kNegInf ? 0.0f : ex2(bmax - m_new);
    const float cmax = __fmul_rn(P.c, pmax);
    if (FMT == kMXFP4) {
        const uint8_t code = cmax > 0.0f ? fr_dev_e8m0_from_exp(fr_dev_floor_log2(cmax) - 2) : fr_dev_e8m0_from_exp(-127);
        return fr_dev_e8m0_decode(code);
    }
    const bool small = P.underflow_aware && cmax <= P.tau;
    const float q = small ? __fmul_rn(cmax, 0.5f) : __fdiv_rn(cmax, 6.0f);
    return fr_dev_e4m3_decode(fr_dev_e4m3_encode(q));
}

template <int FMT, bool EXACT, int NQ, int D>
__device__ void fp4_split(const Params &P, uint8_t *smem, int seq, int head, int split, const fr_paged_seq &s)
{
    using Gm = Geom<FMT, D>;
    constexpr int NP = NQ > 2 ? 2 : 1;
    constexpr int KS = D / 16;
    using Sm = Smem<FMT, NP, D>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int G = P.group, kvh = P.kv.n_kv_heads;
    const int len = s.len, n = len + 1;
    const int fp4_end = P.sink_recent ? len / kPage * kPage : n;
    const int x1 = P.sink_recent ? (n < kSink ? n : kSink) : 0;   /* the sink's quantized copy */
    const int tiles = (fp4_end + kPage - 1) / kPage;
    const int pa = (int)((long)tiles * split / P.n_splits), pb = (int)((long)tiles * (split + 1) / P.n_splits);
    const int t1 = pb * kPage < fp4_end ? pb * kPage : fp4_end;
    const size_t sh = (size_t)seq * kvh + head;
    const size_t slot = sh * (P.n_splits + 1) + split;
    if (pa >= pb) {
        write_empty(P, slot);
        return;
    }
    const int npages = pb - pa;

    uint8_t *pbuf = smem + Sm::pbuf;
    float *maxbuf = reinterpret_cast<float *>(smem + Sm::maxbuf);   /* [2][warps][16] */
    float *lred = reinterpret_cast<float *>(smem + Sm::lred);       /* [warps][16] */
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem + Sm::bars);

    /* where page p of the sequence is: its block, or the on-the-fly page */
    const size_t lh = (size_t)P.kv.layer * kvh + head;
    const int full_pages = len / kPage;
    auto page_src = [&](int k) {
        const int p = pa + k;
        return p < full_pages ? P.kv.pool + (size_t)s.block_table[p] * P.kv.block_bytes + lh * P.kv.head_page_bytes
                              : P.otf + sh * Gm::page_bytes;
    };
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
    for (int k = threadIdx.x; k < Sm::pbuf_bytes / 16; k += kThreads)
        reinterpret_cast<uint4 *>(pbuf)[k] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    if (threadIdx.x == 0)
        for (int k = 0; k < 2 && k < npages; k++) issue_k(k);

    /* the query: B fragments and per-head factors */
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
            pv_page<FMT, NP, D>(smem + Sm::vring + (k & 1) * Gm::v_half, pbuf + (k & 1) * (Sm::pbuf_bytes / 2), acc);
    };

    for (int k = 0; k < npages; k++) {
        const int p = pa + k;
        mbar_wait(bars + (k & 1), (uint32_t)(k >> 1) & 1u);

        float sc[2][2][NQ];
        score_page<FMT, NQ, D>(smem + Sm::kring + (k & 1) * Gm::k_half, qf, qs, tok, sc);
        float bm[NQ], wm[NQ];
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
            /* lanes g = 0..3 hold tokens 0..15 of the warp, 4..7 tokens
             * 16..31: two steps give the NVFP4 block max, three the warp's */
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
            bm[u] = mx;
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
            wm[u] = mx;
            if (FMT == kMXFP4) bm[u] = mx;
            if (g == 0 && 4 * u + t < kMaxGroup) maxbuf[((k & 1) * kWarps + warp) * kMaxGroup + 4 * u + t] = mx;
        }
        __syncthreads();   /* maxima of page k; P of page k - 1; K of page k and V of page k - 2 free */
        if (threadIdx.x == 0) {
            fence_proxy_async();
            if (k + 2 < npages) issue_k(k + 2);
            issue_v(k);
        }
        if (k > 0) pv_wait(k - 1, pending, o);

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
        uint8_t *pbk = pbuf + (k & 1) * (Sm::pbuf_bytes / 2);
#pragma unroll
        for (int u = 0; u < NQ; u++) {
            const int h = 4 * u + t;
            const float mn = h < G ? fmaxf(mq[u], tile_max(h < kMaxGroup ? h : 0)) : 0.0f;
            const float al = (h < G && mq[u] != kNegInf) ? ex2(mq[u] - mn) : 0.0f;
            mq[u] = mn;
            const float mc = mn - P.log2c;   /* c folded into exp2 */
            float pv[2][2], sum = 0.0f;
            if (EXACT) {
                const float sp = p_scale<FMT>(P, bm[u], mn);
                const float rs = sp > 0.0f ? __frcp_rn(sp) : 0.0f, ss = sp * kPShift;
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int r8 = 0; r8 < 2; r8++) {
                        const float cp = ex2(sc[j][r8][u] - mc);
                        sum += cp;
                        pv[j][r8] = e2m1_round(cp * rs) * ss;
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int r8 = 0; r8 < 2; r8++) {
                        const float cp = ex2(sc[j][r8][u] - mc);
                        sum += cp;
                        pv[j][r8] = cp * kPShift;
                    }
            }
            lq[u] = lq[u] * al + sum;
            if (h < G)
                *reinterpret_cast<uint2 *>(pbk + pbuf_off(h, 32 * warp + 4 * g)) =
                    make_uint2(pack_f16x2(pv[0][0], pv[0][1]), pack_f16x2(pv[1][0], pv[1][1]));
        }
        pending = true;
    }
    __syncthreads();
    pv_wait(npages - 1, pending, o);

    /* l over the warp's keys, then over the warps */
#pragma unroll
    for (int u = 0; u < NQ; u++) {
        float x = lq[u];
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 4);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 8);
        x += __shfl_xor_sync(0xFFFFFFFFu, x, 16);
        if (g == 0 && 4 * u + t < kMaxGroup) lred[warp * kMaxGroup + 4 * u + t] = x;
    }
    __syncthreads();
    float of = kPUnshift;   /* O = sum P V * 2^11 * (NVFP4: 2^-7, FP8: 1 / v_scale) */
    if (FMT == kNVFP4) of *= 128.0f;
    if (FMT == kFP8 && P.fp8_scales) of *= P.fp8_scales[lh * 2 + 1];
#pragma unroll
    for (int u = 0; u < NP; u++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * u + 2 * t + e;
            if (h >= G) continue;
            float l = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; w++) l += lred[w * kMaxGroup + h];
            const float inv = l > 0.0f ? of / l : 0.0f;
            float *dst = P.o_part + (slot * G + h) * D;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                dst[out_dim<FMT>(warp, i, g)] = o[i][u][e] * inv;
                dst[out_dim<FMT>(warp, i, g + 8)] = o[i][u][2 + e] * inv;
            }
            if (warp == 0 && g == 0)
                P.lse_part[slot * G + h] = l > 0.0f ? mp[u][e] + log2f(l) - P.log2c : kNegInf;
        }
}

/* ---- the BF16 tokens: sink, recent slot, the step's own token ---- */

/* Byte offset of 16-byte chunk c of row r in a swizzled [rows][D] BF16 tile. */
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
    const int nb = fp4_end ? nsink + (n - fp4_end) : n;   /* <= 144 */
    const int ntiles = (nb + 15) / 16;
    const size_t sh = (size_t)seq * kvh + head, slot = sh * (P.n_splits + 1) + P.n_splits;
    const size_t lh = (size_t)P.kv.layer * kvh + head;
    /* The keys, then the values in their place (the shared memory of one
     * 144-row tile, so that this CTA takes no more than a page-walking one) */
    uint8_t *ks = smem, *vs = smem;

    /* rows: token of row r, from the sink slot, recent slot or staging */
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
    load_rows(false);

    uint2 qf[NQ][KS];
    const uint2 *qsrc = reinterpret_cast<const uint2 *>(P.qfrag_bf) + sh * P.nq * KS * 32;
#pragma unroll
    for (int u = 0; u < NQ; u++)
#pragma unroll
        for (int i = 0; i < KS; i++) qf[u][i] = qsrc[(u * KS + i) * 32 + lane];
    cp_async_wait_all();
    __syncthreads();

    /* scores: warp w takes key tiles w, w + 4, w + 8 */
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
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 16));
        if (g == 0 && 4 * u + t < kMaxGroup) maxbuf[warp * kMaxGroup + 4 * u + t] = x;
    }
    __syncthreads();   /* maxima visible; K no longer read: its space takes V */
    load_rows(true);

    /* one tile, unquantized: P = 2^(S - M), as BF16 hi + lo columns */
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
    cp_async_wait_all();
    __syncthreads();

    /* O^T for dims 32w .. 32w + 31 over all rows */
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
            float lt = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; w++) lt += lred[w * kMaxGroup + h];
            const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
            float *dst = P.o_part + (slot * G + h) * D;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int d0 = 32 * warp + 16 * i + g;
                dst[d0] = (o[i][u][0] + o[i][u][1]) * inv;
                dst[d0 + 8] = (o[i][u][2] + o[i][u][3]) * inv;
            }
            if (warp == 0 && g == 0) P.lse_part[slot * G + h] = lt > 0.0f ? M[u] + log2f(lt) : kNegInf;
        }
    }
}

/* Grid (n_splits + 1, n_kv_heads, n_seqs): x = 0 is the BF16 split (slot
 * n_splits of the partials), x = 1 + i the quantized split i. */
template <int FMT, bool EXACT, int NQ, int D>
__global__ void __launch_bounds__(kThreads, NQ == 1 ? 5 : 2) split_kernel(Params P)
{
    extern __shared__ __align__(128) uint8_t smem[];
    const int head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = P.seqs[seq];
    if (s.n_new != 1) return;
    if (blockIdx.x == 0) {
        using Sm = Smem<FMT, (NQ > 2 ? 2 : 1), D>;
        if (FMT != kFP8 && P.sink_recent)
            bf16_split<NQ, D>(P, smem, seq, head, s, reinterpret_cast<float *>(smem + Sm::maxbuf),
                              reinterpret_cast<float *>(smem + Sm::lred));
        else
            write_empty(P, ((size_t)seq * P.kv.n_kv_heads + head) * (P.n_splits + 1) + P.n_splits);
        return;
    }
    fp4_split<FMT, EXACT, NQ, D>(P, smem, seq, head, blockIdx.x - 1, s);
}

/* ======================= combine ======================= */

/* Grid (n_heads, n_seqs): o = sum_i 2^(lse_i - L) o_i / sum_i 2^(lse_i - L)
 * over the n_splits + 1 partials, as BF16. */
template <int D> __global__ void __launch_bounds__(kThreads) combine_kernel(Params P)
{
    __shared__ float w[1024];
    __shared__ float red[kWarps];
    const int h = blockIdx.x, seq = blockIdx.y;
    const fr_paged_seq s = P.seqs[seq];
    if (s.n_new != 1) return;
    const int G = P.group, kh = h / G, gi = h % G, slots = P.n_splits + 1;
    const size_t row0 = ((size_t)seq * P.kv.n_kv_heads + kh) * slots * G + gi;
    float mx = kNegInf;
    for (int i = threadIdx.x; i < slots; i += kThreads) mx = fmaxf(mx, P.lse_part[row0 + (size_t)i * G]);
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    float sum = 0.0f;
    for (int i = threadIdx.x; i < slots; i += kThreads) {
        const float l = P.lse_part[row0 + (size_t)i * G];
        const float e = (mx == kNegInf || l == kNegInf) ? 0.0f : exp2f(l - mx);
        w[i] = e;
        sum += e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    sum = red[0] + red[1] + red[2] + red[3];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    uint16_t *dst = P.out + ((size_t)s.q_row * P.n_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += kThreads) {
        float acc = 0.0f;
        for (int i = 0; i < slots; i++) {
            const float wi = w[i];
            if (wi != 0.0f) acc += wi * P.o_part[(row0 + (size_t)i * G) * D + d];
        }
        dst[d] = fr_dev_bf16_encode(acc * inv);
    }
}

#undef FR_K

} // namespace fr_fp4

#endif
