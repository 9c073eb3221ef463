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

/* The page: health figures in elements named after their JSON fields (a
 * test reads them back), KL and top-1 agreement over time per weight
 * version, and the latest version's figures by position bucket, as inline
 * SVG. It asks its own server for /metrics.json every 2 s and keeps the
 * history in the page. */
const char fr_metrics_dashboard_html[] =
    "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fp4rollout</title>\n"
    "<style>body{font:14px sans-serif;margin:20px;color:#222}table{border-collapse:collapse}"
    "td{padding:2px 12px 2px 0}h2{font-size:16px;margin:18px 0 6px}svg{border:1px solid #ccc;background:#fff}"
    ".v{font-weight:bold;text-align:right}</style></head><body>\n"
    "<h1 style=\"font-size:20px\">fp4rollout: <span id=\"model\"></span> (<span id=\"kv_dtype\"></span> KV)</h1>\n"
    "<h2>Health</h2><table>\n"
    "<tr><td>weight version</td><td class=\"v\" id=\"weight_version\"></td>"
    "<td>last weight sync (s)</td><td class=\"v\" id=\"weight_sync_seconds\"></td></tr>\n"
    "<tr><td>tokens generated</td><td class=\"v\" id=\"tokens_generated_total\"></td>"
    "<td>tokens/s</td><td class=\"v\" id=\"tokens_per_second\"></td></tr>\n"
    "<tr><td>KV blocks used</td><td class=\"v\" id=\"kv_blocks_used\"></td>"
    "<td>KV blocks free</td><td class=\"v\" id=\"kv_blocks_free\"></td></tr>\n"
    "<tr><td>running</td><td class=\"v\" id=\"running\"></td><td>waiting</td><td class=\"v\" id=\"waiting\"></td></tr>\n"
    "<tr><td>preemptions</td><td class=\"v\" id=\"preemptions_total\"></td>"
    "<td>requests</td><td class=\"v\" id=\"requests_total\"></td></tr>\n"
    "<tr><td>monitored samples</td><td class=\"v\" id=\"monitored_samples_total\"></td>"
    "<td>monitored running</td><td class=\"v\" id=\"monitored_running\"></td></tr>\n"
    "<tr><td>recalibrations</td><td class=\"v\" id=\"recalibrations_total\"></td>"
    "<td>last for version</td><td class=\"v\" id=\"last_recalibration_version\"></td></tr>\n"
    "</table>\n"
    "<h2>Divergence of weight version <span id=\"div_version\">-</span>: mean KL <span id=\"kl_mean_nats\">-</span> "
    "nats, top-1 agreement <span id=\"top1_agreement\">-</span> over <span id=\"positions\">-</span> positions</h2>\n"
    "<div>KL (1e-3 nats) over time, one line per weight version</div><svg id=\"kl\" width=\"720\" height=\"180\"></svg>\n"
    "<div>top-1 agreement over time</div><svg id=\"top1\" width=\"720\" height=\"180\"></svg>\n"
    "<div>by position bucket (latest version): KL (1e-3 nats) and top-1 agreement</div>"
    "<svg id=\"buckets\" width=\"720\" height=\"180\"></svg>\n"
    "<p style=\"color:#666\">refreshes every 2 s from <a href=\"/metrics.json\">/metrics.json</a>; Prometheus: "
    "<a href=\"/metrics\">/metrics</a></p>\n"
    "<script>\n"
    "var hist={},t0=Date.now(),colors=['#1f77b4','#d62728','#2ca02c','#9467bd','#ff7f0e','#8c564b','#e377c2','#17becf'];\n"
    "function el(n,a){var e=document.createElementNS('http://www.w3.org/2000/svg',n);"
    "for(var k in a)e.setAttribute(k,a[k]);return e;}\n"
    "function lines(id,key,scale){var s=document.getElementById(id);while(s.firstChild)s.removeChild(s.firstChild);"
    "var W=720,H=180,maxT=1,maxY=0,i=0;for(var v in hist)hist[v].forEach(function(p){maxT=Math.max(maxT,p.t);"
    "maxY=Math.max(maxY,p[key]*scale);});if(maxY<=0)maxY=1;"
    "s.appendChild(el('text',{x:4,y:14,'font-size':11})).textContent=maxY.toPrecision(3);"
    "for(var v in hist){var pts=hist[v].map(function(p){return (40+(W-50)*p.t/maxT).toFixed(1)+','+"
    "(H-10-(H-30)*p[key]*scale/maxY).toFixed(1);}).join(' ');"
    "s.appendChild(el('polyline',{points:pts,fill:'none',stroke:colors[i%8],'stroke-width':2}));"
    "s.appendChild(el('text',{x:W-80,y:16+14*i,fill:colors[i%8],'font-size':11})).textContent='v'+v;i++;}}\n"
    "function bars(d){var s=document.getElementById('buckets');while(s.firstChild)s.removeChild(s.firstChild);"
    "if(!d)return;var m=0;d.buckets.forEach(function(b){m=Math.max(m,b.kl_mean_nats);});if(m<=0)m=1;"
    "d.buckets.forEach(function(b,j){var x=40+j*135,h=120*b.kl_mean_nats/m,h2=120*b.top1_agreement;"
    "s.appendChild(el('rect',{x:x,y:150-h,width:40,height:h,fill:'#1f77b4'}));"
    "s.appendChild(el('rect',{x:x+45,y:150-h2,width:40,height:h2,fill:'#2ca02c'}));"
    "s.appendChild(el('text',{x:x,y:170,'font-size':11})).textContent=b.bucket+' ('+b.positions+')';"
    "s.appendChild(el('text',{x:x,y:145-h,'font-size':10})).textContent=(1e3*b.kl_mean_nats).toPrecision(3);});}\n"
    "function show(m){['model','kv_dtype','weight_version','weight_sync_seconds','tokens_generated_total',"
    "'tokens_per_second','kv_blocks_used','kv_blocks_free','running','waiting','preemptions_total','requests_total',"
    "'monitored_samples_total','monitored_running','recalibrations_total','last_recalibration_version']"
    ".forEach(function(k){document.getElementById(k).textContent=m[k];});"
    "var t=(Date.now()-t0)/1000,last=null;m.divergence.forEach(function(d){(hist[d.version]=hist[d.version]||[])"
    ".push({t:t,kl:d.kl_mean_nats,top1:d.top1_agreement});if(!last||d.version>last.version)last=d;});"
    "if(last){document.getElementById('div_version').textContent=last.version;"
    "document.getElementById('kl_mean_nats').textContent=last.kl_mean_nats;"
    "document.getElementById('top1_agreement').textContent=last.top1_agreement;"
    "document.getElementById('positions').textContent=last.positions;}"
    "lines('kl','kl',1e3);lines('top1','top1',1);bars(last);}\n"
    "function poll(){fetch('/metrics.json').then(function(r){return r.json();}).then(show)"
    ".catch(function(){}).then(function(){setTimeout(poll,2000);});}\npoll();\n"
    "</script></body></html>\n";

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
    char *body = NULL;
    size_t len = 0;
    const char *type = "text/plain; version=0.0.4; charset=utf-8";
    unsigned status = MHD_HTTP_OK;
    int owned = 1;
    if (strcmp(url, "/metrics") == 0 || strcmp(url, "/metrics.json") == 0) {
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
    } else if (strcmp(url, "/dashboard") == 0 || strcmp(url, "/") == 0) {
        body = (char *)fr_metrics_dashboard_html;
        len = sizeof fr_metrics_dashboard_html - 1;
        type = "text/html; charset=utf-8";
        owned = 0;
    } else {
        status = MHD_HTTP_NOT_FOUND;
    }
    if (!body) {
        static const char nf[] = "not found: /metrics, /metrics.json, /dashboard\n", err[] = "out of memory\n";
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
    h->d = MHD_start_daemon(flags | MHD_USE_ERROR_LOG, (uint16_t)port, NULL, NULL, answer, h, MHD_OPTION_SOCK_ADDR,
                            (struct sockaddr *)&a, MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_CONNECTION_TIMEOUT,
                            idle, MHD_OPTION_EXTERNAL_LOGGER, daemon_log, h, MHD_OPTION_END);
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
    pthread_mutex_lock(&h->mu);
    h->snap = *s;
    pthread_mutex_unlock(&h->mu);
}

void fr_metrics_http_stop(fr_metrics_http **ph)
{
    fr_metrics_http *h = ph ? *ph : NULL;
    if (!h) return;
    MHD_stop_daemon(h->d);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *ph = NULL;
}
