/* Tests of the continuous-batching scheduler (rollout/engine/scheduler.h) on the
 * CPU backend with synthetic:tiny: preemption by recompute reproduces the
 * tokens of an unpreempted run, samples share the prompt's full pages,
 * abort, stop ids and max_tokens, and every sample ends exactly once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "test_util.h"

/* f32 sessions run in deterministic mode: the tests that use them compare
 * runs across batching, chunking and preemption bitwise. */
static void open_session(fr_session *s, fr_kv_dtype kv, int n_blocks, int max_seqs, int chunk)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, NULL, kv);
    o.deterministic = kv == FR_KV_F32;
    o.chunk = chunk;
    assert_int_equal(fr_session_open(&o, n_blocks, max_seqs, s), FR_OK);
}

/* Collects every queued result into out[request][sample] (asserting each
 * arrives once); returns how many arrived. */
#define MAXR 40
#define MAXN 4
static int collect(fr_scheduler *sch, fr_sample_result out[MAXR][MAXN])
{
    int got = 0;
    fr_sample_result r;
    while (fr_scheduler_next_result(sch, &r)) {
        assert_true(r.request_id < MAXR && r.sample < MAXN);
        assert_int_equal(out[r.request_id][r.sample].finish, FR_FINISH_NONE);   /* once */
        out[r.request_id][r.sample] = r;
        got++;
    }
    return got;
}

typedef struct {
    int *prompt, n_prompt, n;
    fr_request_spec spec;
} test_req;

static void make_requests(test_req *q, int count)
{
    fr_test_rng rng = {.s = 42};
    for (int i = 0; i < count; i++) {
        q[i].n_prompt = 20 + (int)(fr_test_u64(&rng) % 120);
        q[i].prompt = malloc(sizeof(int) * (size_t)q[i].n_prompt);
        q[i].prompt[0] = 256;
        for (int k = 1; k < q[i].n_prompt; k++) q[i].prompt[k] = (int)(fr_test_u64(&rng) % 256);
        q[i].n = 1 + i % 2;
        q[i].spec = (fr_request_spec){.id = (uint64_t)i, .group = 7, .prompt = q[i].prompt,
                                      .n_prompt = q[i].n_prompt, .n = q[i].n,
                                      .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f,
                                                 .seed = 1000 + (uint64_t)i},
                                      .max_tokens = 48};
    }
}

/* got against ref, sample by sample: the same tokens and log-probs,
 * bitwise; frees both. Returns how many of got's samples were preempted. */
static int same_runs(const test_req *q, int nr, fr_sample_result got[][MAXN], fr_sample_result ref[][MAXN])
{
    int preempted = 0;
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < q[i].n; k++) {
            fr_sample_result *a = &got[i][k], *b = &ref[i][k];
            assert_int_equal(a->n_tokens, b->n_tokens);
            assert_memory_equal(a->tokens, b->tokens, sizeof(int) * (size_t)a->n_tokens);
            assert_memory_equal(a->logprobs, b->logprobs, sizeof(float) * (size_t)a->n_tokens);
            preempted += a->preemptions > 0;
            fr_sample_result_free(a);
            fr_sample_result_free(b);
        }
    return preempted;
}

/* 32 requests on a cache with room for 8 sequences: all finish, some are
 * preempted, and every sample's tokens equal those of its request run alone
 * with ample capacity, bitwise with their log-probs (f32 KV, deterministic
 * mode: docs/determinism.md). */
static void test_preemption_recompute_exact(void **state)
{
    (void)state;
    enum { NR = 32 };
    test_req q[NR];
    make_requests(q, NR);
    static fr_sample_result got[MAXR][MAXN], ref[MAXR][MAXN];
    memset(got, 0, sizeof got);
    memset(ref, 0, sizeof ref);

    fr_session s;
    open_session(&s, FR_KV_F32, 10, 8, 64);
    fr_scheduler *sch = fr_test_scheduler(&s, 64);
    int total = 0;
    for (int i = 0; i < NR; i++) {
        assert_int_equal(fr_scheduler_submit(sch, &q[i].spec), FR_OK);
        total += q[i].n;
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(collect(sch, got), total);
    assert_int_equal(st.finished, total);
    assert_true(st.preemptions > 0);
    assert_int_equal(st.running + st.waiting + st.prefilling, 0);
    assert_int_equal(st.kv_blocks_used, 0);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);

    open_session(&s, FR_KV_F32, 64, 8, 64);
    sch = fr_test_scheduler(&s, 64);
    for (int i = 0; i < NR; i++) {
        assert_int_equal(fr_scheduler_submit(sch, &q[i].spec), FR_OK);
        assert_int_equal(fr_scheduler_run(sch), FR_OK);
    }
    assert_int_equal(collect(sch, ref), total);
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.preemptions, 0);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);

    for (int i = 0; i < NR; i++)
        for (int k = 0; k < q[i].n; k++) {
            assert_int_equal(got[i][k].finish, FR_FINISH_LENGTH);
            assert_int_equal(got[i][k].n_tokens, 48);
            assert_int_equal(got[i][k].group, 7);
        }
    assert_true(same_runs(q, NR, got, ref) > 0);
    for (int i = 0; i < NR; i++) free(q[i].prompt);
}

