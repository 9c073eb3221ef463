/* An update's begin and buckets as records between the ranks of a job
 * (comm/rank_wire.h, docs/protocol.md "Serving on several ranks"): rank 0
 * passes every begin and bucket it accepted to the other ranks, which
 * stage them through the same rules and the same calls
 * (weight_update.h), whatever the transport. */
#ifndef FR_WEIGHT_WIRE_H
#define FR_WEIGHT_WIRE_H

#include "comm/rank_wire.h"
#include "rollout/engine/weight_check.h"

#ifdef __cplusplus
extern "C" {
#endif

void fr_weight_begin_put(fr_rank_buf *b, const fr_weight_begin *x);
/* x->tensors is malloc'd (the caller frees it); the names point into r's
 * bytes. FR_EFORMAT (r->bad set) when the record is malformed, FR_ENOMEM. */
fr_status fr_weight_begin_get(fr_rank_reader *r, fr_weight_begin *x);

/* Each piece's bytes travel too when it has them (ZeroMQ's buckets; an
 * NCCL bucket's bytes reach every rank over NCCL). */
void fr_weight_bucket_put(fr_rank_buf *b, const fr_weight_bucket *x);
/* x->pieces is malloc'd (the caller frees it); names and bytes point into
 * r's bytes. Failures as fr_weight_begin_get. */
fr_status fr_weight_bucket_get(fr_rank_reader *r, fr_weight_bucket *x);

#ifdef __cplusplus
}
#endif

#endif
