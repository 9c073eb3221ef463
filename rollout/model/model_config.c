#include "rollout/model/model_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A key's value, treating JSON null like an absent key: HF writes null for
 * "not set" (rope_scaling, pad_token_id, head_dim...). */
static const cJSON *get(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static int as_int(const cJSON *v, int *out)
{
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= INT_MIN && d <= INT_MAX) || d != (double)(int)d) return 0;
    *out = (int)d;
    return 1;
}

static fr_status positive_int(const cJSON *root, const char *label, const char *key, int *out)
{
    const cJSON *v = get(root, key);
    if (!v) return fr_fail(FR_EFORMAT, "%s: missing key \"%s\"", label, key);
    if (!as_int(v, out)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be an integer", label, key);
    if (*out <= 0) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be positive (got %d)", label, key, *out);
    return FR_OK;
}

/* Token ids are optional, but one that is given must index the vocabulary. */
static fr_status token_id(const cJSON *v, const char *label, const char *key, int vocab, int *out)
{
    if (!as_int(v, out)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must hold integer token ids", label, key);
    if (*out < 0 || *out >= vocab)
        return fr_fail(FR_EFORMAT, "%s: key \"%s\": token id %d is outside the vocabulary [0, %d)",
                       label, key, *out, vocab);
    return FR_OK;
}

static fr_status opt_bool(const cJSON *root, const char *label, const char *key, int *out)
{
    const cJSON *v = get(root, key);
    *out = 0;
    if (!v) return FR_OK;
    if (!cJSON_IsBool(v)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be true or false", label, key);
    *out = cJSON_IsTrue(v);
    return FR_OK;
}

/* The RoPE type of a rope_scaling or rope_parameters object: plain (no type,
 * or "default") or YaRN; every other type is refused by name. HF spells the
 * key "rope_type" (older: "type"). */
static fr_status rope_type(const cJSON *obj, const char *label, const char *key, int *yarn)
{
    *yarn = 0;
    if (!cJSON_IsObject(obj)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be an object", label, key);
    const cJSON *t = get(obj, "rope_type");
    if (!t) t = get(obj, "type");
    if (!t) return FR_OK;
    if (!cJSON_IsString(t)) return fr_fail(FR_EFORMAT, "%s: key \"%s.rope_type\" must be a string", label, key);
    *yarn = strcmp(t->valuestring, "yarn") == 0;
    if (!*yarn && strcmp(t->valuestring, "default") != 0)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"%s\": RoPE type \"%s\" is not supported (only \"default\" and "
                       "\"yarn\")", label, key, t->valuestring);
    return FR_OK;
}

/* An optional number of a RoPE object in [min, 1e6] (above min only when
 * open), the default when absent. */
static fr_status rope_number(const cJSON *obj, const char *label, const char *key, const char *name, double min,
                             int open, double dflt, double *out)
{
    const cJSON *v = get(obj, name);
    *out = dflt;
    if (!v) return FR_OK;
    const double x = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(x >= min && x <= 1e6) || (open && x == min))
        return fr_fail(FR_EFORMAT, "%s: key \"%s.%s\" must be a number %s %g and at most 1e6", label, key, name,
                       open ? ">" : ">=", min);
    *out = x;
    return FR_OK;
}

/* The keys of a YaRN object, with transformers' defaults: beta_fast 32 and
 * beta_slow 1 (a 0 also means the default there), the original window
 * max_position_embeddings, truncate true; mscale, mscale_all_dim and
 * attention_factor 0 when absent (rope_yarn.h derives the scales). */
static fr_status parse_yarn(const cJSON *obj, const char *label, const char *key, int max_position, fr_rope_scaling *y)
{
    memset(y, 0, sizeof *y);
    y->yarn = 1;
    if (!get(obj, "factor")) return fr_fail(FR_EFORMAT, "%s: key \"%s.factor\" is missing; YaRN needs it", label, key);
    fr_status rc;
    if ((rc = rope_number(obj, label, key, "factor", 1.0, 0, 1.0, &y->factor)) != FR_OK ||
        (rc = rope_number(obj, label, key, "beta_fast", 0.0, 0, 0.0, &y->beta_fast)) != FR_OK ||
        (rc = rope_number(obj, label, key, "beta_slow", 0.0, 0, 0.0, &y->beta_slow)) != FR_OK ||
        (rc = rope_number(obj, label, key, "mscale", 0.0, 0, 0.0, &y->mscale)) != FR_OK ||
        (rc = rope_number(obj, label, key, "mscale_all_dim", 0.0, 0, 0.0, &y->mscale_all_dim)) != FR_OK ||
        (rc = rope_number(obj, label, key, "attention_factor", 0.0, 1, 0.0, &y->attention_factor)) != FR_OK)
        return rc;
    if (y->beta_fast == 0) y->beta_fast = 32;
    if (y->beta_slow == 0) y->beta_slow = 1;
    if (y->beta_fast < y->beta_slow)
        return fr_fail(FR_EFORMAT, "%s: key \"%s.beta_fast\" (%g) must be at least \"%s.beta_slow\" (%g)", label, key,
                       y->beta_fast, key, y->beta_slow);
    const cJSON *o = get(obj, "original_max_position_embeddings");
    y->original_max_position = max_position;
    if (o && (!as_int(o, &y->original_max_position) || y->original_max_position <= 0))
        return fr_fail(FR_EFORMAT, "%s: key \"%s.original_max_position_embeddings\" must be a positive integer", label,
                       key);
    const cJSON *t = get(obj, "truncate");
    y->truncate = 1;
    if (t && !cJSON_IsBool(t)) return fr_fail(FR_EFORMAT, "%s: key \"%s.truncate\" must be true or false", label, key);
    if (t) y->truncate = cJSON_IsTrue(t);
    return FR_OK;
}

/* rope_scaling (older configs) and rope_parameters (transformers 5) may both
 * carry the scaling; when both say YaRN they must agree. */
static fr_status parse_scaling(const cJSON *params, const cJSON *scaling, const char *label, fr_model_config *c)
{
    int yp = 0, ys = 0;
    fr_status rc;
    if (params && (rc = rope_type(params, label, "rope_parameters", &yp)) != FR_OK) return rc;
    if (scaling && (rc = rope_type(scaling, label, "rope_scaling", &ys)) != FR_OK) return rc;
    fr_rope_scaling a, b;
    if (yp && (rc = parse_yarn(params, label, "rope_parameters", c->max_position, &a)) != FR_OK) return rc;
    if (ys && (rc = parse_yarn(scaling, label, "rope_scaling", c->max_position, &b)) != FR_OK) return rc;
    if (yp && ys && memcmp(&a, &b, sizeof a) != 0)
        return fr_fail(FR_EFORMAT, "%s: keys \"rope_parameters\" and \"rope_scaling\" give different YaRN settings",
                       label);
    if (yp || ys) c->rope_scaling = yp ? a : b;
    return FR_OK;
}

/* Newer transformers write rope_parameters.rope_theta, official Qwen3
 * checkpoints a top-level rope_theta; when both appear they must agree. */
static fr_status parse_rope(const cJSON *root, const char *label, fr_model_config *c)
{
    const cJSON *params = get(root, "rope_parameters"), *scaling = get(root, "rope_scaling");
    const cJSON *top = get(root, "rope_theta"), *nested = NULL;
    fr_status rc;
    if ((rc = parse_scaling(params, scaling, label, c)) != FR_OK) return rc;
    if (params) nested = get(params, "rope_theta");
    if (!top && !nested)
        return fr_fail(FR_EFORMAT, "%s: missing key \"rope_theta\" (top level or in rope_parameters)", label);
    const cJSON *v = nested ? nested : top;
    const char *key = nested ? "rope_parameters.rope_theta" : "rope_theta";
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0)
        return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be a positive number", label, key);
    if (top && nested && (!cJSON_IsNumber(top) || top->valuedouble != nested->valuedouble))
        return fr_fail(FR_EFORMAT, "%s: keys \"rope_theta\" and \"rope_parameters.rope_theta\" disagree", label);
    /* YaRN's correction range divides by log(theta). */
    if (c->rope_scaling.yarn && v->valuedouble <= 1.0)
        return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be above 1 with YaRN scaling", label, key);
    c->rope_theta = v->valuedouble;
    return FR_OK;
}

/* The architectures the engine implements, with the model_type each implies. */
static const struct {
    const char *arch, *model_type;
} known_archs[] = {
    {"Qwen3ForCausalLM", "qwen3"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"},
    {"DeepseekV2ForCausalLM", "deepseek_v2"},
    {"DeepseekV3ForCausalLM", "deepseek_v3"},
};

static int is_deepseek(const fr_model_config *c)
{
    return strcmp(c->architecture, "DeepseekV2ForCausalLM") == 0 || strcmp(c->architecture, "DeepseekV3ForCausalLM") == 0;
}

static int is_deepseek_v2(const fr_model_config *c) { return strcmp(c->architecture, "DeepseekV2ForCausalLM") == 0; }

static fr_status check_identity(const cJSON *root, const char *label, fr_model_config *c)
{
    const cJSON *arch = get(root, "architectures"), *a;
    if (!arch) return fr_fail(FR_EFORMAT, "%s: missing key \"architectures\"", label);
    if (!cJSON_IsArray(arch)) return fr_fail(FR_EFORMAT, "%s: key \"architectures\" must be a list", label);
    char found[256] = "";
    const char *want_type = NULL;
    cJSON_ArrayForEach(a, arch) {
        if (!cJSON_IsString(a))
            return fr_fail(FR_EFORMAT, "%s: key \"architectures\" must be a list of strings", label);
        for (size_t i = 0; i < sizeof known_archs / sizeof known_archs[0] && !want_type; i++)
            if (strcmp(a->valuestring, known_archs[i].arch) == 0) {
                snprintf(c->architecture, sizeof c->architecture, "%s", a->valuestring);
                want_type = known_archs[i].model_type;
            }
        if (want_type) break;
        size_t used = strlen(found);
        snprintf(found + used, sizeof found - used, "%s\"%s\"", used ? ", " : "", a->valuestring);
    }
    if (!c->architecture[0])
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"architectures\" is [%s]; only Qwen3ForCausalLM, "
                       "Qwen3MoeForCausalLM, DeepseekV2ForCausalLM and DeepseekV3ForCausalLM are supported", label,
                       found);

    const cJSON *mt = get(root, "model_type");
    if (!mt) return fr_fail(FR_EFORMAT, "%s: missing key \"model_type\"", label);
    if (!cJSON_IsString(mt)) return fr_fail(FR_EFORMAT, "%s: key \"model_type\" must be a string", label);
    if (strcmp(mt->valuestring, want_type) != 0)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"model_type\" is \"%s\"; %s needs \"%s\"", label,
                       mt->valuestring, c->architecture, want_type);

    /* Options the dense forward does not implement. */
    int on;
    fr_status rc;
    if ((rc = opt_bool(root, label, "attention_bias", &on)) != FR_OK) return rc;
    if (on) return fr_fail(FR_EUNSUPPORTED, "%s: key \"attention_bias\" is true; biased attention is not supported", label);
    if ((rc = opt_bool(root, label, "use_sliding_window", &on)) != FR_OK) return rc;
    if (on) return fr_fail(FR_EUNSUPPORTED, "%s: key \"use_sliding_window\" is true; sliding windows are not supported", label);
    if ((rc = opt_bool(root, label, "mlp_bias", &on)) != FR_OK) return rc;
    if (on) return fr_fail(FR_EUNSUPPORTED, "%s: key \"mlp_bias\" is true; biased MLPs are not supported", label);
    const cJSON *act = get(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"hidden_act\" must be \"silu\"", label);
    /* A quantized checkpoint (DeepSeek-V3/R1's FP8 blocks with their
     * weight_scale_inv tensors, GPTQ, AWQ, ...) stores weights the loader
     * would misread: refused by its method, before any tensor is read. */
    const cJSON *q = get(root, "quantization_config");
    if (q && !cJSON_IsNull(q)) {
        const cJSON *m = cJSON_IsObject(q) ? get(q, "quant_method") : NULL;
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"quantization_config\" (quant_method %s): quantized checkpoints "
                       "are not supported; give one in BF16, F16 or F32 (dequantize it first)", label,
                       m && cJSON_IsString(m) ? m->valuestring : "not given");
    }
    return FR_OK;
}

