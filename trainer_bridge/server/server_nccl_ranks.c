/* Weights over NCCL into a server of several ranks (docs/protocol.md,
 * "Weights over NCCL"; docs/tensor_parallel.md, "Weight sync into several
 * ranks"): the trainer's group holds it and every rank of every engine
 * (world rank w is NCCL rank w + 1), and each bucket is one broadcast that
 * every rank receives whole and keeps its shard of (nccl_recv.h).
 *
 * Rank 0 checks the client's messages as for one rank and passes each
 * accepted one to the other ranks as an engine event (the unique id goes
 * this way too, over MPI); every rank polls its own receiver each turn and
 * reports what it finished to rank 0 (OB_NCCL records), which answers a
 * bucket once every rank has checked it and ends the group when any rank's
 * receive failed. The commit is the ranks' vote and switch of ZeroMQ
 * updates (srv_switch_on_ranks): all switch between the same two steps, or
 * none does. */
#include "trainer_bridge/server/server_internal.h"

#ifdef FR_HAVE_CUDA

/* ---- the messages of an update, as engine events ------------------------ */

static void put_tensor(fr_rank_buf *e, const fr_msg_tensor *t)
{
    fr_rank_put_bytes(e, t->name, strlen(t->name));
    fr_rank_put_i32(e, (int)t->dtype);
    fr_rank_put_i32(e, t->ndim);
    for (int k = 0; k < t->ndim; k++) fr_rank_put_u64(e, (uint64_t)t->shape[k]);
}

static void get_tensor(fr_rank_reader *r, fr_msg_tensor *t)
{
    size_t n = 0;
    const char *name = fr_rank_get_bytes(r, &n);
    memset(t, 0, sizeof *t);
    t->dtype = (fr_dtype)fr_rank_get_i32(r);
    t->ndim = fr_rank_get_i32(r);
    if (r->bad || !name || n >= sizeof t->name || t->ndim < 1 || t->ndim > FR_PROTO_MAX_NDIM) {
        r->bad = 1;
        return;
    }
    memcpy(t->name, name, n);
    for (int k = 0; k < t->ndim; k++) t->shape[k] = (int64_t)fr_rank_get_u64(r);
}

void srv_nccl_put_begin(fr_bridge_server *srv, const fr_msg_update_begin *b)
{
    fr_rank_buf *e = &srv->events;
    fr_rank_put_u8(e, EV_NCCL_BEGIN);
    fr_rank_put_u64(e, b->version);
    fr_rank_put_u64(e, b->total_bytes);
    fr_rank_put_u64(e, b->bucket_bytes);
    fr_rank_put_u8(e, (unsigned)(b->partial != 0));
    fr_rank_put_i32(e, b->n_tensors);
    for (int i = 0; i < b->n_tensors; i++) put_tensor(e, &b->tensors[i]);
}

void srv_nccl_put_bucket(fr_bridge_server *srv, const fr_msg_nccl_bucket *b)
{
    fr_rank_buf *e = &srv->events;
    fr_rank_put_u8(e, EV_NCCL_BUCKET);
    fr_rank_put_u64(e, b->version);
    fr_rank_put_i32(e, b->bucket);
    fr_rank_put_u64(e, b->nbytes);
    fr_rank_put_u64(e, b->checksum);
    fr_rank_put_i32(e, b->n_pieces);
    for (int i = 0; i < b->n_pieces; i++) {
        put_tensor(e, &b->pieces[i].t);
        fr_rank_put_u64(e, b->pieces[i].offset);
        fr_rank_put_u64(e, b->pieces[i].nbytes);
        fr_rank_put_u64(e, b->pieces[i].at);
    }
}

/* ---- what a rank other than 0 reports ----------------------------------- */

/* A bucket this rank checked (ok), or the failure that ended its group. */
static void report(fr_bridge_server *srv, int ok, int bucket, const char *code, const char *msg)
{
    fr_rank_put_u8(&srv->outbox, OB_NCCL);
    fr_rank_put_i32(&srv->outbox, srv->rank);
    fr_rank_put_i32(&srv->outbox, srv->ng_gen);
    fr_rank_put_u8(&srv->outbox, (unsigned)ok);
    fr_rank_put_i32(&srv->outbox, bucket);
    fr_rank_put_bytes(&srv->outbox, code ? code : "nccl_failed", strlen(code ? code : "nccl_failed"));
    fr_rank_put_bytes(&srv->outbox, msg ? msg : "", strlen(msg ? msg : ""));
}

