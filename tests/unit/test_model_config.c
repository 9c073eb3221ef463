/* Qwen3 config.json parsing: both RoPE spellings, eos forms, and rejections. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/model.h"
#include "rollout/model/model_config.h"
#include "tests/unit/test_util.h"
#include "test_util.h"

#define LABEL "cfg/config.json"

/* The tq6 config as transformers 5 writes it (rope_parameters spelling). */
static const char *TQ6 =
    "{\"architectures\":[\"Qwen3ForCausalLM\"],\"attention_bias\":false,\"bos_token_id\":256,"
    "\"dtype\":\"bfloat16\",\"eos_token_id\":257,\"head_dim\":128,\"hidden_act\":\"silu\","
    "\"hidden_size\":512,\"intermediate_size\":1536,\"max_position_embeddings\":32768,"
    "\"model_type\":\"qwen3\",\"num_attention_heads\":8,\"num_hidden_layers\":6,"
    "\"num_key_value_heads\":2,\"pad_token_id\":258,\"rms_norm_eps\":1e-06,"
    "\"rope_parameters\":{\"rope_theta\":1000000.0,\"rope_type\":\"default\"},"
    "\"sliding_window\":null,\"tie_word_embeddings\":false,\"use_sliding_window\":false,"
    "\"vocab_size\":272}";

/* Qwen3-4B's config as published (top-level rope_theta, rope_scaling null). */
static const char *QWEN3_4B =
    "{\"architectures\":[\"Qwen3ForCausalLM\"],\"attention_bias\":false,\"attention_dropout\":0.0,"
    "\"bos_token_id\":151643,\"eos_token_id\":151645,\"head_dim\":128,\"hidden_act\":\"silu\","
    "\"hidden_size\":2560,\"initializer_range\":0.02,\"intermediate_size\":9728,"
    "\"max_position_embeddings\":40960,\"max_window_layers\":36,\"model_type\":\"qwen3\","
    "\"num_attention_heads\":32,\"num_hidden_layers\":36,\"num_key_value_heads\":8,"
    "\"rms_norm_eps\":1e-06,\"rope_scaling\":null,\"rope_theta\":1000000,\"sliding_window\":null,"
    "\"tie_word_embeddings\":true,\"torch_dtype\":\"bfloat16\",\"transformers_version\":\"4.51.0\","
    "\"use_cache\":true,\"use_sliding_window\":false,\"vocab_size\":151936}";

/* DeepSeek-V3's published config (routing keys; 61 layers), less its YaRN
 * rope_scaling and with a 4096 window (test_yarn_published adds both). */
static const char *DSV3 =
    "{\"architectures\":[\"DeepseekV3ForCausalLM\"],\"model_type\":\"deepseek_v3\",\"attention_bias\":false,"
    "\"bos_token_id\":0,\"eos_token_id\":1,\"first_k_dense_replace\":3,\"hidden_act\":\"silu\","
    "\"hidden_size\":7168,\"intermediate_size\":18432,\"kv_lora_rank\":512,\"max_position_embeddings\":4096,"
    "\"moe_intermediate_size\":2048,\"moe_layer_freq\":1,\"n_group\":8,\"n_routed_experts\":256,"
    "\"n_shared_experts\":1,\"norm_topk_prob\":true,\"num_attention_heads\":128,\"num_experts_per_tok\":8,"
    "\"num_hidden_layers\":61,\"num_key_value_heads\":128,\"q_lora_rank\":1536,\"qk_nope_head_dim\":128,"
    "\"qk_rope_head_dim\":64,\"rms_norm_eps\":1e-06,\"rope_theta\":10000,\"routed_scaling_factor\":2.5,"
    "\"scoring_func\":\"sigmoid\",\"topk_group\":4,\"topk_method\":\"noaux_tc\",\"v_head_dim\":128,"
    "\"vocab_size\":129280}";

/* DeepSeek-V2-Lite's published config, less its YaRN rope_scaling
 * (test_yarn_published adds it). */
