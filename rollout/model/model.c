#include "rollout/model/model.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/clock.h"
#include "base/log.h"
#include "rollout/model/checkpoint.h"
#include "rollout/model/tensor_table.h"

/* ---- layout -------------------------------------------------------------- */

/* One weight tensor of the layout: where its pointer goes and its shape. */
typedef struct {
    float **slot;
    int64_t rows, cols; /* cols == 0: a vector of `rows` */
} tensor_slot;

/* Visits every tensor in block order; returns the number of floats needed, or
 * 0 on overflow. With base != NULL, also sets each pointer. */
static size_t layout(const fr_model_config *c, fr_weights *w, float *base)
{
    size_t total = 0;
    int overflow = 0;
#define PLACE(ptr, r, k)                                                            \
    do {                                                                            \
        size_t n_ = (size_t)(r) * (size_t)(k);                                      \
        if ((k) != 0 && n_ / (size_t)(k) != (size_t)(r)) overflow = 1;              \
        if (total > SIZE_MAX / sizeof(float) - n_) overflow = 1;                     \
        if (!overflow && base) (ptr) = base + total;                                \
        if (!overflow) total += n_;                                                 \
    } while (0)
    size_t H = (size_t)c->hidden_size, D = (size_t)c->head_dim, I = (size_t)c->intermediate_size;
    size_t qd = (size_t)c->num_heads * D, kvd = (size_t)c->num_kv_heads * D;
    PLACE(w->embed, c->vocab_size, H);
    for (int l = 0; l < c->num_layers; l++) {
        fr_layer_weights *L = &w->layers[l];
        PLACE(L->attn_norm, 1, H);
        if (fr_model_is_mla(c)) {
            size_t nh = (size_t)c->num_heads, dc = (size_t)c->kv_lora_rank, dr = (size_t)c->qk_rope_dim;
            size_t dn = (size_t)c->qk_nope_dim, dv = (size_t)c->v_head_dim, ql = (size_t)c->q_lora_rank;
            if (ql) {
                PLACE(L->q_a_proj, ql, H);
                PLACE(L->q_a_norm, 1, ql);
                PLACE(L->q_b_proj, nh * (dn + dr), ql);
            } else {
                PLACE(L->q_proj, nh * (dn + dr), H);
            }
            PLACE(L->kv_a_proj, dc + dr, H);
            PLACE(L->kv_a_norm, 1, dc);
            PLACE(L->kv_b_proj, nh * (dn + dv), dc);
            PLACE(L->o_proj, H, nh * dv);
        } else {
            PLACE(L->q_proj, qd, H);
            PLACE(L->k_proj, kvd, H);
            PLACE(L->v_proj, kvd, H);
            PLACE(L->o_proj, H, qd);
            PLACE(L->q_norm, 1, D);
            PLACE(L->k_norm, 1, D);
        }
        PLACE(L->mlp_norm, 1, H);
        if (fr_model_layer_is_moe(c, l)) {
            size_t E = (size_t)c->num_experts, Im = (size_t)c->moe_intermediate_size;
            size_t Is = (size_t)fr_model_shared_inter(c);
            PLACE(L->router, E, H);
            if (fr_model_has_router_bias(c)) PLACE(L->router_bias, 1, E);
            PLACE(L->expert_gate, E * Im, H);
            PLACE(L->expert_up, E * Im, H);
            PLACE(L->expert_down, E * H, Im);
            if (Is) {
                PLACE(L->shared_gate, Is, H);
                PLACE(L->shared_up, Is, H);
                PLACE(L->shared_down, H, Is);
            }
        } else {
            PLACE(L->gate_proj, I, H);
            PLACE(L->up_proj, I, H);
            PLACE(L->down_proj, H, I);
        }
    }
    PLACE(w->final_norm, 1, H);
    if (c->tie_word_embeddings) {
        if (base) w->lm_head = w->embed;
    } else {
        PLACE(w->lm_head, c->vocab_size, H);
    }
#undef PLACE
    return overflow ? 0 : total;
}

