/* The device half of comm/dev_checksum.h: one thread computes the standard
 * xxHash64 (seed 0) of one chunk. The algorithm is the published XXH64
 * (primes, 32-byte stripes of four lanes, merge, tail of 8/4/1-byte steps,
 * avalanche); tests/gpu/test_dev_checksum.c checks it against libxxhash. */
#include "dev_checksum.h"

#include <cuda_runtime.h>

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull

__device__ static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

__device__ static inline uint64_t round64(uint64_t acc, uint64_t in)
{
    acc += in * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

__device__ static inline uint64_t merge64(uint64_t acc, uint64_t v)
{
    acc ^= round64(0, v);
    return acc * P1 + P4;
}

/* Unaligned little-endian loads: a chunk starts at a multiple of 16 KiB of
 * the buffer, but the buffer itself is only byte-aligned in general. */
__device__ static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

__device__ static inline uint32_t load32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Aligned fast path: 8-byte loads when the stripe is 8-byte aligned. */
__device__ static inline uint64_t load64_any(const unsigned char *p, bool aligned)
{
    return aligned ? *(const uint64_t *)p : load64(p);
}

__device__ static uint64_t xxh64(const unsigned char *p, size_t len)
{
    const unsigned char *end = p + len;
    const bool aligned = ((uintptr_t)p & 7) == 0;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
        const unsigned char *limit = end - 32;
        do {
            v1 = round64(v1, load64_any(p, aligned));
            v2 = round64(v2, load64_any(p + 8, aligned));
            v3 = round64(v3, load64_any(p + 16, aligned));
            v4 = round64(v4, load64_any(p + 24, aligned));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = merge64(h, v1);
        h = merge64(h, v2);
        h = merge64(h, v3);
        h = merge64(h, v4);
    } else {
        h = P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= round64(0, load64(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)load32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

__global__ static void chunk_kernel(const unsigned char *data, size_t bytes, uint64_t *digests, size_t n)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t at = i * FR_DEV_CHECKSUM_CHUNK;
    const size_t len = bytes - at < FR_DEV_CHECKSUM_CHUNK ? bytes - at : FR_DEV_CHECKSUM_CHUNK;
    digests[i] = xxh64(data + at, len);
}

fr_comm_status fr_dev_checksum_launch(const void *data, size_t bytes, uint64_t *digests, void *stream)
{
    if ((bytes && !data) || !digests) return fr_comm_fail(FR_COMM_EINVAL, "fr_dev_checksum_launch: NULL buffer");
    const size_t n = fr_dev_checksum_chunks(bytes);
    if (n == 0) return FR_COMM_OK;
    const unsigned threads = 128;
    const size_t blocks = (n + threads - 1) / threads;
    chunk_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>((const unsigned char *)data, bytes,
                                                                         digests, n);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fr_comm_fail(FR_COMM_ECUDA, "checksum kernel launch failed: %s", cudaGetErrorString(e));
    return FR_COMM_OK;
}
