#include "rollout/model/tp_shard.h"

#include <stdlib.h>
#include <string.h>

fr_status fr_tp_layout_of(const fr_model_config *c, int rank, int size, fr_tp_layout *out)
{
    memset(out, 0, sizeof *out);
    if (size < 1) return fr_fail(FR_EINVAL, "tensor parallel: tp %d must be >= 1", size);
    if (rank < 0 || rank >= size)
        return fr_fail(FR_EINVAL, "tensor parallel: rank %d outside [0, %d)", rank, size);
    if (c->num_heads < 1 || c->num_kv_heads < 1 || c->num_heads % c->num_kv_heads)
        return fr_fail(FR_EINVAL, "tensor parallel: %d query heads do not group over %d KV heads", c->num_heads,
                       c->num_kv_heads);
    if (c->num_heads % size)
        return fr_fail(FR_EINVAL, "tensor parallel: %d query heads do not split over tp %d", c->num_heads, size);
    if (c->num_kv_heads % size && size % c->num_kv_heads)
        return fr_fail(FR_EINVAL,
                       "tensor parallel: %d KV heads do not split over tp %d (tp must divide the KV heads "
                       "or be a multiple of them)", c->num_kv_heads, size);
    if (c->intermediate_size % size)
        return fr_fail(FR_EINVAL, "tensor parallel: intermediate size %d does not split over tp %d",
                       c->intermediate_size, size);
    if (c->num_experts > 0 && c->moe_intermediate_size % size)
        return fr_fail(FR_EINVAL, "tensor parallel: expert intermediate size %d does not split over tp %d",
                       c->moe_intermediate_size, size);
    if (c->vocab_size % size)
        return fr_fail(FR_EINVAL, "tensor parallel: vocabulary of %d does not split over tp %d", c->vocab_size,
                       size);
    const int G = c->num_heads / c->num_kv_heads;
    out->rank = rank;
    out->size = size;
    out->n_heads = c->num_heads / size;
    out->head0 = rank * out->n_heads;
    if (size <= c->num_kv_heads) {
        out->n_kv_heads = c->num_kv_heads / size;
        out->kv_head0 = rank * out->n_kv_heads;
    } else {   /* H/tp divides G: this rank's query heads share one KV head */
        out->n_kv_heads = 1;
        out->kv_head0 = out->head0 / G;
    }
    out->inter = c->intermediate_size / size;
    out->inter0 = rank * out->inter;
    if (c->num_experts > 0) {
        out->moe_inter = c->moe_intermediate_size / size;
        out->moe_inter0 = rank * out->moe_inter;
        out->shared_inter = fr_model_shared_inter(c) / size;   /* tp divides Im, so it divides n_shared * Im */
        out->shared_inter0 = rank * out->shared_inter;
    }
    out->vocab = c->vocab_size / size;
    out->vocab0 = rank * out->vocab;
    return FR_OK;
}

void fr_tp_local_config(const fr_model_config *cfg, const fr_tp_layout *l, fr_model_config *out)
{
    *out = *cfg;
    out->num_heads = l->n_heads;
    out->num_kv_heads = l->n_kv_heads;
    out->intermediate_size = l->inter;
    out->moe_intermediate_size = l->moe_inter;
    out->vocab_size = l->vocab;
}

void fr_tp_slice_kv_table(const float *src, int layers, int n_kv_heads, int per, const fr_tp_layout *l,
                          float *dst)
{
    for (int layer = 0; layer < layers; layer++)
        memcpy(dst + (size_t)layer * l->n_kv_heads * per,
               src + ((size_t)layer * n_kv_heads + l->kv_head0) * per, sizeof(float) * (size_t)l->n_kv_heads * per);
}

/* dst[rows][cols] = src[rows][col0 .. col0 + cols) of a matrix `stride` wide. */
static void copy_cols(float *dst, const float *src, size_t rows, size_t stride, size_t col0, size_t cols)
{
    for (size_t r = 0; r < rows; r++) memcpy(dst + r * cols, src + r * stride + col0, sizeof(float) * cols);
}

/* The floats a rank owns of layer i: o_proj's columns, then down_proj's,
 * or, in an expert layer, every expert's gate rows, up rows and down columns. */
static size_t owned_floats(const fr_model_config *c, const fr_tp_layout *l, int i)
{
    const size_t per_head = fr_model_is_mla(c) ? (size_t)c->v_head_dim : (size_t)c->head_dim;
    const size_t D = (size_t)c->hidden_size, o = D * (size_t)l->n_heads * per_head;
    if (fr_model_layer_is_moe(c, i))
        return o + 3 * (size_t)c->num_experts * (size_t)l->moe_inter * D + D * (size_t)l->shared_inter;
    return o + D * (size_t)l->inter;
}

/* The rank's slice of every expert, copied to dst (gate, up, down after one
 * another, each stacked by expert as in the model), then of the shared
 * experts: their gate and up rows point into the model, their down
 * columns are copied after the experts'. */
