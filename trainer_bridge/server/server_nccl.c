/* Weight updates over NCCL (docs/protocol.md, "Weights over NCCL"); without
 * CUDA the messages are answered with an error. A server of several ranks
 * passes what rank 0 accepts to every rank (server_nccl_ranks.c). */
#include "trainer_bridge/server/server_internal.h"

static int nccl_timeout_ms(const fr_bridge_server *srv)
{
    return srv->cfg.nccl_timeout_ms > 0 ? srv->cfg.nccl_timeout_ms : 30000;
}

#ifdef FR_HAVE_CUDA
/* Ends the group (an update of it in progress is dropped and counted
 * failed); its client gets an error with code when code is not NULL. */
void srv_nccl_end(fr_bridge_server *srv, const char *why, const char *code)
{
    if (!srv->ng) return;
    if (fr_nccl_recv_updating(srv->ng)) {
        srv->updates_failed++;
        srv_log(srv, "weight update to version %llu over NCCL dropped: %s",
              (unsigned long long)fr_nccl_recv_version(srv->ng), why);
    }
    if (code) srv_send_error(srv, srv->ng_peer, code, 0, 0, "%s", why);
    srv_log(srv, "NCCL weight group of client %s ended: %s", fr_peers_name(srv->peers, srv->ng_peer), why);
    fr_nccl_recv_destroy(&srv->ng);   /* its streams are done with the stage now */
    srv_keep_spare(srv, srv->ng_upd);
    srv->ng_upd = NULL;
    srv->ng_commit = 0;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_NCCL_END);   /* every rank ends its side */
}
#endif

/* Drops the NCCL update in progress (counted failed); the group survives
 * when no bucket of it was in flight. */
void srv_nccl_drop_update(fr_bridge_server *srv, const char *why)
{
#ifdef FR_HAVE_CUDA
    if (!fr_nccl_recv_updating(srv->ng)) return;
    srv_log(srv, "weight update to version %llu over NCCL dropped: %s", (unsigned long long)fr_nccl_recv_version(srv->ng),
          why);
    srv->updates_failed++;
    srv->ng_commit = 0;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_NCCL_DROP);
    if (fr_nccl_recv_drop(srv->ng)) {
        srv_nccl_end(srv, fr_last_error(), NULL);   /* keeps the stage once the streams are done */
        return;
    }
    srv_keep_spare(srv, srv->ng_upd);
    srv->ng_upd = NULL;
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
        srv_nccl_drop_update(srv, msg);
        srv_send_error(srv, peer, code, 0, 0, "%s", msg);
        return;
    }
    if (!ready) return;
    if (srv->multi) {
        /* every rank has checked every bucket: all vote and switch together
         * at the start of the next turn (server_nccl_ranks.c) */
        if (!srv_nccl_all_acked(srv)) return;
        srv->ng_commit = 0;
        fr_rank_put_u8(&srv->events, EV_NCCL_COMMIT);
        fr_rank_put_u64(&srv->events, srv->ng_commit_version);
        return;
    }
    srv->ng_commit = 0;
    const uint64_t version = srv->ng_commit_version, bytes = fr_nccl_recv_bytes(srv->ng);
    const double t0 = fr_now_ms();
    fr_weight_update *w = fr_nccl_recv_finish(srv->ng);
    srv->ng_upd = NULL;
    /* the engine's commit, as for ZeroMQ updates (between steps: this loop runs none meanwhile) */
    const fr_status cst = w ? fr_session_commit_weights_move(srv->sess, w)
                            : fr_fail(FR_EINTERNAL, "NCCL weight group: the update has no stage");
    srv_keep_spare(srv, w);
    if (cst) {
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        srv->updates_failed++;
        srv_log(srv, "weight update to version %llu over NCCL failed: %s", (unsigned long long)version, msg);
        srv_send_error(srv, peer, "update_failed", 0, 0, "%s", msg);
        return;
    }
    srv->weight_version = version;
    fr_scheduler_set_weight_version(srv->sch, version);
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    fr_hist_add(&srv->update_seconds, srv->last_sync_s);
    srv_log(srv, "weights are now version %llu, over NCCL (%llu bytes; switched in %.1f ms, %.3f s since the begin)",
          (unsigned long long)version, (unsigned long long)bytes, fr_now_ms() - t0, srv->last_sync_s);
    srv_send_update_reply(srv, peer, version, FR_UPD_COMMIT, -1, bytes);
}
#endif

