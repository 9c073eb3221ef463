/* The engine's side of weights over NCCL (docs/protocol.md, "Weights over
 * NCCL"): the group a trainer made (comm/weight_group.h; the trainer is
 * rank 0, world rank w of the server rank w + 1), and the buckets that
 * arrive through it straight into the device stage of a weight update
 * (weight_update.h), under the same rules as every other path: each bucket
 * is planned when announced (fr_weight_update_plan) and recorded done once
 * its bytes were checked on the device (fr_weight_update_done). The commit
 * is fr_weight_commit's. A tensor-parallel rank keeps only its shard of
 * each piece (wsync_rank.h). Built with nvcc (weight_recv_cuda.c); without
 * CUDA, fr_weight_recv_new answers that the build has none
 * (weight_recv_nocuda.c).
 *
 * Nothing here blocks on the trainer: joining is nonblocking NCCL, each
 * bucket's receive and unpacking are enqueued on streams of their own, and
 * fr_weight_recv_poll, called every turn of the serve loop, reports what
 * finished. A group that makes no progress for timeout_ms while it has work
 * (joining, or a bucket announced and not received) fails; the caller then
 * destroys it (ncclCommAbort): the serving weights never changed.
 *
 *     fr_weight_recv *r;
 *     fr_weight_recv_new(unique_id, 2, 1, 30000, &r);  // joins in the background
 *     fr_weight_update_declare(u, &begin, &why);       // u: fr_weight_update_begin_for(session, ...)
 *     fr_weight_recv_begin(r, u, bucket_bytes, &why);  // u is borrowed until finish, drop or destroy
 *     fr_weight_recv_bucket(r, &bucket, &why);         // each update_weights_nccl_bucket
 *     fr_weight_recv_poll(r, &bucket, &why);           // every turn: joined, bucket checked, failures
 *     fr_weight_commit(session, u, version, world, &why);   // once u is ready
 *     fr_weight_recv_finish(r);
 *     fr_weight_recv_destroy(&r); */
#ifndef FR_WEIGHT_RECV_H
#define FR_WEIGHT_RECV_H

#include <stdint.h>

#include "rollout/engine/weight_update.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_WEIGHT_RECV_ID_BYTES 128   /* the group's unique id (comm/weight_group.h) */

typedef struct fr_weight_recv fr_weight_recv;

/* Starts joining the group of unique_id as NCCL rank `rank` of `nranks`
 * (nonblocking). FR_EUNSUPPORTED in a build without CUDA. */
fr_status fr_weight_recv_new(const unsigned char unique_id[FR_WEIGHT_RECV_ID_BYTES], int nranks, int rank,
                             int timeout_ms, fr_weight_recv **out);

/* A tensor-parallel rank (tp_size > 1) of a model of config cfg (the whole
 * model's): each bucket's pieces are converted whole, checked, and only the
 * rank's part of each is copied into its stage, which must be a shard
 * stage (fr_weight_update_begin_shard_for). tp_size 1 (the default):
 * pieces go straight into a whole-model stage. */
fr_status fr_weight_recv_set_shard(fr_weight_recv *r, const fr_model_config *cfg, int tp_rank, int tp_size);

/* Ends the group (ncclCommAbort: local, never waits on the trainer), waits
 * for this side's streams, frees everything; NULL-safe. */
void fr_weight_recv_destroy(fr_weight_recv **r);

typedef enum {
    FR_WR_NOTHING = 0,   /* nothing new */
    FR_WR_JOINED,        /* the group is up */
    FR_WR_BUCKET_OK,     /* *bucket was received, checked and staged */
    FR_WR_UPDATE_FAILED, /* the update failed (*why, fr_last_error): the group is no longer usable */
    FR_WR_GROUP_FAILED   /* an NCCL error or a timeout (fr_last_error): the group is no longer usable */
} fr_weight_recv_event;

/* One event of what happened since the last call; call until
 * FR_WR_NOTHING. After FR_WR_UPDATE_FAILED or FR_WR_GROUP_FAILED the
 * caller destroys the group. */
fr_weight_recv_event fr_weight_recv_poll(fr_weight_recv *r, int *bucket, fr_weight_refusal *why);

int fr_weight_recv_joined(const fr_weight_recv *r);
/* Waits (up to the group's timeout) until this side has joined: a rank of
 * several, told of an update once rank 0 has joined, which every member's
 * join completes together but each notices on its own. */
fr_status fr_weight_recv_wait_joined(fr_weight_recv *r);
/* 1 while a bucket is announced and not yet checked. */
int fr_weight_recv_busy(const fr_weight_recv *r);

/* Takes u, a device stage with the begin declared, for the update's
 * buckets (the group must be joined, no bucket of an earlier update in
 * flight: nccl_unavailable, update_state), with two bucket buffers of
 * bucket_bytes. */
fr_status fr_weight_recv_begin(fr_weight_recv *r, fr_weight_update *u, uint64_t bucket_bytes, fr_weight_refusal *why);

/* The bucket the client announces: planned in the update (its rules), then
 * its receive and unpacking enqueued (with two bucket buffers, bucket
 * k + 2 waits until bucket k is checked). A refused bucket fails the
 * update. b's pieces are copied. */
fr_status fr_weight_recv_bucket(fr_weight_recv *r, fr_weight_bucket *b, fr_weight_refusal *why);

/* Lets go of the update after its commit (nothing in flight). */
void fr_weight_recv_finish(fr_weight_recv *r);

/* Drops the update in progress (the serving weights never changed). FR_OK
 * when no bucket was in flight; FR_EIO when one was: its receive cannot be
 * taken back, so the group is no longer usable (destroy it, before the
 * update's stage is used again). */
fr_status fr_weight_recv_drop(fr_weight_recv *r);

#ifdef __cplusplus
}
#endif

#endif
