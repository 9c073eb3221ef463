/* Reference decode attention (attention/ref_attention.h, paper Algorithm 1)
 * and the KV numerics modes (attention/kv_numerics.h): BF16 mode against a
 * naive double-precision softmax attention written here, the split-KV plan and
 * combine in every mode, an exact-mode tile checked against a step-by-step
 * re-derivation of Algorithm 1, the stored token regions (sink, pages,
 * recent), sink masking, FP4-vs-BF16 accuracy, and argument checking. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "attention/hadamard.h"
#include "attention/kv_numerics.h"
#include "attention/microscale.h"
#include "attention/prob_quant.h"
#include "attention/ref_attention.h"
#include "test_util.h"

/* ---- helpers ----------------------------------------------------------- */

static float *alloc_f(size_t n)
{
    float *p = calloc(n, sizeof(float));
    assert_non_null(p);
    return p;
}

static void fill_normal(fr_test_rng *r, float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = scale * fr_test_normal(r);
}

/* Keys that look like real post-RoPE keys: a per-channel mean and a few
 * outlier channels, so smoothing and rotation matter. mu receives the mean. */
static void make_keys(fr_test_rng *r, int n, int d, float *k, float *mu)
{
    for (int j = 0; j < d; j++) mu[j] = 1.5f * fr_test_normal(r);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < d; j++) {
            float x = fr_test_normal(r);
            if (j % 37 == 3) x *= 8.0f;
            k[(size_t)t * d + j] = mu[j] + x;
        }
}

/* Naive softmax attention in double over all n tokens of the given k/v:
 * S = log2(e)/sqrt(d) q.k, o = sum 2^S v / sum 2^S, lse = log2 sum 2^S. */
static void naive_attention(int G, int d, int n, const float *q, const float *k, const float *v,
                            double *o, double *lse)
{
    double *S = malloc(sizeof(double) * (size_t)n);
    assert_non_null(S);
    const double gamma = M_LOG2E / sqrt((double)d);
    for (int h = 0; h < G; h++) {
        double m = -INFINITY;
        for (int t = 0; t < n; t++) {
            double s = 0.0;
            for (int j = 0; j < d; j++) s += (double)q[h * d + j] * k[(size_t)t * d + j];
            S[t] = gamma * s;
            if (S[t] > m) m = S[t];
        }
        double l = 0.0;
        for (int j = 0; j < d; j++) o[h * d + j] = 0.0;
        for (int t = 0; t < n; t++) {
            double p = exp2(S[t] - m);
            l += p;
            for (int j = 0; j < d; j++) o[h * d + j] += p * v[(size_t)t * d + j];
        }
        for (int j = 0; j < d; j++) o[h * d + j] /= l;
        lse[h] = m + log2(l);
    }
    free(S);
}

static double dotd(const float *a, const float *b, int d)
{
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)a[i] * b[i];
    return s;
}

