/* Weight updates over ZeroMQ: begin, buckets, commit and abort
 * (docs/protocol.md, "Weight updates"). */
#include "trainer_bridge/server/server_internal.h"

void srv_send_update_reply(fr_bridge_server *srv, int peer, uint64_t version, fr_update_stage stage, int bucket,
                           uint64_t bytes)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_UPDATE_REPLY);
    m.u.update_reply = (fr_msg_update_reply){.version = version, .stage = stage, .bucket = bucket, .bytes = bytes,
                                             .weight_version = srv->weight_version};
    srv_send_msg(srv, peer, &m);
}

/* Keeps w's staging memory for the next update (the older spare goes). */
void srv_keep_spare(fr_bridge_server *srv, fr_weight_update *w)
{
    if (!w) return;
    if (fr_weight_update_is_shard(w)) {   /* an NCCL update's stage on a tensor-parallel rank */
        fr_weight_update_free(&srv->ng_spare);
        srv->ng_spare = w;
        return;
    }
    fr_weight_update_free(&srv->spare);
    srv->spare = w;
}

/* The engine's stage for an update to `version`: the one kept from the last
 * update, else a new one where the session keeps its weights (NULL and
 * fr_last_error when it cannot be made). */
fr_weight_update *srv_take_stage(fr_bridge_server *srv, uint64_t version)
{
    fr_weight_update *w = srv->spare;
    srv->spare = NULL;
    if (!w && fr_weight_update_begin_for(srv->sess, version, &w)) return NULL;
    return w;
}

/* Drops the staged update (the serving weights are untouched); why goes to
 * the log. */
void srv_drop_update(fr_bridge_server *srv, const char *why)
{
    if (!srv->upd) return;
    srv_log(srv, "weight update to version %llu dropped: %s", (unsigned long long)fr_bridge_update_version(srv->upd),
          why);
    srv_keep_spare(srv, fr_bridge_update_release_staged(srv->upd));
    fr_bridge_update_free(&srv->upd);
    srv->updates_failed++;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_UPD_DROP);
}

/* A failed update message: the update is dropped and the sender gets an
 * error with the code and message of the failure. */
void srv_fail_update(fr_bridge_server *srv, int peer, const char *code)
{
    char msg[FR_PROTO_TEXT_MAX];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    srv_drop_update(srv, msg);
    srv_send_error(srv, peer, code, 0, 0, "%s", msg);
}

/* The staged update a bucket, commit or abort of peer refers to, or NULL
 * after answering with update_state. */
static fr_bridge_update *update_of(fr_bridge_server *srv, int peer, const char *what, uint64_t version)
{
    if (!srv->upd) {
        srv_send_error(srv, peer, "update_state", 0, 0,
                   "%s for version %llu: no weight update is in progress (none began, or it was dropped)", what,
                   (unsigned long long)version);
        return NULL;
    }
    if (srv->upd_peer != peer) {
        srv_send_error(srv, peer, "update_state", 0, 0, "%s: the update in progress belongs to another client", what);
        return NULL;
    }
    if (fr_bridge_update_version(srv->upd) != version) {
        srv_send_error(srv, peer, "update_state", 0, 0, "%s for version %llu: the update in progress is to version %llu",
                   what, (unsigned long long)version, (unsigned long long)fr_bridge_update_version(srv->upd));
        return NULL;
    }
    srv->upd_last_ms = fr_now_ms();
    return srv->upd;
}

/* The client whose update is in progress (ZeroMQ or NCCL), or -1. */
static int update_owner(const fr_bridge_server *srv)
{
    if (srv->upd) return srv->upd_peer;
    if (srv_nccl_updating(srv)) return srv->ng_peer;
    return -1;
}

