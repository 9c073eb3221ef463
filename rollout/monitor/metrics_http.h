/* The metrics endpoint (libmicrohttpd, its own thread): GET /metrics
 * (Prometheus text, rollout/monitor/metrics.h), /metrics.json (the same figures as
 * JSON) and /dashboard (one self-contained page, no network fetches but its
 * own /metrics.json, plotting KL and top-1 agreement over time, by weight
 * version and position bucket, and the health figures; it refreshes itself).
 * The serving loop publishes a snapshot whenever it likes; requests read the
 * latest one. docs/metrics.md. */
#ifndef FR_METRICS_HTTP_H
#define FR_METRICS_HTTP_H

#include "rollout/monitor/metrics.h"

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
/* Copies s as the snapshot requests see from now on. */
void fr_metrics_http_publish(fr_metrics_http *h, const fr_metrics_snapshot *s);
/* Stops the thread and frees everything; NULL-safe. */
void fr_metrics_http_stop(fr_metrics_http **h);

/* The dashboard page (for tests and for saving it). */
extern const char fr_metrics_dashboard_html[];

#ifdef __cplusplus
}
#endif

#endif
