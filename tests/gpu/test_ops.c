/* The CUDA ops of the forward pass (rollout/model/ops_cuda.h) and the matrix
 * products (rollout/model/gemm_cuda.h), each against its CPU op (rollout/model/ops_cpu.h)
 * on the same inputs: the CPU op gets the BF16-rounded values the GPU sees.
 * Without a CUDA device every GPU test is skipped with a message.
 *
 * Tolerance rules (u = 2^-8, BF16's unit roundoff: |bf16(v) - v| <= u |v|
 * for every finite v, subnormals aside):
 *
 *   exact       embed, f32_to_bf16, the residual add x += delta, the RoPE
 *               table, out-of-range ids and positions (zero rows): bit for bit.
 *   BF16 out    rmsnorm, rmsnorm_rows, swiglu (the GPU evaluates the CPU's
 *               float32 expression, then rounds to BF16), against the CPU's
 *               unrounded float32 result `want`:
 *                   |got - want| <= (2^-8 + 2^-16) |want| + 2^-133
 *               one BF16 rounding, plus 2^-16 for float32-level differences in
 *               the value before rounding (order of the sum of squares, the
 *               device expf's 2-ulp error), plus half a BF16 subnormal step.
 *   FP32 out    rmsnorm_f32: |got - want| <= 2^-16 |want| per element.
 *               qk_norm_rope: |got - want| <= 2^-16 max|want over the head|
 *               (a rotation mixes two elements, so an element that cancels to
 *               near zero is judged against its head). The GPU does the same
 *               float32 operations in the same order, so the real differences
 *               are a few float32 ulps (2^-23); 2^-16 is a wide margin that
 *               still fails on anything BF16-sized.
 *   GEMM        both sides sum the same exact products (BF16 x BF16 is exact
 *               in FP32) in FP32 in different orders. Rounding errors of a
 *               K-term FP32 sum grow like 2^-24 K |term| at worst in practice,
 *               so per element i, j:
 *                   |got - want| <= 2^-18 K max_k|x[i][k]| max_k|w[j][k]|
 *               (about 1000 times the typical difference), and over the whole
 *               matrix, in the spirit of ggml's test-backend-ops:
 *                   NMSE = sum (got - want)^2 / sum want^2 <= 2^-24
 *               which fails on FP16/BF16 accumulation or inputs rounded below
 *               BF16 (those give NMSE around 2^-16 or worse). With beta = 1
 *               the sum with y adds one float32 rounding: + 2^-23 |want|.
 *               BF16 output: + 2^-8 |want| per element, NMSE <= 2^-14.
 *
 * Each case prints the largest error as a fraction of its tolerance, and the
 * share of BF16 outputs identical to the CPU result rounded to BF16.
 * test_timing_4b prints times for the Qwen3-4B shapes (not asserted).
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

static float bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ---- comparisons ----------------------------------------------------------- */

typedef struct {
    double worst;       /* largest error / tolerance */
    size_t n, same;     /* values compared; BF16 outputs equal to bf16(want) */
} cmp_stats;

static void cmp(cmp_stats *s, const char *what, size_t i, double got, double want, double tol)
{
    double err = fabs(got - want);
    if (!(err <= tol))
        fail_msg("%s[%zu]: got %.9g, want %.9g (error %.3g > tolerance %.3g)", what, i, got, want, err, tol);
    if (tol > 0 && err / tol > s->worst) s->worst = err / tol;
    s->n++;
}

/* A BF16 output against the CPU's float32 value (rule "BF16 out"). */
static void cmp_bf16(cmp_stats *s, const char *what, size_t i, uint16_t got, float want)
{
    cmp(s, what, i, fr_bf16_decode(got), want, TOL_BF16 * fabs((double)want) + TOL_BF16_FLOOR);
    if (got == fr_bf16_encode(want)) s->same++;
}

static void report(const char *what, const cmp_stats *s, int bf16)
{
    if (bf16 && s->n)
        printf("  %-40s max err/tol %.3f, BF16 identical to the CPU's %.2f%%\n", what, s->worst,
               100.0 * (double)s->same / (double)s->n);
    else
        printf("  %-40s max err/tol %.3f\n", what, s->worst);
}

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
    EXPECT_EINVAL(fr_cuda_rope_table_new(0, 128, 1e4, &c, &s));
    assert_null(c);
    assert_null(s);
    EXPECT_EINVAL(fr_cuda_rope_table_new(16, 127, 1e4, &c, &s));
    EXPECT_EINVAL(fr_cuda_rope_table_new(16, 128, 0.0, &c, &s));
    EXPECT_EINVAL(fr_gemm_bf16(NULL, f, b, b, 1, 1, 1, 0.0f, 0));
    /* Nothing to do is fine. */
    assert_int_equal(fr_cuda_embed(NULL, NULL, NULL, 0, 8, 1, 0), FR_OK);
    assert_int_equal(fr_cuda_rmsnorm(NULL, NULL, NULL, NULL, 0, 8, EPS, 0), FR_OK);
    assert_int_equal(fr_cuda_swiglu(NULL, NULL, NULL, 0, 0), FR_OK);
    assert_int_equal(fr_cuda_f32_to_bf16(NULL, NULL, 0, 0), FR_OK);
    assert_string_equal(fr_cublas_status_str(15), "CUBLAS_STATUS_NOT_SUPPORTED (configuration not supported)");
    assert_non_null(strstr(fr_cublas_status_str(12345), "12345"));
}

