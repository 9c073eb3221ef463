/* The HTTP API's JSON (trainer_bridge/http/): request bodies of /generate
 * and /v1/completions read into the protocol's fields (text prompts
 * encoded as the server encodes prompt_text, stop strings handed on as the
 * generate's stop), each bad body refused naming its field, and the
 * answers built from samples (SGLang's objects, OpenAI's completions and
 * stream chunks, a stop string named as both report it) read back as the
 * JSON they claim to be; the sampler's penalties and min_p on the CPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/sampler.h"
#include "trainer_bridge/http/http_internal.h"

/* Every test's state: the tokenizer serve gives a byte-level model
 * (app/cli_text.c). */
static int open_tokenizer(void **state)
{
    fr_tokenizer *t = NULL;
    if (fr_tokenizer_bytes(272, 256, 257, &t)) return -1;
    *state = t;
    return 0;
}

static int close_tokenizer(void **state)
{
    fr_tokenizer *t = *state;
    fr_tokenizer_free(&t);
    return 0;
}

static void test_generate_body(void **state)
{
    const fr_tokenizer *t = *state;
    http_gen g;
    const char *body = "{\"text\": \"ab\", \"rid\": \"r1\", \"return_logprob\": true, \"top_logprobs_num\": 3,"
                       "\"sampling_params\": {\"max_new_tokens\": 7, \"min_new_tokens\": 2, \"temperature\": 0.5,"
                       "\"top_k\": -1, \"top_p\": 0.9, \"min_p\": 0.1, \"stop\": \"xy\", \"stop_token_ids\": [5],"
                       "\"n\": 3, \"presence_penalty\": 0.5, \"frequency_penalty\": -0.5,"
                       "\"repetition_penalty\": 1.2, \"seed\": 9, \"skip_special_tokens\": false},"
                       "\"lora_path\": null, \"custom\": 1}";
    assert_int_equal(http_parse_generate(body, strlen(body), t, &g), FR_OK);
    assert_int_equal(g.n_prompts, 1);
    assert_int_equal(g.batch, 0);
    assert_int_equal(g.n_prompt[0], 3);
    assert_int_equal(g.prompt[0][0], 256);   /* BOS, then the bytes */
    assert_int_equal(g.prompt[0][2], 'b');
    assert_int_equal(g.n, 3);
    assert_int_equal(g.g.max_tokens, 7);
    assert_int_equal(g.g.min_tokens, 2);
    assert_int_equal(g.g.top_k, 0);
    assert_true(fabs(g.g.temperature - 0.5) < 1e-12 && fabs(g.g.min_p - 0.1) < 1e-12);
    assert_true(fabs(g.g.repetition_penalty - 1.2) < 1e-12 && fabs(g.g.frequency_penalty + 0.5) < 1e-12);
    assert_int_equal(g.g.has_seed, 1);
    assert_int_equal(g.g.n_stop, 1);   /* for the engine, which matches them */
    assert_string_equal(g.g.stop[0], "xy");
    assert_int_equal(g.g.include_stop_str_in_output, 0);
    assert_int_equal(g.g.n_stop_token_ids, 1);
    assert_int_equal(g.g.logprobs, 3);
    assert_string_equal(g.rid[0], "r1");
    http_gen_free(&g);

    const char *batch = "{\"input_ids\": [[1, 2], [3]], \"stream\": true, \"rid\": [\"a\", \"b\"]}";
    assert_int_equal(http_parse_generate(batch, strlen(batch), NULL, &g), FR_OK);
    assert_int_equal(g.batch, 1);
    assert_int_equal(g.n_prompts, 2);
    assert_int_equal(g.n_prompt[1], 1);
    assert_int_equal(g.stream, 1);
    assert_int_equal(g.g.logprobs, 0);   /* no return_logprob: none */
    http_gen_free(&g);

    /* SGLang's no_stop_trim keeps the stop string in the text: vLLM's include */
    const char *trim = "{\"text\": [\"a\", \"\\u00e9\"], \"sampling_params\": {\"stop\": [\"x\", \"\\n\\n\"], "
                       "\"no_stop_trim\": true}}";
    assert_int_equal(http_parse_generate(trim, strlen(trim), t, &g), FR_OK);
    assert_int_equal(g.g.n_stop, 2);
    assert_string_equal(g.g.stop[1], "\n\n");
    assert_int_equal(g.g.include_stop_str_in_output, 1);
    /* the prompt is what the server makes of prompt_text: BOS and the two bytes of U+00E9 */
    int *ids = NULL, n = 0;
    assert_int_equal(fr_bridge_encode_prompt(t, "\xC3\xA9", 2, 1, &ids, &n), FR_OK);
    assert_int_equal(g.n_prompt[1], n);
    assert_memory_equal(g.prompt[1], ids, sizeof(int) * (size_t)n);
    assert_int_equal(n, 3);
    free(ids);
    http_gen_free(&g);
}

