/* The latent attention kernels (attn_mla.h is the contract; docs/mla.md the
 * numerics). Included by attn_mla_cuda.cu only.
 *
 * A CTA of 8 warps owns 64 query rows of one sequence and one split of its tokens,
 * walked in tiles of 32 tokens:
 *  - the tile's latent rows are brought to shared memory as BF16 [32][d_c + d_r]
 *    (BF16 pages by cp.async straight into a double buffer; FP4/FP8 pages by cp.async
 *    of their raw bytes, then dequantized, exact in BF16; unpaged tokens read and,
 *    without sink/recent, quantized on the fly);
 *  - warp (rt, hf) holds rows 16 rt .. 16 rt + 15. S = Q K^T is split over channels
 *    between the two warps of a row tile (hf 0 the first half of the k-steps, hf 1
 *    the second), their partials added through shared memory in one order, so both
 *    hold the same scores and run the same online softmax; P stays in registers as
 *    the A operand of O += P V, where warp hf owns the channels [hf d_c / 2, (hf + 1)
 *    d_c / 2) of O.
 * The same tile is K for the scores and V for the context (no V half).
 *
 * A CTA is large: 64 rows share every tile it loads and dequantizes, and the query
 * operands of all 64 rows sit in shared memory for the whole split (QA up to 73 KiB
 * at d_c 512). That makes 162 to 217 KiB of shared memory and one CTA per SM
 * (docs/attention_gpu.md, "Latent (MLA) attention"), so the host plans splits in
 * waves of one CTA per multiprocessor. What limits it today is the operand traffic of
 * mma.sync (each warp ldmatrix-loads its own Q and K fragments from shared memory),
 * not DRAM (bench/RESULTS.md, "Latent (MLA) attention on one H200").
 *
 * Splits: the paged tokens are cut into page-aligned splits (blockIdx.x); the last
 * split also takes the unpaged tokens (sink, recent slot, the step's rows). With one
 * split the CTA finishes its rows itself; with more, each writes a normalized partial
 * and a base-2 LSE and mla_combine joins them. */
#ifndef FR_ATTN_MLA_KERNELS_CUH
#define FR_ATTN_MLA_KERNELS_CUH

#include <climits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attn_fp4_ptx.cuh"
#include "attn_mla.h"
#include "fp4_device.cuh"

