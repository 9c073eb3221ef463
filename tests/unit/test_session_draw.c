/* The session's sampling steps (rollout/engine/session.h) on the CPU backend,
 * against a plain fr_session_step plus fr_sample on a twin session fed the
 * same tokens:
 *  - fr_session_step_draw: a prefill chunk beside a decode; three draws from
 *    the chunk's row with different sample keys (a prompt's n samples) and
 *    one from the decode row; kept rows in any order;
 *  - fr_session_decode_keep: tokens equal fr_session_decode's, kept rows
 *    equal the step's logits bit for bit, tokens NULL samples nothing;
 *  - fr_session_fill: layer 0's keys and values equal a prefill's, later
 *    layers' do not, and the sequence decodes on;
 *  - refusals: draw or keep rows outside the step, bad sampling parameters;
 *    launching a decode apart from its wait needs CUDA.
 * The CUDA implementations are checked against these semantics on a GPU
 * (tests/gpu/scheduler_gpu.sh, test_sampler_gpu). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "rollout/model/sampler.h"
#include "rollout/engine/session.h"
#include "test_util.h"

static void open_tiny(fr_session *s)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, NULL, FR_KV_NVFP4);
    if (fr_session_open(&o, 32, 8, s)) fail_msg("%s", fr_last_error());
}

/* Two twin sessions, each with sequence a holding `prompt` and sequence b
 * empty. */
static void twins(fr_session *s, fr_session *t, int *a, int *b, const int *prompt, int n)
{
    fr_session *both[2] = {s, t};
    for (int k = 0; k < 2; k++) {
        open_tiny(both[k]);
        float *last = malloc(sizeof(float) * (size_t)both[k]->model->cfg.vocab_size);
        assert_non_null(last);
        assert_int_equal(fr_session_prefill(both[k], prompt, n, 64, a, last, NULL), FR_OK);
        assert_int_equal(fr_kv_seq_new(both[k]->kv, b), FR_OK);
        free(last);
    }
}

static void test_step_draw_equals_step_and_sample(void **state)
{
    (void)state;
    fr_session s, t;
    int a, b;
    const int prompt[6] = {1, 17, 42, 99, 3, 250}, chunk[5] = {7, 8, 9, 10, 11}, next = 33;
    twins(&s, &t, &a, &b, prompt, 6);
    const int V = s.model->cfg.vocab_size;
    /* row 0: the decode of a; row 1: the 5-token chunk of b (its last token) */
    fr_step_seq seqs[2] = {{.seq = a, .n = 1, .tokens = &next}, {.seq = b, .n = 5, .tokens = chunk}};
    const fr_sampling_params hot = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 5};
    const fr_sampling_params nucleus = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .seed = 6};
    fr_step_draw draws[4] = {{.row = 1, .d = {.params = hot, .sequence = 0, .step = 0}},
                             {.row = 1, .d = {.params = hot, .sequence = 1, .step = 0}},
                             {.row = 0, .d = {.params = nucleus, .sequence = 3, .step = 6}},
                             {.row = 1, .d = {.params = hot, .sequence = 2, .step = 0}}};
    int tok[4];
    float lp[4], *kept = malloc(sizeof(float) * 2 * (size_t)V), *want = malloc(sizeof(float) * 2 * (size_t)V);
    assert_non_null(kept);
    assert_non_null(want);
    const int keep[2] = {1, 0};
    assert_int_equal(fr_session_step_draw(&s, seqs, 2, draws, 4, tok, lp, keep, 2, kept), FR_OK);

    /* the twin: a plain step, then the CPU sampler */
    assert_int_equal(fr_session_step(&t, seqs, 2, want), FR_OK);
    assert_memory_equal(kept, want + V, sizeof(float) * (size_t)V);   /* keep[0] = row 1 */
    assert_memory_equal(kept + V, want, sizeof(float) * (size_t)V);
    fr_sampler *smp;
    assert_int_equal(fr_sampler_new(V, &smp), FR_OK);
    for (int i = 0; i < 4; i++) {
        int w;
        float wl;
        assert_int_equal(fr_sample(smp, want + (size_t)draws[i].row * V, &draws[i].d.params, draws[i].d.sequence,
                                   draws[i].d.step, &w, &wl),
                         FR_OK);
        assert_int_equal(tok[i], w);
        assert_true(lp[i] == wl);
    }
    fr_sampler_destroy(&smp);
    free(kept);
    free(want);
    fr_session_close(&s);
    fr_session_close(&t);
}

