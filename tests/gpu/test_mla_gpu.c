/* tqa (DeepSeek-V3 multi-head latent attention, dense MLP) on the CUDA
 * backend against the CPU backend, the reference (rollout/model/mla_cpu.h):
 *  - prefill logits of the seven golden prompts at BF16 level, with BF16,
 *    NVFP4 (bf16 and exact compute), MXFP4 and FP8 latent caches, both
 *    backends with the same cache and numerics;
 *  - greedy continuations (64 tokens, the decode path: CUDA graphs on the
 *    GPU) equal to the CPU's with BF16 and NVFP4 latent caches on at least
 *    six of the seven prompts, and against transformers' float32 ones;
 *  - GPU decode against GPU prefill, forks (one slot half per token), and
 *    what the GPU refuses for these models (deterministic mode, f32 latent
 *    caches).
 * Needs the tqa checkpoint (FR_TQA_DIR, or ../shared/models/tqa) and a
 * device; skipped otherwise. */
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

#include "base/safetensors.h"
#include "rollout/engine/session.h"
#include "tests/unit/logits_util.h"
#include "tests/unit/test_util.h"

enum { V = 272, N_PROMPTS = 7, GREEDY = 64 };

static char tqa[4096], golden_path[4200];

static int have_tqa_and_gpu(void)
{
    if (!fr_gpu_test_available()) return 0;
    const char *d = fr_test_require_model("tqa");
    if (!d) return 0;
    snprintf(tqa, sizeof tqa, "%s", d);
    snprintf(golden_path, sizeof golden_path, "%s/golden.safetensors", d);
    return 1;
}

static void open_session(fr_backend b, fr_kv_dtype kv, fr_fp4_compute compute, int n_blocks, int max_seqs,
                         fr_session *s)
{
    fr_engine_opts o = fr_test_engine_opts(b, tqa, kv);
    o.compute = compute;
    if (fr_session_open(&o, n_blocks, max_seqs, s)) fail_msg("session: %s", fr_last_error());
    assert_int_equal(s->backend, b);
}

static float *prefill_logits(fr_session *s, const int *ids, int n)
{
    float *logits = malloc(sizeof(float) * (size_t)n * V);
    assert_non_null(logits);
    int seq;
    if (fr_session_prefill(s, ids, n, 512, &seq, NULL, logits)) fail_msg("prefill: %s", fr_last_error());
    fr_kv_seq_free(s->kv, seq);
    return logits;
}

static void diff_stats(const float *a, const float *b, size_t n, float *max_d, double *mean_d, float *top)
{
    float m = 0, t = 0;
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        const float d = fabsf(a[i] - b[i]);
        m = fmaxf(m, d);
        t = fmaxf(t, fabsf(b[i]));
        sum += d;
    }
    *max_d = m;
    *mean_d = sum / (double)n;
    *top = t;
}

/* Every golden prompt's prefill logits, GPU against CPU with the same
 * cache: mean |diff| within 1% and max |diff| within 10% of max |logit|
 * (BF16 weights and activations against float32). */
static void logits_case(fr_kv_dtype kv, fr_fp4_compute compute)
{
    printf("  %s latent cache, %s compute\n", fr_kv_dtype_name(kv), fr_fp4_compute_name(compute));
    fr_st_file *g;
    assert_int_equal(fr_st_file_open(golden_path, &g), FR_OK);
    fr_session cpu, gpu;
    open_session(FR_BACKEND_CPU, kv, compute, 4096 / 128 + 2, 1, &cpu);
    open_session(FR_BACKEND_CUDA, kv, compute, 4096 / 128 + 2, 1, &gpu);
    for (int p = 0; p < N_PROMPTS; p++) {
        int n;
        int *ids = fr_test_golden_ints(g, p, "ids", &n);
        float *c = prefill_logits(&cpu, ids, n), *d = prefill_logits(&gpu, ids, n);
        float md, top;
        double mean;
        diff_stats(d, c, (size_t)n * V, &md, &mean, &top);
        printf("    p%d (%4d tokens): GPU vs CPU max |diff| %.4g mean %.4g, max |logit| %.3g (%.2e, %.2e)\n", p, n, md,
               mean, top, md / top, mean / top);
        assert_true(mean <= 1e-2 * top);
        assert_true(md <= 1e-1f * top);
        free(c);
        free(d);
        free(ids);
    }
    fr_session_close(&cpu);
    fr_session_close(&gpu);
    fr_st_file_close(&g);
}

