/* The coordinator (trainer_bridge/server/server.h, docs/protocol.md): one
 * engine in one process, or engines over the ranks of an MPI job
 * (docs/protocol.md, "Serving on several ranks"). This file holds message
 * dispatch and the lifecycle; each concern has a file of its own
 * (server_internal.h lists them). */
#include "trainer_bridge/server/server_internal.h"

#include "base/log.h"

void srv_log(fr_bridge_server *srv, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (srv->log == stderr) {   /* the program's log: timestamped and leveled (base/log.h) */
        char msg[1024];
        vsnprintf(msg, sizeof msg, fmt, ap);
        int warning = strncmp(msg, "warning: ", 9) == 0;
        fr_log_msg(warning ? FR_LOG_WARN : FR_LOG_INFO, "serve: %s", warning ? msg + 9 : msg);
    } else {
        fprintf(srv->log, "serve: ");
        vfprintf(srv->log, fmt, ap);
        fprintf(srv->log, "\n");
        fflush(srv->log);
    }
    va_end(ap);
}

/* Messages only a trainer may send (docs/protocol.md, "Roles"): they change
 * the weights or stop everyone's samples. */
static int needs_trainer(fr_msg_type t)
{
    switch (t) {
    case FR_MSG_PAUSE:
    case FR_MSG_RESUME:
    case FR_MSG_UPDATE_BEGIN:
    case FR_MSG_UPDATE_BUCKET:
    case FR_MSG_UPDATE_COMMIT:
    case FR_MSG_UPDATE_ABORT:
    case FR_MSG_NCCL_INIT:
    case FR_MSG_NCCL_BUCKET:
    case FR_MSG_NCCL_CLOSE: return 1;
    default: return 0;
    }
}

int fr_bridge_endpoint_is_loopback(const char *ep)
{
    static const char *const local[] = {"tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://", "inproc://"};
    for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
        if (strncmp(ep, local[i], strlen(local[i])) == 0) return 1;
    return 0;
}

/* The serving summary: one line every stats_log_ms, so an operator sees the
 * service at work without asking for stats, and at shutdown (final) one
 * for the whole run. Several ranks: rank 0 logs every engine's sum (the
 * figures its leaders send each turn). */
void srv_log_stats(fr_bridge_server *srv, int final)
{
    int every = srv->cfg.stats_log_ms ? srv->cfg.stats_log_ms : 10000;
    double now = fr_now_ms();
    if (every < 0 || (!final && now - srv->last_stats_ms < every) || now <= srv->last_stats_ms) return;
    fr_scheduler_stats ss;
    if (srv->multi) ss = srv->agg;
    else fr_scheduler_stats_get(srv->sch, &ss);
    if (final) {
        double secs = (now - srv->started_ms) / 1000.0;
        srv_log(srv, "served %lld tokens in %.1f s (%.1f tokens/s), %lld preemptions, weight version %llu",
                ss.tokens_generated, secs, secs > 0 ? (double)ss.tokens_generated / secs : 0.0, ss.preemptions,
                (unsigned long long)ss.weight_version);
        return;
    }
    int pages = ss.kv_blocks_used + ss.kv_blocks_free;
    double secs = (now - srv->last_stats_ms) / 1000.0;
    srv_log(srv, "%.1f tokens/s, %d running, %d waiting, KV %.1f%% used (%d of %d pages), weight version %llu",
            (double)(ss.tokens_generated - srv->last_stats_tokens) / secs, ss.running, ss.waiting,
            pages ? 100.0 * ss.kv_blocks_used / pages : 0.0, ss.kv_blocks_used, pages,
            (unsigned long long)ss.weight_version);
    srv->last_stats_ms = now;
    srv->last_stats_tokens = ss.tokens_generated;
}

