/* The scheduler's per-token callback (rollout/engine/scheduler.h, on_token), which
 * the trainer bridge streams from: every token of a sample is reported once,
 * in order, before the sample's end, and the reports equal the result's
 * tokens and log-probs, through preemption by recompute and abort. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "test_util.h"

#define NREQ 12
#define NS 2
#define MAXT 60

typedef struct {
    int tok[NREQ][NS][MAXT];
    float lp[NREQ][NS][MAXT];
    int n[NREQ][NS];
    int ended[NREQ][NS];
    int bad;                 /* a report out of order, repeated, or after the end */
    int ends;
} record;

static void on_token(void *user, uint64_t id, int sample, int index, int token, float logprob)
{
    record *r = user;
    if (id >= NREQ || sample < 0 || sample >= NS || index != r->n[id][sample] || index >= MAXT ||
        r->ended[id][sample]) {
        r->bad++;
        return;
    }
    r->tok[id][sample][index] = token;
    r->lp[id][sample][index] = logprob;
    r->n[id][sample]++;
}

static void on_done(void *user, const fr_sample_result *res)
{
    record *r = user;
    uint64_t id = res->request_id;
    assert_true(id < NREQ && res->sample >= 0 && res->sample < NS);
    assert_int_equal(r->ended[id][res->sample], 0);
    r->ended[id][res->sample] = 1;
    r->ends++;
    assert_int_equal(res->n_tokens, r->n[id][res->sample]);
    if (res->n_tokens) {
        assert_memory_equal(res->tokens, r->tok[id][res->sample], sizeof(int) * (size_t)res->n_tokens);
        assert_memory_equal(res->logprobs, r->lp[id][res->sample], sizeof(float) * (size_t)res->n_tokens);
    }
}

/* A tight cache (preemptions) and NREQ requests of NS samples. */
static void run(int abort_after_steps, long long *preemptions, record *rec)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, NULL, FR_KV_F32);
    o.chunk = 64;
    fr_session s;
    assert_int_equal(fr_session_open(&o, 6, 8, &s), FR_OK);
    fr_scheduler_config c = {.max_seqs = 8, .chunk = 64, .reserve_blocks = 1, .on_done = on_done, .user = rec,
                             .on_token = on_token};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    fr_test_rng rng = {.s = 7};
    for (int i = 0; i < NREQ; i++) {
        int prompt[140];
        int n = 20 + (int)(fr_test_u64(&rng) % 110);
        prompt[0] = 256;
        for (int k = 1; k < n; k++) prompt[k] = (int)(fr_test_u64(&rng) % 256);
        fr_request_spec r = {.id = (uint64_t)i, .group = 0, .prompt = prompt, .n_prompt = n, .n = NS,
                             .params = {.temperature = 1.0f, .top_p = 1.0f, .seed = 3}, .max_tokens = MAXT};
        assert_int_equal(fr_scheduler_submit(sch, &r), FR_OK);
    }
    for (int step = 0; !fr_scheduler_idle(sch); step++) {
        if (abort_after_steps && step == abort_after_steps) {
            int ended = 0;
            assert_int_equal(fr_scheduler_abort_all(sch, &ended), FR_OK);
            assert_true(ended > 0);
            break;
        }
        assert_int_equal(fr_scheduler_step(sch), FR_OK);
    }
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    *preemptions = st.preemptions;
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
    assert_int_equal(rec->bad, 0);
    assert_int_equal(rec->ends, NREQ * NS);
}

static void test_tokens_reported_once_through_preemption(void **state)
{
    (void)state;
    record *rec = calloc(1, sizeof *rec);
    long long preemptions = 0;
    run(0, &preemptions, rec);
    assert_true(preemptions > 0);   /* the recompute path ran and reported nothing twice */
    for (int i = 0; i < NREQ; i++)
        for (int k = 0; k < NS; k++) assert_true(rec->n[i][k] >= 1);
    free(rec);
}

static void test_tokens_then_abort(void **state)
{
    (void)state;
    record *rec = calloc(1, sizeof *rec);
    long long preemptions = 0;
    run(40, &preemptions, rec);
    int partial = 0;
    for (int i = 0; i < NREQ; i++)
        for (int k = 0; k < NS; k++) partial += rec->n[i][k] < MAXT;
    assert_true(partial > 0);
    free(rec);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_tokens_reported_once_through_preemption),
             cmocka_unit_test(test_tokens_then_abort))
