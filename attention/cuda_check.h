/* The error convention (fr_status.h) for CUDA calls: a failing runtime call
 * becomes a status with a message naming the call, the file and line, and
 * CUDA's own text, so a GPU failure reads like any other error. Host code
 * only; include from .c and .cu files alike. */
#ifndef FR_CUDA_CHECK_H
#define FR_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Evaluates a cudaError_t expression; on failure records a message and
 * returns FR_EINTERNAL from the calling function (which must return fr_status). */
#define FR_CUDA_TRY(call)                                                                    \
    do {                                                                                     \
        cudaError_t fr_cuda_err_ = (call);                                                   \
        if (fr_cuda_err_ != cudaSuccess)                                                     \
            return fr_fail(FR_EINTERNAL, "%s failed at %s:%d: %s", #call, __FILE__, __LINE__, \
                           cudaGetErrorString(fr_cuda_err_));                                \
    } while (0)

/* After a kernel launch: reports a bad launch configuration at once. */
#define FR_CUDA_LAUNCHED() FR_CUDA_TRY(cudaGetLastError())

#ifdef __cplusplus
}
#endif

#endif
