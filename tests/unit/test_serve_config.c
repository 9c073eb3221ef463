/* The serve configuration (app/serve_config.h): defaults, every key,
 * strictness (unknown and repeated keys, wrong types and ranges, each named
 * by its JSON path), contradictions, path handling, the JSON round trip, and
 * the example files in configs/. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "app/serve_config.h"
#include "test_util.h"

#define LABEL "conf/serve.json"

static fr_status parse(const char *text, fr_serve_config *c)
{
    fr_serve_config_default(c);
    return fr_serve_config_parse(text, strlen(text), LABEL, c);
}

static void test_defaults(void **state)
{
    (void)state;
    fr_serve_config c;
    fr_serve_config_default(&c);
    assert_string_equal(c.model, "synthetic:tiny");
    assert_int_equal(c.backend, FR_BACKEND_AUTO);
    assert_int_equal(c.tp, 1);
    assert_int_equal(c.kv_dtype, FR_KV_BF16);
    assert_int_equal(c.fp4_compute, FR_COMPUTE_AUTO);
    fr_recipe full = fr_recipe_full();
    assert_memory_equal(&c.recipe, &full, sizeof full);
    assert_string_equal(c.calib, "");
    assert_int_equal(c.max_seqs, 64);
    assert_int_equal(c.kv_blocks, 0);
    assert_true(c.kv_memory_fraction == 0.9);
    assert_int_equal(c.chunk, 512);
    assert_int_equal(c.deterministic, 0);
    assert_string_equal(c.coordinator.bind, "127.0.0.1");
    assert_int_equal(c.coordinator.port, 5555);
    assert_int_equal(c.coordinator.weight_port, 5556);
    assert_int_equal(c.coordinator.engine_port, 5557);
    assert_int_equal(c.metrics_port, FR_METRICS_PORT_DEFAULT);   /* on by default, giving way when taken */
    assert_int_equal(c.metrics_port_default, 1);
    assert_true(c.kl_sample_rate == 0.0);
    assert_true(c.sampling.params.temperature == 1.0f);
    assert_int_equal(c.sampling.params.top_k, 0);
    assert_true(c.sampling.params.top_p == 1.0f);
    assert_int_equal(c.sampling.params.seed, 0);
    assert_int_equal(c.sampling.has_seed, 0);   /* absent: seeds from the operating system */
    assert_int_equal(c.sampling.max_tokens, 256);
    assert_int_equal(c.sampling.n_stop, 0);
    /* An empty object is the defaults; so are the engine options. */
    fr_serve_config d;
    assert_int_equal(parse("{}", &d), FR_OK);
    assert_int_equal(parse("  {\n}\n", &d), FR_OK);
    fr_engine_opts o, od;
    fr_serve_config_engine_opts(&d, &o);
    fr_engine_opts_default(&od);
    assert_string_equal(o.model, od.model);
    assert_int_equal(o.backend, od.backend);
    assert_int_equal(o.kv, od.kv);
    assert_int_equal(o.compute, od.compute);
    assert_memory_equal(&o.recipe, &od.recipe, sizeof od.recipe);
    assert_null(o.calib);
    assert_int_equal(o.chunk, od.chunk);
    assert_int_equal(o.tp, od.tp);
    assert_int_equal(o.deterministic, od.deterministic);
    assert_null(o.group);
}

static const char *ALL_KEYS =
    "{\"model\": \"/models/qwen3-4b\", \"backend\": \"cuda\", \"tp\": 4, \"kv_dtype\": \"mxfp4\","
    " \"fp4_compute\": \"bf16\", \"recipe\": \"full,-rotate,-sink\", \"calib\": \"/models/calib.safetensors\","
    " \"max_seqs\": 300, \"kv_blocks\": 0, \"kv_memory_fraction\": 0.5, \"chunk\": 1024, \"deterministic\": true,"
    " \"coordinator\": {\"bind\": \"*\", \"port\": 6000, \"weight_port\": 6001, \"engine_port\": 6002},"
    " \"metrics_port\": 9100, \"metrics_log\": \"/var/log/run.jsonl\", \"kl_sample_rate\": 0.125,"
    " \"sampling\": {\"temperature\": 0.7, \"top_k\": 50, \"top_p\": 0.95, \"max_tokens\": 4096,"
    "   \"stop_token_ids\": [151643, 151645], \"seed\": 1234567890123}}";

