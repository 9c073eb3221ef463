#include "gpu_test.h"

#include <stdio.h>

int fr_gpu_test_available(void)
{
    static int known = -1;
    if (known < 0) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        known = e == cudaSuccess && n > 0;
        if (!known)
            fprintf(stderr, "SKIP: no CUDA device (%s): the GPU tests need one\n",
                    e == cudaSuccess ? "device count is 0" : cudaGetErrorString(e));
    }
    return known;
}
