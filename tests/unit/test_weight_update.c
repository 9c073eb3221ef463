/* Weight updates of a running session (rollout/engine/weight_update.h): a session
 * on synthetic:tiny receives synthetic:tiny:7's tensors in pieces, in
 * reverse order, and after the commit computes exactly what a session
 * opened on synthetic:tiny:7 computes. Every refusal (unknown name, wrong
 * shape, overlapping or out-of-range bytes, mixed dtypes, NaN and inf,
 * an incomplete update) names the tensor and leaves the serving weights
 * as they were. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "rollout/engine/session.h"
#include "rollout/engine/weight_update.h"
#include "test_util.h"

static const int PROMPT[] = {256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};
enum { NP = sizeof PROMPT / sizeof PROMPT[0] };

static void open_tiny(const char *spec, fr_session *s)
{
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.model = spec;
    o.backend = FR_BACKEND_CPU;
    assert_int_equal(fr_session_open(&o, 16, 2, s), FR_OK);
}

/* The last position's logits of PROMPT (vocab floats, caller frees). */
static float *logits_of(fr_session *s)
{
    const int V = s->model->cfg.vocab_size;
    float *l = malloc(sizeof(float) * (size_t)V);
    assert_non_null(l);
    int seq;
    assert_int_equal(fr_session_prefill(s, PROMPT, NP, 64, &seq, l, NULL), FR_OK);
    fr_kv_seq_free(s->kv, seq);
    return l;
}

/* Tensor i of the update's list, taken from model m (the same walk as the
 * update's: the model's layout). */
static const float *source(const fr_model *m, const fr_weight_update *u, int i, size_t *count)
{
    const char *name;
    int ndim;
    int64_t shape[2];
    assert_int_equal(fr_weight_update_tensor(u, i, &name, &ndim, shape), FR_OK);
    *count = (size_t)shape[0] * (size_t)(ndim == 2 ? shape[1] : 1);
    size_t off = 0;
    for (int j = 0; j < i; j++) {
        const char *n2;
        int d2;
        int64_t s2[2];
        assert_int_equal(fr_weight_update_tensor(u, j, &n2, &d2, s2), FR_OK);
        off += (size_t)s2[0] * (size_t)(d2 == 2 ? s2[1] : 1);
    }
    size_t total;
    const float *data = fr_model_data(m, &total);
    assert_true(off + *count <= total);
    return data + off;
}

static void put(fr_weight_update *u, int i, const float *src, size_t count, size_t from, size_t to)
{
    const char *name;
    int ndim;
    int64_t shape[2];
    assert_int_equal(fr_weight_update_tensor(u, i, &name, &ndim, shape), FR_OK);
    (void)count;
    assert_int_equal(fr_weight_update_put(u, name, FR_DTYPE_F32, shape, ndim, from * 4, src + from, (to - from) * 4),
                     FR_OK);
}

static void test_update_equals_fresh_session(void **state)
{
    (void)state;
    fr_session a, b;
    open_tiny("synthetic:tiny", &a);
    open_tiny("synthetic:tiny:7", &b);
    float *la = logits_of(&a), *lb = logits_of(&b);
    assert_true(memcmp(la, lb, sizeof(float) * 272) != 0);

    fr_weight_update *u;
    assert_int_equal(fr_weight_update_begin(&a.model->cfg, 5, &u), FR_OK);
    assert_int_equal(fr_weight_update_version(u), 5);
    const int n = fr_weight_update_tensor_count(u);
    assert_int_equal(n, 11 * 2 + 3);   /* tiny: 2 layers, untied lm_head */
    for (int i = n - 1; i >= 0; i--) {   /* reverse order, each in two pieces, the second half first */
        size_t count;
        const float *src = source(b.model, u, i, &count);
        put(u, i, src, count, count / 2, count);
        if (i == 3) assert_int_equal(fr_session_commit_weights(&a, u), FR_EINVAL);   /* not complete yet */
        put(u, i, src, count, 0, count / 2);
    }
    assert_int_equal(fr_weight_update_ready(u, NULL), FR_OK);
    assert_int_equal(fr_session_commit_weights(&a, u), FR_OK);
    float *la2 = logits_of(&a);
    assert_memory_equal(la2, lb, sizeof(float) * 272);
    fr_weight_update_free(&u);
    assert_null(u);
    free(la); free(lb); free(la2);
    fr_session_close(&a);
    fr_session_close(&b);
}

