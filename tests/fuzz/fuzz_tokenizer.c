/* libFuzzer target: the tokenizer (tokenizer/tokenizer.h) on any input.
 *
 * The first byte picks what the rest is:
 *   0: text bytes as they come. encode must succeed exactly when they are
 *      valid UTF-8 (checked here by a decoder of its own) and refuse them
 *      with FR_EINVAL otherwise;
 *   1: code points, three bytes each (taken modulo U+110000, surrogates
 *      moved out), written as UTF-8: encode must always succeed;
 *   2: a tokenizer.json: loading may refuse it (with a message) or accept
 *      it, and an accepted one must encode and decode a fixed text.
 * Every encoding must hold ids below the vocabulary size, decode to valid
 * UTF-8, and stream through the incremental detokenizer in valid pieces
 * that add up to the same text (where fr_tokenizer_streams_exactly
 * promises it).
 * The tokenizers: tests/data/tokenizer/spm_bpe (in the repository) and,
 * when ../shared/tokenizers holds it, Qwen3's (DeepSeek-V3's adds little
 * coverage for its load time under the sanitizers). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz_common.h"
#include "tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static fr_tokenizer *toks[2];
static int n_toks;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static const char *const paths[] = {"tests/data/tokenizer/spm_bpe", "../shared/tokenizers/qwen3"};
    for (int i = 0; i < 2; i++)
        if (fr_tokenizer_load(paths[i], &toks[n_toks]) == FR_OK) n_toks++;
        else if (i == 0) FUZZ_CHECK(0, "cannot load %s: %s (run from the repository root)", paths[i], fr_last_error());
    return 0;
}

/* Valid UTF-8 by the book (RFC 3629), written apart from the library's. */
static int valid_utf8(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return 0;
        uint32_t cp = len == 1 ? c : c & (0x7F >> len);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        static const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

/* ids in range, a valid decode, and the streamed decode adding up to it. */
static void check_ids(const fr_tokenizer *t, const int *ids, size_t n)
{
    int vs = fr_tokenizer_vocab_size(t);
    for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < vs, "id %d of %d", ids[i], vs);
    char *text;
    size_t len;
    FUZZ_CHECK(fr_tokenizer_decode(t, ids, n, 0, &text, &len) == FR_OK, "decode: %s", fr_last_error());
    FUZZ_CHECK(valid_utf8((const uint8_t *)text, len), "decode gave invalid UTF-8");
    fr_detok *d;
    FUZZ_CHECK(fr_detok_new(t, 0, &d) == FR_OK, "detok: %s", fr_last_error());
    const int exact = fr_tokenizer_streams_exactly(t);   /* else DecodeStream's pieces: only valid, not equal */
    size_t at = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *s;
        size_t l;
        fr_status st = i < n ? fr_detok_push(d, ids[i], &s, &l) : fr_detok_finish(d, &s, &l);
        FUZZ_CHECK(st == FR_OK, "detok: %s", fr_last_error());
        FUZZ_CHECK(valid_utf8((const uint8_t *)s, l), "a streamed piece is not valid UTF-8");
        FUZZ_CHECK(!exact || (at + l <= len && memcmp(text + at, s, l) == 0), "the streamed pieces differ from the decode");
        at += l;
    }
    FUZZ_CHECK(!exact || at == len, "the streamed pieces are shorter than the decode");
    fr_detok_free(&d);
    free(text);
}

static void encode_and_check(const fr_tokenizer *t, const char *s, size_t n, int expect_ok)
{
    for (int special = 0; special < 2; special++) {
        int *ids = (int *)&special;
        size_t m = 1;
        fr_status st = fr_tokenizer_encode(t, s, n, special, &ids, &m);
        if (!expect_ok) {
            FUZZ_CHECK(st == FR_EINVAL && !ids && !m, "invalid UTF-8 not refused (status %d)", (int)st);
            FUZZ_CHECK(strstr(fr_last_error(), "UTF-8"), "message \"%s\"", fr_last_error());
            return;
        }
        FUZZ_CHECK(st == FR_OK, "encode of valid text failed: %s", fr_last_error());
        check_ids(t, ids, m);
        free(ids);
    }
}

static void fuzz_json(const uint8_t *data, size_t size)
{
    fr_tokenizer *t = (fr_tokenizer *)1;
    fr_status st = fr_tokenizer_from_json((const char *)data, size, NULL, 0, "fuzz.json", &t);
    if (st != FR_OK) {
        FUZZ_CHECK(!t && fr_last_error()[0], "a refused tokenizer left a pointer or no message");
        return;
    }
    static const char text[] = "Hello wörld 123 <s> \xF0\x9F\x98\x80  \t\n";
    encode_and_check(t, text, sizeof text - 1, 1);
    fr_tokenizer_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t mode = data[0] % 3;
    data++;
    size--;
    if (mode == 2) {
        fuzz_json(data, size);
        return 0;
    }
    char *text = malloc(size / 3 * 4 + size + 1);
    size_t n = 0;
    if (mode == 0) {
        memcpy(text, data, size);
        n = size;
    } else {
        for (size_t i = 0; i + 3 <= size; i += 3) {
            uint32_t cp = ((uint32_t)data[i] << 16 | (uint32_t)data[i + 1] << 8 | data[i + 2]) % 0x110000;
            if (cp >= 0xD800 && cp <= 0xDFFF) cp += 0x800;
            unsigned char *o = (unsigned char *)text + n;
            if (cp < 0x80) { o[0] = (unsigned char)cp; n += 1; }
            else if (cp < 0x800) { o[0] = (unsigned char)(0xC0 | cp >> 6); o[1] = (unsigned char)(0x80 | (cp & 0x3F)); n += 2; }
            else if (cp < 0x10000) {
                o[0] = (unsigned char)(0xE0 | cp >> 12); o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                o[2] = (unsigned char)(0x80 | (cp & 0x3F)); n += 3;
            } else {
                o[0] = (unsigned char)(0xF0 | cp >> 18); o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
                o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (unsigned char)(0x80 | (cp & 0x3F)); n += 4;
            }
        }
    }
    int ok = valid_utf8((const uint8_t *)text, n);
    FUZZ_CHECK(mode == 0 || ok, "the code point writer made invalid UTF-8");
    for (int i = 0; i < n_toks; i++) encode_and_check(toks[i], text, n, ok);
    free(text);
    return 0;
}
