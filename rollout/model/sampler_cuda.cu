/* The GPU token sampler: see sampler_cuda.h for the contract and
 * docs/sampling.md for the rules it shares with the CPU sampler.
 *
 * One block of 1024 threads per row. Every pass over a row reads it with
 * 16-byte loads; each thread visits its elements in a fixed order and every
 * reduction has a fixed shape, so results do not depend on scheduling.
 *
 *   pass A   NaN check, +inf count, argmax (largest logit, lowest id).
 *   pass B   z = x / t and w = exp(z - zmax) in double for U, the tokens
 *            within 36.75 nats of the best (the rest have w < 2^-53: they
 *            change neither a running sum that holds the best token's 1 nor
 *            the log-prob beyond 1e-11); the log-prob's sum over U; and for
 *            sampling rows a histogram of U over 2048 bins of xmax - x: a
 *            count per bin and, when the row may need it, the exact sum of
 *            the weights as 128-bit fixed point (w * 2^106 is an integer for
 *            every w >= 2^-54, so these sums are exact and order-free).
 *   greedy   the argmax; done.
 *   exact    when the candidates (top-k of U, or all of U) number at most
 *            kCap: gather them into shared memory, sort them (bitonic, on
 *            key = logit bits << 32 | ~id), and let one thread run the CPU's
 *            loops on the sorted weights: the same additions in the same
 *            order, so the same running sums.
 *   large    otherwise: each cut (top-k by count, top-p by mass, the draw by
 *            mass) is located with the histogram, then narrowed inside its
 *            bin by histograms over logit-key sub-ranges until at most kCap
 *            tokens remain (or one logit value, whose equal weights are
 *            handled arithmetically and whose j-th token in id order is found
 *            by a ballot scan); those are sorted and summed in order,
 *            starting from the exact mass before them.
 *
 * Keys: a logit's float bits mapped so that unsigned order is numeric order
 * (-0 and +0 both map to +0's key, as the CPU compares them equal). The rank
 * order of the CPU sampler (logit descending, lower id first) is descending
 * order of key << 32 | (0xffffffff - id).
 */
#include "rollout/model/sampler_cuda.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention/cuda_check.h"

extern "C" {
#include "rollout/model/sampler.h"
}

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2 * kThreads;            /* histogram bins; two per thread in scans */
constexpr int kCap = FR_SAMPLER_GPU_EXACT_MAX; /* tokens sorted in shared memory at once */
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxVocab = 1 << 21;             /* 2^21 weights <= 1 at 2^106 fit in 128 bits */

/* U: a = z - zmax >= kSigA. exp(-36.75) = 1.0957e-16 < 2^-53 = 1.1102e-16,
 * so every token outside U weighs less than half an ulp of any sum >= 1, on
 * the CPU as here. The cheap prefilter (xmax - x) > kSigDist * t implies
 * a < kSigA with a wide margin for the roundings of z and zmax. */
constexpr double kSigA = -36.75;
constexpr double kSigDist = 37.0;

constexpr uint32_t kNoKey = 0;   /* no non-NaN float has key 0 */
constexpr uint32_t kPosInfKey = 0xff800000u;

static_assert(kBins == 2 * kThreads, "hist_find gives each thread two bins");
static_assert((kCap & (kCap - 1)) == 0, "the bitonic sort needs a power of two");

/* Dynamic shared memory: two histograms (count, 128-bit mass), the window. */
constexpr size_t kSmemBytes = (size_t)kBins * (2 * sizeof(unsigned) + 4 * sizeof(unsigned long long)) +
                              (size_t)kCap * (sizeof(unsigned long long) + sizeof(double));

/* ---- small helpers ------------------------------------------------------ */

