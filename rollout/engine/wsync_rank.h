/* One rank's cut of a weight update whose buckets reach every rank of every
 * engine whole: the trainer broadcasts each bucket once to a group of
 * itself and all the server's ranks (docs/protocol.md, "Weights over NCCL";
 * docs/tensor_parallel.md, "Weight sync into several ranks"), and each rank
 * keeps only its tensor-parallel shard of every piece as the bucket arrives
 * (rollout/model/tp_piece.h). No rank holds the whole model: a bucket at a
 * time, then only its shard.
 *
 * Which buckets and pieces are acceptable, and when the update is whole,
 * are the rules of weight_check.h, the same for every path; this is which
 * blocks of each accepted piece the rank keeps. The bytes move elsewhere:
 * fr_wsync_rank_blocks hands each block to the caller (the NCCL receiver
 * copies it device to device), and fr_wsync_rank_bucket does a whole
 * bucket on the host through a transport (the CPU tests: an in-process
 * fake or an MPI broadcast stands in for NCCL). The commit is the
 * caller's, after every rank voted that it holds the whole update
 * (fr_weight_commit): all switch, or none does.
 *
 *     fr_weight_check *rules;                          // the update's rules
 *     fr_wsync_rank *r;
 *     fr_wsync_rank_new(&cfg, tp_rank, tp, 1, &r);     // 1: stage the shard on the host
 *     fr_weight_check_begin(rules, &begin, &why);
 *     fr_wsync_rank_bucket(r, rules, &bucket, &transport, &why);   // each bucket, in order
 *     fr_weight_check_ready(rules, &why);              // FR_OK: whole; then vote, then commit
 *     fr_wsync_rank_destroy(&r); */
#ifndef FR_WSYNC_RANK_H
#define FR_WSYNC_RANK_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"
#include "rollout/engine/weight_check.h"
#include "rollout/model/model.h"
#include "rollout/model/tp_piece.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Delivers bucket `bucket`'s nbytes bytes into buf (host memory), the
 * same bytes on every rank. A failure (the trainer is gone) fails the
 * update. */
typedef struct {
    fr_status (*recv)(void *ctx, int bucket, void *buf, size_t nbytes);
    void *ctx;
} fr_wsync_transport;

typedef struct fr_wsync_rank fr_wsync_rank;

/* Rank tp_rank of an engine of tp_size ranks serving a model of config cfg.
 * host_stage: keep the shard in float32 host memory (fr_wsync_rank_bucket,
 * fr_wsync_rank_local); 0 for a caller that moves the bytes itself. */
fr_status fr_wsync_rank_new(const fr_model_config *cfg, int tp_rank, int tp_size, int host_stage,
                            fr_wsync_rank **out);
void fr_wsync_rank_destroy(fr_wsync_rank **r);

/* One block this rank keeps of piece `piece` of a bucket: bytes from
 * src_at of the bucket (rect.src and the pitches count elements of dtype),
 * into the rank's copy of model tensor `model_tensor` (fr_model_tensor_list's
 * order) at rect.dst elements of float32 or BF16, whatever the stage holds. */
typedef struct {
    int model_tensor;
    int piece;
    fr_dtype dtype;
    uint64_t src_at;
    fr_tp_rect rect;
    const fr_tp_part *part;
} fr_wsync_block;

typedef fr_status (*fr_wsync_block_fn)(void *user, const fr_wsync_block *blk);

/* Calls fn for every block this rank keeps of bucket b, in order; b's
 * pieces were accepted by the rules (each piece's `tensor` is set). */
fr_status fr_wsync_rank_blocks(const fr_wsync_rank *r, const fr_weight_bucket *b, fr_wsync_block_fn fn, void *user);

/* The whole bucket on the host (a rank made with host_stage): accepted by
 * `rules`, received through t (a refused bucket is still received, so
 * every rank takes the same bytes off the transport and the group stays
 * in step), its checksum (comm/dev_checksum.h) checked, this rank's blocks
 * converted to float32 into its shard (every value finite), recorded done.
 * A refusal (*why) fails the update. */
fr_status fr_wsync_rank_bucket(fr_wsync_rank *r, fr_weight_check *rules, fr_weight_bucket *b,
                               const fr_wsync_transport *t, fr_weight_refusal *why);

uint64_t fr_wsync_rank_bytes_kept(const fr_wsync_rank *r);      /* elements kept x 4 (host stage) */

/* The host stage's copy of model tensor i: this rank's part of it, float32,
 * row-major (*part says which); NULL without a host stage. */
const float *fr_wsync_rank_local(const fr_wsync_rank *r, int i, const fr_tp_part **part);

#ifdef __cplusplus
}
#endif

#endif
