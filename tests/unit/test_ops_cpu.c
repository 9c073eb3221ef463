/* CPU float32 ops against naive double-precision references. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/moe_cpu.h"
#include "rollout/model/ops_cpu.h"
#include "tests/unit/test_util.h"
#include "test_util.h"

static float *randn(fr_test_rng *r, size_t n, float scale)
{
    float *p = malloc(n * sizeof *p);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = scale * fr_test_normal(r);
    return p;
}

/* |got - want| <= tol * max(|want|, floor) with a readable failure. */
static void check_close(const char *what, size_t i, double got, double want, double tol, double floor)
{
    double err = fabs(got - want), lim = tol * fmax(fabs(want), floor);
    if (!(err <= lim)) fail_msg("%s[%zu]: got %.9g, want %.9g (error %.3g > %.3g)", what, i, got, want, err, lim);
}

/* ---- rmsnorm ---------------------------------------------------------------- */

static void ref_rmsnorm(double *out, const float *x, const float *w, int rows, int n, double eps)
{
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)x[r * n + i] * x[r * n + i];
        double inv = 1.0 / sqrt(ss / n + eps);
        for (int i = 0; i < n; i++) out[r * n + i] = x[r * n + i] * inv * w[i];
    }
}

static void test_rmsnorm(void **state)
{
    (void)state;
    fr_test_rng r = {11};
    const int shapes[][2] = {{1, 128}, {5, 512}, {3, 7}, {2, 1}, {4, 2560}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int rows = shapes[s][0], n = shapes[s][1];
        float *x = randn(&r, (size_t)rows * n, 3.0f), *w = randn(&r, (size_t)n, 1.0f);
        float *out = malloc((size_t)rows * n * sizeof *out);
        double *ref = malloc((size_t)rows * n * sizeof *ref);
        assert_non_null(out);
        assert_non_null(ref);
        fr_rmsnorm(out, x, w, rows, n, 1e-6f);
        ref_rmsnorm(ref, x, w, rows, n, (double)1e-6f);
        for (size_t i = 0; i < (size_t)rows * n; i++) check_close("rmsnorm", i, out[i], ref[i], 1e-5, 1e-30);

        /* In place gives the same bits. */
        fr_rmsnorm(x, x, w, rows, n, 1e-6f);
        assert_memory_equal(x, out, (size_t)rows * n * sizeof *out);
        free(x);
        free(w);
        free(out);
        free(ref);
    }
}

static void test_rmsnorm_eps_and_zero(void **state)
{
    (void)state;
    /* A zero row stays zero (no NaN); eps dominates tiny rows. */
    float x[4] = {0, 0, 0, 0}, w[4] = {1, 2, 3, 4}, out[4];
    fr_rmsnorm(out, x, w, 1, 4, 1e-6f);
    for (int i = 0; i < 4; i++) assert_true(out[i] == 0.0f);
    float y[2] = {1e-4f, -1e-4f}, o2[2];
    fr_rmsnorm(o2, y, w, 1, 2, 1e-6f);
    double want = 1e-4 / sqrt(1e-8 + (double)1e-6f);
    check_close("rmsnorm eps", 0, o2[0], want, 1e-5, 0);
    check_close("rmsnorm eps", 1, o2[1], -want * 2, 1e-5, 0);
}

/* ---- rope --------------------------------------------------------------- */

/* The HF float32 angle (what the op must reproduce), then everything else in
 * double. */
static void ref_rope(double *out, const float *x, int n_heads, int d, int pos, double theta)
{
    int h = d / 2;
    for (int hd = 0; hd < n_heads; hd++)
        for (int i = 0; i < h; i++) {
            float inv_freq = 1.0f / powf((float)theta, (float)(2 * i) / (float)d);
            double angle = (double)((float)pos * inv_freq);
            double c = cos(angle), s = sin(angle);
            double a = x[hd * d + i], b = x[hd * d + i + h];
            out[hd * d + i] = a * c - b * s;
            out[hd * d + i + h] = b * c + a * s;
        }
}

static void test_rope_reference(void **state)
{
    (void)state;
    fr_test_rng r = {12};
    const int dims[] = {2, 8, 64, 128, 1024};
    const int positions[] = {0, 1, 2, 17, 511, 4095, 32767};
    const double thetas[] = {10000.0, 1000000.0};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
        for (size_t pi = 0; pi < sizeof positions / sizeof positions[0]; pi++)
            for (size_t ti = 0; ti < 2; ti++) {
                int d = dims[di], heads = 3, pos = positions[pi];
                size_t n = (size_t)heads * d;
                float *x = randn(&r, n, 1.0f);
                double *ref = malloc(n * sizeof *ref);
                assert_non_null(ref);
                ref_rope(ref, x, heads, d, pos, thetas[ti]);
                /* The tolerance floor: a rotated pair can land near zero in
                 * one coordinate; scale by the pair's norm instead. */
                fr_rope(x, heads, d, pos, thetas[ti], NULL);
                for (size_t i = 0; i < n; i++) {
                    size_t hd = i / (size_t)d, k = i % (size_t)d, h = (size_t)d / 2;
                    size_t a = hd * d + (k % h), b = a + h;
                    double norm = hypot(ref[a], ref[b]);
                    check_close("rope", i, x[i], ref[i], 1e-5, norm);
                }
                free(x);
                free(ref);
            }
}