static void test_logits_bf16(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    logits_case(FR_KV_BF16, FR_COMPUTE_BF16);
}

static void test_logits_nvfp4(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    logits_case(FR_KV_NVFP4, FR_COMPUTE_BF16);
    logits_case(FR_KV_NVFP4, FR_COMPUTE_EXACT);
}

static void test_logits_mxfp4_fp8(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    logits_case(FR_KV_MXFP4, FR_COMPUTE_BF16);
    logits_case(FR_KV_FP8, FR_COMPUTE_BF16);
}

/* 64 greedy tokens after the prompt through the session's decode (on the
 * GPU: sampling on the device, CUDA graphs). */
static void greedy_run(fr_session *s, const int *ids, int n, int *out)
{
    int seq;
    float logits[V];
    if (fr_session_prefill(s, ids, n, 512, &seq, logits, NULL)) fail_msg("prefill: %s", fr_last_error());
    int best = 0;
    for (int v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
    out[0] = best;
    const fr_decode_row row = {.params = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 1}};
    for (int i = 1; i < GREEDY; i++) {
        fr_step_seq step = {.seq = seq, .n = 1, .tokens = &out[i - 1], .all_logits = 0};
        if (fr_session_decode(s, &step, &row, 1, &out[i], NULL)) fail_msg("decode: %s", fr_last_error());
    }
    fr_kv_seq_free(s->kv, seq);
}

static void greedy_case(fr_kv_dtype kv)
{
    printf("  %s latent cache\n", fr_kv_dtype_name(kv));
    fr_st_file *g;
    assert_int_equal(fr_st_file_open(golden_path, &g), FR_OK);
    fr_session cpu, gpu;
    open_session(FR_BACKEND_CPU, kv, FR_COMPUTE_BF16, 4096 / 128 + 4, 1, &cpu);
    open_session(FR_BACKEND_CUDA, kv, FR_COMPUTE_BF16, 4096 / 128 + 4, 1, &gpu);
    int equal_cpu = 0, equal_golden = 0;
    for (int p = 0; p < N_PROMPTS; p++) {
        int n, c[GREEDY], d[GREEDY], want[GREEDY];
        int *ids = fr_test_golden_ints(g, p, "ids", &n);
        char name[32];
        snprintf(name, sizeof name, "p%d.greedy", p);
        const fr_st_tensor *t = fr_st_file_find(g, name);
        assert_non_null(t);
        assert_int_equal((int)t->shape[0], GREEDY);
        memcpy(want, t->data, sizeof want);
        greedy_run(&cpu, ids, n, c);
        greedy_run(&gpu, ids, n, d);
        int same = 0, gold = 0;
        while (same < GREEDY && c[same] == d[same]) same++;
        while (gold < GREEDY && d[gold] == want[gold]) gold++;
        printf("    p%d: GPU equals the CPU for %d of %d tokens, transformers' float32 for %d\n", p, same, GREEDY,
               gold);
        equal_cpu += same == GREEDY;
        equal_golden += gold == GREEDY;
        free(ids);
    }
    printf("    %d of 7 prompts equal to the CPU's, %d of 7 to transformers'\n", equal_cpu, equal_golden);
    assert_true(equal_cpu >= 6);
    fr_session_close(&cpu);
    fr_session_close(&gpu);
    fr_st_file_close(&g);
}

static void test_greedy_bf16(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    greedy_case(FR_KV_BF16);
}

static void test_greedy_nvfp4(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    greedy_case(FR_KV_NVFP4);
}

/* The GPU's token-by-token steps against its prefill (p3): the same latent
 * cache read by decode rows and by prefill rows of the kernel. */
