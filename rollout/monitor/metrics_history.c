#include "rollout/monitor/metrics_history_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

fr_status fr_metrics_history_new(int max_points, int max_versions, double interval_s, fr_metrics_history **out)
{
    if (!out) return fr_fail(FR_EINVAL, "metrics history: NULL argument");
    *out = NULL;
    if (max_points < 4 || max_versions < 1 || !(interval_s > 0))
        return fr_fail(FR_EINVAL, "metrics history: %d points (>= 4), %d versions (>= 1), interval %g s (> 0)",
                       max_points, max_versions, interval_s);
    fr_metrics_history *h = calloc(1, sizeof *h);
    if (h) {
        h->points = calloc((size_t)max_points, sizeof *h->points);
        h->versions = calloc((size_t)max_versions, sizeof *h->versions);
        h->syncs = calloc((size_t)max_versions, sizeof *h->syncs);
    }
    if (!h || !h->points || !h->versions || !h->syncs) {
        fr_metrics_history_free(&h);
        return fr_fail(FR_ENOMEM, "metrics history: out of memory");
    }
    h->max_points = max_points;
    h->max_versions = max_versions;
    h->width = interval_s;
    *out = h;
    return FR_OK;
}

void fr_metrics_history_free(fr_metrics_history **ph)
{
    fr_metrics_history *h = ph ? *ph : NULL;
    if (!h) return;
    if (h->log) fclose(h->log);
    free(h->points);
    free(h->versions);
    free(h->syncs);
    free(h->latest);
    free(h);
    *ph = NULL;
}

fr_status fr_metrics_history_log_to(fr_metrics_history *h, const char *path)
{
    if (!h || !path || !path[0]) return fr_fail(FR_EINVAL, "metrics history: a log path is required");
    FILE *f = fopen(path, "a");
    if (!f) return fr_fail(FR_EIO, "metrics_log: cannot open %s for appending", path);
    if (h->log) fclose(h->log);
    h->log = f;
    return FR_OK;
}

int fr_metrics_history_points(const fr_metrics_history *h) { return h ? h->n_points : 0; }
int fr_metrics_history_versions(const fr_metrics_history *h) { return h ? h->n_versions : 0; }

/* Fields of a point that are sums over its interval (the rest are gauges
 * at its end): merging two neighbours adds these, keeps the later others. */
static int is_sum(int f)
{
    return f == P_DT || f == P_TOKENS || f == P_PROMPT || f == P_FINISHED || f == P_TTFT_SUM || f == P_TTFT_N ||
           f == P_TPOT_SUM || f == P_TPOT_N || f == P_KL_SUM || f == P_KL_N;
}

void fr_history_push_point(fr_metrics_history *h, const double *p)
{
    if (h->n_points == h->max_points) {   /* full: merge neighbours, points twice as wide */
        int n = 0;
        for (int i = 0; i + 1 < h->n_points; i += 2, n++)
            for (int f = 0; f < P_FIELDS; f++)
                h->points[n][f] = is_sum(f) ? h->points[i][f] + h->points[i + 1][f] : h->points[i + 1][f];
        if (h->n_points % 2) memcpy(h->points[n++], h->points[h->n_points - 1], sizeof h->points[0]);
        h->n_points = n;
        h->width *= 2;
    }
    memcpy(h->points[h->n_points++], p, sizeof h->points[0]);
}

void fr_history_put_version(fr_metrics_history *h, const double *v)
{
    int i = 0;
    while (i < h->n_versions && h->versions[i][V_VERSION] != v[V_VERSION]) i++;
    if (i == h->n_versions) {
        if (h->n_versions == h->max_versions) {   /* drop the oldest row */
            memmove(h->versions[0], h->versions[1], sizeof h->versions[0] * (size_t)(h->n_versions - 1));
            i = --h->n_versions;
        }
        h->n_versions++;
    }
    memcpy(h->versions[i], v, sizeof h->versions[0]);
}

void fr_history_push_sync(fr_metrics_history *h, const double *e)
{
    if (h->n_syncs == h->max_versions) {
        memmove(h->syncs[0], h->syncs[1], sizeof h->syncs[0] * (size_t)(h->n_syncs - 1));
        h->n_syncs--;
    }
    memcpy(h->syncs[h->n_syncs++], e, sizeof h->syncs[0]);
}

void fr_history_set_latest(fr_metrics_history *h, char *json)
{
    free(h->latest);
    h->latest = json;
}

/* One log line: the record with its kind. */
static fr_status log_row(fr_metrics_history *h, const fr_hist_table *tab, const double *row)
{
    if (!h->log) return FR_OK;
    fr_buf t = {0};
    fr_history_row_json(&t, tab, row);
    fr_buf_printf(&t, "\n");
    const int ok = !t.failed && t.data && fwrite(t.data, 1, t.len, h->log) == t.len && fflush(h->log) == 0;
    free(t.data);
    return ok ? FR_OK : fr_fail(FR_EIO, "metrics_log: a record could not be written");
}

