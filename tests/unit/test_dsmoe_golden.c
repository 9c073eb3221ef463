/* The CPU engine against transformers on the DeepSeek mixture-of-experts
 * test checkpoints (models/dsmoe/README.md): dsmoe (DeepseekV3ForCausalLM,
 * noaux_tc routing with a router bias) and dsmoe2 (DeepseekV2ForCausalLM,
 * group_limited_greedy), found at $FR_DSMOE_DIR / $FR_DSMOE2_DIR, else
 * ../shared/models/<name>, else models/dsmoe/<name> (the repository's copies).
 * golden.safetensors holds tq6's seven prompts with float32 logits (every
 * prompt but p5), 64 greedy tokens, and the experts every MoE layer chose
 * at every position of the prompt and its greedy continuation:
 *  - prefill logits within 1e-3 x max |golden|, greedy continuations (f32
 *    KV) equal;
 *  - the decode path (f32 KV) within 1e-3 of one prefill, BF16 KV at BF16's
 *    level on the rows no flipped expert choice reaches;
 *  - routed-expert replay: the scheduler's records for the greedy samples
 *    equal transformers' choices wherever the choice was not a near-tie. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "rollout/engine/scheduler.h"
#include "rollout/model/sampler.h"
#include "logits_util.h"
#include "routes_util.h"
#include "test_util.h"

/* greedy_prompts: as tqm's, an MoE model may lose one prompt to a near-tie
 * of two experts that float32 order settles the other way. */
typedef struct {
    const char *name;
    int greedy_prompts;
    fr_model *model;
} golden_model;

static golden_model dsmoe = {"dsmoe", 6, NULL}, dsmoe2 = {"dsmoe2", 6, NULL};
static int free_models(void **state)
{
    (void)state;
    fr_model_destroy(&dsmoe.model);
    fr_model_destroy(&dsmoe2.model);
    return 0;
}

/* Prefill logits within 1e-3 x max |golden| where the golden file has them,
 * and greedy continuations of 64 tokens equal transformers'. */
static void test_prefill_and_greedy(void **state)
{
    golden_model *gm = *state;
    fr_st_file *g = fr_test_golden_open(gm->name, &gm->model);
    if (!g) skip();
    const int V = gm->model->cfg.vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)V);
    int prompts_equal = 0, compared = 0;
    for (int p = 0; p < 7; p++) {
        int n, n_new, seq;
        int *ids = fr_test_golden_ints(g, p, "ids", &n), *want = fr_test_golden_ints(g, p, "greedy", &n_new);
        fr_session s;   /* f32 KV: the continuation's logits carry float32 order alone */
        fr_test_shared_open(gm->model, FR_KV_F32, n + n_new, n, &s);
        float *ours = malloc(sizeof(float) * (size_t)n * V);
        assert_int_equal(fr_session_prefill(&s, ids, n, n, &seq, logits, ours), FR_OK);
        const fr_st_tensor *t = fr_test_golden(g, p, "logits_f32");
        if (t) {
            fr_test_check_golden_logits(t, ours, p, n, V);
            compared++;
        } else {
            printf("  p%d (%5d tokens): no golden logits (greedy only)\n", p, n);
        }
        free(ours);
        prompts_equal += fr_test_greedy_matches(&s, seq, logits, want, n_new, p) == n_new;
        free(ids);
        free(want);
        fr_test_shared_close(&s);
    }
    free(logits);
    fr_st_file_close(&g);
    printf("  %d of 7 prompts' greedy continuations equal transformers' (at least %d required)\n", prompts_equal,
           gm->greedy_prompts);
    assert_true(compared >= 5);
    assert_true(prompts_equal >= gm->greedy_prompts);
}

/* Each first difference of two paths' expert choices (first[rows][L],
 * fr_test_route_sets_differ) must be a near-tie in float32: its golden
 * margin (margin[rows][L]) under 0.05, the level a BF16 cache moves a
 * router by. */
static void check_first_flips(const uint8_t *first, int rows, int L, const float *margin)
{
    for (size_t i = 0; i < (size_t)rows * L; i++) {
        if (!first[i]) continue;
        printf("    row %zu layer %zu: experts differ where float32's margin is %.3g\n", i / L, i % L, margin[i]);
        assert_true(margin[i] < 0.05f);
    }
}

