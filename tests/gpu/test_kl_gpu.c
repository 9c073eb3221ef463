/* The divergence on the GPU (rollout/engine/kl_cuda.h), one block a row and
 * split over blocks, against fr_kl_topk on the same logits: kl within 1e-12
 * absolute plus 1e-9 relative (summation order only), top1_match equal,
 * logp_diff within 1e-12; the split form also with the chosen tokens
 * indexed by served row, reporting the tokens it used. Cases: Qwen3's
 * vocabulary with close and distant pairs of distributions, a byte
 * vocabulary smaller than k, rows picked out of larger batches in any
 * order, and ties at the k-th largest reference logit (taken by lowest id),
 * sparse and dense enough that one slice holds more than k of them.
 * test_timing prints the time of 4 rows of Qwen3's vocabulary for both
 * forms (not asserted). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "rollout/engine/kl_cuda.h"
#include "rollout/engine/kl_metrics.h"
#include "tests/unit/test_util.h"

enum { QWEN_VOCAB = 151936, BYTE_VOCAB = 259 };

static uint64_t rng_state = 88172645463325252ull;
static double uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-53;
}
static double normal(void) { return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()); }

/* out[0..n) against fr_kl_topk; returns the worst |kl difference|. */
static double compare(const fr_kl_result *out, const float *ref, const int *ref_rows, const float *served,
                      const int *served_rows, const int *tokens, int n, int vocab, int k, const char *label)
{
    double worst = 0.0;
    for (int j = 0; j < n; j++) {
        fr_kl_result want;
        if (fr_kl_topk(ref + (size_t)ref_rows[j] * vocab, served + (size_t)served_rows[j] * vocab, vocab, k, tokens[j],
                       &want))
            fail_msg("%s", fr_last_error());
        double err = fabs(out[j].kl - want.kl);
        if (err > 1e-12 + 1e-9 * fabs(want.kl))
            fail_msg("%s row %d: kl %.17g on the GPU, %.17g on the CPU", label, j, out[j].kl, want.kl);
        if (out[j].top1_match != want.top1_match) fail_msg("%s row %d: top1_match differs", label, j);
        if (fabs(out[j].logp_diff - want.logp_diff) > 1e-12)
            fail_msg("%s row %d: logp_diff %.17g against %.17g", label, j, out[j].logp_diff, want.logp_diff);
        if (err > worst) worst = err;
    }
    return worst;
}

/* The split form on the same rows (device row lists given), chosen tokens
 * by served row: tokens[j] placed at served_rows[j] of an n_served array. */
