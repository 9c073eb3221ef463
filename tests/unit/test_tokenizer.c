/* The tokenizer's loading and API: what it refuses and how it says so,
 * invalid UTF-8, tokenizer_config.json, the lookups, and BPE on small
 * hand-written tokenizers whose ids are known by construction. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/tokenizer_util.h"
#include "tokenizer/tok_internal.h"
#include "tokenizer/tok_utf8.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"

/* A byte-level BPE tokenizer.json: the 256 byte characters as ids 0..255,
 * then `extra` (a JSON fragment of more "token": id entries, may be ""),
 * the merges, and the rest of the top level (components, added tokens). */
static char *byte_level_json(const char *extra, const char *merges, const char *top)
{
    fr_buf b = {0};
    fr_buf_printf(&b, "{\"version\": \"1.0\", %s \"model\": {\"type\": \"BPE\", \"vocab\": {", top);
    for (int i = 0; i < 256; i++) {
        char c[4];
        int n = tok_utf8_put(tok_byte_char((unsigned char)i), c);
        if (c[0] == '"' || c[0] == '\\') fr_buf_printf(&b, "%s\"\\%c\": %d", i ? ", " : "", c[0], i);
        else fr_buf_printf(&b, "%s\"%.*s\": %d", i ? ", " : "", n, c, i);
    }
    fr_buf_printf(&b, "%s%s}, \"merges\": [%s]}}", *extra ? ", " : "", extra, merges);
    assert_false(b.failed);
    return b.data;
}

static fr_tokenizer *load_json(const char *json)
{
    fr_tokenizer *t = NULL;
    if (fr_tokenizer_from_json(json, strlen(json), NULL, 0, "test.json", &t) != FR_OK)
        fail_msg("load: %s", fr_last_error());
    return t;
}

static void expect_refused(const char *json, fr_status want, const char *needle)
{
    fr_tokenizer *t = (fr_tokenizer *)1;
    fr_status st = fr_tokenizer_from_json(json, strlen(json), NULL, 0, "test.json", &t);
    if (st != want) fail_msg("status %d (%s), want %d, for %.200s", st, fr_last_error(), want, json);
    assert_null(t);
    if (!strstr(fr_last_error(), needle)) fail_msg("message \"%s\" does not name \"%s\"", fr_last_error(), needle);
    if (!strstr(fr_last_error(), "test.json")) fail_msg("message \"%s\" does not name the file", fr_last_error());
}

/* The byte-level tokenizer with a component replaced (top: "\"key\": value,"). */
static void expect_component_refused(const char *top, fr_status want, const char *needle)
{
    char *json = byte_level_json("", "", top);
    expect_refused(json, want, needle);
    free(json);
}

static void test_refuses_unsupported_components(void **state)
{
    (void)state;
    expect_refused("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", FR_EUNSUPPORTED, "WordPiece");
    expect_refused("{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}", FR_EUNSUPPORTED, "Unigram");
    expect_refused("{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}}", FR_EUNSUPPORTED, "WordLevel");
    expect_refused("{\"model\": {\"vocab\": [[\"a\", 0.0]]}}", FR_EUNSUPPORTED, "without a type");
    expect_component_refused("\"normalizer\": {\"type\": \"Lowercase\"},", FR_EUNSUPPORTED, "normalizer type Lowercase");
    expect_component_refused("\"normalizer\": {\"type\": \"BertNormalizer\"},", FR_EUNSUPPORTED, "BertNormalizer");
    expect_component_refused("\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}, "
                             "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"\"}]},",
                             FR_EUNSUPPORTED, "normalizer.normalizers[1]: normalizer type Precompiled");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"Whitespace\"},", FR_EUNSUPPORTED, "pre-tokenizer type Whitespace");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\"}, "
                             "{\"type\": \"UnicodeScripts\"}]},",
                             FR_EUNSUPPORTED, "pre_tokenizer.pretokenizers[1]: pre-tokenizer type UnicodeScripts");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"BertPreTokenizer\"},", FR_EUNSUPPORTED, "BertPreTokenizer");
    expect_component_refused("\"decoder\": {\"type\": \"WordPiece\", \"prefix\": \"##\"},", FR_EUNSUPPORTED, "decoder type WordPiece");
    expect_component_refused("\"decoder\": {\"type\": \"CTC\"},", FR_EUNSUPPORTED, "decoder type CTC");
    expect_component_refused("\"post_processor\": {\"type\": \"Magic\"},", FR_EUNSUPPORTED, "post-processor type Magic");
    expect_component_refused("\"truncation\": {\"max_length\": 512},", FR_EUNSUPPORTED, "truncation");
    expect_component_refused("\"padding\": {\"strategy\": \"BatchLongest\"},", FR_EUNSUPPORTED, "padding");
    expect_refused("{\"version\": \"2.0\", \"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}",
                   FR_EUNSUPPORTED, "version 2.0");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {}, \"merges\": []}}", FR_EUNSUPPORTED,
                   "dropout");
}

