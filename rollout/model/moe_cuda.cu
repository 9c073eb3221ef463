#include "rollout/model/moe_cuda.h"

#include <stdlib.h>

#include <cuda_bf16.h>

#include "attention/attn_fp4_ptx.cuh"

namespace {

constexpr int kMaxExperts = 256, kMaxTopK = 16;
constexpr int kWarps = 4;                 /* warps per expert-GEMM block */
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint16_t to_bf16(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

/* ---- routing -------------------------------------------------------------- */

/* A router's rules (moe_cpu.h's fr_moe_routing, less the bias pointer). */
struct RouteRules {
    int scoring, method, n_group, topk_group, norm;
    float scale;
};

/* Group-limited selection in one warp: lane g < G ranks group g (its best
 * choice, or its two best added under noaux_tc) from the choices the warp
 * left in sh[E]; the topk_group best groups are kept (a tie to the lower
 * group), and every other expert's choice becomes 0.0, as moe_cpu.c does. */
__device__ __forceinline__ void mask_groups(float (&c)[kMaxExperts / 32], const float *sh, int E, const RouteRules &rr)
{
    const int lane = threadIdx.x & 31, G = rr.n_group, per = E / G;
    float rank = -INFINITY;
    if (lane < G) {
        float a = -INFINITY, b = -INFINITY;
        for (int i = 0; i < per; i++) {
            const float v = sh[lane * per + i];
            if (v > a) { b = a; a = v; }
            else if (v > b) b = v;
        }
        rank = rr.method == FR_MOE_NOAUX_TC ? a + b : a;
    }
    unsigned kept = 0;
    for (int j = 0; j < rr.topk_group; j++) {
        float bv = (kept >> lane) & 1u ? -INFINITY : rank;
        int bi = (kept >> lane) & 1u || lane >= G ? 32 : lane;
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(kFull, bv, o);
            const int oi = __shfl_xor_sync(kFull, bi, o);
            if (oi < 32 && (bi == 32 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        kept |= 1u << bi;
    }
#pragma unroll
    for (int i = 0; i < kMaxExperts / 32; i++) {
        const int e = lane + 32 * i;
        if (e < E && !((kept >> (e / per)) & 1u)) c[i] = 0.0f;
    }
}

/* One warp per token: the scores (softmax or sigmoid over the E logits; lane
 * l holds experts l, l + 32, ...), the choices (scores plus the router bias
 * under noaux_tc, the groups not kept masked to 0.0), then k rounds of a
 * warp arg-max of the choices (a tie goes to the lower expert index, as in
 * moe_cpu.c) whose unbiased scores are the weights, renormalized when
 * rr.norm and times rr.scale. */
__global__ void route_kernel(const float *logits, int M, int E, int k, RouteRules rr, const uint16_t *bias, int *ids,
                             float *weights)
{
    __shared__ float sh[4][kMaxExperts];
    const int w = threadIdx.x / 32, t = blockIdx.x * (blockDim.x / 32) + w, lane = threadIdx.x & 31;
    if (t >= M) return;
    float p[kMaxExperts / 32], c[kMaxExperts / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxExperts / 32; i++) {
        const int e = lane + 32 * i;
        p[i] = e < E ? logits[(size_t)t * E + e] : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    if (rr.scoring == FR_MOE_SIGMOID) {
#pragma unroll
        for (int i = 0; i < kMaxExperts / 32; i++)
            p[i] = lane + 32 * i < E ? __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-p[i]))) : 0.0f;
    } else {
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxExperts / 32; i++) {
            p[i] = lane + 32 * i < E ? expf(p[i] - mx) : 0.0f;
            sum += p[i];
        }
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
        const float inv = 1.0f / sum;
#pragma unroll
        for (int i = 0; i < kMaxExperts / 32; i++) p[i] *= inv;
    }
#pragma unroll
    for (int i = 0; i < kMaxExperts / 32; i++) {
        const int e = lane + 32 * i;
        const bool biased = rr.method == FR_MOE_NOAUX_TC && bias && e < E;
        const float b = biased ? __bfloat162float(__ushort_as_bfloat16(bias[e])) : 0.0f;
        c[i] = e < E ? __fadd_rn(p[i], b) : -INFINITY;
        if (e < E) sh[w][e] = c[i];
    }
    __syncwarp();
    if (rr.method != FR_MOE_GREEDY && rr.n_group > 1 && rr.topk_group < rr.n_group) mask_groups(c, sh[w], E, rr);
    float picked = 0.0f, mine = 0.0f;
    for (int j = 0; j < k; j++) {
        float bv = -INFINITY;
        int bi = kMaxExperts;
#pragma unroll
        for (int i = 0; i < kMaxExperts / 32; i++)
            if (c[i] > bv) { bv = c[i]; bi = lane + 32 * i; }
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(kFull, bv, o);
            const int oi = __shfl_xor_sync(kFull, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        float score = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxExperts / 32; i++)
            if (lane + 32 * i == bi) {
                score = p[i];
                c[i] = -INFINITY;   /* taken */
            }
        score = __shfl_sync(kFull, score, bi & 31);
        picked = __fadd_rn(picked, score);
        if (lane == j) mine = score;
        if (lane == 0) ids[(size_t)t * k + j] = bi;
    }
    if (lane < k) {
        const float v = rr.norm ? __fdiv_rn(mine, __fadd_rn(picked, 1e-20f)) : mine;
        weights[(size_t)t * k + lane] = __fmul_rn(v, rr.scale);
    }
}

/* The routes of chosen token rows: out[i][m][k] = the experts MoE layer m
 * (layer layer_of[m]) chose for row rows[i], from the per-layer ids. */
__global__ void routes_kernel(const int *ids, size_t layer_stride, const int *layer_of, int moe_layers, int k,
                              const int *rows, int n, uint16_t *out)
{
    const int total = n * moe_layers * k;
    for (int a = blockIdx.x * blockDim.x + threadIdx.x; a < total; a += gridDim.x * blockDim.x) {
        const int j = a % k, m = (a / k) % moe_layers, i = a / (k * moe_layers);
        out[a] = (uint16_t)ids[(size_t)layer_of[m] * layer_stride + (size_t)rows[i] * k + j];
    }
}

/* One block: counts per expert, their running offsets, and a slot for every
 * token-expert pair (its place among its expert's pairs; the order within an
 * expert is whatever the atomics give, which no token's result depends on). */
__global__ void group_kernel(const int *ids, int n, int k, int E, int *offsets, int *slot_of, int *token_of,
                             int *active)
{
    __shared__ int count[kMaxExperts], cursor[kMaxExperts];
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += blockDim.x) atomicAdd(&count[ids[a]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, used = 0;
        for (int e = 0; e < E; e++) {
            offsets[e] = cursor[e] = run;
            run += count[e];
            used += count[e] > 0;
        }
        offsets[E] = run;
        *active = used;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += blockDim.x) {
        const int s = atomicAdd(&cursor[ids[a]], 1);
        slot_of[a] = s;
        token_of[s] = a / k;
    }
}

/* ---- the experts' products ----------------------------------------------- */

/* The tensor-core MMA is m16n8k16 with the expert's weight rows as M and its
 * tokens as N. A lane loads 16 contiguous bytes (8 values of k) of its two
 * weight rows and of its token, and the first MMA of a 32-wide chunk of k
 * takes values 0-3 of those 8, the second 4-7: the k order inside the MMA is
 * a permutation of memory order, the same for weights and tokens, so the dot
 * products are unchanged and every load is a full 16 bytes. */
struct Frag {
    uint4 a_lo, a_hi;   /* rows g and g + 8 */
};

__device__ __forceinline__ uint4 load16(const uint16_t *p)
{
    return p ? __ldg(reinterpret_cast<const uint4 *>(p)) : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ void mma_chunk(float (&c)[4], const Frag &f, const uint4 &b)
{
    fr_fp4_ptx::mma_bf16(c, f.a_lo.x, f.a_hi.x, f.a_lo.y, f.a_hi.y, b.x, b.y);
    fr_fp4_ptx::mma_bf16(c, f.a_lo.z, f.a_hi.z, f.a_lo.w, f.a_hi.w, b.z, b.w);
}

/* One warp: rows lo (16 x K, two row pointers per lane) against up to 16
 * tokens (two n-tiles: b0 and b1 row pointers, NULL past the expert's
 * tokens), U chunks of 32 in flight. */
template <int U>
__device__ __forceinline__ void warp_dot(const uint16_t *row_lo, const uint16_t *row_hi, const uint16_t *b0,
                                         const uint16_t *b1, int K, float (&c0)[4], float (&c1)[4], bool two)
{
    const int off = (threadIdx.x & 3) * 8;
    for (int kc = 0; kc < K; kc += 32 * U) {
        Frag f[U];
        uint4 x0[U], x1[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = kc + 32 * u + off;
            f[u].a_lo = load16(row_lo + k);
            f[u].a_hi = load16(row_hi + k);
            x0[u] = load16(b0 ? b0 + k : nullptr);
            if (two) x1[u] = load16(b1 ? b1 + k : nullptr);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            mma_chunk(c0, f[u], x0[u]);
            if (two) mma_chunk(c1, f[u], x1[u]);
        }
    }
}

__device__ __forceinline__ float swiglu1(float g, float u)
{
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/* MODE 0: gate|up. Warp w of block x owns h columns i0 = (x * kWarps + w) * 8
 * .. i0 + 7: its MMA rows 0-7 are gate rows i0.., rows 8-15 up rows i0.., so
 * a lane holds gate and up of one column and one token and writes
 * h = silu(gate) * up in BF16. X: the normed hidden rows, by token.
 * MODE 1: down. Warp w owns output rows n0 = (x * kWarps + w) * 16 ..; X: h,
 * by slot; y2[slot][n] in FP32. */
template <int MODE, int U>
__global__ void __launch_bounds__(kWarps * 32) expert_kernel(const uint16_t *W, const uint16_t *X,
                                                             const int *offsets, const int *token_of, int H,
                                                             int Im, uint16_t *h, float *y2)
{
    const int e = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int first = offsets[e], n = offsets[e + 1] - first;
    if (n == 0) return;
    const int K = MODE == 0 ? H : Im;
    const uint16_t *row_lo, *row_hi;
    int col0;
    if (MODE == 0) {
        col0 = (blockIdx.x * kWarps + warp) * 8;
        if (col0 >= Im) return;
        const uint16_t *We = W + (size_t)e * 2 * Im * H;
        row_lo = We + (size_t)(col0 + g) * H;
        row_hi = We + (size_t)(Im + col0 + g) * H;
    } else {
        col0 = (blockIdx.x * kWarps + warp) * 16;
        if (col0 >= H) return;
        const uint16_t *We = W + (size_t)e * H * Im;
        row_lo = We + (size_t)(col0 + g) * Im;
        row_hi = We + (size_t)(col0 + g + 8) * Im;
    }
    for (int p = 0; p < n; p += 16) {
        const bool two = p + 8 < n;
        const uint16_t *b[2];
        for (int nt = 0; nt < 2; nt++) {
            const int i = p + nt * 8 + g;
            const size_t row = i < n ? (MODE == 0 ? (size_t)token_of[first + i] : (size_t)(first + i)) : 0;
            b[nt] = i < n ? X + row * K : nullptr;
        }
        float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
        warp_dot<U>(row_lo, row_hi, b[0], b[1], K, c0, c1, two);
        for (int nt = 0; nt < (two ? 2 : 1); nt++) {
            const float *c = nt ? c1 : c0;
            for (int j = 0; j < 2; j++) {
                const int i = p + nt * 8 + 2 * q + j;   /* the token column this lane holds */
                if (i >= n) continue;
                const size_t s = (size_t)(first + i);
                if (MODE == 0) h[s * Im + col0 + g] = to_bf16(swiglu1(c[j], c[2 + j]));
                else {
                    y2[s * H + col0 + g] = c[j];
                    y2[s * H + col0 + g + 8] = c[2 + j];
                }
            }
        }
    }
}

/* One block per token: y = sum over its experts in increasing index of
 * weight x expert output (added into y when accumulate). */
__global__ void combine_kernel(const int *ids, const float *weights, const int *slot_of, const float *y2, int k,
                               int H, float *y, int accumulate)
{
    const int t = blockIdx.x;
    int id[kMaxTopK], slot[kMaxTopK];
    float w[kMaxTopK];
    for (int j = 0; j < k; j++) {
        id[j] = ids[(size_t)t * k + j];
        w[j] = weights[(size_t)t * k + j];
        slot[j] = slot_of[(size_t)t * k + j];
    }
    for (int j = 1; j < k; j++)   /* insertion sort by expert index; k is small */
        for (int i = j; i > 0 && id[i - 1] > id[i]; i--) {
            int ti = id[i]; id[i] = id[i - 1]; id[i - 1] = ti;
            int ts = slot[i]; slot[i] = slot[i - 1]; slot[i - 1] = ts;
            float tw = w[i]; w[i] = w[i - 1]; w[i - 1] = tw;
        }
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc = __fadd_rn(acc, __fmul_rn(y2[(size_t)slot[j] * H + c], w[j]));
        float *out = y + (size_t)t * H + c;
        *out = accumulate ? __fadd_rn(*out, acc) : acc;
    }
}

template <int MODE>
void launch_expert(int U, dim3 grid, cudaStream_t s, const uint16_t *W, const uint16_t *X, const int *offsets,
                   const int *token_of, int H, int Im, uint16_t *h, float *y2)
{
    if (U == 4) expert_kernel<MODE, 4><<<grid, kWarps * 32, 0, s>>>(W, X, offsets, token_of, H, Im, h, y2);
    else if (U == 2) expert_kernel<MODE, 2><<<grid, kWarps * 32, 0, s>>>(W, X, offsets, token_of, H, Im, h, y2);
    else expert_kernel<MODE, 1><<<grid, kWarps * 32, 0, s>>>(W, X, offsets, token_of, H, Im, h, y2);
}

int unroll_for(int K) { return K % 128 == 0 ? 4 : K % 64 == 0 ? 2 : 1; }

}  // namespace

struct fr_moe_gpu {
    fr_model_config cfg;
    int max_tokens;
    float *logits, *weights, *y2;
    int *ids;             /* [layers][max_tokens][k]: each layer's choices stay until the next step (replay) */
    int *slot_of, *token_of, *offsets;
    int *active;          /* [layers]: experts chosen by at least one token, per layer */
    uint16_t *h;
    /* routed-expert replay (fr_moe_gpu_routes): the MoE layers' indices, a
     * list of rows and their routes, made on first use */
    int moe_layers;
    int *layer_of, *rows;
    uint16_t *routes;
};

void fr_moe_gpu_destroy(fr_moe_gpu **ps)
{
    fr_moe_gpu *s = ps ? *ps : NULL;
    if (!s) return;
    cudaFree(s->logits); cudaFree(s->weights); cudaFree(s->y2); cudaFree(s->ids);
    cudaFree(s->slot_of); cudaFree(s->token_of); cudaFree(s->offsets); cudaFree(s->h); cudaFree(s->active);
    cudaFree(s->layer_of); cudaFree(s->rows); cudaFree(s->routes);
    free(s);
    *ps = NULL;
}

fr_status fr_moe_gpu_new(const fr_model_config *c, int max_tokens, fr_moe_gpu **out)
{
    *out = NULL;
    const int E = c->num_experts, k = c->experts_per_tok, H = c->hidden_size, Im = c->moe_intermediate_size;
    if (E < 1 || E > kMaxExperts || k < 1 || k > kMaxTopK || H % 64 || Im % 32 || Im < 32)
        return fr_fail(FR_EUNSUPPORTED, "MoE on the GPU: %d experts (at most %d), top-%d (at most %d), hidden %d "
                       "(a multiple of 64), expert intermediate %d (a multiple of 32) are outside what the "
                       "kernels take", E, kMaxExperts, k, kMaxTopK, H, Im);
    if (fr_model_groups(c) > 32)
        return fr_fail(FR_EUNSUPPORTED, "MoE on the GPU: %d expert groups (the routing kernel ranks at most 32)",
                       fr_model_groups(c));
    fr_moe_gpu *s = (fr_moe_gpu *)calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "MoE on the GPU: out of memory");
    s->cfg = *c;
    s->max_tokens = max_tokens;
    const size_t T = (size_t)max_tokens, A = T * (size_t)k;
    cudaError_t e = cudaMalloc(&s->logits, sizeof(float) * T * E);
    if (e == cudaSuccess) e = cudaMalloc(&s->weights, sizeof(float) * A);
    if (e == cudaSuccess) e = cudaMalloc(&s->ids, sizeof(int) * A * (size_t)c->num_layers);
    if (e == cudaSuccess) e = cudaMalloc(&s->slot_of, sizeof(int) * A);
    if (e == cudaSuccess) e = cudaMalloc(&s->token_of, sizeof(int) * A);
    if (e == cudaSuccess) e = cudaMalloc(&s->offsets, sizeof(int) * (size_t)(E + 1));
    if (e == cudaSuccess) e = cudaMalloc(&s->active, sizeof(int) * (size_t)c->num_layers);
    if (e == cudaSuccess) e = cudaMemset(s->active, 0, sizeof(int) * (size_t)c->num_layers);
    if (e == cudaSuccess) e = cudaMalloc(&s->h, sizeof(uint16_t) * A * (size_t)Im);
    if (e == cudaSuccess) e = cudaMalloc(&s->y2, sizeof(float) * A * (size_t)H);
    if (e != cudaSuccess) {
        fr_moe_gpu_destroy(&s);
        return fr_fail(FR_ENOMEM, "MoE on the GPU: cannot allocate the expert scratch for %d tokens: %s", max_tokens,
                       cudaGetErrorString(e));
    }
    *out = s;
    return FR_OK;
}