static void expect_fail(fr_status st, const char *needle)
{
    assert_int_equal(st, FR_EINVAL);
    if (!strstr(fr_last_error(), needle)) fail_msg("message '%s' lacks '%s'", fr_last_error(), needle);
}

static void expect_fail_status(fr_status st, fr_status want, const char *needle)
{
    assert_int_equal(st, want);
    if (!strstr(fr_last_error(), needle)) fail_msg("message '%s' lacks '%s'", fr_last_error(), needle);
}

static void test_refusals_change_nothing(void **state)
{
    (void)state;
    fr_session a;
    open_tiny("synthetic:tiny", &a);
    float *before = logits_of(&a);
    fr_weight_update *u;
    assert_int_equal(fr_weight_update_begin(&a.model->cfg, 2, &u), FR_OK);
    const char *q = "model.layers.1.self_attn.q_proj.weight";
    const int64_t qs[2] = {256, 128}, bad_shape[2] = {128, 256};
    float vals[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    expect_fail(fr_weight_update_put(u, "model.layers.9.mlp.up_proj.weight", FR_DTYPE_F32, qs, 2, 0, vals, 32),
                "model.layers.9.mlp.up_proj.weight");
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_F32, bad_shape, 2, 0, vals, 32), "shape [128, 256]");
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 1, 0, vals, 32), q);
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, 2, vals, 32), "multiples");
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, (uint64_t)256 * 128 * 4 - 16, vals, 32), "past");
    vals[5] = NAN;
    expect_fail_status(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, 0, vals, 32), FR_EFORMAT, "element 5 is NaN");
    vals[5] = INFINITY;
    expect_fail_status(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, 0, vals, 32), FR_EFORMAT, "infinite");
    /* bf16 and a NaN in a later block of 4096 elements, named with its index in the tensor */
    {
        static uint16_t big[5000];
        for (int i = 0; i < 5000; i++) big[i] = 0x3f80;   /* 1.0 */
        big[4500] = 0x7fc0;
        const char *e = "lm_head.weight";
        const int64_t es[2] = {a.model->cfg.vocab_size, a.model->cfg.hidden_size};
        expect_fail_status(fr_weight_update_put(u, e, FR_DTYPE_BF16, es, 2, 200, big, sizeof big), FR_EFORMAT,
                           "element 4600 is NaN");
        big[4500] = 0x3f80;
        assert_int_equal(fr_weight_update_put(u, e, FR_DTYPE_BF16, es, 2, 200, big, sizeof big), FR_OK);
        const float *lm = fr_weight_update_model(u)->w.lm_head;
        assert_true(lm[100] == 1.0f && lm[100 + 4500] == 1.0f && lm[100 + 4999] == 1.0f);
        big[4500] = 0x7f80;   /* +inf, and the range is taken now: the overlap is reported first */
        expect_fail(fr_weight_update_put(u, e, FR_DTYPE_BF16, es, 2, 200, big, sizeof big), "overlap");
    }
    vals[5] = 6;
    assert_int_equal(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, 0, vals, 32), FR_OK);
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_F32, qs, 2, 16, vals, 32), "overlap");
    uint16_t h[4] = {0x3f80, 0x4000, 0xbf80, 0};
    expect_fail(fr_weight_update_put(u, q, FR_DTYPE_BF16, qs, 2, 64, h, 8), "arrives as bf16, its first piece came as f32");
    /* BF16 pieces convert exactly */
    const char *k = "model.layers.0.self_attn.k_norm.weight";
    const int64_t ks[1] = {64};
    assert_int_equal(fr_weight_update_put(u, k, FR_DTYPE_BF16, ks, 1, 0, h, 8), FR_OK);
    const fr_model *sm = fr_weight_update_model(u);
    assert_true(sm->w.layers[0].k_norm[0] == 1.0f && sm->w.layers[0].k_norm[1] == 2.0f &&
                sm->w.layers[0].k_norm[2] == -1.0f && sm->w.layers[0].k_norm[3] == 0.0f);
    fr_dtype t;
    assert_int_equal(fr_weight_dtype_parse("BF16", &t), FR_OK);
    assert_int_equal(t, FR_DTYPE_BF16);
    expect_fail(fr_weight_dtype_parse("I8", &t), "I8");
    /* an incomplete update is refused and the session serves as before */
    expect_fail(fr_session_commit_weights(&a, u), "\"model.embed_tokens.weight\" was not sent");
    float *after = logits_of(&a);
    assert_memory_equal(before, after, sizeof(float) * 272);
    fr_weight_update_free(&u);
    free(before); free(after);
    fr_session_close(&a);
}

