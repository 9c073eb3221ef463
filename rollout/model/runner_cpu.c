#include "rollout/model/runner_cpu.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "base/fixed_math.h"
#include "rollout/model/mla_cpu.h"
#include "rollout/model/moe_cpu.h"
#include "rollout/model/ops_cpu.h"
#include "rollout/model/tp_shard.h"

struct fr_runner_cpu {
    const fr_model *m;
    /* What this rank computes with: the model's config and weights (tp 1),
     * or its shard's local head, intermediate and vocabulary counts and
     * weights (rollout/model/tp_shard.h). */
    const fr_model_config *c;
    const fr_weights *w;
    fr_tp tp;
    fr_tp_shard *shard;         /* tp > 1 */
    fr_moe_cpu *moe;            /* scratch of the expert layers; NULL for a dense model */
    fr_mla_cpu *mla;            /* scratch of latent attention; NULL for Qwen3 attention */
    float *logits_local;        /* tp > 1: [tokens][vocab / tp], the LM head's slice */
    fr_kv_cache *kv;
    int max_tokens;
    /* activations of one step, [tokens][...] */
    float *x, *xn, *q, *att, *gate, *up, *hidden_out;
    float *kstep, *vstep;       /* [layers][tokens][kv_heads][d], raw post-RoPE */
    int *pos;                   /* position of each token */
    /* attention scratch, sized for the longest context */
    float *kbuf, *vbuf, *scores;
    int ctx_cap;
    fr_forward_observer obs;    /* all callbacks NULL when unset */
    int fill_only;              /* the step under way only writes keys and values (fr_runner_cpu_fill) */
    int deterministic;          /* fr_runner_cpu_set_deterministic */
    /* Routed-expert capture (fr_runner_cpu_capture_routes): the experts
     * every MoE layer chose for each token row of the last step,
     * [moe layers][max_tokens][k]; NULL while off. */
    uint16_t *routes;
    int route_rows;             /* token rows of the last step they hold (0: none) */
};

enum { PREFILL_ROWS = 256 };   /* query rows per score block in chunked attention */

void fr_runner_cpu_destroy(fr_runner_cpu **pr)
{
    fr_runner_cpu *r = pr ? *pr : NULL;
    if (!r) return;
    free(r->x); free(r->xn); free(r->q); free(r->att); free(r->gate); free(r->up);
    free(r->hidden_out); free(r->kstep); free(r->vstep); free(r->pos);
    free(r->kbuf); free(r->vbuf); free(r->scores);
    free(r->logits_local);
    free(r->routes);
    fr_moe_cpu_destroy(&r->moe);
    fr_mla_cpu_destroy(&r->mla);
    fr_tp_shard_destroy(&r->shard);
    free(r);
    *pr = NULL;
}

fr_status fr_runner_cpu_weights_changed(fr_runner_cpu *r)
{
    if (r->tp.size == 1) return FR_OK;   /* reads the model's weights directly */
    fr_tp_shard *fresh = NULL;
    fr_status st = fr_tp_shard_new(r->m, r->tp.rank, r->tp.size, &fresh);
    if (st) return st;
    fr_tp_shard_destroy(&r->shard);
    r->shard = fresh;
    r->c = &r->shard->cfg;
    r->w = &r->shard->w;
    return FR_OK;
}

fr_status fr_runner_cpu_new(const fr_model *m, fr_kv_cache *kv, int max_step_tokens,
                            fr_runner_cpu **out)
{
    return fr_runner_cpu_new_tp(m, kv, max_step_tokens, NULL, out);
}

