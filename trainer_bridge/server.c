/* The one-engine coordinator loop (trainer_bridge/server.h,
 * docs/protocol.md). */
#include "server.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "peers.h"
#include "protocol.h"
#include "rollout/scheduler.h"
#include "wire.h"

enum { RUNNING = 0, PAUSING, PAUSED };
static const char *const state_names[] = {"running", "pausing", "paused"};

/* A sample's tokens drawn since its last delta went out. */
typedef struct {
    int *tok;
    float *lp;
    int n_pending, cap;
    int sent;                /* tokens streamed so far: the next delta's start */
    int has_first;
    double first_ms;         /* when its first token was drawn */
} sample_state;

/* An accepted generate. sid is the scheduler's id for it (the server's
 * own, increasing), so two clients' equal request ids never meet there. */
typedef struct {
    uint64_t sid;
    uint64_t request_id, group_id;
    int peer;
    int n, n_prompt, open;
    int held;                /* received during a pause: not yet submitted */
    fr_request_spec spec;    /* held: prompt and stop ids owned here */
    double t0_ms;            /* when it was received */
    sample_state *s;
} request;

struct fr_bridge_server {
    fr_session *sess;
    fr_scheduler *sch;
    fr_bridge_config cfg;
    void *zctx, *sock;
    fr_peers *peers;
    FILE *log;
    char endpoint[256];
    request **reqs;          /* open requests, sorted by sid */
    int n_reqs, cap_reqs;
    uint64_t next_sid;
    int state;
    int *waiters;            /* peers waiting for a pause (wait mode) to complete */
    int n_waiters, cap_waiters;
    int vocab, n_blocks, max_pos, max_seqs, chunk;
    int default_stop[FR_SERVE_MAX_STOP_IDS > 8 ? FR_SERVE_MAX_STOP_IDS : 8];
    int n_default_stop;
    uint64_t weight_version;
    /* protocol counters (stats) */
    uint64_t messages_in, messages_out, bad_messages, errors_sent;
    uint64_t requests_accepted, requests_rejected, samples_done, tokens_streamed;
};

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

