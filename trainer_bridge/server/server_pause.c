/* Pausing the engines (docs/protocol.md, "pause"): the three modes, the
 * clients waiting for a wait pause, resume with the requests it held, and
 * the engines' mode (rollout/engine/scheduler.h, fr_scheduler_mode) set on
 * every rank in the same turn, so that every rank of every engine holds,
 * freezes and resumes together. */
#include "trainer_bridge/server/server_internal.h"

/* The engines' mode: at once with one process; with several ranks as an
 * event that every rank applies before the turn's step (server_ranks.c). */
static void set_engines(fr_bridge_server *srv, fr_scheduler_mode mode)
{
    if (!srv->multi) {
        fr_scheduler_set_mode(srv->sch, mode);
        return;
    }
    fr_rank_put_u8(&srv->events, EV_MODE);
    fr_rank_put_i32(&srv->events, (int)mode);
}

/* Every engine drops the KV cache of what it runs, to recompute it when it
 * goes on (fr_scheduler_recompute_all): with the weights serving then. */
static void recompute_engines(fr_bridge_server *srv)
{
    if (!srv->multi) {
        int n = 0;
        fr_scheduler_recompute_all(srv->sch, &n);
        if (n) srv_log(srv, "%d samples and prefills will recompute their KV cache", n);
        return;
    }
    fr_rank_put_u8(&srv->events, EV_RECOMPUTE);
}

/* The engines' samples in flight (running, prefilling, preempted after
 * admission): with several ranks, as the engines reported at the end of the
 * last turn. Nothing the engines start can raise it while they hold, and
 * what this turn submits waits, so the figure is safe to finish a pause by. */
static int in_flight(const fr_bridge_server *srv)
{
    return srv->multi ? srv->agg.in_flight : fr_scheduler_in_flight(srv->sch);
}

int srv_engines_busy(const fr_bridge_server *srv)
{
    if (!srv->multi) return fr_scheduler_busy(srv->sch);
    return srv->state != PAUSED && srv_engine_samples(srv) > 0;
}

static void send_pause_reply(fr_bridge_server *srv, int peer, fr_pause_mode mode, int aborted)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_PAUSE_REPLY);
    m.u.pause_reply.mode = mode;
    m.u.pause_reply.aborted = aborted;
    srv_send_later(srv, peer, &m);
}

void srv_reply_waiters(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_waiters; i++) send_pause_reply(srv, srv->waiters[i], FR_PAUSE_WAIT, 0);
    srv->n_waiters = 0;
}

/* Pause waiters get an error instead of their reply (resume, a keep pause
 * or shutdown came first). */
void srv_fail_waiters(fr_bridge_server *srv, const char *code, const char *why)
{
    for (int i = 0; i < srv->n_waiters; i++) srv_send_error(srv, srv->waiters[i], code, 0, 0, "%s", why);
    srv->n_waiters = 0;
}

void srv_pause_progress(fr_bridge_server *srv)
{
    if (srv->state == PAUSING && in_flight(srv) == 0) {
        srv->state = PAUSED;
        srv_reply_waiters(srv);
    }
}

static int add_waiter(fr_bridge_server *srv, int peer)
{
    if (srv->n_waiters == srv->cap_waiters) {
        int c = srv->cap_waiters ? srv->cap_waiters * 2 : 4;
        int *w = realloc(srv->waiters, sizeof(int) * (size_t)c);
        if (!w) return -1;
        srv->waiters = w;
        srv->cap_waiters = c;
    }
    srv->waiters[srv->n_waiters++] = peer;
    return 0;
}

/* Mode abort: every sample in the engines ends now with what it made (the
 * queued ones with nothing); held requests stay held. */
static void pause_abort(fr_bridge_server *srv, int peer)
{
    int n = 0;
    if (srv_eng_abort_all(srv, &n)) srv_log(srv, "pause: %s", fr_last_error());
    srv_flush_all(srv);
    set_engines(srv, FR_SCHED_HOLD);
    srv->state = PAUSED;
    srv->pause_mode = FR_PAUSE_ABORT;
    srv_reply_waiters(srv);   /* what they waited for has ended */
    send_pause_reply(srv, peer, FR_PAUSE_ABORT, n);
}

