/* Chunked-prefill attention over an FP4 (NVFP4, MXFP4) or FP8 paged KV cache
 * on Hopper (sm_90a): fr_attn_fp4_prefill of attention/attn_fp4.h.
 * docs/attention_gpu.md ("Prefill over FP4/FP8 pages") has the plan.
 *
 * What a chunk's attention sees is what the CPU runner's chunk attention
 * sees over fr_kv_gather's view (kvcache/kv_cache.c), with the step's own
 * tokens taken from the BF16 staging rows:
 *  - full pages, dequantized exactly: E2M1 times its E4M3 / E8M0 block scale
 *    is a BF16 number, and an E4M3 element is one too (the FP8 per-head
 *    scales are applied in float32 outside the MMAs: gamma * k_scale on the
 *    logits, v_scale on the output);
 *  - with sink_recent (full recipe): tokens 0..15 from the BF16 sink slot
 *    (their FP4 copy in page 0 is masked), the partial page from the BF16
 *    recent slot, the chunk from the staging rows;
 *  - without it (vanilla FP4, FP4 without sink, FP8): the unpaged tokens
 *    [len / 128 * 128, len + n_new) quantized on the fly as a page would hold
 *    them, by a first kernel that writes them dequantized (FP8: as unscaled
 *    E4M3 values) to BF16 scratch rows in the workspace.
 * Query and probabilities are unquantized: the query rotated (when the keys
 * are) in float32 and rounded to BF16 once, P rounded to BF16 for the MMA,
 * FP32 accumulation, the output rounded to BF16 once.
 *
 * The prefill kernel is the BF16 one's (attn_prefill_common.cuh): 64 query
 * rows (token, head) x 64-key tiles, 4 warps, mma.sync m16n8k16. Its tile
 * loader differs: a page tile's packed bytes go global -> shared with
 * cp.async into a raw stage (3 stages), then all threads dequantize them
 * into a swizzled BF16 tile (2 buffers); BF16 rows (sink, recent, staging,
 * scratch) go straight into the BF16 tile with cp.async.
 *
 * Dequantizing into BF16 keeps the BF16 prefill's MMA loop unchanged and loses
 * nothing (every value is exact in BF16). Its price: every row block that reads a
 * tile dequantizes it again, roughly as many issue slots as the tile's MMAs
 * (docs/attention_gpu.md, an estimate). The unpaged tokens are quantized once per
 * (sequence, KV head) by otf_kernel instead of by every row block, and land as BF16
 * rows that the loader treats like any other. */
#include "attn_fp4.h"

#include <atomic>
#include <climits>
#include <stdint.h>

#include "attn_prefill_common.cuh"
#include "cuda_check.h"
#include "fp4_device.cuh"

