/* Stop strings (rollout/engine/stop_strings.h): the matcher against a plain
 * search over random texts cut into random pieces, its holdback, the
 * refusals; a sample's text state on the byte-level tokenizer (stop strings
 * across tokens, a character split over byte tokens, the stable part never
 * splitting a character, include, the end) and on Qwen3's tokenizer when
 * ../shared/tokenizers holds it; and the byte-level tokenizer itself. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/stop_strings.h"
#include "tests/unit/tokenizer_util.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"

static fr_stop_matcher *matcher(const char *const *s, int n)
{
    fr_stop_strings ss = {.s = s, .n = n};
    fr_stop_matcher *m = NULL;
    assert_int_equal(fr_stop_matcher_new(&ss, &m), FR_OK);
    return m;
}

static void test_matcher_basics(void **state)
{
    (void)state;
    const char *s[] = {"</answer>", "\n\n"};
    fr_stop_matcher *m = matcher(s, 2);
    size_t used;
    assert_int_equal(fr_stop_matcher_feed(m, "the answer is 4</ans", 20, &used), -1);
    assert_int_equal(used, 20);
    assert_int_equal(fr_stop_matcher_holdback(m), 5);   /* "</ans" may still become "</answer>" */
    assert_int_equal(fr_stop_matcher_feed(m, "wer> and more", 13, &used), 0);
    assert_int_equal(used, 4);                           /* the match ends with "wer>" */
    fr_stop_matcher_free(&m);
    assert_null(m);

    /* Two matches end in one piece: the one that ends first wins, whatever the list order. */
    m = matcher(s, 2);
    assert_int_equal(fr_stop_matcher_feed(m, "a\n\nb</answer>", 13, &used), 1);
    assert_int_equal(used, 3);
    fr_stop_matcher_free(&m);

    /* The same end: the longer string. "abc" contains "bc"; both end at byte 3. */
    const char *t[] = {"bc", "abc"};
    m = matcher(t, 2);
    assert_int_equal(fr_stop_matcher_feed(m, "xabc", 4, &used), 1);
    assert_int_equal(used, 4);
    fr_stop_matcher_free(&m);

    /* Overlaps a naive restart would miss: "aab" inside "aaab", fed a byte at a time. */
    const char *u[] = {"aab"};
    m = matcher(u, 1);
    assert_int_equal(fr_stop_matcher_feed(m, "a", 1, NULL), -1);
    assert_int_equal(fr_stop_matcher_feed(m, "a", 1, NULL), -1);
    assert_int_equal(fr_stop_matcher_feed(m, "a", 1, NULL), -1);
    assert_int_equal(fr_stop_matcher_holdback(m), 2);
    assert_int_equal(fr_stop_matcher_feed(m, "b", 1, &used), 0);
    assert_int_equal(used, 1);
    fr_stop_matcher_free(&m);

    /* No stop strings: nothing matches, nothing is held back. */
    m = matcher(NULL, 0);
    assert_int_equal(fr_stop_matcher_feed(m, "abc", 3, &used), -1);
    assert_int_equal(fr_stop_matcher_holdback(m), 0);
    fr_stop_matcher_free(&m);
}

/* The first place (smallest end, then longest) any of s occurs in text, by
 * brute force: the end, or 0 when none; *which the string. */
static size_t naive_first(const char *const *s, int n, const char *text, size_t len, int *which)
{
    for (size_t end = 1; end <= len; end++) {
        int best = -1;
        for (int k = 0; k < n; k++) {
            size_t l = strlen(s[k]);
            if (l <= end && memcmp(text + end - l, s[k], l) == 0 && (best < 0 || l > strlen(s[best]))) best = k;
        }
        if (best >= 0) {
            *which = best;
            return end;
        }
    }
    return 0;
}

static size_t naive_holdback(const char *const *s, int n, const char *text, size_t len)
{
    size_t h = 0;
    for (int k = 0; k < n; k++) {
        size_t l = strlen(s[k]);
        for (size_t j = 1; j < l && j <= len; j++)
            if (memcmp(text + len - j, s[k], j) == 0 && j > h) h = j;
    }
    return h;
}

/* Random texts over a 3-letter alphabet (so matches and near-matches are
 * common), random stop strings, the text fed in random pieces: the match
 * and every holdback equal the brute force's. */