static void logf_(fr_bridge_server *srv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(fr_bridge_server *srv, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(srv->log, "serve: ");
    vfprintf(srv->log, fmt, ap);
    fprintf(srv->log, "\n");
    fflush(srv->log);
    va_end(ap);
}

/* ---- requests ------------------------------------------------------------ */

static int find_index(const fr_bridge_server *srv, uint64_t sid)
{
    int lo = 0, hi = srv->n_reqs - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        uint64_t v = srv->reqs[mid]->sid;
        if (v == sid) return mid;
        if (v < sid) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static request *find_sid(const fr_bridge_server *srv, uint64_t sid)
{
    int i = find_index(srv, sid);
    return i < 0 ? NULL : srv->reqs[i];
}

/* The sender's open request with its own id, or NULL. */
static request *find_caller(const fr_bridge_server *srv, int peer, uint64_t request_id)
{
    for (int i = 0; i < srv->n_reqs; i++)
        if (srv->reqs[i]->peer == peer && srv->reqs[i]->request_id == request_id) return srv->reqs[i];
    return NULL;
}

static void free_request(request *q)
{
    if (!q) return;
    for (int k = 0; q->s && k < q->n; k++) {
        free(q->s[k].tok);
        free(q->s[k].lp);
    }
    free(q->s);
    free((void *)q->spec.prompt);
    free((void *)q->spec.stop_ids);
    free(q);
}

static void remove_request(fr_bridge_server *srv, request *q)
{
    int i = find_index(srv, q->sid);
    if (i >= 0) {
        memmove(&srv->reqs[i], &srv->reqs[i + 1], sizeof(request *) * (size_t)(srv->n_reqs - i - 1));
        srv->n_reqs--;
    }
    free_request(q);
}

/* ---- sending ------------------------------------------------------------- */

/* Encodes and queues m for the peer. A message that cannot be encoded or
 * queued is reported in the log (it is a bug or out of memory). */
static void send_msg(fr_bridge_server *srv, int peer, const fr_msg *m)
{
    char *data;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st) {
        logf_(srv, "cannot encode a %s message for client %s: %s", fr_msg_type_name(m->type),
              fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    if (fr_peers_send(srv->peers, peer, data, len)) {
        logf_(srv, "sending to client %s: %s", fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    srv->messages_out++;
}

static void send_error(fr_bridge_server *srv, int peer, const char *code, int has_id, uint64_t id,
                       const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void send_error(fr_bridge_server *srv, int peer, const char *code, int has_id, uint64_t id,
                       const char *fmt, ...)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ERROR);
    snprintf(m.u.error.code, sizeof m.u.error.code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m.u.error.message, sizeof m.u.error.message, fmt, ap);
    va_end(ap);
    m.u.error.has_request_id = has_id;
    m.u.error.request_id = id;
    srv->errors_sent++;
    send_msg(srv, peer, &m);
}

/* Sends sample k's pending tokens as one delta. */
static void flush_sample(fr_bridge_server *srv, request *q, int k)
{
    sample_state *s = &q->s[k];
    if (s->n_pending == 0) return;
    uint64_t *wv = malloc(sizeof(uint64_t) * (size_t)s->n_pending);
    if (!wv) {
        logf_(srv, "out of memory streaming request %llu sample %d", (unsigned long long)q->request_id, k);
        return;
    }
    for (int i = 0; i < s->n_pending; i++) wv[i] = srv->weight_version;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_TOKENS);
    m.u.tokens = (fr_msg_tokens){.request_id = q->request_id, .sample = k, .start = s->sent, .n = s->n_pending,
                                 .token_ids = s->tok, .logprobs = s->lp, .weight_versions = wv};
    send_msg(srv, q->peer, &m);
    free(wv);
    srv->tokens_streamed += (uint64_t)s->n_pending;
    s->sent += s->n_pending;
    s->n_pending = 0;
}

static void flush_all(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_reqs; i++)
        for (int k = 0; k < srv->reqs[i]->n; k++) flush_sample(srv, srv->reqs[i], k);
}

/* Sends sample k's done and closes it; frees the request with its last
 * sample (q must not be used after). */
static void send_done(fr_bridge_server *srv, request *q, int k, fr_wire_finish why, int n_tokens, int preemptions)
{
    flush_sample(srv, q, k);
    sample_state *s = &q->s[k];
    if (n_tokens != s->sent)
        logf_(srv, "request %llu sample %d: %d tokens streamed, the engine reports %d",
              (unsigned long long)q->request_id, k, s->sent, n_tokens);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_DONE);
    double t = now_ms();
    m.u.done = (fr_msg_done){.request_id = q->request_id, .group_id = q->group_id, .sample = k,
                             .finish_reason = why, .n_tokens = s->sent, .n_prompt = q->n_prompt,
                             .preemptions = preemptions, .has_ttft = s->has_first,
                             .ttft_ms = s->has_first ? s->first_ms - q->t0_ms : 0, .total_ms = t - q->t0_ms};
    send_msg(srv, q->peer, &m);
    srv->samples_done++;
    if (--q->open == 0) remove_request(srv, q);
}

/* ---- scheduler callbacks -------------------------------------------------- */

static void on_token(void *user, uint64_t sid, int sample, int index, int token, float logprob)
{
    fr_bridge_server *srv = user;
    request *q = find_sid(srv, sid);
    if (!q || sample < 0 || sample >= q->n) return;
    sample_state *s = &q->s[sample];
    if (index != s->sent + s->n_pending)
        logf_(srv, "request %llu sample %d: token %d arrived out of order (expected %d)",
              (unsigned long long)q->request_id, sample, index, s->sent + s->n_pending);
    if (s->n_pending == s->cap) {
        int c = s->cap ? s->cap * 2 : 16;
        int *t = realloc(s->tok, sizeof(int) * (size_t)c);
        if (t) s->tok = t;
        float *l = t ? realloc(s->lp, sizeof(float) * (size_t)c) : NULL;
        if (l) s->lp = l;
        if (!t || !l) {
            logf_(srv, "out of memory keeping a token of request %llu", (unsigned long long)q->request_id);
            return;
        }
        s->cap = c;
    }
    if (!s->has_first) {
        s->has_first = 1;
        s->first_ms = now_ms();
    }
    s->tok[s->n_pending] = token;
    s->lp[s->n_pending++] = logprob;
}

static fr_wire_finish wire_finish(fr_finish_reason r)
{
    switch (r) {
    case FR_FINISH_STOP: return FR_WIRE_STOP;
    case FR_FINISH_LENGTH: return FR_WIRE_LENGTH;
    case FR_FINISH_ABORT: return FR_WIRE_ABORT;
    default: return FR_WIRE_ERROR;
    }
}

static void on_done(void *user, const fr_sample_result *r)
{
    fr_bridge_server *srv = user;
    request *q = find_sid(srv, r->request_id);
    if (!q || r->sample < 0 || r->sample >= q->n) {
        logf_(srv, "the engine ended an unknown sample (%llu, %d)", (unsigned long long)r->request_id, r->sample);
        return;
    }
    send_done(srv, q, r->sample, wire_finish(r->finish), r->n_tokens, r->preemptions);
}

/* ---- requests in ----------------------------------------------------------- */

/* The engine request of a generate, with the server's defaults for what it
 * leaves out (prompt and stop ids point into g or the server). */
static void build_spec(const fr_bridge_server *srv, const request *q, const fr_msg_generate *g, fr_request_spec *r)
{
    const fr_serve_sampling *d = &srv->cfg.sampling;
    memset(r, 0, sizeof *r);
    r->id = q->sid;
    r->group = q->group_id;
    r->prompt = g->prompt;
    r->n_prompt = g->n_prompt;
    r->n = g->n;
    r->params = d->params;
    if (g->has_temperature) r->params.temperature = (float)g->temperature;
    if (g->has_top_k) r->params.top_k = g->top_k;
    if (g->has_top_p) r->params.top_p = (float)g->top_p;
    if (g->has_seed) r->params.seed = g->seed;
    r->max_tokens = g->has_max_tokens ? g->max_tokens : d->max_tokens;
    if (g->has_stop_token_ids) {
        r->stop_ids = g->stop_token_ids;
        r->n_stop = g->n_stop_token_ids;
    } else {
        r->stop_ids = srv->default_stop;
        r->n_stop = srv->n_default_stop;
    }
}

/* The checks fr_scheduler_submit makes, so a request held during a pause
 * is refused at once rather than after the resume. */
static fr_status check_spec(const fr_bridge_server *srv, const fr_request_spec *r, uint64_t caller_id)
{
    fr_status st = fr_request_spec_check(r, srv->vocab);
    if (st) return st;
    if (r->n_prompt >= srv->max_pos)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) does not fit the context window of %d",
                       (unsigned long long)caller_id, r->n_prompt, srv->max_pos);
    if (r->n > srv->max_seqs)
        return fr_fail(FR_EINVAL, "request %llu: n = %d exceeds the %d sequences the engine runs at once",
                       (unsigned long long)caller_id, r->n, srv->max_seqs);
    int mt = r->max_tokens < srv->max_pos - r->n_prompt ? r->max_tokens : srv->max_pos - r->n_prompt;
    int blocks = (r->n_prompt + mt + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    if (blocks > srv->n_blocks)
        return fr_fail(FR_EINVAL, "request %llu: prompt (%d) + max_tokens (%d) needs %d KV blocks, the cache has %d",
                       (unsigned long long)caller_id, r->n_prompt, mt, blocks, srv->n_blocks);
    return FR_OK;
}

