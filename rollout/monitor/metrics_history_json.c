#include "rollout/monitor/metrics_history_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const point_names[P_FIELDS] = {
    "t", "dt", "tokens", "prompt_tokens", "finished", "tokens_total", "running", "waiting", "kv_usage",
    "ttft_sum", "ttft_n", "tpot_sum", "tpot_n", "kl_sum", "kl_n", "weight_version"};
static const char *const version_names[V_FIELDS] = {"version", "t_first", "t_last", "positions", "samples", "kl_mean",
                                                    "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1"};
static const char *const sync_names[S_FIELDS] = {"t", "version", "seconds", "committed"};
const fr_hist_table fr_hist_point_table = {"point", point_names, P_FIELDS};
const fr_hist_table fr_hist_version_table = {"version", version_names, V_FIELDS};
const fr_hist_table fr_hist_sync_table = {"sync", sync_names, S_FIELDS};

/* A number JSON can hold: null for NaN and infinities. */
static void num(fr_buf *t, double x)
{
    if (isfinite(x)) fr_buf_printf(t, "%.15g", x);
    else fr_buf_printf(t, "null");
}

void fr_history_row_json(fr_buf *t, const fr_hist_table *tab, const double *row)
{
    fr_buf_printf(t, "{\"kind\":\"%s\"", tab->kind);
    for (int f = 0; f < tab->n; f++) {
        fr_buf_printf(t, ",\"%s\":", tab->names[f]);
        num(t, row[f]);
    }
    fr_buf_printf(t, "}");
}

/* rows[n][stride] as {"name": [column], ...}; extra (may be NULL) one more row. */
static void columns(fr_buf *t, const fr_hist_table *tab, const double *rows, int n, const double *extra)
{
    fr_buf_printf(t, "{");
    for (int f = 0; f < tab->n; f++) {
        fr_buf_printf(t, "%s\"%s\":[", f ? "," : "", tab->names[f]);
        for (int i = 0; i < n; i++) {
            if (i) fr_buf_printf(t, ",");
            num(t, rows[(size_t)i * (size_t)tab->n + (size_t)f]);
        }
        if (extra) {
            if (n) fr_buf_printf(t, ",");
            num(t, extra[f]);
        }
        fr_buf_printf(t, "]");
    }
    fr_buf_printf(t, "}");
}

/* The most recent version with any position. */
static const fr_div_version *latest_version(const fr_metrics_snapshot *s)
{
    const fr_div_version *best = NULL;
    for (int i = 0; i < FR_DIV_VERSIONS; i++) {
        const fr_div_version *e = &s->div.v[i];
        if (e->used && e->all.n > 0 && (!best || e->version > best->version)) best = e;
    }
    return best;
}

static void detail_buckets(fr_buf *t, const fr_div_version *e)
{
    fr_buf_printf(t, ",\"buckets\":[");
    for (int b = 0; b < FR_DIV_BUCKETS; b++) {
        const fr_div_summary *x = &e->bucket[b];
        fr_buf_printf(t, "%s{\"bucket\":\"%s\",\"positions\":%ld,\"kl_mean\":", b ? "," : "", fr_div_bucket_name(b), x->n);
        num(t, fr_div_summary_mean(x));
        fr_buf_printf(t, ",\"top1\":");
        num(t, x->n ? (double)x->top1_agree / (double)x->n : NAN);
        fr_buf_printf(t, "}");
    }
    int n;
    const double *le = fr_hist_bounds((fr_hist_kind)e->sample_kl.kind, &n);
    fr_buf_printf(t, "],\"sample_kl\":{\"le\":[");
    for (int i = 0; i < n; i++) fr_buf_printf(t, "%s%g", i ? "," : "", le[i]);
    fr_buf_printf(t, "],\"count\":[");
    for (int i = 0; i <= n; i++) fr_buf_printf(t, "%s%lld", i ? "," : "", e->sample_kl.count[i]);
    fr_buf_printf(t, "]},\"worst\":[");
    for (int i = 0; i < e->n_worst; i++)
        fr_buf_printf(t, "%s{\"request_id\":\"%llu\",\"sample\":%d,\"positions\":%ld,\"kl_mean\":%.9g}", i ? "," : "",
                      (unsigned long long)e->worst[i].request_id, e->worst[i].sample, e->worst[i].positions,
                      e->worst[i].kl_mean);
    fr_buf_printf(t, "]");
}

