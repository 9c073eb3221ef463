/* Latent (MLA) attention on the GPU (attention/attn_mla.h) against a float
 * reference of the same numerics.
 *
 * Each case fills a CPU latent cache (kvcache/kv_cache.h, two layers,
 * layer 1 attended) with random rows (a latent mean, outlier channels,
 * log-normal token scales), copies its blocks to the device under the same
 * block ids, and writes the device recent and sink slots from the CPU's
 * gathered view (BF16 exact there); the other layer's slots hold NaNs, so a
 * wrong layer offset shows. The step's rows are the BF16 store form
 * (fr_kv_key_form). The reference takes the gathered view plus those rows
 * (quantized on the fly as kv_cache.c does without sink/recent) and
 * computes what attn_mla.h documents: the rotated content query as its FP4
 * terms on the FP4 pages' tokens, else rounded to BF16 (FP8: times the
 * layer's scale), the RoPE query in BF16, float64 sums, exact softmax, the
 * context rotated back and the mean added.
 *
 * Rule: per row, max |gpu - ref| <= 1e-2 * max |ref| (the kernel rounds P to
 * BF16 and its output to BF16; measured errors are printed). Each case runs
 * twice: with a workspace (split partials and the combine kernel) and
 * without (one CTA per row group, finished in the kernel).
 *
 * Matrix: bf16, fp8, nvfp4 (full, vanilla, full,-dual, bf16 compute, full,-sink),
 * mxfp4 (full); d_c 256 (tqa) and 512 (DeepSeek-V3), d_r 64; 6 and 128
 * heads; decode over lengths 0 .. 4200 and a chunked prefill of 37 tokens.
 * Every other width the kernels are built for (128 to 448 in steps of 64)
 * runs bf16, fp8, nvfp4 and mxfp4, decode and a short prefill; widths that
 * are no power of two take the recipe without the rotation (the caches
 * refuse a Hadamard over them). */
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

#include "attention/attn_mla.h"
#include "attention/fp_formats.h"
#include "attention/hadamard.h"
#include "attention/microscale.h"
#include "kvcache/kv_cache.h"
#include "tests/unit/test_util.h"

enum { NL = 2, LAYER = 1, T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS, DR = 64, MAX_SEQS = 12 };

typedef struct {
    fr_kv_dtype dt;
    const char *recipe;
    fr_fp4_compute compute;
} mode;

typedef struct {
    mode m;
    int dc, d, H, n_seqs, n_new;
    fr_kv_cache_config cfg;
    fr_kv_cache *cpu;
    int seq[MAX_SEQS];
    float mean[NL * 576], fp8[NL * 2];
    fr_test_rng g;
    float *step;            /* [n_seqs * n_new][d] store form (BF16 exact) */
    float *q;               /* [rows][H][d] */
    fr_attn_mla_config kc;
} rig;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static void raw_rows(rig *r, float *x, int n)
{
    for (int i = 0; i < n; i++) {
        const float ts = expf(0.5f * fr_test_normal(&r->g));
        for (int j = 0; j < r->d; j++) {
            const float outlier = (j % 37 == 5) ? 6.0f : 1.0f;
            x[(size_t)i * r->d + j] = (j < r->dc ? r->mean[LAYER * r->d + j] : 0.0f) + ts * outlier * fr_test_normal(&r->g);
        }
    }
}

