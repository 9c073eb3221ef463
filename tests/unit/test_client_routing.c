/* The C client's routing of results by request (trainer_bridge/client/client.h)
 * against the bridge server running in this process on loopback, over a CPU
 * session of synthetic:tiny: threads on one client each get exactly the
 * samples of their own requests; an abort delivers every sample it ended,
 * once, with what it made, to the reader that waits for it (and the samples
 * still count as open until read); a discarded request's results never
 * reach a reader; calls from several threads each get their own reply. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "trainer_bridge/client/client.h"

enum { TIMEOUT_MS = 60000, THREADS = 4, PER_THREAD = 3, N = 2, LONG = 3000 };

static fr_client *connect_to(fr_test_server *l)
{
    fr_client *c;
    assert_int_equal(fr_client_new(fr_test_server_endpoint(l), &c), FR_OK);
    fr_client_set_timeout(c, TIMEOUT_MS);
    return c;
}

/* A generate of prompt {256, a, b}, n samples, max_tokens (0: the server's). */
static fr_msg_generate request(uint64_t id, int *prompt, int a, int b, int n, int max_tokens)
{
    prompt[0] = 256;
    prompt[1] = a;
    prompt[2] = b;
    return (fr_msg_generate){.request_id = id, .prompt = prompt, .n_prompt = 3, .n = n, .monitor_divergence = -1,
                             .has_max_tokens = max_tokens > 0, .max_tokens = max_tokens,
                             .has_stop_token_ids = 1};
}

/* ---- threads on one client ---------------------------------------------------- */

typedef struct {
    fr_client *c;
    int t;
    int got[PER_THREAD][N];   /* samples seen, by request and index */
    int foreign;              /* samples of requests this thread did not send */
    fr_status st;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    uint64_t ids[PER_THREAD];
    int prompts[PER_THREAD][3];
    for (int k = 0; k < PER_THREAD && !w->st; k++) {
        ids[k] = (uint64_t)(100 * (w->t + 1) + k);
        fr_msg_generate g = request(ids[k], prompts[k], w->t, k, N, 0);
        w->st = fr_client_generate_owned(w->c, &g);
    }
    while (!w->st && fr_client_open_samples_of(w->c, ids, PER_THREAD) > 0) {
        fr_client_event ev;
        if ((w->st = fr_client_wait_event(w->c, ids, PER_THREAD, 1, TIMEOUT_MS, &ev))) break;
        if (ev.kind == FR_CLIENT_EVENT_NONE || ev.kind == FR_CLIENT_EVENT_ERROR) w->st = FR_EIO;
        int k = (int)(ev.request_id - ids[0]);
        if (ev.request_id < ids[0] || k >= PER_THREAD) w->foreign++;
        else if (ev.kind == FR_CLIENT_EVENT_SAMPLE && ev.sample->sample >= 0 && ev.sample->sample < N)
            w->got[k][ev.sample->sample]++;
        fr_client_event_free(&ev);
    }
    return NULL;
}

static void test_threads_get_their_own(void **state)
{
    fr_test_server *l = *state;
    fr_client *c = connect_to(l);
    /* a reader of every request that no reader owns: it must see none of the threads' */
    int prompt[3];
    fr_msg_generate loose = request(7, prompt, 9, 9, 1, 0);
    assert_int_equal(fr_client_generate(c, &loose), FR_OK);
    worker w[THREADS];
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++) {
        w[t] = (worker){.c = c, .t = t};
        assert_int_equal(pthread_create(&th[t], NULL, work, &w[t]), 0);
    }
    fr_client_sample *s = NULL;
    int got = 0;
    assert_int_equal(fr_client_next_sample(c, TIMEOUT_MS, &s, &got), FR_OK);
    assert_int_equal(got, 1);
    assert_true(s->request_id == 7);
    fr_client_sample_free(&s);
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(w[t].st, FR_OK);
        assert_int_equal(w[t].foreign, 0);
        for (int k = 0; k < PER_THREAD; k++)
            for (int i = 0; i < N; i++) assert_int_equal(w[t].got[k][i], 1);
    }
    assert_int_equal(fr_client_open_samples(c), 0);
    fr_client_destroy(&c);
}

/* ---- aborts keep what was made ------------------------------------------------ */

/* Waits until request id has streamed a token (taken by this reader). */
static void first_delta(fr_client *c, uint64_t id)
{
    fr_client_event ev;
    assert_int_equal(fr_client_wait_event(c, &id, 1, 1, TIMEOUT_MS, &ev), FR_OK);
    const int kind = ev.kind;
    fr_client_event_free(&ev);
    assert_int_equal(kind, FR_CLIENT_EVENT_DELTA);
}

static void check_aborted(const fr_client_sample *s)
{
    assert_string_equal(s->finish_reason, "abort");
    assert_true(s->n_tokens >= 1 && s->token_ids && s->logprobs && s->weight_versions);
    for (int i = 0; i < s->n_tokens; i++) assert_true(s->logprobs[i] <= 0 && s->weight_versions[i] == 0);
    assert_int_equal(s->top_k, 2);
    assert_non_null(s->top_logprobs);
}

