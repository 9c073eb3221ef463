/* The tokenizer's parts checked on their own: the incremental detokenizer
 * on characters split across tokens and where it streams exactly, normal forms computed piecewise
 * against utf8proc on whole strings, the Oniguruma-to-PCRE2 translation,
 * Split behaviours, and encoding from several threads at once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tests/unit/test_util.h"
#include "tests/unit/tokenizer_util.h"
#include "tokenizer/tok_internal.h"
#include "tokenizer/tok_utf8.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"

/* A byte-level tokenizer with one token per byte (ids 0..255), plus <s> = 256. */
static fr_tokenizer *bytes_tokenizer(void)
{
    fr_buf b = {0};
    fr_buf_printf(&b, "{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}, \"decoder\": "
                      "{\"type\": \"ByteLevel\"}, \"added_tokens\": [{\"id\": 256, \"content\": \"<s>\", "
                      "\"special\": true, \"normalized\": false}], \"model\": {\"type\": \"BPE\", \"vocab\": {");
    for (int i = 0; i < 256; i++) {
        char c[4];
        int n = tok_utf8_put(tok_byte_char((unsigned char)i), c);
        if (c[0] == '"' || c[0] == '\\') fr_buf_printf(&b, "\"\\%c\": %d, ", c[0], i);
        else fr_buf_printf(&b, "\"%.*s\": %d, ", n, c, i);
    }
    fr_buf_printf(&b, "\"<s>\": 256}, \"merges\": []}}");
    fr_tokenizer *t;
    if (fr_tokenizer_from_json(b.data, b.len, NULL, 0, "bytes.json", &t) != FR_OK) fail_msg("%s", fr_last_error());
    fr_buf_free(&b);
    return t;
}

/* Pushes ids one by one; out[i] is what push i handed out. */
static void stream(fr_detok *d, const int *ids, size_t n, char out[][16])
{
    for (size_t i = 0; i < n; i++) {
        const char *s;
        size_t l;
        assert_int_equal(fr_detok_push(d, ids[i], &s, &l), FR_OK);
        assert_true(l < 16);
        memcpy(out[i], s, l);
        out[i][l] = '\0';
    }
}

static void test_detok_multibyte(void **state)
{
    (void)state;
    fr_tokenizer *t = bytes_tokenizer();
    fr_detok *d;
    assert_int_equal(fr_detok_new(t, 0, &d), FR_OK);
    /* é (2 bytes), 你 (3), 😀 (4), then ASCII: nothing until a character is whole. */
    const unsigned char text[] = "\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80!";
    int ids[10];
    for (int i = 0; i < 10; i++) ids[i] = text[i];
    char out[10][16];
    stream(d, ids, 10, out);
    const char *want[] = {"", "\xC3\xA9", "", "", "\xE4\xBD\xA0", "", "", "", "\xF0\x9F\x98\x80", "!"};
    for (int i = 0; i < 10; i++)
        if (strcmp(out[i], want[i]) != 0) fail_msg("push %d gave \"%s\", want \"%s\"", i, out[i], want[i]);
    /* A sequence that cannot complete: held while it might, then U+FFFD. */
    int broken[] = {0xE4, 0xBD, 'a', 0xF0, 0x9F};
    stream(d, broken, 5, out);
    assert_string_equal(out[0], "");
    assert_string_equal(out[1], "");
    assert_string_equal(out[2], "\xEF\xBF\xBD" "a");
    assert_string_equal(out[3], "");
    assert_string_equal(out[4], "");
    const char *s;
    size_t l;
    assert_int_equal(fr_detok_finish(d, &s, &l), FR_OK);
    assert_int_equal(l, 3);
    assert_memory_equal(s, "\xEF\xBF\xBD", 3);
    /* After finish a new sequence starts; special tokens can be skipped. */
    fr_detok_free(&d);
    assert_null(d);
    assert_int_equal(fr_detok_new(t, 1, &d), FR_OK);
    int with_special[] = {256, 'o', 256, 'k'};
    stream(d, with_special, 4, out);
    assert_string_equal(out[1], "o");
    assert_string_equal(out[3], "k");
    assert_int_equal(fr_detok_finish(d, &s, &l), FR_OK);
    assert_int_equal(l, 0);
    fr_detok_free(&d);
    fr_detok_free(NULL);
    assert_int_equal(fr_detok_new(NULL, 0, &d), FR_EINVAL);
    fr_tokenizer_free(&t);
}

