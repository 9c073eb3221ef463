/* Scalar number formats (attention/fp_formats.h, docs/formats.md): E2M1,
 * E4M3, E8M0 and BF16, checked exhaustively where the format is small enough
 * (all 16 E2M1 codes, all 256 E4M3 codes, every tie between neighbours) and
 * against independent nearest-value searches written here, not against the
 * library's own decoders. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "test_util.h"

/* ---- independent models of the formats ------------------------------- */

static const double e2m1_mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

/* Nearest E2M1 magnitude code, ties to the even code, saturating at 6. */
static uint8_t model_e2m1(float x)
{
    if (isnan(x)) return 0;
    double a = fabs((double)x);
    int best = 0;
    for (int c = 1; c < 8; c++) {
        double db = fabs(a - e2m1_mag[best]), dc = fabs(a - e2m1_mag[c]);
        if (dc < db || (dc == db && (c & 1) == 0)) best = c;
    }
    return (uint8_t)((signbit(x) ? 8 : 0) | best);
}

/* E4M3 magnitude of positive code c (0..0x7E) from the bit layout. */
static double model_e4m3_mag(int c)
{
    int e = (c >> 3) & 0xF, m = c & 7;
    return e == 0 ? ldexp((double)m, -9) : ldexp((double)(8 + m), e - 10);
}

static double e4m3_table[127];   /* codes 0..0x7E, strictly increasing */

static void build_e4m3_table(void)
{
    for (int c = 0; c <= 0x7E; c++) e4m3_table[c] = model_e4m3_mag(c);
}

/* Nearest E4M3 code by binary search over the table, ties to the even code,
 * saturating at 448. */
static uint8_t model_e4m3(float x)
{
    if (isnan(x)) return 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0;
    double a = fabs((double)x);
    if (a >= 448.0) return sign | 0x7E;
    int lo = 0, hi = 0x7E;            /* table[lo] <= a < table[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (e4m3_table[mid] <= a) lo = mid; else hi = mid;
    }
    double dl = a - e4m3_table[lo], dh = e4m3_table[hi] - a;
    int c = dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
    return sign | (uint8_t)c;
}

static float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- E2M1 ------------------------------------------------------------ */

static void test_e2m1_all_codes(void **state)
{
    (void)state;
    for (int c = 0; c < 16; c++) {
        float v = fr_e2m1_decode((uint8_t)c);
        double expect = (c & 8) ? -e2m1_mag[c & 7] : e2m1_mag[c & 7];
        assert_true((double)v == expect);
        assert_int_equal(signbit(v) != 0, (c & 8) != 0);   /* code 8 is -0 */
        assert_int_equal(fr_e2m1_encode(v), c);
    }
    assert_int_equal(fr_e2m1_encode(-0.0f), 8);
    assert_int_equal(fr_e2m1_encode(0.0f), 0);
}

static void test_e2m1_ties_and_neighbours(void **state)
{
    (void)state;
    /* Every midpoint between neighbouring magnitudes goes to the even code. */
    static const struct { float x; uint8_t code; } ties[] = {
        {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},
    };
    for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++) {
        assert_int_equal(fr_e2m1_encode(ties[i].x), ties[i].code);
        assert_int_equal(fr_e2m1_encode(-ties[i].x), ties[i].code | 8);
        /* Just below and just above: the nearer neighbour. */
        int lo = (int)i, hi = (int)i + 1;   /* magnitude codes either side */
        float below = nextafterf(ties[i].x, 0.0f), above = nextafterf(ties[i].x, INFINITY);
        assert_int_equal(fr_e2m1_encode(below), lo);
        assert_int_equal(fr_e2m1_encode(above), hi);
        assert_int_equal(fr_e2m1_encode(-below), lo | 8);
        assert_int_equal(fr_e2m1_encode(-above), hi | 8);
    }
    /* Tiny negatives keep the sign: code 8 (-0). */
    assert_int_equal(fr_e2m1_encode(-0.1f), 8);
    assert_int_equal(fr_e2m1_encode(-1e-30f), 8);
}

