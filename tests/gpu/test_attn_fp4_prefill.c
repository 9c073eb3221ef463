/* Chunked-prefill attention over an FP4/FP8 cache on the GPU
 * (fr_attn_fp4_prefill, attention/attn_fp4.h) against what the CPU runner
 * computes for the same chunk (rollout/runner_cpu.c, attend_chunk over
 * fr_kv_gather's view).
 *
 * The same random K/V (keys around a non-zero mean, outlier channels) go
 * through the GPU store (kvcache/kv_store_cuda.h: stage, attention, commit,
 * layer by layer) and through fr_kv_append on the CPU, in the same chunks.
 * On the GPU the step's own tokens are the BF16 staging rows (store form);
 * the reference sees exactly those values: its view comes from fr_kv_gather
 * given the store-form rows as the step input. fr_kv_gather applies the
 * recipe's smoothing and rotation to step rows, so it is called on a mirror
 * cache: the same dtype and recipe without smoothing and rotation, fed with
 * the store form of every token. Its slots and pages hold the CPU cache's
 * bytes (asserted after every step, with the GPU pages), and its key
 * transform is the identity, so the gathered view is the CPU runner's with
 * the step rows in store form.
 *
 * Reference: the query rotated like the keys (fr_kv_query_form) and rounded
 * to BF16 as the kernel does, then causal softmax(q.k / sqrt(d)) v in double.
 * Rule: for every (token, query head, channel j), |gpu - ref| is at most
 * 1e-3 times the row's largest |ref| plus 2^-8 (sum p |v_j| / sum p +
 * |ref_j|), the bound of the kernel's BF16 rounding of P and of the output
 * (see TOL), and no output is NaN. Output rows the call
 * must not write (decode rows, unused rows) keep their NaN sentinel.
 *
 * Cases: nvfp4 and mxfp4 with the recipes full, vanilla, full,-sink and
 * full,-rotate, fp8; head_dim 128 and 64; G = 1 .. 16; 3 KV heads, layers
 * 0 and 1 of 2. Three steps of four sequences (q rows in reverse order after
 * two unused rows): chunks from len 0 and from len > 0, crossing the sink end
 * and page ends, ending exactly on a page end, starting exactly on one,
 * together with decode rows. One case runs through a captured CUDA graph.
 * Argument checks run without a GPU; everything else is skipped with a
 * message when no CUDA device is present. */
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

#include "attention/attn_fp4.h"
#include "attention/fp_formats.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store_cuda.h"
#include "tests/unit/test_util.h"

enum {
    T = FR_PAGE_TOKENS,
    NL = 2, NH = 3,                 /* 3 KV heads: a head stride is not a power of two */
    MAX_D = 128, MAX_G = 16,
    MAX_SEQS = 4, MAX_PAGES = 5, N_BLOCKS = 24,
    GAP = 2,                        /* unused q/staging rows before the first sequence */
    MAX_ROWS = 512
};
/* The kernel rounds each probability to BF16 for the P.V MMA (relative error
 * at most 2^-9) and the output once (2^-9 of |out|), so channel j may differ
 * from the exact result by up to 2^-9 (sum p |v_j| / sum p + |out_j|); twice
 * that, plus TOL of the row's largest |out| for float32 summation, is the
 * rule. A wrong scale, mask or page moves outputs by far more. */
static const double TOL = 1e-3;
static const double BF16_U = 1.0 / 256.0;
static const uint16_t OUT_SENTINEL = 0xFFFF;   /* BF16 NaN */

/* ---- GPU presence ---- */

/* ---- the rig: CPU cache, its mirror, the GPU store ---- */

typedef struct {
    fr_kv_dtype dt;
    const char *recipe;
    int d, G;
    int graph;   /* run the attention through a captured CUDA graph */
    uint64_t seed;
} case_spec;