static int insert_request(fr_bridge_server *srv, request *q)
{
    if (srv->n_reqs == srv->cap_reqs) {
        int c = srv->cap_reqs ? srv->cap_reqs * 2 : 64;
        request **v = realloc(srv->reqs, sizeof *v * (size_t)c);
        if (!v) return -1;
        srv->reqs = v;
        srv->cap_reqs = c;
    }
    srv->reqs[srv->n_reqs++] = q;   /* sids increase: the order holds */
    return 0;
}

static void handle_generate(fr_bridge_server *srv, int peer, const fr_msg_generate *g)
{
    uint64_t id = g->request_id;
    if (find_caller(srv, peer, id)) {
        srv->requests_rejected++;
        send_error(srv, peer, "duplicate_request_id", 1, id,
                   "request_id %llu is already open for this client; ids must be unique among open requests",
                   (unsigned long long)id);
        return;
    }
    request *q = calloc(1, sizeof *q);
    if (q) q->s = calloc((size_t)g->n, sizeof(sample_state));
    if (!q || !q->s) {
        free(q);
        srv->requests_rejected++;
        send_error(srv, peer, "out_of_memory", 1, id, "the server is out of memory");
        return;
    }
    q->sid = ++srv->next_sid;
    q->request_id = id;
    q->group_id = g->has_group_id ? g->group_id : id;
    q->peer = peer;
    q->n = q->open = g->n;
    q->n_prompt = g->n_prompt;
    q->t0_ms = now_ms();
    fr_request_spec spec;
    build_spec(srv, q, g, &spec);
    fr_status st = check_spec(srv, &spec, id);
    if (!st && insert_request(srv, q)) st = fr_fail(FR_ENOMEM, "the server is out of memory");
    if (st) {
        free_request(q);
        srv->requests_rejected++;
        send_error(srv, peer, st == FR_ENOMEM ? "out_of_memory" : "invalid_request", 1, id, "%s", fr_last_error());
        return;
    }
    if (srv->state != RUNNING) {
        /* Held until resume: keep copies of the arrays. */
        int *p = malloc(sizeof(int) * (size_t)spec.n_prompt);
        int *s = malloc(sizeof(int) * (size_t)(spec.n_stop > 0 ? spec.n_stop : 1));
        if (!p || !s) {
            free(p);
            free(s);
            remove_request(srv, q);
            srv->requests_rejected++;
            send_error(srv, peer, "out_of_memory", 1, id, "the server is out of memory");
            return;
        }
        memcpy(p, spec.prompt, sizeof(int) * (size_t)spec.n_prompt);
        if (spec.n_stop > 0) memcpy(s, spec.stop_ids, sizeof(int) * (size_t)spec.n_stop);
        spec.prompt = p;
        spec.stop_ids = s;
        q->spec = spec;
        q->held = 1;
        srv->requests_accepted++;
        return;
    }
    if ((st = fr_scheduler_submit(srv->sch, &spec))) {
        char msg[FR_PROTO_TEXT_MAX];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        remove_request(srv, q);
        srv->requests_rejected++;
        send_error(srv, peer, "invalid_request", 1, id, "%s", msg);
        return;
    }
    srv->requests_accepted++;
}

