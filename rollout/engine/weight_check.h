/* The rules of a weight update, in one place: what a begin may declare,
 * what each bucket and piece must be, and when the update is whole
 * (docs/protocol.md, "update_weights", "Weights over NCCL"). Every path
 * a bucket takes, over ZeroMQ or NCCL, on one rank or several, is checked
 * here and only here; a refusal carries its reason (fr_weight_refusal,
 * whose names are the protocol's error codes) and one message naming the
 * update, the bucket and the tensor.
 *
 *     fr_weight_check *c;
 *     fr_weight_check_new(&cfg, &c);
 *     fr_weight_check_begin(c, &begin, &why);             // the declared tensors
 *     fr_weight_check_bucket(c, &bucket, &sum, &why);      // each bucket, in order (sum: NULL when its
 *     fr_weight_check_done(c, &bucket, &sum, -1, 0, &why); //   bytes come later, then done)
 *     fr_weight_check_ready(c, &why);                      // whole: the commit may go ahead
 *     fr_weight_check_free(&c);
 *
 * Bookkeeping only: the bytes are stored elsewhere (weight_update.h's
 * stage). A begun update that breaks a rule is failed for good (its
 * buckets, done and ready refuse); an open update (no list: tools and
 * tests that put tensors one by one) refuses a piece and stays usable. */
#ifndef FR_WEIGHT_CHECK_H
#define FR_WEIGHT_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Why an update was refused. */
typedef enum {
    FR_WREF_NONE = 0,
    FR_WREF_BAD_MESSAGE,    /* an argument no decoded message holds (a tensor declared twice, none) */
    FR_WREF_BAD_VERSION,    /* not above the version serving */
    FR_WREF_UNKNOWN_TENSOR, /* not a weight of the model, or not declared */
    FR_WREF_BAD_SHAPE,      /* not the model's (or the declared) shape */
    FR_WREF_BAD_DTYPE,      /* not the declared dtype, or not a weight dtype */
    FR_WREF_BAD_BUCKET,     /* no pieces, or more bytes than bucket_bytes */
    FR_WREF_BAD_CHECKSUM,   /* the bytes are not those the sender hashed */
    FR_WREF_NON_FINITE,     /* a NaN or infinity, or a value that rounds to infinity in BF16 */
    FR_WREF_BAD_PIECE,      /* off element bounds, outside its tensor or bucket, out of order, sent twice */
    FR_WREF_MISSING_TENSOR, /* at the commit: not every tensor (declared, or of the model) arrived whole */
    FR_WREF_UPDATE_STATE,   /* no update, another version, a bucket out of turn or still in flight */
    FR_WREF_OUT_OF_MEMORY,
    FR_WREF_FAILED,         /* storing or switching failed (the device, the ranks) */
    FR_WREF_NCCL_UNAVAILABLE, /* weights over NCCL cannot be received here (no device stage, no group yet) */
    FR_WREF_NCCL_FAILED     /* the bytes did not arrive: the NCCL group (or what stands in for it) failed */
} fr_weight_refusal;

/* The reason's name: "bad_shape", ... (the protocol's error codes). */
const char *fr_weight_refusal_name(fr_weight_refusal r);

/* Tensors and shapes have at most this many dimensions (the protocol's). */
#define FR_WEIGHT_MAX_NDIM 8

/* A tensor as an update names it: Hugging Face name, dtype, shape. */
typedef struct {
    const char *name;
    fr_dtype dtype;
    int ndim;
    int64_t shape[FR_WEIGHT_MAX_NDIM];
} fr_weight_tensor;

/* Bytes [offset, offset + nbytes) of tensor t's row-major data, starting
 * at byte `at` of its bucket. bytes: host memory holding them when they
 * travelled with the message (ZeroMQ, or a rank's copy), else NULL (they
 * arrive on the device). `tensor` is set by fr_weight_check_bucket: the
 * model tensor (rollout/model/tensor_table.h's order) the piece is of. */
typedef struct {
    fr_weight_tensor t;
    uint64_t offset, nbytes, at;
    const void *bytes;
    int tensor;
} fr_weight_piece;

/* One bucket of an update. in_order: the pieces of each tensor come in
 * order, each where the previous ended (NCCL); 0: in any order, no byte
 * twice (ZeroMQ). */
typedef struct {
    uint64_t version;
    int bucket;
    uint64_t nbytes;        /* the bucket's bytes: its pieces lie inside them, in increasing `at` */
    uint64_t checksum;      /* as the sender announced it */
    int in_order;
    fr_weight_piece *pieces;
    int n_pieces;
} fr_weight_bucket;