namespace fr_mla {

using namespace fr_fp4_ptx;

#define FR_MK __device__ __forceinline__

/* 64 query rows (4 row tiles of 16, two warps each), tiles of 32 tokens (a page is 4
 * tiles, each one k-step pair of the context product), 8 warps. */
constexpr int kRows = 64, kTile = 32, kThreads = 256, kSink = 16, kPage = 128;
enum Kind { kBF16 = 0, kFP8, kNV, kMX };

/* Shared memory of a latent CTA (byte offsets), for d_c = DC, d_r = DR:
 * - QA [64][D + 8] BF16: the rows' query operands, content then RoPE (the FP4 first
 *   term, or the query rounded to BF16);
 * - QB [64][DC + 8] BF16, FP4 only: the dual query's second term;
 * - KT: the tile as BF16 [32][D + 8]; two for BF16 caches (cp.async lands the next
 *   tile in the other one), one otherwise (the next tile lands raw in ST and is
 *   dequantized into KT);
 * - ST: two raw staging buffers of one paged tile as the page holds it (codes,
 *   scales, RoPE), non-BF16 only;
 * - SX [2][64][32] floats: the two channel halves' partial scores;
 * - TOK [32] ints: the positions of an unpaged tile's slots, for its masks.
 * The pitches add 16 bytes to every row, so the 8 rows an ldmatrix matrix reads fall
 * on 8 different 16-byte bank groups (2D, 2 DC are multiples of 128 bytes). After the
 * last tile the whole buffer becomes FIN, the rows' float outputs. At DC 512: 162 KiB
 * (BF16) to 217 KiB (NVFP4). */
template <int DC, int DR, int KIND> struct Geo {
    static constexpr int D = DC + DR;
    static constexpr bool FP4 = KIND == kNV || KIND == kMX;
    static constexpr int B = KIND == kMX ? 32 : 16;
    static constexpr int QP = D + 8, BP = DC + 8, KP = D + 8;   /* pitches in halves: 16 B rotate the banks */
    static constexpr int CODE_B = FP4 ? kTile * DC / 2 : KIND == kFP8 ? kTile * DC : kTile * DC * 2;
    static constexpr int SCALE_B = FP4 ? kTile * DC / B : 0;
    static constexpr int ROPE_B = kTile * DR * 2;
    static constexpr int RAW = CODE_B + SCALE_B + ROPE_B;       /* one paged tile as the page holds it */
    static constexpr int QA_OFF = 0, QA_BYTES = kRows * QP * 2;
    static constexpr int QB_OFF = QA_BYTES, QB_BYTES = FP4 ? kRows * BP * 2 : 0;
    static constexpr int KT_OFF = QB_OFF + QB_BYTES, KT_BYTES = kTile * KP * 2, KT_N = KIND == kBF16 ? 2 : 1;
    static constexpr int ST_OFF = KT_OFF + KT_N * KT_BYTES, ST_N = KIND == kBF16 ? 0 : 2;
    static constexpr int SX_OFF = ST_OFF + ST_N * RAW, SX_BYTES = 2 * kRows * kTile * 4;
    static constexpr int TOK_OFF = SX_OFF + SX_BYTES;
    static constexpr int MAIN = TOK_OFF + kTile * 4;
    static constexpr int FIN = kRows * DC * 4;                  /* the rows' outputs, float, for the last step */
    static constexpr int SMEM = MAIN > FIN ? MAIN : FIN;
    static_assert(DC % 64 == 0 && DR % 32 == 0 && (D / 16) % 2 == 0, "latent shape");
    static_assert(RAW % 16 == 0 && (QP * 2) % 16 == 0, "16-byte rows");
    static_assert(SMEM <= 227 * 1024, "one CTA's shared memory fits a Hopper SM's opt-in");
};

/* Where element (row, channel) of a BF16 operand tile lives in shared memory, in
 * halves from the tile's base: rows of PITCH halves, as the mma.sync kernel's ldmatrix
 * loads want them (Geo's pitches). The loaders below take the layout as a template
 * argument so that another MMA path (attention/dev/) can lay the same tiles out its
 * way. */
template <int PITCH> struct Pitched {
    static FR_MK int at(int row, int ch) { return row * PITCH + ch; }
};

/* What the kernels read, by value. o_part / lse_part: the split partials
 * [seq][row][split] (with n_splits > 1); mean: the latent mean to add back (FP4
 * smoothing only, else NULL); scale_log2: the softmax scale times log2(e); fp8_scale:
 * the layer's latent scale (1 unless FP8); q_mode, q_search, q_bf16: the content
 * query's form on FP4 pages. */
struct Params {
    fr_latent_kv kv;
    const fr_paged_seq *seqs;
    const float *q;
    uint16_t *out;
    float *o_part, *lse_part;   /* split partials (n_splits > 1) */
    const float *mean;
    int n_heads, n_splits, row_groups;
    float scale_log2, fp8_scale;
    int rotate, sink_recent, q_mode, q_search, q_bf16;
};

/* The checks, plan and parameter block of one fr_attn_mla call (attn_mla_cuda.cu),
 * and the dtype's Kind; fr_attn_mla launches mla_kernel with them, and the
 * experimental kernels of attention/dev/ use the same ones. */
fr_status call_params(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs_dev,
                      int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, void *workspace,
                      size_t workspace_bytes, Params *out_params, int *kind);

/* The query rows' facts every thread needs: token index in the step and the last
 * visible token (-1: no such row). Row r of row group `group` is flattened row group
 * * 64 + r: head g % H of the chunk's token g / H, so a group holds all heads of a
 * token before the next token's (128 heads make two groups per token). A row past the
 * chunk's tokens is padding: every token is masked for it and it is never written. */
FR_MK int row_limit(const Params &P, const fr_paged_seq &s, int group, int r)
{
    const int g = group * kRows + r, i = g / P.n_heads;
    return i < s.n_new ? s.len + i : -1;
}

FR_MK uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The two warps of row tile rt (warps rt and rt + 4) meet; barrier 0 is
 * __syncthreads'. A named barrier (ids 1-4, 64 threads) lets a row tile exchange its
 * score halves without holding up the other row tiles. */
FR_MK void pair_barrier(int rt) { asm volatile("bar.sync %0, 64;\n" ::"r"(rt + 1) : "memory"); }

/* Whether the FP4 query terms (rather than the query rounded to BF16) meet
 * FP4 tokens: exact compute. */
FR_MK bool fp4_terms(const Params &P) { return P.q_mode != FR_Q_UNQUANTIZED && !P.q_bf16; }

/* The Hadamard of a latent striped over a warp (E registers a lane). The rotation
 * exists for power-of-two widths only (the caches refuse it for others, and so does
 * attn_mla_cuda.cu's check), so the other widths' instances leave it out. */
template <int E> FR_MK void rotate_striped(bool rotate, float (&x)[E])
{
    if constexpr ((E & (E - 1)) == 0) {
        if (rotate) fr_dev_hadamard_warp<E>(x, 32 * E);
    }
}

/* The 64 rows' query operands in shared memory: QA [64][d_c + d_r] and, dual, QB
 * [64][d_c]. terms: the FP4 terms of the rotated content query (else the query
 * rounded to BF16; FP8 folds its scale in here). Warp w takes rows 8 w .. 8 w + 7.
 *
 * A row is striped over the warp (element j in lane j % 32), the layout of the
 * Hadamard and of fp4_device.cuh's warp quantizer: a register of 32 channels holds
 * whole FP4 blocks (16 or 32), so each block is quantized across lanes, bit for bit
 * as the CPU's fr_fp4_quantize_dual does. The terms are E2M1 times their block scale,
 * exact in BF16 (at most 6 significant bits); the RoPE part is always the query
 * rounded to BF16. Padding rows (past the chunk's tokens) are zeros. */
template <int DC, int DR, int KIND, class QL = Pitched<Geo<DC, DR, KIND>::QP>,
          class BL = Pitched<Geo<DC, DR, KIND>::BP>>
__device__ void prep_queries(const Params &P, const fr_paged_seq &s, int group, bool terms, uint16_t *QA,
                             uint16_t *QB)
{
    using G = Geo<DC, DR, KIND>;
    constexpr int E = DC / 32, ER = DR / 32;
    constexpr fr_fp4_format FF = KIND == kMX ? FR_MXFP4 : FR_NVFP4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int rr = 0; rr < kRows / 8; rr++) {
        const int r = warp * (kRows / 8) + rr;
        const int g = group * kRows + r, i = g / P.n_heads, h = g % P.n_heads;
        float xc[E], xr[ER];
        const bool valid = i < s.n_new;
        const float *qp = P.q + ((size_t)(s.q_row + (valid ? i : 0)) * P.n_heads + h) * G::D;
#pragma unroll
        for (int e = 0; e < E; e++) xc[e] = valid ? qp[32 * e + lane] : 0.0f;
#pragma unroll
        for (int e = 0; e < ER; e++) xr[e] = valid ? qp[DC + 32 * e + lane] : 0.0f;
        rotate_striped<E>(P.rotate, xc);
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = 32 * e + lane;
            if (G::FP4 && terms) {
                uint8_t code, sc;
                const float t1 = fr_dev_fp4_fake_quant_warp<FF>(xc[e], P.q_search, code, sc);
                QA[QL::at(r, j)] = fr_dev_bf16_encode(t1);   /* exact: E2M1 times its block scale */
                if (P.q_mode == FR_Q_DUAL) {
                    const float res = __fsub_rn(fr_dev_isnan(xc[e]) ? 0.0f : xc[e], t1);
                    QB[BL::at(r, j)] = fr_dev_bf16_encode(fr_dev_fp4_fake_quant_warp<FF>(res, P.q_search, code, sc));
                }
            } else {
                QA[QL::at(r, j)] = fr_dev_bf16_encode(KIND == kFP8 ? __fmul_rn(xc[e], P.fp8_scale) : xc[e]);
            }
        }
#pragma unroll
        for (int e = 0; e < ER; e++) QA[QL::at(r, DC + 32 * e + lane)] = fr_dev_bf16_encode(xr[e]);
    }
}

