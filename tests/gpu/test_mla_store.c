/* The GPU store path of a latent cache (kvcache/kv_store_cuda.h with
 * latent_dim > 0: multi-head latent attention) against the CPU cache
 * (kvcache/kv_cache.c): the same float32 rows go through fr_kv_append on the
 * CPU and through stage + commit on the GPU, in the same steps, and must
 * leave the same bytes:
 *  - the staging rows equal the CPU store form (fr_kv_key_form: the latent
 *    minus the mean and rotated for FP4, all BF16), bit for bit;
 *  - every promoted latent page equals the CPU's (write_latent_page) byte
 *    for byte, in the CPU's block ids;
 *  - the recent slot rows of the partial page and the sink rows (one half
 *    per token, at recent + s * slot_elems + l * 128 * row) equal the store
 *    form.
 * Cases: nvfp4, mxfp4, fp8, bf16 x recipes full and vanilla (and FP4
 * without smoothing, without rotation), at tqa's row (256 + 64) and
 * DeepSeek-V3's (512 + 64), with calibrated means and FP8 scales; steps mix a
 * multi-page prefill chunk, chunks crossing the sink and page boundaries
 * and one-token decodes of several sequences. Skipped without a device. */
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
    T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS, NL = 2, MAX_SEQS = 4, MAX_TOK = 640,
    MAX_PAGES = MAX_TOK / T + 1, MAX_ROWS = 400, N_BLOCKS = 24, DR = 64
};

typedef struct {
    fr_kv_dtype dt;
    int dc, d;
    fr_kv_cache_config cfg;
    fr_kv_cache *cpu;
    fr_kv_store_gpu *gpu;
    cudaStream_t stream;
    float *d_rows;          /* one layer's step rows, [rows][d] */
    uint16_t *d_stage;      /* [NL][rows][d]: each layer keeps its staging until its commit */
    fr_paged_seq *d_seqs;
    int *d_tables;          /* [MAX_SEQS][MAX_PAGES] */
    float *hist[MAX_SEQS];  /* the CPU store form of every token so far, [NL][MAX_TOK][d] */
    float *mean, *fp8;
    fr_test_rng g;
} rig;

typedef struct { int seq, n; } step_item;

static rig *rig_open(fr_kv_dtype dt, const char *recipe, int dc, uint64_t seed)
{
    rig *r = calloc(1, sizeof *r);
    assert_non_null(r);
    r->dt = dt;
    r->dc = dc;
    r->d = dc + DR;
    r->g.s = seed;
    fr_recipe rc;
    assert_int_equal(fr_recipe_parse(recipe, &rc), FR_OK);
    r->mean = calloc((size_t)NL * r->d, sizeof(float));
    r->fp8 = malloc(sizeof(float) * NL * 2);
    assert_non_null(r->mean);
    assert_non_null(r->fp8);
    for (int l = 0; l < NL; l++) {
        for (int j = 0; j < dc; j++) r->mean[(size_t)l * r->d + j] = 0.3f * fr_test_normal(&r->g);
        r->fp8[2 * l] = r->fp8[2 * l + 1] = 0.004f + 0.003f * (float)l;   /* latent amax ~ 2..3 over 448 */
    }
    r->cfg = (fr_kv_cache_config){.n_layers = NL, .n_kv_heads = 1, .head_dim = r->d, .latent_dim = dc, .dtype = dt,
                                  .compute = FR_COMPUTE_EXACT, .recipe = rc, .tau = FR_P_TAU, .n_blocks = N_BLOCKS,
                                  .max_seqs = MAX_SEQS, .key_mean = r->mean, .fp8_scales = r->fp8};
    FR_OK_OR_FAIL(fr_kv_cache_new(&r->cfg, &r->cpu));
    FR_OK_OR_FAIL(fr_kv_store_gpu_new(&r->cfg, &r->gpu));
    CUDA_OK(cudaStreamCreate(&r->stream));
    CUDA_OK(cudaMalloc((void **)&r->d_rows, sizeof(float) * MAX_ROWS * r->d));
    CUDA_OK(cudaMalloc((void **)&r->d_stage, sizeof(uint16_t) * NL * MAX_ROWS * r->d));
    CUDA_OK(cudaMalloc((void **)&r->d_seqs, sizeof(fr_paged_seq) * MAX_SEQS));
    CUDA_OK(cudaMalloc((void **)&r->d_tables, sizeof(int) * MAX_SEQS * MAX_PAGES));
    for (int s = 0; s < MAX_SEQS; s++) {
        r->hist[s] = calloc((size_t)NL * MAX_TOK * r->d, sizeof(float));
        assert_non_null(r->hist[s]);
    }
    return r;
}

