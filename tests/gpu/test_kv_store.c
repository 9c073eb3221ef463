/* The GPU store path (kvcache/kv_store_cuda.h) against the CPU cache
 * (kvcache/kv_cache.h): the same float32 tokens go through fr_kv_append on
 * the CPU and through stage + commit on the GPU, in the same chunks, and
 * must leave the same bytes:
 *  - staging rows equal the CPU store form (fr_kv_key_form/_value_form);
 *  - every promoted page equals the CPU's page byte for byte, the GPU
 *    block being the CPU's block id (fr_kv_seq_blocks);
 *  - the recent slot rows of the partial page and the sink rows equal the
 *    store form, and, where the CPU's gather returns slot values as they are
 *    (bf16, FP4 with sink/recent), what the gather returns.
 * Cases: nvfp4, mxfp4, fp8, bf16 x recipes full, vanilla, full without each
 * of smooth/rotate/search/sink x head_dim 128 and 64; steps that mix a
 * multi-page prefill chunk, chunks crossing page and sink boundaries, chunks
 * ending on a page boundary and sequences decoding one token a step. Also a
 * fork (copy_slot, then both continue), argument errors, and the device-side
 * record checks. Skipped when no CUDA device is present. */
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

#include "attention/fp_formats.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store_cuda.h"
#include "tests/unit/test_util.h"

enum {
    T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS,
    NL = 2, NH = 3,                       /* 3 heads: catches a head stride mistaken for a power of two */
    MAX_SEQS = 6, MAX_TOK = 768, MAX_PAGES = MAX_TOK / T, MAX_ROWS = 640, N_BLOCKS = 32
};

/* ---- GPU presence ---- */

/* ---- a rig: the CPU cache and the GPU store side by side ---- */

typedef struct {
    const char *recipe;
    fr_kv_dtype dt;
    int d;
    float mean[NL * NH * FR_MAX_HEAD_DIM];
    float fp8[NL * NH * 2];
    fr_kv_cache_config cfg;
    fr_kv_cache *cpu;
    fr_kv_store_gpu *gpu;
    cudaStream_t stream;
    float *d_k, *d_v;          /* one layer's step rows */
    uint16_t *d_sk, *d_sv;     /* staging */
    fr_paged_seq *d_seqs;
    int *d_tables;             /* [MAX_SEQS][MAX_PAGES] */
    /* The CPU store form of every token so far, per sequence, [NL][MAX_TOK][NH][d]. */
    float *hist_k[MAX_SEQS], *hist_v[MAX_SEQS];
    fr_test_rng g;
    int step;
} rig;

typedef struct { int seq, n; } step_item;

static int rig_keeps_bf16(const rig *r) { return fr_kv_dtype_is_fp4(r->dt) && r->cfg.recipe.sink_recent; }

static rig *rig_open(fr_kv_dtype dt, const char *recipe, int d, uint64_t seed)
{
    rig *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->recipe = recipe;
    r->dt = dt;
    r->d = d;
    r->g.s = seed;
    fr_recipe rc;
    assert_int_equal(fr_recipe_parse(recipe, &rc), FR_OK);
    for (int i = 0; i < NL * NH * d; i++) r->mean[i] = 0.5f * fr_test_normal(&r->g) + 0.25f;
    for (int i = 0; i < NL * NH; i++) {   /* non-unit, per (layer, head) */
        r->fp8[2 * i] = 0.02f + 0.01f * (float)i;
        r->fp8[2 * i + 1] = 0.015f + 0.005f * (float)i;
    }
    r->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = NH, .head_dim = d, .dtype = dt,
                                  .compute = FR_COMPUTE_EXACT, .recipe = rc, .tau = FR_P_TAU,
                                  .n_blocks = N_BLOCKS, .max_seqs = MAX_SEQS,
                                  .key_mean = r->mean, .fp8_scales = r->fp8};
    FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&r->cfg, &r->gpu));
    assert_int_equal(fr_kv_store_gpu_block_bytes(r->gpu), fr_kv_block_bytes(r->cpu));
    CUDA_OK(cudaStreamCreate(&r->stream));
    const size_t row = (size_t)NH * d;
    CUDA_OK(cudaMalloc((void **)&r->d_k, sizeof(float) * MAX_ROWS * row));
    CUDA_OK(cudaMalloc((void **)&r->d_v, sizeof(float) * MAX_ROWS * row));
    CUDA_OK(cudaMalloc((void **)&r->d_sk, sizeof(uint16_t) * MAX_ROWS * row));
    CUDA_OK(cudaMalloc((void **)&r->d_sv, sizeof(uint16_t) * MAX_ROWS * row));
    CUDA_OK(cudaMalloc((void **)&r->d_seqs, sizeof(fr_paged_seq) * MAX_SEQS));
    CUDA_OK(cudaMalloc((void **)&r->d_tables, sizeof(int) * MAX_SEQS * MAX_PAGES));
    for (int s = 0; s < MAX_SEQS; s++) {
        r->hist_k[s] = calloc((size_t)NL * MAX_TOK * row, sizeof(float));
        r->hist_v[s] = calloc((size_t)NL * MAX_TOK * row, sizeof(float));
        assert_true(r->hist_k[s] && r->hist_v[s]);
    }
    return r;
}

