/* The scheduler's pause modes and continued samples
 * (rollout/engine/scheduler.h, fr_scheduler_mode; fr_request_spec's
 * continue_tokens), on the CPU backend with synthetic:tiny in deterministic
 * mode: a frozen engine takes no step and then goes on as if never
 * stopped, with or without recomputing its KV cache; a holding engine
 * finishes what started (preempted samples included) and starts nothing
 * else; a sample continued from any of its tokens is bitwise the sample
 * never interrupted (f32, BF16 and NVFP4 caches, other chunk sizes, in a
 * busy batch, with barred stop ids and top log-probs, monitored); bad
 * continuations are refused. FR_TEST_BACKEND=cuda runs every case on the
 * CUDA backend, with BF16 where the CPU case has f32 (the GPU has no f32
 * cache) and tq6 where it has NVFP4 (skipped without tq6). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "test_util.h"

enum { MAXR = 16, MAXN = 4 };

static int on_cuda(void)
{
    const char *be = getenv("FR_TEST_BACKEND");
    return be && strcmp(be, "cuda") == 0;
}

/* 0 when the case cannot run here (skipped with a message): the GPU's FP4
 * decode kernels are built for head_dim 128, so an FP4 cache on CUDA runs
 * tq6 in place of synthetic:tiny (head_dim 64). */
static int open_det(fr_session *s, fr_kv_dtype kv, int n_blocks, int max_seqs, int chunk)
{
    const int cuda = on_cuda();
    const char *model = NULL;
    if (cuda && kv == FR_KV_NVFP4 && !(model = fr_test_require_model("tq6"))) return 0;
    fr_engine_opts o = fr_test_engine_opts(cuda ? FR_BACKEND_CUDA : FR_BACKEND_CPU, model,
                                           cuda && kv == FR_KV_F32 ? FR_KV_BF16 : kv);
    o.deterministic = 1;
    o.chunk = chunk;
    if (fr_session_open(&o, n_blocks, max_seqs, s) != FR_OK) fail_msg("session: %s", fr_last_error());
    return 1;
}

/* Every queued result into out[request][sample - first], each once. */
static int collect(fr_scheduler *sch, fr_sample_result out[MAXR][MAXN], int first)
{
    int got = 0;
    fr_sample_result r;
    while (fr_scheduler_next_result(sch, &r)) {
        assert_true(r.request_id < MAXR && r.sample - first >= 0 && r.sample - first < MAXN);
        assert_int_equal(out[r.request_id][r.sample - first].finish, FR_FINISH_NONE);
        out[r.request_id][r.sample - first] = r;
        got++;
    }
    return got;
}

static void free_all(fr_sample_result out[MAXR][MAXN])
{
    for (int i = 0; i < MAXR; i++)
        for (int k = 0; k < MAXN; k++) fr_sample_result_free(&out[i][k]);
}

static int prompt_a[] = {256, 11, 42, 97, 3, 64, 120, 5, 77, 31, 200, 18, 9, 150, 66, 23, 88, 14, 250, 7,
                         45, 101, 33, 60, 12, 199, 8, 71, 140, 2, 55, 93, 170, 28, 81, 6, 111, 49, 230, 19};

static fr_request_spec spec_of(uint64_t id, int n, int max_tokens)
{
    return (fr_request_spec){.id = id, .group = 5, .prompt = prompt_a, .n_prompt = 40, .n = n, .first_sample = 3,
                             .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 4242 + id},
                             .max_tokens = max_tokens};
}

