/* model_config: the Hugging Face config.json of a Qwen3 model, dense
 * (Qwen3ForCausalLM) or Mixture-of-Experts (Qwen3MoeForCausalLM), or of a
 * DeepSeek-V3 model with multi-head latent attention and dense MLPs
 * (DeepseekV3ForCausalLM).
 *
 * Only what the forward pass needs is kept. Anything that would change the
 * math without the engine knowing (another architecture, scaled RoPE, biased
 * attention, sliding windows, another activation) is refused with
 * FR_EUNSUPPORTED rather than silently ignored.
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

typedef struct {
    char architecture[64];   /* "Qwen3ForCausalLM" */
    int vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size, max_position;
    float rms_norm_eps;
    double rope_theta;
    int tie_word_embeddings; /* 0 or 1; absent means 0 */
    int bos_id, pad_id;      /* -1 when absent or null */
    int n_eos;               /* 0..8 */
    int eos_ids[8];
    /* Mixture of experts (model_type "qwen3_moe"); num_experts 0 means a
     * dense model and the fields below are unused. */
    int num_experts;         /* num_experts or num_local_experts */
    int experts_per_tok;     /* top-k, 1..num_experts */
    int moe_intermediate_size;
    int norm_topk_prob;      /* renormalize the top-k weights to sum 1 */
    int decoder_sparse_step; /* layer l is sparse when (l + 1) % step == 0 ... */
    uint64_t mlp_only[FR_MAX_LAYERS / 64]; /* ... and bit l is clear here */
    /* Multi-head latent attention (model_type "deepseek_v3"); kv_lora_rank 0
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
