#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <stdio.h>
#include <stdlib.h>

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

void fr_gpu_test_filter(void)
{
    const char *f = getenv("FR_GPU_TEST_FILTER");
    if (f && *f) cmocka_set_test_filter(f);
}
