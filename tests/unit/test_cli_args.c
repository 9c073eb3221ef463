/* The command-line conventions (app/cli_parse.c, app/serve_flags.c,
 * base/log.c, fr_parse_ids): `--opt=value` and `--opt value` give the same
 * values, vLLM's aliases map to our options, unknown options, missing or
 * bad values and missing required options are usage errors (status 2)
 * whose message names the option and the reason, id lists with empty
 * entries are rejected, serve flags override a configuration, and log
 * lines carry a timestamp and a level and respect the level. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "app/cli.h"
#include "app/serve_flags.h"
#include "base/log.h"
#include "test_util.h"

/* Parses words (words[0] the command's name) for cmd; the status it asks
 * the command to return (0 when it goes on), what it printed on stderr in
 * err (may be NULL), the values in *out. */
static int parse(fr_cmd cmd, int n, const char **words, char *err, size_t cap, fr_cli_values **out)
{
    char *argv[40];
    for (int i = 0; i < n; i++) argv[i] = (char *)words[i];
    argv[n] = NULL;
    fflush(stderr);
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    int saved = dup(fileno(stderr));
    dup2(fileno(tmp), fileno(stderr));
    int rc = 0;
    fr_cli_values *v = NULL;
    if (!fr_cli_parse(cmd, "", n, argv, &v, &rc)) rc = 0;
    fflush(stderr);
    dup2(saved, fileno(stderr));
    close(saved);
    if (err) {
        rewind(tmp);
        size_t got = fread(err, 1, cap - 1, tmp);
        err[got] = '\0';
    }
    fclose(tmp);
    if (out) *out = v;
    return rc;
}

static void expect_usage(fr_cmd cmd, int n, const char **words, const char *needle)
{
    char err[1024];
    int rc = parse(cmd, n, words, err, sizeof err, NULL);
    if (rc != 2) fail_msg("%s %s: status %d, not 2", words[0], words[1], rc);
    if (!strstr(err, needle)) fail_msg("%s %s: message \"%s\" lacks \"%s\"", words[0], words[1], err, needle);
}

static void test_equals_and_space(void **state)
{
    (void)state;
    fr_cli_values *a, *b;
    const char *w1[] = {"generate", "--max-tokens=5", "--model", "m", "--kv=nvfp4", "--greedy", "--prompt-ids=256,1"};
    const char *w2[] = {"generate", "--max-tokens", "5", "--model=m", "--kv", "nvfp4", "--greedy", "--prompt-ids",
                        "256,1"};
    assert_int_equal(parse(FR_CMD_GENERATE, 7, w1, NULL, 0, &a), 0);
    assert_int_equal(parse(FR_CMD_GENERATE, 9, w2, NULL, 0, &b), 0);
    const fr_opt_id ids[] = {FR_O_MAX_TOKENS, FR_O_MODEL, FR_O_KV, FR_O_GREEDY, FR_O_PROMPT_IDS};
    for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
        assert_true(fr_opt_given(a, ids[k]) && fr_opt_given(b, ids[k]));
        assert_int_equal(fr_opt_val(a, ids[k])->i, fr_opt_val(b, ids[k])->i);
    }
    assert_int_equal(fr_opt_int(a, FR_O_MAX_TOKENS), 5);
    assert_string_equal(fr_opt_str(a, FR_O_MODEL), "m");
    assert_string_equal(fr_opt_str(b, FR_O_MODEL), "m");
    assert_int_equal(fr_opt_int(a, FR_O_KV), FR_KV_NVFP4);
    assert_int_equal(fr_opt_val(a, FR_O_PROMPT_IDS)->n, 2);
    assert_int_equal(fr_opt_val(b, FR_O_PROMPT_IDS)->ids[1], 1);
    /* Not given: the table's default. */
    assert_false(fr_opt_given(a, FR_O_N));
    assert_int_equal(fr_opt_int(a, FR_O_N), 1);
    assert_true(fr_opt_num(a, FR_O_TOP_P) == 1.0);
    fr_cli_args_release();
}

