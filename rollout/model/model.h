/* model: a Qwen3 model's weights in memory, as float32 (llama2.c style).
 *
 * Every weight lives in one float32 block that the model owns, laid out in
 * this order (each tensor row-major, with its Hugging Face shape):
 *   embed [vocab][hidden],
 *   for each layer: attn_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm
 *                   (with latent attention instead: q_a_proj, q_a_norm,
 *                   q_b_proj or q_proj, kv_a_proj, kv_a_norm, kv_b_proj,
 *                   o_proj), mlp_norm, then either the dense MLP gate_proj, up_proj,
 *                   down_proj or, in a Mixture-of-Experts layer
 *                   (fr_model_layer_is_moe), router, router_bias (when
 *                   fr_model_has_router_bias), expert_gate, expert_up,
 *                   expert_down (the experts' tensors stacked), then the
 *                   shared experts' shared_gate, shared_up, shared_down
 *                   (when n_shared_experts > 0),
 *   final_norm [hidden],
 *   lm_head [vocab][hidden]   (absent when tie_word_embeddings: it then
 *                              points at embed).
 * fr_model_param_count() is the block's length in floats.
 *
 * Specs fr_model_load() accepts:
 *   "DIR"                   a Hugging Face checkpoint folder (config.json plus
 *                           model.safetensors or a sharded index); tensors are
 *                           converted to float32 (BF16/F16/F32) and every shape
 *                           is checked;
 *   "synthetic:tiny"        the built-in random model below, seed 1;
 *   "synthetic:tiny:SEED"   the same with another seed (decimal, 0..2^64-1);
 *   "synthetic:tiny-qwen3[:SEED]"  tiny's dimensions with Qwen3's vocabulary
 *                           (151,936 ids; BOS 151643, EOS 151645): text
 *                           through Qwen3's tokenizer on a model CI can run
 *                           (156 MB of float32);
 *   "synthetic:qwen3-4b[:SEED]"  Qwen3-4B's shape, for benchmarks on the GPU
 *                           backend (host loading refuses it);
 *   "synthetic:qwen3-4b-128k[:SEED]"  the same weights with a 131,072-token
 *                           window, for long-context decode benchmarks;
 *   "synthetic:qwen3-30b-a3b[-128k][:SEED]"  Qwen3-30B-A3B's shape, a
 *                           Mixture-of-Experts model (GPU backend only);
 *   "synthetic:tiny-dsmoe[:SEED]", "synthetic:tiny-dsmoe-v2[:SEED]"
 *                           small DeepSeek models (latent attention, a dense
 *                           first layer, routed and shared experts) routed as
 *                           DeepSeek-V3 (sigmoid, noaux_tc, groups) and as
 *                           DeepSeek-V2 (softmax, group_limited_greedy), built
 *                           on the host (synthetic_model.c);
 *   "synthetic:deepseek-v2-lite[:SEED]"  DeepSeek-V2-Lite's shape (GPU only).
 *
 * synthetic:tiny is a Qwen3 with the byte tokenizer of tq6: vocab 272 (ids
 * 0..255 bytes, 256 BOS, 257 EOS, 258 PAD), hidden 128, 2 layers, 4 heads,
 * 2 KV heads, head_dim 64, intermediate 256, rms_norm_eps 1e-6, rope_theta
 * 10000, max_position 4096, untied embeddings. Its weights are a pure function
 * of the seed, bit-identical on every machine (see synthetic_model.c).
 */
