#include "rollout/monitor/metrics.h"

#include "base/buf.h"
#include "rollout/model/runner.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef fr_buf text;

static fr_status finish(text *t, char **out, size_t *len)
{
    if (t->failed || !t->data) {
        free(t->data);
        return fr_fail(FR_ENOMEM, "metrics: out of memory");
    }
    *out = t->data;
    *len = t->len;
    return FR_OK;
}

/* A label or JSON string value without quotes, backslashes or control
 * characters (model names are paths chosen by the operator). */
static void clean(char *dst, size_t n, const char *src)
{
    size_t i = 0;
    for (; src && src[i] && i + 1 < n; i++)
        dst[i] = src[i] == '"' || src[i] == '\\' || (unsigned char)src[i] < 32 ? '_' : src[i];
    dst[i] = 0;
}

/* A number Prometheus and JSON both read: NaN as the literal of each. */
static double finite_or(double x, double dflt) { return isfinite(x) ? x : dflt; }

static void gauge(text *t, const char *name, const char *help, const char *type)
{
    fr_buf_printf(t, "# HELP fp4rollout_%s %s\n# TYPE fp4rollout_%s %s\n", name, help, name, type);
}

const char *fr_metrics_state_name(int state)
{
    return state == FR_METRICS_PAUSED ? "paused" : state == FR_METRICS_STOPPING ? "stopping" : "serving";
}

double fr_metrics_kv_usage(const fr_metrics_snapshot *s)
{
    const int all = s->stats.kv_blocks_used + s->stats.kv_blocks_free;
    return all > 0 ? (double)s->stats.kv_blocks_used / (double)all : 0.0;
}

/* One histogram in the Prometheus convention: cumulative name_bucket{le},
 * name_sum, name_count; labels ("" or `k="v"`) go first in each. */
static void histogram(text *t, const char *name, const char *labels, const fr_hist *h)
{
    int n;
    const double *b = fr_hist_bounds((fr_hist_kind)h->kind, &n);
    const char *sep = labels[0] ? "," : "";
    long long cum = 0;
    for (int i = 0; i < n; i++) {
        cum += h->count[i];
        fr_buf_printf(t, "fp4rollout_%s_bucket{%s%sle=\"%g\"} %lld\n", name, labels, sep, b[i], cum);
    }
    fr_buf_printf(t, "fp4rollout_%s_bucket{%s%sle=\"+Inf\"} %lld\n", name, labels, sep, h->n);
    fr_buf_printf(t, "fp4rollout_%s_sum%s%s%s %.9g\nfp4rollout_%s_count%s%s%s %lld\n", name, labels[0] ? "{" : "",
                  labels, labels[0] ? "}" : "", h->sum, name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "", h->n);
}

/* The families vLLM users chart, under fp4rollout_ (docs/metrics.md). */
static void serving_families(text *t, const fr_metrics_snapshot *s)
{
    const fr_serving_stats *v = &s->serving;
    gauge(t, "build_info", "how this binary was built (value 1)", "gauge");
    const char *cuda = fr_cuda_built() ? "yes" : "no";
    char compiler[64];
    clean(compiler, sizeof compiler, __VERSION__);
    fr_buf_printf(t, "fp4rollout_build_info{cuda=\"%s\",compiler=\"%s\",built=\"%s\"} 1\n", cuda, compiler, __DATE__);
    gauge(t, "prompt_tokens_total", "prompt tokens of requests that drew their first token", "counter");
    fr_buf_printf(t, "fp4rollout_prompt_tokens_total %lld\n", v->prompt_tokens);
    gauge(t, "generation_tokens_total", "tokens drawn (the same count as tokens_generated_total)", "counter");
    fr_buf_printf(t, "fp4rollout_generation_tokens_total %lld\n", s->stats.tokens_generated);
    gauge(t, "num_requests_running", "samples decoding or prefilling", "gauge");
    fr_buf_printf(t, "fp4rollout_num_requests_running %d\n", s->stats.running + s->stats.prefilling);
    gauge(t, "num_requests_waiting", "samples not admitted yet, or preempted", "gauge");
    fr_buf_printf(t, "fp4rollout_num_requests_waiting %d\n", s->stats.waiting);
    gauge(t, "kv_cache_usage_ratio", "share of KV cache blocks in use (0..1)", "gauge");
    fr_buf_printf(t, "fp4rollout_kv_cache_usage_ratio %.6f\n", fr_metrics_kv_usage(s));
    gauge(t, "requests_finished_total", "samples ended, by finish reason", "counter");
    for (int i = 1; i < FR_FINISH_KINDS; i++)
        fr_buf_printf(t, "fp4rollout_requests_finished_total{finished_reason=\"%s\"} %lld\n",
                      fr_finish_reason_name((fr_finish_reason)i), v->finished[i]);
    gauge(t, "time_to_first_token_seconds", "from submit to the first token, per sample", "histogram");
    histogram(t, "time_to_first_token_seconds", "", &v->ttft);
    gauge(t, "time_per_output_token_seconds", "mean time between tokens after the first, per sample", "histogram");
    histogram(t, "time_per_output_token_seconds", "", &v->tpot);
    gauge(t, "e2e_request_latency_seconds", "from submit to the end, per sample", "histogram");
    histogram(t, "e2e_request_latency_seconds", "", &v->e2e);
    gauge(t, "weight_updates_total", "weight updates by result: committed, refused (refused or failed)", "counter");
    fr_buf_printf(t, "fp4rollout_weight_updates_total{result=\"committed\"} %lld\n"
                  "fp4rollout_weight_updates_total{result=\"refused\"} %lld\n",
                  s->weight_updates_committed, s->weight_updates_refused);
    gauge(t, "weight_update_duration_seconds", "committed weight updates, from begin to commit", "histogram");
    histogram(t, "weight_update_duration_seconds", "", &s->weight_update_seconds);
    gauge(t, "up", "1 while serving, 0 while paused or shutting down (as /health)", "gauge");
    fr_buf_printf(t, "fp4rollout_up %d\n", s->state == FR_METRICS_SERVING);
}

