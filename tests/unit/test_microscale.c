/* Microscaling FP4 (attention/microscale.h), the Hadamard rotation
 * (attention/hadamard.h) and probability quantization (attention/prob_quant.h),
 * against the rules of docs/formats.md: block quantizers checked code for code
 * against a model written here, the scale search never worse than the standard
 * scale on 100k random blocks, NaN/Inf handling, packing, the dual-residual
 * query (its query-term share of the logit error, paper Figure 3), Hadamard
 * orthonormality, and the P-scale underflow of paper Section 3.2. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "attention/hadamard.h"
#include "attention/microscale.h"
#include "attention/prob_quant.h"
#include "test_util.h"

/* ---- an independent model of the block quantizers --------------------- */

static const double e2m1_mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

static uint8_t model_e2m1(float x)
{
    if (isnan(x)) return 0;
    double a = fabs((double)x);
    if (a >= 6.0) return (uint8_t)((signbit(x) ? 8 : 0) | 7);   /* saturate, infinity too */
    int best = 0;
    for (int c = 1; c < 8; c++) {
        double db = fabs(a - e2m1_mag[best]), dc = fabs(a - e2m1_mag[c]);
        if (dc < db || (dc == db && (c & 1) == 0)) best = c;
    }
    return (uint8_t)((signbit(x) ? 8 : 0) | best);
}

static double model_e2m1_value(uint8_t c) { return (c & 8) ? -e2m1_mag[c & 7] : e2m1_mag[c & 7]; }

static double model_e4m3_mag(int c)
{
    int e = (c >> 3) & 0xF, m = c & 7;
    return e == 0 ? ldexp((double)m, -9) : ldexp((double)(8 + m), e - 10);
}

/* Nearest positive E4M3 code (ties to even), saturating at 448. */
static uint8_t model_e4m3_pos(float x)
{
    double a = (double)x;
    if (a >= 448.0) return 0x7E;
    int best = 0;
    for (int c = 1; c <= 0x7E; c++) {
        double db = fabs(a - model_e4m3_mag(best)), dc = fabs(a - model_e4m3_mag(c));
        if (dc < db || (dc == db && (c & 1) == 0)) best = c;
    }
    return (uint8_t)best;
}

static int model_floor_log2(double a)
{
    int e = (int)floor(log2(a));
    while (ldexp(1.0, e) > a) e--;
    while (ldexp(1.0, e + 1) <= a) e++;
    return e;
}

static double model_scale(fr_fp4_format f, uint8_t code)
{
    return f == FR_MXFP4 ? ldexp(1.0, code - 127) : model_e4m3_mag(code);
}

static float model_amax(const float *x, int n)
{
    float a = 0.0f;
    for (int i = 0; i < n; i++)
        if (!isnan(x[i]) && fabsf(x[i]) > a) a = fabsf(x[i]);
    return a;
}

static void model_encode(fr_fp4_format f, uint8_t sc, const float *x, int n, uint8_t *codes)
{
    float s = (float)model_scale(f, sc);
    for (int i = 0; i < n; i++) codes[i] = s > 0.0f ? model_e2m1(x[i] / s) : 0;
}

/* The documented search criterion: float32, element order, no FMA. */
static float model_sse_f32(fr_fp4_format f, uint8_t sc, const float *x, const uint8_t *codes, int n)
{
    float s = (float)model_scale(f, sc), sse = 0.0f;
    for (int i = 0; i < n; i++) {
        float xi = isnan(x[i]) ? 0.0f : x[i];
        float e = s * (float)model_e2m1_value(codes[i]) - xi;
        sse += e * e;
    }
    return sse;
}

/* Squared error of a quantized block, in double. */
static double sse_f64(fr_fp4_format f, uint8_t sc, const float *x, const uint8_t *codes, int n)
{
    double s = model_scale(f, sc), sse = 0.0;
    for (int i = 0; i < n; i++) {
        double e = s * model_e2m1_value(codes[i]) - (isnan(x[i]) ? 0.0 : (double)x[i]);
        sse += e * e;
    }
    return sse;
}

static uint8_t model_standard_scale(fr_fp4_format f, float amax)
{
    if (f == FR_NVFP4) return model_e4m3_pos(amax / 6.0f);
    if (amax == 0.0f) return 0;
    if (isinf(amax)) return 254;
    int e = model_floor_log2((double)amax) - 2;
    if (e < -127) e = -127;
    if (e > 127) e = 127;
    return (uint8_t)(e + 127);
}

static uint8_t model_quantize_block(fr_fp4_format f, int search, const float *x, uint8_t *codes)
{
    int n = fr_fp4_block_size(f);
    float amax = model_amax(x, n);
    uint8_t s0 = model_standard_scale(f, amax);
    model_encode(f, s0, x, n, codes);
    if (!search) return s0;
    uint8_t s1 = f == FR_NVFP4 ? model_e4m3_pos(amax / 4.0f) : (s0 < 254 ? (uint8_t)(s0 + 1) : s0);
    if (s1 == s0) return s0;
    uint8_t alt[32];
    model_encode(f, s1, x, n, alt);
    if (model_sse_f32(f, s1, x, alt, n) < model_sse_f32(f, s0, x, codes, n)) {
        memcpy(codes, alt, (size_t)n);
        return s1;
    }
    return s0;
}