/* The decode path against one prefill: f32 KV within 1e-3 of max |logit|
 * (float32 order alone). With BF16 KV the cache's rounding can move a
 * token's router across a near-tie of two experts, and then that row and the
 * later ones run another expert (routes_util.h): such a first difference
 * must be at a near-tie of float32's router, and the rows no differing route
 * reaches agree within 2e-2, BF16's level. */
static void test_decode_matches_prefill(void **state)
{
    golden_model *gm = *state;
    fr_st_file *g = fr_test_golden_open(gm->name, &gm->model);
    if (!g) skip();
    const fr_model_config *c = &gm->model->cfg;
    const int L = fr_model_moe_layers(c), k = c->experts_per_tok, prompts[2] = {1, 3};
    for (int i = 0; i < 2; i++) {
        int n;
        int *ids = fr_test_golden_ints(g, prompts[i], "ids", &n);
        fr_session s;
        fr_test_shared_open(gm->model, FR_KV_F32, n, n, &s);
        float *pre = fr_test_logits(&s, ids, n, n), *dec = fr_test_logits(&s, ids, n, 0);
        fr_test_within(pre, dec, (size_t)n * c->vocab_size, 1e-3f, "p%d f32 KV, decode vs prefill", prompts[i]);
        free(pre);
        free(dec);
        fr_test_shared_close(&s);
        fr_test_shared_open(gm->model, FR_KV_BF16, n, n, &s);
        uint16_t *rp = malloc(sizeof(uint16_t) * (size_t)n * L * k), *rd = malloc(sizeof(uint16_t) * (size_t)n * L * k);
        uint8_t *reached = malloc((size_t)n), *first = malloc((size_t)n * L);
        pre = fr_test_logits_routes(&s, ids, n, 0, rp);
        dec = fr_test_logits_routes(&s, ids, n, 1, rd);
        const int differ = fr_test_route_sets_differ(rp, rd, n, L, k, reached, first);
        const fr_st_tensor *mt = fr_test_golden(g, prompts[i], "route_margin");
        assert_non_null(mt);
        float *margin = malloc(sizeof(float) * fr_st_tensor_numel(mt));
        assert_int_equal(fr_st_tensor_to_f32(mt, margin, fr_st_tensor_numel(mt)), FR_OK);
        check_first_flips(first, n, L, margin);
        free(margin);
        free(first);
        char what[64];
        snprintf(what, sizeof what, "p%d bf16 KV, decode vs prefill", prompts[i]);
        fr_test_check_clean_rows(what, dec, pre, n, c->vocab_size, reached, differ, L, 2e-2f);
        free(pre);
        free(dec);
        free(rp);
        free(rd);
        free(reached);
        fr_test_shared_close(&s);
        free(ids);
    }
    fr_st_file_close(&g);
}

typedef struct {
    fr_sample_result res[7];
    int done;
} replay;

