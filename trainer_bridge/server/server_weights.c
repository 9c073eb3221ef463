/* Weight updates (docs/protocol.md, "update_weights"): the messages of both
 * transports up to the engine (rollout/engine/weight_update.h, whose rules
 * check every begin and bucket), the same begin and buckets passed to the
 * other ranks of a job, and the one commit every path ends in. The NCCL
 * group and its buckets' transport are server_nccl.c's. */
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
    fr_weight_update **spare = fr_weight_update_is_shard(w) ? &srv->ng_spare : &srv->spare;
    fr_weight_update_free(spare);
    *spare = w;
}

/* The stage for an update: the one kept from the last update, else a new
 * one where the session keeps its weights (over NCCL on a tensor-parallel
 * rank: its shard only). NULL and fr_last_error when it cannot be made. */
static fr_weight_update *take_stage(fr_bridge_server *srv, uint64_t version, int nccl)
{
    const int shard = nccl && srv->tp > 1;
    fr_weight_update **spare = shard ? &srv->ng_spare : &srv->spare;
    fr_weight_update *w = *spare;
    *spare = NULL;
    if (!w && (shard ? fr_weight_update_begin_shard_for(srv->sess, version, &w)
                     : fr_weight_update_begin_for(srv->sess, version, &w)))
        return NULL;
    return w;
}

/* This rank begins the update b declares (every rank, both transports). */
static fr_status begin_here(fr_bridge_server *srv, const fr_weight_begin *b, int nccl, fr_weight_refusal *why)
{
    *why = FR_WREF_OUT_OF_MEMORY;
    if (nccl && !srv->ng) {
        *why = FR_WREF_NCCL_UNAVAILABLE;
        return fr_fail(FR_EINVAL, "update to version %llu: no NCCL weight group here", (unsigned long long)b->version);
    }
    fr_weight_update *w = take_stage(srv, b->version, nccl);
    fr_status st = w ? fr_weight_update_declare(w, b, why) : fr_fail(FR_ENOMEM, "%s", fr_last_error());
    if (!st && nccl && srv->rank != 0 && (st = fr_weight_recv_wait_joined(srv->ng))) *why = FR_WREF_NCCL_FAILED;
    if (!st && nccl) st = fr_weight_recv_begin(srv->ng, w, b->bucket_bytes, why);
    if (st) {
        srv_keep_spare(srv, w);
        return st;
    }
    srv->upd = w;
    srv->upd_nccl = nccl;
    srv->upd_failed = 0;
    return FR_OK;
}

/* This rank forgets its update (the stage kept for the next). Over NCCL
 * with a bucket still in flight the group ends too, before the stage is
 * kept: its receive cannot be taken back. */
void srv_end_update_here(fr_bridge_server *srv)
{
    fr_weight_update *w = srv->upd;
    const int nccl = srv->upd_nccl;
    srv->upd = NULL;
    srv->upd_nccl = srv->upd_failed = 0;
    srv->ng_commit = 0;
    if (nccl && srv->ng && fr_weight_recv_drop(srv->ng)) srv_nccl_lost(srv, "nccl_failed");
    srv_keep_spare(srv, w);
}

/* Drops the update in progress (the serving weights are untouched), on
 * every rank; why goes to the log. */