static void rig_close(rig *r)
{
    for (int s = 0; s < MAX_SEQS; s++) {
        free(r->hist_k[s]);
        free(r->hist_v[s]);
    }
    cudaFree(r->d_k);
    cudaFree(r->d_v);
    cudaFree(r->d_sk);
    cudaFree(r->d_sv);
    cudaFree(r->d_seqs);
    cudaFree(r->d_tables);
    cudaStreamDestroy(r->stream);
    fr_kv_store_gpu_destroy(&r->gpu);
    assert_null(r->gpu);
    fr_kv_cache_destroy(&r->cpu);
    free(r);
}

static int rig_seq_new(rig *r)
{
    int s;
    FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &s));
    assert_true(s < MAX_SEQS);
    return s;
}

static const char *rig_name(const rig *r, char *buf, size_t len)
{
    snprintf(buf, len, "%s recipe %s d %d step %d", fr_kv_dtype_name(r->dt), r->recipe, r->d, r->step);
    return buf;
}

/* ---- data ---- */

/* Per-token magnitudes: mostly a log-normal spread, some tiny tokens (E4M3
 * subnormal and zero block scales), some large ones (FP8 saturation). */
static float token_scale(fr_test_rng *g)
{
    float u = fr_test_uniform(g);
    if (u < 0.03f) return 1e-6f;
    if (u < 0.08f) return 2e-3f;
    if (u < 0.12f) return 40.0f;
    return expf(0.7f * fr_test_normal(g));
}

static float channel_noise(fr_test_rng *g, int j)
{
    float x = fr_test_normal(g);
    return j % 37 == 5 ? 6.0f * x : x;   /* outlier channels */
}

/* Raw rows of every layer, [NL][rows][NH][d]: keys around the key mean (so
 * smoothing matters), values around zero. The first step also gets a zero
 * key row, and +-inf and NaN values (values are only rounded and divided,
 * never summed, so even those have the same bits on both sides). */
static void fill_rows(rig *r, float *K, float *V, int rows)
{
    const int d = r->d;
    for (int l = 0; l < NL; l++)
        for (int i = 0; i < rows; i++)
            for (int h = 0; h < NH; h++) {
                const size_t o = (((size_t)l * rows + i) * NH + h) * d;
                const float sk = token_scale(&r->g), sv = token_scale(&r->g);
                for (int j = 0; j < d; j++) {
                    K[o + j] = r->mean[((size_t)l * NH + h) * d + j] + sk * channel_noise(&r->g, j);
                    V[o + j] = sv * channel_noise(&r->g, j);
                }
            }
    if (r->step == 0 && rows > 60) {
        const size_t zk = (((size_t)1 * rows + 5) * NH + 0) * d, sv = (((size_t)0 * rows + 50) * NH + 1) * d;
        for (int j = 0; j < d; j++) K[zk + j] = 0.0f;
        V[sv + 3] = INFINITY;
        V[sv + 7] = NAN;
        V[sv + 9] = -INFINITY;
    }
}

/* ---- comparisons ---- */

static const char *page_region(const rig *r, size_t off)
{
    const fr_page_layout *l = fr_kv_store_gpu_layout(r->gpu);
    if (!fr_kv_dtype_is_fp4(r->dt)) return off < l->v_codes ? "K" : "V";
    return off < l->k_scales ? "K codes" : off < l->v_codes ? "K scales" : off < l->v_scales ? "V codes" : "V scales";
}