static void test_every_key(void **state)
{
    (void)state;
    fr_serve_config c;
    assert_int_equal(parse(ALL_KEYS, &c), FR_OK);
    assert_string_equal(c.model, "/models/qwen3-4b");
    assert_int_equal(c.backend, FR_BACKEND_CUDA);
    assert_int_equal(c.tp, 4);
    assert_int_equal(c.kv_dtype, FR_KV_MXFP4);
    assert_int_equal(c.fp4_compute, FR_COMPUTE_BF16);
    assert_true(c.recipe.smooth && !c.recipe.rotate && c.recipe.scale_search && !c.recipe.sink_recent);
    assert_string_equal(c.calib, "/models/calib.safetensors");
    assert_int_equal(c.max_seqs, 300);
    assert_int_equal(c.kv_blocks, 0);
    assert_true(c.kv_memory_fraction == 0.5);
    assert_int_equal(c.chunk, 1024);
    assert_int_equal(c.deterministic, 1);
    assert_string_equal(c.coordinator.bind, "*");
    assert_int_equal(c.coordinator.port, 6000);
    assert_int_equal(c.coordinator.weight_port, 6001);
    assert_int_equal(c.coordinator.engine_port, 6002);
    assert_int_equal(c.metrics_port, 9100);
    assert_string_equal(c.metrics_log, "/var/log/run.jsonl");
    assert_true(c.kl_sample_rate == 0.125);
    assert_true(c.sampling.params.temperature == 0.7f);
    assert_int_equal(c.sampling.params.top_k, 50);
    assert_true(c.sampling.params.top_p == 0.95f);
    assert_int_equal(c.sampling.max_tokens, 4096);
    assert_int_equal(c.sampling.n_stop, 2);
    assert_int_equal(c.sampling.stop_token_ids[0], 151643);
    assert_int_equal(c.sampling.stop_token_ids[1], 151645);
    assert_true(c.sampling.params.seed == 1234567890123ull);
    assert_int_equal(c.sampling.has_seed, 1);
    fr_engine_opts o;
    fr_serve_config_engine_opts(&c, &o);
    assert_ptr_equal(o.model, c.model);
    assert_ptr_equal(o.calib, c.calib);
    assert_int_equal(o.backend, FR_BACKEND_CUDA);
    assert_int_equal(o.kv, FR_KV_MXFP4);
    assert_int_equal(o.compute, FR_COMPUTE_BF16);
    assert_int_equal(o.chunk, 1024);
    assert_int_equal(o.deterministic, 1);
    assert_int_equal(o.tp, 4);
    /* Nested objects keep the defaults of the keys they leave out. */
    assert_int_equal(parse("{\"coordinator\": {\"port\": 7000}, \"sampling\": {\"top_k\": 5}}", &c), FR_OK);
    assert_int_equal(c.coordinator.port, 7000);
    assert_int_equal(c.coordinator.weight_port, 5556);
    assert_string_equal(c.coordinator.bind, "127.0.0.1");
    assert_int_equal(c.sampling.params.top_k, 5);
    assert_int_equal(c.sampling.max_tokens, 256);
    /* Greedy, null calib, integral floats. */
    assert_int_equal(parse("{\"sampling\": {\"temperature\": 0}, \"calib\": null, \"tp\": 2.0}", &c), FR_OK);
    assert_true(c.sampling.params.temperature == 0.0f);
    assert_string_equal(c.calib, "");
    assert_int_equal(c.tp, 2);
}

