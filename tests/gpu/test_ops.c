/* What the table of tests/gpu/test_backend_ops.c (every CUDA op against its
 * CPU op, op x dtype x shape) does not cover: argument checks, a zero row,
 * the RoPE table bit for bit, the GEMM plan cache, a CUDA graph replaying
 * to the direct calls' bits, and times for the Qwen3-4B shapes (printed, not
 * asserted). Without a CUDA device every GPU test is skipped with a message.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "attention/fp_formats.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/ops_cpu.h"
#include "rollout/model/ops_cuda.h"
#include "tests/unit/test_util.h"

/* Qwen3-4B */
enum { Q4_HIDDEN = 2560, Q4_HEADS = 32, Q4_KV_HEADS = 8, Q4_HEAD_DIM = 128, Q4_INTER = 9728, Q4_VOCAB = 151936 };
#define Q4_THETA 1000000.0
#define EPS 1e-6f

#define TOL_BF16 (0x1p-8 + 0x1p-16)
#define TOL_BF16_FLOOR 0x1p-133
#define TOL_F32 0x1p-16

/* ---- GPU presence and shared state --------------------------------------- */

static cudaStream_t g_stream;
static fr_gemm *g_gemm;

static int group_setup(void **state)
{
    (void)state;
    if (!fr_gpu_test_available()) return 0;
    if (cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "cannot create a CUDA stream\n");
        return -1;
    }
    if (fr_gemm_new(0, &g_gemm) != FR_OK) {
        fprintf(stderr, "fr_gemm_new: %s\n", fr_last_error());
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    fr_gemm_destroy(&g_gemm);
    if (g_stream) cudaStreamDestroy(g_stream);
    return 0;
}

/* ---- host and device buffers --------------------------------------------- */

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return p;
}

static void *dmalloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static void upload(void *d, const void *h, size_t bytes)
{
    CUDA_OK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaStreamSynchronize(g_stream));
}

static void *dup_to_device(const void *h, size_t bytes)
{
    void *d = dmalloc(bytes);
    upload(d, h, bytes);
    return d;
}

static void download(void *h, const void *d, size_t bytes)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

static float *randn(fr_test_rng *r, size_t n, float mean, float scale)
{
    float *p = xmalloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = mean + scale * fr_test_normal(r);
    return p;
}

/* BF16 values mean + scale * N(0, 1): bits in *bits, their float32 values
 * returned (what the CPU op gets). */
static float *randn_bf16(fr_test_rng *r, size_t n, float mean, float scale, uint16_t **bits)
{
    float *f = xmalloc(n * sizeof *f);
    uint16_t *h = xmalloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) {
        h[i] = fr_bf16_encode(mean + scale * fr_test_normal(r));
        f[i] = fr_bf16_decode(h[i]);
    }
    *bits = h;
    return f;
}

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* ---- comparisons ----------------------------------------------------------- */

static void expect_bits_f32(const char *what, const float *got, const float *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (f32_bits(got[i]) != f32_bits(want[i]))
            fail_msg("%s[%zu]: got %.9g (0x%08x), want %.9g (0x%08x)", what, i, got[i], f32_bits(got[i]), want[i],
                     f32_bits(want[i]));
}

/* ---- argument checks (no device needed) ---------------------------------- */

static void expect_einval(fr_status st, const char *call)
{
    if (st != FR_EINVAL) fail_msg("%s: expected FR_EINVAL, got %s", call, fr_status_name(st));
    if (!fr_last_error()[0]) fail_msg("%s: no message", call);
}
#define EXPECT_EINVAL(call) expect_einval((call), #call)

