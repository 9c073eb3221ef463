/* Serving metrics (rollout/monitor/metrics.h, rollout/monitor/metrics_http.h,
 * trainer_bridge/server/metrics_pub.h, metrics_sub.h): the Prometheus text and JSON
 * of a snapshot (the histogram families included), /health by state, the
 * history (rollout/monitor/metrics_history.h) and its log, the HTTP endpoint
 * serving them and the dashboard with its library over a real socket on
 * loopback, and the msgpack snapshots on a PUB socket read back
 * by a subscriber. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <msgpack.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"
#include "rollout/monitor/metrics_http.h"
#include "trainer_bridge/client/metrics_sub.h"
#include "trainer_bridge/server/metrics_pub.h"

static void snapshot(fr_metrics_snapshot *s)
{
    memset(s, 0, sizeof *s);
    snprintf(s->model, sizeof s->model, "tq6 \"quoted\"");
    snprintf(s->kv_dtype, sizeof s->kv_dtype, "nvfp4");
    s->stats.kv_blocks_used = 12;
    s->stats.kv_blocks_free = 20;
    s->stats.running = 3;
    s->stats.waiting = 5;
    s->stats.preemptions = 2;
    s->stats.tokens_generated = 4321;
    s->stats.weight_version = 4;
    s->stats.finished = 17;
    s->requests_total = 9;
    s->tokens_per_s = 1234.5;
    s->weight_sync_seconds = 0.25;
    fr_kl_result a = {.kl = 0.002, .top1_match = 1}, b = {.kl = 0.004, .top1_match = 0};
    fr_div_aggregates_add(&s->div, 3, 100, &a);
    fr_div_aggregates_add(&s->div, 4, 100, &a);
    fr_div_aggregates_add(&s->div, 4, 5000, &b);
    s->div.samples = 2;
}

static void has(const char *text, const char *needle)
{
    if (!strstr(text, needle)) fail_msg("missing \"%s\" in:\n%s", needle, text);
}

static void test_render(void **state)
{
    (void)state;
    fr_metrics_snapshot s;
    snapshot(&s);
    char *t;
    size_t n;
    assert_int_equal(fr_metrics_prometheus(&s, &t, &n), FR_OK);
    assert_int_equal(strlen(t), n);
    has(t, "# TYPE fp4rollout_tokens_generated_total counter\nfp4rollout_tokens_generated_total 4321\n");
    has(t, "fp4rollout_kv_blocks{state=\"used\"} 12\n");
    has(t, "fp4rollout_weight_version 4\n");
    has(t, "fp4rollout_info{model=\"tq6 _quoted_\",kv_dtype=\"nvfp4\"} 1\n");
    has(t, "fp4rollout_kl_mean_nats{version=\"4\",bucket=\"0-1K\"} 0.002\n");
    has(t, "fp4rollout_kl_mean_nats{version=\"4\",bucket=\"4K-16K\"} 0.004\n");
    has(t, "fp4rollout_top1_agreement{version=\"4\",bucket=\"4K-16K\"} 0.000000\n");
    has(t, "fp4rollout_kl_positions_total{version=\"3\",bucket=\"1K-4K\"} 0\n");
    assert_null(strstr(t, "kl_mean_nats{version=\"3\",bucket=\"1K-4K\"}"));   /* no positions, no mean */
    free(t);
    assert_int_equal(fr_metrics_json(&s, &t, &n), FR_OK);
    has(t, "\"tokens_generated_total\":4321");
    has(t, "{\"version\":4,\"positions\":2,\"kl_mean_nats\":0.003,");
    free(t);
}

/* GET path from 127.0.0.1:port; returns the whole response (caller frees). */
static char *get(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[256];
    int m = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: x\r\n\r\n", path);
    assert_int_equal(write(fd, req, (size_t)m), m);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t k = read(fd, buf + len, cap - len - 1);
        if (k <= 0) break;
        len += (size_t)k;
    }
    buf[len] = 0;
    close(fd);
    return buf;
}

/* GET path: fails unless the reply has the content type and holds body. */
static void expect_page(int port, const char *path, const char *type, const char *body)
{
    char *r = get(port, path);
    has(r, type);
    has(r, body);
    free(r);
}