static void test_e2m1_saturation_and_nan(void **state)
{
    (void)state;
    const float big[] = {nextafterf(6.0f, INFINITY), 6.5f, 7.0f, 1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(fr_e2m1_encode(big[i]), 7);
        assert_int_equal(fr_e2m1_encode(-big[i]), 15);
    }
    assert_int_equal(fr_e2m1_encode(NAN), 0);
    assert_int_equal(fr_e2m1_encode(-NAN), 0);
}

static void test_e2m1_random_against_model(void **state)
{
    (void)state;
    fr_test_rng r = {11};
    for (int i = 0; i < 200000; i++) {
        float x = (fr_test_uniform(&r) * 2.0f - 1.0f) * 8.0f;
        if (i % 2 == 0) {   /* close to a grid point or a midpoint, at many distances */
            float anchor = (float)(i % 16 < 8 ? e2m1_mag[i / 2 % 8] : 0.5 * (e2m1_mag[i / 2 % 7] + e2m1_mag[i / 2 % 7 + 1]));
            float eps = ldexpf(fr_test_uniform(&r) - 0.5f, -(int)(fr_test_u64(&r) % 24));
            x = (i % 4 == 0 ? anchor : -anchor) + eps;
        }
        assert_int_equal(fr_e2m1_encode(x), model_e2m1(x));
    }
}

/* ---- E4M3 ------------------------------------------------------------ */

static void test_e4m3_all_codes(void **state)
{
    (void)state;
    build_e4m3_table();
    for (int c = 0; c < 256; c++) {
        float v = fr_e4m3_decode((uint8_t)c);
        if ((c & 0x7F) == 0x7F) {
            assert_true(isnan(v));
            continue;
        }
        double expect = e4m3_table[c & 0x7F] * ((c & 0x80) ? -1.0 : 1.0);
        assert_true((double)v == expect);
        assert_int_equal(signbit(v) != 0, (c & 0x80) != 0);
        assert_int_equal(fr_e4m3_encode(v), c);            /* both zeros included */
        assert_true(fr_e4m3_round(v) == v);
    }
    assert_true(fr_e4m3_decode(0x7E) == 448.0f);
    assert_true(fr_e4m3_decode(0x01) == 0x1p-9f);
    assert_true(fr_e4m3_decode(0x08) == 0x1p-6f);            /* smallest normal */
    assert_true(fr_e4m3_decode(0x38) == 1.0f);
    for (int c = 1; c <= 0x7E; c++) assert_true(e4m3_table[c] > e4m3_table[c - 1]);
}

static void test_e4m3_every_tie(void **state)
{
    (void)state;
    build_e4m3_table();
    for (int c = 0; c < 0x7E; c++) {
        float lo = fr_e4m3_decode((uint8_t)c), hi = fr_e4m3_decode((uint8_t)(c + 1));
        float mid = (lo + hi) * 0.5f;
        assert_true((double)mid == (e4m3_table[c] + e4m3_table[c + 1]) / 2);   /* exact */
        int even = (c & 1) ? c + 1 : c;
        assert_int_equal(fr_e4m3_encode(mid), even);
        assert_int_equal(fr_e4m3_encode(-mid), even | 0x80);
        assert_int_equal(fr_e4m3_encode(nextafterf(mid, 0.0f)), c);
        assert_int_equal(fr_e4m3_encode(nextafterf(mid, INFINITY)), c + 1);
        assert_int_equal(fr_e4m3_encode(-nextafterf(mid, 0.0f)), c | 0x80);
        assert_int_equal(fr_e4m3_encode(-nextafterf(mid, INFINITY)), (c + 1) | 0x80);
    }
}

static void test_e4m3_random_against_model(void **state)
{
    (void)state;
    build_e4m3_table();
    fr_test_rng r = {12};
    for (int i = 0; i < 1000000; i++) {
        uint64_t u = fr_test_u64(&r);
        /* Exponent field 127-12 .. 127+9: magnitudes 2^-12 .. 2^10. */
        uint32_t ex = 127 - 12 + (uint32_t)((u >> 32) % 22);
        uint32_t bits = ((uint32_t)(u >> 63) << 31) | (ex << 23) | ((uint32_t)u & 0x7FFFFF);
        float x = bits_to_float(bits);
        uint8_t got = fr_e4m3_encode(x), want = model_e4m3(x);
        if (got != want) fail_msg("E4M3(%a) = 0x%02x, nearest is 0x%02x", (double)x, got, want);
    }
}