fr_status fr_moe_gpu_forward(fr_moe_gpu *s, fr_gemm *g, const fr_layer_weights_gpu *lw, int layer, const uint16_t *xn,
                             int M, float *y, int accumulate, cudaStream_t stream)
{
    const fr_model_config *c = &s->cfg;
    const int E = c->num_experts, k = c->experts_per_tok, H = c->hidden_size, Im = c->moe_intermediate_size;
    if (layer < 0 || layer >= c->num_layers) return fr_fail(FR_EINVAL, "MoE on the GPU: no layer %d", layer);
    if (M < 1 || M > s->max_tokens) return fr_fail(FR_EINVAL, "MoE on the GPU: %d tokens (scratch for %d)", M,
                                                   s->max_tokens);
    fr_status st = fr_gemm_bf16(g, s->logits, xn, lw->router, M, E, H, 0.0f, stream);
    if (st) return st;
    const RouteRules rr = {c->scoring_func, c->topk_method, fr_model_groups(c), fr_model_topk_groups(c),
                           c->norm_topk_prob, fr_model_routed_scale(c)};
    int *ids = s->ids + (size_t)layer * s->max_tokens * k;
    route_kernel<<<(M + 3) / 4, 128, 0, stream>>>(s->logits, M, E, k, rr, lw->router_bias, ids, s->weights);
    group_kernel<<<1, 1024, 0, stream>>>(ids, M * k, k, E, s->offsets, s->slot_of, s->token_of, s->active + layer);
    launch_expert<0>(unroll_for(H), dim3((Im + 8 * kWarps - 1) / (8 * kWarps), E), stream, lw->expert_gate_up, xn,
                     s->offsets, s->token_of, H, Im, s->h, s->y2);
    launch_expert<1>(unroll_for(Im), dim3((H + 16 * kWarps - 1) / (16 * kWarps), E), stream, lw->expert_down, s->h,
                     s->offsets, s->token_of, H, Im, s->h, s->y2);
    combine_kernel<<<M, 256, 0, stream>>>(ids, s->weights, s->slot_of, s->y2, k, H, y, accumulate);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "MoE on the GPU: launch failed: %s", cudaGetErrorString(e));
}