namespace {

using namespace fr_pf;

/* A tile is half a page (64 keys), so a page tile never straddles two pages and a
 * channel's value codes of a tile are 32 contiguous bytes; 3 raw stages keep two
 * tiles' bytes in flight while a third is dequantized. */
constexpr int kPage = 128;        /* tokens per page */
constexpr int kSink = 16;         /* sink tokens kept in BF16 (full recipe) */
constexpr int kThreads = 128;     /* 4 warps in both kernels */
constexpr int kRows = 64;         /* flattened query rows per block */
constexpr int kKeys = 64;         /* keys per tile: half a page */
constexpr int kRawStages = 3;     /* packed page tiles in flight */
constexpr int kMaxGroup = 16;
constexpr int kMaxDevices = 64;

enum Kind { kNV = 0, kMX = 1, kF8 = 2 };

/* Shared memory of the prefill kernel: two BF16 tiles (K [64][D] then V [64][D],
 * swizzled), then kRawStages raw stages, each one 64-key tile of a page as the page
 * stores it:
 * - FP4: K codes [64][D/2] | K scales [64][D/B] | V codes, channel j's 32 bytes (its
 *   64 tokens) at j * 32 + (j / 8) * 16 (16 bytes of padding every 8 channels keep
 *   the transposing reads at most 2-way bank conflicted) | V scales of the whole page
 *   [D][128/B];
 * - FP8: K [64][D] E4M3 | V [64][D] E4M3.
 * A tile's own value scales are 4 (NVFP4) or 2 (MXFP4) bytes per channel, strided by
 * the page's [D][128/B] layout: too small for 16-byte copies, so the whole page's
 * scales (1 KiB or 512 B at D = 128) come along. At D = 128: 64 KiB of BF16 buffers
 * plus 3 x 9,984 B (NVFP4), 3 x 9,216 B (MXFP4) or 3 x 16 KiB (FP8): 93.3, 91.0 and
 * 112 KiB, two blocks per SM (the launch bounds and the FP8 static_assert below). The
 * query rows are staged through the second K tile before the loop (the second
 * static_assert). */
template <int KIND, int D> struct Layout {
    static constexpr int B = KIND == kMX ? 32 : 16;
    static constexpr int kc = 0, kc_bytes = kKeys * D / 2;
    static constexpr int ks = kc + kc_bytes, ks_bytes = kKeys * D / B;
    static constexpr int vc = ks + ks_bytes, vc_bytes = D * 32 + D / 8 * 16;
    static constexpr int vs = vc + vc_bytes, vs_bytes = D * (kPage / B);
    static constexpr int f8k = 0, f8v = kKeys * D;
    static constexpr int raw_bytes = KIND == kF8 ? 2 * kKeys * D : vs + vs_bytes;
    static constexpr int tile_bytes = kKeys * D * 2;        /* one BF16 K (or V) tile */
    static constexpr int buf_bytes = 2 * tile_bytes;         /* K + V */
    static constexpr int raw_off = 2 * buf_bytes;
    static constexpr int smem_bytes = raw_off + kRawStages * raw_bytes;
    static_assert(kc_bytes % 16 == 0 && ks_bytes % 16 == 0 && vc_bytes % 16 == 0 && vs_bytes % 16 == 0 &&
                      raw_bytes % 16 == 0,
                  "raw stage parts must be 16-byte multiples");
    static_assert(kRows * D * 2 <= tile_bytes, "the query staging must fit in one tile");
    static_assert(f8v - f8k == kKeys * D, "FP8 raw stage: K then V");
};

static_assert(Layout<kF8, 128>::smem_bytes <= 113 * 1024, "two blocks per SM");

/* Everything the kernels read, passed by value (kernel parameter space;
 * __grid_constant__ lets the kernels read it in place). scr_k and scr_v are set only
 * on the on-the-fly path: rows [0, n_seqs * 128) hold the sequences' partial pages,
 * the rows after scr_step_row the step's tokens by q_row. */
struct Args {
    fr_paged_kv kv;
    const fr_paged_seq *seqs;
    const float *q;
    uint16_t *out;
    const float *fp8_scales;   /* device [layers][kv_heads][2], FP8 only */
    uint16_t *scr_k, *scr_v;   /* on-the-fly scratch [scr_rows][kv_heads][D] BF16, or NULL */
    int scr_step_row;          /* first scratch row of the step part: n_seqs * 128 */
    int scr_step_cap;          /* rows of the step part */
    int n_heads, group;
    float gamma;
    int sink_recent, rotate, search;
};

/* Scratch row of token t of sequence seq (len tokens cached, full of them in pages):
 * tokens of the partial page at seq * 128 + (t - full), tokens of the chunk at
 * scr_step_row + q_row + (t - len). seq is the sequence's index in the call, so the
 * partial pages need n_seqs * 128 rows whatever the slots; the chunk part follows the
 * step's row numbering, as the staging rows do. */
__device__ __forceinline__ size_t scratch_row(const Args &a, int seq, const fr_paged_seq &s, int full, int t)
{
    return t < s.len ? (size_t)seq * kPage + (t - full) : (size_t)a.scr_step_row + s.q_row + (t - s.len);
}

/* A sequence whose chunk does not fit the scratch rows of the workspace (q_row +
 * n_new beyond it) is not computed; its output rows become NaN. The host can only
 * check the minimum (n_seqs * 128 + max_new rows): q_row lives on the device. A NaN
 * row cannot pass for a result downstream, where a skipped row would. */
__device__ __forceinline__ bool scratch_overflow(const Args &a, const fr_paged_seq &s)
{
    return a.scr_k && (s.q_row < 0 || s.q_row + s.n_new > a.scr_step_cap);
}

/* ---- dequantization into BF16 ------------------------------------------- */

/* One page code word (8 E2M1 codes, docs/formats.md "FP4 code words") as floats,
 * element e in f[e]: the decode kernels' bit placement (fr_dev_fp4_word_to_f16x2,
 * value * 2^-14 as FP16 pairs), widened and scaled back by 2^14, exactly. The slots
 * put the pairs (0, 4), (2, 6), (1, 5), (3, 7) back in element order. */
__device__ __forceinline__ void e2m1x8(uint32_t w, float (&f)[8])
{
    uint32_t r[4];
    fr_dev_fp4_word_to_f16x2(w, r);
    constexpr int slot[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float lo, hi;
        asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
            : "=f"(lo), "=f"(hi)
            : "r"(r[k]));
        f[slot[k][0]] = lo * 16384.0f;
        f[slot[k][1]] = hi * 16384.0f;
    }
}

/* 4 E4M3 bytes (element e in byte e) as floats, exactly (E4M3 -> FP16 in hardware):
 * the unscaled FP8 values; the per-head scales stay outside the MMAs. */
__device__ __forceinline__ void e4m3x4(uint32_t w, float (&f)[4])
{
    uint32_t h0, h1;
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(h0), "=r"(h1)
        : "r"(w));
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(f[0]), "=f"(f[1])
        : "r"(h0));
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(f[2]), "=f"(f[3])
        : "r"(h1));
}

/* Scale times element, exact (a BF16 number), packed two by two: E2M1 x E4M3 has at
 * most 6 significant bits, E2M1 x 2^e at most 2, and BF16 keeps 8 bits over FP32's
 * exponent range. __fmul_rn rounds nothing here; it only keeps the product out of any
 * contraction. */
__device__ __forceinline__ void scaled_bf16x8(const float (&f)[8], float sc, uint32_t (&o)[4])
{
#pragma unroll
    for (int k = 0; k < 4; k++) o[k] = pack_bf16(__fmul_rn(sc, f[2 * k]), __fmul_rn(sc, f[2 * k + 1]));
}

/* ---- the prefill kernel ----------------------------------------------------- */

/* Grid (ceil(max_new * G / 64), n_kv_heads, n_seqs), heaviest row blocks
 * first. A block takes 64 flattened query rows f = i * G + g (token i of the
 * chunk, head g of the KV head), 16 per warp, and walks keys [0, len + i_max]
 * in 64-key tiles. Tile j is either a page tile (below len / 128 * 128:
 * raw bytes, then dequantized) or a loose tile (BF16 rows). Per iteration j,
 * after one barrier: dequantize tile j + 1 into BF16 buffer (j + 1) & 1 and
 * queue its BF16 rows there, queue the raw bytes of tile j + 3, attend to
 * tile j. Sequences with n_new < 2 are left to the decode path. */
