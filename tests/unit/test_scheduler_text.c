/* The scheduler's text and stop strings (rollout/engine/scheduler.h,
 * docs/sampling.md "Stop strings"): a sample's text equals its tokens
 * decoded, the on_text pieces never split a character and join into a
 * prefix of it; a stop string taken from a first run's text (spanning
 * tokens) ends the replayed sample at the token that completes it, with
 * the tokens of the first run up to there and the text before it (or
 * through it, with include); min_tokens passes over stop strings; aborts
 * and preemption keep the text whole; a request for text without a
 * tokenizer is refused. On synthetic:tiny with the byte-level tokenizer, and
 * on synthetic:tiny-qwen3 with Qwen3's when ../shared/tokenizers holds it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/scheduler.h"
#include "tests/unit/tokenizer_util.h"
#include "test_util.h"

#define MAXR 4
#define MAXT 80

typedef struct {
    const fr_tokenizer *tok;
    char streamed[MAXR][4096];   /* on_text pieces joined, per request (sample 0) */
    size_t n_streamed[MAXR];
    int last_index[MAXR];
    fr_sample_result res[MAXR];  /* sample 0's result, kept */
    int got[MAXR];
    long long preemptions;
} record;

/* 1 when s[0, n) is well-formed UTF-8. */
static int utf8_ok(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > n) return 0;
        for (size_t j = 1; j < k; j++)
            if (((unsigned char)s[i + j] & 0xC0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

static void on_text(void *user, uint64_t id, int sample, int index, const char *text, size_t len)
{
    record *r = user;
    assert_true(id < MAXR);
    if (sample != 0) return;
    assert_true(len > 0);
    assert_true(utf8_ok(text, len));   /* never half a character */
    assert_true(index >= r->last_index[id]);
    r->last_index[id] = index;
    assert_true(r->n_streamed[id] + len < sizeof r->streamed[id]);
    memcpy(r->streamed[id] + r->n_streamed[id], text, len);
    r->n_streamed[id] += len;
}

static void on_done(void *user, const fr_sample_result *res)
{
    record *r = user;
    assert_true(res->request_id < MAXR);
    if (res->sample != 0) return;
    fr_sample_result *k = &r->res[res->request_id];
    fr_test_keep_result(k, res);
    r->got[res->request_id] = 1;
}

static void record_free(record *r)
{
    for (int i = 0; i < MAXR; i++) fr_sample_result_free(&r->res[i]);
}

typedef struct {
    const char *model;
    int blocks;               /* KV blocks (few: preemption) */
    int abort_after;          /* steps, 0: run to the end */
    int deterministic;        /* continuations: bitwise the uninterrupted sample */
} run_opts;

/* Runs the specs (ids 0..n-1) to their end on a fresh session; sample 0's
 * results land in rec. */
static void run(const run_opts *ro, const fr_tokenizer *tok, fr_request_spec *specs, int n, record *rec)
{
    memset(rec, 0, sizeof *rec);
    rec->tok = tok;
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, ro->model, FR_KV_F32);
    o.chunk = 32;
    o.deterministic = ro->deterministic;
    fr_session s;
    assert_int_equal(fr_session_open(&o, ro->blocks, 8, &s), FR_OK);
    fr_scheduler_config c = {.max_seqs = 8, .chunk = 32, .reserve_blocks = 1, .on_done = on_done, .user = rec,
                             .on_text = on_text, .tokenizer = tok};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    for (int i = 0; i < n; i++) {
        specs[i].id = (uint64_t)i;
        assert_int_equal(fr_scheduler_submit(sch, &specs[i]), FR_OK);
    }
    for (int step = 0; !fr_scheduler_idle(sch); step++) {
        if (ro->abort_after && step == ro->abort_after) {
            assert_int_equal(fr_scheduler_abort_all(sch, NULL), FR_OK);
            break;
        }
        assert_int_equal(fr_scheduler_step(sch), FR_OK);
    }
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    rec->preemptions = st.preemptions;
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
    for (int i = 0; i < n; i++) assert_true(rec->got[i]);
}

/* The result's text is its tokens decoded, and what was streamed is a prefix of it. */
static void check_text(const record *rec, int i)
{
    const fr_sample_result *r = &rec->res[i];
    assert_non_null(r->text);
    assert_true(rec->n_streamed[i] <= r->text_len);
    assert_memory_equal(rec->streamed[i], r->text, rec->n_streamed[i]);
    if (r->stop_string) return;   /* cut at the stop string: checked by the caller */
    char *text;
    size_t len;
    assert_int_equal(fr_tokenizer_decode(rec->tok, r->tokens, (size_t)r->n_tokens, 1, &text, &len), FR_OK);
    assert_int_equal(len, r->text_len);
    assert_memory_equal(text, r->text, len);
    free(text);
}

/* A stop string from the middle of text: the bytes of `chars` whole
 * characters from the first character boundary at or after byte `from`
 * where such a run holds no U+FFFD (a decode's mark, which a prefix's
 * decode may show where the whole text has a character) and no NUL; NULL
 * when the text has no such run after `from`. */
static char *pick_stop(const char *text, size_t len, size_t from, int chars)
{
    for (size_t a = from; a < len; a++) {
        if (((unsigned char)text[a] & 0xC0) == 0x80) continue;
        size_t b = a;
        int c = 0;
        for (; c < chars && b < len; c++) {
            if ((len - b >= 3 && memcmp(text + b, "\xEF\xBF\xBD", 3) == 0) || text[b] == '\0') break;
            b++;
            while (b < len && ((unsigned char)text[b] & 0xC0) == 0x80) b++;
        }
        if (c < chars || b >= len) continue;
        char *s = malloc(b - a + 1);
        memcpy(s, text + a, b - a);
        s[b - a] = '\0';
        return s;
    }
    return NULL;
}

static fr_request_spec spec_of(const int *prompt, int n_prompt, uint64_t seed)
{
    return (fr_request_spec){.prompt = prompt, .n_prompt = n_prompt, .n = 2, .max_tokens = MAXT, .with_text = 1,
                             .params = {.temperature = 1.0f, .top_p = 1.0f, .seed = seed}};
}

/* A first run without stop strings, then each request again with a stop
 * string from its own text: cut where it first occurs. */
static void stops_from_text(const char *model, const fr_tokenizer *tok, const int *prompt, int n_prompt)
{
    run_opts ro = {.model = model, .blocks = 64};
    fr_request_spec specs[MAXR];
    for (int i = 0; i < MAXR; i++) specs[i] = spec_of(prompt, n_prompt, 11 + (uint64_t)i);
    record *first = calloc(1, sizeof *first), *again = calloc(1, sizeof *again);
    run(&ro, tok, specs, MAXR, first);
    char *stops[MAXR] = {0};
    const char *lists[MAXR][1];
    int tried = 0;
    for (int i = 0; i < MAXR; i++) {
        check_text(first, i);
        assert_int_equal(first->res[i].stop_string, 0);
        stops[i] = pick_stop(first->res[i].text, first->res[i].text_len, first->res[i].text_len / 3, 3);
        if (!stops[i]) continue;
        lists[i][0] = stops[i];
        specs[i].stop_strings = (fr_stop_strings){.s = lists[i], .n = 1, .include = i % 2};
        tried++;
    }
    assert_true(tried >= 2);
    run(&ro, tok, specs, MAXR, again);
    for (int i = 0; i < MAXR; i++) {
        if (!stops[i]) continue;
        const fr_sample_result *a = &first->res[i], *b = &again->res[i];
        const char *hit = memmem(a->text, a->text_len, stops[i], strlen(stops[i]));
        assert_non_null(hit);
        const size_t at = (size_t)(hit - a->text), end = at + strlen(stops[i]);
        assert_int_equal(b->finish, FR_FINISH_STOP);
        assert_int_equal(b->stop_string, 1);
        assert_int_equal(b->text_len, specs[i].stop_strings.include ? end : at);
        assert_memory_equal(b->text, a->text, b->text_len);
        /* the same draws up to the token that completed it, and it did complete it */
        assert_true(b->n_tokens <= a->n_tokens);
        assert_memory_equal(b->tokens, a->tokens, sizeof(int) * (size_t)b->n_tokens);
        char *before;
        size_t blen;
        assert_int_equal(fr_tokenizer_decode(tok, b->tokens, (size_t)b->n_tokens - 1, 1, &before, &blen), FR_OK);
        assert_null(memmem(before, blen, stops[i], strlen(stops[i])));
        free(before);
        assert_true(b->n_tokens >= 2);   /* three characters: more than one token here */
        /* nothing streamed past the cut: the stop string never reached the stream unless included */
        assert_true(again->n_streamed[i] <= b->text_len);
        assert_memory_equal(again->streamed[i], b->text, again->n_streamed[i]);
        free(stops[i]);
    }
    record_free(first);
    record_free(again);
    free(first);
    free(again);
}

static void test_stops_bytes(void **state)
{
    (void)state;
    fr_tokenizer *tok = NULL;
    assert_int_equal(fr_tokenizer_bytes(272, 256, 257, &tok), FR_OK);
    const int prompt[] = {256, 'd', 'e', 'f', ' '};
    stops_from_text("synthetic:tiny", tok, prompt, 5);
    fr_tokenizer_free(&tok);
}

static void test_stops_qwen3(void **state)
{
    (void)state;
    fr_tokenizer *tok = fr_test_tokenizer_folder("shared:qwen3");
    if (!tok) {
        skip();
        return;
    }
    int *ids;
    size_t n;
    assert_int_equal(fr_tokenizer_encode(tok, "Bonjour, 世界", strlen("Bonjour, 世界"), 0, &ids, &n), FR_OK);
    stops_from_text("synthetic:tiny-qwen3", tok, ids, (int)n);
    free(ids);
    fr_tokenizer_free(&tok);
}

/* min_tokens passes over a stop string that the first tokens complete. */
static void test_min_tokens(void **state)
{
    (void)state;
    fr_tokenizer *tok = NULL;
    assert_int_equal(fr_tokenizer_bytes(272, 256, 257, &tok), FR_OK);
    const int prompt[] = {256, 'x'};
    run_opts ro = {.model = "synthetic:tiny", .blocks = 64};
    fr_request_spec sp = spec_of(prompt, 2, 5);
    sp.min_tokens = MAXT;   /* stop ids barred alike in both runs: the same draws */
    record *first = calloc(1, sizeof *first), *again = calloc(1, sizeof *again);
    run(&ro, tok, &sp, 1, first);
    char *stop = pick_stop(first->res[0].text, first->res[0].text_len, 0, 1);   /* an early character */
    assert_non_null(stop);
    const char *list[] = {stop};
    sp.stop_strings = (fr_stop_strings){.s = list, .n = 1};
    run(&ro, tok, &sp, 1, again);
    assert_memory_equal(again->res[0].tokens, first->res[0].tokens, sizeof(int) * MAXT);
    assert_non_null(memmem(again->res[0].text, again->res[0].text_len, stop, strlen(stop)));   /* passed over */
    assert_int_equal(again->res[0].finish, FR_FINISH_LENGTH);
    assert_int_equal(again->res[0].n_tokens, MAXT);
    assert_int_equal(again->res[0].stop_string, 0);
    free(stop);
    record_free(first);
    record_free(again);
    free(first);
    free(again);
    fr_tokenizer_free(&tok);
}

/* A continuation's text is what its tokens add to the whole sample's: the
 * uninterrupted sample's text ends with it, and what comes before is the
 * partial sample's text (up to a character split at the seam, which only
 * the continuation completes). Its stream is a prefix of it. A stop string
 * across the seam ends the continuation. Cut at several tokens, on the
 * byte-level tokenizer, whose random bytes split characters often. */
static void test_continuation(void **state)
{
    (void)state;
    fr_tokenizer *tok = NULL;
    assert_int_equal(fr_tokenizer_bytes(272, 256, 257, &tok), FR_OK);
    const int prompt[] = {256, 'c', 'o', 'n', 't'};
    run_opts ro = {.model = "synthetic:tiny", .blocks = 64, .deterministic = 1};
    fr_request_spec sp = spec_of(prompt, 5, 21);
    sp.n = 1;
    record *full = calloc(1, sizeof *full), *cont = calloc(1, sizeof *cont);
    run(&ro, tok, &sp, 1, full);
    const fr_sample_result *a = &full->res[0];
    const int n = a->n_tokens;
    assert_true(n >= 16);   /* this seed's sample: long enough to cut */
    const int cuts[] = {1, n / 8, n / 3, n / 2, n - 1};
    int seams = 0;   /* stop strings across the seam tried */
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        const int k = cuts[c];
        fr_request_spec r = sp;
        r.continue_tokens = a->tokens;
        r.n_continue = k;
        run(&ro, tok, &r, 1, cont);
        const fr_sample_result *b = &cont->res[0];
        assert_int_equal(b->start, k);
        assert_int_equal(b->finish, a->finish);
        assert_int_equal(b->n_tokens, n - k);
        assert_memory_equal(b->tokens, a->tokens + k, sizeof(int) * (size_t)b->n_tokens);
        assert_true(b->text_len <= a->text_len);
        const size_t head = a->text_len - b->text_len;
        assert_memory_equal(b->text, a->text + head, b->text_len);   /* the whole text ends with it */
        char *part;
        size_t plen;
        assert_int_equal(fr_tokenizer_decode(tok, a->tokens, (size_t)k, 1, &part, &plen), FR_OK);
        assert_true(head <= plen);
        assert_memory_equal(a->text, part, head);   /* before it: the partial sample's text */
        free(part);
        assert_true(cont->n_streamed[0] <= b->text_len);
        assert_memory_equal(cont->streamed[0], b->text, cont->n_streamed[0]);
        const size_t rest = b->text_len;
        record_free(cont);
        /* a stop string from two characters before the seam to two after */
        size_t from = head, to = head;
        for (int i = 0; i < 2 && from > 0; i++)
            while (--from > 0 && ((unsigned char)a->text[from] & 0xC0) == 0x80) {}
        for (int i = 0; i < 2 && to < a->text_len; i++)
            while (++to < a->text_len && ((unsigned char)a->text[to] & 0xC0) == 0x80) {}
        if (head - from < 2 || to - head < 2 || to > head + rest) continue;
        char *stop = strndup(a->text + from, to - from);
        const char *list[] = {stop};
        r.stop_strings = (fr_stop_strings){.s = list, .n = 1, .include = 1};
        if (strlen(stop) < to - from || memmem(a->text, to - 1, stop, to - from)) {   /* NUL in it, or found earlier */
            free(stop);
            continue;
        }
        run(&ro, tok, &r, 1, cont);
        assert_int_equal(cont->res[0].finish, FR_FINISH_STOP);
        assert_int_equal(cont->res[0].stop_string, 1);
        assert_true(cont->res[0].n_tokens <= n - k);
        assert_memory_equal(cont->res[0].tokens, a->tokens + k, sizeof(int) * (size_t)cont->res[0].n_tokens);
        assert_int_equal(cont->res[0].text_len, to - head);   /* through the stop string, from the seam */
        assert_memory_equal(cont->res[0].text, a->text + head, to - head);
        record_free(cont);
        free(stop);
        seams++;
    }
    assert_true(seams >= 2);
    record_free(full);
    free(full);
    free(cont);
    fr_tokenizer_free(&tok);
}

