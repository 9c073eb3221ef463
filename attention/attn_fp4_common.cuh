/* What the FP4/FP8 decode kernels share (attention/attn_fp4.h, docs/attention_gpu.md
 * "FP4 and FP8 KV: decode"): constants, the page geometry, the parameter
 * block and small helpers. Included by the kernel headers of attn_fp4_cuda.cu
 * only. */
#ifndef FR_ATTN_FP4_COMMON_CUH
#define FR_ATTN_FP4_COMMON_CUH

#include <stdint.h>

#include "attn_fp4_ptx.cuh"
#include "fp4_device.cuh"
#include "paged_kv.h"

namespace fr_fp4 {

using namespace fr_fp4_ptx;

#ifndef FR_K
#define FR_K __device__ __forceinline__
#endif

/* A page is also Algorithm 1's tile (fr_attn_params.tile must be 128, attn_fp4_cuda.cu
 * checks it), so exact mode's P block scales are taken against the running maximum as
 * it stands after each whole page, as in the CPU reference. Split CTAs run four
 * warps: a warp owns 32 tokens of a page in the FP4 split and 32 dims of the output
 * in the FP8 split and the BF16 CTA (4 x 32 = 128 either way). kMaxGroup bounds the
 * query heads per KV head: two m-tiles of 8 heads in the FP4 split, four n-tiles of 4
 * heads (two columns each) in the FP8 split and the BF16 CTA. The preparation kernel
 * runs 16 warps so that at G = 16 every head has a warp; smaller groups give each
 * head several warps (prep_query). */
constexpr int kPage = 128;          /* tokens per page = online-softmax tile */
constexpr int kWarps = 4, kThreads = 128;
constexpr int kMaxGroup = 16;
constexpr int kSink = 16;
constexpr int kMaxBf16Rows = 144;   /* sink 16 + recent 127 + step 1, in 16-row tiles */
constexpr int kPrepThreads = 512;   /* 16 warps: up to G = 16 heads, several warps a head below */
constexpr float kNegInf = -__builtin_huge_valf();
/* P enters the P.V MMA as FP16 times 2^11, undone in FP32 on the output. The host
 * sets c = 1 unless P is quantized, and P is then at most 1. Quantized, P = E2M1(cp /
 * s) s <= 6 s with cp <= c (the block maximum is at most the running one): s is at
 * most c pmax / 4 (MXFP4's power of two; NVFP4's E4M3(c pmax / 6) is smaller; the
 * underflow-aware c pmax / 2 applies only below tau, where P stays below 3 tau), so P
 * <= 1.5 c = 12 at the default c = 8, and 12 x 2^11 < 65504. The shift keeps an
 * unquantized P at FP16's full 11 bits down to 2^-25 of the running maximum (2^-14 /
 * 2^11) instead of losing precision below 2^-14. A c above about 21 would overflow
 * FP16 here; the host only checks that c is positive, and only c = 8 (the
 * underflow-aware default) and c = 1 (the plain rule) are ever configured. */
constexpr float kPShift = 2048.0f;
constexpr float kPUnshift = 1.0f / 2048.0f;

/* The cache format, a template parameter of every kernel: the page geometry, the
 * unpacking and the P block (16 tokens NVFP4, 32 MXFP4) follow from it. */
enum { kNVFP4 = 0, kMXFP4 = 1, kFP8 = 2 };

/* Byte layout of one head page (kvcache/page_layout.h; check_view in attn_fp4_cuda.cu
 * refuses a view whose offsets differ). FP4: K codes [128][D/8] code words along the
 * dims (offset 0), K scales [128][D/B], V codes [D][128/8] code words along the
 * tokens, V scales [D][128/B]; the values run along tokens because their block axis
 * is the reduction axis of P.V. FP8: K [128][D] then V [128][D] E4M3, no scales
 * (per-head scales in Params). */
template <int FMT, int D> struct Geom {
    static constexpr int B = FMT == kMXFP4 ? 32 : 16;
    static constexpr int k_scales = FMT == kFP8 ? 0 : kPage * D / 2;
    static constexpr int v_codes = FMT == kFP8 ? kPage * D : k_scales + kPage * D / B;
    static constexpr int v_scales = FMT == kFP8 ? 0 : v_codes + D * kPage / 2;
    static constexpr int page_bytes = FMT == kFP8 ? 2 * kPage * D : v_scales + D * kPage / B;
    /* A page is two halves, keys (codes and scales) then values. The FP8 split loads
     * them on their own barriers into rings of two (Smem8 in attn_fp4_split_fp8.cuh),
     * keys two pages ahead of use and values one; the FP4 split loads whole pages
     * (SmemTok). */
    static constexpr int k_half = v_codes, v_half = page_bytes - v_codes;
};

/* Everything the kernels read; plain data, passed by value. */
struct Params {
    /* kv: the layer's cache view; seqs: lengths and block tables in device memory (a
     * captured graph replays with new ones); fp8_scales: the per-head K and V scales,
     * folded into qscale (K) and the output factor (V). */
    fr_paged_kv kv;
    const fr_paged_seq *seqs;
    const float *q;            /* [rows][n_heads][D] */
    uint16_t *out;             /* [rows][n_heads][D] BF16 */
    const float *fp8_scales;   /* [layers][kv_heads][2] or NULL */
    /* group: G = n_heads / n_kv_heads; n_splits: the quantized splits (slot n_splits
     * of the partials is the BF16 CTA's); nq: QK^T n-tiles of the FP8 split and the
     * BF16 CTA, ceil(2G / 8) with 3 rounded up to 4 (two columns per head: its two
     * query terms). */
    int n_heads, group, n_splits, nq;
    int sink_recent, rotate;
    /* The numerics switches of fr_attn_params: the query's FP4 terms (dual, single,
     * or unquantized = FP16 hi + lo), their scale search, P quantization (exact mode)
     * and its rule; c and log2c: the factor folded into exp2 (1 when P is not
     * quantized); tau: the underflow-aware threshold; gamma = log2(e) / sqrt(D), the
     * base-2 logit scale. */
    int q_mode, q_search, quantize_p, underflow_aware;
    float c, log2c, tau, gamma;
    /* workspace */
    uint32_t *qfrag;           /* FP4: [seq][kvh][mt][D/16][32][4] A fragments; FP8: [seq][kvh][nq][D/16][32][2]
                                  B fragments; FP16x2 in the FP4/FP8 dim order (qk_dim_slot) */
    int qwords;                /* u32 of qfrag per (seq, kvh) */
    uint32_t *qfrag_bf;        /* [seq][kvh][nq][D/16][32][2] BF16x2 hi/lo, natural order */
    float *qscale;             /* [seq][kvh][16]: S = (hi + lo column sum) * qscale */
    uint8_t *otf;              /* [seq][kvh][page_bytes]: the partial page, quantized */
    float *o_part;             /* [seq][kvh][n_splits + 1][G][D] */
    float *lse_part;           /* [seq][kvh][n_splits + 1][G] */
};

/* ======================= small helpers ======================= */

/* Both halves of an FP16x2 set to its low (high) half: a pair of block scales becomes
 * one multiplier for the two elements HMUL2 scales at a time. */
FR_K uint32_t bcast_lo(uint32_t x) { return __byte_perm(x, 0, 0x1010); }
FR_K uint32_t bcast_hi(uint32_t x) { return __byte_perm(x, 0, 0x3232); }


/* One page code word to four FP16x2 registers of value * 2^-14:
 * r0 = elements (0, 4), r1 = (2, 6), r2 = (1, 5), r3 = (3, 7). */
FR_K void unpack_e2m1(uint32_t w, uint32_t (&r)[4]) { fr_dev_fp4_word_to_f16x2(w, r); }

/* FP16 bits of 2^d for d <= 15 (subnormal below -14, 0 below -24). The MXFP4 keys'
 * scales relative to the key's largest block, 2^(e_block - e_max + 14): the + 14
 * cancels the code words' 2^-14. */
FR_K uint32_t f16_pow2(int d)
{
    if (d >= -14) return (uint32_t)(d + 15) << 10;
    return d >= -24 ? 1u << (d + 24) : 0u;
}

/* The largest of the four bytes of w: the largest E8M0 scale code of an MXFP4 key,
 * whose 128 dims are four blocks (one 32-bit load). */
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

/* 2^e from the exponent bits, exact for e in [-126, 127] only (0 below): callers
 * clamp their exponents into that range. */
FR_K float pow2f(int e) { return fr_dev_exp2i(e); }

/* Split `split` of a sequence's quantized tokens (fr_ref_split_range, so the partials
 * can be compared with the CPU reference split by split): pages [pa, pb) of the
 * tile-aligned region, keys of tokens [x1, t1) (below x1: the sink's quantized copy,
 * masked). With sink/recent the quantized region ends at the last full page (the
 * partial page is the BF16 CTA's); without it, it runs to the step's token, whose
 * partial page the preparation kernel quantized. The pages are dealt evenly, so a
 * short sequence leaves some splits empty. */
struct SplitRange {
    int pa, pb, x1, t1;
};

FR_K SplitRange split_range(const Params &P, const fr_paged_seq &s, int split)
{
    const int n = s.len + 1;
    const int q_end = P.sink_recent ? s.len / kPage * kPage : n;
    const int tiles = (q_end + kPage - 1) / kPage;
    SplitRange r;
    r.pa = (int)((long)tiles * split / P.n_splits);
    r.pb = (int)((long)tiles * (split + 1) / P.n_splits);
    r.x1 = P.sink_recent ? (n < kSink ? n : kSink) : 0;
    r.t1 = r.pb * kPage < q_end ? r.pb * kPage : q_end;
    return r;
}

/* An empty partial: zero output and LSE -inf, which the combine weighs 0. Every slot
 * is written every step, so the combine never reads a previous step's bytes. */
FR_K void write_empty(const Params &P, size_t slot)
{
    const int G = P.group, D = P.kv.head_dim;
    for (int k = threadIdx.x; k < G * D; k += kThreads) P.o_part[slot * G * D + k] = 0.0f;
    for (int k = threadIdx.x; k < G; k += kThreads) P.lse_part[slot * G + k] = kNegInf;
}

/* The four warps' shares of head h (a [warps][kMaxGroup] array), added in
 * warp order. */
FR_K float warp_sum(const float *part, int h)
{
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) x += part[w * kMaxGroup + h];
    return x;
}