/* The running totals of s the points take differences of. */
static void totals(const fr_metrics_snapshot *s, double *c)
{
    c[P_TOKENS] = (double)s->stats.tokens_generated;
    c[P_PROMPT] = (double)s->serving.prompt_tokens;
    c[P_FINISHED] = (double)s->stats.finished;
    c[P_TTFT_SUM] = s->serving.ttft.sum;
    c[P_TTFT_N] = (double)s->serving.ttft.n;
    c[P_TPOT_SUM] = s->serving.tpot.sum;
    c[P_TPOT_N] = (double)s->serving.tpot.n;
    c[P_KL_SUM] = s->div.kl_sum_total;
    c[P_KL_N] = (double)s->div.positions_total;
}

/* Sums s into the pending interval; a point once it spans the width. */
static fr_status add_point(fr_metrics_history *h, const fr_metrics_snapshot *s, double now)
{
    double cur[P_FIELDS] = {0};
    totals(s, cur);
    double *p = h->pending;
    if (h->have_prev) {
        for (int f = 0; f < P_FIELDS; f++)
            if (is_sum(f) && f != P_DT && cur[f] > h->prev[f]) p[f] += cur[f] - h->prev[f];
        if (now > h->prev[P_T]) p[P_DT] += now - h->prev[P_T];
    }
    cur[P_T] = now;
    memcpy(h->prev, cur, sizeof cur);
    h->have_prev = 1;
    p[P_T] = now;
    p[P_TOKENS_TOTAL] = (double)s->stats.tokens_generated;
    p[P_RUNNING] = s->stats.running + s->stats.prefilling;
    p[P_WAITING] = s->stats.waiting;
    p[P_KV_USAGE] = fr_metrics_kv_usage(s);
    p[P_VERSION] = (double)s->stats.weight_version;
    if (p[P_DT] < h->width) return FR_OK;
    fr_history_push_point(h, p);
    fr_status st = log_row(h, &fr_hist_point_table, p);
    for (int f = 0; f < P_FIELDS; f++)
        if (is_sum(f)) p[f] = 0;
    return st;
}

static const double *version_row(const fr_metrics_history *h, uint64_t version)
{
    for (int k = 0; k < h->n_versions; k++)
        if (h->versions[k][V_VERSION] == (double)version) return h->versions[k];
    return NULL;
}

/* A row per weight version the snapshot holds; logged when it moved. */
static fr_status add_versions(fr_metrics_history *h, const fr_metrics_snapshot *s, double now)
{
    fr_status st = FR_OK;
    for (int i = 0; i < FR_DIV_VERSIONS; i++) {
        const fr_div_version *e = &s->div.v[i];
        if (!e->used) continue;
        const double *old = version_row(h, e->version);
        if (old && old[V_POSITIONS] == (double)e->all.n && old[V_SAMPLES] == (double)e->sample_kl.n) continue;
        double v[V_FIELDS] = {[V_VERSION] = (double)e->version, [V_T_FIRST] = old ? old[V_T_FIRST] : now,
                              [V_T_LAST] = now};
        v[V_POSITIONS] = (double)e->all.n;
        v[V_SAMPLES] = (double)e->sample_kl.n;
        v[V_KL_MEAN] = fr_div_summary_mean(&e->all);
        v[V_P50] = fr_hist_quantile(&e->sample_kl, 0.5);
        v[V_P90] = fr_hist_quantile(&e->sample_kl, 0.9);
        v[V_P99] = fr_hist_quantile(&e->sample_kl, 0.99);
        v[V_KL_MAX] = e->all.n ? e->all.kl_max : NAN;
        v[V_TOP1] = e->all.n ? (double)e->all.top1_agree / (double)e->all.n : NAN;
        fr_history_put_version(h, v);
        if (!st) st = log_row(h, &fr_hist_version_table, v);
    }
    return st;
}

/* Weight updates since the previous snapshot, and the latest detail. */
static fr_status add_events(fr_metrics_history *h, const fr_metrics_snapshot *s, double now)
{
    fr_status st = FR_OK;
    const double version = (double)s->stats.weight_version;
    if (s->weight_updates_committed > h->prev_committed) {
        double e[S_FIELDS] = {now, version, s->weight_sync_seconds, 1};
        fr_history_push_sync(h, e);
        st = log_row(h, &fr_hist_sync_table, e);
    }
    if (s->weight_updates_refused > h->prev_refused) {
        double e[S_FIELDS] = {now, version, NAN, 0};
        fr_history_push_sync(h, e);
        if (!st) st = log_row(h, &fr_hist_sync_table, e);
    }
    h->prev_committed = s->weight_updates_committed;
    h->prev_refused = s->weight_updates_refused;
    char *d = fr_history_detail_json(s);
    if (!d || (h->latest && strcmp(d, h->latest) == 0)) {
        free(d);
        return st;
    }
    fr_history_set_latest(h, d);
    if (h->log && (fprintf(h->log, "%s\n", d) < 0 || fflush(h->log)) && !st)
        st = fr_fail(FR_EIO, "metrics_log: a record could not be written");
    return st;
}

fr_status fr_metrics_history_add(fr_metrics_history *h, const fr_metrics_snapshot *s, double now_s)
{
    if (!h || !s) return fr_fail(FR_EINVAL, "metrics history: NULL argument");
    fr_status a = add_point(h, s, now_s), b = add_versions(h, s, now_s), c = add_events(h, s, now_s);
    return a ? a : b ? b : c;
}
