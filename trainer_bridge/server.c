/* The coordinator loop (trainer_bridge/server.h, docs/protocol.md): one
 * engine in one process, or engines over the ranks of an MPI job (docs/protocol.md,
 * "Serving on several ranks"). */
#include "server.h"

#include "base/clock.h"
#include "metrics_pub.h"
#include "rollout/monitor/metrics_http.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "peers.h"
#include "protocol.h"
#include "rank_wire.h"
#include "rollout/engine/scheduler.h"
#include "update.h"
#include "wire.h"
#ifdef FR_HAVE_CUDA
#include "nccl_recv.h"
#endif

enum { RUNNING = 0, PAUSING, PAUSED };
static const char *const state_names[] = {"running", "pausing", "paused"};

/* A sample's tokens drawn since its last delta went out. */
typedef struct {
    int *tok;
    float *lp;
    uint64_t *wv;            /* the weight version each pending token was drawn with */
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
    int engine;              /* several ranks: the engine serving it */
    int from_held;           /* submitted by a resume (a refusal then ends its samples) */
    sample_state *s;
} request;

/* Several ranks: what rank 0 sends every rank each turn (engine events)... */
enum { EV_SUBMIT = 1, EV_ABORT, EV_ABORT_ALL, EV_UPD_BEGIN, EV_UPD_BUCKET, EV_UPD_DROP, EV_UPD_COMMIT };
/* ...and what each engine leader sends rank 0 after its step. */
enum { OB_TOKEN = 1, OB_DONE, OB_REJECT, OB_STATS };

/* A reply encoded now and sent once this turn's results went out. */
typedef struct {
    int peer;
    char *data;
    size_t len;
} deferred_msg;

/* The ZAP handler (ZeroMQ's authentication protocol, RFC 27) of a CURVE
 * server: a thread answering inproc://zeromq.zap.01 that accepts a client
 * exactly when its public key is listed. */
typedef struct {
    void *sock;              /* REP, bound in the server's context */
    unsigned char (*keys)[32];
    int n_keys;
    FILE *log;
    pthread_t thread;
    int started;
} zap_handler;

struct fr_bridge_server {
    fr_session *sess;
    fr_scheduler *sch;
    fr_bridge_config cfg;
    void *zctx, *sock;
    fr_peers *peers;
    zap_handler zap;
    FILE *log;
    char endpoint[256];
    request **reqs;          /* open requests, sorted by sid */
    int n_reqs, cap_reqs;
    uint64_t next_sid;
    int state;
    int *waiters;            /* peers waiting for a pause (wait mode) to complete */
    int n_waiters, cap_waiters;
    int vocab, n_blocks, max_pos, max_seqs, chunk;
    int default_stop[FR_BRIDGE_MAX_STOP_IDS];
    int n_default_stop;
    uint64_t weight_version;
    /* the weight update being staged (NULL when none), its client, and when
     * its last message arrived */
    fr_bridge_update *upd;
    /* the staging memory of the last update that ended (committed or
     * dropped), reused by the next so it needs no fresh pages; NULL: none */
    fr_weight_update *spare;
    int upd_peer;
    double upd_last_ms;
    uint64_t updates_committed, updates_failed;
    /* protocol counters (stats) */
    uint64_t messages_in, messages_out, bad_messages, errors_sent;
    uint64_t requests_accepted, requests_rejected, samples_done, tokens_streamed;
    /* metrics endpoint (rollout/monitor/metrics_http.h), NULL when off */
    fr_metrics_http *metrics;
    /* the same snapshots on a ZeroMQ PUB socket (metrics_pub.h), NULL when off */
    fr_metrics_pub *pub;
    int pub_failed;   /* a send failed once: logged, not again */
    /* automatic recalibration (rollout/monitor/recalibrate.h), NULL when off */
    fr_recal *recal;
    double started_ms, upd_begin_ms, last_sync_s, last_pub_ms;
    long long last_pub_tokens;
    /* Several ranks (multi): this rank's place; rank 0 alone has the socket
     * and the request table. */
    const fr_mpi_world *world;
    int multi, rank, tp, n_engines, engine, leader;
    fr_rank_buf events;       /* rank 0: the engine events of this turn */
    fr_rank_buf outbox;       /* engine leaders: this turn's tokens, ends and stats */
    int *engine_open;         /* rank 0: open samples per engine (routing) */
    int next_engine;          /* rank 0: where the routing's tie-break starts */
    fr_scheduler_stats agg;   /* rank 0: the engines' stats summed, as of the last turn */
    fr_weight_update *wupd;   /* ranks other than 0: the update being staged */
    int stage_failed;         /* ranks other than 0: staging the current update failed */
    int turn_barrier;         /* rank 0: stop reading messages this turn (a commit waits for the ranks) */
    deferred_msg *deferred;
    int n_deferred, cap_deferred;
    fr_status fatal;          /* a failure every rank saw alike: the loop ends */
#ifdef FR_HAVE_CUDA
    /* weights over NCCL (nccl_recv.h): a client's group, NULL when none */
    fr_nccl_recv *ng;
#endif
    int ng_peer;              /* the client whose group it is */
    int ng_commit;            /* 1: that client's commit waits for buckets in flight */
    uint64_t ng_commit_version;
};

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
        free(q->s[k].wv);
    }
    free(q->s);
    free((void *)q->spec.prompt);
    free((void *)q->spec.stop_ids);
    free((void *)q->spec.forced);
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

/* A reply that must follow the done messages of what it ended: sent at
 * once with one process; with several ranks those dones arrive at the end
 * of the turn, so the reply waits for them. */
static void send_later(fr_bridge_server *srv, int peer, const fr_msg *m)
{
    if (!srv->multi) {
        send_msg(srv, peer, m);
        return;
    }
    char *data;
    size_t len;
    if (fr_msg_encode(m, &data, &len)) {
        logf_(srv, "cannot encode a %s message for client %s: %s", fr_msg_type_name(m->type),
              fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    if (srv->n_deferred == srv->cap_deferred) {
        int c = srv->cap_deferred ? srv->cap_deferred * 2 : 8;
        deferred_msg *v = realloc(srv->deferred, sizeof *v * (size_t)c);
        if (!v) {
            free(data);
            logf_(srv, "out of memory keeping a reply for client %s", fr_peers_name(srv->peers, peer));
            return;
        }
        srv->deferred = v;
        srv->cap_deferred = c;
    }
    srv->deferred[srv->n_deferred++] = (deferred_msg){.peer = peer, .data = data, .len = len};
}

static void send_deferred(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_deferred; i++) {
        deferred_msg *d = &srv->deferred[i];
        if (fr_peers_send(srv->peers, d->peer, d->data, d->len))
            logf_(srv, "sending to client %s: %s", fr_peers_name(srv->peers, d->peer), fr_last_error());
        else srv->messages_out++;
    }
    srv->n_deferred = 0;
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
    fr_msg m;
    fr_msg_init(&m, FR_MSG_TOKENS);
    m.u.tokens = (fr_msg_tokens){.request_id = q->request_id, .sample = k, .start = s->sent, .n = s->n_pending,
                                 .token_ids = s->tok, .logprobs = s->lp, .weight_versions = s->wv};
    send_msg(srv, q->peer, &m);
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
 * sample (q must not be used after). div: the divergence figures, NULL for
 * none. */
static void send_done(fr_bridge_server *srv, request *q, int k, fr_wire_finish why, int n_tokens, int preemptions,
                      const fr_msg_divergence *div)
{
    flush_sample(srv, q, k);
    sample_state *s = &q->s[k];
    if (n_tokens != s->sent)
        logf_(srv, "request %llu sample %d: %d tokens streamed, the engine reports %d",
              (unsigned long long)q->request_id, k, s->sent, n_tokens);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_DONE);
    double t = fr_now_ms();
    m.u.done = (fr_msg_done){.request_id = q->request_id, .group_id = q->group_id, .sample = k,
                             .finish_reason = why, .n_tokens = s->sent, .n_prompt = q->n_prompt,
                             .preemptions = preemptions, .has_ttft = s->has_first,
                             .ttft_ms = s->has_first ? s->first_ms - q->t0_ms : 0, .total_ms = t - q->t0_ms};
    if (div) m.u.done.divergence = *div;
    send_msg(srv, q->peer, &m);
    srv->samples_done++;
    if (--q->open == 0) remove_request(srv, q);
}

/* ---- scheduler callbacks -------------------------------------------------- */

/* A token drawn by an engine with weight version `version`, kept for the
 * next delta. */
static void token_in(fr_bridge_server *srv, uint64_t sid, int sample, int index, int token, float logprob,
                     uint64_t version)
{
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
        uint64_t *v = l ? realloc(s->wv, sizeof(uint64_t) * (size_t)c) : NULL;
        if (v) s->wv = v;
        if (!t || !l || !v) {
            logf_(srv, "out of memory keeping a token of request %llu", (unsigned long long)q->request_id);
            return;
        }
        s->cap = c;
    }
    if (!s->has_first) {
        s->has_first = 1;
        s->first_ms = fr_now_ms();
    }
    s->tok[s->n_pending] = token;
    s->wv[s->n_pending] = version;
    s->lp[s->n_pending++] = logprob;
}

