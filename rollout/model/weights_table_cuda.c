/* The Hugging Face names of device weights (fr_weights_gpu_tensors of
 * rollout/model/weights_cuda.h): what a receiver writing straight into a
 * fr_weights_gpu needs to find each tensor. */
#include <stdio.h>
#include <stdlib.h>

#include "rollout/model/tensor_table.h"
#include "rollout/model/weights_cuda.h"

static void add(fr_weights_gpu_tensor *t, int *n, const char *name, uint16_t *dst, int ndim, int64_t d0, int64_t d1)
{
    fr_weights_gpu_tensor *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, "%s", name);
    x->dst = dst;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = ndim == 2 ? d1 : 1;
}

/* A MoE layer's router and experts, in the order of rollout/model/tensor_table.h. */
static int add_experts(fr_weights_gpu_tensor *t, int k, const fr_model_config *c, const fr_layer_weights_gpu *L, int l)
{
    const int64_t H = c->hidden_size, Im = c->moe_intermediate_size;
    char name[96];
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
    add(t, &k, name, L->router, 2, c->num_experts, H);
    for (int e = 0; e < c->num_experts; e++) {
        uint16_t *gu = L->expert_gate_up + (size_t)e * 2 * (size_t)(Im * H);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.gate_proj.weight", l, e);
        add(t, &k, name, gu, 2, Im, H);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.up_proj.weight", l, e);
        add(t, &k, name, gu + (size_t)(Im * H), 2, Im, H);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.down_proj.weight", l, e);
        add(t, &k, name, L->expert_down + (size_t)e * (size_t)(H * Im), 2, H, Im);
    }
    return k;
}

fr_status fr_weights_gpu_tensors(const fr_weights_gpu *w, fr_weights_gpu_tensor **out, int *n)
{
    if (!w || !out || !n) return fr_fail(FR_EINVAL, "fr_weights_gpu_tensors: NULL argument");
    *out = NULL;
    *n = 0;
    if (w->tp_size > 1)
        return fr_fail(FR_EUNSUPPORTED, "GPU weights: the tensor table of a tensor-parallel shard is not offered");
    const fr_model_config *c = &w->cfg;
    fr_weights_gpu_tensor *t = calloc(fr_model_tensor_count(c), sizeof *t);
    if (!t) return fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    const int64_t H = c->hidden_size, D = c->head_dim, I = c->intermediate_size, V = c->vocab_size;
    const int64_t qd = (int64_t)c->num_heads * D, kvd = (int64_t)c->num_kv_heads * D;
    char name[96];
    int k = 0;
    add(t, &k, "model.embed_tokens.weight", w->embed, 2, V, H);
    for (int l = 0; l < c->num_layers; l++) {
        const fr_layer_weights_gpu *L = &w->layers[l];
#define N(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix), name)
        add(t, &k, N("input_layernorm.weight"), L->attn_norm, 1, H, 0);
        add(t, &k, N("self_attn.q_proj.weight"), L->q_proj, 2, qd, H);
        add(t, &k, N("self_attn.k_proj.weight"), L->k_proj, 2, kvd, H);
        add(t, &k, N("self_attn.v_proj.weight"), L->v_proj, 2, kvd, H);
        add(t, &k, N("self_attn.o_proj.weight"), L->o_proj, 2, H, qd);
        add(t, &k, N("self_attn.q_norm.weight"), L->q_norm, 1, D, 0);
        add(t, &k, N("self_attn.k_norm.weight"), L->k_norm, 1, D, 0);
        add(t, &k, N("post_attention_layernorm.weight"), L->mlp_norm, 1, H, 0);
#undef N
        if (L->router) {
            k = add_experts(t, k, c, L, l);
            continue;
        }
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate_proj.weight", l);
        add(t, &k, name, L->gate_up, 2, I, H);
        snprintf(name, sizeof name, "model.layers.%d.mlp.up_proj.weight", l);
        add(t, &k, name, L->gate_up + (size_t)I * (size_t)H, 2, I, H);
        snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj.weight", l);
        add(t, &k, name, L->down_proj, 2, H, I);
    }
    add(t, &k, "model.norm.weight", w->final_norm, 1, H, 0);
    if (!c->tie_word_embeddings) add(t, &k, "lm_head.weight", w->lm_head, 2, V, H);
    *out = t;
    *n = k;
    return FR_OK;
}
