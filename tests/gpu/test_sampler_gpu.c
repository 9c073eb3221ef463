/* The GPU sampler (rollout/model/sampler_cuda.h) against the CPU sampler
 * (rollout/model/sampler.h) on the same logits and parameters.
 *
 * Every row must get fr_sample's token and a log-prob within 1e-5 of
 * fr_sample's. The one allowance, as docs/sampling.md describes: on rows with
 * more than FR_SAMPLER_GPU_EXACT_MAX candidates the GPU locates the cuts with
 * exact prefix masses, while the CPU sums in double one token at a time, so a
 * different token is accepted only when the CPU's u * W or top_p * W_k lies
 * within 1e-9 (relative) of one of its running sums. Such rows are counted
 * and printed; with random data there should be none.
 *
 * The draws themselves are compared bit for bit (fr_sampler_gpu_uniforms).
 * Without a CUDA device every test that needs one is skipped with a message.
 * test_timing prints times for 64 rows of Qwen3's vocabulary (not asserted).
 */
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

#include "rollout/model/philox.h"
#include "rollout/model/sampler.h"
#include "rollout/model/sampler_cuda.h"
#include "tests/unit/test_util.h"

enum { QWEN_VOCAB = 151936, SMALL_VOCAB = 272 };

#define BOUNDARY_TOL 1e-9
#define LOGPROB_TOL 1e-5

/* ---- GPU presence and shared state --------------------------------------- */

static cudaStream_t g_stream;

static int group_setup(void **state)
{
    (void)state;
    if (!fr_gpu_test_available()) return 0;
    if (cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "cannot create a CUDA stream\n");
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    if (g_stream) cudaStreamDestroy(g_stream);
    return 0;
}

/* ---- test data ------------------------------------------------------------ */

static fr_sample_row row_params(float temperature, int top_k, float top_p, uint64_t seed, uint64_t sequence,
                                uint64_t step)
{
    fr_sample_row r;
    memset(&r, 0, sizeof r);
    r.temperature = temperature;
    r.top_k = top_k;
    r.top_p = top_p;
    r.seed = seed;
    r.sequence = sequence;
    r.step = step;
    return r;
}

enum {
    K_NORMAL,      /* N(0, 3^2) */
    K_TIES,        /* N(0, 2^2) rounded to multiples of 0.5: many ties everywhere */
    K_FLAT,        /* all zero */
    K_PEAKED,      /* N(0, 2^2) with one token at 40 */
    K_NEG_INF,     /* 30% -inf, the rest N(0, 4^2) */
    K_VERY_FLAT,   /* N(0, 0.05^2): everything within a fraction of a nat */
    K_WIDE,        /* N(0, 8^2) */
    K_ZEROS,       /* +0 and -0 mixed (equal logits), one token at 0.001 */
    K_FEW_VALUES,  /* three adjacent-ish values around 10: huge tie groups */
    K_RAMP,        /* decreasing with the id */
    K_KINDS
};

static const char *const kind_name[K_KINDS] = {"normal", "ties", "flat", "peaked", "-inf",
                                               "very flat", "wide", "signed zeros", "few values", "ramp"};

static void make_logits(float *x, int n, int kind, fr_test_rng *r)
{
    for (int i = 0; i < n; i++) {
        switch (kind) {
        case K_NORMAL: x[i] = 3.0f * fr_test_normal(r); break;
        case K_TIES: x[i] = roundf(4.0f * fr_test_normal(r)) * 0.5f; break;
        case K_FLAT: x[i] = 0.0f; break;
        case K_PEAKED: x[i] = 2.0f * fr_test_normal(r); break;
        case K_NEG_INF: x[i] = fr_test_uniform(r) < 0.3f ? -INFINITY : 4.0f * fr_test_normal(r); break;
        case K_VERY_FLAT: x[i] = 0.05f * fr_test_normal(r); break;
        case K_WIDE: x[i] = 8.0f * fr_test_normal(r); break;
        case K_ZEROS: x[i] = fr_test_uniform(r) < 0.5f ? -0.0f : 0.0f; break;
        case K_FEW_VALUES: x[i] = 10.0f + 1e-6f * (float)(fr_test_u64(r) % 3); break;
        case K_RAMP: x[i] = 20.0f - 30.0f * (float)i / (float)n; break;
        default: x[i] = 0.0f; break;
        }
    }
    if (kind == K_PEAKED) x[fr_test_u64(r) % (uint64_t)n] = 40.0f;
    if (kind == K_ZEROS) x[fr_test_u64(r) % (uint64_t)n] = 0.001f;
    if (kind == K_NEG_INF) x[fr_test_u64(r) % (uint64_t)n] = 1.0f;   /* at least one finite */
}