/* ---- f32_to_bf16 ------------------------------------------------------------ */

static void check_convert(const float *in, size_t n, size_t offset)
{
    float *din = dmalloc((n + offset) * sizeof *din);
    uint16_t *dout = dmalloc((n + offset) * sizeof *dout);
    upload(din + offset, in, n * sizeof *in);
    FR_OK_OR_FAIL(fr_cuda_f32_to_bf16(dout + offset, din + offset, n, g_stream));
    uint16_t *got = xmalloc(n * sizeof *got);
    download(got, dout + offset, n * sizeof *got);
    for (size_t i = 0; i < n; i++)
        if (got[i] != fr_bf16_encode(in[i]))
            fail_msg("f32_to_bf16[%zu] of %zu (offset %zu): %.9g (0x%08x) -> 0x%04x, want 0x%04x", i, n, offset,
                     in[i], f32_bits(in[i]), got[i], fr_bf16_encode(in[i]));
    free(got);
    CUDA_OK(cudaFree(din));
    CUDA_OK(cudaFree(dout));
}

static void test_f32_to_bf16(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,   /* +-0, +-inf */
        0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu,   /* NaNs, signalling too */
        0x7f7fffffu, 0xff7fffffu, 0x7f7f7fffu, 0x7f7f8000u,   /* max float; just below and at a tie to inf */
        0x00000001u, 0x00008000u, 0x00018000u, 0x007fffffu,   /* subnormals, ties among them */
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu,   /* ties to even (down, up), just above/below */
        0xbf808000u, 0xbf818000u, 0x00800000u, 0x80800000u,
    };
    const size_t ns = sizeof special / sizeof special[0];
    fr_test_rng r = {101};
    const size_t sizes[] = {1, 7, 8, 9, ns, 4099, (size_t)1 << 20};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        float *in = xmalloc(n * sizeof *in);
        for (size_t i = 0; i < n; i++) {
            if (i < ns && n >= ns) {
                in[i] = bits_f32(special[i]);
            } else if (i % 3 == 0) {
                in[i] = bits_f32((uint32_t)fr_test_u64(&r));   /* any bit pattern */
            } else {
                int e = (int)(fr_test_u64(&r) % 250) - 125;
                in[i] = ldexpf(fr_test_normal(&r), e);
            }
        }
        check_convert(in, n, 0);
        if (n > 8) check_convert(in, n, 1);   /* 4-byte aligned: the scalar path */
        free(in);
    }
    printf("  f32_to_bf16: bit-exact with fr_bf16_encode\n");
}

/* ---- embed ------------------------------------------------------------------- */

static void embed_case(fr_test_rng *r, int n, int hidden, int vocab, size_t offset)
{
    uint16_t *table;
    float *tf = randn_bf16(r, (size_t)vocab * hidden, 0.0f, 0.05f, &table);
    int *ids = xmalloc((size_t)n * sizeof *ids), *cpu_ids = xmalloc((size_t)n * sizeof *ids);
    for (int t = 0; t < n; t++) {
        ids[t] = (int)(fr_test_u64(r) % (uint64_t)vocab);
        if (t == 1) ids[t] = -1;
        if (t == 2) ids[t] = vocab;          /* out of range: a zero row */
        if (t == 3) ids[t] = vocab - 1;
        if (t == 4) ids[t] = 0;
        cpu_ids[t] = ids[t] >= vocab ? -1 : ids[t];
    }
    size_t nx = (size_t)n * hidden;
    float *want = xmalloc(nx * sizeof *want), *got = xmalloc(nx * sizeof *got);
    fr_embed(want, tf, cpu_ids, n, hidden);
    uint16_t *dt = dup_to_device(table, (size_t)vocab * hidden * sizeof *table);
    int *dids = dup_to_device(ids, (size_t)n * sizeof *ids);
    float *dx = dmalloc((nx + offset) * sizeof *dx);
    CUDA_OK(cudaMemset(dx, 0xff, (nx + offset) * sizeof *dx));   /* NaN everywhere: every value must be written */
    FR_OK_OR_FAIL(fr_cuda_embed(dx + offset, dt, dids, n, hidden, vocab, g_stream));
    download(got, dx + offset, nx * sizeof *got);
    char what[96];
    snprintf(what, sizeof what, "embed %dx%d vocab %d offset %zu", n, hidden, vocab, offset);
    expect_bits_f32(what, got, want, nx);
    printf("  %-40s bit-exact\n", what);
    CUDA_OK(cudaFree(dt));
    CUDA_OK(cudaFree(dids));
    CUDA_OK(cudaFree(dx));
    free(table); free(tf); free(ids); free(cpu_ids); free(want); free(got);
}