/* fr_scheduler_recompute_all in the middle of a run (what a recalibration
 * of the key mean does): every running sample and prefill is preempted, the
 * cache is emptied, and the run then ends with the tokens and log-probs of an
 * uninterrupted run, bitwise (deterministic mode). */
static void test_recompute_all(void **state)
{
    (void)state;
    enum { NR = 8 };
    test_req q[NR];
    make_requests(q, NR);
    static fr_sample_result got[MAXR][MAXN], ref[MAXR][MAXN];
    memset(got, 0, sizeof got);
    memset(ref, 0, sizeof ref);
    int total = 0;
    for (int i = 0; i < NR; i++) total += q[i].n;
    for (int pass = 0; pass < 2; pass++) {
        fr_session s;
        open_session(&s, FR_KV_F32, 64, 16, 64);
        fr_scheduler *sch = fr_test_scheduler(&s, 64);
        for (int i = 0; i < NR; i++) assert_int_equal(fr_scheduler_submit(sch, &q[i].spec), FR_OK);
        if (pass == 1) {
            for (int k = 0; k < 12; k++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
            fr_scheduler_stats st;
            fr_scheduler_stats_get(sch, &st);
            assert_true(st.running > 0);
            int n = -1;
            assert_int_equal(fr_scheduler_recompute_all(sch, &n), FR_OK);
            assert_int_equal(n, st.running + st.prefilling);
            fr_scheduler_stats_get(sch, &st);
            assert_int_equal(st.running + st.prefilling, 0);
            assert_int_equal(st.kv_blocks_used, 0);
            assert_int_equal(fr_scheduler_recompute_all(sch, &n), FR_OK);   /* nothing left to preempt */
            assert_int_equal(n, 0);
        }
        assert_int_equal(fr_scheduler_run(sch), FR_OK);
        assert_int_equal(collect(sch, pass ? got : ref), total);
        fr_scheduler_destroy(&sch);
        fr_session_close(&s);
    }
    assert_true(same_runs(q, NR, got, ref) > 0);
    for (int i = 0; i < NR; i++) free(q[i].prompt);
}

/* n = 4 samples of a 300-token prompt: 2 full pages shared, so after the
 * prefill the cache holds its 3 blocks, and after the first decode only one
 * partial page more per fork (6, not 12). */
static void test_samples_share_pages(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s, FR_KV_BF16, 32, 8, 512);
    fr_scheduler *sch = fr_test_scheduler(&s, 512);
    int prompt[300];
    for (int i = 0; i < 300; i++) prompt[i] = (i * 37 + 5) % 256;
    fr_request_spec r = {.id = 1, .prompt = prompt, .n_prompt = 300, .n = 4,
                         .params = {.temperature = 0.8f, .top_p = 1.0f, .seed = 3}, .max_tokens = 8};
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.waiting, 4);
    assert_int_equal(fr_scheduler_step(sch), FR_OK);   /* the whole prompt in one chunk */
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.running, 4);
    assert_int_equal(st.tokens_generated, 4);
    assert_int_equal(st.kv_blocks_used, 3);
    assert_int_equal(fr_scheduler_step(sch), FR_OK);   /* first decode: forks get their partial page */
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.kv_blocks_used, 6);
    assert_int_equal(st.kv_blocks_free, 26);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.finished, 4);
    /* the serving figures: four samples, one prompt counted once */
    const fr_serving_stats *v = fr_scheduler_serving(sch);
    assert_int_equal(v->prompt_tokens, 300);
    assert_int_equal(v->finished[FR_FINISH_LENGTH], 4);
    assert_int_equal(v->finished[FR_FINISH_STOP] + v->finished[FR_FINISH_ABORT] + v->finished[FR_FINISH_ERROR], 0);
    assert_int_equal(v->ttft.n, 4);
    assert_int_equal(v->tpot.n, 4);
    assert_int_equal(v->e2e.n, 4);
    assert_true(v->ttft.sum > 0 && v->ttft.sum <= v->e2e.sum);
    fr_sample_result res;
    int seen = 0;
    while (fr_scheduler_next_result(sch, &res)) {
        seen |= 1 << res.sample;
        fr_sample_result_free(&res);
    }
    assert_int_equal(seen, 15);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