/* Quantizes with the library and checks it against the model. Returns the scale. */
static uint8_t check_block(fr_fp4_format f, int search, const float *x, uint8_t *codes)
{
    int n = fr_fp4_block_size(f);
    uint8_t want[32];
    uint8_t sw = model_quantize_block(f, search, x, want);
    uint8_t sc = fr_fp4_quantize_block(f, search, x, codes);
    if (sc != sw) fail_msg("%s search=%d: scale 0x%02x, model 0x%02x (x[0]=%a)", fr_fp4_format_name(f), search, sc, sw, (double)x[0]);
    for (int i = 0; i < n; i++)
        if (codes[i] != want[i]) fail_msg("%s search=%d: code[%d] %d, model %d", fr_fp4_format_name(f), search, i, codes[i], want[i]);
    return sc;
}

/* ---- basics ------------------------------------------------------------ */

static void test_format_basics(void **state)
{
    (void)state;
    assert_int_equal(fr_fp4_block_size(FR_NVFP4), 16);
    assert_int_equal(fr_fp4_block_size(FR_MXFP4), 32);
    assert_string_equal(fr_fp4_format_name(FR_NVFP4), "nvfp4");
    assert_string_equal(fr_fp4_format_name(FR_MXFP4), "mxfp4");
    fr_fp4_format f = FR_MXFP4;
    assert_int_equal(fr_fp4_format_parse("nvfp4", &f), FR_OK);
    assert_int_equal(f, FR_NVFP4);
    assert_int_equal(fr_fp4_format_parse("mxfp4", &f), FR_OK);
    assert_int_equal(f, FR_MXFP4);
    assert_int_equal(fr_fp4_format_parse("fp4", &f), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "fp4"));
    assert_int_equal(fr_fp4_format_parse(NULL, &f), FR_EINVAL);
    assert_true(fr_fp4_scale_value(FR_NVFP4, 0x38) == 1.0f);
    assert_true(fr_fp4_scale_value(FR_MXFP4, 127) == 1.0f);
    assert_true(fr_fp4_scale_value(FR_MXFP4, 0) == 0x1p-127f);
}

/* ---- NVFP4 --------------------------------------------------------------- */

static void test_nvfp4_hand_blocks(void **state)
{
    (void)state;
    uint8_t codes[16];
    float x[16];

    /* amax/6 wins: {6, 1} is exact at scale 1; at 1.5, 1 -> 0.75. */
    memset(x, 0, sizeof x); x[0] = 6.0f; x[1] = 1.0f;
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x38);
    assert_int_equal(codes[0], 7); assert_int_equal(codes[1], 2);
    assert_true(fr_fp4_block_sse(FR_NVFP4, 0x38, x, codes) == 0.0f);

    /* amax/4 wins: {4, -3} is exact at scale 1 = 4/4, not at E4M3(4/6) = 0.6875. */
    memset(x, 0, sizeof x); x[0] = 4.0f; x[5] = -3.0f;
    assert_int_equal(check_block(FR_NVFP4, 0, x, codes), fr_e4m3_encode(4.0f / 6.0f));
    assert_true(fr_e4m3_decode(fr_e4m3_encode(4.0f / 6.0f)) == 0.6875f);
    assert_true(fr_fp4_block_sse(FR_NVFP4, fr_e4m3_encode(4.0f / 6.0f), x, codes) == 0.125f * 0.125f + 0.25f * 0.25f);
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x38);
    assert_int_equal(codes[0], 6); assert_int_equal(codes[5], 8 | 5);

    /* Ties keep amax/6: {6} is exact under both; {6, 5.25} errs by 0.75 under both
     * (5.25 -> 6 at scale 1; 3.5 ties to 4 -> 6 at scale 1.5). */
    memset(x, 0, sizeof x); x[0] = 6.0f;
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x38);
    x[1] = -5.25f;
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x38);
    assert_true(fr_fp4_block_sse(FR_NVFP4, 0x38, x, codes) == 0.5625f);
    uint8_t alt[16];
    for (int i = 0; i < 16; i++) alt[i] = fr_e2m1_encode(x[i] / 1.5f);
    assert_true(fr_fp4_block_sse(FR_NVFP4, fr_e4m3_encode(1.5f), x, alt) == 0.5625f);

    /* The scale saturates at 448: elements clip to 6 * 448. */
    memset(x, 0, sizeof x); x[0] = 1e6f; x[1] = 448.0f;
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x7E);
    assert_int_equal(codes[0], 7); assert_int_equal(codes[1], 2);
}

static void test_nvfp4_zero_and_underflow(void **state)
{
    (void)state;
    uint8_t codes[16];
    float x[16], out[16];
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 16; i++) x[i] = (i & 1) ? -0.0f : 0.0f;
        assert_int_equal(check_block(FR_NVFP4, s, x, codes), 0x00);
        for (int i = 0; i < 16; i++) assert_int_equal(codes[i], 0);
        /* amax = 1e-4: both amax/6 and amax/4 are below 2^-10 -> scale 0, all zeros. */
        for (int i = 0; i < 16; i++) x[i] = 1e-4f * (float)(i - 8) / 8.0f;
        assert_int_equal(check_block(FR_NVFP4, s, x, codes), 0x00);
        assert_int_equal(fr_fp4_fake_quantize(FR_NVFP4, s, x, 16, out), FR_OK);
        for (int i = 0; i < 16; i++) { assert_int_equal(codes[i], 0); assert_true(out[i] == 0.0f); }
    }
    /* amax = 0.005: amax/6 underflows (all zeros) but amax/4 rounds to 2^-9, and
     * the search takes it because it has the lower error. */
    for (int i = 0; i < 16; i++) x[i] = 0.005f * (float)(i + 1) / 16.0f;
    assert_int_equal(check_block(FR_NVFP4, 0, x, codes), 0x00);
    for (int i = 0; i < 16; i++) assert_int_equal(codes[i], 0);
    assert_int_equal(check_block(FR_NVFP4, 1, x, codes), 0x01);
    assert_int_equal(codes[15], 5);        /* 0.005 / 2^-9 = 2.56 -> 3 */
}