static void check_split(const float *ref, const float *d_ref, const int *ref_rows, const int *d_rr, const float *served,
                        const float *d_served, int n_served, const int *served_rows, const int *d_sr,
                        const int *tokens, int n, int vocab, int k, const char *label)
{
    int *by_row = malloc(sizeof(int) * (size_t)n_served), *used = malloc(sizeof(int) * (size_t)n);
    fr_kl_result *out = calloc((size_t)n, sizeof *out);
    assert_non_null(by_row);
    assert_non_null(used);
    assert_non_null(out);
    for (int i = 0; i < n_served; i++) by_row[i] = -7;
    for (int j = 0; j < n; j++) by_row[served_rows[j]] = tokens[j];
    const size_t ws_bytes = fr_kl_topk_cuda_ws_bytes(n, vocab, k);
    void *ws;
    int *d_by_row, *d_used;
    fr_kl_result *d_out;
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
    CUDA_OK(cudaMalloc((void **)&d_by_row, sizeof(int) * (size_t)n_served));
    CUDA_OK(cudaMalloc((void **)&d_used, sizeof(int) * (size_t)n));
    CUDA_OK(cudaMalloc((void **)&d_out, sizeof(fr_kl_result) * (size_t)n));
    CUDA_OK(cudaMemcpy(d_by_row, by_row, sizeof(int) * (size_t)n_served, cudaMemcpyHostToDevice));
    assert_int_equal(fr_kl_topk_cuda_split(d_ref, d_rr, d_served, d_sr, d_by_row, 1, n, vocab, k, ws, ws_bytes - 1,
                                           d_out, d_used, 0),
                     FR_EINVAL);   /* a workspace one byte short */
    if (fr_kl_topk_cuda_split(d_ref, d_rr, d_served, d_sr, d_by_row, 1, n, vocab, k, ws, ws_bytes, d_out, d_used, 0))
        fail_msg("%s", fr_last_error());
    CUDA_OK(cudaMemcpy(out, d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(used, d_used, sizeof(int) * (size_t)n, cudaMemcpyDeviceToHost));
    for (int j = 0; j < n; j++)
        if (used[j] != tokens[j]) fail_msg("%s row %d: used token %d, chosen %d", label, j, used[j], tokens[j]);
    double worst = compare(out, ref, ref_rows, served, served_rows, tokens, n, vocab, k, label);
    printf("%s (split): %d rows, worst |kl difference| %.3g\n", label, n, worst);
    cudaFree(ws); cudaFree(d_by_row); cudaFree(d_used); cudaFree(d_out);
    free(by_row);
    free(used);
    free(out);
}

/* Checks n rows: ref row ref_rows[j] of ref (n_ref rows) against served row
 * served_rows[j] of served (n_served rows), in both forms. */
static void check(const float *ref, int n_ref, const int *ref_rows, const float *served, int n_served,
                  const int *served_rows, const int *tokens, int n, int vocab, int k, const char *label)
{
    float *d_ref, *d_served;
    int *d_rr, *d_sr, *d_tok;
    fr_kl_result *d_out, *out = calloc((size_t)n, sizeof *out);
    assert_non_null(out);
    CUDA_OK(cudaMalloc((void **)&d_ref, sizeof(float) * (size_t)n_ref * vocab));
    CUDA_OK(cudaMalloc((void **)&d_served, sizeof(float) * (size_t)n_served * vocab));
    CUDA_OK(cudaMalloc((void **)&d_rr, sizeof(int) * (size_t)n));
    CUDA_OK(cudaMalloc((void **)&d_sr, sizeof(int) * (size_t)n));
    CUDA_OK(cudaMalloc((void **)&d_tok, sizeof(int) * (size_t)n));
    CUDA_OK(cudaMalloc((void **)&d_out, sizeof(fr_kl_result) * (size_t)n));
    CUDA_OK(cudaMemcpy(d_ref, ref, sizeof(float) * (size_t)n_ref * vocab, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_served, served, sizeof(float) * (size_t)n_served * vocab, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_rr, ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_sr, served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_tok, tokens, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice));
    if (fr_kl_topk_cuda(d_ref, d_rr, d_served, d_sr, d_tok, n, vocab, k, d_out, 0)) fail_msg("%s", fr_last_error());
    CUDA_OK(cudaMemcpy(out, d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost));
    double worst = compare(out, ref, ref_rows, served, served_rows, tokens, n, vocab, k, label);
    printf("%s: %d rows, worst |kl difference| %.3g\n", label, n, worst);
    check_split(ref, d_ref, ref_rows, d_rr, served, d_served, n_served, served_rows, d_sr, tokens, n, vocab, k, label);
    cudaFree(d_ref); cudaFree(d_served); cudaFree(d_rr); cudaFree(d_sr); cudaFree(d_tok); cudaFree(d_out);
    free(out);
}

/* n_rows rows of logits with standard deviation sd; served rows are the
 * reference plus noise of sd `noise` (0: a copy). */
static void make_pair(float *ref, float *served, size_t count, double sd, double noise)
{
    for (size_t i = 0; i < count; i++) {
        ref[i] = (float)(sd * normal());
        served[i] = (float)(ref[i] + noise * normal());
    }
}

static void test_qwen_vocab(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB, n = 6;
    float *ref = malloc(sizeof(float) * (size_t)n * V), *served = malloc(sizeof(float) * (size_t)n * V);
    assert_non_null(ref);
    assert_non_null(served);
    int rows[6] = {0, 1, 2, 3, 4, 5}, tok[6];
    make_pair(ref, served, (size_t)2 * V, 3.0, 0.01);                        /* close: FP4 against BF16 */
    make_pair(ref + (size_t)2 * V, served + (size_t)2 * V, (size_t)2 * V, 5.0, 1.0);   /* far apart */
    make_pair(ref + (size_t)4 * V, served + (size_t)4 * V, (size_t)V, 1.0, 0.0);       /* identical: kl 0 */
    make_pair(ref + (size_t)5 * V, served + (size_t)5 * V, (size_t)V, 0.001, 0.001);   /* nearly flat */
    for (int j = 0; j < n; j++) tok[j] = (int)(uniform() * V);
    tok[5] = -1;
    check(ref, n, rows, served, n, rows, tok, n, V, FR_KL_TOP_K, "qwen3 vocabulary");
    free(ref);
    free(served);
}

static void test_small_vocab_and_picked_rows(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = BYTE_VOCAB, n_ref = 5, n_served = 2 * 5 + 1;
    float *ref = malloc(sizeof(float) * (size_t)n_ref * V), *served = malloc(sizeof(float) * (size_t)n_served * V);
    assert_non_null(ref);
    assert_non_null(served);
    for (int i = 0; i < n_ref * V; i++) ref[i] = (float)(4.0 * normal());
    for (int i = 0; i < n_served * V; i++) served[i] = (float)(4.0 * normal());
    for (int j = 0; j < n_ref; j++)   /* served row 2j + 1 is ref row j, perturbed */
        for (int v = 0; v < V; v++) served[(size_t)(2 * j + 1) * V + v] = ref[(size_t)j * V + v] + (float)(0.05 * normal());
    int ref_rows[4] = {3, 0, 4, 1}, served_rows[4] = {7, 1, 8, 3}, tok[4] = {0, 258, 17, -1};
    check(ref, n_ref, ref_rows, served, n_served, served_rows, tok, 4, V, FR_KL_TOP_K, "byte vocabulary, k 128");
    check(ref, n_ref, ref_rows, served, n_served, served_rows, tok, 4, V, 1000, "byte vocabulary, k above it");
    free(ref);
    free(served);
}

/* Many tokens share the k-th largest value: which of them count decides the
 * sum, since their served logits differ. share: the tied share of the
 * vocabulary (at 5% a 4096-token slice holds more than k = 128 of them). */
static void ties_at_kth(double share)
{
    const int V = QWEN_VOCAB, n = 3;
    float *ref = malloc(sizeof(float) * (size_t)n * V), *served = malloc(sizeof(float) * (size_t)n * V);
    assert_non_null(ref);
    assert_non_null(served);
    for (int j = 0; j < n; j++)
        for (int v = 0; v < V; v++) {
            size_t i = (size_t)j * V + v;
            double u = uniform();
            /* 100 distinct top logits, then ~1% of the vocabulary tied at 2.5 */
            ref[i] = v % 1511 == 7 && v < 1511 * 100 ? (float)(4.0 + uniform()) : u < share ? 2.5f : (float)(u - 2.0);
            served[i] = ref[i] + (float)(0.3 * normal());
        }
    int rows[3] = {0, 1, 2}, tok[3] = {7, 1518, -1};
    check(ref, n, rows, served, n, rows, tok, n, V, FR_KL_TOP_K, "ties at the k-th value");
    check(ref, n, rows, served, n, rows, tok, n, V, 1, "top 1");
    free(ref);
    free(served);
}

static void test_ties_at_kth(void **state)
{
    (void)state;
    REQUIRE_GPU();
    ties_at_kth(0.01);
    ties_at_kth(0.05);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    assert_int_equal(fr_kl_topk_cuda(NULL, NULL, NULL, NULL, NULL, 0, 100, 128, NULL, 0), FR_OK);   /* nothing */
    assert_int_equal(fr_kl_topk_cuda(NULL, NULL, NULL, NULL, NULL, 1, 100, 128, NULL, 0), FR_EINVAL);
    assert_int_equal(fr_kl_topk_cuda(NULL, NULL, NULL, NULL, NULL, 1, 100, 0, NULL, 0), FR_EINVAL);
    assert_int_equal(fr_kl_topk_cuda(NULL, NULL, NULL, NULL, NULL, -1, 100, 128, NULL, 0), FR_EINVAL);
    assert_int_equal(fr_kl_topk_cuda_split(NULL, NULL, NULL, NULL, NULL, 0, 0, 100, 128, NULL, 0, NULL, NULL, 0), FR_OK);
    assert_int_equal(fr_kl_topk_cuda_split(NULL, NULL, NULL, NULL, NULL, 0, 1, 100, 128, NULL, 0, NULL, NULL, 0),
                     FR_EINVAL);
    assert_int_equal(fr_kl_topk_cuda_split(NULL, NULL, NULL, NULL, NULL, 0, 1, 100, 0, NULL, 0, NULL, NULL, 0),
                     FR_EINVAL);
    assert_true(fr_kl_topk_cuda_ws_bytes(0, 100, 128) == 0);
    assert_true(fr_kl_topk_cuda_ws_bytes(4, 151936, 128) > 0);
}

static void test_timing(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB, n = 4, reps = 50;
    float *ref = malloc(sizeof(float) * (size_t)n * V), *served = malloc(sizeof(float) * (size_t)n * V);
    assert_non_null(ref);
    assert_non_null(served);
    make_pair(ref, served, (size_t)n * V, 3.0, 0.01);
    float *d_ref, *d_served;
    int *d_rows;
    fr_kl_result *d_out;
    int rows[4] = {0, 1, 2, 3};
    CUDA_OK(cudaMalloc((void **)&d_ref, sizeof(float) * (size_t)n * V));
    CUDA_OK(cudaMalloc((void **)&d_served, sizeof(float) * (size_t)n * V));
    CUDA_OK(cudaMalloc((void **)&d_rows, sizeof rows));
    CUDA_OK(cudaMalloc((void **)&d_out, sizeof(fr_kl_result) * n));
    CUDA_OK(cudaMemcpy(d_ref, ref, sizeof(float) * (size_t)n * V, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_served, served, sizeof(float) * (size_t)n * V, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_rows, rows, sizeof rows, cudaMemcpyHostToDevice));
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    CUDA_OK(cudaEventRecord(a, 0));
    for (int r = 0; r < reps; r++)
        if (fr_kl_topk_cuda(d_ref, d_rows, d_served, d_rows, NULL, n, V, FR_KL_TOP_K, d_out, 0))
            fail_msg("%s", fr_last_error());
    CUDA_OK(cudaEventRecord(b, 0));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    printf("timing: %d rows of %d logits in %.1f us per call\n", n, V, 1000.0 * ms / reps);
    const size_t ws_bytes = fr_kl_topk_cuda_ws_bytes(n, V, FR_KL_TOP_K);
    void *ws;
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
    CUDA_OK(cudaEventRecord(a, 0));
    for (int r = 0; r < reps; r++)
        if (fr_kl_topk_cuda_split(d_ref, d_rows, d_served, d_rows, NULL, 0, n, V, FR_KL_TOP_K, ws, ws_bytes, d_out,
                                  NULL, 0))
            fail_msg("%s", fr_last_error());
    CUDA_OK(cudaEventRecord(b, 0));
    CUDA_OK(cudaEventSynchronize(b));
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    printf("timing (split): %d rows of %d logits in %.1f us per call\n", n, V, 1000.0 * ms / reps);
    cudaFree(ws);
    cudaEventDestroy(a); cudaEventDestroy(b);
    cudaFree(d_ref); cudaFree(d_served); cudaFree(d_rows); cudaFree(d_out);
    free(ref);
    free(served);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_qwen_vocab),
                 cmocka_unit_test(test_small_vocab_and_picked_rows),
                 cmocka_unit_test(test_ties_at_kth),
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_timing))