void srv_drop_update(fr_bridge_server *srv, const char *why)
{
    if (!srv->upd) return;
    srv_log(srv, "weight update to version %llu%s dropped: %s", (unsigned long long)fr_weight_update_version(srv->upd),
            srv->upd_nccl ? " over NCCL" : "", why);
    srv->updates_failed++;
    if (srv->multi) fr_rank_put_u8(&srv->events, EV_UPD_DROP);
    srv_end_update_here(srv);
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

/* 1 when the update in progress is peer's, to `version` (its last message
 * came now); else 0 after answering with update_state. */
int srv_update_of(fr_bridge_server *srv, int peer, const char *what, uint64_t version)
{
    if (!srv->upd) {
        srv_send_error(srv, peer, "update_state", 0, 0,
                       "%s for version %llu: no weight update is in progress (none began, or it was dropped)", what,
                       (unsigned long long)version);
        return 0;
    }
    if (srv->upd_peer != peer) {
        srv_send_error(srv, peer, "update_state", 0, 0, "%s: the update in progress belongs to another client", what);
        return 0;
    }
    if (fr_weight_update_version(srv->upd) != version) {
        srv_send_error(srv, peer, "update_state", 0, 0, "%s for version %llu: the update in progress is to version %llu",
                       what, (unsigned long long)version, (unsigned long long)fr_weight_update_version(srv->upd));
        return 0;
    }
    srv->upd_last_ms = fr_now_ms();
    return 1;
}

/* Whether a begin may replace what is in progress: one update at a time,
 * owned by the client that began it; a begin from anyone else is refused
 * and leaves it alone, the owner's own replaces it once the new version is
 * known to be acceptable. Answers the refusals. */
static int may_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
    fr_weight_refusal why;
    const long long max_frame = srv_max_message_bytes(&srv->cfg);
    if (srv->upd && srv->upd_peer != peer) {
        srv_send_error(srv, peer, "update_state", 0, 0,
                       "update_weights_begin (version %llu): another client's weight update is in progress; it "
                       "ends with its commit or abort, its client's departure, or weight_update_idle_s",
                       (unsigned long long)b->version);
    } else if (fr_weight_check_version(srv->weight_version, b->version, &why)) {
        srv_send_error(srv, peer, fr_weight_refusal_name(why), 0, 0, "%s", fr_last_error());
    } else if (!b->nccl && b->bucket_bytes > (uint64_t)max_frame) {
        /* its buckets' frames would be dropped with the connection */
        srv_send_error(srv, peer, "bad_bucket", 0, 0,
                       "update_weights_begin: bucket_bytes %llu exceeds the server's frame limit, "
                       "coordinator.max_message_bytes = %lld",
                       (unsigned long long)b->bucket_bytes, max_frame);
    } else {
        return 1;
    }
    srv->updates_failed++;
    return 0;
}

void srv_handle_update_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b)
{
    if (!may_begin(srv, peer, b)) return;
    if (srv->upd) {
        char why[160];
        snprintf(why, sizeof why, "a new update_weights_begin (version %llu) arrived", (unsigned long long)b->version);
        srv_drop_update(srv, why);
    }
    if (b->nccl && (!srv->ng || srv->ng_peer != peer)) {
        srv->updates_failed++;
        srv_send_error(srv, peer, "nccl_unavailable", 0, 0,
                       "update_weights_begin: transport nccl: this client has no NCCL weight group (nccl_group_init "
                       "first)");
        return;
    }
    fr_weight_begin wb;
    fr_weight_refusal why = FR_WREF_OUT_OF_MEMORY;
    fr_status st = fr_bridge_begin_of(b, &wb);
    if (!st) st = begin_here(srv, &wb, b->nccl, &why);
    if (st) {
        srv->updates_failed++;
        srv_send_error(srv, peer, fr_weight_refusal_name(why), 0, 0, "%s", fr_last_error());
        free(wb.tensors);
        return;
    }
    srv->upd_peer = peer;
    srv->upd_last_ms = srv->upd_begin_ms = fr_now_ms();
    if (srv->multi) {   /* every rank stages the same update */
        fr_rank_put_u8(&srv->events, EV_UPD_BEGIN);
        fr_rank_put_u8(&srv->events, (unsigned)(b->nccl != 0));
        fr_weight_begin_put(&srv->events, &wb);
        if (b->nccl) srv_nccl_reset_acks(srv);
    }
    free(wb.tensors);
    srv_log(srv, "weight update to version %llu%s begins: %d tensors%s, %llu bytes, buckets of %llu bytes, staged on "
            "the %s", (unsigned long long)b->version, b->nccl ? " over NCCL" : "", b->n_tensors,
            b->partial ? " (partial)" : "", (unsigned long long)b->total_bytes, (unsigned long long)b->bucket_bytes,
            fr_weight_update_on_device(srv->upd) ? "device" : "host");
    srv_send_update_reply(srv, peer, b->version, FR_UPD_BEGIN, -1, 0);
}