static void rig_close(rig *r)
{
    for (int s = 0; s < MAX_SEQS; s++) free(r->hist[s]);
    cudaFree(r->d_rows);
    cudaFree(r->d_stage);
    cudaFree(r->d_seqs);
    cudaFree(r->d_tables);
    cudaStreamDestroy(r->stream);
    fr_kv_store_gpu_destroy(&r->gpu);
    fr_kv_cache_destroy(&r->cpu);
    free(r->mean);
    free(r->fp8);
    free(r);
}

/* A latent row as a model makes it: an RMS-normed latent around the mean
 * with a few larger channels, and a RoPE part of unit scale. */
static void make_row(rig *r, int l, float *x)
{
    for (int j = 0; j < r->dc; j++) {
        float v = r->mean[(size_t)l * r->d + j] + fr_test_normal(&r->g);
        if (j % 37 == 5) v *= 4.0f;
        x[j] = v;
    }
    for (int j = r->dc; j < r->d; j++) x[j] = fr_test_normal(&r->g);
}

/* The GPU's staging rows of one layer against the CPU store form. */
static void check_staging(rig *r, int l, const float *form, int rows)
{
    const size_t n = (size_t)rows * r->d;
    uint16_t *got = malloc(sizeof(uint16_t) * n);
    assert_non_null(got);
    CUDA_OK(cudaMemcpy(got, r->d_stage + (size_t)l * MAX_ROWS * r->d, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        if (got[i] != fr_bf16_encode(form[i]))
            fail_msg("layer %d staging row %zu element %zu: GPU 0x%04x, CPU store form 0x%04x (%.8g)", l, i / r->d,
                     i % r->d, got[i], fr_bf16_encode(form[i]), form[i]);
    free(got);
}

/* One step of several sequences (n tokens each): the CPU appends, the GPU
 * stages every layer, then commits every layer. */
static void rig_step(rig *r, const step_item *items, int n_items)
{
    int rows = 0, max_n = 0;
    fr_paged_seq recs[MAX_SEQS];
    int tables[MAX_SEQS * MAX_PAGES];
    for (int i = 0; i < n_items; i++) {
        const int s = items[i].seq, n = items[i].n;
        FR_OK_OR_FAIL(fr_kv_reserve(r->cpu, s, n));
        int nb = 0;
        const int *blocks = fr_kv_seq_blocks(r->cpu, s, &nb);
        assert_true(nb <= MAX_PAGES);
        memcpy(tables + (size_t)i * MAX_PAGES, blocks, sizeof(int) * (size_t)nb);
        recs[i] = (fr_paged_seq){.block_table = r->d_tables + (size_t)i * MAX_PAGES, .len = fr_kv_seq_len(r->cpu, s),
                                 .n_new = n, .q_row = rows, .slot = s};
        rows += n;
        max_n = n > max_n ? n : max_n;
    }
    assert_true(rows <= MAX_ROWS);
    CUDA_OK(cudaMemcpy(r->d_tables, tables, sizeof tables, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(r->d_seqs, recs, sizeof(fr_paged_seq) * (size_t)n_items, cudaMemcpyHostToDevice));
    const size_t d = (size_t)r->d;
    float *x = malloc(sizeof(float) * NL * (size_t)rows * d), *form = malloc(sizeof(float) * (size_t)rows * d);
    assert_non_null(x);
    assert_non_null(form);
    for (int l = 0; l < NL; l++) {
        float *xl = x + (size_t)l * rows * d;
        for (int t = 0; t < rows; t++) make_row(r, l, xl + (size_t)t * d);
        CUDA_OK(cudaMemcpy(r->d_rows, xl, sizeof(float) * (size_t)rows * d, cudaMemcpyHostToDevice));
        FR_OK_OR_FAIL(fr_kv_store_gpu_stage(r->gpu, l, rows, r->d_rows, NULL, r->d_stage + (size_t)l * MAX_ROWS * d,
                                            NULL, r->stream));
        CUDA_OK(cudaStreamSynchronize(r->stream));
        memcpy(form, xl, sizeof(float) * (size_t)rows * d);
        fr_kv_key_form(r->cpu, l, rows, form);
        check_staging(r, l, form, rows);
        for (int i = 0; i < n_items; i++) {   /* the history of store forms, for the slot checks */
            const int s = items[i].seq, len = recs[i].len;
            memcpy(r->hist[s] + ((size_t)l * MAX_TOK + len) * d, form + (size_t)recs[i].q_row * d,
                   sizeof(float) * (size_t)items[i].n * d);
        }
    }
    for (int l = 0; l < NL; l++)
        FR_OK_OR_FAIL(fr_kv_store_gpu_commit(r->gpu, l, r->d_seqs, n_items, (max_n + T - 1) / T + 1,
                                             r->d_stage + (size_t)l * MAX_ROWS * d, NULL, r->stream));
    FR_OK_OR_FAIL(fr_kv_store_gpu_check(r->gpu, r->stream));
    for (int i = 0; i < n_items; i++)
        FR_OK_OR_FAIL(fr_kv_append(r->cpu, items[i].seq, items[i].n, x + (size_t)recs[i].q_row * d, NULL,
                                   (size_t)rows * d));
    free(x);
    free(form);
}

/* Every full page of seq byte for byte, then its slots' rows. */
static void rig_compare(rig *r, int seq)
{
    const int len = fr_kv_seq_len(r->cpu, seq), d = r->d;
    const size_t bb = fr_kv_block_bytes(r->cpu);
    assert_int_equal(bb, fr_kv_store_gpu_block_bytes(r->gpu));
    int nb = 0;
    const int *blocks = fr_kv_seq_blocks(r->cpu, seq, &nb);
    uint8_t *got = malloc(bb);
    assert_non_null(got);
    for (int p = 0; p < len / T; p++) {
        const uint8_t *want = fr_kv_page(r->cpu, seq, p);
        assert_non_null(want);
        CUDA_OK(cudaMemcpy(got, fr_kv_store_gpu_block(r->gpu, blocks[p]), bb, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < bb; i++)
            if (got[i] != want[i])
                fail_msg("%s seq %d page %d: byte %zu of %zu differs (GPU 0x%02x, CPU 0x%02x; layer %zu, offset %zu "
                         "in its page)", fr_kv_dtype_name(r->dt), seq, p, i, bb, got[i], want[i],
                         i / fr_kv_layout(r->cpu)->head_page_bytes, i % fr_kv_layout(r->cpu)->head_page_bytes);
    }
    free(got);
    const size_t se = fr_kv_store_gpu_slot_elems(r->gpu), ke = fr_kv_store_gpu_sink_elems(r->gpu);
    assert_int_equal(se, (size_t)NL * T * d);
    assert_int_equal(ke, (size_t)NL * SINK * d);
    uint16_t *recent = malloc(sizeof(uint16_t) * se), *sink = malloc(sizeof(uint16_t) * ke);
    assert_non_null(recent);
    assert_non_null(sink);
    /* one half per token: slot s starts s * slot_elems in */
    assert_ptr_equal(fr_kv_store_gpu_recent(r->gpu, seq), fr_kv_store_gpu_recent(r->gpu, 0) + (size_t)seq * se);
    CUDA_OK(cudaMemcpy(recent, fr_kv_store_gpu_recent(r->gpu, seq), sizeof(uint16_t) * se, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sink, fr_kv_store_gpu_sink(r->gpu, seq), sizeof(uint16_t) * ke, cudaMemcpyDeviceToHost));
    for (int l = 0; l < NL; l++) {
        for (int t = len / T * T; t < len; t++)
            for (int j = 0; j < d; j++) {
                const uint16_t want = fr_bf16_encode(r->hist[seq][((size_t)l * MAX_TOK + t) * d + j]);
                const uint16_t g = recent[((size_t)l * T + t % T) * d + j];
                if (g != want) fail_msg("seq %d layer %d recent row of token %d, element %d: 0x%04x vs 0x%04x", seq, l, t, j, g, want);
            }
        for (int t = 0; t < len && t < SINK; t++)
            for (int j = 0; j < d; j++) {
                const uint16_t want = fr_bf16_encode(r->hist[seq][((size_t)l * MAX_TOK + t) * d + j]);
                const uint16_t g = sink[((size_t)l * SINK + t) * d + j];
                if (g != want) fail_msg("seq %d layer %d sink row %d, element %d: 0x%04x vs 0x%04x", seq, l, t, j, g, want);
            }
    }
    free(recent);
    free(sink);
}

/* The step plan: a 300-token prefill (two pages and a partial one), a
 * 20-token chunk crossing the sink, decodes of three sequences across a
 * page boundary, a chunk ending on one. */
static void run_case(fr_kv_dtype dt, const char *recipe, int dc)
{
    printf("  %s %s, latent %d + RoPE %d\n", fr_kv_dtype_name(dt), recipe, dc, DR);
    rig *r = rig_open(dt, recipe, dc, 0x51a7u + (uint64_t)dt * 131u + (uint64_t)dc);
    int a, b, c;
    FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &a));
    FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &b));
    FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &c));
    rig_step(r, (step_item[]){{a, 300}}, 1);
    rig_step(r, (step_item[]){{b, 10}, {c, 120}}, 2);
    rig_step(r, (step_item[]){{b, 20}, {c, 5}}, 2);
    for (int i = 0; i < 100; i++) rig_step(r, (step_item[]){{a, 1}, {b, 1}, {c, 1}}, 3);
    rig_step(r, (step_item[]){{b, 126}}, 1);   /* 256: ends on a page boundary */
    for (int s = 0; s < 3; s++) rig_compare(r, (int[]){a, b, c}[s]);
    rig_close(r);
}

