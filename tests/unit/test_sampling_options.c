/* The sampling options trainers ask for, through the scheduler on the CPU
 * backend (synthetic:tiny, deterministic mode): min_tokens bars the stop ids
 * until that many tokens were drawn; top log-probs are the k largest logits'
 * full-vocabulary log-probs and change no draw; prompt log-probs equal the
 * log-softmax of a whole-prompt prefill's logits, come with the request's
 * first sample only, and do not depend on the prefill chunk or on a request
 * queued in several prefills; bad values are refused with the field named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "test_util.h"

enum { MAXN = 8, MAXT = 40, K = 5 };
static const int PROMPT[] = {256, 40, 41, 42, 43, 10, 11, 12, 13, 99, 100, 101, 7};
enum { NP = (int)(sizeof PROMPT / sizeof PROMPT[0]) };

typedef struct {
    int got[MAXN], n[MAXN], top_n[MAXN], n_plp[MAXN];
    fr_finish_reason why[MAXN];
    int tok[MAXN][MAXT];
    float lp[MAXN][MAXT];
    int top_ids[MAXN][MAXT * K];
    float top_lps[MAXN][MAXT * K];
    float plp[MAXN][NP];
} results;

static void on_done(void *user, const fr_sample_result *r)
{
    results *o = user;
    assert_true(r->sample >= 0 && r->sample < MAXN && r->n_tokens <= MAXT && r->top_n <= K);
    const int s = r->sample;
    o->got[s] = 1;
    o->n[s] = r->n_tokens;
    o->why[s] = r->finish;
    o->top_n[s] = r->top_n;
    memcpy(o->tok[s], r->tokens, sizeof(int) * (size_t)r->n_tokens);
    memcpy(o->lp[s], r->logprobs, sizeof(float) * (size_t)r->n_tokens);
    if (r->top_n) {
        memcpy(o->top_ids[s], r->top_ids, sizeof(int) * (size_t)(r->n_tokens * r->top_n));
        memcpy(o->top_lps[s], r->top_logprobs, sizeof(float) * (size_t)(r->n_tokens * r->top_n));
    }
    o->n_plp[s] = r->prompt_logprobs ? r->n_prompt_logprobs : -1;
    if (r->prompt_logprobs) memcpy(o->plp[s], r->prompt_logprobs, sizeof(float) * (size_t)r->n_prompt_logprobs);
}

static fr_session open_session(void)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, "synthetic:tiny", FR_KV_BF16);
    o.deterministic = 1;
    fr_session s;
    if (fr_session_open(&o, 64, 8, &s)) fail_msg("%s", fr_last_error());
    return s;
}

/* Runs spec (its prompt PROMPT) alone; results by sample index. */
static void run(fr_session *s, fr_request_spec spec, int max_seqs, int chunk, results *out)
{
    memset(out, 0, sizeof *out);
    fr_scheduler_config c = {.max_seqs = max_seqs, .chunk = chunk, .reserve_blocks = -1, .on_done = on_done,
                             .user = out};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(s, &c, &sch), FR_OK);
    spec.prompt = PROMPT;
    spec.n_prompt = NP;
    assert_int_equal(fr_scheduler_submit(sch, &spec), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_destroy(&sch);
    for (int i = 0; i < spec.n; i++) assert_true(out->got[i]);
}

static fr_request_spec base(float temperature, int n, int max_tokens)
{
    return (fr_request_spec){.id = 1, .n = n, .max_tokens = max_tokens, .monitor = 0,
                             .params = {.temperature = temperature, .top_k = 0, .top_p = 1.0f, .seed = 1234}};
}

static void test_top_logprobs(void **state)
{
    (void)state;
    fr_session s = open_session();
    static results plain, top;
    fr_request_spec q = base(1.0f, 3, 24);
    run(&s, q, 8, 512, &plain);
    q.top_logprobs = K;
    run(&s, q, 8, 512, &top);
    for (int i = 0; i < 3; i++) {
        /* drawn on the host with the extras: the same tokens and log-probs */
        assert_int_equal(top.n[i], plain.n[i]);
        assert_memory_equal(top.tok[i], plain.tok[i], sizeof(int) * (size_t)plain.n[i]);
        assert_memory_equal(top.lp[i], plain.lp[i], sizeof(float) * (size_t)plain.n[i]);
        assert_int_equal(top.top_n[i], K);
        assert_int_equal(plain.top_n[i], 0);
        for (int t = 0; t < top.n[i]; t++) {
            const int *ids = &top.top_ids[i][t * K];
            const float *lps = &top.top_lps[i][t * K];
            for (int k = 0; k < K; k++) {
                assert_true(ids[k] >= 0 && ids[k] < s.model->cfg.vocab_size && lps[k] <= 0.0f);
                if (k) assert_true(lps[k] <= lps[k - 1]);
                if (ids[k] == top.tok[i][t]) assert_memory_equal(&lps[k], &top.lp[i][t], sizeof(float));
            }
            assert_true(top.lp[i][t] <= lps[0]);
        }
    }
    /* Greedy with top 1: the top token is the one drawn, with its log-prob. */
    q = base(0.0f, 1, 24);
    q.top_logprobs = 1;
    run(&s, q, 8, 512, &top);
    for (int t = 0; t < top.n[0]; t++) {
        assert_int_equal(top.top_ids[0][t], top.tok[0][t]);
        assert_memory_equal(&top.top_lps[0][t], &top.lp[0][t], sizeof(float));
    }
    fr_session_close(&s);
}

