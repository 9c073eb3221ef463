#include "rollout/engine/kl_cuda.h"

#include <stdint.h>

namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 2048;   /* radix digits of 11 bits (the last pass uses 10) */

/* Larger float, larger key: the order radix selection works in. */
__device__ __forceinline__ uint32_t order_key(float x)
{
    uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ double block_sum(double v, double *scratch)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < kThreads / 32 ? scratch[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

/* The largest value and its lowest index (fr_kl_topk's argmax: the first
 * strict maximum). */
__device__ void block_argmax(float v, int i, float *sv, int *si, float *out_v, int *out_i)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    if (warp == 0) {
        v = lane < kThreads / 32 ? sv[lane] : -INFINITY;
        i = lane < kThreads / 32 ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
        }
        if (lane == 0) sv[0] = v, si[0] = i;
    }
    __syncthreads();
    *out_v = sv[0];
    *out_i = si[0];
}

__global__ void __launch_bounds__(kThreads) kl_topk_kernel(const float *ref_all, const int *ref_rows,
                                                           const float *served_all, const int *served_rows,
                                                           const int *tokens, int vocab, int k, fr_kl_result *out)
{
    __shared__ int hist[kBins];
    __shared__ double dscratch[kThreads / 32];
    __shared__ float fscratch[kThreads / 32];
    __shared__ int iscratch[kThreads / 32];
    __shared__ int scan[kThreads];
    __shared__ uint32_t sel_prefix;
    __shared__ int sel_remaining, sel_greater;
    const int row = blockIdx.x, t = threadIdx.x;
    const float *p = ref_all + (size_t)ref_rows[row] * vocab;
    const float *q = served_all + (size_t)served_rows[row] * vocab;

    /* 1. Maxima and argmaxes. */
    float mp = -INFINITY, mq = -INFINITY;
    int ip = 0x7fffffff, iq = 0x7fffffff;
    for (int v = t; v < vocab; v += kThreads) {
        if (p[v] > mp) mp = p[v], ip = v;
        if (q[v] > mq) mq = q[v], iq = v;
    }
    block_argmax(mp, ip, fscratch, iscratch, &mp, &ip);
    block_argmax(mq, iq, fscratch, iscratch, &mq, &iq);

    /* 2. Log-sum-exps, in double as fr_kl_topk's. */
    double sp = 0.0, sq = 0.0;
    for (int v = t; v < vocab; v += kThreads) {
        sp += exp((double)p[v] - (double)mp);
        sq += exp((double)q[v] - (double)mq);
    }
    const double lse_p = (double)mp + log(block_sum(sp, dscratch));
    const double lse_q = (double)mq + log(block_sum(sq, dscratch));

    /* 3. The k-th largest reference logit by radix selection, most
     *    significant digit first: 11, 11 and 10 bits. */
    if (k > vocab) k = vocab;
    if (t == 0) sel_prefix = 0, sel_remaining = k, sel_greater = 0;
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; pass++) {
        const int shift = shifts[pass], bins = 1 << widths[pass];
        for (int b = t; b < bins; b += kThreads) hist[b] = 0;
        __syncthreads();
        const uint32_t prefix = sel_prefix;
        const uint32_t high_mask = pass == 0 ? 0u : ~((1u << (shift + widths[pass])) - 1u);
        for (int v = t; v < vocab; v += kThreads) {
            uint32_t key = order_key(p[v]);
            if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & (uint32_t)(bins - 1)], 1);
        }
        __syncthreads();
        if (t == 0) {
            int acc = 0, d = bins - 1;
            for (; d > 0 && acc + hist[d] < sel_remaining; d--) acc += hist[d];
            sel_prefix = prefix | ((uint32_t)d << shift);
            sel_remaining -= acc;
            sel_greater += acc;
        }
        __syncthreads();
    }
    const uint32_t kth = sel_prefix;
    const int need_ties = k - sel_greater;

    /* 4. The sum over keys above the k-th, then the first need_ties tokens
     *    at it in id order: each thread takes a contiguous run of ids, so
     *    thread order is id order for the tie ranks. */
    const int chunk = (vocab + kThreads - 1) / kThreads, lo = t * chunk;
    const int hi = lo + chunk < vocab ? lo + chunk : vocab;
    double kl = 0.0;
    int ties = 0;
    for (int v = lo; v < hi; v++) {
        uint32_t key = order_key(p[v]);
        if (key > kth) {
            double lp = (double)p[v] - lse_p, lq = (double)q[v] - lse_q;
            kl += exp(lp) * (lp - lq);
        } else if (key == kth) {
            ties++;
        }
    }
    scan[t] = ties;
    __syncthreads();
    for (int o = 1; o < kThreads; o <<= 1) {   /* inclusive scan (Hillis-Steele) */
        int add = t >= o ? scan[t - o] : 0;
        __syncthreads();
        scan[t] += add;
        __syncthreads();
    }
    int rank = scan[t] - ties;   /* ties in earlier threads */
    for (int v = lo; v < hi && rank < need_ties; v++)
        if (order_key(p[v]) == kth) {
            double lp = (double)p[v] - lse_p, lq = (double)q[v] - lse_q;
            kl += exp(lp) * (lp - lq);
            rank++;
        }
    kl = block_sum(kl, dscratch);
    if (t == 0) {
        const int tok = tokens ? tokens[row] : -1;
        out[row].kl = kl;
        out[row].top1_match = ip == iq;
        out[row].logp_diff = tok >= 0 && tok < vocab ? ((double)q[tok] - lse_q) - ((double)p[tok] - lse_p) : 0.0;
    }
}

}  // namespace

extern "C" fr_status fr_kl_topk_cuda(const float *ref, const int *ref_rows, const float *served,
                                     const int *served_rows, const int *tokens, int n, int vocab, int k,
                                     fr_kl_result *out, cudaStream_t stream)
{
    if (n < 0 || vocab < 1 || vocab > (1 << 24) || k < 1)
        return fr_fail(FR_EINVAL, "kl on the GPU: %d rows of %d logits, top %d", n, vocab, k);
    if (n == 0) return FR_OK;
    if (!ref || !ref_rows || !served || !served_rows || !out)
        return fr_fail(FR_EINVAL, "kl on the GPU: NULL argument");
    kl_topk_kernel<<<n, kThreads, 0, stream>>>(ref, ref_rows, served, served_rows, tokens, vocab, k, out);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "kl on the GPU: launch failed: %s", cudaGetErrorString(e));
    return FR_OK;
}
