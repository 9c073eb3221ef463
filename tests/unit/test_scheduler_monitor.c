/* Divergence monitoring, weight versions and teacher forcing in the
 * scheduler (rollout/engine/scheduler.h, rollout/engine/divergence.h):
 *  - synthetic:tiny: kl_sample_rate picks the same samples every time, about
 *    the asked share; every token carries the weight version set when it was
 *    drawn; preemption keeps the shadow in step (in deterministic mode an f32
 *    engine's tokens, log-probs and KL figures are bitwise an unpreempted
 *    run's); a BF16 engine against its BF16
 *    shadow measures KL below 1e-4 nats (the serving prefill's chunk cuts
 *    differ from the shadow's) and agrees on the top token; a teacher-forced
 *    request emits exactly its forced tokens;
 *  - tq6 with an NVFP4 cache, kl_sample_rate 1, teacher-forced along two eval
 *    texts: each sample's mean KL equals eval-kl's per-text figure for the
 *    same tokens (paper Eq. 9; issue acceptance: within 10%), and the
 *    aggregates count every position. With FR_TEST_BACKEND=cuda this case
 *    runs on the GPU (serving, shadow and eval-kl alike), where decode-only
 *    steps measure on the device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/monitor/calibrate.h"
#include "rollout/monitor/eval_kl.h"
#include "rollout/engine/scheduler.h"
#include "tests/unit/test_util.h"

static void open_session_det(fr_session *s, const char *model, fr_kv_dtype kv, int n_blocks, int max_seqs,
                             fr_backend backend, int deterministic)
{
    fr_engine_opts o = fr_test_engine_opts(backend, NULL, kv);
    o.deterministic = deterministic;
    if (model) o.model = model;
    if (fr_session_open(&o, n_blocks, max_seqs, s)) fail_msg("%s", fr_last_error());
}

static void open_session_on(fr_session *s, const char *model, fr_kv_dtype kv, int n_blocks, int max_seqs,
                            fr_backend backend)
{
    open_session_det(s, model, kv, n_blocks, max_seqs, backend, 0);
}

static void open_session(fr_session *s, const char *model, fr_kv_dtype kv, int n_blocks, int max_seqs)
{
    open_session_on(s, model, kv, n_blocks, max_seqs, FR_BACKEND_CPU);
}

typedef struct {
    fr_sample_result r[16][4];
    int got;
} results;

static void on_done(void *user, const fr_sample_result *r)
{
    results *x = user;
    assert_true(r->request_id < 16 && r->sample < 4);
    fr_sample_result *d = &x->r[r->request_id][r->sample];
    assert_int_equal(d->finish, FR_FINISH_NONE);
    *d = *r;   /* keep the arrays: copy them */
    size_t n = (size_t)r->n_tokens;
    d->tokens = malloc(sizeof(int) * (n ? n : 1));
    d->logprobs = malloc(sizeof(float) * (n ? n : 1));
    d->versions = malloc(sizeof(uint64_t) * (n ? n : 1));
    memcpy(d->tokens, r->tokens, sizeof(int) * n);
    memcpy(d->logprobs, r->logprobs, sizeof(float) * n);
    memcpy(d->versions, r->versions, sizeof(uint64_t) * n);
    d->kl = NULL;
    if (r->kl) {
        d->kl = malloc(sizeof(float) * (n ? n : 1));
        memcpy(d->kl, r->kl, sizeof(float) * n);
    }
    x->got++;
}

static void free_results(results *x)
{
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 4; j++) fr_sample_result_free(&x->r[i][j]);
}

static const int PROMPT[] = {256, 100, 101, 102, 32, 102, 40, 120, 41, 58, 10, 32, 32, 32, 32};
enum { NP = sizeof PROMPT / sizeof PROMPT[0] };

/* 12 requests x n = 3 on synthetic:tiny (prompts of 100..122 tokens, 48 new
 * ones: every sample crosses a page end), version 7 for the first 4 steps,
 * then 8; deterministic mode or not. */
static void run_tiny(fr_kv_dtype kv, int n_blocks, double rate, int det, results *out, long long *preemptions)
{
    fr_session s;
    open_session_det(&s, NULL, kv, n_blocks, 8, FR_BACKEND_CPU, det);
    fr_scheduler_config c = {.chunk = 64, .reserve_blocks = -1, .on_done = on_done, .user = out,
                             .kl_sample_rate = rate, .shadow_blocks = 96};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    fr_scheduler_set_weight_version(sch, 7);
    fr_test_rng rng = {.s = 5};
    int prompt[128];
    for (int i = 0; i < 12; i++) {
        const int n = 100 + 2 * i;
        prompt[0] = 256;
        for (int k = 1; k < n; k++) prompt[k] = (int)(fr_test_u64(&rng) % 256);
        fr_request_spec q = {.id = (uint64_t)i, .prompt = prompt, .n_prompt = n, .n = 3, .max_tokens = 48,
                             .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 11}, .monitor = -1,
                             .per_token_kl = 1};
        assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    }
    for (int step = 0; !fr_scheduler_idle(sch); step++) {
        if (step == 4) fr_scheduler_set_weight_version(sch, 8);
        assert_int_equal(fr_scheduler_step(sch), FR_OK);
    }
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    *preemptions = st.preemptions;
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

