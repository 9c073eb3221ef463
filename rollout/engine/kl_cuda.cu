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

template <int NT>
__device__ double block_sum(double v, double *scratch)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < NT / 32 ? scratch[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

/* The largest value and its lowest index (fr_kl_topk's argmax: the first
 * strict maximum). */
template <int NT>
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
        v = lane < NT / 32 ? sv[lane] : -INFINITY;
        i = lane < NT / 32 ? si[lane] : 0x7fffffff;
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
    block_argmax<kThreads>(mp, ip, fscratch, iscratch, &mp, &ip);
    block_argmax<kThreads>(mq, iq, fscratch, iscratch, &mq, &iq);

    /* 2. Log-sum-exps, in double as fr_kl_topk's. */
    double sp = 0.0, sq = 0.0;
    for (int v = t; v < vocab; v += kThreads) {
        sp += exp((double)p[v] - (double)mp);
        sq += exp((double)q[v] - (double)mq);
    }
    const double lse_p = (double)mp + log(block_sum<kThreads>(sp, dscratch));
    const double lse_q = (double)mq + log(block_sum<kThreads>(sq, dscratch));

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
    kl = block_sum<kThreads>(kl, dscratch);
    if (t == 0) {
        const int tok = tokens ? tokens[row] : -1;
        out[row].kl = kl;
        out[row].top1_match = ip == iq;
        out[row].logp_diff = tok >= 0 && tok < vocab ? ((double)q[tok] - lse_q) - ((double)p[tok] - lse_p) : 0.0;
    }
}

/* ---- the split form: several blocks per row ---- */

constexpr int kSliceThreads = 512;
constexpr int kSlice = 4096;      /* logits of one block, at least */
constexpr int kMaxSlices = 64;

/* A slice's maxima (first strict maximum, as block_argmax) and its sums of
 * exp(x - its maximum) in double. */
struct slice_part {
    double sp, sq;
    float mp, mq;
    int ip, iq;
};

/* An inclusive prefix sum of x over the block (scan: NT ints of shared
 * memory); *total receives the block's sum. */
template <int NT>
__device__ int block_scan(int x, int *scan, int *total)
{
    const int t = threadIdx.x;
    __syncthreads();   /* the previous scan's readers are done */
    scan[t] = x;
    __syncthreads();
    for (int o = 1; o < NT; o <<= 1) {
        int add = t >= o ? scan[t - o] : 0;
        __syncthreads();
        scan[t] += add;
        __syncthreads();
    }
    *total = scan[NT - 1];
    return scan[t];
}

/* The k-th largest key of keys(i), i in [0, count) where keys says valid,
 * by radix selection most significant digit first (11, 11 and 10 bits), as
 * kl_topk_kernel's step 3, with the digit found by one warp 32 bins at a
 * time. *greater receives how many keys exceed it. At least k keys must be
 * valid. */
template <int NT, class Keys>
__device__ uint32_t radix_kth(const Keys &keys, int count, int k, int *hist, uint32_t *s_prefix, int *s_remaining,
                              int *s_greater, int *greater)
{
    const int t = threadIdx.x, lane = t % 32;
    __syncthreads();
    if (t == 0) *s_prefix = 0, *s_remaining = k, *s_greater = 0;
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; pass++) {
        const int shift = shifts[pass], bins = 1 << widths[pass];
        for (int b = t; b < bins; b += NT) hist[b] = 0;
        __syncthreads();
        const uint32_t prefix = *s_prefix;
        const uint32_t high_mask = pass == 0 ? 0u : ~((1u << (shift + widths[pass])) - 1u);
        for (int i = t; i < count; i += NT) {
            uint32_t key;
            if (keys(i, &key) && (key & high_mask) == prefix)
                atomicAdd(&hist[(key >> shift) & (uint32_t)(bins - 1)], 1);
        }
        __syncthreads();
        if (t < 32) {
            /* The highest digit d with (keys above d) + hist[d] >= remaining. */
            const int remaining = *s_remaining;
            int acc = 0, found = -1;
            for (int top = bins - 1; top >= 0 && found < 0; top -= 32) {
                const int d = top - lane, h = d >= 0 ? hist[d] : 0;
                int inc = h;
                for (int o = 1; o < 32; o <<= 1) {
                    int y = __shfl_up_sync(0xffffffffu, inc, o);
                    if (lane >= o) inc += y;
                }
                const unsigned hit = __ballot_sync(0xffffffffu, d >= 0 && acc + inc >= remaining);
                if (hit) {
                    const int at = __ffs(hit) - 1;
                    acc += __shfl_sync(0xffffffffu, inc - h, at);
                    found = top - at;
                } else {
                    acc += __shfl_sync(0xffffffffu, inc, 31);
                }
            }
            if (found < 0) {   /* fewer than remaining keys (never with valid input): digit 0, as step 3 */
                found = 0;
                acc -= hist[0];
            }
            if (t == 0) {
                *s_prefix = prefix | ((uint32_t)found << shift);
                *s_remaining = remaining - acc;
                *s_greater += acc;
            }
        }
        __syncthreads();
    }
    *greater = *s_greater;
    return *s_prefix;
}