template <int D, int KIND>
__global__ void __launch_bounds__(kThreads, 2) prefill_kernel(const __grid_constant__ Args a)
{
    using L = Layout<KIND, D>;
    constexpr int P = D / 8;   /* 16-byte pieces per BF16 row */
    constexpr fr_fp4_format F = KIND == kMX ? FR_MXFP4 : FR_NVFP4;
    constexpr int B = L::B;
    extern __shared__ __align__(128) uint8_t smem[];

    const int head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = a.seqs[seq];
    if (s.n_new < 2) return;
    const int group = a.group, rows = s.n_new * group;
    const int f0 = (gridDim.x - 1 - blockIdx.x) * kRows;
    if (f0 >= rows) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c2 = (lane & 3) * 2;
    auto out_row = [&](int f) {
        return a.out + ((size_t)(s.q_row + f / group) * a.n_heads + (size_t)head * group + f % group) * D;
    };
    /* A chunk the scratch cannot hold: this block's output rows become BF16 NaN
     * (scratch_overflow above). */
    if (scratch_overflow(a, s)) {
        for (int f = f0 + warp; f < min(f0 + kRows, rows); f += 4)
            for (int c = lane; c < D; c += 32) out_row(f)[c] = 0x7FC0u;   /* BF16 NaN */
        return;
    }

    /* As in the BF16 prefill: the block's last token i_max bounds its keys [0, len +
     * i_max], in n_tiles tiles. full: the paged tokens; n_sink: with sink/recent,
     * page 0's first min(len, 16) rows come from the BF16 sink slot in place of their
     * FP4 copy (a full page means len >= 128, so it is 16 whenever tile 0 is a page
     * tile). FP8: the K scale joins gamma, the V scale the output. */
    const int i_max = (min(f0 + kRows, rows) - 1) / group;
    const int kend = s.len + i_max + 1;
    const int n_tiles = (kend + kKeys - 1) / kKeys;
    const int full = s.len / kPage * kPage;
    const int n_sink = a.sink_recent ? min(s.len, kSink) : 0;
    const int H = a.kv.n_kv_heads;
    const size_t lh = (size_t)a.kv.layer * H + head;
    float gamma = a.gamma, v_scale = 1.0f;
    if (KIND == kF8) {
        gamma *= a.fp8_scales[2 * lh];
        v_scale = a.fp8_scales[2 * lh + 1];
    }

    const uint32_t base = smem_addr(smem);
    const uint8_t *raw_base = smem + L::raw_off;

    /* Raw bytes of page tile j into raw stage j % 3, 16-byte cp.async pieces spread
     * over the 128 threads. Nothing for a loose tile or past the last tile; the
     * caller commits a group either way. FP4 V codes: the page holds channel ch's 128
     * tokens as 64 bytes, the tile's half at tok / 2; the destination skips 16 bytes
     * after every 8 channels (Layout). */
    auto issue_raw = [&](int j) {
        const int tb = j * kKeys;
        if (j >= n_tiles || tb >= full) return;
        const int tok = tb % kPage;
        const int blk = __ldg(s.block_table + tb / kPage);
        const uint8_t *hp = a.kv.pool + (size_t)blk * a.kv.block_bytes + lh * a.kv.head_page_bytes;
        const uint32_t dst = base + L::raw_off + (j % kRawStages) * L::raw_bytes;
        if constexpr (KIND == kF8) {
            const uint8_t *k = hp + a.kv.k_codes + (size_t)tok * D, *v = hp + a.kv.v_codes + (size_t)tok * D;
#pragma unroll
            for (int p = tid; p < kKeys * D / 16; p += kThreads) {
                cp_async16(dst + L::f8k + p * 16, k + p * 16, 16);
                cp_async16(dst + L::f8v + p * 16, v + p * 16, 16);
            }
        } else {
            const uint8_t *kc = hp + a.kv.k_codes + (size_t)tok * (D / 2);
            const uint8_t *ks = hp + a.kv.k_scales + (size_t)tok * (D / B);
            const uint8_t *vc = hp + a.kv.v_codes + tok / 2;
            const uint8_t *vs = hp + a.kv.v_scales;
#pragma unroll
            for (int p = tid; p < L::kc_bytes / 16; p += kThreads) cp_async16(dst + L::kc + p * 16, kc + p * 16, 16);
#pragma unroll
            for (int p = tid; p < L::ks_bytes / 16; p += kThreads) cp_async16(dst + L::ks + p * 16, ks + p * 16, 16);
#pragma unroll
            for (int p = tid; p < 2 * D; p += kThreads) {
                const int ch = p >> 1, h = p & 1;
                cp_async16(dst + L::vc + ch * 32 + (ch >> 3) * 16 + h * 16, vc + (size_t)ch * (kPage / 2) + h * 16,
                           16);
            }
#pragma unroll
            for (int p = tid; p < L::vs_bytes / 16; p += kThreads) cp_async16(dst + L::vs + p * 16, vs + p * 16, 16);
        }
    };

    /* BF16 rows of tile j into buffer j & 1: every row of a loose tile (rows at or
     * past kend become zeros, so masked keys never carry NaN into P.V), or the sink
     * rows of page 0's first tile. A loose row comes from the sink slot (t < 16 with
     * sink/recent), the on-the-fly scratch (without sink/recent), or else the recent
     * slot and the staging rows, as the CPU's view takes them. */
    auto issue_rows = [&](int j) {
        const int tb = j * kKeys;
        if (j >= n_tiles) return;
        const int n_rows = tb >= full ? kKeys : tb == 0 ? n_sink : 0;
        const uint32_t sk = base + (j & 1) * L::buf_bytes, sv = sk + L::tile_bytes;
        constexpr int RS = kThreads / P;
        const int col = tid % P;
#pragma unroll
        for (int r = tid / P; r < kKeys; r += RS) {
            if (r >= n_rows) break;
            const int t = tb + r;
            const uint16_t *k, *v;
            uint32_t n = 16;
            if (t < n_sink) {
                k = a.kv.sink + (size_t)s.slot * 2 * a.kv.sink_elems + (lh * kSink + t) * D;
                v = k + a.kv.sink_elems;
            } else if (t >= kend) {
                k = v = a.kv.step_k;
                n = 0;
            } else if (a.scr_k) {
                const size_t o = (scratch_row(a, seq, s, full, t) * H + head) * D;
                k = a.scr_k + o;
                v = a.scr_v + o;
            } else if (t < s.len) {
                k = a.kv.recent + (size_t)s.slot * 2 * a.kv.slot_elems + (lh * kPage + (t - full)) * D;
                v = k + a.kv.slot_elems;
            } else {
                const size_t o = ((size_t)(s.q_row + t - s.len) * H + head) * D;
                k = a.kv.step_k + o;
                v = a.kv.step_v + o;
            }
            cp_async16(sk + swz<P>(r, col), k + col * 8, n);
            cp_async16(sv + swz<P>(r, col), v + col * 8, n);
        }
    };

    /* Page tile j: raw stage j % 3 -> BF16 buffer j & 1 (rows below n_mask, the
     * masked sink copy, are left to issue_rows). All 128 threads convert, each
     * writing whole 16-byte pieces of the swizzled tile (st.shared.v4): FP8 8
     * elements of K and of V per item, FP4 below. */
    auto convert = [&](int j) {
        const int tb = j * kKeys;
        if (j >= n_tiles || tb >= full) return;
        const int n_mask = tb == 0 ? n_sink : 0;
        const uint8_t *raw = raw_base + (j % kRawStages) * L::raw_bytes;
        const uint32_t sk = base + (j & 1) * L::buf_bytes, sv = sk + L::tile_bytes;
        if constexpr (KIND == kF8) {
#pragma unroll
            for (int p = tid; p < kKeys * P; p += kThreads) {
                const int r = p / P, c = p % P;
                const uint2 wk = *reinterpret_cast<const uint2 *>(raw + L::f8k + r * D + c * 8);
                const uint2 wv = *reinterpret_cast<const uint2 *>(raw + L::f8v + r * D + c * 8);
                float x[4], y[4];
                e4m3x4(wk.x, x);
                e4m3x4(wk.y, y);
                st_shared_v4(sk + swz<P>(r, c), pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(y[0], y[1]),
                             pack_bf16(y[2], y[3]));
                e4m3x4(wv.x, x);
                e4m3x4(wv.y, y);
                st_shared_v4(sv + swz<P>(r, c), pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(y[0], y[1]),
                             pack_bf16(y[2], y[3]));
            }
        } else {
            /* K: piece c of row r is 8 channels of one token, one block scale (8
             * divides B: a code word never straddles a block). One 4-byte code load
             * and one scale byte give one 16-byte store. */
#pragma unroll
            for (int p = tid; p < kKeys * P; p += kThreads) {
                const int r = p / P, c = p % P;
                if (r < n_mask) continue;
                const uint32_t w = *reinterpret_cast<const uint32_t *>(raw + L::kc + r * (D / 2) + c * 4);
                const float sc = fr_dev_fp4_scale_value<F>(raw[L::ks + r * (D / B) + c * 8 / B]);
                float f[8];
                uint32_t o[4];
                e2m1x8(w, f);
                scaled_bf16x8(f, sc, o);
                st_shared_v4(sk + swz<P>(r, c), o[0], o[1], o[2], o[3]);
            }
            /* V: the page holds [channel][token]; a thread takes 8 channels x 8
             * tokens (one code word per channel, 8 tokens in one value block) and
             * writes 8 token rows of 8 channels. h[c][i] is channel c's BF16 pair of
             * tokens 2i, 2i + 1; a PRMT takes the low (even token) or high (odd
             * token) halves of two channels, so four PRMTs make a token row's 16-byte
             * piece: the transposition costs no shared-memory round trip. The threads
             * of a warp read channel groups cg with tg fixed or one apart, which the
             * raw stage's padding spreads over the banks. */
#pragma unroll
            for (int p = tid; p < 8 * P; p += kThreads) {
                const int cg = p % P, tg = p / P;
                if (tg * 8 < n_mask) continue;
                const int tok = tb % kPage + tg * 8;
                uint32_t h[8][4];   /* channel c: BF16 pairs of tokens (0,1) (2,3) (4,5) (6,7) */
#pragma unroll
                for (int c = 0; c < 8; c++) {
                    const int ch = cg * 8 + c;
                    const uint32_t w = *reinterpret_cast<const uint32_t *>(raw + L::vc + ch * 32 + cg * 16 + tg * 4);
                    const float sc = fr_dev_fp4_scale_value<F>(raw[L::vs + ch * (kPage / B) + tok / B]);
                    float f[8];
                    e2m1x8(w, f);
                    scaled_bf16x8(f, sc, h[c]);
                }
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const uint32_t sel = (i & 1) ? 0x7632u : 0x5410u;
                    st_shared_v4(sv + swz<P>(tg * 8 + i, cg), prmt(h[0][i >> 1], h[1][i >> 1], sel),
                                 prmt(h[2][i >> 1], h[3][i >> 1], sel), prmt(h[4][i >> 1], h[5][i >> 1], sel),
                                 prmt(h[6][i >> 1], h[7][i >> 1], sel));
                }
            }
        }
    };

    /* Prologue: raw 0, raw 1, rows 0, raw 2 in flight; the query fragments staged
     * through buffer 1 (free until iteration 0); tile 0 dequantized. Four commit
     * groups, in that order; cp_async_wait<2> leaves the last two in flight, so raw 0
     * (and raw 1) have landed for this thread, and the barrier makes every thread's
     * bytes visible before convert(0) reads them. */
    issue_raw(0);
    cp_async_commit();
    issue_raw(1);
    cp_async_commit();
    issue_rows(0);
    cp_async_commit();
    issue_raw(2);
    cp_async_commit();

    const int fw = f0 + warp * 16;
    /* The warp's 16 query rows (flattened as in the BF16 prefill: row f is head f % G
     * of token f / G), rotated by the Hadamard when the keys are (a.rotate), rounded
     * to BF16 once, staged through this warp's 16 rows of buffer 1's K tile and read
     * back as A fragments. */
    uint32_t qa[D / 16][4];
    stage_query<D>(base + L::buf_bytes + warp * 16 * D * 2,
                   [&](int r) -> const float * {
                       const int f = fw + r;
                       if (f >= rows) return nullptr;
                       return a.q + ((size_t)(s.q_row + f / group) * a.n_heads + (size_t)head * group + f % group) * D;
                   },
                   a.rotate != 0, qa, lane);

    cp_async_wait<2>();
    __syncthreads();
    convert(0);

    const bool warp_live = fw < rows;
    const int i_lo = min(fw, rows - 1) / group, i_hi = (min(fw + 16, rows) - 1) / group;
    const int fa = fw + g, fb = fa + 8;
    const int ia = min(fa, rows - 1) / group, ib = min(fb, rows - 1) / group;

    float o[D / 8][4], m_a, m_b, l_a, l_b;
    softmax_start<D>(o, m_a, m_b, l_a, l_b);

    /* Each iteration commits two groups (rows j + 1, raw j + 3), so at iteration j
     * cp_async_wait<1> leaves only raw j + 2 in flight: rows j and raw j + 1 have
     * landed. After the one barrier per tile:
     * - BF16 buffer j & 1 holds tile j complete (dequantized by every thread at
     *   iteration j - 1, its BF16 rows landed);
     * - buffer (j + 1) & 1 is free (every warp attended tile j - 1 before the
     *   barrier), so tile j + 1 is dequantized and its BF16 rows queued there now;
     * - raw stage j % 3 is free (converted at iteration j - 1), so raw j + 3 goes
     *   there.
     * Then tile j is attended with the BF16 prefill's online-softmax step. The copies
     * of the next tiles run under both the conversion and the MMAs. */
    for (int j = 0; j < n_tiles; j++) {
        cp_async_wait<1>();
        __syncthreads();   /* tile j complete for all; buffer (j + 1) & 1 and raw stage j % 3 free */
        convert(j + 1);
        issue_rows(j + 1);
        cp_async_commit();
        issue_raw(j + kRawStages);
        cp_async_commit();
        const int tb = j * kKeys;
        if (warp_live && tb <= s.len + i_hi) {
            const uint32_t sk = base + (j & 1) * L::buf_bytes;
            attend_tile<D, kKeys>(sk, sk + L::tile_bytes, qa, o, m_a, m_b, l_a, l_b, tb, s.len + ia + 1,
                                  s.len + ib + 1, tb + kKeys - 1 > s.len + i_lo, gamma, lane);
        }
    }
    cp_async_wait<0>();
    quad_sums(l_a, l_b);

    /* The quad's lanes add their l to the row's sum. The output is O / l, times the V
     * scale for FP8, rounded to BF16 once. */
    auto store = [&](int f, float l, int hi) {
        if (f >= rows) return;
        const float inv = l > 0.0f ? v_scale / l : 0.0f;
        uint16_t *dst = out_row(f) + c2;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *reinterpret_cast<uint32_t *>(dst + j * 8) = pack_bf16(o[j][hi] * inv, o[j][hi + 1] * inv);
    };
    store(fa, l_a, 0);
    store(fb, l_b, 2);
}