/* Random blocks from several distributions and magnitudes (2^-20 .. 2^20, so
 * E4M3 subnormal scales and saturation are both reached). */
static void random_block(fr_test_rng *r, int kind, int n, float *x)
{
    float mag = ldexpf(1.0f, (int)(fr_test_u64(r) % 41) - 20);
    for (int i = 0; i < n; i++) {
        float g = fr_test_normal(r);
        switch (kind) {
        case 0: x[i] = g; break;                                          /* gaussian */
        case 1: x[i] = g / sqrtf(fmaxf(fr_test_uniform(r), 1e-6f)); break; /* heavy tail */
        case 2: x[i] = g * (fr_test_uniform(r) < 0.1f ? 30.0f : 1.0f); break; /* outliers */
        case 3: x[i] = fr_test_uniform(r) * 2.0f - 1.0f; break;           /* uniform */
        default: x[i] = (float)((int)(fr_test_u64(r) % 13) - 6) * 0.5f;   /* on the grid */
        }
        x[i] *= mag;
    }
}

static void check_search_never_worse(fr_fp4_format f, int n_blocks, unsigned seed)
{
    int n = fr_fp4_block_size(f);
    fr_test_rng r = {seed};
    float x[32];
    uint8_t c0[32], c1[32];
    int n_alt = 0;
    double worst = 0.0;
    for (int b = 0; b < n_blocks; b++) {
        random_block(&r, b % 5, n, x);
        uint8_t s0 = check_block(f, 0, x, c0);
        uint8_t s1 = check_block(f, 1, x, c1);
        double e0 = sse_f64(f, s0, x, c0, n), e1 = sse_f64(f, s1, x, c1, n);
        if (e1 > e0 * (1.0 + 1e-6))
            fail_msg("%s block %d: searched error %.9g worse than standard %.9g", fr_fp4_format_name(f), b, e1, e0);
        if (s1 != s0) n_alt++;
        if (e0 > 0.0 && e1 / e0 > worst) worst = e1 / e0;
    }
    /* The search must actually do something, but not always. */
    assert_true(n_alt > n_blocks / 20);
    assert_true(n_alt < n_blocks);
    printf("    %s: alternative scale chosen in %d of %d random blocks\n", fr_fp4_format_name(f), n_alt, n_blocks);
}

static void test_nvfp4_random_blocks(void **state)
{
    (void)state;
    check_search_never_worse(FR_NVFP4, 100000, 21);
}

/* ---- MXFP4 --------------------------------------------------------------- */

static void test_mxfp4_hand_blocks(void **state)
{
    (void)state;
    uint8_t codes[32];
    float x[32];
    for (int k = -120; k <= 127; k += 7) {
        /* Exact powers of two: 2^k / 2^(k-2) = 4, exact under both scales. */
        memset(x, 0, sizeof x);
        x[0] = ldexpf(1.0f, k); x[3] = ldexpf(1.0f, k - 1); x[31] = -ldexpf(1.0f, k - 2);
        for (int s = 0; s < 2; s++) {
            assert_int_equal(check_block(FR_MXFP4, s, x, codes), k - 2 + 127);
            assert_int_equal(codes[0], 6); assert_int_equal(codes[3], 4); assert_int_equal(codes[31], 8 | 2);
        }
    }
    for (int e = -50; e <= 50; e += 10) {
        /* amax exactly 6 * 2^e: scale 2^e, nothing clips; 0.5 * 2^e would tie to
         * 0 at 2^(e+1), so the OCP scale keeps the exact block. */
        memset(x, 0, sizeof x);
        x[0] = ldexpf(6.0f, e); x[1] = ldexpf(0.5f, e);
        for (int s = 0; s < 2; s++) {
            assert_int_equal(check_block(FR_MXFP4, s, x, codes), e + 127);
            assert_int_equal(codes[0], 7); assert_int_equal(codes[1], 1);
        }
        /* 7.5 * 2^e clips to 6 * 2^e under the OCP scale; 2^(e+1) gives 8 * 2^e. */
        x[0] = ldexpf(7.5f, e); x[1] = 0.0f;
        assert_int_equal(check_block(FR_MXFP4, 0, x, codes), e + 127);
        assert_int_equal(codes[0], 7);
        assert_int_equal(check_block(FR_MXFP4, 1, x, codes), e + 128);
        assert_int_equal(codes[0], 6);
        /* 7 * 2^e: error 2^e either way (clip to 6, or 3.5 -> 4 at 2^(e+1)): a tie. */
        x[0] = ldexpf(7.0f, e);
        assert_int_equal(check_block(FR_MXFP4, 1, x, codes), e + 127);
    }
    /* The search compares float32 sums of squared errors (docs/formats.md), so
     * where the squares underflow (2^-100 scale: errors^2 ~ 2^-200) or overflow
     * (2^100) both sums are equal and the OCP scale is kept. */
    for (int e = -100; e <= 100; e += 200) {
        memset(x, 0, sizeof x);
        x[0] = ldexpf(7.5f, e);
        assert_int_equal(check_block(FR_MXFP4, 1, x, codes), e + 127);
        assert_int_equal(codes[0], 7);
    }
    /* Zero block: scale 2^-127, all zero codes. */
    memset(x, 0, sizeof x);
    for (int s = 0; s < 2; s++) {
        assert_int_equal(check_block(FR_MXFP4, s, x, codes), 0);
        for (int i = 0; i < 32; i++) assert_int_equal(codes[i], 0);
    }
    /* Huge: FLT_MAX -> 2^125, clipped to 6 * 2^125 (finite); the search's 2^126
     * would give 4 * 2^126 = inf, so its error is infinite and it loses. */
    memset(x, 0, sizeof x); x[0] = FLT_MAX; x[1] = -0x1p127f;
    for (int s = 0; s < 2; s++) {
        assert_int_equal(check_block(FR_MXFP4, s, x, codes), 252);
        float out[32];
        assert_int_equal(fr_fp4_fake_quantize(FR_MXFP4, s, x, 32, out), FR_OK);
        assert_true(out[0] == 0x1.8p127f && out[1] == -0x1p127f);
    }
    /* Tiny: the exponent clamps at -127. 1.5 * 2^-126 -> scale 2^-127 (not
     * 2^-128), element 3 exact; 2^-130 -> 0.125 of the scale -> zero. */
    memset(x, 0, sizeof x); x[0] = 0x1.8p-126f;
    assert_int_equal(check_block(FR_MXFP4, 0, x, codes), 0);
    assert_int_equal(codes[0], 5);
    memset(x, 0, sizeof x); x[0] = 0x1p-130f; x[1] = -0x1p-140f;
    for (int s = 0; s < 2; s++) {
        assert_int_equal(check_block(FR_MXFP4, s, x, codes), 0);
        for (int i = 0; i < 32; i++) assert_int_equal(codes[i] & 7, 0);
    }
}

