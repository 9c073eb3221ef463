/* The protocol's text keys (docs/protocol.md, generate's prompt_text,
 * add_special_tokens, stop, include_stop_str_in_output, return_text; the
 * text of tokens and done, done's stop_str and prompt_token_ids,
 * hello_reply's tokenizer): encoded and decoded back, sent only when they
 * say something (so a request without them is the message it always was),
 * and every refusal of a malformed one, by the encoder and the decoder. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/protocol.h"
#include "protocol_samples.h"
#include "test_util.h"

static void test_generate_text_keys(void **state)
{
    (void)state;
    char text[] = "caf\xC3\xA9 \0 and a NUL";   /* NUL is text too */
    char *stops[] = {"</answer>", "\n\n", "\xE2\x9C\x85"};
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_GENERATE);
    fr_msg_generate *g = &m.u.generate;
    g->request_id = 9;
    g->prompt_text = text;
    g->prompt_text_len = sizeof text - 1;
    g->has_add_special_tokens = 1;
    g->add_special_tokens = 0;
    g->stop = stops;
    g->n_stop = 3;
    g->include_stop_str_in_output = 1;
    g->return_text = 1;
    g->keep_special_tokens = 1;
    fr_test_round_trip(&m, &d, NULL);
    const fr_msg_generate *e = &d.u.generate;
    assert_null(e->prompt);
    assert_int_equal(e->n_prompt, 0);
    assert_int_equal(e->prompt_text_len, sizeof text - 1);
    assert_memory_equal(e->prompt_text, text, sizeof text - 1);
    assert_int_equal(e->has_add_special_tokens, 1);
    assert_int_equal(e->add_special_tokens, 0);
    assert_int_equal(e->n_stop, 3);
    for (int i = 0; i < 3; i++) assert_string_equal(e->stop[i], stops[i]);
    assert_int_equal(e->include_stop_str_in_output, 1);
    assert_int_equal(e->return_text, 1);
    assert_int_equal(e->keep_special_tokens, 1);
    fr_msg_free(&d);

    /* Without them a generate is the message it was: none of the keys is sent. */
    int prompt[] = {256, 7};
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.request_id = 1;
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 2;
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_OK);
    const char *keys[] = {"prompt_text", "add_special_tokens", "stop", "include_stop", "return_text", "skip_special"};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) assert_null(memmem(data, len, keys[k], strlen(keys[k])));
    assert_int_equal(fr_msg_decode(data, len, &d), FR_OK);
    assert_int_equal(d.u.generate.add_special_tokens, 1);   /* absent: the tokenizer's special tokens */
    assert_int_equal(d.u.generate.has_add_special_tokens, 0);
    assert_null(d.u.generate.stop);
    assert_null(d.u.generate.prompt_text);
    assert_int_equal(d.u.generate.keep_special_tokens, 0);   /* absent: skipped, as vLLM's default */
    fr_msg_free(&d);
    free(data);
}

