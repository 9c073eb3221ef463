/* FP4/FP8 decode attention (attention/attn_fp4.h) against the CPU reference,
 * split by split and combined.
 *
 * Each case builds the same cache twice from the same random post-RoPE K/V
 * (a non-zero key mean, outlier channels, log-normal token scales): on the
 * GPU with the store path (kvcache/kv_store_cuda.h: stage + commit, in
 * chunks) and on the CPU with fr_kv_append. Their pages are byte-identical
 * (tests/gpu/test_kv_store.c), so the CPU's fr_kv_gather gives the
 * reference view of what the kernel reads, with one adjustment: the step's
 * own token is BF16 store form on the GPU (the staging row) and float32 on
 * the CPU, so the reference takes the BF16 store form (and, without
 * sink/recent, quantizes the partial page on the fly from it, as
 * kv_cache.c does). Layer 1 of 2 is attended, so layer offsets matter.
 *
 * Rule: for every (sequence, KV head, split, query head) and channel j,
 * |gpu - ref| <= 1e-3 * max |ref| over the head's channels, plus, where the
 * kernel rounds the unquantized P to FP16 (bf16 compute, FP8), 2^-10 *
 * sum p |v_j| / sum p (see p_rounding). This holds for the split partials
 * the kernel leaves in the workspace, against fr_ref_attn_partial over the
 * same split ranges (LSE within 1e-3), and for the combined BF16 output,
 * less its own BF16 rounding (2^-8 |ref|), against fr_ref_attn_decode with
 * the same split count. The printed figures are max |gpu - ref| / max |ref|.
 * An exact-mode split partial beyond the rule still passes when its
 * difference from the reference lies in the span of one P block's value
 * rows (one_block_flip: a probability or a block scale on a rounding
 * boundary took the other value); the case line then says so. FP8 caches are compared
 * with the whole context as the "quantized" region of the plan (FP8 keeps
 * the query and P unquantized, so the region only decides the split
 * ranges).
 *
 * Matrix: nvfp4 and mxfp4 x exact and bf16 compute x recipes full, vanilla,
 * full,-dual, full,-pscale, full,-sink, and fp8; G = 1, 3, 4, 5, 6, 7, 8, 16; a
 * batch of lengths 0, 1, 15, 16, 17, 127, 128, 129, 1000, 4096 per case;
 * 33000 tokens for a few modes; a CUDA graph captured once and replayed
 * after the cache grew. A timing printout (not asserted) covers batch
 * 1/16/64 at 4K/32K/128K, 32 query / 8 KV heads, d 128. Without a GPU every
 * case but the argument checks is skipped. */
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
#include "attention/microscale.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store_cuda.h"
#include "rollout/monitor/calibrate.h"
#include "rollout/engine/session.h"
#include "tests/unit/test_util.h"

enum { D = 128, T = FR_PAGE_TOKENS, NL = 2, LAYER = 1, CHUNK = 1024, MAX_SEQS = 16 };
static const double TOL = 1e-3;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* ---- numerics modes ---- */

typedef struct {
    fr_kv_dtype dt;
    fr_fp4_compute compute;
    const char *recipe;
} mode;

static const char *mode_name(const mode *m, char *buf, size_t n)
{
    snprintf(buf, n, "%s/%s/%s", fr_kv_dtype_name(m->dt), fr_fp4_compute_name(m->compute), m->recipe);
    return buf;
}

/* ---- a rig: the CPU cache and the GPU store, filled alike ---- */

typedef struct {
    mode m;
    int kvh, G, n_heads, n_seqs;
    fr_kv_cache_config cfg;
    float mean[NL * 8 * D], fp8[NL * 8 * 2];
    fr_kv_cache *cpu;
    fr_kv_store_gpu *gpu;
    fr_test_rng g;
    int seq[MAX_SEQS];
    /* raw rows of the last page of layer LAYER, per sequence: [128][kvh][D] */
    float *ring_k[MAX_SEQS], *ring_v[MAX_SEQS];
    /* the decode step: raw step rows of layer LAYER [n_seqs][kvh][D], queries */
    float *step_k, *step_v, *q;
    /* device */
    float *d_k, *d_v, *d_q, *d_fp8;
    uint16_t *d_sk, *d_sv, *d_out;
    int *d_tables;   /* [MAX_SEQS][max_pages] */
    int max_pages;
    fr_paged_seq *d_seqs;
    fr_paged_seq recs[MAX_SEQS];
    /* real data instead of random rows (test_real_tq6): rows of token t are
     * real_k/real_v [NL][real_n][kvh][D], its queries real_q [real_n][heads][D] */
    const float *real_k, *real_v, *real_q;
    int real_n;
} rig;

static float token_scale(fr_test_rng *g) { return expf(0.5f * fr_test_normal(g)); }

static float channel_noise(fr_test_rng *g, int j)
{
    const float x = fr_test_normal(g);
    return j % 37 == 5 ? 5.0f * x : x;   /* outlier channels */
}

/* Raw rows [NL][rows][kvh][D] of tokens pos[0..rows) from the real capture. */
static void fill_real(rig *r, float *K, float *V, int rows, const int *pos)
{
    const size_t row = (size_t)r->kvh * D;
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < rows; i++) {
            assert_true(pos[i] < r->real_n);
            const size_t src = ((size_t)l * r->real_n + pos[i]) * row, dst = ((size_t)l * rows + i) * row;
            memcpy(K + dst, r->real_k + src, sizeof(float) * row);
            memcpy(V + dst, r->real_v + src, sizeof(float) * row);
        }
}

/* Raw rows [NL][rows][kvh][D]: keys around the key mean, values around 0. */
static void fill_rows(rig *r, float *K, float *V, int rows)
{
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < rows; i++)
            for (int h = 0; h < r->kvh; h++) {
                const size_t o = (((size_t)l * rows + i) * r->kvh + h) * D;
                const float sk = token_scale(&r->g), sv = token_scale(&r->g);
                for (int j = 0; j < D; j++) {
                    K[o + j] = r->mean[((size_t)l * r->kvh + h) * D + j] + sk * channel_noise(&r->g, j);
                    V[o + j] = sv * channel_noise(&r->g, j);
                }
            }
}