static void test_mxfp4_random_blocks(void **state)
{
    (void)state;
    check_search_never_worse(FR_MXFP4, 50000, 22);
}

/* ---- NaN and infinity ------------------------------------------------------ */

static void check_special_block(fr_fp4_format f, int search, const float *x)
{
    int n = fr_fp4_block_size(f);
    uint8_t codes[32], packed[16], sc_row;
    float out[32], q1[32], q2[32];
    uint8_t sc = check_block(f, search, x, codes);
    float s = fr_fp4_scale_value(f, sc);
    assert_false(isnan(s));
    assert_true(isfinite(fr_fp4_block_sse(f, sc, x, codes)) || !isfinite(model_amax(x, n)));
    int has_inf = 0;
    for (int i = 0; i < n; i++) has_inf |= isinf(x[i]);
    for (int i = 0; i < n; i++) {
        float v = s * fr_e2m1_decode(codes[i]);
        if (isnan(x[i])) { assert_int_equal(codes[i] & 7, 0); assert_true(v == 0.0f); }
        if (isinf(x[i])) assert_int_equal(codes[i], x[i] > 0 ? 7 : 15);
        assert_false(isnan(v));
        /* Documented: an infinite element saturates the scale (E4M3 448, E8M0
         * 2^127); NVFP4 values stay finite (6 * 448), MXFP4's 6 * 2^127 is
         * beyond float32 for the infinite element only. */
        if (f == FR_NVFP4 || !isinf(x[i])) assert_true(isfinite(v));
    }
    if (has_inf) assert_int_equal(sc, f == FR_NVFP4 ? 0x7E : 254);
    /* The NaN elements behave exactly as zeros would. */
    float z[32];
    uint8_t cz[32];
    for (int i = 0; i < n; i++) z[i] = isnan(x[i]) ? 0.0f : x[i];
    assert_int_equal(fr_fp4_quantize_block(f, search, z, cz), sc);
    assert_memory_equal(cz, codes, (size_t)n);
    /* The row functions and the dual query do not trap either. */
    assert_int_equal(fr_fp4_quantize_row(f, search, x, n, packed, &sc_row), FR_OK);
    assert_int_equal(sc_row, sc);
    assert_int_equal(fr_fp4_dequantize_row(f, packed, &sc_row, n, out), FR_OK);
    assert_int_equal(fr_fp4_quantize_dual(f, search, x, n, q1, q2), FR_OK);
    for (int i = 0; i < n; i++) {
        assert_false(isnan(out[i]));
        assert_false(isnan(q1[i]));
        assert_false(isnan(q2[i]));
        if (f == FR_NVFP4) assert_true(isfinite(out[i]) && isfinite(q1[i]) && isfinite(q2[i]));
    }
}

static void test_nan_inf_blocks(void **state)
{
    (void)state;
    fr_test_rng r = {31};
    for (int fi = 0; fi < 2; fi++) {
        fr_fp4_format f = fi ? FR_MXFP4 : FR_NVFP4;
        int n = fr_fp4_block_size(f);
        for (int search = 0; search < 2; search++) {
            float x[32];
            for (int pattern = 0; pattern < 6; pattern++) {
                for (int i = 0; i < n; i++) x[i] = fr_test_normal(&r);
                switch (pattern) {
                case 0: x[3] = NAN; break;
                case 1: x[3] = INFINITY; break;
                case 2: x[n - 1] = -INFINITY; break;
                case 3: for (int i = 0; i < n; i++) x[i] = NAN; break;
                case 4: x[0] = NAN; x[1] = INFINITY; x[2] = -INFINITY; x[3] = -NAN; break;
                default: for (int i = 0; i < n; i++) x[i] = (i & 1) ? NAN : 0.0f; break;
                }
                check_special_block(f, search, x);
                if (pattern == 3 || pattern == 5) {
                    uint8_t codes[32];
                    float out[32];
                    assert_int_equal(fr_fp4_fake_quantize(f, search, x, n, out), FR_OK);
                    for (int i = 0; i < n; i++) assert_true(out[i] == 0.0f);
                    assert_int_equal(fr_fp4_quantize_block(f, search, x, codes), f == FR_NVFP4 ? 0x00 : 0);
                }
                if (pattern == 1 && f == FR_NVFP4) {
                    float out[32];
                    assert_int_equal(fr_fp4_fake_quantize(f, search, x, n, out), FR_OK);
                    assert_true(out[3] == 6.0f * 448.0f);
                }
            }
        }
    }
}

