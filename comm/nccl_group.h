/* The GPU side of an engine: one NCCL communicator over the engine's ranks,
 * for activations (all-reduce of row-parallel partial sums, FP32 or BF16)
 * and broadcasts of device buffers. Built only when nvcc is present
 * (nccl_group_cuda.c); one GPU per rank, chosen as local_rank % device_count.
 *
 * fr_nccl_group_new and fr_nccl_group_destroy are collective over the engine.
 * The device collectives are enqueued on the caller's stream and return at
 * once (safe inside CUDA graph capture); every rank of the engine enqueues
 * the same collectives in the same order. NCCL failures become FR_COMM_ENCCL
 * with NCCL's text; errors found while the work runs (a peer died, a network
 * failure) surface through fr_nccl_group_check. */
#ifndef FR_NCCL_GROUP_H
#define FR_NCCL_GROUP_H

#include <stddef.h>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "comm_status.h"
#include "engine_group.h"

/* The engine's NCCL communicator and this rank's device; opaque. A type
 * has no linkage, so it stands outside the C-linkage block below. */
typedef struct fr_nccl_group fr_nccl_group;

#ifdef __cplusplus
extern "C" {
#endif

/* Collective over the engine. Selects this rank's GPU (cudaSetDevice(local_rank
 * % device_count); the device stays current for the calling thread), then the
 * leader makes an NCCL unique id, sends it over the engine's MPI
 * communicator, and every rank joins with ncclCommInitRank. Every rank fails
 * alike (FR_COMM_ECUDA, naming the rank) when any rank has no device or when
 * two ranks of the engine would share one GPU. */
fr_comm_status fr_nccl_group_new(const fr_engine_group *g, fr_nccl_group **out);

/* Frees the communicator (ncclCommAbort when it holds an asynchronous error,
 * so a broken peer cannot hang shutdown); sets *n to NULL; NULL-safe. */
void fr_nccl_group_destroy(fr_nccl_group **n);

/* The CUDA device this rank uses. */
int fr_nccl_group_device(const fr_nccl_group *n);

/* In place on the device: buf[i] becomes the sum of every rank's buf[i]
 * (count elements of dtype t), enqueued on stream s. */
fr_comm_status fr_nccl_allreduce_sum(fr_nccl_group *n, void *buf, size_t count, fr_dtype t, cudaStream_t s);

/* Every rank's count floats of local, concatenated in rank order into all
 * (count * engine size floats; all may not overlap local). */
fr_comm_status fr_nccl_allgather_f32(fr_nccl_group *n, const float *local, float *all, size_t count, cudaStream_t s);

/* bytes bytes of device buffer buf from tp rank root to the engine's other
 * ranks, enqueued on stream s. */
fr_comm_status fr_nccl_bcast(fr_nccl_group *n, void *buf, size_t bytes, int root, cudaStream_t s);

/* FR_COMM_ENCCL when the communicator has met an asynchronous error since it
 * was made (ncclCommGetAsyncError); poll after a step, or when a stream
 * synchronize seems stuck. The group is then unusable: destroy it. */
fr_comm_status fr_nccl_group_check(fr_nccl_group *n);

#ifdef __cplusplus
}
#endif

#endif