struct slice_keys {
    const float *p;
    __device__ bool operator()(int i, uint32_t *key) const
    {
        *key = order_key(p[i]);
        return true;
    }
};

/* Candidates of row `row`: slice s holds n[s] token ids at cand[s * kc ...],
 * in id order, slices in id order. */
struct cand_keys {
    const float *p;
    const int *cand, *n;
    int kc;
    __device__ bool operator()(int i, uint32_t *key) const
    {
        const int s = i / kc;
        if (i - s * kc >= n[s]) return false;
        *key = order_key(p[cand[i]]);
        return true;
    }
};

/* Block (s, row): logits [s * slice, (s + 1) * slice) of the row: its
 * maxima and exp sums, and its own top min(k, length) reference tokens
 * (ties at its k-th value by lowest id), in id order. Every token of the
 * row's top k is among the union of these: a token above the row's k-th
 * value has fewer than k tokens at or above it anywhere, so in its slice
 * too; the row's tied tokens taken are the lowest ids at that value, and a
 * slice keeps its lowest tied ids when its own k-th value is the row's. */
__global__ void __launch_bounds__(kSliceThreads) kl_slice_kernel(const float *ref_all, const int *ref_rows,
                                                                 const float *served_all, const int *served_rows,
                                                                 int vocab, int k, int slice, int kc,
                                                                 slice_part *parts, int *cand, int *cand_n)
{
    constexpr int NT = kSliceThreads;
    __shared__ int hist[kBins];
    __shared__ double dscratch[NT / 32];
    __shared__ float fscratch[NT / 32];
    __shared__ int iscratch[NT / 32];
    __shared__ int scan[NT];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining, s_greater;
    const int row = blockIdx.y, s = blockIdx.x, S = gridDim.x, t = threadIdx.x;
    const int lo = s * slice, hi = lo + slice < vocab ? lo + slice : vocab, L = hi - lo;
    const float *p = ref_all + (size_t)ref_rows[row] * vocab;
    const float *q = served_all + (size_t)served_rows[row] * vocab;

    float mp = -INFINITY, mq = -INFINITY;
    int ip = 0x7fffffff, iq = 0x7fffffff;
    for (int v = lo + t; v < hi; v += NT) {
        if (p[v] > mp) mp = p[v], ip = v;
        if (q[v] > mq) mq = q[v], iq = v;
    }
    block_argmax<NT>(mp, ip, fscratch, iscratch, &mp, &ip);
    block_argmax<NT>(mq, iq, fscratch, iscratch, &mq, &iq);
    double sp = 0.0, sq = 0.0;
    for (int v = lo + t; v < hi; v += NT) {
        sp += exp((double)p[v] - (double)mp);
        sq += exp((double)q[v] - (double)mq);
    }
    sp = block_sum<NT>(sp, dscratch);
    sq = block_sum<NT>(sq, dscratch);
    if (t == 0)   /* a slice of -inf alone adds nothing (its sum is NaN) */
        parts[row * S + s] = slice_part{mp == -INFINITY ? 0.0 : sp, mq == -INFINITY ? 0.0 : sq, mp, mq, ip, iq};

    const int kk = k < L ? k : L;
    int greater;
    const uint32_t kth = radix_kth<NT>(slice_keys{p + lo}, L, kk, hist, &s_prefix, &s_remaining, &s_greater, &greater);
    const int need_ties = kk - greater;
    /* Each thread a contiguous run of ids, so thread order is id order. */
    const int chunk = (L + NT - 1) / NT;
    const int a = t * chunk < L ? t * chunk : L, b = a + chunk < L ? a + chunk : L;
    int g = 0, e = 0;
    for (int i = a; i < b; i++) {
        const uint32_t key = order_key(p[lo + i]);
        g += key > kth;
        e += key == kth;
    }
    int total;
    const int ties_before = block_scan<NT>(e, scan, &total) - e;
    int take = need_ties - ties_before;
    take = take < 0 ? 0 : take > e ? e : take;
    int at = block_scan<NT>(g + take, scan, &total) - (g + take);
    int *out = cand + ((size_t)row * S + s) * kc;
    for (int i = a; i < b; i++) {
        const uint32_t key = order_key(p[lo + i]);
        if (key > kth) {
            out[at++] = lo + i;
        } else if (key == kth && take > 0) {
            out[at++] = lo + i;
            take--;
        }
    }
    if (t == 0) cand_n[row * S + s] = kk;
}