static fr_status parse_sizes(const cJSON *root, const char *label, fr_model_config *c)
{
    fr_status rc;
    if ((rc = positive_int(root, label, "vocab_size", &c->vocab_size)) != FR_OK ||
        (rc = positive_int(root, label, "hidden_size", &c->hidden_size)) != FR_OK ||
        (rc = positive_int(root, label, "num_hidden_layers", &c->num_layers)) != FR_OK ||
        (rc = positive_int(root, label, "num_attention_heads", &c->num_heads)) != FR_OK ||
        (rc = positive_int(root, label, "intermediate_size", &c->intermediate_size)) != FR_OK ||
        (rc = positive_int(root, label, "max_position_embeddings", &c->max_position)) != FR_OK)
        return rc;
    if (c->num_layers > FR_MAX_LAYERS)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"num_hidden_layers\" is %d; at most %d are supported", label,
                       c->num_layers, FR_MAX_LAYERS);

    /* As in transformers: no num_key_value_heads means plain multi-head. */
    c->num_kv_heads = c->num_heads;
    if (get(root, "num_key_value_heads") &&
        (rc = positive_int(root, label, "num_key_value_heads", &c->num_kv_heads)) != FR_OK)
        return rc;
    if (c->num_heads % c->num_kv_heads != 0)
        return fr_fail(FR_EFORMAT, "%s: key \"num_attention_heads\" (%d) is not divisible by \"num_key_value_heads\" (%d)",
                       label, c->num_heads, c->num_kv_heads);

    /* Qwen3 decouples head_dim from hidden/heads (Qwen3-4B: 2560/32 != 128),
     * so the derived value is only a fallback. */
    if (get(root, "head_dim")) {
        if ((rc = positive_int(root, label, "head_dim", &c->head_dim)) != FR_OK) return rc;
    } else if (c->hidden_size % c->num_heads != 0) {
        return fr_fail(FR_EFORMAT, "%s: missing key \"head_dim\", and hidden_size %d is not divisible by %d heads",
                       label, c->hidden_size, c->num_heads);
    } else {
        c->head_dim = c->hidden_size / c->num_heads;
    }

    const cJSON *eps = get(root, "rms_norm_eps");
    if (!eps) return fr_fail(FR_EFORMAT, "%s: missing key \"rms_norm_eps\"", label);
    if (!cJSON_IsNumber(eps) || !(eps->valuedouble > 0 && eps->valuedouble < 1))
        return fr_fail(FR_EFORMAT, "%s: key \"rms_norm_eps\" must be a number in (0, 1)", label);
    c->rms_norm_eps = (float)eps->valuedouble;
    return FR_OK;
}

