/* Tensor-parallel sharding (rollout/model/tp_shard): the layout arithmetic for
 * even splits and replicated KV heads, the refusals, the calibration table
 * slices, and the shard's weights against the model's (the column-parallel
 * slices summed back over ranks give the full products). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/ops_cpu.h"
#include "rollout/model/moe_cpu.h"
#include "rollout/model/tp_shard.h"
#include "tests/unit/test_util.h"
#include "test_util.h"

/* Qwen3-4B's shape: 32 query heads, 8 KV heads, intermediate 9728, vocab 151936. */
static fr_model_config qwen3_4b(void)
{
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);
    return c;
}

static void test_even_split(void **state)
{
    (void)state;
    fr_model_config c = qwen3_4b();
    fr_tp_layout l;
    assert_int_equal(fr_tp_layout_of(&c, 0, 1, &l), FR_OK);
    assert_int_equal(l.n_heads, 32);
    assert_int_equal(l.n_kv_heads, 8);
    assert_int_equal(l.inter, 9728);
    assert_int_equal(l.vocab, 151936);
    assert_int_equal(l.head0 + l.kv_head0 + l.inter0 + l.vocab0, 0);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(fr_tp_layout_of(&c, r, 4, &l), FR_OK);
        assert_int_equal(l.n_heads, 8);
        assert_int_equal(l.head0, 8 * r);
        assert_int_equal(l.n_kv_heads, 2);
        assert_int_equal(l.kv_head0, 2 * r);
        assert_int_equal(l.inter, 2432);
        assert_int_equal(l.inter0, 2432 * r);
        assert_int_equal(l.vocab, 37984);
        assert_int_equal(l.vocab0, 37984 * r);
    }
    fr_model_config lc;
    assert_int_equal(fr_tp_layout_of(&c, 3, 8, &l), FR_OK);
    fr_tp_local_config(&c, &l, &lc);
    assert_int_equal(lc.num_heads, 4);
    assert_int_equal(lc.num_kv_heads, 1);
    assert_int_equal(lc.intermediate_size, 1216);
    assert_int_equal(lc.vocab_size, 18992);
    assert_int_equal(lc.hidden_size, c.hidden_size);
    assert_int_equal(lc.head_dim, c.head_dim);
    assert_int_equal(lc.num_layers, c.num_layers);
}

/* tp above the KV head count: each rank keeps the KV head its query heads
 * read (synthetic:tiny has 4 query heads over 2 KV heads). */
static void test_replicated_kv(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_tiny_config(&c);
    fr_tp_layout l;
    const int want_kv[4] = {0, 0, 1, 1};
    for (int r = 0; r < 4; r++) {
        assert_int_equal(fr_tp_layout_of(&c, r, 4, &l), FR_OK);
        assert_int_equal(l.n_heads, 1);
        assert_int_equal(l.head0, r);
        assert_int_equal(l.n_kv_heads, 1);
        assert_int_equal(l.kv_head0, want_kv[r]);
    }
    /* Qwen3-4B over 16 ranks: two query heads per rank, groups of 4. */
    c = qwen3_4b();
    assert_int_equal(fr_tp_layout_of(&c, 5, 16, &l), FR_OK);
    assert_int_equal(l.head0, 10);
    assert_int_equal(l.n_heads, 2);
    assert_int_equal(l.kv_head0, 2);
    assert_int_equal(l.n_kv_heads, 1);
}

static void expect_refusal(const fr_model_config *c, int rank, int size, const char *words)
{
    fr_tp_layout l;
    assert_int_equal(fr_tp_layout_of(c, rank, size, &l), FR_EINVAL);
    if (!strstr(fr_last_error(), words)) fail_msg("message '%s' lacks '%s'", fr_last_error(), words);
}

