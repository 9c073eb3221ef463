/* The sampling extras on the GPU (rollout/model/sampler_extras_cuda.h:
 * barred tokens, the drawn token's log-prob and the top log-probs) against
 * the CPU's fr_sample_ex (rollout/model/sampler.h) on the same logits and
 * parameters, for the options min_tokens, logprobs and prompt log-probs
 * (fr_sampler_gpu_logprobs at given tokens).
 *
 * Every row must get fr_sample_ex's token (the rows keep their candidates
 * within FR_SAMPLER_GPU_EXACT_MAX through top_k, where the GPU's draw is the
 * CPU's), the CPU's top ids exactly, and log-probs within 1e-5 (relative,
 * at least 1e-5 absolute) of the CPU's: the vocabulary sums run in another
 * order. A barred token is never drawn. A row with a NaN logit gets NaN
 * log-probs and top ids -1. Without a CUDA device every test is skipped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "rollout/model/sampler.h"
#include "rollout/model/sampler_cuda.h"
#include "rollout/model/sampler_extras_cuda.h"
#include "tests/unit/test_util.h"

enum { ROWS = 12, MAX_BAN = 40 };
#define LOGPROB_TOL 1e-5

static int close_lp(float gpu, float cpu)
{
    if (isinf(cpu) || isinf(gpu)) return gpu == cpu;
    return fabs((double)gpu - (double)cpu) <= LOGPROB_TOL * fmax(1.0, fabs((double)cpu));
}

/* Row r's logits, parameters and barred ids: kinds vary with r. */
static void make_row(float *x, int V, int r, fr_test_rng *g, fr_sample_row *p, int *ban, int *n_ban)
{
    const float scale = r % 3 == 0 ? 1.0f : r % 3 == 1 ? 3.0f : 8.0f;
    for (int i = 0; i < V; i++) x[i] = scale * fr_test_normal(g);
    if (r % 4 == 1) x[(int)(fr_test_u64(g) % (uint64_t)V)] = x[(int)(fr_test_u64(g) % (uint64_t)V)];   /* a tie */
    if (r % 4 == 2)
        for (int i = 0; i < V; i += 7) x[i] = roundf(x[i]);   /* many ties */
    static const float temps[] = {0.0f, 0.7f, 1.0f, 1.3f};
    memset(p, 0, sizeof *p);
    p->temperature = temps[r % 4];
    p->top_k = r % 2 ? 40 : 400;   /* within FR_SAMPLER_GPU_EXACT_MAX: the CPU's draw */
    p->top_p = r % 3 == 2 ? 0.9f : 1.0f;
    p->seed = fr_test_u64(g);
    p->sequence = (uint64_t)r;
    p->step = fr_test_u64(g) % 1000;
    /* Bar the argmax (a greedy row then takes the next best) and a few more. */
    int best = 0;
    for (int i = 1; i < V; i++) if (x[i] > x[best]) best = i;
    *n_ban = r % 5 == 4 ? 0 : 1 + (int)(fr_test_u64(g) % (MAX_BAN - 1));
    for (int k = 0; k < *n_ban; k++) ban[k] = k == 0 ? best : (int)(fr_test_u64(g) % (uint64_t)V);
}

