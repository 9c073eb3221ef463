/* Routed-expert replay through the scheduler (docs/deepseek_moe.md,
 * "Routed-expert replay"): a request that asks gets, for every generated
 * token, the experts each MoE layer chose at the position that drew it;
 * checked against the CPU router's choices in one prefill of the prompt and
 * the generated tokens (another path: one step, all rows), through sampled
 * and greedy samples, a tight cache (preemption by recompute) and the
 * record between ranks; a request that does not ask gets nothing; the
 * refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "test_util.h"

#define NREQ 6
#define NS 2
#define MAXT 40

typedef struct {
    fr_sample_result res[NREQ][NS];
    int done;
} results;

static void on_done(void *user, const fr_sample_result *r)
{
    results *rs = user;
    assert_true(r->request_id < NREQ && r->sample >= 0 && r->sample < NS);
    fr_sample_result *dst = &rs->res[r->request_id][r->sample];
    fr_test_keep_result(dst, r);
    rs->done++;
}

static fr_session open_session(const char *spec, int blocks)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, spec, FR_KV_F32);
    o.chunk = 192;   /* room for prefill_routes's one step; the scheduler steps 48 */
    fr_session s;
    if (fr_session_open(&o, blocks, 8, &s)) fail_msg("%s", fr_last_error());
    return s;
}

/* The routes of every row of prompt + tokens[0 .. n - 1) in one prefill. */
static uint16_t *prefill_routes(fr_session *s, const int *prompt, int n_prompt, const int *tokens, int n)
{
    const int len = n_prompt + n - 1, per = fr_model_moe_layers(&s->model->cfg) * s->model->cfg.experts_per_tok;
    int *ids = malloc(sizeof(int) * (size_t)len), *rows = malloc(sizeof(int) * (size_t)len), seq;
    memcpy(ids, prompt, sizeof(int) * (size_t)n_prompt);
    memcpy(ids + n_prompt, tokens, sizeof(int) * (size_t)(n - 1));
    for (int i = 0; i < len; i++) rows[i] = i;
    uint16_t *out = malloc(sizeof(uint16_t) * (size_t)len * per);
    float *lg = malloc(sizeof(float) * (size_t)s->model->cfg.vocab_size);
    assert_int_equal(fr_session_capture_routes(s, 1), FR_OK);
    assert_int_equal(fr_kv_seq_new(s->kv, &seq), FR_OK);
    fr_step_seq st = {.seq = seq, .n = len, .tokens = ids, .all_logits = 0};
    assert_int_equal(fr_session_step(s, &st, 1, lg), FR_OK);
    assert_int_equal(fr_session_routes(s, rows, len, out), FR_OK);
    fr_kv_seq_free(s->kv, seq);
    assert_int_equal(fr_session_capture_routes(s, 0), FR_OK);
    free(ids); free(rows); free(lg);
    return out;
}

/* Requests 0, 2, 4 ask for routes (sampled, greedy, teacher-forced); the
 * others not. blocks: a tight cache preempts. */