static void test_matcher_random(void **state)
{
    (void)state;
    uint64_t x = 88172645463325252ull;
#define RND() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    for (int trial = 0; trial < 3000; trial++) {
        char bufs[4][8];
        const char *s[4];
        const int n = 1 + (int)(RND() % 4);
        for (int k = 0; k < n; k++) {
            int l = 1 + (int)(RND() % 6);
            for (int i = 0; i < l; i++) bufs[k][i] = (char)('a' + RND() % 3);
            bufs[k][l] = '\0';
            s[k] = bufs[k];
        }
        char text[64];
        const size_t len = 1 + RND() % 60;
        for (size_t i = 0; i < len; i++) text[i] = (char)('a' + RND() % 3);
        int want_k = -1;
        const size_t want_end = naive_first(s, n, text, len, &want_k);
        fr_stop_matcher *m = matcher(s, n);
        size_t at = 0;
        int got = -1;
        while (at < len && got < 0) {
            size_t piece = 1 + RND() % 7, used;
            if (piece > len - at) piece = len - at;
            got = fr_stop_matcher_feed(m, text + at, piece, &used);
            at += used;
            if (got < 0) assert_int_equal(fr_stop_matcher_holdback(m), naive_holdback(s, n, text, at));
        }
        if (want_end == 0) {
            assert_int_equal(got, -1);
        } else {
            assert_int_equal(got, want_k);
            assert_int_equal(at, want_end);
        }
        fr_stop_matcher_free(&m);
    }
#undef RND
}

static void test_refusals(void **state)
{
    (void)state;
    fr_stop_matcher *m = NULL;
    const char *empty[] = {"ok", ""};
    fr_stop_strings ss = {.s = empty, .n = 2};
    assert_int_equal(fr_stop_matcher_new(&ss, &m), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "stop string 1 is empty"));
    const char *bad[] = {"\xC3("};
    ss = (fr_stop_strings){.s = bad, .n = 1};
    assert_int_equal(fr_stop_strings_check(&ss, "request 7"), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "request 7: stop string 0 is not UTF-8"));
    char *longs = malloc(FR_MAX_STOP_STRING_BYTES + 2);
    memset(longs, 'a', FR_MAX_STOP_STRING_BYTES + 1);
    longs[FR_MAX_STOP_STRING_BYTES + 1] = '\0';
    const char *lng[] = {longs};
    ss = (fr_stop_strings){.s = lng, .n = 1};
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "longer than 1024 bytes"));
    longs[FR_MAX_STOP_STRING_BYTES] = '\0';
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_OK);
    free(longs);
    const char *many[FR_MAX_STOP_STRINGS + 1];
    for (int i = 0; i <= FR_MAX_STOP_STRINGS; i++) many[i] = "x";
    ss = (fr_stop_strings){.s = many, .n = FR_MAX_STOP_STRINGS + 1};
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "at most 32"));
    const char *overlong[] = {"\xC0\xAF"}, *surrogate[] = {"\xED\xA0\x80"}, *fine[] = {"\xF0\x9F\x98\x80 \xE2\x82\xAC"};
    ss = (fr_stop_strings){.s = overlong, .n = 1};
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_EINVAL);
    ss = (fr_stop_strings){.s = surrogate, .n = 1};
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_EINVAL);
    ss = (fr_stop_strings){.s = fine, .n = 1};
    assert_int_equal(fr_stop_strings_check(&ss, "r"), FR_OK);
}

/* ---- the byte-level tokenizer and a sample's text on it ------------------- */

static fr_tokenizer *bytes_tok(void)
{
    fr_tokenizer *t = NULL;
    assert_int_equal(fr_tokenizer_bytes(272, 256, 257, &t), FR_OK);
    return t;
}

static void test_byte_tokenizer(void **state)
{
    (void)state;
    fr_tokenizer *t = bytes_tok();
    assert_int_equal(fr_tokenizer_vocab_size(t), 272);
    assert_int_equal(fr_tokenizer_bos_id(t), 256);
    assert_int_equal(fr_tokenizer_eos_id(t), 257);
    assert_true(fr_tokenizer_is_special(t, 258));
    assert_false(fr_tokenizer_is_special(t, 'a'));
    const char *text = "d\xC3\xA9" "f \"x\"\\\n\x01";   /* a 2-byte character, quotes, a backslash, control bytes */
    int *ids;
    size_t n;
    assert_int_equal(fr_tokenizer_encode(t, text, strlen(text), 1, &ids, &n), FR_OK);
    assert_int_equal(n, strlen(text) + 1);
    assert_int_equal(ids[0], 256);
    for (size_t i = 0; i < strlen(text); i++) assert_int_equal(ids[i + 1], (unsigned char)text[i]);
    char *back;
    size_t len;
    int with_eos[64];
    memcpy(with_eos, ids, sizeof(int) * n);
    with_eos[n] = 257;
    assert_int_equal(fr_tokenizer_decode(t, with_eos, n + 1, 1, &back, &len), FR_OK);
    assert_string_equal(back, text);
    free(back);
    assert_int_equal(fr_tokenizer_decode(t, with_eos, n + 1, 0, &back, &len), FR_OK);
    assert_int_equal(strncmp(back, "<256>d", 6), 0);
    assert_non_null(strstr(back, "<257>"));
    free(back);
    free(ids);
    fr_tokenizer_free(&t);
    assert_int_equal(fr_tokenizer_bytes(100, 256, 257, &t), FR_EINVAL);
    assert_int_equal(fr_tokenizer_bytes(272, 65, 257, &t), FR_EINVAL);
    assert_null(t);
}