#ifndef FR_MODEL_H
#define FR_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/model/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float *attn_norm;   /* [hidden] input_layernorm */
    float *q_proj;      /* [n_heads*head_dim][hidden]  (row-major, as in HF: y = x W^T) */
    float *k_proj;      /* [n_kv_heads*head_dim][hidden] */
    float *v_proj;      /* [n_kv_heads*head_dim][hidden] */
    float *o_proj;      /* [hidden][n_heads*head_dim] */
    float *q_norm;      /* [head_dim] */
    float *k_norm;      /* [head_dim] */
    float *mlp_norm;    /* [hidden] post_attention_layernorm */
    float *gate_proj;   /* [intermediate][hidden] */
    float *up_proj;     /* [intermediate][hidden] */
    float *down_proj;   /* [hidden][intermediate] */
    /* MoE layers only (the dense three above are then NULL); E experts of
     * moe_intermediate_size Im, expert e's tensors at offset e * Im * hidden: */
    float *router;      /* [E][hidden] mlp.gate */
    float *router_bias; /* [E] mlp.gate.e_score_correction_bias (noaux_tc routing only) */
    float *expert_gate; /* [E][Im][hidden] mlp.experts.e.gate_proj */
    float *expert_up;   /* [E][Im][hidden] mlp.experts.e.up_proj */
    float *expert_down; /* [E][hidden][Im] mlp.experts.e.down_proj */
    /* DeepSeek's shared experts, one MLP of Is = n_shared_experts * Im rows
     * (NULL without them): */
    float *shared_gate; /* [Is][hidden] mlp.shared_experts.gate_proj */
    float *shared_up;   /* [Is][hidden] mlp.shared_experts.up_proj */
    float *shared_down; /* [hidden][Is] mlp.shared_experts.down_proj */
    /* Multi-head latent attention only (k_proj, v_proj, q_norm, k_norm are
     * then NULL; q_proj [H*(dn+dr)][hidden] only without a query low rank;
     * o_proj [hidden][H*dv]): */
    float *q_a_proj;    /* [q_lora][hidden] */
    float *q_a_norm;    /* [q_lora] */
    float *q_b_proj;    /* [H*(dn+dr)][q_lora] */
    float *kv_a_proj;   /* [dc+dr][hidden] kv_a_proj_with_mqa */
    float *kv_a_norm;   /* [dc] */
    float *kv_b_proj;   /* [H*(dn+dv)][dc] */
} fr_layer_weights;

typedef struct {
    float *embed;       /* [vocab][hidden] */
    float *final_norm;  /* [hidden] */
    float *lm_head;     /* [vocab][hidden]; points at embed when tie_word_embeddings */
    fr_layer_weights *layers; /* [cfg.num_layers] */
} fr_weights;

typedef struct {
    fr_model_config cfg;
    fr_weights w;
    char name[256];     /* the directory (truncated to fit), "synthetic:tiny" or
                           "synthetic:tiny:SEED" (SEED != 1): a spec that reloads it */
    /* private: the one allocation owning all weights; read via fr_model_data() */
    float *data_;
    size_t n_data_;
} fr_model;

#define FR_SYNTHETIC_PREFIX "synthetic:"
#define FR_SYNTHETIC_DEFAULT_SEED 1u

/* spec: a checkpoint directory, or "synthetic:tiny" / "synthetic:tiny:SEED".
 * On failure *out is NULL and fr_last_error() says what and where. */
fr_status fr_model_load(const char *spec, fr_model **out);
/* The configuration of a spec fr_model_load takes, without its weights:
 * the same refusals of a missing folder and of unknown synthetic names. */
fr_status fr_model_spec_config(const char *spec, fr_model_config *cfg);

/* Sets *m = NULL; accepts NULL and *m == NULL. */
void fr_model_destroy(fr_model **m);

/* Frees the host weights, keeping the config and name: for a backend that
 * holds its own copy (the GPU). Weight pointers become NULL. */
void fr_model_drop_weights(fr_model *m);
/* A model with a config and name but no host weights (their values live on
 * the GPU): what fr_model_drop_weights leaves. */
fr_status fr_model_config_only(const fr_model_config *cfg, const char *name, fr_model **out);
/* Number of float32 parameters held (lm_head counted only when untied). */
size_t fr_model_param_count(const fr_model *m);

/* Exchanges the host weights of two models of the same shape (every weight
 * pointer, the block and the layer table move together; configs and names
 * stay), so a staged copy becomes the served one without copying it. Both
 * must hold host weights. FR_EINVAL, changing nothing, otherwise. */
fr_status fr_model_swap_weights(fr_model *a, fr_model *b);

/* The weight block (see the layout above) and its length in floats, e.g. for
 * one host-to-device copy or a bitwise comparison. NULL for a NULL model. */
float *fr_model_data(const fr_model *m, size_t *n_floats);