/* The move commit: the session serves the staged weights without a copy (its
 * model keeps its address, so runners see them), the update then holds the
 * previous weights and refuses more pieces and commits. */
static void test_commit_by_move(void **state)
{
    (void)state;
    fr_session a, b, c;
    open_tiny("synthetic:tiny", &a);
    open_tiny("synthetic:tiny:7", &b);
    open_tiny("synthetic:tiny", &c);   /* a's weights, for comparing afterwards */
    const fr_model *model_before = a.model;
    float *lb = logits_of(&b);
    fr_weight_update *u;
    assert_int_equal(fr_weight_update_begin(&a.model->cfg, 9, &u), FR_OK);
    const int n = fr_weight_update_tensor_count(u);
    for (int i = 0; i < n; i++) {
        size_t count;
        const float *src = source(b.model, u, i, &count);
        put(u, i, src, count, 0, count);
        if (i == 0) assert_int_equal(fr_session_commit_weights_move(&a, u), FR_EINVAL);   /* incomplete: usable */
    }
    assert_int_equal(fr_session_commit_weights_move(&a, u), FR_OK);
    assert_ptr_equal(a.model, model_before);
    float *la = logits_of(&a);
    assert_memory_equal(la, lb, sizeof(float) * 272);
    size_t n_old = 0, n_c = 0;
    const float *old = fr_model_data(fr_weight_update_model(u), &n_old), *orig = fr_model_data(c.model, &n_c);
    assert_int_equal(n_old, n_c);
    assert_memory_equal(old, orig, sizeof(float) * n_c);
    expect_fail(fr_weight_update_ready(u, NULL), "committed already");
    expect_fail(fr_session_commit_weights(&a, u), "committed already");
    expect_fail(fr_session_commit_weights_move(&a, u), "committed already");
    const char *name;
    int ndim;
    int64_t shape[2];
    assert_int_equal(fr_weight_update_tensor(u, 0, &name, &ndim, shape), FR_OK);
    float one = 1.0f;
    expect_fail(fr_weight_update_put(u, name, FR_DTYPE_F32, shape, ndim, 0, &one, 4), "committed already");
    /* restarted, the spent update stages the next version in the same memory */
    assert_int_equal(fr_weight_update_restart(u, 10), FR_OK);
    assert_int_equal(fr_weight_update_version(u), 10);
    expect_fail(fr_weight_update_ready(u, NULL), "was not sent");   /* nothing counts as received */
    for (int i = 0; i < n; i++) {
        size_t count;
        const float *src = source(c.model, u, i, &count);
        put(u, i, src, count, 0, count);
    }
    assert_int_equal(fr_session_commit_weights_move(&a, u), FR_OK);
    float *lc = logits_of(&c), *la3 = logits_of(&a);
    assert_memory_equal(la3, lc, sizeof(float) * 272);   /* back to synthetic:tiny */
    assert_int_equal(fr_weight_update_restart(u, 11), FR_OK);
    for (int i = 0; i < n; i++) {
        size_t count;
        const float *src = source(b.model, u, i, &count);
        put(u, i, src, count, 0, count);
    }
    assert_int_equal(fr_session_commit_weights_move(&a, u), FR_OK);
    free(lc);
    free(la3);
    fr_weight_update_free(&u);
    float *la2 = logits_of(&a);   /* freeing the update freed the previous weights only */
    assert_memory_equal(la2, lb, sizeof(float) * 272);
    fr_model *m2 = NULL;
    assert_int_equal(fr_model_load("synthetic:tiny:7", &m2), FR_OK);
    assert_int_equal(fr_model_swap_weights(a.model, m2), FR_OK);   /* same weights both ways */
    m2->cfg.num_layers++;
    expect_fail(fr_model_swap_weights(a.model, m2), "differ in shape");
    m2->cfg.num_layers--;
    fr_model_destroy(&m2);
    free(la);
    free(la2);
    free(lb);
    fr_session_close(&a);
    fr_session_close(&b);
    fr_session_close(&c);
}

