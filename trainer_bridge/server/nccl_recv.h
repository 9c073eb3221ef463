/* The server's side of weights over NCCL (docs/protocol.md, "Weights over
 * NCCL"): the group a trainer made (the trainer is NCCL rank 0, this server
 * rank 1), and the update whose buckets arrive through it straight into the
 * engine's device stage (rollout/engine/weight_update.h), where ZeroMQ
 * buckets go too; the engine commits it. Built only with nvcc
 * (nccl_recv_cuda.c); one serving rank (world size 1, tp 1).
 *
 * Nothing here blocks on the trainer: joining is nonblocking NCCL, each
 * bucket's receive and unpacking are enqueued on streams of their own, and
 * fr_nccl_recv_poll, called every turn of the serve loop, reports what
 * finished. A group that makes no progress for timeout_ms while it has work
 * (joining, or a bucket announced and not received) is aborted
 * (ncclCommAbort): the serving weights never changed.
 *
 *     fr_nccl_recv *r;
 *     fr_nccl_recv_new(unique_id, 30000, &r);      // joins in the background
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

#define FR_NCCL_RECV_NRANKS 2   /* the trainer (rank 0) and this server (rank 1) */

/* Starts joining the group of unique_id as rank 1 of 2 (nonblocking). */
fr_status fr_nccl_recv_new(const unsigned char unique_id[FR_PROTO_NCCL_ID_BYTES], int timeout_ms,
                           fr_nccl_recv **out);

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