fr_status fr_runner_cpu_new_tp(const fr_model *m, fr_kv_cache *kv, int max_step_tokens, const fr_tp *tp,
                               fr_runner_cpu **out)
{
    *out = NULL;
    fr_tp one = {.rank = 0, .size = 1, .group = NULL};
    if (!tp) tp = &one;
    if (tp->size > 1 && !tp->group)
        return fr_fail(FR_EINVAL, "runner: tp %d needs an engine group", tp->size);
    if (max_step_tokens < 1) return fr_fail(FR_EINVAL, "runner: max_step_tokens must be >= 1");
    fr_runner_cpu *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "runner: out of memory");
    r->m = m; r->kv = kv; r->max_tokens = max_step_tokens; r->tp = *tp;
    r->c = &m->cfg;
    r->w = &m->w;
    fr_status st = FR_OK;
    if (tp->size > 1) {
        if ((st = fr_tp_shard_new(m, tp->rank, tp->size, &r->shard))) {
            fr_runner_cpu_destroy(&r);
            return st;
        }
        r->c = &r->shard->cfg;
        r->w = &r->shard->w;
    }
    const fr_model_config *c = r->c;
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(kv);
    if (kc->n_layers != c->num_layers || kc->n_kv_heads != c->num_kv_heads || kc->head_dim != c->head_dim) {
        st = fr_fail(FR_EINVAL, "runner: KV cache shape (%d layers, %d kv heads, head_dim %d) does not "
                                "match the model (%d, %d, %d)%s", kc->n_layers, kc->n_kv_heads,
                     kc->head_dim, c->num_layers, c->num_kv_heads, c->head_dim,
                     tp->size > 1 ? " on this tensor-parallel rank" : "");
        fr_runner_cpu_destroy(&r);
        return st;
    }
    size_t T = (size_t)max_step_tokens, qd = (size_t)c->num_heads * c->head_dim;
    size_t kvd = (size_t)c->num_kv_heads * c->head_dim;
    r->x = malloc(sizeof(float) * T * c->hidden_size);
    r->xn = malloc(sizeof(float) * T * c->hidden_size);
    r->hidden_out = malloc(sizeof(float) * T * c->hidden_size);
    r->q = malloc(sizeof(float) * T * qd);
    r->att = malloc(sizeof(float) * T * qd);
    r->gate = malloc(sizeof(float) * T * c->intermediate_size);
    r->up = malloc(sizeof(float) * T * c->intermediate_size);
    r->kstep = malloc(sizeof(float) * T * kvd * c->num_layers);
    r->vstep = malloc(sizeof(float) * T * kvd * c->num_layers);
    r->pos = malloc(sizeof(int) * T);
    if (tp->size > 1) r->logits_local = malloc(sizeof(float) * T * c->vocab_size);
    if (!r->x || !r->xn || !r->hidden_out || !r->q || !r->att || !r->gate || !r->up || !r->kstep ||
        !r->vstep || !r->pos || (tp->size > 1 && !r->logits_local)) {
        fr_runner_cpu_destroy(&r);
        return fr_fail(FR_ENOMEM, "runner: cannot allocate activations for %d tokens", max_step_tokens);
    }
    if (c->num_experts > 0 && (st = fr_moe_cpu_new(c, max_step_tokens, &r->moe))) {
        fr_runner_cpu_destroy(&r);
        return st;
    }
    if (fr_model_is_mla(c) != (kc->latent_dim > 0) || (kc->latent_dim > 0 && kc->latent_dim != c->kv_lora_rank))
        st = fr_fail(FR_EINVAL, "runner: the KV cache's latent width %d does not match the model's %d (a "
                     "multi-head latent attention model needs a latent cache, and only it)", kc->latent_dim,
                     c->kv_lora_rank);
    if (!st && fr_model_is_mla(c)) st = fr_mla_cpu_new(c, max_step_tokens, &r->mla);
    if (st) {
        fr_runner_cpu_destroy(&r);
        return st;
    }
    *out = r;
    return FR_OK;
}

void fr_runner_cpu_set_deterministic(fr_runner_cpu *r, int on)
{
    r->deterministic = on != 0;
}

fr_status fr_runner_cpu_capture_routes(fr_runner_cpu *r, int on)
{
    const fr_model_config *c = r->c;
    if (!on) {
        free(r->routes);
        r->routes = NULL;
        r->route_rows = 0;
        return FR_OK;
    }
    if (r->routes) return FR_OK;
    const int layers = fr_model_moe_layers(c);
    if (layers == 0) return fr_fail(FR_EINVAL, "routed experts: the model has no mixture-of-experts layer");
    r->routes = malloc(sizeof(uint16_t) * (size_t)layers * (size_t)r->max_tokens * (size_t)c->experts_per_tok);
    if (!r->routes) return fr_fail(FR_ENOMEM, "routed experts: out of memory");
    r->route_rows = 0;
    return FR_OK;
}