/* The one sample of r run alone on a fresh scheduler. */
static fr_sample_result run_alone(fr_session *s, int chunk, const fr_request_spec *r)
{
    fr_scheduler *sch = fr_test_scheduler(s, chunk);
    assert_int_equal(fr_scheduler_submit(sch, r), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_sample_result out, extra;
    assert_int_equal(fr_scheduler_next_result(sch, &out), 1);
    assert_int_equal(fr_scheduler_next_result(sch, &extra), 0);
    fr_scheduler_destroy(&sch);
    return out;
}

/* b is a's continuation from token k: the rest of a, bitwise. */
static void assert_rest(const fr_sample_result *a, const fr_sample_result *b, int k)
{
    assert_int_equal(b->start, k);
    assert_int_equal(b->sample, a->sample);
    assert_int_equal(b->finish, a->finish);
    assert_int_equal(b->n_tokens, a->n_tokens - k);
    assert_memory_equal(b->tokens, a->tokens + k, sizeof(int) * (size_t)b->n_tokens);
    assert_memory_equal(b->logprobs, a->logprobs + k, sizeof(float) * (size_t)b->n_tokens);
    assert_int_equal(b->top_n, a->top_n);
    if (a->top_n) {
        const size_t t = (size_t)a->top_n;
        assert_memory_equal(b->top_ids, a->top_ids + (size_t)k * t, sizeof(int) * (size_t)b->n_tokens * t);
        assert_memory_equal(b->top_logprobs, a->top_logprobs + (size_t)k * t,
                            sizeof(float) * (size_t)b->n_tokens * t);
    }
}

/* A continuation of a's first k tokens, run alone (chunk) or (busy) beside
 * another request already decoding. */
static fr_sample_result run_continuation(fr_session *s, int chunk, fr_request_spec r, const fr_sample_result *a,
                                         int k, int busy)
{
    r.id = 9;
    r.first_sample = a->sample;
    r.continue_tokens = a->tokens;
    r.n_continue = k;
    if (!busy) return run_alone(s, chunk, &r);
    fr_scheduler *sch = fr_test_scheduler(s, chunk);
    fr_request_spec other = spec_of(1, 2, 30);
    assert_int_equal(fr_scheduler_submit(sch, &other), FR_OK);
    for (int i = 0; i < 4; i++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_sample_result out = {0}, x;
    int found = 0;
    while (fr_scheduler_next_result(sch, &x)) {
        if (x.request_id == 9) {
            out = x;
            found++;
        } else {
            fr_sample_result_free(&x);
        }
    }
    assert_int_equal(found, 1);
    fr_scheduler_destroy(&sch);
    return out;
}

/* Every continuation point of one sample, alone and in a busy batch (and,
 * where the cache allows, with another chunk size): the rest of the sample
 * bitwise, from `start` = the continued count. */
static void check_continuations(fr_kv_dtype kv, fr_request_spec r)
{
    fr_session s;
    if (!open_det(&s, kv, 64, 8, 16)) return;
    fr_sample_result a = run_alone(&s, 16, &r);
    assert_true(a.n_tokens >= 18);
    const int points[] = {1, 2, 9, 16, 17, a.n_tokens - 1};
    for (size_t p = 0; p < sizeof points / sizeof points[0]; p++)
        for (int busy = 0; busy < 2; busy++) {
            fr_sample_result b = run_continuation(&s, 16, r, &a, points[p], busy);
            assert_rest(&a, &b, points[p]);
            fr_sample_result_free(&b);
        }
    /* f32 and BF16 caches prefill alike in any chunks; an FP4 cache's
     * numbers depend on them (docs/determinism.md) */
    if (kv != FR_KV_NVFP4) {
        fr_sample_result b = run_continuation(&s, 7, r, &a, 13, 0);
        assert_rest(&a, &b, 13);
        fr_sample_result_free(&b);
    }
    fr_sample_result_free(&a);
    fr_session_close(&s);
}

static void test_continue_bitwise(void **state)
{
    (void)state;
    const fr_kv_dtype kvs[] = {FR_KV_F32, FR_KV_BF16, FR_KV_NVFP4};
    for (size_t i = on_cuda(); i < sizeof kvs / sizeof kvs[0]; i++) check_continuations(kvs[i], spec_of(0, 1, 24));
}

/* The options that count a sample's tokens: stop ids barred until
 * min_tokens (the continued tokens count), top log-probs of the new tokens
 * only. */
static void test_continue_options(void **state)
{
    (void)state;
    fr_request_spec r = spec_of(0, 1, 24);
    int stops[] = {32, 101, 7};
    r.stop_ids = stops;
    r.n_stop = 3;
    r.min_tokens = 12;
    r.top_logprobs = 3;
    r.params.temperature = 2.0f;   /* a flat distribution: a stop id would come early unbarred */
    check_continuations(FR_KV_F32, r);
}

/* A monitored continuation runs a shadow of its prompt and continued
 * tokens: every new token measured (against a monitored sample: on a GPU
 * a monitored row may be drawn on the host, docs/determinism.md). */
static void test_continue_monitored(void **state)
{
    (void)state;
    fr_session s;
    if (!open_det(&s, FR_KV_NVFP4, 64, 8, 16)) return;
    fr_request_spec r = spec_of(0, 1, 20);
    r.monitor = 1;
    r.per_token_kl = 1;
    fr_sample_result a = run_alone(&s, 16, &r);
    fr_sample_result b = run_continuation(&s, 16, r, &a, 8, 0);
    assert_rest(&a, &b, 8);
    assert_true(b.monitored);
    assert_int_equal((int)b.div.n, b.n_tokens);
    assert_non_null(b.kl);
    for (int i = 0; i < b.n_tokens; i++) assert_true(isfinite(b.kl[i]));
    fr_sample_result_free(&a);
    fr_sample_result_free(&b);
    fr_session_close(&s);
}

/* What a continuation may not be; and one aborted before it made a token
 * ends with none, from its start. */
static void test_continue_refused(void **state)
{
    (void)state;
    fr_session s;
    open_det(&s, FR_KV_F32, 64, 8, 64);
    fr_scheduler *sch = fr_test_scheduler(&s, 64);
    int cont[30], forced[4] = {1, 2, 3, 4};
    for (int i = 0; i < 30; i++) cont[i] = 40 + i;
    fr_request_spec r = spec_of(0, 1, 20);
    r.continue_tokens = cont;
    r.n_continue = 5;
    r.n = 2;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);   /* one sample's tokens */
    r.n = 1;
    r.n_continue = 20;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);   /* nothing left within max_tokens */
    r.n_continue = 5;
    r.forced = forced;
    r.n_forced = 4;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    r.forced = NULL;
    r.n_forced = 0;
    r.prompt_logprobs = 1;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    r.prompt_logprobs = 0;
    cont[2] = 100000;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);   /* outside the vocabulary */
    assert_non_null(strstr(fr_last_error(), "continued token 2"));
    cont[2] = 42;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    int n = 0;
    assert_int_equal(fr_scheduler_abort(sch, 0, &n), FR_OK);
    assert_int_equal(n, 1);
    fr_sample_result x;
    assert_int_equal(fr_scheduler_next_result(sch, &x), 1);
    assert_int_equal(x.finish, FR_FINISH_ABORT);
    assert_int_equal(x.start, 5);
    assert_int_equal(x.n_tokens, 0);
    fr_sample_result_free(&x);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

