#include "rollout/model/weights_cuda.h"

#include <stdlib.h>
#include <string.h>

#include "attention/cuda_check.h"
#include "attention/fp_formats.h"
#include "rollout/model/tensor_table.h"

/* The tensors in the generator's order (model.h): stream t of the synthetic
 * generator is the t-th tensor of this walk, tied lm_head included as a
 * stream number even when it is not stored. */
typedef enum { KIND_EMBED, KIND_PROJ, KIND_NORM, KIND_ROUTER, KIND_BIAS } fill_kind;

typedef struct {
    uint16_t **dst;
    size_t rows, cols;
    fill_kind kind;
    const float *host;   /* the host model's tensor, or NULL */
    size_t offset;       /* elements after *dst: tensors that continue the previous one's block */
} tensor_slot;


/* Adds the layer's MLP: the dense gate|up and down, or the router and every
 * expert's gate|up, then every expert's down. */
static int plan_mlp(const fr_model_config *c, int l, fr_layer_weights_gpu *L, const fr_layer_weights *hl,
                    tensor_slot *t, int n)
{
    const size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
#define ADD(ptr, r, cc, k, h) (t[n++] = (tensor_slot){&(ptr), (r), (cc), (k), (h), 0})
    if (!fr_model_layer_is_moe(c, l)) {
        /* gate and up share one matrix: up's rows follow gate's */
        ADD(L->gate_up, I, H, KIND_PROJ, hl ? hl->gate_proj : NULL);
        ADD(L->gate_up, I, H, KIND_PROJ, hl ? hl->up_proj : NULL);
        ADD(L->down_proj, H, I, KIND_PROJ, hl ? hl->down_proj : NULL);
        return n;
    }
    const size_t E = (size_t)c->num_experts, Im = (size_t)c->moe_intermediate_size, per = Im * H;
    const size_t Is = (size_t)fr_model_shared_inter(c);
    ADD(L->router, E, H, KIND_ROUTER, hl ? hl->router : NULL);
    if (fr_model_has_router_bias(c)) ADD(L->router_bias, 1, E, KIND_BIAS, hl ? hl->router_bias : NULL);
    for (size_t e = 0; e < E; e++) {
        ADD(L->expert_gate_up, Im, H, KIND_PROJ, hl ? hl->expert_gate + e * per : NULL);
        ADD(L->expert_gate_up, Im, H, KIND_PROJ, hl ? hl->expert_up + e * per : NULL);
    }
    for (size_t e = 0; e < E; e++) ADD(L->expert_down, H, Im, KIND_PROJ, hl ? hl->expert_down + e * per : NULL);
    if (Is) {   /* gate and up share one matrix, as the dense MLP's */
        ADD(L->shared_gate_up, Is, H, KIND_PROJ, hl ? hl->shared_gate : NULL);
        ADD(L->shared_gate_up, Is, H, KIND_PROJ, hl ? hl->shared_up : NULL);
        ADD(L->shared_down, H, Is, KIND_PROJ, hl ? hl->shared_down : NULL);
    }
#undef ADD
    return n;
}

/* Adds latent attention's tensors in the order of rollout/model/model.h. */
static int plan_mla(const fr_model_config *c, fr_layer_weights_gpu *L, const fr_layer_weights *hl, tensor_slot *t,
                    int n)
{
    const size_t H = (size_t)c->hidden_size, nh = (size_t)c->num_heads, ql = (size_t)c->q_lora_rank;
    const size_t dc = (size_t)c->kv_lora_rank, dr = (size_t)c->qk_rope_dim, dn = (size_t)c->qk_nope_dim,
                 dv = (size_t)c->v_head_dim;
#define ADD(ptr, r, cc, k, h) (t[n++] = (tensor_slot){&(ptr), (r), (cc), (k), (h), 0})
    if (ql) {
        ADD(L->q_a_proj, ql, H, KIND_PROJ, hl ? hl->q_a_proj : NULL);
        ADD(L->q_a_norm, 1, ql, KIND_NORM, hl ? hl->q_a_norm : NULL);
        ADD(L->q_b_proj, nh * (dn + dr), ql, KIND_PROJ, hl ? hl->q_b_proj : NULL);
    } else {
        ADD(L->q_proj, nh * (dn + dr), H, KIND_PROJ, hl ? hl->q_proj : NULL);
    }
    ADD(L->kv_a_proj, dc + dr, H, KIND_PROJ, hl ? hl->kv_a_proj : NULL);
    ADD(L->kv_a_norm, 1, dc, KIND_NORM, hl ? hl->kv_a_norm : NULL);
    ADD(L->kv_b_proj, nh * (dn + dv), dc, KIND_PROJ, hl ? hl->kv_b_proj : NULL);
    ADD(L->o_proj, H, nh * dv, KIND_PROJ, hl ? hl->o_proj : NULL);
#undef ADD
    return n;
}