/* ---- on-the-fly quantization of the unpaged tokens -------------------------- */

/* Grid (ceil((127 + max_new) / 128), n_kv_heads, n_seqs). Block x of a sequence takes
 * tokens [full + 128 x, full + 128 (x + 1)) of the unpaged region [full, len + n_new)
 * (recent slot rows, then staging rows) and writes them to the scratch rows as
 * attention sees them (kv_cache.c, quantize_on_the_fly): FP4 keys per token with the
 * recipe's scale search, values per block of B tokens from the page start with the
 * standard scale, zero padded, both dequantized; FP8 E4M3(x / scale), unscaled.
 *
 * The region holds at most 127 recent tokens and the chunk, hence the grid's x. Each
 * block's tokens start on a page boundary (full is one), so its value blocks are the
 * ones a promoted page would have; a block whose last value block runs past the
 * region pads it with zeros, as the CPU pads the partial page. The block's writes
 * finish before the prefill kernel, the next launch in the stream, reads them. */
template <int D, int KIND>
__global__ void __launch_bounds__(kThreads) otf_kernel(const __grid_constant__ Args a)
{
    const int head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = a.seqs[seq];
    if (s.n_new < 2 || scratch_overflow(a, s)) return;
    const int full = s.len / kPage * kPage, end = s.len + s.n_new;
    const int t0 = full + blockIdx.x * kPage;
    if (t0 >= end) return;
    const int t1 = min(t0 + kPage, end);
    const int H = a.kv.n_kv_heads;
    const size_t lh = (size_t)a.kv.layer * H + head;
    auto src = [&](int t) -> size_t {   /* offset of token t's row in recent (t < len) or staging */
        return t < s.len ? (size_t)s.slot * 2 * a.kv.slot_elems + (lh * kPage + (t - full)) * D
                         : ((size_t)(s.q_row + t - s.len) * H + head) * D;
    };
    auto src_k = [&](int t) { return (t < s.len ? a.kv.recent : a.kv.step_k) + src(t); };
    auto src_v = [&](int t) {
        return t < s.len ? a.kv.recent + src(t) + a.kv.slot_elems : a.kv.step_v + src(t);
    };
    auto dst = [&](int t) { return (scratch_row(a, seq, s, full, t) * H + head) * D; };

    if constexpr (KIND == kF8) {
        /* FP8: eight BF16 elements (one 16-byte load) per item, each E4M3(x / scale)
         * as the cache rounds it (IEEE division, then fr_dev_e4m3_round), stored as
         * the unscaled E4M3 value in BF16 (exact). */
        const float sk = a.fp8_scales[2 * lh], sv = a.fp8_scales[2 * lh + 1];
        const int n8 = (t1 - t0) * (D / 8);
        for (int it = threadIdx.x; it < n8; it += kThreads) {
            const int t = t0 + it / (D / 8), c = it % (D / 8);
#pragma unroll
            for (int kv = 0; kv < 2; kv++) {
                const uint4 x = *reinterpret_cast<const uint4 *>((kv ? src_v(t) : src_k(t)) + c * 8);
                const float sc = kv ? sv : sk;
                const uint32_t w[4] = {x.x, x.y, x.z, x.w};
                uint32_t y[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float lo = fr_dev_e4m3_round(__fdiv_rn(fr_dev_bf16_decode((uint16_t)(w[e] & 0xFFFFu)), sc));
                    const float hi = fr_dev_e4m3_round(__fdiv_rn(fr_dev_bf16_decode((uint16_t)(w[e] >> 16)), sc));
                    y[e] = (uint32_t)fr_dev_bf16_encode(lo) | ((uint32_t)fr_dev_bf16_encode(hi) << 16);
                }
                *reinterpret_cast<uint4 *>((kv ? a.scr_v : a.scr_k) + dst(t) + c * 8) = make_uint4(y[0], y[1], y[2], y[3]);
            }
        }
    } else {
        constexpr fr_fp4_format F = KIND == kMX ? FR_MXFP4 : FR_NVFP4;
        constexpr int B = fr_dev_fp4<F>::block;
        /* Keys: one (token, block of B channels) per item: the block quantized with
         * the recipe's scale search exactly as fr_dev_fp4_quantize_block does for the
         * cache, then dequantized into BF16 (exact). */
        const int nk = (t1 - t0) * (D / B);
        for (int it = threadIdx.x; it < nk; it += kThreads) {
            const int t = t0 + it / (D / B), b = it % (D / B);
            const uint4 *in = reinterpret_cast<const uint4 *>(src_k(t) + b * B);
            float x[B];
#pragma unroll
            for (int u = 0; u < B / 8; u++) {
                const uint4 w = in[u];
                const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    x[u * 8 + 2 * e] = fr_dev_bf16_decode((uint16_t)(ws[e] & 0xFFFFu));
                    x[u * 8 + 2 * e + 1] = fr_dev_bf16_decode((uint16_t)(ws[e] >> 16));
                }
            }
            uint8_t codes[B];
            const float sc = fr_dev_fp4_scale_value<F>(fr_dev_fp4_quantize_block<F>(a.search != 0, x, codes));
            uint4 *out = reinterpret_cast<uint4 *>(a.scr_k + dst(t) + b * B);
#pragma unroll
            for (int u = 0; u < B / 8; u++) {
                uint32_t y[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    y[e] = (uint32_t)fr_dev_bf16_encode(fr_dev_fp4_dequant(sc, codes[u * 8 + 2 * e])) |
                           ((uint32_t)fr_dev_bf16_encode(fr_dev_fp4_dequant(sc, codes[u * 8 + 2 * e + 1])) << 16);
                out[u] = make_uint4(y[0], y[1], y[2], y[3]);
            }
        }
        /* Values: one (block of B tokens from the page start, channel) per
         * item; tokens past the region are zeros in the block. */
        const int nv = (t1 - t0 + B - 1) / B * D;
        for (int it = threadIdx.x; it < nv; it += kThreads) {
            const int ch = it % D, tb = t0 + it / D * B;
            float x[B];
#pragma unroll
            for (int i = 0; i < B; i++) x[i] = tb + i < t1 ? fr_dev_bf16_decode(src_v(tb + i)[ch]) : 0.0f;
            uint8_t codes[B];
            const float sc = fr_dev_fp4_scale_value<F>(fr_dev_fp4_quantize_block<F>(false, x, codes));
#pragma unroll
            for (int i = 0; i < B; i++)
                if (tb + i < t1) a.scr_v[dst(tb + i) + ch] = fr_dev_bf16_encode(fr_dev_fp4_dequant(sc, codes[i]));
        }
    }
}