fr_status fr_runner_cpu_routes(const fr_runner_cpu *r, const int *rows, int n, uint16_t *out)
{
    const int k = r->c->experts_per_tok, layers = fr_model_moe_layers(r->c);
    if (!r->routes) return fr_fail(FR_EINVAL, "routed experts: capture is off");
    for (int i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= r->route_rows)
            return fr_fail(FR_EINVAL, "routed experts: token row %d is not in the last step's %d", rows[i],
                           r->route_rows);
        for (int m = 0; m < layers; m++)
            memcpy(out + ((size_t)i * layers + m) * k, r->routes + ((size_t)m * r->max_tokens + rows[i]) * k,
                   sizeof(uint16_t) * (size_t)k);
    }
    return FR_OK;
}

/* Keeps MoE layer m's choices for the step's M rows when capturing. */
static void keep_routes(fr_runner_cpu *r, int m, int M)
{
    const int k = r->c->experts_per_tok;
    const int *ids = fr_moe_cpu_ids(r->moe);
    uint16_t *dst = r->routes + (size_t)m * r->max_tokens * k;
    for (size_t i = 0; i < (size_t)M * k; i++) dst[i] = (uint16_t)ids[i];
}

/* BLAS by default; in deterministic mode the fixed-order kernel, whose rows
 * do not depend on what else is in the batch. */
static void matmul(const fr_runner_cpu *r, float *y, const float *x, const float *w, int M, int N, int K)
{
    if (r->deterministic) fr_matmul_fixed(y, x, w, M, N, K);
    else fr_matmul(y, x, w, M, N, K);
}

/* Row-parallel matmul epilogue: adds up the ranks' partial sums in place. */
static fr_status tp_allreduce(const fr_runner_cpu *r, float *buf, size_t n)
{
    if (r->tp.size == 1) return FR_OK;
    fr_comm_status cs = fr_engine_allreduce_sum_f32(r->tp.group, buf, n);
    return cs ? fr_fail(FR_EIO, "%s", fr_last_error()) : FR_OK;
}

void fr_runner_cpu_set_observer(fr_runner_cpu *r, const fr_forward_observer *obs)
{
    if (obs) r->obs = *obs;
    else memset(&r->obs, 0, sizeof r->obs);
}

int fr_step_logit_rows(const fr_step_seq *seqs, int n_seqs)
{
    int rows = 0;
    for (int s = 0; s < n_seqs; s++) rows += seqs[s].all_logits ? seqs[s].n : 1;
    return rows;
}

static fr_status ensure_ctx(fr_runner_cpu *r, int ctx)
{
    if (ctx <= r->ctx_cap) return FR_OK;
    int cap = ctx < 1024 ? 1024 : ctx + ctx / 2;
    size_t d = (size_t)r->c->head_dim;
    int G = r->c->num_heads / r->c->num_kv_heads;
    float *k = realloc(r->kbuf, sizeof(float) * d * cap);
    if (k) r->kbuf = k;
    float *v = realloc(r->vbuf, sizeof(float) * d * cap);
    if (v) r->vbuf = v;
    float *s = realloc(r->scores, sizeof(float) * (size_t)PREFILL_ROWS * G * cap);
    if (s) r->scores = s;
    if (!k || !v || !s) return fr_fail(FR_ENOMEM, "runner: cannot allocate attention scratch for %d tokens", ctx);
    r->ctx_cap = cap;
    return FR_OK;
}

/* Causal attention with unquantized query and probabilities: rows of
 * G query heads for tokens [len, len + n) over keys [0, len + i]. */
