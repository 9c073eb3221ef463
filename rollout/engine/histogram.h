/* Fixed-bucket histograms and the serving figures of one scheduler (request
 * latencies, prompt tokens, ends by reason). Plain data, no engine: the
 * scheduler fills them, rollout/monitor/metrics.h renders them in the
 * Prometheus histogram convention (cumulative buckets, sum, count). */
#ifndef FR_HISTOGRAM_H
#define FR_HISTOGRAM_H

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bounds (inclusive, increasing) of at most FR_HIST_MAX finite
 * buckets; one more counts what lies above the last. The bounds are a
 * static table of the kind below, so a histogram copies by value. */
#define FR_HIST_MAX 24
typedef enum {
    FR_HIST_LATENCY = 0,   /* seconds: 1 ms .. 120 s */
    FR_HIST_TOKEN_TIME,    /* seconds per output token: 0.5 ms .. 5 s */
    FR_HIST_KL,            /* nats: 1e-6 .. 1, 1-2-5 steps */
    FR_HIST_KINDS
} fr_hist_kind;

typedef struct {
    int kind;                      /* fr_hist_kind */
    long long count[FR_HIST_MAX + 1];
    long long n;
    double sum;
} fr_hist;

void fr_hist_init(fr_hist *h, fr_hist_kind kind);
/* The kind's bounds and their number. */
const double *fr_hist_bounds(fr_hist_kind kind, int *n);
void fr_hist_add(fr_hist *h, double x);
/* The q-quantile (0..1) by linear interpolation inside the bucket that holds
 * it (the first bucket starts at 0, the overflow one is read as its lower
 * bound); NAN when empty. */
double fr_hist_quantile(const fr_hist *h, double q);

/* ---- a scheduler's serving figures ---- */

/* Finish reasons counted: index by fr_finish_reason (request.h), 0 unused. */
#define FR_FINISH_KINDS 5
typedef struct {
    fr_hist ttft;            /* submit to first token, per sample */
    fr_hist tpot;            /* (last token - first token) / (tokens - 1), samples of 2+ tokens */
    fr_hist e2e;             /* submit to end, per sample */
    long long prompt_tokens; /* prompt tokens of requests whose first token was drawn, once per request */
    long long finished[FR_FINISH_KINDS];
} fr_serving_stats;

void fr_serving_stats_init(fr_serving_stats *s);

#ifdef __cplusplus
}
#endif

#endif