/* A mix of every parameter shape the brief names. */
static fr_sample_row random_params(int vocab, fr_test_rng *r)
{
    static const float temps[] = {0.0f, 0.3f, 0.6f, 1.0f, 1.0f, 1.5f, 1e-3f};
    static const float top_ps[] = {1.0f, 1.0f, 0.95f, 0.5f, 1e-6f, 0.9999999f, 0.8f};
    const int top_ks[] = {0, 0, 1, 5, 20, 50, 1000, FR_SAMPLER_GPU_EXACT_MAX, FR_SAMPLER_GPU_EXACT_MAX + 1,
                          5000, vocab, vocab + 7};
    const int nt = (int)(sizeof temps / sizeof temps[0]);
    const int np = (int)(sizeof top_ps / sizeof top_ps[0]);
    const int nk = (int)(sizeof top_ks / sizeof top_ks[0]);
    return row_params(temps[fr_test_u64(r) % (uint64_t)nt], top_ks[fr_test_u64(r) % (uint64_t)nk],
                      top_ps[fr_test_u64(r) % (uint64_t)np], fr_test_u64(r), fr_test_u64(r) % 100000,
                      fr_test_u64(r) % 40000);
}

/* ---- running the GPU sampler ---------------------------------------------- */

typedef struct {
    int vocab, rows;
    float *d_logits;
    fr_sample_row *d_rows;
    int *d_tok;
    float *d_lp;
    fr_sampler_gpu *s;
} gpu_batch;

static void batch_open(gpu_batch *b, int vocab, int rows)
{
    memset(b, 0, sizeof *b);
    b->vocab = vocab;
    b->rows = rows;
    CUDA_OK(cudaMalloc((void **)&b->d_logits, (size_t)vocab * rows * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&b->d_rows, (size_t)rows * sizeof(fr_sample_row)));
    CUDA_OK(cudaMalloc((void **)&b->d_tok, (size_t)rows * sizeof(int)));
    CUDA_OK(cudaMalloc((void **)&b->d_lp, (size_t)rows * sizeof(float)));
    FR_OK_OR_FAIL(fr_sampler_gpu_new(vocab, rows, &b->s));
}

static void batch_close(gpu_batch *b)
{
    fr_sampler_gpu_destroy(&b->s);
    assert_null(b->s);
    CUDA_OK(cudaFree(b->d_logits));
    CUDA_OK(cudaFree(b->d_rows));
    CUDA_OK(cudaFree(b->d_tok));
    CUDA_OK(cudaFree(b->d_lp));
}

static void batch_upload(gpu_batch *b, const float *logits, const fr_sample_row *rows)
{
    CUDA_OK(cudaMemcpy(b->d_logits, logits, (size_t)b->vocab * b->rows * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b->d_rows, rows, (size_t)b->rows * sizeof(fr_sample_row), cudaMemcpyHostToDevice));
}

static void batch_run(gpu_batch *b, int *tok, float *lp)
{
    CUDA_OK(cudaMemset(b->d_tok, 0xff, (size_t)b->rows * sizeof(int)));
    FR_OK_OR_FAIL(fr_sampler_gpu_sample(b->s, b->d_logits, b->d_rows, b->rows, b->d_tok, b->d_lp, g_stream));
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaMemcpy(tok, b->d_tok, (size_t)b->rows * sizeof(int), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lp, b->d_lp, (size_t)b->rows * sizeof(float), cudaMemcpyDeviceToHost));
}