static void test_aliases_and_files(void **state)
{
    (void)state;
    fr_cli_values *v;
    const char *w[] = {"rollout", "--kv-cache-dtype", "fp8", "--tensor-parallel-size=2", "--max-num-seqs", "8",
                       "--prompts", "p.txt", "--max-model-len=64"};
    assert_int_equal(parse(FR_CMD_ROLLOUT, 9, w, NULL, 0, &v), 0);
    assert_int_equal(fr_opt_int(v, FR_O_KV), FR_KV_FP8);
    assert_int_equal(fr_opt_int(v, FR_O_TP), 2);
    assert_int_equal(fr_opt_int(v, FR_O_MAX_SEQS), 8);
    assert_int_equal(fr_opt_int(v, FR_O_MAX_MODEL_LEN), 64);
    assert_string_equal(v->spelled[FR_O_MAX_SEQS], "max-num-seqs");
    /* A FILES option takes every argument up to the next option, and more
     * after a second --texts. */
    const char *t[] = {"calibrate", "--texts", "A", "B", "--out", "o", "--model", "m", "--texts", "C"};
    assert_int_equal(parse(FR_CMD_CALIBRATE, 10, t, NULL, 0, &v), 0);
    const fr_opt_value *texts = fr_opt_val(v, FR_O_TEXTS);
    assert_int_equal(texts->n, 3);
    assert_string_equal(texts->list[0], "A");
    assert_string_equal(texts->list[2], "C");
    assert_int_equal(v->n_operands, 0);
    /* quant's operands, and one too many. */
    const char *q[] = {"quant", "IN", "--format", "nvfp4", "--dim", "16", "OUT"};
    assert_int_equal(parse(FR_CMD_QUANT, 7, q, NULL, 0, &v), 0);
    assert_int_equal(v->n_operands, 2);
    assert_string_equal(v->operands[1], "OUT");
    const char *q3[] = {"quant", "--format", "nvfp4", "--dim", "16", "A", "B", "C"};
    expect_usage(FR_CMD_QUANT, 8, q3, "unexpected argument 'C'");
    fr_cli_args_release();
}