/* One block per row: the slices' maxima and sums into log-sum-exps and
 * argmaxes, then the k-th largest reference logit among the candidates and
 * the sum over the top k (candidates are in id order: ties by lowest id). */
__global__ void __launch_bounds__(kThreads) kl_merge_kernel(const float *ref_all, const int *ref_rows,
                                                            const float *served_all, const int *served_rows,
                                                            const int *tokens, int by_served_row, int vocab, int k,
                                                            int S, int kc, const slice_part *parts, const int *cand,
                                                            const int *cand_n, fr_kl_result *out, int *used)
{
    constexpr int NT = kThreads;
    __shared__ int hist[kBins];
    __shared__ double dscratch[NT / 32];
    __shared__ int scan[NT];
    __shared__ uint32_t s_prefix;
    __shared__ int s_remaining, s_greater, s_match;
    __shared__ double s_lse_p, s_lse_q;
    const int row = blockIdx.x, t = threadIdx.x;
    const float *p = ref_all + (size_t)ref_rows[row] * vocab;
    const float *q = served_all + (size_t)served_rows[row] * vocab;
    if (t == 0) {
        const slice_part *pp = parts + (size_t)row * S;
        float bp = -INFINITY, bq = -INFINITY;
        int ip = 0x7fffffff, iq = 0x7fffffff;
        for (int s = 0; s < S; s++) {
            if (pp[s].mp > bp || (pp[s].mp == bp && pp[s].ip < ip)) bp = pp[s].mp, ip = pp[s].ip;
            if (pp[s].mq > bq || (pp[s].mq == bq && pp[s].iq < iq)) bq = pp[s].mq, iq = pp[s].iq;
        }
        double sp = 0.0, sq = 0.0;
        for (int s = 0; s < S; s++) {
            if (pp[s].mp != -INFINITY) sp += pp[s].sp * exp((double)pp[s].mp - (double)bp);
            if (pp[s].mq != -INFINITY) sq += pp[s].sq * exp((double)pp[s].mq - (double)bq);
        }
        s_lse_p = (double)bp + log(sp);
        s_lse_q = (double)bq + log(sq);
        s_match = ip == iq;
    }
    __syncthreads();
    const double lse_p = s_lse_p, lse_q = s_lse_q;
    const int kk = k < vocab ? k : vocab, count = S * kc;
    const int *rc = cand + (size_t)row * S * kc, *rn = cand_n + (size_t)row * S;
    const cand_keys keys{p, rc, rn, kc};
    int greater;
    const uint32_t kth = radix_kth<NT>(keys, count, kk, hist, &s_prefix, &s_remaining, &s_greater, &greater);
    const int need_ties = kk - greater;
    const int chunk = (count + NT - 1) / NT;
    const int a = t * chunk < count ? t * chunk : count, b = a + chunk < count ? a + chunk : count;
    double kl = 0.0;
    int e = 0;
    for (int i = a; i < b; i++) {
        uint32_t key;
        if (!keys(i, &key)) continue;
        if (key > kth) {
            const int v = rc[i];
            const double lp = (double)p[v] - lse_p, lq = (double)q[v] - lse_q;
            kl += exp(lp) * (lp - lq);
        } else if (key == kth) {
            e++;
        }
    }
    int total;
    int rank = block_scan<NT>(e, scan, &total) - e;
    for (int i = a; i < b && rank < need_ties; i++) {
        uint32_t key;
        if (!keys(i, &key) || key != kth) continue;
        const int v = rc[i];
        const double lp = (double)p[v] - lse_p, lq = (double)q[v] - lse_q;
        kl += exp(lp) * (lp - lq);
        rank++;
    }
    kl = block_sum<NT>(kl, dscratch);
    if (t == 0) {
        const int tok = !tokens ? -1 : by_served_row ? tokens[served_rows[row]] : tokens[row];
        out[row].kl = kl;
        out[row].top1_match = s_match;
        out[row].logp_diff = tok >= 0 && tok < vocab ? ((double)q[tok] - lse_q) - ((double)p[tok] - lse_p) : 0.0;
        if (used) used[row] = tok;
    }
}