/* A frozen engine takes no step: nothing drawn, nothing admitted, its KV
 * kept; submits and aborts still work. Back in RUN, its samples end as in
 * a run never frozen, bitwise, whether their KV cache was kept or dropped
 * and recomputed meanwhile. */
static void test_freeze(void **state)
{
    (void)state;
    static fr_sample_result ref[MAXR][MAXN], got[MAXR][MAXN];
    for (int recompute = 0; recompute < 2; recompute++) {
        memset(ref, 0, sizeof ref);
        memset(got, 0, sizeof got);
        for (int pass = 0; pass < 2; pass++) {
            fr_session s;
            open_det(&s, FR_KV_BF16, 64, 8, 32);
            fr_scheduler *sch = fr_test_scheduler(&s, 32);
            fr_request_spec a = spec_of(0, 2, 30), b = spec_of(1, 1, 30), c = spec_of(2, 1, 30);
            assert_int_equal(fr_scheduler_submit(sch, &a), FR_OK);
            assert_int_equal(fr_scheduler_submit(sch, &b), FR_OK);
            for (int i = 0; pass && i < 6; i++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
            if (pass) {
                fr_scheduler_set_mode(sch, FR_SCHED_FREEZE);
                assert_int_equal(fr_scheduler_mode_of(sch), FR_SCHED_FREEZE);
                fr_scheduler_stats before, after;
                fr_scheduler_stats_get(sch, &before);
                assert_true(before.running == 3 && before.kv_blocks_used > 0);
                assert_false(fr_scheduler_busy(sch));
                assert_int_equal(fr_scheduler_submit(sch, &c), FR_OK);
                for (int i = 0; i < 5; i++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
                assert_int_equal(fr_scheduler_run(sch), FR_OK);   /* returns: nothing it may do */
                fr_scheduler_stats_get(sch, &after);
                assert_int_equal(after.tokens_generated, before.tokens_generated);
                assert_int_equal(after.steps, before.steps);
                assert_int_equal(after.kv_blocks_used, before.kv_blocks_used);
                assert_int_equal(after.waiting, 1);   /* c, not admitted */
                if (recompute) {
                    int n = 0;
                    assert_int_equal(fr_scheduler_recompute_all(sch, &n), FR_OK);
                    assert_int_equal(n, 3);
                    fr_scheduler_stats_get(sch, &after);
                    assert_int_equal(after.kv_blocks_used, 0);
                    assert_int_equal(after.in_flight, 3);   /* preempted after admission: still in flight */
                }
                fr_scheduler_set_mode(sch, FR_SCHED_RUN);
            } else {
                assert_int_equal(fr_scheduler_submit(sch, &c), FR_OK);
            }
            assert_int_equal(fr_scheduler_run(sch), FR_OK);
            assert_int_equal(collect(sch, pass ? got : ref, 3), 4);
            fr_scheduler_destroy(&sch);
            fr_session_close(&s);
        }
        for (int i = 0; i < 3; i++)
            for (int k = 0; k < (i == 0 ? 2 : 1); k++) {
                assert_int_equal(got[i][k].n_tokens, ref[i][k].n_tokens);
                assert_memory_equal(got[i][k].tokens, ref[i][k].tokens, sizeof(int) * 30);
                assert_memory_equal(got[i][k].logprobs, ref[i][k].logprobs, sizeof(float) * 30);
            }
        free_all(ref);
        free_all(got);
    }
}

/* A holding engine finishes the samples in flight, preempted ones
 * included, and admits nothing that had not started; back in RUN, the rest
 * runs as it would have. */
static void test_hold(void **state)
{
    (void)state;
    static fr_sample_result got[MAXR][MAXN];
    memset(got, 0, sizeof got);
    fr_session s;
    open_det(&s, FR_KV_F32, 5, 4, 64);   /* 5 pages: the decodes of three samples run out and preempt */
    fr_scheduler *sch = fr_test_scheduler(&s, 64);
    fr_request_spec r[3] = {spec_of(0, 2, 180), spec_of(1, 1, 180), spec_of(2, 2, 40)};
    for (int i = 0; i < 3; i++) assert_int_equal(fr_scheduler_submit(sch, &r[i]), FR_OK);
    fr_scheduler_stats st;
    int steps = 0;
    do {
        assert_int_equal(fr_scheduler_step(sch), FR_OK);
        fr_scheduler_stats_get(sch, &st);
    } while (st.preemptions == 0 && ++steps < 2000);
    assert_true(st.preemptions > 0);
    fr_scheduler_set_mode(sch, FR_SCHED_HOLD);
    const int in_flight = fr_scheduler_in_flight(sch);
    assert_int_equal(in_flight, st.running + st.prefilling + st.waiting - 2);   /* request 2 never started */
    fr_request_spec late = spec_of(3, 1, 10);
    assert_int_equal(fr_scheduler_submit(sch, &late), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    assert_false(fr_scheduler_busy(sch));
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.in_flight, 0);
    assert_int_equal(st.running + st.prefilling, 0);
    assert_int_equal(st.waiting, 3);   /* request 2's two samples and the late one */
    assert_int_equal(collect(sch, got, 3), in_flight);
    int preempted = 0;
    for (int k = 0; k < 2; k++) preempted += got[0][k].preemptions;
    preempted += got[1][0].preemptions;
    assert_true(preempted > 0);   /* a preempted sample counted as in flight and finished */
    assert_int_equal(got[2][0].finish, FR_FINISH_NONE);
    fr_scheduler_set_mode(sch, FR_SCHED_RUN);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    assert_int_equal(collect(sch, got, 3), 3);
    fr_scheduler_destroy(&sch);
    fr_request_spec held[2] = {r[2], late};
    held[0].n = 1;   /* its first sample alone (deterministic mode: the same) */
    for (int i = 0; i < 2; i++) {
        fr_sample_result alone = run_alone(&s, 64, &held[i]);
        assert_int_equal(got[2 + i][0].n_tokens, alone.n_tokens);
        assert_memory_equal(got[2 + i][0].tokens, alone.tokens, sizeof(int) * (size_t)alone.n_tokens);
        fr_sample_result_free(&alone);
    }
    free_all(got);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_continue_bitwise),
             cmocka_unit_test(test_continue_options),
             cmocka_unit_test(test_continue_monitored),
             cmocka_unit_test(test_continue_refused),
             cmocka_unit_test(test_freeze),
             cmocka_unit_test(test_hold))
