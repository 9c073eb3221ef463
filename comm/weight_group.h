/* A trainer's NCCL weight group (docs/protocol.md, "Weights over NCCL"): the
 * trainer, rank 0 and the only sender, and every rank of a server, joined
 * with the unique id the trainer made; each bucket of a weight update is
 * one broadcast from rank 0. Both ends use this: the client library's
 * sender (trainer_bridge/client/client_nccl.c) and the engine's receiver
 * (rollout/engine/weight_recv_cuda.c). Built only with nvcc.
 *
 * Joining and broadcasting are nonblocking NCCL: a call may return while
 * NCCL is still at it (*in_progress); fr_weight_group_state says when it is
 * done, so a serve loop never blocks on a trainer that died. */
#ifndef FR_WEIGHT_GROUP_H
#define FR_WEIGHT_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "comm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_WEIGHT_GROUP_ID_BYTES 128   /* an NCCL unique id (ncclUniqueId) */

typedef struct fr_weight_group fr_weight_group;

/* A new unique id, for the trainer to hand to the server. */
fr_comm_status fr_weight_group_unique_id(unsigned char id[FR_WEIGHT_GROUP_ID_BYTES]);
/* Starts joining the group of `id` as rank `rank` of `nranks` on the
 * current device (nonblocking). */
fr_comm_status fr_weight_group_join(const unsigned char id[FR_WEIGHT_GROUP_ID_BYTES], int nranks, int rank,
                                    fr_weight_group **out);
/* FR_COMM_OK and *in_progress 1 while joining or enqueueing a call, 0 when
 * done; FR_COMM_ENCCL when the group failed (an NCCL error of its own or
 * of a peer, "<what> failed: ..."): it is then unusable. */
fr_comm_status fr_weight_group_state(fr_weight_group *g, int *in_progress, const char *what);
/* Waits (polling) until nothing is in progress, up to deadline_ms
 * (base/clock.h's fr_now_ms); FR_COMM_ETIMEOUT past it. `what` names the
 * wait in the message. */
fr_comm_status fr_weight_group_wait(fr_weight_group *g, double deadline_ms, const char *what);
/* Enqueues on stream s the broadcast of `bytes` bytes from rank 0's buf
 * into every other member's buf; *in_progress 1 when NCCL is still
 * enqueueing it (wait, or poll the state). */
fr_comm_status fr_weight_group_bcast(fr_weight_group *g, void *buf, size_t bytes, cudaStream_t s, int *in_progress);
/* Ends the group at once (ncclCommAbort: local, never waits on a peer; a
 * receive still waiting for a sender that will never send ends too); sets
 * *g to NULL; NULL-safe. */
void fr_weight_group_abort(fr_weight_group **g);

/* Two device buffers for a weight update's buckets, with each one's chunk
 * digests (comm/dev_checksum.h) on the device and in pinned host memory:
 * bucket k uses buffer k % 2 while bucket k + 1 uses the other. */
typedef struct {
    void *buf[2];
    uint64_t *dig[2], *hdig[2];
    uint64_t bytes;               /* each buffer's size; 0 when none */
} fr_dev_buckets;

/* Buffers for buckets of `bytes` bytes (kept while that size is asked). */
fr_comm_status fr_dev_buckets_reserve(fr_dev_buckets *b, uint64_t bytes);
void fr_dev_buckets_free(fr_dev_buckets *b);

#ifdef __cplusplus
}
#endif

#endif
