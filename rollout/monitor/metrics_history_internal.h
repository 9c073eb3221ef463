/* What metrics_history.c (records) and metrics_history_json.c (JSON out,
 * the log and its reader) share. Private to rollout/monitor/. */
#ifndef FR_METRICS_HISTORY_INTERNAL_H
#define FR_METRICS_HISTORY_INTERNAL_H

#include <stdio.h>

#include "base/buf.h"
#include "rollout/monitor/metrics_history.h"

/* A record is a row of doubles named by a field table (JSON keys). */
enum {   /* time points: sums over [t - dt, t] and gauges at t */
    P_T, P_DT, P_TOKENS, P_PROMPT, P_FINISHED, P_TOKENS_TOTAL, P_RUNNING, P_WAITING, P_KV_USAGE,
    P_TTFT_SUM, P_TTFT_N, P_TPOT_SUM, P_TPOT_N, P_KL_SUM, P_KL_N, P_VERSION, P_FIELDS
};
enum {   /* one weight version */
    V_VERSION, V_T_FIRST, V_T_LAST, V_POSITIONS, V_SAMPLES, V_KL_MEAN, V_P50, V_P90, V_P99, V_KL_MAX, V_TOP1,
    V_FIELDS
};
enum { S_T, S_VERSION, S_SECONDS, S_COMMITTED, S_FIELDS };   /* one weight update */

typedef struct {
    const char *kind;          /* the log's "kind" */
    const char *const *names;
    int n;
} fr_hist_table;
extern const fr_hist_table fr_hist_point_table, fr_hist_version_table, fr_hist_sync_table;

struct fr_metrics_history {
    int max_points, max_versions;
    double width;              /* the current point width (s) */
    double (*points)[P_FIELDS];
    int n_points;
    double pending[P_FIELDS];  /* the interval being summed (not a point yet) */
    double (*versions)[V_FIELDS];
    int n_versions;
    double (*syncs)[S_FIELDS];
    int n_syncs;
    char *latest;              /* the latest version's detail (JSON object), NULL: none */
    /* the previous snapshot's running totals, to take differences */
    int have_prev;
    double prev[P_FIELDS];
    long long prev_committed, prev_refused;
    FILE *log;
};

/* Records into the history (and nothing else). */
void fr_history_push_point(fr_metrics_history *h, const double *p);
void fr_history_put_version(fr_metrics_history *h, const double *v);
void fr_history_push_sync(fr_metrics_history *h, const double *e);
/* Takes a malloc'ed JSON object as the latest detail. */
void fr_history_set_latest(fr_metrics_history *h, char *json);

/* One record as a JSON object with its "kind" (a log line without "\n"). */
void fr_history_row_json(fr_buf *t, const fr_hist_table *tab, const double *row);
/* The latest version's detail of s (malloc'ed JSON), NULL when s has none. */
char *fr_history_detail_json(const fr_metrics_snapshot *s);

#endif