/* ---- host side --------------------------------------------------------------- */

/* The cache dtype as the kernels' Kind, -1 for one they do not read. */
int kind_of(fr_kv_dtype t) { return t == FR_KV_NVFP4 ? kNV : t == FR_KV_MXFP4 ? kMX : t == FR_KV_FP8 ? kF8 : -1; }

/* Whether the unpaged tokens are quantized on the fly (through the scratch): FP8
 * always (its view has no BF16 tokens) and FP4 without the sink/recent recipe. This
 * must agree with what the CPU's fr_kv_gather does for the same configuration. */
bool on_the_fly(const fr_attn_fp4_config *cfg) { return cfg->dtype == FR_KV_FP8 || !cfg->sink_recent; }

/* Scratch bytes per row: K and V of every KV head, BF16 (scr_k's rows first, then
 * scr_v's, in one workspace). */
size_t scratch_row_bytes(int n_kv_heads, int head_dim) { return (size_t)2 * n_kv_heads * head_dim * 2; }

/* Per device: set once every instance's shared-memory limit has been raised (stored
 * with release after the calls, read with acquire). */
std::atomic<int> g_ready[kMaxDevices];

/* The prefill kernels take 91-112 KiB (D = 128) of dynamic shared memory, above the
 * 48 KB a kernel gets without opting in; the opt-in is per device and must come
 * before the first launch, outside graph capture. All six instances are set up at
 * once, on the first call of the device. */