static const char *DSV2_LITE =
    "{\"architectures\":[\"DeepseekV2ForCausalLM\"],\"model_type\":\"deepseek_v2\",\"attention_bias\":false,"
    "\"aux_loss_alpha\":0.001,\"bos_token_id\":100000,\"eos_token_id\":100001,\"first_k_dense_replace\":1,"
    "\"hidden_act\":\"silu\",\"hidden_size\":2048,\"intermediate_size\":10944,\"kv_lora_rank\":512,"
    "\"max_position_embeddings\":163840,\"moe_intermediate_size\":1408,\"moe_layer_freq\":1,\"n_group\":1,"
    "\"n_routed_experts\":64,\"n_shared_experts\":2,\"norm_topk_prob\":false,\"num_attention_heads\":16,"
    "\"num_experts_per_tok\":6,\"num_hidden_layers\":27,\"num_key_value_heads\":16,\"q_lora_rank\":null,"
    "\"qk_nope_head_dim\":128,\"qk_rope_head_dim\":64,\"rms_norm_eps\":1e-06,\"rope_theta\":10000,"
    "\"routed_scaling_factor\":1.0,\"scoring_func\":\"softmax\",\"seq_aux\":true,\"topk_group\":1,"
    "\"topk_method\":\"greedy\",\"v_head_dim\":128,\"vocab_size\":102400}";

static fr_status parse_text(const char *text, fr_model_config *cfg)
{
    return fr_model_config_parse(text, strlen(text), LABEL, cfg);
}

/* Parses base with top-level `key` replaced by the JSON `value` (NULL
 * deletes the key). */
static fr_status parse_edit(const char *base, const char *key, const char *value, fr_model_config *cfg)
{
    cJSON *doc = cJSON_Parse(base);
    assert_non_null(doc);
    cJSON_DeleteItemFromObjectCaseSensitive(doc, key);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        assert_non_null(v);
        cJSON_AddItemToObject(doc, key, v);
    }
    char *text = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    assert_non_null(text);
    fr_status rc = parse_text(text, cfg);
    cJSON_free(text);
    return rc;
}

/* Expects the edit to fail with `want` and a message naming the file and `needle`. */
static void expect_edit_fails(const char *key, const char *value, fr_status want, const char *needle)
{
    fr_model_config cfg;
    fr_status rc = parse_edit(TQ6, key, value, &cfg);
    if (rc != want)
        fail_msg("%s = %s: got status %d (%s), want %d", key, value ? value : "(deleted)", rc,
                 fr_last_error(), want);
    fr_test_error_has(LABEL);
    fr_test_error_has(needle);
    assert_int_equal(cfg.hidden_size, 0); /* nothing half-filled */
}

static void test_tq6_spelling(void **state)
{
    (void)state;
    fr_model_config c;
    assert_int_equal(parse_text(TQ6, &c), FR_OK);
    assert_string_equal(c.architecture, "Qwen3ForCausalLM");
    assert_int_equal(c.vocab_size, 272);
    assert_int_equal(c.hidden_size, 512);
    assert_int_equal(c.num_layers, 6);
    assert_int_equal(c.num_heads, 8);
    assert_int_equal(c.num_kv_heads, 2);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.intermediate_size, 1536);
    assert_int_equal(c.max_position, 32768);
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_true(c.rope_theta == 1e6);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(c.bos_id, 256);
    assert_int_equal(c.pad_id, 258);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_ids[0], 257);
}

static void test_official_spelling(void **state)
{
    (void)state;
    fr_model_config c;
    assert_int_equal(parse_text(QWEN3_4B, &c), FR_OK);
    assert_true(c.rope_theta == 1e6);
    assert_int_equal(c.hidden_size, 2560);
    assert_int_equal(c.head_dim, 128); /* not 2560 / 32 */
    assert_int_equal(c.num_kv_heads, 8);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_int_equal(c.pad_id, -1);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_ids[0], 151645);

    /* rope_scaling may also be absent, or a "default" object. */
    assert_int_equal(parse_edit(QWEN3_4B, "rope_scaling", NULL, &c), FR_OK);
    assert_int_equal(parse_edit(QWEN3_4B, "rope_scaling", "{\"rope_type\":\"default\"}", &c), FR_OK);
}