static void test_refuses_malformed_files(void **state)
{
    (void)state;
    expect_refused("{\"model\": ", FR_EFORMAT, "not valid JSON");
    expect_refused("[1, 2]", FR_EFORMAT, "not a JSON object");
    /* a token of bytes that are not UTF-8 would come back out of decode */
    expect_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"\xff\xfe\": 1}, \"merges\": []}}",
                   FR_EFORMAT, "not UTF-8 (byte 45)");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a c\"]}}",
                   FR_EFORMAT, "merges[0]: token \"c\" is not in the vocabulary");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}",
                   FR_EFORMAT, "the merged token \"ab\" is not in the vocabulary");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a a a\"]}}", FR_EFORMAT,
                   "not two tokens");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -4}, \"merges\": []}}", FR_EFORMAT, "vocab[\"a\"]");
    expect_refused("{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
                   FR_EFORMAT, "unk_token \"<unk>\"");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, "
                             "\"behavior\": \"Isolated\", \"invert\": false},", FR_EFORMAT, "does not compile");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, "
                             "\"behavior\": \"Sideways\", \"invert\": false},", FR_EFORMAT, "behavior");
    expect_component_refused("\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"[a&&b]\"}, "
                             "\"behavior\": \"Isolated\", \"invert\": false},", FR_EUNSUPPORTED, "&&");
    expect_component_refused("\"added_tokens\": [{\"id\": 300, \"content\": 5}],", FR_EFORMAT, "added_tokens[0]");
    expect_component_refused("\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
                             "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}], \"special_tokens\": {}},",
                             FR_EFORMAT, "<s>");
    /* A template id beyond every token (a fuzzer's find: <s> is added as id 256, its template says 300). */
    expect_component_refused("\"added_tokens\": [{\"id\": 5, \"content\": \"<s>\", \"special\": true}], "
                             "\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
                             "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", "
                             "\"type_id\": 0}}], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [300], "
                             "\"tokens\": [\"<s>\"]}}},",
                             FR_EFORMAT, "its template adds id 300");
    expect_component_refused("\"post_processor\": {\"type\": \"RobertaProcessing\", \"cls\": [\"<s>\", 0], "
                             "\"sep\": [\"</s>\", 999]},", FR_EFORMAT, "its template adds id 999");

    fr_tokenizer *t = (fr_tokenizer *)1;
    assert_int_equal(fr_tokenizer_load("tests/data/tokenizer/no-such-tokenizer", &t), FR_EIO);
    assert_null(t);
    assert_non_null(strstr(fr_last_error(), "no-such-tokenizer"));
    assert_int_equal(fr_tokenizer_load(NULL, &t), FR_EINVAL);
    assert_int_equal(fr_tokenizer_load("x", NULL), FR_EINVAL);
}

#define BYTE_LEVEL_PARTS "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, " \
                         "\"use_regex\": true}, \"decoder\": {\"type\": \"ByteLevel\"},"