/* ---- packing and rows -------------------------------------------------------- */

static void test_pack_unpack(void **state)
{
    (void)state;
    fr_test_rng r = {41};
    uint8_t codes[256], back[256], packed[128];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)(fr_test_u64(&r) & 0xF);
    fr_fp4_pack(codes, 256, packed);
    for (int i = 0; i < 128; i++) assert_int_equal(packed[i], codes[2 * i] | (codes[2 * i + 1] << 4));
    fr_fp4_unpack(packed, 256, back);
    assert_memory_equal(back, codes, 256);
    const uint8_t two[2] = {0x3, 0xC};
    uint8_t b;
    fr_fp4_pack(two, 2, &b);
    assert_int_equal(b, 0xC3);   /* element 0 in the low nibble */
}

/* An FP16 bit pattern as a float (sign, 5-bit exponent, 10-bit mantissa,
 * subnormals included), for the GPU unpacking emulated below. */
static float f16_bits_value(uint32_t h)
{
    const int e = (int)((h >> 10) & 31), m = (int)(h & 1023);
    const float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000u) ? -v : v;
}

/* Page code words: every code in every slot survives pack and unpack, the
 * stored bytes are little-endian, and the GPU kernels' bit placement
 * (fr_dev_fp4_word_to_f16x2: AND, shift-AND, two multiply-ANDs) turns each
 * slot into FP16 value * 2^-14 exactly, -0 included. */