static void test_refusals(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_tiny_config(&c);   /* 4 heads, 2 KV heads, intermediate 256, vocab 272 */
    expect_refusal(&c, 0, 0, "tp 0 must be >= 1");
    expect_refusal(&c, 2, 2, "rank 2 outside [0, 2)");
    expect_refusal(&c, -1, 2, "rank -1 outside");
    expect_refusal(&c, 0, 3, "4 query heads do not split over tp 3");
    expect_refusal(&c, 0, 8, "4 query heads do not split over tp 8");
    fr_model_config k = c;
    k.num_heads = 6;
    k.num_kv_heads = 3;
    expect_refusal(&k, 0, 2, "3 KV heads do not split over tp 2");
    fr_model_config m = c;
    m.intermediate_size = 250;
    expect_refusal(&m, 0, 4, "intermediate size 250 does not split over tp 4");
    fr_model_config v = c;
    v.vocab_size = 271;
    expect_refusal(&v, 1, 2, "vocabulary of 271 does not split over tp 2");
    fr_model_config q = qwen3_4b();   /* 32 heads, 8 KV heads: tp 64 is too many query heads */
    expect_refusal(&q, 0, 64, "32 query heads do not split over tp 64");
}

static void test_kv_table(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_tiny_config(&c);
    c.num_heads = 8;
    c.num_kv_heads = 4;   /* 2 layers x 4 KV heads x 3 values */
    float src[2 * 4 * 3], dst[2 * 2 * 3];
    for (int i = 0; i < 24; i++) src[i] = (float)i;
    fr_tp_layout l;
    assert_int_equal(fr_tp_layout_of(&c, 1, 2, &l), FR_OK);   /* KV heads 2, 3 */
    fr_tp_slice_kv_table(src, 2, 4, 3, &l, dst);
    const float want[12] = {6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23};
    assert_memory_equal(dst, want, sizeof want);
    assert_int_equal(fr_tp_layout_of(&c, 5, 8, &l), FR_OK);   /* KV head 2 */
    fr_tp_slice_kv_table(src, 2, 4, 3, &l, dst);
    const float want8[6] = {6, 7, 8, 18, 19, 20};
    assert_memory_equal(dst, want8, sizeof want8);
}

/* The shard's weights: slices of the model's, and the row-parallel products
 * of the ranks sum to the full product. */
static void test_shard_weights(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_load("synthetic:tiny", &m), FR_OK);
    const fr_model_config *c = &m->cfg;
    const int D = c->hidden_size, d = c->head_dim, I = c->intermediate_size, tp = 2;
    const int qd = c->num_heads * d;
    float *att = malloc(sizeof(float) * qd), *full = malloc(sizeof(float) * D), *sum = calloc(D, sizeof(float));
    float *part = malloc(sizeof(float) * D);
    fr_test_rng rng = {7};
    for (int i = 0; i < qd; i++) att[i] = fr_test_normal(&rng);
    const fr_layer_weights *lw = &m->w.layers[1];
    fr_matmul(full, att, lw->o_proj, 1, D, qd);
    for (int r = 0; r < tp; r++) {
        fr_tp_shard *s = NULL;
        assert_int_equal(fr_tp_shard_new(m, r, tp, &s), FR_OK);
        const fr_layer_weights *sw = &s->w.layers[1];
        assert_int_equal(s->cfg.num_heads, 2);
        assert_ptr_equal(sw->q_proj, lw->q_proj + (size_t)r * 2 * d * D);
        assert_ptr_equal(sw->k_proj, lw->k_proj + (size_t)r * d * D);
        assert_ptr_equal(sw->v_proj, lw->v_proj + (size_t)r * d * D);
        assert_ptr_equal(sw->gate_proj, lw->gate_proj + (size_t)r * (I / tp) * D);
        assert_ptr_equal(sw->up_proj, lw->up_proj + (size_t)r * (I / tp) * D);
        assert_ptr_equal(sw->q_norm, lw->q_norm);
        assert_ptr_equal(s->w.embed, m->w.embed);
        assert_ptr_equal(s->w.lm_head, m->w.lm_head + (size_t)r * (c->vocab_size / tp) * D);
        for (int row = 0; row < D; row++) {
            assert_memory_equal(sw->o_proj + (size_t)row * (qd / tp), lw->o_proj + (size_t)row * qd + r * (qd / tp),
                                sizeof(float) * (qd / tp));
            assert_memory_equal(sw->down_proj + (size_t)row * (I / tp), lw->down_proj + (size_t)row * I + r * (I / tp),
                                sizeof(float) * (I / tp));
        }
        fr_matmul(part, att + r * (qd / tp), sw->o_proj, 1, D, qd / tp);
        for (int i = 0; i < D; i++) sum[i] += part[i];
        fr_tp_shard_destroy(&s);
        assert_null(s);
    }
    for (int i = 0; i < D; i++) assert_true(fabsf(sum[i] - full[i]) <= 1e-4f * (1.0f + fabsf(full[i])));
    fr_tp_shard *bad = NULL;
    assert_int_equal(fr_tp_shard_new(m, 0, 3, &bad), FR_EINVAL);
    assert_null(bad);
    fr_tp_shard_destroy(NULL);
    free(att); free(full); free(sum); free(part);
    fr_model_destroy(&m);
}