static void test_rope_variants(void **state)
{
    (void)state;
    fr_model_config c;
    /* Both spellings at once are fine when they agree, an error when not. */
    assert_int_equal(parse_edit(TQ6, "rope_theta", "1000000", &c), FR_OK);
    assert_true(c.rope_theta == 1e6);
    expect_edit_fails("rope_theta", "10000", FR_EFORMAT, "rope_theta");
    /* No theta anywhere. */
    expect_edit_fails("rope_parameters", NULL, FR_EFORMAT, "rope_theta");
    expect_edit_fails("rope_parameters", "{\"rope_type\":\"default\"}", FR_EFORMAT, "rope_theta");
    expect_edit_fails("rope_parameters", "{\"rope_theta\":-1}", FR_EFORMAT, "rope_theta");
    expect_edit_fails("rope_parameters", "5", FR_EFORMAT, "rope_parameters");
    /* Scaling other than YaRN is refused by name, whichever key carries it. */
    expect_edit_fails("rope_parameters", "{\"rope_theta\":1e6,\"rope_type\":\"dynamic\",\"factor\":4}",
                      FR_EUNSUPPORTED, "dynamic");
    expect_edit_fails("rope_scaling", "{\"type\":\"linear\",\"factor\":2}", FR_EUNSUPPORTED, "linear");
    expect_edit_fails("rope_scaling", "{\"rope_type\":\"llama3\",\"factor\":8}", FR_EUNSUPPORTED, "llama3");
}

/* The published YaRN settings: DeepSeek-V2-Lite's and V3's rope_scaling, and
 * Qwen3's long-context one in either spelling. */
static void test_yarn_published(void **state)
{
    (void)state;
    fr_model_config c;
    const char *lite = "{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,\"mscale\":0.707,\"mscale_all_dim\":0.707,"
                       "\"original_max_position_embeddings\":4096,\"type\":\"yarn\"}";
    if (parse_edit(DSV2_LITE, "rope_scaling", lite, &c)) fail_msg("%s", fr_last_error());
    const fr_rope_scaling *y = &c.rope_scaling;
    assert_true(y->yarn && y->factor == 40 && y->original_max_position == 4096 && y->beta_fast == 32 &&
                y->beta_slow == 1 && y->mscale == 0.707 && y->mscale_all_dim == 0.707 && y->truncate &&
                y->attention_factor == 0);
    assert_int_equal(c.max_position, 163840);

    const char *v3 = "{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,\"mscale\":1.0,\"mscale_all_dim\":1.0,"
                     "\"original_max_position_embeddings\":4096,\"type\":\"yarn\"}";
    char *text = NULL;
    {
        cJSON *doc = cJSON_Parse(DSV3);
        cJSON_ReplaceItemInObject(doc, "max_position_embeddings", cJSON_CreateNumber(163840));
        cJSON_AddItemToObject(doc, "rope_scaling", cJSON_Parse(v3));
        text = cJSON_PrintUnformatted(doc);
        cJSON_Delete(doc);
    }
    if (parse_text(text, &c)) fail_msg("%s", fr_last_error());
    cJSON_free(text);
    assert_true(y->yarn && y->factor == 40 && y->mscale == 1.0 && y->mscale_all_dim == 1.0);
    assert_int_equal(c.max_position, 163840);

    const char *qwen = "{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}";
    if (parse_edit(QWEN3_4B, "rope_scaling", qwen, &c)) fail_msg("%s", fr_last_error());
    assert_true(y->yarn && y->factor == 4.0 && y->original_max_position == 32768 && y->beta_fast == 32 &&
                y->beta_slow == 1 && y->mscale == 0 && y->mscale_all_dim == 0 && y->truncate);
    assert_true(c.rope_theta == 1e6);
    /* transformers 5's spelling; without original_max_position_embeddings
     * the window is max_position_embeddings */
    const char *tq = "{\"rope_theta\":1e6,\"rope_type\":\"yarn\",\"factor\":2,\"truncate\":false}";
    if (parse_edit(TQ6, "rope_parameters", tq, &c)) fail_msg("%s", fr_last_error());
    assert_true(y->yarn && y->factor == 2 && !y->truncate && y->original_max_position == c.max_position);
    assert_true(c.rope_theta == 1e6);
    /* plain configs carry no scaling */
    assert_int_equal(parse_text(TQ6, &c), FR_OK);
    assert_false(c.rope_scaling.yarn);
}