/* What a begin declares. */
typedef struct {
    uint64_t version;
    fr_weight_tensor *tensors;
    int n_tensors;
    uint64_t bucket_bytes;  /* the most bytes of one bucket */
    int partial;            /* 1: the model's other tensors keep their serving values */
} fr_weight_begin;

typedef struct fr_weight_check fr_weight_check;

/* The rules for a model of config cfg, with no update in progress. */
fr_status fr_weight_check_new(const fr_model_config *cfg, fr_weight_check **out);
void fr_weight_check_free(fr_weight_check **c);

/* The model's tensors: how many, the index of `name` (-1 when none), and
 * tensor i's name and shape (shape[1] is 1 for a 1-D tensor). */
int fr_weight_check_tensor_count(const fr_weight_check *c);
int fr_weight_check_find(const fr_weight_check *c, const char *name);
fr_status fr_weight_check_tensor(const fr_weight_check *c, int i, const char **name, int *ndim, int64_t shape[2]);

/* A new version must be above the one serving (bad_version). */
fr_status fr_weight_check_version(uint64_t serving, uint64_t version, fr_weight_refusal *why);

/* Starts an update (forgetting any other) to b's version: every declared
 * tensor a weight of the model, in a weight dtype, with the model's shape,
 * named once; bucket_bytes >= 1. On a refusal no update is in progress. */
fr_status fr_weight_check_begin(fr_weight_check *c, const fr_weight_begin *b, fr_weight_refusal *why);
/* Starts an open update to `version`: no list, any weight may come, its
 * dtype fixed by its first piece; partial off (fr_weight_check_set_partial). */
void fr_weight_check_open(fr_weight_check *c, uint64_t version);
void fr_weight_check_set_partial(fr_weight_check *c, int partial);
/* No update in progress (a committed or dropped one is forgotten). */
void fr_weight_check_end(fr_weight_check *c);

/* Accepts bucket b: the update's version, the next bucket number, at least
 * one piece and at most bucket_bytes; *checksum (when not NULL: the bytes
 * are here) equal to b->checksum; then every piece a declared tensor (an
 * open update: a weight of the model) with its dtype and shape, on element
 * bounds, inside its bucket after the pieces before it, inside its tensor,
 * in order (b->in_order) or overlapping no byte accepted before. Sets each
 * piece's `tensor`. Buckets may be accepted before earlier ones are done. */
fr_status fr_weight_check_bucket(fr_weight_check *c, fr_weight_bucket *b, const uint64_t *checksum,
                                 fr_weight_refusal *why);
/* The bytes of b, the oldest bucket accepted and not done, arrived and
 * were stored: *checksum (when not NULL) must equal b->checksum, and no
 * value may be bad (bad_piece >= 0: element bad_element of piece
 * bad_piece is NaN or infinite, or rounds to infinity in BF16); then b's
 * pieces count as received. */
fr_status fr_weight_check_done(fr_weight_check *c, const fr_weight_bucket *b, const uint64_t *checksum, int bad_piece,
                               uint64_t bad_element, fr_weight_refusal *why);
/* Takes back b, the last bucket accepted, which was not stored (an open
 * update's piece that could not be): its bytes count as never sent. */
void fr_weight_check_unaccept(fr_weight_check *c, const fr_weight_bucket *b);
/* A failure found outside these rules (the device, memory, the transport)
 * fails the update: records `r` and returns st, keeping the message. */
fr_status fr_weight_check_fail(fr_weight_check *c, fr_weight_refusal r, fr_status st, fr_weight_refusal *why);

/* FR_OK when the update can commit: every bucket accepted is done, every
 * declared tensor arrived whole and, unless partial, every tensor of the
 * model was declared (missing_tensor names the first that was not);
 * update_state when no update is in progress, it failed, or a bucket is
 * still in flight. */
fr_status fr_weight_check_ready(const fr_weight_check *c, fr_weight_refusal *why);

int fr_weight_check_updating(const fr_weight_check *c);
int fr_weight_check_buckets(const fr_weight_check *c);       /* buckets accepted: the next one's number */
int fr_weight_check_in_flight(const fr_weight_check *c);     /* buckets accepted and not done */
int fr_weight_check_partial(const fr_weight_check *c);
uint64_t fr_weight_check_version_of(const fr_weight_check *c);
uint64_t fr_weight_check_bytes(const fr_weight_check *c);    /* bucket bytes done so far */
/* 1 when bytes of model tensor i arrived in this update. */
int fr_weight_check_received(const fr_weight_check *c, int i);

#ifdef __cplusplus
}
#endif

#endif
