/* DeepSeek's mixture of experts on the CPU (docs/deepseek_moe.md): every
 * routing method on hand-made scores (the tie rules and transformers' 0.0
 * mask included), the tensors of the tiny DeepSeek models, the decode path
 * against one prefill (f32 KV), deterministic mode's MoE layer bitwise
 * alike alone and in a batch,
 * a tensor-parallel shard's partial sums against the whole layer, and the
 * runner's routed-expert capture on prefill and decode. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/session.h"
#include "rollout/model/moe_cpu.h"
#include "rollout/model/tensor_table.h"
#include "rollout/model/tp_shard.h"
#include "logits_util.h"
#include "test_util.h"

/* logit(p): the sigmoid router's logit whose score is p. */
static float logit_of(double p) { return (float)log(p / (1.0 - p)); }

static void route(const fr_moe_routing *rt, const float *logits, int *ids, float *w)
{
    float scores[64], choice[64];
    assert_true(rt->E <= 64);
    fr_moe_route_row(rt, logits, scores, choice, ids, w);
}

/* Greedy softmax (DeepSeek-V2-Lite): the k best probabilities, weights the
 * probabilities times the scale, not renormalized. */
static void test_route_greedy(void **state)
{
    (void)state;
    const float logits[6] = {1.0f, 3.0f, 0.5f, 2.0f, 3.0f, -1.0f};
    const fr_moe_routing rt = {.E = 6, .k = 3, .scoring = FR_MOE_SOFTMAX, .method = FR_MOE_GREEDY, .n_group = 1,
                               .topk_group = 1, .norm = 0, .scale = 1.5f};
    int ids[3];
    float w[3];
    route(&rt, logits, ids, w);
    /* 1 and 4 tie: the lower index first */
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[2], 3);
    double sum = 0;
    for (int e = 0; e < 6; e++) sum += exp(logits[e]);
    assert_float_equal(w[0], 1.5 * exp(3.0) / sum, 1e-6);
    assert_float_equal(w[2], 1.5 * exp(2.0) / sum, 1e-6);
}

/* group_limited_greedy (DeepSeek-V2): groups ranked by their best
 * probability; the k best among the kept groups' experts. */
static void test_route_group_limited(void **state)
{
    (void)state;
    /* groups {0,1} {2,3} {4,5} {6,7}: best 5.0, 4.0, 0, 4.5 -> keep 0 and 3 */
    const float logits[8] = {5.0f, 0.0f, 4.0f, 3.9f, 0.0f, 0.0f, 4.5f, 0.0f};
    fr_moe_routing rt = {.E = 8, .k = 3, .scoring = FR_MOE_SOFTMAX, .method = FR_MOE_GROUP_LIMITED, .n_group = 4,
                         .topk_group = 2, .norm = 0, .scale = 1.0f};
    int ids[3];
    float w[3];
    route(&rt, logits, ids, w);
    /* greedy would take 0, 6, 2; expert 2's group is dropped: 1 and 7 tie
     * (equal logits), the lower index wins */
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 6);
    assert_int_equal(ids[2], 1);
    rt.method = FR_MOE_GREEDY;
    route(&rt, logits, ids, w);
    assert_int_equal(ids[2], 2);
}

/* noaux_tc (DeepSeek-V3): sigmoid scores, the bias in the choice only,
 * groups ranked by the sum of their two best choices, weights the unbiased
 * scores normalized then scaled. */