/* ---- the CPU rule written out, to measure how close a draw is to a boundary */

static const float *g_cmp_logits;

static int rank_cmp(const void *a, const void *b)
{
    int i = *(const int *)a, j = *(const int *)b;
    float x = g_cmp_logits[i], y = g_cmp_logits[j];
    if (x != y) return x > y ? -1 : 1;
    return i < j ? -1 : 1;
}

/* The smallest relative distance between the CPU's thresholds (top_p * W_k,
 * u * W) and its running sums, for a finite sampling row; 1 when no sums are
 * involved (+inf rows). */
static double boundary_margin(const float *logits, int n, const fr_sample_row *p, int *ids, double *s)
{
    int cand = 0, posinf = 0;
    for (int i = 0; i < n; i++) posinf += logits[i] == INFINITY;
    if (posinf) return 1.0;
    for (int i = 0; i < n; i++)
        if (logits[i] != -INFINITY) ids[cand++] = i;
    g_cmp_logits = logits;
    qsort(ids, (size_t)cand, sizeof *ids, rank_cmp);
    const int k = p->top_k > 0 && p->top_k < cand ? p->top_k : cand;
    const double t = p->temperature, zmax = (double)logits[ids[0]] / t;
    double run = 0.0;
    for (int i = 0; i < k; i++) {
        run += exp((double)logits[ids[i]] / t - zmax);
        s[i] = run;
    }
    const double nucleus = (double)p->top_p * s[k - 1];
    int kept = 0;
    while (kept < k)
        if (s[kept++] >= nucleus) break;
    const double W = s[kept - 1], target = (double)fr_philox_uniform(p->seed, p->sequence, p->step) * W;
    double margin = 1.0;
    for (int i = 0; i < k; i++) {
        if (p->top_p < 1.0f) margin = fmin(margin, fabs(s[i] - nucleus) / s[k - 1]);
        if (i < kept) margin = fmin(margin, fabs(s[i] - target) / W);
    }
    return margin;
}

typedef struct {
    int rows, tolerated;
    double worst_lp;   /* largest |logprob difference| seen */
} compare_stats;

/* Compares every GPU row with fr_sample on the same inputs. */
static void compare_rows(const float *logits, int vocab, const fr_sample_row *rows, int n, const int *tok,
                         const float *lp, compare_stats *cs)
{
    fr_sampler *cpu = NULL;
    FR_OK_OR_FAIL(fr_sampler_new(vocab, &cpu));
    int *ids = malloc((size_t)vocab * sizeof *ids);
    double *s = malloc((size_t)vocab * sizeof *s);
    assert_non_null(ids);
    assert_non_null(s);
    for (int r = 0; r < n; r++) {
        const float *x = logits + (size_t)r * vocab;
        const fr_sample_row *p = &rows[r];
        const fr_sampling_params sp = {p->temperature, p->top_k, p->top_p, p->seed};
        int want = -1;
        float want_lp = 0.0f;
        fr_status st = fr_sample(cpu, x, &sp, p->sequence, p->step, &want, &want_lp);
        cs->rows++;
        if (st != FR_OK) {   /* NaN or all -inf: the GPU marks the row */
            if (tok[r] != -1 || !isnan(lp[r]))
                fail_msg("row %d: CPU rejects it (%s) but the GPU gave token %d logprob %g", r, fr_last_error(),
                         tok[r], (double)lp[r]);
            continue;
        }
        if (tok[r] != want) {
            double margin = p->temperature > 0.0f ? boundary_margin(x, vocab, p, ids, s) : 1.0;
            if (margin >= BOUNDARY_TOL)
                fail_msg("row %d (T %g top_k %d top_p %.9g seed %llu seq %llu step %llu): GPU token %d, CPU %d "
                         "(boundary margin %.3g)",
                         r, (double)p->temperature, p->top_k, (double)p->top_p, (unsigned long long)p->seed,
                         (unsigned long long)p->sequence, (unsigned long long)p->step, tok[r], want, margin);
            cs->tolerated++;
            print_message("  row %d: GPU token %d, CPU %d, within %.3g of a boundary (tolerated)\n", r, tok[r], want,
                          margin);
            continue;
        }
        double d = fabs((double)lp[r] - (double)want_lp);
        if (isinf(want_lp) && lp[r] == want_lp) d = 0.0;
        if (!(d <= LOGPROB_TOL))
            fail_msg("row %d: token %d logprob GPU %.9g CPU %.9g", r, want, (double)lp[r], (double)want_lp);
        if (d > cs->worst_lp) cs->worst_lp = d;
    }
    free(ids);
    free(s);
    fr_sampler_destroy(&cpu);
}