/* KL as histograms (sums and counts add over time and servers) and top-1
 * agreements as a counter, by weight version: at most FR_DIV_VERSIONS. */
static void divergence_families(text *t, const fr_metrics_snapshot *s)
{
    char lab[48];
    gauge(t, "top1_agreements_total", "positions where both argmaxes agree, by version and position bucket",
          "counter");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        for (int b = 0; s->div.v[v].used && b < FR_DIV_BUCKETS; b++)
            fr_buf_printf(t, "fp4rollout_top1_agreements_total{version=\"%llu\",bucket=\"%s\"} %ld\n",
                          (unsigned long long)s->div.v[v].version, fr_div_bucket_name(b), s->div.v[v].bucket[b].top1_agree);
    gauge(t, "kl_bucket_nats_total", "sum of D_t by weight version and position bucket (over kl_positions_total: the mean)",
          "counter");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        for (int b = 0; s->div.v[v].used && b < FR_DIV_BUCKETS; b++)
            fr_buf_printf(t, "fp4rollout_kl_bucket_nats_total{version=\"%llu\",bucket=\"%s\"} %.9g\n",
                          (unsigned long long)s->div.v[v].version, fr_div_bucket_name(b), s->div.v[v].bucket[b].kl_sum);
    gauge(t, "kl_nats", "D_t of every measured position (paper Eq. 9), by weight version", "histogram");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        if (s->div.v[v].used) {
            snprintf(lab, sizeof lab, "version=\"%llu\"", (unsigned long long)s->div.v[v].version);
            histogram(t, "kl_nats", lab, &s->div.v[v].kl);
        }
    gauge(t, "sample_kl_nats", "mean D_t of each finished monitored sample, by the version of its last token",
          "histogram");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        if (s->div.v[v].used) {
            snprintf(lab, sizeof lab, "version=\"%llu\"", (unsigned long long)s->div.v[v].version);
            histogram(t, "sample_kl_nats", lab, &s->div.v[v].sample_kl);
        }
}

static double kl_max(const fr_div_summary *b) { return b->kl_max; }
static double top1_share(const fr_div_summary *b) { return (double)b->top1_agree / (double)b->n; }

/* A gauge family by weight version and position bucket, over the buckets
 * that measured something; a share is printed to 6 decimals, else 9
 * significant digits. */
static void bucket_gauge(text *t, const fr_metrics_snapshot *s, const char *name, const char *help,
                         double (*value)(const fr_div_summary *), int share)
{
    gauge(t, name, help, "gauge");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        for (int b = 0; s->div.v[v].used && b < FR_DIV_BUCKETS; b++)
            if (s->div.v[v].bucket[b].n)
                fr_buf_printf(t, share ? "fp4rollout_%s{version=\"%llu\",bucket=\"%s\"} %.6f\n"
                                       : "fp4rollout_%s{version=\"%llu\",bucket=\"%s\"} %.9g\n",
                              name, (unsigned long long)s->div.v[v].version, fr_div_bucket_name(b),
                              value(&s->div.v[v].bucket[b]));
}