static void test_route_noaux_tc(void **state)
{
    (void)state;
    const double p[8] = {0.9, 0.1, 0.8, 0.7, 0.6, 0.55, 0.2, 0.1};
    float logits[8], bias[8] = {0};
    for (int e = 0; e < 8; e++) logits[e] = logit_of(p[e]);
    fr_moe_routing rt = {.E = 8, .k = 2, .scoring = FR_MOE_SIGMOID, .method = FR_MOE_NOAUX_TC, .n_group = 4,
                         .topk_group = 2, .norm = 1, .scale = 2.5f, .bias = bias};
    int ids[2];
    float w[2];
    /* sums 1.0, 1.5, 1.15, 0.3: groups 1 and 2 kept, though group 0 has the
     * best single expert (ranking by the best one would keep 0 and 1) */
    route(&rt, logits, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 3);
    assert_float_equal(w[0], 2.5 * 0.8 / 1.5, 1e-5);
    assert_float_equal(w[1], 2.5 * 0.7 / 1.5, 1e-5);
    /* the bias moves expert 4 ahead (0.85) but its weight is its score 0.6 */
    bias[4] = 0.25f;
    route(&rt, logits, ids, w);
    assert_int_equal(ids[0], 4);
    assert_int_equal(ids[1], 2);
    assert_float_equal(w[0], 2.5 * 0.6 / 1.4, 1e-5);
    assert_float_equal(w[1], 2.5 * 0.8 / 1.4, 1e-5);
    /* not renormalized: the scores times the scale */
    rt.norm = 0;
    route(&rt, logits, ids, w);
    assert_float_equal(w[0], 2.5 * 0.6, 1e-5);
    /* one group: the plain top-k of the choices */
    rt.n_group = rt.topk_group = 1;
    route(&rt, logits, ids, w);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 4);
}

/* transformers masks the dropped groups' choices to 0.0, not -inf: when the
 * kept groups' biased choices are all negative, the dropped groups' experts
 * (0.0, lowest index first) are chosen. The engine follows it. */
static void test_route_masked_zero(void **state)
{
    (void)state;
    const double p[8] = {0.05, 0.06, 0.3, 0.2, 0.04, 0.03, 0.02, 0.01};
    float logits[8], bias[8] = {-0.2f, -0.2f, 0.0f, 0.0f, -0.2f, -0.2f, -0.5f, -0.5f};
    for (int e = 0; e < 8; e++) logits[e] = logit_of(p[e]);
    const fr_moe_routing rt = {.E = 8, .k = 3, .scoring = FR_MOE_SIGMOID, .method = FR_MOE_NOAUX_TC, .n_group = 4,
                               .topk_group = 2, .norm = 1, .scale = 1.0f, .bias = bias};
    int ids[3];
    float w[3];
    /* choices -0.15 -0.14 | 0.3 0.2 | -0.16 -0.17 | -0.48 -0.49: groups 1 and
     * 0 kept (0.5 and -0.29); the best choices are 2 and 3, then the dropped
     * groups' 0.0 beats expert 1's -0.14: expert 4, the lowest dropped one */
    route(&rt, logits, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 4);
    assert_float_equal(w[2], 0.04 / (0.3 + 0.2 + 0.04), 1e-5);
}

/* Equal scores: the lower expert index first, and among equal group ranks
 * the lower group (deterministic, docs/deepseek_moe.md). */
static void test_route_ties(void **state)
{
    (void)state;
    float logits[16];
    for (int e = 0; e < 16; e++) logits[e] = 0.25f;
    const int methods[3] = {FR_MOE_GREEDY, FR_MOE_GROUP_LIMITED, FR_MOE_NOAUX_TC};
    for (int m = 0; m < 3; m++) {
        const fr_moe_routing rt = {.E = 16, .k = 6, .scoring = m == 2 ? FR_MOE_SIGMOID : FR_MOE_SOFTMAX,
                                   .method = methods[m], .n_group = 4, .topk_group = 2, .norm = 1, .scale = 1.0f};
        int ids[6];
        float w[6];
        route(&rt, logits, ids, w);
        /* groups 0 and 1 (experts 0..7) kept; 0..5 chosen in order */
        for (int j = 0; j < 6; j++) assert_int_equal(ids[j], j);
        for (int j = 0; j < 6; j++) assert_float_equal(w[j], 1.0 / 6.0, 1e-6);
    }
}

typedef struct {
    int bias, shared, dense_mlp;
} table_count;

static fr_status count_names(void *user, const fr_model_tensor *t)
{
    table_count *c = user;
    c->bias += strstr(t->name, ".mlp.gate.e_score_correction_bias") != NULL;
    c->shared += strstr(t->name, ".mlp.shared_experts.") != NULL;
    c->dense_mlp += strstr(t->name, "layers.0.mlp.gate_proj") != NULL;
    return FR_OK;
}

/* The tiny models' tensors: layer 0 dense, layers 1-2 with router (and its
 * bias under noaux_tc), experts and shared experts. */
