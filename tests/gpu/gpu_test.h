/* Helpers shared by the GPU tests (cmocka): whether a CUDA device is there,
 * and one-line checks that fail the test with CUDA's or the project's
 * message. Include after <cmocka.h>. */
#ifndef FR_GPU_TEST_H
#define FR_GPU_TEST_H

#include <cuda_runtime.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when a CUDA device is usable. The first call that finds none prints why
 * ("SKIP: no CUDA device ..."), once per process. */
int fr_gpu_test_available(void);

/* Runs only the tests whose names match $FR_GPU_TEST_FILTER (a cmocka
 * pattern, * and ? wildcards) when it is set: one binary's slow cases can
 * then run as parallel processes. Call before cmocka_run_group_tests. */
void fr_gpu_test_filter(void);

#ifdef __cplusplus
}
#endif

/* Skips the calling test when there is no device. */
#define REQUIRE_GPU()                              \
    do {                                           \
        if (!fr_gpu_test_available()) skip();      \
    } while (0)

/* Fails the test when a CUDA runtime call fails. */
#define CUDA_OK(call)                                                                    \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) fail_msg("%s failed: %s", #call, cudaGetErrorString(e_)); \
    } while (0)

/* The main() of a GPU test binary: FR_TEST_MAIN (tests/unit/test_util.h)
 * that first applies $FR_GPU_TEST_FILTER. */
#define FR_GPU_TEST_MAIN(group_setup, group_teardown, ...)                   \
    int main(void)                                                           \
    {                                                                        \
        const struct CMUnitTest tests[] = {__VA_ARGS__};                     \
        fr_gpu_test_filter();                                                \
        return cmocka_run_group_tests(tests, group_setup, group_teardown);   \
    }

#endif
