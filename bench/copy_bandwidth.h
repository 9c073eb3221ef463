/* The denominator of the benches' byte limits: bytes read plus written per
 * second by a device-to-device copy of `bytes` (the best of five timed copies
 * after a warm-up), or 0 when the buffers cannot be had. Header-only: each
 * program of bench/ is one C file. */
#ifndef FR_BENCH_COPY_BANDWIDTH_H
#define FR_BENCH_COPY_BANDWIDTH_H

#include <stddef.h>

#include <cuda_runtime.h>

static double fr_bench_copy_bandwidth(size_t bytes, cudaStream_t st)
{
    void *a = NULL, *b = NULL;
    double best = 0.0;
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
        cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
        cudaMemsetAsync(a, 1, bytes, st);
        for (int rep = 0; rep < 6; rep++) {
            cudaEventRecord(e0, st);
            cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            float ms = 0.0f;
            cudaEventElapsedTime(&ms, e0, e1);
            const double bw = 2.0 * (double)bytes / (ms * 1e-3);
            if (rep > 0 && bw > best) best = bw;
        }
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    cudaGetLastError();
    return best;
}

#endif