static void test_tiny_tables(void **state)
{
    (void)state;
    const char *specs[2] = {"synthetic:tiny-dsmoe", "synthetic:tiny-dsmoe-v2"};
    for (int v = 0; v < 2; v++) {
        fr_model *m = NULL;
        if (fr_model_load(specs[v], &m)) fail_msg("%s", fr_last_error());
        const fr_model_config *c = &m->cfg;
        assert_true(fr_model_is_mla(c));
        assert_int_equal(fr_model_moe_layers(c), 2);
        table_count n = {0};
        assert_int_equal(fr_model_tensors_each(c, &m->w, count_names, &n), FR_OK);
        assert_int_equal(n.bias, v ? 0 : 2);
        assert_int_equal(n.shared, 2 * 3);
        assert_int_equal(n.dense_mlp, 1);
        assert_non_null(m->w.layers[1].shared_gate);
        assert_true(v ? !m->w.layers[1].router_bias : m->w.layers[1].router_bias != NULL);
        assert_null(m->w.layers[0].router);
        fr_model_destroy(&m);
    }
    fr_model *m = NULL;
    assert_int_equal(fr_model_load("synthetic:deepseek-v2-lite", &m), FR_EUNSUPPORTED);   /* made on the GPU */
}

/* tiny-dsmoe-dcN: tiny-dsmoe with the latent width N (a multiple of 64 from 64
 * to 512), every other size and the routing unchanged. */
static void test_latent_width_specs(void **state)
{
    (void)state;
    fr_model_config base, c;
    assert_int_equal(fr_model_spec_config("synthetic:tiny-dsmoe", &base), FR_OK);
    static const int widths[] = {64, 128, 192, 448, 512};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) {
        char spec[64];
        snprintf(spec, sizeof spec, "synthetic:tiny-dsmoe-dc%d:3", widths[i]);
        if (fr_model_spec_config(spec, &c)) fail_msg("%s: %s", spec, fr_last_error());
        assert_int_equal(c.kv_lora_rank, widths[i]);
        assert_int_equal(c.head_dim, widths[i] + c.qk_rope_dim);
        c.kv_lora_rank = base.kv_lora_rank;
        c.head_dim = base.head_dim;
        assert_memory_equal(&c, &base, sizeof c);
    }
    static const char *const bad[] = {"synthetic:tiny-dsmoe-dc100", "synthetic:tiny-dsmoe-dc0",
                                      "synthetic:tiny-dsmoe-dc576", "synthetic:tiny-dsmoe-dc960"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fr_model_spec_config(bad[i], &c), FR_EINVAL);
        assert_non_null(strstr(fr_last_error(), "a multiple of 64 from 64 to 512"));
    }
    assert_int_equal(fr_model_spec_config("synthetic:tiny-dsmoe-dcx", &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "unknown synthetic model"));
    assert_int_equal(fr_model_spec_config("synthetic:tiny-dsmoe-dc1024", &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "unknown synthetic model"));
}

static fr_session open_tiny(const char *spec, fr_kv_dtype kv)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, spec, kv);
    fr_session s;
    if (fr_session_open(&o, 8, 2, &s)) fail_msg("%s: %s", spec, fr_last_error());
    return s;
}

static const int PROMPT[] = {256, 100, 101, 102, 32, 109, 97, 105, 110, 40, 41, 58, 10, 32, 32, 32, 32, 114, 101,
                             116, 117, 114, 110, 32, 49, 50, 51, 10, 35, 32, 100, 111, 110, 101, 46};
#define NP ((int)(sizeof PROMPT / sizeof PROMPT[0]))

/* The decode path against one prefill with an f32 cache (float32 order
 * only). */