/* ||a - b|| / ||b|| over n values. */
static double rel_err_fd(const float *a, const double *b, int n)
{
    double num = 0.0, den = 0.0;
    for (int i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static double rel_err_ff(const float *a, const float *b, int n)
{
    double num = 0.0, den = 0.0;
    for (int i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* A cache of n tokens in one mode, prepared from raw tensors. */
typedef struct {
    fr_ref_config cfg;
    int n, d, G;
    float *k, *v, *mu, *q;       /* raw */
    float *ks, *vs, *qs;         /* stored keys/values, prepared query */
    fr_kv_view view;
    fr_attn_params p;
} cache;

static const float qscale = 0.5f;   /* query scale: logits with a standard deviation of about 1.2 (base 2) */

static void cache_init(cache *c, const fr_ref_config *cfg, int n, int d, int G, unsigned seed)
{
    fr_test_rng r = {seed};
    c->cfg = *cfg;
    c->n = n; c->d = d; c->G = G;
    c->k = alloc_f((size_t)n * d); c->v = alloc_f((size_t)n * d);
    c->mu = alloc_f((size_t)d); c->q = alloc_f((size_t)G * d);
    c->ks = alloc_f((size_t)n * d); c->vs = alloc_f((size_t)n * d); c->qs = alloc_f((size_t)G * d);
    make_keys(&r, n, d, c->k, c->mu);
    /* Values with a per-channel mean, as real value caches have; without one
     * the output of soft attention over many tokens nearly cancels and any
     * relative error is dominated by that cancellation. */
    float vmean[FR_MAX_HEAD_DIM];
    fill_normal(&r, vmean, (size_t)d, 1.0f);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < d; j++) c->v[(size_t)t * d + j] = vmean[j] + fr_test_normal(&r);
    fill_normal(&r, c->q, (size_t)G * d, qscale);
}

static void cache_prepare(cache *c)
{
    assert_int_equal(fr_ref_prepare_kv(&c->cfg, c->d, c->n, c->k, c->v, c->mu, c->ks, c->vs, &c->view), FR_OK);
    assert_int_equal(fr_ref_prepare_query(&c->cfg, c->d, c->G, c->q, c->qs), FR_OK);
    c->p = fr_ref_attn_params(&c->cfg, c->d, c->G);
}

static void cache_free(cache *c)
{
    free(c->k); free(c->v); free(c->mu); free(c->q);
    free(c->ks); free(c->vs); free(c->qs);
}

/* ---- modes and parsing ---------------------------------------------------- */

static void test_numerics_parsing(void **state)
{
    (void)state;
    static const char *names[] = {"bf16", "fp8", "nvfp4", "mxfp4"};
    for (int i = 0; i < 4; i++) {
        fr_kv_dtype t;
        assert_int_equal(fr_kv_dtype_parse(names[i], &t), FR_OK);
        assert_int_equal(t, i);
        assert_string_equal(fr_kv_dtype_name(t), names[i]);
        assert_int_equal(fr_kv_dtype_is_fp4(t), i >= 2);
    }
    assert_int_equal(fr_kv_dtype_fp4_format(FR_KV_MXFP4), FR_MXFP4);
    assert_int_equal(fr_kv_dtype_fp4_format(FR_KV_NVFP4), FR_NVFP4);
    fr_kv_dtype t;
    assert_int_equal(fr_kv_dtype_parse("int4", &t), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "int4"));
    fr_fp4_compute c;
    assert_int_equal(fr_fp4_compute_parse("exact", &c), FR_OK);
    assert_int_equal(c, FR_COMPUTE_EXACT);
    assert_int_equal(fr_fp4_compute_parse("bf16", &c), FR_OK);
    assert_int_equal(c, FR_COMPUTE_BF16);
    assert_int_equal(fr_fp4_compute_parse("auto", &c), FR_OK);
    assert_int_equal(c, FR_COMPUTE_AUTO);
    assert_int_equal(fr_fp4_compute_parse("fp4", &c), FR_EINVAL);

    fr_recipe rc;
    char buf[128];
    const fr_recipe all_on = {1, 1, 1, 1, 1, 1, 0}, all_off = {0, 0, 0, 0, 0, 0, 0};
    assert_int_equal(fr_recipe_parse("full", &rc), FR_OK);
    assert_memory_equal(&rc, &all_on, sizeof rc);
    assert_int_equal(fr_recipe_parse("vanilla", &rc), FR_OK);
    assert_memory_equal(&rc, &all_off, sizeof rc);
    assert_int_equal(fr_recipe_parse("full,-rotate,-sink", &rc), FR_OK);
    assert_true(rc.smooth && !rc.rotate && rc.scale_search && rc.dual_query && rc.p_scaling && !rc.sink_recent);
    fr_recipe_format(&rc, buf, sizeof buf);
    assert_string_equal(buf, "full,-rotate,-sink");
    assert_int_equal(fr_recipe_parse("vanilla,+search", &rc), FR_OK);
    assert_true(rc.scale_search && !rc.smooth && !rc.dual_query);
    fr_recipe back;
    fr_recipe_format(&rc, buf, sizeof buf);
    assert_int_equal(fr_recipe_parse(buf, &back), FR_OK);
    assert_memory_equal(&back, &rc, sizeof rc);
    assert_int_equal(fr_recipe_parse("full,+rowmax", &rc), FR_OK);
    assert_true(rc.p_row_max && rc.sink_recent);
    assert_int_equal(fr_recipe_parse("half", &rc), FR_EINVAL);
    assert_int_equal(fr_recipe_parse("full,rotate", &rc), FR_EINVAL);
    assert_int_equal(fr_recipe_parse("full,-foo", &rc), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "foo"));
    assert_int_equal(fr_recipe_parse(NULL, &rc), FR_EINVAL);
}

static void test_config_to_params(void **state)
{
    (void)state;
    fr_ref_config cfg = fr_ref_config_default(FR_KV_NVFP4);
    assert_int_equal(cfg.tile, 128);
    assert_int_equal(cfg.compute, FR_COMPUTE_EXACT);
    assert_true(cfg.tau == FR_P_TAU && cfg.fp8_k_scale == 1.0f && cfg.fp8_v_scale == 1.0f);
    cfg.tau = 22.0f / 1024.0f;
    fr_attn_params p = fr_ref_attn_params(&cfg, 128, 4);
    assert_int_equal(p.q_mode, FR_Q_DUAL);
    assert_int_equal(p.quantize_p, 1);
    assert_int_equal(p.fmt, FR_NVFP4);
    assert_int_equal(p.q_search, 1);
    assert_true(p.p.underflow_aware && p.p.c == 8.0f && p.p.tau == 22.0f / 1024.0f);
    cfg.recipe = fr_recipe_vanilla();
    p = fr_ref_attn_params(&cfg, 128, 4);
    assert_int_equal(p.q_mode, FR_Q_SINGLE);
    assert_true(p.quantize_p && !p.p.underflow_aware && p.p.c == 1.0f && !p.q_search);
    cfg = fr_ref_config_default(FR_KV_MXFP4);
    cfg.compute = FR_COMPUTE_BF16;
    p = fr_ref_attn_params(&cfg, 64, 2);
    assert_int_equal(p.fmt, FR_MXFP4);
    assert_int_equal(p.q_mode, FR_Q_UNQUANTIZED);
    assert_int_equal(p.quantize_p, 0);
    for (int t = FR_KV_BF16; t <= FR_KV_FP8; t++) {
        cfg = fr_ref_config_default((fr_kv_dtype)t);
        p = fr_ref_attn_params(&cfg, 64, 2);
        assert_int_equal(p.q_mode, FR_Q_UNQUANTIZED);
        assert_int_equal(p.quantize_p, 0);
    }
}

/* ---- BF16 mode equals naive attention ------------------------------------------ */

static void test_bf16_equals_naive(void **state)
{
    (void)state;
    const int Gs[] = {1, 4, 5, 7, 16}, ds[] = {64, 128, 256}, Ns[] = {1, 17, 128, 1000};
    double worst = 0.0, worst_lse = 0.0;
    fr_ref_config cfg = fr_ref_config_default(FR_KV_BF16);
    for (int gi = 0; gi < 5; gi++)
        for (int di = 0; di < 3; di++)
            for (int ni = 0; ni < 4; ni++) {
                int G = Gs[gi], d = ds[di], n = Ns[ni];
                cache c;
                cache_init(&c, &cfg, n, d, G, (unsigned)(1000 + 100 * gi + 10 * di + ni));
                cache_prepare(&c);
                assert_int_equal(c.view.n_tokens, n);
                assert_int_equal(c.view.n_sink, 0);
                assert_int_equal(c.view.fp4_end, 0);
                assert_ptr_equal(c.view.k, c.ks);
                assert_ptr_equal(c.view.v, c.vs);
                for (size_t i = 0; i < (size_t)n * d; i++) {
                    assert_true(c.ks[i] == fr_bf16_round(c.k[i]));   /* stored as BF16, no shift */
                    assert_true(c.vs[i] == fr_bf16_round(c.v[i]));
                }
                assert_memory_equal(c.qs, c.q, sizeof(float) * (size_t)(G * d));
                float *o = alloc_f((size_t)G * d), lse[FR_MAX_GROUP];
                double *on = malloc(sizeof(double) * (size_t)(G * d)), lsen[FR_MAX_GROUP];
                assert_non_null(on);
                assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 1, o, lse), FR_OK);
                naive_attention(G, d, n, c.qs, c.ks, c.vs, on, lsen);
                double e = rel_err_fd(o, on, G * d);
                if (e > worst) worst = e;
                if (e > 1e-6) fail_msg("G=%d d=%d N=%d: relative error %.3g", G, d, n, e);
                for (int h = 0; h < G; h++) {
                    double el = fabs(lse[h] - lsen[h]) / fmax(1.0, fabs(lsen[h]));
                    if (el > worst_lse) worst_lse = el;
                    assert_true(el < 1e-6);
                }
                free(o); free(on);
                cache_free(&c);
            }
    printf("    BF16 reference vs naive double attention: worst relative error %.2g (output), %.2g (lse)\n",
           worst, worst_lse);
}

