/* Barred tokens and top log-probs on the GPU: rollout/model/sampler_extras_cuda.h. */
#include "rollout/model/sampler_extras_cuda.h"

#include <math.h>

#include "attention/cuda_check.h"

extern "C" {
#include "rollout/model/sampler.h"
}

namespace {

constexpr int kThreads = 256;

__global__ void bar_kernel(const float *__restrict__ logits, float *__restrict__ out, int vocab,
                           const int *__restrict__ ban_start, const int *__restrict__ ban_ids)
{
    const size_t r = blockIdx.x;
    const float *in = logits + r * (size_t)vocab;
    float *o = out + r * (size_t)vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) o[i] = in[i];
    __syncthreads();
    for (int k = ban_start[r] + (int)threadIdx.x; k < ban_start[r + 1]; k += blockDim.x) {
        const int id = ban_ids[k];
        if (id >= 0 && id < vocab) o[id] = -INFINITY;
    }
}

/* A token in the sampling order: (logit, id), larger logit first, ties to
 * the lower id; id -1 is "none" and comes after every token. */
struct Tok {
    float x;
    int id;
};

__device__ __forceinline__ bool before(const Tok &a, const Tok &b)
{
    if (a.id < 0) return false;
    if (b.id < 0) return true;
    return a.x > b.x || (a.x == b.x && a.id < b.id);
}

__device__ Tok reduce_best(Tok v, Tok *sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && before(sh[threadIdx.x + s], sh[threadIdx.x])) sh[threadIdx.x] = sh[threadIdx.x + s];
        __syncthreads();
    }
    Tok best = sh[0];
    __syncthreads();
    return best;
}

/* A fixed tree: the same sum on every run and in any batch position. */
__device__ double reduce_sum(double v, double *sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double total = sh[0];
    __syncthreads();
    return total;
}

struct Stats {
    bool nan;
    int n_posinf;
    double t, zmax, log_sum;
};

__device__ __forceinline__ float logprob_at(const Stats &st, float x)
{
    if (st.n_posinf > 0) return x == INFINITY ? (float)-st.log_sum : -INFINITY;
    return (float)(((double)x / st.t - st.zmax) - st.log_sum);
}

/* One block per row: the CPU's softmax statistics (softmax_scan in
 * rollout/model/sampler.c), the token's log-prob and the top_n. */
__global__ void logprobs_kernel(const float *__restrict__ logits, int vocab, const fr_sample_row *__restrict__ rows,
                                const int *__restrict__ tokens, float *logprobs, int top_n, int *top_ids,
                                float *top_logprobs)
{
    __shared__ Tok sht[kThreads];
    __shared__ double shd[kThreads];
    const size_t r = blockIdx.x;
    const float *row = logits + r * (size_t)vocab;
    Tok best = {0.0f, -1};
    double nan = 0.0, posinf = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = row[i];
        if (isnan(x)) nan += 1.0;
        else if (x == INFINITY) posinf += 1.0;
        const Tok c = {x, i};
        if (!isnan(x) && x != -INFINITY && before(c, best)) best = c;
    }
    best = reduce_best(best, sht);
    Stats st;
    st.nan = reduce_sum(nan, shd) > 0.0 || best.id < 0;
    st.n_posinf = (int)reduce_sum(posinf, shd);
    const float temp = rows[r].temperature;
    st.t = temp > 0.0f ? (double)temp : 1.0;
    st.zmax = st.n_posinf ? INFINITY : (double)best.x / st.t;
    double sum = 0.0;
    if (!st.nan && !st.n_posinf)
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += exp((double)row[i] / st.t - st.zmax);
    sum = reduce_sum(sum, shd);
    st.log_sum = st.n_posinf ? log((double)st.n_posinf) : log(sum);
    if (threadIdx.x == 0 && logprobs) {
        const int tok = tokens ? tokens[r] : -1;
        logprobs[r] = st.nan || tok < 0 || tok >= vocab ? NAN : logprob_at(st, row[tok]);
    }
    /* The top_n: each pass takes the best token after the previous one. */
    Tok prev = {0.0f, -1};
    for (int k = 0; k < top_n; k++) {
        Tok cand = {0.0f, -1};
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const Tok c = {row[i], i};
            if (isnan(c.x) || (prev.id >= 0 && !before(prev, c))) continue;
            if (before(c, cand)) cand = c;
        }
        cand = reduce_best(cand, sht);
        if (threadIdx.x == 0) {
            top_ids[r * top_n + k] = st.nan ? -1 : cand.id;
            top_logprobs[r * top_n + k] = st.nan || cand.id < 0 ? NAN : logprob_at(st, cand.x);
        }
        prev = cand;
    }
}

}  // namespace

extern "C" fr_status fr_sampler_gpu_bar(const float *logits, float *out, int vocab, int rows, const int *ban_start,
                                        const int *ban_ids, cudaStream_t stream)
{
    if (!logits || !out || !ban_start || vocab < 1 || rows < 0)
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_bar: bad argument");
    if (rows == 0) return FR_OK;
    bar_kernel<<<rows, kThreads, 0, stream>>>(logits, out, vocab, ban_start, ban_ids);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_sampler_gpu_logprobs(const float *logits, int vocab, const fr_sample_row *rows_dev, int rows,
                                             const int *tokens, float *logprobs, int top_n, int *top_ids,
                                             float *top_logprobs, cudaStream_t stream)
{
    if (!logits || !rows_dev || vocab < 1 || rows < 0 || (logprobs && !tokens))
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_logprobs: bad argument");
    if (top_n < 0 || top_n > FR_MAX_TOP_LOGPROBS || top_n > vocab || (top_n && (!top_ids || !top_logprobs)))
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_logprobs: top_n %d must be in [0, %d] and at most the vocabulary",
                       top_n, FR_MAX_TOP_LOGPROBS);
    if (rows == 0) return FR_OK;
    logprobs_kernel<<<rows, kThreads, 0, stream>>>(logits, vocab, rows_dev, tokens, logprobs, top_n, top_ids,
                                                   top_logprobs);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

extern "C" fr_status fr_sampler_gpu_sample_ex(fr_sampler_gpu *s, const float *logits, int vocab,
                                              const fr_sample_row *rows_dev, int rows, const int *ban_start,
                                              const int *ban_ids, float *scratch, int top_n, int *tokens,
                                              float *logprobs, int *top_ids, float *top_logprobs, cudaStream_t stream)
{
    if (!s || !logits || !tokens || (ban_start && !scratch))
        return fr_fail(FR_EINVAL, "fr_sampler_gpu_sample_ex: bad argument");
    fr_status st = FR_OK;
    const float *draw_from = logits;
    if (ban_start) {
        st = fr_sampler_gpu_bar(logits, scratch, vocab, rows, ban_start, ban_ids, stream);
        draw_from = scratch;
    }
    if (!st) st = fr_sampler_gpu_sample(s, draw_from, rows_dev, rows, tokens, NULL, stream);
    if (!st)
        st = fr_sampler_gpu_logprobs(logits, vocab, rows_dev, rows, tokens, logprobs, top_n, top_ids, top_logprobs,
                                     stream);
    return st;
}