static void test_decode_matches_prefill(void **state)
{
    (void)state;
    /* with the latent widths of tiny-dsmoe-dcN beside the tiny models' 256 */
    const char *specs[] = {"synthetic:tiny-dsmoe", "synthetic:tiny-dsmoe-v2", "synthetic:tiny-dsmoe-dc128",
                           "synthetic:tiny-dsmoe-dc192", "synthetic:tiny-dsmoe-dc64"};
    for (size_t v = 0; v < sizeof specs / sizeof specs[0]; v++) {
        fr_session s = open_tiny(specs[v], FR_KV_F32);
        const size_t count = (size_t)NP * s.model->cfg.vocab_size;
        float *pre = fr_test_logits(&s, PROMPT, NP, NP), *dec = fr_test_logits(&s, PROMPT, NP, 0);
        float d = 0, m = 0;
        for (size_t i = 0; i < count; i++) {
            d = fmaxf(d, fabsf(pre[i] - dec[i]));
            m = fmaxf(m, fabsf(pre[i]));
        }
        printf("  %s: decode vs prefill (f32 KV) max |diff| %.3g of max |logit| %.3g\n", specs[v], d, m);
        assert_true(m > 0.1f && d <= 1e-4f * m);
        free(pre);
        free(dec);
        fr_session_close(&s);
    }
}

/* y[H] = down . (silu(gate . x) * (up . x)) for an MLP of I rows, naively
 * in double. */
static void naive_mlp(const float *g, const float *u, const float *d, const float *x, int H, int I, double *y)
{
    double *h = malloc(sizeof(double) * (size_t)I);
    for (int i = 0; i < I; i++) {
        double a = 0, b = 0;
        for (int j = 0; j < H; j++) {
            a += (double)g[(size_t)i * H + j] * x[j];
            b += (double)u[(size_t)i * H + j] * x[j];
        }
        h[i] = a / (1.0 + exp(-a)) * b;
    }
    for (int j = 0; j < H; j++) {
        double acc = 0;
        for (int i = 0; i < I; i++) acc += (double)d[(size_t)j * I + i] * h[i];
        y[j] = acc;
    }
    free(h);
}

/* The MoE layer against a naive reference written from the rules alone:
 * each row's k experts weighted, plus the shared experts' MLP. */
static void test_moe_layer_reference(void **state)
{
    (void)state;
    const char *specs[2] = {"synthetic:tiny-dsmoe", "synthetic:tiny-dsmoe-v2"};
    for (int v = 0; v < 2; v++) {
        fr_model *m = NULL;
        if (fr_model_load(specs[v], &m)) fail_msg("%s", fr_last_error());
        const fr_model_config *c = &m->cfg;
        const fr_layer_weights *lw = &m->w.layers[1];
        const int M = 5, H = c->hidden_size, E = c->num_experts, k = c->experts_per_tok, Im = c->moe_intermediate_size;
        const int Is = fr_model_shared_inter(c);
        float *x = malloc(sizeof(float) * M * H), *y = malloc(sizeof(float) * M * H), logits[64], w[16];
        double *ref = calloc((size_t)H, sizeof(double)), *tmp = malloc(sizeof(double) * (size_t)H);
        int ids[16];
        fr_test_rng rng = {.s = 21 + (uint64_t)v};
        for (int i = 0; i < M * H; i++) x[i] = fr_test_normal(&rng);
        fr_moe_cpu *moe = NULL;
        assert_int_equal(fr_moe_cpu_new(c, M, &moe), FR_OK);
        fr_moe_cpu_forward(moe, c, lw, x, M, y, 0);
        const fr_moe_routing rt = fr_moe_routing_of(c, lw->router_bias);
        float err = 0, top = 0;
        for (int t = 0; t < M; t++) {
            const float *xt = x + (size_t)t * H;
            for (int e = 0; e < E; e++) {
                double a = 0;
                for (int j = 0; j < H; j++) a += (double)lw->router[(size_t)e * H + j] * xt[j];
                logits[e] = (float)a;
            }
            route(&rt, logits, ids, w);
            memset(ref, 0, sizeof(double) * (size_t)H);
            for (int j = 0; j < k; j++) {
                const size_t at = (size_t)ids[j] * Im * H;
                naive_mlp(lw->expert_gate + at, lw->expert_up + at, lw->expert_down + at, xt, H, Im, tmp);
                for (int i = 0; i < H; i++) ref[i] += w[j] * tmp[i];
            }
            naive_mlp(lw->shared_gate, lw->shared_up, lw->shared_down, xt, H, Is, tmp);
            for (int i = 0; i < H; i++) {
                ref[i] += tmp[i];
                err = fmaxf(err, fabsf((float)ref[i] - y[(size_t)t * H + i]));
                top = fmaxf(top, fabsf((float)ref[i]));
            }
        }
        printf("  %s: MoE layer vs the naive reference, max |diff| %.3g of %.3g\n", specs[v], err, top);
        assert_true(top > 0.1f && err <= 1e-5f * top);
        free(x); free(y); free(ref); free(tmp);
        fr_moe_cpu_destroy(&moe);
        fr_model_destroy(&m);
    }
}