/* A partial update: the tensors sent change, the others keep their serving
 * values. Sending every tensor but the first partially, then the first,
 * reaches synthetic:tiny:7's weights; a partial update with nothing sent or
 * with a tensor sent in part is refused; the move commit of a partial
 * update copies (the stage holds only what was sent). */
static void test_partial_update(void **state)
{
    (void)state;
    fr_session a, b, c;
    open_tiny("synthetic:tiny", &a);
    open_tiny("synthetic:tiny:7", &b);
    open_tiny("synthetic:tiny", &c);
    float *lb = logits_of(&b), *lc = logits_of(&c);
    fr_weight_update *u;
    assert_int_equal(fr_weight_update_begin_for(&a, 3, &u), FR_OK);   /* a CPU session: a host stage */
    assert_false(fr_weight_update_on_device(u));
    assert_int_equal(fr_weight_update_set_partial(u, 1), FR_OK);
    expect_fail(fr_session_commit_weights_move(&a, u), "no tensor arrived");
    const int n = fr_weight_update_tensor_count(u);
    size_t count;
    const float *src = source(b.model, u, 1, &count);
    put(u, 1, src, count, 0, count / 2);
    /* tensor 1 in part */
    expect_fail(fr_session_commit_weights_move(&a, u),
                "update to version 3: \"model.layers.0.input_layernorm.weight\" has 256 of its 512 bytes");
    put(u, 1, src, count, count / 2, count);
    for (int i = 2; i < n; i++) {
        src = source(b.model, u, i, &count);
        put(u, i, src, count, 0, count);
    }
    assert_int_equal(fr_session_commit_weights_move(&a, u), FR_OK);
    /* the embedding (tensor 0) is still synthetic:tiny's */
    size_t n0;
    const float *emb_a = source(a.model, u, 0, &n0), *emb_c = source(c.model, u, 0, &n0);
    assert_memory_equal(emb_a, emb_c, sizeof(float) * n0);
    const float *q_a = source(a.model, u, 1, &count), *q_b = source(b.model, u, 1, &count);
    assert_memory_equal(q_a, q_b, sizeof(float) * count);
    float *la = logits_of(&a);
    assert_true(memcmp(la, lb, sizeof(float) * 272) != 0 && memcmp(la, lc, sizeof(float) * 272) != 0);
    free(la);
    /* the next update, partial again, sends the embedding alone */
    assert_int_equal(fr_weight_update_restart(u, 4), FR_OK);
    assert_false(fr_weight_update_is_partial(u));   /* restart makes a full update */
    assert_int_equal(fr_weight_update_set_partial(u, 1), FR_OK);
    src = source(b.model, u, 0, &count);
    put(u, 0, src, count, 0, count);
    assert_int_equal(fr_session_commit_weights_move(&a, u), FR_OK);
    la = logits_of(&a);
    assert_memory_equal(la, lb, sizeof(float) * 272);   /* now all synthetic:tiny:7 */
    fr_weight_update_free(&u);
    free(la);
    free(lb);
    free(lc);
    fr_session_close(&a);
    fr_session_close(&b);
    fr_session_close(&c);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_update_equals_fresh_session),
             cmocka_unit_test(test_refusals_change_nothing),
             cmocka_unit_test(test_commit_by_move),
             cmocka_unit_test(test_partial_update))
