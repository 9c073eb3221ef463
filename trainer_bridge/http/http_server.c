/* The HTTP server (http.h): libmicrohttpd with a pool of threads, each on
 * epoll (thousands of connections, no FD_SETSIZE limit), connections
 * suspended while they wait for the engine and resumed by the serve loop's
 * sink; bodies bounded; tokens and roles; the routes dispatched to the
 * metrics (rollout/monitor/metrics_http.h), the generations
 * (http_gateway.c) and the control endpoints (http_control.c). */
#include "trainer_bridge/http/http_internal.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

void http_log(fr_http *h, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (h->log) {
        fprintf(h->log, "http: %s\n", msg);
        fflush(h->log);
    } else {
        fr_log_msg(FR_LOG_INFO, "http: %s", msg);
    }
}

/* ---- calls ------------------------------------------------------------------------ */

void http_wake(http_call *c)
{
    if (c->conn && c->suspended) {
        c->suspended = 0;
        MHD_resume_connection(c->conn);
    }
}

void http_ready(http_call *c, unsigned status, const char *ctype)
{
    c->status = status;
    c->ctype = ctype;
    c->state = CALL_READY;
    http_wake(c);
}

void http_fail(http_call *c, unsigned status, const char *type, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->answer.len = 0;
    http_error_json(&c->answer, status, type, msg);
    http_ready(c, status, "application/json");
}

