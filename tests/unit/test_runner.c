/* The runner interface (rollout/model/runner.h) on the CPU runner, opened
 * without a session over a cache of its own (as calibration and eval-kl
 * open it):
 *  - a decode batch's tokens and kept rows equal a step batch's logits and
 *    fr_sample on a twin runner fed the same tokens; a decode without
 *    tokens samples nothing and keeps its rows;
 *  - a fill batch appends its tokens (no logits) and the sequence decodes on;
 *  - what the CPU runner refuses: a decode launched apart from its wait, a
 *    rider, keep rows outside the batch, an unknown batch kind; bad
 *    configurations; what it reports: no device, no graphs;
 *  - in a build without CUDA, fr_runner_cuda_open answers FR_EUNSUPPORTED
 *    and says so, and device weights in a configuration reach it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "rollout/model/runner.h"
#include "test_util.h"

typedef struct {
    fr_model *m;
    fr_kv_cache *kv;
    fr_runner *r;
} rig;

static void rig_open(rig *g)
{
    memset(g, 0, sizeof *g);
    if (fr_model_load("synthetic:tiny", &g->m)) fail_msg("%s", fr_last_error());
    const fr_model_config *c = &g->m->cfg;
    fr_kv_cache_config kc = {.n_layers = c->num_layers, .n_kv_heads = c->num_kv_heads, .head_dim = c->head_dim,
                             .dtype = FR_KV_BF16, .compute = FR_COMPUTE_EXACT, .recipe = fr_recipe_full(),
                             .tau = FR_P_TAU, .n_blocks = 8, .max_seqs = 4};
    if (fr_kv_cache_new(&kc, &g->kv)) fail_msg("%s", fr_last_error());
    const fr_runner_config rc = {.model = g->m, .kv = g->kv, .max_step_tokens = 64};
    if (fr_runner_open(&rc, &g->r)) fail_msg("%s", fr_last_error());
}

static void rig_close(rig *g)
{
    fr_runner_destroy(&g->r);
    assert_null(g->r);
    fr_kv_cache_destroy(&g->kv);
    fr_model_destroy(&g->m);
}

/* Sequences a and b, each holding the prompt, in g. */
static void two_prompts(rig *g, int *a, int *b)
{
    const int prompt[5] = {1, 17, 42, 99, 3};
    assert_int_equal(fr_kv_seq_new(g->kv, a), FR_OK);
    assert_int_equal(fr_kv_seq_new(g->kv, b), FR_OK);
    fr_step_seq seqs[2] = {{.seq = *a, .n = 5, .tokens = prompt}, {.seq = *b, .n = 5, .tokens = prompt}};
    const fr_batch step = {.kind = FR_BATCH_STEP, .seqs = seqs, .n_seqs = 2};   /* no draw, nothing kept */
    assert_int_equal(fr_runner_run(g->r, &step), FR_OK);
}

static void test_decode_equals_step_and_sample(void **state)
{
    (void)state;
    rig g, t;
    rig_open(&g);
    rig_open(&t);
    int a, b;
    two_prompts(&g, &a, &b);
    two_prompts(&t, &a, &b);
    const int V = g.m->cfg.vocab_size, next[2] = {7, 250};
    fr_step_seq seqs[2] = {{.seq = a, .n = 1, .tokens = &next[0]}, {.seq = b, .n = 1, .tokens = &next[1]}};
    const fr_decode_row rows[2] = {
        {.params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 5}, .sequence = 0, .step = 5},
        {.params = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .seed = 6}, .sequence = 3, .step = 5}};
    const int keep[1] = {1};
    int tok[2];
    float lp[2], *kept = malloc(sizeof(float) * (size_t)V), *want = malloc(sizeof(float) * 2 * (size_t)V);
    assert_non_null(kept);
    assert_non_null(want);
    const fr_batch dec = {.kind = FR_BATCH_DECODE, .seqs = seqs, .n_seqs = 2, .rows = rows, .keep = keep,
                          .n_keep = 1, .tokens = tok, .logprobs = lp, .kept_logits = kept};
    assert_int_equal(fr_runner_run(g.r, &dec), FR_OK);
    const fr_batch step = {.kind = FR_BATCH_STEP, .seqs = seqs, .n_seqs = 2, .logits = want};
    assert_int_equal(fr_runner_run(t.r, &step), FR_OK);
    assert_memory_equal(kept, want + V, sizeof(float) * (size_t)V);
    fr_sampler *smp;
    assert_int_equal(fr_sampler_new(V, &smp), FR_OK);
    for (int i = 0; i < 2; i++) {
        int w;
        float wl;
        assert_int_equal(fr_sample(smp, want + (size_t)i * V, &rows[i].params, rows[i].sequence, rows[i].step, &w, &wl),
                         FR_OK);
        assert_int_equal(tok[i], w);
        assert_true(lp[i] == wl);
    }
    fr_sampler_destroy(&smp);
    /* Logits only: nothing sampled, the kept row still out. */
    const int again[2] = {tok[0], tok[1]};
    seqs[0].tokens = &again[0];
    seqs[1].tokens = &again[1];
    tok[0] = tok[1] = -7;
    const fr_batch quiet = {.kind = FR_BATCH_DECODE, .seqs = seqs, .n_seqs = 2, .rows = rows, .keep = keep,
                            .n_keep = 1, .kept_logits = kept};
    assert_int_equal(fr_runner_run(g.r, &quiet), FR_OK);
    assert_int_equal(tok[0], -7);
    assert_int_equal(fr_kv_seq_len(g.kv, a), 7);
    free(kept);
    free(want);
    rig_close(&g);
    rig_close(&t);
}