/* A split's partial for head h: its normalized output row, and its base-2 log-sum-exp
 * m + log2 l - shift (-inf when no key had weight, so the combine gives the row no
 * weight). shift is log2 c where c was folded into the exponentials (l then sums c
 * 2^(S - m)), 0 in the BF16 CTA. */
template <int D> FR_K float *partial_row(const Params &P, size_t slot, int h)
{
    return P.o_part + (slot * P.group + h) * D;
}
FR_K void store_lse(const Params &P, size_t slot, int h, float m, float l, float shift)
{
    P.lse_part[slot * P.group + h] = l > 0.0f ? m + log2f(l) - shift : kNegInf;
}

/* What a quantized split CTA (FP4 or FP8) works from: its pages and where
 * its partial goes. The two split bodies differ in their math, not in this. */
struct SplitCtx {
    SplitRange r;
    size_t sh;         /* (sequence, KV head): the query fragments' and the on-the-fly page's index */
    size_t slot;       /* the partial's index in o_part / lse_part */
    size_t lh;         /* (layer, KV head): the head page inside a block */
    int npages;        /* pages [r.pa, r.pb) */
    int full_pages;    /* pages of the pool; a page past them is the on-the-fly page */
};

/* Opens split `split` of (seq, head); false when it holds no page (its
 * partial is then written empty, so the combine can read every slot). */