static void test_embed(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {102};
    embed_case(&r, 33, Q4_HIDDEN, 1000, 0);
    embed_case(&r, 5, Q4_HIDDEN, 300, 1);     /* misaligned output: scalar path */
    embed_case(&r, 9, 7, 50, 0);              /* odd hidden */
    embed_case(&r, 6, 8, 10, 0);
    embed_case(&r, 300, 128, 272, 0);
}

/* ---- RMSNorm ---------------------------------------------------------------- */

/* One rmsnorm case: BF16 or float32 output, with or without delta, buffers
 * shifted by `offset` elements (1: misaligned, the scalar path). */
static void rmsnorm_case(fr_test_rng *r, int rows, int n, int with_delta, int f32_out, size_t offset, int in_place)
{
    size_t nx = (size_t)rows * n;
    float *x = randn(r, nx, 0.0f, 3.0f), *delta = with_delta ? randn(r, nx, 0.0f, 1.0f) : NULL;
    uint16_t *w;
    float *wf = randn_bf16(r, (size_t)n, 1.0f, 0.2f, &w);
    /* CPU: the residual add in float32, then fr_rmsnorm. */
    float *xs = xmalloc(nx * sizeof *xs), *want = xmalloc(nx * sizeof *want);
    for (size_t i = 0; i < nx; i++) xs[i] = with_delta ? x[i] + delta[i] : x[i];
    fr_rmsnorm(want, xs, wf, rows, n, EPS);

    float *dx = dmalloc((nx + offset) * sizeof *dx), *dd = NULL;
    upload(dx + offset, x, nx * sizeof *x);
    if (with_delta) {
        dd = dmalloc((nx + offset) * sizeof *dd);
        upload(dd + offset, delta, nx * sizeof *delta);
    }
    uint16_t *dw = dmalloc(((size_t)n + offset) * sizeof *dw);
    upload(dw + offset, w, (size_t)n * sizeof *w);
    void *dout = in_place ? (void *)dx : dmalloc((nx + offset) * sizeof(float));
    char what[96];
    snprintf(what, sizeof what, "rmsnorm%s %dx%d%s%s%s", f32_out ? "_f32" : "", rows, n, with_delta ? " +delta" : "",
             offset ? " misaligned" : "", in_place ? " in place" : "");
    cmp_stats s = {0};
    if (f32_out) {
        float *o = (float *)dout + offset;
        FR_OK_OR_FAIL(fr_cuda_rmsnorm_f32(o, dx + offset, dd ? dd + offset : NULL, dw + offset, rows, n, EPS, g_stream));
        float *got = xmalloc(nx * sizeof *got);
        download(got, o, nx * sizeof *got);
        for (size_t i = 0; i < nx; i++) cmp(&s, what, i, got[i], want[i], TOL_F32 * fabs((double)want[i]));
        free(got);
    } else {
        uint16_t *o = (uint16_t *)dout + offset;
        FR_OK_OR_FAIL(fr_cuda_rmsnorm(o, dx + offset, dd ? dd + offset : NULL, dw + offset, rows, n, EPS, g_stream));
        uint16_t *got = xmalloc(nx * sizeof *got);
        download(got, o, nx * sizeof *got);
        for (size_t i = 0; i < nx; i++) cmp_bf16(&s, what, i, got[i], want[i]);
        free(got);
    }
    if (!in_place) {   /* the residual stream after the add, bit for bit */
        float *gx = xmalloc(nx * sizeof *gx);
        download(gx, dx + offset, nx * sizeof *gx);
        expect_bits_f32(what, gx, xs, nx);
        free(gx);
    }
    report(what, &s, !f32_out);
    CUDA_OK(cudaFree(dx));
    if (dd) CUDA_OK(cudaFree(dd));
    CUDA_OK(cudaFree(dw));
    if (!in_place) CUDA_OK(cudaFree(dout));
    free(x); free(delta); free(w); free(wf); free(xs); free(want);
}