/* Deterministic mode's MoE layer: a row's output (router, experts in
 * increasing index, shared experts, all fixed-order products) is bitwise the
 * same alone and among other rows, in any order; so are its experts. */
static void test_moe_batch_invariant(void **state)
{
    (void)state;
    const char *specs[2] = {"synthetic:tiny-dsmoe", "synthetic:tiny-dsmoe-v2"};
    for (int v = 0; v < 2; v++) {
        fr_model *m = NULL;
        if (fr_model_load(specs[v], &m)) fail_msg("%s", fr_last_error());
        const fr_model_config *c = &m->cfg;
        const int M = 12, H = c->hidden_size, k = c->experts_per_tok;
        float *x = malloc(sizeof(float) * M * H), *all = malloc(sizeof(float) * M * H);
        float *one = malloc(sizeof(float) * H);
        fr_test_rng rng = {.s = 5 + (uint64_t)v};
        for (int i = 0; i < M * H; i++) x[i] = fr_test_normal(&rng);
        fr_moe_cpu *moe = NULL;
        assert_int_equal(fr_moe_cpu_new(c, M, &moe), FR_OK);
        fr_moe_cpu_forward(moe, c, &m->w.layers[2], x, M, all, 1);
        int *ids = malloc(sizeof(int) * (size_t)M * k);
        memcpy(ids, fr_moe_cpu_ids(moe), sizeof(int) * (size_t)M * k);
        for (int t = M - 1; t >= 0; t--) {
            fr_moe_cpu_forward(moe, c, &m->w.layers[2], x + (size_t)t * H, 1, one, 1);
            assert_memory_equal(one, all + (size_t)t * H, sizeof(float) * H);
            assert_memory_equal(fr_moe_cpu_ids(moe), ids + (size_t)t * k, sizeof(int) * (size_t)k);
        }
        free(x); free(all); free(one); free(ids);
        fr_moe_cpu_destroy(&moe);
        fr_model_destroy(&m);
    }
}

/* A tensor-parallel rank's MoE layer (its slice of every expert and of the
 * shared experts, the router whole) is a partial sum: the ranks' sum equals
 * the whole layer. */
static void test_tp_partial_sums(void **state)
{
    (void)state;
    fr_model *m = NULL;
    if (fr_model_load("synthetic:tiny-dsmoe", &m)) fail_msg("%s", fr_last_error());
    const fr_model_config *c = &m->cfg;
    const int M = 9, H = c->hidden_size;
    float *x = malloc(sizeof(float) * M * H), *full = malloc(sizeof(float) * M * H);
    float *sum = calloc((size_t)M * H, sizeof(float)), *part = malloc(sizeof(float) * M * H);
    fr_test_rng rng = {.s = 11};
    for (int i = 0; i < M * H; i++) x[i] = fr_test_normal(&rng);
    fr_moe_cpu *moe = NULL;
    assert_int_equal(fr_moe_cpu_new(c, M, &moe), FR_OK);
    fr_moe_cpu_forward(moe, c, &m->w.layers[1], x, M, full, 0);
    int ids[9 * 4];
    memcpy(ids, fr_moe_cpu_ids(moe), sizeof ids);
    fr_moe_cpu_destroy(&moe);
    for (int t = 0; t < 2; t++) {
        fr_tp_shard *sh = NULL;
        assert_int_equal(fr_tp_shard_new(m, t, 2, &sh), FR_OK);
        assert_int_equal(sh->layout.shared_inter, fr_model_shared_inter(c) / 2);
        assert_int_equal(fr_moe_cpu_new(&sh->cfg, M, &moe), FR_OK);
        fr_moe_cpu_forward(moe, &sh->cfg, &sh->w.layers[1], x, M, part, 0);
        assert_memory_equal(fr_moe_cpu_ids(moe), ids, sizeof ids);   /* every rank routes alike */
        for (int i = 0; i < M * H; i++) sum[i] += part[i];
        fr_moe_cpu_destroy(&moe);
        fr_tp_shard_destroy(&sh);
    }
    float d = 0, mx = 0;
    for (int i = 0; i < M * H; i++) {
        d = fmaxf(d, fabsf(sum[i] - full[i]));
        mx = fmaxf(mx, fabsf(full[i]));
    }
    printf("  tp 2 partial sums vs the whole layer: max |diff| %.3g of %.3g\n", d, mx);
    assert_true(mx > 0.1f && d <= 1e-5f * mx);
    free(x); free(full); free(sum); free(part);
    fr_model_destroy(&m);
}