/* Bad YaRN values are refused naming the key. */
static void test_yarn_refused(void **state)
{
    (void)state;
    expect_edit_fails("rope_scaling", "{\"rope_type\":\"yarn\"}", FR_EFORMAT, "rope_scaling.factor");
    /* one key of a YaRN object at a time: its name and a bad value */
    static const char *bad[][2] = {{"factor", "0.5"}, {"factor", "\"4\""}, {"beta_fast", "-1"},
                                   {"mscale", "-0.5"}, {"mscale_all_dim", "true"}, {"attention_factor", "0"},
                                   {"original_max_position_embeddings", "0"},
                                   {"original_max_position_embeddings", "1.5"}, {"truncate", "1"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char obj[160], needle[64];
        const char *rest = strcmp(bad[i][0], "factor") ? "\"factor\":4," : "";
        snprintf(obj, sizeof obj, "{\"rope_type\":\"yarn\",%s\"%s\":%s}", rest, bad[i][0], bad[i][1]);
        snprintf(needle, sizeof needle, "rope_scaling.%s", bad[i][0]);
        expect_edit_fails("rope_scaling", obj, FR_EFORMAT, needle);
    }
    expect_edit_fails("rope_scaling", "{\"rope_type\":\"yarn\",\"factor\":4,\"beta_fast\":1,\"beta_slow\":2}",
                      FR_EFORMAT, "rope_scaling.beta_fast");
    /* both keys saying YaRN must agree */
    fr_model_config c;
    const char *p = "{\"rope_theta\":1e6,\"rope_type\":\"yarn\",\"factor\":2}";
    char *text = NULL;
    {
        cJSON *doc = cJSON_Parse(TQ6);
        cJSON_ReplaceItemInObject(doc, "rope_parameters", cJSON_Parse(p));
        cJSON_AddItemToObject(doc, "rope_scaling", cJSON_Parse("{\"type\":\"yarn\",\"factor\":4}"));
        text = cJSON_PrintUnformatted(doc);
        cJSON_Delete(doc);
    }
    assert_int_equal(parse_text(text, &c), FR_EFORMAT);
    fr_test_error_has("rope_scaling");
    cJSON_free(text);
    /* YaRN's range divides by log(theta) */
    expect_edit_fails("rope_parameters", "{\"rope_theta\":1,\"rope_type\":\"yarn\",\"factor\":2}", FR_EFORMAT,
                      "rope_theta");
}

static void test_eos_forms(void **state)
{
    (void)state;
    fr_model_config c;
    assert_int_equal(parse_edit(TQ6, "eos_token_id", "[257, 258, 3]", &c), FR_OK);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_ids[0], 257);
    assert_int_equal(c.eos_ids[2], 3);
    assert_int_equal(parse_edit(TQ6, "eos_token_id", "[]", &c), FR_OK);
    assert_int_equal(c.n_eos, 0);
    assert_int_equal(parse_edit(TQ6, "eos_token_id", NULL, &c), FR_OK);
    assert_int_equal(c.n_eos, 0);
    assert_int_equal(parse_edit(TQ6, "bos_token_id", "null", &c), FR_OK);
    assert_int_equal(c.bos_id, -1);

    expect_edit_fails("eos_token_id", "[1,2,3,4,5,6,7,8,9]", FR_EUNSUPPORTED, "eos_token_id");
    expect_edit_fails("eos_token_id", "[257, \"x\"]", FR_EFORMAT, "eos_token_id");
    expect_edit_fails("eos_token_id", "272", FR_EFORMAT, "eos_token_id"); /* outside vocab */
    expect_edit_fails("bos_token_id", "-1", FR_EFORMAT, "bos_token_id");
    expect_edit_fails("pad_token_id", "1.5", FR_EFORMAT, "pad_token_id");
}

static void test_defaults(void **state)
{
    (void)state;
    fr_model_config c;
    assert_int_equal(parse_edit(TQ6, "head_dim", NULL, &c), FR_OK);
    assert_int_equal(c.head_dim, 64); /* 512 / 8 */
    assert_int_equal(parse_edit(TQ6, "head_dim", "null", &c), FR_OK);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(parse_edit(TQ6, "tie_word_embeddings", NULL, &c), FR_OK);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(parse_edit(TQ6, "num_key_value_heads", NULL, &c), FR_OK);
    assert_int_equal(c.num_kv_heads, 8);
}

