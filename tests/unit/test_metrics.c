/* Serving metrics (rollout/monitor/metrics.h, rollout/monitor/metrics_http.h,
 * trainer_bridge/server/metrics_pub.h, metrics_sub.h): the Prometheus text and JSON
 * of a snapshot, the HTTP endpoint serving them and the dashboard over a real
 * socket on loopback, and the msgpack snapshots on a PUB socket read back
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
    r = get(port, "/metrics.json");
    has(r, "application/json");
    has(r, "\"tokens_generated_total\":5000");
    free(r);
    r = get(port, "/dashboard");
    has(r, "text/html");
    has(r, "id=\"tokens_generated_total\"");
    has(r, "fetch('/metrics.json')");
    /* self-contained: the only absolute URL is the SVG namespace */
    for (const char *u = strstr(r, "://"); u; u = strstr(u + 3, "://"))
        assert_int_equal(strncmp(u - 4, "http://www.w3.org/2000/svg", 26), 0);
    free(r);
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
                                       cmocka_unit_test(test_msgpack), cmocka_unit_test(test_pub_sub)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