static void test_unknown_keys(void **state)
{
    (void)state;
    static const struct { const char *json, *want[3]; } cases[] = {
        {"{\"kv_dtpye\": \"nvfp4\"}", {LABEL, "unknown key \"kv_dtpye\"", "did you mean \"kv_dtype\""}},
        {"{\"kv\": \"nvfp4\"}", {"unknown key \"kv\"", "did you mean \"kv_dtype\"", NULL}},
        {"{\"max-seqs\": 4}", {"unknown key \"max-seqs\"", "did you mean \"max_seqs\"", NULL}},
        {"{\"coordinator\": {\"prot\": 1}}", {"unknown key \"coordinator.prot\"", "\"coordinator.port\"", NULL}},
        {"{\"sampling\": {\"temprature\": 1}}", {"\"sampling.temprature\"", "\"sampling.temperature\"", NULL}},
        {"{\"frobnicate\": true}", {LABEL, "unknown key \"frobnicate\"", "configs/README.md"}},
        {"{\"tp\": 1, \"tp\": 2}", {LABEL, "\"tp\" is given twice", NULL}},
        {"{\"sampling\": {\"seed\": 1, \"seed\": 1}}", {"\"sampling.seed\" is given twice", NULL, NULL}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fr_serve_config c;
        if (parse(cases[i].json, &c) != FR_EINVAL) fail_msg("accepted: %s", cases[i].json);
        for (int k = 0; k < 3 && cases[i].want[k]; k++) fr_test_error_has(cases[i].want[k]);
    }
}

static void test_bad_values(void **state)
{
    (void)state;
    static const struct { const char *json, *want[2]; } cases[] = {
        {"{\"model\": 3}", {"model: expected a string, got a number", NULL}},
        {"{\"model\": \"\"}", {"model: must not be empty", NULL}},
        {"{\"backend\": \"tpu\"}", {"backend: unknown backend 'tpu'", NULL}},
        {"{\"tp\": \"2\"}", {"tp: expected an integer", "got a string"}},
        {"{\"tp\": 0}", {"tp: must be in [1, 1024], got 0", NULL}},
        {"{\"tp\": 1.5}", {"tp: expected an integer", "got 1.5"}},
        {"{\"kv_dtype\": \"int4\"}", {"kv_dtype: unknown kv dtype 'int4'", NULL}},
        {"{\"kv_dtype\": null}", {"kv_dtype: expected a string, got null", NULL}},
        {"{\"fp4_compute\": \"fp32\"}", {"fp4_compute: unknown fp4 compute mode", NULL}},
        {"{\"recipe\": \"full,-magic\"}", {"recipe: unknown recipe switch", NULL}},
        {"{\"calib\": \"\"}", {"calib: must not be empty (use null for none)", NULL}},
        {"{\"calib\": false}", {"calib: expected a string or null, got a boolean", NULL}},
        {"{\"max_seqs\": -1}", {"max_seqs: must be in", NULL}},
        {"{\"kv_blocks\": -5}", {"kv_blocks: must be in [0,", NULL}},
        {"{\"kv_memory_fraction\": 0}", {"kv_memory_fraction: must be in (0, 1], got 0", NULL}},
        {"{\"kv_memory_fraction\": 1.5}", {"kv_memory_fraction: must be in (0, 1]", NULL}},
        {"{\"chunk\": 0}", {"chunk: must be in [1,", NULL}},
        {"{\"deterministic\": 1}", {"deterministic: expected true or false, got a number", NULL}},
        {"{\"coordinator\": 5}", {"coordinator: expected an object, got a number", NULL}},
        {"{\"coordinator\": {\"port\": 70000}}", {"coordinator.port: must be in [1, 65535], got 70000", NULL}},
        {"{\"coordinator\": {\"bind\": \"tcp://*:5555\"}}", {"coordinator.bind: give the host", NULL}},
        {"{\"coordinator\": {\"bind\": []}}", {"coordinator.bind: expected a string, got an array", NULL}},
        {"{\"metrics_port\": -1}", {"metrics_port: must be in [0, 65535]", NULL}},
        {"{\"metrics_pub_port\": 70000}", {"metrics_pub_port: must be in [0, 65535]", NULL}},
        {"{\"kl_sample_rate\": 1.5}", {"kl_sample_rate: must be in [0, 1], got 1.5", NULL}},
        {"{\"recalibration\": {\"texts\": [\"a\"]}}", {"recalibration: give kl_threshold", "after_commit true"}},
        {"{\"recalibration\": {\"kl_threshold\": 0.01}}", {"recalibration: needs texts", NULL}},
        {"{\"recalibration\": {\"after_commit\": 1, \"texts\": [\"a\"]}}", {"recalibration.after_commit: expected true or false, got a number", NULL}},
        {"{\"recalibration\": {\"kl_threshold\": 0, \"texts\": [\"a\"]}}", {"recalibration.kl_threshold: must be in (0,", NULL}},
        {"{\"recalibration\": {\"kl_threshold\": 0.01, \"texts\": []}}", {"recalibration.texts: has 0 files; give 1 to 8", NULL}},
        {"{\"recalibration\": {\"kl_treshold\": 0.01}}", {"unknown key \"recalibration.kl_treshold\" (did you mean \"recalibration.kl_threshold\"?)", NULL}},
        {"{\"tp\": 2, \"recalibration\": {\"kl_threshold\": 0.01, \"texts\": [\"a\"]}}", {"recalibration needs tp 1", NULL}},
        {"{\"sampling\": []}", {"sampling: expected an object, got an array", NULL}},
        {"{\"sampling\": {\"temperature\": -1}}", {"sampling.temperature: must be in [0,", NULL}},
        {"{\"sampling\": {\"top_p\": 0}}", {"sampling.top_p: must be in (0, 1], got 0", NULL}},
        {"{\"sampling\": {\"top_k\": -3}}", {"sampling.top_k: must be in", NULL}},
        {"{\"sampling\": {\"max_tokens\": 0}}", {"sampling.max_tokens: must be in", NULL}},
        {"{\"sampling\": {\"seed\": -1}}", {"sampling.seed: expected an integer in [0, 2^53], got -1", NULL}},
        {"{\"sampling\": {\"seed\": \"7\"}}", {"sampling.seed: expected an integer", "got a string"}},
        {"{\"sampling\": {\"stop_token_ids\": 5}}", {"sampling.stop_token_ids: expected an array", NULL}},
        {"{\"sampling\": {\"stop_token_ids\": [1, -2]}}", {"sampling.stop_token_ids[1]: must be in", NULL}},
        {"{\"sampling\": {\"stop_token_ids\": [1, \"x\"]}}", {"sampling.stop_token_ids[1]: expected", NULL}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fr_serve_config c;
        if (parse(cases[i].json, &c) != FR_EINVAL) fail_msg("accepted: %s", cases[i].json);
        fr_test_error_has(LABEL ": ");
        for (int k = 0; k < 2 && cases[i].want[k]; k++) fr_test_error_has(cases[i].want[k]);
    }
    /* Too many stop ids. */
    char many[1024] = "{\"sampling\": {\"stop_token_ids\": [";
    for (int i = 0; i < FR_SERVE_MAX_STOP_IDS + 1; i++)
        snprintf(many + strlen(many), sizeof many - strlen(many), "%s%d", i ? "," : "", i);
    strcat(many, "]}}");
    fr_serve_config c;
    assert_int_equal(parse(many, &c), FR_EINVAL);
    fr_test_error_has("sampling.stop_token_ids: has 65 ids; at most 64");
}

static void test_contradictions(void **state)
{
    (void)state;
    fr_serve_config c;
    assert_int_equal(parse("{\"kv_blocks\": 100, \"kv_memory_fraction\": 0.5}", &c), FR_EINVAL);
    fr_test_error_has("kv_blocks (100) and kv_memory_fraction are alternatives");
    assert_int_equal(parse("{\"backend\": \"cpu\", \"kv_memory_fraction\": 0.5}", &c), FR_EINVAL);
    fr_test_error_has("with backend \"cpu\" give kv_blocks");
    assert_int_equal(parse("{\"metrics_port\": 5555}", &c), FR_EINVAL);
    fr_test_error_has("coordinator.port and metrics_port are both 5555");
    assert_int_equal(parse("{\"metrics_port\": 7000, \"metrics_pub_port\": 7000}", &c), FR_EINVAL);
    fr_test_error_has("metrics_port and metrics_pub_port are both 7000");
    assert_int_equal(parse("{\"metrics_pub_port\": 7001}", &c), FR_OK);
    assert_int_equal(c.metrics_pub_port, 7001);
    assert_int_equal(parse("{\"metrics_log\": \"run.jsonl\", \"metrics_port\": 0}", &c), FR_EINVAL);
    fr_test_error_has("metrics_log records the history the metrics endpoint keeps: set metrics_port too");
    assert_int_equal(parse("{\"metrics_log\": \"run.jsonl\"}", &c), FR_OK);   /* the default endpoint keeps it */
    assert_int_equal(parse("{\"recalibration\": {\"kl_threshold\": 0.02, \"texts\": [\"a.txt\", \"b.txt\"], "
                           "\"min_positions\": 100, \"continue\": 0, \"out_dir\": \"recal\"}}", &c), FR_OK);
    assert_true(c.recalibration.kl_threshold == 0.02);
    assert_int_equal(c.recalibration.n_texts, 2);
    assert_string_equal(c.recalibration.texts[1], "b.txt");
    assert_int_equal(c.recalibration.min_positions, 100);
    assert_int_equal(c.recalibration.continue_tokens, 0);
    assert_int_equal(c.recalibration.context, -1);
    assert_string_equal(c.recalibration.out_dir, "recal");
    assert_int_equal(parse("{\"coordinator\": {\"engine_port\": 5556}}", &c), FR_EINVAL);
    fr_test_error_has("coordinator.weight_port and coordinator.engine_port are both 5556");
    /* kv_blocks 0 means automatic: it goes with kv_memory_fraction. */
    assert_int_equal(parse("{\"kv_blocks\": 0, \"kv_memory_fraction\": 0.5}", &c), FR_OK);
    assert_int_equal(parse("{\"backend\": \"cpu\", \"kv_blocks\": 64}", &c), FR_OK);
    assert_int_equal(parse("{\"metrics_port\": 0, \"coordinator\": {\"port\": 80}}", &c), FR_OK);
    assert_int_equal(c.metrics_port, 0);   /* 0 turns the endpoint off */
    assert_int_equal(c.metrics_port_default, 0);
    /* The default metrics port gives way to a coordinator that takes it; a
     * metrics_port given is the user's and must not collide. */
    assert_int_equal(parse("{\"coordinator\": {\"port\": 8000}}", &c), FR_OK);
    assert_int_equal(parse("{\"metrics_port\": 8000, \"coordinator\": {\"port\": 8000}}", &c), FR_EINVAL);
    fr_test_error_has("coordinator.port and metrics_port are both 8000");
}

static void test_malformed(void **state)
{
    (void)state;
    fr_serve_config c;
    assert_int_equal(parse("{\"tp\": }", &c), FR_EFORMAT);
    fr_test_error_has(LABEL ": not valid JSON (line 1, column 8)");
    assert_int_equal(parse("{\n  \"tp\": 2,\n  \"chunk\": 12x\n}", &c), FR_EFORMAT);
    fr_test_error_has("(line 3, column");
    assert_int_equal(parse("{\"tp\": 2} {\"tp\": 3}", &c), FR_EFORMAT);
    fr_test_error_has("unexpected text after the JSON object (line 1, column 11)");
    assert_int_equal(parse("[1, 2]", &c), FR_EFORMAT);
    fr_test_error_has("must be a JSON object, got an array");
    assert_int_equal(parse("", &c), FR_EFORMAT);
    assert_int_equal(fr_serve_config_parse(NULL, 0, LABEL, &c), FR_EINVAL);
    /* Text need not end in NUL: only len bytes are read. */
    const char text[] = "{\"tp\": 3}GARBAGE";
    assert_int_equal(fr_serve_config_parse(text, 9, LABEL, &c), FR_OK);
    assert_int_equal(c.tp, 3);
}

/* A failed parse leaves the configuration as it was. */
static void test_failure_keeps_config(void **state)
{
    (void)state;
    fr_serve_config c, before;
    fr_serve_config_default(&c);
    assert_int_equal(fr_serve_config_parse("{\"tp\": 2}", 9, LABEL, &c), FR_OK);
    memcpy(&before, &c, sizeof c);
    const char *bad = "{\"max_seqs\": 7, \"chunk\": 99, \"sampling\": {\"top_k\": 3, \"top_p\": 2}}";
    assert_int_equal(fr_serve_config_parse(bad, strlen(bad), LABEL, &c), FR_EINVAL);
    assert_memory_equal(&c, &before, sizeof c);
}

static void test_json_round_trip(void **state)
{
    (void)state;
    const char *inputs[] = {"{}", ALL_KEYS, "{\"backend\": \"cpu\", \"kv_blocks\": 40, \"calib\": \"c.st\"}",
                            "{\"recalibration\": {\"kl_threshold\": 0.5, \"texts\": [\"a\", \"b\"], \"context\": 1024}}",
                            "{\"recalibration\": {\"kl_threshold\": 0.5, \"texts\": [\"a\"], \"out_dir\": \"o\"}}",
                            "{\"recalibration\": {\"after_commit\": true, \"texts\": [\"a\"]}}"};
    for (int i = 0; i < 6; i++) {
        fr_serve_config a, b;
        assert_int_equal(parse(inputs[i], &a), FR_OK);
        char *j1 = NULL, *j2 = NULL;
        assert_int_equal(fr_serve_config_to_json(&a, &j1), FR_OK);
        if (parse(j1, &b) != FR_OK) fail_msg("to_json output does not parse: %s\n%s", fr_last_error(), j1);
        assert_int_equal(fr_serve_config_to_json(&b, &j2), FR_OK);
        assert_string_equal(j1, j2);
        assert_string_equal(a.model, b.model);
        assert_memory_equal(&a.recipe, &b.recipe, sizeof a.recipe);
        assert_true(a.sampling.params.temperature == b.sampling.params.temperature);
        assert_true(a.sampling.params.top_p == b.sampling.params.top_p);
        assert_true(a.sampling.params.seed == b.sampling.params.seed);
        assert_int_equal(a.sampling.has_seed, b.sampling.has_seed);
        assert_int_equal(a.sampling.n_stop, b.sampling.n_stop);
        assert_true(a.kl_sample_rate == b.kl_sample_rate);
        assert_memory_equal(&a.recalibration, &b.recalibration, sizeof a.recalibration);
        free(j1);
        free(j2);
    }
}

static void test_load_paths(void **state)
{
    (void)state;
    char dir[] = "/tmp/fr_serve_cfg_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/serve.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"model\": \"models/tq6\", \"calib\": \"calib.safetensors\", \"tp\": 2}\n", f);
    fclose(f);
    fr_serve_config r;
    fr_serve_config_default(&r);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"recalibration\": {\"kl_threshold\": 1, \"texts\": [\"t/a.txt\", \"/abs/b.txt\"], \"out_dir\": \"o\"},"
          " \"metrics_port\": 9100, \"metrics_log\": \"logs/m.jsonl\"}", f);
    fclose(f);
    assert_int_equal(fr_serve_config_load(path, &r), FR_OK);
    char logp[300];
    snprintf(logp, sizeof logp, "%s/logs/m.jsonl", dir);
    assert_string_equal(r.metrics_log, logp);   /* relative to the file's folder, like every path */
    char rel[300];
    snprintf(rel, sizeof rel, "%s/t/a.txt", dir);
    assert_string_equal(r.recalibration.texts[0], rel);
    assert_string_equal(r.recalibration.texts[1], "/abs/b.txt");
    snprintf(rel, sizeof rel, "%s/o", dir);
    assert_string_equal(r.recalibration.out_dir, rel);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"model\": \"models/tq6\", \"calib\": \"calib.safetensors\", \"tp\": 2}\n", f);
    fclose(f);
    fr_serve_config c;
    fr_serve_config_default(&c);
    assert_int_equal(fr_serve_config_load(path, &c), FR_OK);
    char want[300];
    snprintf(want, sizeof want, "%s/models/tq6", dir);
    assert_string_equal(c.model, want);
    snprintf(want, sizeof want, "%s/calib.safetensors", dir);
    assert_string_equal(c.calib, want);
    assert_int_equal(c.tp, 2);
    /* Absolute paths and synthetic models stay as written. */
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"model\": \"synthetic:qwen3-4b:7\", \"calib\": \"/abs/c.safetensors\"}", f);
    fclose(f);
    assert_int_equal(fr_serve_config_load(path, &c), FR_OK);
    assert_string_equal(c.model, "synthetic:qwen3-4b:7");
    assert_string_equal(c.calib, "/abs/c.safetensors");
    /* Errors name the file. */
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"tp\": 2,\n \"bogus_key\": 1}", f);
    fclose(f);
    assert_int_equal(fr_serve_config_load(path, &c), FR_EINVAL);
    fr_test_error_has(path);
    fr_test_error_has("unknown key \"bogus_key\"");
    remove(path);
    assert_int_equal(fr_serve_config_load(path, &c), FR_EIO);
    fr_test_error_has("cannot read config file");
    fr_test_error_has(path);
    rmdir(dir);
}