static rig *rig_open(const mode *m, int G, int kvh, int n_seqs, int max_len, uint64_t seed)
{
    assert_true(n_seqs <= MAX_SEQS && kvh <= 8);
    rig *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->m = *m;
    r->kvh = kvh;
    r->G = G;
    r->n_heads = G * kvh;
    r->n_seqs = n_seqs;
    r->g.s = seed;
    fr_recipe rc;
    FR_OK_OR_FAIL(fr_recipe_parse(m->recipe, &rc));
    for (int i = 0; i < NL * kvh * D; i++) r->mean[i] = 0.5f * fr_test_normal(&r->g) + 0.3f;
    for (int i = 0; i < NL * kvh; i++) {
        r->fp8[2 * i] = 0.03f + 0.01f * (float)i;
        r->fp8[2 * i + 1] = 0.02f + 0.005f * (float)i;
    }
    r->max_pages = max_len / T + 2;
    r->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = kvh, .head_dim = D, .dtype = m->dt,
                                  .compute = m->compute, .recipe = rc, .tau = FR_P_TAU,
                                  .n_blocks = n_seqs * r->max_pages + 4, .max_seqs = n_seqs,
                                  .key_mean = r->mean, .fp8_scales = r->fp8};
    FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&r->cfg, &r->gpu));
    const size_t row = (size_t)kvh * D;
    CUDA_OK(cudaMalloc((void **)&r->d_k, sizeof(float) * CHUNK * row));
    CUDA_OK(cudaMalloc((void **)&r->d_v, sizeof(float) * CHUNK * row));
    CUDA_OK(cudaMalloc((void **)&r->d_sk, sizeof(uint16_t) * CHUNK * row));
    CUDA_OK(cudaMalloc((void **)&r->d_sv, sizeof(uint16_t) * CHUNK * row));
    CUDA_OK(cudaMalloc((void **)&r->d_q, sizeof(float) * n_seqs * r->n_heads * D));
    CUDA_OK(cudaMalloc((void **)&r->d_out, sizeof(uint16_t) * n_seqs * r->n_heads * D));
    CUDA_OK(cudaMalloc((void **)&r->d_fp8, sizeof(float) * NL * kvh * 2));
    CUDA_OK(cudaMemcpy(r->d_fp8, r->fp8, sizeof(float) * NL * kvh * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&r->d_tables, sizeof(int) * MAX_SEQS * r->max_pages));
    CUDA_OK(cudaMalloc((void **)&r->d_seqs, sizeof(fr_paged_seq) * MAX_SEQS));
    r->step_k = xmalloc(sizeof(float) * NL * n_seqs * row);
    r->step_v = xmalloc(sizeof(float) * NL * n_seqs * row);
    r->q = xmalloc(sizeof(float) * n_seqs * r->n_heads * D);
    for (int s = 0; s < n_seqs; s++) {
        FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &r->seq[s]));
        r->ring_k[s] = xmalloc(sizeof(float) * T * row);
        r->ring_v[s] = xmalloc(sizeof(float) * T * row);
    }
    return r;
}

static void rig_close(rig *r)
{
    for (int s = 0; s < r->n_seqs; s++) { free(r->ring_k[s]); free(r->ring_v[s]); }
    free(r->step_k); free(r->step_v); free(r->q);
    cudaFree(r->d_k); cudaFree(r->d_v); cudaFree(r->d_sk); cudaFree(r->d_sv); cudaFree(r->d_q);
    cudaFree(r->d_out); cudaFree(r->d_fp8); cudaFree(r->d_tables); cudaFree(r->d_seqs);
    fr_kv_store_gpu_destroy(&r->gpu);
    fr_kv_cache_destroy(&r->cpu);
    free(r);
}

static void upload_table(rig *r, int s)
{
    int nb = 0;
    const int *blocks = fr_kv_seq_blocks(r->cpu, r->seq[s], &nb);
    assert_true(blocks && nb <= r->max_pages);
    if (nb)
        CUDA_OK(cudaMemcpy(r->d_tables + s * r->max_pages, blocks, sizeof(int) * nb, cudaMemcpyHostToDevice));
}

/* Appends n tokens to sequence s on both sides, in chunks. */
static void rig_grow(rig *r, int s, int n)
{
    const size_t row = (size_t)r->kvh * D;
    float *K = xmalloc(sizeof(float) * NL * CHUNK * row), *V = xmalloc(sizeof(float) * NL * CHUNK * row);
    for (int done = 0; done < n;) {
        const int rows = n - done < CHUNK ? n - done : CHUNK, seq = r->seq[s];
        const int len = fr_kv_seq_len(r->cpu, seq);
        if (r->real_k) {
            int *pos = xmalloc(sizeof(int) * (size_t)rows);
            for (int i = 0; i < rows; i++) pos[i] = len + i;
            fill_real(r, K, V, rows, pos);
            free(pos);
        } else {
            fill_rows(r, K, V, rows);
        }
        FR_OK_OR_FAIL(fr_kv_reserve(r->cpu, seq, rows));
        upload_table(r, s);
        const fr_paged_seq rec = {.block_table = r->d_tables + s * r->max_pages, .len = len, .n_new = rows,
                                  .q_row = 0, .slot = seq};
        CUDA_OK(cudaMemcpy(r->d_seqs, &rec, sizeof rec, cudaMemcpyHostToDevice));
        for (int l = 0; l < NL; l++) {
            const size_t off = (size_t)l * rows * row;
            CUDA_OK(cudaMemcpy(r->d_k, K + off, sizeof(float) * rows * row, cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(r->d_v, V + off, sizeof(float) * rows * row, cudaMemcpyHostToDevice));
            FR_OK_OR_FAIL(fr_kv_store_gpu_stage(r->gpu, l, rows, r->d_k, r->d_v, r->d_sk, r->d_sv, 0));
            FR_OK_OR_FAIL(fr_kv_store_gpu_commit(r->gpu, l, r->d_seqs, 1, (rows + T - 1) / T, r->d_sk, r->d_sv, 0));
        }
        FR_OK_OR_FAIL(fr_kv_append(r->cpu, seq, rows, K, V, (size_t)rows * row));
        for (int i = 0; i < rows; i++) {   /* the last page's raw rows of layer LAYER */
            const int t = (len + i) % T;
            memcpy(r->ring_k[s] + (size_t)t * row, K + ((size_t)LAYER * rows + i) * row, sizeof(float) * row);
            memcpy(r->ring_v[s] + (size_t)t * row, V + ((size_t)LAYER * rows + i) * row, sizeof(float) * row);
        }
        done += rows;
    }
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(r->gpu, 0));
    free(K); free(V);
}