/* Ends every sample of a held request with reason abort. */
static int abort_held(fr_bridge_server *srv, request *q)
{
    int n = q->open, total = q->n;
    for (int k = 0; k < total; k++) send_done(srv, q, k, FR_WIRE_ABORT, 0, 0);   /* the last frees q */
    return n;
}

/* Ends the request with scheduler id sid; returns the samples ended. */
static int abort_sid(fr_bridge_server *srv, uint64_t sid)
{
    request *q = find_sid(srv, sid);
    if (!q) return 0;
    if (q->held) return abort_held(srv, q);
    int n = 0;
    if (fr_scheduler_abort(srv->sch, sid, &n)) logf_(srv, "abort: %s", fr_last_error());
    return n;
}

/* The scheduler ids of the peer's open requests (every peer's when peer < 0). */
static uint64_t *sids_of(const fr_bridge_server *srv, int peer, int *n)
{
    uint64_t *v = malloc(sizeof(uint64_t) * (size_t)(srv->n_reqs ? srv->n_reqs : 1));
    *n = 0;
    if (!v) return NULL;
    for (int i = 0; i < srv->n_reqs; i++)
        if (peer < 0 || srv->reqs[i]->peer == peer) v[(*n)++] = srv->reqs[i]->sid;
    return v;
}

static void handle_abort(fr_bridge_server *srv, int peer, const fr_msg_abort *a)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ABORT_REPLY);
    int ended = 0;
    uint64_t *missing = NULL;
    int n_missing = 0;
    if (a->all) {
        int n;
        uint64_t *sids = sids_of(srv, peer, &n);
        if (!sids) {
            send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
            return;
        }
        for (int i = 0; i < n; i++) ended += abort_sid(srv, sids[i]);
        free(sids);
    } else {
        missing = malloc(sizeof(uint64_t) * (size_t)a->n_request_ids);
        if (!missing) {
            send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
            return;
        }
        for (int i = 0; i < a->n_request_ids; i++) {
            request *q = find_caller(srv, peer, a->request_ids[i]);
            if (!q) missing[n_missing++] = a->request_ids[i];
            else ended += abort_sid(srv, q->sid);
        }
    }
    flush_all(srv);
    m.u.abort_reply.samples = ended;
    m.u.abort_reply.not_found = missing;
    m.u.abort_reply.n_not_found = n_missing;
    send_msg(srv, peer, &m);
    free(missing);
}