/* Every turn: what the group finished (joined, buckets checked, failures),
 * then a commit that waited for it. */
void srv_nccl_turn(fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    if (srv->rank != 0) {
        srv_nccl_follower_turn(srv);
        return;
    }
    for (int k = 0; srv->ng && k < 64; k++) {
        int bucket = -1;
        const char *code = "nccl_failed";
        fr_nr_event ev = fr_nccl_recv_poll(srv->ng, &bucket, &code);
        if (ev == FR_NR_NOTHING) break;
        if (ev == FR_NR_JOINED) {
            srv_log(srv, "NCCL weight group of client %s is up", fr_peers_name(srv->peers, srv->ng_peer));
        } else if (ev == FR_NR_BUCKET_OK && srv->multi) {
            srv_nccl_ack(srv, 0, bucket);   /* answered once every rank has it */
        } else if (ev == FR_NR_BUCKET_OK) {
            srv->upd_last_ms = fr_now_ms();
            srv_send_update_reply(srv, srv->ng_peer, fr_nccl_recv_version(srv->ng), FR_UPD_BUCKET, bucket,
                              fr_nccl_recv_bytes(srv->ng));
        } else {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            srv_nccl_end(srv, msg, code ? code : "nccl_failed");
        }
    }
    nccl_try_commit(srv);
#else
    (void)srv;
#endif
}

/* Whether the loop should come back soon for the group (it polls instead
 * of waiting on the socket). */
int srv_nccl_pending(const fr_bridge_server *srv)
{
#ifdef FR_HAVE_CUDA
    return srv->ng && (!fr_nccl_recv_joined(srv->ng) || fr_nccl_recv_busy(srv->ng) || srv->ng_commit ||
                       srv->ng_replied < srv->ng_announced);
#else
    (void)srv;
    return 0;
#endif
}

void srv_handle_nccl_init(fr_bridge_server *srv, int peer, const fr_msg_nccl_init *n)
{
#ifndef FR_HAVE_CUDA
    (void)n;
    srv_send_error(srv, peer, "nccl_unavailable", 0, 0,
               "nccl_group_init: this server was built without CUDA; weights travel over ZeroMQ only");
#else
    if (srv->sess->backend != FR_BACKEND_CUDA || !srv->sess->gpu_weights) {
        srv_send_error(srv, peer, "nccl_unavailable", 0, 0,
                   "nccl_group_init: the %s backend has no device weights to receive into; weights over NCCL need "
                   "the cuda backend (use update_weights over ZeroMQ)", fr_backend_name(srv->sess->backend));
        return;
    }
    if (srv->multi && !srv->ng_acks && !(srv->ng_acks = calloc((size_t)srv->world->size, sizeof *srv->ng_acks))) {
        srv_send_error(srv, peer, "out_of_memory", 0, 0, "nccl_group_init: out of memory");
        return;
    }
    if (srv->ng) srv_nccl_end(srv, "a new nccl_group_init arrived", NULL);
    if (srv->upd && srv->upd_peer == peer) srv_drop_update(srv, "its client makes an NCCL weight group");
    /* the trainer is rank 0; world rank w of this server is rank w + 1 */
    const int nranks = (srv->multi ? srv->world->size : 1) + 1;
    if (srv_nccl_join(srv, n->unique_id, nranks, nccl_timeout_ms(srv))) {
        srv_send_error(srv, peer, "nccl_failed", 0, 0, "%s", fr_last_error());
        return;
    }
    if (srv->multi) {   /* the unique id reaches every rank with this turn's events */
        fr_rank_put_u8(&srv->events, EV_NCCL_INIT);
        fr_rank_put_bytes(&srv->events, n->unique_id, FR_PROTO_NCCL_ID_BYTES);
        fr_rank_put_i32(&srv->events, nranks);
        fr_rank_put_i32(&srv->events, nccl_timeout_ms(srv));
    }
    srv->ng_peer = peer;
    srv->ng_commit = 0;
    srv_log(srv, "client %s makes an NCCL weight group: joining as rank 1 of %d%s", fr_peers_name(srv->peers, peer),
          nranks, srv->multi ? " (every rank of every engine joins)" : "");
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_JOINING, .nranks = nranks, .rank = 0,
                                         .timeout_s = nccl_timeout_ms(srv) * 1e-3};
    srv_send_msg(srv, peer, &m);