template <int D, int KIND> fr_status set_smem_limit()
{
    FR_CUDA_TRY(cudaFuncSetAttribute(prefill_kernel<D, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     Layout<KIND, D>::smem_bytes));
    return FR_OK;
}

/* Per-device setup, once (idempotent, so a race only repeats it). */
fr_status device_setup(void)
{
    int dev = 0;
    FR_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4_prefill: device %d beyond the %d supported", dev, kMaxDevices);
    if (g_ready[dev].load(std::memory_order_acquire)) return FR_OK;
    fr_status st;
    if ((st = set_smem_limit<64, kNV>()) || (st = set_smem_limit<64, kMX>()) || (st = set_smem_limit<64, kF8>()) ||
        (st = set_smem_limit<128, kNV>()) || (st = set_smem_limit<128, kMX>()) || (st = set_smem_limit<128, kF8>()))
        return st;
    g_ready[dev].store(1, std::memory_order_release);
    return FR_OK;
}

/* The prefill's checks are fewer than decode's: it has no split plan and no quantized
 * query or P, so only the format, the shape it is built for (head_dim 64 or 128, G <=
 * 16, KV heads within the grid's y) and a config head_dim that agrees with the cache
 * (0: unset) matter. */
fr_status check_config(const fr_attn_fp4_config *cfg, int n_heads, int n_kv_heads, int head_dim)
{
    if (!cfg) return fr_fail(FR_EINVAL, "attn_fp4_prefill: NULL config");
    if (kind_of(cfg->dtype) < 0)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4_prefill: kv dtype %s (nvfp4, mxfp4 and fp8 are supported)",
                       fr_kv_dtype_name(cfg->dtype));
    if (head_dim != 64 && head_dim != 128)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4_prefill: head_dim %d (64 and 128 are supported)", head_dim);
    if (cfg->p.head_dim && cfg->p.head_dim != head_dim)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: config head_dim %d, cache head_dim %d", cfg->p.head_dim,
                       head_dim);
    if (n_kv_heads < 1 || n_kv_heads > 65535 || n_heads < n_kv_heads || n_heads % n_kv_heads)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: %d query heads do not group over %d KV heads", n_heads,
                       n_kv_heads);
    if (n_heads / n_kv_heads > kMaxGroup)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: group %d above %d", n_heads / n_kv_heads, kMaxGroup);
    return FR_OK;
}