/* Every promoted page of seq: the GPU block against the CPU page. */
static void check_pages(rig *r, int seq)
{
    const int len = fr_kv_seq_len(r->cpu, seq);
    int nb = 0;
    const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
    assert_non_null(blocks);
    const size_t bb = fr_kv_block_bytes(r->cpu), hp = fr_kv_store_gpu_layout(r->gpu)->head_page_bytes;
    uint8_t *got = malloc(bb);
    assert_non_null(got);
    for (int p = 0; p < len / T; p++) {
        const uint8_t *want = fr_kv_page(r->cpu, seq, p);
        assert_non_null(want);
        CUDA_OK(cudaMemcpy(got, fr_kv_store_gpu_block(r->gpu, blocks[p]), bb, cudaMemcpyDeviceToHost));
        if (memcmp(got, want, bb)) {
            size_t i = 0;
            while (got[i] == want[i]) i++;
            const size_t lh = i / hp, off = i % hp;
            char name[128];
            fail_msg("%s: seq %d page %d (block %d) layer %zu head %zu, %s byte %zu: GPU 0x%02x, CPU 0x%02x",
                     rig_name(r, name, sizeof name), seq, p, blocks[p], lh / NH, lh % NH, page_region(r, off), off,
                     got[i], want[i]);
        }
    }
    free(got);
}

static void expect_bits(const rig *r, const char *what, int seq, int l, int h, int t, int j, uint16_t got,
                        float want)
{
    if (got == fr_bf16_encode(want)) return;
    char name[128];
    fail_msg("%s: %s seq %d layer %d head %d token %d channel %d: GPU 0x%04x (%g), expected 0x%04x (%g)",
             rig_name(r, name, sizeof name), what, seq, l, h, t, j, got, fr_bf16_decode(got),
             fr_bf16_encode(want), want);
}

/* The recent slot rows of the partial page and the sink rows of seq, against
 * the store form, and against the CPU gather where it returns slot values. */
