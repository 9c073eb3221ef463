/* YaRN RoPE (rollout/model/rope_yarn.h, docs/mla.md "YaRN"): the
 * frequencies, correction range and scales against the golden values
 * tests/data/rope/yarn_golden.py computes from the published formulas, the
 * edge cases by hand (factor 1 is plain RoPE; pairs below the range keep the
 * trained frequency, pairs above it are divided by factor; plain RoPE is
 * bit for bit what it was), and the engine with YaRN on the tiny Qwen3 and
 * DeepSeek models: decode equals prefill at positions beyond the original
 * window, and the scaling changes the logits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/engine/session.h"
#include "rollout/model/ops_cpu.h"
#include "rollout/model/rope_yarn.h"
#include "logits_util.h"
#include "test_util.h"

#define GOLDEN "tests/data/rope/yarn_golden.txt"

/* |got - want| within rel * |want| (and a tiny floor for zeros). */
static void expect_close(const char *what, const char *name, int i, double got, double want, double rel)
{
    if (fabs(got - want) <= rel * fabs(want) + 1e-30) return;
    fail_msg("%s %s[%d]: got %.17g, want %.17g", name, what, i, got, want);
}

/* One golden case: reads its four lines and checks them. Returns 0 at the
 * end of the file. */
static int check_case(FILE *f)
{
    char name[64];
    double theta, factor, bf, bs, ms, msa, attn, low, high, af, soft;
    int dim, orig, trunc;
    if (fscanf(f, " case %63s %lf %d %lf %d %lf %lf %lf %lf %lf %d", name, &theta, &dim, &factor, &orig, &bf, &bs,
               &ms, &msa, &attn, &trunc) != 11)
        return 0;
    assert_int_equal(fscanf(f, " range %lf %lf scales %lf %lf inv", &low, &high, &af, &soft), 4);
    fr_rope_scaling y = {.yarn = 1, .factor = factor, .original_max_position = orig, .beta_fast = bf,
                         .beta_slow = bs, .mscale = ms, .mscale_all_dim = msa, .attention_factor = attn,
                         .truncate = trunc};
    double lo, hi;
    fr_yarn_range(&y, dim, theta, &lo, &hi);
    /* truncated ranges are whole numbers, the rest logs within a few ulps */
    expect_close("low", name, 0, lo, low, trunc ? 0 : 1e-12);
    expect_close("high", name, 0, hi, high, trunc ? 0 : 1e-12);
    expect_close("attention factor", name, 0, fr_rope_attention_factor(&y), af, 1e-12);
    fr_model_config c = {.qk_nope_dim = 128, .qk_rope_dim = dim, .rope_scaling = y};
    expect_close("softmax scale", name, 0, fr_mla_softmax_scale(&c), soft / sqrt(128.0 + dim), 1.2e-7);
    float inv[256];
    fr_rope_inv_freq(inv, 0, dim / 2, dim, theta, &y);
    for (int i = 0; i < dim / 2; i++) {
        double want;
        assert_int_equal(fscanf(f, "%lf", &want), 1);
        /* powf may differ from Python's rounded pow by an ulp */
        expect_close("inv_freq", name, i, inv[i], want, 3e-7);
    }
    printf("  %s: range [%g, %g], cos/sin factor %.6f, softmax multiplier %.6f\n", name, lo, hi, af, soft);
    return 1;
}

static void test_golden(void **state)
{
    (void)state;
    FILE *f = fopen(GOLDEN, "r");
    if (!f) fail_msg("%s: cannot open (run from the repository root)", GOLDEN);
    int c, cases = 0;
    while ((c = fgetc(f)) == '#')
        while ((c = fgetc(f)) != '\n' && c != EOF) {}
    ungetc(c, f);
    while (check_case(f)) cases++;
    fclose(f);
    assert_int_equal(cases, 7);
}

/* Plain RoPE's frequencies, the formula of before YaRN. */
static float plain_inv(int i, int dim, double theta)
{
    return 1.0f / fr_powf((float)theta, (float)(2 * i) / (float)dim);
}

static void test_edges(void **state)
{
    (void)state;
    const int dim = 64;
    const double theta = 10000.0;
    float inv[32], plain[32];
    fr_rope_inv_freq(plain, 0, 32, dim, theta, NULL);
    for (int i = 0; i < 32; i++) assert_true(plain[i] == plain_inv(i, dim, theta));
    fr_rope_scaling off = {0};
    fr_rope_inv_freq(inv, 0, 32, dim, theta, &off);
    assert_memory_equal(inv, plain, sizeof inv);
    assert_true(fr_rope_attention_factor(NULL) == 1.0 && fr_rope_attention_factor(&off) == 1.0);

    /* DeepSeek-V3's range is [10, 23]: below, the trained frequency; above,
     * divided by factor; between, strictly between the two */
    fr_rope_scaling y = {.yarn = 1, .factor = 40, .original_max_position = 4096, .beta_fast = 32, .beta_slow = 1,
                         .mscale = 1, .mscale_all_dim = 1, .truncate = 1};
    fr_rope_inv_freq(inv, 0, 32, dim, theta, &y);
    for (int i = 0; i < 32; i++) {
        const float pf = fr_powf((float)theta, (float)(2 * i) / (float)dim), inter = 1.0f / (40.0f * pf);
        if (i <= 10) assert_true(inv[i] == plain[i]);
        else if (i >= 23) assert_true(inv[i] == inter);
        else assert_true(inv[i] < plain[i] && inv[i] > inter);
    }
    /* chunks give the same numbers as the whole */
    float part[8];
    fr_rope_inv_freq(part, 12, 8, dim, theta, &y);
    assert_memory_equal(part, inv + 12, sizeof part);

    /* factor 1: plain RoPE within an ulp (inter * (1 - e) + extra * e
     * rounds), exactly outside the ramp, and no cos/sin factor */
    fr_rope_scaling one = {.yarn = 1, .factor = 1, .original_max_position = 4096, .beta_fast = 32, .beta_slow = 1,
                           .truncate = 1};
    fr_rope_inv_freq(inv, 0, 32, dim, theta, &one);
    for (int i = 0; i < 32; i++) {
        assert_true(fabsf(inv[i] - plain[i]) <= 1.2e-7f * plain[i]);
        if (i <= 10 || i >= 23) assert_true(inv[i] == plain[i]);
    }
    assert_true(fr_rope_attention_factor(&one) == 1.0);
    fr_model_config c = {.qk_nope_dim = 128, .qk_rope_dim = 64, .rope_scaling = one};
    assert_true(fr_mla_softmax_scale(&c) == 1.0f / sqrtf(192.0f));
    c.rope_scaling.mscale_all_dim = 1;   /* mscale(1, m) is 1 */
    assert_true(fr_mla_softmax_scale(&c) == (float)(1.0 / sqrt(192.0)));
}