static void test_e4m3_saturation_underflow_nan(void **state)
{
    (void)state;
    const float big[] = {448.0f, 448.0001f, 464.0f, 1e9f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(fr_e4m3_encode(big[i]), 0x7E);
        assert_int_equal(fr_e4m3_encode(-big[i]), 0xFE);
        assert_true(fr_e4m3_round(big[i]) == 448.0f);
    }
    /* 432 is the midpoint of 416 (mantissa 5) and 448 (mantissa 6). */
    assert_int_equal(fr_e4m3_encode(432.0f), 0x7E);
    assert_int_equal(fr_e4m3_encode(nextafterf(432.0f, 0.0f)), 0x7D);
    /* Half of the smallest subnormal is a tie to code 0; above it rounds up. */
    assert_int_equal(fr_e4m3_encode(0x1p-10f), 0x00);
    assert_int_equal(fr_e4m3_encode(-0x1p-10f), 0x80);
    assert_int_equal(fr_e4m3_encode(nextafterf(0x1p-10f, 1.0f)), 0x01);
    assert_true(fr_e4m3_round(nextafterf(0x1p-10f, 1.0f)) == 0x1p-9f);
    assert_int_equal(fr_e4m3_encode(0x1p-12f), 0x00);
    assert_int_equal(fr_e4m3_encode(1e-45f), 0x00);          /* float denormal */
    assert_int_equal(fr_e4m3_encode(0x1.8p-9f), 0x02);        /* 1.5 * 2^-9 ties to 2 * 2^-9 */
    assert_int_equal(fr_e4m3_encode(0.0f), 0x00);
    assert_int_equal(fr_e4m3_encode(-0.0f), 0x80);
    assert_int_equal(fr_e4m3_encode(NAN), FR_E4M3_NAN);
    assert_int_equal(fr_e4m3_encode(-NAN), FR_E4M3_NAN);
    assert_true(isnan(fr_e4m3_round(NAN)));
    /* Rounding up across an exponent boundary carries into the exponent. */
    assert_int_equal(fr_e4m3_encode(nextafterf(2.0f, 0.0f)), 0x40);
    assert_int_equal(fr_e4m3_encode(0x1.fp+0f), 0x40);        /* 1.9375: tie 1.875|2 -> 2 */
}

/* ---- E8M0 ------------------------------------------------------------ */

static void test_e8m0(void **state)
{
    (void)state;
    assert_int_equal(fr_e8m0_from_exp(0), 127);
    assert_int_equal(fr_e8m0_from_exp(-127), 0);
    assert_int_equal(fr_e8m0_from_exp(-128), 0);
    assert_int_equal(fr_e8m0_from_exp(-100000), 0);
    assert_int_equal(fr_e8m0_from_exp(127), 254);
    assert_int_equal(fr_e8m0_from_exp(128), 254);
    assert_int_equal(fr_e8m0_from_exp(100000), 254);
    for (int e = -127; e <= 127; e++) assert_int_equal(fr_e8m0_from_exp(e), e + 127);
    for (int c = 0; c < 255; c++) {
        float v = fr_e8m0_decode((uint8_t)c);
        assert_true((double)v == ldexp(1.0, c - 127));
        assert_true(v > 0.0f);
    }
    assert_true(fr_e8m0_decode(0) == 0x1p-127f);
    assert_true(fr_e8m0_decode(254) == 0x1p127f);
    assert_true(isnan(fr_e8m0_decode(FR_E8M0_NAN)));
}

/* ---- BF16 ------------------------------------------------------------ */

