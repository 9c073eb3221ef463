#include "runner_kernels_cuda.h"

#include "attention/cuda_check.h"

__global__ static void gather_rows_kernel(float *dst, const float *src, const int *rows, int width)
{
    const float *from = src + (size_t)rows[blockIdx.x] * width;
    float *to = dst + (size_t)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) to[j] = from[j];
}

fr_status fr_cuda_gather_rows(float *dst, const float *src, const int *rows, int n, int width, cudaStream_t stream)
{
    if (n < 0 || width < 1) return fr_fail(FR_EINVAL, "gather_rows: invalid sizes (%d rows of %d)", n, width);
    if (n == 0) return FR_OK;
    gather_rows_kernel<<<n, 256, 0, stream>>>(dst, src, rows, width);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}