static void test_missing_keys(void **state)
{
    (void)state;
    const char *required[] = {"architectures", "model_type", "vocab_size", "hidden_size",
                              "num_hidden_layers", "num_attention_heads", "intermediate_size",
                              "max_position_embeddings", "rms_norm_eps"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        expect_edit_fails(required[i], NULL, FR_EFORMAT, required[i]);
        fr_test_error_has("missing");
    }
}

static void test_wrong_values(void **state)
{
    (void)state;
    expect_edit_fails("hidden_size", "\"512\"", FR_EFORMAT, "hidden_size");
    expect_edit_fails("hidden_size", "512.5", FR_EFORMAT, "hidden_size");
    expect_edit_fails("hidden_size", "0", FR_EFORMAT, "hidden_size");
    expect_edit_fails("num_hidden_layers", "-6", FR_EFORMAT, "num_hidden_layers");
    expect_edit_fails("vocab_size", "1e12", FR_EFORMAT, "vocab_size");
    expect_edit_fails("head_dim", "0", FR_EFORMAT, "head_dim");
    expect_edit_fails("num_key_value_heads", "3", FR_EFORMAT, "num_key_value_heads");
    expect_edit_fails("rms_norm_eps", "0", FR_EFORMAT, "rms_norm_eps");
    expect_edit_fails("rms_norm_eps", "\"1e-6\"", FR_EFORMAT, "rms_norm_eps");
    expect_edit_fails("tie_word_embeddings", "1", FR_EFORMAT, "tie_word_embeddings");
    expect_edit_fails("architectures", "\"Qwen3ForCausalLM\"", FR_EFORMAT, "architectures");
    expect_edit_fails("architectures", "[1]", FR_EFORMAT, "architectures");
    expect_edit_fails("model_type", "7", FR_EFORMAT, "model_type");
}

static void test_unsupported_models(void **state)
{
    (void)state;
    expect_edit_fails("architectures", "[\"LlamaForCausalLM\"]", FR_EUNSUPPORTED, "LlamaForCausalLM");
    expect_edit_fails("architectures", "[]", FR_EUNSUPPORTED, "architectures");
    expect_edit_fails("model_type", "\"qwen3_moe\"", FR_EUNSUPPORTED, "qwen3_moe");
    expect_edit_fails("attention_bias", "true", FR_EUNSUPPORTED, "attention_bias");
    expect_edit_fails("use_sliding_window", "true", FR_EUNSUPPORTED, "use_sliding_window");
    expect_edit_fails("hidden_act", "\"gelu\"", FR_EUNSUPPORTED, "hidden_act");
    expect_edit_fails("quantization_config",
                      "{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": \"fp8\", "
                      "\"weight_block_size\": [128, 128]}",
                      FR_EUNSUPPORTED, "quantization_config\" (quant_method fp8)");
    expect_edit_fails("quantization_config", "{}", FR_EUNSUPPORTED, "quant_method not given");
    fr_model_config q;
    assert_int_equal(parse_edit(TQ6, "quantization_config", "null", &q), FR_OK);   /* none, spelled out */

    /* Listing Qwen3 among others is fine. */
    fr_model_config c;
    assert_int_equal(parse_edit(TQ6, "architectures", "[\"Other\", \"Qwen3ForCausalLM\"]", &c), FR_OK);
    assert_string_equal(c.architecture, "Qwen3ForCausalLM");
}

/* A test checkpoint's config.json as text, or NULL (then the test skips). */
static char *read_config(const char *name)
{
    const char *dir = fr_test_require_model(name);
    if (!dir) return NULL;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *text = calloc(1, 1 << 16);
    assert_non_null(text);
    assert_true(fread(text, 1, (1 << 16) - 1, f) > 0);
    fclose(f);
    return text;
}

/* Qwen3-MoE (tqm) and DeepSeek-V3 latent attention (tqa): the keys read,
 * both spellings of the expert count, and the refusals naming their key. */