static void test_http(void **state)
{
    (void)state;
    fr_metrics_http *h;
    assert_int_equal(fr_metrics_http_start("127.0.0.1", 0, &h), FR_OK);
    const int port = fr_metrics_http_port(h);
    assert_true(port > 0);
    fr_metrics_snapshot s;
    snapshot(&s);
    fr_metrics_http_publish(h, &s);
    char *r = get(port, "/metrics");
    has(r, " 200 OK");
    has(r, "text/plain; version=0.0.4");
    char *t;
    size_t n;
    assert_int_equal(fr_metrics_prometheus(&s, &t, &n), FR_OK);
    has(r, t);   /* the body is exactly the rendering */
    free(t);
    free(r);
    s.stats.tokens_generated = 5000;
    fr_metrics_http_publish(h, &s);
    expect_page(port, "/metrics.json", "application/json", "\"tokens_generated_total\":5000");
    r = get(port, "/dashboard");
    has(r, "text/html");
    has(r, "fetch('/history.json')");
    has(r, "<script src=\"/uplot.js\"></script>");
    assert_null(strstr(r, "://"));   /* self-contained: no absolute URL to fetch */
    free(r);
    r = get(port, "/uplot.js");   /* the embedded library, whole and without the NUL */
    has(r, "text/javascript");
    const size_t js = (size_t)(fr_metrics_uplot_js_end - fr_metrics_uplot_js);
    assert_true(js > 10000 && fr_metrics_uplot_js[js] == 0 && strlen(fr_metrics_uplot_js) == js);
    assert_memory_equal(r + strlen(r) - js, fr_metrics_uplot_js, js);
    free(r);
    expect_page(port, "/uplot.css", "text/css", ".uplot");
    expect_page(port, "/history.json", "application/json", "\"versions\":{\"version\":[3,4]");
    r = get(port, "/nope");
    has(r, "404");
    free(r);
    fr_metrics_http *h2;
    assert_int_equal(fr_metrics_http_start("127.0.0.1", port, &h2), FR_EIO);   /* the port is taken */
    assert_int_equal(fr_metrics_http_start("localhost:80", 0, &h2), FR_EINVAL);
    fr_metrics_http_stop(&h);
    assert_null(h);
    fr_metrics_http_stop(&h);
}

/* The JSON texts a and b hold the same value (numbers to 1e-12 relative). */
static void same_json(const char *a, const char *b)
{
    cJSON *x = cJSON_Parse(a), *y = cJSON_Parse(b);
    assert_non_null(x);
    assert_non_null(y);
    if (!cJSON_Compare(x, y, 1)) fail_msg("JSON differs:\n%s\n%s", a, b);
    cJSON_Delete(x);
    cJSON_Delete(y);
}

/* /health by state: 200 serving, 503 paused or stopping; a finished run's
 * history served offline has no /metrics. */
static void test_health(void **state)
{
    (void)state;
    fr_metrics_http *h;
    assert_int_equal(fr_metrics_http_start("127.0.0.1", 0, &h), FR_OK);
    const int port = fr_metrics_http_port(h);
    fr_metrics_snapshot s;
    snapshot(&s);
    static const struct { int state; const char *status, *body; } cases[] = {
        {FR_METRICS_SERVING, " 200 OK", "serving"},
        {FR_METRICS_PAUSED, " 503 Service Unavailable", "paused"},
        {FR_METRICS_STOPPING, " 503 Service Unavailable", "stopping"},
    };
    for (int i = 0; i < 3; i++) {
        s.state = cases[i].state;
        fr_metrics_http_publish(h, &s);
        char *r = get(port, "/health");
        has(r, cases[i].status);
        has(r, cases[i].body);
        free(r);
    }
    fr_metrics_history *hist;
    assert_int_equal(fr_metrics_history_new(8, 4, 1.0, &hist), FR_OK);
    fr_metrics_http_serve_history(h, hist);
    char *r = get(port, "/health");
    has(r, " 200 OK");
    free(r);
    r = get(port, "/metrics");
    has(r, " 404 ");
    free(r);
    fr_metrics_http_stop(&h);
}

/* The Prometheus families of issue-level names: histograms cumulative with
 * +Inf equal to the count, counters by reason and result, KL by version. */
