#include "rollout/monitor/metrics_http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

struct fr_metrics_http {
    struct MHD_Daemon *d;
    pthread_mutex_t mu;
    fr_metrics_snapshot snap;
    int port;
    fr_metrics_history *hist;   /* NULL until the first snapshot (or log_to) */
    int offline;                /* serving a finished run's history */
};

/* ---- the routes beside /metrics ---- */

typedef struct {
    char *body;
    size_t len;
    const char *type;
    unsigned status;
    int owned;   /* body is malloc'ed */
} reply;

static int text_reply(reply *r, unsigned status, const char *msg)
{
    *r = (reply){.body = (char *)msg, .len = strlen(msg), .type = "text/plain; charset=utf-8", .status = status};
    return 1;
}

/* The page and the charting library, embedded at build time. */
static int asset_route(const char *url, reply *r)
{
    const char *b = NULL, *e = NULL, *type = NULL;
    if (strcmp(url, "/dashboard") == 0 || strcmp(url, "/") == 0) {
        b = fr_metrics_dashboard_html, e = fr_metrics_dashboard_html_end, type = "text/html; charset=utf-8";
    } else if (strcmp(url, "/uplot.js") == 0) {
        b = fr_metrics_uplot_js, e = fr_metrics_uplot_js_end, type = "text/javascript; charset=utf-8";
    } else if (strcmp(url, "/uplot.css") == 0) {
        b = fr_metrics_uplot_css, e = fr_metrics_uplot_css_end, type = "text/css; charset=utf-8";
    } else {
        return 0;
    }
    *r = (reply){.body = (char *)b, .len = (size_t)(e - b), .type = type, .status = MHD_HTTP_OK};
    return 1;
}

/* 200 while serving (or showing a finished run), 503 while paused or
 * stopping, so a load balancer or a supervisor can tell. */
static int health_route(fr_metrics_http *h, const char *url, reply *r)
{
    if (strcmp(url, "/health") != 0) return 0;
    pthread_mutex_lock(&h->mu);
    const int state = h->offline ? FR_METRICS_SERVING : h->snap.state;
    pthread_mutex_unlock(&h->mu);
    static const char ok[] = "serving\n", paused[] = "paused\n", stopping[] = "stopping\n";
    if (state == FR_METRICS_SERVING) return text_reply(r, MHD_HTTP_OK, ok);
    return text_reply(r, MHD_HTTP_SERVICE_UNAVAILABLE, state == FR_METRICS_PAUSED ? paused : stopping);
}

/* The history, made on first use (2048 points of 1 s at first, 1024
 * versions). Under h->mu. */
static fr_metrics_history *history_of(fr_metrics_http *h)
{
    if (!h->hist && fr_metrics_history_new(2048, 1024, 1.0, &h->hist)) h->hist = NULL;
    return h->hist;
}

static int history_route(fr_metrics_http *h, const char *url, reply *r)
{
    if (strcmp(url, "/history.json") != 0) return 0;
    *r = (reply){.type = "application/json", .status = MHD_HTTP_OK, .owned = 1};
    pthread_mutex_lock(&h->mu);
    fr_status st = history_of(h) ? fr_metrics_history_json(h->hist, &r->body, &r->len) : FR_ENOMEM;
    pthread_mutex_unlock(&h->mu);
    if (st) {
        static const char err[] = "out of memory\n";
        return text_reply(r, MHD_HTTP_INTERNAL_SERVER_ERROR, err);
    }
    return 1;
}

static int other_route(fr_metrics_http *h, const char *url, reply *r)
{
    return asset_route(url, r) || health_route(h, url, r) || history_route(h, url, r);
}