typedef struct {
    case_spec cs;
    int n_heads;
    fr_recipe rc;
    float mean[NL * NH * MAX_D];
    float fp8[NL * NH * 2];
    fr_kv_cache_config cfg;
    fr_kv_cache *cpu;      /* the CPU cache, fed the raw rows */
    fr_kv_cache *mirror;   /* same bytes, fed the store form, identity key transform */
    int seqm[MAX_SEQS];    /* mirror sequence of each CPU sequence */
    fr_kv_store_gpu *gpu;
    cudaStream_t stream;
    float *d_k, *d_v, *d_q, *d_fp8;
    uint16_t *d_sk, *d_sv, *d_out;
    fr_paged_seq *d_seqs;
    int *d_tables;          /* [MAX_SEQS][MAX_PAGES] */
    void *d_ws;
    size_t ws_bytes;
    fr_attn_fp4_config acfg;
    fr_test_rng g;
    int step;
    long compared;          /* (token, head) rows checked */
    double worst_use;       /* largest |gpu - ref| / limit seen */
} rig;

typedef struct { int seq, n; } step_item;

static const char *rig_name(const rig *r, char *buf, size_t len)
{
    snprintf(buf, len, "%s recipe %s d %d G %d step %d", fr_kv_dtype_name(r->cs.dt), r->cs.recipe, r->cs.d,
             r->cs.G, r->step);
    return buf;
}

static rig *rig_open(const case_spec *cs)
{
    rig *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->cs = *cs;
    r->n_heads = NH * cs->G;
    r->g.s = cs->seed;
    const int d = cs->d;
    assert_int_equal(fr_recipe_parse(cs->recipe, &r->rc), FR_OK);
    for (int i = 0; i < NL * NH * d; i++) r->mean[i] = 0.5f * fr_test_normal(&r->g) + 0.25f;
    for (int i = 0; i < NL * NH; i++) {   /* FP8: keys up to ~100 stay below 448 * scale */
        r->fp8[2 * i] = 0.2f + 0.03f * (float)i;
        r->fp8[2 * i + 1] = 0.15f + 0.02f * (float)i;
    }
    r->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = NH, .head_dim = d, .dtype = cs->dt,
                                  .compute = FR_COMPUTE_BF16, .recipe = r->rc, .tau = FR_P_TAU,
                                  .n_blocks = N_BLOCKS, .max_seqs = MAX_SEQS,
                                  .key_mean = r->mean, .fp8_scales = r->fp8};
    FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
    fr_kv_cache_config mc = r->cfg;
    mc.recipe.smooth = 0;
    mc.recipe.rotate = 0;
    mc.key_mean = NULL;
    FR_OK_OR_FAIL(fr_kv_cache_new(&mc, &r->mirror));
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&r->cfg, &r->gpu));
    assert_int_equal(fr_kv_store_gpu_block_bytes(r->gpu), fr_kv_block_bytes(r->cpu));
    CUDA_OK(cudaStreamCreate(&r->stream));
    const size_t kvrow = (size_t)NH * d, qrow = (size_t)r->n_heads * d;
    CUDA_OK(cudaMalloc((void **)&r->d_k, sizeof(float) * MAX_ROWS * kvrow));
    CUDA_OK(cudaMalloc((void **)&r->d_v, sizeof(float) * MAX_ROWS * kvrow));
    CUDA_OK(cudaMalloc((void **)&r->d_q, sizeof(float) * MAX_ROWS * qrow));
    CUDA_OK(cudaMalloc((void **)&r->d_sk, sizeof(uint16_t) * MAX_ROWS * kvrow));
    CUDA_OK(cudaMalloc((void **)&r->d_sv, sizeof(uint16_t) * MAX_ROWS * kvrow));
    CUDA_OK(cudaMalloc((void **)&r->d_out, sizeof(uint16_t) * MAX_ROWS * qrow));
    CUDA_OK(cudaMalloc((void **)&r->d_seqs, sizeof(fr_paged_seq) * MAX_SEQS));
    CUDA_OK(cudaMalloc((void **)&r->d_tables, sizeof(int) * MAX_SEQS * MAX_PAGES));
    CUDA_OK(cudaMalloc((void **)&r->d_fp8, sizeof r->fp8));
    CUDA_OK(cudaMemcpy(r->d_fp8, r->fp8, sizeof r->fp8, cudaMemcpyHostToDevice));

    r->acfg = (fr_attn_fp4_config){.dtype = cs->dt, .p = fr_kv_attn_params(r->cpu, cs->G),
                                   .rotate = fr_kv_dtype_is_fp4(cs->dt) && r->rc.rotate,
                                   .sink_recent = r->rc.sink_recent,   /* ignored for FP8 */
                                   .fp8_scales = cs->dt == FR_KV_FP8 ? r->d_fp8 : NULL};
    FR_OK_OR_FAIL(fr_attn_fp4_prefill_workspace_bytes(&r->acfg, MAX_SEQS, MAX_ROWS, r->n_heads, NH, &r->ws_bytes));
    const int on_the_fly = cs->dt == FR_KV_FP8 || !r->rc.sink_recent;
    if (on_the_fly) assert_true(r->ws_bytes > 0);
    else assert_int_equal(r->ws_bytes, 0);
    if (r->ws_bytes) CUDA_OK(cudaMalloc(&r->d_ws, r->ws_bytes));
    for (int s = 0; s < MAX_SEQS; s++) {
        int a, b;
        FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &a));
        FR_OK_OR_FAIL(fr_kv_seq_new(r->mirror, &b));
        assert_int_equal(a, s);
        r->seqm[a] = b;
    }
    return r;
}