static void test_results_text_keys(void **state)
{
    (void)state;
    int ids[] = {5, 6};
    float lps[] = {-0.5f, -1.0f};
    uint64_t wv[] = {0, 0};
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_TOKENS);
    m.u.tokens = (fr_msg_tokens){.request_id = 3, .sample = 1, .start = 4, .n = 2, .token_ids = ids, .logprobs = lps,
                                 .weight_versions = wv, .has_text = 1, .text = "", .text_len = 0};
    fr_test_round_trip(&m, &d, NULL);   /* a delta whose text is still held back: "" */
    assert_int_equal(d.u.tokens.has_text, 1);
    assert_int_equal(d.u.tokens.text_len, 0);
    fr_msg_free(&d);
    m.u.tokens.has_text = 0;
    m.u.tokens.text = NULL;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.tokens.has_text, 0);
    assert_null(d.u.tokens.text);
    fr_msg_free(&d);

    int prompt_ids[] = {256, 104, 105};
    fr_msg_init(&m, FR_MSG_DONE);
    m.u.done = (fr_msg_done){.request_id = 3, .group_id = 3, .sample = 1, .finish_reason = FR_WIRE_STOP, .n_tokens = 6,
                             .n_prompt = 3, .total_ms = 1.0, .has_text = 1, .text = "hi \xE2\x9C\x85", .text_len = 6,
                             .stop_str = "\n\n", .prompt_token_ids = prompt_ids, .n_prompt_token_ids = 3};
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.done.has_text, 1);
    assert_int_equal(d.u.done.text_len, 6);
    assert_string_equal(d.u.done.text, "hi \xE2\x9C\x85");
    assert_string_equal(d.u.done.stop_str, "\n\n");
    assert_int_equal(d.u.done.n_prompt_token_ids, 3);
    assert_memory_equal(d.u.done.prompt_token_ids, prompt_ids, sizeof prompt_ids);
    fr_msg_free(&d);

    fr_sample_hello_reply(&m);
    fr_msg_hello_reply *h = &m.u.hello_reply;
    fr_test_round_trip(&m, &d, NULL);
    assert_string_equal(d.u.hello_reply.tokenizer, "");   /* none: the key is not sent */
    snprintf(h->tokenizer, sizeof h->tokenizer, "byte-level");
    fr_test_round_trip(&m, &d, NULL);
    assert_string_equal(d.u.hello_reply.tokenizer, "byte-level");
}

/* The encoder refuses what the decoder would. */
static void test_encode_refuses(void **state)
{
    (void)state;
    int prompt[] = {1};
    char *data;
    size_t len;
    fr_msg m;
    char *empty[] = {"ok", ""}, *bad_utf8[] = {"\xC3("}, *many[FR_PROTO_MAX_STOP + 1];
    for (int i = 0; i <= FR_PROTO_MAX_STOP; i++) many[i] = "x";
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 1;
    m.u.generate.prompt_text = "x";
    m.u.generate.prompt_text_len = 1;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("give \"prompt\" or \"prompt_text\", not both");
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.prompt_text = "x";
    m.u.generate.prompt_text_len = 0;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"prompt_text\" is empty");
    m.u.generate.prompt_text = "\xFF";
    m.u.generate.prompt_text_len = 1;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"prompt_text\" is not valid UTF-8");
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 1;
    m.u.generate.has_add_special_tokens = 1;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"add_special_tokens\" goes with \"prompt_text\"");
    m.u.generate.has_add_special_tokens = 0;
    m.u.generate.stop = empty;
    m.u.generate.n_stop = 2;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"stop[1]\" is empty");
    m.u.generate.stop = bad_utf8;
    m.u.generate.n_stop = 1;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"stop[0]\" is not valid UTF-8");
    m.u.generate.stop = many;
    m.u.generate.n_stop = FR_PROTO_MAX_STOP + 1;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"stop\" must hold 1 to 32 strings, got 33");

    fr_msg_init(&m, FR_MSG_DONE);
    m.u.done = (fr_msg_done){.finish_reason = FR_WIRE_LENGTH, .total_ms = 1, .stop_str = "x"};
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"stop_str\" comes only with finish_reason stop");
    int ids[] = {1, 2};
    m.u.done = (fr_msg_done){.finish_reason = FR_WIRE_STOP, .total_ms = 1, .n_prompt = 3, .prompt_token_ids = ids,
                             .n_prompt_token_ids = 2};
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"prompt_token_ids\" must hold n_prompt = 3 ids, got 2");
}

/* A generate's frame 0 from its parts: request_id 1, then key/value pairs
 * packed by the caller's function. */
typedef void (*packer_fn)(msgpack_packer *pk);

static fr_status decode_generate(int n_extra, packer_fn extra)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3 + (size_t)n_extra);
    msgpack_pack_str_with_body(&pk, "type", 4);
    msgpack_pack_str_with_body(&pk, "generate", 8);
    msgpack_pack_str_with_body(&pk, "v", 1);
    msgpack_pack_uint64(&pk, 1);
    msgpack_pack_str_with_body(&pk, "request_id", 10);
    msgpack_pack_uint64(&pk, 1);
    extra(&pk);
    fr_msg d;
    fr_status st = fr_msg_decode(sb.data, sb.size, &d);
    if (!st) fr_msg_free(&d);
    msgpack_sbuffer_destroy(&sb);
    return st;
}

