/* Online divergence between the serving engine (FP4/FP8 KV) and a BF16-KV
 * shadow of it, per sample and in aggregate (design.md "Divergence
 * monitoring"; paper Appendix A).
 *
 * A monitored sample owns a shadow sequence in a BF16-KV session over the
 * same weights (fr_session_open_shadow). The shadow is teacher-forced: it is
 * fed exactly the tokens the serving sample consumes, so after every step
 * both have the next-token distribution of the same prefix, and
 *   D_t = sum over BF16's top-128 tokens v of p(v) log(p(v) / q(v))
 * (fr_kl_topk, Eq. 9; p = BF16 shadow, q = serving), the top-1 agreement and
 * the chosen token's log-prob difference follow. Memory is spent only for
 * monitored samples, and a dropped sample frees its shadow sequence. */
#ifndef FR_DIVERGENCE_H
#define FR_DIVERGENCE_H

#include <stdint.h>

#include "kl_metrics.h"
#include "session.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- summaries ---- */

/* One sample's figures. */
typedef struct {
    long n;                 /* positions measured */
    double kl_sum, kl_max;  /* nats */
    long top1_agree;
    double logp_diff_sum;   /* sum of log q(token) - log p(token) of the chosen tokens */
} fr_div_summary;

void fr_div_summary_add(fr_div_summary *s, const fr_kl_result *r);
double fr_div_summary_mean(const fr_div_summary *s);   /* NAN when empty */

/* Position buckets of the aggregates: [0, 1K), [1K, 4K), [4K, 16K),
 * [16K, 64K), [64K, inf), by the position of the predicted token. */
#define FR_DIV_BUCKETS 5
int fr_div_bucket_of(long position);
const char *fr_div_bucket_name(int b);   /* "0-1K", "1K-4K", ... */

/* Aggregates by weight version (the most recent FR_DIV_VERSIONS kept) and
 * position bucket. */
#define FR_DIV_VERSIONS 8
typedef struct {
    uint64_t version;
    int used;
    fr_div_summary bucket[FR_DIV_BUCKETS];
    fr_div_summary all;
} fr_div_version;

typedef struct {
    fr_div_version v[FR_DIV_VERSIONS];
    long long samples;      /* monitored samples finished */
} fr_div_aggregates;

void fr_div_aggregates_add(fr_div_aggregates *a, uint64_t version, long position, const fr_kl_result *r);
/* The entry of `version`, or NULL when it has none (or was evicted). */
const fr_div_version *fr_div_aggregates_find(const fr_div_aggregates *a, uint64_t version);

/* ---- the shadow ---- */

typedef struct fr_shadow fr_shadow;

/* A BF16 shadow of session main with room for max_seqs monitored samples of
 * up to max_tokens tokens each. */
fr_status fr_shadow_open(fr_session *main, int max_seqs, int max_tokens, fr_shadow **out);
void fr_shadow_close(fr_shadow **sh);

/* Starts monitoring: prefills tokens[0, n) into a new shadow sequence in
 * chunks; ref_logits (vocab floats) receives the shadow's distribution after
 * the last token. FR_ENOMEM (and nothing kept) when the shadow is full. */
fr_status fr_shadow_start(fr_shadow *sh, const int *tokens, int n, int *shadow_seq, float *ref_logits);
/* One token for each of n shadow sequences (the tokens their serving samples
 * consume in this step); ref_logits [n][vocab] receives the shadow's next
 * distributions. */
fr_status fr_shadow_step(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n, float *ref_logits);
/* Ends monitoring of a sequence and frees its blocks. */
void fr_shadow_drop(fr_shadow *sh, int shadow_seq);
/* Free KV blocks of the shadow. */
int fr_shadow_free_blocks(const fr_shadow *sh);

#ifdef __cplusplus
}
#endif

#endif
