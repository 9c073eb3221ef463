/* The Hugging Face names of device weights (fr_weights_gpu_tensors of
 * rollout/model/weights_cuda.h), with the part of the whole tensor a shard
 * holds: what a writer into a fr_weights_gpu (weight staging, sharding)
 * needs to find each tensor. */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "rollout/model/tensor_table.h"
#include "rollout/model/tp_shard.h"
#include "rollout/model/weights_cuda.h"

typedef struct {
    fr_weights_gpu_tensor *t;
    int n;
} table;

static void add(table *b, uint16_t *dst, int ndim, int64_t d0, int64_t d1, fr_tensor_split split, int64_t start,
                const char *fmt, int l, int e)
{
    fr_weights_gpu_tensor *x = &b->t[b->n++];
    snprintf(x->name, sizeof x->name, fmt, l, e);
    x->dst = dst;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = ndim == 2 ? d1 : 1;
    x->split = split;
    x->start = start;
}

/* A MoE layer's router and experts: the router (and its bias) whole, of
 * every expert this rank's gate and up rows and down columns, then its rows
 * and columns of the shared experts. */
static void add_experts(table *b, const fr_model_config *c, const fr_tp_layout *tl, const fr_layer_weights_gpu *L,
                        int l)
{
    const int64_t H = c->hidden_size, Il = tl->moe_inter, i0 = tl->moe_inter0;
    const int64_t Sl = tl->shared_inter, s0 = tl->shared_inter0;
    add(b, L->router, 2, c->num_experts, H, FR_SPLIT_NONE, 0, "model.layers.%d.mlp.gate.weight", l, 0);
    if (fr_model_has_router_bias(c))
        add(b, L->router_bias, 1, c->num_experts, 0, FR_SPLIT_NONE, 0,
            "model.layers.%d.mlp.gate.e_score_correction_bias", l, 0);
    for (int e = 0; e < c->num_experts; e++) {
        uint16_t *gu = L->expert_gate_up + (size_t)e * 2 * (size_t)(Il * H);
        add(b, gu, 2, Il, H, FR_SPLIT_ROWS, i0, "model.layers.%d.mlp.experts.%d.gate_proj.weight", l, e);
        add(b, gu + (size_t)(Il * H), 2, Il, H, FR_SPLIT_ROWS, i0, "model.layers.%d.mlp.experts.%d.up_proj.weight",
            l, e);
        add(b, L->expert_down + (size_t)e * (size_t)(H * Il), 2, H, Il, FR_SPLIT_COLS, i0,
            "model.layers.%d.mlp.experts.%d.down_proj.weight", l, e);
    }
    if (!Sl) return;
    add(b, L->shared_gate_up, 2, Sl, H, FR_SPLIT_ROWS, s0, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l, 0);
    add(b, L->shared_gate_up + (size_t)(Sl * H), 2, Sl, H, FR_SPLIT_ROWS, s0,
        "model.layers.%d.mlp.shared_experts.up_proj.weight", l, 0);
    add(b, L->shared_down, 2, H, Sl, FR_SPLIT_COLS, s0, "model.layers.%d.mlp.shared_experts.down_proj.weight", l, 0);
}

/* Latent attention (DeepSeek-V3 names): the query and kv_b rows of this
 * rank's heads, o_proj's columns of them; the latent path whole. */