static void test_fp8_storage(void **state)
{
    (void)state;
    fr_ref_config cfg = fr_ref_config_default(FR_KV_FP8);
    cfg.fp8_k_scale = 0.05f;
    cfg.fp8_v_scale = 0.02f;
    cache c;
    cache_init(&c, &cfg, 300, 128, 4, 77);
    cache_prepare(&c);
    assert_int_equal(c.view.n_sink, 0);
    assert_int_equal(c.view.fp4_end, 0);
    for (size_t i = 0; i < (size_t)c.n * c.d; i++) {
        assert_true(c.ks[i] == 0.05f * fr_e4m3_round(c.k[i] / 0.05f));
        assert_true(c.vs[i] == 0.02f * fr_e4m3_round(c.v[i] / 0.02f));
    }
    float o[4 * 128], lse[4];
    double on[4 * 128], lsen[4];
    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 1, o, lse), FR_OK);
    naive_attention(4, 128, 300, c.qs, c.ks, c.vs, on, lsen);
    assert_true(rel_err_fd(o, on, 4 * 128) < 1e-6);
    cache_free(&c);
}

/* ---- regions and stored values ------------------------------------------------- */

static void test_regions_and_storage(void **state)
{
    (void)state;
    const int Ns[] = {1, 17, 100, 127, 128, 129, 300, 1000};
    const int d = 128;
    for (int fmt = 0; fmt < 2; fmt++)
        for (int vanilla = 0; vanilla < 2; vanilla++)
            for (int ni = 0; ni < 8; ni++) {
                int n = Ns[ni];
                fr_ref_config cfg = fr_ref_config_default(fmt ? FR_KV_MXFP4 : FR_KV_NVFP4);
                if (vanilla) cfg.recipe = fr_recipe_vanilla();
                fr_fp4_format f = fmt ? FR_MXFP4 : FR_NVFP4;
                int B = fr_fp4_block_size(f);
                cache c;
                cache_init(&c, &cfg, n, d, 2, (unsigned)(300 + ni));
                cache_prepare(&c);
                int sink = vanilla ? 0 : (n < 16 ? n : 16);
                int end = vanilla ? n : n / 128 * 128;
                assert_int_equal(c.view.n_sink, sink);
                assert_int_equal(c.view.fp4_end, end);
                /* Keys: H(k - mu) for every token; quantized in the pages, BF16 elsewhere. */
                float kt[128], want[128];
                for (int t = 0; t < n; t++) {
                    for (int j = 0; j < d; j++) kt[j] = c.k[(size_t)t * d + j] - (vanilla ? 0.0f : c.mu[j]);
                    if (!vanilla) assert_int_equal(fr_hadamard(kt, d), FR_OK);
                    if (t >= sink && t < end) {
                        assert_int_equal(fr_fp4_fake_quantize(f, !vanilla, kt, d, want), FR_OK);
                    } else {
                        for (int j = 0; j < d; j++) want[j] = fr_bf16_round(kt[j]);
                    }
                    assert_memory_equal(c.ks + (size_t)t * d, want, sizeof want);
                }
                /* Values: blocks of B along tokens from token 0 in the pages (a partial
                 * last block padded with zeros), BF16 for sink and recent tokens. */
                float col[32], deq[32];
                for (int a = 0; a < end; a += B)
                    for (int j = 0; j < d; j++) {
                        /* the sink's masked page copy is quantized as zeros */
                        for (int i = 0; i < B; i++)
                            col[i] = a + i < end && a + i >= sink ? c.v[(size_t)(a + i) * d + j] : 0.0f;
                        assert_int_equal(fr_fp4_fake_quantize(f, 0, col, B, deq), FR_OK);
                        for (int i = 0; i < B && a + i < end; i++)
                            if (a + i >= sink) assert_true(c.vs[(size_t)(a + i) * d + j] == deq[i]);
                    }
                for (int t = 0; t < n; t++)
                    if (t < sink || t >= end)
                        for (int j = 0; j < d; j++)
                            assert_true(c.vs[(size_t)t * d + j] == fr_bf16_round(c.v[(size_t)t * d + j]));
                /* The query is rotated like the keys (and not shifted). */
                for (int h = 0; h < 2; h++) {
                    memcpy(kt, c.q + h * d, sizeof kt);
                    if (!vanilla) fr_hadamard(kt, d);
                    assert_memory_equal(c.qs + h * d, kt, sizeof kt);
                }
                /* Fewer than 128 tokens with the sink/recent recipe: no page, every
                 * token BF16, so even exact mode is plain attention on the view. */
                if (!vanilla && n < 128) {
                    float o[2 * 128], lse[2];
                    double on[2 * 128], lsen[2];
                    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 3, o, lse), FR_OK);
                    naive_attention(2, d, n, c.qs, c.ks, c.vs, on, lsen);
                    assert_true(rel_err_fd(o, on, 2 * d) < 1e-6);
                }
                cache_free(&c);
            }
}

