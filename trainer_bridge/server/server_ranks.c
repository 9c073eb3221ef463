/* Several ranks (docs/protocol.md, "Serving on several ranks"): rank 0's
 * events shared with every rank, the engine leaders' results gathered on
 * rank 0, and the loop every rank runs. */
#include "trainer_bridge/server/server_internal.h"

/* MPI itself failed on this rank: the ranks can no longer agree, so the
 * whole job ends (non-zero) rather than wait on each other. */
void srv_comm_fatal(fr_bridge_server *srv, const char *what)
{
    srv_log(srv, "rank %d: %s failed: %s; ending every rank", srv->rank, what, fr_last_error());
    if (srv->rank == 0 && srv->peers) {
        /* the coordinator knows every open sample: each gets its done (reason
         * error) before the job ends, so no client waits for ever */
        int n = srv_end_all(srv, FR_WIRE_ERROR);
        srv_answer_waiting(srv);   /* what arrived while this rank waited on the lost one */
        srv_send_deferred(srv);
        srv_fail_waiters(srv, "shutdown", "a rank was lost: the server is ending");
        fr_peers_flush(srv->peers, srv->cfg.shutdown_linger_ms > 0 ? srv->cfg.shutdown_linger_ms : 1000);
        srv_log(srv, "a rank was lost: %d open samples ended with reason error", n);
    }
    fr_mpi_world_abort(srv->world, 1);
}

/* Rank 0's events of this turn reach every rank (into srv->events). */
static void share_events(fr_bridge_server *srv)
{
    uint64_t len = srv->rank == 0 ? (uint64_t)srv->events.len : 0;
    if (fr_mpi_world_bcast(srv->world, &len, sizeof len, 0)) srv_comm_fatal(srv, "broadcasting the events");
    if (srv->rank != 0) {
        fr_rank_buf_clear(&srv->events);
        if (len > SIZE_MAX / 2 || fr_buf_reserve(&srv->events, (size_t)len)) {
            srv_log(srv, "rank %d: out of memory receiving %llu bytes of events", srv->rank, (unsigned long long)len);
            fr_mpi_world_abort(srv->world, 1);
            return;
        }
        srv->events.len = (size_t)len;
    }
    if (len && fr_mpi_world_bcast(srv->world, srv->events.data, (size_t)len, 0)) srv_comm_fatal(srv, "broadcasting the events");
}

/* A generate for engine `engine`: its ranks submit it; a refusal (which
 * check_spec makes rare) goes back to rank 0 from the leader. */