static void attend_chunk(fr_runner_cpu *r, const float *q, float *out, int len, int n, int G,
                         const fr_kv_view *view)
{
    const int d = r->c->head_dim, H = r->c->num_heads;
    const float scale = 1.0f / sqrtf((float)d);
    for (int i0 = 0; i0 < n; i0 += PREFILL_ROWS) {
        int ni = n - i0 < PREFILL_ROWS ? n - i0 : PREFILL_ROWS;
        int ctx = len + i0 + ni;          /* keys visible to the last row */
        for (int i = 0; i < ni; i++)      /* scores [ni][G][ctx] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, ctx, d, scale,
                        q + (size_t)(i0 + i) * H * d, d, view->k, d, 0.0f,
                        r->scores + (size_t)i * G * ctx, ctx);
        for (int i = 0; i < ni; i++)
            for (int g = 0; g < G; g++) {
                float *s = r->scores + ((size_t)i * G + g) * ctx;
                int visible = len + i0 + i + 1;
                float mx = -INFINITY;
                for (int t = 0; t < visible; t++) mx = fmaxf(mx, s[t]);
                double sum = 0.0;
                for (int t = 0; t < visible; t++) { s[t] = fr_expf(s[t] - mx); sum += s[t]; }
                float inv = (float)(1.0 / sum);
                for (int t = 0; t < visible; t++) s[t] *= inv;
                for (int t = visible; t < ctx; t++) s[t] = 0.0f;
            }
        for (int i = 0; i < ni; i++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, G, d, ctx, 1.0f,
                        r->scores + (size_t)i * G * ctx, ctx, view->v, d, 0.0f,
                        out + (size_t)(i0 + i) * H * d, d);
    }
}

/* attend_chunk in deterministic mode: row i of the chunk (position len + i)
 * reads exactly keys [0, len + i] in token order, every score a fixed-order
 * dot product and every output a sum over those keys in token order. Nothing
 * depends on where the chunk starts or how many rows it has, so a prompt's
 * numbers are the same however it was chunked. */
static void attend_chunk_fixed(fr_runner_cpu *r, const float *q, float *out, int len, int n, int G,
                               const fr_kv_view *view)
{
    const int d = r->c->head_dim, H = r->c->num_heads;
    const float scale = 1.0f / sqrtf((float)d);
    float *s = r->scores;   /* one row of scores at a time */
    for (int i = 0; i < n; i++)
        for (int g = 0; g < G; g++) {
            const float *qr = q + (size_t)i * H * d + (size_t)g * d;
            float *o = out + (size_t)i * H * d + (size_t)g * d;
            int visible = len + i + 1;
            float mx = -INFINITY;
            fr_dot_fixed_rows(s, view->k, (size_t)d, visible, qr, d);
            for (int t = 0; t < visible; t++) {
                s[t] *= scale;
                mx = fmaxf(mx, s[t]);
            }
            double sum = 0.0;
            for (int t = 0; t < visible; t++) { s[t] = fr_expf(s[t] - mx); sum += s[t]; }
            float inv = (float)(1.0 / sum);
            for (int j = 0; j < d; j++) o[j] = 0.0f;
            for (int t = 0; t < visible; t++) fr_axpy(o, s[t] * inv, view->v + (size_t)t * d, d);
        }
}

/* Deterministic mode with a BF16 cache: the step's own keys and values, which
 * attention would read at float32, rounded to BF16 as the cache stores them,
 * so a token reads the same numbers whether a key came from this step or
 * from an earlier chunk. (f32 caches store them exactly; FP8 and vanilla FP4
 * quantize them on the fly already.) */
static void round_step_kv(const fr_runner_cpu *r, float *k, float *v, int from, int to)
{
    if (!r->deterministic || fr_kv_cache_config_of(r->kv)->dtype != FR_KV_BF16) return;
    const size_t d = (size_t)r->c->head_dim;
    for (size_t j = (size_t)from * d; j < (size_t)to * d; j++) {
        k[j] = fr_bf16_round(k[j]);
        v[j] = fr_bf16_round(v[j]);
    }
}

static fr_status attention(fr_runner_cpu *r, int layer, const fr_step_seq *seqs, int n_seqs)
{
    const fr_model_config *c = r->c;
    const int d = c->head_dim, H = c->num_heads, KVH = c->num_kv_heads, G = H / KVH;
    const size_t kvd = (size_t)KVH * d;
    const float *kl = r->kstep + (size_t)layer * r->max_tokens * kvd;
    const float *vl = r->vstep + (size_t)layer * r->max_tokens * kvd;
    fr_attn_params ap = fr_kv_attn_params(r->kv, G);
    /* Deterministic mode gives a token one attention path whether it comes
     * alone (a decode, or a prompt chunk of one token) or in a chunk. FP4
     * caches keep their quantized decode path (docs/determinism.md). */
    const int fixed = r->deterministic && !fr_kv_dtype_is_fp4(fr_kv_cache_config_of(r->kv)->dtype);
    int row = 0;
    fr_status st = FR_OK;
    for (int s = 0; s < n_seqs && !st; row += seqs[s].n, s++) {
        int len = fr_kv_seq_len(r->kv, seqs[s].seq), n = seqs[s].n;
        if ((st = ensure_ctx(r, len + n))) break;
        float *qs = r->q + (size_t)row * H * d, *os = r->att + (size_t)row * H * d;
        fr_kv_query_form(r->kv, n * H, qs);
        for (int h = 0; h < KVH && !st; h++) {
            fr_kv_view view;
            st = fr_kv_gather(r->kv, seqs[s].seq, layer, h, n, kl + row * kvd, vl + row * kvd,
                              r->kbuf, r->vbuf, &view);
            if (st) break;
            round_step_kv(r, r->kbuf, r->vbuf, len, len + n);
            if (n == 1 && r->obs.decode_query &&
                (st = r->obs.decode_query(r->obs.user, layer, s, h, qs + (size_t)h * G * d, G, &view)))
                break;
            if (n == 1 && !fixed) {
                float lse[FR_MAX_GROUP];
                st = fr_ref_attn_decode(&ap, qs + (size_t)h * G * d, &view, 1, os + (size_t)h * G * d, lse);
            } else if (fixed) {
                attend_chunk_fixed(r, qs + (size_t)h * G * d, os + (size_t)h * G * d, len, n, G, &view);
            } else {
                attend_chunk(r, qs + (size_t)h * G * d, os + (size_t)h * G * d, len, n, G, &view);
            }
        }
    }
    return st;
}

/* Latent attention of every sequence of the step (rollout/model/mla_cpu.h):
 * the cache rows are the single "KV head" of an MLA model, in the store
 * form of the cache (kvcache/kv_cache.h). */
static fr_status mla_attention(fr_runner_cpu *r, int layer, const fr_step_seq *seqs, int n_seqs)
{
    const fr_model_config *c = r->c;
    const int H = c->num_heads, qh = c->qk_nope_dim + c->qk_rope_dim, dv = c->v_head_dim;
    const size_t kvd = (size_t)c->head_dim;
    const float *kl = r->kstep + (size_t)layer * r->max_tokens * kvd;
    const fr_kv_latent_form form = fr_kv_latent_form_of(r->kv, layer);
    int row = 0;
    fr_status st = FR_OK;
    for (int s = 0; s < n_seqs && !st; row += seqs[s].n, s++) {
        int len = fr_kv_seq_len(r->kv, seqs[s].seq), n = seqs[s].n;
        fr_kv_view view;
        if ((st = ensure_ctx(r, len + n))) break;
        if ((st = fr_kv_gather(r->kv, seqs[s].seq, layer, 0, n, kl + row * kvd, NULL, r->kbuf, NULL, &view)))
            break;
        fr_mla_cpu_attend(r->mla, c, &r->w->layers[layer], r->q + (size_t)row * H * qh, len, n, &view, &form,
                          r->scores, r->att + (size_t)row * H * dv);
    }
    return st;
}

fr_status fr_step_admit(fr_kv_cache *kv, const fr_step_seq *seqs, int n_seqs, int vocab, int max_position,
                        int max_tokens, int *n_tokens)
{
    int M = 0, need = 0;
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].n < 1 || !seqs[s].tokens)
            return fr_fail(FR_EINVAL, "step: sequence %d has no tokens", seqs[s].seq);
        for (int i = 0; i < seqs[s].n; i++)
            if (seqs[s].tokens[i] < 0 || seqs[s].tokens[i] >= vocab)
                return fr_fail(FR_EINVAL, "step: token id %d outside the vocabulary [0, %d)", seqs[s].tokens[i],
                               vocab);
        int len = fr_kv_seq_len(kv, seqs[s].seq);
        if (len < 0) return fr_fail(FR_EINVAL, "step: KV sequence %d does not exist", seqs[s].seq);
        if (len + seqs[s].n > max_position)
            return fr_fail(FR_EINVAL, "step: %d tokens exceed the context window of %d", len + seqs[s].n,
                           max_position);
        M += seqs[s].n;
        need += fr_kv_blocks_needed(kv, seqs[s].seq, seqs[s].n);
    }
    if (M > max_tokens) return fr_fail(FR_EINVAL, "step: %d tokens exceed the step limit of %d", M, max_tokens);
    if (need > fr_kv_free_blocks(kv))
        return fr_fail(FR_ENOMEM, "step: needs %d free KV blocks, %d are free", need, fr_kv_free_blocks(kv));
    for (int s = 0; s < n_seqs; s++) {
        fr_status st = fr_kv_reserve(kv, seqs[s].seq, seqs[s].n);
        if (st) return st;
    }
    *n_tokens = M;
    return FR_OK;
}