/* Where page tile pt (32 tokens) of sequence s lies. */
FR_MK const uint8_t *page_of(const Params &P, const fr_paged_seq &s, int pt)
{
    return P.kv.pool + (size_t)s.block_table[pt / (kPage / kTile)] * P.kv.block_bytes +
           (size_t)P.kv.layer * P.kv.page_bytes;
}

/* Starts the copy of paged tile pt: BF16 rows straight into the K tile, other dtypes'
 * raw bytes (codes | scales | RoPE) into a staging buffer. Sub-tile sub of a page is
 * 32 consecutive tokens, so each of its parts is one contiguous run of the page (the
 * codes and scales are per token). Every thread commits one group, so
 * cp_async_wait_all in the tile loop covers exactly this copy. */
template <int DC, int DR, int KIND, class TL = Pitched<Geo<DC, DR, KIND>::KP>>
FR_MK void issue_paged(const Params &P, const fr_paged_seq &s, int pt, uint16_t *kt, uint8_t *st)
{
    using G = Geo<DC, DR, KIND>;
    const uint8_t *page = page_of(P, s, pt);
    const int sub = pt % (kPage / kTile);
    if (KIND == kBF16) {
        /* A BF16 page holds the latents [128][d_c] and the RoPE rows [128][d_r]
         * apart; a tile row joins them: chunks j < d_c / 8 from the latent region,
         * the rest from the RoPE region. */
        constexpr int CH = G::D / 8;   /* 16-byte chunks per row */
        for (int c = threadIdx.x; c < kTile * CH; c += kThreads) {
            const int tok = c / CH, j = c % CH, t = sub * kTile + tok;
            const uint8_t *src = j < DC / 8 ? page + P.kv.codes + ((size_t)t * DC + 8 * j) * 2
                                            : page + P.kv.rope + ((size_t)t * DR + 8 * (j - DC / 8)) * 2;
            cp_async16(kt + TL::at(tok, 8 * j), src, 16);
        }
    } else {
        for (int c = threadIdx.x; c < G::RAW / 16; c += kThreads) {
            const int b = 16 * c;
            const uint8_t *src = b < G::CODE_B ? page + P.kv.codes + (size_t)sub * G::CODE_B + b
                                 : b < G::CODE_B + G::SCALE_B
                                     ? page + P.kv.scales + (size_t)sub * G::SCALE_B + (b - G::CODE_B)
                                     : page + P.kv.rope + (size_t)sub * G::ROPE_B + (b - G::CODE_B - G::SCALE_B);
            cp_async16(st + b, src, 16);
        }
    }
    cp_async_commit();
}

/* Code of element e (0..7) of a page code word (fr_dev_fp4_word_place's inverse). No
 * kernel here calls it: dequant_tile unpacks whole words with
 * fr_dev_fp4_word_to_f16x2. */
template <int e> FR_MK uint32_t word_code(uint32_t w)
{
    constexpr int h = 16 * (e >> 2), sl = e & 3;
    constexpr int sign_bit = sl == 0 ? 15 : sl == 1 ? 14 : sl == 2 ? 12 : 13;
    constexpr int mag_bit = sl == 0 ? 9 : sl == 1 ? 0 : sl == 2 ? 6 : 3;
    return (((w >> (h + sign_bit)) & 1u) << 3) | ((w >> (h + mag_bit)) & 7u);
}

/* A staged FP4/FP8 tile into the BF16 K tile: every value exact in BF16 (E2M1 times
 * an E4M3 or power-of-two scale; E4M3 values, the layer scale being folded into the
 * query and the output). One item is one code word (8 channels of a token, one block)
 * and one 16-byte store. Dequantizing through FP16 pairs (the decode kernels'
 * 9-instruction bit placement) took NVFP4 at 128K batch 64 from 26.7 to 22.3 ms
 * (bench/RESULTS.md, "Latent (MLA) attention on one H200", the attempts). The FP16
 * value * 2^-14 widened to float and multiplied by scale * 2^14 is exact while scale
 * * 2^14 stays finite, i.e. for MXFP4 scales below 2^114, far above any latent's. */