/* Ends this rank's group without a word to any client (rank 0 speaks). */
static void end_here(fr_bridge_server *srv)
{
    fr_nccl_recv_destroy(&srv->ng);
    srv_keep_spare(srv, srv->ng_upd);
    srv->ng_upd = NULL;
}

static void fail_here(fr_bridge_server *srv, const char *code)
{
    char msg[FR_PROTO_TEXT_MAX - 32];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    srv_log(srv, "rank %d: NCCL weight group: %s", srv->rank, msg);
    report(srv, 0, -1, code, msg);
    end_here(srv);
}

/* ---- rank 0: every rank's progress -------------------------------------- */

/* Rank `rank` checked bucket `bucket`: the client hears of each bucket once
 * every rank has. */
void srv_nccl_ack(fr_bridge_server *srv, int rank, int bucket)
{
    if (!srv->ng_acks || rank < 0 || rank >= srv->world->size) return;
    if (bucket + 1 > srv->ng_acks[rank]) srv->ng_acks[rank] = bucket + 1;
    int low = srv->ng_acks[0];
    for (int i = 1; i < srv->world->size; i++)
        if (srv->ng_acks[i] < low) low = srv->ng_acks[i];
    while (srv->ng && srv->ng_replied < low) {
        srv->upd_last_ms = fr_now_ms();
        srv_send_update_reply(srv, srv->ng_peer, fr_nccl_recv_version(srv->ng), FR_UPD_BUCKET, srv->ng_replied,
                              fr_nccl_recv_bytes(srv->ng));
        srv->ng_replied++;
    }
}

/* 1 when every rank has checked every bucket announced. */
int srv_nccl_all_acked(const fr_bridge_server *srv) { return srv->ng_replied == srv->ng_announced; }

/* A record of OB_NCCL from another rank (rank 0). */
void srv_nccl_take_report(fr_bridge_server *srv, fr_rank_reader *r)
{
    const int rank = fr_rank_get_i32(r), gen = fr_rank_get_i32(r);
    const int ok = (int)fr_rank_get_u8(r), bucket = fr_rank_get_i32(r);
    size_t nc = 0, nm = 0;
    const char *code = fr_rank_get_bytes(r, &nc), *msg = fr_rank_get_bytes(r, &nm);
    if (r->bad || gen != srv->ng_gen) return;   /* a report of a group that ended since */
    if (ok) {
        srv_nccl_ack(srv, rank, bucket);
        return;
    }
    char c[64], why[FR_PROTO_TEXT_MAX - 64];
    snprintf(c, sizeof c, "%.*s", (int)(nc < sizeof c ? nc : sizeof c - 1), code);
    snprintf(why, sizeof why, "rank %d: %.*s", rank, (int)(nm < sizeof why - 16 ? nm : sizeof why - 17), msg);
    if (srv->ng) srv_nccl_end(srv, why, c);
}

/* ---- every rank --------------------------------------------------------- */

/* Joins the group of unique id `id` as NCCL rank world rank + 1 of nranks;
 * a tensor-parallel rank keeps its shard of each piece. */
fr_status srv_nccl_join(fr_bridge_server *srv, const unsigned char *id, int nranks, int timeout_ms)
{
    srv->ng_gen++;   /* every rank counts the same joins, in the same order */
    fr_status st = fr_nccl_recv_new(id, nranks, srv->rank + 1, timeout_ms, &srv->ng);
    if (!st && srv->tp > 1) st = fr_nccl_recv_set_shard(srv->ng, &srv->sess->model->cfg, srv->rank % srv->tp, srv->tp);
    if (st) fr_nccl_recv_destroy(&srv->ng);
    srv->ng_announced = srv->ng_replied = 0;
    if (srv->ng_acks) memset(srv->ng_acks, 0, sizeof *srv->ng_acks * (size_t)srv->world->size);
    return st;
}

