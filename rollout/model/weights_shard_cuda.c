/* Tensor-parallel shards of device weights (fr_weights_gpu_shard of
 * rollout/model/weights_cuda.h), cut on the device from the whole model with the
 * layout of rollout/model/tp_shard.h. */
#include <stdlib.h>

#include <cuda_runtime.h>

#include "rollout/model/tp_shard.h"
#include "rollout/model/weights_cuda.h"

/* rows x width elements from a row-major source of pitch src_cols,
 * starting at column c0, into a dense destination. */
static cudaError_t copy_cols(uint16_t *dst, const uint16_t *src, size_t rows, size_t src_cols, size_t c0,
                             size_t width)
{
    return cudaMemcpy2D(dst, width * sizeof(uint16_t), src + c0, src_cols * sizeof(uint16_t),
                        width * sizeof(uint16_t), rows, cudaMemcpyDeviceToDevice);
}

static cudaError_t copy_rows(uint16_t *dst, const uint16_t *src, size_t r0, size_t rows, size_t cols)
{
    return cudaMemcpy(dst, src + r0 * cols, rows * cols * sizeof(uint16_t), cudaMemcpyDeviceToDevice);
}

/* The router whole; of every expert, this rank's gate rows, up rows and down
 * columns (rollout/model/tp_shard.h). */
static cudaError_t shard_experts(const fr_model_config *c, const fr_tp_layout *l, const fr_layer_weights_gpu *F,
                                 fr_layer_weights_gpu *L)
{
    const size_t H = (size_t)c->hidden_size, Im = (size_t)c->moe_intermediate_size, Il = (size_t)l->moe_inter,
                 i0 = (size_t)l->moe_inter0;
    cudaError_t e = copy_rows(L->router, F->router, 0, (size_t)c->num_experts, H);
    for (size_t x = 0; x < (size_t)c->num_experts && e == cudaSuccess; x++) {
        const uint16_t *fg = F->expert_gate_up + x * 2 * Im * H;
        uint16_t *lg = L->expert_gate_up + x * 2 * Il * H;
        e = copy_rows(lg, fg, i0, Il, H);
        if (e == cudaSuccess) e = copy_rows(lg + Il * H, fg, Im + i0, Il, H);
        if (e == cudaSuccess) e = copy_cols(L->expert_down + x * H * Il, F->expert_down + x * H * Im, H, Im, i0, Il);
    }
    return e;
}

fr_status fr_weights_gpu_shard(const fr_weights_gpu *full, int rank, int size, fr_weights_gpu **out)
{
    if (!full || !out) return fr_fail(FR_EINVAL, "fr_weights_gpu_shard: NULL argument");
    *out = NULL;
    if (full->tp_size > 1) return fr_fail(FR_EINVAL, "GPU weights: already a shard");
    fr_tp_layout l;
    fr_status st = fr_tp_layout_of(&full->cfg, rank, size, &l);
    if (st) return st;
    fr_model_config lc;
    fr_tp_local_config(&full->cfg, &l, &lc);
    if ((st = fr_weights_gpu_alloc(&lc, full->cfg.vocab_size, out))) return st;
    fr_weights_gpu *w = *out;
    w->tp_rank = rank;
    w->tp_size = size;
    const fr_model_config *c = &full->cfg;
    const size_t H = (size_t)c->hidden_size, D = (size_t)c->head_dim, I = (size_t)c->intermediate_size,
                 qd = (size_t)c->num_heads * D, Il = (size_t)l.inter;
    cudaError_t e = copy_rows(w->embed, full->embed, 0, (size_t)c->vocab_size, H);
    if (e == cudaSuccess) e = copy_rows(w->final_norm, full->final_norm, 0, 1, H);
    for (int i = 0; i < c->num_layers && e == cudaSuccess; i++) {
        const fr_layer_weights_gpu *F = &full->layers[i];
        fr_layer_weights_gpu *L = &w->layers[i];
        e = copy_rows(L->attn_norm, F->attn_norm, 0, 1, H);
        if (e == cudaSuccess) e = copy_rows(L->mlp_norm, F->mlp_norm, 0, 1, H);
        if (e == cudaSuccess) e = copy_rows(L->q_norm, F->q_norm, 0, 1, D);
        if (e == cudaSuccess) e = copy_rows(L->k_norm, F->k_norm, 0, 1, D);
        if (e == cudaSuccess) e = copy_rows(L->q_proj, F->q_proj, (size_t)l.head0 * D, (size_t)l.n_heads * D, H);
        if (e == cudaSuccess) e = copy_rows(L->k_proj, F->k_proj, (size_t)l.kv_head0 * D, (size_t)l.n_kv_heads * D, H);
        if (e == cudaSuccess) e = copy_rows(L->v_proj, F->v_proj, (size_t)l.kv_head0 * D, (size_t)l.n_kv_heads * D, H);
        if (e == cudaSuccess) e = copy_cols(L->o_proj, F->o_proj, H, qd, (size_t)l.head0 * D, (size_t)l.n_heads * D);
        if (F->router) {
            if (e == cudaSuccess) e = shard_experts(c, &l, F, L);
            continue;
        }
        /* gate rows, then up rows, of this rank's intermediate slice */
        if (e == cudaSuccess) e = copy_rows(L->gate_up, F->gate_up, (size_t)l.inter0, Il, H);
        if (e == cudaSuccess) e = copy_rows(L->gate_up + Il * H, F->gate_up, I + (size_t)l.inter0, Il, H);
        if (e == cudaSuccess) e = copy_cols(L->down_proj, F->down_proj, H, I, (size_t)l.inter0, Il);
    }
    if (c->tie_word_embeddings) w->lm_head = w->embed + (size_t)l.vocab0 * H;
    else if (e == cudaSuccess) e = copy_rows(w->lm_head, full->lm_head, (size_t)l.vocab0, (size_t)l.vocab, H);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        fr_weights_gpu_destroy(out);
        return fr_fail(FR_EINTERNAL, "GPU weights: copying rank %d's shard failed: %s", rank, cudaGetErrorString(e));
    }
    return FR_OK;
}

fr_status fr_weights_gpu_refill(fr_weights_gpu *w, const fr_model *m)
{
    if (!w || !m) return fr_fail(FR_EINVAL, "fr_weights_gpu_refill: NULL argument");
    fr_weights_gpu *full = NULL, *shard = NULL;
    fr_status st = fr_weights_gpu_from_model(m, &full);
    if (!st && w->tp_size > 1) st = fr_weights_gpu_shard(full, w->tp_rank, w->tp_size, &shard);
    const fr_weights_gpu *src = shard ? shard : full;
    if (!st && src->bytes != w->bytes)
        st = fr_fail(FR_EINVAL, "GPU weights: the new weights take %zu bytes, the serving ones %zu (another model?)",
                     src->bytes, w->bytes);
    if (!st) {
        cudaError_t e = cudaMemcpy(w->block_, src->block_, w->bytes, cudaMemcpyDeviceToDevice);
        if (e != cudaSuccess)
            st = fr_fail(FR_EINTERNAL, "GPU weights: copying the new weights in failed (%s); the device weights "
                                       "are now undefined", cudaGetErrorString(e));
    }
    fr_weights_gpu_destroy(&shard);
    fr_weights_gpu_destroy(&full);
    return st;
}