/* Random rows of every kind with random parameters, sampled on both sides. */
static void random_batch_test(int vocab, int rows, uint64_t seed)
{
    float *logits = malloc((size_t)vocab * rows * sizeof *logits);
    fr_sample_row *p = malloc((size_t)rows * sizeof *p);
    int *tok = malloc((size_t)rows * sizeof *tok);
    float *lp = malloc((size_t)rows * sizeof *lp);
    assert_non_null(logits);
    assert_non_null(p);
    assert_non_null(tok);
    assert_non_null(lp);
    fr_test_rng r = {seed};
    for (int i = 0; i < rows; i++) {
        make_logits(logits + (size_t)i * vocab, vocab, i % K_KINDS, &r);
        p[i] = random_params(vocab, &r);
        FR_OK_OR_FAIL(fr_sample_row_check(&p[i], vocab));
    }
    gpu_batch b;
    batch_open(&b, vocab, rows);
    batch_upload(&b, logits, p);
    batch_run(&b, tok, lp);
    compare_stats cs = {0, 0, 0.0};
    compare_rows(logits, vocab, p, rows, tok, lp, &cs);
    printf("  vocab %d: %d rows match the CPU (%d near-boundary differences), largest logprob difference %.3g\n",
           vocab, cs.rows, cs.tolerated, cs.worst_lp);
    batch_close(&b);
    free(logits);
    free(p);
    free(tok);
    free(lp);
}

/* ---- tests ------------------------------------------------------------------ */

static void test_bad_arguments(void **state)
{
    (void)state;
    fr_sample_row p = row_params(-1.0f, 0, 1.0f, 0, 0, 0);
    assert_int_equal(fr_sample_row_check(&p, 10), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "temperature"));
    p = row_params(1.0f, -2, 1.0f, 0, 0, 0);
    assert_int_equal(fr_sample_row_check(&p, 10), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "top_k"));
    p = row_params(1.0f, 0, 1.5f, 0, 0, 0);
    assert_int_equal(fr_sample_row_check(&p, 10), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "top_p"));
    p = row_params(1.0f, 0, 1.0f, 0, 0, 0);
    assert_int_equal(fr_sample_row_check(&p, 0), FR_EINVAL);
    assert_int_equal(fr_sample_row_check(NULL, 10), FR_EINVAL);
    assert_int_equal(fr_sample_row_check(&p, 10), FR_OK);

    REQUIRE_GPU();
    fr_sampler_gpu *s = NULL;
    assert_int_equal(fr_sampler_gpu_new(0, 4, &s), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_new(10, 0, &s), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_new((1 << 21) + 1, 4, &s), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_new(10, 4, NULL), FR_EINVAL);
    assert_null(s);
    FR_OK_OR_FAIL(fr_sampler_gpu_new(10, 4, &s));
    float *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, 64));
    assert_int_equal(fr_sampler_gpu_sample(s, d, (const fr_sample_row *)d, 5, (int *)d, NULL, g_stream), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "rows"));
    assert_int_equal(fr_sampler_gpu_sample(s, NULL, (const fr_sample_row *)d, 1, (int *)d, NULL, g_stream), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_sample(s, d, NULL, 1, (int *)d, NULL, g_stream), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_sample(s, d, (const fr_sample_row *)d, 1, NULL, NULL, g_stream), FR_EINVAL);
    assert_int_equal(fr_sampler_gpu_sample(NULL, d, (const fr_sample_row *)d, 1, (int *)d, NULL, g_stream), FR_EINVAL);
    FR_OK_OR_FAIL(fr_sampler_gpu_sample(s, NULL, NULL, 0, NULL, NULL, g_stream));   /* zero rows: nothing to do */
    assert_int_equal(fr_sampler_gpu_uniforms(NULL, 1, (float *)d, g_stream), FR_EINVAL);
    CUDA_OK(cudaFree(d));
    fr_sampler_gpu_destroy(&s);
    assert_null(s);
    fr_sampler_gpu_destroy(&s);
    fr_sampler_gpu_destroy(NULL);
}