static rig *rig_open(const mode *m, int dc, int H, int n_seqs, const int *lens, int n_new, uint64_t seed)
{
    rig *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->m = *m;
    r->dc = dc;
    r->d = dc + DR;
    r->H = H;
    r->n_seqs = n_seqs;
    r->n_new = n_new;
    r->g.s = seed;
    fr_recipe rc;
    FR_OK_OR_FAIL(fr_recipe_parse(m->recipe, &rc));
    for (int l = 0; l < NL; l++)
        for (int j = 0; j < r->d; j++) r->mean[l * r->d + j] = j < dc ? 0.4f * fr_test_normal(&r->g) + 0.2f : 0.0f;
    r->fp8[0] = r->fp8[1] = 0.05f;
    r->fp8[2] = r->fp8[3] = 0.04f;
    int blocks = 4;
    for (int s = 0; s < n_seqs; s++) blocks += (lens[s] + n_new) / T + 2;
    r->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = 1, .head_dim = r->d, .dtype = m->dt,
                                  .compute = m->compute, .recipe = rc, .tau = 21.0f / 1024.0f, .n_blocks = blocks,
                                  .max_seqs = n_seqs, .key_mean = r->mean, .fp8_scales = r->fp8, .latent_dim = dc};
    FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
    for (int s = 0; s < n_seqs; s++) {
        FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &r->seq[s]));
        if (!lens[s]) continue;
        float *x = xmalloc(sizeof(float) * NL * lens[s] * r->d);
        raw_rows(r, x, NL * lens[s]);
        FR_OK_OR_FAIL(fr_kv_reserve(r->cpu, r->seq[s], lens[s]));
        FR_OK_OR_FAIL(fr_kv_append(r->cpu, r->seq[s], lens[s], x, NULL, (size_t)lens[s] * r->d));
        free(x);
    }
    const int rows = n_seqs * n_new;
    r->step = xmalloc(sizeof(float) * rows * r->d);
    raw_rows(r, r->step, rows);
    fr_kv_key_form(r->cpu, LAYER, rows, r->step);
    r->q = xmalloc(sizeof(float) * rows * H * r->d);
    for (size_t i = 0; i < (size_t)rows * H * r->d; i++) r->q[i] = 0.6f * fr_test_normal(&r->g);
    const fr_kv_latent_form f = fr_kv_latent_form_of(r->cpu, LAYER);
    const int fp4 = fr_kv_dtype_is_fp4(m->dt);
    r->kc = (fr_attn_mla_config){.dtype = m->dt, .n_heads = H, .latent_dim = dc, .rope_dim = DR,
                                 .scale = 1.0f / sqrtf(128.0f + DR), .rotate = f.rotate, .mean = NULL,
                                 .sink_recent = fp4 && rc.sink_recent, .q_mode = f.q_mode, .q_search = rc.scale_search,
                                 .q_bf16 = f.q_bf16, .fp8_scale = r->fp8[2 * LAYER]};
    return r;
}

static void rig_close(rig *r)
{
    fr_kv_cache_destroy(&r->cpu);
    free(r->step);
    free(r->q);
    free(r);
}

/* ---- the reference ---- */

static float bf16r(float x) { return fr_bf16_round(x); }

/* The tokens sequence s's rows see, [len + n_new][d], and where the FP4
 * query terms apply ([a, b)). */
static float *reference_view(const rig *r, int s, int *a, int *b)
{
    const int len = fr_kv_seq_len(r->cpu, r->seq[s]), n = len + r->n_new, d = r->d;
    float *k = xmalloc(sizeof(float) * (size_t)(n + 1) * d);
    fr_kv_view v;
    FR_OK_OR_FAIL(fr_kv_gather(r->cpu, r->seq[s], LAYER, 0, 0, NULL, NULL, k, NULL, &v));
    memcpy(k + (size_t)len * d, r->step + (size_t)s * r->n_new * d, sizeof(float) * r->n_new * d);
    const int fp4 = fr_kv_dtype_is_fp4(r->m.dt), keep = fp4 && r->cfg.recipe.sink_recent;
    const int full = len / T * T;
    if (!keep && r->m.dt != FR_KV_BF16)
        for (int t = len; t < n; t++) {   /* the step's rows as kv_cache.c quantizes unpaged tokens */
            float *x = k + (size_t)t * d;
            if (fp4) fr_fp4_fake_quantize(fr_kv_dtype_fp4_format(r->m.dt), r->cfg.recipe.scale_search, x, r->dc, x);
            else for (int j = 0; j < r->dc; j++) x[j] = r->fp8[2 * LAYER] * fr_e4m3_round(x[j] / r->fp8[2 * LAYER]);
        }
    *a = keep ? (n < SINK ? n : SINK) : 0;
    *b = fp4 ? (keep ? full : n) : 0;
    return k;
}