static void test_invalid_utf8(void **state)
{
    (void)state;
    char *json = byte_level_json("", "", BYTE_LEVEL_PARTS);
    fr_tokenizer *t = load_json(json);
    free(json);
    static const struct { const char *text; size_t at; } bad[] = {
        {"ok \xC0\xAF", 3},             /* overlong '/' */
        {"ab\xED\xA0\x80", 2},          /* a surrogate */
        {"\xE4\xBD", 0},                /* cut short */
        {"x\x80y", 1},                  /* a stray continuation byte */
        {"\xF4\x90\x80\x80", 0},        /* past U+10FFFF */
        {"\xFF", 0},
        {"caf\xC3\xA9 \xF0\x9F\x98", 6},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int *ids = (int *)1;
        size_t n = 7;
        assert_int_equal(fr_tokenizer_encode(t, bad[i].text, strlen(bad[i].text), 0, &ids, &n), FR_EINVAL);
        assert_null(ids);
        assert_int_equal(n, 0);
        char want[32];
        snprintf(want, sizeof want, "byte %zu", bad[i].at);
        if (!strstr(fr_last_error(), "UTF-8") || !strstr(fr_last_error(), want))
            fail_msg("text %zu: message \"%s\" lacks UTF-8 / %s", i, fr_last_error(), want);
    }
    /* The largest scalar values and an embedded NUL are fine. */
    const char good[] = "\xF4\x8F\xBF\xBF\xEF\xBF\xBF\xED\x9F\xBF a\0b";
    int *ids;
    size_t n;
    assert_int_equal(fr_tokenizer_encode(t, good, sizeof good - 1, 0, &ids, &n), FR_OK);
    assert_int_equal(n, sizeof good - 1);   /* no merges: one id per byte */
    char *back;
    size_t bl;
    assert_int_equal(fr_tokenizer_decode(t, ids, n, 0, &back, &bl), FR_OK);
    assert_int_equal(bl, sizeof good - 1);
    assert_memory_equal(back, good, bl);
    free(back);
    free(ids);
    fr_tokenizer_free(&t);
}