static void test_abort_keeps_what_was_made(void **state)
{
    fr_test_server *l = *state;
    fr_client *c = connect_to(l);
    int prompt[3];
    fr_msg_generate g = request(1, prompt, 4, 5, N, LONG);
    g.logprobs = 2;
    assert_int_equal(fr_client_generate(c, &g), FR_OK);
    first_delta(c, 1);
    int ended = -1, missing = -1;
    assert_int_equal(fr_client_abort(c, NULL, 0, &ended, &missing), FR_OK);
    assert_int_equal(ended, N);
    /* the dones came before the reply; they wait for their reader */
    assert_int_equal(fr_client_open_samples(c), N);
    for (int i = 0; i < N; i++) {
        fr_client_sample *s = NULL;
        int got = 0;
        assert_int_equal(fr_client_next_sample(c, 0, &s, &got), FR_OK);
        assert_int_equal(got, 1);
        check_aborted(s);
        fr_client_sample_free(&s);
    }
    assert_int_equal(fr_client_open_samples(c), 0);

    /* the same for a request with a reader of its own, ended by a pause */
    g = request(2, prompt, 6, 7, N, LONG);
    g.logprobs = 2;
    assert_int_equal(fr_client_generate_owned(c, &g), FR_OK);
    uint64_t id = 2;
    first_delta(c, id);
    fr_msg_pause_reply p;
    assert_int_equal(fr_client_pause(c, FR_PAUSE_ABORT, &p), FR_OK);
    assert_int_equal(p.aborted, N);
    int seen[N] = {0};
    while (fr_client_open_samples_of(c, &id, 1) > 0) {
        fr_client_event ev;
        assert_int_equal(fr_client_wait_event(c, &id, 1, 0, 0, &ev), FR_OK);
        assert_int_equal(ev.kind, FR_CLIENT_EVENT_SAMPLE);
        check_aborted(ev.sample);
        seen[ev.sample->sample]++;
        fr_client_event_free(&ev);
    }
    for (int i = 0; i < N; i++) assert_int_equal(seen[i], 1);
    assert_int_equal(fr_client_resume(c, NULL), FR_OK);
    fr_client_destroy(&c);
}

/* ---- discard ------------------------------------------------------------------- */

static void test_discard_drops_everything(void **state)
{
    fr_test_server *l = *state;
    fr_client *c = connect_to(l);
    int prompt[3];
    fr_msg_generate g = request(3, prompt, 1, 2, N, 64);
    assert_int_equal(fr_client_generate(c, &g), FR_OK);
    uint64_t id = 3;
    assert_int_equal(fr_client_discard(c, &id, 1), FR_OK);
    assert_int_equal(fr_client_open_samples(c), 0);
    /* nothing of it reaches any reader while the server finishes it (the
     * stats reply comes after its dones) */
    fr_msg_stats_reply s = {.open_requests = 1};
    for (int turn = 0; turn < 300 && s.open_requests > 0; turn++) {
        fr_msg m;
        int got = 1;
        assert_int_equal(fr_client_next(c, 200, &m, &got), FR_OK);
        assert_int_equal(got, 0);
        assert_int_equal(fr_client_stats(c, &s), FR_OK);
    }
    assert_int_equal(s.open_requests, 0);
    fr_msg m;
    int got = 1;
    assert_int_equal(fr_client_next(c, 200, &m, &got), FR_OK);
    assert_int_equal(got, 0);
    fr_client_destroy(&c);
}

/* ---- calls from several threads -------------------------------------------------- */

typedef struct {
    fr_client *c;
    int hello;
    int bad;
} caller;

static void *call_many(void *arg)
{
    caller *k = arg;
    for (int i = 0; i < 20; i++) {
        if (k->hello) {
            fr_msg_hello_reply h;
            if (fr_client_hello(k->c, "t", &h) || h.vocab_size != 272) k->bad++;
        } else {
            fr_msg_stats_reply s;
            if (fr_client_stats(k->c, &s) || strcmp(s.state, "running") != 0) k->bad++;
        }
    }
    return NULL;
}

static void test_calls_from_threads(void **state)
{
    fr_test_server *l = *state;
    fr_client *c = connect_to(l);
    caller k[THREADS];
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++) {
        k[t] = (caller){.c = c, .hello = t % 2};
        assert_int_equal(pthread_create(&th[t], NULL, call_many, &k[t]), 0);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(k[t].bad, 0);
    }
    fr_client_destroy(&c);
}

static int setup(void **state)
{
    fr_test_server *l = NULL;
    if (fr_test_server_start("synthetic:tiny", 64, 8, 8, &l)) return -1;
    *state = l;
    return 0;
}

static int teardown(void **state)
{
    fr_test_server *l = *state;
    return fr_test_server_stop(&l) == FR_OK ? 0 : -1;
}

FR_TEST_MAIN(setup, teardown,
             cmocka_unit_test(test_threads_get_their_own),
             cmocka_unit_test(test_abort_keeps_what_was_made),
             cmocka_unit_test(test_discard_drops_everything),
             cmocka_unit_test(test_calls_from_threads))