static void check_slots(rig *r, int seq)
{
    const int d = r->d, len = fr_kv_seq_len(r->cpu, seq), full = len / T * T, ns = len < SINK ? len : SINK;
    const size_t se = fr_kv_store_gpu_slot_elems(r->gpu), ke = fr_kv_store_gpu_sink_elems(r->gpu);
    uint16_t *rec = malloc(sizeof(uint16_t) * 2 * se), *snk = malloc(sizeof(uint16_t) * 2 * ke);
    float *gk = malloc(sizeof(float) * (size_t)(len + 1) * d), *gv = malloc(sizeof(float) * (size_t)(len + 1) * d);
    assert_true(rec && snk && gk && gv);
    CUDA_OK(cudaMemcpy(rec, fr_kv_store_gpu_recent(r->gpu, seq), sizeof(uint16_t) * 2 * se, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(snk, fr_kv_store_gpu_sink(r->gpu, seq), sizeof(uint16_t) * 2 * ke, cudaMemcpyDeviceToHost));
    const int verbatim = r->dt == FR_KV_BF16 || rig_keeps_bf16(r);
    for (int l = 0; l < NL; l++)
        for (int h = 0; h < NH; h++) {
            const size_t lh = (size_t)l * NH + h;
            fr_kv_view view;
            if (verbatim) FR_OK_OR_FAIL(fr_kv_gather(r->cpu, seq, l, h, 0, NULL, NULL, gk, gv, &view));
            for (int t = 0; t < len; t++) {
                const int in_recent = t >= full, in_sink = t < ns;
                if (!in_recent && !in_sink) continue;
                const float *hk = r->hist_k[seq] + (((size_t)l * MAX_TOK + t) * NH + h) * d;
                const float *hv = r->hist_v[seq] + (((size_t)l * MAX_TOK + t) * NH + h) * d;
                for (int j = 0; j < d; j++) {
                    if (in_recent) {
                        const size_t o = (lh * T + (size_t)(t % T)) * d + j;
                        expect_bits(r, "recent K", seq, l, h, t, j, rec[o], hk[j]);
                        expect_bits(r, "recent V", seq, l, h, t, j, rec[o + se], hv[j]);
                        if (verbatim) {
                            expect_bits(r, "recent K vs gather", seq, l, h, t, j, rec[o], gk[(size_t)t * d + j]);
                            expect_bits(r, "recent V vs gather", seq, l, h, t, j, rec[o + se], gv[(size_t)t * d + j]);
                        }
                    }
                    if (in_sink) {
                        const size_t o = (lh * SINK + (size_t)t) * d + j;
                        expect_bits(r, "sink K", seq, l, h, t, j, snk[o], hk[j]);
                        expect_bits(r, "sink V", seq, l, h, t, j, snk[o + ke], hv[j]);
                        if (rig_keeps_bf16(r)) {
                            expect_bits(r, "sink K vs gather", seq, l, h, t, j, snk[o], gk[(size_t)t * d + j]);
                            expect_bits(r, "sink V vs gather", seq, l, h, t, j, snk[o + ke], gv[(size_t)t * d + j]);
                        }
                    }
                }
            }
        }
    free(rec); free(snk); free(gk); free(gv);
}

/* The staging rows of layer l against the CPU store form of the same raw
 * rows; the store form joins each sequence's history. */
static void check_staging(rig *r, int l, int rows, const float *kl, const float *vl, const step_item *items,
                          const fr_paged_seq *recs, int n_items)
{
    const size_t row = (size_t)NH * r->d, n = (size_t)rows * row;
    uint16_t *sk = malloc(sizeof(uint16_t) * n), *sv = malloc(sizeof(uint16_t) * n);
    float *ck = malloc(sizeof(float) * n), *cv = malloc(sizeof(float) * n);
    assert_true(sk && sv && ck && cv);
    CUDA_OK(cudaMemcpyAsync(sk, r->d_sk, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost, r->stream));
    CUDA_OK(cudaMemcpyAsync(sv, r->d_sv, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost, r->stream));
    CUDA_OK(cudaStreamSynchronize(r->stream));
    memcpy(ck, kl, sizeof(float) * n);
    memcpy(cv, vl, sizeof(float) * n);
    fr_kv_key_form(r->cpu, l, rows, ck);
    fr_kv_value_form(r->cpu, rows, cv);
    for (size_t i = 0; i < n; i++) {
        const int rw = (int)(i / row), h = (int)(i % row) / r->d, j = (int)(i % (size_t)r->d);
        expect_bits(r, "staging K", -1, l, h, rw, j, sk[i], ck[i]);
        expect_bits(r, "staging V", -1, l, h, rw, j, sv[i], cv[i]);
    }
    for (int it = 0; it < n_items; it++) {
        const int seq = items[it].seq;
        for (int i = 0; i < items[it].n; i++) {
            const size_t src = (size_t)(recs[it].q_row + i) * row;
            const size_t dst = ((size_t)l * MAX_TOK + (size_t)(recs[it].len + i)) * row;
            memcpy(r->hist_k[seq] + dst, ck + src, sizeof(float) * row);
            memcpy(r->hist_v[seq] + dst, cv + src, sizeof(float) * row);
        }
    }
    free(sk); free(sv); free(ck); free(cv);
}

static void check_all(rig *r, const step_item *items, int n_items)
{
    for (int i = 0; i < n_items; i++) {
        check_pages(r, items[i].seq);
        check_slots(r, items[i].seq);
    }
}

/* ---- a forward step, both sides ---- */

/* Reserves on the CPU (which owns the block tables), uploads the records,
 * then per layer stages, checks the staging rows and commits; appends the
 * same chunks on the CPU and compares the touched sequences. */
static void rig_step(rig *r, const step_item *items, int n_items)
{
    const int d = r->d;
    const size_t row = (size_t)NH * d;
    fr_paged_seq recs[MAX_SEQS];
    int rows = 0, max_pages = 0;
    assert_true(n_items <= MAX_SEQS);
    for (int i = 0; i < n_items; i++) {
        const int seq = items[i].seq, n = items[i].n;
        FR_OK_OR_FAIL(fr_kv_reserve(r->cpu, seq, n));
        int nb = 0;
        const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
        assert_true(blocks && nb <= MAX_PAGES);
        CUDA_OK(cudaMemcpy(r->d_tables + seq * MAX_PAGES, blocks, sizeof(int) * (size_t)nb, cudaMemcpyHostToDevice));
        recs[i] = (fr_paged_seq){.block_table = r->d_tables + seq * MAX_PAGES, .len = fr_kv_seq_len(r->cpu, seq),
                                 .n_new = n, .q_row = rows, .slot = seq};
        rows += n;
        if ((n + T - 1) / T > max_pages) max_pages = (n + T - 1) / T;
    }
    assert_true(rows <= MAX_ROWS);
    CUDA_OK(cudaMemcpy(r->d_seqs, recs, sizeof(fr_paged_seq) * (size_t)n_items, cudaMemcpyHostToDevice));
    const size_t per_layer = (size_t)rows * row;
    float *K = malloc(sizeof(float) * NL * per_layer), *V = malloc(sizeof(float) * NL * per_layer);
    assert_true(K && V);
    fill_rows(r, K, V, rows);
    for (int l = 0; l < NL; l++) {
        const float *kl = K + l * per_layer, *vl = V + l * per_layer;
        CUDA_OK(cudaMemcpyAsync(r->d_k, kl, sizeof(float) * per_layer, cudaMemcpyHostToDevice, r->stream));
        CUDA_OK(cudaMemcpyAsync(r->d_v, vl, sizeof(float) * per_layer, cudaMemcpyHostToDevice, r->stream));
        FR_OK_OR_FAIL(fr_kv_store_gpu_stage(r->gpu, l, rows, r->d_k, r->d_v, r->d_sk, r->d_sv, r->stream));
        check_staging(r, l, rows, kl, vl, items, recs, n_items);
        FR_OK_OR_FAIL(fr_kv_store_gpu_commit(r->gpu, l, r->d_seqs, n_items, max_pages, r->d_sk, r->d_sv,
                                             r->stream));
    }
    for (int i = 0; i < n_items; i++)
        FR_OK_OR_FAIL(fr_kv_append(r->cpu, items[i].seq, items[i].n, K + (size_t)recs[i].q_row * row,
                                   V + (size_t)recs[i].q_row * row, per_layer));
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(r->gpu, r->stream));
    check_all(r, items, n_items);
    free(K);
    free(V);
    r->step++;
}