template <int DC, int DR, int KIND, class TL = Pitched<Geo<DC, DR, KIND>::KP>>
FR_MK void dequant_tile(const uint8_t *st, uint16_t *kt)
{
    using G = Geo<DC, DR, KIND>;
    if (G::FP4) {
        constexpr fr_fp4_format FF = KIND == kMX ? FR_MXFP4 : FR_NVFP4;
        constexpr int WPR = DC / 8;   /* code words per row */
        const uint32_t *words = reinterpret_cast<const uint32_t *>(st);
        const uint8_t *scales = st + G::CODE_B;
        for (int k = threadIdx.x; k < kTile * WPR; k += kThreads) {
            const int tok = k / WPR, wi = k % WPR;
            /* the word's codes as FP16 value * 2^-14 (fp4_device.cuh): r0 = (e0, e4),
             * r1 = (e2, e6), r2 = (e1, e5), r3 = (e3, e7); times scale * 2^14, exact */
            uint32_t r[4];
            fr_dev_fp4_word_to_f16x2(words[k], r);
            const float sv = __fmul_rn(fr_dev_fp4_scale_value<FF>(scales[tok * (DC / G::B) + 8 * wi / G::B]), 16384.0f);
            float2 f[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                f[i] = __half22float2(*reinterpret_cast<const __half2 *>(&r[i]));
                f[i].x = __fmul_rn(f[i].x, sv);
                f[i].y = __fmul_rn(f[i].y, sv);
            }
            uint4 o;
            o.x = pack_bf16x2(f[0].x, f[2].x);
            o.y = pack_bf16x2(f[1].x, f[3].x);
            o.z = pack_bf16x2(f[0].y, f[2].y);
            o.w = pack_bf16x2(f[1].y, f[3].y);
            *reinterpret_cast<uint4 *>(kt + TL::at(tok, 8 * wi)) = o;
        }
    } else {
        constexpr int CPR = DC / 8;   /* 8-byte groups per row */
        for (int k = threadIdx.x; k < kTile * CPR; k += kThreads) {
            const int tok = k / CPR, c = k % CPR;
            const uint2 raw = *reinterpret_cast<const uint2 *>(st + tok * DC + 8 * c);
            uint4 o;
            uint32_t *ov = reinterpret_cast<uint32_t *>(&o);
#pragma unroll
            for (int p = 0; p < 4; p++) {   /* E4M3 pairs to FP16 (exact), then to BF16 (exact) */
                const uint32_t h2 = e4m3x2_to_f16x2(((p < 2 ? raw.x : raw.y) >> (16 * (p & 1))) & 0xFFFFu);
                const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&h2));
                ov[p] = pack_bf16x2(f.x, f.y);
            }
            *reinterpret_cast<uint4 *>(kt + TL::at(tok, 8 * c)) = o;
        }
    }
    /* The RoPE part is BF16 in every page format: copied into the tile row's last d_r
     * channels as it is. */
    constexpr int RC = DR / 8;
    const uint8_t *rope = st + G::CODE_B + G::SCALE_B;
    for (int k = threadIdx.x; k < kTile * RC; k += kThreads) {
        const int tok = k / RC, c = k % RC;
        *reinterpret_cast<uint4 *>(kt + TL::at(tok, DC + 8 * c)) =
            *reinterpret_cast<const uint4 *>(rope + (tok * DR + 8 * c) * 2);
    }
}

/* The unpaged tokens of s in order: the sink slot's 16 (sink/recent with full pages),
 * the recent slot's, the step's rows. Their positions rise along the list (0..15 <
 * full <= recent < len <= step rows), which lets the kernel stop at the first tile
 * past its rows' last token. Without a full page the sink tokens are still in the
 * recent slot, and without sink/recent they are read from page 0, so n_sink is 0
 * then. */
struct Unpaged {
    int n_sink, n_recent, full, count;
};

FR_MK Unpaged unpaged_of(const Params &P, const fr_paged_seq &s)
{
    Unpaged u;
    u.full = s.len / kPage * kPage;
    u.n_sink = P.sink_recent && u.full > 0 ? kSink : 0;
    u.n_recent = s.len - u.full;
    u.count = u.n_sink + u.n_recent + s.n_new;
    return u;
}

/* Unpaged tile ut into the K tile: warp w takes slots 4 w .. 4 w + 3; each slot's
 * absolute position goes to tok (INT_MAX: no token). Without sink/recent the latent
 * is quantized on the fly as a page would hold it. A latent page's blocks run along
 * the channels of one token, so a row quantizes on its own (the warp quantizer,
 * content channels only; the RoPE part stays BF16); FP8 rounds E4M3(x / scale) and
 * keeps the unscaled value, as a page would. An empty slot is a zero row at position
 * INT_MAX, masked for every query row. */
template <int DC, int DR, int KIND, class TL = Pitched<Geo<DC, DR, KIND>::KP>>
__device__ void load_unpaged(const Params &P, const fr_paged_seq &s, const Unpaged &u, int ut, uint16_t *kt,
                             int *tok)
{
    using G = Geo<DC, DR, KIND>;
    constexpr int E = G::D / 32;
    constexpr fr_fp4_format FF = KIND == kMX ? FR_MXFP4 : FR_NVFP4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t row = G::D;
    for (int k = 0; k < kTile / 8; k++) {
        const int slot = warp * (kTile / 8) + k, v = ut * kTile + slot;
        const uint16_t *src = nullptr;
        int t = INT_MAX;
        if (v < u.n_sink) {
            t = v;
            src = P.kv.sink + (size_t)s.slot * P.kv.sink_elems + (size_t)P.kv.layer * kSink * row + (size_t)v * row;
        } else if (v < u.n_sink + u.n_recent) {
            t = u.full + (v - u.n_sink);
            src = P.kv.recent + (size_t)s.slot * P.kv.slot_elems + (size_t)P.kv.layer * kPage * row +
                  (size_t)(t - u.full) * row;
        } else if (v < u.count) {
            t = s.len + (v - u.n_sink - u.n_recent);
            src = P.kv.step_rows + (size_t)(s.q_row + t - s.len) * row;
        }
        if (lane == 0) tok[slot] = t;
        const bool quant = !P.sink_recent && KIND != kBF16;
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = 32 * e + lane;
            float x = src ? fr_dev_bf16_decode(src[j]) : 0.0f;
            if (quant && 32 * e < DC) {   /* warp-uniform: DC is a multiple of 32 */
                if (G::FP4) {
                    uint8_t code, sc;
                    x = fr_dev_fp4_fake_quant_warp<FF>(x, P.q_search, code, sc);
                } else {
                    x = fr_dev_e4m3_round(__fdiv_rn(x, P.fp8_scale));
                }
            }
            kt[TL::at(slot, j)] = fr_dev_bf16_encode(x);
        }
    }
}

