/* The command-line conventions (app/cli_args.c, app/serve_flags.c,
 * base/log.c, fr_parse_ids): `--opt=value` and `--opt value` give the same
 * canonical argv, vLLM's aliases map to our names, unknown options and
 * missing values are usage errors, id lists with empty entries are
 * rejected, serve flags override a configuration, and log lines carry a
 * timestamp and a level and respect the level. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "app/serve_flags.h"
#include "base/log.h"

static const struct option own[] = {
    {"prompts", required_argument, 0, 0}, {"texts", required_argument, 0, 0}, {"max-seqs", required_argument, 0, 0},
    {0, 0, 0, 0},
};

/* Runs fr_cli_args on a copy of words (words[0] the command) and returns its
 * status; the canonical argv joined by spaces goes to out. */
static int canon(char *out, size_t cap, int n, const char **words)
{
    char *argv[32];
    for (int i = 0; i < n; i++) argv[i] = (char *)words[i];
    argv[n] = NULL;
    int argc = n;
    char **av = argv;
    int rc = fr_cli_args("test", &argc, &av,
                         (const struct option *const[]){own, fr_cli_engine_longopts, fr_cli_sampling_longopts, NULL});
    out[0] = '\0';
    for (int i = 1; rc == 0 && i < argc; i++) {
        strncat(out, av[i], cap - strlen(out) - 1);
        if (i + 1 < argc) strncat(out, " ", cap - strlen(out) - 1);
    }
    return rc;
}

static void test_equals_and_space(void **state)
{
    (void)state;
    char a[512], b[512];
    const char *w1[] = {"generate", "--max-tokens=5", "--model", "m", "--kv=nvfp4", "--greedy"};
    const char *w2[] = {"generate", "--max-tokens", "5", "--model=m", "--kv", "nvfp4", "--greedy"};
    assert_int_equal(canon(a, sizeof a, 6, w1), 0);
    assert_int_equal(canon(b, sizeof b, 7, w2), 0);
    assert_string_equal(a, "--max-tokens 5 --model m --kv nvfp4 --greedy");
    assert_string_equal(a, b);
    fr_cli_args_release();
}

static void test_aliases_and_positionals(void **state)
{
    (void)state;
    char a[512];
    const char *w[] = {"x", "--kv-cache-dtype", "fp8", "--tensor-parallel-size=2", "--max-num-seqs", "8",
                       "--texts", "A", "B", "--max-model-len=64"};
    assert_int_equal(canon(a, sizeof a, 10, w), 0);
    assert_string_equal(a, "--kv fp8 --tp 2 --max-seqs 8 --texts A B --max-model-len 64");
    fr_cli_args_release();
}

static void test_usage_errors(void **state)
{
    (void)state;
    char a[512];
    const char *unknown[] = {"x", "--bogus", "1"};
    const char *missing[] = {"x", "--model"};
    const char *flag_value[] = {"x", "--greedy=yes"};
    const char *bad_level[] = {"x", "--log-level", "loud"};
    assert_int_equal(canon(a, sizeof a, 3, unknown), 2);
    assert_int_equal(canon(a, sizeof a, 2, missing), 2);
    assert_int_equal(canon(a, sizeof a, 2, flag_value), 2);
    assert_int_equal(canon(a, sizeof a, 3, bad_level), 2);
    const char *level[] = {"x", "--log-level=warn", "--greedy"};
    assert_int_equal(canon(a, sizeof a, 3, level), 0);
    assert_string_equal(a, "--greedy");   /* applied, not passed on */
    assert_int_equal(fr_log_get_level(), FR_LOG_WARN);
    fr_log_set_level(FR_LOG_INFO);
    fr_cli_args_release();
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
    char *argv[] = {"serve", "--config", "f", "--port", "7100", "--kv", "nvfp4", "--deterministic",
                    "--temperature", "0.5", NULL};
    assert_int_equal(fr_serve_flags_apply(10, argv, &c), FR_OK);
    assert_int_equal(c.coordinator.port, 7100);
    assert_string_equal(c.coordinator.bind, "0.0.0.0");   /* the file's, not overridden */
    assert_int_equal(c.max_seqs, 4);
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    assert_int_equal(c.deterministic, 1);
    assert_true(c.sampling.params.temperature == 0.5f);
    char *bad_port[] = {"serve", "--port", "70000", NULL};
    char *not_int[] = {"serve", "--max-seqs", "four", NULL};
    assert_int_not_equal(fr_serve_flags_apply(3, bad_port, &c), FR_OK);
    assert_int_not_equal(fr_serve_flags_apply(3, not_int, &c), FR_OK);
    assert_int_equal(c.coordinator.port, 7100);   /* unchanged on failure */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equals_and_space),
        cmocka_unit_test(test_aliases_and_positionals),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_id_lists),
        cmocka_unit_test(test_serve_flags_override),
        cmocka_unit_test(test_log_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