/* The draws, bit for bit, including the high halves of the 64-bit inputs. */
static void test_uniforms_match_philox(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const uint64_t vals[] = {0, 1, 0xffffffffull, 0x100000000ull, 0x0123456789abcdefull, ~0ull};
    enum { NV = 6, N = NV * NV * NV + 1000 };
    fr_sample_row *p = malloc(N * sizeof *p);
    float *u = malloc(N * sizeof *u);
    assert_non_null(p);
    assert_non_null(u);
    int n = 0;
    for (int a = 0; a < NV; a++)
        for (int b = 0; b < NV; b++)
            for (int c = 0; c < NV; c++) p[n++] = row_params(1.0f, 0, 1.0f, vals[a], vals[b], vals[c]);
    fr_test_rng r = {99};
    while (n < N) {
        p[n] = row_params(1.0f, 0, 1.0f, fr_test_u64(&r), fr_test_u64(&r), fr_test_u64(&r));
        n++;
    }
    fr_sample_row *d_p = NULL;
    float *d_u = NULL;
    CUDA_OK(cudaMalloc((void **)&d_p, N * sizeof *d_p));
    CUDA_OK(cudaMalloc((void **)&d_u, N * sizeof *d_u));
    CUDA_OK(cudaMemcpy(d_p, p, N * sizeof *p, cudaMemcpyHostToDevice));
    FR_OK_OR_FAIL(fr_sampler_gpu_uniforms(d_p, N, d_u, g_stream));
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaMemcpy(u, d_u, N * sizeof *u, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) {
        float want = fr_philox_uniform(p[i].seed, p[i].sequence, p[i].step);
        if (memcmp(&u[i], &want, sizeof want) != 0)
            fail_msg("draw %d: GPU %.9g CPU %.9g", i, (double)u[i], (double)want);
    }
    CUDA_OK(cudaFree(d_p));
    CUDA_OK(cudaFree(d_u));
    free(p);
    free(u);
}

static void test_small_vocab_matches_cpu(void **state)
{
    (void)state;
    REQUIRE_GPU();
    random_batch_test(SMALL_VOCAB, 600, 1);
    random_batch_test(SMALL_VOCAB, 600, 2);
}

static void test_large_vocab_matches_cpu(void **state)
{
    (void)state;
    REQUIRE_GPU();
    random_batch_test(QWEN_VOCAB, 60, 3);
}

/* One parameter set per row on the same logits, for every distribution, so
 * each path of the kernel (exact, histogram, sub-ranges, tie groups) sees
 * every shape of input. */
