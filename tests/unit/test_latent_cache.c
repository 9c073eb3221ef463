/* Latent caches (kvcache/kv_cache.h, multi-head latent attention, paper
 * Appendix G): the latent page layout, the FP4 latent round trip against a
 * direct float computation made here (an explicit Hadamard matrix in double,
 * the NVFP4 / MXFP4 scale search written out from the format definition),
 * the FP8, BF16 and f32 latent pages, the views' regions, forks, the
 * configuration errors, and the latent attention's undoing of the store
 * form (rollout/model/mla_cpu.h) against a direct double computation.
 * Model-free: small random rows. */
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
#include "attention/microscale.h"
#include "kvcache/kv_cache.h"
#include "kvcache/page_layout.h"
#include "rollout/model/mla_cpu.h"
#include "test_util.h"

enum { T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS, NL = 2, DC = 64, DR = 16, D = DC + DR, N = 300 };

/* ---- direct computations ---- */

/* y = H x / sqrt(n) with H_ij = (-1)^popcount(i & j), in double. */
static void hadamard_direct(const double *x, int n, double *y)
{
    for (int i = 0; i < n; i++) {
        double s = 0.0;
        for (int j = 0; j < n; j++) s += (__builtin_popcount((unsigned)(i & j)) & 1) ? -x[j] : x[j];
        y[i] = s / sqrt((double)n);
    }
}

/* Nearest E2M1 value of x (saturating at 6), ties to the even code. */
static double e2m1_nearest(double x)
{
    static const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    double a = fabs(x);
    int best = 0;
    for (int k = 1; k < 8; k++) {
        double dk = fabs(a - grid[k]), db = fabs(a - grid[best]);
        if (dk < db || (dk == db && k % 2 == 0)) best = k;
    }
    return x < 0 ? -grid[best] : grid[best];
}

/* One block with the scale search: the candidate scales of the format
 * (NVFP4: E4M3 of amax/6 and amax/4; MXFP4: 2^(floor(log2 amax) - 2) and
 * twice it), the lower squared error wins, ties to the first. */
static void fp4_block_direct(fr_fp4_format f, int search, const float *x, int B, double *out)
{
    double amax = 0.0;
    for (int i = 0; i < B; i++) amax = fmax(amax, fabs(x[i]));
    double cand[2];
    if (f == FR_NVFP4) {
        cand[0] = fr_e4m3_round((float)(amax / 6.0));
        cand[1] = fr_e4m3_round((float)(amax / 4.0));
    } else {
        double e = amax > 0 ? floor(log2(amax)) : 0;
        cand[0] = ldexp(1.0, (int)e - 2);
        cand[1] = ldexp(1.0, (int)e - 1);
    }
    double best_err = INFINITY;
    for (int c = 0; c < (search ? 2 : 1); c++) {
        double q[FR_MAX_FP4_BLOCK], err = 0.0, s = cand[c];
        for (int i = 0; i < B; i++) {
            q[i] = s > 0 ? s * e2m1_nearest((float)(x[i] / (float)s)) : 0.0;
            err += (q[i] - x[i]) * (q[i] - x[i]);
        }
        if (err < best_err) {
            best_err = err;
            memcpy(out, q, sizeof(double) * (size_t)B);
        }
    }
}

/* ---- cases ---- */

typedef struct {
    float mean[NL * D];
    float fp8[NL * 2];
    float rows[NL][N][D];       /* raw rows: latent then RoPE key */
    fr_kv_cache_config cfg;
} lcase;