static void shard_experts(const fr_model_config *c, const fr_tp_layout *l, const fr_layer_weights *src,
                          fr_layer_weights *dst, float *at)
{
    const size_t Is = (size_t)fr_model_shared_inter(c), sl = (size_t)l->shared_inter, s0 = (size_t)l->shared_inter0;
    if (Is && src->shared_gate) {
        const size_t D = (size_t)c->hidden_size, experts = 3 * (size_t)c->num_experts * (size_t)l->moe_inter * D;
        dst->shared_gate = src->shared_gate + s0 * D;
        dst->shared_up = src->shared_up + s0 * D;
        dst->shared_down = at + experts;
        copy_cols(dst->shared_down, src->shared_down, D, Is, s0, sl);
    }
    const size_t D = (size_t)c->hidden_size, E = (size_t)c->num_experts, Im = (size_t)c->moe_intermediate_size;
    const size_t il = (size_t)l->moe_inter, i0 = (size_t)l->moe_inter0;
    dst->expert_gate = at;
    dst->expert_up = at + E * il * D;
    dst->expert_down = at + 2 * E * il * D;
    for (size_t e = 0; e < E; e++) {
        memcpy(dst->expert_gate + e * il * D, src->expert_gate + (e * Im + i0) * D, sizeof(float) * il * D);
        memcpy(dst->expert_up + e * il * D, src->expert_up + (e * Im + i0) * D, sizeof(float) * il * D);
        copy_cols(dst->expert_down + e * D * il, src->expert_down + e * D * Im, D, Im, i0, il);
    }
}

/* Latent attention: the rank's heads' rows of the query and kv_b
 * projections, its heads' columns of o_proj (into dst->o_proj, already
 * placed); the latent path (q_a, kv_a and their norms) is replicated. */
static void shard_mla(const fr_model_config *c, const fr_tp_layout *l, const fr_layer_weights *src,
                      fr_layer_weights *dst)
{
    const size_t D = (size_t)c->hidden_size, h0 = (size_t)l->head0, nh = (size_t)l->n_heads;
    const size_t qh = (size_t)c->qk_nope_dim + (size_t)c->qk_rope_dim, dv = (size_t)c->v_head_dim;
    const size_t kvb = (size_t)c->qk_nope_dim + dv, dc = (size_t)c->kv_lora_rank;
    if (c->q_lora_rank) dst->q_b_proj = src->q_b_proj + h0 * qh * (size_t)c->q_lora_rank;
    else dst->q_proj = src->q_proj + h0 * qh * D;
    dst->kv_b_proj = src->kv_b_proj + h0 * kvb * dc;
    copy_cols(dst->o_proj, src->o_proj, D, (size_t)c->num_heads * dv, h0 * dv, nh * dv);
}

fr_status fr_tp_shard_new(const fr_model *m, int rank, int size, fr_tp_shard **out)
{
    *out = NULL;
    const fr_model_config *c = &m->cfg;
    fr_tp_layout l;
    fr_status st = fr_tp_layout_of(c, rank, size, &l);
    if (st) return st;
    if (!m->w.layers || !m->w.embed)
        return fr_fail(FR_EINVAL, "tensor parallel: the model has no host weights to shard");
    fr_tp_shard *s = calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "tensor parallel: out of memory");
    const size_t D = (size_t)c->hidden_size, d = (size_t)c->head_dim, L = (size_t)c->num_layers;
    const size_t qd = (size_t)c->num_heads * d, lqd = (size_t)l.n_heads * d;
    const size_t o_floats = D * (size_t)l.n_heads * (fr_model_is_mla(c) ? (size_t)c->v_head_dim : d);
    size_t total = 0;
    for (size_t i = 0; i < L; i++) total += owned_floats(c, &l, (int)i);
    s->layout = l;
    fr_tp_local_config(c, &l, &s->cfg);
    s->w.layers = calloc(L, sizeof *s->w.layers);
    s->owned_ = malloc(sizeof(float) * total);
    if (!s->w.layers || !s->owned_) {
        fr_tp_shard_destroy(&s);
        return fr_fail(FR_ENOMEM, "tensor parallel: cannot allocate the row-parallel weight slices of rank %d",
                       rank);
    }
    s->w.embed = m->w.embed;
    s->w.final_norm = m->w.final_norm;
    s->w.lm_head = m->w.lm_head + (size_t)l.vocab0 * D;
    float *at = s->owned_;
    for (size_t i = 0; i < L; i++) {
        const fr_layer_weights *src = &m->w.layers[i];
        fr_layer_weights *dst = &s->w.layers[i];
        *dst = *src;   /* norms, the router, the latent projection (replicated) */
        dst->o_proj = at;
        if (fr_model_is_mla(c)) {
            shard_mla(c, &l, src, dst);
        } else {
            dst->q_proj = src->q_proj + (size_t)l.head0 * d * D;
            dst->k_proj = src->k_proj + (size_t)l.kv_head0 * d * D;
            dst->v_proj = src->v_proj + (size_t)l.kv_head0 * d * D;
            copy_cols(dst->o_proj, src->o_proj, D, qd, (size_t)l.head0 * d, lqd);
        }
        if (src->router) {
            shard_experts(c, &l, src, dst, at + o_floats);
        } else {
            dst->gate_proj = src->gate_proj + (size_t)l.inter0 * D;
            dst->up_proj = src->up_proj + (size_t)l.inter0 * D;
            dst->down_proj = at + o_floats;
            copy_cols(dst->down_proj, src->down_proj, D, (size_t)c->intermediate_size, (size_t)l.inter0,
                      (size_t)l.inter);
        }
        at += owned_floats(c, &l, (int)i);
    }
    *out = s;
    return FR_OK;
}

void fr_tp_shard_destroy(fr_tp_shard **ps)
{
    fr_tp_shard *s = ps ? *ps : NULL;
    if (!s) return;
    free(s->w.layers);
    free(s->owned_);
    free(s);
    *ps = NULL;
}