bool misaligned(const void *p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0; }

/* Two launches in stream order: on the on-the-fly path otf_kernel fills the scratch,
 * then the prefill kernel reads it. Both are plain launches, so the prefill kernel
 * starts only once otf_kernel has ended and its scratch rows are visible. */
template <int D, int KIND> fr_status launch(const Args &a, int n_seqs, int max_new, cudaStream_t stream)
{
    if (a.scr_k) {
        const int pieces = (kPage - 1 + max_new + kPage - 1) / kPage;
        otf_kernel<D, KIND><<<dim3(pieces, a.kv.n_kv_heads, n_seqs), kThreads, 0, stream>>>(a);
        FR_CUDA_LAUNCHED();
    }
    const long mblocks = ((long)max_new * a.group + kRows - 1) / kRows;
    prefill_kernel<D, KIND><<<dim3((unsigned)mblocks, a.kv.n_kv_heads, n_seqs), kThreads,
                              Layout<KIND, D>::smem_bytes, stream>>>(a);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

} // namespace

/* The scratch for max_seqs partial pages and max_step_tokens chunk rows (0 with
 * sink/recent, whose view needs no scratch). Also the per-device shared-memory setup:
 * docs/attention_gpu.md asks for this call before capturing a graph. */
extern "C" fr_status fr_attn_fp4_prefill_workspace_bytes(const fr_attn_fp4_config *cfg, int max_seqs,
                                                         int max_step_tokens, int n_heads, int n_kv_heads,
                                                         size_t *bytes)
{
    if (!bytes) return fr_fail(FR_EINVAL, "attn_fp4_prefill_workspace_bytes: NULL result");
    *bytes = 0;
    if (!cfg) return fr_fail(FR_EINVAL, "attn_fp4_prefill_workspace_bytes: NULL config");
    fr_status st = check_config(cfg, n_heads, n_kv_heads, cfg->p.head_dim);
    if (st) return st;
    if (max_seqs < 0 || max_step_tokens < 0)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill_workspace_bytes: max_seqs %d or max_step_tokens %d < 0",
                       max_seqs, max_step_tokens);
    if ((st = device_setup())) return st;
    if (on_the_fly(cfg))
        *bytes = ((size_t)max_seqs * kPage + (size_t)max_step_tokens) * scratch_row_bytes(n_kv_heads, cfg->p.head_dim);
    return FR_OK;
}