/* ---- split plan ------------------------------------------------------------------ */

static void test_split_plan_covers_once(void **state)
{
    (void)state;
    const int Ns[] = {1, 15, 16, 17, 100, 128, 129, 255, 256, 300, 1000, 1024};
    const int tiles[] = {32, 64, 128, 256};
    int *count = malloc(sizeof(int) * 1024);
    assert_non_null(count);
    for (int ni = 0; ni < 12; ni++)
        for (int layout = 0; layout < 3; layout++) {
            int n = Ns[ni];
            fr_kv_view kv = {.n_tokens = n};
            if (layout == 1) { kv.n_sink = n < 16 ? n : 16; kv.fp4_end = n / 128 * 128; }   /* sink/recent */
            if (layout == 2) kv.fp4_end = n;                                               /* vanilla */
            for (int ti = 0; ti < 4; ti++)
                for (int ns = 1; ns <= 9; ns++) {
                    memset(count, 0, sizeof(int) * (size_t)n);
                    int prev_t1 = 0;
                    for (int i = 0; i <= ns; i++) {
                        int t0, t1, x0, x1;
                        fr_ref_split_range(&kv, tiles[ti], ns, i, &t0, &t1, &x0, &x1);
                        assert_true(0 <= t0 && t0 <= t1 && t1 <= n);
                        assert_int_equal(t0 % tiles[ti], 0);
                        if (i < ns) {   /* quantized splits: consecutive, inside the pages */
                            assert_true(t1 <= kv.fp4_end);
                            if (t1 > t0) assert_int_equal(t0, prev_t1);
                            if (t1 > t0) prev_t1 = t1;
                        }
                        for (int t = t0; t < t1; t++) {
                            if (t >= x0 && t < x1) continue;
                            int paged = t >= kv.n_sink && t < kv.fp4_end;
                            /* quantized tokens only in quantized splits, and vice versa */
                            assert_int_equal(paged, i < ns);
                            count[t]++;
                        }
                    }
                    for (int t = 0; t < n; t++)
                        if (count[t] != 1)
                            fail_msg("N=%d layout=%d tile=%d splits=%d: token %d covered %d times",
                                     n, layout, tiles[ti], ns, t, count[t]);
                }
        }
    free(count);
}

static void test_combine(void **state)
{
    (void)state;
    /* Two heads, d = 2: part 0 (lse 0), part 1 (lse 1), part 2 empty (-inf). */
    const float op[3 * 2 * 2] = {1, 2, 5, 5, /**/ 4, 8, 7, 7, /**/ 0, 0, 0, 0};
    const float lp[3 * 2] = {0.0f, 3.0f, 1.0f, 3.0f, -INFINITY, -INFINITY};
    float o[4], lse[2];
    assert_int_equal(fr_ref_attn_combine(3, 2, 2, op, lp, o, lse), FR_OK);
    assert_true(fabsf(o[0] - 3.0f) < 1e-6f && fabsf(o[1] - 6.0f) < 1e-6f);   /* 1/3, 2/3 */
    assert_true(fabsf(o[2] - 6.0f) < 1e-6f && fabsf(o[3] - 6.0f) < 1e-6f);   /* 1/2, 1/2 */
    assert_true(fabsf(lse[0] - log2f(3.0f)) < 1e-6f && fabsf(lse[1] - 4.0f) < 1e-6f);
    const float none[2] = {-INFINITY, -INFINITY};
    assert_int_equal(fr_ref_attn_combine(1, 2, 2, op, none, o, lse), FR_OK);
    assert_true(o[0] == 0.0f && o[3] == 0.0f && isinf(lse[0]) && lse[0] < 0 && isinf(lse[1]));
    assert_int_equal(fr_ref_attn_combine(0, 2, 2, op, lp, o, lse), FR_EINVAL);
    assert_true(strlen(fr_last_error()) > 0);
}

/* ---- split-KV in every mode --------------------------------------------------------- */