void http_maybe_free(http_call *c)
{
    if (c->conn || c->n_open > 0 || c->waiting || c->worker) return;
    fr_http *h = c->h;
    if (c->slot) http_release_slot(c);
    for (int i = 0; i < h->n_aborts; i++)
        if (h->aborts[i] == c) h->aborts[i] = NULL;
    if (c->prev) c->prev->next = c->next;
    else h->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    for (int i = 0; i < c->n_samples; i++) http_sample_free(&c->s[i]);
    free(c->s);
    free(c->req_id);
    free(c->req_open);
    http_gen_free(&c->gen);
    fr_buf_free(&c->body);
    fr_buf_free(&c->answer);
    fr_buf_free(&c->out);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* ---- tokens and roles ---------------------------------------------------------------- */

static int same_token(const char *got, const char *want)
{
    size_t n = strlen(want);
    if (strlen(got) != n) return 0;
    unsigned diff = 0;   /* every byte compared: the time says nothing of where a guess went wrong */
    for (size_t i = 0; i < n; i++) diff |= (unsigned)(got[i] ^ want[i]);
    return diff == 0;
}

static int loopback_peer(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return 0;
    const struct sockaddr *a = ci->client_addr;
    if (a->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family == AF_INET6) {
        const struct in6_addr *x = &((const struct sockaddr_in6 *)a)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(x);
    }
    return 0;
}

/* The role a request has: the highest whose token it carries, and any role
 * without a token of its own (read: for everyone; client and trainer: for
 * loopback peers). A role without a token still wants the nearest token set
 * below it: a read token must not be bypassed by asking for more. */
static int role_of(fr_http *h, struct MHD_Connection *conn)
{
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    const char *got = auth && strncmp(auth, "Bearer ", 7) == 0 ? auth + 7 : NULL;
    const int local = loopback_peer(conn);
    for (int r = ROLE_TRAINER; r >= ROLE_READ; r--) {
        const char *want = h->tokens[r - 1];
        if (want[0]) {
            if (got && same_token(got, want)) return r;
            continue;
        }
        const char *below = "";
        for (int k = r - 1; k >= ROLE_READ && !below[0]; k--) below = h->tokens[k - 1];
        if ((r == ROLE_READ || local) && (!below[0] || (got && same_token(got, below)))) return r;
    }
    return ROLE_NONE;
}

/* The role a route needs. */
static int needs(const char *url)
{
    static const char *const client[] = {"/generate", "/v1/completions", "/v1/models", "/abort_request",
                                         "/get_model_info", "/get_server_info", "/health_generate", NULL};
    static const char *const trainer[] = {"/pause_generation", "/continue_generation", "/flush_cache",
                                          "/update_weights_from_disk", "/release_memory_occupation",
                                          "/resume_memory_occupation", NULL};
    for (int i = 0; client[i]; i++)
        if (!strcmp(url, client[i])) return ROLE_CLIENT;
    for (int i = 0; trainer[i]; i++)
        if (!strcmp(url, trainer[i])) return ROLE_TRAINER;
    return ROLE_READ;
}

/* ---- answers ----------------------------------------------------------------------------- */

static enum MHD_Result send_buf(struct MHD_Connection *conn, unsigned status, const char *ctype, fr_buf *b)
{
    if (b->failed) {
        fr_buf_free(b);
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":500}}";
        b->data = NULL;
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret = MHD_queue_response(conn, 500, r);
        MHD_destroy_response(r);
        return ret;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(b->len, b->data ? b->data : (char *)"",
                                                             MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", ctype);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_error(struct MHD_Connection *conn, unsigned status, const char *type, const char *msg)
{
    fr_buf b = {0};
    http_error_json(&b, status, type, msg);
    enum MHD_Result ret = send_buf(conn, status, "application/json", &b);
    fr_buf_free(&b);
    return ret;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    http_call *c = cls;
    pthread_mutex_lock(&c->h->mu);
    int n = http_stream_read(c, buf, max);
    pthread_mutex_unlock(&c->h->mu);
    return n < 0 ? MHD_CONTENT_READER_END_OF_STREAM : n;
}

/* A call whose answer is ready, or whose stream starts. Under h->mu. */
static enum MHD_Result answer_call(http_call *c, struct MHD_Connection *conn)
{
    if (c->state == CALL_READY) return send_buf(conn, c->status, c->ctype, &c->answer);
    if (c->state == CALL_STREAMING) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, stream_reader, c, NULL);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        enum MHD_Result ret = MHD_queue_response(conn, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    c->suspended = 1;   /* still waiting for the engine */
    MHD_suspend_connection(conn);
    return MHD_YES;
}

/* The metrics routes, answered at once. */
static enum MHD_Result metrics_route(fr_http *h, struct MHD_Connection *conn, const char *url, int *done)
{
    fr_metrics_reply rp;
    *done = 0;
    if (!h->metrics || !fr_metrics_http_route(h->metrics, url, &rp)) return MHD_YES;
    *done = 1;
    return (enum MHD_Result)fr_metrics_http_send(conn, &rp);
}

/* A generation: parsed, then sent to the engine (http_gateway.c). */
static void start_generation(http_call *c, int openai)
{
    fr_http *h = c->h;
    fr_status st = openai ? http_parse_completions(c->body.data, c->body.len, h->tok, &c->gen)
                          : http_parse_generate(c->body.data, c->body.len, h->tok, &c->gen);
    if (st) {
        http_fail(c, 400, "invalid_request_error", "%s", fr_last_error());
        return;
    }
    c->gen_ok = 1;
    if (c->gen.g.n_stop && !h->tok) {
        http_fail(c, 400, "invalid_request_error", "stop: stop strings need the server's tokenizer, and this server "
                                                   "has none; use stop_token_ids");
        return;
    }
    http_start_generation(c);
}

/* The last call of a request's handler: the body is whole. Under h->mu. */
static void dispatch(http_call *c, const char *method)
{
    fr_http *h = c->h;
    if (h->stopping) {
        http_fail(c, 503, "unavailable", "the server is shutting down");
    } else if (!strcmp(c->url, "/generate") || !strcmp(c->url, "/v1/completions")) {
        if (!c->post) http_fail(c, 405, "invalid_request_error", "%s takes POST", c->url);
        else start_generation(c, c->url[1] == 'v');
    } else if (!http_control_route(c)) {
        http_fail(c, 404, "not_found", "%s %s: no such endpoint (docs/http.md lists them)", method, c->url);
    }
}

static enum MHD_Result access_handler(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                      const char *version, const char *upload, size_t *upload_len, void **con_cls)
{
    (void)version;
    fr_http *h = cls;
    http_call *c = *con_cls;
    if (!c) {   /* the headers: the route, the role, and the body's bound */
        const int role = role_of(h, conn), need = needs(url);
        if (role < need) {
            return send_error(conn, role == ROLE_NONE ? 401 : 403, "authentication_error",
                              role == ROLE_NONE ? "a token is required: Authorization: Bearer TOKEN"
                                                : "this token's role may not use this endpoint (docs/http.md, \"Tokens and roles\")");
        }
        if (need == ROLE_READ) {
            int done;
            enum MHD_Result r = metrics_route(h, conn, url, &done);
            if (done) return r;
        }
        if (!(c = calloc(1, sizeof *c))) return MHD_NO;
        c->h = h;
        c->conn = conn;
        c->role = role;
        c->post = !strcmp(method, "POST");
        pthread_cond_init(&c->cv, NULL);
        snprintf(c->url, sizeof c->url, "%s", url);
        pthread_mutex_lock(&h->mu);
        c->next = h->calls;
        if (h->calls) h->calls->prev = c;
        h->calls = c;
        pthread_mutex_unlock(&h->mu);
        *con_cls = c;
        return MHD_YES;
    }
    if (*upload_len) {   /* a part of the body */
        if (!c->too_large && c->body.len + *upload_len > (size_t)h->cfg.max_body_bytes) c->too_large = 1;
        if (!c->too_large) fr_buf_put(&c->body, upload, *upload_len);
        *upload_len = 0;
        return MHD_YES;
    }
    pthread_mutex_lock(&h->mu);
    if (c->state == CALL_NEW) {
        c->state = CALL_RUNNING;
        if (c->too_large) {
            http_fail(c, 413, "invalid_request_error", "the body is larger than %lld bytes (http.max_body_bytes)",
                      h->cfg.max_body_bytes);
        } else if (c->body.failed) {
            http_fail(c, 500, "server_error", "out of memory reading the body");
        } else {
            dispatch(c, method);
        }
    }
    enum MHD_Result ret = answer_call(c, conn);
    pthread_mutex_unlock(&h->mu);
    return ret;
}

/* The connection ended (answered, or its client went away): what it still
 * runs in the engine is aborted. */
static void completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)conn;
    (void)toe;
    fr_http *h = cls;
    http_call *c = *con_cls;
    if (!c) return;
    *con_cls = NULL;
    pthread_mutex_lock(&h->mu);
    c->conn = NULL;
    c->suspended = 0;
    if (c->n_open > 0) http_abort_open(c);
    http_maybe_free(c);
    pthread_mutex_unlock(&h->mu);
}

/* libmicrohttpd's own messages (a refused connection over the limit, say):
 * one line a second at most. */
static void daemon_log(void *cls, const char *fmt, va_list ap)
{
    static time_t last;
    (void)cls;
    const time_t now = time(NULL);
    if (now == last) return;
    last = now;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    fr_log_msg(FR_LOG_WARN, "http: %s", msg);
}

/* ---- start and stop ---------------------------------------------------------------------- */

static fr_status listen_on(fr_http *h, const char *bind, int port)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, bind, &a.sin_addr) != 1) return fr_fail(FR_EINVAL, "http: '%s' is not an IPv4 address", bind);
    const unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    h->d = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, access_handler, h, MHD_OPTION_EXTERNAL_LOGGER,
                            daemon_log, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&a, MHD_OPTION_THREAD_POOL_SIZE,
                            (unsigned)h->cfg.threads, MHD_OPTION_CONNECTION_LIMIT, (unsigned)h->cfg.max_connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)h->cfg.idle_timeout_s,
                            MHD_OPTION_LISTEN_BACKLOG_SIZE, 4096u, MHD_OPTION_NOTIFY_COMPLETED, completed, h,
                            MHD_OPTION_END);
    if (!h->d) return fr_fail(FR_EIO, "http: cannot listen on %s:%d (in use, or not an address of this host)", bind, port);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : port;
    return FR_OK;
}