FR_K bool split_open(const Params &P, const fr_paged_seq &s, int seq, int head, int split, SplitCtx &c)
{
    const int kvh = P.kv.n_kv_heads;
    c.r = split_range(P, s, split);
    c.sh = (size_t)seq * kvh + head;
    c.slot = c.sh * (P.n_splits + 1) + split;
    c.lh = (size_t)P.kv.layer * kvh + head;
    c.npages = c.r.pb - c.r.pa;
    c.full_pages = s.len / kPage;
    if (c.npages > 0) return true;
    write_empty(P, c.slot);
    return false;
}

/* Page k of the split: a block of the pool, or (past the full pages, only
 * without sink/recent) the partial page the preparation kernel quantized. */
template <int PAGE_BYTES>
FR_K const uint8_t *split_page(const Params &P, const fr_paged_seq &s, const SplitCtx &c, int k)
{
    const int p = c.r.pa + k;
    return p < c.full_pages ? P.kv.pool + (size_t)s.block_table[p] * P.kv.block_bytes + c.lh * P.kv.head_page_bytes
                            : P.otf + c.sh * PAGE_BYTES;
}

/* The first `ahead` pages of the split, issued by thread 0 around the wait
 * for the query preparation (programmatic dependent launch): the pool's
 * pages were written before that kernel started, so they load while it
 * runs; the on-the-fly page is its output, so it waits. Every thread
 * passes the wait, so everything after it may read the query fragments. */
template <typename Issue> FR_K void split_prologue(const SplitCtx &c, int ahead, Issue issue)
{
    if (threadIdx.x == 0)
        for (int k = 0; k < ahead && k < c.npages; k++)
            if (c.r.pa + k < c.full_pages) issue(k);
    griddep_wait();
    if (threadIdx.x == 0)
        for (int k = 0; k < ahead && k < c.npages; k++)
            if (c.r.pa + k >= c.full_pages) issue(k);
}

/* P quantization of one block against the running maximum (Algorithm 1 lines 12-14,
 * fr_pquant_scale): the real scale s, 0 when the block is empty or underflows. bmax
 * is the block's largest logit and m_new the running maximum including this page, so
 * pmax <= 1. MXFP4: the OCP power of two of c pmax (E8M0 reaches 2^-127, nothing
 * underflows). NVFP4: E4M3(c pmax / kappa), kappa 2 when c pmax <= tau
 * (underflow-aware) and 6 otherwise, each step an IEEE operation in the reference's
 * order. */
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
    return e4m3_round(q);
}



} // namespace fr_fp4

#endif