static void test_usage_errors(void **state)
{
    (void)state;
    /* Each a usage error (status 2) whose message names the problem. */
    struct {
        fr_cmd cmd;
        const char *words[8];   /* up to the first NULL */
        const char *needle;
    } bad[] = {
        {FR_CMD_GENERATE, {"generate", "--bogus", "1"}, "unknown or ambiguous option '--bogus'"},
        {FR_CMD_GENERATE, {"generate", "--model"}, "--model needs a value"},
        {FR_CMD_GENERATE, {"generate", "--greedy=yes"}, "--greedy takes no value"},
        {FR_CMD_GENERATE, {"generate", "--log-level", "loud"}, "--log-level: "},
        {FR_CMD_GENERATE, {"generate", "--kv-blocks", "4"}, "unknown or ambiguous option '--kv-blocks'"},
        /* The cases that once exited 1 or without a reason: every bad value is
         * a usage error naming the option. */
        {FR_CMD_GENERATE, {"generate", "--temperature", "-1"},
         "--temperature expects a number in [0, 1e+06], got '-1'"},
        {FR_CMD_GENERATE, {"generate", "--top-k", "-1"}, "--top-k expects an integer in [0, 1073741824], got '-1'"},
        {FR_CMD_GENERATE, {"generate", "--prompt-ids", ""}, "--prompt-ids needs at least one token id"},
        {FR_CMD_GENERATE, {"generate", "--prompt-ids", "256,,3"}, "--prompt-ids: token ids: an empty entry"},
        {FR_CMD_ROLLOUT, {"rollout", "--prompts", "p", "--kl-sample-rate", "nan"},
         "--kl-sample-rate expects a number in [0, 1], got 'nan'"},
        {FR_CMD_SERVE, {"serve", "--port", "70000"}, "--port expects an integer in [1, 65535], got '70000'"},
        /* Required options and values checked together. */
        {FR_CMD_ROLLOUT, {"rollout", "--n", "2"}, "--prompts is required"},
        {FR_CMD_CALIBRATE, {"calibrate", "--model", "m", "--out", "o"}, "--texts needs at least one file"},
        {FR_CMD_CALIBRATE, {"calibrate", "--model", "m", "--out", "o", "--texts"}, "--texts needs a value"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int n = 0;
        while (bad[i].words[n]) n++;
        expect_usage(bad[i].cmd, n, bad[i].words, bad[i].needle);
    }
    fr_cli_values *v;
    fr_cli_sampling so;
    const char *greedy[] = {"generate", "--greedy", "--temperature", "0.5"};
    assert_int_equal(parse(FR_CMD_GENERATE, 4, greedy, NULL, 0, &v), 0);
    assert_int_equal(fr_cli_sampling_get(FR_CMD_GENERATE, v, &so), 2);
    const char *level[] = {"generate", "--log-level=warn", "--greedy"};
    assert_int_equal(parse(FR_CMD_GENERATE, 3, level, NULL, 0, &v), 0);
    assert_int_equal(fr_log_get_level(), FR_LOG_WARN);
    fr_log_set_level(FR_LOG_INFO);
    /* --help anywhere prints the help and asks for status 0. */
    const char *help[] = {"generate", "--bogus", "--help"};
    assert_int_equal(parse(FR_CMD_GENERATE, 3, help, NULL, 0, &v), 0);
    fr_cli_args_release();
}

static void test_engine_opts(void **state)
{
    (void)state;
    fr_cli_values *v;
    fr_engine_opts eo;
    const char *w[] = {"score", "--recipe", "full,-rotate", "--deterministic", "--chunk", "64", "--out", "x"};
    assert_int_equal(parse(FR_CMD_SCORE, 8, w, NULL, 0, &v), 0);
    fr_cli_engine_opts_get(v, &eo);
    assert_false(eo.recipe.rotate);
    assert_true(eo.recipe.smooth);
    assert_int_equal(eo.deterministic, 1);
    assert_int_equal(eo.chunk, 64);
    assert_string_equal(eo.model, fr_cli_demo_model());
    fr_cli_args_release();
    /* The loop form for programs outside the table's commands. */
    char *argv[] = {"bench", "--kv-cache-dtype", "mxfp4", "--other", "--tp", "0", NULL};
    fr_engine_opts_default(&eo);
    int i = 1;
    assert_int_equal(fr_engine_opts_parse("bench", 6, argv, &i, &eo), 1);
    assert_int_equal(i, 2);
    assert_int_equal(eo.kv, FR_KV_MXFP4);
    i = 3;
    assert_int_equal(fr_engine_opts_parse("bench", 6, argv, &i, &eo), 0);
    i = 4;
    assert_int_equal(fr_engine_opts_parse("bench", 6, argv, &i, &eo), -1);
}

static void test_id_lists(void **state)
{
    (void)state;
    int *ids = NULL, n = 0;
    assert_int_equal(fr_parse_ids("256, 1,2 3\n4", &ids, &n), FR_OK);
    assert_int_equal(n, 5);
    assert_int_equal(ids[0], 256);
    assert_int_equal(ids[4], 4);
    free(ids);
    const char *bad[] = {"1,,2", ",1", "1,2,", "1, ,2", "1,x", "-1", "+3", "1.5"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ids = NULL;
        if (fr_parse_ids(bad[i], &ids, &n) == FR_OK) fail_msg("'%s' was accepted", bad[i]);
        assert_null(ids);
    }
}

static void test_serve_flags_override(void **state)
{
    (void)state;
    fr_serve_config c;
    fr_serve_config_default(&c);
    const char *file = "{\"model\": \"synthetic:tiny\", \"max_seqs\": 4, \"coordinator\": {\"port\": 7000, "
                       "\"bind\": \"0.0.0.0\"}}";
    assert_int_equal(fr_serve_config_parse(file, strlen(file), "f", &c), FR_OK);
    const char *w[] = {"serve", "--config", "f", "--port", "7100", "--kv", "nvfp4", "--deterministic",
                       "--temperature", "0.5", "--metrics-port", "9100"};
    fr_cli_values *v;
    assert_int_equal(parse(FR_CMD_SERVE, 12, w, NULL, 0, &v), 0);
    assert_int_equal(fr_serve_flags_apply(v, &c), FR_OK);
    assert_int_equal(c.coordinator.port, 7100);
    assert_string_equal(c.coordinator.bind, "0.0.0.0");   /* the file's, not overridden */
    assert_int_equal(c.max_seqs, 4);
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    assert_int_equal(c.deterministic, 1);
    assert_true(c.sampling.params.temperature == 0.5f);
    assert_int_equal(c.metrics_port, 9100);
    assert_int_equal(c.metrics_port_default, 0);   /* given: no longer the default that gives way */
    /* Values valid alone that contradict the configuration: refused whole. */
    const char *clash[] = {"serve", "--metrics-port", "7100"};
    assert_int_equal(parse(FR_CMD_SERVE, 3, clash, NULL, 0, &v), 0);
    assert_int_equal(fr_serve_flags_apply(v, &c), FR_EINVAL);
    if (!strstr(fr_last_error(), "command line: coordinator.port and metrics_port are both 7100"))
        fail_msg("%s", fr_last_error());
    assert_int_equal(c.metrics_port, 9100);   /* unchanged on failure */
    fr_cli_args_release();
}

static void test_log_lines(void **state)
{
    (void)state;
    char buf[1024] = {0};
    FILE *f = fmemopen(buf, sizeof buf, "w");
    assert_non_null(f);
    fr_log_set_stream(f);
    fr_log_set_level(FR_LOG_INFO);
    fr_debug("hidden %d", 1);
    fr_info("shown %d", 2);
    fr_log_set_level(FR_LOG_ERROR);
    fr_warn("hidden too");
    fr_error("bad %s", "thing");
    fr_log_set_stream(NULL);
    fr_log_set_level(FR_LOG_INFO);
    fclose(f);
    /* 2026-12-02T08:58:03.412Z INFO  shown 2 */
    assert_null(strstr(buf, "hidden"));
    char *line2 = strchr(buf, '\n');
    assert_non_null(line2);
    assert_int_equal(buf[4], '-');
    assert_int_equal(buf[10], 'T');
    assert_int_equal(buf[23], 'Z');
    assert_non_null(strstr(buf, "Z INFO  shown 2\n"));
    assert_non_null(strstr(line2 + 1, "Z ERROR bad thing\n"));
    fr_log_level l;
    assert_int_equal(fr_log_level_parse("debug", &l), FR_OK);
    assert_int_equal(l, FR_LOG_DEBUG);
    assert_int_not_equal(fr_log_level_parse("verbose", &l), FR_OK);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_equals_and_space),
             cmocka_unit_test(test_aliases_and_files),
             cmocka_unit_test(test_usage_errors),
             cmocka_unit_test(test_engine_opts),
             cmocka_unit_test(test_id_lists),
             cmocka_unit_test(test_serve_flags_override),
             cmocka_unit_test(test_log_lines))