static void test_decode_vs_prefill(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    fr_st_file *g;
    assert_int_equal(fr_st_file_open(golden_path, &g), FR_OK);
    fr_kv_dtype kinds[2] = {FR_KV_BF16, FR_KV_NVFP4};
    for (int k = 0; k < 2; k++) {
        fr_session s;
        open_session(FR_BACKEND_CUDA, kinds[k], FR_COMPUTE_BF16, 12, 1, &s);
        int n, seq;
        int *ids = fr_test_golden_ints(g, 3, "ids", &n);
        float *pre = prefill_logits(&s, ids, n), *dec = malloc(sizeof(float) * (size_t)n * V);
        assert_non_null(dec);
        assert_int_equal(fr_kv_seq_new(s.kv, &seq), FR_OK);
        for (int i = 0; i < n; i++) {
            fr_step_seq step = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 1};
            if (fr_session_step(&s, &step, 1, dec + (size_t)i * V)) fail_msg("step: %s", fr_last_error());
        }
        float md, top;
        double mean;
        diff_stats(dec, pre, (size_t)n * V, &md, &mean, &top);
        printf("  %s p3 (%d tokens): GPU decode vs GPU prefill max |diff| %.4g (%.2e of max |logit|), mean %.3g\n",
               fr_kv_dtype_name(kinds[k]), n, md, md / top, mean);
        assert_true(md <= 3e-2f * top);
        free(pre);
        free(dec);
        free(ids);
        fr_session_close(&s);
    }
    fr_st_file_close(&g);
}

/* A forked sample continues exactly as its source (greedy), across a page
 * boundary: the fork's latent slots (one half per token) were copied. */
static void test_fork(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    fr_session s;
    open_session(FR_BACKEND_CUDA, FR_KV_NVFP4, FR_COMPUTE_BF16, 16, 2, &s);
    int ids[200];
    for (int i = 0; i < 200; i++) ids[i] = (i * 37 + 11) % 256;
    int a, b;
    float la[V];
    if (fr_session_prefill(&s, ids, 200, 64, &a, la, NULL)) fail_msg("%s", fr_last_error());
    if (fr_session_fork(&s, a, &b)) fail_msg("fork: %s", fr_last_error());
    int ta = 65, tb = 65;
    const fr_decode_row rows[2] = {{.params = {.temperature = 0.0f, .top_p = 1.0f}},
                                   {.params = {.temperature = 0.0f, .top_p = 1.0f}}};
    for (int i = 0; i < 80; i++) {   /* 200 + 80 crosses the page boundary at 256 */
        fr_step_seq steps[2] = {{.seq = a, .n = 1, .tokens = &ta}, {.seq = b, .n = 1, .tokens = &tb}};
        int out[2];
        if (fr_session_decode(&s, steps, rows, 2, out, NULL)) fail_msg("decode: %s", fr_last_error());
        assert_int_equal(out[0], out[1]);
        ta = out[0];
        tb = out[1];
    }
    fr_session_close(&s);
}

/* What the GPU refuses for a latent model, and that auto then picks the CPU
 * for an f32 latent cache. */
static void test_refusals(void **state)
{
    (void)state;
    if (!have_tqa_and_gpu()) skip();
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.model = tqa;
    o.backend = FR_BACKEND_CUDA;
    o.deterministic = 1;
    fr_session s;
    assert_int_equal(fr_session_open(&o, 8, 1, &s), FR_EUNSUPPORTED);
    printf("  deterministic: %s\n", fr_last_error());
    assert_non_null(strstr(fr_last_error(), "latent"));
    o.deterministic = 0;
    o.kv = FR_KV_F32;
    assert_int_equal(fr_session_open(&o, 8, 1, &s), FR_EUNSUPPORTED);
    printf("  f32 latent cache: %s\n", fr_last_error());
    o.backend = FR_BACKEND_AUTO;
    FR_OK_OR_FAIL(fr_session_open(&o, 8, 1, &s));
    assert_int_equal(s.backend, FR_BACKEND_CPU);
    fr_session_close(&s);
    o.kv = FR_KV_NVFP4;   /* auto takes the GPU for every other latent dtype */
    FR_OK_OR_FAIL(fr_session_open(&o, 8, 1, &s));
    assert_int_equal(s.backend, FR_BACKEND_CUDA);
    fr_session_close(&s);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_logits_bf16),
                 cmocka_unit_test(test_logits_nvfp4),
                 cmocka_unit_test(test_logits_mxfp4_fp8),
                 cmocka_unit_test(test_greedy_bf16),
                 cmocka_unit_test(test_greedy_nvfp4),
                 cmocka_unit_test(test_decode_vs_prefill),
                 cmocka_unit_test(test_fork),
                 cmocka_unit_test(test_refusals))