static size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

/* Lays the tensors out in one block (each 256-byte aligned) and lists them.
 * Returns the number of tensors; fills bytes with the block size. */
static int plan(fr_weights_gpu *w, const fr_model *m, tensor_slot *t, size_t *bytes)
{
    const fr_model_config *c = &w->cfg;
    /* A tensor-parallel shard keeps the whole embedding (vocab_full rows). */
    size_t V = (size_t)c->vocab_size, H = (size_t)c->hidden_size, D = (size_t)c->head_dim,
           VE = w->vocab_full > 0 ? (size_t)w->vocab_full : V,
           qd = (size_t)c->num_heads * D, kvd = (size_t)c->num_kv_heads * D;
    int n = 0;
#define ADD(ptr, r, cc, k, h) (t[n++] = (tensor_slot){&(ptr), (r), (cc), (k), (h), 0})
    ADD(w->embed, VE, H, KIND_EMBED, m ? m->w.embed : NULL);
    for (int l = 0; l < c->num_layers; l++) {
        fr_layer_weights_gpu *L = &w->layers[l];
        const fr_layer_weights *hl = m ? &m->w.layers[l] : NULL;
        ADD(L->attn_norm, 1, H, KIND_NORM, hl ? hl->attn_norm : NULL);
        if (fr_model_is_mla(c)) {
            n = plan_mla(c, L, hl, t, n);
            ADD(L->mlp_norm, 1, H, KIND_NORM, hl ? hl->mlp_norm : NULL);
            n = plan_mlp(c, l, L, hl, t, n);
            continue;
        }
        ADD(L->q_proj, qd, H, KIND_PROJ, hl ? hl->q_proj : NULL);
        ADD(L->k_proj, kvd, H, KIND_PROJ, hl ? hl->k_proj : NULL);
        ADD(L->v_proj, kvd, H, KIND_PROJ, hl ? hl->v_proj : NULL);
        ADD(L->o_proj, H, qd, KIND_PROJ, hl ? hl->o_proj : NULL);
        ADD(L->q_norm, 1, D, KIND_NORM, hl ? hl->q_norm : NULL);
        ADD(L->k_norm, 1, D, KIND_NORM, hl ? hl->k_norm : NULL);
        ADD(L->mlp_norm, 1, H, KIND_NORM, hl ? hl->mlp_norm : NULL);
        n = plan_mlp(c, l, L, hl, t, n);
    }
    ADD(w->final_norm, 1, H, KIND_NORM, m ? m->w.final_norm : NULL);
    ADD(w->lm_head, V, H, KIND_PROJ, m ? m->w.lm_head : NULL);
#undef ADD
    /* Offsets: a tensor with the previous one's pointer (gate_up's second
     * half, the experts) continues its block; a tied lm_head takes no space. */
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        int cont = i > 0 && t[i].dst == t[i - 1].dst;
        int tied = t[i].dst == &w->lm_head && c->tie_word_embeddings;
        if (cont) t[i].offset = t[i - 1].offset + t[i - 1].rows * t[i - 1].cols;
        if (!cont && !tied) off = align_up(off);
        if (!cont && !tied) *t[i].dst = (uint16_t *)(uintptr_t)off;
        if (!tied) off += t[i].rows * t[i].cols * sizeof(uint16_t);
    }
    *bytes = align_up(off);
    return n;
}