static void test_rmsnorm(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {103};
    const int shapes[][2] = {{1, Q4_HIDDEN}, {64, Q4_HIDDEN}, {3, 7}, {5, 128}, {2, 1}, {4, 4096},
                             {2, Q4_INTER}, {3, 30000}, {2, 40000}, {3, 2561}, {7, 8}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int delta = 0; delta < 2; delta++)
            for (int f32 = 0; f32 < 2; f32++) rmsnorm_case(&r, shapes[i][0], shapes[i][1], delta, f32, 0, 0);
    rmsnorm_case(&r, 4, Q4_HIDDEN, 1, 0, 1, 0);
    rmsnorm_case(&r, 4, Q4_HIDDEN, 1, 1, 1, 0);
    rmsnorm_case(&r, 4, Q4_HIDDEN, 1, 1, 0, 1);
    rmsnorm_case(&r, 4, 100, 0, 1, 1, 1);
}

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

static void test_rmsnorm_rows(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {104};
    const int widths[] = {Q4_HIDDEN, 13};
    for (int wi = 0; wi < 2; wi++) {
        const int n = widths[wi], x_rows = 10;
        const int ids[] = {3, 0, 9, -1, 10, 3, 7};
        const int n_out = (int)(sizeof ids / sizeof ids[0]);
        float *x = randn(&r, (size_t)x_rows * n, 0.0f, 2.0f);
        uint16_t *w;
        float *wf = randn_bf16(&r, (size_t)n, 1.0f, 0.2f, &w);
        float *want = xmalloc((size_t)n_out * n * sizeof *want);
        for (int o = 0; o < n_out; o++) {
            float *dst = want + (size_t)o * n;
            if (ids[o] < 0 || ids[o] >= x_rows) memset(dst, 0, (size_t)n * sizeof *dst);
            else fr_rmsnorm(dst, x + (size_t)ids[o] * n, wf, 1, n, EPS);
        }
        float *dx = dup_to_device(x, (size_t)x_rows * n * sizeof *x);
        uint16_t *dw = dup_to_device(w, (size_t)n * sizeof *w);
        int *dids = dup_to_device(ids, sizeof ids);
        uint16_t *dout = dmalloc((size_t)n_out * n * sizeof *dout);
        FR_OK_OR_FAIL(fr_cuda_rmsnorm_rows(dout, dx, x_rows, dids, n_out, dw, n, EPS, g_stream));
        uint16_t *got = xmalloc((size_t)n_out * n * sizeof *got);
        download(got, dout, (size_t)n_out * n * sizeof *got);
        char what[64];
        snprintf(what, sizeof what, "rmsnorm_rows %d of %dx%d", n_out, x_rows, n);
        cmp_stats s = {0};
        for (size_t i = 0; i < (size_t)n_out * n; i++) cmp_bf16(&s, what, i, got[i], want[i]);
        for (int i = 0; i < n; i++) {   /* zero rows exactly */
            assert_int_equal(got[3 * n + i], 0);
            assert_int_equal(got[4 * n + i], 0);
        }
        float *gx = xmalloc((size_t)x_rows * n * sizeof *gx);   /* x untouched */
        download(gx, dx, (size_t)x_rows * n * sizeof *gx);
        expect_bits_f32("rmsnorm_rows source", gx, x, (size_t)x_rows * n);
        report(what, &s, 1);
        CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dids)); CUDA_OK(cudaFree(dout));
        free(x); free(w); free(wf); free(want); free(got); free(gx);
    }
}

/* ---- q/k norm + RoPE -------------------------------------------------------- */

static void test_rope_table(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int max_pos = 5000, d = Q4_HEAD_DIM, h = d / 2;
    float *dc = NULL, *ds = NULL;
    FR_OK_OR_FAIL(fr_cuda_rope_table_new(max_pos, d, Q4_THETA, &dc, &ds));
    float *c = xmalloc((size_t)max_pos * h * sizeof *c), *s = xmalloc((size_t)max_pos * h * sizeof *s);
    download(c, dc, (size_t)max_pos * h * sizeof *c);
    download(s, ds, (size_t)max_pos * h * sizeof *s);
    const int probe[] = {0, 1, 2, 255, 4095, max_pos - 1};
    for (size_t i = 0; i < sizeof probe / sizeof probe[0]; i++) {
        float wc[64], ws[64];
        fr_rope_cos_sin(wc, ws, d, probe[i], Q4_THETA);
        expect_bits_f32("rope table cos", c + (size_t)probe[i] * h, wc, (size_t)h);
        expect_bits_f32("rope table sin", s + (size_t)probe[i] * h, ws, (size_t)h);
    }
    fr_cuda_rope_table_free(&dc, &ds);
    assert_null(dc);
    assert_null(ds);
    fr_cuda_rope_table_free(&dc, &ds);   /* twice is fine */
    free(c);
    free(s);
}

/* CPU reference of fr_cuda_qk_norm_rope on rows of `heads` head vectors. */
static void ref_norm_rope(float *x, const float *wf, const int *pos, int rows, int heads, int d, int max_pos,
                          double theta)
{
    for (int t = 0; t < rows; t++) {
        float *xr = x + (size_t)t * heads * d;
        if (pos[t] < 0 || pos[t] >= max_pos) {
            memset(xr, 0, (size_t)heads * d * sizeof *xr);
            continue;
        }
        fr_rmsnorm(xr, xr, wf, heads, d, EPS);
        fr_rope(xr, heads, d, pos[t], theta);
    }
}

