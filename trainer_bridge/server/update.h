/* The server's side of a weight update's messages (docs/protocol.md,
 * "update_weights", "Weights over NCCL"): what the wire decoded, in the
 * engine's terms (rollout/engine/weight_check.h), whose rules are the only
 * checks a begin or bucket passes; and the one check only the ZeroMQ
 * transport can make, that a bucket carries one payload frame per piece,
 * of the piece's length.
 *
 *     fr_weight_begin b;
 *     fr_bridge_begin_of(&msg.u.update_begin, &b);        // then fr_weight_update_declare
 *     fr_weight_bucket k;
 *     uint64_t xxh64;
 *     fr_bridge_bucket_of(&msg.u.update_bucket, wire, &k, &xxh64);   // then fr_weight_update_bucket
 *     free(b.tensors); free(k.pieces);
 *
 * The engine's refusals are named by the protocol's error codes
 * (fr_weight_refusal_name). */
#ifndef FR_BRIDGE_UPDATE_H
#define FR_BRIDGE_UPDATE_H

#include <stdint.h>

#include "rollout/engine/weight_check.h"
#include "trainer_bridge/protocol/protocol.h"
#include "trainer_bridge/protocol/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A begin's tensors as the engine's (out->tensors malloc'd, their names
 * pointing into b). */
fr_status fr_bridge_begin_of(const fr_msg_update_begin *b, fr_weight_begin *out);

/* A ZeroMQ bucket: one payload frame per piece, of its length (bad_bucket
 * otherwise, FR_EINVAL); its pieces as the engine's, each with its frame's
 * bytes, laid end to end; *xxh64 the xxHash64 (seed 0) of the payload
 * frames concatenated. out->pieces malloc'd (names and bytes pointing into
 * b and w). */
fr_status fr_bridge_bucket_of(const fr_msg_update_bucket *b, const fr_wire_msg *w, fr_weight_bucket *out,
                              uint64_t *xxh64);

/* An NCCL bucket's pieces as the engine's, in order (their bytes arrive on
 * the device). out->pieces malloc'd (names pointing into b). */
fr_status fr_bridge_nccl_bucket_of(const fr_msg_nccl_bucket *b, fr_weight_bucket *out);

#ifdef __cplusplus
}
#endif

#endif
