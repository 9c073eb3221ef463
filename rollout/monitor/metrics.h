/* Serving metrics: one snapshot of an engine's health and divergence
 * figures, rendered as Prometheus text (docs/metrics.md lists every name) and
 * as JSON for the dashboard and for msgpack-minded clients. Pure formatting:
 * rollout/monitor/metrics_http.h serves it. */
#ifndef FR_METRICS_H
#define FR_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "rollout/engine/divergence_summary.h"
#include "rollout/engine/histogram.h"
#include "rollout/engine/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    fr_scheduler_stats stats;       /* KV blocks, running/waiting, preemptions, tokens, version */
    fr_div_aggregates div;          /* divergence by weight version and position bucket */
    double tokens_per_s;            /* generated tokens per second over the last interval */
    double weight_sync_seconds;     /* duration of the last committed weight update (0: none) */
    double uptime_s;
    long long requests_total;
    /* automatic recalibration (rollout/monitor/recalibrate.h; all 0 when off) */
    long long recalibrations, recalibration_failures;
    uint64_t last_recalibration_version;
    double last_recalibration_seconds, last_recalibration_kl;
    char kv_dtype[16];
    char model[64];
    /* latencies, prompt tokens and ends by reason (engine 0's with several) */
    fr_serving_stats serving;
    /* weight updates: committed, and refused or failed; the begin-to-commit
     * time of each committed one (a zeroed fr_hist is a latency histogram) */
    long long weight_updates_committed, weight_updates_refused;
    fr_hist weight_update_seconds;
    int state;                      /* fr_metrics_state: what /health answers */
} fr_metrics_snapshot;

typedef enum { FR_METRICS_SERVING = 0, FR_METRICS_PAUSED, FR_METRICS_STOPPING } fr_metrics_state;
const char *fr_metrics_state_name(int state);   /* "serving", "paused", "stopping" */

/* Share of the KV cache's blocks in use (0..1; 0 when it has none). */
double fr_metrics_kv_usage(const fr_metrics_snapshot *s);

/* Prometheus text exposition format 0.0.4 of s into a new NUL-terminated
 * buffer (*out, *len without the NUL; free it). */
fr_status fr_metrics_prometheus(const fr_metrics_snapshot *s, char **out, size_t *len);
/* The same figures as one JSON object (docs/metrics.md). */
fr_status fr_metrics_json(const fr_metrics_snapshot *s, char **out, size_t *len);

#ifdef __cplusplus
}
#endif

#endif