/* Per head: |got - want| <= 2^-16 max|want over the head|; zero rows exact. */
static void cmp_heads(cmp_stats *s, const char *what, const float *got, const float *want, size_t n_heads, int d)
{
    for (size_t hd = 0; hd < n_heads; hd++) {
        const float *g = got + hd * d, *w = want + hd * d;
        double mx = 0;
        for (int i = 0; i < d; i++) mx = fmax(mx, fabs((double)w[i]));
        for (int i = 0; i < d; i++) cmp(s, what, hd * d + i, g[i], w[i], TOL_F32 * mx);
        for (int i = 0; i < d; i++)
            if (f32_bits(g[i]) == f32_bits(w[i])) s->same++;
    }
}

static void qk_case(fr_test_rng *r, int rows, int H, int KVH, int d, double theta)
{
    const int max_pos = 4096;
    size_t nq = (size_t)rows * H * d, nk = (size_t)rows * KVH * d;
    float *q = randn(r, nq, 0.0f, 2.0f), *k = randn(r, nk, 0.0f, 2.0f);
    uint16_t *qw, *kw;
    float *qwf = randn_bf16(r, (size_t)d, 1.0f, 0.3f, &qw), *kwf = randn_bf16(r, (size_t)d, 1.0f, 0.3f, &kw);
    int *pos = xmalloc((size_t)rows * sizeof *pos);
    for (int t = 0; t < rows; t++) pos[t] = (int)(fr_test_u64(r) % max_pos);
    pos[0] = 0;
    if (rows > 1) pos[1] = max_pos - 1;
    if (rows > 3) pos[3] = max_pos;          /* out of range: zero rows */
    if (rows > 4) pos[4] = -2;

    float *wq = xmalloc((nq ? nq : 1) * sizeof *wq), *wk = xmalloc((nk ? nk : 1) * sizeof *wk);
    memcpy(wq, q, nq * sizeof *q);
    memcpy(wk, k, nk * sizeof *k);
    ref_norm_rope(wq, qwf, pos, rows, H, d, max_pos, theta);
    ref_norm_rope(wk, kwf, pos, rows, KVH, d, max_pos, theta);

    float *dc, *ds;
    FR_OK_OR_FAIL(fr_cuda_rope_table_new(max_pos, d, theta, &dc, &ds));
    float *dq = H ? dup_to_device(q, nq * sizeof *q) : NULL, *dk = KVH ? dup_to_device(k, nk * sizeof *k) : NULL;
    uint16_t *dqw = dup_to_device(qw, (size_t)d * sizeof *qw), *dkw = dup_to_device(kw, (size_t)d * sizeof *kw);
    int *dpos = dup_to_device(pos, (size_t)rows * sizeof *pos);
    FR_OK_OR_FAIL(fr_cuda_qk_norm_rope(dq, dk, dqw, KVH ? dkw : NULL, dpos, rows, H, KVH, d, EPS, dc, ds, max_pos, g_stream));
    float *gq = xmalloc((nq ? nq : 1) * sizeof *gq), *gk = xmalloc((nk ? nk : 1) * sizeof *gk);
    if (H) download(gq, dq, nq * sizeof *gq);
    if (KVH) download(gk, dk, nk * sizeof *gk);
    char what[96];
    snprintf(what, sizeof what, "qk_norm_rope %d rows, %d/%d heads x %d", rows, H, KVH, d);
    cmp_stats s = {0};
    cmp_heads(&s, what, gq, wq, (size_t)rows * H, d);
    cmp_heads(&s, what, gk, wk, (size_t)rows * KVH, d);
    printf("  %-40s max err/tol %.3f, float32 bit-identical %.2f%%\n", what, s.worst,
           s.n ? 100.0 * (double)s.same / (double)s.n : 100.0);

    /* The fused q|k|v layout: same results for q and k, v untouched. */
    if (H && KVH) {
        size_t row = (size_t)(H + 2 * KVH) * d;
        float *qkv = xmalloc((size_t)rows * row * sizeof *qkv);
        for (int t = 0; t < rows; t++) {
            memcpy(qkv + t * row, q + (size_t)t * H * d, (size_t)H * d * sizeof *q);
            memcpy(qkv + t * row + (size_t)H * d, k + (size_t)t * KVH * d, (size_t)KVH * d * sizeof *k);
            for (size_t i = (size_t)(H + KVH) * d; i < row; i++) qkv[t * row + i] = fr_test_normal(r);
        }
        float *dqkv = dup_to_device(qkv, (size_t)rows * row * sizeof *qkv);
        FR_OK_OR_FAIL(fr_cuda_qk_norm_rope_strided(dqkv, row, dqkv + (size_t)H * d, row, dqw, dkw, dpos, rows, H, KVH, d, EPS, dc,
                                        ds, max_pos, g_stream));
        float *g2 = xmalloc((size_t)rows * row * sizeof *g2);
        download(g2, dqkv, (size_t)rows * row * sizeof *g2);
        for (int t = 0; t < rows; t++) {
            expect_bits_f32("qk_norm_rope strided q", g2 + t * row, gq + (size_t)t * H * d, (size_t)H * d);
            expect_bits_f32("qk_norm_rope strided k", g2 + t * row + (size_t)H * d, gk + (size_t)t * KVH * d,
                            (size_t)KVH * d);
            expect_bits_f32("qk_norm_rope strided v", g2 + t * row + (size_t)(H + KVH) * d,
                            qkv + t * row + (size_t)(H + KVH) * d, (size_t)KVH * d);
        }
        CUDA_OK(cudaFree(dqkv));
        free(qkv);
        free(g2);
    }
    fr_cuda_rope_table_free(&dc, &ds);
    if (dq) CUDA_OK(cudaFree(dq));
    if (dk) CUDA_OK(cudaFree(dk));
    CUDA_OK(cudaFree(dqw)); CUDA_OK(cudaFree(dkw)); CUDA_OK(cudaFree(dpos));
    free(q); free(k); free(qw); free(kw); free(qwf); free(kwf); free(pos); free(wq); free(wk); free(gq); free(gk);
}

