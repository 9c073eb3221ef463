/* Experiment: the latent (MLA) kernel of attn_mla_kernels.cuh with its two products
 * on warpgroup MMAs (wgmma) instead of per-warp mma.sync. Same numerics, same
 * parameter block, same split plan and combine; only where the operands live and
 * which instructions multiply them change. Not yet run on a GPU: see README.md
 * here for its state and how to check it.
 *
 * Why: the mainline kernel's products load every operand fragment with ldmatrix
 * into each warp's registers (the four row-tile warps load the same K fragments, the
 * two channel-half warps the same P), which keeps shared memory 70% busy and the
 * tensor pipe 25% (bench/RESULTS.md, "Latent (MLA) attention on one H200"). A
 * wgmma reads its shared-memory operands once for the 64 rows of a warpgroup.
 *
 * The CTA keeps the mainline's shape: 64 query rows, 8 warps, tiles of 32 tokens.
 * Warpgroup h (warps 4h .. 4h + 3) is the mainline's channel half hf = h, and its
 * warp w holds rows 16 w .. 16 w + 15, the mainline's row tile rt = w, so the
 * softmax step between the products (softmax_tile) is the mainline's, unchanged:
 *  - scores: warpgroup h takes its half of the k-steps (content and RoPE alike) as
 *    wgmma m64n32k16 with Q and the tile from shared memory (K-major); the dual FP4
 *    query adds its second term's k-steps over the content channels;
 *  - the halves' partial scores meet through SX as in the mainline;
 *  - context: O[:, h half] += P V as wgmma m64n64k16 per 64 channels, P from
 *    registers (the scores' C fragments are the A fragments, as in the mainline),
 *    V from the same tile read MN-major.
 * Operands are 128-byte swizzled (wgmma_ptx.cuh): Q [64 rows] and the tile [32
 * rows] in blocks of 64 channels, [rows][128 bytes] each. The loaders are the
 * mainline's, given this layout (Sw128). Every wgmma group is waited for at once
 * (no overlap of one tile's products with the next tile's loads beyond the
 * mainline's cp.async double buffer): correctness first. */
#ifndef FR_DEV_MLA_WGMMA_CUH
#define FR_DEV_MLA_WGMMA_CUH

#include "attention/attn_mla_kernels.cuh"
#include "attention/dev/wgmma_ptx.cuh"