fr_status fr_model_alloc(const fr_model_config *cfg, const char *name, fr_model **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_model_alloc: out is NULL");
    *out = NULL;
    if (!cfg) return fr_fail(FR_EINVAL, "fr_model_alloc: cfg is NULL");
    const char *label = name ? name : "model";
    if (cfg->vocab_size <= 0 || cfg->hidden_size <= 0 || cfg->num_layers <= 0 || cfg->num_heads <= 0 ||
        cfg->num_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->intermediate_size <= 0)
        return fr_fail(FR_EINVAL, "%s: model sizes must be positive (vocab %d, hidden %d, layers %d, heads %d, "
                                  "kv heads %d, head_dim %d, intermediate %d)",
                       label, cfg->vocab_size, cfg->hidden_size, cfg->num_layers, cfg->num_heads,
                       cfg->num_kv_heads, cfg->head_dim, cfg->intermediate_size);
    if (cfg->num_heads % cfg->num_kv_heads != 0)
        return fr_fail(FR_EINVAL, "%s: %d attention heads are not a multiple of %d KV heads", label,
                       cfg->num_heads, cfg->num_kv_heads);
    if (cfg->head_dim % 2 != 0)
        return fr_fail(FR_EUNSUPPORTED, "%s: head_dim %d is odd; RoPE needs an even head_dim", label,
                       cfg->head_dim);
    if (cfg->num_experts > 0 && (cfg->experts_per_tok < 1 || cfg->experts_per_tok > cfg->num_experts ||
                                 cfg->moe_intermediate_size <= 0 || cfg->decoder_sparse_step < 1 ||
                                 cfg->n_shared_experts < 0))
        return fr_fail(FR_EINVAL, "%s: expert sizes must be positive and top-k within the %d experts (top-k %d, "
                                  "expert intermediate %d, sparse step %d, shared experts %d)", label, cfg->num_experts,
                       cfg->experts_per_tok, cfg->moe_intermediate_size, cfg->decoder_sparse_step,
                       cfg->n_shared_experts);
    if (cfg->num_experts > FR_MAX_EXPERTS || fr_model_groups(cfg) > FR_MAX_EXPERT_GROUPS)
        return fr_fail(FR_EUNSUPPORTED, "%s: %d experts in %d groups; at most %d experts in %d groups are supported",
                       label, cfg->num_experts, fr_model_groups(cfg), FR_MAX_EXPERTS, FR_MAX_EXPERT_GROUPS);
    if (cfg->num_experts > 0 && (cfg->num_experts % fr_model_groups(cfg) ||
                                 fr_model_topk_groups(cfg) > fr_model_groups(cfg) ||
                                 cfg->experts_per_tok > fr_model_topk_groups(cfg) * (cfg->num_experts /
                                                                                     fr_model_groups(cfg))))
        return fr_fail(FR_EINVAL, "%s: %d expert groups, %d used per token, do not hold the %d experts and top-%d",
                       label, fr_model_groups(cfg), fr_model_topk_groups(cfg), cfg->num_experts, cfg->experts_per_tok);
    if ((int64_t)cfg->num_heads * cfg->head_dim > INT_MAX)
        return fr_fail(FR_EUNSUPPORTED, "%s: num_heads x head_dim = %lld is too large", label,
                       (long long)cfg->num_heads * cfg->head_dim);

    fr_model *m = calloc(1, sizeof *m);
    fr_layer_weights *layers = calloc((size_t)cfg->num_layers, sizeof *layers);
    if (!m || !layers) {
        free(m);
        free(layers);
        return fr_fail(FR_ENOMEM, "%s: no memory for the model structure", label);
    }
    m->cfg = *cfg;
    m->w.layers = layers;
    snprintf(m->name, sizeof m->name, "%s", name ? name : "");

    size_t n = layout(cfg, &m->w, NULL);
    if (n == 0) {
        fr_model_destroy(&m);
        return fr_fail(FR_EUNSUPPORTED, "%s: the weights' size overflows the address space", label);
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, n * sizeof(float)) != 0) {
        fr_model_destroy(&m);
        return fr_fail(FR_ENOMEM, "%s: no memory for %zu float32 weights (%.1f MiB)", label, n,
                       (double)n * sizeof(float) / (1024.0 * 1024.0));
    }
    m->data_ = p;
    m->n_data_ = n;
    layout(cfg, &m->w, m->data_);
    *out = m;
    return FR_OK;
}

void fr_model_destroy(fr_model **m)
{
    if (!m || !*m) return;
    free((*m)->data_);
    free((*m)->w.layers);
    free(*m);
    *m = NULL;
}

