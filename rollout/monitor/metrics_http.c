#include "rollout/monitor/metrics_http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
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
    char token[FR_METRICS_TOKEN_MAX];   /* "" when none is required */
    time_t last_log;                    /* the daemon's log lines: one a second at most */
    long unlogged;
};

/* With a token, a request must carry "Authorization: Bearer TOKEN"; 1 when
 * it may be answered. Compares every byte, so the time says nothing of
 * where a guess went wrong. */
static int authorized(const fr_metrics_http *h, struct MHD_Connection *c)
{
    if (!h->token[0]) return 1;
    const char *got = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!got || strncmp(got, "Bearer ", 7) != 0) return 0;
    got += 7;
    size_t n = strlen(h->token);
    if (strlen(got) != n) return 0;
    unsigned diff = 0;
    for (size_t i = 0; i < n; i++) diff |= (unsigned)(got[i] ^ h->token[i]);
    return diff == 0;
}

/* libmicrohttpd's own messages (a refused connection over the limit, say)
 * go to stderr at most once a second: a flood of connections writes one
 * line a second, with the count of lines left out. */
static void daemon_log(void *cls, const char *fmt, va_list ap)
{
    fr_metrics_http *h = cls;
    const time_t now = time(NULL);
    if (h->last_log == now) {
        h->unlogged++;
        return;
    }
    fprintf(stderr, "metrics: ");
    vfprintf(stderr, fmt, ap);
    if (h->unlogged) fprintf(stderr, "(and %ld more messages in the second before)\n", h->unlogged);
    h->last_log = now;
    h->unlogged = 0;
}

/* ---- the routes beside /metrics ---- */

typedef fr_metrics_reply reply;

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


int fr_metrics_http_route(fr_metrics_http *h, const char *url, fr_metrics_reply *rp)
{
    if (!h || !url || !rp) return 0;
    if (other_route(h, url, rp)) return 1;
    const int json = strcmp(url, "/metrics.json") == 0;
    if (!json && strcmp(url, "/metrics") != 0) return 0;
    *rp = (reply){.type = json ? "application/json" : "text/plain; version=0.0.4; charset=utf-8",
                  .status = MHD_HTTP_OK, .owned = 1};
    if (h->offline) {
        static const char gone[] = "not found: a finished run has no live metrics\n";
        return text_reply(rp, MHD_HTTP_NOT_FOUND, gone);
    }
    fr_metrics_snapshot s;
    pthread_mutex_lock(&h->mu);
    s = h->snap;
    pthread_mutex_unlock(&h->mu);
    if (json ? fr_metrics_json(&s, &rp->body, &rp->len) : fr_metrics_prometheus(&s, &rp->body, &rp->len)) {
        static const char err[] = "out of memory\n";
        return text_reply(rp, MHD_HTTP_INTERNAL_SERVER_ERROR, err);
    }
    return 1;
}

int fr_metrics_http_serving(fr_metrics_http *h)
{
    if (!h) return 0;
    pthread_mutex_lock(&h->mu);
    const int state = h->offline ? FR_METRICS_SERVING : h->snap.state;
    pthread_mutex_unlock(&h->mu);
    return state == FR_METRICS_SERVING;
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_len, void **con_cls)
{
    (void)version; (void)upload; (void)upload_len; (void)con_cls;
    fr_metrics_http *h = cls;
    if (!authorized(h, c)) {
        static const char msg[] = "a token is required: Authorization: Bearer TOKEN\n";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_UNAUTHORIZED, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (strcmp(method, "GET") != 0) {
        static const char msg[] = "only GET\n";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg, MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_METHOD_NOT_ALLOWED, r);
        MHD_destroy_response(r);
        return ret;
    }
    reply rp;
    if (!fr_metrics_http_route(h, url, &rp)) {
        static const char nf[] = "not found: /metrics, /metrics.json, /health, /history.json, /dashboard\n";
        text_reply(&rp, MHD_HTTP_NOT_FOUND, nf);
    }
    return (enum MHD_Result)fr_metrics_http_send(c, &rp);
}

int fr_metrics_http_send(struct MHD_Connection *conn, fr_metrics_reply *rp)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(rp->len, rp->body,
                                                             rp->owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        if (rp->owned) free(rp->body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", rp->type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ret = MHD_queue_response(conn, rp->status, r);
    MHD_destroy_response(r);
    return ret;
}

fr_status fr_metrics_http_new(fr_metrics_http **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_metrics_http_new: NULL argument");
    fr_metrics_http *h = calloc(1, sizeof *h);
    if (!h) return fr_fail(FR_ENOMEM, "metrics: out of memory");
    pthread_mutex_init(&h->mu, NULL);
    *out = h;
    return FR_OK;
}

fr_status fr_metrics_http_start(const char *bind_addr, int port, fr_metrics_http **out)
{
    return fr_metrics_http_start_opts(bind_addr, port, NULL, out);
}

fr_status fr_metrics_http_start_opts(const char *bind_addr, int port, const fr_metrics_http_opts *o,
                                     fr_metrics_http **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_metrics_http_start: NULL argument");
    if (o && o->token && strlen(o->token) >= FR_METRICS_TOKEN_MAX)
        return fr_fail(FR_EINVAL, "metrics: the token is longer than %d bytes", FR_METRICS_TOKEN_MAX - 1);
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
    if (o && o->token) snprintf(h->token, sizeof h->token, "%s", o->token);
    /* epoll (poll where there is none): select() cannot watch a descriptor
     * numbered FD_SETSIZE or above, so a few hundred idle connections
     * would stop the endpoint; idle connections are closed after a
     * timeout, and connections over the limit are refused at once. */
    const unsigned limit = o && o->max_connections > 0 ? (unsigned)o->max_connections : 64;
    const unsigned idle = o && o->idle_timeout_s > 0 ? (unsigned)o->idle_timeout_s : 10;
    const unsigned flags = MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES ? MHD_USE_EPOLL_INTERNAL_THREAD
                                                                                : MHD_USE_POLL_INTERNAL_THREAD;
    /* the logger first: libmicrohttpd uses its own until it reads it */
    h->d = MHD_start_daemon(flags | MHD_USE_ERROR_LOG, (uint16_t)port, NULL, NULL, answer, h,
                            MHD_OPTION_EXTERNAL_LOGGER, daemon_log, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&a,
                            MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_CONNECTION_TIMEOUT, idle, MHD_OPTION_END);
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
    if (h->d) MHD_stop_daemon(h->d);
    fr_metrics_history_free(&h->hist);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *ph = NULL;
}
