/* The NCCL group of an engine (comm/nccl_group.h): device all-reduce in FP32
 * and BF16, broadcast from either rank, replay inside a CUDA graph, and the
 * argument checks. Needs two ranks on two GPUs:
 *     mpirun -np 2 build/gpu/test_nccl
 * (scripts/run-gpu-tests.sh does this when it finds two GPUs). Run alone, or
 * with fewer than two GPUs, every case is skipped with a message.
 *
 * Every case enqueues all its collectives before it asserts anything, so a
 * failure on one rank cannot leave the other waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "comm/engine_group.h"
#include "comm/mpi_world.h"
#include "comm/nccl_group.h"
#include "tests/unit/test_util.h"

static fr_mpi_world *W;
static fr_engine_group *G;  /* one engine of every rank */
static fr_nccl_group *N;
static cudaStream_t S;
static int ready;   /* 2+ ranks, a GPU each */
static int crowded; /* 2+ ranks, more ranks than GPUs on a host */

#define NEED_GPUS()            \
    do {                       \
        if (!ready) skip();    \
    } while (0)

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the small integers used here */
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_group(void **state)
{
    (void)state;
    NEED_GPUS();
    int count = 0;
    assert_int_equal(cudaGetDeviceCount(&count), cudaSuccess);
    assert_int_equal(fr_nccl_group_device(N), W->local_rank % count);
    int current = -1;
    assert_int_equal(cudaGetDevice(&current), cudaSuccess);
    assert_int_equal(current, fr_nccl_group_device(N));
    assert_int_equal(fr_nccl_group_check(N), FR_COMM_OK);
}

static void test_allreduce_f32(void **state)
{
    (void)state;
    NEED_GPUS();
    const size_t n = ((size_t)1 << 20) + 3;
    float *h = malloc(n * sizeof(float)), *d = NULL;
    assert_non_null(h);
    for (size_t i = 0; i < n; i++) h[i] = (float)((W->rank + 1) * (int)(i % 1000) - 7 * W->rank);
    assert_int_equal(cudaMalloc((void **)&d, n * sizeof(float)), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    fr_comm_status st = fr_nccl_allreduce_sum(N, d, n, FR_DTYPE_F32, S);
    fr_comm_status st0 = fr_nccl_allreduce_sum(N, d, 0, FR_DTYPE_F32, S);
    cudaError_t e = cudaStreamSynchronize(S);
    if (e == cudaSuccess) e = cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(d);

    assert_int_equal(st, FR_COMM_OK);
    assert_int_equal(st0, FR_COMM_OK);
    assert_int_equal(e, cudaSuccess);
    const int p = W->size, rank_sum = p * (p + 1) / 2, seven_sum = 7 * p * (p - 1) / 2;
    for (size_t i = 0; i < n; i++)
        if (h[i] != (float)(rank_sum * (int)(i % 1000) - seven_sum))
            fail_msg("element %zu: %g, expected %d", i, h[i], rank_sum * (int)(i % 1000) - seven_sum);
    free(h);
    assert_int_equal(fr_nccl_group_check(N), FR_COMM_OK);
}

static void test_allreduce_bf16(void **state)
{
    (void)state;
    NEED_GPUS();
    const size_t n = 100003;
    uint16_t *h = malloc(n * sizeof(uint16_t)), *d = NULL;
    assert_non_null(h);
    for (size_t i = 0; i < n; i++) h[i] = to_bf16((float)((W->rank + 1) * (int)(i % 17) - 8));
    assert_int_equal(cudaMalloc((void **)&d, n * sizeof(uint16_t)), cudaSuccess);
    assert_int_equal(cudaMemcpy(d, h, n * sizeof(uint16_t), cudaMemcpyHostToDevice), cudaSuccess);
    fr_comm_status st = fr_nccl_allreduce_sum(N, d, n, FR_DTYPE_BF16, S);
    cudaError_t e = cudaStreamSynchronize(S);
    if (e == cudaSuccess) e = cudaMemcpy(h, d, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    cudaFree(d);

    assert_int_equal(st, FR_COMM_OK);
    assert_int_equal(e, cudaSuccess);
    const int p = W->size, rank_sum = p * (p + 1) / 2;
    for (size_t i = 0; i < n; i++) {
        const float want = (float)(rank_sum * (int)(i % 17) - 8 * p); /* |want| < 256: exact in BF16 */
        if (from_bf16(h[i]) != want) fail_msg("element %zu: %g, expected %g", i, from_bf16(h[i]), want);
    }
    free(h);
}

static void test_bcast(void **state)
{
    (void)state;
    NEED_GPUS();
    const size_t bytes = 3 * 1000 * 1000 + 1;
    unsigned char *h = malloc(bytes), *d = NULL;
    assert_non_null(h);
    assert_int_equal(cudaMalloc((void **)&d, bytes), cudaSuccess);
    fr_comm_status st[2];
    int bad[2] = {0, 0};
    for (int root = 0; root < 2; root++) {
        const int k = root + 1;
        for (size_t i = 0; i < bytes; i++)
            h[i] = G->layout.tp_rank == root ? (unsigned char)(i * 13 + k) : 0xA5;
        cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
        st[root] = fr_nccl_bcast(N, d, bytes, root, S);
        cudaStreamSynchronize(S);
        memset(h, 0, bytes);
        cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < bytes; i++)
            if (h[i] != (unsigned char)(i * 13 + k)) {
                bad[root] = 1;
                break;
            }
    }
    cudaFree(d);
    free(h);
    assert_int_equal(st[0], FR_COMM_OK);
    assert_int_equal(st[1], FR_COMM_OK);
    assert_false(bad[0]);
    assert_false(bad[1]);
}

/* Decode steps replay CUDA graphs: an all-reduce captured once must sum the
 * buffer's current contents at every replay. */
static void test_graph_replay(void **state)
{
    (void)state;
    NEED_GPUS();
    enum { n = 4096 };
    float h[n], *d = NULL;
    for (int i = 0; i < n; i++) h[i] = (float)(W->rank + 1 + i % 3);
    assert_int_equal(cudaMalloc((void **)&d, sizeof h), cudaSuccess);
    cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal);
    fr_comm_status st = fr_nccl_allreduce_sum(N, d, n, FR_DTYPE_F32, S);
    cudaError_t e2 = cudaStreamEndCapture(S, &graph);
    if (e == cudaSuccess) e = e2;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    for (int rep = 0; rep < 2 && e == cudaSuccess; rep++) e = cudaGraphLaunch(exec, S);
    if (e == cudaSuccess) e = cudaStreamSynchronize(S);
    if (e == cudaSuccess) e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaFree(d);

    assert_int_equal(st, FR_COMM_OK);
    assert_int_equal(e, cudaSuccess);
    const int p = W->size;
    for (int i = 0; i < n; i++) {
        const int once = p * (p + 1) / 2 + p * (i % 3);
        assert_true(h[i] == (float)(p * once)); /* two replays: the sum of sums */
    }
}