static void lc_init(lcase *lc, fr_kv_dtype dt, const char *recipe, uint64_t seed)
{
    memset(lc, 0, sizeof *lc);
    fr_test_rng g = {seed};
    for (int i = 0; i < NL * D; i++) lc->mean[i] = 0.3f * fr_test_normal(&g) + 0.2f;
    for (int l = 0; l < NL; l++) {
        lc->fp8[2 * l] = 0.01f + 0.005f * (float)l;
        lc->fp8[2 * l + 1] = 1.0f;
        for (int t = 0; t < N; t++) {
            float s = expf(0.5f * fr_test_normal(&g));
            for (int j = 0; j < D; j++) lc->rows[l][t][j] = s * fr_test_normal(&g) * (j % 29 == 3 ? 5.0f : 1.0f);
        }
    }
    fr_recipe r;
    assert_int_equal(fr_recipe_parse(recipe, &r), FR_OK);
    lc->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = 1, .head_dim = D, .latent_dim = DC, .dtype = dt,
                                   .compute = FR_COMPUTE_EXACT, .recipe = r, .tau = FR_P_TAU, .n_blocks = 8,
                                   .max_seqs = 2, .key_mean = lc->mean, .fp8_scales = lc->fp8};
}

static fr_kv_cache *lc_cache(const lcase *lc)
{
    fr_kv_cache *c = NULL;
    fr_status st = fr_kv_cache_new(&lc->cfg, &c);
    if (st) fprintf(stderr, "fr_kv_cache_new: %s\n", fr_last_error());
    assert_int_equal(st, FR_OK);
    return c;
}

/* Appends token t of every layer. */
static void append_token(fr_kv_cache *c, const lcase *lc, int seq, int t)
{
    float k[NL][D];
    for (int l = 0; l < NL; l++) memcpy(k[l], lc->rows[l][t], sizeof k[l]);
    assert_int_equal(fr_kv_reserve(c, seq, 1), FR_OK);
    assert_int_equal(fr_kv_append(c, seq, 1, &k[0][0], NULL, D), FR_OK);
}

static void gather(const fr_kv_cache *c, int seq, int l, float *out, fr_kv_view *v)
{
    assert_int_equal(fr_kv_gather(c, seq, l, 0, 0, NULL, NULL, out, NULL, v), FR_OK);
    assert_ptr_equal(v->v, v->k);   /* no values: the rows are both */
}

/* The store form of raw row x of layer l, directly: FP4 with the full
 * recipe: latent minus the mean, rotated, both in double, then BF16. */
static void store_direct(const lcase *lc, int l, const float *x, double *out)
{
    const int fp4 = fr_kv_dtype_is_fp4(lc->cfg.dtype);
    double c[DC];
    for (int j = 0; j < DC; j++) c[j] = (double)x[j] - (fp4 && lc->cfg.recipe.smooth ? lc->mean[l * D + j] : 0.0);
    if (fp4 && lc->cfg.recipe.rotate) hadamard_direct(c, DC, out);
    else memcpy(out, c, sizeof c);
    for (int j = 0; j < DC; j++) out[j] = (float)out[j];
    for (int j = DC; j < D; j++) out[j] = x[j];
}

/* ---- tests ---- */

static void test_layout(void **state)
{
    (void)state;
    /* DeepSeek-V3's row: 512 latent + 64 RoPE; the bytes per token. */
    const struct { fr_kv_dtype dt; size_t per_token, rope; } want[] = {
        {FR_KV_NVFP4, 256 + 32 + 128, 256 + 32}, {FR_KV_MXFP4, 256 + 16 + 128, 256 + 16},
        {FR_KV_FP8, 512 + 128, 512}, {FR_KV_BF16, 1152, 1024}, {FR_KV_F32, 2304, 2048}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        fr_page_layout l = fr_page_layout_latent(want[i].dt, 512, 64);
        assert_int_equal(l.head_page_bytes, T * want[i].per_token);
        assert_int_equal(l.rope, T * want[i].rope);
        assert_int_equal(l.k_codes, 0);
        assert_int_equal(l.v_codes, l.rope);   /* no V half */
        assert_int_equal(l.v_scales, l.rope);
    }
    fr_page_layout nv = fr_page_layout_latent(FR_KV_NVFP4, 512, 64);
    assert_int_equal(nv.k_scales, T * 256);
}