static void test_tiny_monitoring(void **state)
{
    (void)state;
    static results a, b, c;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&c, 0, sizeof c);
    long long pa, pb, pc;
    run_tiny(FR_KV_F32, 256, 0.5, 1, &a, &pa);   /* room for everything */
    run_tiny(FR_KV_F32, 10, 0.5, 1, &b, &pb);    /* preemptions: other batches and prompt chunks */
    run_tiny(FR_KV_BF16, 256, 0.5, 0, &c, &pc);  /* a BF16 engine against its BF16 shadow, default mode */
    printf("  preemptions: %lld with room, %lld with 10 blocks\n", pa, pb);
    assert_int_equal(pa, 0);
    assert_true(pb > 0);
    assert_int_equal(a.got, 36);
    assert_int_equal(b.got, 36);
    assert_int_equal(c.got, 36);
    int monitored = 0, v7 = 0, v8 = 0;
    double kl_f32 = 0.0, kl_bf16 = 0.0;
    long agree_bf16 = 0, n_bf16 = 0;
    for (int i = 0; i < 12; i++)
        for (int j = 0; j < 3; j++) {
            const fr_sample_result *x = &a.r[i][j], *y = &b.r[i][j], *z = &c.r[i][j];
            assert_int_equal(x->monitored, y->monitored);   /* the same choice every time */
            assert_int_equal(x->monitored, z->monitored);
            assert_int_equal(x->n_tokens, y->n_tokens);
            assert_memory_equal(x->tokens, y->tokens, sizeof(int) * (size_t)x->n_tokens);
            assert_memory_equal(x->logprobs, y->logprobs, sizeof(float) * (size_t)x->n_tokens);
            for (int t = 0; t < x->n_tokens; t++) {
                assert_true(x->versions[t] == 7 || x->versions[t] == 8);
                if (t > 0) assert_true(x->versions[t] >= x->versions[t - 1]);
                v7 += x->versions[t] == 7;
                v8 += x->versions[t] == 8;
            }
            if (!x->monitored) {
                assert_int_equal(x->div.n, 0);
                assert_null(x->kl);
                continue;
            }
            monitored++;
            assert_int_equal(x->div.n, x->n_tokens);
            assert_non_null(x->kl);
            /* preempted and recomputed, the shadow stayed in step: bitwise the same figures */
            assert_int_equal(y->div.n, x->div.n);
            assert_non_null(y->kl);
            assert_memory_equal(x->kl, y->kl, sizeof(float) * (size_t)x->n_tokens);
            assert_true(y->div.kl_sum == x->div.kl_sum);
            kl_f32 += x->div.kl_sum / x->div.n;
            /* BF16 engine, BF16 shadow: the same distributions up to the
             * prompt's chunk cuts (the serving prefill's depend on load) */
            assert_int_equal(z->div.n, z->n_tokens);
            kl_bf16 = fmax(kl_bf16, z->div.kl_max);
            agree_bf16 += z->div.top1_agree;
            n_bf16 += z->div.n;
        }
    printf("  %d of 36 samples monitored at rate 0.5; tokens at version 7: %d, 8: %d; f32 KV vs BF16 shadow: "
           "mean KL %.3g nats\n", monitored, v7, v8, kl_f32 / (monitored ? monitored : 1));
    printf("  BF16 engine vs BF16 shadow: max KL %.3g nats, top-1 agreement %ld/%ld\n", kl_bf16, agree_bf16, n_bf16);
    assert_true(monitored >= 9 && monitored <= 27);
    assert_true(v7 > 0 && v8 > 0);
    assert_true(kl_bf16 < 1e-4 && agree_bf16 >= n_bf16 - n_bf16 / 100);
    free_results(&a);
    free_results(&b);
    free_results(&c);
}