static fr_status parse_tokens(const cJSON *root, const char *label, fr_model_config *c)
{
    fr_status rc;
    const cJSON *v;
    c->bos_id = c->pad_id = -1;
    if ((v = get(root, "bos_token_id")) && (rc = token_id(v, label, "bos_token_id", c->vocab_size, &c->bos_id)) != FR_OK)
        return rc;
    if ((v = get(root, "pad_token_id")) && (rc = token_id(v, label, "pad_token_id", c->vocab_size, &c->pad_id)) != FR_OK)
        return rc;

    const cJSON *eos = get(root, "eos_token_id");
    if (!eos) return FR_OK;
    if (!cJSON_IsArray(eos)) {
        c->n_eos = 1;
        return token_id(eos, label, "eos_token_id", c->vocab_size, &c->eos_ids[0]);
    }
    int cap = (int)(sizeof c->eos_ids / sizeof c->eos_ids[0]);
    if (cJSON_GetArraySize(eos) > cap)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"eos_token_id\" lists %d ids, at most %d supported",
                       label, cJSON_GetArraySize(eos), cap);
    cJSON_ArrayForEach(v, eos) {
        if ((rc = token_id(v, label, "eos_token_id", c->vocab_size, &c->eos_ids[c->n_eos])) != FR_OK)
            return rc;
        c->n_eos++;
    }
    return FR_OK;
}