static void rig_close(rig *r)
{
    cudaFree(r->d_k);
    cudaFree(r->d_v);
    cudaFree(r->d_q);
    cudaFree(r->d_sk);
    cudaFree(r->d_sv);
    cudaFree(r->d_out);
    cudaFree(r->d_seqs);
    cudaFree(r->d_tables);
    cudaFree(r->d_fp8);
    cudaFree(r->d_ws);
    cudaStreamDestroy(r->stream);
    fr_kv_store_gpu_destroy(&r->gpu);
    fr_kv_cache_destroy(&r->cpu);
    fr_kv_cache_destroy(&r->mirror);
    free(r);
}

/* ---- data ---- */

static float token_scale(fr_test_rng *g)
{
    const float u = fr_test_uniform(g);
    if (u < 0.05f) return 4.0f;
    if (u < 0.08f) return 0.05f;
    return expf(0.4f * fr_test_normal(g));
}

static float channel_noise(fr_test_rng *g, int j)
{
    const float x = fr_test_normal(g);
    return j % 37 == 5 ? 6.0f * x : x;   /* outlier channels */
}

/* Raw rows of every layer, [NL][rows][NH][d]: keys around the key mean,
 * values around zero; queries [NL][rows][n_heads][d]. */
static void fill_rows(rig *r, float *K, float *V, float *Q, int rows)
{
    const int d = r->cs.d, H = r->n_heads;
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < rows; i++) {
            for (int h = 0; h < NH; h++) {
                const size_t o = (((size_t)l * rows + i) * NH + h) * d;
                const float sk = token_scale(&r->g), sv = token_scale(&r->g);
                for (int j = 0; j < d; j++) {
                    K[o + j] = r->mean[((size_t)l * NH + h) * d + j] + sk * channel_noise(&r->g, j);
                    V[o + j] = sv * channel_noise(&r->g, j);
                }
            }
            for (int j = 0; j < H * d; j++) Q[((size_t)l * rows + i) * H * d + j] = 0.7f * fr_test_normal(&r->g);
        }
}

/* ---- checks ---- */