__device__ __forceinline__ uint32_t fkey(float x)
{
    uint32_t b = __float_as_uint(x);
    if ((b & 0x7fffffffu) == 0) b = 0;   /* -0 sorts with +0 */
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float kfloat(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* fr_philox_uniform, bit for bit (rollout/model/philox.c). */
__device__ __forceinline__ float philox_uniform(uint64_t seed, uint64_t sequence, uint64_t step)
{
    uint32_t c0 = (uint32_t)step, c1 = (uint32_t)(step >> 32);
    uint32_t c2 = (uint32_t)sequence, c3 = (uint32_t)(sequence >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; round++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return (float)(c0 >> 8) * 0x1p-24f;
}

/* 128-bit unsigned fixed point, value * 2^-106. */
struct U128 {
    unsigned long long lo, hi;
};

__device__ __forceinline__ U128 u128_add(U128 a, U128 b)
{
    U128 r;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
    return r;
}

__device__ __forceinline__ U128 u128_mul(U128 a, unsigned long long k)
{
    U128 r;
    r.lo = a.lo * k;
    r.hi = __umul64hi(a.lo, k) + a.hi * k;
    return r;
}

__device__ __forceinline__ double u128_to_double(unsigned long long lo, unsigned long long hi)
{
    double v = __dadd_rn(__dmul_rn(__ull2double_rn(hi), 0x1p64), __ull2double_rn(lo));
    return __dmul_rn(v, 0x1p-106);
}

/* w * 2^106 exactly, for 2^-54 <= w <= 1 (every weight in U). */
__device__ __forceinline__ U128 mass_of(double w)
{
    unsigned long long bits = (unsigned long long)__double_as_longlong(w);
    int e = (int)((bits >> 52) & 0x7ff);
    unsigned long long m = (bits & ((1ull << 52) - 1)) | (1ull << 52);
    int sh = e - 969;   /* w = m * 2^(e - 1075); times 2^106 */
    U128 r;
    if (e == 0) {       /* zero (never in U) */
        r.lo = r.hi = 0;
    } else if (sh <= 0) {
        r.lo = sh > -64 ? m >> -sh : 0;
        r.hi = 0;
    } else {
        r.lo = sh < 64 ? m << sh : 0;
        r.hi = sh < 64 ? m >> (64 - sh) : m << (sh - 64);
    }
    return r;
}

/* ---- block-wide building blocks (every thread of the block calls them) ---- */

struct Acc {   /* a token count and a 128-bit mass */
    unsigned long long cnt, lo, hi;
};

__device__ __forceinline__ Acc acc_add(const Acc &a, const Acc &b)
{
    Acc r;
    r.cnt = a.cnt + b.cnt;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
    return r;
}

__device__ __forceinline__ Acc acc_shfl_up(const Acc &a, int d)
{
    Acc r;
    r.cnt = __shfl_up_sync(kFull, a.cnt, d);
    r.lo = __shfl_up_sync(kFull, a.lo, d);
    r.hi = __shfl_up_sync(kFull, a.hi, d);
    return r;
}

struct Found {   /* a histogram bin and everything ranked before it */
    int bin;
    Acc before;
};

struct Scratch {
    double red_d[kWarps];
    unsigned long long red_u64[kWarps];
    int red_i[kWarps];
    unsigned red_u[kWarps];
    Acc scan[kWarps];
    Acc before;
    int found, last;
    int n;                 /* gather slots taken */
    uint32_t pick_key;     /* thread 0's choices, broadcast */
    double pick_s;
    int pick_id;
    U128 pick_mass;
    int nth_cnt[kWarps];
    int nth_warp, nth_rem, nth_id;
};

template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T *red)
{
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(kFull, v, o));
    __syncthreads();   /* the previous reduction has read red[0] */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = red[threadIdx.x];
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(kFull, v, o));
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

struct OpAdd {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct OpMin {
    template <typename T> __device__ T operator()(T a, T b) const { return b < a ? b : a; }
};
struct OpMax {
    template <typename T> __device__ T operator()(T a, T b) const { return b > a ? b : a; }
};

/* Exclusive prefix of v over the block in thread order. */
__device__ Acc block_exscan(const Acc &v, Acc *wt)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    Acc inc = v;
    for (int d = 1; d < 32; d <<= 1) {
        Acc o = acc_shfl_up(inc, d);
        if (lane >= d) inc = acc_add(o, inc);
    }
    Acc ex = acc_shfl_up(inc, 1);
    if (lane == 0) ex = Acc{0, 0, 0};
    __syncthreads();
    if (lane == 31) wt[w] = inc;
    __syncthreads();
    if (w == 0) {
        Acc ti = wt[lane];
        for (int d = 1; d < 32; d <<= 1) {
            Acc o = acc_shfl_up(ti, d);
            if (lane >= d) ti = acc_add(o, ti);
        }
        Acc te = acc_shfl_up(ti, 1);
        if (lane == 0) te = Acc{0, 0, 0};
        wt[lane] = te;
    }
    __syncthreads();
    Acc r = acc_add(wt[w], ex);
    __syncthreads();
    return r;
}

/* Calls f(x, id) for every element of row, each thread in a fixed order. */
template <typename F>
__device__ __forceinline__ void for_each(const float *__restrict__ row, int V, F &&f)
{
    if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        const float4 *r4 = reinterpret_cast<const float4 *>(row);
        const int n4 = V >> 2;
        int i = threadIdx.x;
        for (; i + 3 * kThreads < n4; i += 4 * kThreads) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = __ldg(r4 + i + u * kThreads);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int id = 4 * (i + u * kThreads);
                f(v[u].x, id);
                f(v[u].y, id + 1);
                f(v[u].z, id + 2);
                f(v[u].w, id + 3);
            }
        }
        for (; i < n4; i += kThreads) {
            float4 v = __ldg(r4 + i);
            f(v.x, 4 * i);
            f(v.y, 4 * i + 1);
            f(v.z, 4 * i + 2);
            f(v.w, 4 * i + 3);
        }
        for (int j = 4 * n4 + (int)threadIdx.x; j < V; j += kThreads) f(__ldg(row + j), j);
    } else {
        for (int j = threadIdx.x; j < V; j += kThreads) f(__ldg(row + j), j);
    }
}

/* ---- the row being sampled ---------------------------------------------- */

struct Ctx {   /* block-uniform */
    const float *row;
    int V;
    double t;         /* temperature applied (1 when greedy) */
    bool t_is_one;    /* x / 1.0 == x: skip the division */
    double zmax;      /* xmax / t */
    float xmax;
    double scale0;    /* level-0 bins per unit of xmax - x */
    uint32_t lkey;    /* smallest key in U */
    bool with_mass;   /* the level-0 histogram holds masses */
};

