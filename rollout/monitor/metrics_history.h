/* The run's history, kept by the server so that a dashboard opened at any
 * time shows all of it (docs/metrics.md, "History"): time points (sums over
 * an interval; when full, neighbours merge in pairs and the interval
 * doubles, so memory stays bounded and the whole run stays visible), one row
 * per weight version (the most recent max_versions), the weight updates, and
 * the latest version's detail (position buckets, per-sample KL histogram,
 * worst samples). Optionally every record is appended to a JSON-lines file,
 * from which a later process rebuilds the same history. Not thread-safe:
 * the HTTP endpoint calls it under its own lock. */
#ifndef FR_METRICS_HISTORY_H
#define FR_METRICS_HISTORY_H

#include "rollout/monitor/metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_metrics_history fr_metrics_history;

/* max_points >= 4 time points, max_versions >= 1 version rows and as many
 * weight-update events; interval_s > 0: the first width of a point. */
fr_status fr_metrics_history_new(int max_points, int max_versions, double interval_s, fr_metrics_history **out);
void fr_metrics_history_free(fr_metrics_history **h);

/* Appends every record from now on to path (created when missing; a run
 * appended to an older one keeps both, ordered by wall-clock time). */
fr_status fr_metrics_history_log_to(fr_metrics_history *h, const char *path);

/* Takes snapshot s, seen at wall-clock time now_s (seconds since the epoch).
 * Fails only when the log cannot be written (the history itself is kept). */
fr_status fr_metrics_history_add(fr_metrics_history *h, const fr_metrics_snapshot *s, double now_s);

/* The history as one JSON object: points, versions and syncs as columns
 * (arrays by field), latest as an object or null (docs/metrics.md). */
fr_status fr_metrics_history_json(const fr_metrics_history *h, char **out, size_t *len);

/* A history rebuilt from a log written by _log_to; a line that is not one of
 * its records fails with its line number. */
fr_status fr_metrics_history_load(const char *path, int max_points, int max_versions, fr_metrics_history **out);

/* Points and version rows held (for tests). */
int fr_metrics_history_points(const fr_metrics_history *h);
int fr_metrics_history_versions(const fr_metrics_history *h);

#ifdef __cplusplus
}
#endif

#endif
