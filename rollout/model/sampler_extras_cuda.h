/* The sampling extras on the GPU (docs/sampling.md, "Options"): barred
 * tokens (min_tokens bars the stop ids) and the top log-probs of a step,
 * with the rules of the CPU's fr_sample_ex (rollout/model/sampler.h).
 *
 * A row with extras is sampled in three steps on one stream, nothing copied
 * to the host between them:
 *   1. fr_sampler_gpu_bar copies the logits with each row's barred ids at
 *      -inf (the CPU sampler draws from the same vector);
 *   2. fr_sampler_gpu_sample (rollout/model/sampler_cuda.h) draws the token
 *      from that copy, with the CPU's draw;
 *   3. fr_sampler_gpu_logprobs evaluates, on the unbarred logits, the
 *      drawn token's log-prob and the top_n best tokens with theirs: the
 *      full-vocabulary log-softmax of logits / temperature (temperature 1
 *      when greedy), as the CPU reports whatever is barred.
 * fr_sampler_gpu_sample_ex enqueues the three.
 *
 * Exactness: the top ids are the CPU's (comparisons only: larger logit
 * first, ties to the lower id); a log-prob is (z - zmax) - log(sum) in
 * double, rounded to float once, with the sum over the vocabulary taken in
 * a fixed tree order instead of id order, so it matches the CPU's to a float
 * ulp or so. A row with a NaN logit gets NaN log-probs and top ids -1.
 * Deterministic: no atomics. */
#ifndef FR_SAMPLER_EXTRAS_CUDA_H
#define FR_SAMPLER_EXTRAS_CUDA_H

#include <cuda_runtime.h>

#include "rollout/model/sampler_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[r] = logits[r] with ids ban_ids[ban_start[r] .. ban_start[r + 1]) at
 * -inf, for rows 0..rows-1 (vocab each). Device pointers; ban_start has
 * rows + 1 entries; ids outside [0, vocab) are ignored. Async on stream;
 * FR_EINVAL for NULL pointers or bad sizes. */
fr_status fr_sampler_gpu_bar(const float *logits, float *out, int vocab, int rows, const int *ban_start,
                             const int *ban_ids, cudaStream_t stream);

/* For rows 0..rows-1: logprobs[r] (may be NULL) = the log-prob of
 * tokens[r] under logits[r] / rows_dev[r].temperature, and with top_n in
 * [1, FR_MAX_TOP_LOGPROBS] (at most vocab) top_ids[r * top_n ..] and
 * top_logprobs[r * top_n ..] the top_n best tokens and their log-probs
 * (top_n 0: none; the pointers may be NULL). Device pointers; async. */
fr_status fr_sampler_gpu_logprobs(const float *logits, int vocab, const fr_sample_row *rows_dev, int rows,
                                  const int *tokens, float *logprobs, int top_n, int *top_ids, float *top_logprobs,
                                  cudaStream_t stream);

/* The three steps above: tokens and logprobs as fr_sampler_gpu_sample
 * gives them, from logits with the barred ids at -inf (scratch: rows x
 * vocab floats of device memory; unused when ban_start is NULL), the
 * log-probs and top_n from the unbarred logits. */
fr_status fr_sampler_gpu_sample_ex(fr_sampler_gpu *s, const float *logits, int vocab, const fr_sample_row *rows_dev,
                                   int rows, const int *ban_start, const int *ban_ids, float *scratch, int top_n,
                                   int *tokens, float *logprobs, int *top_ids, float *top_logprobs,
                                   cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
