/* The conversion kernel of rollout/model/weights_unpack.h. */
#include "rollout/model/weights_unpack.h"

#include <cuda_fp16.h>

/* Nearest-even BF16 of a finite float, as fr_bf16_encode rounds it on the
 * host (host weights uploaded at load agree with staged ones). */
__device__ static inline uint16_t to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__global__ static void unpack_kernel(const unsigned char *src, int kind, size_t n, uint16_t *dst,
                                     unsigned long long *bad, unsigned long long tag)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        uint16_t out;
        bool finite;
        if (kind == FR_DTYPE_BF16) {
            out = ((const uint16_t *)src)[e];
            finite = (out & 0x7f80u) != 0x7f80u;
        } else {
            float f = kind == FR_DTYPE_F32 ? ((const float *)src)[e] : __half2float(((const __half *)src)[e]);
            finite = isfinite(f);
            out = finite ? to_bf16(f) : 0;
            finite = finite && (out & 0x7f80u) != 0x7f80u;   /* a float32 near FLT_MAX rounds to infinity */
        }
        dst[e] = out;
        if (!finite) atomicMin(bad, (tag << 40) | (unsigned long long)e);
    }
}

fr_status fr_weights_unpack_launch(const void *src, int kind, size_t n, uint16_t *dst, unsigned long long *bad,
                                unsigned long long tag, cudaStream_t s)
{
    if (n == 0) return FR_OK;
    if (!src || !dst || !bad || kind < FR_DTYPE_F32 || kind > FR_DTYPE_F16)
        return fr_fail(FR_EINVAL, "fr_weights_unpack_launch: bad argument");
    const unsigned threads = 256;
    size_t blocks = (n + threads - 1) / threads;
    if (blocks > 4096) blocks = 4096;   /* grid-stride beyond: enough to fill the device */
    unpack_kernel<<<(unsigned)blocks, threads, 0, s>>>((const unsigned char *)src, kind, n, dst, bad, tag);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "weight unpack kernel launch failed: %s", cudaGetErrorString(e));
    return FR_OK;
}