typedef struct { const char *name; fr_kv_dtype t; int compute_bf16; const char *recipe; int exact; } mode;
static const mode modes[] = {
    {"bf16", FR_KV_BF16, 0, "full", 0},
    {"fp8", FR_KV_FP8, 0, "full", 0},
    {"nvfp4 exact", FR_KV_NVFP4, 0, "full", 1},
    {"nvfp4 bf16-compute", FR_KV_NVFP4, 1, "full", 0},
    {"mxfp4 exact", FR_KV_MXFP4, 0, "full", 1},
    {"mxfp4 bf16-compute", FR_KV_MXFP4, 1, "full", 0},
    {"nvfp4 vanilla", FR_KV_NVFP4, 0, "vanilla", 1},
    {"nvfp4 single-q", FR_KV_NVFP4, 0, "full,-dual", 1},
    {"nvfp4 plain-P", FR_KV_NVFP4, 0, "full,-pscale", 1},
};
enum { N_MODES = sizeof modes / sizeof modes[0] };

static fr_ref_config mode_config(const mode *m)
{
    fr_ref_config cfg = fr_ref_config_default(m->t);
    if (m->compute_bf16) cfg.compute = FR_COMPUTE_BF16;
    assert_int_equal(fr_recipe_parse(m->recipe, &cfg.recipe), FR_OK);
    if (m->t == FR_KV_FP8) { cfg.fp8_k_scale = 0.1f; cfg.fp8_v_scale = 0.02f; }
    return cfg;
}

/* The plan, partial by partial, then the combine: what fr_ref_attn_decode must do. */
static void manual_decode(const cache *c, int ns, float *o, float *lse)
{
    int G = c->G, d = c->d;
    float *op = alloc_f((size_t)(ns + 1) * G * d), *lp = alloc_f((size_t)(ns + 1) * G);
    for (int i = 0; i <= ns; i++) {
        int t0, t1, x0, x1;
        fr_ref_split_range(&c->view, c->p.tile, ns, i, &t0, &t1, &x0, &x1);
        assert_int_equal(fr_ref_attn_partial(&c->p, c->qs, &c->view, t0, t1, x0, x1, i < ns,
                                             op + (size_t)i * G * d, lp + (size_t)i * G), FR_OK);
    }
    assert_int_equal(fr_ref_attn_combine(ns + 1, G, d, op, lp, o, lse), FR_OK);
    free(op); free(lp);
}

static void test_split_kv_every_mode(void **state)
{
    (void)state;
    const int G = 4, d = 128;
    const int splits[] = {1, 2, 3, 8};
    const int Ns[] = {300, 1000};
    for (int mi = 0; mi < N_MODES; mi++)
        for (int ni = 0; ni < 2; ni++) {
            const mode *m = &modes[mi];
            fr_ref_config cfg = mode_config(m);
            cache c;
            cache_init(&c, &cfg, Ns[ni], d, G, (unsigned)(500 + mi));
            cache_prepare(&c);
            float o1[4 * 128], lse1[4], o[4 * 128], lse[4], om[4 * 128], lsem[4];
            assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 1, o1, lse1), FR_OK);
            double worst = 0.0;
            for (int si = 0; si < 4; si++) {
                int ns = splits[si];
                assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, ns, o, lse), FR_OK);
                manual_decode(&c, ns, om, lsem);
                assert_memory_equal(o, om, sizeof o);       /* same plan, same partials */
                assert_memory_equal(lse, lsem, sizeof lse);
                double e = rel_err_ff(o, o1, G * d);
                if (e > worst) worst = e;
                if (m->exact) {
                    /* P is quantized against the running maximum, which depends on
                     * where a split starts: small legitimate differences. */
                    if (e > 1e-2) fail_msg("%s N=%d: %d splits differ from 1 by %.3g", m->name, Ns[ni], ns, e);
                } else {
                    if (e > 1e-5) fail_msg("%s N=%d: %d splits differ from 1 by %.3g", m->name, Ns[ni], ns, e);
                    for (int h = 0; h < G; h++) assert_true(fabsf(lse[h] - lse1[h]) < 1e-5f);
                }
            }
            if (!fr_kv_dtype_is_fp4(m->t)) {
                /* The plan keeps every token of a BF16/FP8 cache in its one unquantized
                 * split; declare them all "pages" to make decode really split them. */
                fr_kv_view all = c.view;
                all.fp4_end = c.n;
                for (int si = 0; si < 4; si++) {
                    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &all, splits[si], o, lse), FR_OK);
                    double e = rel_err_ff(o, o1, G * d);
                    if (e > 1e-5) fail_msg("%s N=%d: %d real splits differ from 1 by %.3g", m->name, Ns[ni], splits[si], e);
                    if (e > worst) worst = e;
                }
            }
            if (!m->exact) {
                /* Unquantized compute is plain softmax attention over the stored view. */
                double on[4 * 128], lsen[4];
                naive_attention(G, d, c.n, c.qs, c.ks, c.vs, on, lsen);
                double e = rel_err_fd(o1, on, G * d);
                if (e > 1e-6) fail_msg("%s N=%d: differs from naive attention by %.3g", m->name, Ns[ni], e);
                for (int h = 0; h < G; h++) assert_true(fabs(lse1[h] - lsen[h]) <= 1e-6 * fmax(1.0, fabs(lsen[h])));
            }
            printf("    %-20s N=%4d: splits {2,3,8} vs 1: worst relative difference %.2g\n", m->name, Ns[ni], worst);
            cache_free(&c);
        }
}