/* A non-negative integer key with a default for when it is absent. */
static fr_status opt_int(const cJSON *root, const char *label, const char *key, int dflt, int min, int *out)
{
    const cJSON *v = get(root, key);
    *out = dflt;
    if (!v) return FR_OK;
    if (!as_int(v, out)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be an integer", label, key);
    if (*out < min) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be >= %d (got %d)", label, key, min, *out);
    return FR_OK;
}

/* Published Qwen3-MoE configs say num_experts, newer transformers write
 * num_local_experts; when both appear they must agree. */
static fr_status parse_expert_count(const cJSON *root, const char *label, int *n)
{
    int a = 0, b = 0;
    fr_status rc;
    int has_a = get(root, "num_experts") != NULL, has_b = get(root, "num_local_experts") != NULL;
    if (!has_a && !has_b)
        return fr_fail(FR_EFORMAT, "%s: missing key \"num_experts\" (or \"num_local_experts\")", label);
    if (has_a && (rc = positive_int(root, label, "num_experts", &a)) != FR_OK) return rc;
    if (has_b && (rc = positive_int(root, label, "num_local_experts", &b)) != FR_OK) return rc;
    if (has_a && has_b && a != b)
        return fr_fail(FR_EFORMAT, "%s: keys \"num_experts\" (%d) and \"num_local_experts\" (%d) disagree",
                       label, a, b);
    *n = has_a ? a : b;
    return FR_OK;
}

static fr_status parse_mlp_only(const cJSON *root, const char *label, fr_model_config *c)
{
    const cJSON *list = get(root, "mlp_only_layers"), *v;
    if (!list) return FR_OK;
    if (!cJSON_IsArray(list)) return fr_fail(FR_EFORMAT, "%s: key \"mlp_only_layers\" must be a list", label);
    cJSON_ArrayForEach(v, list) {
        int l;
        if (!as_int(v, &l) || l < 0 || l >= c->num_layers)
            return fr_fail(FR_EFORMAT, "%s: key \"mlp_only_layers\" must list layer indices in [0, %d)", label,
                           c->num_layers);
        c->mlp_only[l / 64] |= 1ull << (l % 64);
    }
    return FR_OK;
}

/* The routed-expert keys of a qwen3_moe config. Everything that would change
 * the math and is not implemented (shared experts, as in Qwen2-MoE) is
 * refused. */
static fr_status parse_moe(const cJSON *root, const char *label, fr_model_config *c)
{
    fr_status rc;
    int shared = 0;
    if (strcmp(c->architecture, "Qwen3MoeForCausalLM") != 0) return FR_OK;
    if ((rc = parse_expert_count(root, label, &c->num_experts)) != FR_OK ||
        (rc = positive_int(root, label, "num_experts_per_tok", &c->experts_per_tok)) != FR_OK ||
        (rc = positive_int(root, label, "moe_intermediate_size", &c->moe_intermediate_size)) != FR_OK ||
        (rc = opt_int(root, label, "decoder_sparse_step", 1, 1, &c->decoder_sparse_step)) != FR_OK ||
        (rc = opt_bool(root, label, "norm_topk_prob", &c->norm_topk_prob)) != FR_OK ||
        (rc = opt_int(root, label, "shared_expert_intermediate_size", 0, 0, &shared)) != FR_OK ||
        (rc = parse_mlp_only(root, label, c)) != FR_OK)
        return rc;
    if (c->experts_per_tok > c->num_experts)
        return fr_fail(FR_EFORMAT, "%s: key \"num_experts_per_tok\" (%d) is larger than the %d experts", label,
                       c->experts_per_tok, c->num_experts);
    if (shared > 0)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"shared_expert_intermediate_size\" is %d; shared experts "
                       "are not supported", label, shared);
    return FR_OK;
}