static void copy_config(fr_http *h, const fr_http_config *cfg)
{
    h->cfg = *cfg;
    const char *tok[3] = {cfg->read_token, cfg->client_token, cfg->trainer_token};
    for (int i = 0; i < 3; i++) snprintf(h->tokens[i], sizeof h->tokens[i], "%s", tok[i] ? tok[i] : "");
    snprintf(h->model_name, sizeof h->model_name, "%s", cfg->model_name ? cfg->model_name : "fp4rollout");
    h->cfg.model_name = h->model_name;
    h->cfg.read_token = h->cfg.client_token = h->cfg.trainer_token = NULL;
    if (h->cfg.max_connections <= 0) h->cfg.max_connections = 4096;
    if (h->cfg.idle_timeout_s <= 0) h->cfg.idle_timeout_s = 10;
    if (h->cfg.max_body_bytes <= 0) h->cfg.max_body_bytes = 64ll << 20;
    if (h->cfg.threads <= 0) h->cfg.threads = 4;
    h->log = cfg->log;
}

fr_status fr_http_start(const fr_http_config *cfg, fr_bridge_server *srv, fr_http **out)
{
    if (!cfg || !srv || !out) return fr_fail(FR_EINVAL, "fr_http_start: NULL argument");
    *out = NULL;
    if (cfg->port < 0 || cfg->port > 65535) return fr_fail(FR_EINVAL, "http: port %d outside [0, 65535]", cfg->port);
    fr_http *h = calloc(1, sizeof *h);
    if (!h) return fr_fail(FR_ENOMEM, "http: out of memory");
    copy_config(h, cfg);
    pthread_mutex_init(&h->mu, NULL);
    h->srv = srv;
    h->metrics = fr_bridge_server_metrics(srv);
    const fr_model_config *mc = fr_bridge_server_model_config(srv);
    h->vocab = mc->vocab_size;
    h->n_eos = mc->n_eos < 8 ? mc->n_eos : 8;
    memcpy(h->eos, mc->eos_ids, sizeof(int) * (size_t)h->n_eos);
    h->tok = fr_bridge_server_tokenizer(srv, &h->tok_name);
    const fr_bridge_local_sink sink = {.on_msg = http_on_msg, .on_command = http_on_command, .user = h};
    fr_status st = fr_bridge_server_local_open(srv, 1 + HTTP_CTL_SLOTS, &sink);
    const char *bind = !cfg->bind ? "127.0.0.1" : (!strcmp(cfg->bind, "*") ? "0.0.0.0" : cfg->bind);
    if (!st && (st = listen_on(h, bind, cfg->port)) && cfg->port_fallback && cfg->port > 0) {
        http_log(h, "port %d: %s; taking a free port instead", cfg->port, fr_last_error());
        st = listen_on(h, bind, 0);
    }
    if (st) {
        fr_http_stop(&h);
        return st;
    }
    http_log(h, "API on http://%s:%d (/generate, /v1/completions, control endpoints; /metrics, /dashboard, /health; "
                "text: %s)", bind, h->port, h->tok ? h->tok_name : "none, token ids only");
    if (h->metrics)
        http_log(h, "metrics on http://%s:%d/metrics and /dashboard%s", bind, h->port,
                 h->tokens[0][0] ? " (a bearer token required)" : "");
    *out = h;
    return FR_OK;
}