static void test_qk_norm_rope(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {105};
    qk_case(&r, 1, Q4_HEADS, Q4_KV_HEADS, Q4_HEAD_DIM, Q4_THETA);
    qk_case(&r, 17, Q4_HEADS, Q4_KV_HEADS, Q4_HEAD_DIM, Q4_THETA);
    qk_case(&r, 3, 4, 2, 64, 10000.0);        /* synthetic:tiny */
    qk_case(&r, 5, 3, 1, 96, 10000.0);        /* half a head not a multiple of 32 */
    qk_case(&r, 6, 1, 1, 2, 10000.0);
    qk_case(&r, 4, 2, 2, 512, Q4_THETA);
    qk_case(&r, 8, 4, 2, 256, Q4_THETA);
    qk_case(&r, 5, 5, 0, 64, 10000.0);        /* no k heads */
    qk_case(&r, 5, 0, 3, 64, 10000.0);        /* no q heads */
}

/* ---- SwiGLU ------------------------------------------------------------------- */

static void fill_gate(fr_test_rng *r, float *g, size_t n)
{
    static const float special[] = {-100.0f, -20.0f, -0.0f, 0.0f, 20.0f, 100.0f, -87.0f, 88.5f};
    for (size_t i = 0; i < n; i++) g[i] = i < 8 && n > 64 ? special[i] : 3.0f * fr_test_normal(r);
}

static void test_swiglu(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {106};
    const size_t sizes[] = {1, 7, 8, 1000, (size_t)Q4_INTER * 3 + 5};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        float *g = xmalloc(n * sizeof *g), *u = randn(&r, n, 0.0f, 2.0f), *want = xmalloc(n * sizeof *want);
        fill_gate(&r, g, n);
        fr_swiglu(want, g, u, (int)n);
        float *dg = dup_to_device(g, n * sizeof *g), *du = dup_to_device(u, n * sizeof *u);
        uint16_t *dout = dmalloc(n * sizeof *dout), *got = xmalloc(n * sizeof *got);
        FR_OK_OR_FAIL(fr_cuda_swiglu(dout, dg, du, n, g_stream));
        download(got, dout, n * sizeof *got);
        char what[64];
        snprintf(what, sizeof what, "swiglu n %zu", n);
        cmp_stats s = {0};
        for (size_t i = 0; i < n; i++) cmp_bf16(&s, what, i, got[i], want[i]);
        report(what, &s, 1);
        CUDA_OK(cudaFree(dg)); CUDA_OK(cudaFree(du)); CUDA_OK(cudaFree(dout));
        free(g); free(u); free(want); free(got);
    }
    const int shapes[][2] = {{1, Q4_INTER}, {5, Q4_INTER}, {64, Q4_INTER}, {3, 13}, {4, 8}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int rows = shapes[si][0], I = shapes[si][1];
        size_t n = (size_t)rows * I;
        float *gu = xmalloc(2 * n * sizeof *gu), *g = xmalloc(n * sizeof *g), *u = xmalloc(n * sizeof *u);
        float *want = xmalloc(n * sizeof *want);
        for (int t = 0; t < rows; t++) {
            fill_gate(&r, gu + (size_t)t * 2 * I, (size_t)I);
            for (int i = 0; i < I; i++) gu[(size_t)t * 2 * I + I + i] = 2.0f * fr_test_normal(&r);
            memcpy(g + (size_t)t * I, gu + (size_t)t * 2 * I, (size_t)I * sizeof *g);
            memcpy(u + (size_t)t * I, gu + (size_t)t * 2 * I + I, (size_t)I * sizeof *u);
        }
        fr_swiglu(want, g, u, (int)n);
        float *dgu = dup_to_device(gu, 2 * n * sizeof *gu);
        uint16_t *dout = dmalloc(n * sizeof *dout), *got = xmalloc(n * sizeof *got);
        FR_OK_OR_FAIL(fr_cuda_swiglu_rows(dout, dgu, rows, I, g_stream));
        download(got, dout, n * sizeof *got);
        char what[64];
        snprintf(what, sizeof what, "swiglu_rows %dx%d", rows, I);
        cmp_stats s = {0};
        for (size_t i = 0; i < n; i++) cmp_bf16(&s, what, i, got[i], want[i]);
        report(what, &s, 1);
        CUDA_OK(cudaFree(dgu)); CUDA_OK(cudaFree(dout));
        free(gu); free(g); free(u); free(want); free(got);
    }
}