static void test_families(void **state)
{
    (void)state;
    fr_metrics_snapshot s;
    snapshot(&s);
    fr_serving_stats_init(&s.serving);
    fr_hist_add(&s.serving.ttft, 0.003);
    fr_hist_add(&s.serving.ttft, 0.2);
    fr_hist_add(&s.serving.ttft, 500.0);   /* above every bound */
    s.serving.prompt_tokens = 77;
    s.serving.finished[FR_FINISH_LENGTH] = 5;
    s.serving.finished[FR_FINISH_ABORT] = 1;
    s.weight_updates_committed = 2;
    s.weight_updates_refused = 1;
    fr_hist_add(&s.weight_update_seconds, 0.03);
    fr_div_summary one = {.n = 4, .kl_sum = 0.004};
    fr_div_aggregates_add_sample(&s.div, 4, 99, 1, &one);
    char *t;
    size_t n;
    assert_int_equal(fr_metrics_prometheus(&s, &t, &n), FR_OK);
    has(t, "# TYPE fp4rollout_time_to_first_token_seconds histogram\n");
    has(t, "fp4rollout_time_to_first_token_seconds_bucket{le=\"0.001\"} 0\n");
    has(t, "fp4rollout_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n");
    has(t, "fp4rollout_time_to_first_token_seconds_bucket{le=\"0.25\"} 2\n");
    has(t, "fp4rollout_time_to_first_token_seconds_bucket{le=\"120\"} 2\n");
    has(t, "fp4rollout_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n");
    has(t, "fp4rollout_time_to_first_token_seconds_sum 500.203\nfp4rollout_time_to_first_token_seconds_count 3\n");
    has(t, "fp4rollout_time_per_output_token_seconds_count 0\n");
    has(t, "fp4rollout_prompt_tokens_total 77\n");
    has(t, "fp4rollout_generation_tokens_total 4321\n");
    has(t, "fp4rollout_requests_finished_total{finished_reason=\"length\"} 5\n");
    has(t, "fp4rollout_requests_finished_total{finished_reason=\"abort\"} 1\n");
    has(t, "fp4rollout_requests_finished_total{finished_reason=\"stop\"} 0\n");
    has(t, "fp4rollout_num_requests_running 3\n");
    has(t, "fp4rollout_num_requests_waiting 5\n");
    has(t, "fp4rollout_kv_cache_usage_ratio 0.375000\n");   /* 12 of 32 blocks */
    has(t, "fp4rollout_weight_updates_total{result=\"committed\"} 2\nfp4rollout_weight_updates_total{result=\"refused\"} 1\n");
    has(t, "fp4rollout_weight_update_duration_seconds_bucket{le=\"0.04\"} 1\n");
    has(t, "fp4rollout_kl_nats_bucket{version=\"4\",le=\"0.002\"} 1\n");
    has(t, "fp4rollout_kl_nats_bucket{version=\"4\",le=\"+Inf\"} 2\n");
    has(t, "fp4rollout_kl_nats_sum{version=\"4\"} 0.006\nfp4rollout_kl_nats_count{version=\"4\"} 2\n");
    has(t, "fp4rollout_kl_nats_count{version=\"3\"} 1\n");
    has(t, "fp4rollout_sample_kl_nats_count{version=\"4\"} 1\n");
    has(t, "fp4rollout_kl_bucket_nats_total{version=\"4\",bucket=\"4K-16K\"} 0.004\n");
    has(t, "fp4rollout_top1_agreements_total{version=\"4\",bucket=\"0-1K\"} 1\n");
    has(t, "fp4rollout_up 1\n");
    has(t, "fp4rollout_build_info{cuda=");
    assert_null(strstr(t, "tokens_per_second"));   /* a rate is Prometheus's to compute */
    free(t);
    s.state = FR_METRICS_PAUSED;
    assert_int_equal(fr_metrics_prometheus(&s, &t, &n), FR_OK);
    has(t, "fp4rollout_up 0\n");
    free(t);
}

/* Quantiles read from a histogram, interpolated inside the bucket. */
static void test_quantile(void **state)
{
    (void)state;
    fr_hist h;
    fr_hist_init(&h, FR_HIST_KL);
    assert_true(isnan(fr_hist_quantile(&h, 0.5)));
    for (int i = 0; i < 10; i++) fr_hist_add(&h, 1.5e-3);   /* all in (1e-3, 2e-3] */
    double q = fr_hist_quantile(&h, 0.5);
    assert_true(q > 1e-3 && q <= 2e-3);
    fr_hist_add(&h, 0.3);
    assert_true(fr_hist_quantile(&h, 0.99) > 0.2 && fr_hist_quantile(&h, 0.99) <= 0.5);
    assert_true(fr_hist_quantile(&h, 0.1) <= fr_hist_quantile(&h, 0.5));
    fr_hist_add(&h, NAN);   /* ignored */
    assert_int_equal(h.n, 11);
}