void srv_handle_update_bucket(fr_bridge_server *srv, int peer, const fr_msg_update_bucket *b, const fr_wire_msg *w)
{
    if (!srv_update_of(srv, peer, "update_weights_bucket", b->version)) return;
    if (srv->upd_nccl) {   /* answered, and the update over NCCL goes on */
        srv_send_error(srv, peer, "update_state", 0, 0, "update_weights_bucket: the update to version %llu takes its "
                       "buckets over NCCL (update_weights_nccl_bucket)", (unsigned long long)b->version);
        return;
    }
    fr_weight_bucket wb;
    uint64_t xxh64 = 0;
    fr_weight_refusal why = FR_WREF_BAD_BUCKET;
    fr_status st = fr_bridge_bucket_of(b, w, &wb, &xxh64);
    if (!st) st = fr_weight_update_bucket(srv->upd, &wb, &xxh64, &why);
    if (st) {
        srv_fail_update(srv, peer, st == FR_ENOMEM ? "out_of_memory" : fr_weight_refusal_name(why));
    } else {
        if (srv->multi) {   /* checked here; the other ranks stage the same pieces */
            fr_rank_put_u8(&srv->events, EV_UPD_BUCKET);
            fr_weight_bucket_put(&srv->events, &wb);
        }
        srv_send_update_reply(srv, peer, b->version, FR_UPD_BUCKET, b->bucket, fr_weight_update_bytes(srv->upd));
    }
    free(wb.pieces);
}

/* Rank 0: the commit goes ahead now (one rank) or at the start of the next
 * turn on every rank (the engine events). */
void srv_request_commit(fr_bridge_server *srv, uint64_t version)
{
    if (!srv->multi) {
        srv_commit_update(srv, version);
        return;
    }
    fr_rank_put_u8(&srv->events, EV_UPD_COMMIT);
    fr_rank_put_u64(&srv->events, version);
    srv->turn_barrier = 1;
}

void srv_handle_update_commit(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv_update_of(srv, peer, "update_weights_commit", version)) return;
    if (srv->upd_nccl) srv_nccl_commit_when_received(srv, version);
    else srv_request_commit(srv, version);
}

/* Rank 0, once every rank serves the new version. */
static void committed(fr_bridge_server *srv, uint64_t version, uint64_t bytes, int nccl, double t0)
{
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    fr_hist_add(&srv->update_seconds, srv->last_sync_s);
    char ranks[48] = "";
    if (srv->multi) snprintf(ranks, sizeof ranks, " on all %d ranks", srv->world->size);
    srv_log(srv, "weights are now version %llu%s%s (%llu bytes; switched in %.1f ms, %.3f s since the begin)",
            (unsigned long long)version, ranks, nccl ? ", over NCCL" : "", (unsigned long long)bytes,
            fr_now_ms() - t0, srv->last_sync_s);
    srv_send_update_reply(srv, srv->upd_peer, version, FR_UPD_COMMIT, -1, bytes);
}

/* The one commit of a weight update, for both transports, on every rank
 * (several ranks: in the same turn, fr_weight_commit's vote): between
 * engine steps (this loop runs none meanwhile) the session takes the
 * staged weights, and every token drawn from then on carries the new
 * version; or, when any rank cannot, none does and rank 0 answers why. */
void srv_commit_update(fr_bridge_server *srv, uint64_t version)
{
    fr_weight_update *u = srv->upd_failed ? NULL : srv->upd;
    const int nccl = srv->upd_nccl;
    const uint64_t bytes = fr_weight_update_bytes(u), old = srv->weight_version;
    const double t0 = fr_now_ms();
    fr_weight_refusal why = FR_WREF_FAILED;
    const fr_weight_switch sw = fr_weight_commit(srv->sess, u, version, srv->multi ? srv->world : NULL, &why);
    if (sw == FR_WEIGHTS_NO_VOTE) srv_comm_fatal(srv, "agreeing on a weight update");
    if (sw == FR_WEIGHTS_SWITCHED) {
        if (nccl) fr_weight_recv_finish(srv->ng);
        srv->weight_version = version;
        fr_scheduler_set_weight_version(srv->sch, version);
        srv->upd = NULL;
        srv->upd_nccl = 0;
        srv_keep_spare(srv, u);   /* now holding the previous weights */
        if (srv->rank == 0) committed(srv, version, bytes, nccl, t0);
        return;
    }
    char msg[FR_PROTO_TEXT_MAX - 64];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    if (sw == FR_WEIGHTS_SPLIT) {
        srv->fatal = fr_fail(FR_EIO, "serve: %s, so every rank stops", msg);
        srv_log(srv, "rank %d: %s", srv->rank, fr_last_error());
    }
    if (srv->rank != 0) {
        srv_log(srv, "rank %d: weight version %llu not switched: %s", srv->rank, (unsigned long long)version, msg);
        srv_end_update_here(srv);
        return;
    }
    if (sw == FR_WEIGHTS_KEPT) fr_fail(FR_EINVAL, "%s; version %llu keeps serving", msg, (unsigned long long)old);
    srv_fail_update(srv, srv->upd_peer, fr_weight_refusal_name(why));
}

