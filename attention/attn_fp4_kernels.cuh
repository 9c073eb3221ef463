/* Device side of the FP4/FP8 decode attention (attention/attn_fp4.h,
 * docs/attention_gpu.md "FP4 and FP8 KV: decode"). Three kernels per step:
 *
 *  prep_kernel     the query of every (sequence, KV head) as MMA fragments
 *                  and, without sink/recent, the partial last page
 *                  quantized on the fly (attn_fp4_prep.cuh);
 *  split_kernel    one CTA per (split, KV head, sequence): CTA x = 0 the
 *                  BF16 sink/recent/step tokens (attn_fp4_split_bf16.cuh),
 *                  x >= 1 the pages of one split (FP4: attn_fp4_split_fp4.cuh,
 *                  FP8: attn_fp4_split_fp8.cuh);
 *  combine_kernel  joins the split partials by their base-2 LSE.
 *
 * Included by attn_fp4_cuda.cu only. */
#ifndef FR_ATTN_FP4_KERNELS_CUH
#define FR_ATTN_FP4_KERNELS_CUH

#include <stdint.h>

#include "attn_fp4_common.cuh"
#include "attn_fp4_prep.cuh"
#include "attn_fp4_split_bf16.cuh"
#include "attn_fp4_split_fp4.cuh"
#include "attn_fp4_split_fp8.cuh"