/* Sequences a (4 prompt tokens) and c (2) prefilled on a new session. */
static void two_prefilled(fr_session *s, int *a, int *c)
{
    const int prompt[4] = {1, 5, 6, 7};
    open_tiny(s);
    float *last = malloc(sizeof(float) * (size_t)s->model->cfg.vocab_size);
    assert_non_null(last);
    assert_int_equal(fr_session_prefill(s, prompt, 4, 64, a, last, NULL), FR_OK);
    assert_int_equal(fr_session_prefill(s, prompt, 2, 64, c, last, NULL), FR_OK);
    free(last);
}

static void test_decode_keep(void **state)
{
    (void)state;
    fr_session s, t, u;   /* decode_keep, decode, plain step: the same inputs */
    int a, c;
    two_prefilled(&s, &a, &c);
    two_prefilled(&t, &a, &c);
    two_prefilled(&u, &a, &c);
    const int V = s.model->cfg.vocab_size, next[2] = {40, 41};
    fr_step_seq seqs[2] = {{.seq = a, .n = 1, .tokens = &next[0]}, {.seq = c, .n = 1, .tokens = &next[1]}};
    fr_decode_row rows[2] = {{.params = {.temperature = 1.0f, .top_p = 1.0f, .seed = 9}, .sequence = 0, .step = 4},
                             {.params = {.temperature = 0.0f, .top_p = 1.0f}, .sequence = 1, .step = 2}};
    int tok[2], want_tok[2];
    float lp[2], want_lp[2], *kept = malloc(sizeof(float) * (size_t)V), *step = malloc(sizeof(float) * 2 * (size_t)V);
    assert_non_null(kept);
    assert_non_null(step);
    const int keep[1] = {1};
    assert_int_equal(fr_session_decode_keep(&s, seqs, rows, 2, tok, lp, keep, 1, kept), FR_OK);
    assert_int_equal(fr_session_decode(&t, seqs, rows, 2, want_tok, want_lp), FR_OK);
    assert_int_equal(fr_session_step(&u, seqs, 2, step), FR_OK);
    assert_int_equal(tok[0], want_tok[0]);
    assert_int_equal(tok[1], want_tok[1]);
    assert_true(lp[0] == want_lp[0] && lp[1] == want_lp[1]);
    assert_memory_equal(kept, step + V, sizeof(float) * (size_t)V);
    /* tokens NULL: the logits only, and the step still advances the cache */
    const int len = fr_kv_seq_len(s.kv, a);
    assert_int_equal(fr_session_decode_keep(&s, seqs, rows, 1, NULL, NULL, keep + 0, 0, NULL), FR_OK);
    assert_int_equal(fr_kv_seq_len(s.kv, a), len + 1);
    free(kept);
    free(step);
    fr_session_close(&s);
    fr_session_close(&t);
    fr_session_close(&u);
}

/* fr_session_fill writes what a prefill writes for layer 0 (the residual
 * stream is the embedding there in both), not for later layers (no
 * attention or MLP), and the sequence decodes on from its length. */