static void test_bad_arguments(void **state)
{
    (void)state;
    /* Host stand-ins for device buffers: no call below may read them. */
    float f[8] = {0};
    uint16_t b[8] = {0};
    int ids[1] = {0};
    EXPECT_EINVAL(fr_cuda_embed(f, b, ids, -1, 8, 1, 0));
    EXPECT_EINVAL(fr_cuda_embed(f, b, ids, 1, 0, 1, 0));
    EXPECT_EINVAL(fr_cuda_embed(NULL, b, ids, 1, 8, 1, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm(b, f, NULL, b, 1, 0, EPS, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm(b, f, NULL, b, -1, 8, EPS, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm(b, f, NULL, b, 1, 8, -1.0f, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm(NULL, f, NULL, b, 1, 8, EPS, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm_f32(f, NULL, NULL, b, 1, 8, EPS, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm_rows(b, f, 1, NULL, 1, b, 8, EPS, 0));
    EXPECT_EINVAL(fr_cuda_rmsnorm_rows(b, f, -1, ids, 1, b, 8, EPS, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope(f, f, b, b, ids, 1, 1, 1, 7, EPS, f, f, 1, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope(f, f, b, b, ids, 1, 1, 1, 1024, EPS, f, f, 1, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope(f, f, b, b, ids, 1, -1, 1, 8, EPS, f, f, 1, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope(f, f, b, b, ids, 1, 1, 1, 8, EPS, f, f, 0, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope(f, NULL, b, b, ids, 1, 1, 1, 8, EPS, f, f, 1, 0));
    EXPECT_EINVAL(fr_cuda_qk_norm_rope_strided(f, 4, f, 8, b, b, ids, 1, 1, 1, 8, EPS, f, f, 1, 0));
    EXPECT_EINVAL(fr_cuda_swiglu_rows(b, f, 1, 0, 0));
    EXPECT_EINVAL(fr_cuda_swiglu_rows(b, NULL, 1, 8, 0));
    EXPECT_EINVAL(fr_cuda_swiglu(b, NULL, f, 8, 0));
    EXPECT_EINVAL(fr_cuda_f32_to_bf16(NULL, f, 8, 0));
    float *c = f, *s = f;
    EXPECT_EINVAL(fr_cuda_rope_table_new(0, 128, 1e4, NULL, &c, &s));
    assert_null(c);
    assert_null(s);
    EXPECT_EINVAL(fr_cuda_rope_table_new(16, 127, 1e4, NULL, &c, &s));
    EXPECT_EINVAL(fr_cuda_rope_table_new(16, 128, 0.0, NULL, &c, &s));
    EXPECT_EINVAL(fr_gemm_bf16(NULL, f, b, b, 1, 1, 1, 0.0f, 0));
    /* Nothing to do is fine. */
    assert_int_equal(fr_cuda_embed(NULL, NULL, NULL, 0, 8, 1, 0), FR_OK);
    assert_int_equal(fr_cuda_rmsnorm(NULL, NULL, NULL, NULL, 0, 8, EPS, 0), FR_OK);
    assert_int_equal(fr_cuda_swiglu(NULL, NULL, NULL, 0, 0), FR_OK);
    assert_int_equal(fr_cuda_f32_to_bf16(NULL, NULL, 0, 0), FR_OK);
    assert_string_equal(fr_cublas_status_str(15), "CUBLAS_STATUS_NOT_SUPPORTED (configuration not supported)");
    assert_non_null(strstr(fr_cublas_status_str(12345), "12345"));
}

/* ---- edge cases ------------------------------------------------------------- */

static void test_rmsnorm_zero_row(void **state)
{
    (void)state;
    REQUIRE_GPU();
    /* A zero row stays zero (no NaN), as on the CPU. */
    const int n = Q4_HIDDEN;
    float *dx = dmalloc(n * sizeof(float));
    uint16_t *dw = dmalloc(n * sizeof(uint16_t)), *dout = dmalloc(n * sizeof(uint16_t));
    CUDA_OK(cudaMemset(dx, 0, n * sizeof(float)));
    CUDA_OK(cudaMemset(dw, 0x3f, n * sizeof(uint16_t)));
    FR_OK_OR_FAIL(fr_cuda_rmsnorm(dout, dx, NULL, dw, 1, n, EPS, g_stream));
    uint16_t got[Q4_HIDDEN];
    download(got, dout, sizeof got);
    for (int i = 0; i < n; i++) assert_int_equal(got[i], 0);
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dout));
}

/* The table holds fr_rope_cos_sin's bits, plain and with Qwen3's YaRN
 * setting (whose rows then differ from plain RoPE's). */
static void test_rope_table(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int max_pos = 5000, d = Q4_HEAD_DIM, h = d / 2;
    const fr_rope_scaling yarn = {.yarn = 1, .factor = 4, .original_max_position = 32768, .beta_fast = 32,
                                  .beta_slow = 1, .truncate = 1};
    const fr_rope_scaling *scalings[2] = {NULL, &yarn};
    for (int k = 0; k < 2; k++) {
        const fr_rope_scaling *y = scalings[k];
        float *dc = NULL, *ds = NULL;
        FR_OK_OR_FAIL(fr_cuda_rope_table_new(max_pos, d, Q4_THETA, y, &dc, &ds));
        float *c = xmalloc((size_t)max_pos * h * sizeof *c), *s = xmalloc((size_t)max_pos * h * sizeof *s);
        download(c, dc, (size_t)max_pos * h * sizeof *c);
        download(s, ds, (size_t)max_pos * h * sizeof *s);
        const int probe[] = {0, 1, 2, 255, 4095, max_pos - 1};
        for (size_t i = 0; i < sizeof probe / sizeof probe[0]; i++) {
            float wc[64], ws[64], pc[64], ps[64];
            fr_rope_cos_sin(wc, ws, d, probe[i], Q4_THETA, y);
            expect_bits_f32("rope table cos", c + (size_t)probe[i] * h, wc, (size_t)h);
            expect_bits_f32("rope table sin", s + (size_t)probe[i] * h, ws, (size_t)h);
            fr_rope_cos_sin(pc, ps, d, probe[i], Q4_THETA, NULL);
            if (y) assert_true(memcmp(pc, wc, sizeof pc) != 0);   /* YaRN's factor scales even position 0 */
        }
        fr_cuda_rope_table_free(&dc, &ds);
        assert_null(dc);
        assert_null(ds);
        fr_cuda_rope_table_free(&dc, &ds);   /* twice is fine */
        free(c);
        free(s);
    }
}

/* ---- GEMM plans ------------------------------------------------------------ */

#define GEMM_TOL_K 0x1p-18
#define GEMM_NMSE_F32 0x1p-24
#define GEMM_NMSE_BF16 0x1p-14

static void test_gemm_plan_cache(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int M = 64, N = (Q4_HEADS + 2 * Q4_KV_HEADS) * Q4_HEAD_DIM, K = Q4_HIDDEN;
    uint16_t *dx = dmalloc((size_t)M * K * 2), *dw = dmalloc((size_t)N * K * 2);
    float *dy = dmalloc((size_t)M * N * 4);
    CUDA_OK(cudaMemset(dx, 0x3c, (size_t)M * K * 2));
    CUDA_OK(cudaMemset(dw, 0x3c, (size_t)N * K * 2));
    FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, dy, dx, dw, M, N, K, 0.0f, g_stream));   /* plans the shape */
    fr_gemm_stats s0 = fr_gemm_get_stats(g_gemm);
    FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, dy, dx, dw, M, N, K, 0.0f, g_stream));
    FR_OK_OR_FAIL(fr_gemm_prepare(g_gemm, M, N, K, 0, NULL, NULL, NULL));
    fr_gemm_stats s1 = fr_gemm_get_stats(g_gemm);
    assert_int_equal(s1.searches, s0.searches);
    assert_int_equal(s1.plans, s0.plans);
    printf("  gemm plans cached: %d, searches: %ld, flushes: %ld\n", s1.plans, s1.searches, s1.flushes);
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dy));
}

/* ---- CUDA graph capture ----------------------------------------------------- */

/* One layer's MLP half, recorded into a graph after its GEMM plans are
 * prepared, replays to the same bits as the direct calls. */
static void test_graph_capture(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {108};
    const int M = 8, D = 256, I = 512;
    uint16_t *hw1, *hw2, *hn;
    float *fw1 = randn_bf16(&r, (size_t)2 * I * D, 0.0f, 0.05f, &hw1);
    float *fw2 = randn_bf16(&r, (size_t)D * I, 0.0f, 0.05f, &hw2);
    float *fn = randn_bf16(&r, (size_t)D, 1.0f, 0.2f, &hn);
    float *x = randn(&r, (size_t)M * D, 0.0f, 1.0f);
    uint16_t *dw1 = dup_to_device(hw1, (size_t)2 * I * D * 2), *dw2 = dup_to_device(hw2, (size_t)D * I * 2);
    uint16_t *dn = dup_to_device(hn, (size_t)D * 2);
    float *dx = dmalloc((size_t)M * D * 4), *dgu = dmalloc((size_t)M * 2 * I * 4);
    uint16_t *dxn = dmalloc((size_t)M * D * 2), *dh = dmalloc((size_t)M * I * 2);
    float *out[2];
    for (int pass = 0; pass < 2; pass++) {   /* 0: direct calls, 1: a captured graph */
        upload(dx, x, (size_t)M * D * 4);
        cudaGraph_t graph = NULL;
        if (pass == 1) {
            FR_OK_OR_FAIL(fr_gemm_prepare(g_gemm, M, 2 * I, D, 0, dgu, dxn, dw1));
            FR_OK_OR_FAIL(fr_gemm_prepare(g_gemm, M, D, I, 0, dx, dh, dw2));
            CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
        }
        long searches = fr_gemm_get_stats(g_gemm).searches;
        FR_OK_OR_FAIL(fr_cuda_rmsnorm(dxn, dx, NULL, dn, M, D, EPS, g_stream));
        FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, dgu, dxn, dw1, M, 2 * I, D, 0.0f, g_stream));
        FR_OK_OR_FAIL(fr_cuda_swiglu_rows(dh, dgu, M, I, g_stream));
        FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, dx, dh, dw2, M, D, I, 1.0f, g_stream));
        if (pass == 1) {
            assert_int_equal(fr_gemm_get_stats(g_gemm).searches, searches);
            CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
            cudaGraphExec_t exec = NULL;
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            CUDA_OK(cudaGraphLaunch(exec, g_stream));
            CUDA_OK(cudaStreamSynchronize(g_stream));
            CUDA_OK(cudaGraphExecDestroy(exec));
            CUDA_OK(cudaGraphDestroy(graph));
        }
        out[pass] = xmalloc((size_t)M * D * 4);
        download(out[pass], dx, (size_t)M * D * 4);
    }
    expect_bits_f32("graph replay", out[1], out[0], (size_t)M * D);
    printf("  graph replay of norm + gate|up + swiglu + down: bit-identical\n");
    CUDA_OK(cudaFree(dw1)); CUDA_OK(cudaFree(dw2)); CUDA_OK(cudaFree(dn)); CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dgu));
    CUDA_OK(cudaFree(dxn)); CUDA_OK(cudaFree(dh));
    free(hw1); free(hw2); free(hn); free(fw1); free(fw2); free(fn); free(x); free(out[0]); free(out[1]);
}