/* Each body is refused (FR_EINVAL) with a message naming `field`. */
static void refused(const fr_tokenizer *t, int openai, const char *body, const char *field)
{
    http_gen g;
    fr_status st = openai ? http_parse_completions(body, strlen(body), t, &g) : http_parse_generate(body, strlen(body), t, &g);
    assert_int_equal(st, FR_EINVAL);
    if (!strstr(fr_last_error(), field)) fail_msg("%s: message '%s' lacks '%s'", body, fr_last_error(), field);
}

static void test_refusals(void **state)
{
    const fr_tokenizer *t = *state;
    refused(t, 0, "{not json", "JSON");
    refused(t, 0, "[1, 2]", "object");
    refused(t, 0, "{}", "text, input_ids");
    refused(t, 0, "{\"text\": \"a\", \"input_ids\": [1]}", "text, input_ids");
    refused(t, 0, "{\"text\": 5}", "text");
    refused(t, 0, "{\"input_ids\": [1, -2]}", "input_ids[1]");
    refused(t, 0, "{\"input_ids\": [[1], \"x\"]}", "input_ids[1]");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"temperature\": -1}}", "sampling_params.temperature");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"top_p\": 0}}", "sampling_params.top_p");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"max_new_tokens\": 0}}", "sampling_params.max_new_tokens");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"temprature\": 1}}", "sampling_params.temprature");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"regex\": \"a+\"}}", "sampling_params.regex");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"repetition_penalty\": 0}}", "repetition_penalty");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"stop\": [\"\"]}}", "sampling_params.stop[0]");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"stop\": 5}}", "sampling_params.stop");
    refused(t, 0, "{\"text\": \"a\", \"sampling_params\": {\"no_stop_trim\": 1}}", "sampling_params.no_stop_trim");
    refused(t, 1, "{\"prompt\": \"a\", \"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\",\"13\","
               "\"14\",\"15\",\"16\",\"17\",\"18\",\"19\",\"20\",\"21\",\"22\",\"23\",\"24\",\"25\",\"26\",\"27\",\"28\",\"29\",\"30\","
               "\"31\",\"32\",\"33\"]}",
            "at most 32");
    refused(t, 1, "{\"prompt\": \"a\", \"include_stop_str_in_output\": \"yes\"}", "include_stop_str_in_output");
    refused(t, 0, "{\"text\": [\"a\", \"b\"], \"rid\": \"one\"}", "rid");
    refused(t, 0, "{\"text\": \"a\", \"top_logprobs_num\": 21}", "top_logprobs_num");
    refused(t, 1, "{\"max_tokens\": 3}", "prompt");
    refused(t, 1, "{\"prompt\": \"a\", \"max_tokens\": 0}", "max_tokens");
    refused(t, 1, "{\"prompt\": \"a\", \"logprobs\": 21}", "logprobs");
    refused(t, 1, "{\"prompt\": \"a\", \"best_of\": 3}", "best_of");
    refused(t, 1, "{\"prompt\": \"a\", \"suffix\": \"z\"}", "suffix");
    refused(t, 1, "{\"prompt\": \"a\", \"presence_penalty\": 3}", "presence_penalty");
    /* no tokenizer: text is refused, ids are not */
    http_gen g;
    const char *text = "{\"text\": \"a\"}";
    assert_int_equal(http_parse_generate(text, strlen(text), NULL, &g), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "has none"));
}