/* The online-softmax state and the context accumulator of one warp: O's C fragments
 * for the warp's 16 rows and d_c / 2 channels (DC / 16 n-tiles of 8: 128 floats at
 * d_c 512), and m, l for rows g (index 0) and g + 8 (index 1). */
template <int DC> struct Acc {
    static constexpr int NO = DC / 16;   /* n8 tiles of the warp's d_c / 2 channels */
    float o[NO][4];
    float m[2], l[2];
};

/* s (16 rows x 32 tokens) += the query rows at q times the tile's keys at kb over N
 * k-steps from k-step k0 (each 16 channels). A constant trip count lets the loads run
 * ahead of the MMAs. Per k-step: one ldmatrix of A (the rows' 16 channels) and two of
 * B (tokens 0-15, 16-31), four MMAs (n-tiles of 8 tokens). */
template <int N, int UNROLL, int KP>
FR_MK void score_steps(const uint16_t *q, const uint16_t *kb, int k0, float (&s)[4][4])
{
#pragma unroll UNROLL
    for (int kq = 0; kq < N; kq++) {
        const int ks = k0 + kq;
        uint32_t a[4], b[4];
        ldsm_x4(q + ks * 16, a);
#pragma unroll
        for (int tp = 0; tp < 2; tp++) {
            ldsm_x4(kb + tp * 16 * KP + ks * 16, b);
            mma_bf16(s[2 * tp], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(s[2 * tp + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
    }
}

/* The softmax half of a tile (tile_step's, and attention/dev/'s wgmma tile's): the
 * warp's partial scores s (16 rows x 32 tokens of its channel half) joined with its
 * partner's through SX, masked (mask(n, lim) says whether token column n is hidden
 * from a row whose last visible token is lim), the online-softmax update of acc (m,
 * l, and O rescaled) and P as the context product's A fragments, pa[kk] for the
 * tile's k-step kk of 16 tokens. */
template <int DC, typename Mask>
FR_MK void softmax_tile(const Params &P, float *sx, const int (&lim)[2], Acc<DC> &acc, Mask mask, float (&s)[4][4],
                        uint32_t (&pa)[2][4])
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rt = warp & 3, hf = warp >> 2;
    const int g = lane >> 2, tq = lane & 3;
    /* the two channel halves' partials, added in one order by both warps: each warp
     * writes its half to SX[hf], the pair barrier, then both read SX[0] + SX[1] (in
     * that order) for the same elements. Both warps thus hold bitwise the same
     * scores, maxima, P and l, with no further exchange. SX is rewritten at the next
     * tile only after the CTA barrier at its top, so no warp overwrites a half its
     * partner still reads. */
    float *mine = sx + hf * kRows * kTile;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++)
            *reinterpret_cast<float2 *>(mine + (rt * 16 + g + 8 * hr) * kTile + nt * 8 + 2 * tq) =
                make_float2(s[nt][2 * hr], s[nt][2 * hr + 1]);
    pair_barrier(rt);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int off = (rt * 16 + g + 8 * hr) * kTile + nt * 8 + 2 * tq;
            const float2 a = *reinterpret_cast<const float2 *>(sx + off);
            const float2 b = *reinterpret_cast<const float2 *>(sx + kRows * kTile + off);
            const int n = nt * 8 + 2 * tq;
            const float v0 = mask(n, lim[hr]) ? -INFINITY : __fmul_rn(__fadd_rn(a.x, b.x), P.scale_log2);
            const float v1 = mask(n + 1, lim[hr]) ? -INFINITY : __fmul_rn(__fadd_rn(a.y, b.y), P.scale_log2);
            s[nt][2 * hr] = v0;
            s[nt][2 * hr + 1] = v1;
            mx[hr] = fmaxf(mx[hr], fmaxf(v0, v1));
        }
    /* Scores are scaled and masked after the sum (scale_log2: base-2 units). The row
     * maximum is reduced over the quad, the four lanes that share a row. */
    float alpha[2], base[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xFFFFFFFFu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xFFFFFFFFu, mx[hr], 2));
        const float mn = fmaxf(acc.m[hr], mx[hr]);
        base[hr] = mn == -INFINITY ? 0.0f : mn;
        alpha[hr] = acc.m[hr] == -INFINITY ? (mn == -INFINITY ? 1.0f : 0.0f) : ex2(acc.m[hr] - mn);
        acc.m[hr] = mn;
        acc.l[hr] *= alpha[hr];
    }
    /* alpha rescales O and l by 2^(m_old - m_new); a row that has seen no visible
     * token yet (m_old = -inf) gets alpha 0, or 1 when it still sees none (nothing to
     * rescale, and -inf - -inf would be NaN). base keeps the exponent finite for such
     * a row, whose scores are all -inf and give P = 0. */
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            /* the sum takes the BF16 values the product uses, so O / l normalizes
             * exactly the weights that were multiplied. P's C layout (rows g, g + 8;
             * tokens 2t, 2t + 1 of each n-tile) is the A layout of the context
             * product: n-tiles 2 kk and 2 kk + 1 are k-step kk's a0 / a1 and a2 / a3. */
            const __nv_bfloat162 p = __floats2bfloat162_rn(ex2(s[nt][2 * hr] - base[hr]),
                                                           ex2(s[nt][2 * hr + 1] - base[hr]));
            acc.l[hr] += __low2float(p) + __high2float(p);
            pa[nt >> 1][(nt & 1) * 2 + hr] = *reinterpret_cast<const uint32_t *>(&p);
        }