/* ---- timing (printed, not asserted) ---------------------------------------- */

typedef fr_status (*op_fn)(void *ctx);

/* Mean microseconds per call over `iters` calls after a warm-up. */
static double time_us(op_fn fn, void *ctx, int iters)
{
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) FR_OK_OR_FAIL(fn(ctx));
    CUDA_OK(cudaEventRecord(a, g_stream));
    for (int i = 0; i < iters; i++) FR_OK_OR_FAIL(fn(ctx));
    CUDA_OK(cudaEventRecord(b, g_stream));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    return 1000.0 * ms / iters;
}

typedef struct {
    int M, N, K, rows;
    void *y, *x, *w, *aux;
    int *ids;
    float *cos_t, *sin_t;
} bench_ctx;

static fr_status run_gemm(void *p)
{
    bench_ctx *c = p;
    return fr_gemm_bf16(g_gemm, c->y, c->x, c->w, c->M, c->N, c->K, 0.0f, g_stream);
}
static fr_status run_rmsnorm(void *p)
{
    bench_ctx *c = p;
    return fr_cuda_rmsnorm(c->y, c->x, c->aux, c->w, c->rows, Q4_HIDDEN, EPS, g_stream);
}
static fr_status run_qk(void *p)
{
    bench_ctx *c = p;
    float *q = c->x;
    return fr_cuda_qk_norm_rope(q, q + (size_t)c->rows * Q4_HEADS * Q4_HEAD_DIM, c->w, c->w, c->ids, c->rows, Q4_HEADS,
                                Q4_KV_HEADS, Q4_HEAD_DIM, EPS, c->cos_t, c->sin_t, 4096, g_stream);
}
static fr_status run_swiglu(void *p)
{
    bench_ctx *c = p;
    return fr_cuda_swiglu_rows(c->y, c->x, c->rows, Q4_INTER, g_stream);
}
static fr_status run_embed(void *p)
{
    bench_ctx *c = p;
    return fr_cuda_embed(c->y, c->w, c->ids, c->rows, Q4_HIDDEN, Q4_VOCAB, g_stream);
}