static void reference_row(const rig *r, const float *k, int a, int b, const float *q, int last, float *out)
{
    const int dc = r->dc, d = r->d, fp4 = fr_kv_dtype_is_fp4(r->m.dt);
    const fr_kv_latent_form f = fr_kv_latent_form_of(r->cpu, LAYER);
    float *qc = xmalloc(sizeof(float) * d), *plain = xmalloc(sizeof(float) * d), *t1 = xmalloc(sizeof(float) * d);
    float *t2 = xmalloc(sizeof(float) * dc), *res = xmalloc(sizeof(float) * dc);
    memcpy(qc, q, sizeof(float) * d);
    if (f.rotate) fr_hadamard(qc, dc);
    /* FP8: the view holds sc * E4M3 values, the kernel meets the E4M3 values with bf16(sc q) */
    const float sc = r->fp8[2 * LAYER];
    for (int j = 0; j < d; j++) plain[j] = j < dc && r->m.dt == FR_KV_FP8 ? bf16r(qc[j] * sc) / sc : bf16r(qc[j]);
    memcpy(t1, plain, sizeof(float) * d);
    memset(t2, 0, sizeof(float) * dc);
    if (fp4 && f.q_mode != FR_Q_UNQUANTIZED) {
        fr_fp4_fake_quantize(f.fmt, f.q_search, qc, dc, t1);
        if (f.q_mode == FR_Q_DUAL) {
            for (int j = 0; j < dc; j++) res[j] = qc[j] - t1[j];
            fr_fp4_fake_quantize(f.fmt, f.q_search, res, dc, t2);
        }
    }
    double *p = xmalloc(sizeof(double) * (size_t)(last + 1));
    double mx = -INFINITY, sum = 0.0;
    for (int t = 0; t <= last; t++) {
        const float *kt = k + (size_t)t * d;
        const int quant = t >= a && t < b;
        double s = 0.0;
        for (int j = 0; j < d; j++) s += (double)(quant ? t1[j] : plain[j]) * kt[j];
        for (int j = 0; quant && j < dc; j++) s += (double)t2[j] * kt[j];
        p[t] = s * r->kc.scale;
        if (p[t] > mx) mx = p[t];
    }
    for (int t = 0; t <= last; t++) sum += (p[t] = exp(p[t] - mx));
    double *o = xmalloc(sizeof(double) * dc);
    for (int j = 0; j < dc; j++) o[j] = 0.0;
    for (int t = 0; t <= last; t++)
        for (int j = 0; j < dc; j++) o[j] += p[t] / sum * k[(size_t)t * d + j];
    for (int j = 0; j < dc; j++) out[j] = (float)o[j];
    if (f.rotate) fr_hadamard(out, dc);
    for (int j = 0; f.mean && j < dc; j++) out[j] += f.mean[j];
    free(qc); free(plain); free(t1); free(t2); free(res); free(p); free(o);
}

/* ---- the device side ---- */

typedef struct {
    uint8_t *pool;
    uint16_t *recent, *sink, *step, *out;
    float *q, *mean;
    int *tables;
    fr_paged_seq *seqs;
    fr_latent_kv kv;
    int max_pages;
} dev;