fr_status fr_metrics_prometheus(const fr_metrics_snapshot *s, char **out, size_t *len)
{
    if (!s || !out || !len) return fr_fail(FR_EINVAL, "fr_metrics_prometheus: NULL argument");
    text t = {0};
    const fr_scheduler_stats *st = &s->stats;
    char model[sizeof s->model], kv[sizeof s->kv_dtype];
    clean(model, sizeof model, s->model);
    clean(kv, sizeof kv, s->kv_dtype);
    gauge(&t, "info", "the engine's model and KV cache dtype (value 1)", "gauge");
    fr_buf_printf(&t, "fp4rollout_info{model=\"%s\",kv_dtype=\"%s\"} 1\n", model, kv);
    gauge(&t, "uptime_seconds", "seconds since the server started", "gauge");
    fr_buf_printf(&t, "fp4rollout_uptime_seconds %.3f\n", s->uptime_s);
    gauge(&t, "kv_blocks", "KV cache blocks (128 tokens each) by state", "gauge");
    fr_buf_printf(&t, "fp4rollout_kv_blocks{state=\"used\"} %d\nfp4rollout_kv_blocks{state=\"free\"} %d\n", st->kv_blocks_used,
                  st->kv_blocks_free);
    gauge(&t, "samples", "samples by state: running (decoding), prefilling (prompts), waiting", "gauge");
    fr_buf_printf(&t, "fp4rollout_samples{state=\"running\"} %d\nfp4rollout_samples{state=\"prefilling\"} %d\n"
                  "fp4rollout_samples{state=\"waiting\"} %d\n",
                  st->running, st->prefilling, st->waiting);
    gauge(&t, "requests_total", "generate requests accepted", "counter");
    fr_buf_printf(&t, "fp4rollout_requests_total %lld\n", s->requests_total);
    gauge(&t, "samples_finished_total", "samples ended, any reason", "counter");
    fr_buf_printf(&t, "fp4rollout_samples_finished_total %lld\n", st->finished);
    gauge(&t, "preemptions_total", "samples or prefills dropped and recomputed", "counter");
    fr_buf_printf(&t, "fp4rollout_preemptions_total %lld\n", st->preemptions);
    gauge(&t, "tokens_generated_total", "tokens drawn", "counter");
    fr_buf_printf(&t, "fp4rollout_tokens_generated_total %lld\n", st->tokens_generated);
    gauge(&t, "weight_version", "weight version new tokens are drawn with", "gauge");
    fr_buf_printf(&t, "fp4rollout_weight_version %llu\n", (unsigned long long)st->weight_version);
    gauge(&t, "weight_sync_seconds", "duration of the last committed weight update", "gauge");
    fr_buf_printf(&t, "fp4rollout_weight_sync_seconds %.6f\n", s->weight_sync_seconds);
    gauge(&t, "monitored_running", "running samples with a BF16 shadow", "gauge");
    fr_buf_printf(&t, "fp4rollout_monitored_running %d\n", st->monitored);
    gauge(&t, "monitored_samples_total", "monitored samples finished", "counter");
    fr_buf_printf(&t, "fp4rollout_monitored_samples_total %lld\n", s->div.samples);
    gauge(&t, "recalibrations_total", "automatic recalibrations of the key mean done", "counter");
    fr_buf_printf(&t, "fp4rollout_recalibrations_total %lld\n", s->recalibrations);
    gauge(&t, "recalibration_failures_total", "automatic recalibrations that failed (the old key mean stayed)",
          "counter");
    fr_buf_printf(&t, "fp4rollout_recalibration_failures_total %lld\n", s->recalibration_failures);
    gauge(&t, "last_recalibration_version", "weight version of the last recalibration (0: none)", "gauge");
    fr_buf_printf(&t, "fp4rollout_last_recalibration_version %llu\n", (unsigned long long)s->last_recalibration_version);
    gauge(&t, "last_recalibration_seconds", "duration of the last recalibration", "gauge");
    fr_buf_printf(&t, "fp4rollout_last_recalibration_seconds %.6f\n", s->last_recalibration_seconds);
    gauge(&t, "kl_positions_total", "positions whose divergence was measured, by weight version and position bucket",
          "counter");
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        for (int b = 0; s->div.v[v].used && b < FR_DIV_BUCKETS; b++)
            fr_buf_printf(&t, "fp4rollout_kl_positions_total{version=\"%llu\",bucket=\"%s\"} %ld\n",
                          (unsigned long long)s->div.v[v].version, fr_div_bucket_name(b), s->div.v[v].bucket[b].n);
    bucket_gauge(&t, s, "kl_mean_nats", "mean KL(BF16 KV || served KV) over BF16's top-128 tokens (paper Eq. 9)",
                 fr_div_summary_mean, 0);
    bucket_gauge(&t, s, "kl_max_nats", "largest per-position KL", kl_max, 0);
    bucket_gauge(&t, s, "top1_agreement", "share of positions where BF16 KV and served KV agree on the top token",
                 top1_share, 1);
    serving_families(&t, s);
    divergence_families(&t, s);
    return finish(&t, out, len);
}