typedef struct {
    int count[8][4];
    fr_finish_reason why[8][4];
    int n_tokens[8][4];
} tally;

static void on_done(void *user, const fr_sample_result *r)
{
    tally *t = user;
    t->count[r->request_id][r->sample]++;
    t->why[r->request_id][r->sample] = r->finish;
    t->n_tokens[r->request_id][r->sample] = r->n_tokens;
}

/* Abort of a running request, of a waiting one, abort all, and destroy with
 * work in flight: each sample ends exactly once, partial tokens kept. */
static void test_abort(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s, FR_KV_BF16, 16, 4, 512);
    tally t;
    memset(&t, 0, sizeof t);
    fr_scheduler_config c = {.max_seqs = 4, .chunk = 512, .reserve_blocks = -1, .on_done = on_done, .user = &t};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    int prompt[] = {256, 1, 2, 3, 4, 5};
    for (int i = 0; i < 4; i++) {
        fr_request_spec r = {.id = (uint64_t)i, .prompt = prompt, .n_prompt = 6, .n = 2,
                             .params = {.temperature = 1.0f, .top_p = 1.0f, .seed = 9}, .max_tokens = 100};
        assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    }
    for (int i = 0; i < 5; i++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.running, 4);   /* requests 0 and 1; 2 and 3 wait for slots */
    assert_int_equal(st.waiting, 4);
    int n = -1;
    assert_int_equal(fr_scheduler_abort(sch, 1, &n), FR_OK);
    assert_int_equal(n, 2);
    assert_int_equal(fr_scheduler_abort(sch, 3, &n), FR_OK);   /* still waiting */
    assert_int_equal(n, 2);
    assert_int_equal(fr_scheduler_abort(sch, 77, &n), FR_OK);   /* unknown: nothing */
    assert_int_equal(n, 0);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(t.count[1][k], 1);
        assert_int_equal(t.why[1][k], FR_FINISH_ABORT);
        assert_int_equal(t.n_tokens[1][k], 5);   /* first token from the prefill + 4 decodes */
        assert_int_equal(t.why[3][k], FR_FINISH_ABORT);
        assert_int_equal(t.n_tokens[3][k], 0);
    }
    for (int i = 0; i < 3; i++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
    assert_int_equal(fr_scheduler_abort_all(sch, &n), FR_OK);
    assert_int_equal(n, 4);   /* requests 0 and 2 */
    assert_true(fr_scheduler_idle(sch));
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.finished, 8);
    const fr_serving_stats *v = fr_scheduler_serving(sch);
    assert_int_equal(v->finished[FR_FINISH_ABORT], 8);
    assert_int_equal(v->e2e.n, 8);
    int drew = 0, drew2 = 0, prompts = 0;   /* samples with a first (second) token, requests with any */
    for (int i = 0; i < 4; i++) {
        prompts += t.n_tokens[i][0] > 0 || t.n_tokens[i][1] > 0;
        for (int k = 0; k < 2; k++) drew += t.n_tokens[i][k] > 0, drew2 += t.n_tokens[i][k] > 1;
    }
    assert_int_equal(v->ttft.n, drew);
    assert_int_equal(v->tpot.n, drew2);
    assert_int_equal(v->prompt_tokens, 6 * prompts);
    /* Destroy with work in flight ends it with reason abort. */
    fr_request_spec r = {.id = 5, .prompt = prompt, .n_prompt = 6, .n = 3,
                         .params = {.temperature = 0.0f, .top_p = 1.0f}, .max_tokens = 50};
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    assert_int_equal(fr_scheduler_step(sch), FR_OK);
    fr_scheduler_destroy(&sch);
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 4; k++) assert_true(t.count[i][k] <= 1);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(t.count[5][k], 1);
        assert_int_equal(t.why[5][k], FR_FINISH_ABORT);
        assert_int_equal(t.n_tokens[5][k], 1);
    }
    assert_int_equal(t.count[0][0] + t.count[0][1] + t.count[2][0] + t.count[2][1], 4);
    fr_session_close(&s);
}

