/* model_config: the Hugging Face config.json of a Qwen3 model, dense
 * (Qwen3ForCausalLM) or Mixture-of-Experts (Qwen3MoeForCausalLM), or of a
 * DeepSeek model with multi-head latent attention, dense MLPs and DeepSeek's
 * mixture of experts (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM;
 * docs/deepseek_moe.md).
 *
 * Only what the forward pass needs is kept. Anything that would change the
 * math without the engine knowing (another architecture, RoPE scaling other
 * than YaRN, biased attention, sliding windows, another activation) is
 * refused with FR_EUNSUPPORTED rather than silently ignored.
 */
#ifndef FR_MODEL_CONFIG_H
#define FR_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"
#include "kvcache/calib_file.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most layers a config may declare (the MoE layer mask is sized by it). */
#define FR_MAX_LAYERS 256
/* The most routed experts and expert groups a config may declare (the
 * routers keep a row's choices on the stack). */
#define FR_MAX_EXPERTS 4096
#define FR_MAX_EXPERT_GROUPS 256

/* How a router turns its logits into scores (scoring_func). */
typedef enum { FR_MOE_SOFTMAX = 0, FR_MOE_SIGMOID } fr_moe_scoring;
/* How it picks a token's experts from the scores (topk_method):
 *   GREEDY         the k best scores;
 *   GROUP_LIMITED  DeepSeek-V2's: the experts split into n_group groups in
 *                  index order, the topk_group groups of the largest best
 *                  score kept, the k best scores among their experts;
 *   NOAUX_TC       DeepSeek-V3's: the choice is score + e_score_correction_bias,
 *                  the groups ranked by the sum of their two best choices,
 *                  the k best choices among the kept groups' experts; the
 *                  weights are the unbiased scores.
 * docs/deepseek_moe.md states every rule exactly. */
typedef enum { FR_MOE_GREEDY = 0, FR_MOE_GROUP_LIMITED, FR_MOE_NOAUX_TC } fr_moe_topk_method;

/* YaRN RoPE scaling: rope_scaling (or rope_parameters) of type "yarn", as
 * transformers reads it; rollout/model/rope_yarn.h turns it into frequencies
 * and scales (docs/mla.md, "YaRN"). A zeroed struct is plain RoPE. */
typedef struct {
    int yarn;                  /* 1: the fields below apply */
    double factor;             /* factor, >= 1 */
    int original_max_position; /* original_max_position_embeddings (default: max_position_embeddings) */
    double beta_fast, beta_slow; /* rotations bounding the ramp; defaults 32 and 1 */
    double mscale, mscale_all_dim; /* DeepSeek's; 0 when absent */
    double attention_factor;   /* the cos/sin multiplier as given; 0: derived (rope_yarn.h) */
    int truncate;              /* floor/ceil the correction range (default 1) */
} fr_rope_scaling;