static void test_moe_and_mla(void **state)
{
    (void)state;
    char *tqm = read_config("tqm"), *tqa = read_config("tqa");
    if (!tqm || !tqa) {
        free(tqm);
        free(tqa);
        skip();
    }
    fr_model_config c;
    assert_int_equal(parse_text(tqm, &c), FR_OK);
    assert_int_equal(c.num_experts, 16);
    assert_int_equal(c.experts_per_tok, 4);
    assert_int_equal(c.moe_intermediate_size, 128);
    assert_true(c.norm_topk_prob && fr_model_layer_is_moe(&c, 0) && fr_model_layer_is_moe(&c, 3));
    assert_int_equal(parse_edit(tqm, "num_experts", "16", &c), FR_OK);
    assert_int_equal(parse_edit(tqm, "num_experts", "8", &c), FR_EFORMAT);
    fr_test_error_has("disagree");
    assert_int_equal(parse_edit(tqm, "num_experts_per_tok", "17", &c), FR_EFORMAT);
    fr_test_error_has("num_experts_per_tok");
    assert_int_equal(parse_edit(tqm, "mlp_only_layers", "[1, 3]", &c), FR_OK);
    assert_true(fr_model_layer_is_moe(&c, 0) && !fr_model_layer_is_moe(&c, 1) && !fr_model_layer_is_moe(&c, 3));
    assert_int_equal(parse_edit(tqm, "decoder_sparse_step", "2", &c), FR_OK);
    assert_true(!fr_model_layer_is_moe(&c, 0) && fr_model_layer_is_moe(&c, 1));
    assert_int_equal(parse_edit(tqm, "shared_expert_intermediate_size", "64", &c), FR_EUNSUPPORTED);

    assert_int_equal(parse_text(tqa, &c), FR_OK);
    assert_true(fr_model_is_mla(&c));
    assert_int_equal(c.kv_lora_rank, 256);
    assert_int_equal(c.q_lora_rank, 192);
    assert_int_equal(c.num_kv_heads, 1);
    assert_int_equal(c.head_dim, 256 + 64);   /* the cached latent row */
    assert_int_equal(parse_edit(tqa, "q_lora_rank", "null", &c), FR_OK);
    assert_int_equal(c.q_lora_rank, 0);
    assert_int_equal(c.num_experts, 0);   /* every layer dense: the MoE keys are inert */
    assert_int_equal(parse_edit(tqa, "first_k_dense_replace", "1", &c), FR_OK);
    assert_int_equal(c.num_experts, 4);
    assert_true(!fr_model_layer_is_moe(&c, 0) && fr_model_layer_is_moe(&c, 1) && fr_model_layer_is_moe(&c, 3));
    assert_int_equal(parse_edit(tqa, "kv_lora_rank", NULL, &c), FR_EFORMAT);
    fr_test_error_has("kv_lora_rank");
    free(tqm);
    free(tqa);
}

/* DeepSeek's mixture of experts: the published V3 and V2-Lite configs, the
 * defaults of an absent key (transformers' for each class), and every
 * refusal naming its key. */
