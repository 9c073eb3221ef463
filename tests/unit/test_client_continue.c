/* The C client's side of continued samples and pause modes
 * (trainer_bridge/client/client.h: fr_client_continuation,
 * fr_client_pause_ex, fr_client_resume_ex) against the bridge server in this
 * process, deterministic, over synthetic:tiny: samples ended by an abort,
 * continued, and the continuation ended and continued again, make the
 * samples an uninterrupted request makes, bitwise (tokens, log-probs, top
 * log-probs), each part starting where the one before ended; a keep pause
 * freezes the samples and resume with recompute lets them finish as they
 * would have. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"
#include "trainer_bridge/client/client.h"

enum { TIMEOUT_MS = 60000, N = 2, MAX_TOKENS = 1500, TOP = 2 };

static int prompt[] = {256, 5, 6, 7, 8};

static fr_client *connect_to(fr_test_server *l)
{
    fr_client *c;
    assert_int_equal(fr_client_new(fr_test_server_endpoint(l), &c), FR_OK);
    fr_client_set_timeout(c, TIMEOUT_MS);
    return c;
}

static fr_msg_generate request(uint64_t id, int n, int first)
{
    return (fr_msg_generate){.request_id = id, .prompt = prompt, .n_prompt = 5, .n = n, .first_sample = first,
                             .monitor_divergence = -1, .has_temperature = 1, .temperature = 1.0,
                             .has_max_tokens = 1, .max_tokens = MAX_TOKENS, .has_stop_token_ids = 1,
                             .has_seed = 1, .seed = 77, .logprobs = TOP};
}

/* Reads request id's events until every one of its n samples drew a token
 * (then aborts it, when abort is set) and ended; out[k] gets sample k - first. */
static void run(fr_client *c, uint64_t id, int n, int first, int abort, fr_client_sample **out)
{
    int started = 0, ended = 0, seen[8] = {0};
    while (ended < n) {
        fr_client_event ev;
        assert_int_equal(fr_client_wait_event(c, &id, 1, 1, TIMEOUT_MS, &ev), FR_OK);
        assert_true(ev.kind == FR_CLIENT_EVENT_DELTA || ev.kind == FR_CLIENT_EVENT_SAMPLE);
        if (ev.kind == FR_CLIENT_EVENT_DELTA && !seen[ev.delta.sample - first]++ && ++started == n && abort)
            assert_int_equal(fr_client_abort(c, &id, 1, NULL, NULL), FR_OK);
        if (ev.kind == FR_CLIENT_EVENT_SAMPLE) {
            out[ev.sample->sample - first] = ev.sample;
            ev.sample = NULL;
            ended++;
        }
        fr_client_event_free(&ev);
    }
}

/* Appends part's tokens, log-probs and top log-probs to whole's. */
static void append(fr_client_sample *whole, const fr_client_sample *part)
{
    const int n = whole->n_tokens + part->n_tokens;
    assert_int_equal(part->start, whole->n_tokens);
    whole->token_ids = realloc(whole->token_ids, sizeof(int) * (size_t)n);
    whole->logprobs = realloc(whole->logprobs, sizeof(float) * (size_t)n);
    whole->top_token_ids = realloc(whole->top_token_ids, sizeof(int) * (size_t)n * TOP);
    whole->top_logprobs = realloc(whole->top_logprobs, sizeof(float) * (size_t)n * TOP);
    assert_true(whole->token_ids && whole->logprobs && whole->top_token_ids && whole->top_logprobs);
    assert_int_equal(part->top_k, TOP);
    memcpy(whole->token_ids + whole->n_tokens, part->token_ids, sizeof(int) * (size_t)part->n_tokens);
    memcpy(whole->logprobs + whole->n_tokens, part->logprobs, sizeof(float) * (size_t)part->n_tokens);
    memcpy(whole->top_token_ids + (size_t)whole->n_tokens * TOP, part->top_token_ids,
           sizeof(int) * (size_t)part->n_tokens * TOP);
    memcpy(whole->top_logprobs + (size_t)whole->n_tokens * TOP, part->top_logprobs,
           sizeof(float) * (size_t)part->n_tokens * TOP);
    whole->n_tokens = n;
}