static void test_latent_pages_fp4(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const char *recipes[] = {"full", "vanilla", "full,-smooth", "full,-rotate"};
    for (int dc = 256; dc <= 512; dc *= 2)
        for (int i = 0; i < 4; i++) {
            run_case(FR_KV_NVFP4, recipes[i], dc);
            run_case(FR_KV_MXFP4, recipes[i], dc);
        }
}

static void test_latent_pages_fp8_bf16(void **state)
{
    (void)state;
    REQUIRE_GPU();
    for (int dc = 256; dc <= 512; dc *= 2) {
        run_case(FR_KV_FP8, "full", dc);
        run_case(FR_KV_FP8, "vanilla", dc);
        run_case(FR_KV_BF16, "full", dc);
        run_case(FR_KV_BF16, "vanilla", dc);
    }
}

/* A fork copies one half per token: the copy continues exactly as a
 * sequence that never forked would, on both sides. */
static void test_latent_fork(void **state)
{
    (void)state;
    REQUIRE_GPU();
    rig *r = rig_open(FR_KV_NVFP4, "full", 256, 99);
    int a, b;
    FR_OK_OR_FAIL(fr_kv_seq_new(r->cpu, &a));
    rig_step(r, (step_item[]){{a, 140}}, 1);
    FR_OK_OR_FAIL(fr_kv_seq_fork(r->cpu, a, &b));
    FR_OK_OR_FAIL(fr_kv_store_gpu_copy_slot(r->gpu, a, b, r->stream));
    memcpy(r->hist[b], r->hist[a], sizeof(float) * (size_t)NL * MAX_TOK * r->d);
    for (int i = 0; i < 120; i++) rig_step(r, (step_item[]){{a, 1}, {b, 1}}, 2);
    rig_compare(r, a);
    rig_compare(r, b);
    rig_close(r);
}