static void test_fill(void **state)
{
    (void)state;
    fr_session s, t;
    int a, b;
    enum { N = 300 };   /* two full pages (FP4) and a partial one */
    int toks[N];
    for (int i = 0; i < N; i++) toks[i] = (i * 37 + 11) % 250;
    open_tiny(&s);
    open_tiny(&t);
    const int V = s.model->cfg.vocab_size, d = s.model->cfg.head_dim, L = s.model->cfg.num_layers;
    assert_int_equal(fr_kv_seq_new(s.kv, &a), FR_OK);
    for (int at = 0; at < N; at += 128) {   /* in chunks, as a benchmark fills */
        fr_step_seq one = {.seq = a, .n = N - at < 128 ? N - at : 128, .tokens = toks + at};
        assert_int_equal(fr_session_fill(&s, &one, 1), FR_OK);
    }
    assert_int_equal(fr_kv_seq_len(s.kv, a), N);
    float *last = malloc(sizeof(float) * (size_t)V);
    assert_non_null(last);
    assert_int_equal(fr_session_prefill(&t, toks, N, 128, &b, last, NULL), FR_OK);
    float *k1 = malloc(sizeof(float) * N * (size_t)d), *v1 = malloc(sizeof(float) * N * (size_t)d);
    float *k2 = malloc(sizeof(float) * N * (size_t)d), *v2 = malloc(sizeof(float) * N * (size_t)d);
    assert_true(k1 && v1 && k2 && v2);
    fr_kv_view view;
    for (int l = 0; l < L; l++) {
        assert_int_equal(fr_kv_gather(s.kv, a, l, 0, 0, NULL, NULL, k1, v1, &view), FR_OK);
        assert_int_equal(fr_kv_gather(t.kv, b, l, 0, 0, NULL, NULL, k2, v2, &view), FR_OK);
        const int same = memcmp(k1, k2, sizeof(float) * N * (size_t)d) == 0 &&
                         memcmp(v1, v2, sizeof(float) * N * (size_t)d) == 0;
        if (l == 0) assert_true(same);
        else assert_false(same);
    }
    /* a decode after the fill */
    const int next = 5;
    fr_step_seq one = {.seq = a, .n = 1, .tokens = &next};
    fr_decode_row r = {.params = {.temperature = 0.0f, .top_p = 1.0f}, .sequence = 0, .step = 0};
    int tok = -1;
    assert_int_equal(fr_session_decode(&s, &one, &r, 1, &tok, NULL), FR_OK);
    assert_true(tok >= 0 && tok < V);
    assert_int_equal(fr_kv_seq_len(s.kv, a), N + 1);
    assert_int_equal(fr_session_fill(&s, NULL, 1), FR_EINVAL);
    free(last);
    free(k1); free(v1); free(k2); free(v2);
    fr_session_close(&s);
    fr_session_close(&t);
}

static void test_refusals(void **state)
{
    (void)state;
    fr_session s;
    open_tiny(&s);
    const int V = s.model->cfg.vocab_size;
    int a;
    assert_int_equal(fr_kv_seq_new(s.kv, &a), FR_OK);
    const int toks[3] = {1, 2, 3};
    fr_step_seq seqs[1] = {{.seq = a, .n = 3, .tokens = toks}};
    fr_step_draw d = {.row = 1, .d = {.params = {.temperature = 1.0f, .top_p = 1.0f}}};
    int tok;
    float *kept = malloc(sizeof(float) * (size_t)V);
    assert_non_null(kept);
    assert_int_equal(fr_session_step_draw(&s, seqs, 1, &d, 1, &tok, NULL, NULL, 0, NULL), FR_EINVAL);
    fr_test_error_has("reads logit row 1 of 1");
    d.row = 0;
    d.d.params.top_p = 1.5f;
    assert_int_equal(fr_session_step_draw(&s, seqs, 1, &d, 1, &tok, NULL, NULL, 0, NULL), FR_EINVAL);
    d.d.params.top_p = 1.0f;
    const int bad_keep = 2;
    assert_int_equal(fr_session_step_draw(&s, seqs, 1, &d, 1, &tok, NULL, &bad_keep, 1, kept), FR_EINVAL);
    fr_test_error_has("outside the step");
    assert_int_equal(fr_kv_seq_len(s.kv, a), 0);   /* nothing ran */
    fr_step_seq one[1] = {{.seq = a, .n = 1, .tokens = toks}};
    fr_decode_row r = {.params = {.temperature = 0.0f, .top_p = 1.0f}};
    assert_int_equal(fr_session_decode_keep(&s, one, &r, 1, &tok, NULL, &bad_keep, 1, kept), FR_EINVAL);
    assert_int_equal(fr_session_decode_launch(&s, one, &r, 1), FR_EUNSUPPORTED);
    fr_test_error_has("CUDA");
    free(kept);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_step_draw_equals_step_and_sample),
             cmocka_unit_test(test_decode_keep),
             cmocka_unit_test(test_fill),
             cmocka_unit_test(test_refusals))