static void send_pause_reply(fr_bridge_server *srv, int peer, fr_pause_mode mode, int aborted)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_PAUSE_REPLY);
    m.u.pause_reply.mode = mode;
    m.u.pause_reply.aborted = aborted;
    send_msg(srv, peer, &m);
}

static void reply_waiters(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_waiters; i++) send_pause_reply(srv, srv->waiters[i], FR_PAUSE_WAIT, 0);
    srv->n_waiters = 0;
}

static void handle_pause(fr_bridge_server *srv, int peer, fr_pause_mode mode)
{
    if (mode == FR_PAUSE_ABORT) {
        int n = 0;
        if (fr_scheduler_abort_all(srv->sch, &n)) logf_(srv, "pause: %s", fr_last_error());
        flush_all(srv);
        srv->state = PAUSED;
        reply_waiters(srv);
        send_pause_reply(srv, peer, mode, n);
        return;
    }
    if (srv->state == PAUSED || fr_scheduler_idle(srv->sch)) {
        srv->state = PAUSED;
        reply_waiters(srv);
        send_pause_reply(srv, peer, mode, 0);
        return;
    }
    srv->state = PAUSING;
    if (srv->n_waiters == srv->cap_waiters) {
        int c = srv->cap_waiters ? srv->cap_waiters * 2 : 4;
        int *w = realloc(srv->waiters, sizeof(int) * (size_t)c);
        if (!w) {
            send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
            return;
        }
        srv->waiters = w;
        srv->cap_waiters = c;
    }
    srv->waiters[srv->n_waiters++] = peer;
}

/* Pause waiters get an error instead of their reply (resume or shutdown
 * came first). */
static void fail_waiters(fr_bridge_server *srv, const char *code, const char *why)
{
    for (int i = 0; i < srv->n_waiters; i++) send_error(srv, srv->waiters[i], code, 0, 0, "%s", why);
    srv->n_waiters = 0;
}

static void handle_resume(fr_bridge_server *srv, int peer)
{
    if (srv->state == PAUSING)
        fail_waiters(srv, "pause_cancelled", "a resume arrived before the engine finished its work");
    srv->state = RUNNING;
    int released = 0, n;
    uint64_t *sids = sids_of(srv, -1, &n);
    for (int i = 0; sids && i < n; i++) {
        request *q = find_sid(srv, sids[i]);
        if (!q || !q->held) continue;
        fr_status st = fr_scheduler_submit(srv->sch, &q->spec);
        if (st) {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            int p = q->peer;
            uint64_t id = q->request_id;
            abort_held(srv, q);
            send_error(srv, p, "invalid_request", 1, id, "held request could not start: %s", msg);
            continue;
        }
        q->held = 0;
        free((void *)q->spec.prompt);
        free((void *)q->spec.stop_ids);
        q->spec.prompt = NULL;
        q->spec.stop_ids = NULL;
        released++;
    }
    free(sids);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_RESUME_REPLY);
    m.u.resume_reply.released = released;
    send_msg(srv, peer, &m);
}