/* The attention keys of a DeepSeek config (deepseek_v2, deepseek_v3):
 * multi-head latent attention. */
static fr_status parse_mla(const cJSON *root, const char *label, fr_model_config *c)
{
    fr_status rc;
    if (!is_deepseek(c)) return FR_OK;
    if ((rc = positive_int(root, label, "kv_lora_rank", &c->kv_lora_rank)) != FR_OK ||
        (rc = opt_int(root, label, "q_lora_rank", 0, 0, &c->q_lora_rank)) != FR_OK ||
        (rc = positive_int(root, label, "qk_nope_head_dim", &c->qk_nope_dim)) != FR_OK ||
        (rc = positive_int(root, label, "qk_rope_head_dim", &c->qk_rope_dim)) != FR_OK ||
        (rc = positive_int(root, label, "v_head_dim", &c->v_head_dim)) != FR_OK)
        return rc;
    /* transformers' DeepSeek-V2 rotates (2i, 2i + 1) pairs as complex
     * numbers: the interleaved layout, whatever the config says. */
    const cJSON *il = is_deepseek_v2(c) ? NULL : get(root, "rope_interleave");
    c->rope_interleave = 1;   /* transformers' default for DeepSeek-V3 */
    if (il && !cJSON_IsBool(il)) return fr_fail(FR_EFORMAT, "%s: key \"rope_interleave\" must be true or false", label);
    if (il) c->rope_interleave = cJSON_IsTrue(il);
    if (c->qk_rope_dim % 2) return fr_fail(FR_EFORMAT, "%s: key \"qk_rope_head_dim\" must be even", label);
    /* The cache row of a token: latent then RoPE key, shared by the heads. */
    c->num_kv_heads = 1;
    c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
    return FR_OK;
}