fr_status fr_runner_cpu_fill(fr_runner_cpu *r, const fr_step_seq *seqs, int n_seqs)
{
    r->fill_only = 1;
    fr_status st = fr_runner_cpu_step(r, seqs, n_seqs, NULL);
    r->fill_only = 0;
    return st;
}

/* Qwen3's q, k, v of xn: projections, per-head RMSNorm, RoPE. */
static void qwen_qkv(fr_runner_cpu *r, const fr_layer_weights *lw, int M, float *k, float *v)
{
    const fr_model_config *c = r->c;
    const int D = c->hidden_size, d = c->head_dim, H = c->num_heads, KVH = c->num_kv_heads;
    const size_t qd = (size_t)H * d, kvd = (size_t)KVH * d;
    matmul(r, r->q, r->xn, lw->q_proj, M, (int)qd, D);
    matmul(r, k, r->xn, lw->k_proj, M, (int)kvd, D);
    matmul(r, v, r->xn, lw->v_proj, M, (int)kvd, D);
    fr_rmsnorm(r->q, r->q, lw->q_norm, M * H, d, c->rms_norm_eps);
    fr_rmsnorm(k, k, lw->k_norm, M * KVH, d, c->rms_norm_eps);
    for (int t = 0; t < M; t++) {
        fr_rope(r->q + (size_t)t * qd, H, d, r->pos[t], c->rope_theta, &c->rope_scaling);
        fr_rope(k + (size_t)t * kvd, KVH, d, r->pos[t], c->rope_theta, &c->rope_scaling);
    }
}

