/* One rank's side of a weight update whose buckets reach every rank of every
 * engine whole: the trainer broadcasts each bucket once to a group of
 * itself and all the server's ranks (docs/protocol.md, "Weights over NCCL";
 * docs/tensor_parallel.md, "Weight sync into several ranks"), and each rank
 * keeps only its tensor-parallel shard of every piece as the bucket arrives
 * (rollout/model/tp_piece.h). No rank holds the whole model: a bucket at a
 * time, then only its shard.
 *
 * This is the rank logic, the same for every transport and backend: the
 * checks of each bucket against the begin (order, sizes, pieces of each
 * tensor in order), the blocks of each piece the rank keeps, the record of
 * what arrived, and whether the update is whole. The bytes move elsewhere:
 * fr_wsync_rank_plan and fr_wsync_rank_blocks hand each block to the caller (the CUDA receiver
 * copies it device to device), and fr_wsync_rank_bucket does the whole
 * bucket on the host through a transport (the CPU tests; an in-process fake
 * or MPI broadcast stands in for NCCL). The commit is the caller's, after
 * every rank voted that it holds the whole update (fr_mpi_world_all_ok):
 * all switch, or none does.
 *
 *     fr_wsync_rank *r;
 *     fr_wsync_rank_new(&cfg, tp_rank, tp, 1, &r);     // 1: stage the shard on the host
 *     fr_wsync_rank_begin(r, version, tensors, n, bucket_bytes, partial);
 *     fr_wsync_rank_bucket(r, &bucket, &transport);    // each bucket, in order
 *     fr_wsync_rank_ready(r);                          // FR_OK: whole; then vote, then commit
 *     fr_wsync_rank_destroy(&r);
 *
 * Failures return a status with a message naming the bucket and tensor and
 * set the update's fault (fr_wsync_rank_fault); a failed update takes no
 * more buckets and is never ready. */
#ifndef FR_WSYNC_RANK_H
#define FR_WSYNC_RANK_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"
#include "rollout/model/model.h"
#include "rollout/model/tp_piece.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor the begin declares: a Hugging Face name, the dtype it travels
 * in, its whole shape (cols 0 for 1-D). */
typedef struct {
    const char *name;
    fr_dtype dtype;
    int64_t rows, cols;
} fr_wsync_tensor;

/* A piece of bucket: bytes [offset, offset + nbytes) of declared tensor
 * `tensor`'s row-major data, at byte `at` of the bucket. */
typedef struct {
    int tensor;
    uint64_t offset, nbytes, at;
} fr_wsync_piece;

typedef struct {
    int bucket;
    uint64_t nbytes, checksum;   /* checksum: comm/dev_checksum.h's, of the nbytes */
    const fr_wsync_piece *pieces;
    int n_pieces;
} fr_wsync_bucket;

/* Delivers bucket `bucket`'s nbytes bytes into buf (host memory), the
 * same bytes on every rank. A failure (the trainer is gone) fails the
 * update. */
typedef struct {
    fr_status (*recv)(void *ctx, int bucket, void *buf, size_t nbytes);
    void *ctx;
} fr_wsync_transport;

typedef enum {
    FR_WSYNC_OK = 0,
    FR_WSYNC_BAD_TENSOR,   /* begin: not a weight of the model, or not its shape */
    FR_WSYNC_BAD_BUCKET,   /* a bucket out of order, too large, pieces outside it or out of order */
    FR_WSYNC_BAD_CHECKSUM, /* the bytes received are not those announced */
    FR_WSYNC_NON_FINITE,   /* a NaN or infinity */
    FR_WSYNC_TRANSPORT,    /* the bytes did not arrive */
    FR_WSYNC_MISSING,      /* not every tensor arrived whole */
    FR_WSYNC_NO_MEMORY
} fr_wsync_fault;

typedef struct fr_wsync_rank fr_wsync_rank;