/* The decode step: new K/V rows (staged for layer LAYER), queries, records. */
static void rig_step(rig *r)
{
    const size_t row = (size_t)r->kvh * D;
    float *K = xmalloc(sizeof(float) * NL * r->n_seqs * row), *V = xmalloc(sizeof(float) * NL * r->n_seqs * row);
    int pos[MAX_SEQS];
    for (int s = 0; s < r->n_seqs; s++) pos[s] = fr_kv_seq_len(r->cpu, r->seq[s]);
    if (r->real_k) fill_real(r, K, V, r->n_seqs, pos);
    else fill_rows(r, K, V, r->n_seqs);
    memcpy(r->step_k, K + (size_t)LAYER * r->n_seqs * row, sizeof(float) * r->n_seqs * row);
    memcpy(r->step_v, V + (size_t)LAYER * r->n_seqs * row, sizeof(float) * r->n_seqs * row);
    CUDA_OK(cudaMemcpy(r->d_k, r->step_k, sizeof(float) * r->n_seqs * row, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(r->d_v, r->step_v, sizeof(float) * r->n_seqs * row, cudaMemcpyHostToDevice));
    FR_OK_OR_FAIL(fr_kv_store_gpu_stage(r->gpu, LAYER, r->n_seqs, r->d_k, r->d_v, r->d_sk, r->d_sv, 0));
    if (r->real_q) {
        for (int s = 0; s < r->n_seqs; s++)
            memcpy(r->q + (size_t)s * r->n_heads * D, r->real_q + (size_t)pos[s] * r->n_heads * D,
                   sizeof(float) * r->n_heads * D);
    } else {
        for (size_t i = 0; i < (size_t)r->n_seqs * r->n_heads * D; i++) r->q[i] = fr_test_normal(&r->g);
    }
    CUDA_OK(cudaMemcpy(r->d_q, r->q, sizeof(float) * r->n_seqs * r->n_heads * D, cudaMemcpyHostToDevice));
    for (int s = 0; s < r->n_seqs; s++) {
        upload_table(r, s);
        r->recs[s] = (fr_paged_seq){.block_table = r->d_tables + s * r->max_pages,
                                    .len = fr_kv_seq_len(r->cpu, r->seq[s]), .n_new = 1, .q_row = s,
                                    .slot = r->seq[s]};
    }
    CUDA_OK(cudaMemcpy(r->d_seqs, r->recs, sizeof(fr_paged_seq) * r->n_seqs, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(r->d_out, 0xFF, sizeof(uint16_t) * r->n_seqs * r->n_heads * D));
    free(K); free(V);
}

static fr_attn_fp4_config kernel_config(const rig *r)
{
    const int fp4 = fr_kv_dtype_is_fp4(r->m.dt);
    return (fr_attn_fp4_config){.dtype = r->m.dt, .p = fr_kv_attn_params(r->cpu, r->G),
                                .rotate = fp4 && r->cfg.recipe.rotate,
                                .sink_recent = fp4 && r->cfg.recipe.sink_recent,
                                .fp8_scales = r->m.dt == FR_KV_FP8 ? r->d_fp8 : NULL};
}

/* ---- the reference view ---- */

/* Unpaged tokens as a page would hold them (kv_cache.c quantize_on_the_fly). */
static void quantize_on_the_fly(const rig *r, int head, int n, float *k, float *v)
{
    if (r->m.dt == FR_KV_FP8) {
        const float *sc = r->fp8 + ((size_t)LAYER * r->kvh + head) * 2;
        for (int i = 0; i < n * D; i++) {
            k[i] = sc[0] * fr_e4m3_round(k[i] / sc[0]);
            v[i] = sc[1] * fr_e4m3_round(v[i] / sc[1]);
        }
        return;
    }
    const fr_fp4_format f = fr_kv_dtype_fp4_format(r->m.dt);
    const int B = fr_fp4_block_size(f);
    for (int t = 0; t < n; t++) fr_fp4_fake_quantize(f, r->cfg.recipe.scale_search, k + (size_t)t * D, D, k + (size_t)t * D);
    float col[FR_MAX_FP4_BLOCK];
    for (int a = 0; a < n; a += B)
        for (int j = 0; j < D; j++) {
            for (int i = 0; i < B; i++) col[i] = a + i < n ? v[(size_t)(a + i) * D + j] : 0.0f;
            fr_fp4_fake_quantize(f, 0, col, B, col);
            for (int i = 0; i < B && a + i < n; i++) v[(size_t)(a + i) * D + j] = col[i];
        }
}

/* BF16 store form of raw rows [n][kvh][D] of layer LAYER, head `head` -> out [n][D]. */
static void store_form(const rig *r, const float *k_raw, const float *v_raw, int n, int head, float *k_out,
                       float *v_out)
{
    const size_t row = (size_t)r->kvh * D;
    float *k = xmalloc(sizeof(float) * n * row), *v = xmalloc(sizeof(float) * n * row);
    memcpy(k, k_raw, sizeof(float) * n * row);
    memcpy(v, v_raw, sizeof(float) * n * row);
    fr_kv_key_form(r->cpu, LAYER, n, k);
    fr_kv_value_form(r->cpu, n, v);
    for (int i = 0; i < n; i++) {
        memcpy(k_out + (size_t)i * D, k + (size_t)i * row + (size_t)head * D, sizeof(float) * D);
        memcpy(v_out + (size_t)i * D, v + (size_t)i * row + (size_t)head * D, sizeof(float) * D);
    }
    free(k); free(v);
}

/* What the kernel reads for (sequence s, KV head): k/v [len + 1][D], view. */
static void reference_view(const rig *r, int s, int head, float *k, float *v, fr_kv_view *view)
{
    const size_t row = (size_t)r->kvh * D;
    const int len = fr_kv_seq_len(r->cpu, r->seq[s]), n = len + 1, full = len / T * T;
    FR_OK_OR_FAIL(fr_kv_gather(r->cpu, r->seq[s], LAYER, head, 1, r->step_k + (size_t)s * row,
                               r->step_v + (size_t)s * row, k, v, view));
    const int keeps = fr_kv_dtype_is_fp4(r->m.dt) && r->cfg.recipe.sink_recent;
    if (keeps) {   /* the step token as staged: BF16 store form */
        store_form(r, r->step_k + (size_t)s * row, r->step_v + (size_t)s * row, 1, head, k + (size_t)len * D,
                   v + (size_t)len * D);
        return;
    }
    /* the partial page from the BF16 store form of its raw rows, then
     * quantized on the fly */
    for (int t = full; t < len; t++)
        store_form(r, r->ring_k[s] + (size_t)(t % T) * row, r->ring_v[s] + (size_t)(t % T) * row, 1, head,
                   k + (size_t)t * D, v + (size_t)t * D);
    store_form(r, r->step_k + (size_t)s * row, r->step_v + (size_t)s * row, 1, head, k + (size_t)len * D,
               v + (size_t)len * D);
    quantize_on_the_fly(r, head, n - full, k + (size_t)full * D, v + (size_t)full * D);
    if (r->m.dt == FR_KV_FP8) view->fp4_end = n;   /* the plan's split ranges cover everything */
}

/* ---- run and check ---- */

static int max_ctx_of(const rig *r)
{
    int m = 1;
    for (int s = 0; s < r->n_seqs; s++)
        if (r->recs[s].len + 1 > m) m = r->recs[s].len + 1;
    return m;
}

/* exact compute quantizes P exactly as the reference does; the other modes
 * keep P unquantized but round it to FP16 for the P.V MMA (2^-11 relative),
 * which moves channel j by up to 2^-11 sum p |v_j| / sum p (and as much
 * again through the float32 row sum of the unrounded P). */
static double p_rounding(const rig *r)
{
    return r->m.compute == FR_COMPUTE_EXACT && r->m.dt != FR_KV_FP8 ? 0.0 : ldexp(1.0, -10);
}

/* Channel error beyond what the row may have: TOL of the row's largest
 * |ref| and the P rounding of p_rounding() on the channel's sum p |v|. */
static double excess(double diff, double ref_max, double u, double abs_ref)
{
    return diff - (TOL * ref_max + u * abs_ref + 1e-6);
}

/* Exact compute quantizes P to FP4 as the reference does, but its logits
 * come from FP32 MMAs, not the reference's double sums: a probability that
 * sits on an E2M1 rounding boundary may take the neighbouring code, or a
 * block's maximum on an E4M3 scale boundary the neighbouring scale. The
 * partial then differs from the reference by a combination of the value rows
 * of one probability block. Such a split partial is accepted when its
 * difference lies, to 2%, in the span of one block's value rows (least
 * squares over the head's channels, every block of the split tried); *blk
 * names the block's first token and *fit the residual share. A kernel error
 * spread over the split does not leave that shape. */
static int one_block_flip(const fr_kv_view *view, int t0, int t1, int x0, int x1, int bs, const float *gpu,
                          const float *ref, int *blk, double *fit)
{
    double diff[D], dd = 0.0;
    for (int j = 0; j < D; j++) {
        diff[j] = (double)gpu[j] - ref[j];
        dd += diff[j] * diff[j];
    }
    *blk = -1;
    *fit = 1.0;
    if (dd == 0.0) return 0;
    for (int b0 = t0 - t0 % bs; b0 < t1; b0 += bs) {
        const float *rows[32];
        int n = 0;
        for (int t = b0; t < b0 + bs && t < t1; t++)
            if (t >= t0 && !(t >= x0 && t < x1)) rows[n++] = view->v + (size_t)t * D;
        if (n == 0) continue;
        /* normal equations A x = c, A = V V^T (+ a tiny ridge), c = V diff; Cholesky */
        double A[32][32], c[32], L[32][32], y[32];
        for (int i = 0; i < n; i++) {
            c[i] = 0.0;
            for (int j = 0; j < D; j++) c[i] += rows[i][j] * diff[j];
            for (int k = 0; k <= i; k++) {
                double sum = 0.0;
                for (int j = 0; j < D; j++) sum += (double)rows[i][j] * rows[k][j];
                A[i][k] = A[k][i] = sum;
            }
            A[i][i] *= 1.0 + 1e-9;
        }
        int ok = 1;
        for (int i = 0; i < n && ok; i++)
            for (int k = 0; k <= i; k++) {
                double sum = A[i][k];
                for (int m = 0; m < k; m++) sum -= L[i][m] * L[k][m];
                if (i == k) {
                    if (sum <= 0.0) ok = 0;
                    else L[i][i] = sqrt(sum);
                } else {
                    L[i][k] = sum / L[k][k];
                }
            }
        if (!ok) continue;
        for (int i = 0; i < n; i++) {   /* L y = c; the explained energy is |y|^2 */
            double sum = c[i];
            for (int m = 0; m < i; m++) sum -= L[i][m] * y[m];
            y[i] = sum / L[i][i];
        }
        double expl = 0.0;
        for (int i = 0; i < n; i++) expl += y[i] * y[i];
        const double res = (dd - expl) / dd;
        if (res < *fit) {
            *fit = res;
            *blk = b0;
        }
    }
    return *fit <= 4e-4;   /* residual within 2% of the difference (in norm) */
}

/* Compares every split partial and the combined output; returns failures. */
static int check(rig *r, void *ws, const fr_attn_fp4_plan *plan, const char *what)
{
    char name[96];
    mode_name(&r->m, name, sizeof name);
    const int G = r->G, S = plan->n_splits, slots = S + 1, H = r->n_heads;
    const size_t n_rows = (size_t)r->n_seqs * r->kvh * slots * G;
    float *o_part = xmalloc(sizeof(float) * n_rows * D), *lse_part = xmalloc(sizeof(float) * n_rows);
    uint16_t *out = xmalloc(sizeof(uint16_t) * r->n_seqs * H * D);
    CUDA_OK(cudaMemcpy(o_part, (char *)ws + plan->o_part_offset, sizeof(float) * n_rows * D, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse_part, (char *)ws + plan->lse_part_offset, sizeof(float) * n_rows, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(out, r->d_out, sizeof(uint16_t) * r->n_seqs * H * D, cudaMemcpyDeviceToHost));
    const fr_attn_params p = fr_kv_attn_params(r->cpu, G);
    double worst_split = 0.0, worst_out = 0.0;
    const double u = p_rounding(r);
    int bad = 0, flips = 0;
    for (int s = 0; s < r->n_seqs; s++) {
        const int len = r->recs[s].len, n = len + 1;
        float *k = xmalloc(sizeof(float) * (size_t)n * D), *v = xmalloc(sizeof(float) * (size_t)n * D);
        float *v_abs = xmalloc(sizeof(float) * (size_t)n * D);
        float qg[FR_MAX_GROUP * D], o_ref[FR_MAX_GROUP * D], lse_ref[FR_MAX_GROUP];
        float o_abs[FR_MAX_GROUP * D], lse_abs[FR_MAX_GROUP];
        for (int head = 0; head < r->kvh; head++) {
            fr_kv_view view;
            reference_view(r, s, head, k, v, &view);
            /* the same attention over |v|: sum p |v_j| / sum p, what P rounding scales with */
            for (size_t e = 0; e < (size_t)n * D; e++) v_abs[e] = fabsf(v[e]);
            fr_kv_view view_abs = view;
            view_abs.v = v_abs;
            memcpy(qg, r->q + ((size_t)s * H + (size_t)head * G) * D, sizeof(float) * G * D);
            fr_kv_query_form(r->cpu, G, qg);
            for (int i = 0; i < slots; i++) {
                int t0, t1, x0, x1;
                fr_ref_split_range(&view, T, S, i, &t0, &t1, &x0, &x1);
                FR_OK_OR_FAIL(fr_ref_attn_partial(&p, qg, &view, t0, t1, x0, x1, i < S, o_ref, lse_ref));
                FR_OK_OR_FAIL(fr_ref_attn_partial(&p, qg, &view_abs, t0, t1, x0, x1, i < S, o_abs, lse_abs));
                const size_t base = (((size_t)s * r->kvh + head) * slots + i) * G;
                for (int h = 0; h < G; h++) {
                    double mref = 0.0, mdiff = 0.0, over = -1.0;
                    int nan = 0;
                    for (int j = 0; j < D; j++) mref = fmax(mref, fabs(o_ref[h * D + j]));
                    for (int j = 0; j < D; j++) {
                        const double gv = o_part[(base + h) * D + j], rv = o_ref[h * D + j];
                        if (isnan(gv)) nan = 1;
                        mdiff = fmax(mdiff, fabs(gv - rv));
                        over = fmax(over, excess(fabs(gv - rv), mref, u, o_abs[h * D + j]));
                    }
                    const float gl = lse_part[base + h], rl = lse_ref[h];
                    const int lse_bad = isinf(rl) ? !(isinf(gl) && gl < 0) : !(fabsf(gl - rl) <= 1e-3f);
                    const double ratio = mdiff / fmax(mref, 1e-30);
                    if (ratio > worst_split && mref > 0) worst_split = ratio;
                    int ftok = -1;
                    double alpha = 1.0;   /* the fit's residual share */
                    if (!nan && !lse_bad && over > 0 && i < S && u == 0.0 &&
                        one_block_flip(&view, t0, t1, x0, x1, r->m.dt == FR_KV_MXFP4 ? 32 : 16, o_part + (base + h) * D,
                                       o_ref + h * D, &ftok, &alpha)) {
                        if (flips++ < 4)
                            printf("  %s %s G=%d: seq %d kv head %d split %d head %d: max|diff| %.3g of max|ref| %.3g "
                                   "lies in the span of the value rows of the P block at token %d (residual %.2g): "
                                   "a rounding boundary of that block's P\n",
                                   name, what, G, s, head, i, h, mdiff, mref, ftok, sqrt(alpha));
                        continue;
                    }
                    if (nan || over > 0 || lse_bad) {
                        if (bad++ < 8)
                            fprintf(stderr,
                                    "  %s %s G=%d: seq %d len %d kv head %d split %d/%d [%d, %d) mask [%d, %d) "
                                    "head %d: max|diff| %.3g max|ref| %.3g lse gpu %.6g ref %.6g%s (closest one-block "
                                    "shape: block at token %d, residual %.2g)\n",
                                    name, what, G, s, len, head, i, S, t0, t1, x0, x1, h, mdiff, mref, gl, rl,
                                    nan ? " (NaN)" : "", ftok, sqrt(alpha));
                    }
                }
            }
            FR_OK_OR_FAIL(fr_ref_attn_decode(&p, qg, &view, S, o_ref, lse_ref));
            FR_OK_OR_FAIL(fr_ref_attn_decode(&p, qg, &view_abs, S, o_abs, lse_abs));
            for (int h = 0; h < G; h++) {
                double mref = 0.0, mdiff = 0.0, over = -1.0;
                int nan = 0;
                const uint16_t *o = out + ((size_t)s * H + (size_t)head * G + h) * D;
                for (int j = 0; j < D; j++) mref = fmax(mref, fabs(o_ref[h * D + j]));
                for (int j = 0; j < D; j++) {
                    const double gv = fr_bf16_decode(o[j]), rv = o_ref[h * D + j];
                    if (isnan(gv)) nan = 1;
                    const double d = fabs(gv - rv) - ldexp(fabs(rv), -8);   /* less the output rounding */
                    mdiff = fmax(mdiff, d > 0 ? d : 0);
                    over = fmax(over, excess(d > 0 ? d : 0, mref, u, o_abs[h * D + j]));
                }
                if (mref > 0 && mdiff / mref > worst_out) worst_out = mdiff / mref;
                if (nan || over > 0) {
                    if (bad++ < 8)
                        fprintf(stderr, "  %s %s G=%d: seq %d len %d kv head %d head %d combined: max|diff| %.3g "
                                        "(beyond BF16 rounding) max|ref| %.3g%s\n",
                                name, what, G, s, len, head, h, mdiff, mref, nan ? " (NaN)" : "");
                }
            }
        }
        free(k); free(v); free(v_abs);
    }
    printf("  %-28s %-22s G=%2d %3d splits: worst split %.2e, combined %.2e of max|o| (limit %.0e)%s%s\n", name,
           what, G, S, worst_split, worst_out, TOL, flips ? " (rounding-boundary flips accepted)" : "",
           bad ? "  FAILED" : "");
    free(o_part); free(lse_part); free(out);
    return bad;
}

static void *workspace_for(rig *r, int max_ctx, size_t *bytes)
{
    fr_attn_fp4_config kc = kernel_config(r);
    FR_OK_OR_FAIL(fr_attn_fp4_workspace_bytes(&kc, r->n_seqs, r->n_heads, r->kvh, max_ctx, bytes));
    void *ws = NULL;
    CUDA_OK(cudaMalloc(&ws, *bytes ? *bytes : 256));
    return ws;
}

static void run_decode(rig *r, int max_ctx, void *ws, size_t ws_bytes, fr_attn_fp4_plan *plan, cudaStream_t st)
{
    fr_attn_fp4_config kc = kernel_config(r);
    const fr_paged_kv view = fr_kv_store_gpu_view(r->gpu, LAYER, r->d_sk, r->d_sv);
    FR_OK_OR_FAIL(fr_attn_fp4_plan_for(&kc, r->n_seqs, r->n_heads, r->kvh, D, max_ctx, ws_bytes, plan));
    FR_OK_OR_FAIL(fr_attn_fp4_decode(&kc, &view, r->d_seqs, r->n_seqs, max_ctx, r->d_q, r->d_out, r->n_heads, ws,
                                     ws_bytes, st));
}

/* Builds a batch of the given lengths, decodes once, checks. */
static int run_case(const mode *m, int G, const int *lens, int n, uint64_t seed, const char *what)
{
    int max_len = 1;
    for (int i = 0; i < n; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    rig *r = rig_open(m, G, 2, n, max_len + 1, seed);
    for (int s = 0; s < n; s++) rig_grow(r, s, lens[s]);
    rig_step(r);
    size_t ws_bytes;
    const int max_ctx = max_ctx_of(r);
    void *ws = workspace_for(r, max_ctx, &ws_bytes);
    fr_attn_fp4_plan plan;
    run_decode(r, max_ctx, ws, ws_bytes, &plan, 0);
    CUDA_OK(cudaDeviceSynchronize());
    const int bad = check(r, ws, &plan, what);
    cudaFree(ws);
    rig_close(r);
    return bad;
}

static const int GROUPS[] = {1, 3, 4, 5, 6, 7, 8, 16};
static const int LENS[] = {0, 1, 15, 16, 17, 127, 128, 129, 1000, 4096};
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const char *const RECIPES[] = {"full", "vanilla", "full,-dual", "full,-pscale", "full,-sink"};

static void mode_matrix(fr_kv_dtype dt, fr_fp4_compute c, uint64_t seed)
{
    REQUIRE_GPU();
    int bad = 0;
    for (int ri = 0; ri < N_OF(RECIPES); ri++) {
        const mode m = {dt, c, RECIPES[ri]};
        for (int gi = 0; gi < N_OF(GROUPS); gi++)
            bad += run_case(&m, GROUPS[gi], LENS, N_OF(LENS), seed++, "mixed lengths");
    }
    assert_int_equal(bad, 0);
}

static void test_nvfp4_exact(void **state) { (void)state; mode_matrix(FR_KV_NVFP4, FR_COMPUTE_EXACT, 100); }
static void test_nvfp4_bf16(void **state) { (void)state; mode_matrix(FR_KV_NVFP4, FR_COMPUTE_BF16, 200); }
static void test_mxfp4_exact(void **state) { (void)state; mode_matrix(FR_KV_MXFP4, FR_COMPUTE_EXACT, 300); }
static void test_mxfp4_bf16(void **state) { (void)state; mode_matrix(FR_KV_MXFP4, FR_COMPUTE_BF16, 400); }

static void test_fp8(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const mode m = {FR_KV_FP8, FR_COMPUTE_EXACT, "full"};
    int bad = 0;
    for (int gi = 0; gi < N_OF(GROUPS); gi++) bad += run_case(&m, GROUPS[gi], LENS, N_OF(LENS), 500 + gi, "mixed lengths");
    assert_int_equal(bad, 0);
}

/* 33000 tokens: many splits at batch 1, and next to short sequences. */
static void test_long(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const mode modes[] = {{FR_KV_NVFP4, FR_COMPUTE_EXACT, "full"}, {FR_KV_NVFP4, FR_COMPUTE_BF16, "full"},
                                 {FR_KV_MXFP4, FR_COMPUTE_EXACT, "full"}, {FR_KV_MXFP4, FR_COMPUTE_BF16, "full"},
                                 {FR_KV_NVFP4, FR_COMPUTE_EXACT, "vanilla"}, {FR_KV_FP8, FR_COMPUTE_EXACT, "full"}};
    static const int one[] = {33000}, mix[] = {33000, 5, 129, 2000};
    int bad = 0;
    for (int i = 0; i < N_OF(modes); i++) {
        bad += run_case(&modes[i], 4, one, 1, 600 + i, "batch 1 len 33000");
        if (i < 2) bad += run_case(&modes[i], 8, mix, N_OF(mix), 610 + i, "33000 with short ones");
    }
    assert_int_equal(bad, 0);
}

/* Captured once, replayed after every sequence grew (new lengths, new
 * pages, new block tables in the same device arrays). */
static void test_graph_replay(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const mode modes[] = {{FR_KV_NVFP4, FR_COMPUTE_EXACT, "full"}, {FR_KV_MXFP4, FR_COMPUTE_BF16, "vanilla"},
                                 {FR_KV_FP8, FR_COMPUTE_EXACT, "full"}};
    static const int lens[] = {100, 2000, 15};
    static const int grow[] = {300, 1, 130};
    int bad = 0;
    for (int mi = 0; mi < N_OF(modes); mi++) {
        rig *r = rig_open(&modes[mi], 4, 2, 3, 2500, 700 + mi);
        for (int s = 0; s < 3; s++) rig_grow(r, s, lens[s]);
        rig_step(r);
        const int max_ctx = 2001;   /* the bound the graph is captured with */
        size_t ws_bytes;
        void *ws = workspace_for(r, max_ctx, &ws_bytes);
        cudaStream_t st;
        CUDA_OK(cudaStreamCreate(&st));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        fr_attn_fp4_plan plan;
        CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        fr_attn_fp4_config kc = kernel_config(r);
        const fr_paged_kv view = fr_kv_store_gpu_view(r->gpu, LAYER, r->d_sk, r->d_sv);
        const fr_status s1 = fr_attn_fp4_plan_for(&kc, 3, r->n_heads, r->kvh, D, max_ctx, ws_bytes, &plan);
        const fr_status s2 = fr_attn_fp4_decode(&kc, &view, r->d_seqs, 3, max_ctx, r->d_q, r->d_out, r->n_heads, ws,
                                                ws_bytes, st);
        CUDA_OK(cudaStreamEndCapture(st, &graph));
        if (s1 || s2) fail_msg("decode under capture: %s", fr_last_error());
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        bad += check(r, ws, &plan, "graph, captured");
        for (int s = 0; s < 3; s++) rig_grow(r, s, grow[s]);
        rig_step(r);   /* same device arrays: new lengths, tables, step rows, queries */
        CUDA_OK(cudaGraphLaunch(exec, st));
        CUDA_OK(cudaStreamSynchronize(st));
        bad += check(r, ws, &plan, "graph replay, grown");
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(st);
        cudaFree(ws);
        rig_close(r);
    }
    assert_int_equal(bad, 0);
}

/* ---- real tq6 queries, keys and values ---- */

typedef struct {
    int layer0, n, kvh, heads;
    int at;             /* tokens captured so far (the prefill's position) */
    float *k, *v, *q;   /* k, v: [NL][n][kvh][D]; q: [n][heads][D] of layer layer0 + LAYER */
} capture;

static fr_status cap_kv(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *k, const float *v)
{
    capture *c = user;
    if (layer < c->layer0 || layer >= c->layer0 + NL) return FR_OK;
    const int rows = seqs[0].n, at = c->at;
    (void)n_seqs;
    assert_true(at + rows <= c->n);
    const size_t row = (size_t)c->kvh * D, o = ((size_t)(layer - c->layer0) * c->n + at) * row;
    memcpy(c->k + o, k, sizeof(float) * rows * row);
    memcpy(c->v + o, v, sizeof(float) * rows * row);
    return FR_OK;
}

static fr_status cap_q(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *q)
{
    capture *c = user;
    (void)n_seqs;
    if (layer != c->layer0 + LAYER) return FR_OK;
    memcpy(c->q + (size_t)c->at * c->heads * D, q, sizeof(float) * seqs[0].n * c->heads * D);
    c->at += seqs[0].n;   /* layer layer0 + LAYER is the last one captured */
    return FR_OK;
}

/* tq6 (8 query heads, 2 KV heads of 128: G = 4) run on the CPU over an eval
 * text; layers 4 and 5's post-RoPE keys, values and layer 5's queries are
 * the cache and the queries of the rig (key mean: the capture's own). */
static void test_real_tq6(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const char *dir = fr_test_require_tq6();
    if (!dir) skip();
    enum { N = 1100 };
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, dir, FR_KV_F32);
    fr_session ss;
    FR_OK_OR_FAIL(fr_session_open(&o, N / T + 4, 1, &ss));
    capture c = {.layer0 = 4, .n = N, .kvh = ss.model->cfg.num_kv_heads, .heads = ss.model->cfg.num_heads};
    assert_int_equal(c.kvh, 2);
    assert_int_equal(c.heads, 8);
    c.k = xmalloc(sizeof(float) * NL * N * c.kvh * D);
    c.v = xmalloc(sizeof(float) * NL * N * c.kvh * D);
    c.q = xmalloc(sizeof(float) * N * c.heads * D);
    char path[4200];
    snprintf(path, sizeof path, "%s/texts/eval_3.txt", dir);
    int *ids, n;
    FR_OK_OR_FAIL(fr_byte_text_read(&ss.model->cfg, path, N, &ids, &n));
    assert_int_equal(n, N);
    fr_forward_observer obs = {.user = &c, .layer_kv = cap_kv, .layer_q = cap_q};
    FR_OK_OR_FAIL(fr_runner_set_observer(ss.runner, &obs));
    int seq;
    float *last = xmalloc(sizeof(float) * ss.model->cfg.vocab_size);
    FR_OK_OR_FAIL(fr_session_prefill(&ss, ids, N, 256, &seq, last, NULL));
    assert_int_equal(c.at, N);
    fr_session_close(&ss);
    free(last);
    free(ids);

    static const mode modes[] = {{FR_KV_NVFP4, FR_COMPUTE_EXACT, "full"}, {FR_KV_NVFP4, FR_COMPUTE_BF16, "full"},
                                 {FR_KV_NVFP4, FR_COMPUTE_EXACT, "vanilla"}, {FR_KV_MXFP4, FR_COMPUTE_EXACT, "full"},
                                 {FR_KV_MXFP4, FR_COMPUTE_BF16, "full"}, {FR_KV_FP8, FR_COMPUTE_EXACT, "full"}};
    static const int lens[] = {1000, 129, 17, 300};
    int bad = 0;
    for (int mi = 0; mi < N_OF(modes); mi++) {
        rig *r = rig_open(&modes[mi], 4, 2, N_OF(lens), 1001, 800 + mi);
        r->real_k = c.k;
        r->real_v = c.v;
        r->real_q = c.q;
        r->real_n = N;
        /* the key mean of the captured keys, per layer and head */
        for (int l = 0; l < NL; l++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < D; j++) {
                    double sum = 0.0;
                    for (int t = 0; t < N; t++) sum += c.k[(((size_t)l * N + t) * 2 + h) * D + j];
                    r->mean[((size_t)l * 2 + h) * D + j] = (float)(sum / N);
                }
        fr_kv_cache_destroy(&r->cpu);   /* again with the captured mean */
        fr_kv_store_gpu_destroy(&r->gpu);
        FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
        FR_OK_OR_FAIL(fr_kv_store_gpu_new(&r->cfg, &r->gpu));
        for (int s = 0; s < N_OF(lens); s++) FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &r->seq[s]));
        for (int s = 0; s < N_OF(lens); s++) rig_grow(r, s, lens[s]);
        rig_step(r);
        size_t ws_bytes;
        const int max_ctx = max_ctx_of(r);
        void *ws = workspace_for(r, max_ctx, &ws_bytes);
        fr_attn_fp4_plan plan;
        run_decode(r, max_ctx, ws, ws_bytes, &plan, 0);
        CUDA_OK(cudaDeviceSynchronize());
        bad += check(r, ws, &plan, "tq6 layer 5 data");
        cudaFree(ws);
        rig_close(r);
    }
    free(c.k); free(c.v); free(c.q);
    assert_int_equal(bad, 0);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    fr_ref_config rc = fr_ref_config_default(FR_KV_NVFP4);
    fr_attn_fp4_config cfg = {.dtype = FR_KV_NVFP4, .p = fr_ref_attn_params(&rc, D, 4), .rotate = 1, .sink_recent = 1};
    size_t b;
    assert_int_equal(fr_attn_fp4_workspace_bytes(NULL, 1, 8, 2, 100, &b), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_workspace_bytes(&cfg, 1, 8, 2, 100, NULL), FR_EINVAL);
    assert_int_equal(fr_attn_fp4_workspace_bytes(&cfg, 1, 9, 2, 100, &b), FR_EINVAL);   /* 9 over 2 */
    assert_non_null(strstr(fr_last_error(), "group"));
    assert_int_equal(fr_attn_fp4_workspace_bytes(&cfg, 1, 12, 2, 100, &b), FR_EINVAL);  /* G 6 vs params 4 */
    fr_attn_fp4_config bad = cfg;
    bad.p.tile = 64;
    assert_int_equal(fr_attn_fp4_workspace_bytes(&bad, 1, 8, 2, 100, &b), FR_EINVAL);
    bad = cfg;
    bad.dtype = FR_KV_BF16;
    assert_int_equal(fr_attn_fp4_workspace_bytes(&bad, 1, 8, 2, 100, &b), FR_EINVAL);
    bad = cfg;
    bad.dtype = FR_KV_MXFP4;   /* params still NVFP4 */
    assert_int_equal(fr_attn_fp4_workspace_bytes(&bad, 1, 8, 2, 100, &b), FR_EINVAL);
    bad = cfg;
    bad.p.head_dim = 64;
    assert_int_equal(fr_attn_fp4_workspace_bytes(&bad, 1, 8, 2, 100, &b), FR_EUNSUPPORTED);
    fr_ref_config r8 = fr_ref_config_default(FR_KV_FP8);
    fr_attn_fp4_config fp8 = {.dtype = FR_KV_FP8, .p = fr_ref_attn_params(&r8, D, 4)};
    assert_int_equal(fr_attn_fp4_workspace_bytes(&fp8, 1, 8, 2, 100, &b), FR_EINVAL);   /* no scales */
    assert_non_null(strstr(fr_last_error(), "scales"));
    static uint8_t dummy[256] __attribute__((aligned(256)));
    const fr_paged_kv kv = {.pool = dummy, .n_layers = 1, .n_kv_heads = 2, .head_dim = D};
    assert_int_equal(fr_attn_fp4_decode(&cfg, &kv, (const fr_paged_seq *)dummy, 0, 1, (const float *)dummy,
                                        (uint16_t *)dummy, 8, dummy, 256, 0),
                     FR_OK);   /* nothing to do */
    assert_int_equal(fr_attn_fp4_decode(&cfg, NULL, (const fr_paged_seq *)dummy, 1, 1, (const float *)dummy,
                                        (uint16_t *)dummy, 8, dummy, 256, 0),
                     FR_EINVAL);
    assert_int_equal(fr_attn_fp4_decode(&cfg, &kv, (const fr_paged_seq *)dummy, 1, 1, (const float *)dummy,
                                        (uint16_t *)dummy, 8, dummy, 256, 0),
                     FR_EINVAL);   /* no recent slots or staging rows in the view */
}

/* ---- timing (printed, not asserted) ---- */

static void time_mode(fr_kv_dtype dt, fr_fp4_compute comp, uint8_t *pool, size_t pool_bytes, uint16_t *slots,
                      uint16_t *stage, float *q, uint16_t *out, int *bt, fr_paged_seq *seqs_dev, float *scales)
{
    const int kvh = 8, H = 32, G = 4, iters = 20, max_b = 64;
    const int batches[] = {1, 16, 64}, ctxs[] = {4096, 32768, 131072};
    fr_ref_config rc = fr_ref_config_default(dt);
    rc.compute = comp;
    const int fp4 = fr_kv_dtype_is_fp4(dt);
    fr_attn_fp4_config cfg = {.dtype = dt, .p = fr_ref_attn_params(&rc, D, G), .rotate = fp4, .sink_recent = fp4,
                              .fp8_scales = dt == FR_KV_FP8 ? scales : NULL};
    const size_t hpb = fp4 ? (size_t)T * D / 2 * 2 + (size_t)T * D / fr_fp4_block_size(fr_kv_dtype_fp4_format(dt)) * 2
                           : (size_t)2 * T * D;
    const size_t bb = hpb * kvh, slot_elems = (size_t)kvh * T * D, sink_elems = (size_t)kvh * 16 * D;
    const size_t ks = fp4 ? (size_t)T * D / 2 : (size_t)T * D;
    const size_t vc = fp4 ? ks + (size_t)T * D / fr_fp4_block_size(fr_kv_dtype_fp4_format(dt)) : (size_t)T * D;
    const size_t vs = fp4 ? vc + (size_t)D * T / 2 : vc;
    const int max_pages = 131072 / T;
    if (bb * (size_t)max_b * max_pages > pool_bytes) return;
    const fr_paged_kv kv = {.pool = pool, .block_bytes = bb, .head_page_bytes = hpb, .k_codes = 0, .k_scales = ks,
                            .v_codes = vc, .v_scales = vs, .recent = slots, .sink = slots + 2 * slot_elems * max_b,
                            .slot_elems = slot_elems, .sink_elems = sink_elems, .step_k = stage, .step_v = stage,
                            .layer = 0, .n_layers = 1, .n_kv_heads = kvh, .head_dim = D};
    size_t ws_bytes = 0;
    if (fr_attn_fp4_workspace_bytes(&cfg, max_b, H, kvh, 131072, &ws_bytes)) fail_msg("%s", fr_last_error());
    void *ws = NULL;
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int ci = 0; ci < 3; ci++)
        for (int bi = 0; bi < 3; bi++) {
            const int B = batches[bi], ctx = ctxs[ci], len = ctx - 1;
            fr_paged_seq seqs[64];
            for (int s = 0; s < B; s++)
                seqs[s] = (fr_paged_seq){.block_table = bt + (size_t)s * max_pages, .len = len, .n_new = 1,
                                         .q_row = s, .slot = s};
            CUDA_OK(cudaMemcpy(seqs_dev, seqs, sizeof(fr_paged_seq) * B, cudaMemcpyHostToDevice));
            fr_attn_fp4_plan plan;
            if (fr_attn_fp4_plan_for(&cfg, B, H, kvh, D, ctx, ws_bytes, &plan)) fail_msg("%s", fr_last_error());
            for (int it = 0; it < 3; it++)
                FR_OK_OR_FAIL(fr_attn_fp4_decode(&cfg, &kv, seqs_dev, B, ctx, q, out, H, ws, ws_bytes, 0));
            CUDA_OK(cudaEventRecord(e0, 0));
            for (int it = 0; it < iters; it++)
                FR_OK_OR_FAIL(fr_attn_fp4_decode(&cfg, &kv, seqs_dev, B, ctx, q, out, H, ws, ws_bytes, 0));
            CUDA_OK(cudaEventRecord(e1, 0));
            CUDA_OK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
            const double us = 1e3 * ms / iters;
            const double pages = (double)B * kvh * (fp4 ? len / T : (len + T) / T);
            const double bf16_tokens = fp4 ? (double)B * kvh * (16 + len % T + 1) : 0.0;
            const double bytes = pages * hpb + bf16_tokens * D * 4 + (double)B * H * D * (4 + 2);
            char name[64];
            snprintf(name, sizeof name, "%s/%s", fr_kv_dtype_name(dt), fr_fp4_compute_name(comp));
            printf("    %-12s batch %2d ctx %6d: %3d splits %9.1f us %9.1f MB %6.2f TB/s\n", name, B, ctx,
                   plan.n_splits, us, bytes / 1e6, bytes / (us * 1e6));
        }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(ws);
}