/* The stage an NCCL update fills: a tensor-parallel rank's own shard. */
fr_weight_update *srv_take_nccl_stage(fr_bridge_server *srv, uint64_t version)
{
    if (srv->tp <= 1) return srv_take_stage(srv, version);
    fr_weight_update *w = srv->ng_spare;
    srv->ng_spare = NULL;
    if (!w && fr_weight_update_begin_shard_for(srv->sess, version, &w)) return NULL;
    return w;
}

static void apply_begin(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_msg_update_begin b;
    memset(&b, 0, sizeof b);
    b.version = fr_rank_get_u64(r);
    b.total_bytes = fr_rank_get_u64(r);
    b.bucket_bytes = fr_rank_get_u64(r);
    b.partial = (int)fr_rank_get_u8(r);
    b.nccl = 1;
    b.n_tensors = fr_rank_get_i32(r);
    if (r->bad || b.n_tensors < 1 || b.n_tensors > FR_PROTO_MAX_TENSORS) {
        r->bad = 1;
        return;
    }
    b.tensors = calloc((size_t)b.n_tensors, sizeof *b.tensors);
    for (int i = 0; i < b.n_tensors && !r->bad; i++) {
        fr_msg_tensor tmp;   /* out of memory: read past it alike, so every rank stays in step */
        get_tensor(r, b.tensors ? &b.tensors[i] : &tmp);
    }
    if (!r->bad && srv->rank != 0 && srv->ng) {
        const char *code = "out_of_memory";
        fr_weight_update *w = b.tensors ? srv_take_nccl_stage(srv, b.version) : NULL;
        fr_status st = w ? fr_nccl_recv_wait_joined(srv->ng) : fr_fail(FR_ENOMEM, "out of memory staging an update");
        if (!st) st = fr_nccl_recv_begin(srv->ng, &b, w, &code);
        if (st) {
            srv_keep_spare(srv, w);
            fail_here(srv, code);
        } else {
            srv->ng_upd = w;
        }
    }
    free(b.tensors);
}

static void apply_bucket(fr_bridge_server *srv, fr_rank_reader *r)
{
    fr_msg_nccl_bucket b;
    memset(&b, 0, sizeof b);
    b.version = fr_rank_get_u64(r);
    b.bucket = fr_rank_get_i32(r);
    b.nbytes = fr_rank_get_u64(r);
    b.checksum = fr_rank_get_u64(r);
    b.n_pieces = fr_rank_get_i32(r);
    if (r->bad || b.n_pieces < 1 || (size_t)b.n_pieces > r->len) {
        r->bad = 1;
        return;
    }
    b.pieces = calloc((size_t)b.n_pieces, sizeof *b.pieces);
    for (int i = 0; i < b.n_pieces && !r->bad; i++) {
        fr_msg_piece tmp, *p = b.pieces ? &b.pieces[i] : &tmp;
        get_tensor(r, &p->t);
        p->offset = fr_rank_get_u64(r);
        p->nbytes = fr_rank_get_u64(r);
        p->at = fr_rank_get_u64(r);
    }
    if (!r->bad && srv->rank != 0 && srv->ng && fr_nccl_recv_updating(srv->ng)) {
        const char *code = "out_of_memory";
        if (!b.pieces) {
            fr_fail(FR_ENOMEM, "out of memory taking bucket %d", b.bucket);
            fail_here(srv, code);
        } else if (fr_nccl_recv_bucket(srv->ng, &b, &code)) {
            fail_here(srv, code);
        }
    }
    free(b.pieces);
}

/* update_weights_commit over NCCL on every rank: each votes whether it
 * holds every bucket, checked, and the whole update. */
