/* The device checksum of weight buckets (comm/dev_checksum.h) against its
 * definition computed on the host with libxxhash: lengths around the chunk
 * size and the xxHash64 stripe and tail boundaries, buffers that start at
 * odd addresses, and one flipped byte changing the value. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/dev_checksum.h"
#include "gpu_test.h"

static uint64_t device_checksum(const unsigned char *dev, size_t bytes, uint64_t *dig, uint64_t *host)
{
    if (fr_dev_checksum_launch(dev, bytes, dig, NULL)) fail_msg("launch: %s", fr_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    const size_t n = fr_dev_checksum_chunks(bytes);
    CUDA_OK(cudaMemcpy(host, dig, n * sizeof *host, cudaMemcpyDeviceToHost));
    return fr_dev_checksum_combine(host, n);
}

static void test_matches_host(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const size_t cap = 5 * FR_DEV_CHECKSUM_CHUNK + 100;
    unsigned char *h = malloc(cap + 8), *dev;
    uint64_t *dig, *hd = malloc(sizeof *hd * 16);
    assert_non_null(h);
    assert_non_null(hd);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < cap + 8; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        h[i] = (unsigned char)x;
    }
    CUDA_OK(cudaMalloc((void **)&dev, cap + 8));
    CUDA_OK(cudaMalloc((void **)&dig, sizeof *dig * 16));
    CUDA_OK(cudaMemcpy(dev, h, cap + 8, cudaMemcpyHostToDevice));
    const size_t lens[] = {1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, FR_DEV_CHECKSUM_CHUNK - 1, FR_DEV_CHECKSUM_CHUNK,
                           FR_DEV_CHECKSUM_CHUNK + 1, 3 * FR_DEV_CHECKSUM_CHUNK + 17, cap};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        for (size_t shift = 0; shift < 8; shift += 3) {
            uint64_t want;
            assert_int_equal(fr_dev_checksum_host(h + shift, lens[k], &want), FR_COMM_OK);
            uint64_t got = device_checksum(dev + shift, lens[k], dig, hd);
            if (got != want)
                fail_msg("%zu bytes at offset %zu: device %016llx, host %016llx", lens[k], shift,
                         (unsigned long long)got, (unsigned long long)want);
        }
    uint64_t before = device_checksum(dev, cap, dig, hd);
    h[2 * FR_DEV_CHECKSUM_CHUNK + 5] ^= 1;
    CUDA_OK(cudaMemcpy(dev, h, cap, cudaMemcpyHostToDevice));
    assert_true(device_checksum(dev, cap, dig, hd) != before);
    cudaFree(dev);
    cudaFree(dig);
    free(h);
    free(hd);
}

int main(void)
{
    fr_gpu_test_filter();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_matches_host)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