static void test_code_words(void **state)
{
    (void)state;
    fr_test_rng r = {43};
    static const int pair_of[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
    for (int e = 0; e < 8; e++)
        for (int c = 0; c < 16; c++)
            for (int trial = 0; trial < 8; trial++) {
                uint8_t codes[8], back[8];
                for (int i = 0; i < 8; i++) codes[i] = (uint8_t)(fr_test_u64(&r) & 0xF);
                codes[e] = (uint8_t)c;
                const uint32_t w = fr_fp4_word_pack(codes);
                fr_fp4_word_unpack(w, back);
                assert_memory_equal(back, codes, 8);
                const uint32_t M = 0x8E008E00u;
                const uint32_t reg[4] = {w & M, (w << 3) & M, ((w & 0x40074007u) * 0x202u) & M,
                                         ((w & 0x20382038u) * 0x44u) & M};
                for (int k = 0; k < 4; k++)
                    for (int half = 0; half < 2; half++) {
                        const int el = pair_of[k][half];
                        const float got = f16_bits_value((reg[k] >> (16 * half)) & 0xFFFFu) * 16384.0f;
                        const float want = fr_e2m1_decode(codes[el]);
                        assert_true(got == want);
                        assert_int_equal(signbit(got) != 0, signbit(want) != 0);
                    }
            }
    /* element 0 = code 0xF: sign bit 15, magnitude 7 at bits 11..9 */
    const uint8_t one[8] = {0xF, 0, 0, 0, 0, 0, 0, 0};
    assert_int_equal(fr_fp4_word_pack(one), 0x8E00u);
    uint8_t bytes[8], codes[16], back[16];
    for (int i = 0; i < 16; i++) codes[i] = (uint8_t)(fr_test_u64(&r) & 0xF);
    fr_fp4_words_store(codes, 16, bytes);
    for (int k = 0; k < 2; k++) {
        const uint32_t w = fr_fp4_word_pack(codes + 8 * k);
        for (int b = 0; b < 4; b++) assert_int_equal(bytes[4 * k + b], (w >> (8 * b)) & 0xFFu);
    }
    fr_fp4_words_load(bytes, 16, back);
    assert_memory_equal(back, codes, 16);
}

static void test_rows(void **state)
{
    (void)state;
    fr_test_rng r = {42};
    enum { N = 256 };
    float x[N], fq[N], dq[N], inplace[N];
    uint8_t packed[N / 2], scales[N / 16], codes[N], bc[32];
    for (int fi = 0; fi < 2; fi++) {
        fr_fp4_format f = fi ? FR_MXFP4 : FR_NVFP4;
        int b = fr_fp4_block_size(f);
        for (int search = 0; search < 2; search++) {
            for (int i = 0; i < N; i++) x[i] = fr_test_normal(&r) * (i % 37 == 0 ? 20.0f : 1.0f);
            assert_int_equal(fr_fp4_quantize_row(f, search, x, N, packed, scales), FR_OK);
            assert_int_equal(fr_fp4_dequantize_row(f, packed, scales, N, dq), FR_OK);
            assert_int_equal(fr_fp4_fake_quantize(f, search, x, N, fq), FR_OK);
            assert_memory_equal(dq, fq, sizeof dq);
            memcpy(inplace, x, sizeof x);
            assert_int_equal(fr_fp4_fake_quantize(f, search, inplace, N, inplace), FR_OK);
            assert_memory_equal(inplace, fq, sizeof fq);
            fr_fp4_unpack(packed, N, codes);
            for (int blk = 0; blk < N / b; blk++) {
                assert_int_equal(fr_fp4_quantize_block(f, search, x + blk * b, bc), scales[blk]);
                assert_memory_equal(bc, codes + blk * b, (size_t)b);
            }
        }
        /* Bad rows are rejected with a message. */
        assert_int_equal(fr_fp4_quantize_row(f, 0, x, 0, packed, scales), FR_EINVAL);
        assert_non_null(strstr(fr_last_error(), "row length 0"));
        assert_int_equal(fr_fp4_fake_quantize(f, 0, x, b + b / 2, fq), FR_EINVAL);
        assert_non_null(strstr(fr_last_error(), "block size"));
        assert_int_equal(fr_fp4_dequantize_row(f, packed, scales, -b, dq), FR_EINVAL);
        assert_int_equal(fr_fp4_quantize_dual(f, 0, NULL, b, fq, dq), FR_EINVAL);
        assert_true(strlen(fr_last_error()) > 0);
    }
    assert_int_equal(fr_fp4_quantize_row(FR_MXFP4, 0, x, 16, packed, scales), FR_EINVAL);
}

/* ---- dual-residual query --------------------------------------------------- */

static void test_dual_terms(void **state)
{
    (void)state;
    fr_test_rng r = {51};
    enum { N = 128 };
    float x[N], q1[N], q2[N], e1[N], e2[N], res[N];
    for (int fi = 0; fi < 2; fi++) {
        fr_fp4_format f = fi ? FR_MXFP4 : FR_NVFP4;
        for (int search = 0; search < 2; search++) {
            double err1 = 0, err2 = 0;
            for (int rep = 0; rep < 50; rep++) {
                for (int i = 0; i < N; i++) x[i] = fr_test_normal(&r);
                assert_int_equal(fr_fp4_quantize_dual(f, search, x, N, q1, q2), FR_OK);
                assert_int_equal(fr_fp4_fake_quantize(f, search, x, N, e1), FR_OK);
                assert_memory_equal(q1, e1, sizeof q1);
                for (int i = 0; i < N; i++) res[i] = x[i] - q1[i];
                assert_int_equal(fr_fp4_fake_quantize(f, search, res, N, e2), FR_OK);
                assert_memory_equal(q2, e2, sizeof q2);
                for (int i = 0; i < N; i++) {
                    err1 += (double)res[i] * res[i];
                    double d2 = (double)x[i] - q1[i] - q2[i];
                    err2 += d2 * d2;
                }
                /* Either output may be NULL. */
                assert_int_equal(fr_fp4_quantize_dual(f, search, x, N, NULL, e2), FR_OK);
                assert_memory_equal(q2, e2, sizeof q2);
                assert_int_equal(fr_fp4_quantize_dual(f, search, x, N, e1, NULL), FR_OK);
                assert_memory_equal(q1, e1, sizeof q1);
            }
            /* The second term removes most of the first term's error. */
            assert_true(err2 < 0.1 * err1);
        }
    }
}

/* Paper Section 3.1, Figure 3: logit error q~.k~ - q.k = q~.dk (key term) +
 * dq.k (query term). Keys with a few outlier channels, NVFP4 per token, no
 * smoothing or rotation; gaussian queries. */
static void logit_error_shares(fr_fp4_format f, int dual, double *share_total, double *share_sum)
{
    enum { D = 128, NK = 256, NQ = 256 };
    static float K[NK][D], Kq[NK][D];
    float q[D], qq[D], q2[D];
    fr_test_rng r = {61};
    const int outliers[4] = {5, 40, 77, 110};
    const float sign[4] = {1.0f, -1.0f, 1.0f, -1.0f};
    for (int t = 0; t < NK; t++) {
        for (int j = 0; j < D; j++) K[t][j] = fr_test_normal(&r);
        for (int o = 0; o < 4; o++) K[t][outliers[o]] = sign[o] * 20.0f * (1.0f + 0.25f * fr_test_normal(&r));
        assert_int_equal(fr_fp4_fake_quantize(f, 0, K[t], D, Kq[t]), FR_OK);
    }
    double key2 = 0, query2 = 0, total2 = 0;
    for (int n = 0; n < NQ; n++) {
        for (int j = 0; j < D; j++) q[j] = fr_test_normal(&r);
        if (dual) {
            assert_int_equal(fr_fp4_quantize_dual(f, 0, q, D, qq, q2), FR_OK);
            for (int j = 0; j < D; j++) qq[j] += q2[j];
        } else {
            assert_int_equal(fr_fp4_fake_quantize(f, 0, q, D, qq), FR_OK);
        }
        for (int t = 0; t < NK; t++) {
            double kt = 0, qt = 0, exact = 0, quant = 0;
            for (int j = 0; j < D; j++) {
                kt += (double)qq[j] * ((double)Kq[t][j] - K[t][j]);
                qt += ((double)qq[j] - q[j]) * K[t][j];
                exact += (double)q[j] * K[t][j];
                quant += (double)qq[j] * Kq[t][j];
            }
            key2 += kt * kt;
            query2 += qt * qt;
            total2 += (quant - exact) * (quant - exact);
        }
    }
    *share_total = query2 / total2;
    *share_sum = query2 / (query2 + key2);
}

static void test_dual_residual_query_share(void **state)
{
    (void)state;
    for (int fi = 0; fi < 2; fi++) {
        fr_fp4_format f = fi ? FR_MXFP4 : FR_NVFP4;
        double single_t, single_s, dual_t, dual_s;
        logit_error_shares(f, 0, &single_t, &single_s);
        logit_error_shares(f, 1, &dual_t, &dual_s);
        printf("    %s keys: query term = %.1f%% of logit MSE with a single FP4 query "
               "(%.1f%% of key+query), %.2f%% with the dual-residual query (%.2f%%)\n",
               fr_fp4_format_name(f), 100 * single_t, 100 * single_s, 100 * dual_t, 100 * dual_s);
        assert_true(single_t > 0.20 && single_s > 0.20);
        assert_true(dual_t < 0.05 && dual_s < 0.05);
    }
}

/* ---- Hadamard ------------------------------------------------------------- */

static void test_hadamard_involution(void **state)
{
    (void)state;
    fr_test_rng r = {71};
    float x[512], y[512];
    for (int n = 1; n <= 512; n *= 2)
        for (int rep = 0; rep < 10; rep++) {
            for (int i = 0; i < n; i++) x[i] = fr_test_normal(&r);
            memcpy(y, x, sizeof(float) * (size_t)n);
            assert_int_equal(fr_hadamard(y, n), FR_OK);
            assert_int_equal(fr_hadamard(y, n), FR_OK);
            for (int i = 0; i < n; i++) assert_true(fabsf(y[i] - x[i]) <= 1e-6f);
        }
    float one[1] = {-3.5f};
    assert_int_equal(fr_hadamard(one, 1), FR_OK);
    assert_true(one[0] == -3.5f);
    float two[2] = {3.0f, 1.0f};
    assert_int_equal(fr_hadamard(two, 2), FR_OK);
    assert_true(fabsf(two[0] - 4.0f / sqrtf(2.0f)) < 1e-6f && fabsf(two[1] - 2.0f / sqrtf(2.0f)) < 1e-6f);
}

static void test_hadamard_orthonormal(void **state)
{
    (void)state;
    enum { N = 128 };
    static float H[N][N];
    for (int i = 0; i < N; i++) {
        memset(H[i], 0, sizeof H[i]);
        H[i][i] = 1.0f;
        assert_int_equal(fr_hadamard(H[i], N), FR_OK);   /* column i = row i (symmetric) */
    }
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < N; j++) {
            /* Sylvester order: sign (-1)^popcount(i & j), magnitude 1/sqrt(n). */
            double want = (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) / sqrt((double)N);
            assert_true(fabs(H[i][j] - want) < 1e-7);
            double dot = 0.0;
            for (int k = 0; k < N; k++) dot += (double)H[i][k] * H[j][k];
            assert_true(fabs(dot - (i == j ? 1.0 : 0.0)) < 1e-6);
        }
    }
}