static void test_forced_tokens(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s, NULL, FR_KV_BF16, 64, 4);
    static results out;
    memset(&out, 0, sizeof out);
    fr_scheduler_config c = {.reserve_blocks = -1, .on_done = on_done, .user = &out};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    static const int forced[] = {65, 66, 67, 68, 69, 70, 71};
    fr_request_spec q = {.id = 3, .prompt = PROMPT, .n_prompt = NP, .n = 2, .max_tokens = 100,
                         .params = {.temperature = 0.7f, .top_k = 0, .top_p = 1.0f, .seed = 1}, .monitor = 1,
                         .forced = forced, .n_forced = 7};
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    q.forced = NULL;
    q.n_forced = 3;   /* ignored without forced */
    q.id = 4;
    int bad[] = {65, 999};
    q.forced = bad;
    q.n_forced = 2;
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_EINVAL);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    for (int j = 0; j < 2; j++) {
        const fr_sample_result *x = &out.r[3][j];
        assert_int_equal(x->finish, FR_FINISH_LENGTH);
        assert_int_equal(x->n_tokens, 7);
        assert_memory_equal(x->tokens, forced, sizeof forced);
        for (int t = 0; t < 7; t++) assert_true(x->logprobs[t] <= 0.0f && isfinite(x->logprobs[t]));
        assert_true(x->monitored && x->div.n == 7);
    }
    assert_memory_equal(out.r[3][0].logprobs, out.r[3][1].logprobs, sizeof(float) * 7);
    free_results(&out);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

/* The check at the serving level: tq6, NVFP4, every sample
 * monitored, teacher-forced along two eval texts (BOS as the prompt, the
 * text as forced tokens), against eval-kl over the same tokens. */
static void test_tq6_monitor_equals_eval_kl(void **state)
{
    (void)state;
    const char *dir = fr_test_require_tq6();
    if (!dir) skip();
    enum { L = 383 };   /* positions 0 .. 382: BOS + 382 forced tokens */
    fr_session s;
    const char *be = getenv("FR_TEST_BACKEND");
    const int cuda = be && strcmp(be, "cuda") == 0;
    open_session_on(&s, dir, FR_KV_NVFP4, 16, 2, cuda ? FR_BACKEND_CUDA : FR_BACKEND_CPU);
    int *ev[2], len[2];
    char path[4200];
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/texts/eval_%d.txt", dir, i);
        assert_int_equal(fr_byte_text_read(&s.model->cfg, path, L, &ev[i], &len[i]), FR_OK);
        assert_int_equal(len[i], L);
    }
    static results out;
    memset(&out, 0, sizeof out);
    fr_scheduler_config c = {.reserve_blocks = -1, .on_done = on_done, .user = &out, .kl_sample_rate = 1.0};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    for (int i = 0; i < 2; i++) {
        fr_request_spec q = {.id = (uint64_t)i, .prompt = ev[i], .n_prompt = 1, .n = 1, .max_tokens = L,
                             .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 1}, .monitor = -1,
                             .forced = ev[i] + 1, .n_forced = L - 1};
        assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    const fr_div_version *agg = fr_div_aggregates_find(fr_scheduler_divergence(sch), 0);
    assert_non_null(agg);
    assert_int_equal(agg->all.n, 2 * (L - 1));

    /* eval-kl's configuration with the session's own arithmetic: the
     * default fp4_compute is exact on the CPU and BF16 on CUDA (query and P
     * unquantized), which is eval-kl's nvfp4-kv */
    fr_eval_config *cfgs;
    int n;
    const int bf16_compute = fr_kv_cache_config_of(s.kv)->compute == FR_COMPUTE_BF16;
    assert_int_equal(fr_eval_config_list(bf16_compute ? "nvfp4-kv" : "nvfp4", 0, &cfgs, &n), FR_OK);
    int short_len[2] = {L - 1, L - 1};   /* eval-kl's positions 0 .. 381 are the distributions after */
    fr_eval_kl_params p = {.n_texts = 2, .texts = (const int *const *)ev, .lens = short_len, .configs = cfgs,
                           .n_configs = n, .gpu = cuda ? s.gpu_weights : NULL};
    fr_eval_kl_report r;
    assert_int_equal(fr_eval_kl(s.model, &p, &r), FR_OK);
    for (int i = 0; i < 2; i++) {
        const fr_sample_result *x = &out.r[i][0];
        assert_true(x->monitored);
        assert_int_equal(x->div.n, L - 1);
        const double m = fr_div_summary_mean(&x->div);
        printf("  text %d: served sample %.4f, eval-kl %s %.4f (1e-3 nats); top-1 agreement %ld/%ld\n", i, 1e3 * m,
               bf16_compute ? "nvfp4-kv" : "nvfp4", 1e3 * r.results[0].text_kl[i], x->div.top1_agree, x->div.n);
        assert_true(fabs(m / r.results[0].text_kl[i] - 1.0) <= 0.10);
    }
    fr_eval_kl_report_free(&r);
    free(cfgs);
    free_results(&out);
    fr_scheduler_destroy(&sch);
    free(ev[0]);
    free(ev[1]);
    fr_session_close(&s);
}

int main(void)
{
    openblas_set_num_threads(1);   /* one-token steps: threads only add synchronization */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_monitoring),
        cmocka_unit_test(test_forced_tokens),
        cmocka_unit_test(test_tq6_monitor_equals_eval_kl),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