static void test_timing(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int kvh = 8, H = 32, max_b = 64, max_pages = 131072 / T;
    const size_t pool_bytes = (size_t)2 * T * D * kvh * max_b * max_pages;   /* FP8, the largest */
    uint8_t *pool = NULL;
    if (cudaMalloc((void **)&pool, pool_bytes) != cudaSuccess) {
        cudaGetLastError();
        printf("  timing skipped: cannot allocate %.1f GB of KV pool\n", pool_bytes / 1e9);
        return;
    }
    /* 0x3C everywhere: finite codes, E4M3 scales 1.5, BF16 slot values ~0.011 */
    CUDA_OK(cudaMemset(pool, 0x3C, pool_bytes));
    const size_t slot_elems = (size_t)kvh * T * D, sink_elems = (size_t)kvh * 16 * D;
    uint16_t *slots, *stage, *out;
    float *q, *scales;
    int *bt;
    fr_paged_seq *seqs_dev;
    CUDA_OK(cudaMalloc((void **)&slots, sizeof(uint16_t) * 2 * (slot_elems + sink_elems) * max_b));
    CUDA_OK(cudaMemset(slots, 0x3C, sizeof(uint16_t) * 2 * (slot_elems + sink_elems) * max_b));
    CUDA_OK(cudaMalloc((void **)&stage, sizeof(uint16_t) * max_b * kvh * D));
    CUDA_OK(cudaMemset(stage, 0x3C, sizeof(uint16_t) * max_b * kvh * D));
    CUDA_OK(cudaMalloc((void **)&q, sizeof(float) * max_b * H * D));
    CUDA_OK(cudaMemset(q, 0, sizeof(float) * max_b * H * D));
    CUDA_OK(cudaMalloc((void **)&out, sizeof(uint16_t) * max_b * H * D));
    CUDA_OK(cudaMalloc((void **)&scales, sizeof(float) * kvh * 2));
    float ones[16];
    for (int i = 0; i < 16; i++) ones[i] = 1.0f;
    CUDA_OK(cudaMemcpy(scales, ones, sizeof ones, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&bt, sizeof(int) * max_b * max_pages));
    CUDA_OK(cudaMalloc((void **)&seqs_dev, sizeof(fr_paged_seq) * max_b));
    int *perm = xmalloc(sizeof(int) * max_b * max_pages);
    fr_test_rng r = {5};
    for (int i = 0; i < max_b * max_pages; i++) perm[i] = i;
    for (int i = max_b * max_pages - 1; i > 0; i--) {
        const int j = (int)(fr_test_u64(&r) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    CUDA_OK(cudaMemcpy(bt, perm, sizeof(int) * max_b * max_pages, cudaMemcpyHostToDevice));
    free(perm);
    printf("  decode timing, 32 q / 8 kv heads, d 128, one layer (bytes: pages + BF16 tokens + q/out):\n");
    time_mode(FR_KV_NVFP4, FR_COMPUTE_BF16, pool, pool_bytes, slots, stage, q, out, bt, seqs_dev, scales);
    time_mode(FR_KV_NVFP4, FR_COMPUTE_EXACT, pool, pool_bytes, slots, stage, q, out, bt, seqs_dev, scales);
    time_mode(FR_KV_MXFP4, FR_COMPUTE_BF16, pool, pool_bytes, slots, stage, q, out, bt, seqs_dev, scales);
    time_mode(FR_KV_MXFP4, FR_COMPUTE_EXACT, pool, pool_bytes, slots, stage, q, out, bt, seqs_dev, scales);
    time_mode(FR_KV_FP8, FR_COMPUTE_EXACT, pool, pool_bytes, slots, stage, q, out, bt, seqs_dev, scales);
    cudaFree(pool); cudaFree(slots); cudaFree(stage); cudaFree(q); cudaFree(out); cudaFree(scales);
    cudaFree(bt); cudaFree(seqs_dev);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_nvfp4_exact),
                 cmocka_unit_test(test_nvfp4_bf16),
                 cmocka_unit_test(test_mxfp4_exact),
                 cmocka_unit_test(test_mxfp4_bf16),
                 cmocka_unit_test(test_fp8),
                 cmocka_unit_test(test_long),
                 cmocka_unit_test(test_graph_replay),
                 cmocka_unit_test(test_real_tq6),
                 cmocka_unit_test(test_timing))