static void handle_stats(fr_bridge_server *srv, int peer)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    fr_msg_stats_reply *r = &m.u.stats_reply;
    fr_scheduler_stats ss;
    fr_scheduler_stats_get(srv->sch, &ss);
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    r->running = ss.running;
    r->prefilling = ss.prefilling;
    r->waiting = ss.waiting;
    r->preemptions = (uint64_t)ss.preemptions;
    r->tokens_generated = (uint64_t)ss.tokens_generated;
    r->prefill_tokens = (uint64_t)ss.prefill_tokens;
    r->steps = (uint64_t)ss.steps;
    r->finished = (uint64_t)ss.finished;
    r->kv_blocks_used = ss.kv_blocks_used;
    r->kv_blocks_free = ss.kv_blocks_free;
    snprintf(r->state, sizeof r->state, "%s", state_names[srv->state]);
    r->weight_version = srv->weight_version;
    r->clients = fr_peers_count(srv->peers);
    r->open_requests = srv->n_reqs;
    for (int i = 0; i < srv->n_reqs; i++) r->held_requests += srv->reqs[i]->held;
    r->messages_in = srv->messages_in;
    r->messages_out = srv->messages_out + 1;   /* this reply included */
    r->bad_messages = srv->bad_messages;
    r->errors_sent = srv->errors_sent;
    r->requests_accepted = srv->requests_accepted;
    r->requests_rejected = srv->requests_rejected;
    r->samples_done = srv->samples_done;
    r->tokens_streamed = srv->tokens_streamed;
    r->send_retries = ps.retries;
    r->queued_messages = ps.queued;
    r->undeliverable_messages = ps.undeliverable;
    send_msg(srv, peer, &m);
}

static void handle_hello(fr_bridge_server *srv, int peer)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_HELLO_REPLY);
    fr_msg_hello_reply *h = &m.u.hello_reply;
    const fr_model_config *mc = &srv->sess->model->cfg;
    snprintf(h->server, sizeof h->server, "fp4rollout");
    snprintf(h->model, sizeof h->model, "%s", srv->cfg.model_name ? srv->cfg.model_name : "unknown");
    snprintf(h->backend, sizeof h->backend, "%s", fr_backend_name(srv->sess->backend));
    snprintf(h->kv_dtype, sizeof h->kv_dtype, "%s", fr_kv_dtype_name(fr_kv_cache_config_of(srv->sess->kv)->dtype));
    h->tp = srv->sess->tp.size > 0 ? srv->sess->tp.size : 1;
    h->engines = 1;
    h->weight_version = srv->weight_version;
    h->max_seqs = srv->max_seqs;
    h->kv_blocks = srv->n_blocks;
    h->kv_block_tokens = FR_PAGE_TOKENS;
    h->max_model_len = srv->max_pos;
    h->vocab_size = srv->vocab;
    h->n_eos_token_ids = mc->n_eos < FR_PROTO_MAX_EOS ? mc->n_eos : FR_PROTO_MAX_EOS;
    for (int i = 0; i < h->n_eos_token_ids; i++) h->eos_token_ids[i] = mc->eos_ids[i];
    h->chunk = srv->chunk;
    send_msg(srv, peer, &m);
}

/* One message from the socket. */
static void handle_message(fr_bridge_server *srv, fr_wire_msg *w)
{
    srv->messages_in++;
    int peer;
    if (w->peer_len == 0 || fr_peers_find_or_add(srv->peers, w->peer, w->peer_len, &peer)) {
        srv->bad_messages++;
        logf_(srv, "dropped a message without a usable routing id");
        return;
    }
    uint64_t id = 0;
    int has_id = w->frame0 ? fr_msg_peek_request_id(w->frame0, w->len0, &id) : 0;
    if (w->n_frames != 1) {
        srv->bad_messages++;
        send_error(srv, peer, "bad_message", has_id, id,
                   "message: %d frames; every protocol version 1 message is one frame (no empty delimiter)",
                   w->n_frames);
        return;
    }
    fr_msg_type named = fr_msg_peek_type(w->frame0, w->len0);
    if (named != FR_MSG_NONE && !fr_msg_type_from_client(named)) {
        srv->bad_messages++;
        send_error(srv, peer, "bad_message", has_id, id, "message: \"%s\" is a message the server sends",
                   fr_msg_type_name(named));
        return;
    }
    fr_msg m;
    fr_status st = fr_msg_decode(w->frame0, w->len0, &m);
    if (st) {
        srv->bad_messages++;
        send_error(srv, peer, st == FR_EUNSUPPORTED ? "unsupported_version" : "bad_message", has_id, id, "%s",
                   fr_last_error());
        return;
    }
    if (!fr_msg_type_from_client(m.type)) {
        srv->bad_messages++;
        send_error(srv, peer, "bad_message", has_id, id, "message: \"%s\" is a message the server sends",
                   fr_msg_type_name(m.type));
        fr_msg_free(&m);
        return;
    }
    switch (m.type) {
    case FR_MSG_HELLO: handle_hello(srv, peer); break;
    case FR_MSG_GENERATE: handle_generate(srv, peer, &m.u.generate); break;
    case FR_MSG_ABORT: handle_abort(srv, peer, &m.u.abort); break;
    case FR_MSG_PAUSE: handle_pause(srv, peer, m.u.pause.mode); break;
    case FR_MSG_RESUME: handle_resume(srv, peer); break;
    case FR_MSG_STATS: handle_stats(srv, peer); break;
    default: break;
    }
    fr_msg_free(&m);
}