/* Mode wait: the samples in flight finish, nothing new starts; answered
 * once none is left. Paused already (any mode): answered at once, the
 * engines left as they are. */
static void pause_wait(fr_bridge_server *srv, int peer)
{
    if (srv->state == RUNNING) {
        set_engines(srv, FR_SCHED_HOLD);
        srv->pause_mode = FR_PAUSE_WAIT;
        srv->state = in_flight(srv) == 0 ? PAUSED : PAUSING;
    }
    if (srv->state == PAUSED) {
        send_pause_reply(srv, peer, FR_PAUSE_WAIT, 0);
        return;
    }
    if (add_waiter(srv, peer)) srv_send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
}

/* Mode keep: no engine takes another step; the samples keep their tokens
 * and KV cache (with recompute, their KV cache is dropped now and
 * recomputed when they go on). A wait pause still waiting is cancelled:
 * what it waited for is frozen, not finished. */
static void pause_keep(fr_bridge_server *srv, int peer, int recompute)
{
    if (srv->state == PAUSING)
        srv_fail_waiters(srv, "pause_cancelled", "a pause with mode keep froze the samples before they finished");
    set_engines(srv, FR_SCHED_FREEZE);
    if (recompute) recompute_engines(srv);
    srv->state = PAUSED;
    srv->pause_mode = FR_PAUSE_KEEP;
    send_pause_reply(srv, peer, FR_PAUSE_KEEP, 0);
}

void srv_handle_pause(fr_bridge_server *srv, int peer, const fr_msg_pause *p)
{
    switch (p->mode) {
    case FR_PAUSE_ABORT: pause_abort(srv, peer); break;
    case FR_PAUSE_WAIT: pause_wait(srv, peer); break;
    case FR_PAUSE_KEEP: pause_keep(srv, peer, p->recompute); break;
    }
    if (srv->events.failed) srv_log(srv, "pause: the server is out of memory recording the engine events");
}

/* Starts the requests a pause held, in arrival order; returns how many. */
static int release_held(fr_bridge_server *srv)
{
    int released = 0, n;
    uint64_t *sids = srv_sids_of(srv, -1, &n);
    for (int i = 0; sids && i < n; i++) {
        request *q = srv_find_sid(srv, sids[i]);
        if (!q || !q->held) continue;
        fr_status st = srv_eng_submit(srv, q, &q->spec);
        if (st) {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            int p = q->peer;
            uint64_t id = q->request_id;
            srv_abort_held(srv, q);
            srv_send_error(srv, p, "invalid_request", 1, id, "held request could not start: %s", msg);
            continue;
        }
        q->held = 0;
        q->from_held = 1;
        free((void *)q->spec.prompt);
        free((void *)q->spec.stop_ids);
        free((void *)q->spec.forced);
        free((void *)q->spec.continue_tokens);
        q->spec.prompt = NULL;
        q->spec.stop_ids = NULL;
        q->spec.forced = NULL;
        q->spec.continue_tokens = NULL;
        released++;
    }
    free(sids);
    return released;
}

void srv_handle_resume(fr_bridge_server *srv, int peer, const fr_msg_resume *r)
{
    if (srv->state == PAUSING)
        srv_fail_waiters(srv, "pause_cancelled", "a resume arrived before the engine finished its work");
    /* only a keep pause leaves samples whose KV cache the weights may have outdated */
    if (r->recompute && srv->state == PAUSED && srv->pause_mode == FR_PAUSE_KEEP) recompute_engines(srv);
    set_engines(srv, FR_SCHED_RUN);
    srv->state = RUNNING;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_RESUME_REPLY);
    m.u.resume_reply.released = release_held(srv);
    srv_send_msg(srv, peer, &m);
}