namespace fr_fp4 {

/* ======================= combine ======================= */

/* Query head h of sequence seq: o = sum_i 2^(lse_i - L) o_i / sum_i 2^(lse_i - L) over
 * the n_splits + 1 partials, as BF16, by the THREADS threads of a CTA. At batch 1 a
 * head has up to a few hundred partials, and the time is the latency of their loads:
 * warp w takes partials w, w + W, ..., a lane four dims (one 16-byte load), eight
 * partials in flight, instead of one chain per dim. The W warp sums are added in warp
 * order, so the result depends only on the split count and THREADS (deterministic
 * mode relies on that: its split count is fixed per sequence, and it always runs the
 * combine kernel). Shared memory: w, one weight per partial (n_splits + 1 <=
 * FR_ATTN_FP4_MAX_SPLITS + 1 = 257); red, W floats; part, W x D / 4 float4. (Joining
 * the partials in the last split CTA of each head instead of this kernel was measured
 * slower at every shape: bench/RESULTS.md, "FP4 decode: the combine in the last split
 * CTA".) */
template <int D, int THREADS>
FR_K void combine_head(const Params &P, const fr_paged_seq &s, int seq, int h, float *w, float *red, float4 *part)
{
    static_assert(D == 4 * 32 && D <= THREADS, "a lane sums four dims; a thread writes one");
    constexpr int W = THREADS / 32, kUnroll = 8;
    const int G = P.group, kh = h / G, gi = h % G, slots = P.n_splits + 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t row0 = ((size_t)seq * P.kv.n_kv_heads + kh) * slots * G + gi;
    auto lse_at = [&](int i) { return P.lse_part[row0 + (size_t)i * G]; };
    float mx = kNegInf;
    /* The largest LSE L_max, so that every weight 2^(lse_i - L_max) <= 1 (the sum
     * cannot overflow and the largest partial keeps its precision). */
    for (int i = threadIdx.x; i < slots; i += THREADS) mx = fmaxf(mx, lse_at(i));
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int k = 1; k < W; k++) mx = fmaxf(mx, red[k]);
    /* red is reused for the sums below: every thread must have read the maxima first. */
    __syncthreads();
    float sum = 0.0f;
    for (int i = threadIdx.x; i < slots; i += THREADS) {
        const float l = lse_at(i);
        const float e = (mx == kNegInf || l == kNegInf) ? 0.0f : exp2f(l - mx);
        w[i] = e;
        sum += e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    if (lane == 0) red[warp] = sum;
    __syncthreads();   /* also publishes w[] */
    sum = 0.0f;
#pragma unroll
    for (int k = 0; k < W; k++) sum += red[k];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;

    /* The weighted sum of the partials. A partial of weight 0 (an empty split, or one
     * far below the maximum) is not loaded: at batch 1 many splits of a short
     * sequence are empty. */
    const float4 *src = reinterpret_cast<const float4 *>(P.o_part) + lane;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int i0 = warp; i0 < slots; i0 += W * kUnroll) {
        float4 v[kUnroll];
        float wi[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {   /* loads first, so all of them are in flight */
            const int i = i0 + u * W;
            wi[u] = i < slots ? w[i] : 0.0f;
            const float4 *at = src + (row0 + (size_t)i * G) * (D / 4);
            v[u] = wi[u] != 0.0f ? *at : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            acc.x += wi[u] * v[u].x;
            acc.y += wi[u] * v[u].y;
            acc.z += wi[u] * v[u].z;
            acc.w += wi[u] * v[u].w;
        }
    }
    part[warp * (D / 4) + lane] = acc;
    __syncthreads();
    const int d = threadIdx.x;
    if (d < D) {
        const float *pf = reinterpret_cast<const float *>(part);
        float o = pf[d];
#pragma unroll
        for (int k = 1; k < W; k++) o += pf[k * D + d];
        P.out[((size_t)s.q_row * P.n_heads + h) * D + d] = fr_dev_bf16_encode(o * inv);
    }
}

/* The combine kernel: grid (n_heads, n_seqs), kCombineThreads threads, one query head
 * a CTA, after the split grid (programmatic dependent launch: it may be scheduled
 * while the split grid's last CTAs merge). */
constexpr int kCombineWarps = 8, kCombineThreads = 32 * kCombineWarps;
template <int D> __global__ void __launch_bounds__(kCombineThreads) combine_kernel(Params P)
{
    __shared__ float w[1024];
    __shared__ float red[kCombineWarps];
    __shared__ float4 part[kCombineWarps][D / 4];
    griddep_wait();   /* the split partials are the previous grid's output */
    const int h = blockIdx.x, seq = blockIdx.y;
    const fr_paged_seq s = P.seqs[seq];
    if (s.n_new != 1) return;
    combine_head<D, kCombineThreads>(P, s, seq, h, w, red, &part[0][0]);
}

/* Grid (n_splits + 1, n_kv_heads, n_seqs): x = 0 is the BF16 split (slot n_splits of
 * the partials), x = 1 + i the quantized split i.
 *
 * Template parameters: FMT the cache format; EXACT whether P is quantized (FP4 exact
 * mode; FP8 never); NQ the QK^T n-tiles of the FP8 split and the BF16 CTA (1, 2 or 4,
 * i.e. G up to 4, 8 or 16), from which the FP4 split takes its m-tiles of 8 heads (1
 * or 2); D = 128.
 *
 * Launch bounds: the FP4 variants of one m-tile (G <= 8) and the FP8 variant of one
 * n-tile (G <= 4) are held to five CTAs' registers per SM, 96 registers a thread
 * (65,536 / (5 x 128), rounded down to the allocation step). An FP4 CTA takes 41 KB
 * of shared memory, so five do fit; in whole 64K decode steps five CTAs beat four by
 * 2-3% (bench/RESULTS.md, "K and V halves on their own barriers, five CTAs per SM").
 * FP8's rings (69 KB) let three fit. The variants with more heads per CTA keep more
 * accumulators and are held to two CTAs. Without sink/recent (FP8, vanilla FP4) CTA x
 * = 0 has no tokens but still writes its slot as an empty partial, because the
 * combine reads every slot. */
template <int FMT, bool EXACT, int NQ, int D>
__global__ void __launch_bounds__(kThreads, FMT == kFP8 ? (NQ == 1 ? 5 : 2) : (NQ <= 2 ? 5 : 2)) split_kernel(Params P)
{
    /* One dynamic buffer, sized on the host for the larger of the BF16 CTA and the
     * split body of this variant (split_smem_bytes in attn_fp4_cuda.cu); each body lays
     * out its own regions in it. */
    extern __shared__ __align__(128) uint8_t smem[];
    const int head = blockIdx.y, seq = blockIdx.z;
    const fr_paged_seq s = P.seqs[seq];
    /* Prefill sequences (n_new > 1) and idle graph entries (n_new 0) are not
     * decode's: fr_attn_fp4_prefill serves the former. */
    if (s.n_new != 1) return;
    if (blockIdx.x == 0) {
        using Sm = SmemBf16<NQ, D>;
        if (FMT != kFP8 && P.sink_recent)
            bf16_split<NQ, D>(P, smem, seq, head, s, reinterpret_cast<float *>(smem + Sm::maxbuf),
                              reinterpret_cast<float *>(smem + Sm::lred));
        else
            write_empty(P, ((size_t)seq * P.kv.n_kv_heads + head) * (P.n_splits + 1) + P.n_splits);
    } else if constexpr (FMT == kFP8) {
        fp8_split<NQ, D>(P, smem, seq, head, blockIdx.x - 1, s);
    } else {
        fp4_split_tok<FMT, EXACT, (NQ > 2 ? 2 : 1), D>(P, smem, seq, head, blockIdx.x - 1, s);
    }
}

#undef FR_K

} // namespace fr_fp4

#endif