namespace fr_mla_wg {

using namespace fr_mla;

#define FR_WK __device__ __forceinline__

/* A BF16 operand of ROWS rows, 128-byte swizzled in blocks of 64 channels: block
 * ch / 64 is [ROWS][64] halves, and the 8-half chunk c of row r sits at chunk
 * c ^ (r % 8) (the hardware's XOR of address bits 4-6 with bits 7-9 in a
 * 1024-byte-aligned block). */
template <int ROWS> struct Sw128 {
    static constexpr int BLOCK = ROWS * 64;   /* halves of one 64-channel block */
    static FR_WK int at(int row, int ch)
    {
        return (ch >> 6) * BLOCK + row * 64 + ((((ch >> 3) & 7) ^ (row & 7)) << 3) + (ch & 7);
    }
};

/* Shared memory of a CTA (byte offsets from a 1024-byte-aligned base): QA (the query
 * operands, content then RoPE), QB (the dual FP4 query's second term), KT (the tile;
 * two for BF16 caches, whose pages cp.async straight in), ST (two raw staging tiles,
 * other dtypes), SX, TOK, as the mainline's Geo; FIN reuses it all after the last
 * tile. SMEM adds the alignment's slack. */
template <int DC, int DR, int KIND> struct GeoW {
    using G = Geo<DC, DR, KIND>;
    static constexpr int D = DC + DR, NB = D / 64, NBC = DC / 64;
    static constexpr int QA_OFF = 0, QA_BYTES = NB * kRows * 128;
    static constexpr int QB_OFF = QA_BYTES, QB_BYTES = G::FP4 ? NBC * kRows * 128 : 0;
    static constexpr int KT_OFF = QB_OFF + QB_BYTES, KT_BYTES = NB * kTile * 128, KT_N = KIND == kBF16 ? 2 : 1;
    static constexpr int ST_OFF = KT_OFF + KT_N * KT_BYTES, ST_N = KIND == kBF16 ? 0 : 2;
    static constexpr int SX_OFF = ST_OFF + ST_N * G::RAW, SX_BYTES = 2 * kRows * kTile * 4;
    static constexpr int TOK_OFF = SX_OFF + SX_BYTES;
    static constexpr int MAIN = TOK_OFF + kTile * 4;
    static constexpr int FIN = kRows * DC * 4;
    static constexpr int SMEM = (MAIN > FIN ? MAIN : FIN) + 1024;
    static_assert(D % 64 == 0 && DC % 128 == 0, "whole 64-channel blocks; each half of O in n64 steps");
    static_assert(QA_BYTES % 1024 == 0 && QB_BYTES % 1024 == 0 && KT_BYTES % 1024 == 0, "1024-byte atoms");
    static_assert(SMEM <= 227 * 1024, "one CTA's shared memory fits a Hopper SM's opt-in");
};

using QLay = Sw128<kRows>;
using TLay = Sw128<kTile>;

/* No descriptor here uses its leading byte offset: a K-major k-step (32 bytes)
 * stays inside one 128-byte row, and the context's n64 B spans one 64-channel
 * block. It is set to the 8-row stride anyway, which is what it would have to be
 * if the hardware read the two offsets the other way round for either major-ness
 * (the one reading of the PTX ISA this kernel has not been able to check). */
constexpr uint32_t kUnusedLbo = 1024;

/* The scores' wgmma group: the warpgroup's half of the k-steps (content and RoPE)
 * of Q against the tile, and with DUAL the second term's half of the content
 * k-steps. One straight sequence per variant, between one fence and one wait. */
template <int DC, int DR, bool DUAL>
FR_WK void scores_wg(const uint16_t *QA, const uint16_t *QB, const uint16_t *kt, float (&sf)[16])
{
    const int hf = threadIdx.x >> 7;
    constexpr int KS = (DC + DR) / 16, KC = DC / 16;
    fr_wgmma::pin(sf);
    fr_wgmma::fence();
#pragma unroll
    for (int k = 0; k < KS / 2; k++) {
        const int ks = hf * (KS / 2) + k;   /* 16 channels: block ks / 4, 32 bytes (ks % 4) into its rows */
        const uint64_t da = fr_wgmma::sw128_desc(QA + (ks >> 2) * QLay::BLOCK + (ks & 3) * 16, kUnusedLbo, 1024);
        const uint64_t db = fr_wgmma::sw128_desc(kt + (ks >> 2) * TLay::BLOCK + (ks & 3) * 16, kUnusedLbo, 1024);
        fr_wgmma::m64n32k16_ss(sf, da, db, 1);
    }
    if constexpr (DUAL) {
#pragma unroll
        for (int k = 0; k < KC / 2; k++) {
            const int ks = hf * (KC / 2) + k;
            const uint64_t da = fr_wgmma::sw128_desc(QB + (ks >> 2) * QLay::BLOCK + (ks & 3) * 16, kUnusedLbo, 1024);
            const uint64_t db = fr_wgmma::sw128_desc(kt + (ks >> 2) * TLay::BLOCK + (ks & 3) * 16, kUnusedLbo, 1024);
            fr_wgmma::m64n32k16_ss(sf, da, db, 1);
        }
    }
    fr_wgmma::commit();
    fr_wgmma::wait<0>();
    fr_wgmma::pin(sf);
}

/* One tile on wgmma: the scores, the mainline's softmax step, the context. */
template <int DC, int DR, int KIND, typename Mask>
__device__ void tile_step_wg(const Params &P, const uint16_t *QA, const uint16_t *QB, bool dual, const uint16_t *kt,
                             float *sx, const int (&lim)[2], Acc<DC> &acc, Mask mask)
{
    const int hf = threadIdx.x >> 7;
    float s[4][4] = {};
    float(&sf)[16] = *reinterpret_cast<float(*)[16]>(&s[0][0]);
    float(&of)[Acc<DC>::NO * 4] = *reinterpret_cast<float(*)[Acc<DC>::NO * 4]>(&acc.o[0][0]);
    if (Geo<DC, DR, KIND>::FP4 && dual) scores_wg<DC, DR, true>(QA, QB, kt, sf);
    else scores_wg<DC, DR, false>(QA, QB, kt, sf);
    uint32_t pa[2][4];
    softmax_tile<DC>(P, sx, lim, acc, mask, s, pa);
    /* O += P V: the tile's rows are tokens (K) with 64 channels (N) a row in each
     * block, i.e. MN-major; warpgroup hf's channels are blocks hf DC / 128 .. The
     * 16 tokens of k-step kk start 16 rows (2048 bytes) into a block; 8-row groups
     * are 1024 bytes apart, blocks 32 rows (4096 bytes). */
    fr_wgmma::pin(of);
    fr_wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int nb = 0; nb < DC / 128; nb++) {
            const uint16_t *vb = kt + (hf * (DC / 128) + nb) * TLay::BLOCK + kk * 16 * 64;
            const uint64_t db = fr_wgmma::sw128_desc(vb, kUnusedLbo, 1024);
            fr_wgmma::m64n64k16_rs(*reinterpret_cast<float(*)[32]>(&of[nb * 32]), pa[kk], db);
        }
    fr_wgmma::commit();
    fr_wgmma::wait<0>();
    fr_wgmma::pin(of);
}