static void test_deepseek_moe(void **state)
{
    (void)state;
    fr_model_config c;
    if (parse_text(DSV3, &c)) fail_msg("%s", fr_last_error());
    assert_int_equal(c.num_experts, 256);
    assert_int_equal(c.experts_per_tok, 8);
    assert_int_equal(c.moe_intermediate_size, 2048);
    assert_int_equal(c.n_shared_experts, 1);
    assert_int_equal(fr_model_shared_inter(&c), 2048);
    assert_int_equal(c.scoring_func, FR_MOE_SIGMOID);
    assert_int_equal(c.topk_method, FR_MOE_NOAUX_TC);
    assert_true(fr_model_has_router_bias(&c));
    assert_int_equal(c.n_group, 8);
    assert_int_equal(c.topk_group, 4);
    assert_true(c.norm_topk_prob && c.routed_scaling_factor == 2.5f);
    assert_true(!fr_model_layer_is_moe(&c, 2) && fr_model_layer_is_moe(&c, 3) && fr_model_layer_is_moe(&c, 60));
    assert_int_equal(fr_model_moe_layers(&c), 58);
    /* absent keys: DeepseekV3Config's defaults */
    const char *keys[] = {"scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob",
                          "routed_scaling_factor", "n_shared_experts", "moe_layer_freq"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        fr_model_config d;
        if (parse_edit(DSV3, keys[i], NULL, &d)) fail_msg("without %s: %s", keys[i], fr_last_error());
        assert_memory_equal(&d, &c, sizeof c);
    }
    assert_int_equal(parse_edit(DSV3, "first_k_dense_replace", NULL, &c), FR_OK);
    assert_true(!fr_model_layer_is_moe(&c, 2) && fr_model_layer_is_moe(&c, 3));
    assert_int_equal(parse_edit(DSV3, "n_group", "1", &c), FR_EFORMAT);   /* topk_group 4 of 1 group */
    fr_test_error_has("topk_group");
    assert_int_equal(parse_edit(DSV3, "topk_group", "1", &c), FR_OK);
    assert_int_equal(parse_edit(DSV3, "n_shared_experts", "0", &c), FR_OK);
    assert_int_equal(fr_model_shared_inter(&c), 0);
    /* what transformers' DeepseekV3 would not compute as the config says */
    assert_int_equal(parse_edit(DSV3, "scoring_func", "\"softmax\"", &c), FR_EUNSUPPORTED);
    fr_test_error_has("scoring_func");
    assert_int_equal(parse_edit(DSV3, "topk_method", "\"group_limited_greedy\"", &c), FR_EUNSUPPORTED);
    fr_test_error_has("topk_method");
    assert_int_equal(parse_edit(DSV3, "topk_method", "\"aux_free\"", &c), FR_EUNSUPPORTED);
    fr_test_error_has("aux_free");
    assert_int_equal(parse_edit(DSV3, "moe_layer_freq", "2", &c), FR_EUNSUPPORTED);
    fr_test_error_has("moe_layer_freq");
    assert_int_equal(parse_edit(DSV3, "n_group", "3", &c), FR_EFORMAT);   /* does not divide 256 */
    fr_test_error_has("n_group");
    assert_int_equal(parse_edit(DSV3, "n_group", "256", &c), FR_EFORMAT);  /* groups of one */
    fr_test_error_has("two best");
    assert_int_equal(parse_edit(DSV3, "num_experts_per_tok", "129", &c), FR_EFORMAT);
    fr_test_error_has("num_experts_per_tok");
    assert_int_equal(parse_edit(DSV3, "routed_scaling_factor", "0", &c), FR_EFORMAT);
    fr_test_error_has("routed_scaling_factor");
    assert_int_equal(parse_edit(DSV3, "n_routed_experts", NULL, &c), FR_EFORMAT);
    fr_test_error_has("n_routed_experts");
    assert_int_equal(parse_edit(DSV3, "mlp_bias", "true", &c), FR_EUNSUPPORTED);

    if (parse_text(DSV2_LITE, &c)) fail_msg("%s", fr_last_error());
    assert_string_equal(c.architecture, "DeepseekV2ForCausalLM");
    assert_true(fr_model_is_mla(&c) && c.rope_interleave && c.q_lora_rank == 0);
    assert_int_equal(c.num_experts, 64);
    assert_int_equal(c.experts_per_tok, 6);
    assert_int_equal(fr_model_shared_inter(&c), 2 * 1408);
    assert_int_equal(c.scoring_func, FR_MOE_SOFTMAX);
    assert_int_equal(c.topk_method, FR_MOE_GREEDY);
    assert_true(!fr_model_has_router_bias(&c) && !c.norm_topk_prob && fr_model_routed_scale(&c) == 1.0f);
    assert_true(!fr_model_layer_is_moe(&c, 0) && fr_model_layer_is_moe(&c, 1));
    fr_model_config lite;
    fr_synthetic_deepseek_v2_lite_config(&lite);   /* the benchmark shape: the same routing */
    assert_int_equal(lite.num_experts, c.num_experts);
    assert_int_equal(fr_model_moe_layers(&lite), fr_model_moe_layers(&c));
    assert_int_equal(parse_edit(DSV2_LITE, "rope_interleave", "false", &c), FR_OK);
    assert_true(c.rope_interleave);   /* V2 rotates interleaved pairs whatever the key says */
    /* DeepSeek-V2's group-limited routing (the full model: 8 groups, 3 kept) */
    char *v2 = NULL;
    {
        cJSON *doc = cJSON_Parse(DSV2_LITE);
        cJSON_ReplaceItemInObject(doc, "topk_method", cJSON_CreateString("group_limited_greedy"));
        cJSON_ReplaceItemInObject(doc, "n_group", cJSON_CreateNumber(8));
        cJSON_ReplaceItemInObject(doc, "topk_group", cJSON_CreateNumber(3));
        v2 = cJSON_PrintUnformatted(doc);
        cJSON_Delete(doc);
    }
    if (parse_text(v2, &c)) fail_msg("%s", fr_last_error());
    assert_int_equal(c.topk_method, FR_MOE_GROUP_LIMITED);
    assert_true(c.n_group == 8 && c.topk_group == 3);
    assert_int_equal(parse_edit(v2, "n_group", NULL, &c), FR_EFORMAT);
    fr_test_error_has("n_group");
    cJSON_free(v2);
    assert_int_equal(parse_edit(DSV2_LITE, "topk_method", "\"noaux_tc\"", &c), FR_EUNSUPPORTED);
    fr_test_error_has("topk_method");
    assert_int_equal(parse_edit(DSV2_LITE, "scoring_func", "\"sigmoid\"", &c), FR_EUNSUPPORTED);
    fr_test_error_has("scoring_func");
    assert_int_equal(parse_edit(DSV2_LITE, "norm_topk_prob", "true", &c), FR_EUNSUPPORTED);
    fr_test_error_has("norm_topk_prob");
    /* V2's defaults: greedy softmax, two shared experts, scale 1 */
    assert_int_equal(parse_edit(DSV2_LITE, "topk_method", NULL, &c), FR_OK);
    assert_int_equal(c.topk_method, FR_MOE_GREEDY);
    assert_int_equal(parse_edit(DSV2_LITE, "n_shared_experts", NULL, &c), FR_OK);
    assert_int_equal(c.n_shared_experts, 2);
}