/* The CPU's scaled(): (double)x / t, correctly rounded. */
__device__ __forceinline__ double scaled(const Ctx &c, float x)
{
    return c.t_is_one ? (double)x : __ddiv_rn((double)x, c.t);
}

/* The CPU's weight_at() for a finite row. */
__device__ __forceinline__ double weight_of(const Ctx &c, float x)
{
    return exp(__dsub_rn(scaled(c, x), c.zmax));
}

/* Level-0 bin: nondecreasing as x decreases, so a bin is a range of logits
 * and ties share a bin. */
__device__ __forceinline__ int bin0_from_dist(const Ctx &c, double dist)
{
    double f = __dmul_rn(dist, c.scale0);
    return f >= (double)(kBins - 1) ? kBins - 1 : (int)f;
}

__device__ __forceinline__ int bin0_of(const Ctx &c, float x)
{
    return bin0_from_dist(c, __dsub_rn((double)c.xmax, (double)x));
}

/* Tokens with klo <= key <= khi, at key == ktie only ids <= idmax, and when
 * blo >= 0 only level-0 bins blo..bhi. */
struct Pred {
    uint32_t klo, khi, ktie;
    int idmax;
    int blo, bhi;
};

__device__ __forceinline__ bool pred_ok(const Ctx &c, const Pred &p, float x, uint32_t key, int id)
{
    if (key < p.klo || key > p.khi) return false;
    if (key == p.ktie && id > p.idmax) return false;
    if (p.blo >= 0) {
        int b = bin0_of(c, x);
        if (b < p.blo || b > p.bhi) return false;
    }
    return true;
}

struct Smem {
    unsigned *h0cnt, *h1cnt;
    unsigned long long *h0lo, *h0hi, *h1lo, *h1hi;
    unsigned long long *wkey;   /* window keys, best first once sorted */
    double *ww;                 /* their weights, then running sums */
};

__device__ void hist_zero(unsigned *hc, unsigned long long *hlo, unsigned long long *hhi)
{
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
        hc[b] = 0;
        hlo[b] = 0;
        hhi[b] = 0;
    }
    __syncthreads();
}

/* A thread's run of tokens in one bin, added to the histogram at once. */
struct Run {
    int bin;
    unsigned cnt;
    U128 m;
};

__device__ __forceinline__ void run_flush(Run &r, unsigned *hc, unsigned long long *hlo,
                                          unsigned long long *hhi)
{
    if (r.bin < 0) return;
    atomicAdd(&hc[r.bin], r.cnt);
    if (r.m.lo | r.m.hi) {
        unsigned long long old = atomicAdd(&hlo[r.bin], r.m.lo);
        unsigned long long carry = old + r.m.lo < old ? 1ull : 0ull;
        if (r.m.hi + carry) atomicAdd(&hhi[r.bin], r.m.hi + carry);
    }
    r.bin = -1;
    r.cnt = 0;
    r.m.lo = r.m.hi = 0;
}

__device__ __forceinline__ void run_add(Run &r, int bin, U128 m, unsigned *hc, unsigned long long *hlo,
                                        unsigned long long *hhi)
{
    if (bin != r.bin) {
        run_flush(r, hc, hlo, hhi);
        r.bin = bin;
    }
    r.cnt++;
    r.m = u128_add(r.m, m);
}

enum { kModeCount = 0, kModeGE = 1, kModeGT = 2 };

__device__ __forceinline__ bool crosses(const Acc &a, int mode, unsigned long long k, double thr)
{
    if (mode == kModeCount) return a.cnt >= k;
    double m = u128_to_double(a.lo, a.hi);
    return mode == kModeGE ? m >= thr : m > thr;
}

/* The first bin b <= bmax at which base + (bins 0..b) reaches the threshold:
 * count >= k, or mass >= / > thr. None (rounding at the very end): the last
 * nonempty bin <= bmax. bin -1: the histogram is empty up to bmax. */
__device__ Found hist_find(const unsigned *hc, const unsigned long long *hlo, const unsigned long long *hhi,
                           const Acc &base, int mode, unsigned long long k, double thr, int bmax,
                           Scratch &sh)
{
    const int b0 = 2 * threadIdx.x, b1 = b0 + 1;
    const Acc a0 = {hc[b0], hlo[b0], hhi[b0]}, a1 = {hc[b1], hlo[b1], hhi[b1]};
    const Acc ex = acc_add(base, block_exscan(acc_add(a0, a1), sh.scan));
    const Acc c0 = acc_add(ex, a0), c1 = acc_add(c0, a1);
    if (threadIdx.x == 0) {
        sh.found = INT_MAX;
        sh.last = -1;
    }
    __syncthreads();
    if (b0 <= bmax && crosses(c0, mode, k, thr))
        atomicMin(&sh.found, b0);
    else if (b1 <= bmax && crosses(c1, mode, k, thr))
        atomicMin(&sh.found, b1);
    if (b1 <= bmax && a1.cnt)
        atomicMax(&sh.last, b1);
    else if (b0 <= bmax && a0.cnt)
        atomicMax(&sh.last, b0);
    __syncthreads();
    const int b = sh.found != INT_MAX ? sh.found : sh.last;
    if (b >= 0 && (b >> 1) == (int)threadIdx.x) sh.before = (b & 1) ? c0 : ex;
    __syncthreads();
    Found f;
    f.bin = b;
    f.before = sh.before;
    __syncthreads();
    return f;
}