/* Rank 0, every turn: an update with no message for weight_update_idle_s
 * is dropped (its trainer died or forgot it). */
void srv_drop_idle_update(fr_bridge_server *srv)
{
    if (!srv->upd || srv->cfg.update_idle_ms <= 0 || fr_now_ms() - srv->upd_last_ms <= srv->cfg.update_idle_ms) return;
    char why[96];
    snprintf(why, sizeof why, "nothing arrived for it in %d ms", srv->cfg.update_idle_ms);
    srv_drop_update(srv, why);
}

void srv_handle_update_abort(fr_bridge_server *srv, int peer, uint64_t version)
{
    if (!srv_update_of(srv, peer, "update_weights_abort", version)) return;
    const uint64_t bytes = fr_weight_update_bytes(srv->upd);
    srv_drop_update(srv, "the client aborted it");
    srv_send_update_reply(srv, peer, version, FR_UPD_ABORT, -1, bytes);
}

/* Ranks other than 0: a begin rank 0 accepted. */
static void apply_begin(fr_bridge_server *srv, fr_rank_reader *r)
{
    const int nccl = (int)fr_rank_get_u8(r);
    fr_weight_begin b;
    fr_status st = fr_weight_begin_get(r, &b);
    if (!r->bad && srv->rank != 0) {
        srv_end_update_here(srv);
        fr_weight_refusal why = FR_WREF_OUT_OF_MEMORY;
        if (!st) st = begin_here(srv, &b, nccl, &why);
        if (st) {
            srv_log(srv, "rank %d: cannot stage weight version %llu: %s", srv->rank, (unsigned long long)b.version,
                    fr_last_error());
            srv->upd_failed = 1;   /* this rank votes no at the commit */
            if (nccl && srv->ng) srv_nccl_fail_here(srv, fr_weight_refusal_name(why));
        }
    }
    free(b.tensors);
}

/* Ranks other than 0: a bucket rank 0 accepted, staged here through the
 * same rules (over NCCL its bytes come from the group). */
static void apply_bucket(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_weight_bucket b;
    fr_status st = fr_weight_bucket_get(r, &b);
    if (!r->bad && srv->rank != 0 && srv->upd && !srv->upd_failed) {
        fr_weight_refusal why = FR_WREF_OUT_OF_MEMORY;
        if (!st)
            st = srv->upd_nccl ? fr_weight_recv_bucket(srv->ng, &b, &why)
                               : fr_weight_update_bucket(srv->upd, &b, NULL, &why);
        if (st) {
            srv_log(srv, "rank %d: staging weight version %llu failed: %s", srv->rank,
                    (unsigned long long)fr_weight_update_version(srv->upd), fr_last_error());
            if (srv->upd_nccl) srv_nccl_fail_here(srv, fr_weight_refusal_name(why));
            else srv->upd_failed = 1;
        }
    }
    free(b.pieces);
}

void srv_apply_update(fr_bridge_server *srv, int ev, fr_rank_reader *r)
{
    switch (ev) {
    case EV_UPD_BEGIN: apply_begin(srv, r); return;
    case EV_UPD_BUCKET: apply_bucket(srv, r); return;
    case EV_UPD_DROP:
        if (srv->rank != 0) srv_end_update_here(srv);
        return;
    case EV_UPD_COMMIT: {
        const uint64_t v = fr_rank_get_u64(r);
        if (!r->bad) srv_commit_update(srv, v);
        return;
    }
    default: r->bad = 1; return;
    }
}