fr_status fr_metrics_json(const fr_metrics_snapshot *s, char **out, size_t *len)
{
    if (!s || !out || !len) return fr_fail(FR_EINVAL, "fr_metrics_json: NULL argument");
    text t = {0};
    const fr_scheduler_stats *st = &s->stats;
    char model[sizeof s->model], kv[sizeof s->kv_dtype];
    clean(model, sizeof model, s->model);
    clean(kv, sizeof kv, s->kv_dtype);
    fr_buf_printf(&t,
                  "{\"model\":\"%s\",\"kv_dtype\":\"%s\",\"uptime_s\":%.3f,\"kv_blocks_used\":%d,\"kv_blocks_free\":%d,"
                  "\"running\":%d,\"prefilling\":%d,\"waiting\":%d,\"requests_total\":%lld,\"samples_finished_total\":%lld,"
                  "\"preemptions_total\":%lld,\"tokens_generated_total\":%lld,\"tokens_per_second\":%.3f,"
                  "\"weight_version\":%llu,\"weight_sync_seconds\":%.6f,\"monitored_running\":%d,"
                  "\"monitored_samples_total\":%lld,\"recalibrations_total\":%lld,\"recalibration_failures_total\":%lld,"
                  "\"last_recalibration_version\":%llu,\"last_recalibration_seconds\":%.6f,"
                  "\"last_recalibration_kl_nats\":%.9g,",
                  model, kv, s->uptime_s, st->kv_blocks_used, st->kv_blocks_free, st->running, st->prefilling,
                  st->waiting, s->requests_total, st->finished, st->preemptions, st->tokens_generated, s->tokens_per_s,
                  (unsigned long long)st->weight_version, s->weight_sync_seconds, st->monitored, s->div.samples,
                  s->recalibrations, s->recalibration_failures, (unsigned long long)s->last_recalibration_version,
                  s->last_recalibration_seconds, finite_or(s->last_recalibration_kl, 0.0));
    const fr_serving_stats *sv = &s->serving;
    fr_buf_printf(&t,
                  "\"state\":\"%s\",\"prompt_tokens_total\":%lld,\"kv_cache_usage_ratio\":%.6f,"
                  "\"finished_stop\":%lld,\"finished_length\":%lld,\"finished_abort\":%lld,\"finished_error\":%lld,"
                  "\"weight_updates_committed\":%lld,\"weight_updates_refused\":%lld,\"divergence\":[",
                  fr_metrics_state_name(s->state), sv->prompt_tokens, fr_metrics_kv_usage(s), sv->finished[1],
                  sv->finished[2], sv->finished[3], sv->finished[4], s->weight_updates_committed,
                  s->weight_updates_refused);
    int first = 1;
    for (int v = 0; v < FR_DIV_VERSIONS; v++) {
        const fr_div_version *e = &s->div.v[v];
        if (!e->used) continue;
        fr_buf_printf(&t, "%s{\"version\":%llu,\"positions\":%ld,\"kl_mean_nats\":%.9g,\"kl_max_nats\":%.9g,"
                      "\"top1_agreement\":%.6f,\"buckets\":[",
                      first ? "" : ",", (unsigned long long)e->version, e->all.n, finite_or(fr_div_summary_mean(&e->all), 0.0),
                      e->all.kl_max, e->all.n ? (double)e->all.top1_agree / (double)e->all.n : 0.0);
        first = 0;
        for (int b = 0; b < FR_DIV_BUCKETS; b++)
            fr_buf_printf(&t, "%s{\"bucket\":\"%s\",\"positions\":%ld,\"kl_mean_nats\":%.9g,\"top1_agreement\":%.6f}",
                          b ? "," : "", fr_div_bucket_name(b), e->bucket[b].n,
                          finite_or(fr_div_summary_mean(&e->bucket[b]), 0.0),
                          e->bucket[b].n ? (double)e->bucket[b].top1_agree / (double)e->bucket[b].n : 0.0);
        fr_buf_printf(&t, "]}");
    }
    fr_buf_printf(&t, "]}\n");
    return finish(&t, out, len);
}