int fr_http_port(const fr_http *h) { return h ? h->port : -1; }

/* Every call still waiting ends with 503 (the serve loop has stopped, so
 * nothing more comes from the engine); returns how many connections are
 * still suspended. */
static int end_waiting_calls(fr_http *h)
{
    int suspended = 0;
    pthread_mutex_lock(&h->mu);
    h->stopping = 1;
    for (http_call *c = h->calls; c; c = c->next) {
        c->n_open = 0;   /* the engine is gone: nothing will close them */
        c->waiting = 0;
        pthread_cond_broadcast(&c->cv);   /* a disk update's thread stops waiting */
        if (c->state == CALL_RUNNING) http_fail(c, 503, "unavailable", "the server is shutting down");
        if (c->state == CALL_STREAMING && c->samples_left > 0) {
            for (int i = 0; i < c->n_samples; i++)
                if (!c->s[i].ended) {
                    c->s[i].ended = 1;
                    c->s[i].finish = FR_WIRE_ABORT;
                    snprintf(c->s[i].why, sizeof c->s[i].why, "the server is shutting down");
                    c->s[i].dirty = 1;
                }
            c->samples_left = 0;
        }
        http_wake(c);
        suspended += c->suspended;
    }
    pthread_mutex_unlock(&h->mu);
    return suspended;
}

void fr_http_stop(fr_http **ph)
{
    fr_http *h = ph ? *ph : NULL;
    if (!h) return;
    if (h->d) {
        /* libmicrohttpd must have no connection suspended when it stops:
         * end every call, then give the threads a moment to send them */
        for (int i = 0; i < 200 && end_waiting_calls(h) > 0; i++) usleep(10000);
        usleep(50000);
        for (int i = 0; i < 100; i++) {
            int workers = 0;
            pthread_mutex_lock(&h->mu);
            for (http_call *c = h->calls; c; c = c->next) workers += c->worker;
            pthread_mutex_unlock(&h->mu);
            if (!workers) break;
            usleep(20000);
        }
        MHD_stop_daemon(h->d);
    }
    pthread_mutex_lock(&h->mu);
    while (h->calls) {
        http_call *c = h->calls;
        c->conn = NULL;
        c->n_open = c->waiting = c->worker = 0;
        http_maybe_free(c);
    }
    pthread_mutex_unlock(&h->mu);
    http_table_free(h);
    free(h->aborts);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *ph = NULL;
}