/* FP4 pages hold the direct quantization of each token's BF16 store form,
 * read from the recent slot just before the page is promoted; the slots
 * hold the direct store form to BF16 precision; the RoPE part is BF16 on
 * the page, byte for byte. */
static void fp4_round_trip(fr_kv_dtype dt, const char *recipe)
{
    lcase *lc = malloc(sizeof *lc);
    assert_non_null(lc);
    lc_init(lc, dt, recipe, 11 + (uint64_t)dt);
    fr_kv_cache *c = lc_cache(lc);
    const fr_fp4_format f = fr_kv_dtype_fp4_format(dt);
    const int B = fr_fp4_block_size(f), search = lc->cfg.recipe.scale_search;
    float *buf = malloc(sizeof(float) * N * D), *before = malloc(sizeof(float) * NL * T * D);
    assert_non_null(buf);
    assert_non_null(before);
    int seq;
    assert_int_equal(fr_kv_seq_new(c, &seq), FR_OK);
    fr_kv_view v;
    long checked = 0;
    for (int t = 0; t < N; t++) {
        if (t % T == T - 1)   /* the page's rows in BF16 store form, before promotion; the */
            for (int l = 0; l < NL; l++) {   /* last one as a step token (transformed, not rounded) */
                assert_int_equal(fr_kv_gather(c, seq, l, 0, 1, lc->rows[l][t], NULL, buf, NULL, &v), FR_OK);
                for (int j = 0; j < D; j++) buf[(size_t)t * D + j] = fr_bf16_round(buf[(size_t)t * D + j]);
                memcpy(before + (size_t)l * T * D, buf + (size_t)(t / T) * T * D, sizeof(float) * T * D);
            }
        append_token(c, lc, seq, t);
        if (t % T == T - 1) {
            const int p = t / T;
            const uint8_t *page = fr_kv_page(c, seq, p);
            assert_non_null(page);
            const fr_page_layout *lay = fr_kv_layout(c);
            for (int l = 0; l < NL; l++) {
                gather(c, seq, l, buf, &v);
                const uint8_t *hp = page + (size_t)l * lay->head_page_bytes;
                for (int i = 0; i < T; i++) {
                    const float *pre = before + ((size_t)l * T + i) * D;
                    const float *got = buf + ((size_t)p * T + i) * D;
                    const int tok = p * T + i;
                    for (int j = DC; j < D; j++) {   /* RoPE: BF16 of the raw value, on the page */
                        uint16_t bits;
                        memcpy(&bits, hp + lay->rope + ((size_t)i * DR + (j - DC)) * 2, 2);
                        assert_int_equal(bits, fr_bf16_encode(lc->rows[l][tok][j]));
                        assert_true(got[j] == fr_bf16_round(lc->rows[l][tok][j]));
                    }
                    if (tok < SINK && lc->cfg.recipe.sink_recent) continue;   /* read from the sink */
                    for (int b = 0; b < DC / B; b++) {
                        double q[FR_MAX_FP4_BLOCK];
                        fp4_block_direct(f, search, pre + b * B, B, q);
                        for (int j = 0; j < B; j++) {
                            if (got[b * B + j] != (float)q[j])
                                fprintf(stderr, "layer %d token %d channel %d: page %g, direct %g\n", l, tok,
                                        b * B + j, got[b * B + j], q[j]);
                            assert_true(got[b * B + j] == (float)q[j]);
                            checked++;
                        }
                    }
                }
            }
        }
    }
    /* Regions, and the slots (sink, recent) against the direct store form. */
    for (int l = 0; l < NL; l++) {
        gather(c, seq, l, buf, &v);
        assert_int_equal(v.n_tokens, N);
        if (lc->cfg.recipe.sink_recent) {
            assert_int_equal(v.n_sink, SINK);
            assert_int_equal(v.fp4_end, N / T * T);
        } else {
            assert_int_equal(v.fp4_end, N);
        }
        for (int t = 0; t < N; t++) {
            int slot = lc->cfg.recipe.sink_recent && (t < SINK || t >= N / T * T);
            if (!slot) continue;
            double s[D];
            store_direct(lc, l, lc->rows[l][t], s);
            for (int j = 0; j < D; j++) {
                float g = buf[(size_t)t * D + j];
                assert_true(fabs(g - s[j]) <= 1.0 / 128 * fabs(s[j]) + 1e-6);   /* BF16 of s */
            }
        }
    }
    assert_true(checked > 0);
    printf("  %s %s: %ld page elements equal the direct computation\n", fr_kv_dtype_name(dt), recipe, checked);
    fr_kv_cache_destroy(&c);
    free(buf); free(before); free(lc);
}