static void test_completions_body(void **state)
{
    const fr_tokenizer *t = *state;
    http_gen g;
    const char *body = "{\"model\": \"m\", \"prompt\": [\"a\", \"bc\"], \"n\": 2, \"echo\": true, \"logprobs\": 1,"
                       "\"stream\": true, \"stream_options\": {\"include_usage\": true}, \"user\": \"u\", \"seed\": 3}";
    assert_int_equal(http_parse_completions(body, strlen(body), t, &g), FR_OK);
    assert_int_equal(g.n_prompts, 2);
    assert_int_equal(g.g.max_tokens, 16);   /* OpenAI's default */
    assert_int_equal(g.echo, 1);
    assert_int_equal(g.openai_logprobs, 1);
    assert_int_equal(g.g.prompt_logprobs, 1);   /* echo with logprobs: the prompt's too */
    assert_int_equal(g.include_usage, 1);
    assert_string_equal(g.prompt_text[1], "bc");
    http_gen_free(&g);
    const char *inc = "{\"prompt\": [1, 2], \"stop\": \"\\n\", \"include_stop_str_in_output\": true}";
    assert_int_equal(http_parse_completions(inc, strlen(inc), t, &g), FR_OK);
    assert_int_equal(g.g.n_stop, 1);
    assert_int_equal(g.g.include_stop_str_in_output, 1);
    http_gen_free(&g);
}

static http_sample sample_of(const int *tok, int n, const char *text, fr_wire_finish why)
{
    http_sample s;
    memset(&s, 0, sizeof s);
    float lp[8];
    uint64_t wv[8] = {0};
    for (int i = 0; i < n; i++) lp[i] = i == 0 ? -INFINITY : -0.5f * (float)i;
    assert_int_equal(http_sample_append(&s, tok, lp, wv, n), 0);
    fr_buf_put(&s.text, text, strlen(text));
    s.ended = 1;
    s.finish = why;
    s.has_seed = 1;
    s.seed = 42;
    return s;
}

static cJSON *parsed(const fr_buf *b)
{
    cJSON *j = cJSON_ParseWithLength(b->data, b->len);
    if (!j) fail_msg("not JSON: %.*s", (int)b->len, b->data);
    return j;
}

static void test_answers(void **state)
{
    const fr_tokenizer *t = *state;
    http_gen g;
    const char *body = "{\"input_ids\": [256, 97], \"return_logprob\": true, \"sampling_params\": {\"n\": 2}}";
    assert_int_equal(http_parse_generate(body, strlen(body), t, &g), FR_OK);
    const int tok[] = {104, 105, 257};
    http_sample s[2] = {sample_of(tok, 3, "hi\"\n\xff", FR_WIRE_STOP), sample_of(tok, 2, "hi", FR_WIRE_LENGTH)};
    s[1].sample = 1;
    http_view v = {.gen = &g, .s = s, .n_samples = 2, .tok = t, .model = "m", .id = "gen-1", .created = 1};
    fr_buf out = {0};
    http_answer_generate(&v, &out);
    cJSON *j = parsed(&out);
    assert_int_equal(cJSON_GetArraySize(j), 2);   /* n 2: a list */
    const cJSON *a = cJSON_GetArrayItem(j, 0), *meta = cJSON_GetObjectItem(a, "meta_info");
    assert_string_equal(cJSON_GetObjectItem(a, "text")->valuestring, "hi\"\n\xEF\xBF\xBD");   /* a stray byte: U+FFFD */
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(a, "output_ids")), 3);
    const cJSON *fin = cJSON_GetObjectItem(meta, "finish_reason");
    assert_string_equal(cJSON_GetObjectItem(fin, "type")->valuestring, "stop");
    assert_int_equal(cJSON_GetObjectItem(fin, "matched")->valueint, 257);
    const cJSON *lps = cJSON_GetObjectItem(meta, "output_token_logprobs");
    assert_true(cJSON_GetArrayItem(cJSON_GetArrayItem(lps, 0), 0)->valuedouble <= -9999.0);   /* -inf */
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetArrayItem(lps, 1), 1)->valueint, 105);
    assert_string_equal(cJSON_GetObjectItem(meta, "id")->valuestring, "gen-1-0");
    assert_int_equal(cJSON_GetObjectItem(meta, "completion_tokens")->valueint, 3);
    fin = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 1), "meta_info"), "finish_reason");
    assert_string_equal(cJSON_GetObjectItem(fin, "type")->valuestring, "length");
    cJSON_Delete(j);

    /* a stop string (the done's stop_str) is named where a stop id would be */
    s[0].matched = strdup("\n\n");
    out.len = 0;
    http_answer_generate(&v, &out);
    j = parsed(&out);
    fin = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 0), "meta_info"), "finish_reason");
    assert_string_equal(cJSON_GetObjectItem(fin, "matched")->valuestring, "\n\n");
    cJSON_Delete(j);

    g.api = API_OPENAI;
    out.len = 0;
    http_answer_completions(&v, &out);
    j = parsed(&out);
    const cJSON *ch = cJSON_GetObjectItem(j, "choices");
    assert_int_equal(cJSON_GetArraySize(ch), 2);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(ch, 1), "finish_reason")->valuestring, "length");
    const cJSON *c0 = cJSON_GetArrayItem(ch, 0);
    assert_string_equal(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "stop");
    assert_string_equal(cJSON_GetObjectItem(c0, "stop_reason")->valuestring, "\n\n");    /* vLLM's */
    assert_string_equal(cJSON_GetObjectItem(c0, "matched_stop")->valuestring, "\n\n");   /* SGLang's */
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "total_tokens")->valueint, 2 + 5);
    cJSON_Delete(j);

    /* stream chunks: deltas that join to the whole, then nothing */
    s[0].tok_sent = 0;
    out.len = 0;
    http_chunk_completions(&v, 0, &out);
    assert_true(out.len > 6 && !strncmp(out.data, "data: ", 6) && !strcmp(out.data + out.len - 2, "\n\n"));
    out.data[out.len - 2] = '\0';
    j = cJSON_Parse(out.data + 6);
    assert_non_null(j);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0),
                                                            "token_ids")), 3);
    cJSON_Delete(j);
    out.len = 0;
    http_chunk_completions(&v, 0, &out);
    assert_int_equal(out.len, 0);   /* its last chunk went out */
    fr_buf_free(&out);
    s[1].sample = 0;   /* the samples own no prompt log-probs here */
    for (int i = 0; i < 2; i++) http_sample_free(&s[i]);
    http_gen_free(&g);
}