/* Sample `first` of g's request, continued until it ends: each part after
 * an abort continued with fr_client_continuation, twice aborted at most. */
static fr_client_sample *continue_to_end(fr_client *c, const fr_msg_generate *g, fr_client_sample *part,
                                         uint64_t *next_id)
{
    fr_client_sample *whole = calloc(1, sizeof *whole);
    assert_non_null(whole);
    whole->sample = part->sample;
    fr_msg_generate cur = *g;   /* the request the part came from (its arrays stay the caller's) */
    fr_msg held;
    fr_msg_init(&held, FR_MSG_NONE);
    for (int round = 0; part; round++) {
        append(whole, part);
        const int done = strcmp(part->finish_reason, "abort") != 0;
        fr_msg m;
        if (!done) assert_int_equal(fr_client_continuation(&cur, part, (*next_id)++, &m), FR_OK);
        fr_client_sample_free(&part);
        if (done) break;
        assert_int_equal(m.u.generate.n, 1);
        assert_int_equal(m.u.generate.n_continue_tokens, whole->n_tokens);
        assert_memory_equal(m.u.generate.continue_tokens, whole->token_ids, sizeof(int) * (size_t)whole->n_tokens);
        assert_int_equal(fr_client_generate_owned(c, &m.u.generate), FR_OK);
        fr_client_sample *got[1] = {NULL};
        run(c, m.u.generate.request_id, 1, whole->sample, round == 0, got);
        fr_msg_free(&held);
        held = m;   /* the next continuation's request: its arrays live while it does */
        cur = held.u.generate;
        part = got[0];
    }
    fr_msg_free(&held);
    snprintf(whole->finish_reason, sizeof whole->finish_reason, "length");
    return whole;
}

static void test_continue_after_abort(void **state)
{
    fr_client *c = connect_to(*state);
    fr_msg_generate g = request(1, N, 0);
    assert_int_equal(fr_client_generate_owned(c, &g), FR_OK);
    fr_client_sample *parts[N] = {NULL}, *wholes[N], *want[N] = {NULL};
    run(c, 1, N, 0, 1, parts);
    uint64_t next_id = 10;
    for (int k = 0; k < N; k++) {
        assert_string_equal(parts[k]->finish_reason, "abort");
        assert_int_equal(parts[k]->start, 0);
        assert_true(parts[k]->has_seed && parts[k]->seed == 77);
        wholes[k] = continue_to_end(c, &g, parts[k], &next_id);
        fr_msg_generate alone = request(100 + (uint64_t)k, 1, k);
        assert_int_equal(fr_client_generate_owned(c, &alone), FR_OK);
        run(c, alone.request_id, 1, k, 0, &want[k]);
        assert_int_equal(wholes[k]->n_tokens, MAX_TOKENS);
        assert_int_equal(want[k]->n_tokens, MAX_TOKENS);
        assert_memory_equal(wholes[k]->token_ids, want[k]->token_ids, sizeof(int) * MAX_TOKENS);
        assert_memory_equal(wholes[k]->logprobs, want[k]->logprobs, sizeof(float) * MAX_TOKENS);
        assert_memory_equal(wholes[k]->top_token_ids, want[k]->top_token_ids, sizeof(int) * MAX_TOKENS * TOP);
        assert_memory_equal(wholes[k]->top_logprobs, want[k]->top_logprobs, sizeof(float) * MAX_TOKENS * TOP);
        fr_client_sample_free(&wholes[k]);
        fr_client_sample_free(&want[k]);
    }
    /* a sample without its request's continued tokens cannot be continued */
    fr_client_sample odd = {.sample = 0, .start = 3, .has_seed = 1, .seed = 77};
    fr_msg m;
    assert_int_equal(fr_client_continuation(&g, &odd, 50, &m), FR_EINVAL);
    /* a continuation asks for what its request asked, routed experts included */
    fr_client_sample first = {.sample = 0, .has_seed = 1, .seed = 77};
    fr_msg_generate routed = g;
    routed.return_routed_experts = 1;
    assert_int_equal(fr_client_continuation(&routed, &first, 51, &m), FR_OK);
    assert_int_equal(m.u.generate.return_routed_experts, 1);
    fr_msg_free(&m);
    /* and its text: a prompt given as text and the stop strings are the
     * continuation's own copies (freeing both requests frees each once) */
    fr_msg texted;
    fr_msg_init(&texted, FR_MSG_GENERATE);
    texted.u.generate = g;
    texted.u.generate.prompt = NULL;
    texted.u.generate.n_prompt = 0;
    texted.u.generate.stop_token_ids = NULL;
    texted.u.generate.has_stop_token_ids = 0;
    texted.u.generate.n_stop_token_ids = 0;
    texted.u.generate.prompt_text = strdup("def f(x):");
    texted.u.generate.prompt_text_len = strlen("def f(x):");
    texted.u.generate.stop = calloc(1, sizeof(char *));
    texted.u.generate.stop[0] = strdup("\n\n");
    texted.u.generate.n_stop = 1;
    assert_int_equal(fr_client_continuation(&texted.u.generate, &first, 52, &m), FR_OK);
    assert_null(m.u.generate.prompt);
    assert_ptr_not_equal(m.u.generate.prompt_text, texted.u.generate.prompt_text);
    assert_int_equal(m.u.generate.prompt_text_len, texted.u.generate.prompt_text_len);
    assert_memory_equal(m.u.generate.prompt_text, "def f(x):", m.u.generate.prompt_text_len);
    assert_int_equal(m.u.generate.n_stop, 1);
    assert_ptr_not_equal(m.u.generate.stop, texted.u.generate.stop);
    assert_string_equal(m.u.generate.stop[0], "\n\n");
    fr_msg_free(&m);
    fr_msg_free(&texted);
    fr_client_destroy(&c);
}