static void test_every_param_on_every_kind(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB;
    const fr_sample_row shapes[] = {
        row_params(0.0f, 0, 1.0f, 1, 0, 0),       /* greedy */
        row_params(1.0f, 0, 1.0f, 2, 1, 1),       /* temperature only */
        row_params(0.7f, 0, 1.0f, 3, 2, 2),
        row_params(1.0f, 20, 1.0f, 4, 3, 3),      /* top-k */
        row_params(1.0f, 3000, 1.0f, 5, 4, 4),    /* top-k beyond the exact window */
        row_params(1.0f, 0, 0.9f, 6, 5, 5),       /* top-p */
        row_params(0.6f, 20, 0.95f, 7, 6, 6),     /* both */
        row_params(1.2f, 4000, 0.7f, 8, 7, 7),
        row_params(1.0f, V, 1.0f, 9, 8, 8),       /* top_k >= vocab */
        row_params(1.0f, V + 100, 0.5f, 10, 9, 9),
        row_params(1.0f, 0, 1e-6f, 11, 10, 10),   /* tiny top_p */
        row_params(1.0f, 1, 1.0f, 12, 11, 11),    /* top_k 1 */
    };
    const int ns = (int)(sizeof shapes / sizeof shapes[0]);
    const int rows = ns * K_KINDS;
    float *logits = malloc((size_t)V * rows * sizeof *logits);
    fr_sample_row *p = malloc((size_t)rows * sizeof *p);
    int *tok = malloc((size_t)rows * sizeof *tok);
    float *lp = malloc((size_t)rows * sizeof *lp);
    assert_non_null(logits);
    assert_non_null(p);
    assert_non_null(tok);
    assert_non_null(lp);
    fr_test_rng r = {7};
    for (int kind = 0; kind < K_KINDS; kind++) {
        float *x = logits + (size_t)kind * ns * V;
        make_logits(x, V, kind, &r);
        for (int j = 0; j < ns; j++) {
            if (j) memcpy(x + (size_t)j * V, x, (size_t)V * sizeof *x);
            p[kind * ns + j] = shapes[j];
            p[kind * ns + j].step += 1000 * (uint64_t)kind;
        }
    }
    gpu_batch b;
    batch_open(&b, V, rows);
    batch_upload(&b, logits, p);
    batch_run(&b, tok, lp);
    for (int kind = 0; kind < K_KINDS; kind++) {
        compare_stats cs = {0, 0, 0.0};
        compare_rows(logits + (size_t)kind * ns * V, V, p + kind * ns, ns, tok + kind * ns, lp + kind * ns, &cs);
        printf("  %-12s %d rows match (%d near-boundary), largest logprob difference %.3g\n", kind_name[kind], cs.rows,
               cs.tolerated, cs.worst_lp);
    }
    batch_close(&b);
    free(logits);
    free(p);
    free(tok);
    free(lp);
}

/* +inf, NaN, all -inf, a single finite token, a tiny temperature. */
static void test_special_rows(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = SMALL_VOCAB;
    enum { ROWS = 14 };
    float *logits = malloc((size_t)V * ROWS * sizeof *logits);
    fr_sample_row p[ROWS];
    int tok[ROWS];
    float lp[ROWS];
    assert_non_null(logits);
    fr_test_rng r = {5};
    for (int i = 0; i < ROWS; i++) {
        float *x = logits + (size_t)i * V;
        for (int j = 0; j < V; j++) x[j] = fr_test_normal(&r);
        p[i] = row_params(1.0f, 0, 1.0f, 42, (uint64_t)i, 17);
    }
    float *x;
    x = logits + 0 * V; x[3] = x[100] = x[271] = INFINITY;                      /* +inf: share */
    x = logits + 1 * V; x[3] = x[100] = x[271] = INFINITY; p[1].top_k = 2;      /* +inf, top-k */
    x = logits + 2 * V; x[3] = x[100] = x[271] = INFINITY; p[2].top_p = 0.4f;   /* +inf, top-p */
    x = logits + 3 * V; x[3] = x[100] = x[271] = INFINITY; p[3].temperature = 0.0f;
    x = logits + 4 * V; x[77] = NAN;                                            /* NaN */
    x = logits + 5 * V; for (int j = 0; j < V; j++) x[j] = -INFINITY;           /* nothing left */
    x = logits + 6 * V; for (int j = 0; j < V; j++) x[j] = -INFINITY; x[200] = -5.0f;   /* one token */
    x = logits + 7 * V; x[0] = 3e38f; x[1] = -3e38f; x[2] = 2.9e38f; p[7].temperature = 1e-30f;
    x = logits + 8 * V; p[8].temperature = 1e-30f;                              /* near-greedy */
    x = logits + 9 * V; x[5] = 1e30f; x[6] = 1e30f; p[9].temperature = 3e38f;   /* huge t: flat */
    x = logits + 10 * V; x[9] = NAN; p[10].temperature = 0.0f;                  /* NaN, greedy */
    p[11].temperature = NAN;                                                    /* bad parameters */
    p[12].top_p = 0.0f;
    p[13].top_k = -3;
    gpu_batch b;
    batch_open(&b, V, ROWS);
    batch_upload(&b, logits, p);
    batch_run(&b, tok, lp);
    compare_stats cs = {0, 0, 0.0};
    compare_rows(logits, V, p, 11, tok, lp, &cs);
    assert_int_equal(tok[5], -1);
    assert_int_equal(tok[6], 200);
    for (int i = 11; i < ROWS; i++) {
        assert_int_equal(fr_sample_row_check(&p[i], V), FR_EINVAL);
        assert_int_equal(tok[i], -1);
        assert_true(isnan(lp[i]));
    }
    assert_float_equal(lp[0], -log(3.0), 1e-6);
    batch_close(&b);
    free(logits);
}