/* Histogram of the tokens satisfying p over kBins equal ranges of keys
 * [hklo, hkhi] (p must lie inside it), with masses when `mass`. Bin 0 holds
 * the largest keys, so bins run in rank order as at level 0. */
__device__ void hist_keys(const Ctx &c, const Pred &p, uint32_t hklo, uint32_t hkhi, bool mass,
                          unsigned *hc, unsigned long long *hlo, unsigned long long *hhi)
{
    hist_zero(hc, hlo, hhi);
    const unsigned long long span = (unsigned long long)(hkhi - hklo) + 1;
    Run run = {-1, 0, {0, 0}};
    for_each(c.row, c.V, [&](float x, int id) {
        uint32_t key = fkey(x);
        if (!pred_ok(c, p, x, key, id)) return;
        int b = (int)(((unsigned long long)(hkhi - key) * kBins) / span);
        U128 m = {0, 0};
        if (mass) m = mass_of(weight_of(c, x));
        run_add(run, b, m, hc, hlo, hhi);
    });
    run_flush(run, hc, hlo, hhi);
    __syncthreads();
}

/* The keys of bin b of hist_keys(.., hklo, hkhi, ..): those with
 * floor((hkhi - key) * kBins / span) == b. */
__device__ __forceinline__ void sub_range(uint32_t hklo, uint32_t hkhi, int b, uint32_t *lo, uint32_t *hi)
{
    const unsigned long long span = (unsigned long long)(hkhi - hklo) + 1;
    const unsigned long long first = ((unsigned long long)b * span + kBins - 1) / kBins;
    const unsigned long long next = ((unsigned long long)(b + 1) * span + kBins - 1) / kBins;
    *lo = hkhi - (uint32_t)(next - 1);
    *hi = hkhi - (uint32_t)first;
}

/* Sorts keys[0..n) descending (n <= kCap). */
__device__ void sort_desc(unsigned long long *keys, int n)
{
    int P = 1;
    while (P < n) P <<= 1;
    for (int i = n + threadIdx.x; i < P; i += kThreads) keys[i] = 0;
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < (P >> 1); i += kThreads) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const unsigned long long a = keys[lo], b = keys[hi];
                const bool desc = (lo & size) == 0;
                if ((a < b) == desc) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ uint32_t wkey_key(unsigned long long k) { return (uint32_t)(k >> 32); }
__device__ __forceinline__ int wkey_id(unsigned long long k) { return (int)(0xffffffffu - (uint32_t)k); }

struct Window {
    int count;           /* tokens satisfying the predicate */
    uint32_t kmin, kmax; /* their smallest and largest keys */
};

/* Counts the tokens satisfying p and finds their key range; when there are at
 * most kCap, leaves them in m.wkey sorted best first with their weights in
 * m.ww. */
__device__ Window gather(const Ctx &c, const Pred &p, const Smem &m, Scratch &sh)
{
    if (threadIdx.x == 0) sh.n = 0;
    __syncthreads();
    int cnt = 0;
    uint32_t kmin = 0xffffffffu, kmax = 0;
    for_each(c.row, c.V, [&](float x, int id) {
        uint32_t key = fkey(x);
        if (!pred_ok(c, p, x, key, id)) return;
        cnt++;
        kmin = min(kmin, key);
        kmax = max(kmax, key);
        int slot = atomicAdd(&sh.n, 1);
        if (slot < kCap)
            m.wkey[slot] = ((unsigned long long)key << 32) | (unsigned long long)(0xffffffffu - (uint32_t)id);
    });
    Window w;
    w.count = block_reduce(cnt, OpAdd(), sh.red_i);
    w.kmin = block_reduce(kmin, OpMin(), sh.red_u);
    w.kmax = block_reduce(kmax, OpMax(), sh.red_u);
    if (w.count > 0 && w.count <= kCap) {
        sort_desc(m.wkey, w.count);
        for (int i = threadIdx.x; i < w.count; i += kThreads) m.ww[i] = weight_of(c, kfloat(wkey_key(m.wkey[i])));
        __syncthreads();
    }
    return w;
}

/* The id of the j-th token (0-based, in id order) whose key is `key`, or -1.
 * Warp w scans ids [w * seg, (w + 1) * seg) in order with ballots. */