/* Pushes the bytes of s as byte tokens; returns the token index (0-based)
 * at which a stop string matched, or -1. Checks on the way that the stable
 * part grows, never shrinks, and ends on a character boundary. */
static int push_bytes(fr_sample_text *st, const char *s, size_t *stable_max)
{
    for (size_t i = 0; s[i]; i++) {
        int m;
        assert_int_equal(fr_sample_text_push(st, (unsigned char)s[i], 1, &m), FR_OK);
        size_t len, stable;
        const char *txt = fr_sample_text_get(st, &len, &stable);
        assert_true(stable <= len);
        assert_true(stable >= *stable_max);
        *stable_max = stable;
        if (stable < len) assert_int_not_equal((unsigned char)txt[stable] & 0xC0, 0x80);
        if (m >= 0) return (int)i;
    }
    return -1;
}

static void test_sample_text_bytes(void **state)
{
    (void)state;
    fr_tokenizer *t = bytes_tok();
    const char *s[] = {"\xC3\xA9t\xC3\xA9", "\n\n"};   /* "été" */
    fr_stop_strings ss = {.s = s, .n = 2};
    fr_sample_text *st;
    assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_OK);
    size_t hi = 0, len, stable;
    /* "un été": the stop string ends with the last byte of its last character (token 7, 0-based). */
    assert_int_equal(push_bytes(st, "un \xC3\xA9t\xC3\xA9 chaud", &hi), 7);
    assert_int_equal(fr_sample_text_matched(st), 0);
    const char *txt = fr_sample_text_get(st, &len, &stable);
    assert_string_equal(txt, "un ");
    assert_int_equal(stable, 3);
    int m;
    assert_int_equal(fr_sample_text_push(st, 'x', 1, &m), FR_EINVAL);   /* the text has ended */
    assert_int_equal(fr_sample_text_finish(st), FR_OK);              /* nothing to do */
    fr_sample_text_free(&st);

    /* Included, and a special token's text skipped. */
    ss.include = 1;
    assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_OK);
    assert_int_equal(fr_sample_text_push(st, 256, 1, &m), FR_OK);
    hi = 0;
    assert_int_equal(push_bytes(st, "ab\n\ncd", &hi), 3);
    assert_int_equal(fr_sample_text_matched(st), 1);
    assert_string_equal(fr_sample_text_get(st, &len, &stable), "ab\n\n");
    assert_int_equal(stable, 4);
    fr_sample_text_free(&st);

    /* No match: the held-back start of a stop string and a half character join at the end. */
    ss.include = 0;
    assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_OK);
    hi = 0;
    assert_int_equal(push_bytes(st, "hi \xC3\xA9t", &hi), -1);
    fr_sample_text_get(st, &len, &stable);
    assert_int_equal(stable, 3);   /* "ét" might become "été" */
    assert_int_equal(push_bytes(st, "\n", &hi), -1);
    txt = fr_sample_text_get(st, &len, &stable);
    assert_string_equal(txt, "hi \xC3\xA9t\n");
    assert_int_equal(stable, 6);   /* the "\n" might become "\n\n" */
    assert_int_equal(fr_sample_text_push(st, 0xE2, 1, &m), FR_OK);   /* the first byte of a 3-byte character */
    assert_int_equal(fr_sample_text_finish(st), FR_OK);
    txt = fr_sample_text_get(st, &len, &stable);
    assert_string_equal(txt, "hi \xC3\xA9t\n\xEF\xBF\xBD");
    assert_int_equal(stable, len);
    fr_sample_text_free(&st);

    /* Stop strings passed over (min_tokens), then one that ends the sample. */
    assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_OK);
    for (const char *p = "a\n\nb"; *p; p++) {
        assert_int_equal(fr_sample_text_push(st, (unsigned char)*p, 0, &m), FR_OK);
        assert_int_equal(m, -1);
    }
    hi = 0;
    assert_int_equal(push_bytes(st, "\n\nc", &hi), 1);
    assert_string_equal(fr_sample_text_get(st, &len, &stable), "a\n\nb");
    fr_sample_text_free(&st);

    /* Text alone: everything decoded is stable at once. */
    assert_int_equal(fr_sample_text_new(t, NULL, 1, &st), FR_OK);
    hi = 0;
    assert_int_equal(push_bytes(st, "a\n\nb", &hi), -1);
    fr_sample_text_get(st, &len, &stable);
    assert_int_equal(stable, 4);
    fr_sample_text_free(&st);

    /* A special token: out of the text by default, in it (as "<257>") when
     * kept, and only then can a stop string match it. */
    const char *end_list[] = {"<257>"};
    fr_stop_strings es = {.s = end_list, .n = 1};
    for (int skip = 1; skip >= 0; skip--) {
        assert_int_equal(fr_sample_text_new(t, &es, skip, &st), FR_OK);
        assert_int_equal(fr_sample_text_push(st, 'x', 1, &m), FR_OK);
        assert_int_equal(fr_sample_text_push(st, 257, 1, &m), FR_OK);
        assert_int_equal(m, skip ? -1 : 0);
        if (skip) assert_int_equal(fr_sample_text_finish(st), FR_OK);
        assert_string_equal(fr_sample_text_get(st, &len, NULL), "x");   /* the stop string itself is cut */
        fr_sample_text_free(&st);
    }
    es.include = 1;
    assert_int_equal(fr_sample_text_new(t, &es, 0, &st), FR_OK);
    assert_int_equal(fr_sample_text_push(st, 'x', 1, &m), FR_OK);
    assert_int_equal(fr_sample_text_push(st, 257, 1, &m), FR_OK);
    assert_string_equal(fr_sample_text_get(st, &len, NULL), "x<257>");
    fr_sample_text_free(&st);
    fr_tokenizer_free(&t);
}

