/* The server's side of weights over NCCL (docs/protocol.md, "Weights over
 * NCCL"): the group a trainer made (the trainer is NCCL rank 0, this server
 * rank 1), and the update whose buckets arrive through it straight into the
 * engine's device stage (rollout/engine/weight_update.h), where ZeroMQ
 * buckets go too; the engine commits it. Built only with nvcc
 * (nccl_recv_cuda.c). Every rank of a server of several ranks runs one
 * (server_nccl_ranks.c): the group is the trainer and all of them, each
 * bucket one broadcast, and a tensor-parallel rank keeps its shard only.
 *
 * Nothing here blocks on the trainer: joining is nonblocking NCCL, each
 * bucket's receive and unpacking are enqueued on streams of their own, and
 * fr_nccl_recv_poll, called every turn of the serve loop, reports what
 * finished. A group that makes no progress for timeout_ms while it has work
 * (joining, or a bucket announced and not received) is aborted
 * (ncclCommAbort): the serving weights never changed.
 *
 *     fr_nccl_recv *r;
 *     fr_nccl_recv_new(unique_id, 2, 1, 30000, &r); // joins in the background
 *     fr_nccl_recv_begin(r, &begin, staged, &code); // staged: fr_weight_update_begin_for(session, ...)
 *     fr_nccl_recv_bucket(r, &bucket, &code);      // each update_weights_nccl_bucket
 *     fr_nccl_recv_poll(r, &bucket, &code);        // every turn: joined, bucket checked, failures
 *     fr_nccl_recv_ready(r, &ready, &code);
 *     fr_session_commit_weights_move(session, fr_nccl_recv_finish(r));
 *     fr_nccl_recv_destroy(&r);
 *
 * Failures return a status with a readable message (fr_last_error) and set
 * *code to the protocol's error code. */
#ifndef FR_NCCL_RECV_H
#define FR_NCCL_RECV_H

#include <stdint.h>

#include "trainer_bridge/protocol/protocol.h"
#include "rollout/engine/weight_update.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_nccl_recv fr_nccl_recv;

/* Starts joining the group of unique_id as NCCL rank `rank` of `nranks`
 * (nonblocking): the trainer is rank 0, world rank w of the server is rank
 * w + 1 (one server rank: 1 of 2). */
fr_status fr_nccl_recv_new(const unsigned char unique_id[FR_PROTO_NCCL_ID_BYTES], int nranks, int rank,
                           int timeout_ms, fr_nccl_recv **out);

/* A tensor-parallel rank (tp_size > 1) of a model of config cfg (the whole
 * model's): each bucket's pieces are converted whole, checked, and only the
 * rank's part of each (rollout/engine/wsync_rank.h) is copied into its
 * stage, which must be a shard stage (fr_weight_update_begin_shard_for).
 * tp_size 1 (the default): pieces go straight into a whole-model stage. */
fr_status fr_nccl_recv_set_shard(fr_nccl_recv *r, const fr_model_config *cfg, int tp_rank, int tp_size);

/* Ends the group (ncclCommAbort: local, never waits on the trainer), waits
 * for this side's streams, frees everything; NULL-safe. */
void fr_nccl_recv_destroy(fr_nccl_recv **r);

typedef enum {
    FR_NR_NOTHING = 0,   /* nothing new */
    FR_NR_JOINED,        /* the group is up */
    FR_NR_BUCKET_OK,     /* *bucket was received, checked and staged */
    FR_NR_UPDATE_FAILED, /* the update failed (*code, fr_last_error): the group is no longer usable */
    FR_NR_GROUP_FAILED   /* an NCCL error or a timeout (fr_last_error): the group is no longer usable */
} fr_nr_event;

/* One event of what happened since the last call; call until
 * FR_NR_NOTHING. After FR_NR_UPDATE_FAILED or FR_NR_GROUP_FAILED the caller
 * destroys the group. */
fr_nr_event fr_nccl_recv_poll(fr_nccl_recv *r, int *bucket, const char **code);

int fr_nccl_recv_joined(const fr_nccl_recv *r);
/* Waits (up to the group's timeout) until this side has joined: a rank of
 * several, told of an update once rank 0 has joined, which every member's
 * join completes together but each notices on its own. */
fr_status fr_nccl_recv_wait_joined(fr_nccl_recv *r);
/* 1 while an update is begun and not committed or dropped. */
int fr_nccl_recv_updating(const fr_nccl_recv *r);
uint64_t fr_nccl_recv_version(const fr_nccl_recv *r);
/* 1 while a bucket is announced and not yet checked. */
int fr_nccl_recv_busy(const fr_nccl_recv *r);
uint64_t fr_nccl_recv_bytes(const fr_nccl_recv *r);    /* bytes checked and staged in this update */

/* Starts an update (the group must be joined) into staged, a device stage
 * of the engine's (borrowed until fr_nccl_recv_finish, a drop or destroy;
 * restarted to the begin's version, partial when the begin says so):
 * every declared tensor a weight of the model with its shape
 * (unknown_tensor, bad_shape). */
fr_status fr_nccl_recv_begin(fr_nccl_recv *r, const fr_msg_update_begin *b, fr_weight_update *staged,
                             const char **code);

/* The bucket the client announces: checked against the begin (version,
 * order, size, declared tensors with their dtype and shape, each tensor's
 * pieces in order: bad_piece), then its receive and unpacking are enqueued
 * (with two bucket buffers, bucket k + 2 waits until bucket k is checked).
 * A refused bucket fails the update. */
fr_status fr_nccl_recv_bucket(fr_nccl_recv *r, const fr_msg_nccl_bucket *b, const char **code);

/* Whether the update can commit now: 1 when every announced bucket is
 * checked; then FR_OK when every declared tensor and, unless the update is
 * partial, every weight of the model arrived whole (else missing_tensor).
 * 0 (and FR_OK) while buckets are still in flight. */
fr_status fr_nccl_recv_ready(fr_nccl_recv *r, int *ready, const char **code);

/* Ends the update once ready, handing back its stage for the engine's
 * commit (fr_session_commit_weights_move); NULL when none is ready. */
fr_weight_update *fr_nccl_recv_finish(fr_nccl_recv *r);

/* Drops the update in progress (the serving weights never changed). FR_OK
 * when no bucket was in flight; FR_EIO when one was: its receive cannot be
 * taken back, so the group is no longer usable (destroy it). */
fr_status fr_nccl_recv_drop(fr_nccl_recv *r);

#ifdef __cplusplus
}
#endif

#endif