static void check_staging(rig *r, int l, int rows, const float *ck, const float *cv)
{
    const size_t n = (size_t)rows * NH * r->cs.d;
    uint16_t *sk = malloc(sizeof(uint16_t) * n), *sv = malloc(sizeof(uint16_t) * n);
    assert_true(sk && sv);
    CUDA_OK(cudaMemcpy(sk, r->d_sk, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sv, r->d_sv, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        if (sk[i] != fr_bf16_encode(ck[i]) || sv[i] != fr_bf16_encode(cv[i])) {
            char name[128];
            fail_msg("%s layer %d: staging element %zu differs from the CPU store form (the store path, "
                     "not attention)", rig_name(r, name, sizeof name), l, i);
        }
    free(sk);
    free(sv);
}

/* Every full page of seq: the mirror's and the GPU's against the CPU's. */
static void check_pages(rig *r, int seq)
{
    const int len = fr_kv_seq_len(r->cpu, seq);
    assert_int_equal(fr_kv_seq_len(r->mirror, r->seqm[seq]), len);
    int nb = 0;
    const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
    assert_non_null(blocks);
    const size_t bb = fr_kv_block_bytes(r->cpu);
    uint8_t *got = malloc(bb);
    assert_non_null(got);
    char name[128];
    for (int p = 0; p < len / T; p++) {
        const uint8_t *want = fr_kv_page(r->cpu, seq, p), *mir = fr_kv_page(r->mirror, r->seqm[seq], p);
        assert_true(want && mir);
        if (memcmp(mir, want, bb))
            fail_msg("%s: seq %d page %d: the mirror cache's page differs from the CPU cache's",
                     rig_name(r, name, sizeof name), seq, p);
        CUDA_OK(cudaMemcpy(got, fr_kv_store_gpu_block(r->gpu, blocks[p]), bb, cudaMemcpyDeviceToHost));
        if (memcmp(got, want, bb))
            fail_msg("%s: seq %d page %d: the GPU page differs from the CPU page (the store path)",
                     rig_name(r, name, sizeof name), seq, p);
    }
    free(got);
}

/* Chunk attention of one sequence and layer: the GPU rows against the
 * reference over the mirror's gathered view. ck/cv: the store form of the
 * layer's step rows; q: the layer's raw queries; out: the GPU output. */
static void check_chunk(rig *r, int l, int seq, const fr_paged_seq *rec, const float *ck, const float *cv,
                        const float *q, const uint16_t *out)
{
    const int d = r->cs.d, G = r->cs.G, H = r->n_heads, len = rec->len, n = rec->n_new;
    const size_t kvrow = (size_t)NH * d;
    float *kb = malloc(sizeof(float) * (size_t)(len + n) * d), *vb = malloc(sizeof(float) * (size_t)(len + n) * d);
    double *sc = malloc(sizeof(double) * (size_t)(len + n)), *ref = malloc(sizeof(double) * d),
           *aref = malloc(sizeof(double) * d);
    assert_true(kb && vb && sc && ref);
    const double inv_sqrt_d = 1.0 / sqrt((double)d);
    char name[128];
    for (int h = 0; h < NH; h++) {
        fr_kv_view view;
        FR_OK_OR_FAIL(fr_kv_gather(r->mirror, r->seqm[seq], l, h, n, ck + (size_t)rec->q_row * kvrow,
                                   cv + (size_t)rec->q_row * kvrow, kb, vb, &view));
        assert_int_equal(view.n_tokens, len + n);
        for (int i = 0; i < n; i++)
            for (int gg = 0; gg < G; gg++) {
                const size_t row = ((size_t)(rec->q_row + i) * H + (size_t)h * G + gg) * d;
                float qq[MAX_D];
                memcpy(qq, q + row, sizeof(float) * d);
                fr_kv_query_form(r->cpu, 1, qq);
                for (int j = 0; j < d; j++) qq[j] = fr_bf16_round(qq[j]);
                const int ctx = len + i + 1;
                double mx = -INFINITY, sum = 0.0;
                for (int t = 0; t < ctx; t++) {
                    double s = 0.0;
                    for (int j = 0; j < d; j++) s += (double)qq[j] * kb[(size_t)t * d + j];
                    sc[t] = s * inv_sqrt_d;
                    if (sc[t] > mx) mx = sc[t];
                }
                for (int j = 0; j < d; j++) ref[j] = aref[j] = 0.0;
                for (int t = 0; t < ctx; t++) {
                    const double p = exp(sc[t] - mx);
                    sum += p;
                    for (int j = 0; j < d; j++) {
                        ref[j] += p * vb[(size_t)t * d + j];
                        aref[j] += p * fabs(vb[(size_t)t * d + j]);
                    }
                }
                double max_ref = 0.0;
                for (int j = 0; j < d; j++) {
                    ref[j] /= sum;
                    aref[j] /= sum;
                    if (fabs(ref[j]) > max_ref) max_ref = fabs(ref[j]);
                }
                double worst_excess = -1.0;
                int worst = 0;
                for (int j = 0; j < d; j++) {
                    const double gv = fr_bf16_decode(out[row + j]);
                    if (isnan(gv))
                        fail_msg("%s layer %d seq %d (len %d, chunk %d) token %d head %d channel %d: GPU output is NaN",
                                 rig_name(r, name, sizeof name), l, seq, len, n, len + i, h * G + gg, j);
                    const double diff = fabs(gv - ref[j]);
                    const double lim = TOL * max_ref + BF16_U * (aref[j] + fabs(ref[j]));
                    if (diff / lim > worst_excess) {
                        worst_excess = diff / lim;
                        worst = j;
                    }
                }
                if (worst_excess > r->worst_use) r->worst_use = worst_excess;
                if (worst_excess > 1.0)
                    fail_msg("%s layer %d seq %d (len %d, chunk %d) token %d head %d channel %d: |gpu - ref| %.4g "
                             "(gpu %.6g, ref %.6g, sum p|v| / sum p %.4g) > %.0e x max |ref| %.4g + 2^-8 x "
                             "(sum p|v| / sum p + |ref|)",
                             rig_name(r, name, sizeof name), l, seq, len, n, len + i, h * G + gg, worst,
                             fabs(fr_bf16_decode(out[row + worst]) - ref[worst]), fr_bf16_decode(out[row + worst]),
                             ref[worst], aref[worst], TOL, max_ref);
                r->compared++;
            }
    }
    free(kb);
    free(vb);
    free(sc);
    free(ref);
    free(aref);
}

/* Output rows the call must leave alone: unused rows and decode rows. */
static void check_untouched(rig *r, int l, int row0, int n_rows, const uint16_t *out, const char *what)
{
    const size_t w = (size_t)r->n_heads * r->cs.d;
    for (size_t i = (size_t)row0 * w; i < (size_t)(row0 + n_rows) * w; i++)
        if (out[i] != OUT_SENTINEL) {
            char name[128];
            fail_msg("%s layer %d: output row %zu (%s) was written", rig_name(r, name, sizeof name), l, i / w, what);
        }
}

/* ---- a step, both sides ---- */

static void run_attention(rig *r, const fr_paged_kv *view, int n_items, int max_new, int max_ctx)
{
    if (!r->cs.graph) {
        FR_OK_OR_FAIL(fr_attn_fp4_prefill(&r->acfg, view, r->d_seqs, n_items, max_new, max_ctx, r->d_q, r->d_out,
                                          r->n_heads, r->d_ws, r->ws_bytes, r->stream));
        return;
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeGlobal));
    const fr_status st = fr_attn_fp4_prefill(&r->acfg, view, r->d_seqs, n_items, max_new, max_ctx, r->d_q,
                                             r->d_out, r->n_heads, r->d_ws, r->ws_bytes, r->stream);
    CUDA_OK(cudaStreamEndCapture(r->stream, &graph));
    if (st != FR_OK) fail_msg("fr_attn_fp4_prefill under capture: %s", fr_last_error());
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, r->stream));
    CUDA_OK(cudaStreamSynchronize(r->stream));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
}

