/* The server's side of update_weights (docs/protocol.md): the messages of
 * one update decoded and checked against what its begin declared and
 * against the model, their pieces forwarded to the engine's staging
 * (rollout/engine/weight_update.h), which stores them where the engine
 * keeps its weights.
 *
 *     fr_weight_update *staged;                                // the engine's
 *     fr_weight_update_begin_for(session, version, &staged);   // or an earlier update's, kept
 *     fr_bridge_update *u;
 *     const char *code;
 *     fr_bridge_update_begin(staged, &begin, &u, &code);       // u owns staged now
 *     fr_bridge_update_bucket(u, &bucket, &wire_msg, &code);   // each bucket, in order
 *     fr_bridge_update_ready(u, &code);                        // then commit the staged weights
 *     fr_bridge_update_free(&u);
 *
 * Every failure returns a status whose message names the tensor and the
 * check, and sets *code to the protocol's error code: unknown_tensor,
 * bad_shape, bad_dtype, bad_bucket, bad_checksum, non_finite, bad_piece,
 * missing_tensor, update_state, out_of_memory. After a failure the caller
 * drops the update (the protocol does); nothing here touches the session. */
#ifndef FR_BRIDGE_UPDATE_H
#define FR_BRIDGE_UPDATE_H

#include <stdint.h>

#include "trainer_bridge/protocol/protocol.h"
#include "rollout/engine/weight_update.h"
#include "trainer_bridge/protocol/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_bridge_update fr_bridge_update;

/* Checks the declared tensors against the model (every name a weight of
 * it, every shape the model's), then takes staged over (restarted to the
 * begin's version, partial when the begin says so). On failure staged stays
 * the caller's and is unchanged. */
fr_status fr_bridge_update_begin(fr_weight_update *staged, const fr_msg_update_begin *b, fr_bridge_update **out,
                                 const char **code);

/* One bucket with its payload frames (w's payload): the version and bucket
 * index expected, one frame per piece of exactly its length, at most
 * bucket_bytes in all, the xxHash64 of the payload, every piece a declared
 * tensor with its declared dtype and shape, every value finite; then the
 * pieces are staged. */
fr_status fr_bridge_update_bucket(fr_bridge_update *u, const fr_msg_update_bucket *b, const fr_wire_msg *w,
                                  const char **code);

/* Whether every declared tensor arrived whole and, unless the update is
 * partial, every tensor of the model (missing_tensor names the first one
 * that did not). */
fr_status fr_bridge_update_ready(const fr_bridge_update *u, const char **code);

fr_weight_update *fr_bridge_update_staged(fr_bridge_update *u);
/* Detaches the staged update from u (for reuse as a spare; u keeps its
 * counters but stages nothing more); the caller owns the result. */
fr_weight_update *fr_bridge_update_release_staged(fr_bridge_update *u);
uint64_t fr_bridge_update_version(const fr_bridge_update *u);
uint64_t fr_bridge_update_bytes(const fr_bridge_update *u);     /* payload bytes staged */
int fr_bridge_update_next_bucket(const fr_bridge_update *u);    /* buckets accepted so far */

void fr_bridge_update_free(fr_bridge_update **u);

/* The xxHash64 (seed 0) of the payload frames of w, concatenated. */
uint64_t fr_bridge_payload_xxh64(const fr_wire_msg *w);

/* The checks both weight paths (ZeroMQ here, NCCL in nccl_recv.h) make, with
 * one wording: a declared tensor t against the model's shape (ndim 1 or 2),
 * and a bucket's piece against the tensor its begin declared (dtype, shape).
 * On a mismatch *code is bad_shape or bad_dtype. */
fr_status fr_bridge_check_model_shape(const fr_msg_tensor *t, int ndim, const int64_t *shape, uint64_t version,
                                      const char **code);
fr_status fr_bridge_check_piece(const fr_msg_tensor *piece, const fr_msg_tensor *declared, uint64_t version,
                                int bucket, const char **code);

#ifdef __cplusplus
}
#endif

#endif