typedef struct {
    char architecture[64];   /* "Qwen3ForCausalLM" */
    int vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size, max_position;
    float rms_norm_eps;
    double rope_theta;
    fr_rope_scaling rope_scaling; /* yarn 0: plain RoPE */
    int tie_word_embeddings; /* 0 or 1; absent means 0 */
    int bos_id, pad_id;      /* -1 when absent or null */
    int n_eos;               /* 0..8 */
    int eos_ids[8];
    /* Mixture of experts (model_type "qwen3_moe", "deepseek_v2",
     * "deepseek_v3"); num_experts 0 means a dense model and the fields below
     * are unused. */
    int num_experts;         /* num_experts, num_local_experts or n_routed_experts */
    int experts_per_tok;     /* top-k, 1..num_experts */
    int moe_intermediate_size;
    int norm_topk_prob;      /* renormalize the top-k weights to sum 1 */
    int decoder_sparse_step; /* layer l is sparse when (l + 1) % step == 0 ... */
    uint64_t mlp_only[FR_MAX_LAYERS / 64]; /* ... and bit l is clear here (DeepSeek: the layers
                                            * before first_k_dense_replace) */
    /* DeepSeek's routing (docs/deepseek_moe.md). A zeroed config (Qwen3-MoE,
     * or one built by hand) routes as Qwen3-MoE: softmax, greedy, no groups,
     * scale 1, no shared experts. */
    int scoring_func;        /* fr_moe_scoring */
    int topk_method;         /* fr_moe_topk_method; NOAUX_TC layers carry e_score_correction_bias */
    int n_group, topk_group; /* 0 or 1: no groups */
    float routed_scaling_factor; /* the routing weights' factor; 0 means 1 */
    int n_shared_experts;    /* shared experts of every MoE layer, one MLP of
                              * n_shared_experts * moe_intermediate_size rows; 0: none */
    /* Multi-head latent attention (model_type "deepseek_v2" or "deepseek_v3"); kv_lora_rank 0
     * means the Qwen3 attention above. An MLA model caches one row per token
     * shared by all heads: the normed latent (kv_lora_rank) then the rotated
     * RoPE key (qk_rope_dim). num_kv_heads is then 1 and head_dim that row's
     * width, so the KV cache and everything sized by it hold latent rows. */
    int kv_lora_rank;        /* d_c */
    int q_lora_rank;         /* 0: no query low-rank path (q_proj) */
    int qk_nope_dim, qk_rope_dim, v_head_dim;
    int rope_interleave;     /* RoPE on interleaved pairs (DeepSeek-V3) */
} fr_model_config;

static inline int fr_model_is_mla(const fr_model_config *c) { return c->kv_lora_rank > 0; }

/* Whether layer l has a routed-expert MLP (transformers' rule: not listed in
 * mlp_only_layers and (l + 1) a multiple of decoder_sparse_step). */
static inline int fr_model_layer_is_moe(const fr_model_config *c, int l)
{
    if (c->num_experts <= 0 || l < 0 || l >= FR_MAX_LAYERS) return 0;
    if ((c->mlp_only[l / 64] >> (l % 64)) & 1u) return 0;
    return (l + 1) % c->decoder_sparse_step == 0;
}

/* The number of MoE layers (the routed-expert records of a token hold one
 * entry per such layer, in layer order). */
static inline int fr_model_moe_layers(const fr_model_config *c)
{
    int n = 0;
    for (int l = 0; l < c->num_layers; l++) n += fr_model_layer_is_moe(c, l);
    return n;
}

/* The rows of a MoE layer's shared-expert MLP (0: none). */
static inline int fr_model_shared_inter(const fr_model_config *c)
{
    return c->num_experts > 0 ? c->n_shared_experts * c->moe_intermediate_size : 0;
}

/* Whether the MoE layers carry a router bias (e_score_correction_bias). */
static inline int fr_model_has_router_bias(const fr_model_config *c)
{
    return c->num_experts > 0 && c->topk_method == FR_MOE_NOAUX_TC;
}

/* The routing weights' factor: routed_scaling_factor, 1 when unset. */
static inline float fr_model_routed_scale(const fr_model_config *c)
{
    return c->routed_scaling_factor > 0.0f ? c->routed_scaling_factor : 1.0f;
}

/* The expert groups (1 when unset) and the groups a token may use. */
static inline int fr_model_groups(const fr_model_config *c) { return c->n_group > 1 ? c->n_group : 1; }
static inline int fr_model_topk_groups(const fr_model_config *c)
{
    return c->n_group > 1 && c->topk_group >= 1 ? c->topk_group : fr_model_groups(c);
}

/* The shape of the model's calibration tables (kvcache/calib_file.h). */
static inline fr_calib_dims fr_model_calib_dims(const fr_model_config *c)
{
    return (fr_calib_dims){.layers = c->num_layers, .kv_heads = c->num_kv_heads, .head_dim = c->head_dim};
}

/* Parses json[0, len) (need not be NUL-terminated). `label` (usually the
 * path) starts every error message, followed by the offending key. On
 * failure *cfg is left zeroed. */
fr_status fr_model_config_parse(const char *json, size_t len, const char *label, fr_model_config *cfg);

/* Reads and parses the file at path. */
fr_status fr_model_config_load(const char *path, fr_model_config *cfg);

#ifdef __cplusplus
}
#endif

#endif