static void test_rope_small_positions_match_exact_math(void **state)
{
    (void)state;
    /* At small positions the float32 angle is accurate, so the result is also
     * close to the rotation computed entirely in double. */
    fr_test_rng r = {13};
    int d = 128, h = 64;
    for (int pos = 0; pos < 8; pos++) {
        float *x = randn(&r, (size_t)d, 1.0f);
        double ref[128];
        for (int i = 0; i < h; i++) {
            double ang = pos / pow(1000000.0, 2.0 * i / d);
            ref[i] = x[i] * cos(ang) - x[i + h] * sin(ang);
            ref[i + h] = x[i + h] * cos(ang) + x[i] * sin(ang);
        }
        fr_rope(x, 1, d, pos, 1000000.0, NULL);
        for (int i = 0; i < d; i++)
            check_close("rope exact", (size_t)i, x[i], ref[i], 1e-5, hypot(ref[i % h], ref[i % h + h]));
        free(x);
    }
}

static void test_rope_position_zero_is_identity(void **state)
{
    (void)state;
    fr_test_rng r = {14};
    float *x = randn(&r, 8 * 128, 5.0f);
    float *y = malloc(8 * 128 * sizeof *y);
    assert_non_null(y);
    memcpy(y, x, 8 * 128 * sizeof *y);
    fr_rope(y, 8, 128, 0, 1000000.0, NULL);
    assert_memory_equal(x, y, 8 * 128 * sizeof *y);
    free(x);
    free(y);
}

static void test_rope_preserves_pair_norms(void **state)
{
    (void)state;
    fr_test_rng r = {15};
    int heads = 4, d = 64, h = 32;
    for (int pos = 1; pos < 5000; pos += 997) {
        float *x = randn(&r, (size_t)heads * d, 2.0f);
        float *y = malloc((size_t)heads * d * sizeof *y);
        assert_non_null(y);
        memcpy(y, x, (size_t)heads * d * sizeof *y);
        fr_rope(y, heads, d, pos, 10000.0, NULL);
        for (int hd = 0; hd < heads; hd++)
            for (int i = 0; i < h; i++) {
                const float *a = x + hd * d, *b = y + hd * d;
                double before = hypot(a[i], a[i + h]), after = hypot(b[i], b[i + h]);
                check_close("rope pair norm", (size_t)(hd * d + i), after, before, 1e-5, 1e-30);
            }
        free(x);
        free(y);
    }
}

static void test_rope_cos_sin_is_what_rope_uses(void **state)
{
    (void)state;
    int d = 128, h = 64, pos = 3001;
    float c[64], s[64], x[128];
    fr_rope_cos_sin(c, s, d, pos, 1000000.0, NULL);
    for (int i = 0; i < h; i++) {
        /* x = e_i: the output is (cos, sin) on pair i exactly. */
        memset(x, 0, sizeof x);
        x[i] = 1.0f;
        fr_rope(x, 1, d, pos, 1000000.0, NULL);
        assert_true(x[i] == c[i]);
        assert_true(x[i + h] == s[i]);
    }
    /* Hand-checked value: i = 1, theta 1e6, d 128, pos 3001. */
    float inv = 1.0f / powf(1e6f, 2.0f / 128.0f);
    assert_true(c[1] == cosf(3001.0f * inv));
    assert_true(s[1] == sinf(3001.0f * inv));
}

/* ---- swiglu ------------------------------------------------------------------ */

static void test_swiglu(void **state)
{
    (void)state;
    fr_test_rng r = {16};
    int n = 1537;
    float *g = randn(&r, (size_t)n, 4.0f), *u = randn(&r, (size_t)n, 1.0f);
    float *out = malloc((size_t)n * sizeof *out);
    assert_non_null(out);
    g[0] = -100.0f; g[1] = 100.0f; g[2] = 0.0f; g[3] = -1000.0f; g[4] = 88.0f; g[5] = -88.0f;
    fr_swiglu(out, g, u, n);
    for (int i = 0; i < n; i++) {
        double gd = g[i], want = gd / (1.0 + exp(-gd)) * u[i];
        assert_false(isnan(out[i]));
        check_close("swiglu", (size_t)i, out[i], want, 1e-5, 1e-30);
    }
    /* In place over gate. */
    fr_swiglu(g, g, u, n);
    assert_memory_equal(g, out, (size_t)n * sizeof *out);
    free(g);
    free(u);
    free(out);
}

/* ---- matmul ------------------------------------------------------------------ */