/* Byte fallback streams the same way: <0xE4><0xBD><0xA0> is one character. */
static void test_detok_byte_fallback(void **state)
{
    (void)state;
    fr_tokenizer *t = fr_test_tokenizer_folder("data:spm_bpe");
    assert_non_null(t);
    int ids[8];
    size_t n = 0;
    ids[n++] = fr_tokenizer_token_id(t, "\xE2\x96\x81");   /* ▁ */
    const char *bytes[] = {"<0xE4>", "<0xBD>", "<0xA0>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"};
    for (int i = 0; i < 7; i++) ids[n++] = fr_tokenizer_token_id(t, bytes[i]);
    for (size_t i = 0; i < n; i++) assert_true(ids[i] >= 0);
    fr_detok *d;
    assert_int_equal(fr_detok_new(t, 0, &d), FR_OK);
    char out[8][16];
    stream(d, ids, n, out);
    /* The first piece's leading space is stripped, as in a whole decode. */
    const char *want[] = {"", "", "", "\xE4\xBD\xA0", "", "", "", "\xF0\x9F\x98\x80"};
    for (size_t i = 0; i < n; i++)
        if (strcmp(out[i], want[i]) != 0) fail_msg("push %zu gave \"%s\", want \"%s\"", i, out[i], want[i]);
    fr_detok_free(&d);
    fr_tokenizer_free(&t);
}

/* Which tokenizers stream exactly: byte-level and SentencePiece-style
 * decoders do; a Strip of a trailing character after Fuse does not, and
 * there the pieces follow DecodeStream: "x", " ", " ", "y" under Strip(" ",
 * 2, 1) decodes to "x  y" but streams as "x", " ", "y" (the window's second
 * leading space is stripped too). */
static void test_detok_exactness(void **state)
{
    (void)state;
    fr_tokenizer *t = bytes_tokenizer();
    assert_int_equal(fr_tokenizer_streams_exactly(t), 1);
    fr_tokenizer_free(&t);
    t = fr_test_tokenizer_folder("data:spm_bpe");
    assert_non_null(t);
    assert_int_equal(fr_tokenizer_streams_exactly(t), 1);
    fr_tokenizer_free(&t);
    assert_int_equal(fr_tokenizer_streams_exactly(NULL), 0);
    static const char json[] =
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"x\": 0, \" \": 1, \"y\": 2}, \"merges\": []}, "
        "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, "
        "{\"type\": \"Strip\", \"content\": \" \", \"start\": 2, \"stop\": 1}]}}";
    if (fr_tokenizer_from_json(json, sizeof json - 1, NULL, 0, "strip.json", &t) != FR_OK) fail_msg("%s", fr_last_error());
    assert_int_equal(fr_tokenizer_streams_exactly(t), 0);
    int ids[] = {0, 1, 1, 2};
    char *text;
    size_t len;
    assert_int_equal(fr_tokenizer_decode(t, ids, 4, 0, &text, &len), FR_OK);
    assert_string_equal(text, "x  y");
    free(text);
    fr_detok *d;
    assert_int_equal(fr_detok_new(t, 0, &d), FR_OK);
    char out[5][16];
    stream(d, ids, 4, out);
    const char *s;
    size_t l;
    assert_int_equal(fr_detok_finish(d, &s, &l), FR_OK);
    snprintf(out[4], sizeof out[4], "%.*s", (int)l, s);
    char joined[96];
    snprintf(joined, sizeof joined, "%s%s%s%s%s", out[0], out[1], out[2], out[3], out[4]);
    assert_string_equal(joined, "x y");
    fr_detok_free(&d);
    fr_tokenizer_free(&t);
}

/* A random string of characters that normal forms care about: ASCII,
 * combining marks, precomposed letters, Hangul jamo and syllables,
 * compatibility characters, singletons. */
static size_t random_text(fr_test_rng *r, char *out, size_t max_chars)
{
    static const uint32_t pool[] = {'a', 'e', 'A', ' ', 0x301, 0x308, 0x323, 0x31B, 0x327, 0x30A, 0xE9, 0xC5,
                                    0x1E63, 0x1100, 0x1161, 0x11A8, 0xAC00, 0xAC01, 0x212B, 0x2126, 0xFB01,
                                    0xFF21, 0x4F60, 0x0958, 0x093C, 0x0915, 0x3099, 0x304B, 0x0F73, 0x1D15E};
    size_t n = 0, chars = 1 + fr_test_u64(r) % max_chars;
    for (size_t i = 0; i < chars; i++) n += (size_t)tok_utf8_put(pool[fr_test_u64(r) % (sizeof pool / sizeof *pool)], out + n);
    return n;
}