/* A Mixture-of-Experts model: the router replicated; every expert's gate and
 * up rows and down columns sliced; the ranks' partial MoE outputs (the same
 * routing on every rank) sum to the whole model's. */
static void test_shard_experts(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_tiny_config(&c);
    snprintf(c.architecture, sizeof c.architecture, "Qwen3MoeForCausalLM");
    c.num_experts = 4;
    c.experts_per_tok = 2;
    c.moe_intermediate_size = 64;
    c.norm_topk_prob = 1;
    c.decoder_sparse_step = 1;
    fr_model *m = NULL;
    assert_int_equal(fr_model_alloc(&c, "moe", &m), FR_OK);
    size_t n;
    float *w = fr_model_data(m, &n);
    fr_test_rng rng = {11};
    for (size_t i = 0; i < n; i++) w[i] = 0.1f * fr_test_normal(&rng);
    const int D = c.hidden_size, Im = c.moe_intermediate_size, E = c.num_experts, tp = 2, M = 3;
    const fr_layer_weights *lw = &m->w.layers[0];
    float *x = malloc(sizeof(float) * M * D), *full = malloc(sizeof(float) * M * D);
    float *part = malloc(sizeof(float) * M * D), *sum = calloc((size_t)M * D, sizeof(float));
    for (int i = 0; i < M * D; i++) x[i] = fr_test_normal(&rng);
    fr_moe_cpu *moe = NULL;
    assert_int_equal(fr_moe_cpu_new(&c, M, &moe), FR_OK);
    fr_moe_cpu_forward(moe, &c, lw, x, M, full, 0);
    fr_moe_cpu_destroy(&moe);
    for (int r = 0; r < tp; r++) {
        fr_tp_shard *s = NULL;
        assert_int_equal(fr_tp_shard_new(m, r, tp, &s), FR_OK);
        const fr_layer_weights *sw = &s->w.layers[0];
        const int il = Im / tp;
        assert_int_equal(s->cfg.moe_intermediate_size, il);
        assert_ptr_equal(sw->router, lw->router);
        for (int e = 0; e < E; e++) {
            assert_memory_equal(sw->expert_gate + (size_t)e * il * D, lw->expert_gate + ((size_t)e * Im + r * il) * D,
                                sizeof(float) * il * D);
            assert_memory_equal(sw->expert_up + (size_t)e * il * D, lw->expert_up + ((size_t)e * Im + r * il) * D,
                                sizeof(float) * il * D);
            for (int row = 0; row < D; row++)
                assert_memory_equal(sw->expert_down + ((size_t)e * D + row) * il,
                                    lw->expert_down + ((size_t)e * D + row) * Im + r * il, sizeof(float) * il);
        }
        assert_int_equal(fr_moe_cpu_new(&s->cfg, M, &moe), FR_OK);
        fr_moe_cpu_forward(moe, &s->cfg, sw, x, M, part, 0);
        fr_moe_cpu_destroy(&moe);
        for (int i = 0; i < M * D; i++) sum[i] += part[i];
        fr_tp_shard_destroy(&s);
    }
    for (int i = 0; i < M * D; i++) assert_true(fabsf(sum[i] - full[i]) <= 1e-4f * (1.0f + fabsf(full[i])));
    fr_tp_layout l;
    c.moe_intermediate_size = 63;
    assert_int_equal(fr_tp_layout_of(&c, 0, 2, &l), FR_EINVAL);
    free(x); free(full); free(part); free(sum);
    fr_model_destroy(&m);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_even_split),
             cmocka_unit_test(test_replicated_kv),
             cmocka_unit_test(test_refusals),
             cmocka_unit_test(test_kv_table),
             cmocka_unit_test(test_shard_weights),
             cmocka_unit_test(test_shard_experts))