/* A snapshot of a run at a point: `tokens` drawn, positions measured on
 * `version`. */
static void run_at(fr_metrics_snapshot *s, long long tokens, uint64_t version, int committed)
{
    snapshot(s);
    memset(&s->div, 0, sizeof s->div);
    fr_serving_stats_init(&s->serving);
    s->stats.tokens_generated = tokens;
    s->stats.weight_version = version;
    s->weight_updates_committed = committed;
    fr_kl_result k = {.kl = 0.001 * (double)(version + 1), .top1_match = 1};
    for (long i = 0; i < tokens / 10; i++) fr_div_aggregates_add(&s->div, version, i, &k);
    fr_div_summary one = {.n = 10, .kl_sum = 0.01};
    fr_div_aggregates_add_sample(&s->div, version, 1000 + (uint64_t)tokens, 0, &one);
}

static char *history_text(const fr_metrics_history *h)
{
    char *t;
    size_t n;
    assert_int_equal(fr_metrics_history_json(h, &t, &n), FR_OK);
    assert_int_equal(strlen(t), n);
    return t;
}

/* Points summed per interval, merged in pairs when full; a row per version;
 * weight updates; the log read back into the same history. */
static void test_history(void **state)
{
    (void)state;
    char path[] = "/tmp/fr_test_history_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    fr_metrics_history *h;
    assert_int_equal(fr_metrics_history_new(3, 4, 1.0, &h), FR_EINVAL);   /* too few points */
    assert_int_equal(fr_metrics_history_new(4, 4, 1.0, &h), FR_OK);
    assert_int_equal(fr_metrics_history_log_to(h, path), FR_OK);
    fr_metrics_snapshot s;
    for (int i = 0; i <= 10; i++) {   /* 100 tokens a second for 10 s, a weight update at 5 s */
        run_at(&s, 100 * i, i >= 5, i >= 5);
        assert_int_equal(fr_metrics_history_add(h, &s, 1000.0 + i), FR_OK);
    }
    /* 10 intervals of 1 s into 4 points: 1+1+1+1 -> 2+2, +1+1 -> 2+2+2(+...): widths double */
    assert_true(fr_metrics_history_points(h) <= 4);
    assert_int_equal(fr_metrics_history_versions(h), 2);
    char *live = history_text(h);
    cJSON *j = cJSON_Parse(live);
    assert_non_null(j);
    const cJSON *p = cJSON_GetObjectItem(j, "points");
    double tokens = 0, dt = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, cJSON_GetObjectItem(p, "tokens")) tokens += x->valuedouble;
    cJSON_ArrayForEach(x, cJSON_GetObjectItem(p, "dt")) dt += x->valuedouble;
    assert_true(fabs(tokens - 1000.0) < 1e-9 && fabs(dt - 10.0) < 1e-9);   /* nothing lost in the merging */
    assert_true(cJSON_GetObjectItem(j, "interval_s")->valuedouble >= 2.0);
    has(live, "\"syncs\":{\"t\":[1005],\"version\":[1],\"seconds\":[0.25],\"committed\":[1]}");
    has(live, "\"latest\":{\"kind\":\"latest\",\"model\":\"tq6 _quoted_\",\"kv_dtype\":\"nvfp4\",\"version\":1,");
    has(live, "\"worst\":[{\"request_id\":\"2000\",\"sample\":0,\"positions\":10,\"kl_mean\":0.001}");
    cJSON_Delete(j);
    fr_metrics_history_free(&h);
    /* the log gives back the same versions, updates and latest, and the logged points */
    fr_metrics_history *back;
    assert_int_equal(fr_metrics_history_load(path, 4, 4, &back), FR_OK);
    char *again = history_text(back);
    const char *v1 = strstr(live, "\"versions\""), *v2 = strstr(again, "\"versions\"");
    assert_non_null(v1);
    assert_non_null(v2);
    assert_string_equal(v1, v2);
    free(again);
    free(live);
    fr_metrics_history_free(&back);
    FILE *f = fopen(path, "a");
    fputs("{\"kind\":\"nonsense\"}\n", f);
    fclose(f);
    assert_int_equal(fr_metrics_history_load(path, 4, 4, &back), FR_EINVAL);
    has(fr_last_error(), "is not a metrics_log record");
    assert_null(back);
    unlink(path);
    assert_int_equal(fr_metrics_history_load(path, 4, 4, &back), FR_EIO);
}