static void test_api_edges(void **state)
{
    (void)state;
    char *json = byte_level_json("\"<s>\": 256", "", BYTE_LEVEL_PARTS "\"added_tokens\": [{\"id\": 256, \"content\": \"<s>\", "
                                 "\"special\": true, \"normalized\": false}], \"post_processor\": {\"type\": "
                                 "\"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\", "
                                 "\"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], "
                                 "\"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [256], \"tokens\": [\"<s>\"]}}},");
    fr_tokenizer *t = load_json(json);
    free(json);
    int *ids = NULL;
    size_t n = 9;
    assert_int_equal(fr_tokenizer_encode(t, "", 0, 0, &ids, &n), FR_OK);
    assert_int_equal(n, 0);
    assert_null(ids);
    assert_int_equal(fr_tokenizer_encode(t, NULL, 0, 1, &ids, &n), FR_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 256);
    free(ids);
    assert_int_equal(fr_tokenizer_encode(t, NULL, 3, 0, &ids, &n), FR_EINVAL);
    assert_int_equal(fr_tokenizer_encode(NULL, "a", 1, 0, &ids, &n), FR_EINVAL);
    assert_int_equal(fr_tokenizer_encode(t, "a", 1, 0, NULL, &n), FR_EINVAL);

    assert_int_equal(fr_tokenizer_vocab_size(t), 257);
    assert_int_equal(fr_tokenizer_token_id(t, "<s>"), 256);
    assert_int_equal(fr_tokenizer_token_id(t, "\xC4\xA0"), 32);   /* 'Ġ' is the space byte */
    assert_int_equal(fr_tokenizer_token_id(t, "nope"), -1);
    assert_true(fr_tokenizer_is_special(t, 256));
    assert_false(fr_tokenizer_is_special(t, 32));
    assert_false(fr_tokenizer_is_special(t, 999));
    size_t len;
    const char *s = fr_tokenizer_id_token(t, 256, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(s, "<s>", 3);
    assert_null(fr_tokenizer_id_token(t, 257, &len));
    assert_null(fr_tokenizer_id_token(t, -1, &len));
    assert_int_equal(fr_tokenizer_bos_id(t), -1);   /* no tokenizer_config.json */

    /* Unknown ids are skipped in decoding, as tokenizers does. */
    int odd[] = {256, 'h', 99999, -3, 'i'};
    char *text;
    assert_int_equal(fr_tokenizer_decode(t, odd, 5, 0, &text, &len), FR_OK);
    assert_string_equal(text, "<s>hi");
    free(text);
    assert_int_equal(fr_tokenizer_decode(t, odd, 5, 1, &text, &len), FR_OK);
    assert_string_equal(text, "hi");
    free(text);
    assert_int_equal(fr_tokenizer_decode(t, NULL, 0, 0, &text, &len), FR_OK);
    assert_string_equal(text, "");
    assert_int_equal(len, 0);
    free(text);
    assert_int_equal(fr_tokenizer_decode(t, NULL, 2, 0, &text, &len), FR_EINVAL);
    fr_tokenizer_free(&t);
    fr_tokenizer_free(&t);   /* a second free is harmless */
    fr_tokenizer_free(NULL);
}

/* merges a a -> aa, aa aa -> aaaa: a run of n a's is n/4 "aaaa", then the rest. */
static void test_bpe_long_runs(void **state)
{
    (void)state;
    char *json = byte_level_json("\"aa\": 256, \"aaaa\": 257", "\"a a\", \"aa aa\"", BYTE_LEVEL_PARTS);
    fr_tokenizer *t = load_json(json);
    free(json);
    static const size_t lens[] = {1, 2, 3, 5, 47, 48, 49, 50, 1001, 100003};
    for (size_t k = 0; k < sizeof lens / sizeof *lens; k++) {
        size_t L = lens[k];
        char *s = malloc(L);
        memset(s, 'a', L);
        int *ids;
        size_t n;
        assert_int_equal(fr_tokenizer_encode(t, s, L, 0, &ids, &n), FR_OK);
        size_t want = L / 4 + (L % 4) / 2 + L % 2;
        if (n != want) fail_msg("%zu a's: %zu ids, want %zu", L, n, want);
        for (size_t i = 0; i < L / 4; i++) assert_int_equal(ids[i], 257);
        if (L % 4 >= 2) assert_int_equal(ids[L / 4], 256);
        if (L % 2) assert_int_equal(ids[n - 1], 'a');
        free(ids);
        free(s);
    }
    fr_tokenizer_free(&t);
}

/* SentencePiece style: characters outside the vocabulary become <0xNN>
 * tokens, or the unknown token (fused) when a byte token is missing too. */
static void test_byte_fallback_and_unk(void **state)
{
    (void)state;
    const char *json =
        "{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": true, \"byte_fallback\": true, "
        "\"vocab\": {\"<unk>\": 0, \"a\": 1, \"<0xC3>\": 2, \"<0xA9>\": 3, \"b\": 4}, \"merges\": []},"
        " \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}]}}";
    fr_tokenizer *t = load_json(json);
    int *ids;
    size_t n;
    /* é is C3 A9 (both there); 你 (E4 BD A0) and 好 have none: one fused <unk>. */
    const char *text = "a\xC3\xA9" "b\xE4\xBD\xA0\xE5\xA5\xBD" "a";
    assert_int_equal(fr_tokenizer_encode(t, text, strlen(text), 0, &ids, &n), FR_OK);
    int want[] = {1, 2, 3, 4, 0, 1};
    assert_int_equal(n, 6);
    assert_memory_equal(ids, want, sizeof want);
    char *back;
    size_t bl;
    assert_int_equal(fr_tokenizer_decode(t, ids, n, 0, &back, &bl), FR_OK);
    assert_string_equal(back, "a\xC3\xA9" "b<unk>a");
    free(back);
    free(ids);
    /* A lone <0xC3> decodes to U+FFFD, one per byte of the broken run. */
    int broken[] = {2, 2, 1};
    assert_int_equal(fr_tokenizer_decode(t, broken, 3, 0, &back, &bl), FR_OK);
    assert_string_equal(back, "\xEF\xBF\xBD\xEF\xBF\xBD" "a");
    free(back);
    fr_tokenizer_free(&t);
}

/* tokenizer_config.json: bos and eos names, and the template transformers
 * builds for Llama-class tokenizers. */
static void test_config(void **state)
{
    (void)state;
    char *json = byte_level_json("\"<s>\": 256, \"</s>\": 257", "",
                                 "\"added_tokens\": [{\"id\": 256, \"content\": \"<s>\", \"special\": true, "
                                 "\"normalized\": false}, {\"id\": 257, \"content\": \"</s>\", \"special\": true, "
                                 "\"normalized\": false}],");
    static const struct { const char *config; int bos, eos, n, first, last; } cases[] = {
        {"{\"bos_token\": \"<s>\", \"eos_token\": {\"content\": \"</s>\"}}", 256, 257, 1, 'x', 'x'},
        {"{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"tokenizer_class\": \"LlamaTokenizerFast\"}", 256, 257, 2,
         256, 'x'},
        {"{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"tokenizer_class\": \"LlamaTokenizer\", "
         "\"add_bos_token\": false, \"add_eos_token\": true}", 256, 257, 2, 'x', 257},
        {"{\"bos_token\": null, \"eos_token\": \"</s>\", \"tokenizer_class\": \"Qwen2TokenizerFast\"}", -1, 257, 1, 'x',
         'x'},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        fr_tokenizer *t;
        assert_int_equal(fr_tokenizer_from_json(json, strlen(json), cases[i].config, strlen(cases[i].config), "c.json",
                                                &t), FR_OK);
        assert_int_equal(fr_tokenizer_bos_id(t), cases[i].bos);
        assert_int_equal(fr_tokenizer_eos_id(t), cases[i].eos);
        int *ids;
        size_t n;
        assert_int_equal(fr_tokenizer_encode(t, "x", 1, 1, &ids, &n), FR_OK);
        assert_int_equal(n, cases[i].n);
        assert_int_equal(ids[0], cases[i].first);
        assert_int_equal(ids[n - 1], cases[i].last);
        free(ids);
        fr_tokenizer_free(&t);
    }
    const char *bad = "{\"eos_token\": \"</s>\", \"tokenizer_class\": \"LlamaTokenizerFast\"}";
    fr_tokenizer *t = (fr_tokenizer *)1;
    assert_int_equal(fr_tokenizer_from_json(json, strlen(json), bad, strlen(bad), "c.json", &t), FR_EFORMAT);
    assert_null(t);
    assert_non_null(strstr(fr_last_error(), "add_bos_token"));
    assert_int_equal(fr_tokenizer_from_json(json, strlen(json), "{", 1, "c.json", &t), FR_EFORMAT);
    assert_non_null(strstr(fr_last_error(), "tokenizer_config.json"));
    free(json);
}

/* The checkpoints' folders: their configs' bos and eos, and DeepSeek-V3's
 * beginning-of-sentence token with special tokens (transformers adds it). */
static void test_checkpoint_configs(void **state)
{
    (void)state;
    fr_tokenizer *q = fr_test_tokenizer_folder("shared:qwen3");
    fr_tokenizer *d = fr_test_tokenizer_folder("shared:deepseek_v3");
    if (!q || !d) {
        fr_tokenizer_free(&q);
        fr_tokenizer_free(&d);
        skip();
    }
    assert_int_equal(fr_tokenizer_token_id(q, "<|im_end|>"), 151645);
    assert_int_equal(fr_tokenizer_eos_id(q), 151645);
    assert_int_equal(fr_tokenizer_bos_id(q), -1);
    assert_int_equal(fr_tokenizer_vocab_size(q), 151669);
    assert_int_equal(fr_tokenizer_bos_id(d), 0);
    assert_int_equal(fr_tokenizer_eos_id(d), 1);
    int *ids;
    size_t n;
    assert_int_equal(fr_tokenizer_encode(d, "Hi", 2, 1, &ids, &n), FR_OK);
    assert_true(n >= 2);
    assert_int_equal(ids[0], 0);
    free(ids);
    assert_int_equal(fr_tokenizer_encode(q, "Hi", 2, 1, &ids, &n), FR_OK);
    assert_int_equal(n, 1);   /* Qwen's post-processor adds nothing */
    free(ids);
    fr_tokenizer_free(&q);
    fr_tokenizer_free(&d);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_refuses_unsupported_components),
             cmocka_unit_test(test_refuses_malformed_files),
             cmocka_unit_test(test_invalid_utf8),
             cmocka_unit_test(test_api_edges),
             cmocka_unit_test(test_bpe_long_runs),
             cmocka_unit_test(test_byte_fallback_and_unk),
             cmocka_unit_test(test_config),
             cmocka_unit_test(test_checkpoint_configs))