/* How a row is split: S slices of `slice` logits (at least kSlice, at most
 * kMaxSlices of them), kc candidate slots each. */
void split_of(int vocab, int k, int *S, int *slice, int *kc)
{
    int sl = kSlice;
    if ((vocab + sl - 1) / sl > kMaxSlices) sl = (vocab + kMaxSlices - 1) / kMaxSlices;
    if (sl > vocab) sl = vocab;
    *S = (vocab + sl - 1) / sl;
    *slice = sl;
    *kc = k < sl ? k : sl;
}

size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

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

extern "C" size_t fr_kl_topk_cuda_ws_bytes(int n, int vocab, int k)
{
    if (n < 1 || vocab < 1 || k < 1) return 0;
    int S, slice, kc;
    split_of(vocab, k, &S, &slice, &kc);
    const size_t parts = (size_t)n * S;
    return align_up(sizeof(slice_part) * parts) + align_up(sizeof(int) * parts * (size_t)kc) + sizeof(int) * parts;
}

extern "C" fr_status fr_kl_topk_cuda_split(const float *ref, const int *ref_rows, const float *served,
                                           const int *served_rows, const int *tokens, int tokens_by_served_row, int n,
                                           int vocab, int k, void *ws, size_t ws_bytes, fr_kl_result *out, int *used,
                                           cudaStream_t stream)
{
    if (n < 0 || n > 65535 || vocab < 1 || vocab > (1 << 24) || k < 1)   /* rows are the grid's second dimension */
        return fr_fail(FR_EINVAL, "kl on the GPU: %d rows of %d logits, top %d", n, vocab, k);
    if (n == 0) return FR_OK;
    if (!ref || !ref_rows || !served || !served_rows || !out || !ws)
        return fr_fail(FR_EINVAL, "kl on the GPU: NULL argument");
    const size_t need = fr_kl_topk_cuda_ws_bytes(n, vocab, k);
    if (ws_bytes < need)
        return fr_fail(FR_EINVAL, "kl on the GPU: workspace of %zu bytes, %zu needed", ws_bytes, need);
    int S, slice, kc;
    split_of(vocab, k, &S, &slice, &kc);
    const size_t parts_n = (size_t)n * S;
    char *w = (char *)ws;
    slice_part *parts = (slice_part *)w;
    int *cand = (int *)(w + align_up(sizeof(slice_part) * parts_n));
    int *cand_n = cand + align_up(sizeof(int) * parts_n * (size_t)kc) / sizeof(int);
    kl_slice_kernel<<<dim3((unsigned)S, (unsigned)n), kSliceThreads, 0, stream>>>(ref, ref_rows, served, served_rows,
                                                                                  vocab, k, slice, kc, parts, cand,
                                                                                  cand_n);
    kl_merge_kernel<<<n, kThreads, 0, stream>>>(ref, ref_rows, served, served_rows, tokens, tokens_by_served_row, vocab,
                                                k, S, kc, parts, cand, cand_n, out, used);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "kl on the GPU: launch failed: %s", cudaGetErrorString(e));
    return FR_OK;
}
