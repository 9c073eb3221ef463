/* Divergence figures (design.md "Divergence monitoring"): one sample's
 * summary of D_t (paper Eq. 9, rollout/engine/kl_metrics.h), and aggregates by
 * weight version and position bucket. Plain data, no engine: results and
 * metrics carry them; rollout/engine/divergence.h measures them. */
#ifndef FR_DIVERGENCE_SUMMARY_H
#define FR_DIVERGENCE_SUMMARY_H

#include <stdint.h>

#include "rollout/engine/histogram.h"
#include "rollout/engine/kl_metrics.h"

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
/* The monitored samples of highest mean KL a version keeps. */
#define FR_DIV_WORST 5
typedef struct {
    uint64_t request_id;
    int sample;
    long positions;
    double kl_mean;         /* nats */
} fr_div_worst;

typedef struct {
    uint64_t version;
    int used;
    fr_div_summary bucket[FR_DIV_BUCKETS];
    fr_div_summary all;
    fr_hist kl;             /* D_t of every position (FR_HIST_KL) */
    fr_hist sample_kl;      /* mean D_t of each finished monitored sample */
    fr_div_worst worst[FR_DIV_WORST];   /* highest mean first; n_worst used */
    int n_worst;
} fr_div_version;

typedef struct {
    fr_div_version v[FR_DIV_VERSIONS];
    long long samples;      /* monitored samples finished */
    /* every position ever measured, whatever its version (evicted ones
     * included): rates over time come from these */
    long long positions_total;
    double kl_sum_total;
} fr_div_aggregates;

void fr_div_aggregates_add(fr_div_aggregates *a, uint64_t version, long position, const fr_kl_result *r);
/* A finished monitored sample (s: its figures) under the version of its
 * last token: its mean into the version's per-sample histogram and, when
 * among the highest, its worst list. Samples with no position are skipped. */
void fr_div_aggregates_add_sample(fr_div_aggregates *a, uint64_t version, uint64_t request_id, int sample,
                                  const fr_div_summary *s);
/* The entry of `version`, or NULL when it has none (or was evicted). */
const fr_div_version *fr_div_aggregates_find(const fr_div_aggregates *a, uint64_t version);

#ifdef __cplusplus
}
#endif

#endif