static void test_bf16_hand_cases(void **state)
{
    (void)state;
    static const struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3F800000u, 0x3F80},            /* 1.0 */
        {0x3F808000u, 0x3F80},            /* 1 + 2^-8: tie between 0x3F80 and 0x3F81 -> even */
        {0x3F818000u, 0x3F82},            /* 1 + 3*2^-8: tie 0x3F81|0x3F82 -> even */
        {0x3F808001u, 0x3F81},            /* just above the tie */
        {0x3F807FFFu, 0x3F80},            /* just below the tie */
        {0x40490FDBu, 0x4049},            /* pi -> 3.140625 */
        {0xC0000000u, 0xC000},            /* -2 */
        {0x3F7FFFFFu, 0x3F80},            /* 1 - 2^-24 rounds up across the exponent */
        {0x7F7FFFFFu, 0x7F80},            /* FLT_MAX is past the largest BF16 + half ulp: inf */
        {0x7F7F7FFFu, 0x7F7F},            /* just below that tie stays finite */
        {0x7F800000u, 0x7F80},            /* +inf */
        {0xFF800000u, 0xFF80},            /* -inf */
        {0x00000001u, 0x0000},            /* smallest float denormal */
        {0x80000000u, 0x8000},            /* -0 */
        {0x00018000u, 0x0002},            /* denormal tie -> even */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = fr_bf16_encode(bits_to_float(cases[i].in));
        if (got != cases[i].out) fail_msg("bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].in, got, cases[i].out);
        assert_true(float_to_bits(fr_bf16_decode(cases[i].out)) == (uint32_t)cases[i].out << 16);
    }
    /* NaNs stay NaN, including a signalling NaN whose payload sits in the low bits. */
    const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = fr_bf16_encode(bits_to_float(nans[i]));
        assert_true(isnan(fr_bf16_decode(h)));
        assert_true(h & 0x40);                                /* quiet */
        assert_int_equal(h & 0x8000, (nans[i] >> 16) & 0x8000);
    }
    assert_true(fr_bf16_round(1.0f) == 1.0f);
    assert_true(fr_bf16_round(0x1.0101p0f) == 0x1.02p0f);
}

static void test_bf16_random_against_rint(void **state)
{
    (void)state;
    fr_test_rng r = {13};
    for (int i = 0; i < 200000; i++) {
        uint64_t u = fr_test_u64(&r);
        uint32_t ex = 1 + (uint32_t)((u >> 32) % 253);         /* normal, no overflow */
        float x = bits_to_float(((uint32_t)(u >> 63) << 31) | (ex << 23) | ((uint32_t)u & 0x7FFFFF));
        double ulp = ldexp(1.0, fr_floor_log2(x) - 7);
        double want = rint((double)x / ulp) * ulp;               /* ties to even in double */
        if ((double)fr_bf16_round(x) != want) fail_msg("bf16(%a) = %a, expected %a", (double)x, (double)fr_bf16_round(x), want);
    }
}

static void test_floor_log2(void **state)
{
    (void)state;
    for (int k = -149; k <= 127; k++) {
        float p = ldexpf(1.0f, k);
        assert_int_equal(fr_floor_log2(p), k);
        assert_int_equal(fr_floor_log2(-p), k);
        if (k > -149) assert_int_equal(fr_floor_log2(nextafterf(p, 0.0f)), k - 1);
        if (k < 127) assert_int_equal(fr_floor_log2(nextafterf(2.0f * p, 0.0f)), k);
    }
    assert_int_equal(fr_floor_log2(FLT_MAX), 127);
    assert_int_equal(fr_floor_log2(6.0f), 2);
    assert_int_equal(fr_floor_log2(0.75f), -1);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_e2m1_all_codes),
             cmocka_unit_test(test_e2m1_ties_and_neighbours),
             cmocka_unit_test(test_e2m1_saturation_and_nan),
             cmocka_unit_test(test_e2m1_random_against_model),
             cmocka_unit_test(test_e4m3_all_codes),
             cmocka_unit_test(test_e4m3_every_tie),
             cmocka_unit_test(test_e4m3_random_against_model),
             cmocka_unit_test(test_e4m3_saturation_underflow_nan),
             cmocka_unit_test(test_e8m0),
             cmocka_unit_test(test_bf16_hand_cases),
             cmocka_unit_test(test_bf16_random_against_rint),
             cmocka_unit_test(test_floor_log2))
