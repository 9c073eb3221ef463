/* The device side of unpacking an NCCL weight bucket (nccl_recv_cuda.c):
 * one piece of a received bucket converted to BF16 into the device staging
 * copy of the weights, with non-finite values flagged. Built only with nvcc. */
#ifndef FR_NCCL_UNPACK_H
#define FR_NCCL_UNPACK_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* `kind` of a piece: FR_DTYPE_F32, FR_DTYPE_BF16 or FR_DTYPE_F16. */

/* Enqueues on stream s: n elements of kind `kind` at src (device bytes,
 * aligned to their element size) rounded to BF16 (nearest even) into dst.
 * An element that is NaN or infinite, or that rounds to infinity, lowers
 * *bad (device) to at most (tag << 40) | its index, so after the stream ran
 * *bad holds the first bad element of the lowest tag that had one, or stays
 * UINT64_MAX. FR_EINTERNAL with CUDA's text when the launch fails. */
fr_status fr_nccl_unpack_launch(const void *src, int kind, size_t n, uint16_t *dst, unsigned long long *bad,
                                unsigned long long tag, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