static enum MHD_Result answer(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_len, void **con_cls)
{
    (void)version; (void)upload; (void)upload_len; (void)con_cls;
    fr_metrics_http *h = cls;
    if (strcmp(method, "GET") != 0) {
        static const char msg[] = "only GET\n";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_METHOD_NOT_ALLOWED, r);
        MHD_destroy_response(r);
        return ret;
    }
    char *body = NULL;
    size_t len = 0;
    const char *type = "text/plain; version=0.0.4; charset=utf-8";
    unsigned status = MHD_HTTP_OK;
    int owned = 1;
    reply rp;
    if (other_route(h, url, &rp)) {
        body = rp.body, len = rp.len, type = rp.type, status = rp.status, owned = rp.owned;
    } else if (h->offline) {
        status = MHD_HTTP_NOT_FOUND;
    } else if (strcmp(url, "/metrics") == 0 || strcmp(url, "/metrics.json") == 0) {
        fr_metrics_snapshot s;
        pthread_mutex_lock(&h->mu);
        s = h->snap;
        pthread_mutex_unlock(&h->mu);
        const int json = strcmp(url, "/metrics.json") == 0;
        if (json) type = "application/json";
        if (json ? fr_metrics_json(&s, &body, &len) : fr_metrics_prometheus(&s, &body, &len)) {
            body = NULL;
            status = MHD_HTTP_INTERNAL_SERVER_ERROR;
        }
    } else {
        status = MHD_HTTP_NOT_FOUND;
    }
    if (!body) {
        static const char nf[] = "not found: /metrics, /metrics.json, /health, /history.json, /dashboard\n", err[] = "out of memory\n";
        body = (char *)(status == MHD_HTTP_NOT_FOUND ? nf : err);
        len = strlen(body);
        owned = 0;
        type = "text/plain; charset=utf-8";
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        if (owned) free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

fr_status fr_metrics_http_start(const char *bind_addr, int port, fr_metrics_http **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_metrics_http_start: NULL argument");
    *out = NULL;
    if (port < 0 || port > 65535) return fr_fail(FR_EINVAL, "metrics: port %d outside [0, 65535]", port);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (bind_addr && (strcmp(bind_addr, "*") == 0 || strcmp(bind_addr, "0.0.0.0") == 0)) bind_addr = "0.0.0.0";
    if (inet_pton(AF_INET, bind_addr ? bind_addr : "127.0.0.1", &a.sin_addr) != 1)
        return fr_fail(FR_EINVAL, "metrics: '%s' is not an IPv4 address", bind_addr);
    fr_metrics_http *h = calloc(1, sizeof *h);
    if (!h) return fr_fail(FR_ENOMEM, "metrics: out of memory");
    pthread_mutex_init(&h->mu, NULL);
    h->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, (uint16_t)port, NULL, NULL, answer, h,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&a, MHD_OPTION_END);
    if (!h->d) {
        pthread_mutex_destroy(&h->mu);
        free(h);
        return fr_fail(FR_EIO, "metrics: cannot listen on %s:%d (in use, or not an address of this host)",
                       bind_addr ? bind_addr : "127.0.0.1", port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : port;
    *out = h;
    return FR_OK;
}

int fr_metrics_http_port(const fr_metrics_http *h) { return h ? h->port : 0; }

void fr_metrics_http_publish(fr_metrics_http *h, const fr_metrics_snapshot *s)
{
    if (!h || !s) return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    pthread_mutex_lock(&h->mu);
    if (!h->offline) {
        h->snap = *s;
        /* a failed log write is seen by the reader of the file; serving goes on */
        if (history_of(h)) (void)fr_metrics_history_add(h->hist, s, (double)now.tv_sec + 1e-9 * (double)now.tv_nsec);
    }
    pthread_mutex_unlock(&h->mu);
}

void fr_metrics_http_serve_history(fr_metrics_http *h, fr_metrics_history *hist)
{
    if (!h || !hist) return;
    pthread_mutex_lock(&h->mu);
    fr_metrics_history_free(&h->hist);
    h->hist = hist;
    h->offline = 1;
    pthread_mutex_unlock(&h->mu);
}

fr_status fr_metrics_http_log_to(fr_metrics_http *h, const char *path)
{
    if (!h || !path) return fr_fail(FR_EINVAL, "fr_metrics_http_log_to: NULL argument");
    pthread_mutex_lock(&h->mu);
    fr_status st = history_of(h) ? fr_metrics_history_log_to(h->hist, path) : fr_fail(FR_ENOMEM, "metrics: out of memory");
    pthread_mutex_unlock(&h->mu);
    return st;
}

void fr_metrics_http_stop(fr_metrics_http **ph)
{
    fr_metrics_http *h = ph ? *ph : NULL;
    if (!h) return;
    MHD_stop_daemon(h->d);
    fr_metrics_history_free(&h->hist);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *ph = NULL;
}