static void test_nvfp4_round_trip(void **state) { (void)state; fp4_round_trip(FR_KV_NVFP4, "full"); }
static void test_mxfp4_round_trip(void **state) { (void)state; fp4_round_trip(FR_KV_MXFP4, "full"); }
static void test_nvfp4_no_search_round_trip(void **state) { (void)state; fp4_round_trip(FR_KV_NVFP4, "full,-search"); }

/* Vanilla: no transform; the unpaged tokens read quantized on the fly like
 * a page's, the RoPE part in BF16. */
static void test_vanilla_on_the_fly(void **state)
{
    (void)state;
    lcase *lc = malloc(sizeof *lc);
    assert_non_null(lc);
    lc_init(lc, FR_KV_NVFP4, "vanilla", 5);
    fr_kv_cache *c = lc_cache(lc);
    float *buf = malloc(sizeof(float) * N * D);
    assert_non_null(buf);
    int seq;
    assert_int_equal(fr_kv_seq_new(c, &seq), FR_OK);
    for (int t = 0; t < 40; t++) append_token(c, lc, seq, t);
    fr_kv_view v;
    gather(c, seq, 1, buf, &v);
    assert_int_equal(v.n_sink, 0);
    assert_int_equal(v.fp4_end, 40);
    for (int t = 0; t < 40; t++) {
        float bf[DC];
        for (int j = 0; j < DC; j++) bf[j] = fr_bf16_round(lc->rows[1][t][j]);
        for (int b = 0; b < DC / 16; b++) {
            double q[16];
            fp4_block_direct(FR_NVFP4, 0, bf + b * 16, 16, q);
            for (int j = 0; j < 16; j++) assert_true(buf[(size_t)t * D + b * 16 + j] == (float)q[j]);
        }
        for (int j = DC; j < D; j++) assert_true(buf[(size_t)t * D + j] == fr_bf16_round(lc->rows[1][t][j]));
    }
    fr_kv_cache_destroy(&c);
    free(buf); free(lc);
}

/* FP8, BF16 and f32 latent pages: no transform; FP8 with the layer's scale. */
static void test_plain_dtypes(void **state)
{
    (void)state;
    const fr_kv_dtype dts[] = {FR_KV_FP8, FR_KV_BF16, FR_KV_F32};
    lcase *lc = malloc(sizeof *lc);
    float *buf = malloc(sizeof(float) * N * D);
    assert_non_null(lc);
    assert_non_null(buf);
    for (int k = 0; k < 3; k++) {
        lc_init(lc, dts[k], "full", 9);
        fr_kv_cache *c = lc_cache(lc);
        int seq;
        assert_int_equal(fr_kv_seq_new(c, &seq), FR_OK);
        for (int t = 0; t < N; t++) append_token(c, lc, seq, t);
        for (int l = 0; l < NL; l++) {
            fr_kv_view v;
            gather(c, seq, l, buf, &v);
            assert_int_equal(v.fp4_end, 0);
            for (int t = 0; t < N; t++)
                for (int j = 0; j < D; j++) {
                    float x = lc->rows[l][t][j], want = dts[k] == FR_KV_F32 ? x : fr_bf16_round(x);
                    if (dts[k] == FR_KV_FP8 && j < DC)   /* paged or on the fly: the BF16 slot value */
                        want = lc->fp8[2 * l] * fr_e4m3_round(want / lc->fp8[2 * l]);
                    assert_true(buf[(size_t)t * D + j] == want);
                }
        }
        fr_kv_cache_destroy(&c);
    }
    free(buf); free(lc);
}