/* ---- 1. the store path, byte exact ---- */

/* Four sequences: A a long prompt in big chunks, B a short one growing past
 * the sink and a page in one chunk, C and D decoding one token a step
 * across a page end (C) and the sink end (D), all in shared steps. */
static void store_case(fr_kv_dtype dt, const char *recipe, int d, uint64_t seed)
{
    rig *r = rig_open(dt, recipe, d, seed);
    const int A = rig_seq_new(r), B = rig_seq_new(r), C = rig_seq_new(r), D = rig_seq_new(r);
    /* A completes pages 0 and 1 in one chunk; B stays in the sink */
    rig_step(r, (step_item[]){{A, 300}, {B, 5}, {C, 120}, {D, 10}}, 4);
    /* A crosses 384, B crosses 16 and 128 */
    rig_step(r, (step_item[]){{A, 100}, {B, 130}, {C, 1}, {D, 1}}, 4);
    /* decode: C's page 0 completes with len 127, D crosses 16 */
    for (int i = 0; i < 12; i++) rig_step(r, (step_item[]){{C, 1}, {A, 1}, {D, 1}, {B, 1}}, 4);
    /* A completes pages 3 and 4; B and C end exactly on a page end */
    assert_int_equal(fr_kv_seq_len(r->cpu, B), 147);
    assert_int_equal(fr_kv_seq_len(r->cpu, C), 133);
    rig_step(r, (step_item[]){{A, 250}, {B, 109}, {C, 123}}, 3);
    /* a new page's first token, in slot row 0 */
    rig_step(r, (step_item[]){{A, 1}, {B, 1}, {C, 1}, {D, 1}}, 4);
    assert_int_equal(fr_kv_seq_len(r->cpu, A), 663);
    rig_close(r);
}

static const char *const recipes[] = {"full", "vanilla", "full,-smooth", "full,-rotate", "full,-search", "full,-sink"};

static void store_cases(fr_kv_dtype dt, uint64_t seed)
{
    REQUIRE_GPU();
    for (int d = 128; d >= 64; d /= 2)
        for (size_t i = 0; i < sizeof recipes / sizeof recipes[0]; i++)
            store_case(dt, recipes[i], d, seed++);
}