/* A keep pause freezes the samples (nothing drawn while it lasts); resume
 * with recompute lets them finish as if never stopped. */
static void test_pause_keep(void **state)
{
    fr_client *c = connect_to(*state);
    fr_msg_generate g = request(2, 1, 1);
    assert_int_equal(fr_client_generate_owned(c, &g), FR_OK);
    fr_client_event ev;
    assert_int_equal(fr_client_wait_event(c, &g.request_id, 1, 1, TIMEOUT_MS, &ev), FR_OK);
    assert_int_equal(ev.kind, FR_CLIENT_EVENT_DELTA);
    fr_client_event_free(&ev);
    fr_msg_pause_reply pr;
    assert_int_equal(fr_client_pause_ex(c, FR_PAUSE_KEEP, 0, &pr), FR_OK);
    assert_int_equal(pr.mode, FR_PAUSE_KEEP);
    fr_msg_stats_reply a, b;
    assert_int_equal(fr_client_stats(c, &a), FR_OK);
    usleep(300 * 1000);
    assert_int_equal(fr_client_stats(c, &b), FR_OK);
    assert_string_equal(b.state, "paused");
    assert_true(a.tokens_generated == b.tokens_generated && b.running == 1);
    fr_msg_resume_reply rr;
    assert_int_equal(fr_client_resume_ex(c, 1, &rr), FR_OK);
    fr_client_sample *s = NULL, *want = NULL;
    run(c, 2, 1, 1, 0, &s);
    fr_msg_generate alone = request(3, 1, 1);
    assert_int_equal(fr_client_generate_owned(c, &alone), FR_OK);
    run(c, 3, 1, 1, 0, &want);
    assert_string_equal(s->finish_reason, "length");
    assert_int_equal(s->n_tokens, want->n_tokens);
    assert_memory_equal(s->token_ids, want->token_ids, sizeof(int) * (size_t)s->n_tokens);
    assert_memory_equal(s->logprobs, want->logprobs, sizeof(float) * (size_t)s->n_tokens);
    fr_client_sample_free(&s);
    fr_client_sample_free(&want);
    fr_client_destroy(&c);
}

static int setup(void **state)
{
    fr_test_server *l = NULL;
    if (fr_test_server_start_det("synthetic:tiny", 128, 4, 64, 1, &l)) return -1;
    *state = l;
    return 0;
}

static int teardown(void **state)
{
    fr_test_server *l = *state;
    return fr_test_server_stop(&l) == FR_OK ? 0 : -1;
}

FR_TEST_MAIN(setup, teardown,
             cmocka_unit_test(test_continue_after_abort),
             cmocka_unit_test(test_pause_keep))