char *fr_history_detail_json(const fr_metrics_snapshot *s)
{
    const fr_div_version *e = latest_version(s);
    if (!e) return NULL;
    char model[sizeof s->model], kv[sizeof s->kv_dtype];
    size_t i = 0;   /* the same cleaning as the metrics' labels */
    for (; s->model[i] && i + 1 < sizeof model; i++)
        model[i] = s->model[i] == '"' || s->model[i] == '\\' || (unsigned char)s->model[i] < 32 ? '_' : s->model[i];
    model[i] = 0;
    for (i = 0; s->kv_dtype[i] && i + 1 < sizeof kv; i++) kv[i] = s->kv_dtype[i] == '"' ? '_' : s->kv_dtype[i];
    kv[i] = 0;
    fr_buf t = {0};
    fr_buf_printf(&t, "{\"kind\":\"latest\",\"model\":\"%s\",\"kv_dtype\":\"%s\",\"version\":%llu,\"positions\":%ld,"
                  "\"samples\":%lld,\"kl_mean\":", model, kv, (unsigned long long)e->version, e->all.n, e->sample_kl.n);
    num(&t, fr_div_summary_mean(&e->all));
    fr_buf_printf(&t, ",\"top1\":");
    num(&t, (double)e->all.top1_agree / (double)e->all.n);
    detail_buckets(&t, e);
    fr_buf_printf(&t, "}");
    if (t.failed) {
        free(t.data);
        return NULL;
    }
    return t.data;
}

fr_status fr_metrics_history_json(const fr_metrics_history *h, char **out, size_t *len)
{
    if (!h || !out || !len) return fr_fail(FR_EINVAL, "fr_metrics_history_json: NULL argument");
    fr_buf t = {0};
    fr_buf_printf(&t, "{\"interval_s\":%g,\"points\":", h->width);
    columns(&t, &fr_hist_point_table, &h->points[0][0], h->n_points, h->pending[P_DT] > 0 ? h->pending : NULL);
    fr_buf_printf(&t, ",\"versions\":");
    columns(&t, &fr_hist_version_table, &h->versions[0][0], h->n_versions, NULL);
    fr_buf_printf(&t, ",\"syncs\":");
    columns(&t, &fr_hist_sync_table, &h->syncs[0][0], h->n_syncs, NULL);
    fr_buf_printf(&t, ",\"latest\":%s}\n", h->latest ? h->latest : "null");
    if (t.failed || !t.data) {
        free(t.data);
        return fr_fail(FR_ENOMEM, "metrics history: out of memory");
    }
    *out = t.data;
    *len = t.len;
    return FR_OK;
}

/* A record's fields (absent or null: NaN). */
static void parse_row(const cJSON *o, const fr_hist_table *tab, double *row)
{
    for (int f = 0; f < tab->n; f++) {
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, tab->names[f]);
        row[f] = cJSON_IsNumber(x) ? x->valuedouble : NAN;
    }
}

/* One log line into h; 0 when it is none of the records. */
static int load_line(fr_metrics_history *h, const char *line)
{
    cJSON *o = cJSON_Parse(line);
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(o, "kind");
    const char *kind = cJSON_IsString(k) ? k->valuestring : "";
    double row[P_FIELDS + V_FIELDS];
    int ok = 1;
    if (strcmp(kind, "point") == 0) {
        parse_row(o, &fr_hist_point_table, row);
        fr_history_push_point(h, row);
    } else if (strcmp(kind, "version") == 0) {
        parse_row(o, &fr_hist_version_table, row);
        fr_history_put_version(h, row);
    } else if (strcmp(kind, "sync") == 0) {
        parse_row(o, &fr_hist_sync_table, row);
        fr_history_push_sync(h, row);
    } else if (strcmp(kind, "latest") == 0) {
        char *d = cJSON_PrintUnformatted(o);
        ok = d != NULL;
        if (d) fr_history_set_latest(h, d);
    } else {
        ok = 0;
    }
    cJSON_Delete(o);
    return ok;
}

fr_status fr_metrics_history_load(const char *path, int max_points, int max_versions, fr_metrics_history **out)
{
    if (!path || !out) return fr_fail(FR_EINVAL, "fr_metrics_history_load: NULL argument");
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (!f) return fr_fail(FR_EIO, "dashboard: cannot open %s", path);
    fr_metrics_history *h;
    fr_status st = fr_metrics_history_new(max_points, max_versions, 1.0, &h);
    char *line = NULL;
    size_t cap = 0;
    long no = 0;
    while (!st && getline(&line, &cap, f) > 0) {
        no++;
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        if (!load_line(h, line)) st = fr_fail(FR_EINVAL, "dashboard: %s line %ld is not a metrics_log record", path, no);
    }
    free(line);
    fclose(f);
    if (!st && h->n_points == 0 && h->n_versions == 0 && !h->latest)
        st = fr_fail(FR_EINVAL, "dashboard: %s holds no metrics_log record", path);
    if (st) {
        fr_metrics_history_free(&h);
        return st;
    }
    *out = h;
    return FR_OK;
}