static void on_token(void *user, uint64_t sid, int sample, int index, int token, float logprob)
{
    fr_bridge_server *srv = user;
    /* Weights change only between steps, and the scheduler stamps a token
     * with the version it was told last: the server's (this rank's). */
    if (!srv->multi) {
        token_in(srv, sid, sample, index, token, logprob, srv->weight_version);
    } else if (srv->leader) {
        fr_rank_put_u8(&srv->outbox, OB_TOKEN);
        fr_rank_put_u64(&srv->outbox, sid);
        fr_rank_put_i32(&srv->outbox, sample);
        fr_rank_put_i32(&srv->outbox, index);
        fr_rank_put_i32(&srv->outbox, token);
        fr_rank_put_f32(&srv->outbox, logprob);
        fr_rank_put_u64(&srv->outbox, srv->weight_version);
    }
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

/* The divergence figures of a result (none when it was not monitored). */
static void divergence_of(const fr_sample_result *r, fr_msg_divergence *div)
{
    memset(div, 0, sizeof *div);
    if (r->monitored && r->div.n > 0) {
        div->has_values = 1;
        div->kl_mean = r->div.kl_sum / (double)r->div.n;
        div->kl_max = r->div.kl_max;
        div->top1_agreement = (double)r->div.top1_agree / (double)r->div.n;
        div->logprob_diff_mean = r->div.logp_diff_sum / (double)r->div.n;
        div->positions = (int)r->div.n;
        if (r->kl && r->n_tokens > 0) {
            div->kl = r->kl;
            div->n_kl = r->n_tokens;
        }
    }
}

/* Several ranks: an engine leader's record of a finished sample. */
static void put_done(fr_bridge_server *srv, const fr_sample_result *r)
{
    fr_msg_divergence div;
    divergence_of(r, &div);
    fr_rank_buf *b = &srv->outbox;
    fr_rank_put_u8(b, OB_DONE);
    fr_rank_put_u64(b, r->request_id);
    fr_rank_put_i32(b, r->sample);
    fr_rank_put_i32(b, (int)wire_finish(r->finish));
    fr_rank_put_i32(b, r->n_tokens);
    fr_rank_put_i32(b, r->preemptions);
    fr_rank_put_u8(b, (unsigned)div.has_values);
    fr_rank_put_f64(b, div.kl_mean);
    fr_rank_put_f64(b, div.kl_max);
    fr_rank_put_f64(b, div.top1_agreement);
    fr_rank_put_f64(b, div.logprob_diff_mean);
    fr_rank_put_i32(b, div.positions);
    fr_rank_put_i32(b, div.kl ? div.n_kl : 0);
    for (int i = 0; div.kl && i < div.n_kl; i++) fr_rank_put_f32(b, div.kl[i]);
}

static void on_done(void *user, const fr_sample_result *r)
{
    fr_bridge_server *srv = user;
    if (srv->multi) {
        if (srv->leader) put_done(srv, r);
        return;
    }
    request *q = find_sid(srv, r->request_id);
    if (!q || r->sample < 0 || r->sample >= q->n) {
        logf_(srv, "the engine ended an unknown sample (%llu, %d)", (unsigned long long)r->request_id, r->sample);
        return;
    }
    /* The tokens were stamped as they were drawn; the result's versions say
     * the same (a mismatch would be a bug worth a log line). */
    const sample_state *s = &q->s[r->sample];
    for (int i = 0; r->versions && i < s->n_pending; i++) {
        int idx = s->sent + i;
        if (idx < r->n_tokens && r->versions[idx] != s->wv[i]) {
            logf_(srv, "request %llu sample %d token %d: streamed with weight version %llu, the engine says %llu",
                  (unsigned long long)q->request_id, r->sample, idx, (unsigned long long)s->wv[i],
                  (unsigned long long)r->versions[idx]);
            break;
        }
    }
    fr_msg_divergence div;
    divergence_of(r, &div);
    send_done(srv, q, r->sample, wire_finish(r->finish), r->n_tokens, r->preemptions, &div);
}

/* ---- the engines ----------------------------------------------------------- */

/* With one process these act on the scheduler at once. With several ranks
 * rank 0 records them as events, which every rank applies to its own
 * scheduler at the start of the next step (apply_events); their results
 * come back as records after it (take_results). */

static void put_spec(fr_rank_buf *b, int engine, const fr_request_spec *r)
{
    fr_rank_put_u8(b, EV_SUBMIT);
    fr_rank_put_i32(b, engine);
    fr_rank_put_u64(b, r->id);
    fr_rank_put_u64(b, r->group);
    fr_rank_put_i32s(b, r->prompt, r->n_prompt);
    fr_rank_put_i32(b, r->n);
    fr_rank_put_f32(b, r->params.temperature);
    fr_rank_put_i32(b, r->params.top_k);
    fr_rank_put_f32(b, r->params.top_p);
    fr_rank_put_u64(b, r->params.seed);
    fr_rank_put_i32(b, r->max_tokens);
    fr_rank_put_i32s(b, r->stop_ids, r->n_stop > 0 ? r->n_stop : 0);
    fr_rank_put_i32(b, r->monitor);
    fr_rank_put_i32(b, r->per_token_kl);
    fr_rank_put_i32(b, r->forced ? 1 : 0);
    if (r->forced) fr_rank_put_i32s(b, r->forced, r->n_forced);
}

/* Open samples of the requests the engines run (held ones excluded). */
static int engine_samples(const fr_bridge_server *srv)
{
    int n = 0;
    for (int i = 0; i < srv->n_reqs; i++)
        if (!srv->reqs[i]->held) n += srv->reqs[i]->open;
    return n;
}

static int eng_idle(const fr_bridge_server *srv)
{
    return srv->multi ? engine_samples(srv) == 0 : fr_scheduler_idle(srv->sch);
}

/* Starts q on an engine: with several, the one with the fewest open
 * samples (ties: turn by turn). */
static fr_status eng_submit(fr_bridge_server *srv, request *q, const fr_request_spec *spec)
{
    if (!srv->multi) return fr_scheduler_submit(srv->sch, spec);
    int best = -1;
    for (int k = 0; k < srv->n_engines; k++) {
        int e = (srv->next_engine + k) % srv->n_engines;
        if (best < 0 || srv->engine_open[e] < srv->engine_open[best]) best = e;
    }
    srv->next_engine = (best + 1) % srv->n_engines;
    put_spec(&srv->events, best, spec);
    if (srv->events.failed) return fr_fail(FR_ENOMEM, "the server is out of memory");
    q->engine = best;
    srv->engine_open[best] += q->n;
    return FR_OK;
}

/* Ends q's samples on its engine; *n gets how many. */
static fr_status eng_abort(fr_bridge_server *srv, const request *q, int *n)
{
    if (!srv->multi) return fr_scheduler_abort(srv->sch, q->sid, n);
    fr_rank_put_u8(&srv->events, EV_ABORT);
    fr_rank_put_i32(&srv->events, q->engine);
    fr_rank_put_u64(&srv->events, q->sid);
    *n = q->open;
    return srv->events.failed ? fr_fail(FR_ENOMEM, "the server is out of memory") : FR_OK;
}

static fr_status eng_abort_all(fr_bridge_server *srv, int *n)
{
    if (!srv->multi) return fr_scheduler_abort_all(srv->sch, n);
    fr_rank_put_u8(&srv->events, EV_ABORT_ALL);
    *n = engine_samples(srv);
    return srv->events.failed ? fr_fail(FR_ENOMEM, "the server is out of memory") : FR_OK;
}

/* ---- requests in ----------------------------------------------------------- */

/* The engine request of a generate, with the server's defaults for what it
 * leaves out (prompt and stop ids point into g or the server). */
static void build_spec(const fr_bridge_server *srv, const request *q, const fr_msg_generate *g, fr_request_spec *r)
{
    const fr_bridge_sampling *d = &srv->cfg.sampling;
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
    r->monitor = g->monitor_divergence;   /* -1 when absent: the scheduler's kl_sample_rate */
    r->per_token_kl = g->per_token_kl;
    r->forced = g->forced_tokens;
    r->n_forced = g->forced_tokens ? g->n_forced_tokens : 0;
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
    q->t0_ms = fr_now_ms();
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
        int *f = spec.forced ? malloc(sizeof(int) * (size_t)spec.n_forced) : NULL;
        if (!p || !s || (spec.forced && !f)) {
            free(p);
            free(s);
            free(f);
            remove_request(srv, q);
            srv->requests_rejected++;
            send_error(srv, peer, "out_of_memory", 1, id, "the server is out of memory");
            return;
        }
        memcpy(p, spec.prompt, sizeof(int) * (size_t)spec.n_prompt);
        if (spec.n_stop > 0) memcpy(s, spec.stop_ids, sizeof(int) * (size_t)spec.n_stop);
        if (f) memcpy(f, spec.forced, sizeof(int) * (size_t)spec.n_forced);
        spec.prompt = p;
        spec.stop_ids = s;
        spec.forced = f;
        q->spec = spec;
        q->held = 1;
        srv->requests_accepted++;
        return;
    }
    if ((st = eng_submit(srv, q, &spec))) {
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
    for (int k = 0; k < total; k++) send_done(srv, q, k, FR_WIRE_ABORT, 0, 0, NULL);   /* the last frees q */
    return n;
}

/* Ends the request with scheduler id sid; returns the samples ended. */
static int abort_sid(fr_bridge_server *srv, uint64_t sid)
{
    request *q = find_sid(srv, sid);
    if (!q) return 0;
    if (q->held) return abort_held(srv, q);
    int n = 0;
    if (eng_abort(srv, q, &n)) logf_(srv, "abort: %s", fr_last_error());
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
    send_later(srv, peer, &m);
    free(missing);
}

static void send_pause_reply(fr_bridge_server *srv, int peer, fr_pause_mode mode, int aborted)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_PAUSE_REPLY);
    m.u.pause_reply.mode = mode;
    m.u.pause_reply.aborted = aborted;
    send_later(srv, peer, &m);
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
        if (eng_abort_all(srv, &n)) logf_(srv, "pause: %s", fr_last_error());
        flush_all(srv);
        srv->state = PAUSED;
        reply_waiters(srv);
        send_pause_reply(srv, peer, mode, n);
        return;
    }
    if (srv->state == PAUSED || eng_idle(srv)) {
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
        fr_status st = eng_submit(srv, q, &q->spec);
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
        q->from_held = 1;
        free((void *)q->spec.prompt);
        free((void *)q->spec.stop_ids);
        free((void *)q->spec.forced);
        q->spec.prompt = NULL;
        q->spec.stop_ids = NULL;
        q->spec.forced = NULL;
        released++;
    }
    free(sids);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_RESUME_REPLY);
    m.u.resume_reply.released = released;
    send_msg(srv, peer, &m);
}

static int nccl_updating(const fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    return fr_nccl_recv_updating(srv->ng);
#else
    (void)srv;
    return 0;
#endif
}