/* ---- an exact-mode tile, step by step ------------------------------------------------ */

/* Algorithm 1 lines 3-17 for a split of a single tile (so the running maximum
 * is the tile maximum), written out from the paper. */
static void naive_exact_tile(const fr_attn_params *p, const float *q, const fr_kv_view *kv, int t0,
                             int t1, int x0, int x1, double *o, double *lse)
{
    const int d = p->head_dim, B = fr_fp4_block_size(p->fmt), n = t1 - t0;
    const float gamma = (float)(M_LOG2E / sqrt((double)d));
    const float log2c = log2f(p->p.c);
    float q1[256], q2[256], S[256], P[256], blk[32], deq[32];
    assert_true(n <= 256 && d <= 256);
    for (int h = 0; h < p->group; h++) {
        const float *qh = q + h * d;
        if (p->q_mode == FR_Q_DUAL) {
            assert_int_equal(fr_fp4_quantize_dual(p->fmt, p->q_search, qh, d, q1, q2), FR_OK);
        } else {
            assert_int_equal(fr_fp4_fake_quantize(p->fmt, p->q_search, qh, d, q1), FR_OK);
            memset(q2, 0, sizeof q2);
        }
        float m = -INFINITY;
        for (int i = 0; i < n; i++) {
            int t = t0 + i;
            const float *k = kv->k + (size_t)t * d;
            S[i] = (t >= x0 && t < x1) ? -INFINITY : gamma * ((float)dotd(q1, k, d) + (float)dotd(q2, k, d));
            m = fmaxf(m, S[i]);
        }
        double l = 0.0;
        for (int i = 0; i < n; i++) {
            P[i] = S[i] == -INFINITY ? 0.0f : exp2f(S[i] - m + log2c);
            l += P[i];
        }
        for (int i0 = 0; i0 < n; i0 += B) {
            float bm = -INFINITY;
            for (int j = 0; j < B; j++) {
                blk[j] = i0 + j < n ? P[i0 + j] : 0.0f;
                if (i0 + j < n) bm = fmaxf(bm, S[i0 + j]);
            }
            fr_pquant_block(p->fmt, &p->p, blk, bm == -INFINITY ? 0.0f : exp2f(bm - m), deq);
            for (int j = 0; j < B && i0 + j < n; j++) P[i0 + j] = deq[j];
        }
        for (int j = 0; j < d; j++) {
            double s = 0.0;
            for (int i = 0; i < n; i++) s += (double)P[i] * kv->v[(size_t)(t0 + i) * d + j];
            o[h * d + j] = s / l;
        }
        lse[h] = m + log2(l) - log2c;
    }
}

static void test_exact_tile_step_by_step(void **state)
{
    (void)state;
    const int G = 3, d = 128, n = 1000;
    for (int mi = 0; mi < N_MODES; mi++) {
        const mode *m = &modes[mi];
        if (!m->exact) continue;
        fr_ref_config cfg = mode_config(m);
        cache c;
        cache_init(&c, &cfg, n, d, G, (unsigned)(700 + mi));
        cache_prepare(&c);
        int tiles = (c.view.fp4_end + c.p.tile - 1) / c.p.tile;   /* one tile per split */
        float o[3 * 128], lse[3];
        double on[3 * 128], lsen[3];
        int nonzero_lse = 0;
        for (int i = 0; i < tiles; i++) {
            int t0, t1, x0, x1;
            fr_ref_split_range(&c.view, c.p.tile, tiles, i, &t0, &t1, &x0, &x1);
            assert_true(t1 - t0 <= c.p.tile);
            assert_int_equal(fr_ref_attn_partial(&c.p, c.qs, &c.view, t0, t1, x0, x1, 1, o, lse), FR_OK);
            naive_exact_tile(&c.p, c.qs, &c.view, t0, t1, x0, x1, on, lsen);
            double e = rel_err_fd(o, on, G * d);
            if (e > 1e-6) fail_msg("%s split %d: exact partial differs from Algorithm 1 by %.3g", m->name, i, e);
            for (int h = 0; h < G; h++) {
                assert_true(fabs(lse[h] - lsen[h]) <= 1e-6 * fmax(1.0, fabs(lsen[h])));
                nonzero_lse += isfinite(lse[h]);
            }
        }
        assert_true(nonzero_lse > 0);
        cache_free(&c);
    }
}

/* ---- accuracy against BF16 ------------------------------------------------------------ */

static void test_fp4_close_to_bf16(void **state)
{
    (void)state;
    /* Output relative error against BF16 KV, averaged over several caches and
     * 8 query heads each (one head's error depends a lot on its top tokens). */
    enum { G = 8, D = 128, N = 1000, SEEDS = 4 };
    float ob[G * D], o[G * D], lse[G];
    double err[N_MODES] = {0};
    for (int sd = 0; sd < SEEDS; sd++)
        for (int mi = 0; mi < N_MODES; mi++) {
            fr_ref_config cfg = mode_config(&modes[mi]);
            cache c;
            cache_init(&c, &cfg, N, D, G, (unsigned)(900 + sd));   /* same raw data for every mode */
            cache_prepare(&c);
            assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 4, mi == 0 ? ob : o, lse), FR_OK);
            if (mi > 0) err[mi] += rel_err_ff(o, ob, G * D) / SEEDS;
            cache_free(&c);
        }
    printf("    relative error vs BF16 KV:");
    for (int mi = 1; mi < N_MODES; mi++) printf(" %s %.4f%s", modes[mi].name, err[mi], mi + 1 < N_MODES ? "," : "\n");
    assert_true(err[1] < 0.01);                         /* fp8 */
    assert_true(err[2] < 0.1 && err[4] < 0.1);          /* nvfp4, mxfp4 exact */
    assert_true(err[3] < 0.1 && err[5] < 0.1);          /* bf16-compute */
    assert_true(err[3] < err[2] && err[5] < err[4]);    /* quantized q and P cost something */
    assert_true(err[3] < err[6]);                       /* nvfp4 bf16-compute beats vanilla */
    assert_true(err[2] < err[6]);                       /* and so does the full exact recipe */
}