/* One message from the socket. */
void srv_handle_message(fr_bridge_server *srv, fr_wire_msg *w)
{
    srv->messages_in++;
    int peer;
    if (w->peer_len == 0 || fr_peers_find_or_add(srv->peers, w->peer, w->peer_len, &peer)) {
        srv->bad_messages++;
        srv_log(srv, "dropped a message without a usable routing id");
        return;
    }
    srv_conn_arrived(srv, peer, w->fd);
    /* before anything unpacks it: the decoder allocates per declared entry */
    if (w->frame0 && fr_msg_check_bounds(w->frame0, w->len0, srv->max_array)) {
        srv->bad_messages++;
        srv_send_error(srv, peer, "bad_message", 0, 0, "%s", fr_last_error());
        srv_conn_refused(w->len0);
        return;
    }
    uint64_t id = 0;
    int has_id = w->frame0 ? fr_msg_peek_request_id(w->frame0, w->len0, &id) : 0;
    fr_msg_type named = fr_msg_peek_type(w->frame0, w->len0);
    if (w->n_frames != 1 && named != FR_MSG_UPDATE_BUCKET) {
        srv->bad_messages++;
        srv_send_error(srv, peer, "bad_message", has_id, id,
                   "message: %d frames; only update_weights_bucket carries payload frames (and no message has an "
                   "empty delimiter)",
                   w->n_frames);
        return;
    }
    if (named != FR_MSG_NONE && !fr_msg_type_from_client(named)) {
        srv->bad_messages++;
        srv_send_error(srv, peer, "bad_message", has_id, id, "message: \"%s\" is a message the server sends",
                   fr_msg_type_name(named));
        return;
    }
    fr_msg m;
    fr_status st = fr_msg_decode(w->frame0, w->len0, &m);
    if (st) {
        srv->bad_messages++;
        srv_send_error(srv, peer, st == FR_EUNSUPPORTED ? "unsupported_version" : "bad_message", has_id, id, "%s",
                   fr_last_error());
        srv_conn_refused(w->len0);
        return;
    }
    if (!fr_msg_type_from_client(m.type)) {
        srv->bad_messages++;
        srv_send_error(srv, peer, "bad_message", has_id, id, "message: \"%s\" is a message the server sends",
                   fr_msg_type_name(m.type));
        fr_msg_free(&m);
        return;
    }
    if (srv->roles && needs_trainer(m.type) && strcmp(w->user_id, "trainer") != 0) {
        srv->forbidden++;
        srv_send_error(srv, peer, "forbidden", has_id, id,
                       "%s needs the trainer role; this client's key has the rollout-client role (docs/protocol.md, "
                       "\"Roles\")",
                       fr_msg_type_name(m.type));
        fr_msg_free(&m);
        return;
    }
    switch (m.type) {
    case FR_MSG_HELLO: srv_handle_hello(srv, peer); break;
    case FR_MSG_GENERATE: srv_handle_generate(srv, peer, &m.u.generate); break;
    case FR_MSG_ABORT: srv_handle_abort(srv, peer, &m.u.abort); break;
    case FR_MSG_PAUSE: srv_handle_pause(srv, peer, &m.u.pause); break;
    case FR_MSG_RESUME: srv_handle_resume(srv, peer, &m.u.resume); break;
    case FR_MSG_STATS: srv_handle_stats(srv, peer); break;
    case FR_MSG_UPDATE_BEGIN: srv_handle_update_begin(srv, peer, &m.u.update_begin); break;
    case FR_MSG_UPDATE_BUCKET: srv_handle_update_bucket(srv, peer, &m.u.update_bucket, w); break;
    case FR_MSG_UPDATE_COMMIT: srv_handle_update_commit(srv, peer, m.u.update_end.version); break;
    case FR_MSG_UPDATE_ABORT: srv_handle_update_abort(srv, peer, m.u.update_end.version); break;
    case FR_MSG_NCCL_INIT: srv_handle_nccl_init(srv, peer, &m.u.nccl_init); break;
    case FR_MSG_NCCL_BUCKET: srv_handle_nccl_bucket(srv, peer, &m.u.nccl_bucket); break;
    case FR_MSG_NCCL_CLOSE: srv_handle_nccl_close(srv, peer); break;
    default: break;
    }
    fr_msg_free(&m);
}

/* A client ZeroMQ no longer knows: its open requests end (their done
 * messages are counted undeliverable) and it stops waiting for a pause. */