void fr_model_drop_weights(fr_model *m)
{
    if (!m) return;
    free(m->data_);
    m->data_ = NULL;
    m->n_data_ = 0;
    fr_layer_weights *layers = m->w.layers;
    memset(layers, 0, sizeof *layers * (size_t)m->cfg.num_layers);
    m->w = (fr_weights){.layers = layers};
}

fr_status fr_model_config_only(const fr_model_config *cfg, const char *name, fr_model **out)
{
    if (!out || !cfg) return fr_fail(FR_EINVAL, "fr_model_config_only: NULL argument");
    *out = NULL;
    if (cfg->num_layers <= 0) return fr_fail(FR_EINVAL, "%s: model sizes must be positive", name ? name : "model");
    fr_model *m = calloc(1, sizeof *m);
    fr_layer_weights *layers = calloc((size_t)cfg->num_layers, sizeof *layers);
    if (!m || !layers) {
        free(m);
        free(layers);
        return fr_fail(FR_ENOMEM, "no memory for the model structure");
    }
    m->cfg = *cfg;
    m->w.layers = layers;
    snprintf(m->name, sizeof m->name, "%s", name ? name : "");
    *out = m;
    return FR_OK;
}

size_t fr_model_param_count(const fr_model *m) { return m ? m->n_data_ : 0; }

fr_status fr_model_swap_weights(fr_model *a, fr_model *b)
{
    if (!a || !b) return fr_fail(FR_EINVAL, "fr_model_swap_weights: NULL model");
    const fr_model_config *x = &a->cfg, *y = &b->cfg;
    if (x->num_layers != y->num_layers || x->hidden_size != y->hidden_size || x->vocab_size != y->vocab_size ||
        x->num_heads != y->num_heads || x->num_kv_heads != y->num_kv_heads || x->head_dim != y->head_dim ||
        x->intermediate_size != y->intermediate_size || x->tie_word_embeddings != y->tie_word_embeddings ||
        x->num_experts != y->num_experts || x->moe_intermediate_size != y->moe_intermediate_size ||
        x->decoder_sparse_step != y->decoder_sparse_step || memcmp(x->mlp_only, y->mlp_only, sizeof x->mlp_only) ||
        x->n_shared_experts != y->n_shared_experts || x->topk_method != y->topk_method ||
        x->kv_lora_rank != y->kv_lora_rank || x->q_lora_rank != y->q_lora_rank)
        return fr_fail(FR_EINVAL, "fr_model_swap_weights: the two models differ in shape");
    if (!a->data_ || !b->data_ || a->n_data_ != b->n_data_)
        return fr_fail(FR_EINVAL, "fr_model_swap_weights: both models must hold host weights of one size");
    fr_weights w = a->w;
    a->w = b->w;
    b->w = w;
    float *d = a->data_;
    a->data_ = b->data_;
    b->data_ = d;
    return FR_OK;
}

float *fr_model_data(const fr_model *m, size_t *n_floats)
{
    if (n_floats) *n_floats = m ? m->n_data_ : 0;
    return m ? m->data_ : NULL;
}

/* ---- loading a checkpoint -------------------------------------------------- */

/* The walk over the tensor table that fills a model from a checkpoint. */
typedef struct {
    const fr_checkpoint *ck;
    const char *dir;
    double t0, last;
    size_t done, total;
} load_ctx;

static void load_progress(load_ctx *lc);

static fr_status load_tensor(void *user, const fr_model_tensor *t)
{
    load_ctx *lc = user;
    int64_t shape[2] = {t->rows, t->cols};
    fr_status st = fr_checkpoint_load_f32(lc->ck, t->name, t->ndim, shape, t->data);
    lc->done++;
    if (!st) load_progress(lc);
    return st;
}

/* Qwen3 has no biases; a checkpoint that carries them would be computed
 * wrongly without them, so refuse it (config.json may not say so). */