/* The examples in configs/ parse, and say what configs/README.md says. */
static void test_example_files(void **state)
{
    (void)state;
    fr_serve_config c;
    fr_serve_config_default(&c);
    assert_int_equal(fr_serve_config_load("configs/tq6-cpu.json", &c), FR_OK);
    assert_string_equal(c.model, "configs/../../shared/models/tq6");
    assert_int_equal(c.backend, FR_BACKEND_CPU);
    assert_int_equal(c.tp, 1);
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    assert_true(c.kv_blocks > 0);
    fr_serve_config_default(&c);
    if (fr_serve_config_load("configs/qwen3-moe-tqm-cpu.json", &c) != FR_OK) fail_msg("%s", fr_last_error());
    assert_string_equal(c.model, "configs/../../shared/models/tqm");
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    fr_serve_config_default(&c);
    if (fr_serve_config_load("configs/deepseek-mla-tqa-cpu.json", &c) != FR_OK) fail_msg("%s", fr_last_error());
    assert_string_equal(c.model, "configs/../../shared/models/tqa");
    assert_int_equal(c.backend, FR_BACKEND_CPU);
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    fr_serve_config_default(&c);
    if (fr_serve_config_load("configs/deepseek-mla-tqa-cuda.json", &c) != FR_OK) fail_msg("%s", fr_last_error());
    assert_string_equal(c.model, "configs/../../shared/models/tqa");
    assert_int_equal(c.backend, FR_BACKEND_CUDA);
    assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
    assert_int_equal(c.kv_blocks, 2048);
    for (int tp = 1; tp <= 2; tp++) {
        char path[64];
        snprintf(path, sizeof path, "configs/qwen3-4b-tp%d.json", tp);
        fr_serve_config_default(&c);
        if (fr_serve_config_load(path, &c) != FR_OK) fail_msg("%s", fr_last_error());
        assert_string_equal(c.model, "synthetic:qwen3-4b");
        assert_int_equal(c.backend, FR_BACKEND_CUDA);
        assert_int_equal(c.tp, tp);
        assert_int_equal(c.kv_dtype, FR_KV_NVFP4);
        assert_int_equal(c.kv_blocks, 0);
        assert_true(c.kv_memory_fraction > 0 && c.kv_memory_fraction <= 1);
    }
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_defaults),
             cmocka_unit_test(test_every_key),
             cmocka_unit_test(test_unknown_keys),
             cmocka_unit_test(test_bad_values),
             cmocka_unit_test(test_contradictions),
             cmocka_unit_test(test_malformed),
             cmocka_unit_test(test_failure_keeps_config),
             cmocka_unit_test(test_json_round_trip),
             cmocka_unit_test(test_load_paths),
             cmocka_unit_test(test_example_files))