static void on_done(void *user, const fr_sample_result *r)
{
    replay *rp = user;
    assert_true(r->request_id < 7);
    fr_sample_result *dst = &rp->res[r->request_id];
    *dst = (fr_sample_result){.n_tokens = r->n_tokens, .route_layers = r->route_layers, .route_k = r->route_k,
                              .route_width = r->route_width};
    dst->tokens = malloc(sizeof(int) * (size_t)(r->n_tokens + 1));
    memcpy(dst->tokens, r->tokens, sizeof(int) * (size_t)r->n_tokens);
    if (r->routed_experts) {
        const size_t bytes = fr_sample_route_bytes(r) * (size_t)r->n_tokens;
        dst->routed_experts = malloc(bytes + 1);
        memcpy(dst->routed_experts, r->routed_experts, bytes);
    }
    rp->done++;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* Routed-expert replay: the seven prompts served greedily by the scheduler
 * with return_routed_experts (f32 KV), their records against transformers'
 * experts at positions n - 1 .. n + 62, compared as sets (the golden file's
 * are ascending, ours best first) wherever the golden margin is at least
 * 1e-4 (closer choices are near-ties that float32 order may settle either
 * way; they are counted). */
static void test_routes_match_golden(void **state)
{
    golden_model *gm = *state;
    fr_st_file *g = fr_test_golden_open(gm->name, &gm->model);
    if (!g) skip();
    const fr_model_config *c = &gm->model->cfg;
    const int L = fr_model_moe_layers(c), k = c->experts_per_tok;
    fr_session s;
    fr_test_shared_open(gm->model, FR_KV_F32, 4096 + 64 + 128, 512, &s);
    replay rp;
    memset(&rp, 0, sizeof rp);
    fr_scheduler_config sc = {.max_seqs = 2, .chunk = 512, .on_done = on_done, .user = &rp};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &sc, &sch), FR_OK);
    int *ids[7], n[7];
    for (int p = 0; p < 7; p++) {
        ids[p] = fr_test_golden_ints(g, p, "ids", &n[p]);
        fr_request_spec r = {.id = (uint64_t)p, .prompt = ids[p], .n_prompt = n[p], .n = 1,
                             .params = {.temperature = 0.0f, .top_p = 1.0f}, .max_tokens = 64,
                             .return_routed_experts = 1};
        assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    assert_int_equal(rp.done, 7);
    long compared = 0, ties = 0, differ = 0;
    for (int p = 0; p < 7; p++) {
        const fr_sample_result *r = &rp.res[p];
        int n_routes, n_greedy, n_margin;
        int *want = fr_test_golden_ints(g, p, "routes", &n_routes);
        int *greedy = fr_test_golden_ints(g, p, "greedy", &n_greedy);
        const fr_st_tensor *mt = fr_test_golden(g, p, "route_margin");
        assert_non_null(mt);
        n_margin = (int)fr_st_tensor_numel(mt);
        float *margin = malloc(sizeof(float) * (size_t)n_margin);
        assert_int_equal(fr_st_tensor_to_f32(mt, margin, (size_t)n_margin), FR_OK);
        assert_int_equal(n_routes, (n[p] + 63) * L * k);
        assert_non_null(r->routed_experts);
        assert_true(r->route_layers == L && r->route_k == k);
        int same = 0;   /* tokens equal to the golden greedy ones: their positions' routes are comparable */
        while (same < r->n_tokens && same < n_greedy && r->tokens[same] == greedy[same]) same++;
        for (int t = 0; t < same; t++)
            for (int m = 0; m < L; m++) {
                const int pos = n[p] - 1 + t;
                int ours[64];
                for (int j = 0; j < k; j++) ours[j] = fr_sample_route_id(r, t, m, j);
                qsort(ours, (size_t)k, sizeof(int), cmp_int);
                const int *theirs = want + ((size_t)pos * L + m) * k;
                const int eq = memcmp(ours, theirs, sizeof(int) * (size_t)k) == 0;
                if (margin[(size_t)pos * L + m] < 1e-4f) {
                    ties++;
                    continue;
                }
                compared++;
                if (!eq) {
                    differ++;
                    printf("  p%d token %d layer %d: experts differ from transformers' (margin %.3g)\n", p, t, m,
                           margin[(size_t)pos * L + m]);
                }
            }
        printf("  p%d: %d greedy tokens equal, their routes compared\n", p, same);
        free(want);
        free(greedy);
        free(margin);
        free(rp.res[p].tokens);
        free(rp.res[p].routed_experts);
        free(ids[p]);
    }
    printf("  routed experts: %ld (token, layer) records equal transformers' of %ld compared, %ld near-ties "
           "skipped\n", compared - differ, compared, ties);
    assert_true(compared > 7 * 32 * L);
    assert_int_equal(differ, 0);
    fr_scheduler_destroy(&sch);
    fr_test_shared_close(&s);
    fr_st_file_close(&g);
}

FR_TEST_MAIN(NULL, free_models,
             cmocka_unit_test_prestate(test_prefill_and_greedy, &dsmoe),
             cmocka_unit_test_prestate(test_decode_matches_prefill, &dsmoe),
             cmocka_unit_test_prestate(test_routes_match_golden, &dsmoe),
             cmocka_unit_test_prestate(test_prefill_and_greedy, &dsmoe2),
             cmocka_unit_test_prestate(test_decode_matches_prefill, &dsmoe2),
             cmocka_unit_test_prestate(test_routes_match_golden, &dsmoe2))