/* ---- GEMM ----------------------------------------------------------------- */

#define GEMM_TOL_K 0x1p-18
#define GEMM_NMSE_F32 0x1p-24
#define GEMM_NMSE_BF16 0x1p-14

static float row_absmax(const float *p, int n)
{
    float m = 0;
    for (int i = 0; i < n; i++) m = fmaxf(m, fabsf(p[i]));
    return m;
}

/* y = x . w^T (+ y0 when beta = 1) on both sides; buffers shifted by `offset`
 * elements (1: 2- or 4-byte alignment, a different plan). */
static void gemm_case(fr_test_rng *r, int M, int N, int K, int bf16_out, float beta, size_t offset)
{
    size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N;
    uint16_t *hx, *hw;
    float *fx = randn_bf16(r, nx, 0.0f, 1.0f, &hx), *fw = randn_bf16(r, nw, 0.0f, 0.05f, &hw);
    float *want = xmalloc(ny * sizeof *want), *y0 = NULL;
    fr_matmul(want, fx, fw, M, N, K);
    if (beta != 0.0f) {
        y0 = randn(r, ny, 0.0f, 1.0f);
        for (size_t i = 0; i < ny; i++) {
            if (bf16_out) y0[i] = fr_bf16_round(y0[i]);
            want[i] = y0[i] + want[i];
        }
    }
    float *mx = xmalloc((size_t)M * sizeof *mx), *mw = xmalloc((size_t)N * sizeof *mw);
    for (int i = 0; i < M; i++) mx[i] = row_absmax(fx + (size_t)i * K, K);
    for (int j = 0; j < N; j++) mw[j] = row_absmax(fw + (size_t)j * K, K);

    uint16_t *dx = dmalloc((nx + offset) * sizeof *dx), *dw = dmalloc((nw + offset) * sizeof *dw);
    upload(dx + offset, hx, nx * sizeof *hx);
    upload(dw + offset, hw, nw * sizeof *hw);
    size_t ysz = bf16_out ? sizeof(uint16_t) : sizeof(float);
    char *dy = dmalloc((ny + offset) * ysz);
    if (y0) {
        if (bf16_out) {
            uint16_t *t = xmalloc(ny * sizeof *t);
            for (size_t i = 0; i < ny; i++) t[i] = fr_bf16_encode(y0[i]);
            upload(dy + offset * ysz, t, ny * sizeof *t);
            free(t);
        } else {
            upload(dy + offset * ysz, y0, ny * sizeof *y0);
        }
    } else {
        CUDA_OK(cudaMemset(dy, 0xff, (ny + offset) * ysz));   /* NaN: beta = 0 must not read y */
    }
    fr_gemm_stats before = fr_gemm_get_stats(g_gemm);
    for (int rep = 0; rep < 2; rep++) {   /* the second call of a shape must find its plan */
        if (rep == 1 && y0) break;        /* beta = 1 accumulates: one call */
        if (bf16_out)
            FR_OK_OR_FAIL(fr_gemm_bf16_out(g_gemm, (uint16_t *)(dy + offset * ysz), dx + offset, dw + offset, M, N, K, beta,
                                g_stream));
        else
            FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, (float *)(dy + offset * ysz), dx + offset, dw + offset, M, N, K, beta, g_stream));
    }
    fr_gemm_stats after = fr_gemm_get_stats(g_gemm);
    assert_true(after.searches - before.searches <= 1);

    float *got = xmalloc(ny * sizeof *got);
    if (bf16_out) {
        uint16_t *t = xmalloc(ny * sizeof *t);
        download(t, dy + offset * ysz, ny * sizeof *t);
        for (size_t i = 0; i < ny; i++) got[i] = fr_bf16_decode(t[i]);
        free(t);
    } else {
        download(got, dy + offset * ysz, ny * sizeof *got);
    }
    char what[96];
    snprintf(what, sizeof what, "gemm%s %dx%dx%d%s%s", bf16_out ? "_bf16out" : "", M, N, K, y0 ? " beta=1" : "",
             offset ? " misaligned" : "");
    cmp_stats s = {0};
    double se = 0, sw = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            size_t e = (size_t)i * N + j;
            double wv = want[e], tol = GEMM_TOL_K * K * (double)mx[i] * (double)mw[j];
            if (y0) tol += 0x1p-23 * fabs(wv);
            if (bf16_out) tol += 0x1p-8 * fabs(wv) + TOL_BF16_FLOOR;
            cmp(&s, what, e, got[e], wv, tol);
            se += (got[e] - wv) * (got[e] - wv);
            sw += wv * wv;
        }
    double nmse = sw > 0 ? se / sw : se;
    double lim = bf16_out ? GEMM_NMSE_BF16 : GEMM_NMSE_F32;
    if (!(nmse <= lim)) fail_msg("%s: NMSE %.3g > %.3g", what, nmse, lim);
    printf("  %-40s max err/tol %.3f, NMSE %.2e\n", what, s.worst, nmse);
    CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dy));
    free(hx); free(hw); free(fx); free(fw); free(want); free(y0); free(mx); free(mw); free(got);
}

