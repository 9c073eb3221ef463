/* Weight values arriving on the device (a trainer's bytes copied up, or an
 * NCCL bucket) converted to BF16 into device weights, with non-finite values
 * flagged: the device half of weight staging (rollout/engine/weight_update.h)
 * for every transport. Built only with nvcc. */
#ifndef FR_WEIGHTS_UNPACK_H
#define FR_WEIGHTS_UNPACK_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* `kind` of the values: FR_DTYPE_F32, FR_DTYPE_BF16 or FR_DTYPE_F16. */

/* Enqueues on stream s: n elements of kind `kind` at src (device bytes,
 * aligned to their element size) rounded to BF16 (nearest even) into dst.
 * An element that is NaN or infinite, or that rounds to infinity, lowers
 * *bad (device) to at most (tag << 40) | its index, so after the stream ran
 * *bad holds the first bad element of the lowest tag that had one, or stays
 * UINT64_MAX. src may be dst for BF16 (a check in place). FR_EINTERNAL with CUDA's text when the launch fails. */
fr_status fr_weights_unpack_launch(const void *src, int kind, size_t n, uint16_t *dst, unsigned long long *bad,
                                unsigned long long tag, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