fr_status fr_moe_gpu_active(const fr_moe_gpu *s, int *per_layer, cudaStream_t stream)
{
    cudaError_t e = cudaMemcpyAsync(per_layer, s->active, sizeof(int) * (size_t)s->cfg.num_layers,
                                    cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "MoE on the GPU: %s", cudaGetErrorString(e));
}

fr_status fr_moe_gpu_counts(const fr_moe_gpu *s, int *counts, cudaStream_t stream)
{
    const int E = s->cfg.num_experts;
    int *off = (int *)malloc(sizeof(int) * (size_t)(E + 1));
    if (!off) return fr_fail(FR_ENOMEM, "MoE on the GPU: out of memory");
    cudaError_t e = cudaMemcpyAsync(off, s->offsets, sizeof(int) * (size_t)(E + 1), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    for (int i = 0; i < E && e == cudaSuccess; i++) counts[i] = off[i + 1] - off[i];
    free(off);
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "MoE on the GPU: %s", cudaGetErrorString(e));
}

/* The device lists routes_kernel reads, made on first use: the MoE layers'
 * indices, room for max_tokens rows and their routes. */
static fr_status routes_room(fr_moe_gpu *s)
{
    if (s->routes) return FR_OK;
    const fr_model_config *c = &s->cfg;
    const int layers = fr_model_moe_layers(c);
    if (layers == 0) return fr_fail(FR_EINVAL, "routed experts: the model has no mixture-of-experts layer");
    int *host = (int *)malloc(sizeof(int) * (size_t)layers);
    if (!host) return fr_fail(FR_ENOMEM, "routed experts: out of memory");
    for (int l = 0, m = 0; l < c->num_layers; l++)
        if (fr_model_layer_is_moe(c, l)) host[m++] = l;
    const size_t T = (size_t)s->max_tokens;
    cudaError_t e = cudaMalloc(&s->layer_of, sizeof(int) * (size_t)layers);
    if (e == cudaSuccess) e = cudaMemcpy(s->layer_of, host, sizeof(int) * (size_t)layers, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMalloc(&s->rows, sizeof(int) * T);
    const size_t ids_per_row = (size_t)layers * (size_t)c->experts_per_tok;
    if (e == cudaSuccess) e = cudaMalloc(&s->routes, sizeof(uint16_t) * T * ids_per_row);
    free(host);
    if (e != cudaSuccess) {
        cudaFree(s->layer_of); cudaFree(s->rows); cudaFree(s->routes);
        s->layer_of = s->rows = NULL;
        s->routes = NULL;
        return fr_fail(FR_ENOMEM, "routed experts: cannot allocate their device lists: %s", cudaGetErrorString(e));
    }
    s->moe_layers = layers;
    return FR_OK;
}

fr_status fr_moe_gpu_routes(fr_moe_gpu *s, const int *rows, int n, uint16_t *out, cudaStream_t stream)
{
    if (n < 0 || n > s->max_tokens) return fr_fail(FR_EINVAL, "routed experts: %d rows (at most %d)", n, s->max_tokens);
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= s->max_tokens)
            return fr_fail(FR_EINVAL, "routed experts: row %d is outside the step's %d", rows[i], s->max_tokens);
    fr_status st = routes_room(s);
    if (st || n == 0) return st;
    const int k = s->cfg.experts_per_tok, total = n * s->moe_layers * k;
    cudaError_t e = cudaMemcpyAsync(s->rows, rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess) {
        routes_kernel<<<(total + 255) / 256, 256, 0, stream>>>(s->ids, (size_t)s->max_tokens * k, s->layer_of,
                                                               s->moe_layers, k, s->rows, n, s->routes);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(out, s->routes, sizeof(uint16_t) * (size_t)total, cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "routed experts on the GPU: %s", cudaGetErrorString(e));
}