static void test_msgpack(void **state)
{
    (void)state;
    fr_metrics_snapshot s;
    snapshot(&s);
    s.stats.weight_version = 18446744073709551615ull;   /* integers stay exact */
    char *mp, *json, *ref;
    size_t n, rn;
    assert_int_equal(fr_metrics_msgpack(&s, &mp, &n), FR_OK);
    assert_int_equal(fr_msgpack_to_json(mp, n, &json), FR_OK);
    assert_int_equal(fr_metrics_json(&s, &ref, &rn), FR_OK);
    same_json(json, ref);
    has(json, "\"weight_version\":18446744073709551615");
    has(json, "\"model\":\"tq6 _quoted_\"");
    has(json, "\"bucket\":\"4K-16K\"");
    /* what JSON cannot hold, and broken input, are errors that say so */
    char *trunc;
    assert_int_equal(fr_msgpack_to_json(mp, n - 1, &trunc), FR_EFORMAT);
    assert_null(trunc);
    free(json);
    free(ref);
    free(mp);
    char *out;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "b", 1);
    msgpack_pack_bin(&pk, 2);
    msgpack_pack_bin_body(&pk, "xy", 2);
    assert_int_equal(fr_msgpack_to_json(sb.data, sb.size, &out), FR_EFORMAT);
    assert_null(out);
    msgpack_sbuffer_clear(&sb);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 0.1);
    msgpack_pack_double(&pk, NAN);
    msgpack_pack_int64(&pk, -7);
    assert_int_equal(fr_msgpack_to_json(sb.data, sb.size, &out), FR_OK);
    assert_string_equal(out, "[0.1,null,-7]");
    free(out);
    msgpack_sbuffer_destroy(&sb);
}

static void test_pub_sub(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    assert_non_null(ctx);
    fr_metrics_pub *pub, *bad;
    assert_int_equal(fr_metrics_pub_open(ctx, "tcp://127.0.0.1:*", NULL, &pub), FR_OK);
    assert_int_equal(fr_metrics_pub_open(ctx, "nope://x", NULL, &bad), FR_EIO);
    assert_null(bad);
    fr_metrics_sub *sub, *bad_sub;
    assert_int_equal(fr_metrics_sub_new("not an endpoint", NULL, &bad_sub), FR_EINVAL);
    assert_null(bad_sub);
    assert_int_equal(fr_metrics_sub_new(fr_metrics_pub_endpoint(pub), NULL, &sub), FR_OK);
    char *json = (char *)"x";
    assert_int_equal(fr_metrics_sub_next(sub, 10, &json), FR_OK);   /* nothing published yet */
    assert_null(json);
    /* a subscriber sees what is published after it has joined: publish
     * until one arrives */
    fr_metrics_snapshot s;
    snapshot(&s);
    const double t0 = fr_now_s();
    while (!json && fr_now_s() - t0 < 10.0) {
        assert_int_equal(fr_metrics_pub_send(pub, &s), FR_OK);
        assert_int_equal(fr_metrics_sub_next(sub, 20, &json), FR_OK);
    }
    assert_non_null(json);
    char *ref;
    size_t rn;
    assert_int_equal(fr_metrics_json(&s, &ref, &rn), FR_OK);
    same_json(json, ref);
    fr_client_free_string(json);
    free(ref);
    fr_metrics_sub_destroy(&sub);
    assert_null(sub);
    fr_metrics_pub_close(&pub);
    assert_null(pub);
    fr_metrics_pub_close(&pub);
    zmq_ctx_term(ctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_render), cmocka_unit_test(test_http),
                                       cmocka_unit_test(test_health), cmocka_unit_test(test_families),
                                       cmocka_unit_test(test_quantile), cmocka_unit_test(test_history),
                                       cmocka_unit_test(test_msgpack), cmocka_unit_test(test_pub_sub)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