static fr_sample_result run_one(fr_session *s, const fr_request_spec *r)
{
    fr_scheduler *sch = fr_test_scheduler(s, 512);
    assert_int_equal(fr_scheduler_submit(sch, r), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_sample_result out;
    assert_int_equal(fr_scheduler_next_result(sch, &out), 1);
    fr_sample_result extra;
    assert_int_equal(fr_scheduler_next_result(sch, &extra), 0);
    fr_scheduler_destroy(&sch);
    return out;
}

/* Stop ids end a sample at (and including) the stop token; max_tokens ends
 * it with reason length; invalid requests are refused. */
static void test_stop_and_length(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s, FR_KV_BF16, 8, 4, 512);
    int prompt[] = {256, 10, 20, 30};
    fr_request_spec r = {.id = 0, .prompt = prompt, .n_prompt = 4, .n = 1,
                         .params = {.temperature = 1.0f, .top_p = 1.0f, .seed = 5}, .max_tokens = 12};
    fr_sample_result a = run_one(&s, &r);
    assert_int_equal(a.finish, FR_FINISH_LENGTH);
    assert_int_equal(a.n_tokens, 12);
    int stop = a.tokens[5], first = 0;
    while (a.tokens[first] != stop) first++;
    r.stop_ids = &stop;
    r.n_stop = 1;
    fr_sample_result b = run_one(&s, &r);
    assert_int_equal(b.finish, FR_FINISH_STOP);
    assert_int_equal(b.n_tokens, first + 1);
    assert_memory_equal(a.tokens, b.tokens, sizeof(int) * (size_t)b.n_tokens);
    r.stop_ids = NULL;
    r.n_stop = 0;
    r.max_tokens = 1;
    fr_sample_result c = run_one(&s, &r);
    assert_int_equal(c.finish, FR_FINISH_LENGTH);
    assert_int_equal(c.n_tokens, 1);
    assert_int_equal(c.tokens[0], a.tokens[0]);
    fr_sample_result_free(&b);
    fr_sample_result_free(&c);

    fr_scheduler *sch = fr_test_scheduler(&s, 512);
    /* More samples than the 4 slots queue: 4 run, then the fifth, each drawn
     * as it would be in a batch of its own request alone. */
    fr_request_spec many = r;
    many.n = 5;
    many.max_tokens = 6;
    assert_int_equal(fr_scheduler_submit(sch, &many), FR_OK);
    int done5[5] = {0}, n5 = 0;
    while (!fr_scheduler_idle(sch)) {
        assert_int_equal(fr_scheduler_step(sch), FR_OK);
        fr_sample_result x;
        while (fr_scheduler_next_result(sch, &x)) {
            assert_true(x.sample >= 0 && x.sample < 5 && !done5[x.sample]);
            assert_int_equal(x.n_tokens, 6);
            if (x.sample == 0) assert_memory_equal(x.tokens, a.tokens, sizeof(int) * 6);
            done5[x.sample] = 1;
            n5++;
            fr_sample_result_free(&x);
        }
    }
    assert_int_equal(n5, 5);
    fr_sample_result_free(&a);
    fr_request_spec bad = r;
    bad.n_prompt = 0;
    assert_int_equal(fr_scheduler_submit(sch, &bad), FR_EINVAL);
    bad = r;
    bad.max_tokens = 2000;   /* 8 blocks hold 1024 tokens */
    assert_int_equal(fr_scheduler_submit(sch, &bad), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "KV blocks"));
    int oov = 300;
    bad = r;
    bad.stop_ids = &oov;
    bad.n_stop = 1;
    assert_int_equal(fr_scheduler_submit(sch, &bad), FR_EINVAL);
    bad = r;
    bad.params.top_p = 2.0f;
    assert_int_equal(fr_scheduler_submit(sch, &bad), FR_EINVAL);
    assert_true(fr_scheduler_idle(sch));
    assert_int_equal(fr_scheduler_step(sch), FR_OK);   /* idle: nothing */
    fr_scheduler_destroy(&sch);
    fr_scheduler_config cfg = {.max_seqs = 9};
    assert_int_equal(fr_scheduler_new(&s, &cfg, &sch), FR_EINVAL);
    assert_null(sch);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_preemption_recompute_exact),
             cmocka_unit_test(test_recompute_all),
             cmocka_unit_test(test_samples_share_pages),
             cmocka_unit_test(test_abort),
             cmocka_unit_test(test_stop_and_length))