static void test_timing_4b(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int maxM = 1024, qkv = (Q4_HEADS + 2 * Q4_KV_HEADS) * Q4_HEAD_DIM;
    const size_t wmax = (size_t)Q4_VOCAB * Q4_HIDDEN;   /* the LM head is the largest weight */
    uint16_t *w = dmalloc(wmax * 2), *x = dmalloc((size_t)maxM * Q4_INTER * 2);
    float *y = dmalloc((size_t)maxM * Q4_VOCAB * 4);
    CUDA_OK(cudaMemset(w, 0x3c, wmax * 2));   /* BF16 0x3c3c = 0.0115 */
    CUDA_OK(cudaMemset(x, 0x3c, (size_t)maxM * Q4_INTER * 2));
    printf("  Qwen3-4B GEMM (BF16 in, FP32 out):\n");
    printf("  %-12s %6s %8s %8s %10s %9s %9s\n", "layer", "M", "N", "K", "us", "TFLOP/s", "GB/s");
    const struct { const char *name; int N, K; } layers[] = {
        {"qkv", qkv, Q4_HIDDEN}, {"o_proj", Q4_HIDDEN, Q4_HEADS * Q4_HEAD_DIM}, {"gate_up", 2 * Q4_INTER, Q4_HIDDEN},
        {"down_proj", Q4_HIDDEN, Q4_INTER}, {"lm_head", Q4_VOCAB, Q4_HIDDEN},
    };
    const int Ms[] = {1, 8, 64, 256, 1024};
    for (size_t li = 0; li < sizeof layers / sizeof layers[0]; li++)
        for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
            bench_ctx c = {.M = Ms[mi], .N = layers[li].N, .K = layers[li].K, .y = y, .x = x, .w = w};
            double us = time_us(run_gemm, &c, 20);
            double flop = 2.0 * c.M * c.N * c.K;
            double bytes = 2.0 * ((double)c.N * c.K + (double)c.M * c.K) + 4.0 * c.M * c.N;
            printf("  %-12s %6d %8d %8d %10.1f %9.1f %9.0f\n", layers[li].name, c.M, c.N, c.K, us, flop / us * 1e-6,
                   bytes / us * 1e-3);
        }
    float *dc, *ds;
    FR_OK_OR_FAIL(fr_cuda_rope_table_new(4096, Q4_HEAD_DIM, Q4_THETA, NULL, &dc, &ds));
    int *ids = dmalloc((size_t)maxM * sizeof(int));
    CUDA_OK(cudaMemset(ids, 0, (size_t)maxM * sizeof(int)));
    float *fx = dmalloc((size_t)maxM * 2 * Q4_INTER * 4), *delta = dmalloc((size_t)maxM * Q4_HIDDEN * 4);
    CUDA_OK(cudaMemset(fx, 0, (size_t)maxM * 2 * Q4_INTER * 4));
    CUDA_OK(cudaMemset(delta, 0, (size_t)maxM * Q4_HIDDEN * 4));
    printf("  Qwen3-4B ops:\n  %-28s %6s %10s %9s\n", "op", "rows", "us", "GB/s");
    const int rows[] = {1, 64, 256, 1024};
    for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
        int R = rows[ri];
        bench_ctx c = {.rows = R, .y = x, .x = fx, .w = w, .aux = delta, .ids = ids, .cos_t = dc, .sin_t = ds};
        double us = time_us(run_rmsnorm, &c, 50);
        printf("  %-28s %6d %10.2f %9.0f\n", "rmsnorm+residual 2560", R, us, (double)R * Q4_HIDDEN * 14 / us * 1e-3);
        us = time_us(run_qk, &c, 50);
        printf("  %-28s %6d %10.2f %9.0f\n", "qk_norm_rope 32/8 x 128", R, us,
               (double)R * (Q4_HEADS + Q4_KV_HEADS) * Q4_HEAD_DIM * 8 / us * 1e-3);
        c.y = x;
        us = time_us(run_swiglu, &c, 50);
        printf("  %-28s %6d %10.2f %9.0f\n", "swiglu_rows 9728", R, us, (double)R * Q4_INTER * 10 / us * 1e-3);
        c.y = y;
        us = time_us(run_embed, &c, 50);
        printf("  %-28s %6d %10.2f %9.0f\n", "embed 2560", R, us, (double)R * Q4_HIDDEN * 6 / us * 1e-3);
    }
    fr_cuda_rope_table_free(&dc, &ds);
    CUDA_OK(cudaFree(ids)); CUDA_OK(cudaFree(fx)); CUDA_OK(cudaFree(delta));
    CUDA_OK(cudaFree(w)); CUDA_OK(cudaFree(x)); CUDA_OK(cudaFree(y));
}

FR_GPU_TEST_MAIN(group_setup, group_teardown,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_rmsnorm_zero_row),
                 cmocka_unit_test(test_rope_table),
                 cmocka_unit_test(test_gemm_plan_cache),
                 cmocka_unit_test(test_graph_capture),
                 cmocka_unit_test(test_timing_4b))
