/* Divergence between a reference next-token distribution (BF16 KV) and a
 * quantized one, as paper Appendix A defines it (Eq. 9):
 *   D = sum over the reference's top-k tokens v of p(v) log(p(v) / q(v)),
 * with p and q the full-vocabulary softmax of the two logit vectors (k = 128
 * in the paper; all tokens when the vocabulary is smaller). */
#ifndef FR_KL_METRICS_H
#define FR_KL_METRICS_H

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_KL_TOP_K 128

typedef struct {
    double kl;          /* nats */
    int top1_match;     /* argmax of both agrees */
    double logp_diff;   /* log q(token) - log p(token) for a chosen token, 0 if none */
} fr_kl_result;

/* token: the chosen token whose log-prob difference is reported, or -1. */
fr_status fr_kl_topk(const float *ref_logits, const float *logits, int vocab, int k, int token,
                     fr_kl_result *out);

#ifdef __cplusplus
}
#endif

#endif