/* A client ZeroMQ no longer knows: its open requests end (their done
 * messages are counted undeliverable) and it stops waiting for a pause. */
static void drop_gone_peers(fr_bridge_server *srv)
{
    int peer;
    while (fr_peers_take_gone(srv->peers, &peer)) {
        int n, ended = 0;
        uint64_t *sids = sids_of(srv, peer, &n);
        for (int i = 0; sids && i < n; i++) ended += abort_sid(srv, sids[i]);
        free(sids);
        for (int i = 0; i < srv->n_waiters;)
            if (srv->waiters[i] == peer) {
                memmove(&srv->waiters[i], &srv->waiters[i + 1], sizeof(int) * (size_t)(srv->n_waiters - i - 1));
                srv->n_waiters--;
            } else i++;
        logf_(srv, "client %s disconnected: its messages are undeliverable, %d open samples aborted",
              fr_peers_name(srv->peers, peer), ended);
    }
}

/* ---- lifecycle ------------------------------------------------------------ */

fr_status fr_bridge_server_new(fr_session *s, const fr_bridge_config *cfg, fr_bridge_server **out)
{
    if (!out) return fr_fail(FR_EINVAL, "serve: out is NULL");
    *out = NULL;
    if (!s || !s->model || !s->kv || !cfg || !cfg->endpoint)
        return fr_fail(FR_EINVAL, "serve: session, config and endpoint are required");
    fr_bridge_server *srv = calloc(1, sizeof *srv);
    if (!srv) return fr_fail(FR_ENOMEM, "serve: out of memory");
    srv->sess = s;
    srv->cfg = *cfg;
    srv->log = cfg->log ? cfg->log : stderr;
    const fr_model_config *mc = &s->model->cfg;
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(s->kv);
    srv->vocab = mc->vocab_size;
    srv->max_pos = mc->max_position;
    srv->n_blocks = kc->n_blocks;
    srv->max_seqs = cfg->max_seqs > 0 ? cfg->max_seqs : kc->max_seqs;
    srv->chunk = cfg->chunk > 0 ? cfg->chunk : 512;
    if (cfg->sampling.n_stop > 0) {
        srv->n_default_stop = cfg->sampling.n_stop;
        memcpy(srv->default_stop, cfg->sampling.stop_token_ids, sizeof(int) * (size_t)cfg->sampling.n_stop);
    } else {
        srv->n_default_stop = mc->n_eos;
        memcpy(srv->default_stop, mc->eos_ids, sizeof(int) * (size_t)mc->n_eos);
    }
    fr_scheduler_config sc = {.max_seqs = srv->max_seqs, .chunk = srv->chunk, .reserve_blocks = -1,
                              .on_done = on_done, .user = srv, .on_token = on_token};
    fr_status st = fr_scheduler_new(s, &sc, &srv->sch);
    if (st) {
        free(srv);
        return st;
    }
    srv->zctx = zmq_ctx_new();
    srv->sock = srv->zctx ? zmq_socket(srv->zctx, ZMQ_ROUTER) : NULL;
    /* Linger: what shutdown handed to ZeroMQ still goes out when the socket
     * closes, for up to shutdown_linger_ms. */
    int one = 1, linger = cfg->shutdown_linger_ms > 0 ? cfg->shutdown_linger_ms : 0;
    if (!srv->sock || zmq_setsockopt(srv->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one) ||
        zmq_setsockopt(srv->sock, ZMQ_LINGER, &linger, sizeof linger)) {
        st = fr_fail(FR_EIO, "serve: cannot make a ZeroMQ ROUTER socket: %s", zmq_strerror(errno));
    } else if (zmq_bind(srv->sock, cfg->endpoint)) {
        st = fr_fail(FR_EIO, "serve: cannot bind %s: %s", cfg->endpoint, zmq_strerror(errno));
    }
    if (!st) {
        size_t n = sizeof srv->endpoint;
        if (zmq_getsockopt(srv->sock, ZMQ_LAST_ENDPOINT, srv->endpoint, &n))
            snprintf(srv->endpoint, sizeof srv->endpoint, "%s", cfg->endpoint);
        st = fr_peers_new(srv->sock, &srv->peers);
    }
    if (st) {
        fr_bridge_server_destroy(&srv);
        return st;
    }
    *out = srv;
    return FR_OK;
}