/* ---- sink masking ----------------------------------------------------------------------- */

static void test_sink_masked(void **state)
{
    (void)state;
    const int G = 2, d = 128, n = 300;
    for (int compute = 0; compute < 2; compute++)
        for (int fmt = 0; fmt < 2; fmt++) {
            fr_ref_config cfg = fr_ref_config_default(fmt ? FR_KV_MXFP4 : FR_KV_NVFP4);
            cfg.compute = compute ? FR_COMPUTE_BF16 : FR_COMPUTE_EXACT;
            cache c;
            cache_init(&c, &cfg, n, d, G, 1234);
            /* Token 0: a key along both queries (a dominant logit) and a huge value. */
            for (int j = 0; j < d; j++) {
                c.k[j] = c.mu[j] + 4.0f * (c.q[j] + c.q[d + j]);
                c.v[j] = 300.0f + 50.0f * c.v[j];
            }
            cache_prepare(&c);
            assert_int_equal(c.view.n_sink, 16);
            assert_int_equal(c.view.fp4_end, 256);
            /* The stored token 0 is the BF16 one. */
            float kt[128];
            for (int j = 0; j < d; j++) kt[j] = c.k[j] - c.mu[j];
            fr_hadamard(kt, d);
            for (int j = 0; j < d; j++) {
                assert_true(c.ks[j] == fr_bf16_round(kt[j]));
                assert_true(c.vs[j] == fr_bf16_round(c.v[j]));
            }
            float o[2 * 128], lse[2], om[2 * 128], lsem[2];
            double on[2 * 128], lsen[2];
            assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 2, o, lse), FR_OK);
            naive_attention(G, d, n, c.qs, c.ks, c.vs, on, lsen);
            double e = rel_err_fd(o, on, G * d);
            /* Token 0 dominates and is counted once, with its BF16 value. */
            for (int h = 0; h < G; h++) {
                double s0 = M_LOG2E / sqrt((double)d) * dotd(c.qs + h * d, c.ks, d);
                assert_true(exp2(s0 - lsen[h]) > 0.9);   /* token 0 takes most of the softmax */
            }
            if (e > (compute ? 1e-6 : 1e-2))
                fail_msg("%s compute=%s: %.3g from naive attention", fr_kv_dtype_name(cfg.kv_dtype),
                         compute ? "bf16" : "exact", e);
            /* Without the mask the sink would count twice: far off. */
            const int ns = 2;
            float *op = alloc_f((size_t)(ns + 1) * G * d), *lp = alloc_f((size_t)(ns + 1) * G);
            for (int i = 0; i <= ns; i++) {
                int t0, t1, x0, x1;
                fr_ref_split_range(&c.view, c.p.tile, ns, i, &t0, &t1, &x0, &x1);
                if (i < ns) { assert_int_equal(x0, 0); assert_int_equal(x1, 16); x1 = 0; }
                assert_int_equal(fr_ref_attn_partial(&c.p, c.qs, &c.view, t0, t1, x0, x1, i < ns,
                                                     op + (size_t)i * G * d, lp + (size_t)i * G), FR_OK);
            }
            assert_int_equal(fr_ref_attn_combine(ns + 1, G, d, op, lp, om, lsem), FR_OK);
            for (int h = 0; h < G; h++) assert_true(lsem[h] > lsen[h] + 0.5);   /* about double the mass */
            free(op); free(lp);
            cache_free(&c);
        }
}

/* ---- P against the row's final maximum (the rowmax analysis switch) ---------------------- */

/* One dominant key at token `at`, one split over two full pages: with the
 * key inside the first FP4 tile the running maximum is the row maximum from
 * the start, so both ways agree to float rounding (the BF16 sink split
 * exponentiates against a different reference); with it in the BF16 sink, rowmax quantizes every FP4 block
 * against a larger maximum (more underflow) and the output moves. */
static void test_row_max(void **state)
{
    (void)state;
    const int G = 2, d = 128, n = 256;   /* two full FP4 pages, nothing recent */
    const int ats[2] = {20, 0};
    for (int w = 0; w < 2; w++) {
        fr_ref_config cfg = fr_ref_config_default(FR_KV_NVFP4);
        cache c;
        cache_init(&c, &cfg, n, d, G, 77);
        float *k = c.k + (size_t)ats[w] * d;
        for (int j = 0; j < d; j++) k[j] = c.mu[j] + 4.0f * (c.q[j] + c.q[d + j]);
        cache_prepare(&c);
        float o1[2 * 128], l1[2], o2[2 * 128], l2[2];
        assert_int_equal(c.view.fp4_end, 256);
        assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 1, o1, l1), FR_OK);
        fr_attn_params pr = c.p;
        pr.p_row_max = 1;
        assert_int_equal(fr_ref_attn_decode(&pr, c.qs, &c.view, 1, o2, l2), FR_OK);
        const double e = rel_err_ff(o2, o1, G * d);
        printf("    dominant key at token %d: rowmax moves the output by %.3g (relative)\n", ats[w], e);
        if (w == 0) assert_true(e < 1e-6);   /* the sink split's float rounding only */
        else assert_true(e > 1e-4);
        cache_free(&c);
    }
}