#pragma unroll
    for (int nt = 0; nt < Acc<DC>::NO; nt++) {
        acc.o[nt][0] *= alpha[0];
        acc.o[nt][1] *= alpha[0];
        acc.o[nt][2] *= alpha[1];
        acc.o[nt][3] *= alpha[1];
    }
}

/* One tile: scores, softmax update, context. mask(n, lim) says whether token column n
 * is hidden from a row whose last visible token is lim.
 *
 * Lane (g, t) of warp (rt, hf) holds rows 16 rt + g and + 8 (lim[0], lim[1]). Its A
 * addresses (qa) walk the rows' channels 16 at a time; its B addresses (kb) cover
 * tokens 0-7 and 8-15 of a 16-token pair with the k-step's two 8-channel halves (mi =
 * lane / 8), the ldmatrix order of b0, b1 for n-tiles 0 and 1. The warp's k-steps are
 * its half of the row (hf), content and RoPE alike; dual adds the second term's
 * products over the content channels into the same accumulators. */
template <int DC, int DR, int KIND, typename Mask>
__device__ void tile_step(const Params &P, const uint16_t *QA, const uint16_t *QB, bool dual, const uint16_t *kt,
                          float *sx, const int (&lim)[2], Acc<DC> &acc, Mask mask)
{
    using G = Geo<DC, DR, KIND>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rt = warp & 3, hf = warp >> 2;
    const int mi = lane >> 3;
    float s[4][4] = {};
    {
        constexpr int KS = G::D / 16, KC = DC / 16;
        const uint16_t *qa = QA + (rt * 16 + (lane & 15)) * G::QP + (lane >> 4) * 8;
        const uint16_t *kb = kt + ((mi >> 1) * 8 + (lane & 7)) * G::KP + (mi & 1) * 8;
        score_steps<KS / 2, 6, G::KP>(qa, kb, hf * (KS / 2), s);
        if (dual)
            score_steps<KC / 2, 4, G::KP>(QB + (rt * 16 + (lane & 15)) * G::BP + (lane >> 4) * 8, kb, hf * (KC / 2), s);
    }
    uint32_t pa[2][4];
    softmax_tile<DC>(P, sx, lim, acc, mask, s, pa);
    /* O += P V over the warp's half of the channels: V's B fragments by transposed
     * ldmatrix of the tile's [token][channel] rows (lanes 0-7 tokens 0-7, 8-15 tokens
     * 8-15 of 8 channels; 16-31 the next 8 channels), for the tile's two k-steps of
     * 16 tokens. */
    const uint16_t *vb = kt + ((mi & 1) * 8 + (lane & 7)) * G::KP + hf * (DC / 2) + (mi >> 1) * 8;
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int np = 0; np < Acc<DC>::NO / 2; np++) {
            uint32_t b[4];
            ldsm_x4_trans(vb + kk * 16 * G::KP + np * 16, b);
            mma_bf16(acc.o[2 * np], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
            mma_bf16(acc.o[2 * np + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
        }
}

/* The last step of a row held striped by one warp (element j in lane j % 32, register
 * j / 32): back from the store form, then BF16. The normalized Hadamard is its own
 * inverse, so the same warp transform rotates the context back; then the latent mean,
 * which the softmax weights (summing to 1) carry through unchanged, and FP8's layer
 * scale. The mean is set only with FP4 smoothing (rollout/model/mla_cuda.cu), so it
 * never meets the FP8 scale. */
template <int DC, int KIND>
FR_MK void finish_row(const Params &P, float (&x)[DC / 32], uint16_t *dst)
{
    constexpr int E = DC / 32;
    const int lane = threadIdx.x & 31;
    rotate_striped<E>(P.rotate, x);
#pragma unroll
    for (int e = 0; e < E; e++) {
        float v = x[e];
        if (P.mean) v += P.mean[32 * e + lane];
        if (KIND == kFP8) v *= P.fp8_scale;
        dst[32 * e + lane] = fr_dev_bf16_encode(v);
    }
}

/* Output row of row r of row group `group`: the step's row of its token, head h, d_c
 * channels. */
FR_MK uint16_t *out_row(const Params &P, const fr_paged_seq &s, int group, int r, int dc)
{
    const int g = group * kRows + r, i = g / P.n_heads, h = g % P.n_heads;
    return P.out + ((size_t)(s.q_row + i) * P.n_heads + h) * dc;
}

/* The last visible token of this lane's two rows (rows g and g + 8 of its row
 * tile), and the online softmax's empty start. */
FR_MK void lane_limits(const Params &P, const fr_paged_seq &s, int group, int (&lim)[2])
{
    const int lane = threadIdx.x & 31, rt = (threadIdx.x >> 5) & 3;
    lim[0] = row_limit(P, s, group, rt * 16 + (lane >> 2));
    lim[1] = row_limit(P, s, group, rt * 16 + (lane >> 2) + 8);
}

template <int DC> FR_MK void acc_init(Acc<DC> &acc)
{
#pragma unroll
    for (int nt = 0; nt < Acc<DC>::NO; nt++) acc.o[nt][0] = acc.o[nt][1] = acc.o[nt][2] = acc.o[nt][3] = 0.0f;
    acc.m[0] = acc.m[1] = -INFINITY;
    acc.l[0] = acc.l[1] = 0.0f;
}

/* The tiles one CTA walks: this split's pages [p0, p1) of the sequence's full
 * pages, dealt evenly (so each split's range depends on the plan and the length
 * only), as tiles [pt0, pt1); the last split adds n_ut unpaged tiles, up to the row
 * group's last visible token (the unpaged list rises in position). */
struct Walk {
    int pt0, pt1, n_ut;
};

FR_MK Walk walk_of(const Params &P, const fr_paged_seq &s, const Unpaged &u, int split, int group)
{
    int max_lim = -1;   /* the group's last visible token */
    for (int r = kRows - 1; r >= 0 && max_lim < 0; r--) max_lim = row_limit(P, s, group, r);
    const int pages = u.full / kPage, per = kPage / kTile;
    const int p0 = (int)((long)split * pages / P.n_splits), p1 = (int)((long)(split + 1) * pages / P.n_splits);
    Walk w = {p0 * per, p1 * per, 0};
    if (split == P.n_splits - 1)
        while (w.n_ut * kTile < u.count) {
            const int v = w.n_ut * kTile;
            const int t = v < u.n_sink ? v : v < u.n_sink + u.n_recent ? u.full + v - u.n_sink : s.len + v - u.n_sink - u.n_recent;
            if (t > max_lim) break;
            w.n_ut++;
        }
    return w;
}

/* The end of a CTA's walk: the rows' totals (the quad's lanes hold different
 * columns), then either the split's partial (normalized O of the warp's half of the
 * channels, LSE m + log2 l in base 2, -inf for a row with no visible token) or, with
 * one split, the final rows. smem: the CTA's shared memory, free to reuse. */
template <int DC, int KIND>
__device__ void finish_walk(const Params &P, const fr_paged_seq &s, int split, int group, Acc<DC> &acc, uint8_t *smem)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rt = warp & 3, hf = warp >> 2;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        acc.l[hr] += __shfl_xor_sync(0xFFFFFFFFu, acc.l[hr], 1);
        acc.l[hr] += __shfl_xor_sync(0xFFFFFFFFu, acc.l[hr], 2);
    }
    const int g = lane >> 2, tq = lane & 3;
    if (P.n_splits > 1) {
        const size_t rows = (size_t)P.row_groups * kRows;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = rt * 16 + g + 8 * hr;
            const size_t slot = ((size_t)blockIdx.z * rows + (size_t)group * kRows + r) * P.n_splits + split;
            const float inv = acc.l[hr] > 0.0f ? 1.0f / acc.l[hr] : 0.0f;
            float *o = P.o_part + slot * DC + hf * (DC / 2);
#pragma unroll
            for (int nt = 0; nt < Acc<DC>::NO; nt++)
                *reinterpret_cast<float2 *>(o + nt * 8 + 2 * tq) =
                    make_float2(acc.o[nt][2 * hr] * inv, acc.o[nt][2 * hr + 1] * inv);
            if (hf == 0 && tq == 0)
                P.lse_part[slot] = acc.l[hr] > 0.0f ? acc.m[hr] + log2f(acc.l[hr]) : -INFINITY;
        }
        return;
    }
    /* One split: the rows are finished here. Every warp writes its normalized half of
     * O into F ([64][d_c] floats over the tile buffers, 128 KiB at d_c 512), and
     * after the barrier warp w finishes rows 8 w .. 8 w + 7 from there, striped as
     * finish_row needs them. */
    __syncthreads();   /* the tiles' buffers become the rows' outputs */
    float *F = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int r = rt * 16 + g + 8 * hr;
        const float inv = acc.l[hr] > 0.0f ? 1.0f / acc.l[hr] : 0.0f;