static void add_mla(table *b, const fr_model_config *c, const fr_tp_layout *tl, const fr_layer_weights_gpu *L, int l)
{
    const int64_t H = c->hidden_size, nh = tl->n_heads, h0 = tl->head0, ql = c->q_lora_rank;
    const int64_t dc = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    if (ql) {
        add(b, L->q_a_proj, 2, ql, H, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.q_a_proj.weight", l, 0);
        add(b, L->q_a_norm, 1, ql, 0, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.q_a_layernorm.weight", l, 0);
        add(b, L->q_b_proj, 2, nh * (dn + dr), ql, FR_SPLIT_ROWS, h0 * (dn + dr),
            "model.layers.%d.self_attn.q_b_proj.weight", l, 0);
    } else {
        add(b, L->q_proj, 2, nh * (dn + dr), H, FR_SPLIT_ROWS, h0 * (dn + dr), "model.layers.%d.self_attn.q_proj.weight",
            l, 0);
    }
    add(b, L->kv_a_proj, 2, dc + dr, H, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l, 0);
    add(b, L->kv_a_norm, 1, dc, 0, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.kv_a_layernorm.weight", l, 0);
    add(b, L->kv_b_proj, 2, nh * (dn + dv), dc, FR_SPLIT_ROWS, h0 * (dn + dv), "model.layers.%d.self_attn.kv_b_proj.weight",
        l, 0);
    add(b, L->o_proj, 2, H, nh * dv, FR_SPLIT_COLS, h0 * dv, "model.layers.%d.self_attn.o_proj.weight", l, 0);
}

/* The layer's MLP: the router and experts, or the dense three. */
static void add_mlp(table *b, const fr_model_config *c, const fr_tp_layout *tl, const fr_layer_weights_gpu *L, int l)
{
    if (L->router) {
        add_experts(b, c, tl, L, l);
        return;
    }
    const int64_t H = c->hidden_size, I = tl->inter, i0 = tl->inter0;
    add(b, L->gate_up, 2, I, H, FR_SPLIT_ROWS, i0, "model.layers.%d.mlp.gate_proj.weight", l, 0);
    add(b, L->gate_up + (size_t)I * (size_t)H, 2, I, H, FR_SPLIT_ROWS, i0, "model.layers.%d.mlp.up_proj.weight", l, 0);
    add(b, L->down_proj, 2, H, I, FR_SPLIT_COLS, i0, "model.layers.%d.mlp.down_proj.weight", l, 0);
}

static void add_layer(table *b, const fr_model_config *c, const fr_tp_layout *tl, const fr_layer_weights_gpu *L, int l)
{
    const int64_t H = c->hidden_size, D = c->head_dim, qd = (int64_t)tl->n_heads * D, kvd = (int64_t)tl->n_kv_heads * D;
    const int64_t q0 = (int64_t)tl->head0 * D, kv0 = (int64_t)tl->kv_head0 * D;
    add(b, L->attn_norm, 1, H, 0, FR_SPLIT_NONE, 0, "model.layers.%d.input_layernorm.weight", l, 0);
    if (fr_model_is_mla(c)) {
        add_mla(b, c, tl, L, l);
        add(b, L->mlp_norm, 1, H, 0, FR_SPLIT_NONE, 0, "model.layers.%d.post_attention_layernorm.weight", l, 0);
        add_mlp(b, c, tl, L, l);
        return;
    }
    add(b, L->q_proj, 2, qd, H, FR_SPLIT_ROWS, q0, "model.layers.%d.self_attn.q_proj.weight", l, 0);
    add(b, L->k_proj, 2, kvd, H, FR_SPLIT_ROWS, kv0, "model.layers.%d.self_attn.k_proj.weight", l, 0);
    add(b, L->v_proj, 2, kvd, H, FR_SPLIT_ROWS, kv0, "model.layers.%d.self_attn.v_proj.weight", l, 0);
    add(b, L->o_proj, 2, H, qd, FR_SPLIT_COLS, q0, "model.layers.%d.self_attn.o_proj.weight", l, 0);
    add(b, L->q_norm, 1, D, 0, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.q_norm.weight", l, 0);
    add(b, L->k_norm, 1, D, 0, FR_SPLIT_NONE, 0, "model.layers.%d.self_attn.k_norm.weight", l, 0);
    add(b, L->mlp_norm, 1, H, 0, FR_SPLIT_NONE, 0, "model.layers.%d.post_attention_layernorm.weight", l, 0);
    add_mlp(b, c, tl, L, l);
}

fr_status fr_weights_gpu_tensors(const fr_weights_gpu *w, const fr_model_config *full, fr_weights_gpu_tensor **out,
                                 int *n)
{
    if (!w || !out || !n) return fr_fail(FR_EINVAL, "fr_weights_gpu_tensors: NULL argument");
    *out = NULL;
    *n = 0;
    if (w->tp_size > 1 && !full)
        return fr_fail(FR_EINVAL, "GPU weights: the tensor table of a shard needs the whole model's config");
    const fr_model_config *fc = w->tp_size > 1 ? full : &w->cfg;
    fr_tp_layout tl;
    fr_status st = fr_tp_layout_of(fc, w->tp_size > 1 ? w->tp_rank : 0, w->tp_size > 1 ? w->tp_size : 1, &tl);
    if (st) return st;
    table b = {calloc(fr_model_tensor_count(fc), sizeof *b.t), 0};
    if (!b.t) return fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    const int64_t H = fc->hidden_size;
    add(&b, w->embed, 2, fc->vocab_size, H, FR_SPLIT_NONE, 0, "model.embed_tokens.weight", 0, 0);
    for (int l = 0; l < fc->num_layers; l++) add_layer(&b, fc, &tl, &w->layers[l], l);
    add(&b, w->final_norm, 1, H, 0, FR_SPLIT_NONE, 0, "model.norm.weight", 0, 0);
    if (!fc->tie_word_embeddings) add(&b, w->lm_head, 2, tl.vocab, H, FR_SPLIT_ROWS, tl.vocab0, "lm_head.weight", 0, 0);
    *out = b.t;
    *n = b.n;
    return FR_OK;
}

fr_status fr_weights_gpu_copy_tensor(const fr_weights_gpu_tensor *dst, const fr_weights_gpu_tensor *src, void *stream)
{
    if (!dst || !src) return fr_fail(FR_EINVAL, "fr_weights_gpu_copy_tensor: NULL argument");
    cudaStream_t s = (cudaStream_t)stream;
    const size_t rows = (size_t)dst->shape[0], cols = (size_t)dst->shape[1], src_cols = (size_t)src->shape[1];
    const size_t es = sizeof(uint16_t);
    const uint16_t *from = src->dst;
    cudaError_t e;
    if (dst->split == FR_SPLIT_COLS)
        e = cudaMemcpy2DAsync(dst->dst, cols * es, from + dst->start, src_cols * es, cols * es, rows,
                              cudaMemcpyDeviceToDevice, s);
    else
        e = cudaMemcpyAsync(dst->dst, from + (dst->split == FR_SPLIT_ROWS ? (size_t)dst->start * src_cols : 0),
                            rows * cols * es, cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "GPU weights: copying %s failed: %s", dst->name, cudaGetErrorString(e));
    return FR_OK;
}