static fr_status alloc_layers(const fr_model_config *cfg, fr_weights_gpu **out)
{
    *out = NULL;
    if (cfg->num_layers < 1 || cfg->hidden_size < 1 || cfg->vocab_size < 1 || cfg->head_dim < 1 ||
        cfg->num_heads < 1 || cfg->num_kv_heads < 1 || cfg->intermediate_size < 1)
        return fr_fail(FR_EINVAL, "GPU weights: invalid model sizes");
    if (fr_model_is_mla(cfg) && (cfg->qk_nope_dim < 1 || cfg->qk_rope_dim < 2 || cfg->v_head_dim < 1))
        return fr_fail(FR_EINVAL, "GPU weights: invalid latent attention sizes");
    fr_weights_gpu *w = (fr_weights_gpu *)calloc(1, sizeof *w);
    if (!w) return fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    w->cfg = *cfg;
    w->tp_size = 1;
    w->layers = (fr_layer_weights_gpu *)calloc((size_t)cfg->num_layers, sizeof *w->layers);
    if (!w->layers) {
        free(w);
        return fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    }
    *out = w;
    return FR_OK;
}

/* Turns the planned offsets into device pointers. */
static void rebase(fr_weights_gpu *w, tensor_slot *t, int n)
{
    uint8_t *base = (uint8_t *)w->block_;
    for (int i = 0; i < n; i++) {
        if (i > 0 && t[i].dst == t[i - 1].dst) continue;   /* continues the previous block */
        if (t[i].dst == &w->lm_head && w->cfg.tie_word_embeddings) continue;
        *t[i].dst = (uint16_t *)(base + (uintptr_t)*t[i].dst);
    }
    if (w->cfg.tie_word_embeddings) w->lm_head = w->embed;
}

static fr_status prepare(const fr_model_config *cfg, const fr_model *m, fr_weights_gpu **out, tensor_slot **slots,
                         int *n, int vocab_full)
{
    fr_status st = alloc_layers(cfg, out);
    if (st) return st;
    fr_weights_gpu *w = *out;
    w->vocab_full = vocab_full;
    *slots = (tensor_slot *)calloc(fr_model_tensor_count(cfg) + 1, sizeof **slots);   /* + a tied lm_head */
    if (!*slots) {
        fr_weights_gpu_destroy(out);
        return fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    }
    *n = plan(w, m, *slots, &w->bytes);
    cudaError_t e = cudaMalloc(&w->block_, w->bytes);
    if (e != cudaSuccess) {
        free(*slots);
        fr_weights_gpu_destroy(out);
        return fr_fail(FR_ENOMEM, "GPU weights: cannot allocate %.2f GB on the device: %s", (double)w->bytes / 1e9,
                       cudaGetErrorString(e));
    }
    rebase(w, *slots, *n);
    return FR_OK;
}

/* Where tensor i's values start. */
static uint16_t *dest_of(const tensor_slot *t, int i) { return *t[i].dst + t[i].offset; }

fr_status fr_weights_gpu_from_model(const fr_model *m, fr_weights_gpu **out)
{
    if (!m || !out) return fr_fail(FR_EINVAL, "fr_weights_gpu_from_model: NULL argument");
    tensor_slot *t;
    int n;
    fr_status st = prepare(&m->cfg, m, out, &t, &n, m->cfg.vocab_size);
    if (st) return st;
    size_t most = 0;
    for (int i = 0; i < n; i++) most = t[i].rows * t[i].cols > most ? t[i].rows * t[i].cols : most;
    uint16_t *stage = (uint16_t *)malloc(most * sizeof(uint16_t));
    if (!stage) st = fr_fail(FR_ENOMEM, "GPU weights: out of memory");
    for (int i = 0; i < n && !st; i++) {
        if (t[i].dst == &(*out)->lm_head && m->cfg.tie_word_embeddings) continue;
        size_t count = t[i].rows * t[i].cols;
        for (size_t e = 0; e < count; e++) stage[e] = fr_bf16_encode(t[i].host[e]);
        cudaError_t e = cudaMemcpy(dest_of(t, i), stage, count * sizeof(uint16_t), cudaMemcpyHostToDevice);
        if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "GPU weights: copy failed: %s", cudaGetErrorString(e));
    }
    free(stage);
    free(t);
    if (st) fr_weights_gpu_destroy(out);
    return st;
}