/* Rank tp_rank of an engine of tp_size ranks serving a model of config cfg.
 * host_stage: keep the shard in float32 host memory (fr_wsync_rank_bucket,
 * fr_wsync_rank_local); 0 for a caller that moves the bytes itself. */
fr_status fr_wsync_rank_new(const fr_model_config *cfg, int tp_rank, int tp_size, int host_stage,
                            fr_wsync_rank **out);
void fr_wsync_rank_destroy(fr_wsync_rank **r);

/* Starts an update to `version` (drops one in progress): every declared
 * tensor a weight of the model with the model's shape, names distinct;
 * buckets of at most bucket_bytes. partial: tensors not declared keep
 * their serving values. */
fr_status fr_wsync_rank_begin(fr_wsync_rank *r, uint64_t version, const fr_wsync_tensor *tensors, int n,
                              uint64_t bucket_bytes, int partial);

/* One block this rank keeps of a piece: bytes from src_at of the bucket
 * (rect.src and the pitches count elements of dtype), into the rank's copy
 * of model tensor `model_tensor` (fr_model_tensor_list's order) at
 * rect.dst elements of float32 or BF16, whatever the stage holds. */
typedef struct {
    int model_tensor;
    fr_dtype dtype;
    uint64_t src_at;
    fr_tp_rect rect;
    const fr_tp_part *part;
} fr_wsync_block;

typedef fr_status (*fr_wsync_block_fn)(void *user, const fr_wsync_block *blk);

/* Accepts bucket b for receiving after checking it against the begin and
 * the buckets accepted before it (the next bucket, at most bucket_bytes,
 * pieces inside it in increasing `at` without overlap, offsets and sizes
 * multiples of the dtype's size, each tensor's pieces in order from byte
 * 0). Several buckets may be accepted before the first is done (a
 * receiver overlapping them). */
fr_status fr_wsync_rank_plan(fr_wsync_rank *r, const fr_wsync_bucket *b);

/* Calls fn for every block this rank keeps of accepted bucket b, in order
 * (a caller that moves the bytes itself, once they are there). */
fr_status fr_wsync_rank_blocks(const fr_wsync_rank *r, const fr_wsync_bucket *b, fr_wsync_block_fn fn, void *user);

/* The bytes of the oldest accepted bucket, b, arrived and were checked
 * (ok 1): its pieces count as received; ok 0: the update fails with
 * `fault`. */
fr_status fr_wsync_rank_bucket_done(fr_wsync_rank *r, const fr_wsync_bucket *b, int ok, fr_wsync_fault fault);

/* The whole bucket on the host (a rank made with host_stage): plan,
 * receive through t, check the checksum, convert this rank's blocks to
 * float32 into its shard (every value finite), record. */
fr_status fr_wsync_rank_bucket(fr_wsync_rank *r, const fr_wsync_bucket *b, const fr_wsync_transport *t);

/* FR_OK when the update can commit: not failed, no accepted bucket still
 * in flight, every declared tensor whole, and, unless partial, every weight of the model declared
 * (FR_EINVAL naming the first missing tensor). */
fr_status fr_wsync_rank_ready(const fr_wsync_rank *r);

fr_wsync_fault fr_wsync_rank_fault(const fr_wsync_rank *r);
uint64_t fr_wsync_rank_version(const fr_wsync_rank *r);
uint64_t fr_wsync_rank_bytes_received(const fr_wsync_rank *r);  /* bucket bytes checked so far */
uint64_t fr_wsync_rank_bytes_kept(const fr_wsync_rank *r);      /* of them, elements kept x 4 (host stage) */
/* 1 when model tensor i was declared in this update. */
int fr_wsync_rank_touched(const fr_wsync_rank *r, int i);

/* The host stage's copy of model tensor i: this rank's part of it, float32,
 * row-major (*part says which); NULL without a host stage. */
const float *fr_wsync_rank_local(const fr_wsync_rank *r, int i, const fr_tp_part **part);

#ifdef __cplusplus
}
#endif

#endif