/* Reserves (the CPU cache owns the block tables), uploads the records with q
 * rows in reverse item order after GAP unused rows, then per layer: stage,
 * attention, commit on the GPU, and the reference for every chunk; then the
 * same tokens are appended on the CPU (raw) and the mirror (store form). */
static void rig_step(rig *r, const step_item *items, int n_items)
{
    const int d = r->cs.d, H = r->n_heads;
    const size_t kvrow = (size_t)NH * d, qrow = (size_t)H * d;
    fr_paged_seq recs[MAX_SEQS];
    int rows = GAP, max_new = 1, max_pages = 1, max_ctx = 1;
    assert_true(n_items <= MAX_SEQS);
    for (int i = n_items - 1; i >= 0; i--) {
        recs[i].q_row = rows;
        rows += items[i].n;
    }
    assert_true(rows <= MAX_ROWS);
    for (int i = 0; i < n_items; i++) {
        const int seq = items[i].seq, n = items[i].n;
        FR_OK_OR_FAIL(fr_kv_reserve(r->cpu, seq, n));
        FR_OK_OR_FAIL(fr_kv_reserve(r->mirror, r->seqm[seq], n));
        int nb = 0;
        const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
        assert_true(blocks && nb <= MAX_PAGES);
        CUDA_OK(cudaMemcpy(r->d_tables + seq * MAX_PAGES, blocks, sizeof(int) * (size_t)nb, cudaMemcpyHostToDevice));
        recs[i].block_table = r->d_tables + seq * MAX_PAGES;
        recs[i].len = fr_kv_seq_len(r->cpu, seq);
        recs[i].n_new = n;
        recs[i].slot = seq;
        if (n > max_new) max_new = n;
        if ((n + T - 1) / T > max_pages) max_pages = (n + T - 1) / T;
        if (recs[i].len + n > max_ctx) max_ctx = recs[i].len + n;
    }
    CUDA_OK(cudaMemcpy(r->d_seqs, recs, sizeof(fr_paged_seq) * (size_t)n_items, cudaMemcpyHostToDevice));

    const size_t per_layer = (size_t)rows * kvrow, q_layer = (size_t)rows * qrow;
    float *K = malloc(sizeof(float) * NL * per_layer), *V = malloc(sizeof(float) * NL * per_layer);
    float *CK = malloc(sizeof(float) * NL * per_layer), *CV = malloc(sizeof(float) * NL * per_layer);
    float *Q = malloc(sizeof(float) * NL * q_layer);
    uint16_t *out = malloc(sizeof(uint16_t) * q_layer);
    assert_true(K && V && CK && CV && Q && out);
    fill_rows(r, K, V, Q, rows);
    memcpy(CK, K, sizeof(float) * NL * per_layer);
    memcpy(CV, V, sizeof(float) * NL * per_layer);

    for (int l = 0; l < NL; l++) {
        const size_t ko = l * per_layer;
        CUDA_OK(cudaMemcpyAsync(r->d_k, K + ko, sizeof(float) * per_layer, cudaMemcpyHostToDevice, r->stream));
        CUDA_OK(cudaMemcpyAsync(r->d_v, V + ko, sizeof(float) * per_layer, cudaMemcpyHostToDevice, r->stream));
        CUDA_OK(cudaMemcpyAsync(r->d_q, Q + l * q_layer, sizeof(float) * q_layer, cudaMemcpyHostToDevice, r->stream));
        CUDA_OK(cudaMemsetAsync(r->d_out, 0xFF, sizeof(uint16_t) * q_layer, r->stream));
        FR_OK_OR_FAIL(fr_kv_store_gpu_stage(r->gpu, l, rows, r->d_k, r->d_v, r->d_sk, r->d_sv, r->stream));
        const fr_paged_kv view = fr_kv_store_gpu_view(r->gpu, l, r->d_sk, r->d_sv);
        run_attention(r, &view, n_items, max_new, max_ctx);
        CUDA_OK(cudaMemcpyAsync(out, r->d_out, sizeof(uint16_t) * q_layer, cudaMemcpyDeviceToHost, r->stream));
        CUDA_OK(cudaStreamSynchronize(r->stream));
        CUDA_OK(cudaGetLastError());
        fr_kv_key_form(r->cpu, l, rows, CK + ko);
        fr_kv_value_form(r->cpu, rows, CV + ko);
        check_staging(r, l, rows, CK + ko, CV + ko);
        FR_OK_OR_FAIL(fr_kv_store_gpu_commit(r->gpu, l, r->d_seqs, n_items, max_pages, r->d_sk, r->d_sv,
                                             r->stream));

        check_untouched(r, l, 0, GAP, out, "unused");
        for (int i = 0; i < n_items; i++) {
            if (items[i].n < 2) check_untouched(r, l, recs[i].q_row, items[i].n, out, "decode");
            else check_chunk(r, l, items[i].seq, &recs[i], CK + ko, CV + ko, Q + l * q_layer, out);
        }
    }
    for (int i = 0; i < n_items; i++) {
        const int seq = items[i].seq, n = items[i].n;
        const size_t o = (size_t)recs[i].q_row * kvrow;
        FR_OK_OR_FAIL(fr_kv_append(r->cpu, seq, n, K + o, V + o, per_layer));
        FR_OK_OR_FAIL(fr_kv_append(r->mirror, r->seqm[seq], n, CK + o, CV + o, per_layer));
    }
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(r->gpu, r->stream));
    for (int i = 0; i < n_items; i++) check_pages(r, items[i].seq);
    free(K);
    free(V);
    free(CK);
    free(CV);
    free(Q);
    free(out);
    r->step++;
}