static uint64_t nccl_update_version(const fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    return fr_nccl_recv_version(srv->ng);
#else
    (void)srv;
    return 0;
#endif
}

static void handle_stats(fr_bridge_server *srv, int peer)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    fr_msg_stats_reply *r = &m.u.stats_reply;
    fr_scheduler_stats ss;
    if (srv->multi) ss = srv->agg;   /* every engine's, summed, as of the last step */
    else fr_scheduler_stats_get(srv->sch, &ss);
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
    r->updating = srv->upd != NULL || nccl_updating(srv);
    r->update_version = srv->upd ? fr_bridge_update_version(srv->upd) : nccl_update_version(srv);
    r->updates_committed = srv->updates_committed;
    r->updates_failed = srv->updates_failed;
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
    h->tp = srv->multi ? srv->tp : srv->sess->tp.size > 0 ? srv->sess->tp.size : 1;
    h->engines = srv->multi ? srv->n_engines : 1;
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

/* ---- weight updates ------------------------------------------------------ */

static int nccl_end_message(fr_bridge_server *srv, int peer, uint64_t version, int commit);
static void nccl_drop_update(fr_bridge_server *srv, const char *why);
static void handle_nccl_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b);

static void send_update_reply(fr_bridge_server *srv, int peer, uint64_t version, fr_update_stage stage, int bucket,
                              uint64_t bytes)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_UPDATE_REPLY);
    m.u.update_reply = (fr_msg_update_reply){.version = version, .stage = stage, .bucket = bucket, .bytes = bytes,
                                             .weight_version = srv->weight_version};
    send_msg(srv, peer, &m);
}

/* Keeps w's staging memory for the next update (the older spare goes). */
static void keep_spare(fr_bridge_server *srv, fr_weight_update *w)
{
    if (!w) return;
    fr_weight_update_free(&srv->spare);
    srv->spare = w;
}

/* Drops the staged update (the serving weights are untouched); why goes to
 * the log. */
static void drop_update(fr_bridge_server *srv, const char *why)
{
    if (!srv->upd) return;
    logf_(srv, "weight update to version %llu dropped: %s", (unsigned long long)fr_bridge_update_version(srv->upd),
          why);
    keep_spare(srv, fr_bridge_update_release_staged(srv->upd));
    fr_bridge_update_free(&srv->upd);
    srv->updates_failed++;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_UPD_DROP);
}

/* A failed update message: the update is dropped and the sender gets an
 * error with the code and message of the failure. */
static void fail_update(fr_bridge_server *srv, int peer, const char *code)
{
    char msg[FR_PROTO_TEXT_MAX];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    drop_update(srv, msg);
    send_error(srv, peer, code, 0, 0, "%s", msg);
}

/* The staged update a bucket, commit or abort of peer refers to, or NULL
 * after answering with update_state. */
static fr_bridge_update *update_of(fr_bridge_server *srv, int peer, const char *what, uint64_t version)
{
    if (!srv->upd) {
        send_error(srv, peer, "update_state", 0, 0,
                   "%s for version %llu: no weight update is in progress (none began, or it was dropped)", what,
                   (unsigned long long)version);
        return NULL;
    }
    if (srv->upd_peer != peer) {
        send_error(srv, peer, "update_state", 0, 0, "%s: the update in progress belongs to another client", what);
        return NULL;
    }
    if (fr_bridge_update_version(srv->upd) != version) {
        send_error(srv, peer, "update_state", 0, 0, "%s for version %llu: the update in progress is to version %llu",
                   what, (unsigned long long)version, (unsigned long long)fr_bridge_update_version(srv->upd));
        return NULL;
    }
    srv->upd_last_ms = fr_now_ms();
    return srv->upd;
}

static void handle_update_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
    if (nccl_updating(srv)) {
        char why[160];
        snprintf(why, sizeof why, "a new update_weights_begin (version %llu) arrived", (unsigned long long)b->version);
        nccl_drop_update(srv, why);
    }
    if (srv->upd) {
        char why[160];
        snprintf(why, sizeof why, "a new update_weights_begin (version %llu) arrived", (unsigned long long)b->version);
        drop_update(srv, why);
    }
    if (b->version <= srv->weight_version) {
        srv->updates_failed++;
        send_error(srv, peer, "bad_version", 0, 0,
                   "update_weights_begin: version %llu must be greater than the version serving, %llu",
                   (unsigned long long)b->version, (unsigned long long)srv->weight_version);
        return;
    }
    if (b->nccl) {
        handle_nccl_begin(srv, peer, b);
        return;
    }
    const char *code;
    if (fr_bridge_update_begin_reusing(&srv->sess->model->cfg, b, &srv->spare, &srv->upd, &code)) {
        srv->updates_failed++;
        send_error(srv, peer, code, 0, 0, "%s", fr_last_error());
        return;
    }
    srv->upd_peer = peer;
    srv->upd_last_ms = fr_now_ms();
    srv->upd_begin_ms = srv->upd_last_ms;
    if (srv->multi) {
        fr_rank_put_u8(&srv->events, EV_UPD_BEGIN);
        fr_rank_put_u64(&srv->events, b->version);
    }
    logf_(srv, "weight update to version %llu begins: %d tensors, %llu bytes, buckets of %llu bytes",
          (unsigned long long)b->version, b->n_tensors, (unsigned long long)b->total_bytes,
          (unsigned long long)b->bucket_bytes);
    send_update_reply(srv, peer, b->version, FR_UPD_BEGIN, -1, 0);
}

static void handle_update_bucket(fr_bridge_server *srv, int peer, const fr_msg_update_bucket *b,
                                 const fr_wire_msg *w)
{
    fr_bridge_update *u = update_of(srv, peer, "update_weights_bucket", b->version);
    if (!u) return;
    const char *code;
    if (fr_bridge_update_bucket(u, b, w, &code)) {
        fail_update(srv, peer, code);
        return;
    }
    if (srv->multi) {
        /* checked here; the other ranks stage the same pieces */
        fr_rank_buf *e = &srv->events;
        fr_rank_put_u8(e, EV_UPD_BUCKET);
        fr_rank_put_i32(e, b->n_pieces);
        for (int i = 0; i < b->n_pieces; i++) {
            const fr_msg_piece *p = &b->pieces[i];
            fr_rank_put_bytes(e, p->t.name, strlen(p->t.name));
            fr_rank_put_i32(e, p->t.dtype == FR_DTYPE_F32 ? FR_DTYPE_F32 : p->t.dtype == FR_DTYPE_BF16 ? FR_DTYPE_BF16 : FR_DTYPE_F16);
            fr_rank_put_i32(e, p->t.ndim);
            for (int k = 0; k < p->t.ndim; k++) fr_rank_put_u64(e, (uint64_t)p->t.shape[k]);
            fr_rank_put_u64(e, p->offset);
            fr_rank_put_bytes(e, fr_wire_payload(w, i, NULL), (size_t)p->nbytes);
        }
    }
    send_update_reply(srv, peer, b->version, FR_UPD_BUCKET, b->bucket, fr_bridge_update_bytes(u));
}

/* The staged update is serving: every token drawn from now on carries its
 * version; the client gets its reply (rank 0). */
static void committed(fr_bridge_server *srv, uint64_t version, double t0)
{
    uint64_t bytes = fr_bridge_update_bytes(srv->upd);
    srv->weight_version = version;
    fr_scheduler_set_weight_version(srv->sch, version);
    keep_spare(srv, fr_bridge_update_release_staged(srv->upd));   /* now holding the previous weights */
    fr_bridge_update_free(&srv->upd);
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    if (srv->multi)
        logf_(srv, "weights are now version %llu on all %d ranks (%llu bytes; switched in %.1f ms)",
              (unsigned long long)version, srv->world->size, (unsigned long long)bytes, fr_now_ms() - t0);
    else
        logf_(srv, "weights are now version %llu (%llu bytes; switched in %.1f ms)", (unsigned long long)version,
              (unsigned long long)bytes, fr_now_ms() - t0);
    send_update_reply(srv, srv->upd_peer, version, FR_UPD_COMMIT, -1, bytes);
}

/* Commits between engine steps (this loop never runs one meanwhile): the
 * session takes the staged weights, and every token drawn from now on
 * carries the new version. */
static void handle_update_commit(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv->upd && nccl_end_message(srv, peer, version, 1)) return;
    fr_bridge_update *u = update_of(srv, peer, "update_weights_commit", version);
    if (!u) return;
    const char *code;
    if (fr_bridge_update_ready(u, &code)) {
        fail_update(srv, peer, code);
        return;
    }
    if (srv->multi) {
        /* every rank commits at the start of the next step (commit_on_ranks) */
        fr_rank_put_u8(&srv->events, EV_UPD_COMMIT);
        fr_rank_put_u64(&srv->events, version);
        srv->turn_barrier = 1;
        return;
    }
    double t0 = fr_now_ms();
    if (fr_session_commit_weights_move(srv->sess, fr_bridge_update_staged(u))) {
        fail_update(srv, peer, "update_failed");
        return;
    }
    committed(srv, version, t0);
}

static void handle_update_abort(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv->upd && nccl_end_message(srv, peer, version, 0)) return;
    fr_bridge_update *u = update_of(srv, peer, "update_weights_abort", version);
    if (!u) return;
    uint64_t bytes = fr_bridge_update_bytes(u);
    drop_update(srv, "the client aborted it");
    send_update_reply(srv, peer, version, FR_UPD_ABORT, -1, bytes);
}

/* ---- weights over NCCL (docs/protocol.md, "Weights over NCCL") ----------- */

static int nccl_timeout_ms(const fr_bridge_server *srv)
{
    return srv->cfg.nccl_timeout_ms > 0 ? srv->cfg.nccl_timeout_ms : 30000;
}

#ifdef FR_HAVE_CUDA
/* Ends the group (an update of it in progress is dropped and counted
 * failed); its client gets an error with code when code is not NULL. */
