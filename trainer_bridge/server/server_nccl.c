/* Weights over NCCL (docs/protocol.md, "Weights over NCCL"): a client's
 * group and the buckets announced over it, received by the engine's
 * receiver (rollout/engine/weight_recv.h, which answers that the build has
 * no CUDA when it has none). The begin and the commit are those of every
 * update (server_weights.c). A server of several ranks passes what rank 0
 * accepts to every rank (server_nccl_ranks.c). */
#include "trainer_bridge/server/server_internal.h"

static int nccl_timeout_ms(const fr_bridge_server *srv)
{
    return srv->cfg.nccl_timeout_ms > 0 ? srv->cfg.nccl_timeout_ms : 30000;
}

/* Ends the group (an update over it in progress is dropped and counted
 * failed); its client gets an error with code when code is not NULL. */
void srv_nccl_end(fr_bridge_server *srv, const char *why, const char *code)
{
    if (!srv->ng) return;
    fr_weight_update *w = srv->upd_nccl ? srv->upd : NULL;
    if (w) {
        srv->updates_failed++;
        srv_log(srv, "weight update to version %llu over NCCL dropped: %s", (unsigned long long)fr_weight_update_version(w),
                why);
        srv->upd = NULL;
        srv->upd_nccl = 0;
    }
    if (code) srv_send_error(srv, srv->ng_peer, code, 0, 0, "%s", why);
    srv_log(srv, "NCCL weight group of client %s ended: %s", fr_peers_name(srv->peers, srv->ng_peer), why);
    fr_weight_recv_destroy(&srv->ng);   /* its streams are done with the stage now */
    srv_keep_spare(srv, w);
    srv->ng_commit = 0;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_NCCL_END);   /* every rank ends its side */
}

/* The group can no longer go on (an update dropped with a bucket in
 * flight): rank 0 ends it everywhere, another rank here and tells rank 0. */
void srv_nccl_lost(fr_bridge_server *srv, const char *code)
{
    char msg[FR_PROTO_TEXT_MAX - 64];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    if (srv->rank == 0) srv_nccl_end(srv, msg, NULL);
    else srv_nccl_fail_here(srv, code);
}

/* Rank 0: the commit a client asked for goes ahead once every bucket
 * announced was received and checked (on every rank). */
static void try_commit(fr_bridge_server *srv)
{
    if (!srv->ng || !srv->ng_commit || !srv->upd || !srv->upd_nccl) return;
    if (fr_weight_recv_busy(srv->ng) || (srv->multi && !srv_nccl_all_acked(srv))) return;
    srv->ng_commit = 0;
    srv_request_commit(srv, srv->ng_commit_version);
}

void srv_nccl_commit_when_received(fr_bridge_server *srv, uint64_t version)
{
    srv->ng_commit = 1;
    srv->ng_commit_version = version;
    try_commit(srv);
}

/* Every turn: what the group finished (joined, buckets checked, failures),
 * then a commit that waited for it. */
void srv_nccl_turn(fr_bridge_server *srv)
{
    if (srv->rank != 0) {
        srv_nccl_follower_turn(srv);
        return;
    }
    for (int k = 0; srv->ng && k < 64; k++) {
        int bucket = -1;
        fr_weight_refusal why = FR_WREF_NCCL_FAILED;
        const fr_weight_recv_event ev = fr_weight_recv_poll(srv->ng, &bucket, &why);
        if (ev == FR_WR_NOTHING) break;
        if (ev == FR_WR_JOINED) {
            srv_log(srv, "NCCL weight group of client %s is up", fr_peers_name(srv->peers, srv->ng_peer));
        } else if (ev == FR_WR_BUCKET_OK && srv->multi) {
            srv_nccl_ack(srv, 0, bucket);   /* answered once every rank has it */
        } else if (ev == FR_WR_BUCKET_OK) {
            srv->upd_last_ms = fr_now_ms();
            srv_send_update_reply(srv, srv->ng_peer, fr_weight_update_version(srv->upd), FR_UPD_BUCKET, bucket,
                                  fr_weight_update_bytes(srv->upd));
        } else {
            char msg[FR_PROTO_TEXT_MAX];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            srv_nccl_end(srv, msg, ev == FR_WR_GROUP_FAILED ? "nccl_failed" : fr_weight_refusal_name(why));
        }
    }
    try_commit(srv);
}

/* Whether the loop should come back soon for the group (it polls instead
 * of waiting on the socket). */
int srv_nccl_pending(const fr_bridge_server *srv)
{
    return srv->ng && (!fr_weight_recv_joined(srv->ng) || fr_weight_recv_busy(srv->ng) || srv->ng_commit ||
                       srv->ng_replied < srv->ng_announced);
}

void srv_handle_nccl_init(fr_bridge_server *srv, int peer, const fr_msg_nccl_init *n)
{
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
}

void srv_handle_nccl_close(fr_bridge_server *srv, int peer)
{
    if (srv->ng && srv->ng_peer == peer) srv_nccl_end(srv, "its client closed it", NULL);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_CLOSED, .timeout_s = nccl_timeout_ms(srv) * 1e-3};
    srv_send_msg(srv, peer, &m);
}

void srv_handle_nccl_bucket(fr_bridge_server *srv, int peer, const fr_msg_nccl_bucket *b)
{
    if (!srv->ng || srv->ng_peer != peer || !srv->upd || !srv->upd_nccl || srv->upd_peer != peer) {
        srv_send_error(srv, peer, "update_state", 0, 0,
                       "update_weights_nccl_bucket for version %llu: no weight update over NCCL of this client is in "
                       "progress", (unsigned long long)b->version);
        return;
    }
    srv->upd_last_ms = fr_now_ms();
    fr_weight_bucket wb;
    fr_weight_refusal why = FR_WREF_OUT_OF_MEMORY;
    fr_status st = fr_bridge_nccl_bucket_of(b, &wb);
    if (!st) st = fr_weight_recv_bucket(srv->ng, &wb, &why);
    /* The client broadcasts the bucket whatever the answer, so a refused
     * one leaves the group out of step: it ends with the update. */
    if (st) {
        char msg[FR_PROTO_TEXT_MAX];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        srv_nccl_end(srv, msg, fr_weight_refusal_name(why));
    } else if (srv->multi) {   /* checked here: every other rank receives it too */
        srv->ng_announced++;
        fr_rank_put_u8(&srv->events, EV_UPD_BUCKET);
        fr_weight_bucket_put(&srv->events, &wb);
    }
    free(wb.pieces);
}