/* An optional string key: *out the default when absent. */
static fr_status opt_string(const cJSON *root, const char *label, const char *key, const char *dflt, const char **out)
{
    const cJSON *v = get(root, key);
    *out = dflt;
    if (!v) return FR_OK;
    if (!cJSON_IsString(v)) return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be a string", label, key);
    *out = v->valuestring;
    return FR_OK;
}

static fr_status opt_positive_float(const cJSON *root, const char *label, const char *key, double dflt, float *out)
{
    const cJSON *v = get(root, key);
    *out = (float)dflt;
    if (!v) return FR_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || !(v->valuedouble > 0) || v->valuedouble > 1e6)
        return fr_fail(FR_EFORMAT, "%s: key \"%s\" must be a positive number", label, key);
    *out = (float)v->valuedouble;
    return FR_OK;
}

/* The routing keys of a DeepSeek config. Each architecture takes the
 * routing its transformers class computes: DeepseekV3ForCausalLM sigmoid
 * scores with noaux_tc (and nothing else: the class ignores the two keys),
 * DeepseekV2ForCausalLM softmax scores with greedy or group_limited_greedy
 * and no renormalization; anything else would be computed other than the
 * reference does, so it is refused by name. */
static fr_status parse_routing(const cJSON *root, const char *label, fr_model_config *c)
{
    const int v2 = is_deepseek_v2(c);
    const char *scoring, *method;
    fr_status rc;
    if ((rc = opt_string(root, label, "scoring_func", v2 ? "softmax" : "sigmoid", &scoring)) != FR_OK ||
        (rc = opt_string(root, label, "topk_method", v2 ? "greedy" : "noaux_tc", &method)) != FR_OK)
        return rc;
    if (strcmp(scoring, v2 ? "softmax" : "sigmoid") != 0)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"scoring_func\" is \"%s\"; %s routes with %s scores only", label,
                       scoring, c->architecture, v2 ? "softmax" : "sigmoid");
    c->scoring_func = v2 ? FR_MOE_SOFTMAX : FR_MOE_SIGMOID;
    if (!v2 && strcmp(method, "noaux_tc") == 0) c->topk_method = FR_MOE_NOAUX_TC;
    else if (v2 && strcmp(method, "greedy") == 0) c->topk_method = FR_MOE_GREEDY;
    else if (v2 && strcmp(method, "group_limited_greedy") == 0) c->topk_method = FR_MOE_GROUP_LIMITED;
    else
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"topk_method\" is \"%s\"; %s routes with %s only", label, method,
                       c->architecture, v2 ? "\"greedy\" or \"group_limited_greedy\"" : "\"noaux_tc\"");
    /* Groups: V3's defaults 8 and 4; V2's null means none (greedy). */
    const int grouped = c->topk_method != FR_MOE_GREEDY;
    if ((rc = opt_int(root, label, "n_group", v2 ? 1 : 8, 1, &c->n_group)) != FR_OK ||
        (rc = opt_int(root, label, "topk_group", v2 ? 1 : 4, 1, &c->topk_group)) != FR_OK)
        return rc;
    if (v2 && grouped && (!get(root, "n_group") || !get(root, "topk_group")))
        return fr_fail(FR_EFORMAT, "%s: key \"topk_method\" \"group_limited_greedy\" needs keys \"n_group\" and "
                       "\"topk_group\"", label);
    if (!grouped) c->n_group = c->topk_group = 1;
    const int E = c->num_experts, G = c->n_group;
    if (E > FR_MAX_EXPERTS || G > FR_MAX_EXPERT_GROUPS)
        return fr_fail(FR_EUNSUPPORTED, "%s: keys \"n_routed_experts\" (%d) and \"n_group\" (%d): at most %d experts "
                       "in %d groups are supported", label, E, G, FR_MAX_EXPERTS, FR_MAX_EXPERT_GROUPS);
    if (E % G || c->topk_group > G)
        return fr_fail(FR_EFORMAT, "%s: key \"n_group\" (%d) must divide the %d experts and \"topk_group\" (%d) "
                       "be at most it", label, G, E, c->topk_group);
    if (c->topk_method == FR_MOE_NOAUX_TC && G > 1 && E / G < 2)
        return fr_fail(FR_EFORMAT, "%s: key \"n_group\" (%d): noaux_tc ranks a group by its two best experts, and "
                       "groups of %d experts have no two", label, G, E / G);
    if (c->experts_per_tok > c->topk_group * (E / G))
        return fr_fail(FR_EFORMAT, "%s: key \"num_experts_per_tok\" (%d) is more than the %d experts of %d groups",
                       label, c->experts_per_tok, c->topk_group * (E / G), c->topk_group);
    return FR_OK;
}