static int in(const int *v, int n, int x)
{
    for (int i = 0; i < n; i++)
        if (v[i] == x) return 1;
    return 0;
}

static void test_min_tokens(void **state)
{
    (void)state;
    fr_session s = open_session();
    static results free_run, got;
    /* Greedy without stop ids, then with its first token as the stop id. */
    fr_request_spec q = base(0.0f, 1, 12);
    run(&s, q, 8, 512, &free_run);
    int stop[1] = {free_run.tok[0][0]};
    q.stop_ids = stop;
    q.n_stop = 1;
    run(&s, q, 8, 512, &got);
    assert_int_equal(got.n[0], 1);
    assert_int_equal(got.why[0], FR_FINISH_STOP);
    q.min_tokens = 4;
    run(&s, q, 8, 512, &got);
    assert_true(got.n[0] >= 4);
    for (int t = 0; t < 4; t++) assert_true(got.tok[0][t] != stop[0]);
    assert_true(got.tok[0][0] != free_run.tok[0][0]);   /* barred: the next best */
    /* Sampling: a third of the vocabulary barred for 16 tokens, n 4. */
    int many[90];
    for (int i = 0; i < 90; i++) many[i] = 3 * i;
    q = base(1.0f, 4, 30);
    q.stop_ids = many;
    q.n_stop = 90;
    q.min_tokens = 16;
    run(&s, q, 8, 512, &got);
    int stopped = 0;
    for (int i = 0; i < 4; i++) {
        assert_true(got.n[i] >= 16);
        for (int t = 0; t < 16; t++) assert_false(in(many, 90, got.tok[i][t]));
        stopped += got.why[i] == FR_FINISH_STOP;
    }
    assert_true(stopped > 0);   /* after min_tokens the stop ids end samples again */
    fr_session_close(&s);
}

static void test_prompt_logprobs(void **state)
{
    (void)state;
    fr_session s = open_session();
    const int V = s.model->cfg.vocab_size;
    /* The reference: one whole-prompt prefill, every position's logits. */
    float *all = malloc(sizeof(float) * (size_t)V * NP), *lsm = malloc(sizeof(float) * (size_t)V), want[NP];
    assert_non_null(all);
    assert_non_null(lsm);
    int seq;
    assert_int_equal(fr_session_prefill(&s, PROMPT, NP, 512, &seq, NULL, all), FR_OK);
    fr_kv_seq_free(s.kv, seq);
    for (int i = 0; i + 1 < NP; i++) {
        assert_int_equal(fr_log_softmax(all + (size_t)i * V, V, 0.7f, lsm), FR_OK);
        want[i] = lsm[PROMPT[i + 1]];
    }
    static results got;
    static const int chunks[] = {512, 3};
    for (int c = 0; c < 2; c++) {
        /* 5 samples on 2 slots: three prefills; sample 0 alone carries them. */
        fr_request_spec q = base(0.7f, 5, 6);
        q.prompt_logprobs = 1;
        run(&s, q, 2, chunks[c], &got);
        for (int i = 0; i < 5; i++) assert_int_equal(got.n_plp[i], i == 0 ? NP - 1 : -1);
        assert_memory_equal(got.plp[0], want, sizeof(float) * (NP - 1));
    }
    free(all);
    free(lsm);
    fr_session_close(&s);
}

static void test_refused(void **state)
{
    (void)state;
    fr_session s = open_session();
    fr_scheduler_config c = {.chunk = 512, .reserve_blocks = -1};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    static const struct {
        int min_tokens, top, plp;
        const char *needle;
    } bad[] = {
        {-1, 0, 0, "min_tokens must be in [0, max_tokens = 8] (got -1)"},
        {9, 0, 0, "min_tokens must be in [0, max_tokens = 8] (got 9)"},
        {0, 21, 0, "logprobs (top log-probs per token) must be in [0, 20] (got 21)"},
        {0, -1, 0, "logprobs (top log-probs per token) must be in [0, 20] (got -1)"},
        {0, 0, 2, "prompt_logprobs must be 0 or 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fr_request_spec q = base(1.0f, 1, 8);
        q.prompt = PROMPT;
        q.n_prompt = NP;
        q.min_tokens = bad[i].min_tokens;
        q.top_logprobs = bad[i].top;
        q.prompt_logprobs = bad[i].plp;
        assert_int_equal(fr_scheduler_submit(sch, &q), FR_EINVAL);
        if (!strstr(fr_last_error(), bad[i].needle)) fail_msg("message '%s' lacks '%s'", fr_last_error(), bad[i].needle);
    }
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_top_logprobs),
             cmocka_unit_test(test_min_tokens),
             cmocka_unit_test(test_prompt_logprobs),
             cmocka_unit_test(test_refused))