static void check_matmul(fr_test_rng *r, int M, int N, int K)
{
    float *x = randn(r, (size_t)M * K, 1.0f), *w = randn(r, (size_t)N * K, 0.1f);
    float *y = malloc((size_t)M * N * sizeof *y);
    assert_non_null(y);
    fr_matmul(y, x, w, M, N, K);
    char what[64];
    snprintf(what, sizeof what, "matmul %dx%dx%d", M, N, K);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double acc = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double p = (double)x[(size_t)m * K + k] * w[(size_t)n * K + k];
                acc += p;
                mag += fabs(p);
            }
            /* Relative to the sum of magnitudes: a dot product may cancel. */
            double err = fabs(y[(size_t)m * N + n] - acc);
            if (!(err <= 1e-5 * mag + 1e-30))
                fail_msg("%s[%d][%d]: got %.9g, want %.9g (error %.3g, magnitude %.3g)", what, m, n,
                         (double)y[(size_t)m * N + n], acc, err, mag);
        }
    free(x);
    free(w);
    free(y);
}

static void test_matmul(void **state)
{
    (void)state;
    fr_test_rng r = {17};
    check_matmul(&r, 1, 512, 512);
    check_matmul(&r, 1, 272, 128);
    check_matmul(&r, 37, 256, 128);
    check_matmul(&r, 37, 1536, 512);
    check_matmul(&r, 1, 13, 7);
    check_matmul(&r, 3, 1, 1);
    check_matmul(&r, 1, 1, 1);
    check_matmul(&r, 17, 31, 129);
    check_matmul(&r, 37, 1, 333);
    check_matmul(&r, 2, 1001, 3);
}

static void test_matmul_degenerate(void **state)
{
    (void)state;
    float y[6] = {1, 2, 3, 4, 5, 6}, x[1] = {1}, w[1] = {1};
    fr_matmul(y, x, w, 2, 3, 0); /* empty dot products are 0 */
    for (int i = 0; i < 6; i++) assert_true(y[i] == 0.0f);
    y[0] = 7;
    fr_matmul(y, x, w, 0, 3, 1); /* nothing to do */
    fr_matmul(y, x, w, 3, 0, 1);
    assert_true(y[0] == 7.0f);
}

/* ---- embed ------------------------------------------------------------------- */

static void test_embed(void **state)
{
    (void)state;
    fr_test_rng r = {18};
    int vocab = 10, hidden = 6;
    float *table = randn(&r, (size_t)vocab * hidden, 1.0f);
    int ids[5] = {3, 0, 9, 3, -1};
    float out[5 * 6];
    fr_embed(out, table, ids, 5, hidden);
    for (int t = 0; t < 4; t++) assert_memory_equal(out + t * hidden, table + ids[t] * hidden, hidden * sizeof(float));
    for (int i = 0; i < hidden; i++) assert_true(out[4 * hidden + i] == 0.0f);
    free(table);
}

/* Routing: softmax, top-k in descending order with ties to the lower index,
 * renormalized or not. */
static void test_moe_route(void **state)
{
    (void)state;
    const float logits[5] = {1.0f, 3.0f, -2.0f, 3.0f, 2.0f};
    float p[5], w[3];
    int ids[3];
    fr_moe_route(logits, 5, 3, 0, p, ids, w);
    double z = exp(1.0) + 2 * exp(3.0) + exp(-2.0) + exp(2.0);
    for (int e = 0; e < 5; e++) assert_float_equal(p[e], exp(logits[e]) / z, 1e-6);
    assert_int_equal(ids[0], 1);   /* the tie of experts 1 and 3: lower index first */
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 4);
    assert_true(w[0] == p[1] && w[1] == p[3] && w[2] == p[4]);
    fr_moe_route(logits, 5, 3, 1, p, ids, w);
    assert_float_equal(w[0] + w[1] + w[2], 1.0, 1e-6);
    assert_float_equal(w[2], p[4] / (p[1] + p[3] + p[4]), 1e-6);
    float w5[5];
    int ids5[5], seen = 0;
    fr_moe_route(logits, 5, 5, 1, p, ids5, w5);
    for (int j = 0; j < 5; j++) seen |= 1 << ids5[j];
    assert_int_equal(seen, 31);   /* k = E picks every expert once */
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_rmsnorm),
             cmocka_unit_test(test_rmsnorm_eps_and_zero),
             cmocka_unit_test(test_rope_reference),
             cmocka_unit_test(test_rope_small_positions_match_exact_math),
             cmocka_unit_test(test_rope_position_zero_is_identity),
             cmocka_unit_test(test_rope_preserves_pair_norms),
             cmocka_unit_test(test_rope_cos_sin_is_what_rope_uses),
             cmocka_unit_test(test_swiglu),
             cmocka_unit_test(test_matmul),
             cmocka_unit_test(test_matmul_degenerate),
             cmocka_unit_test(test_embed),
             cmocka_unit_test(test_moe_route))