static void nccl_end(fr_bridge_server *srv, const char *why, const char *code)
{
    if (!srv->ng) return;
    if (fr_nccl_recv_updating(srv->ng)) {
        srv->updates_failed++;
        logf_(srv, "weight update to version %llu over NCCL dropped: %s",
              (unsigned long long)fr_nccl_recv_version(srv->ng), why);
    }
    if (code) send_error(srv, srv->ng_peer, code, 0, 0, "%s", why);
    logf_(srv, "NCCL weight group of client %s ended: %s", fr_peers_name(srv->peers, srv->ng_peer), why);
    fr_nccl_recv_destroy(&srv->ng);
    srv->ng_commit = 0;
}
#endif

/* Drops the NCCL update in progress (counted failed); the group survives
 * when no bucket of it was in flight. */
static void nccl_drop_update(fr_bridge_server *srv, const char *why)
{
#ifdef FR_HAVE_CUDA
    if (!fr_nccl_recv_updating(srv->ng)) return;
    logf_(srv, "weight update to version %llu over NCCL dropped: %s", (unsigned long long)fr_nccl_recv_version(srv->ng),
          why);
    srv->updates_failed++;
    srv->ng_commit = 0;
    if (fr_nccl_recv_drop(srv->ng)) nccl_end(srv, fr_last_error(), NULL);
#else
    (void)srv;
    (void)why;
#endif
}

#ifdef FR_HAVE_CUDA
/* The commit a client asked for, once every bucket of it is checked. */
static void nccl_try_commit(fr_bridge_server *srv)
{
    if (!srv->ng || !srv->ng_commit) return;
    int ready = 0;
    const char *code = "update_state";
    const int peer = srv->ng_peer;
    char msg[FR_PROTO_TEXT_MAX];
    if (fr_nccl_recv_ready(srv->ng, &ready, &code)) {
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        nccl_drop_update(srv, msg);
        send_error(srv, peer, code, 0, 0, "%s", msg);
        return;
    }
    if (!ready) return;
    srv->ng_commit = 0;
    const uint64_t version = srv->ng_commit_version, bytes = fr_nccl_recv_bytes(srv->ng);
    const double t0 = fr_now_ms();
    if (fr_nccl_recv_commit(srv->ng)) {
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        srv->updates_failed++;
        logf_(srv, "weight update to version %llu over NCCL failed: %s", (unsigned long long)version, msg);
        send_error(srv, peer, "update_failed", 0, 0, "%s", msg);
        return;
    }
    srv->weight_version = version;
    fr_scheduler_set_weight_version(srv->sch, version);
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    logf_(srv, "weights are now version %llu, over NCCL (%llu bytes; switched in %.1f ms, %.3f s since the begin)",
          (unsigned long long)version, (unsigned long long)bytes, fr_now_ms() - t0, srv->last_sync_s);
    send_update_reply(srv, peer, version, FR_UPD_COMMIT, -1, bytes);
}
#endif

/* Every turn: what the group finished (joined, buckets checked, failures),
 * then a commit that waited for it. */
static void nccl_turn(fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    for (int k = 0; srv->ng && k < 64; k++) {
        int bucket = -1;
        const char *code = "nccl_failed";
        fr_nr_event ev = fr_nccl_recv_poll(srv->ng, &bucket, &code);
        if (ev == FR_NR_NOTHING) break;
        if (ev == FR_NR_JOINED) {
            logf_(srv, "NCCL weight group of client %s is up", fr_peers_name(srv->peers, srv->ng_peer));
        } else if (ev == FR_NR_BUCKET_OK) {
            srv->upd_last_ms = fr_now_ms();
            send_update_reply(srv, srv->ng_peer, fr_nccl_recv_version(srv->ng), FR_UPD_BUCKET, bucket,
                              fr_nccl_recv_bytes(srv->ng));
        } else {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            nccl_end(srv, msg, code ? code : "nccl_failed");
        }
    }
    nccl_try_commit(srv);
#else
    (void)srv;
#endif
}

/* Whether the loop should come back soon for the group (it polls instead
 * of waiting on the socket). */
static int nccl_pending(const fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    return srv->ng && (!fr_nccl_recv_joined(srv->ng) || fr_nccl_recv_busy(srv->ng) || srv->ng_commit);
#else
    (void)srv;
    return 0;
#endif
}

static void handle_nccl_init(fr_bridge_server *srv, int peer, const fr_msg_nccl_init *n)
{
#ifndef FR_HAVE_CUDA
    (void)n;
    send_error(srv, peer, "nccl_unavailable", 0, 0,
               "nccl_group_init: this server was built without CUDA; weights travel over ZeroMQ only");
#else
    if (srv->multi) {
        send_error(srv, peer, "nccl_unavailable", 0, 0,
                   "nccl_group_init: weights over NCCL need a server of one rank (this one serves on %d ranks); "
                   "use update_weights over ZeroMQ", srv->world->size);
        return;
    }
    if (srv->sess->backend != FR_BACKEND_CUDA || !srv->sess->gpu_weights) {
        send_error(srv, peer, "nccl_unavailable", 0, 0,
                   "nccl_group_init: the %s backend has no device weights to receive into; weights over NCCL need "
                   "the cuda backend (use update_weights over ZeroMQ)", fr_backend_name(srv->sess->backend));
        return;
    }
    if (srv->ng) nccl_end(srv, "a new nccl_group_init arrived", NULL);
    if (srv->upd && srv->upd_peer == peer) drop_update(srv, "its client makes an NCCL weight group");
    if (fr_nccl_recv_new(srv->sess->gpu_weights, n->unique_id, nccl_timeout_ms(srv), &srv->ng)) {
        send_error(srv, peer, "nccl_failed", 0, 0, "%s", fr_last_error());
        return;
    }
    srv->ng_peer = peer;
    srv->ng_commit = 0;
    logf_(srv, "client %s makes an NCCL weight group: joining as rank 1 of %d", fr_peers_name(srv->peers, peer),
          FR_NCCL_RECV_NRANKS);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_JOINING, .nranks = FR_NCCL_RECV_NRANKS, .rank = 0,
                                         .timeout_s = nccl_timeout_ms(srv) * 1e-3};
    send_msg(srv, peer, &m);
#endif
}

static void handle_nccl_close(fr_bridge_server *srv, int peer)
{
#ifdef FR_HAVE_CUDA
    if (srv->ng && srv->ng_peer == peer) nccl_end(srv, "its client closed it", NULL);
#endif
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_CLOSED, .timeout_s = nccl_timeout_ms(srv) * 1e-3};
    send_msg(srv, peer, &m);
}

/* update_weights_begin with transport nccl, after the version check. */
static void handle_nccl_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
#ifndef FR_HAVE_CUDA
    srv->updates_failed++;
    send_error(srv, peer, "nccl_unavailable", 0, 0,
               "update_weights_begin to version %llu: transport nccl: this server was built without CUDA",
               (unsigned long long)b->version);
#else
    if (!srv->ng || srv->ng_peer != peer) {
        srv->updates_failed++;
        send_error(srv, peer, "nccl_unavailable", 0, 0,
                   "update_weights_begin: transport nccl: this client has no NCCL weight group (nccl_group_init "
                   "first)");
        return;
    }
    const char *code = "update_state";
    if (fr_nccl_recv_begin(srv->ng, b, &code)) {
        srv->updates_failed++;
        send_error(srv, peer, code, 0, 0, "%s", fr_last_error());
        return;
    }
    srv->upd_last_ms = srv->upd_begin_ms = fr_now_ms();
    srv->ng_commit = 0;
    logf_(srv, "weight update to version %llu over NCCL begins: %d tensors, %llu bytes, buckets of %llu bytes",
          (unsigned long long)b->version, b->n_tensors, (unsigned long long)b->total_bytes,
          (unsigned long long)b->bucket_bytes);
    send_update_reply(srv, peer, b->version, FR_UPD_BEGIN, -1, 0);
#endif
}

static void handle_nccl_bucket(fr_bridge_server *srv, int peer, const fr_msg_nccl_bucket *b)
{
#ifdef FR_HAVE_CUDA
    if (srv->ng && srv->ng_peer == peer && fr_nccl_recv_updating(srv->ng)) {
        srv->upd_last_ms = fr_now_ms();
        const char *code = "bad_bucket";
        /* The client broadcasts the bucket whatever the answer, so a refused
         * one leaves the group out of step: it ends with the update. */
        if (fr_nccl_recv_bucket(srv->ng, b, &code)) {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            nccl_end(srv, msg, code);
        }
        return;
    }
#endif
    send_error(srv, peer, "update_state", 0, 0,
               "update_weights_nccl_bucket for version %llu: no weight update over NCCL of this client is in "
               "progress", (unsigned long long)b->version);
}

/* Commit or abort of the client's NCCL update: 1 when it was one. */
static int nccl_end_message(fr_bridge_server *srv, int peer, uint64_t version, int commit)
{
#ifdef FR_HAVE_CUDA
    if (!srv->ng || srv->ng_peer != peer || !fr_nccl_recv_updating(srv->ng)) return 0;
    const char *what = commit ? "update_weights_commit" : "update_weights_abort";
    if (version != fr_nccl_recv_version(srv->ng)) {
        send_error(srv, peer, "update_state", 0, 0, "%s for version %llu: the update in progress is to version %llu",
                   what, (unsigned long long)version, (unsigned long long)fr_nccl_recv_version(srv->ng));
        return 1;
    }
    srv->upd_last_ms = fr_now_ms();
    if (commit) {
        srv->ng_commit = 1;
        srv->ng_commit_version = version;
        nccl_try_commit(srv);
        return 1;
    }
    const uint64_t bytes = fr_nccl_recv_bytes(srv->ng);
    nccl_drop_update(srv, "the client aborted it");
    send_update_reply(srv, peer, version, FR_UPD_ABORT, -1, bytes);
    return 1;
#else
    (void)srv;
    (void)peer;
    (void)version;
    (void)commit;
    return 0;
#endif
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
    fr_msg_type named = fr_msg_peek_type(w->frame0, w->len0);
    if (w->n_frames != 1 && named != FR_MSG_UPDATE_BUCKET) {
        srv->bad_messages++;
        send_error(srv, peer, "bad_message", has_id, id,
                   "message: %d frames; only update_weights_bucket carries payload frames (and no message has an "
                   "empty delimiter)",
                   w->n_frames);
        return;
    }
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
    case FR_MSG_UPDATE_BEGIN: handle_update_begin(srv, peer, &m.u.update_begin); break;
    case FR_MSG_UPDATE_BUCKET: handle_update_bucket(srv, peer, &m.u.update_bucket, w); break;
    case FR_MSG_UPDATE_COMMIT: handle_update_commit(srv, peer, m.u.update_end.version); break;
    case FR_MSG_UPDATE_ABORT: handle_update_abort(srv, peer, m.u.update_end.version); break;
    case FR_MSG_NCCL_INIT: handle_nccl_init(srv, peer, &m.u.nccl_init); break;
    case FR_MSG_NCCL_BUCKET: handle_nccl_bucket(srv, peer, &m.u.nccl_bucket); break;
    case FR_MSG_NCCL_CLOSE: handle_nccl_close(srv, peer); break;
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
        if (srv->upd && srv->upd_peer == peer) drop_update(srv, "its client disconnected");
#ifdef FR_HAVE_CUDA
        if (srv->ng && srv->ng_peer == peer) nccl_end(srv, "its client disconnected", NULL);
#endif
    }
}