static void test_malformed(void **state)
{
    (void)state;
    fr_model_config c;
    const char *bad[] = {"", "{", "[1]", "{\"a\":1} trailing", "null", "{\"hidden_size\":}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse_text(bad[i], &c), FR_EFORMAT);
        fr_test_error_has(LABEL);
    }
    /* The length bounds the input: a valid document cut short is malformed. */
    assert_int_equal(fr_model_config_parse(TQ6, strlen(TQ6) - 1, LABEL, &c), FR_EFORMAT);
    assert_int_equal(fr_model_config_parse(NULL, 5, LABEL, &c), FR_EINVAL);
    assert_int_equal(fr_model_config_parse(TQ6, strlen(TQ6), LABEL, NULL), FR_EINVAL);
}

static void test_load(void **state)
{
    (void)state;
    fr_model_config c;
    assert_int_equal(fr_model_config_load("/nonexistent/dir/config.json", &c), FR_EIO);
    fr_test_error_has("/nonexistent/dir/config.json");
    assert_int_equal(fr_model_config_load("/", &c), FR_EIO);
    assert_int_equal(fr_model_config_load(NULL, &c), FR_EINVAL);

    const char *dir = fr_test_require_tq6();
    if (!dir) skip();
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (fr_model_config_load(path, &c) != FR_OK) fail_msg("%s", fr_last_error());
    assert_int_equal(c.num_layers, 6);
    assert_int_equal(c.head_dim, 128);
    assert_true(c.rope_theta == 1e6);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_tq6_spelling),
             cmocka_unit_test(test_official_spelling),
             cmocka_unit_test(test_rope_variants),
             cmocka_unit_test(test_yarn_published),
             cmocka_unit_test(test_yarn_refused),
             cmocka_unit_test(test_eos_forms),
             cmocka_unit_test(test_defaults),
             cmocka_unit_test(test_missing_keys),
             cmocka_unit_test(test_wrong_values),
             cmocka_unit_test(test_unsupported_models),
             cmocka_unit_test(test_malformed),
             cmocka_unit_test(test_load),
             cmocka_unit_test(test_moe_and_mla),
             cmocka_unit_test(test_deepseek_moe))