/* The mainline mla_kernel's walk (splits, paged then unpaged tiles, the query form
 * switch, partials or finished rows) over the wgmma tile. The differences: the
 * swizzled layouts, and the proxy fence after every shared-memory write a wgmma
 * reads (cp.async'd pages, dequantized tiles, unpaged rows, the queries). */
template <int DC, int DR, int KIND> __global__ void __launch_bounds__(kThreads, 1) mla_wgmma_kernel(Params P)
{
    using G = Geo<DC, DR, KIND>;
    using W = GeoW<DC, DR, KIND>;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    uint8_t *smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
    uint16_t *QA = reinterpret_cast<uint16_t *>(smem + W::QA_OFF), *QB = reinterpret_cast<uint16_t *>(smem + W::QB_OFF);
    uint16_t *KT = reinterpret_cast<uint16_t *>(smem + W::KT_OFF);
    uint8_t *ST = smem + W::ST_OFF;
    float *SX = reinterpret_cast<float *>(smem + W::SX_OFF);
    int *TOK = reinterpret_cast<int *>(smem + W::TOK_OFF);

    const int split = blockIdx.x, group = blockIdx.y;
    const fr_paged_seq s = P.seqs[blockIdx.z];
    if (s.n_new <= 0 || group * kRows >= s.n_new * P.n_heads) return;
    int lim[2];
    lane_limits(P, s, group, lim);
    const Unpaged u = unpaged_of(P, s);
    const Walk wk = walk_of(P, s, u, split, group);
    const int pt0 = wk.pt0, pt1 = wk.pt1, n_ut = wk.n_ut;

    const bool paged_terms = G::FP4 && fp4_terms(P);
    const bool unpaged_terms = G::FP4 && fp4_terms(P) && !P.sink_recent;
    bool terms = pt1 > pt0 ? paged_terms : unpaged_terms;
    if (pt1 > pt0) issue_paged<DC, DR, KIND, TLay>(P, s, pt0, KT, ST);
    prep_queries<DC, DR, KIND, QLay, QLay>(P, s, group, terms, QA, QB);

    Acc<DC> acc;
    acc_init(acc);

    const int n_tiles = pt1 - pt0 + n_ut;
    for (int it = 0; it < n_tiles; it++) {
        const bool paged = it < pt1 - pt0;
        cp_async_wait_all();
        fr_wgmma::fence_smem_for_async();
        __syncthreads();   /* the tile's copy landed everywhere; the last tile's wgmmas were waited for */
        const int buf = it & 1;
        if (it + 1 < pt1 - pt0)
            issue_paged<DC, DR, KIND, TLay>(P, s, pt0 + it + 1,
                                            KT + (KIND == kBF16 ? (buf ^ 1) * W::KT_BYTES / 2 : 0),
                                            ST + (buf ^ 1) * G::RAW);
        uint16_t *kt = KT + (KIND == kBF16 && paged ? buf * W::KT_BYTES / 2 : 0);
        if (paged) {
            if (KIND != kBF16) dequant_tile<DC, DR, KIND, TLay>(ST + buf * G::RAW, kt);
        } else {
            if (KIND == kBF16) kt = KT + buf * W::KT_BYTES / 2;
            if (terms != unpaged_terms) {
                terms = unpaged_terms;
                prep_queries<DC, DR, KIND, QLay, QLay>(P, s, group, terms, QA, QB);
            }
            load_unpaged<DC, DR, KIND, TLay>(P, s, u, it - (pt1 - pt0), kt, TOK);
        }
        fr_wgmma::fence_smem_for_async();
        __syncthreads();
        const bool dual = G::FP4 && terms && P.q_mode == FR_Q_DUAL;
        if (paged) {
            const int t0 = (pt0 + it) * kTile;
            const bool sink_masked = P.sink_recent && G::FP4;
            tile_step_wg<DC, DR, KIND>(P, QA, QB, dual, kt, SX, lim, acc, [&](int n, int lm) {
                const int t = t0 + n;
                return t > lm || (sink_masked && t < kSink);
            });
        } else {
            tile_step_wg<DC, DR, KIND>(P, QA, QB, dual, kt, SX, lim, acc, [&](int n, int lm) { return TOK[n] > lm; });
        }
    }

    finish_walk<DC, KIND>(P, s, split, group, acc, smem);
}

#undef FR_WK

}   // namespace fr_mla_wg

#endif