/* A fork shares the pages and copies the slots: same view. */
static void test_fork(void **state)
{
    (void)state;
    lcase *lc = malloc(sizeof *lc);
    float *a = malloc(sizeof(float) * N * D), *b = malloc(sizeof(float) * N * D);
    assert_non_null(lc);
    assert_non_null(a);
    assert_non_null(b);
    lc_init(lc, FR_KV_MXFP4, "full", 3);
    fr_kv_cache *c = lc_cache(lc);
    int s0, s1;
    assert_int_equal(fr_kv_seq_new(c, &s0), FR_OK);
    for (int t = 0; t < 200; t++) append_token(c, lc, s0, t);
    int free_before = fr_kv_free_blocks(c);
    assert_int_equal(fr_kv_seq_fork(c, s0, &s1), FR_OK);
    assert_int_equal(fr_kv_free_blocks(c), free_before);   /* the full page is shared */
    fr_kv_view va, vb;
    gather(c, s0, 1, a, &va);
    gather(c, s1, 1, b, &vb);
    assert_memory_equal(a, b, sizeof(float) * 200 * D);
    fr_kv_cache_destroy(&c);
    free(a); free(b); free(lc);
}

static void test_config_errors(void **state)
{
    (void)state;
    lcase *lc = malloc(sizeof *lc);
    assert_non_null(lc);
    lc_init(lc, FR_KV_NVFP4, "full", 1);
    fr_kv_cache *c = NULL;
    fr_kv_cache_config bad = lc->cfg;
    bad.n_kv_heads = 2;
    assert_int_equal(fr_kv_cache_new(&bad, &c), FR_EINVAL);
    bad = lc->cfg;
    bad.latent_dim = D;
    assert_int_equal(fr_kv_cache_new(&bad, &c), FR_EINVAL);
    bad = lc->cfg;
    bad.latent_dim = 40;   /* not a multiple of 16 */
    assert_int_equal(fr_kv_cache_new(&bad, &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "latent width"));
    bad.latent_dim = 48;   /* a multiple of 16, not a power of two: no rotation */
    assert_int_equal(fr_kv_cache_new(&bad, &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "power-of-two"));
    bad.recipe.rotate = 0;
    assert_int_equal(fr_kv_cache_new(&bad, &c), FR_OK);
    fr_kv_cache_destroy(&c);
    assert_null(c);
    free(lc);
}

/* ---- latent attention over the store form ---- */

enum { H = 2, DN = 24, DV = 20, CTX = 40 };

typedef struct {
    fr_model_config cfg;
    fr_layer_weights lw;
    float kv_b[H * (DN + DV) * DC];
    float q[H * (DN + DR)];
    float rows[CTX][D];
    float mu[DC];
} attn_case;

static void attn_init(attn_case *a)
{
    memset(a, 0, sizeof *a);
    a->cfg.num_heads = H;
    a->cfg.kv_lora_rank = DC;
    a->cfg.qk_rope_dim = DR;
    a->cfg.qk_nope_dim = DN;
    a->cfg.v_head_dim = DV;
    a->cfg.head_dim = D;
    a->lw.kv_b_proj = a->kv_b;
    fr_test_rng g = {77};
    for (size_t i = 0; i < sizeof a->kv_b / sizeof(float); i++) a->kv_b[i] = 0.2f * fr_test_normal(&g);
    for (int i = 0; i < H * (DN + DR); i++) a->q[i] = fr_test_normal(&g);
    for (int t = 0; t < CTX; t++)
        for (int j = 0; j < D; j++) a->rows[t][j] = fr_test_normal(&g) + (j < DC ? 0.5f : 0.0f);
    for (int j = 0; j < DC; j++) a->mu[j] = 0.5f + 0.1f * fr_test_normal(&g);
}