/* ---- authentication --------------------------------------------------------- */

/* Receives one multipart request into up to cap frames: the number of
 * frames, or -1 when the context is ending or the socket fails. */
static int zap_recv(void *sock, zmq_msg_t *f, int cap)
{
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            if (errno == EINTR) continue;
            for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
            return -1;
        }
        more = zmq_msg_more(&part);
        if (n < cap) {
            zmq_msg_init(&f[n]);
            zmq_msg_move(&f[n++], &part);
        }
        zmq_msg_close(&part);
    }
    return n;
}

static int frame_is(zmq_msg_t *f, const char *s)
{
    size_t n = strlen(s);
    return zmq_msg_size(f) == n && memcmp(zmq_msg_data(f), s, n) == 0;
}

static void *zap_main(void *arg)
{
    zap_handler *z = arg;
    for (;;) {
        /* version, request id, domain, address, identity, mechanism, credentials */
        zmq_msg_t f[8];
        int n = zap_recv(z->sock, f, 8);
        if (n < 0) break;
        int ok = 0;
        if (n >= 7 && frame_is(&f[0], "1.0") && frame_is(&f[5], "CURVE") && zmq_msg_size(&f[6]) == 32)
            for (int k = 0; k < z->n_keys && !ok; k++) ok = memcmp(zmq_msg_data(&f[6]), z->keys[k], 32) == 0;
        if (!ok) {
            char key[41] = "none";
            if (n >= 7 && zmq_msg_size(&f[6]) == 32) zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
            fprintf(z->log, "serve: refused a client: %s key %s is not among the allowed keys\n",
                    n >= 6 && frame_is(&f[5], "CURVE") ? "CURVE" : "its", key);
            fflush(z->log);
        }
        /* reply: version, request id, status code, status text, user id, metadata */
        const char *code = ok ? "200" : "400", *text = ok ? "OK" : "client key not allowed";
        int sent = zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE) >= 0;
        if (sent && n >= 2) sent = zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE) >= 0;
        else if (sent) sent = zmq_send(z->sock, "", 0, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, code, 3, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, "", 0, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, "", 0, 0) >= 0;
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        if (!sent && errno == ETERM) break;
    }
    zmq_close(z->sock);
    z->sock = NULL;
    return NULL;
}

/* Makes the ROUTER socket a CURVE server with the listed client keys and
 * starts the ZAP handler; before the socket binds. */
static fr_status setup_curve(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    if (!zmq_has("curve"))
        return fr_fail(FR_EUNSUPPORTED, "serve: a CURVE key is configured, but this libzmq has no CURVE support");
    uint8_t secret[32];
    char pub[41];
    if (strlen(cfg->curve_secret_key) != 40 || !zmq_z85_decode(secret, cfg->curve_secret_key) ||
        zmq_curve_public(pub, cfg->curve_secret_key))
        return fr_fail(FR_EINVAL, "serve: the CURVE server secret key must be 40 Z85 characters");
    if (cfg->n_curve_client_keys < 1 || !cfg->curve_client_keys)
        return fr_fail(FR_EINVAL, "serve: a CURVE server needs at least one allowed client public key");
    zap_handler *z = &srv->zap;
    z->keys = calloc((size_t)cfg->n_curve_client_keys, sizeof *z->keys);
    if (!z->keys) return fr_fail(FR_ENOMEM, "serve: out of memory");
    for (int i = 0; i < cfg->n_curve_client_keys; i++) {
        const char *k = cfg->curve_client_keys[i];
        if (!k || strlen(k) != 40 || !zmq_z85_decode(z->keys[i], k))
            return fr_fail(FR_EINVAL, "serve: allowed client key %d is not 40 Z85 characters", i);
    }
    z->n_keys = cfg->n_curve_client_keys;
    z->log = srv->log;
    z->sock = zmq_socket(srv->zctx, ZMQ_REP);
    if (!z->sock || zmq_bind(z->sock, "inproc://zeromq.zap.01"))
        return fr_fail(FR_EIO, "serve: cannot start the ZAP handler: %s", zmq_strerror(errno));
    if (pthread_create(&z->thread, NULL, zap_main, z)) {
        zmq_close(z->sock);
        z->sock = NULL;
        return fr_fail(FR_EIO, "serve: cannot start the ZAP handler thread");
    }
    z->started = 1;
    int one = 1;
    if (zmq_setsockopt(srv->sock, ZMQ_CURVE_SERVER, &one, sizeof one) ||
        zmq_setsockopt(srv->sock, ZMQ_CURVE_SECRETKEY, cfg->curve_secret_key, 40))
        return fr_fail(FR_EIO, "serve: cannot make the socket a CURVE server: %s", zmq_strerror(errno));
    logf_(srv, "CURVE authentication on: server public key %s, %d allowed client keys", pub, z->n_keys);
    return FR_OK;
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
    srv->n_engines = 1;
    srv->tp = 1;
    srv->leader = 1;
    if (cfg->world && cfg->world->size > 1) {
        const int tp = cfg->tp > 0 ? cfg->tp : 1;
        if (cfg->world->size % tp) {
            free(srv);
            return fr_fail(FR_EINVAL, "serve: tp %d does not divide the %d ranks into engines", tp, cfg->world->size);
        }
        srv->world = cfg->world;
        srv->multi = 1;
        srv->rank = cfg->world->rank;
        srv->tp = tp;
        srv->n_engines = cfg->world->size / tp;
        srv->engine = srv->rank / tp;
        srv->leader = srv->rank % tp == 0;
        srv->agg.shadow_blocks_free = -1;
        if (srv->rank == 0 && !(srv->engine_open = calloc((size_t)srv->n_engines, sizeof(int)))) {
            free(srv);
            return fr_fail(FR_ENOMEM, "serve: out of memory");
        }
    }
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
                              .on_done = on_done, .user = srv, .on_token = on_token,
                              .kl_sample_rate = cfg->kl_sample_rate};
    fr_status st = fr_scheduler_new(s, &sc, &srv->sch);
    if (st) {
        free(srv->engine_open);
        free(srv);
        return st;
    }
    if (cfg->recal) {
        fr_recal_config rc = *cfg->recal;
        rc.log = srv->log;
        st = srv->multi ? fr_fail(FR_EUNSUPPORTED, "serve: automatic recalibration runs with one rank (mpirun -np 1 or "
                                                   "none); this job has %d",
                                  srv->world->size)
                        : fr_recal_new(&rc, &s->model->cfg, &srv->recal);
        if (st) {
            fr_scheduler_destroy(&srv->sch);
            free(srv->engine_open);
            free(srv);
            return st;
        }
        if (cfg->kl_sample_rate <= 0 && cfg->recal->kl_threshold > 0)
            logf_(srv, "warning: recalibration watches the monitored KL, and kl_sample_rate is 0: only requests "
                       "that ask for monitoring count");
    }
    if (srv->multi && srv->rank != 0) {
        /* the socket, the clients and the metrics are rank 0's */
        srv->started_ms = fr_now_ms();
        snprintf(srv->endpoint, sizeof srv->endpoint, "%s", cfg->endpoint);
        *out = srv;
        return FR_OK;
    }
    srv->zctx = zmq_ctx_new();
    srv->sock = srv->zctx ? zmq_socket(srv->zctx, ZMQ_ROUTER) : NULL;
    /* Linger: what shutdown handed to ZeroMQ still goes out when the socket
     * closes, for up to shutdown_linger_ms. */
    int one = 1, linger = cfg->shutdown_linger_ms > 0 ? cfg->shutdown_linger_ms : 0;
    if (!srv->sock || zmq_setsockopt(srv->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one) ||
        zmq_setsockopt(srv->sock, ZMQ_LINGER, &linger, sizeof linger)) {
        st = fr_fail(FR_EIO, "serve: cannot make a ZeroMQ ROUTER socket: %s", zmq_strerror(errno));
    } else if (cfg->curve_secret_key && cfg->curve_secret_key[0] && (st = setup_curve(srv, cfg))) {
        /* st says why */
    } else if (zmq_bind(srv->sock, cfg->endpoint)) {
        st = fr_fail(FR_EIO, "serve: cannot bind %s: %s", cfg->endpoint, zmq_strerror(errno));
    }
    if (!st) {
        size_t n = sizeof srv->endpoint;
        if (zmq_getsockopt(srv->sock, ZMQ_LAST_ENDPOINT, srv->endpoint, &n))
            snprintf(srv->endpoint, sizeof srv->endpoint, "%s", cfg->endpoint);
        st = fr_peers_new(srv->sock, &srv->peers);
    }
    srv->started_ms = fr_now_ms();
    if (!st && cfg->metrics_pub_endpoint && cfg->metrics_pub_endpoint[0]) {
        st = fr_metrics_pub_open(srv->zctx, cfg->metrics_pub_endpoint, cfg->curve_secret_key, &srv->pub);
        if (!st) logf_(srv, "metrics snapshots on %s (ZeroMQ PUB, topic %s, msgpack)", fr_metrics_pub_endpoint(srv->pub),
                       FR_METRICS_TOPIC);
    }
    if (!st && cfg->metrics_port != 0) {
        st = fr_metrics_http_start(cfg->metrics_bind, cfg->metrics_port < 0 ? 0 : cfg->metrics_port, &srv->metrics);
        if (!st) logf_(srv, "metrics on http://%s:%d/metrics and /dashboard", cfg->metrics_bind ? cfg->metrics_bind : "127.0.0.1",
                       fr_metrics_http_port(srv->metrics));
    }
    if (st) {
        fr_bridge_server_destroy(&srv);
        return st;
    }
    *out = srv;
    return FR_OK;
}