/* ---- the synthetic generator (rollout/model/synthetic_model.c states it) ---- */

__device__ static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t mix64_host(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* BF16 round to nearest even of a finite float (the generator's values are
 * small and finite). */
__device__ static uint16_t bf16_rne(float f)
{
    uint32_t u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element e's normal draw is a pure function of the stream's start state:
 * the generator advances the state by a constant per 64-bit draw, six draws
 * per element. */
__global__ void gen_kernel(uint16_t *dst, size_t n, uint64_t state0, int kind, double scale, size_t rows,
                           size_t cols)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        uint64_t s = state0 + 6 * e * 0x9e3779b97f4a7c15ull;
        uint64_t sum = 0;
        for (int j = 0; j < 6; j++) {
            s += 0x9e3779b97f4a7c15ull;
            uint64_t v = mix64(s);
            sum += (v >> 32) + (v & 0xffffffffull);
        }
        double z = (double)((int64_t)sum - (int64_t)(6ull << 32)) * 0x1p-32;
        if (kind == KIND_ROUTER) {
            /* expert r's spread: 0.25 .. 3 times a projection's, in a
             * scattered order over the experts */
            const double u = (double)((e / cols * 37) % rows) / (double)rows;
            z = __dmul_rn(z, __dadd_rn(0.25, __dmul_rn(2.75, __dmul_rn(u, u))));
        }
        float f = kind == KIND_EMBED ? (float)z
                  : kind == KIND_PROJ || kind == KIND_ROUTER ? (float)__dmul_rn(z, scale)
                  : kind == KIND_BIAS                        ? (float)__dmul_rn(0.05, z)
                                                             : (float)__dadd_rn(1.0, __dmul_rn(0.1, z));
        dst[e] = bf16_rne(f);
    }
}

fr_status fr_weights_gpu_synthetic(const fr_model_config *cfg, uint64_t seed, fr_weights_gpu **out)
{
    if (!cfg || !out) return fr_fail(FR_EINVAL, "fr_weights_gpu_synthetic: NULL argument");
    tensor_slot *t;
    int n;
    fr_status st = prepare(cfg, NULL, out, &t, &n, cfg->vocab_size);
    if (st) return st;
    for (int i = 0; i < n && !st; i++) {
        if (t[i].dst == &(*out)->lm_head && cfg->tie_word_embeddings) continue;
        uint64_t state0 = mix64_host(seed ^ mix64_host((uint64_t)i + 1));
        double scale = t[i].kind == KIND_PROJ || t[i].kind == KIND_ROUTER ? 1.0 / sqrt((double)t[i].cols) : 1.0;
        size_t count = t[i].rows * t[i].cols;
        gen_kernel<<<1024, 256>>>(dest_of(t, i), count, state0, (int)t[i].kind, scale, t[i].rows, t[i].cols);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "GPU weights: generator launch failed: %s", cudaGetErrorString(e));
    }
    if (!st) {
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "GPU weights: generator failed: %s", cudaGetErrorString(e));
    }
    free(t);
    if (st) fr_weights_gpu_destroy(out);
    return st;
}

void fr_weights_gpu_destroy(fr_weights_gpu **pw)
{
    fr_weights_gpu *w = pw ? *pw : NULL;
    if (!w) return;
    if (w->block_ && !w->host_copy_) cudaFree(w->block_);   /* released: block_ is gone already */
    free(w->host_copy_);
    free(w->layers);
    free(w);
    *pw = NULL;
}

fr_status fr_weights_gpu_alloc(const fr_model_config *cfg, int vocab_full, fr_weights_gpu **out)
{
    if (!cfg || !out) return fr_fail(FR_EINVAL, "fr_weights_gpu_alloc: NULL argument");
    tensor_slot *t;
    int n;
    fr_status st = prepare(cfg, NULL, out, &t, &n, vocab_full);
    if (!st) free(t);
    return st;
}