/* hidden_out = the layer's MLP (dense, or routed experts) of xn; under
 * tensor parallelism a partial sum the caller all-reduces. */
static void mlp(fr_runner_cpu *r, const fr_layer_weights *lw, int M)
{
    const fr_model_config *c = r->c;
    const int D = c->hidden_size;
    if (lw->router) {
        fr_moe_cpu_forward(r->moe, c, lw, r->xn, M, r->hidden_out, r->deterministic);
        return;
    }
    matmul(r, r->gate, r->xn, lw->gate_proj, M, c->intermediate_size, D);
    matmul(r, r->up, r->xn, lw->up_proj, M, c->intermediate_size, D);
    fr_swiglu(r->gate, r->gate, r->up, M * c->intermediate_size);
    matmul(r, r->hidden_out, r->gate, lw->down_proj, M, D, c->intermediate_size);
}

fr_status fr_runner_cpu_step(fr_runner_cpu *r, const fr_step_seq *seqs, int n_seqs, float *logits)
{
    const fr_model_config *c = r->c;   /* local head, intermediate and vocabulary counts */
    const fr_weights *w = r->w;
    const int D = c->hidden_size, d = c->head_dim, H = c->num_heads, KVH = c->num_kv_heads;
    const int vocab = r->m->cfg.vocab_size;
    const size_t qd = (size_t)H * d, kvd = (size_t)KVH * d;
    int M = 0;
    fr_status st = fr_step_admit(r->kv, seqs, n_seqs, vocab, c->max_position, r->max_tokens, &M);
    if (st) return st;
    for (int s = 0, row = 0; s < n_seqs; row += seqs[s].n, s++)
        for (int i = 0; i < seqs[s].n; i++) r->pos[row + i] = fr_kv_seq_len(r->kv, seqs[s].seq) + i;

    for (int s = 0, row = 0; s < n_seqs; row += seqs[s].n, s++)
        fr_embed(r->x + (size_t)row * D, w->embed, seqs[s].tokens, seqs[s].n, D);

    if (r->routes) r->route_rows = 0;   /* until this step's are all kept */
    for (int l = 0, moe_layer = 0; l < c->num_layers && !st; l++) {
        const fr_layer_weights *lw = &w->layers[l];
        float *k = r->kstep + (size_t)l * r->max_tokens * kvd, *v = r->vstep + (size_t)l * r->max_tokens * kvd;
        fr_rmsnorm(r->xn, r->x, lw->attn_norm, M, D, c->rms_norm_eps);
        if (r->mla) {
            fr_mla_cpu_project(r->mla, c, lw, r->xn, M, r->pos, r->q, k);
            /* the latent row is both key and value: observers see it as both */
            if (r->obs.layer_kv && (st = r->obs.layer_kv(r->obs.user, l, seqs, n_seqs, k, k))) break;
            if (r->fill_only) continue;
            if ((st = mla_attention(r, l, seqs, n_seqs))) break;
            matmul(r, r->hidden_out, r->att, lw->o_proj, M, D, H * c->v_head_dim);
        } else {
            qwen_qkv(r, lw, M, k, v);
            if (r->obs.layer_kv && (st = r->obs.layer_kv(r->obs.user, l, seqs, n_seqs, k, v))) break;
            if (r->obs.layer_q && (st = r->obs.layer_q(r->obs.user, l, seqs, n_seqs, r->q))) break;
            if (r->fill_only) continue;   /* keys and values are all a fill wants */
            if ((st = attention(r, l, seqs, n_seqs))) break;
            matmul(r, r->hidden_out, r->att, lw->o_proj, M, D, (int)qd);
        }
        if ((st = tp_allreduce(r, r->hidden_out, (size_t)M * D))) break;
        for (size_t i = 0; i < (size_t)M * D; i++) r->x[i] += r->hidden_out[i];
        fr_rmsnorm(r->xn, r->x, lw->mlp_norm, M, D, c->rms_norm_eps);
        mlp(r, lw, M);
        if (lw->router && r->routes) keep_routes(r, moe_layer, M);
        moe_layer += lw->router != NULL;
        if ((st = tp_allreduce(r, r->hidden_out, (size_t)M * D))) break;
        for (size_t i = 0; i < (size_t)M * D; i++) r->x[i] += r->hidden_out[i];
    }
    if (st) return st;
    if (r->routes && !r->fill_only) r->route_rows = M;

    /* The step's tokens join the cache only after every layer has read them. */
    for (int s = 0, row = 0; s < n_seqs && !st; row += seqs[s].n, s++)
        st = fr_kv_append(r->kv, seqs[s].seq, seqs[s].n, r->kstep + (size_t)row * kvd,
                          r->vstep + (size_t)row * kvd, (size_t)r->max_tokens * kvd);
    if (st || r->fill_only) return st;

    /* Final norm and LM head on the rows that want logits. */
    int out_rows = 0;
    for (int s = 0, row = 0; s < n_seqs; row += seqs[s].n, s++) {
        int first = seqs[s].all_logits ? row : row + seqs[s].n - 1;
        for (int t = first; t < row + seqs[s].n; t++, out_rows++)
            memcpy(r->xn + (size_t)out_rows * D, r->x + (size_t)t * D, sizeof(float) * D);
    }
    fr_rmsnorm(r->xn, r->xn, w->final_norm, out_rows, D, c->rms_norm_eps);
    if (r->tp.size == 1) {
        matmul(r, logits, r->xn, w->lm_head, out_rows, c->vocab_size, D);
        return FR_OK;
    }
    /* Vocabulary-parallel LM head: this rank's slice, then every rank gets
     * the full rows (the slices concatenated in tp-rank order). */
    matmul(r, r->logits_local, r->xn, w->lm_head, out_rows, c->vocab_size, D);
    fr_comm_status cs = fr_engine_allgather_f32(r->tp.group, r->logits_local, (size_t)out_rows,
                                                (size_t)c->vocab_size, logits);
    return cs ? fr_fail(FR_EIO, "%s", fr_last_error()) : FR_OK;
}