#endif
}

void srv_handle_nccl_close(fr_bridge_server *srv, int peer)
{
#ifdef FR_HAVE_CUDA
    if (srv->ng && srv->ng_peer == peer) srv_nccl_end(srv, "its client closed it", NULL);
#endif
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_CLOSED, .timeout_s = nccl_timeout_ms(srv) * 1e-3};
    srv_send_msg(srv, peer, &m);
}

/* update_weights_begin with transport nccl, after the version check. */
void srv_handle_nccl_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
#ifndef FR_HAVE_CUDA
    srv->updates_failed++;
    srv_send_error(srv, peer, "nccl_unavailable", 0, 0,
               "update_weights_begin to version %llu: transport nccl: this server was built without CUDA",
               (unsigned long long)b->version);
#else
    if (!srv->ng || srv->ng_peer != peer) {
        srv->updates_failed++;
        srv_send_error(srv, peer, "nccl_unavailable", 0, 0,
                   "update_weights_begin: transport nccl: this client has no NCCL weight group (nccl_group_init "
                   "first)");
        return;
    }
    const char *code = "out_of_memory";
    fr_weight_update *w = srv_take_nccl_stage(srv, b->version);
    if (!w || fr_nccl_recv_begin(srv->ng, b, w, &code)) {
        srv_keep_spare(srv, w);
        srv->updates_failed++;
        srv_send_error(srv, peer, code, 0, 0, "%s", fr_last_error());
        return;
    }
    srv->ng_upd = w;
    srv->upd_last_ms = srv->upd_begin_ms = fr_now_ms();
    srv->ng_commit = 0;
    if (srv->multi) {
        srv->ng_announced = srv->ng_replied = 0;
        memset(srv->ng_acks, 0, sizeof *srv->ng_acks * (size_t)srv->world->size);
        srv_nccl_put_begin(srv, b);
    }
    srv_log(srv, "weight update to version %llu over NCCL begins: %d tensors, %llu bytes, buckets of %llu bytes",
          (unsigned long long)b->version, b->n_tensors, (unsigned long long)b->total_bytes,
          (unsigned long long)b->bucket_bytes);
    srv_send_update_reply(srv, peer, b->version, FR_UPD_BEGIN, -1, 0);
#endif
}

void srv_handle_nccl_bucket(fr_bridge_server *srv, int peer, const fr_msg_nccl_bucket *b)
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
            srv_nccl_end(srv, msg, code);
        } else if (srv->multi) {   /* checked here: every other rank receives it too */
            srv->ng_announced++;
            srv_nccl_put_bucket(srv, b);
        }
        return;
    }
#endif
    srv_send_error(srv, peer, "update_state", 0, 0,
               "update_weights_nccl_bucket for version %llu: no weight update over NCCL of this client is in "
               "progress", (unsigned long long)b->version);
}

/* Commit or abort of the client's NCCL update: 1 when it was one. */
int srv_nccl_end_message(fr_bridge_server *srv, int peer, uint64_t version, int commit)
{
#ifdef FR_HAVE_CUDA
    if (!srv->ng || srv->ng_peer != peer || !fr_nccl_recv_updating(srv->ng)) return 0;
    const char *what = commit ? "update_weights_commit" : "update_weights_abort";
    if (version != fr_nccl_recv_version(srv->ng)) {
        srv_send_error(srv, peer, "update_state", 0, 0, "%s for version %llu: the update in progress is to version %llu",
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
    srv_nccl_drop_update(srv, "the client aborted it");
    srv_send_update_reply(srv, peer, version, FR_UPD_ABORT, -1, bytes);
    return 1;
#else
    (void)srv;
    (void)peer;
    (void)version;
    (void)commit;
    return 0;
#endif
}