static void test_gemm(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_test_rng r = {107};
    const int qkv = (Q4_HEADS + 2 * Q4_KV_HEADS) * Q4_HEAD_DIM;
    const int shapes[][3] = {
        {1, qkv, Q4_HIDDEN}, {1, Q4_HIDDEN, Q4_HEADS * Q4_HEAD_DIM}, {1, 2 * Q4_INTER, Q4_HIDDEN},
        {1, Q4_HIDDEN, Q4_INTER}, {7, Q4_KV_HEADS * Q4_HEAD_DIM, Q4_HIDDEN}, {64, qkv, Q4_HIDDEN},
        {64, Q4_HIDDEN, Q4_INTER}, {256, 2 * Q4_INTER, Q4_HIDDEN},
        {1, 1, 1}, {3, 5, 7}, {13, 33, 129}, {17, 1000, 2559}, {5, 2561, 31}, {2, 272, 128},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        gemm_case(&r, shapes[i][0], shapes[i][1], shapes[i][2], 0, 0.0f, 0);
    /* The fused residual adds (o_proj, down_proj). */
    gemm_case(&r, 1, Q4_HIDDEN, Q4_HEADS * Q4_HEAD_DIM, 0, 1.0f, 0);
    gemm_case(&r, 33, Q4_HIDDEN, Q4_INTER, 0, 1.0f, 0);
    gemm_case(&r, 3, 5, 7, 0, 1.0f, 0);
    /* BF16 output. */
    gemm_case(&r, 1, Q4_HIDDEN, Q4_HEADS * Q4_HEAD_DIM, 1, 0.0f, 0);
    gemm_case(&r, 64, Q4_KV_HEADS * Q4_HEAD_DIM, Q4_HIDDEN, 1, 0.0f, 0);
    gemm_case(&r, 3, 5, 7, 1, 1.0f, 0);
    /* Sub-views that are not 256-byte aligned. */
    gemm_case(&r, 4, 1024, Q4_HIDDEN, 0, 0.0f, 1);
    gemm_case(&r, 3, 17, 9, 0, 1.0f, 1);
    gemm_case(&r, 5, 64, 64, 1, 0.0f, 1);

    /* The plan cache: repeating a shape searches nothing. */
    fr_gemm_stats s0 = fr_gemm_get_stats(g_gemm);
    FR_OK_OR_FAIL(fr_gemm_prepare(g_gemm, 64, qkv, Q4_HIDDEN, 0, NULL, NULL, NULL));
    fr_gemm_stats s1 = fr_gemm_get_stats(g_gemm);
    assert_int_equal(s1.searches, s0.searches);
    assert_int_equal(s1.plans, s0.plans);
    printf("  gemm plans cached: %d, searches: %ld, flushes: %ld\n", s1.plans, s1.searches, s1.flushes);
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
    FR_OK_OR_FAIL(fr_cuda_rope_table_new(4096, Q4_HEAD_DIM, Q4_THETA, &dc, &ds));
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_f32_to_bf16),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rmsnorm_zero_row),
        cmocka_unit_test(test_rmsnorm_rows),
        cmocka_unit_test(test_rope_table),
        cmocka_unit_test(test_qk_norm_rope),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_gemm),
        cmocka_unit_test(test_graph_capture),
        cmocka_unit_test(test_timing_4b),
    };
    fr_gpu_test_filter();
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