static void test_hadamard_inner_products(void **state)
{
    (void)state;
    fr_test_rng r = {72};
    float a[512], b[512];
    for (int n = 16; n <= 512; n *= 2)
        for (int rep = 0; rep < 20; rep++) {
            double ab = 0, na = 0, nb = 0, hab = 0, hna = 0;
            for (int i = 0; i < n; i++) {
                a[i] = fr_test_normal(&r);
                b[i] = fr_test_normal(&r) + 0.5f * a[i];
                ab += (double)a[i] * b[i]; na += (double)a[i] * a[i]; nb += (double)b[i] * b[i];
            }
            assert_int_equal(fr_hadamard(a, n), FR_OK);
            assert_int_equal(fr_hadamard(b, n), FR_OK);
            for (int i = 0; i < n; i++) { hab += (double)a[i] * b[i]; hna += (double)a[i] * a[i]; }
            assert_true(fabs(hab - ab) <= 1e-6 * sqrt(na * nb));
            assert_true(fabs(hna - na) <= 1e-6 * na);
        }
}

static void test_hadamard_rejects(void **state)
{
    (void)state;
    float x[1024];
    for (int i = 0; i < 1024; i++) x[i] = (float)i;
    const int bad[] = {0, -4, 3, 6, 100, 384, 1024};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char want[32];
        snprintf(want, sizeof want, "size %d", bad[i]);
        assert_int_equal(fr_hadamard(x, bad[i]), FR_EINVAL);
        assert_non_null(strstr(fr_last_error(), want));
    }
    for (int i = 0; i < 1024; i++) assert_true(x[i] == (float)i);   /* untouched */
    assert_int_equal(fr_hadamard(NULL, 16), FR_EINVAL);
    assert_true(strlen(fr_last_error()) > 0);
}

/* ---- probability quantization ---------------------------------------------- */

static void test_pquant_params_and_kappa(void **state)
{
    (void)state;
    fr_pquant_params d = fr_pquant_default(), p = fr_pquant_plain();
    assert_int_equal(d.underflow_aware, 1);
    assert_true(d.c == 8.0f && d.tau == 21.0f / 1024.0f);
    assert_int_equal(p.underflow_aware, 0);
    assert_true(p.c == 1.0f);

    /* kappa = 2 exactly when c p_max <= tau: p_max = tau / c is on the threshold. */
    float at = d.tau / d.c, above = nextafterf(at, 1.0f);
    assert_true(d.c * at == d.tau);
    assert_int_equal(fr_pquant_scale(FR_NVFP4, &d, at), fr_e4m3_encode(d.c * at / 2.0f));
    assert_int_equal(fr_pquant_scale(FR_NVFP4, &d, above), fr_e4m3_encode(d.c * above / 6.0f));
    assert_true(fr_e4m3_decode(fr_pquant_scale(FR_NVFP4, &d, at)) == 10.0f / 1024.0f);  /* 21/2048 -> 20/2048 */
    assert_true(fr_pquant_scale(FR_NVFP4, &d, at) != fr_pquant_scale(FR_NVFP4, &d, above));
    const float ps[] = {1.0f, 0.5f, 0.1f, 0.01f, 1e-3f, 3e-4f, 0x1p-12f, 1e-6f, 0.0f};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        float cm = d.c * ps[i];
        float kappa = cm <= d.tau ? 2.0f : 6.0f;
        assert_int_equal(fr_pquant_scale(FR_NVFP4, &d, ps[i]), fr_e4m3_encode(cm / kappa));
        assert_int_equal(fr_pquant_scale(FR_NVFP4, &p, ps[i]), fr_e4m3_encode(ps[i] / 6.0f));
        /* MXFP4: the OCP power of two of c p_max. */
        uint8_t mx = fr_pquant_scale(FR_MXFP4, &d, ps[i]);
        if (ps[i] == 0.0f) assert_int_equal(mx, 0);
        else assert_int_equal(mx, fr_e8m0_from_exp(fr_floor_log2(cm) - 2));
    }
}

