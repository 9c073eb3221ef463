/* The metrics endpoint (libmicrohttpd, its own thread): GET /metrics
 * (Prometheus text, rollout/monitor/metrics.h), /metrics.json (the same figures as
 * JSON), /health (200 while serving, 503 while paused or stopping),
 * /history.json (the whole run, rollout/monitor/metrics_history.h) and
 * /dashboard (a page that fetches nothing but this server's /history.json
 * and the charting library it embeds, /uplot.js and /uplot.css).
 * The serving loop publishes a snapshot whenever it likes; requests read the
 * latest one, and each snapshot goes into the history. docs/metrics.md. */
#ifndef FR_METRICS_HTTP_H
#define FR_METRICS_HTTP_H

#include "rollout/monitor/metrics.h"
#include "rollout/monitor/metrics_history.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_metrics_http fr_metrics_http;

/* Listens on bind_addr (an IPv4 address, "127.0.0.1" by default when NULL)
 * and port (0: any free port; fr_metrics_http_port says which). */
fr_status fr_metrics_http_start(const char *bind_addr, int port, fr_metrics_http **out);

/* Limits of the endpoint (docs/metrics.md, "Limits"): connections at once
 * (0: 64; more are refused), seconds an idle connection stays open (0:
 * 10), and a token every request must carry as "Authorization: Bearer
 * TOKEN" (NULL or "": none). */
#define FR_METRICS_TOKEN_MAX 128
typedef struct {
    int max_connections;
    int idle_timeout_s;
    const char *token;
} fr_metrics_http_opts;
fr_status fr_metrics_http_start_opts(const char *bind_addr, int port, const fr_metrics_http_opts *o,
                                     fr_metrics_http **out);
int fr_metrics_http_port(const fr_metrics_http *h);

/* Snapshots and history without a daemon of their own: another HTTP server
 * (the serve command's HTTP API, trainer_bridge/http/) answers these routes
 * on its port with fr_metrics_http_route. fr_metrics_http_port is then 0. */
fr_status fr_metrics_http_new(fr_metrics_http **out);

/* One answer of the routes above, for a GET of url (no query string).
 * body: malloc'ed when owned, else static. */
typedef struct {
    char *body;
    size_t len;
    const char *type;
    unsigned status;
    int owned;
} fr_metrics_reply;

/* 1 and *r when url is one of the endpoint's routes (/metrics,
 * /metrics.json, /health, /history.json, /dashboard, /uplot.js,
 * /uplot.css), else 0. */
int fr_metrics_http_route(fr_metrics_http *h, const char *url, fr_metrics_reply *r);
/* Queues r on a libmicrohttpd connection, which takes its body when owned
 * (freed here when the response cannot be made); libmicrohttpd's result
 * (MHD_YES, MHD_NO) as an int, so this header needs none of its types. */
struct MHD_Connection;
int fr_metrics_http_send(struct MHD_Connection *conn, fr_metrics_reply *r);
/* 1 when the engine is serving (not paused, not stopping): what /health says. */
int fr_metrics_http_serving(fr_metrics_http *h);
/* Copies s as the snapshot requests see from now on. */
void fr_metrics_http_publish(fr_metrics_http *h, const fr_metrics_snapshot *s);
/* Stops the thread and frees everything; NULL-safe. */
void fr_metrics_http_stop(fr_metrics_http **h);

/* Serves the history of a finished run (rollout/monitor/metrics_history.h,
 * taken over: freed with h) instead of live snapshots: /metrics and
 * /metrics.json answer 404, /health 200, publish is ignored. */
void fr_metrics_http_serve_history(fr_metrics_http *h, fr_metrics_history *hist);
/* Appends the history's records to path (metrics_log, docs/metrics.md). */
fr_status fr_metrics_http_log_to(fr_metrics_http *h, const char *path);

/* The dashboard's files, embedded at build time (NUL-terminated; each
 * *_end marks the NUL): the page, the charting library and its style. */
extern const char fr_metrics_dashboard_html[], fr_metrics_dashboard_html_end[];
extern const char fr_metrics_uplot_js[], fr_metrics_uplot_js_end[];
extern const char fr_metrics_uplot_css[], fr_metrics_uplot_css_end[];

#ifdef __cplusplus
}
#endif

#endif
