#include "rollout/model/tensor_table.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t fr_model_tensor_count(const fr_model_config *c)
{
    size_t n = 2 + (c->tie_word_embeddings ? 0 : 1);   /* embed, final norm, lm_head */
    /* norms, then the attention's tensors */
    const size_t attn = fr_model_is_mla(c) ? (c->q_lora_rank ? 7 : 5) : 6;
    for (int l = 0; l < c->num_layers; l++)
        n += 2 + attn + (fr_model_layer_is_moe(c, l) ? 1 + 3 * (size_t)c->num_experts + (size_t)fr_model_has_router_bias(c) +
                                                        (fr_model_shared_inter(c) ? 3 : 0)
                                                  : 3);
    return n;
}

typedef struct {
    fr_model_tensor t;
    fr_model_tensor_fn fn;
    void *user;
} walk;

static fr_status visit(walk *k, float *data, int64_t rows, int64_t cols, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->t.name, sizeof k->t.name, fmt, ap);
    va_end(ap);
    k->t.data = data;
    k->t.ndim = cols ? 2 : 1;
    k->t.rows = rows;
    k->t.cols = cols;
    return k->fn(k->user, &k->t);
}

static fr_status experts(walk *k, const fr_model_config *c, const fr_layer_weights *L, int l)
{
    const int64_t H = c->hidden_size, Im = c->moe_intermediate_size;
    const size_t per = (size_t)Im * (size_t)H;
    fr_status st = visit(k, L->router, c->num_experts, H, "model.layers.%d.mlp.gate.weight", l);
    if (!st && fr_model_has_router_bias(c))
        st = visit(k, L->router_bias, c->num_experts, 0, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
    for (int e = 0; e < c->num_experts && !st; e++) {
        size_t at = (size_t)e * per;
        st = visit(k, L->expert_gate ? L->expert_gate + at : NULL, Im, H,
                   "model.layers.%d.mlp.experts.%d.gate_proj.weight", l, e);
        if (!st)
            st = visit(k, L->expert_up ? L->expert_up + at : NULL, Im, H,
                       "model.layers.%d.mlp.experts.%d.up_proj.weight", l, e);
        if (!st)
            st = visit(k, L->expert_down ? L->expert_down + at : NULL, H, Im,
                       "model.layers.%d.mlp.experts.%d.down_proj.weight", l, e);
    }
    const int64_t Is = fr_model_shared_inter(c);
    if (!st && Is) st = visit(k, L->shared_gate, Is, H, "model.layers.%d.mlp.shared_experts.gate_proj.weight", l);
    if (!st && Is) st = visit(k, L->shared_up, Is, H, "model.layers.%d.mlp.shared_experts.up_proj.weight", l);
    if (!st && Is) st = visit(k, L->shared_down, H, Is, "model.layers.%d.mlp.shared_experts.down_proj.weight", l);
    return st;
}

static fr_status mlp(walk *k, const fr_model_config *c, const fr_layer_weights *L, int l);

/* Multi-head latent attention's tensors (DeepSeek names). */
static fr_status mla(walk *k, const fr_model_config *c, const fr_layer_weights *L, int l)
{
    const int64_t H = c->hidden_size, nh = c->num_heads, dc = c->kv_lora_rank, dr = c->qk_rope_dim,
                  dn = c->qk_nope_dim, dv = c->v_head_dim, ql = c->q_lora_rank;
    fr_status st;
    if (ql) {
        if ((st = visit(k, L->q_a_proj, ql, H, "model.layers.%d.self_attn.q_a_proj.weight", l)) ||
            (st = visit(k, L->q_a_norm, ql, 0, "model.layers.%d.self_attn.q_a_layernorm.weight", l)) ||
            (st = visit(k, L->q_b_proj, nh * (dn + dr), ql, "model.layers.%d.self_attn.q_b_proj.weight", l)))
            return st;
    } else if ((st = visit(k, L->q_proj, nh * (dn + dr), H, "model.layers.%d.self_attn.q_proj.weight", l))) {
        return st;
    }
    if ((st = visit(k, L->kv_a_proj, dc + dr, H, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l)) ||
        (st = visit(k, L->kv_a_norm, dc, 0, "model.layers.%d.self_attn.kv_a_layernorm.weight", l)) ||
        (st = visit(k, L->kv_b_proj, nh * (dn + dv), dc, "model.layers.%d.self_attn.kv_b_proj.weight", l)))
        return st;
    return visit(k, L->o_proj, H, nh * dv, "model.layers.%d.self_attn.o_proj.weight", l);
}

static fr_status layer(walk *k, const fr_model_config *c, const fr_layer_weights *L, int l)
{
    const int64_t H = c->hidden_size, D = c->head_dim;
    const int64_t qd = (int64_t)c->num_heads * D, kvd = (int64_t)c->num_kv_heads * D;
    fr_status st;
    if (fr_model_is_mla(c)) {
        if ((st = visit(k, L->attn_norm, H, 0, "model.layers.%d.input_layernorm.weight", l)) ||
            (st = mla(k, c, L, l)) ||
            (st = visit(k, L->mlp_norm, H, 0, "model.layers.%d.post_attention_layernorm.weight", l)))
            return st;
        return mlp(k, c, L, l);
    }
    if ((st = visit(k, L->attn_norm, H, 0, "model.layers.%d.input_layernorm.weight", l)) ||
        (st = visit(k, L->q_proj, qd, H, "model.layers.%d.self_attn.q_proj.weight", l)) ||
        (st = visit(k, L->k_proj, kvd, H, "model.layers.%d.self_attn.k_proj.weight", l)) ||
        (st = visit(k, L->v_proj, kvd, H, "model.layers.%d.self_attn.v_proj.weight", l)) ||
        (st = visit(k, L->o_proj, H, qd, "model.layers.%d.self_attn.o_proj.weight", l)) ||
        (st = visit(k, L->q_norm, D, 0, "model.layers.%d.self_attn.q_norm.weight", l)) ||
        (st = visit(k, L->k_norm, D, 0, "model.layers.%d.self_attn.k_norm.weight", l)) ||
        (st = visit(k, L->mlp_norm, H, 0, "model.layers.%d.post_attention_layernorm.weight", l)))
        return st;
    return mlp(k, c, L, l);
}

/* The layer's MLP: routed experts or the dense three. */
static fr_status mlp(walk *k, const fr_model_config *c, const fr_layer_weights *L, int l)
{
    const int64_t H = c->hidden_size, I = c->intermediate_size;
    fr_status st;
    if (fr_model_layer_is_moe(c, l)) return experts(k, c, L, l);
    if ((st = visit(k, L->gate_proj, I, H, "model.layers.%d.mlp.gate_proj.weight", l)) ||
        (st = visit(k, L->up_proj, I, H, "model.layers.%d.mlp.up_proj.weight", l)))
        return st;
    return visit(k, L->down_proj, H, I, "model.layers.%d.mlp.down_proj.weight", l);
}

fr_status fr_model_tensors_each(const fr_model_config *c, const fr_weights *w, fr_model_tensor_fn fn, void *user)
{
    if (!c || !w || !fn) return fr_fail(FR_EINVAL, "fr_model_tensors_each: NULL argument");
    walk k = {.fn = fn, .user = user};
    const int64_t V = c->vocab_size, H = c->hidden_size;
    static const fr_layer_weights none;
    fr_status st = visit(&k, w->embed, V, H, "model.embed_tokens.weight");
    for (int l = 0; l < c->num_layers && !st; l++) st = layer(&k, c, w->layers ? &w->layers[l] : &none, l);
    if (!st) st = visit(&k, w->final_norm, H, 0, "model.norm.weight");
    if (!st && !c->tie_word_embeddings) st = visit(&k, w->lm_head, V, H, "lm_head.weight");
    return st;
}

typedef struct {
    fr_model_tensor *t;
    size_t n;
} list_ctx;

static fr_status append(void *user, const fr_model_tensor *t)
{
    list_ctx *l = user;
    l->t[l->n++] = *t;
    return FR_OK;
}

fr_status fr_model_tensor_list(const fr_model_config *c, const fr_weights *w, fr_model_tensor **out, size_t *n)
{
    if (!c || !w || !out || !n) return fr_fail(FR_EINVAL, "fr_model_tensor_list: NULL argument");
    *out = NULL;
    *n = 0;
    list_ctx l = {.t = calloc(fr_model_tensor_count(c), sizeof *l.t)};
    if (!l.t) return fr_fail(FR_ENOMEM, "tensor table: out of memory");
    fr_status st = fr_model_tensors_each(c, w, append, &l);
    if (st) {
        free(l.t);
        return st;
    }
    *out = l.t;
    *n = l.n;
    return FR_OK;
}