/* The mixture-of-experts keys of a DeepSeek config (docs/deepseek_moe.md
 * has every key, its default and why). The layers before
 * first_k_dense_replace are dense (mlp_only), every later one routed. */
static fr_status parse_deepseek_moe(const cJSON *root, const char *label, fr_model_config *c)
{
    fr_status rc;
    int dense = 0, freq = 1;
    if (!is_deepseek(c)) return FR_OK;
    const int v2 = is_deepseek_v2(c);
    if ((rc = opt_int(root, label, "first_k_dense_replace", v2 ? 0 : 3, 0, &dense)) != FR_OK ||
        (rc = opt_int(root, label, "moe_layer_freq", 1, 1, &freq)) != FR_OK)
        return rc;
    if (dense >= c->num_layers) return FR_OK;   /* dense MLPs only: the MoE keys are inert */
    /* transformers makes every layer from first_k_dense_replace on an MoE
     * layer; DeepSeek's own code also skips layers by moe_layer_freq. */
    if (freq != 1)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"moe_layer_freq\" is %d; only 1 (every layer after the dense "
                       "ones routed, as transformers builds them) is supported", label, freq);
    if ((rc = positive_int(root, label, "n_routed_experts", &c->num_experts)) != FR_OK ||
        (rc = positive_int(root, label, "num_experts_per_tok", &c->experts_per_tok)) != FR_OK ||
        (rc = positive_int(root, label, "moe_intermediate_size", &c->moe_intermediate_size)) != FR_OK ||
        (rc = opt_int(root, label, "n_shared_experts", v2 ? 2 : 1, 0, &c->n_shared_experts)) != FR_OK ||
        (rc = opt_positive_float(root, label, "routed_scaling_factor", v2 ? 1.0 : 2.5, &c->routed_scaling_factor)) !=
            FR_OK)
        return rc;
    if (c->experts_per_tok > c->num_experts)
        return fr_fail(FR_EFORMAT, "%s: key \"num_experts_per_tok\" (%d) is larger than the %d experts", label,
                       c->experts_per_tok, c->num_experts);
    c->norm_topk_prob = !v2;   /* transformers' default for V3 */
    if (get(root, "norm_topk_prob") && (rc = opt_bool(root, label, "norm_topk_prob", &c->norm_topk_prob)) != FR_OK)
        return rc;
    /* DeepSeek-V2's own code renormalizes without the scaling factor when
     * this is true; transformers' DeepseekV2 ignores the key. No published
     * V2 checkpoint sets it, so the two never meet: refuse rather than pick. */
    if (v2 && c->norm_topk_prob)
        return fr_fail(FR_EUNSUPPORTED, "%s: key \"norm_topk_prob\" is true; DeepseekV2ForCausalLM with renormalized "
                       "routing weights is not supported (its references disagree on the weights)", label);
    c->decoder_sparse_step = 1;
    for (int l = 0; l < dense; l++) c->mlp_only[l / 64] |= 1ull << (l % 64);
    return parse_routing(root, label, c);
}