/* A model for cfg whose weight pointers are laid out but whose values are
 * unset (what the loaders fill). Checks that the sizes are positive and that
 * the block size does not overflow. `name` may be NULL. */
fr_status fr_model_alloc(const fr_model_config *cfg, const char *name, fr_model **out);

/* ---- synthetic models (synthetic_model.c) ------------------------------ */

/* The synthetic:tiny configuration. */
void fr_synthetic_tiny_config(fr_model_config *cfg);

/* synthetic:tiny with the given seed: what fr_model_load("synthetic:tiny:SEED")
 * returns. */
fr_status fr_model_synthetic_tiny(uint64_t seed, fr_model **out);
/* The synthetic:tiny-qwen3 configuration: tiny's, with Qwen3's vocabulary
 * size and special ids. */
void fr_synthetic_tiny_qwen3_config(fr_model_config *cfg);

/* The configuration of synthetic:qwen3-4b, the shape of Qwen3-4B (36 layers,
 * hidden 2560, 32 query and 8 KV heads of 128, intermediate 9728, vocab
 * 151936, tied embeddings). Its weights follow the same generator as tiny's
 * but are made on the GPU (rollout/model/weights_cuda.h): 4.0e9 float32 values do
 * not belong in host memory. */
void fr_synthetic_qwen3_4b_config(fr_model_config *cfg);
/* The configuration of synthetic:qwen3-30b-a3b, the published shape of
 * Qwen3-30B-A3B (48 layers, hidden 2048, 32 query and 4 KV heads of 128, 128
 * experts of intermediate 768, top-8 with normalized weights, vocab 151936,
 * untied, a 40,960-token window; -128k: 131,072), made on the GPU as
 * qwen3-4b's, with a router whose experts are used unevenly. */
void fr_synthetic_qwen3_30b_a3b_config(fr_model_config *cfg);
/* Qwen3-14B's shape (40 query / 8 KV heads of 128: a group of 5), dense. */
void fr_synthetic_qwen3_14b_config(fr_model_config *cfg);
/* Resolves the part of a spec after "synthetic:" ("tiny", "qwen3-4b", either
 * with ":SEED") to its configuration and seed. FR_EINVAL for unknown names
 * and malformed seeds. */
fr_status fr_synthetic_parse(const char *rest, fr_model_config *cfg, uint64_t *seed);
/* Builds a synthetic model in host memory; FR_EUNSUPPORTED for the ones
 * made on the GPU only. */
fr_status fr_model_synthetic(const char *rest, fr_model **out);
/* Whether the synthetic model `rest` names is built on the host only (a
 * device copies it from there): the tiny DeepSeek models, which the device
 * generator does not make (tiny is made either way, with the same bits). */
int fr_synthetic_host_only(const char *rest);
/* The small DeepSeek configurations (synthetic_model.c): tiny-dsmoe
 * (DeepseekV3ForCausalLM: vocab 272 as tiny, hidden 128, 3 layers of which
 * the first dense of 256, 4 heads, latent 256 and RoPE 64 (the widths the
 * GPU's latent kernel takes), no query low rank, nope 64, values 64, 16
 * experts of 64 rows, top-4 in 2 of 4 groups by noaux_tc, sigmoid,
 * normalized, scale 2.5, one shared expert) and with v2 set tiny-dsmoe-v2
 * (DeepseekV2ForCausalLM: query low rank 64, softmax, group_limited_greedy,
 * no renormalization, scale 1.5, two shared experts). */
void fr_synthetic_tiny_dsmoe_config(fr_model_config *cfg, int v2);
/* DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads, latent 512, no
 * query low rank, nope 128, RoPE 64, values 128, first layer dense of 10944,
 * then 64 experts of 1408 rows, top-6 greedy softmax, two shared experts,
 * vocab 102400), made on the GPU. */
void fr_synthetic_deepseek_v2_lite_config(fr_model_config *cfg);
/* The host-built tiny DeepSeek models: every tensor of the table
 * (tensor_table.h) filled by the generator of synthetic_model.c, stream t
 * for the t-th tensor. */
fr_status fr_model_synthetic_dsmoe(const fr_model_config *cfg, const char *name, uint64_t seed, fr_model **out);

#ifdef __cplusplus
}
#endif

#endif