extern "C" fr_status fr_attn_fp4_prefill(const fr_attn_fp4_config *cfg, const fr_paged_kv *kv,
                                         const fr_paged_seq *seqs_dev, int n_seqs, int max_new, int max_ctx,
                                         const float *q, uint16_t *out, int n_heads, void *workspace,
                                         size_t workspace_bytes, cudaStream_t stream)
{
    (void)max_ctx;   /* prefill walks each sequence's whole context: no split plan to size */
    if (!cfg || !kv || !seqs_dev || !q || !out) return fr_fail(FR_EINVAL, "attn_fp4_prefill: NULL argument");
    if (n_seqs < 0 || n_seqs > 65535)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: %d sequences outside [0, 65535]", n_seqs);
    if (max_new < 1) return fr_fail(FR_EINVAL, "attn_fp4_prefill: max_new %d < 1", max_new);
    fr_status st = check_config(cfg, n_heads, kv->n_kv_heads, kv->head_dim);
    if (st) return st;
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    const int fp4 = cfg->dtype != FR_KV_FP8;
    const int sink_recent = fp4 && cfg->sink_recent;
    if (!kv->pool || !kv->recent || !kv->step_k || !kv->step_v || (sink_recent && !kv->sink))
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: the cache view lacks a pool, slots or staging rows");
    if (!fp4 && !cfg->fp8_scales) return fr_fail(FR_EINVAL, "attn_fp4_prefill: FP8 needs the per-head scales");
    /* Every tile row and raw page piece moves by 16-byte cp.async, so the pool, the
     * page offsets (scales too for FP4), the blocks, head pages, slots and staging
     * rows must be 16-byte aligned; q is read one float at a time and the output
     * written as BF16 pairs, hence 4 bytes for both. */
    if (misaligned(kv->pool, 16) || misaligned(kv->recent, 16) || misaligned(kv->step_k, 16) ||
        misaligned(kv->step_v, 16) || (sink_recent && misaligned(kv->sink, 16)) || kv->block_bytes % 16 ||
        kv->head_page_bytes % 16 || kv->k_codes % 16 || kv->v_codes % 16 || (fp4 && (kv->k_scales % 16 || kv->v_scales % 16)) ||
        kv->slot_elems % 8 || kv->sink_elems % 8 || misaligned(q, 4) || misaligned(out, 4))
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: pointers and page offsets must be 16-byte aligned "
                                  "(q and out 4-byte)");
    if (max_new < 2 || n_seqs == 0) return FR_OK;   /* no sequence has a chunk */

    const int D = kv->head_dim, group = n_heads / kv->n_kv_heads;
    Args a = {};
    a.kv = *kv;
    a.seqs = seqs_dev;
    a.q = q;
    a.out = out;
    a.fp8_scales = cfg->fp8_scales;
    a.n_heads = n_heads;
    a.group = group;
    /* gamma = log2(e) / sqrt(D), the base-2 logit scale (the kernel multiplies FP8's
     * K scale in); the query is rotated when the keys were (cfg->rotate); the scale
     * search switch serves the on-the-fly keys. */
    a.gamma = (float)(1.4426950408889634 / (D == 128 ? 11.313708498984761 : 8.0));
    a.sink_recent = sink_recent;
    a.rotate = cfg->rotate != 0;
    a.search = cfg->p.q_search != 0;
    /* The scratch: n_seqs * 128 rows for the partial pages, then the rest of the
     * workspace for the chunk rows by q_row. Fewer rows than n_seqs * 128 + max_new
     * cannot serve even one chunk at q_row 0, so the call fails; a chunk further down
     * that does not fit is caught on the device (scratch_overflow). */
    if (on_the_fly(cfg)) {
        const size_t row_bytes = scratch_row_bytes(kv->n_kv_heads, D);
        const size_t rows = workspace && !misaligned(workspace, 16) ? workspace_bytes / row_bytes : 0;
        const size_t need = (size_t)n_seqs * kPage + (size_t)max_new;
        if (rows < need || rows > (size_t)INT_MAX)
            return fr_fail(FR_EINVAL, "attn_fp4_prefill: the workspace holds %zu scratch rows, %d sequences and "
                                      "a chunk of %d need at least %zu (fr_attn_fp4_prefill_workspace_bytes)",
                           rows, n_seqs, max_new, need);
        a.scr_k = static_cast<uint16_t *>(workspace);
        a.scr_v = a.scr_k + rows * kv->n_kv_heads * D;
        a.scr_step_row = n_seqs * kPage;
        a.scr_step_cap = (int)(rows - (size_t)n_seqs * kPage);
    }
    if (((long)max_new * group + kRows - 1) / kRows > INT_MAX)
        return fr_fail(FR_EINVAL, "attn_fp4_prefill: max_new %d too large", max_new);
    if ((st = device_setup())) return st;
    /* One of six instances: the format and the head dim are template arguments of
     * both kernels. */
    switch (kind_of(cfg->dtype) + 3 * (D == 128)) {
    case kNV: return launch<64, kNV>(a, n_seqs, max_new, stream);
    case kMX: return launch<64, kMX>(a, n_seqs, max_new, stream);
    case kF8: return launch<64, kF8>(a, n_seqs, max_new, stream);
    case 3 + kNV: return launch<128, kNV>(a, n_seqs, max_new, stream);
    case 3 + kMX: return launch<128, kMX>(a, n_seqs, max_new, stream);
    default: return launch<128, kF8>(a, n_seqs, max_new, stream);
    }
}