static void check_vocab(int V, int top_n)
{
    fr_test_rng g = {.s = 77 + (uint64_t)V + (uint64_t)top_n};
    float *x = malloc(sizeof(float) * (size_t)V * ROWS);
    fr_sample_row p[ROWS];
    int ban[ROWS * MAX_BAN], start[ROWS + 1], n_ban;
    assert_non_null(x);
    start[0] = 0;
    for (int r = 0; r < ROWS; r++) {
        make_row(x + (size_t)r * V, V, r, &g, &p[r], ban + start[r], &n_ban);
        start[r + 1] = start[r] + n_ban;
    }
    float *d_x, *d_scratch, *d_lp, *d_top_lp;
    int *d_start, *d_ban, *d_tok, *d_top;
    fr_sample_row *d_p;
    CUDA_OK(cudaMalloc((void **)&d_x, sizeof(float) * (size_t)V * ROWS));
    CUDA_OK(cudaMalloc((void **)&d_scratch, sizeof(float) * (size_t)V * ROWS));
    CUDA_OK(cudaMalloc((void **)&d_lp, sizeof(float) * ROWS));
    CUDA_OK(cudaMalloc((void **)&d_top_lp, sizeof(float) * ROWS * FR_MAX_TOP_LOGPROBS));
    CUDA_OK(cudaMalloc((void **)&d_start, sizeof start));
    CUDA_OK(cudaMalloc((void **)&d_ban, sizeof ban));
    CUDA_OK(cudaMalloc((void **)&d_tok, sizeof(int) * ROWS));
    CUDA_OK(cudaMalloc((void **)&d_top, sizeof(int) * ROWS * FR_MAX_TOP_LOGPROBS));
    CUDA_OK(cudaMalloc((void **)&d_p, sizeof p));
    CUDA_OK(cudaMemcpy(d_x, x, sizeof(float) * (size_t)V * ROWS, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_start, start, sizeof start, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ban, ban, sizeof ban, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_p, p, sizeof p, cudaMemcpyHostToDevice));
    fr_sampler_gpu *s;
    FR_OK_OR_FAIL(fr_sampler_gpu_new(V, ROWS, &s));
    FR_OK_OR_FAIL(fr_sampler_gpu_sample_ex(s, d_x, V, d_p, ROWS, d_start, d_ban, d_scratch, top_n, d_tok, d_lp, d_top,
                                           d_top_lp, 0));
    CUDA_OK(cudaDeviceSynchronize());
    int tok[ROWS], top[ROWS * FR_MAX_TOP_LOGPROBS];
    float lp[ROWS], top_lp[ROWS * FR_MAX_TOP_LOGPROBS];
    CUDA_OK(cudaMemcpy(tok, d_tok, sizeof tok, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lp, d_lp, sizeof lp, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(top, d_top, sizeof(int) * ROWS * (size_t)top_n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(top_lp, d_top_lp, sizeof(float) * ROWS * (size_t)top_n, cudaMemcpyDeviceToHost));
    fr_sampler *cpu;
    FR_OK_OR_FAIL(fr_sampler_new(V, &cpu));
    double worst = 0.0;
    for (int r = 0; r < ROWS; r++) {
        const float *row = x + (size_t)r * V;
        fr_sampling_params q = {p[r].temperature, p[r].top_k, p[r].top_p, p[r].seed};
        int ctok, cids[FR_MAX_TOP_LOGPROBS];
        float clp, clps[FR_MAX_TOP_LOGPROBS];
        fr_sample_extras ex = {.banned = ban + start[r], .n_banned = start[r + 1] - start[r], .top_n = top_n,
                               .top_ids = cids, .top_logprobs = clps};
        FR_OK_OR_FAIL(fr_sample_ex(cpu, row, &q, p[r].sequence, p[r].step, &ex, &ctok, &clp));
        if (tok[r] != ctok) fail_msg("vocab %d row %d: GPU token %d, CPU %d", V, r, tok[r], ctok);
        for (int k = start[r]; k < start[r + 1]; k++) assert_int_not_equal(tok[r], ban[k]);
        if (!close_lp(lp[r], clp)) fail_msg("vocab %d row %d: GPU log-prob %.9g, CPU %.9g", V, r, lp[r], clp);
        worst = fmax(worst, fabs((double)lp[r] - clp));
        for (int k = 0; k < top_n; k++) {
            if (top[r * top_n + k] != cids[k])
                fail_msg("vocab %d row %d: top %d is %d on the GPU, %d on the CPU", V, r, k, top[r * top_n + k], cids[k]);
            if (!close_lp(top_lp[r * top_n + k], clps[k]))
                fail_msg("vocab %d row %d top %d: GPU %.9g, CPU %.9g", V, r, k, top_lp[r * top_n + k], clps[k]);
            worst = fmax(worst, fabs((double)top_lp[r * top_n + k] - clps[k]));
        }
    }
    printf("  vocab %d, %d rows, top %d: tokens and top ids equal the CPU's, log-probs within %.3g\n", V, ROWS, top_n,
           worst);
    fr_sampler_destroy(&cpu);
    fr_sampler_gpu_destroy(&s);
    cudaFree(d_x); cudaFree(d_scratch); cudaFree(d_lp); cudaFree(d_top_lp); cudaFree(d_start); cudaFree(d_ban);
    cudaFree(d_tok); cudaFree(d_top); cudaFree(d_p);
    free(x);
}

static void test_matches_cpu(void **state)
{
    (void)state;
    REQUIRE_GPU();
    check_vocab(272, 20);
    check_vocab(272, 1);
    check_vocab(32768, 5);
    check_vocab(151936, 20);
}

/* Prompt log-probs: fr_sampler_gpu_logprobs at given tokens equals the
 * CPU's fr_log_softmax there; a NaN row gets NaN and top ids -1. */
static void test_logprobs_at_tokens(void **state)
{
    (void)state;
    REQUIRE_GPU();
    enum { V = 151936, R = 4 };
    fr_test_rng g = {.s = 5};
    float *x = malloc(sizeof(float) * V * R), *ls = malloc(sizeof(float) * V);
    assert_non_null(x);
    assert_non_null(ls);
    for (size_t i = 0; i < (size_t)V * R; i++) x[i] = 4.0f * fr_test_normal(&g);
    x[(size_t)3 * V + 17] = NAN;
    fr_sample_row p[R];
    memset(p, 0, sizeof p);
    int tok[R] = {0, 151935, 4242, 1};
    for (int r = 0; r < R; r++) p[r].temperature = r == 0 ? 0.0f : 0.8f, p[r].top_p = 1.0f;
    float *d_x, *d_lp, *d_tlp;
    int *d_tok, *d_top;
    fr_sample_row *d_p;
    CUDA_OK(cudaMalloc((void **)&d_x, sizeof(float) * V * R));
    CUDA_OK(cudaMalloc((void **)&d_lp, sizeof(float) * R));
    CUDA_OK(cudaMalloc((void **)&d_tlp, sizeof(float) * R * 3));
    CUDA_OK(cudaMalloc((void **)&d_tok, sizeof tok));
    CUDA_OK(cudaMalloc((void **)&d_top, sizeof(int) * R * 3));
    CUDA_OK(cudaMalloc((void **)&d_p, sizeof p));
    CUDA_OK(cudaMemcpy(d_x, x, sizeof(float) * V * R, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_tok, tok, sizeof tok, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_p, p, sizeof p, cudaMemcpyHostToDevice));
    FR_OK_OR_FAIL(fr_sampler_gpu_logprobs(d_x, V, d_p, R, d_tok, d_lp, 3, d_top, d_tlp, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float lp[R], tlp[R * 3];
    int top[R * 3];
    CUDA_OK(cudaMemcpy(lp, d_lp, sizeof lp, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(tlp, d_tlp, sizeof tlp, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(top, d_top, sizeof top, cudaMemcpyDeviceToHost));
    for (int r = 0; r < 3; r++) {
        FR_OK_OR_FAIL(fr_log_softmax(x + (size_t)r * V, V, p[r].temperature, ls));
        if (!close_lp(lp[r], ls[tok[r]])) fail_msg("row %d: GPU %.9g, CPU %.9g", r, lp[r], ls[tok[r]]);
        for (int k = 0; k < 3; k++) assert_true(close_lp(tlp[r * 3 + k], ls[top[r * 3 + k]]));
    }
    assert_true(isnan(lp[3]) && isnan(tlp[9]) && top[9] == -1);
    /* Bad arguments are refused before anything is launched. */
    assert_int_equal(fr_sampler_gpu_logprobs(d_x, V, d_p, R, d_tok, d_lp, 21, d_top, d_tlp, 0), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_logprobs(d_x, V, d_p, R, NULL, d_lp, 0, NULL, NULL, 0), FR_EINVAL);
    printf("  prompt-style log-probs at given tokens equal the CPU's within %g; a NaN row is NaN\n", LOGPROB_TOL);
    cudaFree(d_x); cudaFree(d_lp); cudaFree(d_tlp); cudaFree(d_tok); cudaFree(d_top); cudaFree(d_p);
    free(x);
    free(ls);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_matches_cpu),
                 cmocka_unit_test(test_logprobs_at_tokens))