static fr_status refuse_biases(const fr_checkpoint *ck, int l)
{
    static const char *const bias_names[] = {"self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                             "self_attn.v_proj.bias", "self_attn.o_proj.bias"};
    char name[128];
    for (size_t i = 0; i < sizeof bias_names / sizeof bias_names[0]; i++) {
        snprintf(name, sizeof name, "model.layers.%d.%s", l, bias_names[i]);
        if (fr_checkpoint_find(ck, name))
            return fr_fail(FR_EUNSUPPORTED, "checkpoint has tensor %s; biased attention is not supported", name);
    }
    return FR_OK;
}

/* Loading a large checkpoint takes minutes: a line at least every 5 s
 * says how far it got (debug level for the rest, one a tensor). */
static void load_progress(load_ctx *lc)
{
    double now = fr_now_s();
    fr_log_level lv = now - lc->last >= 5.0 ? FR_LOG_INFO : FR_LOG_DEBUG;
    if (!fr_log_enabled(lv)) return;
    fr_log_msg(lv, "model %s: loaded %zu of %zu tensors (%.1f s)", lc->dir, lc->done, lc->total, now - lc->t0);
    if (lv == FR_LOG_INFO) lc->last = now;
}

/* A model spec that names a folder: it must be one. */
static fr_status check_dir(const char *dir)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        char eb[128];
        return fr_fail(FR_EIO, "model \"%s\": no such checkpoint folder (%s); a model spec is a Hugging Face "
                               "checkpoint folder or synthetic:tiny[:SEED]",
                       dir, strerror_r(errno, eb, sizeof eb));
    }
    if (!S_ISDIR(sb.st_mode))
        return fr_fail(FR_EINVAL, "model \"%s\": not a folder; a model spec is a Hugging Face checkpoint folder "
                                  "or synthetic:tiny[:SEED]",
                       dir);
    return FR_OK;
}

static fr_status load_dir(const char *dir, fr_model **out)
{
    fr_status dst = check_dir(dir);
    if (dst) return dst;

    fr_checkpoint *ck = NULL;
    fr_model *m = NULL;
    fr_status rc = fr_checkpoint_open(dir, &ck);
    if (rc != FR_OK) return rc;
    const fr_model_config *c = fr_checkpoint_config(ck);
    double t0 = fr_now_s(), last = t0;
    fr_info("model %s: loading %d layers, hidden %d, vocabulary %d", dir, c->num_layers, c->hidden_size,
            c->vocab_size);
    if ((rc = fr_model_alloc(c, dir, &m)) != FR_OK) goto done;

    for (int l = 0; l < c->num_layers; l++)
        if ((rc = refuse_biases(ck, l)) != FR_OK) goto done;
    /* Tied: transformers ties lm_head to the embedding and ignores any stored
     * lm_head.weight; so does the table. */
    if (!c->tie_word_embeddings && !fr_checkpoint_find(ck, "lm_head.weight")) {
        rc = fr_fail(FR_EFORMAT, "%s: missing tensor lm_head.weight, and config.json does not set "
                                 "tie_word_embeddings", dir);
        goto done;
    }
    load_ctx lc = {.ck = ck, .dir = dir, .t0 = t0, .last = last, .total = fr_model_tensor_count(c)};
    rc = fr_model_tensors_each(c, &m->w, load_tensor, &lc);
    if (rc == FR_OK) fr_info("model %s: loaded in %.2f s", dir, fr_now_s() - t0);
done:
    fr_checkpoint_close(&ck);
    if (rc != FR_OK) fr_model_destroy(&m);
    *out = m;
    return rc;
}

/* ---- the entry points ----------------------------------------------------- */

fr_status fr_model_spec_config(const char *spec, fr_model_config *cfg)
{
    if (!spec || !cfg) return fr_fail(FR_EINVAL, "fr_model_spec_config: NULL argument");
    if (!spec[0])
        return fr_fail(FR_EINVAL, "empty model spec; give a Hugging Face checkpoint folder or synthetic:tiny[:SEED]");
    size_t plen = strlen(FR_SYNTHETIC_PREFIX);
    if (strncmp(spec, FR_SYNTHETIC_PREFIX, plen) == 0) {
        uint64_t seed;
        return fr_synthetic_parse(spec + plen, cfg, &seed);
    }
    fr_status st = check_dir(spec);
    if (st) return st;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", spec);
    return fr_model_config_load(path, cfg);
}

fr_status fr_model_load(const char *spec, fr_model **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_model_load: out is NULL");
    *out = NULL;
    if (!spec) return fr_fail(FR_EINVAL, "fr_model_load: spec is NULL");
    if (!spec[0])
        return fr_fail(FR_EINVAL, "empty model spec; give a Hugging Face checkpoint folder or synthetic:tiny[:SEED]");
    size_t plen = strlen(FR_SYNTHETIC_PREFIX);
    if (strncmp(spec, FR_SYNTHETIC_PREFIX, plen) == 0) return fr_model_synthetic(spec + plen, out);
    return load_dir(spec, out);
}