/* Qwen3's tokenizer: a stop string inside a token, one across tokens, and
 * a text decoded piece by piece equal to the whole decode. */
static void test_sample_text_qwen3(void **state)
{
    (void)state;
    fr_tokenizer *t = fr_test_tokenizer_folder("shared:qwen3");
    if (!t) {
        skip();
        return;
    }
    const char *text = "The answer is 42.</answer>\n\nNext question: caf\xC3\xA9 \xE2\x9C\x85 done";
    int *ids;
    size_t n;
    assert_int_equal(fr_tokenizer_encode(t, text, strlen(text), 0, &ids, &n), FR_OK);
    const struct {
        const char *stop;
        const char *want;   /* NULL: no match */
        int refused;
    } cases[] = {
        {"</answer>", "The answer is 42.", 0},
        {"swer is", "The an", 0},                 /* inside words: across token boundaries */
        {"\xC3\xA9 \xE2\x9C", NULL, 1},           /* half a character is no stop string */
        {"\xE2\x9C\x85", "The answer is 42.</answer>\n\nNext question: caf\xC3\xA9 ", 0},
        {"zzz", NULL, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const char *s[] = {cases[c].stop};
        fr_stop_strings ss = {.s = s, .n = 1};
        fr_sample_text *st;
        if (cases[c].refused) {
            assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_EINVAL);
            assert_null(st);
            continue;
        }
        assert_int_equal(fr_sample_text_new(t, &ss, 1, &st), FR_OK);
        int m = -1;
        size_t i = 0;
        for (; i < n && m < 0; i++) assert_int_equal(fr_sample_text_push(st, ids[i], 1, &m), FR_OK);
        size_t len, stable;
        const char *got = fr_sample_text_get(st, &len, &stable);
        if (cases[c].want) {
            assert_int_equal(m, 0);
            assert_string_equal(got, cases[c].want);
            /* The token that completed it: the text of the tokens before it does not hold it yet. */
            char *before;
            size_t blen;
            assert_int_equal(fr_tokenizer_decode(t, ids, i - 1, 1, &before, &blen), FR_OK);
            assert_null(strstr(before, cases[c].stop));
            free(before);
        } else {
            assert_int_equal(m, -1);
            assert_int_equal(fr_sample_text_finish(st), FR_OK);
            got = fr_sample_text_get(st, &len, &stable);
            assert_string_equal(got, text);
        }
        fr_sample_text_free(&st);
    }
    free(ids);
    fr_tokenizer_free(&t);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_matcher_basics),
             cmocka_unit_test(test_matcher_random),
             cmocka_unit_test(test_refusals),
             cmocka_unit_test(test_byte_tokenizer),
             cmocka_unit_test(test_sample_text_bytes),
             cmocka_unit_test(test_sample_text_qwen3))