#pragma unroll
        for (int nt = 0; nt < Acc<DC>::NO; nt++)
            *reinterpret_cast<float2 *>(F + r * DC + hf * (DC / 2) + nt * 8 + 2 * tq) =
                make_float2(acc.o[nt][2 * hr] * inv, acc.o[nt][2 * hr + 1] * inv);
    }
    __syncthreads();
    for (int rr = 0; rr < kRows / 8; rr++) {
        const int r = warp * (kRows / 8) + rr;
        if (row_limit(P, s, group, r) < 0) continue;   /* warp-uniform */
        float x[DC / 32];
#pragma unroll
        for (int e = 0; e < DC / 32; e++) x[e] = F[r * DC + 32 * e + lane];
        finish_row<DC, KIND>(P, x, out_row(P, s, group, r, DC));
    }
}

/* Grid (split, row group, sequence). One CTA fits an SM (its shared memory); the
 * launch bounds ask for just that, which leaves up to 255 registers a thread for the
 * 8 warps (O alone is 128 floats at d_c 512). */
template <int DC, int DR, int KIND> __global__ void __launch_bounds__(kThreads, 1) mla_kernel(Params P)
{
    using G = Geo<DC, DR, KIND>;
    extern __shared__ __align__(16) uint8_t smem[];
    uint16_t *QA = reinterpret_cast<uint16_t *>(smem + G::QA_OFF), *QB = reinterpret_cast<uint16_t *>(smem + G::QB_OFF);
    uint16_t *KT = reinterpret_cast<uint16_t *>(smem + G::KT_OFF);
    uint8_t *ST = smem + G::ST_OFF;
    float *SX = reinterpret_cast<float *>(smem + G::SX_OFF);
    int *TOK = reinterpret_cast<int *>(smem + G::TOK_OFF);

    const int split = blockIdx.x, group = blockIdx.y;
    const fr_paged_seq s = P.seqs[blockIdx.z];
    if (s.n_new <= 0 || group * kRows >= s.n_new * P.n_heads) return;
    int lim[2];
    lane_limits(P, s, group, lim);
    const Unpaged u = unpaged_of(P, s);
    const Walk wk = walk_of(P, s, u, split, group);
    const int pt0 = wk.pt0, pt1 = wk.pt1, n_ut = wk.n_ut;

    /* Which query form the tiles meet: FP4 pages meet the FP4 terms in exact compute;
     * unpaged tokens meet them only without sink/recent (quantized on the fly, as
     * pages), otherwise the query rounded to BF16. The first paged tile's copy is
     * issued before the queries are prepared, so the two overlap. */
    const bool paged_terms = G::FP4 && fp4_terms(P);
    const bool unpaged_terms = G::FP4 && fp4_terms(P) && !P.sink_recent;
    bool terms = pt1 > pt0 ? paged_terms : unpaged_terms;
    if (pt1 > pt0) issue_paged<DC, DR, KIND>(P, s, pt0, KT, ST);
    prep_queries<DC, DR, KIND>(P, s, group, terms, QA, QB);

    Acc<DC> acc;
    acc_init(acc);

    const int n_tiles = pt1 - pt0 + n_ut;
    /* The tile loop: paged tiles first, then the unpaged ones. Two barriers a tile.
     * The first (after cp_async_wait_all) makes tile it's copy visible to all and
     * ends every read of the previous tile, so the next paged tile's copy may go to
     * the other buffer (BF16: KT's other half; else ST's other half) and the single
     * KT (FP4/FP8) may be overwritten. The second makes the dequantized or loaded
     * tile, and a query switch, visible before the MMAs read them. The copy of tile
     * it + 1 runs under tile it's dequantization and MMAs. */
    for (int it = 0; it < n_tiles; it++) {
        const bool paged = it < pt1 - pt0;
        cp_async_wait_all();
        __syncthreads();   /* the tile's copy landed everywhere; the last tile's readers are done */
        const int buf = it & 1;
        if (it + 1 < pt1 - pt0)
            issue_paged<DC, DR, KIND>(P, s, pt0 + it + 1, KT + (KIND == kBF16 ? (buf ^ 1) * G::KT_BYTES / 2 : 0),
                                      ST + (buf ^ 1) * G::RAW);
        uint16_t *kt = KT + (KIND == kBF16 && paged ? buf * G::KT_BYTES / 2 : 0);
        if (paged) {
            if (KIND != kBF16) dequant_tile<DC, DR, KIND>(ST + buf * G::RAW, kt);
        } else {
            if (KIND == kBF16) kt = KT + buf * G::KT_BYTES / 2;
            if (terms != unpaged_terms) {   /* from the FP4 pages to the BF16 tokens: the plain query */
                terms = unpaged_terms;
                prep_queries<DC, DR, KIND>(P, s, group, terms, QA, QB);
            }
            load_unpaged<DC, DR, KIND>(P, s, u, it - (pt1 - pt0), kt, TOK);
        }
        __syncthreads();
        const bool dual = G::FP4 && terms && P.q_mode == FR_Q_DUAL;
        if (paged) {
            const int t0 = (pt0 + it) * kTile;
            const bool sink_masked = P.sink_recent && G::FP4;
            tile_step<DC, DR, KIND>(P, QA, QB, dual, kt, SX, lim, acc, [&](int n, int lm) {
                const int t = t0 + n;
                return t > lm || (sink_masked && t < kSink);
            });
        } else {
            tile_step<DC, DR, KIND>(P, QA, QB, dual, kt, SX, lim, acc, [&](int n, int lm) { return TOK[n] > lm; });
        }
    }

    finish_walk<DC, KIND>(P, s, split, group, acc, smem);
}