static void test_penalties(void **state)
{
    (void)state;
    enum { V = 8 };
    fr_sampler *s;
    assert_int_equal(fr_sampler_new(V, &s), FR_OK);
    float logits[V] = {3, 2.9f, 1, 0.5f, 0, -1, -2, -3};
    const fr_sampling_params greedy = {.temperature = 0, .top_p = 1};
    const int out1[] = {0, 0};
    int tok;
    float lp, lp0;
    assert_int_equal(fr_sample(s, logits, &greedy, 0, 0, &tok, &lp0), FR_OK);
    assert_int_equal(tok, 0);
    /* token 0 generated twice: a frequency penalty of 0.1 (0.2 in all) moves the argmax to 1 */
    fr_sample_extras x = {.pen = {.frequency_penalty = 0.1f}, .output = out1, .n_output = 2};
    assert_int_equal(fr_sample_ex(s, logits, &greedy, 0, 0, &x, &tok, &lp), FR_OK);
    assert_int_equal(tok, 1);
    /* the reported log-prob is the unpenalized distribution's */
    float full[V];
    assert_int_equal(fr_log_softmax(logits, V, 0, full), FR_OK);
    assert_true(lp == full[1]);
    /* repetition penalty on a prompt token: 3 / 1.1 < 2.9 */
    const int prompt[] = {0};
    fr_sample_extras r = {.pen = {.repetition_penalty = 1.1f}, .prompt = prompt, .n_prompt = 1};
    assert_int_equal(fr_sample_ex(s, logits, &greedy, 0, 0, &r, &tok, &lp), FR_OK);
    assert_int_equal(tok, 1);
    /* presence penalty: once whatever the count */
    fr_sample_extras p = {.pen = {.presence_penalty = 0.05f}, .output = out1, .n_output = 2};
    assert_int_equal(fr_sample_ex(s, logits, &greedy, 0, 0, &p, &tok, &lp), FR_OK);
    assert_int_equal(tok, 0);   /* 3 - 0.05 > 2.9 */
    /* min_p 0.5 at temperature 1: only tokens 0 and 1 can be drawn */
    const fr_sampling_params hot = {.temperature = 1, .top_p = 1, .seed = 5};
    fr_sample_extras m = {.pen = {.min_p = 0.5f}};
    for (uint64_t step = 0; step < 200; step++) {
        assert_int_equal(fr_sample_ex(s, logits, &hot, 1, step, &m, &tok, &lp), FR_OK);
        assert_true(tok == 0 || tok == 1);
    }
    fr_sample_extras bad = {.pen = {.min_p = 1.5f}};
    assert_int_equal(fr_sample_ex(s, logits, &hot, 1, 0, &bad, &tok, &lp), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "min_p"));
    fr_sampler_destroy(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generate_body),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_completions_body),
        cmocka_unit_test(test_answers),
        cmocka_unit_test(test_penalties),
    };
    return cmocka_run_group_tests(tests, open_tokenizer, close_tokenizer);
}