__device__ int nth_with_key(const Ctx &c, uint32_t key, int j, Scratch &sh)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int seg = ((c.V + kWarps - 1) / kWarps + 31) & ~31;
    const int beg = w * seg, end = min(c.V, beg + seg);
    int cnt = 0;
    for (int base = beg; base < end; base += 32) {
        const int i = base + lane;
        cnt += __popc(__ballot_sync(kFull, i < end && fkey(c.row[i]) == key));
    }
    if (lane == 0) sh.nth_cnt[w] = cnt;
    __syncthreads();
    if (threadIdx.x == 0) {
        sh.nth_warp = -1;
        sh.nth_id = -1;
        int acc = 0;
        for (int q = 0; q < kWarps; q++) {
            if (j >= acc && j < acc + sh.nth_cnt[q]) {
                sh.nth_warp = q;
                sh.nth_rem = j - acc;
                break;
            }
            acc += sh.nth_cnt[q];
        }
    }
    __syncthreads();
    if (w == sh.nth_warp) {
        int rem = sh.nth_rem;
        for (int base = beg; base < end; base += 32) {
            const int i = base + lane;
            unsigned b = __ballot_sync(kFull, i < end && fkey(c.row[i]) == key);
            const int pc = __popc(b);
            if (rem < pc) {
                for (int q = 0; q < rem; q++) b &= b - 1;
                if (lane == 0) sh.nth_id = base + __ffs(b) - 1;
                break;
            }
            rem -= pc;
        }
    }
    __syncthreads();
    const int id = sh.nth_id;
    __syncthreads();
    return id;
}

/* ---- sampling a finite row ---------------------------------------------- */

/* fr_sample's draw() on the sorted candidates m.wkey[0..n) with weights
 * m.ww: the same additions in the same order, by one thread. */
__device__ int exact_choice(int n, float top_p, float u, const Smem &m, Scratch &sh)
{
    if (threadIdx.x == 0) {
        double *s = m.ww;
        double total_k = 0.0;
        for (int i = 0; i < n; i++) {
            total_k += s[i];
            s[i] = total_k;   /* s[i] is every later loop's running sum at i */
        }
        const double nucleus_mass = (double)top_p * total_k;
        int kept = 0;
        while (kept < n) {
            const double total = s[kept++];
            if (total >= nucleus_mass) break;
        }
        const double target = (double)u * s[kept - 1];
        int pick = kept - 1;
        for (int i = 0; i < kept; i++)
            if (s[i] > target) {
                pick = i;
                break;
            }
        sh.pick_id = wkey_id(m.wkey[pick]);
    }
    __syncthreads();
    const int id = sh.pick_id;
    __syncthreads();
    return id;
}

struct Pick {
    int id;     /* -1: failed */
    double s;   /* running sum at the pick */
};

/* The first of the sorted window m.wkey[0..n) at which the running sum,
 * starting from `before`, reaches thr (>= or >); the last one if none does. */
__device__ Pick walk_window(int n, double before, double thr, int mode, const Smem &m, Scratch &sh)
{
    if (threadIdx.x == 0) {
        double s = before;
        int pick = n - 1;
        for (int i = 0; i < n; i++) {
            s += m.ww[i];
            if (mode == kModeGE ? s >= thr : s > thr) {
                pick = i;
                break;
            }
        }
        sh.pick_id = wkey_id(m.wkey[pick]);
        sh.pick_s = s;
    }
    __syncthreads();
    Pick p = {sh.pick_id, sh.pick_s};
    __syncthreads();
    return p;
}

/* The same for `count` tokens of one logit (equal weights w), in id order. */
__device__ Pick walk_ties(const Ctx &c, uint32_t key, int count, double before, double thr, int mode,
                          Scratch &sh)
{
    const double w = weight_of(c, kfloat(key));
    const double q = __ddiv_rn(__dsub_rn(thr, before), w);   /* first j with before + (j+1) w past thr */
    double j = mode == kModeGE ? ceil(q) - 1.0 : floor(q);
    if (!(j >= 0.0)) j = 0.0;
    if (j > (double)(count - 1)) j = (double)(count - 1);
    const int ji = (int)j;
    Pick p;
    p.id = nth_with_key(c, key, ji, sh);
    p.s = __dadd_rn(before, __dmul_rn((double)(ji + 1), w));
    return p;
}

/* The top-k cut: the candidates are the tokens ranked at or above (key, id). */
struct Cut {
    bool on;
    uint32_t key;   /* the k-th token's key ... */
    int id;         /* ... and id */
    U128 mass;      /* exact mass of the top k (when the histogram has masses) */
    bool ok;
};

/* The candidates: all of U, or the top k when the cut is on. */
__device__ __forceinline__ Pred cand_pred(const Ctx &c, const Cut &cut)
{
    Pred p;
    p.klo = cut.on ? cut.key : c.lkey;
    p.khi = 0xffffffffu;
    p.ktie = cut.on ? cut.key : kNoKey;
    p.idmax = cut.on ? cut.id : INT_MAX;
    p.blo = p.bhi = -1;
    return p;
}

/* The k-th token of U in rank order (1 <= k < |U|), by counts: the level-0
 * bin that holds it, then sub-ranges of keys, until the window is small
 * enough to sort or is a single logit. */