static void dev_open(const rig *r, dev *D)
{
    memset(D, 0, sizeof *D);
    const fr_page_layout *lay = fr_kv_layout(r->cpu);
    const size_t bb = fr_kv_block_bytes(r->cpu), row = (size_t)r->d;
    CUDA_OK(cudaMalloc((void **)&D->pool, bb * r->cfg.n_blocks));
    CUDA_OK(cudaMemset(D->pool, 0xFF, bb * r->cfg.n_blocks));
    const size_t slot = (size_t)NL * T * row, sink = (size_t)NL * SINK * row;
    CUDA_OK(cudaMalloc((void **)&D->recent, sizeof(uint16_t) * slot * r->n_seqs));
    CUDA_OK(cudaMalloc((void **)&D->sink, sizeof(uint16_t) * sink * r->n_seqs));
    CUDA_OK(cudaMemset(D->recent, 0xFF, sizeof(uint16_t) * slot * r->n_seqs));
    CUDA_OK(cudaMemset(D->sink, 0xFF, sizeof(uint16_t) * sink * r->n_seqs));
    const int rows = r->n_seqs * r->n_new;
    CUDA_OK(cudaMalloc((void **)&D->step, sizeof(uint16_t) * rows * row));
    CUDA_OK(cudaMalloc((void **)&D->q, sizeof(float) * rows * r->H * row));
    CUDA_OK(cudaMalloc((void **)&D->out, sizeof(uint16_t) * rows * r->H * r->dc));
    CUDA_OK(cudaMalloc((void **)&D->mean, sizeof(float) * r->dc));
    D->max_pages = r->cfg.n_blocks;
    CUDA_OK(cudaMalloc((void **)&D->tables, sizeof(int) * r->n_seqs * D->max_pages));
    CUDA_OK(cudaMalloc((void **)&D->seqs, sizeof(fr_paged_seq) * r->n_seqs));

    uint16_t *h = xmalloc(sizeof(uint16_t) * (slot > rows * row ? slot : rows * row));
    fr_paged_seq recs[MAX_SEQS];
    for (int s = 0; s < r->n_seqs; s++) {
        const int seq = r->seq[s], len = fr_kv_seq_len(r->cpu, seq), full = len / T * T;
        int nb = 0;
        const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
        for (int p = 0; p < len / T; p++)
            CUDA_OK(cudaMemcpy(D->pool + (size_t)blocks[p] * bb, fr_kv_page(r->cpu, seq, p), bb, cudaMemcpyHostToDevice));
        if (nb) CUDA_OK(cudaMemcpy(D->tables + s * D->max_pages, blocks, sizeof(int) * nb, cudaMemcpyHostToDevice));
        float *k = xmalloc(sizeof(float) * (size_t)(len + 1) * row);
        fr_kv_view v;
        FR_OK_OR_FAIL(fr_kv_gather(r->cpu, seq, LAYER, 0, 0, NULL, NULL, k, NULL, &v));
        for (int t = full; t < len; t++)
            for (size_t j = 0; j < row; j++) h[(size_t)(t - full) * row + j] = fr_bf16_encode(k[(size_t)t * row + j]);
        if (len > full)
            CUDA_OK(cudaMemcpy(D->recent + s * slot + (size_t)LAYER * T * row, h, sizeof(uint16_t) * (len - full) * row,
                               cudaMemcpyHostToDevice));
        if (full > 0 && r->kc.sink_recent) {
            for (int t = 0; t < SINK; t++)
                for (size_t j = 0; j < row; j++) h[(size_t)t * row + j] = fr_bf16_encode(k[(size_t)t * row + j]);
            CUDA_OK(cudaMemcpy(D->sink + s * sink + (size_t)LAYER * SINK * row, h, sizeof(uint16_t) * SINK * row,
                               cudaMemcpyHostToDevice));
        }
        free(k);
        recs[s] = (fr_paged_seq){.block_table = D->tables + s * D->max_pages, .len = len, .n_new = r->n_new,
                                 .q_row = s * r->n_new, .slot = s};
    }
    CUDA_OK(cudaMemcpy(D->seqs, recs, sizeof(fr_paged_seq) * r->n_seqs, cudaMemcpyHostToDevice));
    for (size_t i = 0; i < (size_t)rows * row; i++) h[i] = fr_bf16_encode(r->step[i]);
    CUDA_OK(cudaMemcpy(D->step, h, sizeof(uint16_t) * rows * row, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(D->q, r->q, sizeof(float) * rows * r->H * row, cudaMemcpyHostToDevice));
    const fr_kv_latent_form f = fr_kv_latent_form_of(r->cpu, LAYER);
    if (f.mean) CUDA_OK(cudaMemcpy(D->mean, f.mean, sizeof(float) * r->dc, cudaMemcpyHostToDevice));
    free(h);
    D->kv = (fr_latent_kv){.pool = D->pool, .block_bytes = bb, .page_bytes = lay->head_page_bytes,
                           .codes = lay->k_codes, .scales = lay->k_scales, .rope = lay->rope, .recent = D->recent,
                           .sink = D->sink, .slot_elems = slot, .sink_elems = sink, .step_rows = D->step,
                           .layer = LAYER};
}

static void dev_close(dev *D)
{
    cudaFree(D->pool); cudaFree(D->recent); cudaFree(D->sink); cudaFree(D->step); cudaFree(D->out);
    cudaFree(D->q); cudaFree(D->mean); cudaFree(D->tables); cudaFree(D->seqs);
}

/* Runs the kernel (with or without a workspace) and checks every row. */
static double run_and_check(rig *r, dev *D, int with_ws, int *splits)
{
    fr_attn_mla_config kc = r->kc;
    const fr_kv_latent_form f = fr_kv_latent_form_of(r->cpu, LAYER);
    kc.mean = f.mean ? D->mean : NULL;
    int max_ctx = 1;
    for (int s = 0; s < r->n_seqs; s++) {
        const int c = fr_kv_seq_len(r->cpu, r->seq[s]) + r->n_new;
        if (c > max_ctx) max_ctx = c;
    }
    size_t ws_bytes = 0;
    void *ws = NULL;
    if (with_ws) {
        FR_OK_OR_FAIL(fr_attn_mla_workspace_bytes(&kc, r->n_seqs, r->n_new, max_ctx, &ws_bytes));
        if (ws_bytes) CUDA_OK(cudaMalloc(&ws, ws_bytes));
    }
    fr_attn_mla_plan plan;
    FR_OK_OR_FAIL(fr_attn_mla_plan_for(&kc, r->n_seqs, r->n_new, max_ctx, ws_bytes, &plan));
    *splits = plan.n_splits;
    const int rows = r->n_seqs * r->n_new;
    CUDA_OK(cudaMemset(D->out, 0xFF, sizeof(uint16_t) * rows * r->H * r->dc));
    FR_OK_OR_FAIL(fr_attn_mla(&kc, &D->kv, D->seqs, r->n_seqs, r->n_new, max_ctx, D->q, D->out, ws, ws_bytes, 0));
    CUDA_OK(cudaDeviceSynchronize());
    uint16_t *out = xmalloc(sizeof(uint16_t) * rows * r->H * r->dc);
    CUDA_OK(cudaMemcpy(out, D->out, sizeof(uint16_t) * rows * r->H * r->dc, cudaMemcpyDeviceToHost));
    float *ref = xmalloc(sizeof(float) * r->dc);
    double worst = 0.0;
    for (int s = 0; s < r->n_seqs; s++) {
        int a, b;
        float *k = reference_view(r, s, &a, &b);
        const int len = fr_kv_seq_len(r->cpu, r->seq[s]);
        for (int i = 0; i < r->n_new; i++)
            for (int h = 0; h < r->H; h++) {
                const size_t qr = ((size_t)(s * r->n_new + i) * r->H + h);
                reference_row(r, k, a, b, r->q + qr * r->d, len + i, ref);
                double mref = 0.0, err = 0.0;
                for (int j = 0; j < r->dc; j++) {
                    mref = fmax(mref, fabs(ref[j]));
                    err = fmax(err, fabs(fr_bf16_decode(out[qr * r->dc + j]) - ref[j]));
                }
                const double rel = err / (mref > 0 ? mref : 1.0);
                if (!(rel <= 1e-2))
                    fail_msg("seq %d (len %d) token %d head %d: max |gpu - ref| / max |ref| = %.3g", s, len, i, h, rel);
                if (rel > worst) worst = rel;
            }
        free(k);
    }
    free(ref);
    free(out);
    cudaFree(ws);
    return worst;
}

static void run_case(const mode *m, int dc, int H, const int *lens, int n_seqs, int n_new, uint64_t seed)
{
    rig *r = rig_open(m, dc, H, n_seqs, lens, n_new, seed);
    dev D;
    dev_open(r, &D);
    int s1 = 0, s2 = 0;
    const double e1 = run_and_check(r, &D, 1, &s1), e2 = run_and_check(r, &D, 0, &s2);
    printf("  %-6s %-14s %-5s d_c %3d H %3d n_new %2d: splits %2d max rel err %.2e; one split %.2e\n",
           fr_kv_dtype_name(m->dt), m->recipe, fr_fp4_compute_name(m->compute), dc, H, n_new, s1, e1, e2);
    dev_close(&D);
    rig_close(r);
}

static const mode kModes[] = {
    {FR_KV_BF16, "full", FR_COMPUTE_EXACT},         {FR_KV_FP8, "full", FR_COMPUTE_EXACT},
    {FR_KV_NVFP4, "full", FR_COMPUTE_EXACT},        {FR_KV_NVFP4, "vanilla", FR_COMPUTE_EXACT},
    {FR_KV_NVFP4, "full,-dual", FR_COMPUTE_EXACT},  {FR_KV_NVFP4, "full", FR_COMPUTE_BF16},
    {FR_KV_NVFP4, "full,-sink", FR_COMPUTE_EXACT},  {FR_KV_MXFP4, "full", FR_COMPUTE_EXACT},
};

static void test_decode(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const int lens[] = {0, 1, 15, 16, 17, 127, 128, 129, 300, 1000, 4200};
    const int n = (int)(sizeof lens / sizeof lens[0]);
    for (size_t i = 0; i < sizeof kModes / sizeof kModes[0]; i++) {
        run_case(&kModes[i], 256, 6, lens, n, 1, 11 + i);
        run_case(&kModes[i], 512, 128, lens + 5, 4, 1, 31 + i);
    }
}

static void test_prefill(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const int lens[] = {0, 100, 250, 1030};
    for (size_t i = 0; i < sizeof kModes / sizeof kModes[0]; i++) {
        run_case(&kModes[i], 256, 6, lens, 4, 37, 51 + i);
        if (i == 0 || i == 2) run_case(&kModes[i], 512, 128, lens + 1, 2, 5, 71 + i);
    }
}

static void test_widths(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const int lens[] = {0, 17, 128, 300, 1000};
    static const mode pow2[] = {{FR_KV_BF16, "full", FR_COMPUTE_EXACT}, {FR_KV_FP8, "full", FR_COMPUTE_EXACT},
                                {FR_KV_NVFP4, "full", FR_COMPUTE_EXACT}, {FR_KV_MXFP4, "full", FR_COMPUTE_BF16}};
    static const mode other[] = {{FR_KV_BF16, "full", FR_COMPUTE_EXACT}, {FR_KV_FP8, "full", FR_COMPUTE_EXACT},
                                 {FR_KV_NVFP4, "full,-rotate", FR_COMPUTE_EXACT},
                                 {FR_KV_MXFP4, "full,-rotate", FR_COMPUTE_BF16}};
    for (int dc = 128; dc <= 448; dc += 64) {
        if (dc == 256) continue;   /* test_decode and test_prefill's */
        const mode *ms = (dc & (dc - 1)) == 0 ? pow2 : other;
        for (int i = 0; i < 4; i++) {
            run_case(&ms[i], dc, 16, lens, 5, 1, 91 + i + dc);
            run_case(&ms[i], dc, 6, lens + 1, 2, 9, 97 + i + dc);
        }
    }
}

static void test_bad_arguments(void **state)
{
    (void)state;
    fr_attn_mla_config c = {.dtype = FR_KV_F32, .n_heads = 8, .latent_dim = 512, .rope_dim = 64, .scale = 0.1f};
    fr_attn_mla_plan p;
    assert_int_not_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_OK);
    c.dtype = FR_KV_NVFP4;
    static const int unbuilt[] = {64, 96, 544, 576, 1024};   /* the kernels take 128 to 512 in steps of 64 */
    for (size_t i = 0; i < sizeof unbuilt / sizeof unbuilt[0]; i++) {
        c.latent_dim = unbuilt[i];
        assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_EUNSUPPORTED);
        assert_non_null(strstr(fr_last_error(), "latent width"));
    }
    c.latent_dim = 384;
    assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_OK);
    c.rope_dim = 32;
    assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_EUNSUPPORTED);
    c.rope_dim = 64;
    c.rotate = 1;   /* no Hadamard over a width that is no power of two */
    assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_EINVAL);
    c.latent_dim = 128;
    assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_OK);
    c.rotate = 0;
    c.latent_dim = 512;
    c.n_heads = 0;
    assert_int_not_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_OK);
    c.n_heads = 8;
    assert_int_not_equal(fr_attn_mla_plan_for(&c, 1, 0, 10, 0, &p), FR_OK);
    assert_int_equal(fr_attn_mla_plan_for(&c, 1, 1, 10, 0, &p), FR_OK);
    assert_int_equal(p.n_splits, 1);
    assert_int_not_equal(fr_attn_mla(&c, NULL, NULL, 1, 1, 10, NULL, NULL, NULL, 0, 0), FR_OK);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_decode),
                 cmocka_unit_test(test_prefill),
                 cmocka_unit_test(test_widths))