const char *fr_bridge_server_endpoint(const fr_bridge_server *srv) { return srv ? srv->endpoint : ""; }

/* Ends everything open with reason abort (held requests and the engine's). */
static int abort_everything(fr_bridge_server *srv)
{
    int ended = 0, n;
    uint64_t *sids = sids_of(srv, -1, &n);
    for (int i = 0; sids && i < n; i++) {
        request *q = find_sid(srv, sids[i]);
        if (q && q->held) ended += abort_held(srv, q);
    }
    free(sids);
    int m = 0;
    if (srv->sch && !fr_scheduler_abort_all(srv->sch, &m)) ended += m;
    flush_all(srv);
    return ended;
}

fr_status fr_bridge_server_run(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    if (!srv || !stop) return fr_fail(FR_EINVAL, "serve: server and stop flag are required");
    fr_status failure = FR_OK;
    logf_(srv, "listening on %s (protocol version %d)", srv->endpoint, FR_PROTO_VERSION);
    while (!*stop) {
        fr_peers_stats ps;
        fr_peers_stats_get(srv->peers, &ps);
        int work = !fr_scheduler_idle(srv->sch);
        long wait = work ? 0 : ps.queued ? 2 : 100;
        zmq_pollitem_t it = {.socket = srv->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, wait) < 0) {
            if (errno == EINTR) continue;
            failure = fr_fail(FR_EIO, "serve: poll failed: %s", zmq_strerror(errno));
            break;
        }
        /* Everything that is waiting, up to a bound so the engine keeps
         * stepping under a flood of messages. */
        for (int k = 0; k < 1024 && !*stop; k++) {
            fr_wire_msg w;
            int got;
            if (fr_wire_recv(srv->sock, 1, 0, &w, &got)) {
                failure = FR_EIO;
                break;
            }
            if (!got) break;
            handle_message(srv, &w);
            fr_wire_msg_free(&w);
        }
        if (failure) break;
        if (!fr_scheduler_idle(srv->sch)) {
            if (fr_scheduler_step(srv->sch))
                logf_(srv, "engine step failed (its samples end with reason error): %s", fr_last_error());
        }
        flush_all(srv);
        if (srv->state == PAUSING && fr_scheduler_idle(srv->sch)) {
            srv->state = PAUSED;
            reply_waiters(srv);
        }
        int gone = 0;
        if (fr_peers_pump(srv->peers, &gone)) {
            failure = FR_EIO;
            break;
        }
        if (gone) drop_gone_peers(srv);
    }
    int ended = abort_everything(srv);
    fail_waiters(srv, "shutdown", "the server is shutting down");
    logf_(srv, "shutting down: %d open samples ended with reason abort", ended);
    fr_peers_flush(srv->peers, srv->cfg.shutdown_linger_ms > 0 ? srv->cfg.shutdown_linger_ms : 0);
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    if (ps.queued) logf_(srv, "%llu messages could not be delivered before shutdown", (unsigned long long)ps.queued);
    return failure;
}

void fr_bridge_server_destroy(fr_bridge_server **pp)
{
    if (!pp || !*pp) return;
    fr_bridge_server *srv = *pp;
    if (srv->sch && srv->peers) abort_everything(srv);
    fr_scheduler_destroy(&srv->sch);   /* nothing open is left; any result would find no request */
    for (int i = 0; i < srv->n_reqs; i++) free_request(srv->reqs[i]);
    free(srv->reqs);
    free(srv->waiters);
    fr_peers_destroy(&srv->peers);
    if (srv->sock) zmq_close(srv->sock);
    if (srv->zctx) zmq_ctx_term(srv->zctx);
    free(srv);
    *pp = NULL;
}