/* fr_rope and fr_rope_cos_sin with YaRN: cos and sin of pos * inv_freq,
 * times the factor, beyond the original window too. */
static void test_rope_rotation(void **state)
{
    (void)state;
    const int d = 128;
    fr_rope_scaling y = {.yarn = 1, .factor = 4, .original_max_position = 32768, .beta_fast = 32, .beta_slow = 1,
                         .truncate = 1};
    const double af = fr_rope_attention_factor(&y);
    assert_true(fabs(af - (0.1 * log(4.0) + 1.0)) < 1e-12);
    float inv[64], c[64], s[64], x[128], x0[128];
    fr_rope_inv_freq(inv, 0, 64, d, 1e6, &y);
    const int positions[] = {0, 1, 4095, 32767, 40000, 131071};
    for (size_t p = 0; p < sizeof positions / sizeof positions[0]; p++) {
        const int pos = positions[p];
        fr_rope_cos_sin(c, s, d, pos, 1e6, &y);
        for (int i = 0; i < 64; i++) {
            const double a = (double)((float)pos * inv[i]);
            assert_true(fabs(c[i] - cos(a) * af) <= 3e-7 * af && fabs(s[i] - sin(a) * af) <= 3e-7 * af);
            x0[i] = x[i] = (float)(i % 7) - 3.0f;
            x0[i + 64] = x[i + 64] = (float)(i % 5) - 2.0f;
        }
        fr_rope(x, 1, d, pos, 1e6, &y);
        for (int i = 0; i < 64; i++) {
            assert_true(x[i] == x0[i] * c[i] - x0[i + 64] * s[i]);
            assert_true(x[i + 64] == x0[i + 64] * c[i] + x0[i] * s[i]);
        }
    }
}

static const int PROMPT[] = {256, 100, 101, 102, 32, 109, 97, 105, 110, 40, 41, 58, 10, 32, 32, 32, 32, 114, 101,
                             116, 117, 114, 110, 32, 49, 50, 51, 10, 35, 32, 100, 111, 110, 101, 46};
#define NP ((int)(sizeof PROMPT / sizeof PROMPT[0]))

/* The logits of PROMPT by one prefill and by decode steps on `spec` with
 * the given scaling (an f32 cache: float32 order only). */
static void run_model(const char *spec, const fr_rope_scaling *y, float **pre, float **dec, int *vocab)
{
    fr_model *m = NULL;
    if (fr_model_load(spec, &m)) fail_msg("%s: %s", spec, fr_last_error());
    m->cfg.rope_scaling = *y;
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, spec, FR_KV_F32);
    fr_session s;
    if (fr_session_open_model(&o, m, 8, 2, &s)) fail_msg("%s: %s", spec, fr_last_error());
    *vocab = s.model->cfg.vocab_size;
    *pre = fr_test_logits(&s, PROMPT, NP, NP);
    *dec = fr_test_logits(&s, PROMPT, NP, 0);
    fr_session_close(&s);
}

/* A 16-token original window, so most of the prompt lies beyond it. */
static void test_engine(void **state)
{
    (void)state;
    const char *specs[3] = {"synthetic:tiny", "synthetic:tiny-dsmoe", "synthetic:tiny-dsmoe-v2"};
    const fr_rope_scaling plain = {0};
    const fr_rope_scaling y = {.yarn = 1, .factor = 4, .original_max_position = 16, .beta_fast = 32, .beta_slow = 1,
                               .mscale = 1, .mscale_all_dim = 0.5, .truncate = 1};
    for (int v = 0; v < 3; v++) {
        float *pre, *dec, *pre0, *dec0;
        int V;
        run_model(specs[v], &y, &pre, &dec, &V);
        run_model(specs[v], &plain, &pre0, &dec0, &V);
        const size_t count = (size_t)NP * V, late = (size_t)16 * V;
        const float m = fr_test_max_abs(pre, count), d = fr_test_max_diff(pre, dec, count);
        /* YaRN moves the logits (the cos/sin factor from the first token,
         * and for DeepSeek the softmax scale) */
        const float moved = fr_test_max_diff(pre + late, pre0 + late, count - late);
        printf("  %s with YaRN: decode vs prefill max |diff| %.3g of max |logit| %.3g; against plain RoPE %.3g\n",
               specs[v], d, m, moved);
        assert_true(m > 0.1f && d <= 1e-4f * m);
        assert_true(fr_test_max_diff(pre0, dec0, count) <= 1e-4f * fr_test_max_abs(pre0, count));
        assert_true(moved > 1e-3f * m);
        free(pre);
        free(dec);
        free(pre0);
        free(dec0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_rope_rotation),
        cmocka_unit_test(test_engine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