static void test_store_nvfp4(void **state) { (void)state; store_cases(FR_KV_NVFP4, 1000); }
static void test_store_mxfp4(void **state) { (void)state; store_cases(FR_KV_MXFP4, 2000); }
static void test_store_fp8(void **state) { (void)state; store_cases(FR_KV_FP8, 3000); }
static void test_store_bf16(void **state) { (void)state; store_cases(FR_KV_BF16, 4000); }

/* ---- 2. fork ---- */

static void fork_case(fr_kv_dtype dt, const char *recipe, uint64_t seed)
{
    rig *r = rig_open(dt, recipe, 128, seed);
    const int A = rig_seq_new(r);
    rig_step(r, (step_item[]){{A, 200}}, 1);
    int F;
    FR_OK_OR_FAIL(fr_kv_seq_fork(r->cpu, A, &F));
    assert_true(F < MAX_SEQS);
    FR_OK_OR_FAIL(fr_kv_store_gpu_copy_slot(r->gpu, A, F, r->stream));
    CUDA_OK(cudaStreamSynchronize(r->stream));
    const size_t hist = sizeof(float) * NL * MAX_TOK * NH * 128;
    memcpy(r->hist_k[F], r->hist_k[A], hist);
    memcpy(r->hist_v[F], r->hist_v[A], hist);
    check_pages(r, F);   /* page 0 is A's block */
    check_slots(r, F);   /* the partial page and sink came along */
    /* both cross 256 with different tokens: page 1 differs, page 0 stays shared */
    rig_step(r, (step_item[]){{A, 100}, {F, 60}}, 2);
    for (int i = 0; i < 3; i++) rig_step(r, (step_item[]){{F, 1}, {A, 1}}, 2);
    rig_step(r, (step_item[]){{F, 200}}, 1);
    check_pages(r, A);
    check_slots(r, A);
    int na, nf;
    const int *ba = fr_kv_seq_blocks(r->cpu, A, &na), *bf = fr_kv_seq_blocks(r->cpu, F, &nf);
    assert_int_equal(ba[0], bf[0]);
    assert_int_not_equal(ba[1], bf[1]);
    rig_close(r);
}

static void test_fork(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fork_case(FR_KV_NVFP4, "full", 11);
    fork_case(FR_KV_MXFP4, "full", 12);
    fork_case(FR_KV_NVFP4, "vanilla", 13);
    fork_case(FR_KV_FP8, "full", 14);
    fork_case(FR_KV_BF16, "full", 15);
}

/* ---- 3. argument errors ---- */

static fr_kv_cache_config small_config(fr_kv_dtype dt, int d)
{
    fr_recipe rc;
    assert_int_equal(fr_recipe_parse("full", &rc), FR_OK);
    return (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = NH, .head_dim = d, .dtype = dt,
                                .compute = FR_COMPUTE_EXACT, .recipe = rc, .tau = FR_P_TAU,
                                .n_blocks = 4, .max_seqs = 2};
}

static void expect_new_fails(const fr_kv_cache_config *cfg, fr_status want, const char *text)
{
    fr_kv_store_gpu *s = (fr_kv_store_gpu *)1;
    assert_int_equal(fr_kv_store_gpu_new(cfg, &s), want);
    assert_null(s);
    if (text && !strstr(fr_last_error(), text)) fail_msg("message '%s' lacks '%s'", fr_last_error(), text);
}

/* Configurations are refused before any device work, so this runs without
 * a GPU too. */
static void test_config_errors(void **state)
{
    (void)state;
    fr_kv_cache_config c = small_config(FR_KV_F32, 128);
    expect_new_fails(&c, FR_EUNSUPPORTED, "f32");
    expect_new_fails(NULL, FR_EINVAL, NULL);
    assert_int_equal(fr_kv_store_gpu_new(&c, NULL), FR_EINVAL);
    c = small_config(FR_KV_NVFP4, 24);   /* not a multiple of 16 */
    expect_new_fails(&c, FR_EINVAL, "multiple");
    c = small_config(FR_KV_NVFP4, 96);   /* rotation needs a power of two */
    expect_new_fails(&c, FR_EINVAL, "power-of-two");
    c = small_config(FR_KV_BF16, 512);
    expect_new_fails(&c, FR_EINVAL, "sizes");
    c = small_config(FR_KV_BF16, 128);
    c.max_seqs = 0;
    expect_new_fails(&c, FR_EINVAL, "sizes");
    c = small_config(FR_KV_FP8, 128);
    float scales[NL * NH * 2];
    for (int i = 0; i < NL * NH * 2; i++) scales[i] = i == 3 ? 0.0f : 1.0f;
    c.fp8_scales = scales;
    expect_new_fails(&c, FR_EINVAL, "FP8 scale 3");
    fr_kv_store_gpu *none = NULL;
    fr_kv_store_gpu_destroy(&none);   /* harmless */
    fr_kv_store_gpu_destroy(NULL);
}

