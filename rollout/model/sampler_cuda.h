/* The GPU token sampler: every row of a decode step sampled on the device,
 * with the choices of the CPU sampler (rollout/model/sampler.h, docs/sampling.md).
 *
 * Given the same float32 logits and parameters, a row gets the token fr_sample
 * picks and the log-prob fr_sample returns:
 *   - the same random draw: u = fr_philox_uniform(seed, sequence, step),
 *     evaluated bit for bit on the device (fr_sampler_gpu_uniforms exposes it);
 *   - the same order (logit descending, ties to the lower id), the same
 *     top-k cut through ties, the same top-p rule (shortest prefix whose
 *     running sum is >= top_p * W_k) and the same walk (first running sum
 *     > u * W);
 *   - the same arithmetic where it decides the token: z = (double)logit / t
 *     (IEEE division), w = exp(z - zmax) in double, running sums in double in
 *     the sampling order, top_p and u widened to double exactly as the CPU.
 *
 * What is exact and what is not:
 *   - Greedy rows and rows with +inf logits: exact (no sums are involved, or
 *     the sums are of ones).
 *   - Rows whose candidates (the top-k, or the tokens within 36.75 nats of
 *     the best, whichever is fewer) number at most FR_SAMPLER_GPU_EXACT_MAX:
 *     the candidates are sorted on the device and summed in the CPU's order
 *     with the CPU's operations, so the running sums are the CPU's, to the
 *     last bit, whenever the device exp rounds each weight as the C library
 *     does. Tokens further than 36.75 nats below the best have weights below
 *     2^-53, so adding them to a running sum that already holds the best
 *     token's weight 1 changes nothing: leaving them out is exact.
 *     The device exp (max error 1 ulp) and glibc's can differ in the last bit
 *     for rare arguments; no implementation can promise otherwise.
 *   - Rows with more candidates (temperature-only sampling of a flat
 *     distribution over a large vocabulary, say): sorting 152k candidates per
 *     row is too slow, so the cut points are located with exact (128-bit
 *     fixed point) prefix masses over logit bins, and only the few thousand
 *     tokens around each cut are sorted and summed in order from there. The
 *     CPU's sequential double sums differ from the exact ones by rounding
 *     (relative 1e-13 or less at 152k tokens), so the token can differ from
 *     fr_sample's only when u * W or top_p * W_k lies within that distance of
 *     a running-sum boundary, which docs/sampling.md allows for.
 *   - The log-prob is the CPU's expression (z_tok - zmax) - log(sum) in
 *     double, rounded to float once; the sum runs over the tokens within
 *     36.75 nats of the best in a fixed tree order instead of id order. It
 *     matches fr_sample's to a float ulp or so (well within 1e-5).
 *
 * Results are deterministic: the same inputs give the same tokens and
 * log-probs, bit for bit, on every run and in any batch position.
 *
 * Row-level errors happen on the device, where nothing can be reported
 * synchronously: a row with a NaN logit, with every logit -inf, or with
 * parameters fr_sample_row_check rejects gets token -1 and log-prob NaN
 * (fr_sample returns FR_EINVAL for these). Check parameters on the host with
 * fr_sample_row_check before they are copied to the device.
 */
#ifndef FR_SAMPLER_CUDA_H
#define FR_SAMPLER_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "base/fr_status.h"

/* Candidates up to this many are summed in the CPU's exact order. */
#define FR_SAMPLER_GPU_EXACT_MAX 2048

/* Sampling parameters of one row, as fr_sampling_params plus the (sequence,
 * step) pair fr_sample takes: the row's draw is
 * fr_philox_uniform(seed, sequence, step). Lives in device memory, one per
 * row. */
typedef struct {
    float temperature;   /* 0 = greedy; otherwise finite and > 0 */
    int top_k;           /* 0 or >= vocab = off; >= 0 */
    float top_p;         /* in (0, 1]; 1 = off */
    uint64_t seed;
    uint64_t sequence;   /* the sample's stream */
    uint64_t step;       /* the position of the token being generated */
} fr_sample_row;

/* fr_sampling_params_check on the row's parameters (same messages). */
fr_status fr_sample_row_check(const fr_sample_row *row, int vocab);

typedef struct fr_sampler_gpu fr_sampler_gpu;

/* A sampler for rows of `vocab` logits, at most max_rows per call. vocab is
 * at most 2^21. Configures the kernel (it uses about 115 KB of shared memory
 * per row and no global scratch), so fr_sampler_gpu_sample allocates nothing.
 * Uses the current device. */
fr_status fr_sampler_gpu_new(int vocab, int max_rows, fr_sampler_gpu **out);
void fr_sampler_gpu_destroy(fr_sampler_gpu **s);   /* frees *s, sets it to NULL; NULL-safe */

/* Samples rows 0..rows-1: tokens[r] (and logprobs[r] when logprobs is not
 * NULL) from logits[r * vocab .. r * vocab + vocab) with rows_dev[r].
 * All pointers are device pointers; logits is only read. One kernel is
 * enqueued on `stream`: no allocation, no synchronization, so the call can be
 * recorded into a CUDA graph. rows = 0 is a no-op. A NULL pointer or rows
 * outside [0, max_rows] is FR_EINVAL (nothing launched); a launch failure is
 * FR_EINTERNAL. */
fr_status fr_sampler_gpu_sample(fr_sampler_gpu *s, const float *logits, const fr_sample_row *rows_dev,
                                int rows, int *tokens, float *logprobs, cudaStream_t stream);

/* u[r] = the draw row r uses, fr_philox_uniform(seed, sequence, step) computed
 * on the device (for tests and debugging; greedy rows draw nothing but get
 * their u here too). Device pointers, async on stream. */
fr_status fr_sampler_gpu_uniforms(const fr_sample_row *rows_dev, int rows, float *u, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