/* The same inputs give the same bits; a row's result does not depend on its
 * batch position; another seed gives other tokens. */
static void test_reproducible(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB;
    enum { ROWS = 16 };
    float *logits = malloc((size_t)V * ROWS * sizeof *logits), *swapped = malloc((size_t)V * ROWS * sizeof *swapped);
    fr_sample_row p[ROWS], q[ROWS], sp[ROWS];
    int t1[ROWS], t2[ROWS], t3[ROWS], t4[ROWS];
    float l1[ROWS], l2[ROWS], l3[ROWS], l4[ROWS];
    assert_non_null(logits);
    assert_non_null(swapped);
    fr_test_rng r = {11};
    for (int i = 0; i < ROWS; i++) {
        make_logits(logits + (size_t)i * V, V, i % 2 ? K_NORMAL : K_VERY_FLAT, &r);
        p[i] = row_params(i % 3 ? 1.0f : 0.8f, i % 4 == 1 ? 50 : 0, i % 4 == 2 ? 0.9f : 1.0f, 1234, (uint64_t)i,
                          (uint64_t)(100 + i));
        q[i] = p[i];
        q[i].seed = 1235;
    }
    for (int i = 0; i < ROWS; i++) {   /* reversed batch */
        memcpy(swapped + (size_t)i * V, logits + (size_t)(ROWS - 1 - i) * V, (size_t)V * sizeof(float));
        sp[i] = p[ROWS - 1 - i];
    }
    gpu_batch b;
    batch_open(&b, V, ROWS);
    batch_upload(&b, logits, p);
    batch_run(&b, t1, l1);
    batch_run(&b, t2, l2);
    batch_upload(&b, logits, q);
    batch_run(&b, t3, l3);
    batch_upload(&b, swapped, sp);
    batch_run(&b, t4, l4);
    int same_seed = 0;
    for (int i = 0; i < ROWS; i++) {
        assert_int_equal(t1[i], t2[i]);
        assert_memory_equal(&l1[i], &l2[i], sizeof(float));
        assert_int_equal(t1[i], t4[ROWS - 1 - i]);
        assert_memory_equal(&l1[i], &l4[ROWS - 1 - i], sizeof(float));
        same_seed += t1[i] == t3[i];
    }
    /* Flat rows over 152k tokens almost never repeat a token across seeds. */
    assert_true(same_seed < ROWS / 2);
    compare_stats cs = {0, 0, 0.0};
    compare_rows(logits, V, q, ROWS, t3, l3, &cs);
    batch_close(&b);
    free(logits);
    free(swapped);
}

/* Recorded into a CUDA graph and replayed, the sampler gives what it gives
 * when called directly. */