/* Direct attention of the one query (position CTX - 1) over rows in store
 * form (latents H (c - mu)) in double, the content query rotated, and on
 * tokens [a, b) replaced by qterm[h] (the quantized query terms summed). */
static void attend_direct(const attn_case *ac, const float store[CTX][D], const double qterm[H][DC], int a, int b,
                          double *out)
{
    const double scale = 1.0 / sqrt((double)(DN + DR));
    for (int h = 0; h < H; h++) {
        const float *w_uk = ac->kv_b + (size_t)h * (DN + DV) * DC, *w_uv = w_uk + (size_t)DN * DC;
        const float *qh = ac->q + h * (DN + DR);
        double qc[DC], qr[DC], s[CTX], ctx[DC] = {0}, ctx_back[DC], mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < DC; j++) {
            qc[j] = 0.0;
            for (int i = 0; i < DN; i++) qc[j] += (double)qh[i] * w_uk[(size_t)i * DC + j];
        }
        hadamard_direct(qc, DC, qr);
        for (int t = 0; t < CTX; t++) {
            const double *qq = t >= a && t < b ? qterm[h] : qr;
            double x = 0.0;
            for (int j = 0; j < DC; j++) x += qq[j] * store[t][j];
            for (int j = 0; j < DR; j++) x += (double)qh[DN + j] * store[t][DC + j];
            s[t] = x * scale;
            mx = fmax(mx, s[t]);
        }
        for (int t = 0; t < CTX; t++) sum += s[t] = exp(s[t] - mx);
        for (int t = 0; t < CTX; t++)
            for (int j = 0; j < DC; j++) ctx[j] += s[t] / sum * store[t][j];
        hadamard_direct(ctx, DC, ctx_back);
        for (int o = 0; o < DV; o++) {
            double y = 0.0;
            for (int j = 0; j < DC; j++) y += (ctx_back[j] + ac->mu[j]) * w_uv[(size_t)o * DC + j];
            out[h * DV + o] = y;
        }
    }
}

static double max_abs_diff(const float *a, const double *b, int n, double *scale)
{
    double d = 0.0, m = 0.0;
    for (int i = 0; i < n; i++) {
        d = fmax(d, fabs(a[i] - b[i]));
        m = fmax(m, fabs(b[i]));
    }
    *scale = m;
    return d;
}

/* The store form's rotation and mean come back out: attention over
 * H (c - mu) equals attention over c (the direct computation), whatever
 * the quantized query terms on the FP4 region are (here: exact query,
 * then FP4 single and dual terms, checked against the same terms in the
 * direct computation). */
