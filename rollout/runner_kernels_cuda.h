/* Small device kernels of the CUDA runner's own plumbing (not model ops). */
#ifndef FR_RUNNER_KERNELS_CUDA_H
#define FR_RUNNER_KERNELS_CUDA_H

#include <cuda_runtime.h>

#include "attention/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i][:] = src[rows[i]][:] for i < n, rows of `width` floats; rows is a
 * device array. */
fr_status fr_cuda_gather_rows(float *dst, const float *src, const int *rows, int n, int width, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