void srv_drop_gone_peers(fr_bridge_server *srv)
{
    int peer;
    while (fr_peers_take_gone(srv->peers, &peer)) {
        int n, ended = 0;
        uint64_t *sids = srv_sids_of(srv, peer, &n);
        for (int i = 0; sids && i < n; i++) ended += srv_abort_sid(srv, sids[i]);
        free(sids);
        int waited = 0;
        for (int i = 0; i < srv->n_waiters;)
            if (srv->waiters[i] == peer) {
                waited = 1;
                memmove(&srv->waiters[i], &srv->waiters[i + 1], sizeof(int) * (size_t)(srv->n_waiters - i - 1));
                srv->n_waiters--;
            } else i++;
        srv->clients_departed++;
        int had_update = srv->upd && srv->upd_peer == peer;
        /* one line for a client that left something behind; a client that
         * had nothing open (a stats query, say) leaves only the count */
        if (ended > 0 || waited || had_update)
            srv_log(srv, "client %s disconnected: its messages are undeliverable, %d open samples aborted%s",
                    fr_peers_name(srv->peers, peer), ended, had_update ? ", its weight update dropped" : "");
        if (had_update) srv_drop_update(srv, "its client disconnected");
        if (srv->ng && srv->ng_peer == peer) srv_nccl_end(srv, "its client disconnected", NULL);
    }
}

/* ---- lifecycle ------------------------------------------------------------ */

/* This rank's place in a job of several (cfg->world), or one process. */
static fr_status setup_ranks(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    srv->n_engines = 1;
    srv->tp = 1;
    srv->leader = 1;
    if (!cfg->world || cfg->world->size <= 1) return FR_OK;
    const int tp = cfg->tp > 0 ? cfg->tp : 1;
    if (cfg->world->size % tp)
        return fr_fail(FR_EINVAL, "serve: tp %d does not divide the %d ranks into engines", tp, cfg->world->size);
    srv->world = cfg->world;
    srv->multi = 1;
    srv->rank = cfg->world->rank;
    srv->tp = tp;
    srv->n_engines = cfg->world->size / tp;
    srv->engine = srv->rank / tp;
    srv->leader = srv->rank % tp == 0;
    srv->agg.shadow_blocks_free = -1;
    if (srv->rank == 0 && !(srv->engine_open = calloc((size_t)srv->n_engines, sizeof(int))))
        return fr_fail(FR_ENOMEM, "serve: out of memory");
    return FR_OK;
}

/* What requests are checked against: the model's window and vocabulary,
 * the cache, the default stop ids; then the scheduler. */
static fr_status setup_engine(fr_bridge_server *srv, fr_session *s, const fr_bridge_config *cfg)
{
    const fr_model_config *mc = &s->model->cfg;
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(s->kv);
    srv->vocab = mc->vocab_size;
    srv->max_pos = mc->max_position;
    srv->moe_layers = fr_model_moe_layers(mc);
    srv->n_blocks = kc->n_blocks;
    srv->max_seqs = cfg->max_seqs > 0 ? cfg->max_seqs : kc->max_seqs;
    srv->chunk = cfg->chunk > 0 ? cfg->chunk : 512;
    /* prompts and forced tokens fit the window; a weight update lists at most
     * FR_PROTO_MAX_TENSORS tensors; no other array is longer */
    srv->max_array = (uint64_t)(srv->max_pos > FR_PROTO_MAX_TENSORS ? srv->max_pos : FR_PROTO_MAX_TENSORS);
    if (cfg->sampling.n_stop > 0) {
        srv->n_default_stop = cfg->sampling.n_stop;
        memcpy(srv->default_stop, cfg->sampling.stop_token_ids, sizeof(int) * (size_t)cfg->sampling.n_stop);
    } else {
        srv->n_default_stop = mc->n_eos;
        memcpy(srv->default_stop, mc->eos_ids, sizeof(int) * (size_t)mc->n_eos);
    }
    fr_scheduler_config sc = {.max_seqs = srv->max_seqs, .chunk = srv->chunk, .reserve_blocks = -1,
                              .on_done = srv_on_done, .user = srv, .on_token = srv_on_token,
                              .on_text = srv_on_text, .tokenizer = cfg->tokenizer,
                              .kl_sample_rate = cfg->kl_sample_rate};
    fr_status st = fr_scheduler_new(s, &sc, &srv->sch);
    if (st || !cfg->recal) return st;
    fr_recal_config rc = *cfg->recal;
    rc.log = srv->log;
    st = srv->multi ? fr_fail(FR_EUNSUPPORTED, "serve: automatic recalibration runs with one rank (mpirun -np 1 or "
                                               "none); this job has %d", srv->world->size)
                    : fr_recal_new(&rc, &s->model->cfg, &srv->recal);
    if (!st && cfg->kl_sample_rate <= 0 && cfg->recal->kl_threshold > 0)
        srv_log(srv, "warning: recalibration watches the monitored KL, and kl_sample_rate is 0: only requests "
                     "that ask for monitoring count");
    return st;
}