static void test_attend_store_form(void **state)
{
    (void)state;
    attn_case *ac = malloc(sizeof *ac);
    float (*store)[D] = malloc(sizeof(float) * CTX * D), *scores = malloc(sizeof(float) * CTX);
    assert_non_null(ac);
    assert_non_null(store);
    assert_non_null(scores);
    attn_init(ac);
    for (int t = 0; t < CTX; t++) {
        double c[DC], r[DC];
        for (int j = 0; j < DC; j++) c[j] = (double)ac->rows[t][j] - ac->mu[j];
        hadamard_direct(c, DC, r);
        for (int j = 0; j < DC; j++) store[t][j] = (float)r[j];
        for (int j = DC; j < D; j++) store[t][j] = ac->rows[t][j];
    }
    fr_mla_cpu *m = NULL;
    assert_int_equal(fr_mla_cpu_new(&ac->cfg, 1, &m), FR_OK);
    fr_kv_view view = {.n_tokens = CTX, .k = &store[0][0], .v = &store[0][0], .n_sink = 4, .fp4_end = 32};
    float out[H * DV], plain[H * DV];
    double want[H * DV], scale;
    /* 1. the rows as computed, no form: the reference in float32 */
    fr_kv_view raw = {.n_tokens = CTX, .k = &ac->rows[0][0], .v = &ac->rows[0][0]};
    fr_mla_cpu_attend(m, &ac->cfg, &ac->lw, ac->q, CTX - 1, 1, &raw, NULL, scores, plain);
    /* 2. store form, unquantized query: equals 1 */
    fr_kv_latent_form form = {.latent_dim = DC, .mean = ac->mu, .rotate = 1, .q_mode = FR_Q_UNQUANTIZED,
                              .fmt = FR_NVFP4, .q_search = 1};
    fr_mla_cpu_attend(m, &ac->cfg, &ac->lw, ac->q, CTX - 1, 1, &view, &form, scores, out);
    double qr[H][DC];
    for (int h = 0; h < H; h++) {   /* the rotated absorbed query, directly */
        double qc[DC];
        const float *w_uk = ac->kv_b + (size_t)h * (DN + DV) * DC;
        for (int j = 0; j < DC; j++) {
            qc[j] = 0.0;
            for (int i = 0; i < DN; i++) qc[j] += (double)ac->q[h * (DN + DR) + i] * w_uk[(size_t)i * DC + j];
        }
        hadamard_direct(qc, DC, qr[h]);
    }
    attend_direct(ac, (const float(*)[D])store, (const double(*)[DC])qr, 0, 0, want);
    double d = max_abs_diff(out, want, H * DV, &scale), d_plain = max_abs_diff(plain, want, H * DV, &scale);
    printf("  store form, exact query: max |diff| %.3g (plain rows %.3g) of max |out| %.3g\n", d, d_plain, scale);
    assert_true(d <= 1e-5 * scale && d_plain <= 1e-5 * scale);
    /* 3. FP4 query terms on [4, 32): the direct computation with the same terms
     * (quantized from the direct rotated query in float). */
    const fr_qquant_mode modes[] = {FR_Q_SINGLE, FR_Q_DUAL};
    double dist[2];
    for (int k = 0; k < 2; k++) {
        form.q_mode = modes[k];
        fr_mla_cpu_attend(m, &ac->cfg, &ac->lw, ac->q, CTX - 1, 1, &view, &form, scores, out);
        double qt[H][DC];
        for (int h = 0; h < H; h++) {
            float x[DC], q1[DC], q2[DC] = {0};
            for (int j = 0; j < DC; j++) x[j] = (float)qr[h][j];
            if (modes[k] == FR_Q_DUAL) assert_int_equal(fr_fp4_quantize_dual(FR_NVFP4, 1, x, DC, q1, q2), FR_OK);
            else assert_int_equal(fr_fp4_fake_quantize(FR_NVFP4, 1, x, DC, q1), FR_OK);
            for (int j = 0; j < DC; j++) qt[h][j] = (double)q1[j] + q2[j];
        }
        double w2[H * DV];
        attend_direct(ac, (const float(*)[D])store, (const double(*)[DC])qt, 4, 32, w2);
        d = max_abs_diff(out, w2, H * DV, &scale);
        dist[k] = max_abs_diff(out, want, H * DV, &scale);
        printf("  %s FP4 query on the FP4 region: max |diff| to the direct %.3g, to the exact query %.3g\n",
               k ? "dual" : "single", d, dist[k]);
        assert_true(d <= 1e-4 * scale);
        assert_true(dist[k] > 1e2 * d);   /* the terms really are used */
    }
    assert_true(dist[1] < dist[0]);   /* the residual term helps */
    fr_mla_cpu_destroy(&m);
    assert_null(m);
    free(ac); free(store); free(scores);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_layout),
             cmocka_unit_test(test_nvfp4_round_trip),
             cmocka_unit_test(test_mxfp4_round_trip),
             cmocka_unit_test(test_nvfp4_no_search_round_trip),
             cmocka_unit_test(test_vanilla_on_the_fly),
             cmocka_unit_test(test_plain_dtypes),
             cmocka_unit_test(test_fork),
             cmocka_unit_test(test_config_errors),
             cmocka_unit_test(test_attend_store_form))