/* Four sequences, three steps:
 *  1. A 0 -> 300 (pages 0, 1 and a partial page), B 0 -> 128 (ends on a page
 *     end), C 0 -> 7, D 0 -> 1 (a decode row);
 *  2. B 128 -> 328 (starts on a page end), A 300 -> 384 (ends on one),
 *     C a decode row, D 1 -> 20 (crosses the sink end);
 *  3. C 8 -> 258 (the sink end and page 0 complete inside the chunk),
 *     A 384 -> 513 (starts on a page end, crosses one), B 328 -> 388,
 *     D 20 -> 22. */
static void run_case(const case_spec *cs)
{
    rig *r = rig_open(cs);
    enum { A = 0, B = 1, C = 2, D = 3 };
    rig_step(r, (step_item[]){{A, 300}, {B, 128}, {C, 7}, {D, 1}}, 4);
    rig_step(r, (step_item[]){{B, 200}, {A, 84}, {C, 1}, {D, 19}}, 4);
    rig_step(r, (step_item[]){{C, 250}, {A, 129}, {B, 60}, {D, 2}}, 4);
    assert_int_equal(fr_kv_seq_len(r->cpu, A), 513);
    assert_true(r->compared > 0);
    print_message("%s recipe %s d %d G %d%s: %ld (token, head) rows match, worst %.2f of the limit\n",
                  fr_kv_dtype_name(cs->dt), cs->recipe,
                  cs->d, cs->G, cs->graph ? " (CUDA graph)" : "", r->compared, r->worst_use);
    rig_close(r);
}