/* Rank 0's ROUTER socket: options, heartbeats, CURVE (or loopback only
 * without it), bound, and the table of its clients. */
static fr_status open_socket(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    srv->zctx = zmq_ctx_new();
    srv->sock = srv->zctx ? zmq_socket(srv->zctx, ZMQ_ROUTER) : NULL;
    /* Linger: what shutdown handed to ZeroMQ still goes out when the socket
     * closes, for up to shutdown_linger_ms. */
    int one = 1, linger = cfg->shutdown_linger_ms > 0 ? cfg->shutdown_linger_ms : 0;
    const int curve = cfg->curve_secret_key && cfg->curve_secret_key[0];
    fr_status st = FR_OK;
    if (!srv->sock || zmq_setsockopt(srv->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one) ||
        zmq_setsockopt(srv->sock, ZMQ_LINGER, &linger, sizeof linger)) {
        st = fr_fail(FR_EIO, "serve: cannot make a ZeroMQ ROUTER socket: %s", zmq_strerror(errno));
    } else if ((st = srv_conn_setup(srv, cfg))) {
        /* st says why */
    } else if (!curve && !fr_bridge_endpoint_is_loopback(cfg->endpoint)) {
        st = fr_fail(FR_EINVAL, "serve: %s is not a loopback address and CURVE is off: without CURVE every client "
                                "has the trainer role (weights, pause), so the server binds loopback only; make "
                                "key pairs with `fp4rollout-client keygen` and give the server's secret key and the "
                                "clients' public keys (docs/protocol.md, \"Authentication\")",
                     cfg->endpoint);
    } else if (curve && (st = srv_setup_curve(srv, cfg))) {
        /* st says why */
    } else if (zmq_bind(srv->sock, cfg->endpoint)) {
        st = fr_fail(FR_EIO, "serve: cannot bind %s: %s", cfg->endpoint, zmq_strerror(errno));
    }
    if (st) return st;
    size_t n = sizeof srv->endpoint;
    if (zmq_getsockopt(srv->sock, ZMQ_LAST_ENDPOINT, srv->endpoint, &n))
        snprintf(srv->endpoint, sizeof srv->endpoint, "%s", cfg->endpoint);
    return fr_peers_new(srv->sock, &srv->peers);
}