/* The runner's capture: a prefill's rows and the decode path's choose the
 * same experts (f32 KV: the same hidden states to float32 order), each row
 * k distinct experts of range; off, or on a dense model, it is refused. */
static void test_route_capture(void **state)
{
    (void)state;
    fr_session s = open_tiny("synthetic:tiny-dsmoe", FR_KV_F32);
    const int L = 2, k = 4, per = L * k;
    int rows[NP];
    for (int i = 0; i < NP; i++) rows[i] = i;
    uint16_t *pre = malloc(sizeof(uint16_t) * NP * per), *dec = malloc(sizeof(uint16_t) * NP * per);
    assert_int_equal(fr_session_routes(&s, rows, 1, pre), FR_EINVAL);   /* capture is off */
    assert_int_equal(fr_session_capture_routes(&s, 1), FR_OK);
    int seq;
    float *lg = malloc(sizeof(float) * (size_t)NP * s.model->cfg.vocab_size);
    assert_int_equal(fr_kv_seq_new(s.kv, &seq), FR_OK);
    fr_step_seq step = {.seq = seq, .n = NP, .tokens = PROMPT, .all_logits = 0};
    assert_int_equal(fr_session_step(&s, &step, 1, lg), FR_OK);
    assert_int_equal(fr_session_routes(&s, rows, NP, pre), FR_OK);
    const int past = NP;
    assert_int_equal(fr_session_routes(&s, &past, 1, dec), FR_EINVAL);   /* not a row of the step */
    fr_kv_seq_free(s.kv, seq);
    assert_int_equal(fr_kv_seq_new(s.kv, &seq), FR_OK);
    for (int i = 0; i < NP; i++) {
        fr_step_seq one = {.seq = seq, .n = 1, .tokens = PROMPT + i, .all_logits = 0};
        assert_int_equal(fr_session_step(&s, &one, 1, lg), FR_OK);
        assert_int_equal(fr_session_routes(&s, rows, 1, dec + (size_t)i * per), FR_OK);
    }
    assert_memory_equal(pre, dec, sizeof(uint16_t) * NP * per);
    for (int i = 0; i < NP * L; i++)
        for (int j = 0; j < k; j++) {
            assert_true(pre[i * k + j] < 16);
            for (int jj = 0; jj < j; jj++) assert_int_not_equal(pre[i * k + j], pre[i * k + jj]);
        }
    assert_int_equal(fr_session_capture_routes(&s, 0), FR_OK);
    free(pre); free(dec); free(lg);
    fr_session_close(&s);
    s = open_tiny("synthetic:tiny", FR_KV_F32);
    assert_int_equal(fr_session_capture_routes(&s, 1), FR_EINVAL);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_route_greedy),
             cmocka_unit_test(test_route_group_limited),
             cmocka_unit_test(test_route_noaux_tc),
             cmocka_unit_test(test_route_masked_zero),
             cmocka_unit_test(test_route_ties),
             cmocka_unit_test(test_tiny_tables),
             cmocka_unit_test(test_latent_width_specs),
             cmocka_unit_test(test_moe_layer_reference),
             cmocka_unit_test(test_decode_matches_prefill),
             cmocka_unit_test(test_moe_batch_invariant),
             cmocka_unit_test(test_tp_partial_sums),
             cmocka_unit_test(test_route_capture))