static void make_prob_block(fr_test_rng *r, float pmax, float c, float *cp)
{
    for (int i = 0; i < 16; i++) cp[i] = c * pmax * fr_test_uniform(r);
    cp[7] = c * pmax;
}

static int count_nonzero(const float *x, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++) k += x[i] != 0.0f;
    return k;
}

static void test_pquant_underflow(void **state)
{
    (void)state;
    fr_pquant_params d = fr_pquant_default(), p = fr_pquant_plain();
    fr_test_rng r = {81};
    float cp[16], out[16];

    /* Plain rule: p_max / 6 below 2^-10 underflows, so the floor is p_max <= 6 * 2^-10. */
    const float plain_dead[] = {0x1p-12f, 0x1.4p-12f, 0x1p-9f, 6.0f * 0x1p-10f};
    for (size_t i = 0; i < sizeof plain_dead / sizeof plain_dead[0]; i++) {
        make_prob_block(&r, plain_dead[i], 1.0f, cp);
        assert_true(fr_pquant_block(FR_NVFP4, &p, cp, plain_dead[i], out) == 0.0f);
        assert_int_equal(count_nonzero(out, 16), 0);
    }
    float plain_live = nextafterf(6.0f * 0x1p-10f, 1.0f);
    make_prob_block(&r, plain_live, 1.0f, cp);
    assert_true(fr_pquant_block(FR_NVFP4, &p, cp, plain_live, out) == 0x1p-9f);
    assert_true(count_nonzero(out, 16) > 0);

    /* Underflow-aware: c = 8 and kappa = 2 push the floor 24x lower, to
     * p_max = 2^-12 (where c p_max / 2 = 2^-10, the E4M3 tie that goes to 0). */
    const float aware_live[] = {nextafterf(0x1p-12f, 1.0f), 0x1.4p-12f, 0x1p-11f, 0x1p-9f};
    for (size_t i = 0; i < sizeof aware_live / sizeof aware_live[0]; i++) {
        float pm = aware_live[i];
        make_prob_block(&r, pm, 1.0f, cp);
        assert_int_equal(count_nonzero((fr_pquant_block(FR_NVFP4, &p, cp, pm, out), out), 16), 0);
        make_prob_block(&r, pm, d.c, cp);
        float s = fr_pquant_block(FR_NVFP4, &d, cp, pm, out);
        assert_true(s > 0.0f);
        assert_true(s == fr_e4m3_decode(fr_e4m3_encode(d.c * pm / 2.0f)));
        assert_true(count_nonzero(out, 16) > 0);
        assert_true(fabsf(out[7] - cp[7]) <= 0.5f * cp[7]);   /* the maximum survives */
        for (int j = 0; j < 16; j++) assert_true(out[j] == s * fr_e2m1_decode(fr_e2m1_encode(cp[j] / s)));
    }
    make_prob_block(&r, 0x1p-12f, d.c, cp);
    assert_true(fr_pquant_block(FR_NVFP4, &d, cp, 0x1p-12f, out) == 0.0f);
    assert_int_equal(count_nonzero(out, 16), 0);
    printf("    P underflow floor: plain rule p_max <= %g, underflow-aware p_max <= %g (ratio %g)\n",
           (double)(6.0f * 0x1p-10f), (double)0x1p-12f, (double)(6.0f * 0x1p-10f / 0x1p-12f));

    /* A typical block away from the floors: both rules quantize E2M1(cp / s). */
    make_prob_block(&r, 0.3f, d.c, cp);
    float s = fr_pquant_block(FR_NVFP4, &d, cp, 0.3f, out);
    assert_true(s == fr_e4m3_round(d.c * 0.3f / 6.0f));
    assert_true(fabsf(out[7] - cp[7]) <= 0.1f * cp[7]);
    /* MXFP4 P blocks (32 keys) never underflow at these magnitudes. */
    float cp32[32], out32[32];
    for (int i = 0; i < 32; i++) cp32[i] = d.c * 0x1p-20f * fr_test_uniform(&r);
    cp32[0] = d.c * 0x1p-20f;
    s = fr_pquant_block(FR_MXFP4, &d, cp32, 0x1p-20f, out32);
    assert_true(s == 0x1p-19f);          /* 2^(floor(log2(8 * 2^-20)) - 2) */
    assert_true(out32[0] == cp32[0]);    /* 4 * 2^-19 */
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_format_basics),
             cmocka_unit_test(test_nvfp4_hand_blocks),
             cmocka_unit_test(test_nvfp4_zero_and_underflow),
             cmocka_unit_test(test_nvfp4_random_blocks),
             cmocka_unit_test(test_mxfp4_hand_blocks),
             cmocka_unit_test(test_mxfp4_random_blocks),
             cmocka_unit_test(test_nan_inf_blocks),
             cmocka_unit_test(test_pack_unpack),
             cmocka_unit_test(test_rows),
             cmocka_unit_test(test_dual_terms),
             cmocka_unit_test(test_dual_residual_query_share),
             cmocka_unit_test(test_hadamard_involution),
             cmocka_unit_test(test_hadamard_orthonormal),
             cmocka_unit_test(test_hadamard_inner_products),
             cmocka_unit_test(test_hadamard_rejects),
             cmocka_unit_test(test_pquant_params_and_kappa),
             cmocka_unit_test(test_pquant_underflow),
             cmocka_unit_test(test_code_words))