static void test_fill_then_decode(void **state)
{
    (void)state;
    rig g;
    rig_open(&g);
    int s;
    const int toks[9] = {3, 1, 4, 1, 5, 9, 2, 6, 5};
    assert_int_equal(fr_kv_seq_new(g.kv, &s), FR_OK);
    fr_step_seq fill = {.seq = s, .n = 9, .tokens = toks};
    const fr_batch b = {.kind = FR_BATCH_FILL, .seqs = &fill, .n_seqs = 1};
    assert_int_equal(fr_runner_run(g.r, &b), FR_OK);
    assert_int_equal(fr_kv_seq_len(g.kv, s), 9);
    fr_step_seq one = {.seq = s, .n = 1, .tokens = toks};
    const fr_decode_row row = {.params = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f}};
    int tok = -1;
    const fr_batch dec = {.kind = FR_BATCH_DECODE, .seqs = &one, .n_seqs = 1, .rows = &row, .tokens = &tok};
    assert_int_equal(fr_runner_run(g.r, &dec), FR_OK);
    assert_true(tok >= 0 && tok < g.m->cfg.vocab_size);
    assert_int_equal(fr_kv_seq_len(g.kv, s), 10);
    rig_close(&g);
}

static void test_cpu_refusals_and_reports(void **state)
{
    (void)state;
    rig g, h;
    rig_open(&g);
    rig_open(&h);
    int s, tok;
    const int t0 = 5;
    assert_int_equal(fr_kv_seq_new(g.kv, &s), FR_OK);
    fr_step_seq one = {.seq = s, .n = 1, .tokens = &t0};
    const fr_decode_row row = {.params = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f}};
    fr_batch b = {.kind = FR_BATCH_DECODE, .phase = FR_RUN_LAUNCH, .seqs = &one, .n_seqs = 1, .rows = &row};
    assert_int_equal(fr_runner_run(g.r, &b), FR_EUNSUPPORTED);
    fr_test_error_has("launched apart from its wait needs the CUDA backend");
    b.phase = FR_RUN_WAIT;
    assert_int_equal(fr_runner_run(g.r, &b), FR_EUNSUPPORTED);
    b.phase = FR_RUN_LAUNCH;
    b.rider = h.r;
    b.rider_seqs = &one;
    b.n_rider = 1;
    assert_int_equal(fr_runner_run(g.r, &b), FR_EUNSUPPORTED);
    fr_test_error_has("carrying another session's needs the CUDA backend");
    const int keep[1] = {1};
    float kept[1];
    const fr_batch out = {.kind = FR_BATCH_DECODE, .seqs = &one, .n_seqs = 1, .rows = &row, .keep = keep,
                          .n_keep = 1, .tokens = &tok, .kept_logits = kept};
    assert_int_equal(fr_runner_run(g.r, &out), FR_EINVAL);
    fr_test_error_has("outside the batch");
    assert_int_equal(fr_kv_seq_len(g.kv, s), 0);   /* refused before anything ran */
    const fr_batch odd = {.kind = (fr_batch_kind)42, .seqs = &one, .n_seqs = 1};
    assert_int_equal(fr_runner_run(g.r, &odd), FR_EINVAL);
    assert_int_equal(fr_runner_run(g.r, NULL), FR_EINVAL);
    /* The CPU cache is the runner's own: fork and key mean have nothing more to do. */
    assert_int_equal(fr_runner_fork(g.r, s, s), FR_OK);
    assert_int_equal(fr_runner_set_deterministic(g.r, 1), FR_OK);
    assert_int_equal(fr_runner_weights_changed(g.r), FR_OK);
    assert_false(fr_runner_on_device(g.r));
    int captures = -1;
    double seconds = -1.0;
    fr_runner_capture_stats(g.r, &captures, &seconds);
    assert_int_equal(captures, 0);
    assert_true(seconds == 0.0);
    fr_runner_capture_stats(NULL, &captures, &seconds);
    assert_int_equal(captures, 0);
    fr_runner *none = (fr_runner *)&g;   /* overwritten with NULL before any use */
    assert_int_equal(fr_runner_open(NULL, &none), FR_EINVAL);
    assert_null(none);
    const fr_runner_config no_cache = {.model = g.m, .max_step_tokens = 8};
    assert_int_equal(fr_runner_open(&no_cache, &none), FR_EINVAL);
    fr_runner_destroy(NULL);
    rig_close(&g);
    rig_close(&h);
}

static void test_cuda_absent_from_cpu_build(void **state)
{
    (void)state;
    if (fr_cuda_built()) skip();   /* the stand-ins exist in the CPU-only build alone */
    assert_false(fr_cuda_available());
    assert_non_null(strstr(fr_cuda_absence(), "no CUDA support"));
    rig g;
    rig_open(&g);
    fr_runner *r = NULL;
    fr_runner_config rc = {.model = g.m, .kv = g.kv, .max_step_tokens = 8};
    assert_int_equal(fr_runner_cuda_open(&rc, &r), FR_EUNSUPPORTED);
    fr_test_error_has("no CUDA support");
    assert_null(r);
    rc.gpu = (const struct fr_weights_gpu *)&g;   /* never read: refused first */
    assert_int_equal(fr_runner_open(&rc, &r), FR_EUNSUPPORTED);
    assert_null(r);
    rig_close(&g);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_decode_equals_step_and_sample),
             cmocka_unit_test(test_fill_then_decode),
             cmocka_unit_test(test_cpu_refusals_and_reports),
             cmocka_unit_test(test_cuda_absent_from_cpu_build))