static void test_normal_forms_piecewise(void **state)
{
    (void)state;
    fr_test_rng r = {42};
    static const tok_norm_kind kinds[] = {TOK_NORM_NFC, TOK_NORM_NFD, TOK_NORM_NFKC, TOK_NORM_NFKD};
    static const int opts[] = {UTF8PROC_COMPOSE, UTF8PROC_DECOMPOSE, UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
                               UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT};
    char text[64 * 4];
    for (int iter = 0; iter < 20000; iter++) {
        size_t n = random_text(&r, text, 64);
        int k = iter % 4;
        fr_buf got = {0};
        fr_status st;
        int same = tok_unicode_form(kinds[k], text, n, &got, &st);
        assert_int_equal(st, FR_OK);
        utf8proc_uint8_t *want = NULL;
        utf8proc_ssize_t wl = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)n, &want,
                                           (utf8proc_option_t)(UTF8PROC_STABLE | opts[k]));
        assert_true(wl >= 0);
        const char *g = same ? text : got.data;
        size_t gl = same ? n : got.len;
        if ((size_t)wl != gl || memcmp(g, want, gl) != 0)
            fail_msg("form %d of \"%.*s\" differs from utf8proc's on the whole string", k, (int)n, text);
        free(want);
        fr_buf_free(&got);
    }
}

static void test_regex_translation(void **state)
{
    (void)state;
    static const struct { const char *onig, *pcre; } cases[] = {
        {"\\s+(?!\\S)", "[\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
                        "\\x{3000}]+(?![^\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
                        "\\x{202F}\\x{205F}\\x{3000}])"},
        {"[^\\s\\p{L}]", "[^\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
                         "\\x{205F}\\x{3000}\\p{L}]"},
        {"\\h\\w", "[0-9a-fA-F][\\p{L}\\p{M}\\p{N}\\p{Pc}]"},
        {"\\u00e9[]a]\\p{N}{1,3}", "\\x{00e9}[]a]\\p{N}{1,3}"},
        {"[[:alpha:]\\d]", "[[:alpha:]\\d]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t n;
        char *p = tok_regex_translate(cases[i].onig, strlen(cases[i].onig), &n);
        assert_non_null(p);
        assert_string_equal(p, cases[i].pcre);
        free(p);
    }
    size_t n;
    assert_null(tok_regex_translate("[a[b]]", 6, &n));
    assert_null(tok_regex_translate("[a-z&&[^c]]", 11, &n));
    assert_null(tok_regex_translate("[\\H]", 4, &n));

    /* \s as Oniguruma reads it: U+0085 is a space, U+180E is not. */
    tok_regex re;
    tok_rx_ctx c;
    tok_segs l = {0};
    assert_int_equal(tok_regex_compile(&re, "\\s", 2, 0, "test"), FR_OK);
    assert_int_equal(tok_rx_ctx_init(&c), FR_OK);
    const char *text = "a\xC2\x85" "b\xE1\xA0\x8E" "c";
    assert_int_equal(tok_regex_matches(&re, &c, text, strlen(text), &l), FR_OK);
    assert_int_equal(l.n, 3);   /* "a", NEL, "b<U+180E>c" */
    assert_int_equal(l.v[1].match, 1);
    assert_int_equal(l.v[1].s, 1);
    assert_int_equal(l.v[2].e, strlen(text));
    tok_regex_free(&re);
    /* Empty matches: not right after a match, as Oniguruma's iterator. */
    assert_int_equal(tok_regex_compile(&re, "x*", 2, 0, "test"), FR_OK);
    assert_int_equal(tok_regex_matches(&re, &c, "axxb", 4, &l), FR_OK);
    /* matches: [0,0) [1,3) [4,4) -> pieces "a", "xx", "b" */
    assert_int_equal(l.n, 5);
    tok_regex_free(&re);
    tok_rx_ctx_free(&c);
    free(l.v);
}

/* Split behaviours on one match list: "ab--cd-e" split on "-". */
static void test_split_behaviors(void **state)
{
    (void)state;
    static const struct { tok_split_behavior b; int invert; const char *want; } cases[] = {
        {TOK_SPLIT_REMOVED, 0, "ab|cd|e"},
        {TOK_SPLIT_ISOLATED, 0, "ab|-|-|cd|-|e"},
        {TOK_SPLIT_MERGED_PREV, 0, "ab-|-|cd-|e"},
        {TOK_SPLIT_MERGED_NEXT, 0, "ab|-|-cd|-e"},
        {TOK_SPLIT_CONTIGUOUS, 0, "ab|--|cd|-|e"},
        {TOK_SPLIT_REMOVED, 1, "-|-|-"},
    };
    const char *text = "ab--cd-e";
    tok_regex re;
    tok_rx_ctx c;
    assert_int_equal(tok_regex_compile(&re, "-", 1, 1, "test"), FR_OK);
    assert_int_equal(tok_rx_ctx_init(&c), FR_OK);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        tok_segs l = {0};
        assert_int_equal(tok_regex_matches(&re, &c, text, strlen(text), &l), FR_OK);
        tok_segs_apply(&l, cases[i].b, cases[i].invert);
        char got[64] = "";
        for (size_t k = 0; k < l.n; k++) {
            if (l.v[k].match) continue;
            if (*got) strcat(got, "|");
            strncat(got, text + l.v[k].s, l.v[k].e - l.v[k].s);
        }
        if (strcmp(got, cases[i].want) != 0) fail_msg("behavior %d invert %d: %s, want %s", cases[i].b, cases[i].invert, got, cases[i].want);
        free(l.v);
    }
    tok_regex_free(&re);
    tok_rx_ctx_free(&c);
}