__device__ Cut rank_cut(const Ctx &c, int k, const Smem &m, Scratch &sh)
{
    Cut cut = {true, 0, 0, {0, 0}, false};
    const Acc zero = {0, 0, 0};
    Found f = hist_find(m.h0cnt, m.h0lo, m.h0hi, zero, kModeCount, (unsigned long long)k, 0.0, kBins - 1, sh);
    if (f.bin < 0) return cut;
    Acc before = f.before;
    Pred p = {c.lkey, 0xffffffffu, kNoKey, INT_MAX, f.bin, f.bin};
    Window w = gather(c, p, m, sh);
    for (int level = 0; level < 8; level++) {
        const int r = k - (int)before.cnt;   /* the cut is the r-th token of the window */
        if (w.count <= 0 || r < 1 || r > w.count) return cut;
        if (w.count <= kCap) {
            if (threadIdx.x == 0) {
                U128 mass = {before.lo, before.hi};
                if (c.with_mass)
                    for (int i = 0; i < r; i++) mass = u128_add(mass, mass_of(m.ww[i]));
                sh.pick_mass = mass;
                sh.pick_id = wkey_id(m.wkey[r - 1]);
                sh.pick_key = wkey_key(m.wkey[r - 1]);
            }
            __syncthreads();
            cut.key = sh.pick_key;
            cut.id = sh.pick_id;
            cut.mass = sh.pick_mass;
            cut.ok = true;
            __syncthreads();
            return cut;
        }
        if (w.kmin == w.kmax) {   /* all ties: the r-th in id order */
            cut.key = w.kmin;
            cut.id = nth_with_key(c, w.kmin, r - 1, sh);
            U128 mass = {before.lo, before.hi};
            if (c.with_mass) mass = u128_add(mass, u128_mul(mass_of(weight_of(c, kfloat(w.kmin))), (unsigned long long)r));
            cut.mass = mass;
            cut.ok = cut.id >= 0;
            return cut;
        }
        Pred hp = {w.kmin, w.kmax, kNoKey, INT_MAX, -1, -1};
        hist_keys(c, hp, w.kmin, w.kmax, c.with_mass, m.h1cnt, m.h1lo, m.h1hi);
        Found g = hist_find(m.h1cnt, m.h1lo, m.h1hi, before, kModeCount, (unsigned long long)k, 0.0, kBins - 1, sh);
        if (g.bin < 0) return cut;
        before = g.before;
        uint32_t lo, hi;
        sub_range(w.kmin, w.kmax, g.bin, &lo, &hi);
        Pred q = {lo, hi, kNoKey, INT_MAX, -1, -1};
        w = gather(c, q, m, sh);
    }
    return cut;
}

/* The first candidate (in rank order) at which the running mass reaches thr
 * (mode >= or >), by masses: level-0 bins up to bmax (the last candidate's),
 * then sub-ranges, then an in-order walk of at most kCap tokens. */
__device__ Pick mass_search(const Ctx &c, const Pred &cand, int bmax, double thr, int mode, const Smem &m,
                            Scratch &sh)
{
    Pick fail = {-1, 0.0};
    const Acc zero = {0, 0, 0};
    Found f = hist_find(m.h0cnt, m.h0lo, m.h0hi, zero, mode, 0, thr, bmax, sh);
    if (f.bin < 0) return fail;
    Acc before = f.before;
    Pred p = cand;
    p.blo = p.bhi = f.bin;
    Window w = gather(c, p, m, sh);
    for (int level = 0; level < 8; level++) {
        if (w.count <= 0) return fail;
        const double bd = u128_to_double(before.lo, before.hi);
        if (w.count <= kCap) return walk_window(w.count, bd, thr, mode, m, sh);
        if (w.kmin == w.kmax) return walk_ties(c, w.kmin, w.count, bd, thr, mode, sh);
        Pred hp = cand;
        hp.klo = max(hp.klo, w.kmin);
        hp.khi = min(hp.khi, w.kmax);
        hp.blo = hp.bhi = -1;
        hist_keys(c, hp, w.kmin, w.kmax, true, m.h1cnt, m.h1lo, m.h1hi);
        Found g = hist_find(m.h1cnt, m.h1lo, m.h1hi, before, mode, 0, thr, kBins - 1, sh);
        if (g.bin < 0) return fail;
        before = g.before;
        uint32_t lo, hi;
        sub_range(w.kmin, w.kmax, g.bin, &lo, &hi);
        Pred q = cand;
        q.klo = max(q.klo, lo);
        q.khi = min(q.khi, hi);
        w = gather(c, q, m, sh);
    }
    return fail;
}

/* Total count and mass of the level-0 histogram. */
__device__ Acc hist_total(const Smem &m, Scratch &sh)
{
    const int b0 = 2 * threadIdx.x, b1 = b0 + 1;
    const Acc mine = acc_add(Acc{m.h0cnt[b0], m.h0lo[b0], m.h0hi[b0]}, Acc{m.h0cnt[b1], m.h0lo[b1], m.h0hi[b1]});
    const Acc ex = block_exscan(mine, sh.scan);
    if (threadIdx.x == kThreads - 1) sh.before = acc_add(ex, mine);
    __syncthreads();
    const Acc t = sh.before;
    __syncthreads();
    return t;
}