void srv_handle_update_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
    /* One update at a time, owned by the client that began it: a begin from
     * anyone else is refused and leaves it alone; the owner's own begin
     * replaces it, once the new version is known to be acceptable. */
    const int owner = update_owner(srv);
    if (owner >= 0 && owner != peer) {
        srv->updates_failed++;
        srv_send_error(srv, peer, "update_state", 0, 0,
                       "update_weights_begin (version %llu): another client's weight update is in progress; it "
                       "ends with its commit or abort, its client's departure, or weight_update_idle_s",
                       (unsigned long long)b->version);
        return;
    }
    if (b->version <= srv->weight_version) {
        srv->updates_failed++;
        srv_send_error(srv, peer, "bad_version",
                       0, 0, "update_weights_begin: version %llu must be greater than the version serving, %llu",
                       (unsigned long long)b->version, (unsigned long long)srv->weight_version);
        return;
    }
    const long long max_frame = srv_max_message_bytes(&srv->cfg);
    if (!b->nccl && b->bucket_bytes > (uint64_t)max_frame) {
        /* its buckets' frames would be dropped with the connection */
        srv->updates_failed++;
        srv_send_error(srv, peer, "bad_bucket", 0, 0,
                       "update_weights_begin: bucket_bytes %llu exceeds the server's frame limit, "
                       "coordinator.max_message_bytes = %lld",
                       (unsigned long long)b->bucket_bytes, max_frame);
        return;
    }
    if (srv_nccl_updating(srv)) {
        char why[160];
        snprintf(why, sizeof why, "a new update_weights_begin (version %llu) arrived", (unsigned long long)b->version);
        srv_nccl_drop_update(srv, why);
    }
    if (srv->upd) {
        char why[160];
        snprintf(why, sizeof why, "a new update_weights_begin (version %llu) arrived", (unsigned long long)b->version);
        srv_drop_update(srv, why);
    }
    if (b->nccl) {
        srv_handle_nccl_begin(srv, peer, b);
        return;
    }
    const char *code = "out_of_memory";
    fr_weight_update *w = srv_take_stage(srv, b->version);
    if (!w || fr_bridge_update_begin(w, b, &srv->upd, &code)) {
        srv_keep_spare(srv, w);
        srv->updates_failed++;
        srv_send_error(srv, peer, code, 0, 0, "%s", fr_last_error());
        return;
    }
    srv->upd_peer = peer;
    srv->upd_last_ms = fr_now_ms();
    srv->upd_begin_ms = srv->upd_last_ms;
    if (srv->multi) {
        fr_rank_put_u8(&srv->events, EV_UPD_BEGIN);
        fr_rank_put_u64(&srv->events, b->version);
        fr_rank_put_u8(&srv->events, (uint8_t)(b->partial != 0));
    }
    srv_log(srv, "weight update to version %llu begins: %d tensors%s, %llu bytes, buckets of %llu bytes, staged on "
          "the %s", (unsigned long long)b->version, b->n_tensors, b->partial ? " (partial)" : "",
          (unsigned long long)b->total_bytes, (unsigned long long)b->bucket_bytes,
          fr_weight_update_on_device(fr_bridge_update_staged(srv->upd)) ? "device" : "host");
    srv_send_update_reply(srv, peer, b->version, FR_UPD_BEGIN, -1, 0);
}

void srv_handle_update_bucket(fr_bridge_server *srv, int peer, const fr_msg_update_bucket *b,
                              const fr_wire_msg *w)
{
    fr_bridge_update *u = update_of(srv, peer, "update_weights_bucket", b->version);
    if (!u) return;
    const char *code;
    if (fr_bridge_update_bucket(u, b, w, &code)) {
        srv_fail_update(srv, peer, code);
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
            fr_rank_put_i32(e, (int32_t)p->t.dtype);
            fr_rank_put_i32(e, p->t.ndim);
            for (int k = 0; k < p->t.ndim; k++) fr_rank_put_u64(e, (uint64_t)p->t.shape[k]);
            fr_rank_put_u64(e, p->offset);
            fr_rank_put_bytes(e, fr_wire_payload(w, i, NULL), (size_t)p->nbytes);
        }
    }
    srv_send_update_reply(srv, peer, b->version, FR_UPD_BUCKET, b->bucket, fr_bridge_update_bytes(u));
}

/* The staged update is serving: every token drawn from now on carries its
 * version; the client gets its reply (rank 0). */
void srv_committed(fr_bridge_server *srv, uint64_t version, double t0)
{
    uint64_t bytes = fr_bridge_update_bytes(srv->upd);
    srv->weight_version = version;
    fr_scheduler_set_weight_version(srv->sch, version);
    srv_keep_spare(srv, fr_bridge_update_release_staged(srv->upd));   /* now holding the previous weights */
    fr_bridge_update_free(&srv->upd);
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    fr_hist_add(&srv->update_seconds, srv->last_sync_s);
    if (srv->multi)
        srv_log(srv, "weights are now version %llu on all %d ranks (%llu bytes; switched in %.1f ms)",
              (unsigned long long)version, srv->world->size, (unsigned long long)bytes, fr_now_ms() - t0);
    else
        srv_log(srv, "weights are now version %llu (%llu bytes; switched in %.1f ms)", (unsigned long long)version,
              (unsigned long long)bytes, fr_now_ms() - t0);
    srv_send_update_reply(srv, srv->upd_peer, version, FR_UPD_COMMIT, -1, bytes);
}

/* Commits between engine steps (this loop never runs one meanwhile): the
 * session takes the staged weights, and every token drawn from now on
 * carries the new version. */
void srv_handle_update_commit(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv->upd && srv_nccl_end_message(srv, peer, version, 1)) return;
    fr_bridge_update *u = update_of(srv, peer, "update_weights_commit", version);
    if (!u) return;
    const char *code;
    if (fr_bridge_update_ready(u, &code)) {
        srv_fail_update(srv, peer, code);
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
        srv_fail_update(srv, peer, "update_failed");
        return;
    }
    srv_committed(srv, version, t0);
}

void srv_handle_update_abort(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv->upd && srv_nccl_end_message(srv, peer, version, 0)) return;
    fr_bridge_update *u = update_of(srv, peer, "update_weights_abort", version);
    if (!u) return;
    uint64_t bytes = fr_bridge_update_bytes(u);
    srv_drop_update(srv, "the client aborted it");
    srv_send_update_reply(srv, peer, version, FR_UPD_ABORT, -1, bytes);
}