static void test_graph_capture(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB;
    enum { ROWS = 8 };
    float *logits = malloc((size_t)V * ROWS * sizeof *logits);
    fr_sample_row p[ROWS];
    int t1[ROWS], t2[ROWS];
    float l1[ROWS], l2[ROWS];
    assert_non_null(logits);
    fr_test_rng r = {21};
    for (int i = 0; i < ROWS; i++) {
        make_logits(logits + (size_t)i * V, V, K_NORMAL, &r);
        p[i] = random_params(V, &r);
    }
    gpu_batch b;
    batch_open(&b, V, ROWS);
    batch_upload(&b, logits, p);
    batch_run(&b, t1, l1);
    CUDA_OK(cudaMemset(b.d_tok, 0xff, ROWS * sizeof(int)));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
    FR_OK_OR_FAIL(fr_sampler_gpu_sample(b.s, b.d_logits, b.d_rows, ROWS, b.d_tok, b.d_lp, g_stream));
    CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, g_stream));
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaMemcpy(t2, b.d_tok, sizeof t2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(l2, b.d_lp, sizeof l2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < ROWS; i++) {
        assert_int_equal(t1[i], t2[i]);
        assert_memory_equal(&l1[i], &l2[i], sizeof(float));
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    batch_close(&b);
    free(logits);
}

/* ---- timing (printed, not asserted) ---------------------------------------- */

static void test_timing(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int V = QWEN_VOCAB;
    enum { ROWS = 64, ITERS = 20 };
    float *logits = malloc((size_t)V * ROWS * sizeof *logits);
    fr_sample_row *p = malloc(ROWS * sizeof *p);
    assert_non_null(logits);
    assert_non_null(p);
    fr_test_rng r = {31};
    /* LM-head-like rows: a broad bulk and a few strong candidates. */
    for (int i = 0; i < ROWS; i++) {
        float *x = logits + (size_t)i * V;
        for (int j = 0; j < V; j++) x[j] = 2.5f * fr_test_normal(&r);
        for (int j = 0; j < 8; j++) x[fr_test_u64(&r) % V] = 12.0f + 3.0f * fr_test_uniform(&r);
    }
    static const struct { const char *name; float t; int k; float p; } mixes[] = {
        {"greedy", 0.0f, 0, 1.0f},
        {"T=1 (full vocabulary)", 1.0f, 0, 1.0f},
        {"T=1 top_p=0.9", 1.0f, 0, 0.9f},
        {"T=0.6 top_k=20 top_p=0.95", 0.6f, 20, 0.95f},
        {"T=0.7 top_k=5000", 0.7f, 5000, 1.0f},
    };
    gpu_batch b;
    batch_open(&b, V, ROWS);
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    printf("  %d rows x %d logits:\n", ROWS, V);
    for (size_t m = 0; m < sizeof mixes / sizeof mixes[0]; m++) {
        for (int i = 0; i < ROWS; i++)
            p[i] = row_params(mixes[m].t, mixes[m].k, mixes[m].p, 7, (uint64_t)i, (uint64_t)m);
        batch_upload(&b, logits, p);
        FR_OK_OR_FAIL(fr_sampler_gpu_sample(b.s, b.d_logits, b.d_rows, ROWS, b.d_tok, b.d_lp, g_stream));   /* warm up */
        CUDA_OK(cudaEventRecord(e0, g_stream));
        for (int it = 0; it < ITERS; it++)
            FR_OK_OR_FAIL(fr_sampler_gpu_sample(b.s, b.d_logits, b.d_rows, ROWS, b.d_tok, b.d_lp, g_stream));
        CUDA_OK(cudaEventRecord(e1, g_stream));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        printf("  %-28s %9.1f us per call\n", mixes[m].name, 1000.0 * ms / ITERS);
    }
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    batch_close(&b);
    free(logits);
    free(p);
}

FR_GPU_TEST_MAIN(group_setup, group_teardown,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_uniforms_match_philox),
                 cmocka_unit_test(test_special_rows),
                 cmocka_unit_test(test_small_vocab_matches_cpu),
                 cmocka_unit_test(test_large_vocab_matches_cpu),
                 cmocka_unit_test(test_every_param_on_every_kind),
                 cmocka_unit_test(test_reproducible),
                 cmocka_unit_test(test_graph_capture),
                 cmocka_unit_test(test_timing))