/* A sampling row without +inf logits: fr_sample's draw(). nu = |U|. */
__device__ int sample_finite(const Ctx &c, const fr_sample_row &prm, int nu, const Smem &m, Scratch &sh)
{
    const float u = philox_uniform(prm.seed, prm.sequence, prm.step);
    const int k = (prm.top_k > 0 && prm.top_k < nu) ? prm.top_k : nu;
    Cut nocut = {false, 0, 0, {0, 0}, true};
    const Pred all = cand_pred(c, nocut);

    if (k <= kCap) {
        if (k == nu) {   /* all of U */
            Window w = gather(c, all, m, sh);
            if (w.count != k) return -1;
            return exact_choice(k, prm.top_p, u, m, sh);
        }
        /* The top k are in the level-0 bins up to the one holding the k-th;
         * when those fit, sorting them gives the top k directly. */
        const Acc zero = {0, 0, 0};
        Found f = hist_find(m.h0cnt, m.h0lo, m.h0hi, zero, kModeCount, (unsigned long long)k, 0.0, kBins - 1, sh);
        if (f.bin < 0) return -1;
        if (f.before.cnt + m.h0cnt[f.bin] <= (unsigned long long)kCap) {
            Pred p = all;
            p.blo = 0;
            p.bhi = f.bin;
            Window w = gather(c, p, m, sh);
            if (w.count < k || w.count > kCap) return -1;
            return exact_choice(k, prm.top_p, u, m, sh);
        }
        Cut cut = rank_cut(c, k, m, sh);
        if (!cut.ok) return -1;
        Window w = gather(c, cand_pred(c, cut), m, sh);
        if (w.count != k) return -1;
        return exact_choice(k, prm.top_p, u, m, sh);
    }

    /* More than kCap candidates: exact masses locate each cut. */
    Cut cut = nocut;
    U128 mass_k;
    if (k < nu) {
        cut = rank_cut(c, k, m, sh);
        if (!cut.ok) return -1;
        mass_k = cut.mass;
    } else {
        Acc t = hist_total(m, sh);
        mass_k.lo = t.lo;
        mass_k.hi = t.hi;
    }
    const Pred cand = cand_pred(c, cut);
    const int bmax = bin0_of(c, kfloat(cut.on ? cut.key : c.lkey));
    const double total_k = u128_to_double(mass_k.lo, mass_k.hi);
    double W = total_k;
    if (prm.top_p < 1.0f) {
        const double nucleus_mass = (double)prm.top_p * total_k;
        Pick p = mass_search(c, cand, bmax, nucleus_mass, kModeGE, m, sh);
        if (p.id < 0) return -1;
        W = p.s;
    }
    const double target = (double)u * W;
    return mass_search(c, cand, bmax, target, kModeGT, m, sh).id;
}

__device__ __forceinline__ bool params_ok(const fr_sample_row &p)
{
    return !isnan(p.temperature) && !isinf(p.temperature) && p.temperature >= 0.0f && p.top_k >= 0 &&
           p.top_p > 0.0f && p.top_p <= 1.0f;
}

__global__ void __launch_bounds__(kThreads, 1)
sample_kernel(const float *__restrict__ logits, int V, const fr_sample_row *__restrict__ rows,
              int *__restrict__ tokens, float *__restrict__ logprobs)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ Scratch sh;
    Smem m;
    m.h0lo = reinterpret_cast<unsigned long long *>(smem_raw);
    m.h0hi = m.h0lo + kBins;
    m.h1lo = m.h0hi + kBins;
    m.h1hi = m.h1lo + kBins;
    m.wkey = m.h1hi + kBins;
    m.ww = reinterpret_cast<double *>(m.wkey + kCap);
    m.h0cnt = reinterpret_cast<unsigned *>(m.ww + kCap);
    m.h1cnt = m.h0cnt + kBins;

    const int r = blockIdx.x;
    const fr_sample_row prm = rows[r];
    Ctx c;
    c.row = logits + (size_t)r * (size_t)V;
    c.V = V;

    if (!params_ok(prm)) {
        if (threadIdx.x == 0) {
            tokens[r] = -1;
            if (logprobs) logprobs[r] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const bool greedy = prm.temperature == 0.0f;

    /* Pass A. */
    int nan = 0, nposinf = 0;
    unsigned long long best = 0;
    for_each(c.row, V, [&](float x, int id) {
        if (isnan(x)) {
            nan = 1;
            return;
        }
        if (x == -INFINITY) return;
        if (x == INFINITY) nposinf++;
        unsigned long long k = ((unsigned long long)fkey(x) << 32) | (unsigned long long)(0xffffffffu - (uint32_t)id);
        best = max(best, k);
    });
    nan = block_reduce(nan, OpMax(), sh.red_i);
    nposinf = block_reduce(nposinf, OpAdd(), sh.red_i);
    best = block_reduce(best, OpMax(), sh.red_u64);
    if (nan || best == 0) {
        if (threadIdx.x == 0) {
            tokens[r] = -1;
            if (logprobs) logprobs[r] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const int argmax = wkey_id(best);

    if (nposinf > 0) {   /* the +inf tokens share all the probability */
        int tok = argmax;
        if (!greedy) {
            const int k = (prm.top_k > 0 && prm.top_k < nposinf) ? prm.top_k : nposinf;
            const double nucleus_mass = (double)prm.top_p * (double)k;   /* exact */
            double kept = ceil(nucleus_mass);   /* running sums are 1, 2, ...: exact */
            if (kept < 1.0) kept = 1.0;
            if (kept > (double)k) kept = (double)k;
            const double target = (double)philox_uniform(prm.seed, prm.sequence, prm.step) * kept;
            double j = floor(target);   /* first j with j + 1 > target */
            if (j > kept - 1.0) j = kept - 1.0;
            tok = nth_with_key(c, kPosInfKey, (int)j, sh);
        }
        if (threadIdx.x == 0) {
            tokens[r] = tok;
            if (logprobs) logprobs[r] = tok >= 0 ? (float)(-log((double)nposinf)) : __int_as_float(0x7fc00000);
        }
        return;
    }

    /* Pass B. */
    c.xmax = c.row[argmax];
    c.t = greedy ? 1.0 : (double)prm.temperature;
    c.t_is_one = c.t == 1.0;
    c.zmax = scaled(c, c.xmax);
    const double dmax = __dmul_rn(kSigDist, c.t);
    c.scale0 = __ddiv_rn((double)kBins, dmax);
    c.with_mass = !greedy && (prm.top_k == 0 || prm.top_k > kCap);
    if (!greedy) hist_zero(m.h0cnt, m.h0lo, m.h0hi);
    double sum = 0.0;
    int nu = 0;
    uint32_t lkey = 0xffffffffu;
    Run run = {-1, 0, {0, 0}};
    for_each(c.row, V, [&](float x, int id) {
        (void)id;
        if (x == -INFINITY) return;
        const double dist = __dsub_rn((double)c.xmax, (double)x);
        if (dist > dmax) return;
        const double a = __dsub_rn(scaled(c, x), c.zmax);
        if (a < kSigA) return;
        const double w = exp(a);
        sum += w;
        nu++;
        lkey = min(lkey, fkey(x));
        if (!greedy) {
            U128 mass = {0, 0};
            if (c.with_mass) mass = mass_of(w);
            run_add(run, bin0_from_dist(c, dist), mass, m.h0cnt, m.h0lo, m.h0hi);
        }
    });
    if (!greedy) run_flush(run, m.h0cnt, m.h0lo, m.h0hi);
    sum = block_reduce(sum, OpAdd(), sh.red_d);
    nu = block_reduce(nu, OpAdd(), sh.red_i);
    c.lkey = block_reduce(lkey, OpMin(), sh.red_u);   /* also orders the histogram atomics before use */

    const int tok = greedy ? argmax : sample_finite(c, prm, nu, m, sh);
    if (threadIdx.x == 0) {
        tokens[r] = tok;
        if (logprobs) {
            float lp = __int_as_float(0x7fc00000);
            if (tok >= 0 && tok < V)
                lp = __double2float_rn(__dsub_rn(__dsub_rn(scaled(c, c.row[tok]), c.zmax), log(sum)));
            logprobs[r] = lp;
        }
    }
}

__global__ void uniforms_kernel(const fr_sample_row *__restrict__ rows, int n, float *__restrict__ u)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) u[i] = philox_uniform(rows[i].seed, rows[i].sequence, rows[i].step);
}

}  // namespace