/* What the latent store refuses: f32, a latent width not a multiple of the
 * FP4 block, a rotation over a non-power-of-two latent. */
static void test_latent_config_errors(void **state)
{
    (void)state;
    REQUIRE_GPU();
    fr_recipe rc;
    assert_int_equal(fr_recipe_parse("full", &rc), FR_OK);
    fr_kv_cache_config cfg = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 320, .latent_dim = 256, .dtype = FR_KV_F32,
                              .compute = FR_COMPUTE_EXACT, .recipe = rc, .tau = FR_P_TAU, .n_blocks = 2, .max_seqs = 1};
    fr_kv_store_gpu *s = NULL;
    assert_int_equal(fr_kv_store_gpu_new(&cfg, &s), FR_EUNSUPPORTED);
    cfg.dtype = FR_KV_MXFP4;
    cfg.latent_dim = 240;   /* 240 + 80 */
    assert_int_equal(fr_kv_store_gpu_new(&cfg, &s), FR_EINVAL);
    cfg.dtype = FR_KV_NVFP4;   /* a multiple of 16, but no power of two */
    assert_int_equal(fr_kv_store_gpu_new(&cfg, &s), FR_EINVAL);
    cfg.n_kv_heads = 2;
    cfg.latent_dim = 256;
    assert_int_equal(fr_kv_store_gpu_new(&cfg, &s), FR_EINVAL);
    assert_null(s);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_latent_pages_fp4),
                 cmocka_unit_test(test_latent_pages_fp8_bf16),
                 cmocka_unit_test(test_latent_fork),
                 cmocka_unit_test(test_latent_config_errors))