static void test_call_errors(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_kv_cache_config c = small_config(FR_KV_NVFP4, 64);
    fr_kv_store_gpu *s = NULL;
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&c, &s));
    float *k;
    uint16_t *sk;
    fr_paged_seq *seqs;
    CUDA_OK(cudaMalloc((void **)&k, sizeof(float) * NH * 64));
    CUDA_OK(cudaMalloc((void **)&sk, sizeof(uint16_t) * NH * 64));
    CUDA_OK(cudaMalloc((void **)&seqs, sizeof(fr_paged_seq)));
    /* stage */
    assert_int_equal(fr_kv_store_gpu_stage(s, -1, 1, k, k, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_stage(s, NL, 1, k, k, sk, sk, 0), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "layer"));
    assert_int_equal(fr_kv_store_gpu_stage(s, 0, -1, k, k, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_stage(s, 0, 1, NULL, k, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_stage(s, 0, 1, k, k, sk, NULL, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_stage(NULL, 0, 1, k, k, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_stage(s, 0, 0, NULL, NULL, NULL, NULL, 0), FR_OK);
    /* commit */
    assert_int_equal(fr_kv_store_gpu_commit(s, NL, seqs, 1, 1, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, seqs, -1, 1, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, seqs, 3, 1, sk, sk, 0), FR_EINVAL);   /* > max_seqs */
    assert_non_null(strstr(fr_last_error(), "sequences"));
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, seqs, 1, -1, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, NULL, 1, 1, sk, sk, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, seqs, 1, 1, sk, NULL, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_commit(s, 0, NULL, 0, 0, NULL, NULL, 0), FR_OK);
    /* copy_slot */
    assert_int_equal(fr_kv_store_gpu_copy_slot(s, 0, 2, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_copy_slot(s, -1, 0, 0), FR_EINVAL);
    assert_int_equal(fr_kv_store_gpu_copy_slot(s, 1, 1, 0), FR_OK);
    assert_int_equal(fr_kv_store_gpu_copy_slot(s, 1, 0, 0), FR_OK);
    /* view and accessors */
    fr_paged_kv v = fr_kv_store_gpu_view(s, NL, sk, sk);
    assert_null(v.pool);
    v = fr_kv_store_gpu_view(s, 1, sk, sk);
    assert_ptr_equal(v.pool, fr_kv_store_gpu_pool(s));
    assert_int_equal(v.layer, 1);
    assert_int_equal(v.head_dim, 64);
    assert_int_equal(v.block_bytes, fr_kv_store_gpu_block_bytes(s));
    assert_int_equal(v.head_page_bytes, fr_page_layout_for(FR_KV_NVFP4, 64).head_page_bytes);
    assert_int_equal(v.slot_elems, (size_t)NL * NH * T * 64);
    assert_int_equal(v.sink_elems, (size_t)NL * NH * SINK * 64);
    assert_ptr_equal(v.recent, fr_kv_store_gpu_recent(s, 0));
    assert_ptr_equal(v.step_k, sk);
    assert_null(fr_kv_store_gpu_block(s, 4));
    assert_null(fr_kv_store_gpu_block(s, -1));
    assert_null(fr_kv_store_gpu_recent(s, 2));
    assert_null(fr_kv_store_gpu_sink(s, -1));
    assert_null(fr_kv_store_gpu_config(s)->key_mean);
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(s, 0));
    cudaFree(k);
    cudaFree(sk);
    cudaFree(seqs);
    fr_kv_store_gpu_destroy(&s);
    assert_null(s);
}

/* ---- 4. records only the device sees ---- */

/* Commits one record and expects the check to name the problem; nothing of
 * the pool or slots may change. */
static void bad_record(fr_kv_store_gpu *s, fr_paged_seq rec, int max_pages, const char *text, fr_paged_seq *d_rec,
                       const uint16_t *d_stage)
{
    CUDA_OK(cudaMemcpy(d_rec, &rec, sizeof rec, cudaMemcpyHostToDevice));
    FR_OK_OR_FAIL(fr_kv_store_gpu_commit(s, 0, d_rec, 1, max_pages, d_stage, d_stage, 0));
    assert_int_equal(fr_kv_store_gpu_check(s, 0), FR_EINTERNAL);
    if (!strstr(fr_last_error(), text)) fail_msg("message '%s' lacks '%s'", fr_last_error(), text);
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(s, 0));   /* reported once, then cleared */
    const fr_kv_cache_config *c = fr_kv_store_gpu_config(s);
    const size_t pool = fr_kv_store_gpu_block_bytes(s) * (size_t)c->n_blocks;
    const size_t slots = 2 * (fr_kv_store_gpu_slot_elems(s) + fr_kv_store_gpu_sink_elems(s)) * (size_t)c->max_seqs;
    uint8_t *h = malloc(pool > slots * 2 ? pool : slots * 2);
    assert_non_null(h);
    CUDA_OK(cudaMemcpy(h, fr_kv_store_gpu_pool(s), pool, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < pool; i++)
        if (h[i]) fail_msg("%s: pool byte %zu was written", text, i);
    const size_t rec_bytes = sizeof(uint16_t) * 2 * fr_kv_store_gpu_slot_elems(s) * (size_t)c->max_seqs;
    CUDA_OK(cudaMemcpy(h, fr_kv_store_gpu_recent(s, 0), rec_bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < rec_bytes; i++)
        if (h[i]) fail_msg("%s: recent slot byte %zu was written", text, i);
    free(h);
}

static void test_device_record_errors(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_kv_cache_config c = small_config(FR_KV_NVFP4, 64);
    fr_kv_store_gpu *s = NULL;
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&c, &s));
    const size_t stage_elems = (size_t)300 * NH * 64;
    uint16_t *d_stage;
    fr_paged_seq *d_rec;
    int *d_table;
    CUDA_OK(cudaMalloc((void **)&d_stage, sizeof(uint16_t) * stage_elems));
    CUDA_OK(cudaMemset(d_stage, 0x3F, sizeof(uint16_t) * stage_elems));   /* non-zero: a write would show */
    CUDA_OK(cudaMalloc((void **)&d_rec, sizeof(fr_paged_seq)));
    CUDA_OK(cudaMalloc((void **)&d_table, sizeof(int) * 3));
    const int good[3] = {0, 1, 2}, bad[3] = {4, 1, 2};
    CUDA_OK(cudaMemcpy(d_table, good, sizeof good, cudaMemcpyHostToDevice));
    const fr_paged_seq ok = {.block_table = d_table, .len = 120, .n_new = 1, .q_row = 0, .slot = 1};
    fr_paged_seq r = ok;
    r.slot = 2;
    bad_record(s, r, 1, "slot", d_rec, d_stage);
    r = ok;
    r.len = -1;
    bad_record(s, r, 1, "negative", d_rec, d_stage);
    r = ok;
    r.n_new = 260;   /* completes pages 0 and 1 (and 2 partly): 2 pages, bound 1 */
    bad_record(s, r, 1, "max_pages_per_seq", d_rec, d_stage);
    /* promotion of page 0 with no block: the page is skipped (the record's
     * sink tokens 0..15 are still written; the recent slot has no partial page) */
    r = ok;
    r.len = 0;
    r.n_new = 128;
    r.block_table = NULL;
    bad_record(s, r, 1, "block id", d_rec, d_stage);
    CUDA_OK(cudaMemcpy(d_table, bad, sizeof bad, cudaMemcpyHostToDevice));   /* block 4 of 4 */
    r.block_table = d_table;
    bad_record(s, r, 1, "block id", d_rec, d_stage);
    cudaFree(d_stage);
    cudaFree(d_rec);
    cudaFree(d_table);
    fr_kv_store_gpu_destroy(&s);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_config_errors),
                 cmocka_unit_test(test_call_errors),
                 cmocka_unit_test(test_device_record_errors),
                 cmocka_unit_test(test_store_nvfp4),
                 cmocka_unit_test(test_store_mxfp4),
                 cmocka_unit_test(test_store_fp8),
                 cmocka_unit_test(test_store_bf16),
                 cmocka_unit_test(test_fork))