struct fr_sampler_gpu {
    int vocab;
    int max_rows;
};

extern "C" fr_status fr_sample_row_check(const fr_sample_row *row, int vocab)
{
    if (!row) return fr_fail(FR_EINVAL, "sample row is NULL");
    const fr_sampling_params p = {row->temperature, row->top_k, row->top_p, row->seed};
    return fr_sampling_params_check(&p, vocab);
}

extern "C" fr_status fr_sampler_gpu_new(int vocab, int max_rows, fr_sampler_gpu **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_sampler_gpu_new: out is NULL");
    if (vocab <= 0 || vocab > kMaxVocab)
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_new: vocab %d must be in [1, %d]", vocab, kMaxVocab);
    if (max_rows <= 0)
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_new: max_rows %d must be positive", max_rows);
    FR_CUDA_TRY(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmemBytes));
    fr_sampler_gpu *s = (fr_sampler_gpu *)calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "fr_sampler_gpu_new: no memory");
    s->vocab = vocab;
    s->max_rows = max_rows;
    *out = s;
    return FR_OK;
}

extern "C" void fr_sampler_gpu_destroy(fr_sampler_gpu **s)
{
    if (!s || !*s) return;
    free(*s);
    *s = NULL;
}

extern "C" fr_status fr_sampler_gpu_sample(fr_sampler_gpu *s, const float *logits, const fr_sample_row *rows_dev,
                                           int rows, int *tokens, float *logprobs, cudaStream_t stream)
{
    if (!s) return fr_fail(FR_EINVAL, "fr_sampler_gpu_sample: sampler is NULL");
    if (rows < 0 || rows > s->max_rows)
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_sample: rows %d outside [0, %d]", rows, s->max_rows);
    if (rows == 0) return FR_OK;
    if (!logits || !rows_dev || !tokens)
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_sample: logits, rows and tokens must not be NULL");
    sample_kernel<<<rows, kThreads, kSmemBytes, stream>>>(logits, s->vocab, rows_dev, tokens, logprobs);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_sampler_gpu_uniforms(const fr_sample_row *rows_dev, int rows, float *u, cudaStream_t stream)
{
    if (rows < 0) return fr_fail(FR_EINVAL, "fr_sampler_gpu_uniforms: rows %d is negative", rows);
    if (rows == 0) return FR_OK;
    if (!rows_dev || !u) return fr_fail(FR_EINVAL, "fr_sampler_gpu_uniforms: rows and u must not be NULL");
    const int threads = 128;
    uniforms_kernel<<<(rows + threads - 1) / threads, threads, 0, stream>>>(rows_dev, rows, u);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}
