/* Weights over NCCL into a server of several ranks (docs/protocol.md,
 * "Weights over NCCL"; docs/tensor_parallel.md, "Weight sync into several
 * ranks"): the trainer's group holds it and every rank of every engine
 * (world rank w is NCCL rank w + 1), and each bucket is one broadcast that
 * every rank receives whole and keeps its shard of (rollout/engine/weight_recv.h).
 *
 * Rank 0 checks the client's messages as for one rank and passes each
 * accepted one to the other ranks as an engine event, as for every update
 * (server_weights.c; the unique id goes this way too, over MPI); every rank
 * polls its own receiver each turn and reports what it finished to rank 0
 * (OB_NCCL records), which answers a bucket once every rank has checked it
 * and ends the group when any rank's receive failed. The commit is every
 * update's (srv_commit_update, fr_weight_commit): all switch between the
 * same two steps, or none does. */
#include "trainer_bridge/server/server_internal.h"

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

/* Ends this rank's group, and its update over the group, without a word to
 * any client (rank 0 speaks). */
static void end_here(fr_bridge_server *srv)
{
    fr_weight_recv_destroy(&srv->ng);   /* first: its streams may still write into the update's stage */
    if (srv->upd_nccl) srv_end_update_here(srv);
}

/* A failure on this rank (fr_last_error): rank 0 hears of it and ends the
 * group everywhere. */
void srv_nccl_fail_here(fr_bridge_server *srv, const char *code)
{
    char msg[FR_PROTO_TEXT_MAX - 32];
    snprintf(msg, sizeof msg, "%s", fr_last_error());
    srv_log(srv, "rank %d: NCCL weight group: %s", srv->rank, msg);
    report(srv, 0, -1, code, msg);
    end_here(srv);
}

/* ---- rank 0: every rank's progress -------------------------------------- */

/* A new update over the group: no rank has checked a bucket of it. */
void srv_nccl_reset_acks(fr_bridge_server *srv)
{
    srv->ng_announced = srv->ng_replied = 0;
    if (srv->ng_acks) memset(srv->ng_acks, 0, sizeof *srv->ng_acks * (size_t)srv->world->size);
}

/* Rank `rank` checked bucket `bucket`: the client hears of each bucket once
 * every rank has. */
void srv_nccl_ack(fr_bridge_server *srv, int rank, int bucket)
{
    if (!srv->ng_acks || rank < 0 || rank >= srv->world->size) return;
    if (bucket + 1 > srv->ng_acks[rank]) srv->ng_acks[rank] = bucket + 1;
    int low = srv->ng_acks[0];
    for (int i = 1; i < srv->world->size; i++)
        if (srv->ng_acks[i] < low) low = srv->ng_acks[i];
    while (srv->ng && srv->upd && srv->upd_nccl && srv->ng_replied < low) {
        srv->upd_last_ms = fr_now_ms();
        srv_send_update_reply(srv, srv->ng_peer, fr_weight_update_version(srv->upd), FR_UPD_BUCKET, srv->ng_replied,
                              fr_weight_update_bytes(srv->upd));
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
    fr_status st = fr_weight_recv_new(id, nranks, srv->rank + 1, timeout_ms, &srv->ng);
    if (!st && srv->tp > 1)
        st = fr_weight_recv_set_shard(srv->ng, &srv->sess->model->cfg, srv->rank % srv->tp, srv->tp);
    if (st) fr_weight_recv_destroy(&srv->ng);
    if (srv->multi) srv_nccl_reset_acks(srv);
    return st;
}

/* The group's events of a turn, on every rank (server_ranks.c dispatches). */
void srv_nccl_apply(fr_bridge_server *srv, int ev, fr_rank_reader *r)
{
    if (ev == EV_NCCL_END) {
        if (srv->rank != 0) end_here(srv);
        return;
    }
    if (ev != EV_NCCL_INIT) {
        r->bad = 1;
        return;
    }
    size_t n = 0;
    const unsigned char *id = fr_rank_get_bytes(r, &n);
    const int nranks = fr_rank_get_i32(r), timeout_ms = fr_rank_get_i32(r);
    if (r->bad || n != FR_PROTO_NCCL_ID_BYTES) {
        r->bad = 1;
        return;
    }
    if (srv->rank == 0) return;   /* joined when the message came */
    end_here(srv);
    if (srv_nccl_join(srv, id, nranks, timeout_ms)) srv_nccl_fail_here(srv, "nccl_failed");
}

/* A rank other than 0, every turn: what its group finished, for rank 0. */
void srv_nccl_follower_turn(fr_bridge_server *srv)
{
    for (int k = 0; srv->ng && k < 64; k++) {
        int bucket = -1;
        fr_weight_refusal why = FR_WREF_NCCL_FAILED;
        const fr_weight_recv_event ev = fr_weight_recv_poll(srv->ng, &bucket, &why);
        if (ev == FR_WR_NOTHING) break;
        if (ev == FR_WR_BUCKET_OK) report(srv, 1, bucket, NULL, NULL);
        else if (ev != FR_WR_JOINED)
            srv_nccl_fail_here(srv, ev == FR_WR_GROUP_FAILED ? "nccl_failed" : fr_weight_refusal_name(why));
    }
}
