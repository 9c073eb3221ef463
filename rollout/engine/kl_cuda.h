/* The divergence of kl_metrics.h computed on the GPU, for rows whose logits
 * never leave the device (the serving batch and its BF16-KV shadow): one
 * block per row finds both log-sum-exps and argmaxes, the reference's k-th
 * largest logit by radix selection, and sums p log(p / q) over the
 * reference's top-k tokens (ties at the k-th value taken by lowest id, as
 * fr_kl_topk does), all sums in double.
 *
 * Against fr_kl_topk on the same float32 logits the results differ only by
 * summation order (the kl to about 1e-12 absolute); top1_match is identical.
 * The top-k is chosen on the float logits rather than on their double
 * log-probabilities, which order the same tokens unless subtracting the
 * log-sum-exp rounds two different logits to one value. */
#ifndef FR_KL_CUDA_H
#define FR_KL_CUDA_H

#include <cuda_runtime.h>

#include "rollout/engine/kl_metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Row j (j < n): reference ref[ref_rows[j]] against served[served_rows[j]]
 * (each row `vocab` floats), chosen token tokens[j] (-1: none), k top tokens
 * (k >= 1; the whole vocabulary when larger); the result goes to out[j].
 * Every pointer is a device pointer; enqueued on stream without
 * synchronization. vocab up to 2^24. */
fr_status fr_kl_topk_cuda(const float *ref, const int *ref_rows, const float *served, const int *served_rows,
                          const int *tokens, int n, int vocab, int k, fr_kl_result *out, cudaStream_t stream);

/* The same divergence with each row spread over several blocks (a decode's
 * few monitored rows against a 152k vocabulary leave most of the GPU idle
 * with one block a row): each block takes a slice of the vocabulary and
 * keeps its own top k, a second kernel merges them. Results as
 * fr_kl_topk_cuda's (the log-sum-exps summed in another order). tokens: as
 * above, or with tokens_by_served_row the chosen token of row j is
 * tokens[served_rows[j]] (a decode's sampled tokens, by batch row); used
 * (device, may be NULL) receives each row's chosen token. ws: device
 * workspace of fr_kl_topk_cuda_ws_bytes(n, vocab, k) bytes at least; n up
 * to 65535. Two launches on stream, no synchronization. */
size_t fr_kl_topk_cuda_ws_bytes(int n, int vocab, int k);
fr_status fr_kl_topk_cuda_split(const float *ref, const int *ref_rows, const float *served, const int *served_rows,
                                const int *tokens, int tokens_by_served_row, int n, int vocab, int k, void *ws,
                                size_t ws_bytes, fr_kl_result *out, int *used, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