static void test_nvfp4(void **state)
{
    (void)state;
    REQUIRE_GPU();
    run_case(&(case_spec){FR_KV_NVFP4, "full", 128, 4, 0, 101});
    run_case(&(case_spec){FR_KV_NVFP4, "vanilla", 128, 1, 0, 102});
    run_case(&(case_spec){FR_KV_NVFP4, "full,-sink", 128, 5, 0, 103});
    run_case(&(case_spec){FR_KV_NVFP4, "full,-rotate", 128, 8, 0, 104});
    run_case(&(case_spec){FR_KV_NVFP4, "full", 128, 6, 0, 105});
}

static void test_mxfp4(void **state)
{
    (void)state;
    REQUIRE_GPU();
    run_case(&(case_spec){FR_KV_MXFP4, "full", 128, 4, 0, 201});
    run_case(&(case_spec){FR_KV_MXFP4, "vanilla", 128, 16, 0, 202});
    run_case(&(case_spec){FR_KV_MXFP4, "full,-sink", 128, 2, 0, 203});
    run_case(&(case_spec){FR_KV_MXFP4, "full,-rotate", 128, 7, 0, 204});
}

static void test_fp8(void **state)
{
    (void)state;
    REQUIRE_GPU();
    run_case(&(case_spec){FR_KV_FP8, "full", 128, 4, 0, 301});
    run_case(&(case_spec){FR_KV_FP8, "vanilla", 128, 3, 0, 302});
    run_case(&(case_spec){FR_KV_FP8, "full", 128, 6, 0, 303});
}