int fr_bridge_server_metrics_port(const fr_bridge_server *srv)
{
    return srv && srv->metrics ? fr_metrics_http_port(srv->metrics) : -1;
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

/* A snapshot for the metrics endpoint: scheduler health, divergence, the
 * token rate since the previous snapshot. */
static void publish_metrics(fr_bridge_server *srv)
{
    fr_metrics_snapshot m;
    memset(&m, 0, sizeof m);
    if (srv->multi) m.stats = srv->agg;
    else fr_scheduler_stats_get(srv->sch, &m.stats);
    m.div = *fr_scheduler_divergence(srv->sch);   /* several engines: engine 0's */
    const double now = fr_now_ms();
    if (srv->last_pub_ms > 0 && now > srv->last_pub_ms)
        m.tokens_per_s = (double)(m.stats.tokens_generated - srv->last_pub_tokens) / ((now - srv->last_pub_ms) * 1e-3);
    srv->last_pub_ms = now;
    srv->last_pub_tokens = m.stats.tokens_generated;
    m.weight_sync_seconds = srv->last_sync_s;
    m.uptime_s = (now - srv->started_ms) * 1e-3;
    m.requests_total = (long long)srv->requests_accepted;
    if (srv->recal) {
        fr_recal_stats rs;
        fr_recal_stats_get(srv->recal, &rs);
        m.recalibrations = rs.recalibrations;
        m.recalibration_failures = rs.failures;
        m.last_recalibration_version = rs.last_version;
        m.last_recalibration_seconds = rs.last_seconds;
        m.last_recalibration_kl = rs.last_kl;
    }
    snprintf(m.model, sizeof m.model, "%s", srv->cfg.model_name ? srv->cfg.model_name : "");
    snprintf(m.kv_dtype, sizeof m.kv_dtype, "%s", fr_kv_dtype_name(fr_kv_cache_config_of(srv->sess->kv)->dtype));
    if (srv->metrics) fr_metrics_http_publish(srv->metrics, &m);
    if (srv->pub && fr_metrics_pub_send(srv->pub, &m) && !srv->pub_failed) {
        srv->pub_failed = 1;
        logf_(srv, "warning: %s (further failures are not logged)", fr_last_error());
    }
}

static int publishes(const fr_bridge_server *srv) { return srv->metrics || srv->pub; }

/* ---- several ranks -------------------------------------------------------- */

/* MPI itself failed on this rank: the ranks can no longer agree, so the
 * whole job ends (non-zero) rather than wait on each other. */
static void comm_fatal(fr_bridge_server *srv, const char *what)
{
    logf_(srv, "rank %d: %s failed: %s; ending every rank", srv->rank, what, fr_comm_last_error());
    fr_mpi_world_abort(srv->world, 1);
}

/* Rank 0's events of this turn reach every rank (into srv->events). */
static void share_events(fr_bridge_server *srv)
{
    uint64_t len = srv->rank == 0 ? (uint64_t)srv->events.len : 0;
    if (fr_mpi_world_bcast(srv->world, &len, sizeof len, 0)) comm_fatal(srv, "broadcasting the events");
    if (srv->rank != 0) {
        fr_rank_buf_clear(&srv->events);
        if (len > SIZE_MAX / 2 || fr_buf_reserve(&srv->events, (size_t)len)) {
            logf_(srv, "rank %d: out of memory receiving %llu bytes of events", srv->rank, (unsigned long long)len);
            fr_mpi_world_abort(srv->world, 1);
            return;
        }
        srv->events.len = (size_t)len;
    }
    if (len && fr_mpi_world_bcast(srv->world, srv->events.data, (size_t)len, 0)) comm_fatal(srv, "broadcasting the events");
}

/* A generate for engine `engine`: its ranks submit it; a refusal (which
 * check_spec makes rare) goes back to rank 0 from the leader. */
static fr_status apply_submit(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_request_spec spec;
    memset(&spec, 0, sizeof spec);
    int engine = fr_rank_get_i32(r), oom[3] = {0, 0, 0}, has_forced;
    spec.id = fr_rank_get_u64(r);
    spec.group = fr_rank_get_u64(r);
    int *prompt = fr_rank_get_i32s(r, &spec.n_prompt, &oom[0]);
    spec.n = fr_rank_get_i32(r);
    spec.params.temperature = fr_rank_get_f32(r);
    spec.params.top_k = fr_rank_get_i32(r);
    spec.params.top_p = fr_rank_get_f32(r);
    spec.params.seed = fr_rank_get_u64(r);
    spec.max_tokens = fr_rank_get_i32(r);
    int *stop = fr_rank_get_i32s(r, &spec.n_stop, &oom[1]);
    spec.monitor = fr_rank_get_i32(r);
    spec.per_token_kl = fr_rank_get_i32(r);
    has_forced = fr_rank_get_i32(r);
    int *forced = has_forced ? fr_rank_get_i32s(r, &spec.n_forced, &oom[2]) : NULL;
    spec.prompt = prompt;
    spec.stop_ids = stop;
    spec.forced = forced;
    fr_status st = FR_OK;
    if (r->bad) {
        /* the caller reports the malformed stream */
    } else if (oom[0] || oom[1] || oom[2]) {
        st = fr_fail(FR_ENOMEM, "serve: rank %d: out of memory taking request %llu", srv->rank,
                     (unsigned long long)spec.id);
    } else if (engine == srv->engine && fr_scheduler_submit(srv->sch, &spec) && srv->leader) {
        const char *msg = fr_last_error();
        fr_rank_put_u8(&srv->outbox, OB_REJECT);
        fr_rank_put_u64(&srv->outbox, spec.id);
        fr_rank_put_bytes(&srv->outbox, msg, strlen(msg));
    }
    free(prompt);
    free(stop);
    free(forced);
    return st;
}

/* A bucket rank 0 checked: the other ranks stage its pieces. */
static void apply_bucket(fr_bridge_server *srv, fr_rank_reader *r)
{
    int n = fr_rank_get_i32(r);
    for (int i = 0; i < n && !r->bad; i++) {
        size_t name_len, n_bytes;
        const char *name = fr_rank_get_bytes(r, &name_len);
        int dtype = fr_rank_get_i32(r), ndim = fr_rank_get_i32(r);
        if (r->bad || name_len >= FR_PROTO_NAME_MAX || ndim < 1 || ndim > FR_PROTO_MAX_NDIM) {
            r->bad = 1;
            return;
        }
        int64_t shape[FR_PROTO_MAX_NDIM];
        for (int k = 0; k < ndim; k++) shape[k] = (int64_t)fr_rank_get_u64(r);
        uint64_t offset = fr_rank_get_u64(r);
        const void *bytes = fr_rank_get_bytes(r, &n_bytes);
        if (r->bad) return;
        if (srv->rank == 0 || !srv->wupd || srv->stage_failed) continue;
        char tname[FR_PROTO_NAME_MAX];
        memcpy(tname, name, name_len);
        tname[name_len] = 0;
        if (fr_weight_update_put(srv->wupd, tname, (fr_dtype)dtype, shape, ndim, offset, bytes, n_bytes)) {
            logf_(srv, "rank %d: staging the weight update failed: %s", srv->rank, fr_last_error());
            srv->stage_failed = 1;
        }
    }
}

/* update_weights_commit on every rank: first all agree that each holds the
 * whole update, then all switch and agree that each did. When a rank
 * cannot stage it, every rank drops it and the old version keeps serving;
 * a switch that failed on some ranks only ends the job (srv->fatal). */
static void commit_on_ranks(fr_bridge_server *srv, uint64_t version)
{
    const char *code;
    int ok;
    if (srv->rank == 0) {
        ok = srv->upd && fr_bridge_update_version(srv->upd) == version && !fr_bridge_update_ready(srv->upd, &code);
    } else {
        ok = srv->wupd && !srv->stage_failed && fr_weight_update_version(srv->wupd) == version &&
             !fr_weight_update_complete(srv->wupd);
        if (!ok) logf_(srv, "rank %d: cannot commit weight version %llu: %s", srv->rank, (unsigned long long)version,
                       srv->wupd && !srv->stage_failed ? fr_last_error() : "it was not staged whole");
    }
    int all = 0;
    if (fr_mpi_world_all_ok(srv->world, ok, &all)) comm_fatal(srv, "agreeing on a weight update");
    if (!all) {
        if (srv->rank == 0) {
            fr_fail(FR_EIO, "update to version %llu: not every rank could stage it (their logs say why); version "
                    "%llu keeps serving", (unsigned long long)version, (unsigned long long)srv->weight_version);
            fail_update(srv, srv->upd_peer, "update_failed");
        }
        fr_weight_update_free(&srv->wupd);
        return;
    }
    double t0 = fr_now_ms();
    fr_status st =
        fr_session_commit_weights_move(srv->sess, srv->rank == 0 ? fr_bridge_update_staged(srv->upd) : srv->wupd);
    if (st) logf_(srv, "rank %d: switching to weight version %llu failed: %s", srv->rank, (unsigned long long)version,
                  fr_last_error());
    if (fr_mpi_world_all_ok(srv->world, st == FR_OK, &all)) comm_fatal(srv, "agreeing on a weight update");
    if (!all) {
        srv->fatal = fr_fail(FR_EIO, "serve: weight version %llu was switched in on some ranks only; the engines no "
                                     "longer agree on their weights, so every rank stops",
                             (unsigned long long)version);
        logf_(srv, "rank %d: %s", srv->rank, fr_last_error());
        if (srv->rank == 0) fail_update(srv, srv->upd_peer, "update_failed");
        fr_weight_update_free(&srv->wupd);
        return;
    }
    if (srv->rank == 0) {
        committed(srv, version, t0);
    } else {
        srv->weight_version = version;
        fr_scheduler_set_weight_version(srv->sch, version);
        keep_spare(srv, srv->wupd);
        srv->wupd = NULL;
    }
}

/* Every rank applies this turn's events to its scheduler, in order. A
 * local failure (out of memory) does not stop the rest, so every rank
 * reaches the same collectives; the turn's vote then ends the loop. */
static fr_status apply_events(fr_bridge_server *srv)
{
    fr_rank_reader r = {(const unsigned char *)srv->events.data, srv->events.len, 0, 0};
    fr_status first = FR_OK;
    while (fr_rank_more(&r)) {
        fr_status st = FR_OK;
        switch (fr_rank_get_u8(&r)) {
        case EV_SUBMIT: st = apply_submit(srv, &r); break;
        case EV_ABORT: {
            int e = fr_rank_get_i32(&r);
            uint64_t sid = fr_rank_get_u64(&r);
            if (!r.bad && e == srv->engine && fr_scheduler_abort(srv->sch, sid, NULL))
                logf_(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
            break;
        }
        case EV_ABORT_ALL:
            if (fr_scheduler_abort_all(srv->sch, NULL)) logf_(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
            break;
        case EV_UPD_BEGIN: {
            uint64_t v = fr_rank_get_u64(&r);
            if (r.bad || srv->rank == 0) break;
            keep_spare(srv, srv->wupd);
            srv->wupd = srv->spare;
            srv->spare = NULL;
            srv->stage_failed = 0;
            if (srv->wupd ? fr_weight_update_restart(srv->wupd, v) : fr_weight_update_begin(&srv->sess->model->cfg, v, &srv->wupd)) {
                logf_(srv, "rank %d: cannot stage weight version %llu: %s", srv->rank, (unsigned long long)v,
                      fr_last_error());
                srv->stage_failed = 1;
            }
            break;
        }
        case EV_UPD_BUCKET: apply_bucket(srv, &r); break;
        case EV_UPD_DROP:
            if (srv->rank != 0) {
                keep_spare(srv, srv->wupd);
                srv->wupd = NULL;
            }
            srv->stage_failed = 0;
            break;
        case EV_UPD_COMMIT: {
            uint64_t v = fr_rank_get_u64(&r);
            if (!r.bad) commit_on_ranks(srv, v);
            break;
        }
        default: r.bad = 1; break;
        }
        if (st && !first) first = st;
    }
    if (r.bad) {
        /* every rank received the same bytes, so every rank stops here alike */
        return fr_fail(FR_EIO, "serve: rank %d received a malformed engine event", srv->rank);
    }
    return first;
}

static void put_stats(fr_bridge_server *srv)
{
    fr_scheduler_stats ss;
    fr_scheduler_stats_get(srv->sch, &ss);
    fr_rank_buf *b = &srv->outbox;
    fr_rank_put_u8(b, OB_STATS);
    fr_rank_put_i32(b, ss.running);
    fr_rank_put_i32(b, ss.prefilling);
    fr_rank_put_i32(b, ss.waiting);
    fr_rank_put_u64(b, (uint64_t)ss.preemptions);
    fr_rank_put_u64(b, (uint64_t)ss.tokens_generated);
    fr_rank_put_u64(b, (uint64_t)ss.prefill_tokens);
    fr_rank_put_u64(b, (uint64_t)ss.steps);
    fr_rank_put_u64(b, (uint64_t)ss.finished);
    fr_rank_put_i32(b, ss.kv_blocks_used);
    fr_rank_put_i32(b, ss.kv_blocks_free);
    fr_rank_put_u64(b, ss.weight_version);
    fr_rank_put_i32(b, ss.monitored);
    fr_rank_put_i32(b, ss.shadow_blocks_free);
}

static void take_stats(fr_bridge_server *srv, fr_rank_reader *r, int first)
{
    fr_scheduler_stats s;
    s.running = fr_rank_get_i32(r);
    s.prefilling = fr_rank_get_i32(r);
    s.waiting = fr_rank_get_i32(r);
    s.preemptions = (long long)fr_rank_get_u64(r);
    s.tokens_generated = (long long)fr_rank_get_u64(r);
    s.prefill_tokens = (long long)fr_rank_get_u64(r);
    s.steps = (long long)fr_rank_get_u64(r);
    s.finished = (long long)fr_rank_get_u64(r);
    s.kv_blocks_used = fr_rank_get_i32(r);
    s.kv_blocks_free = fr_rank_get_i32(r);
    s.weight_version = fr_rank_get_u64(r);
    s.monitored = fr_rank_get_i32(r);
    s.shadow_blocks_free = fr_rank_get_i32(r);
    fr_scheduler_stats *a = &srv->agg;
    if (first) {
        *a = s;
        return;
    }
    a->running += s.running;
    a->prefilling += s.prefilling;
    a->waiting += s.waiting;
    a->preemptions += s.preemptions;
    a->tokens_generated += s.tokens_generated;
    a->prefill_tokens += s.prefill_tokens;
    a->steps += s.steps;
    a->finished += s.finished;
    a->kv_blocks_used += s.kv_blocks_used;
    a->kv_blocks_free += s.kv_blocks_free;
    a->monitored += s.monitored;
    if (s.shadow_blocks_free >= 0) a->shadow_blocks_free = (a->shadow_blocks_free > 0 ? a->shadow_blocks_free : 0) +
                                                           s.shadow_blocks_free;
}

/* A sample's end from an engine (rank 0). */
static void take_done(fr_bridge_server *srv, fr_rank_reader *r)
{
    uint64_t sid = fr_rank_get_u64(r);
    int sample = fr_rank_get_i32(r), finish = fr_rank_get_i32(r), n_tokens = fr_rank_get_i32(r),
        preemptions = fr_rank_get_i32(r);
    fr_msg_divergence div;
    memset(&div, 0, sizeof div);
    div.has_values = (int)fr_rank_get_u8(r);
    div.kl_mean = fr_rank_get_f64(r);
    div.kl_max = fr_rank_get_f64(r);
    div.top1_agreement = fr_rank_get_f64(r);
    div.logprob_diff_mean = fr_rank_get_f64(r);
    div.positions = fr_rank_get_i32(r);
    int n_kl = fr_rank_get_i32(r);
    if (r->bad || n_kl < 0 || (size_t)n_kl > (r->len - r->pos) / sizeof(float)) {
        r->bad = 1;
        return;
    }
    float *kl = n_kl > 0 ? malloc(sizeof(float) * (size_t)n_kl) : NULL;
    for (int i = 0; i < n_kl; i++) {
        float v = fr_rank_get_f32(r);
        if (kl) kl[i] = v;
    }
    if (kl) {
        div.kl = kl;
        div.n_kl = n_kl;
    } else if (n_kl > 0) {
        logf_(srv, "out of memory keeping the per-token KL of request %llu", (unsigned long long)sid);
    }
    request *q = find_sid(srv, sid);
    if (!q || sample < 0 || sample >= q->n) {
        logf_(srv, "an engine ended an unknown sample (%llu, %d)", (unsigned long long)sid, sample);
    } else {
        srv->engine_open[q->engine]--;
        send_done(srv, q, sample, (fr_wire_finish)finish, n_tokens, preemptions, &div);
    }
    free(kl);
}

/* A generate its engine refused (rank 0): the client gets the error. */
static void take_reject(fr_bridge_server *srv, fr_rank_reader *r)
{
    uint64_t sid = fr_rank_get_u64(r);
    size_t n;
    const char *text = fr_rank_get_bytes(r, &n);
    if (r->bad) return;
    char msg[FR_PROTO_TEXT_MAX - 64];
    snprintf(msg, sizeof msg, "%.*s", (int)(n < sizeof msg ? n : sizeof msg - 1), text);
    request *q = find_sid(srv, sid);
    if (!q) {
        logf_(srv, "an engine refused an unknown request (%llu): %s", (unsigned long long)sid, msg);
        return;
    }
    srv->engine_open[q->engine] -= q->open;
    int peer = q->peer;
    uint64_t id = q->request_id;
    if (q->from_held) {
        abort_held(srv, q);
        send_error(srv, peer, "invalid_request", 1, id, "held request could not start: %s", msg);
    } else {
        remove_request(srv, q);
        srv->requests_accepted--;
        srv->requests_rejected++;
        send_error(srv, peer, "invalid_request", 1, id, "%s", msg);
    }
}

/* The engine leaders' records of this turn reach rank 0, which streams
 * them to the clients. FR_ENOMEM when this rank lost records. */
static fr_status exchange_results(fr_bridge_server *srv)
{
    fr_status st = FR_OK;
    if (srv->leader) put_stats(srv);
    if (srv->outbox.failed) st = fr_fail(FR_ENOMEM, "serve: rank %d: out of memory keeping the engine's results", srv->rank);
    void *all = NULL;
    size_t n = 0;
    if (fr_mpi_world_gather_bytes(srv->world, srv->outbox.data, st ? 0 : srv->outbox.len, 0, &all, &n, NULL))
        comm_fatal(srv, "gathering the engines' results");
    fr_rank_buf_clear(&srv->outbox);
    if (srv->rank != 0) return st;
    fr_rank_reader r = {all, n, 0, 0};
    int first_stats = 1;
    while (fr_rank_more(&r)) {
        switch (fr_rank_get_u8(&r)) {
        case OB_TOKEN: {
            uint64_t sid = fr_rank_get_u64(&r);
            int sample = fr_rank_get_i32(&r), index = fr_rank_get_i32(&r), token = fr_rank_get_i32(&r);
            float lp = fr_rank_get_f32(&r);
            uint64_t v = fr_rank_get_u64(&r);
            if (!r.bad) token_in(srv, sid, sample, index, token, lp, v);
            break;
        }
        case OB_DONE: take_done(srv, &r); break;
        case OB_REJECT: take_reject(srv, &r); break;
        case OB_STATS:
            take_stats(srv, &r, first_stats);
            first_stats = 0;
            break;
        default: r.bad = 1; break;
        }
    }
    free(all);
    if (r.bad && !st) st = fr_fail(FR_EIO, "serve: the engines' results arrived malformed");
    return st;
}

/* Handles every message waiting on the socket, up to a bound so the engine
 * keeps stepping under a flood of messages; with at_barrier, also stops at
 * a message that must end the ranks' turn (srv->turn_barrier). */
static fr_status handle_waiting(fr_bridge_server *srv, const volatile sig_atomic_t *stop, int at_barrier)
{
    for (int k = 0; k < 1024 && !*stop && !(at_barrier && srv->turn_barrier); k++) {
        fr_wire_msg w;
        int got;
        if (fr_wire_recv(srv->sock, 1, 0, &w, &got)) return FR_EIO;
        if (!got) break;
        handle_message(srv, &w);
        fr_wire_msg_free(&w);
    }
    return FR_OK;
}

/* Rank 0: reads what the clients sent (waiting when the engines are idle)
 * into this turn's events. */
static fr_status drain_messages(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    long wait = !eng_idle(srv) ? 0 : ps.queued ? 2 : 100;
    zmq_pollitem_t it = {.socket = srv->sock, .events = ZMQ_POLLIN};
    if (zmq_poll(&it, 1, wait) < 0) {
        if (errno == EINTR) return FR_OK;
        return fr_fail(FR_EIO, "serve: poll failed: %s", zmq_strerror(errno));
    }
    srv->turn_barrier = 0;
    fr_status st = handle_waiting(srv, stop, 1);
    if (!st && srv->events.failed) st = fr_fail(FR_ENOMEM, "serve: out of memory recording the engine events");
    return st;
}

/* Rank 0 after a turn's results went out. */
static fr_status after_turn(fr_bridge_server *srv)
{
    flush_all(srv);
    if (srv->state == PAUSING && eng_idle(srv)) {
        srv->state = PAUSED;
        reply_waiters(srv);
    }
    send_deferred(srv);
    int gone = 0;
    if (fr_peers_pump(srv->peers, &gone)) return FR_EIO;
    if (gone) drop_gone_peers(srv);
    if (publishes(srv) && fr_now_ms() - srv->last_pub_ms >= 200.0) publish_metrics(srv);
    if (srv->upd && srv->cfg.update_idle_ms > 0 && fr_now_ms() - srv->upd_last_ms > srv->cfg.update_idle_ms) {
        char why[96];
        snprintf(why, sizeof why, "nothing arrived for it in %d ms", srv->cfg.update_idle_ms);
        drop_update(srv, why);
    }
    return FR_OK;
}

/* Every rank, turn by turn: rank 0 reads messages into events; every rank
 * applies them; all vote to go on; every engine steps; the leaders' results
 * go to rank 0, which streams them. */
static fr_status run_ranks(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    fr_status failure = FR_OK;
    char why[FR_PROTO_TEXT_MAX] = "";
#define NOTE_FAILURE(s)                                                    \
    do {                                                                   \
        fr_status s_ = (s);                                                \
        if (s_ && !failure) {                                              \
            failure = s_;                                                  \
            snprintf(why, sizeof why, "%s", fr_last_error());              \
        }                                                                  \
    } while (0)
    if (srv->rank == 0) {
        logf_(srv, "listening on %s (protocol version %d; %d engine(s) of tp %d on %d ranks)", srv->endpoint,
              FR_PROTO_VERSION, srv->n_engines, srv->tp, srv->world->size);
        if (publishes(srv)) publish_metrics(srv);
    }
    for (;;) {
        if (srv->rank == 0 && !failure && !*stop) NOTE_FAILURE(drain_messages(srv, stop));
        if (srv->rank == 0 && failure) fr_rank_buf_clear(&srv->events);
        share_events(srv);
        NOTE_FAILURE(apply_events(srv));
        NOTE_FAILURE(srv->fatal);
        fr_rank_buf_clear(&srv->events);
        int all = 0;
        if (fr_mpi_world_all_ok(srv->world, !failure && !*stop, &all)) comm_fatal(srv, "the turn's vote");
        if (!all) break;
        if (!fr_scheduler_idle(srv->sch) && fr_scheduler_step(srv->sch)) {
            /* with tp > 1 the engine's ranks may now disagree: stop */
            if (srv->tp > 1) NOTE_FAILURE(fr_fail(FR_EIO, "serve: rank %d: engine step failed: %s", srv->rank,
                                                  fr_last_error()));
            else logf_(srv, "rank %d: engine step failed (its samples end with reason error): %s", srv->rank,
                       fr_last_error());
        }
        NOTE_FAILURE(exchange_results(srv));
        if (srv->rank == 0) NOTE_FAILURE(after_turn(srv));
    }
    /* Shutdown: every engine ends its samples; rank 0 sends their dones. */
    int ended = srv->rank == 0 ? engine_samples(srv) : 0;
    if (fr_scheduler_abort_all(srv->sch, NULL)) logf_(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
    NOTE_FAILURE(exchange_results(srv));
    int all = 0;
    if (fr_mpi_world_all_ok(srv->world, !failure, &all)) comm_fatal(srv, "the shutdown vote");
    if (srv->rank == 0) {
        ended += abort_everything(srv);
        send_deferred(srv);
        fail_waiters(srv, "shutdown", "the server is shutting down");
        logf_(srv, "shutting down: %d open samples ended with reason abort", ended);
        fr_peers_flush(srv->peers, srv->cfg.shutdown_linger_ms > 0 ? srv->cfg.shutdown_linger_ms : 0);
        fr_peers_stats ps;
        fr_peers_stats_get(srv->peers, &ps);
        if (ps.queued)
            logf_(srv, "%llu messages could not be delivered before shutdown", (unsigned long long)ps.queued);
    }
#undef NOTE_FAILURE
    if (failure) return fr_fail(failure, "%s", why[0] ? why : "serve: this rank failed");
    if (!all) return fr_fail(FR_EIO, "serve: rank %d stops because another rank failed (its log says why)", srv->rank);
    return FR_OK;
}

fr_status fr_bridge_server_run(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    if (!srv || !stop) return fr_fail(FR_EINVAL, "serve: server and stop flag are required");
    if (srv->multi) return run_ranks(srv, stop);
    fr_status failure = FR_OK;
    logf_(srv, "listening on %s (protocol version %d)", srv->endpoint, FR_PROTO_VERSION);
    if (publishes(srv)) publish_metrics(srv);
    while (!*stop) {
        fr_peers_stats ps;
        fr_peers_stats_get(srv->peers, &ps);
        int work = !fr_scheduler_idle(srv->sch);
        long wait = work ? 0 : ps.queued || nccl_pending(srv) ? 1 : 100;
        zmq_pollitem_t it = {.socket = srv->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, wait) < 0) {
            if (errno == EINTR) continue;
            failure = fr_fail(FR_EIO, "serve: poll failed: %s", zmq_strerror(errno));
            break;
        }
        if ((failure = handle_waiting(srv, stop, 0))) break;
        nccl_turn(srv);
        if (!fr_scheduler_idle(srv->sch)) {
            if (fr_scheduler_step(srv->sch))
                logf_(srv, "engine step failed (its samples end with reason error): %s", fr_last_error());
        }
        flush_all(srv);
        /* not while weights are being staged or the trainer has paused the engine */
        fr_status rst = FR_OK;
        if (srv->recal && !srv->upd && !nccl_updating(srv) && srv->state == RUNNING &&
            (rst = fr_recal_check(srv->recal, srv->sess, srv->sch, srv->weight_version, NULL))) {
            failure = rst;
            logf_(srv, "recalibration left the engine unusable: %s", fr_last_error());
            break;
        }
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
        if (publishes(srv) && fr_now_ms() - srv->last_pub_ms >= 200.0) publish_metrics(srv);
        if (srv->upd && srv->cfg.update_idle_ms > 0 && fr_now_ms() - srv->upd_last_ms > srv->cfg.update_idle_ms) {
            char why[96];
            snprintf(why, sizeof why, "nothing arrived for it in %d ms", srv->cfg.update_idle_ms);
            drop_update(srv, why);
        }
        if (nccl_updating(srv) && srv->cfg.update_idle_ms > 0 && fr_now_ms() - srv->upd_last_ms > srv->cfg.update_idle_ms) {
            char why[96];
            snprintf(why, sizeof why, "nothing arrived for it in %d ms", srv->cfg.update_idle_ms);
            nccl_drop_update(srv, why);
        }
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
    fr_metrics_http_stop(&srv->metrics);   /* its thread reads only published snapshots */
    fr_metrics_pub_close(&srv->pub);
    fr_recal_destroy(&srv->recal);
    if (srv->sch && srv->peers) abort_everything(srv);
    fr_scheduler_destroy(&srv->sch);   /* nothing open is left; any result would find no request */
    fr_bridge_update_free(&srv->upd);
#ifdef FR_HAVE_CUDA
    fr_nccl_recv_destroy(&srv->ng);
#endif
    for (int i = 0; i < srv->n_reqs; i++) free_request(srv->reqs[i]);
    free(srv->reqs);
    free(srv->waiters);
    fr_peers_destroy(&srv->peers);
    if (srv->sock) zmq_close(srv->sock);
    if (srv->zap.started) {
        zmq_ctx_shutdown(srv->zctx);   /* the handler's receive fails with ETERM: it closes its socket and ends */
        pthread_join(srv->zap.thread, NULL);
    } else if (srv->zap.sock) {
        zmq_close(srv->zap.sock);
    }
    free(srv->zap.keys);
    if (srv->zctx) zmq_ctx_term(srv->zctx);
    for (int i = 0; i < srv->n_deferred; i++) free(srv->deferred[i].data);
    free(srv->deferred);
    fr_weight_update_free(&srv->wupd);
    fr_weight_update_free(&srv->spare);
    fr_rank_buf_free(&srv->events);
    fr_rank_buf_free(&srv->outbox);
    free(srv->engine_open);
    free(srv);
    *pp = NULL;
}