static void commit_on_ranks(fr_bridge_server *srv, uint64_t version)
{
    int ready = 0;
    const char *code = "update_state";
    int ok = srv->ng && fr_nccl_recv_updating(srv->ng) && fr_nccl_recv_version(srv->ng) == version &&
             !fr_nccl_recv_ready(srv->ng, &ready, &code) && ready;
    if (!ok && srv->rank != 0)
        srv_log(srv, "rank %d: cannot commit weight version %llu over NCCL: %s", srv->rank, (unsigned long long)version,
                srv->ng ? fr_last_error() : "its group ended");
    const uint64_t bytes = srv->ng ? fr_nccl_recv_bytes(srv->ng) : 0, old = srv->weight_version;
    fr_weight_update *w = ok ? fr_nccl_recv_finish(srv->ng) : NULL;
    if (ok) srv->ng_upd = NULL;
    double t0 = 0;
    const int switched = srv_switch_on_ranks(srv, version, ok && w, w, &t0);
    srv_keep_spare(srv, w);
    if (!switched) {
        if (srv->rank == 0 && srv->ng) {   /* (a group that ended meanwhile already told its client) */
            char why[FR_PROTO_TEXT_MAX - 64];
            snprintf(why, sizeof why, "%s", srv->fatal ? fr_last_error() : "not every rank held it whole (their logs say why)");
            srv->updates_failed++;
            srv_log(srv, "weight update to version %llu over NCCL failed: %s; version %llu keeps serving",
                    (unsigned long long)version, why, (unsigned long long)old);
            srv_send_error(srv, srv->ng_peer, "update_failed", 0, 0, "update to version %llu: %s; version %llu keeps "
                           "serving", (unsigned long long)version, why, (unsigned long long)old);
        }
        if (srv->ng && fr_nccl_recv_updating(srv->ng)) {
            if (!fr_nccl_recv_drop(srv->ng)) {
                srv_keep_spare(srv, srv->ng_upd);
                srv->ng_upd = NULL;
            } else if (srv->rank == 0) {
                srv_nccl_end(srv, fr_last_error(), NULL);
            } else {
                end_here(srv);
            }
        }
        return;
    }
    if (srv->rank != 0) return;
    srv->updates_committed++;
    srv->last_sync_s = (fr_now_ms() - srv->upd_begin_ms) * 1e-3;
    fr_hist_add(&srv->update_seconds, srv->last_sync_s);
    srv_log(srv, "weights are now version %llu on all %d ranks, over NCCL (%llu bytes; switched in %.1f ms, %.3f s "
            "since the begin)", (unsigned long long)version, srv->world->size, (unsigned long long)bytes,
            fr_now_ms() - t0, srv->last_sync_s);
    srv_send_update_reply(srv, srv->ng_peer, version, FR_UPD_COMMIT, -1, bytes);
}

/* The NCCL events of a turn, on every rank (server_ranks.c dispatches). */
void srv_nccl_apply(fr_bridge_server *srv, int ev, fr_rank_reader *r)
{
    switch (ev) {
    case EV_NCCL_INIT: {
        size_t n = 0;
        const unsigned char *id = fr_rank_get_bytes(r, &n);
        const int nranks = fr_rank_get_i32(r), timeout_ms = fr_rank_get_i32(r);
        if (r->bad || n != FR_PROTO_NCCL_ID_BYTES) {
            r->bad = 1;
            return;
        }
        if (srv->rank == 0) return;   /* joined when the message came */
        end_here(srv);
        if (srv_nccl_join(srv, id, nranks, timeout_ms)) fail_here(srv, "nccl_failed");
        return;
    }
    case EV_NCCL_BEGIN: apply_begin(srv, r); return;
    case EV_NCCL_BUCKET: apply_bucket(srv, r); return;
    case EV_NCCL_COMMIT: {
        const uint64_t v = fr_rank_get_u64(r);
        if (!r->bad) commit_on_ranks(srv, v);
        return;
    }
    case EV_NCCL_DROP:
        if (srv->rank != 0 && srv->ng && fr_nccl_recv_updating(srv->ng)) {
            if (fr_nccl_recv_drop(srv->ng)) {
                fail_here(srv, "nccl_failed");
            } else {
                srv_keep_spare(srv, srv->ng_upd);
                srv->ng_upd = NULL;
            }
        }
        return;
    case EV_NCCL_END:
        if (srv->rank != 0) end_here(srv);
        return;
    default: r->bad = 1; return;
    }
}

/* A rank other than 0, every turn: what its group finished, for rank 0. */
void srv_nccl_follower_turn(fr_bridge_server *srv)
{
    for (int k = 0; srv->ng && k < 64; k++) {
        int bucket = -1;
        const char *code = "nccl_failed";
        fr_nr_event ev = fr_nccl_recv_poll(srv->ng, &bucket, &code);
        if (ev == FR_NR_NOTHING) break;
        if (ev == FR_NR_BUCKET_OK) report(srv, 1, bucket, NULL, NULL);
        else if (ev != FR_NR_JOINED) fail_here(srv, code ? code : "nccl_failed");
    }
}

#endif