static void test_head_dim_64(void **state)
{
    (void)state;
    REQUIRE_GPU();
    run_case(&(case_spec){FR_KV_NVFP4, "full", 64, 4, 0, 401});
    run_case(&(case_spec){FR_KV_MXFP4, "vanilla", 64, 3, 0, 402});
    run_case(&(case_spec){FR_KV_MXFP4, "full,-sink", 64, 16, 0, 403});
    run_case(&(case_spec){FR_KV_FP8, "full", 64, 1, 0, 404});
}

static void test_graph_capture(void **state)
{
    (void)state;
    REQUIRE_GPU();
    run_case(&(case_spec){FR_KV_NVFP4, "full", 128, 4, 1, 501});
    run_case(&(case_spec){FR_KV_MXFP4, "vanilla", 128, 4, 1, 502});
}

/* ---- argument checks (refused before any device work: no GPU needed) ---- */

static void test_bad_arguments(void **state)
{
    (void)state;
    static float fake_f[64];
    static uint16_t fake_u[64] __attribute__((aligned(16)));
    static uint8_t pool[64] __attribute__((aligned(16)));
    fr_paged_seq seqs[1] = {{0}};
    fr_paged_kv kv = {.pool = pool, .block_bytes = 18432, .head_page_bytes = 18432, .k_codes = 0,
                      .k_scales = 8192, .v_codes = 9216, .v_scales = 17408, .recent = fake_u, .sink = fake_u,
                      .slot_elems = 1024, .sink_elems = 1024, .step_k = fake_u, .step_v = fake_u,
                      .layer = 0, .n_layers = 1, .n_kv_heads = 2, .head_dim = 128};
    fr_recipe rc = fr_recipe_full();
    fr_ref_config rf = fr_ref_config_default(FR_KV_NVFP4);
    rf.recipe = rc;
    fr_attn_fp4_config cfg = {.dtype = FR_KV_NVFP4, .p = fr_ref_attn_params(&rf, 128, 4), .rotate = 1,
                              .sink_recent = 1};
    size_t bytes = 1;
    /* nothing to do: max_new 1 (decode only) */
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 1, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_OK);
    assert_int_equal(fr_attn_fp4_prefill(NULL, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill(&cfg, NULL, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, NULL, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, -1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 0, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    /* heads: 7 over 2, group 17 */
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 7, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 34, NULL, 0, 0), FR_EINVAL);
    /* dtypes without an FP4/FP8 page */
    cfg.dtype = FR_KV_BF16;
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EUNSUPPORTED);
    assert_int_equal(fr_attn_fp4_prefill_workspace_bytes(&cfg, 4, 100, 8, 2, &bytes), FR_EUNSUPPORTED);
    assert_int_equal(bytes, 0);
    cfg.dtype = FR_KV_NVFP4;
    /* head_dim 96 */
    kv.head_dim = 96;
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EUNSUPPORTED);
    kv.head_dim = 128;
    /* FP8 without its scales */
    cfg.dtype = FR_KV_FP8;
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    /* on-the-fly quantization without a workspace big enough */
    cfg.dtype = FR_KV_NVFP4;
    cfg.sink_recent = 0;
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    if (!strstr(fr_last_error(), "workspace")) fail_msg("message '%s' lacks 'workspace'", fr_last_error());
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, pool, sizeof pool, 0),
                     FR_EINVAL);
    /* a page offset that is not a multiple of 16 */
    cfg.sink_recent = 1;
    kv.v_scales = 17400;
    assert_int_equal(fr_attn_fp4_prefill(&cfg, &kv, seqs, 1, 4, 10, fake_f, fake_u, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_prefill_workspace_bytes(&cfg, 4, 100, 8, 2, NULL), FR_EINVAL);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_nvfp4),
                 cmocka_unit_test(test_mxfp4),
                 cmocka_unit_test(test_fp8),
                 cmocka_unit_test(test_head_dim_64),
                 cmocka_unit_test(test_graph_capture))