static void run_and_check(int blocks, long long *preemptions)
{
    fr_session s = open_session("synthetic:tiny-dsmoe", blocks);
    results rs;
    memset(&rs, 0, sizeof rs);
    fr_scheduler_config c = {.max_seqs = 4, .chunk = 48, .reserve_blocks = 1, .on_done = on_done, .user = &rs};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    int prompts[NREQ][128], n_prompt[NREQ], forced[MAXT];
    fr_test_rng rng = {.s = 3};
    for (int i = 0; i < MAXT; i++) forced[i] = 97 + i % 26;
    for (int i = 0; i < NREQ; i++) {
        n_prompt[i] = 90 + (int)(fr_test_u64(&rng) % 36);   /* a page, then the second one while decoding */
        prompts[i][0] = 256;
        for (int k = 1; k < n_prompt[i]; k++) prompts[i][k] = (int)(fr_test_u64(&rng) % 256);
        fr_request_spec r = {.id = (uint64_t)i, .prompt = prompts[i], .n_prompt = n_prompt[i], .n = NS,
                             .params = {.temperature = i == 2 ? 0.0f : 1.0f, .top_p = 1.0f, .seed = 9},
                             .max_tokens = MAXT, .return_routed_experts = i % 2 == 0,
                             .forced = i == 4 ? forced : NULL, .n_forced = i == 4 ? MAXT : 0};
        assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    assert_int_equal(rs.done, NREQ * NS);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    *preemptions = st.preemptions;
    fr_scheduler_destroy(&sch);
    const int L = 2, k = 4;
    for (int i = 0; i < NREQ; i++)
        for (int x = 0; x < NS; x++) {
            fr_sample_result *r = &rs.res[i][x];
            assert_int_equal(r->n_tokens, MAXT);
            if (i % 2) {
                assert_null(r->routed_experts);
                assert_int_equal(r->route_layers, 0);
                fr_sample_result_free(r);
                continue;
            }
            assert_non_null(r->routed_experts);
            assert_true(r->route_layers == L && r->route_k == k && r->route_width == 1);
            uint16_t *want = prefill_routes(&s, prompts[i], n_prompt[i], r->tokens, r->n_tokens);
            for (int t = 0; t < r->n_tokens; t++)
                for (int m = 0; m < L; m++)
                    for (int j = 0; j < k; j++) {
                        const int got = fr_sample_route_id(r, t, m, j);
                        const int exp = want[((size_t)(n_prompt[i] - 1 + t) * L + m) * k + j];
                        if (got != exp)
                            fail_msg("request %d sample %d token %d layer %d: expert %d is %d, the router chose %d",
                                     i, x, t, m, j, got, exp);
                    }
            free(want);
            fr_sample_result_free(r);
        }
    fr_session_close(&s);
}

static void test_routes_match_router(void **state)
{
    (void)state;
    long long pre = 0;
    run_and_check(40, &pre);
    printf("  roomy cache: %lld preemptions\n", pre);
    run_and_check(5, &pre);   /* 4 running samples need 8 blocks of 128 tokens: preempted */
    printf("  tight cache: %lld preemptions\n", pre);
    assert_true(pre > 0);
}

/* Asking for routes changes no draw: one prompt, seed and sampling, with
 * and without them, gives the same tokens. */
static void test_no_draw_changes(void **state)
{
    (void)state;
    fr_session s = open_session("synthetic:tiny-dsmoe-v2", 12);
    results rs;
    memset(&rs, 0, sizeof rs);
    fr_scheduler_config c = {.max_seqs = 4, .chunk = 48, .on_done = on_done, .user = &rs};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    int prompt[30];
    prompt[0] = 256;
    for (int i = 1; i < 30; i++) prompt[i] = 60 + i;
    for (int i = 0; i < 2; i++) {
        fr_request_spec r = {.id = (uint64_t)i, .prompt = prompt, .n_prompt = 30, .n = NS,
                             .params = {.temperature = 0.9f, .top_p = 0.95f, .seed = 77}, .max_tokens = MAXT,
                             .return_routed_experts = i};
        assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_destroy(&sch);
    for (int x = 0; x < NS; x++) {
        assert_int_equal(rs.res[0][x].n_tokens, rs.res[1][x].n_tokens);
        assert_memory_equal(rs.res[0][x].tokens, rs.res[1][x].tokens, sizeof(int) * (size_t)rs.res[0][x].n_tokens);
        assert_null(rs.res[0][x].routed_experts);
        assert_non_null(rs.res[1][x].routed_experts);
        fr_sample_result_free(&rs.res[0][x]);
        fr_sample_result_free(&rs.res[1][x]);
    }
    fr_session_close(&s);
}

/* A result's routes between ranks: the record carries them whole. */
static void test_record_round_trip(void **state)
{
    (void)state;
    int toks[3] = {1, 2, 3};
    float lps[3] = {-0.5f, -1.0f, -2.0f};
    uint8_t routes[3 * 2 * 3 * 2];
    for (size_t i = 0; i < sizeof routes; i++) routes[i] = (uint8_t)(i * 37 + 5);
    fr_sample_result r = {.request_id = 7, .sample = 1, .tokens = toks, .logprobs = lps, .n_tokens = 3,
                          .finish = FR_FINISH_LENGTH, .routed_experts = routes, .route_layers = 2, .route_k = 3,
                          .route_width = 2};
    fr_rank_buf b = {0};
    fr_sample_result_put(&b, &r, 1);
    assert_false(b.failed);
    fr_rank_reader rd = {(const unsigned char *)b.data, b.len, 0, 0};
    fr_sample_result back;
    assert_int_equal(fr_sample_result_get(&rd, &back), FR_OK);
    assert_true(back.route_layers == 2 && back.route_k == 3 && back.route_width == 2);
    assert_memory_equal(back.routed_experts, routes, sizeof routes);
    const size_t at = (2 * 6 + 1 * 3 + 2) * 2;   /* token 2, layer 1, expert 2: little endian */
    assert_int_equal(fr_sample_route_id(&back, 2, 1, 2), routes[at] | routes[at + 1] << 8);
    fr_sample_result_free(&back);
    /* a record cut inside its routes is malformed */
    fr_rank_reader cut = {(const unsigned char *)b.data, b.len - 3, 0, 0};
    assert_int_equal(fr_sample_result_get(&cut, &back), FR_EFORMAT);
    fr_rank_buf_free(&b);
}

/* A dense model refuses return_routed_experts; 2 is no flag. */
static void test_refusals(void **state)
{
    (void)state;
    int prompt[3] = {256, 1, 2};
    fr_request_spec r = {.id = 1, .prompt = prompt, .n_prompt = 3, .n = 1, .params = {.temperature = 1, .top_p = 1},
                         .max_tokens = 4, .return_routed_experts = 2};
    assert_int_equal(fr_request_spec_check(&r, 272), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "return_routed_experts"));
    fr_session s = open_session("synthetic:tiny", 8);
    fr_scheduler_config c = {.max_seqs = 2, .chunk = 48};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    r.return_routed_experts = 1;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "no mixture-of-experts layer"));
    r.return_routed_experts = 0;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_routes_match_router),
             cmocka_unit_test(test_no_draw_changes),
             cmocka_unit_test(test_record_round_trip),
             cmocka_unit_test(test_refusals))