/* More ranks than GPUs (e.g. CUDA_VISIBLE_DEVICES=0 mpirun -np 2): two
 * ranks of one engine would share a GPU, which NCCL cannot do; every rank
 * fails with the same clear message instead of hanging. */
static void test_shared_gpu_rejected(void **state)
{
    (void)state;
    if (!crowded) skip();
    fr_engine_group *g = NULL;
    assert_int_equal(fr_engine_group_new(W, W->size, &g), FR_COMM_OK);
    fr_nccl_group *n = NULL;
    fr_comm_status st = fr_nccl_group_new(g, &n);
    fr_nccl_group_destroy(&n);
    fr_engine_group_destroy(&g);
    assert_int_equal(st, FR_COMM_ECUDA);
    fr_test_error_has("would share GPU");
    fr_test_error_has("at most one rank per GPU");
}

static void test_bad_arguments(void **state)
{
    (void)state;
    NEED_GPUS();
    float *d = (float *)(uintptr_t)0x1000; /* never touched: every call fails its checks first */
    assert_int_equal(fr_nccl_bcast(N, d, 4, W->size, S), FR_COMM_EINVAL);
    fr_test_error_has("root");
    assert_int_equal(fr_nccl_bcast(N, d, 4, -1, S), FR_COMM_EINVAL);
    assert_int_equal(fr_nccl_allreduce_sum(N, NULL, 4, FR_DTYPE_F32, S), FR_COMM_EINVAL);
    assert_int_equal(fr_nccl_allreduce_sum(N, d, 4, (fr_dtype)7, S), FR_COMM_EINVAL);
    fr_test_error_has("dtype");
    assert_int_equal(fr_nccl_allreduce_sum(NULL, d, 4, FR_DTYPE_F32, S), FR_COMM_EINVAL);
    assert_int_equal(fr_nccl_group_check(NULL), FR_COMM_EINVAL);
    assert_int_equal(fr_nccl_group_new(NULL, NULL), FR_COMM_EINVAL);
    assert_int_equal(fr_nccl_group_device(NULL), -1);
    fr_nccl_group_destroy(NULL);
}

/* Decides, the same way on every rank, whether the cases can run. */
static int setup(void **state)
{
    (void)state;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    int ok = W->size >= 2 && count >= 2 && W->local_size <= count, all = 0;
    int many = W->size >= 2 && count >= 1 && W->local_size > count;
    if (fr_mpi_world_all_ok(W, ok, &all) || fr_mpi_world_all_ok(W, many, &crowded)) return -1;
    if (!all) {
        if (W->rank == 0)
            fprintf(stderr, "SKIP: the NCCL group needs 2 ranks on 2 GPUs (mpirun -np 2); here %d rank(s), "
                            "%d GPU(s) on rank 0's host\n", W->size, count);
        return 0;
    }
    if (fr_engine_group_new(W, W->size, &G) || fr_nccl_group_new(G, &N)) {
        fprintf(stderr, "rank %d: %s\n", W->rank, fr_last_error());
        return -1;
    }
    if (cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking) != cudaSuccess) return -1;
    ready = 1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (S) cudaStreamDestroy(S);
    fr_nccl_group_destroy(&N);
    fr_engine_group_destroy(&G);
    return 0;
}

FR_MPI_TEST_MAIN(W, setup, teardown,
                 cmocka_unit_test(test_group),
                 cmocka_unit_test(test_allreduce_f32),
                 cmocka_unit_test(test_allreduce_bf16),
                 cmocka_unit_test(test_bcast),
                 cmocka_unit_test(test_graph_replay),
                 cmocka_unit_test(test_shared_gpu_rejected),
                 cmocka_unit_test(test_bad_arguments))