fr_status fr_model_config_parse(const char *json, size_t len, const char *label, fr_model_config *cfg)
{
    if (!cfg) return fr_fail(FR_EINVAL, "fr_model_config_parse: cfg is NULL");
    memset(cfg, 0, sizeof *cfg);
    if (!label) label = "<config>";
    if (!json && len) return fr_fail(FR_EINVAL, "%s: json is NULL", label);

    /* cJSON wants a NUL-terminated string; the caller's bytes may have none. */
    char *text = malloc(len + 1);
    if (!text) return fr_fail(FR_ENOMEM, "%s: no memory for %zu bytes", label, len);
    if (len) memcpy(text, json, len);
    text[len] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 1);

    fr_model_config c;
    memset(&c, 0, sizeof c);
    fr_status rc = FR_OK;
    if (!root)
        rc = fr_fail(FR_EFORMAT, "%s: not valid JSON (error near byte %td)", label, end ? end - text : (ptrdiff_t)0);
    else if (!cJSON_IsObject(root))
        rc = fr_fail(FR_EFORMAT, "%s: not a JSON object", label);
    else if ((rc = check_identity(root, label, &c)) == FR_OK && (rc = parse_sizes(root, label, &c)) == FR_OK &&
             (rc = parse_rope(root, label, &c)) == FR_OK &&
             (rc = opt_bool(root, label, "tie_word_embeddings", &c.tie_word_embeddings)) == FR_OK &&
             (rc = parse_tokens(root, label, &c)) == FR_OK && (rc = parse_moe(root, label, &c)) == FR_OK &&
             (rc = parse_mla(root, label, &c)) == FR_OK && (rc = parse_deepseek_moe(root, label, &c)) == FR_OK)
        *cfg = c;
    cJSON_Delete(root);
    free(text);
    return rc;
}

/* Configs are a few KiB; the cap only stops a wrong path from reading a
 * multi-gigabyte file into memory. */
#define CONFIG_MAX_BYTES ((size_t)16 << 20)

fr_status fr_model_config_load(const char *path, fr_model_config *cfg)
{
    if (!cfg) return fr_fail(FR_EINVAL, "fr_model_config_load: cfg is NULL");
    memset(cfg, 0, sizeof *cfg);
    if (!path) return fr_fail(FR_EINVAL, "fr_model_config_load: path is NULL");

    char eb[128];
    FILE *fp = fopen(path, "rb");
    if (!fp) return fr_fail(FR_EIO, "%s: cannot open: %s", path, strerror_r(errno, eb, sizeof eb));
    size_t cap = 0, n = 0;
    char *buf = NULL;
    fr_status rc = FR_OK;
    for (;;) {
        if (n == cap) {
            if (cap > CONFIG_MAX_BYTES) {
                rc = fr_fail(FR_EFORMAT, "%s: larger than %zu bytes; not a config.json", path, CONFIG_MAX_BYTES);
                break;
            }
            char *grown = realloc(buf, cap = cap ? 2 * cap : 16384);
            if (!grown) {
                rc = fr_fail(FR_ENOMEM, "%s: no memory", path);
                break;
            }
            buf = grown;
        }
        n += fread(buf + n, 1, cap - n, fp);
        if (ferror(fp)) {
            rc = fr_fail(FR_EIO, "%s: read failed: %s", path, strerror_r(errno, eb, sizeof eb));
            break;
        }
        if (feof(fp)) break;
    }
    if (rc == FR_OK) rc = fr_model_config_parse(buf, n, path, cfg);
    free(buf);
    fclose(fp);
    return rc;
}