/* Joins the split partials of every row: one warp per row (a lane holds channels j %
 * 32 == lane, as finish_row needs). The weights 2^(lse_k - max) are taken in split
 * order, empty splits (-inf) skipped; the sum is normalized by the weights' total,
 * then the row is rotated back, the mean added and written as BF16. Rows past a
 * sequence's tokens are skipped. */
template <int DC, int KIND> __global__ void __launch_bounds__(kThreads) mla_combine(Params P, int n_seqs)
{
    const int lane = threadIdx.x & 31;
    const size_t rows = (size_t)P.row_groups * kRows;
    const size_t id = (size_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
    if (id >= rows * n_seqs) return;
    const int z = (int)(id / rows), rg = (int)(id % rows);
    const fr_paged_seq s = P.seqs[z];
    const int group = rg / kRows, r = rg % kRows;
    if (s.n_new <= 0 || row_limit(P, s, group, r) < 0) return;
    const float *lse = P.lse_part + id * P.n_splits;
    float m = -INFINITY;
    for (int k = 0; k < P.n_splits; k++) m = fmaxf(m, lse[k]);
    float x[DC / 32] = {}, wsum = 0.0f;
    for (int k = 0; k < P.n_splits; k++) {
        if (lse[k] == -INFINITY) continue;
        const float w = ex2(lse[k] - m);
        wsum += w;
        const float *o = P.o_part + (id * P.n_splits + k) * DC;
#pragma unroll
        for (int e = 0; e < DC / 32; e++) x[e] += w * o[32 * e + lane];
    }
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
#pragma unroll
    for (int e = 0; e < DC / 32; e++) x[e] *= inv;
    finish_row<DC, KIND>(P, x, out_row(P, s, group, r, DC));
}

#undef FR_MK

}   // namespace fr_mla

#endif