static fr_status apply_submit(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_request_spec spec;
    memset(&spec, 0, sizeof spec);
    int engine = fr_rank_get_i32(r), oom[4] = {0, 0, 0, 0}, has_forced;
    spec.id = fr_rank_get_u64(r);
    spec.group = fr_rank_get_u64(r);
    int *prompt = fr_rank_get_i32s(r, &spec.n_prompt, &oom[0]);
    spec.n = fr_rank_get_i32(r);
    spec.first_sample = fr_rank_get_i32(r);
    spec.params.temperature = fr_rank_get_f32(r);
    spec.params.top_k = fr_rank_get_i32(r);
    spec.params.top_p = fr_rank_get_f32(r);
    spec.params.seed = fr_rank_get_u64(r);
    spec.max_tokens = fr_rank_get_i32(r);
    int *stop = fr_rank_get_i32s(r, &spec.n_stop, &oom[1]);
    spec.monitor = fr_rank_get_i32(r);
    spec.per_token_kl = fr_rank_get_i32(r);
    spec.min_tokens = fr_rank_get_i32(r);
    spec.top_logprobs = fr_rank_get_i32(r);
    spec.prompt_logprobs = fr_rank_get_i32(r);
    spec.return_routed_experts = fr_rank_get_i32(r);
    spec.penalties.min_p = fr_rank_get_f32(r);
    spec.penalties.presence_penalty = fr_rank_get_f32(r);
    spec.penalties.frequency_penalty = fr_rank_get_f32(r);
    spec.penalties.repetition_penalty = fr_rank_get_f32(r);
    has_forced = fr_rank_get_i32(r);
    int *forced = has_forced ? fr_rank_get_i32s(r, &spec.n_forced, &oom[2]) : NULL;
    int *cont = fr_rank_get_i32s(r, &spec.n_continue, &oom[3]);
    char **stops = NULL;
    const int text_oom = srv_get_text_spec(r, &spec, &stops);
    spec.prompt = prompt;
    spec.stop_ids = stop;
    spec.forced = forced;
    spec.continue_tokens = spec.n_continue > 0 ? cont : NULL;
    fr_status st = FR_OK;
    if (r->bad) {
        /* the caller reports the malformed stream */
    } else if (oom[0] || oom[1] || oom[2] || oom[3] || text_oom) {
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
    free(cont);
    srv_free_strs(stops, spec.stop_strings.n);
    return st;
}

/* Every rank applies this turn's events to its scheduler, in order. A
 * local failure (out of memory) does not stop the rest, so every rank
 * reaches the same collectives; the turn's vote then ends the loop. */
fr_status srv_apply_events(fr_bridge_server *srv)
{
    fr_rank_reader r = {(const unsigned char *)srv->events.data, srv->events.len, 0, 0};
    fr_status first = FR_OK;
    while (fr_rank_more(&r)) {
        fr_status st = FR_OK;
        const int ev = (int)fr_rank_get_u8(&r);
        switch (ev) {
        case EV_SUBMIT: st = apply_submit(srv, &r); break;
        case EV_ABORT: {
            int e = fr_rank_get_i32(&r);
            uint64_t sid = fr_rank_get_u64(&r);
            if (!r.bad && e == srv->engine && fr_scheduler_abort(srv->sch, sid, NULL))
                srv_log(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
            break;
        }
        case EV_ABORT_ALL:
            if (fr_scheduler_abort_all(srv->sch, NULL)) srv_log(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
            break;
        case EV_MODE: {   /* a pause or resume: every rank of every engine at the same turn */
            int mode = fr_rank_get_i32(&r);
            if (!r.bad) fr_scheduler_set_mode(srv->sch, (fr_scheduler_mode)mode);
            break;
        }
        case EV_RECOMPUTE:
            fr_scheduler_recompute_all(srv->sch, NULL);
            break;
        case EV_UPD_BEGIN:
        case EV_UPD_BUCKET:
        case EV_UPD_DROP:
        case EV_UPD_COMMIT: srv_apply_update(srv, ev, &r); break;
        case EV_NCCL_INIT:
        case EV_NCCL_END: srv_nccl_apply(srv, ev, &r); break;
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
    fr_rank_put_u8(&srv->outbox, OB_STATS);
    fr_scheduler_stats_put(&srv->outbox, &ss);
}

static void take_stats(fr_bridge_server *srv, fr_rank_reader *r, int first)
{
    fr_scheduler_stats s;
    fr_scheduler_stats_read(r, &s);
    if (first) srv->agg = s;
    else fr_scheduler_stats_add(&srv->agg, &s);
}

/* A sample's end from an engine (rank 0). */
static void take_done(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_sample_result res;
    if (fr_sample_result_get(r, &res)) {
        if (!r->bad) srv_log(srv, "an engine's result could not be kept: %s", fr_last_error());
        return;
    }
    request *q = srv_find_sid(srv, res.request_id);
    const int k = q ? res.sample - q->first_sample : -1;
    if (!q || k < 0 || k >= q->n) {
        srv_log(srv, "an engine ended an unknown sample (%llu, %d)", (unsigned long long)res.request_id, res.sample);
    } else {
        fr_msg_divergence div;
        srv_divergence_of(&res, &div);
        srv->engine_open[q->engine]--;
        srv_send_done(srv, q, k, srv_wire_finish(res.finish), res.n_tokens, res.preemptions, &div, &res);
    }
    fr_sample_result_free(&res);
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
    request *q = srv_find_sid(srv, sid);
    if (!q) {
        srv_log(srv, "an engine refused an unknown request (%llu): %s", (unsigned long long)sid, msg);
        return;
    }
    srv->engine_open[q->engine] -= q->open;
    int peer = q->peer;
    uint64_t id = q->request_id;
    if (q->from_held) {
        srv_abort_held(srv, q);
        srv_send_error(srv, peer, "invalid_request", 1, id, "held request could not start: %s", msg);
    } else {
        srv_remove_request(srv, q);
        srv->requests_accepted--;
        srv->requests_rejected++;
        srv_send_error(srv, peer, "invalid_request", 1, id, "%s", msg);
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
        srv_comm_fatal(srv, "gathering the engines' results");
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
            if (!r.bad) srv_token_in(srv, sid, sample, index, token, lp, v);
            break;
        }
        case OB_DONE: take_done(srv, &r); break;
        case OB_TEXT: srv_take_text(srv, &r); break;
        case OB_REJECT: take_reject(srv, &r); break;
        case OB_STATS:
            take_stats(srv, &r, first_stats);
            first_stats = 0;
            break;
        case OB_NCCL: srv_nccl_take_report(srv, &r); break;
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
fr_status srv_handle_waiting(fr_bridge_server *srv, const volatile sig_atomic_t *stop, int at_barrier)
{
    for (int k = 0; k < 1024 && !*stop && !(at_barrier && srv->turn_barrier); k++) {
        fr_wire_msg w;
        int got;
        if (fr_wire_recv(srv->sock, 1, 0, &w, &got)) return FR_EIO;
        if (!got) break;
        srv_handle_message(srv, &w);
        fr_wire_msg_free(&w);
    }
    srv_local_drain(srv, stop, at_barrier);
    return FR_OK;
}

/* Rank 0, the loop over: every message still on the socket is answered (a
 * generate with an error reply, "shutdown"), so no client is left to guess
 * whether a request it sent will run. */
void srv_answer_waiting(fr_bridge_server *srv)
{
    static const volatile sig_atomic_t go_on = 0;
    srv->stopping = 1;
    srv_handle_waiting(srv, &go_on, 0);
}

/* Rank 0: reads what the clients sent (waiting when the engines are idle)
 * into this turn's events. */
static fr_status drain_messages(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
{
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    long wait = srv_engines_busy(srv) ? 0 : ps.queued || srv_nccl_pending(srv) ? 2 : 100;
    if (srv_poll(srv, wait) < 0) {
        if (errno == EINTR) return FR_OK;
        return fr_fail(FR_EIO, "serve: poll failed: %s", zmq_strerror(errno));
    }
    srv->turn_barrier = 0;
    fr_status st = srv_handle_waiting(srv, stop, 1);
    if (!st && srv->events.failed) st = fr_fail(FR_ENOMEM, "serve: out of memory recording the engine events");
    return st;
}

/* Rank 0 after a turn's results went out. */
static fr_status after_turn(fr_bridge_server *srv)
{
    srv_flush_all(srv);
    srv_pause_progress(srv);
    srv_send_deferred(srv);
    if (fr_peers_pump(srv->peers, NULL)) return FR_EIO;
    srv_conn_watch(srv);   /* peers found gone by a send, or whose connection closed */
    if (srv_publishes(srv) && fr_now_ms() - srv->last_pub_ms >= 200.0) srv_publish_metrics(srv);
    srv_drop_idle_update(srv);
    return FR_OK;
}

/* Every rank, turn by turn: rank 0 reads messages into events; every rank
 * applies them; all vote to go on; every engine steps; the leaders' results
 * go to rank 0, which streams them. */
fr_status srv_run_ranks(fr_bridge_server *srv, const volatile sig_atomic_t *stop)
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
        srv_log(srv, "listening on %s (protocol version %d; %d engine(s) of tp %d on %d ranks)", srv->endpoint,
              FR_PROTO_VERSION, srv->n_engines, srv->tp, srv->world->size);
        if (!srv->zap.started) srv_log(srv, "CURVE is off: every client has the trainer role (loopback only)");
        if (srv_publishes(srv)) srv_publish_metrics(srv);
        srv->last_stats_ms = fr_now_ms();
    }
    for (;;) {
        if (srv->rank == 0 && !failure && !*stop) NOTE_FAILURE(drain_messages(srv, stop));
        if (srv->rank == 0 && failure) fr_rank_buf_clear(&srv->events);
        share_events(srv);
        NOTE_FAILURE(srv_apply_events(srv));
        NOTE_FAILURE(srv->fatal);
        fr_rank_buf_clear(&srv->events);
        int all = 0;
        if (fr_mpi_world_all_ok(srv->world, !failure && !*stop, &all)) srv_comm_fatal(srv, "the turn's vote");
        if (!all) break;
        if (fr_scheduler_busy(srv->sch) && fr_scheduler_step(srv->sch)) {
            /* with tp > 1 the engine's ranks may now disagree: stop */
            if (srv->tp > 1) NOTE_FAILURE(fr_fail(FR_EIO, "serve: rank %d: engine step failed: %s", srv->rank,
                                                  fr_last_error()));
            else srv_log(srv, "rank %d: engine step failed (its samples end with reason error): %s", srv->rank,
                       fr_last_error());
        }
        srv_nccl_turn(srv);   /* every rank's weight group: buckets checked, failures */
        NOTE_FAILURE(exchange_results(srv));
        if (srv->rank == 0) NOTE_FAILURE(after_turn(srv));
        if (srv->rank == 0) srv_log_stats(srv, 0);
    }
    /* Shutdown: every engine ends its samples; rank 0 sends their dones. */
    int ended = srv->rank == 0 ? srv_engine_samples(srv) : 0;
    if (fr_scheduler_abort_all(srv->sch, NULL)) srv_log(srv, "rank %d: abort: %s", srv->rank, fr_last_error());
    NOTE_FAILURE(exchange_results(srv));
    int all = 0;
    if (fr_mpi_world_all_ok(srv->world, !failure, &all)) srv_comm_fatal(srv, "the shutdown vote");
    if (srv->rank == 0) {
        srv_log_stats(srv, 1);
        ended += srv_abort_everything(srv);
        srv_answer_waiting(srv);
        srv_send_deferred(srv);
        srv_fail_waiters(srv, "shutdown", "the server is shutting down");
        srv_log(srv, "shutting down: %d open samples ended with reason abort", ended);
        fr_peers_flush(srv->peers, srv->cfg.shutdown_linger_ms > 0 ? srv->cfg.shutdown_linger_ms : 0);
        fr_peers_stats ps;
        fr_peers_stats_get(srv->peers, &ps);
        if (ps.queued)
            srv_log(srv, "%llu messages could not be delivered before shutdown", (unsigned long long)ps.queued);
    }
#undef NOTE_FAILURE
    if (failure) return fr_fail(failure, "%s", why[0] ? why : "serve: this rank failed");
    if (!all) return fr_fail(FR_EIO, "serve: rank %d stops because another rank failed (its log says why)", srv->rank);
    return FR_OK;
}