/* Rank 0's metrics: the PUB socket of snapshots and the HTTP endpoint. */
static fr_status start_metrics(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    fr_status st = FR_OK;
    if (cfg->metrics_pub_endpoint && cfg->metrics_pub_endpoint[0]) {
        st = fr_metrics_pub_open(srv->zctx, cfg->metrics_pub_endpoint, cfg->curve_secret_key, &srv->pub);
        if (!st) srv_log(srv, "metrics snapshots on %s (ZeroMQ PUB, topic %s, msgpack)", fr_metrics_pub_endpoint(srv->pub),
                         FR_METRICS_TOPIC);
    }
    if (st || cfg->metrics_port == 0) return st;
    if (cfg->metrics_external) {   /* the HTTP API's server answers /metrics from these snapshots */
        st = fr_metrics_http_new(&srv->metrics);
        if (!st && cfg->metrics_log && cfg->metrics_log[0]) st = fr_metrics_http_log_to(srv->metrics, cfg->metrics_log);
        return st;
    }
    const int curve = cfg->curve_secret_key && cfg->curve_secret_key[0];
    const int token = cfg->metrics_token && cfg->metrics_token[0];
    const char *bind = curve && !token ? "127.0.0.1" : cfg->metrics_bind;
    const fr_metrics_http_opts mo = {.max_connections = cfg->metrics_max_connections,
                                     .idle_timeout_s = cfg->metrics_idle_timeout_s, .token = cfg->metrics_token};
    st = fr_metrics_http_start_opts(bind, cfg->metrics_port < 0 ? 0 : cfg->metrics_port, &mo, &srv->metrics);
    if (st && cfg->metrics_port_fallback && cfg->metrics_port > 0) {
        srv_log(srv, "metrics port %d: %s; taking a free port instead", cfg->metrics_port, fr_last_error());
        st = fr_metrics_http_start_opts(bind, 0, &mo, &srv->metrics);
    }
    if (!st) srv_log(srv, "metrics on http://%s:%d/metrics and /dashboard%s", bind ? bind : "127.0.0.1",
                     fr_metrics_http_port(srv->metrics),
                     token ? " (a bearer token required)" : curve ? " (CURVE on, no metrics_http.token: loopback only)" : "");
    if (!st && cfg->metrics_log && cfg->metrics_log[0]) st = fr_metrics_http_log_to(srv->metrics, cfg->metrics_log);
    return st;
}

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
    fr_status st = fr_seed_stream_init(&srv->seeds, cfg->sampling.has_seed, cfg->sampling.params.seed)
                       ? fr_fail(FR_EIO, "serve: no stream of seeds: %s", fr_last_error())
                       : FR_OK;
    if (!st) st = setup_ranks(srv, cfg);
    if (!st) st = setup_engine(srv, s, cfg);
    /* the socket, the clients and the metrics are rank 0's */
    const int socket = !srv->multi || srv->rank == 0;
    if (!st && socket) st = open_socket(srv, cfg);
    srv->started_ms = fr_now_ms();
    if (!st && socket) st = start_metrics(srv, cfg);
    if (!st && !socket) snprintf(srv->endpoint, sizeof srv->endpoint, "%s", cfg->endpoint);
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

const fr_model_config *fr_bridge_server_model_config(const fr_bridge_server *srv)
{
    return &srv->sess->model->cfg;
}

struct fr_metrics_http *fr_bridge_server_metrics(fr_bridge_server *srv)
{
    return srv && srv->cfg.metrics_external ? srv->metrics : NULL;
}

/* Ends everything open with reason abort (held requests and the engine's). */
int srv_abort_everything(fr_bridge_server *srv)
{
    int ended = 0, n;
    uint64_t *sids = srv_sids_of(srv, -1, &n);
    for (int i = 0; sids && i < n; i++) {
        request *q = srv_find_sid(srv, sids[i]);
        if (q && q->held) ended += srv_abort_held(srv, q);
    }
    free(sids);
    int m = 0;
    if (srv->sch && !fr_scheduler_abort_all(srv->sch, &m)) ended += m;
    srv_flush_all(srv);
    return ended;
}

/* A snapshot for the metrics endpoint: scheduler health, divergence, the
 * token rate since the previous snapshot. */
void srv_publish_metrics(fr_bridge_server *srv)
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
    m.serving = *fr_scheduler_serving(srv->sch);
    m.weight_updates_committed = (long long)srv->updates_committed;
    m.weight_updates_refused = (long long)srv->updates_failed;
    m.weight_update_seconds = srv->update_seconds;
    m.state = srv->stopping ? FR_METRICS_STOPPING : srv->state == RUNNING ? FR_METRICS_SERVING : FR_METRICS_PAUSED;
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
        srv_log(srv, "warning: %s (further failures are not logged)", fr_last_error());
    }
}

int srv_publishes(const fr_bridge_server *srv) { return srv->metrics || srv->pub; }