/* ---- bad arguments ----------------------------------------------------------------------- */

static void test_bad_arguments(void **state)
{
    (void)state;
    fr_ref_config cfg = fr_ref_config_default(FR_KV_NVFP4);
    cache c;
    cache_init(&c, &cfg, 200, 128, 4, 99);
    cache_prepare(&c);
    float o[16 * 256], lse[16];
    struct { int tile, group, head_dim; const char *msg; } bad[] = {
        {48, 4, 128, "tile 48"}, {0, 4, 128, "tile 0"}, {-32, 4, 128, "tile -32"},
        {128, 17, 128, "group 17"}, {128, 0, 128, "group 0"},
        {128, 4, 300, "head_dim 300"}, {128, 4, 0, "head_dim 0"}, {128, 4, 72, "head_dim 72"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fr_attn_params p = c.p;
        p.tile = bad[i].tile; p.group = bad[i].group; p.head_dim = bad[i].head_dim;
        assert_int_equal(fr_ref_attn_decode(&p, c.qs, &c.view, 1, o, lse), FR_EINVAL);
        if (!strstr(fr_last_error(), bad[i].msg)) fail_msg("message '%s' lacks '%s'", fr_last_error(), bad[i].msg);
        assert_int_equal(fr_ref_attn_partial(&p, c.qs, &c.view, 0, 128, 0, 0, 1, o, lse), FR_EINVAL);
    }
    fr_attn_params p = c.p;
    p.p = fr_pquant_plain();
    p.p.c = 8.0f;
    assert_int_equal(fr_ref_attn_decode(&p, c.qs, &c.view, 1, o, lse), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "c = 1"));
    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &c.view, 0, o, lse), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "n_splits 0"));
    fr_kv_view v = c.view;
    v.fp4_end = 201;
    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &v, 1, o, lse), FR_EINVAL);
    assert_true(strlen(fr_last_error()) > 0);
    v = c.view; v.n_tokens = 0;
    assert_int_equal(fr_ref_attn_decode(&c.p, c.qs, &v, 1, o, lse), FR_EINVAL);
    assert_int_equal(fr_ref_attn_partial(&c.p, c.qs, &c.view, 64, 128, 0, 0, 1, o, lse), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "split [64, 128)"));
    assert_int_equal(fr_ref_attn_partial(&c.p, c.qs, &c.view, 128, 300, 0, 0, 1, o, lse), FR_EINVAL);
    assert_int_equal(fr_ref_attn_partial(&c.p, NULL, &c.view, 0, 128, 0, 0, 1, o, lse), FR_EINVAL);
    /* An empty split: o = 0, lse = -inf. */
    assert_int_equal(fr_ref_attn_partial(&c.p, c.qs, &c.view, 128, 128, 0, 0, 1, o, lse), FR_OK);
    assert_true(o[0] == 0.0f && isinf(lse[0]) && lse[0] < 0);

    float *ks = alloc_f(200 * 300), *vs = alloc_f(200 * 300), *raw = alloc_f(200 * 300);
    fr_kv_view view;
    assert_int_equal(fr_ref_prepare_kv(&cfg, 300, 200, raw, raw, NULL, ks, vs, &view), FR_EINVAL);
    assert_int_equal(fr_ref_prepare_kv(&cfg, 24, 200, raw, raw, NULL, ks, vs, &view), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "head_dim 24"));
    assert_int_equal(fr_ref_prepare_kv(&cfg, 48, 200, raw, raw, NULL, ks, vs, &view), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "power-of-two"));
    assert_int_equal(fr_ref_prepare_kv(&cfg, 128, 0, raw, raw, NULL, ks, vs, &view), FR_EINVAL);
    assert_int_equal(fr_ref_prepare_kv(&cfg, 128, 10, NULL, raw, NULL, ks, vs, &view), FR_EINVAL);
    assert_int_equal(fr_ref_prepare_query(&cfg, 128, 4, NULL, ks), FR_EINVAL);
    assert_int_equal(fr_ref_prepare_query(&cfg, 96, 1, raw, ks), FR_EINVAL);   /* rotation needs 2^k */
    cfg.recipe.rotate = 0;   /* without rotation 48 is a fine NVFP4 head_dim */
    assert_int_equal(fr_ref_prepare_kv(&cfg, 48, 200, raw, raw, NULL, ks, vs, &view), FR_OK);
    free(ks); free(vs); free(raw);
    cache_free(&c);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_numerics_parsing),
             cmocka_unit_test(test_config_to_params),
             cmocka_unit_test(test_bf16_equals_naive),
             cmocka_unit_test(test_fp8_storage),
             cmocka_unit_test(test_regions_and_storage),
             cmocka_unit_test(test_split_plan_covers_once),
             cmocka_unit_test(test_combine),
             cmocka_unit_test(test_split_kv_every_mode),
             cmocka_unit_test(test_exact_tile_step_by_step),
             cmocka_unit_test(test_fp4_close_to_bf16),
             cmocka_unit_test(test_sink_masked),
             cmocka_unit_test(test_row_max),
             cmocka_unit_test(test_bad_arguments))