typedef struct {
    const fr_tokenizer *t;
    const char *text;
    size_t len;
    const int *want;
    size_t n_want;
    int ok;
} thread_job;

static void *encode_many(void *arg)
{
    thread_job *j = arg;
    j->ok = 1;
    for (int rep = 0; rep < 20 && j->ok; rep++) {
        int *ids;
        size_t n;
        if (fr_tokenizer_encode(j->t, j->text, j->len, 1, &ids, &n) != FR_OK) { j->ok = 0; break; }
        j->ok = n == j->n_want && memcmp(ids, j->want, n * sizeof *ids) == 0;
        free(ids);
    }
    return NULL;
}

/* One tokenizer, four threads encoding at once: each gets what one alone gets. */
static void test_threads(void **state)
{
    (void)state;
    fr_tokenizer *t = fr_test_tokenizer_folder("data:spm_bpe");
    static const char *const names[] = {"long_en", "long_multilingual", "long_code", "emoji"};
    thread_job jobs[4];
    char *texts[4];
    int *want[4];
    for (int i = 0; i < 4; i++) {
        texts[i] = fr_test_read_corpus(names[i], &jobs[i].len);
        assert_int_equal(fr_tokenizer_encode(t, texts[i], jobs[i].len, 1, &want[i], &jobs[i].n_want), FR_OK);
        jobs[i] = (thread_job){t, texts[i], jobs[i].len, want[i], jobs[i].n_want, 0};
    }
    pthread_t th[4];
    for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&th[i], NULL, encode_many, &jobs[i]), 0);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_true(jobs[i].ok);
        free(texts[i]);
        free(want[i]);
    }
    fr_tokenizer_free(&t);
}

/* Long runs of one class: megabytes of spaces, digits, one word. */
static void test_large_inputs(void **state)
{
    (void)state;
    fr_tokenizer *t = fr_test_tokenizer_variant("shared:qwen3", NULL);
    if (!t) t = fr_test_tokenizer_folder("data:spm_bpe");
    size_t n = 2u << 20;
    char *s = malloc(n);
    static const char fill[] = {' ', '7', 'x', '\n'};
    for (int k = 0; k < 4; k++) {
        memset(s, fill[k], n);
        int *ids;
        size_t m;
        if (fr_tokenizer_encode(t, s, n, 0, &ids, &m) != FR_OK) fail_msg("%d: %s", k, fr_last_error());
        assert_true(m > 0 && m <= n);
        char *back;
        size_t bl;
        assert_int_equal(fr_tokenizer_decode(t, ids, m, 0, &back, &bl), FR_OK);
        assert_true(bl >= n);   /* the SentencePiece tokenizer adds a leading space */
        assert_memory_equal(back + bl - n, s, n);
        free(back);
        free(ids);
    }
    free(s);
    fr_tokenizer_free(&t);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_detok_multibyte),
             cmocka_unit_test(test_detok_byte_fallback),
             cmocka_unit_test(test_detok_exactness),
             cmocka_unit_test(test_normal_forms_piecewise),
             cmocka_unit_test(test_regex_translation),
             cmocka_unit_test(test_split_behaviors),
             cmocka_unit_test(test_threads),
             cmocka_unit_test(test_large_inputs))