fr_status fr_bridge_server_run(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    if (!srv || !stop) return fr_fail(FR_EINVAL, "serve: server and stop flag are required");
    if (srv->multi) return srv_run_ranks(srv, stop);
    fr_status failure = FR_OK;
    srv_log(srv, "listening on %s (protocol version %d)", srv->endpoint, FR_PROTO_VERSION);
    if (!srv->zap.started) srv_log(srv, "CURVE is off: every client has the trainer role (loopback only)");
    if (srv_publishes(srv)) srv_publish_metrics(srv);
    srv->last_stats_ms = fr_now_ms();
    while (!*stop) {
        fr_peers_stats ps;
        fr_peers_stats_get(srv->peers, &ps);
        int work = fr_scheduler_busy(srv->sch);   /* a paused engine waits for messages */
        long wait = work ? 0 : ps.queued || srv_nccl_pending(srv) ? 1 : 100;
        if (srv_poll(srv, wait) < 0) {
            if (errno == EINTR) continue;
            failure = fr_fail(FR_EIO, "serve: poll failed: %s", zmq_strerror(errno));
            break;
        }
        if ((failure = srv_handle_waiting(srv, stop, 0))) break;
        srv_nccl_turn(srv);
        if (fr_scheduler_busy(srv->sch)) {
            if (fr_scheduler_step(srv->sch))
                srv_log(srv, "engine step failed (its samples end with reason error): %s", fr_last_error());
        }
        srv_flush_all(srv);
        /* not while weights are being staged or the trainer has paused the engine */
        fr_status rst = FR_OK;
        if (srv->recal && !srv->upd && srv->state == RUNNING &&
            (rst = fr_recal_check(srv->recal, srv->sess, srv->sch, srv->weight_version, NULL))) {
            failure = rst;
            srv_log(srv, "recalibration left the engine unusable: %s", fr_last_error());
            break;
        }
        srv_pause_progress(srv);
        if (fr_peers_pump(srv->peers, NULL)) {
            failure = FR_EIO;
            break;
        }
        srv_conn_watch(srv);   /* peers found gone by a send, or whose connection closed */
        if (srv_publishes(srv) && fr_now_ms() - srv->last_pub_ms >= 200.0) srv_publish_metrics(srv);
        srv_log_stats(srv, 0);
        srv_drop_idle_update(srv);
    }
    srv->stopping = 1;
    if (srv_publishes(srv)) srv_publish_metrics(srv);   /* /health: 503 from now on */
    srv_log_stats(srv, 1);
    int ended = srv_abort_everything(srv);
    srv_answer_waiting(srv);
    srv_fail_waiters(srv, "shutdown", "the server is shutting down");
    srv_local_close(srv);   /* the in-process clients had their dones; nothing more is taken */
    srv_log(srv, "shutting down: %d open samples ended with reason abort", ended);
    fr_peers_flush(srv->peers, srv->cfg.shutdown_linger_ms > 0 ? srv->cfg.shutdown_linger_ms : 0);
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    if (ps.queued) srv_log(srv, "%llu messages could not be delivered before shutdown", (unsigned long long)ps.queued);
    return failure;
}

void fr_bridge_server_destroy(fr_bridge_server **pp)
{
    if (!pp || !*pp) return;
    fr_bridge_server *srv = *pp;
    fr_metrics_http_stop(&srv->metrics);   /* its thread reads only published snapshots */
    fr_metrics_pub_close(&srv->pub);
    fr_recal_destroy(&srv->recal);
    if (srv->sch && srv->peers) srv_abort_everything(srv);
    fr_scheduler_destroy(&srv->sch);   /* nothing open is left; any result would find no request */
    fr_weight_recv_destroy(&srv->ng);   /* first: its streams may still write into the update's stage */
    fr_weight_update_free(&srv->upd);
    for (int i = 0; i < srv->n_reqs; i++) srv_free_request(srv->reqs[i]);
    free(srv->reqs);
    free(srv->waiters);
    srv_local_destroy(srv);
    fr_peers_destroy(&srv->peers);
    srv_conn_close(srv);
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
    fr_weight_update_free(&srv->spare);
    fr_weight_update_free(&srv->ng_spare);
    free(srv->ng_acks);
    fr_rank_buf_free(&srv->events);
    fr_rank_buf_free(&srv->outbox);
    free(srv->engine_open);
    free(srv);
    *pp = NULL;
}