/* Preemption (a cache of few blocks) and aborts keep every text whole. */
static void test_preemption_and_abort(void **state)
{
    (void)state;
    fr_tokenizer *tok = NULL;
    assert_int_equal(fr_tokenizer_bytes(272, 256, 257, &tok), FR_OK);
    int prompt[100];
    prompt[0] = 256;
    for (int i = 1; i < 100; i++) prompt[i] = 'a' + i % 26;
    fr_request_spec specs[MAXR];
    for (int i = 0; i < MAXR; i++) specs[i] = spec_of(prompt, 60 + 10 * i, 21 + (uint64_t)i);
    record *rec = calloc(1, sizeof *rec);
    for (int abort_after = 0; abort_after <= 12; abort_after += 12) {
        run_opts ro = {.model = "synthetic:tiny", .blocks = 5, .abort_after = abort_after};
        run(&ro, tok, specs, MAXR, rec);
        if (!abort_after) assert_true(rec->preemptions > 0);
        for (int i = 0; i < MAXR; i++) check_text(rec, i);
        record_free(rec);
    }
    free(rec);
    fr_tokenizer_free(&tok);
}

static void test_refused_without_tokenizer(void **state)
{
    (void)state;
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.model = "synthetic:tiny";
    o.backend = FR_BACKEND_CPU;
    fr_session s;
    assert_int_equal(fr_session_open(&o, 8, 2, &s), FR_OK);
    fr_scheduler_config c = {.max_seqs = 2};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    const int prompt[] = {256, 'a'};
    const char *list[] = {"\n"};
    fr_request_spec r = spec_of(prompt, 2, 1);
    r.id = 9;
    r.stop_strings = (fr_stop_strings){.s = list, .n = 1};
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "request 9: stop strings need a tokenizer, and this engine has none"));
    r.stop_strings.n = 0;
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "request 9: text needs a tokenizer"));
    const char *bad[] = {""};
    r.stop_strings = (fr_stop_strings){.s = bad, .n = 1};
    assert_int_equal(fr_scheduler_submit(sch, &r), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "request 9: stop string 0 is empty"));
    assert_true(fr_scheduler_idle(sch));
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_stops_bytes),
             cmocka_unit_test(test_stops_qwen3),
             cmocka_unit_test(test_min_tokens),
             cmocka_unit_test(test_preemption_and_abort),
             cmocka_unit_test(test_refused_without_tokenizer),
             cmocka_unit_test(test_continuation))