static void key(msgpack_packer *pk, const char *k) { msgpack_pack_str_with_body(pk, k, strlen(k)); }
static void text_kv(msgpack_packer *pk, const char *k, const char *v, size_t n)
{
    key(pk, k);
    msgpack_pack_str_with_body(pk, v, n);
}
static void prompt_ids(msgpack_packer *pk)
{
    key(pk, "prompt");
    msgpack_pack_array(pk, 1);
    msgpack_pack_int(pk, 3);
}

static void both_prompts(msgpack_packer *pk)
{
    prompt_ids(pk);
    text_kv(pk, "prompt_text", "hi", 2);
}
static void no_prompt(msgpack_packer *pk) { key(pk, "n"), msgpack_pack_int(pk, 1); }
static void empty_text(msgpack_packer *pk) { text_kv(pk, "prompt_text", "", 0); }
static void text_not_str(msgpack_packer *pk) { key(pk, "prompt_text"), msgpack_pack_int(pk, 5); }
static void stop_not_array(msgpack_packer *pk)
{
    prompt_ids(pk);
    text_kv(pk, "stop", "\n", 1);
}
static void stop_empty_array(msgpack_packer *pk)
{
    prompt_ids(pk);
    key(pk, "stop");
    msgpack_pack_array(pk, 0);
}
static void stop_with_nul(msgpack_packer *pk)
{
    prompt_ids(pk);
    key(pk, "stop");
    msgpack_pack_array(pk, 1);
    msgpack_pack_str_with_body(pk, "a\0b", 3);
}
static void stop_too_long(msgpack_packer *pk)
{
    static char s[FR_PROTO_MAX_STOP_BYTES + 1];
    memset(s, 'a', sizeof s);
    prompt_ids(pk);
    key(pk, "stop");
    msgpack_pack_array(pk, 1);
    msgpack_pack_str_with_body(pk, s, sizeof s);
}
static void ids_with_special_flag(msgpack_packer *pk)
{
    prompt_ids(pk);
    key(pk, "add_special_tokens");
    msgpack_pack_false(pk);
}
static void return_text_not_bool(msgpack_packer *pk)
{
    prompt_ids(pk);
    key(pk, "return_text");
    msgpack_pack_int(pk, 1);
}
static void nil_prompt_and_text(msgpack_packer *pk)
{
    key(pk, "prompt");
    msgpack_pack_nil(pk);
    text_kv(pk, "prompt_text", "\xE4\xBD\xA0\0", 4);
}

static void test_decode_refuses(void **state)
{
    (void)state;
    struct {
        int n;
        packer_fn fn;
        const char *msg;
    } cases[] = {
        {2, both_prompts, "give \"prompt\" or \"prompt_text\", not both"},
        {1, no_prompt, "missing key \"prompt\""},
        {1, empty_text, "\"prompt_text\" is empty"},
        {1, text_not_str, "\"prompt_text\" must be a string, got an integer"},
        {2, stop_not_array, "\"stop\" must be an array"},
        {2, stop_empty_array, "\"stop\" must hold 1 to 32 strings, got 0"},
        {2, stop_with_nul, "\"stop[0]\" holds a NUL byte"},
        {2, stop_too_long, "\"stop[0]\" is 1025 bytes, the limit is 1024"},
        {2, ids_with_special_flag, "\"add_special_tokens\" goes with \"prompt_text\""},
        {2, return_text_not_bool, "\"return_text\" must be a boolean"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        assert_int_equal(decode_generate(cases[i].n, cases[i].fn), FR_EFORMAT);
        fr_test_error_has(cases[i].msg);
    }
    assert_int_equal(decode_generate(2, nil_prompt_and_text), FR_OK);   /* nil is absent */
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_generate_text_keys),
             cmocka_unit_test(test_results_text_keys),
             cmocka_unit_test(test_encode_refuses),
             cmocka_unit_test(test_decode_refuses))
