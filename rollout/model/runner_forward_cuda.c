/* The CUDA runner's forward pass (runner_cuda.h): step metadata, the decoder
 * layers (Qwen3 and latent attention, a rider's rows beside ours), the LM
 * head, and the eager steps: every logit row to the host, a fill, or draws
 * sampled on the device. Decode graphs hold rcuda_enqueue_decode's work
 * (runner_decode_cuda.c). */
#include "rollout/model/runner_cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#include "attention/attn_bf16.h"
#include "attention/attn_fixed.h"
#include "attention/cuda_check.h"
#include "rollout/model/ops_cuda.h"

fr_status rcuda_admit(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *M_out)
{
    const fr_model_config *c = &r->w->cfg;
    if (n_seqs < 1 || n_seqs > r->max_seqs)
        return fr_fail(FR_EINVAL, "step: %d sequences (1..%d allowed)", n_seqs, r->max_seqs);
    return fr_step_admit(r->book, seqs, n_seqs, r->vocab, c->max_position, r->max_tokens, M_out);
}

fr_status rcuda_upload_metadata(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int pad_to, int M,
                                int *n_logits)
{
    int row = 0, lrows = 0;
    for (int s = 0; s < n_seqs; s++) {
        int len = fr_kv_seq_len(r->book, seqs[s].seq), nb = 0;
        const int *blocks = fr_kv_seq_blocks(r->book, seqs[s].seq, &nb);
        int *trow = r->h_tables + (size_t)s * r->max_pages;
        memcpy(trow, blocks, sizeof(int) * (size_t)nb);
        r->h_seqs[s] = (fr_paged_seq){.block_table = r->tables + (size_t)s * r->max_pages, .len = len,
                                      .n_new = seqs[s].n, .q_row = row, .slot = seqs[s].seq};
        for (int i = 0; i < seqs[s].n; i++) {
            r->h_ids[row + i] = seqs[s].tokens[i];
            r->h_pos[row + i] = len + i;
            if (seqs[s].all_logits || i == seqs[s].n - 1) r->h_logit_rows[lrows++] = row + i;
        }
        row += seqs[s].n;
    }
    for (int s = n_seqs; s < pad_to; s++, row++) {
        r->h_seqs[s] = (fr_paged_seq){.block_table = r->tables + (size_t)s * r->max_pages, .len = 0, .n_new = 0,
                                      .q_row = row, .slot = seqs[0].seq};
        r->h_ids[row] = 0;
        r->h_pos[row] = 0;
        r->h_logit_rows[lrows++] = row;
    }
    const int n_meta = pad_to > n_seqs ? pad_to : n_seqs;
    M = row > M ? row : M;
    FR_CUDA_TRY(cudaMemcpyAsync(r->ids, r->h_ids, sizeof(int) * (size_t)M, cudaMemcpyHostToDevice, r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->pos, r->h_pos, sizeof(int) * (size_t)M, cudaMemcpyHostToDevice, r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->logit_rows, r->h_logit_rows, sizeof(int) * (size_t)lrows,
                                cudaMemcpyHostToDevice, r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->seqs, r->h_seqs, sizeof(fr_paged_seq) * (size_t)n_meta,
                                cudaMemcpyHostToDevice, r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->tables, r->h_tables, sizeof(int) * (size_t)n_seqs * r->max_pages,
                                cudaMemcpyHostToDevice, r->stream));
    *n_logits = lrows;
    return FR_OK;
}

/* One decoder layer on the step's M rows. */
/* Hands layer l's post-RoPE q, k, v of the step's M rows to the observer
 * (synchronous copies: taps are for calibration and analysis, not speed). */
static fr_status observe(fr_runner_cuda *r, int l, int M)
{
    const fr_model_config *c = &r->w->cfg;
    if (r->mla) {   /* the latent row is both key and value, as the CPU runner shows it; no query tap */
        const size_t row = (size_t)c->head_dim;
        cudaError_t e = cudaMemcpyAsync(r->h_k, r->k, sizeof(float) * M * row, cudaMemcpyDeviceToHost, r->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(r->stream);
        if (e != cudaSuccess)
            return fr_fail(FR_EINTERNAL, "CUDA runner: copying layer %d's latent rows for the observer: %s", l,
                           cudaGetErrorString(e));
        return r->obs.layer_kv ? r->obs.layer_kv(r->obs.user, l, r->obs_seqs, r->obs_n_seqs, r->h_k, r->h_k) : FR_OK;
    }
    const size_t qd = (size_t)c->num_heads * c->head_dim, kvd = (size_t)c->num_kv_heads * c->head_dim;
    cudaError_t e = cudaMemcpyAsync(r->h_q, r->q, sizeof(float) * M * qd, cudaMemcpyDeviceToHost, r->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(r->h_k, r->k, sizeof(float) * M * kvd, cudaMemcpyDeviceToHost, r->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(r->h_v, r->v, sizeof(float) * M * kvd, cudaMemcpyDeviceToHost, r->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(r->stream);
    if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "CUDA runner: copying layer %d's q/k/v for the observer: %s", l,
                                         cudaGetErrorString(e));
    fr_status st = FR_OK;
    if (r->obs.layer_kv) st = r->obs.layer_kv(r->obs.user, l, r->obs_seqs, r->obs_n_seqs, r->h_k, r->h_v);
    if (!st && r->obs.layer_q) st = r->obs.layer_q(r->obs.user, l, r->obs_seqs, r->obs_n_seqs, r->h_q);
    return st;
}

/* x += in . W^T for a row-parallel W ([hidden][k]): directly with beta 1 on
 * one rank; across an engine, this rank's partial sum all-reduced over NCCL
 * and then added, so every rank holds the same residual stream. */
/* Tensor parallel: the ranks' partial sums in r->partial added up across
 * the engine, then into the residual stream. */
static fr_status residual_allreduce(fr_runner_cuda *r, int M)
{
    const int D = r->w->cfg.hidden_size;
    fr_comm_status cs = fr_nccl_allreduce_sum(r->nccl, r->partial, (size_t)M * D, FR_DTYPE_F32, r->stream);
    if (cs) return fr_fail(FR_EINTERNAL, "CUDA runner: %s", fr_last_error());
    return fr_cuda_add_f32(r->x, r->partial, (size_t)M * D, r->stream);
}

static fr_status residual_gemm(fr_runner_cuda *r, const uint16_t *in, const uint16_t *w, int M, int k)
{
    const int D = r->w->cfg.hidden_size;
    if (!r->nccl) return fr_gemm_bf16(r->gemm, r->x, in, w, M, D, k, 1.0f, r->stream);
    fr_status st = fr_gemm_bf16(r->gemm, r->partial, in, w, M, D, k, 0.0f, r->stream);
    return st ? st : residual_allreduce(r, M);
}

/* The layer's MLP on r->xn into the residual stream: dense, or routed
 * experts (rollout/model/moe_cuda.h) and DeepSeek's shared experts, a dense
 * MLP whose down product adds into the same sum. */
static fr_status mlp(fr_runner_cuda *r, const fr_layer_weights_gpu *lw, int l, int M)
{
    const fr_model_config *c = &r->w->cfg;
    const int D = c->hidden_size, I = c->intermediate_size;
    fr_status st;
    if (lw->router) {
        float *y = r->nccl ? r->partial : r->x;
        const int Is = fr_model_shared_inter(c);
        st = fr_moe_gpu_forward(r->moe, r->gemm, lw, l, r->xn, M, y, !r->nccl, r->stream);
        if (!st && lw->shared_gate_up) {
            st = fr_gemm_bf16(r->gemm, r->gu, r->xn, lw->shared_gate_up, M, 2 * Is, D, 0.0f, r->stream);
            if (!st) st = fr_cuda_swiglu_rows(r->h, r->gu, M, Is, r->stream);
            if (!st) st = fr_gemm_bf16(r->gemm, y, r->h, lw->shared_down, M, D, Is, 1.0f, r->stream);
        }
        return st || !r->nccl ? st : residual_allreduce(r, M);
    }
    st = fr_gemm_bf16(r->gemm, r->gu, r->xn, lw->gate_up, M, 2 * I, D, 0.0f, r->stream);
    if (!st) st = fr_cuda_swiglu_rows(r->h, r->gu, M, I, r->stream);
    return st ? st : residual_gemm(r, r->h, lw->down_proj, M, I);
}

/* Logits of `rows` normed rows (r->xn) into r->logits [rows][vocab]: one
 * product on one rank; across an engine, this rank's vocabulary slice, an
 * all-gather of every slice and a strided copy of each into its columns. */
static fr_status lm_head(fr_runner_cuda *r, int rows)
{
    const int D = r->w->cfg.hidden_size, Vl = r->w->cfg.vocab_size;
    if (!r->nccl) return fr_gemm_bf16(r->gemm, r->logits, r->xn, r->w->lm_head, rows, Vl, D, 0.0f, r->stream);
    fr_status st = fr_gemm_bf16(r->gemm, r->logits_local, r->xn, r->w->lm_head, rows, Vl, D, 0.0f, r->stream);
    if (st) return st;
    fr_comm_status cs = fr_nccl_allgather_f32(r->nccl, r->logits_local, r->logits_all, (size_t)rows * Vl, r->stream);
    if (cs) return fr_fail(FR_EINTERNAL, "CUDA runner: %s", fr_last_error());
    for (int t = 0; t < r->w->tp_size; t++) {
        cudaError_t e = cudaMemcpy2DAsync(r->logits + (size_t)t * Vl, sizeof(float) * (size_t)r->vocab,
                                          r->logits_all + (size_t)t * rows * Vl, sizeof(float) * (size_t)Vl,
                                          sizeof(float) * (size_t)Vl, (size_t)rows, cudaMemcpyDeviceToDevice,
                                          r->stream);
        if (e != cudaSuccess) return fr_fail(FR_EINTERNAL, "CUDA runner: logits gather: %s", cudaGetErrorString(e));
    }
    return FR_OK;
}

/* One decoder layer of a latent attention model (rollout/model/mla_cuda.h):
 * the rows the cache stores in r->k, staged as the store form in
 * r->step_k; a rider's rows follow ours in every product and have their
 * own attention and cache, as in layer_forward. */
static fr_status mla_layer_forward(fr_runner_cuda *r, int l, int M, int n_seqs, int max_new)
{
    const fr_model_config *c = &r->w->cfg;
    const fr_layer_weights_gpu *lw = &r->w->layers[l];
    const int D = c->hidden_size, H = c->num_heads, R = r->riding, Mt = M + R;
    const size_t row = (size_t)c->head_dim;
    const fr_runner_cuda *rd = r->rider;
    cudaStream_t s = r->stream;
    fr_status st = fr_cuda_rmsnorm(r->xn, r->x, NULL, lw->attn_norm, Mt, D, c->rms_norm_eps, s);
    if (!st) st = fr_mla_gpu_project(r->mla, r->gemm, lw, r->xn, r->pos, Mt, r->k, s);
    if (!st && r->obs_seqs) st = observe(r, l, M);
    if (!st) st = fr_kv_store_gpu_stage(r->store, l, M, r->k, NULL, r->step_k, NULL, s);
    if (!st && R) st = fr_kv_store_gpu_stage(rd->store, l, R, r->k + (size_t)M * row, NULL, rd->step_k, NULL, s);
    if (!st && r->fill_only)   /* the cache rows are all a fill wants */
        return fr_kv_store_gpu_commit(r->store, l, r->seqs, n_seqs, (max_new + T - 1) / T, r->step_k, NULL, s);
    if (!st) st = fr_mla_gpu_absorb(r->mla, r->gemm, lw, Mt, s);
    float *q = fr_mla_gpu_attn_query(r->mla);
    uint16_t *ctx = fr_mla_gpu_context(r->mla);
    int grew = 0;
    if (!st) st = fr_mla_gpu_attend(r->mla, r->store, l, r->step_k, r->seqs, n_seqs, max_new, q, ctx, &grew, s);
    if (!st && grew) rcuda_drop_graphs(r);   /* they hold the old workspace */
    if (!st && R)   /* the rider's cache, numerics and workspace are its own */
        st = fr_mla_gpu_attend(rd->mla, rd->store, l, rd->step_k, rd->seqs, R, 1, q + (size_t)M * H * row,
                               ctx + (size_t)M * H * c->kv_lora_rank, NULL, s);
    if (!st) st = fr_mla_gpu_values(r->mla, r->gemm, lw, Mt, r->att, s);
    if (!st) st = residual_gemm(r, r->att, lw->o_proj, Mt, H * c->v_head_dim);
    if (!st) st = fr_cuda_rmsnorm(r->xn, r->x, NULL, lw->mlp_norm, Mt, D, c->rms_norm_eps, s);
    if (!st) st = mlp(r, lw, l, Mt);
    if (!st) st = fr_kv_store_gpu_commit(r->store, l, r->seqs, n_seqs, (max_new + T - 1) / T, r->step_k, NULL, s);
    if (!st && R) st = fr_kv_store_gpu_commit(rd->store, l, rd->seqs, R, 1, rd->step_k, NULL, s);
    return st;
}

/* Whether the rider's launches go to the side stream: only beside an
 * FP4/FP8 cache's attention, whose workspace is not the BF16 one the
 * rider's attention uses. */
static int rider_side(const fr_runner_cuda *r) { return r->riding && r->quantized_kv && r->side; }

/* Makes `to` wait for the work enqueued on `from` so far (also inside a
 * graph capture, where it adds the dependency). */
static fr_status stream_after(cudaStream_t to, cudaStream_t from, cudaEvent_t ev)
{
    FR_CUDA_TRY(cudaEventRecord(ev, from));
    FR_CUDA_TRY(cudaStreamWaitEvent(to, ev, 0));
    return FR_OK;
}

static fr_status layer_forward(fr_runner_cuda *r, int l, int M, int n_seqs, int max_new)
{
    if (r->mla) return mla_layer_forward(r, l, M, n_seqs, max_new);
    const fr_model_config *c = &r->w->cfg;
    const fr_layer_weights_gpu *lw = &r->w->layers[l];
    const int D = c->hidden_size, d = c->head_dim, H = c->num_heads, KVH = c->num_kv_heads;
    const int qd = H * d, kvd = KVH * d;
    cudaStream_t s = r->stream;
    /* A rider's rows (r->riding of them) follow ours through everything but
     * attention and the cache. */
    const int R = r->riding, Mt = M + R, side = rider_side(r);
    const fr_runner_cuda *rd = r->rider;
    const cudaStream_t rs = side ? r->side : s;
    fr_status st = fr_cuda_rmsnorm(r->xn, r->x, NULL, lw->attn_norm, Mt, D, c->rms_norm_eps, s);
    if (!st) st = fr_gemm_bf16(r->gemm, r->q, r->xn, lw->q_proj, Mt, qd, D, 0.0f, s);
    if (!st) st = fr_gemm_bf16(r->gemm, r->k, r->xn, lw->k_proj, Mt, kvd, D, 0.0f, s);
    if (!st) st = fr_gemm_bf16(r->gemm, r->v, r->xn, lw->v_proj, Mt, kvd, D, 0.0f, s);
    if (!st)
        st = fr_cuda_qk_norm_rope(r->q, r->k, lw->q_norm, lw->k_norm, r->pos, Mt, H, KVH, d, c->rms_norm_eps,
                                  r->rope_cos, r->rope_sin, c->max_position, s);
    if (!st && r->obs_seqs) st = observe(r, l, M);
    if (!st) st = fr_kv_store_gpu_stage(r->store, l, M, r->k, r->v, r->step_k, r->step_v, s);
    if (!st && r->fill_only)   /* keys and values are all a fill wants (no rider rides a fill) */
        return fr_kv_store_gpu_commit(r->store, l, r->seqs, n_seqs, (max_new + T - 1) / T, r->step_k, r->step_v, s);
    if (!st && side) st = stream_after(rs, s, r->side_fork);
    if (!st && R)
        st = fr_kv_store_gpu_stage(rd->store, l, R, r->k + (size_t)M * kvd, r->v + (size_t)M * kvd, rd->step_k,
                                   rd->step_v, rs);
    if (!st && R) {   /* the rider's cache is BF16 */
        fr_paged_kv rv = fr_kv_store_gpu_view(rd->store, l, rd->step_k, rd->step_v);
        st = fr_attn_bf16(&rv, rd->seqs, R, 1, c->max_position, r->q + (size_t)M * qd, r->att + (size_t)M * qd, H,
                          r->attn_ws, r->attn_ws_bytes, rs);
    }
    /* On the side stream the rider's commit follows its attention there;
     * o_proj waits for the attention alone. */
    if (!st && side) FR_CUDA_TRY(cudaEventRecord(r->side_join, rs));
    if (!st && side) st = fr_kv_store_gpu_commit(rd->store, l, rd->seqs, R, 1, rd->step_k, rd->step_v, rs);
    if (!st) {
        fr_paged_kv view = fr_kv_store_gpu_view(r->store, l, r->step_k, r->step_v);
        if (!r->quantized_kv && r->deterministic) {
            st = fr_attn_fixed(&view, r->seqs, n_seqs, M, max_new, c->max_position, r->q, r->att, H, r->fixed_ws,
                               r->fixed_ws_bytes, s);
        } else if (!r->quantized_kv) {
            st = fr_attn_bf16(&view, r->seqs, n_seqs, max_new, c->max_position, r->q, r->att, H, r->attn_ws,
                              r->attn_ws_bytes, s);
        } else {
            /* Each kernel computes its own sequences (n_new 1, or more) and skips the rest. */
            st = fr_attn_fp4_decode(&r->fp4, &view, r->seqs, n_seqs, c->max_position, r->q, r->att, H, r->fp4_ws,
                                    r->fp4_ws_bytes, s);
            if (!st && max_new > 1)
                st = fr_attn_fp4_prefill(&r->fp4, &view, r->seqs, n_seqs, max_new, c->max_position, r->q, r->att, H,
                                         r->prefill_ws, r->prefill_ws_bytes, s);
        }
    }
    if (!st && side) FR_CUDA_TRY(cudaStreamWaitEvent(s, r->side_join, 0));
    /* o_proj and down_proj accumulate into the residual stream (beta = 1),
     * or, tensor parallel, their partial sums are all-reduced first. */
    if (!st) st = residual_gemm(r, r->att, lw->o_proj, Mt, qd);
    if (!st) st = fr_cuda_rmsnorm(r->xn, r->x, NULL, lw->mlp_norm, Mt, D, c->rms_norm_eps, s);
    if (!st) st = mlp(r, lw, l, Mt);
    if (!st)
        st = fr_kv_store_gpu_commit(r->store, l, r->seqs, n_seqs, (max_new + T - 1) / T, r->step_k, r->step_v, s);
    if (!st && R && !side) st = fr_kv_store_gpu_commit(rd->store, l, rd->seqs, R, 1, rd->step_k, rd->step_v, s);
    return st;
}

/* The step's forward pass up to the last layer (metadata, embedding,
 * layers): the residual stream of every token is left in r->x. */
static fr_status forward_layers(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *n_logits)
{
    const fr_model_config *c = &r->w->cfg;
    const int D = c->hidden_size, V = r->vocab;
    int M = 0, max_new = 0;
    fr_status st = rcuda_admit(r, seqs, n_seqs, &M);
    for (int s = 0; s < n_seqs; s++) max_new = seqs[s].n > max_new ? seqs[s].n : max_new;
    if (!st) st = rcuda_upload_metadata(r, seqs, n_seqs, 0, M, n_logits);
    if (!st) st = fr_cuda_embed(r->x, r->w->embed, r->ids, M, D, V, r->stream);
    if (r->obs.layer_kv || r->obs.layer_q) {
        r->obs_seqs = seqs;
        r->obs_n_seqs = n_seqs;
    }
    for (int l = 0; l < c->num_layers && !st; l++) st = layer_forward(r, l, M, n_seqs, max_new);
    r->obs_seqs = NULL;
    r->step_tokens = M;
    r->route_rows = st ? 0 : M;
    return st;
}

/* Final norm and LM head of logit rows a .. a + rows - 1 (rows <= logit_cap)
 * into r->logits. */
static fr_status logits_slice(fr_runner_cuda *r, int a, int rows)
{
    const fr_model_config *c = &r->w->cfg;
    fr_status st = fr_cuda_rmsnorm_rows(r->xn, r->x, r->step_tokens, r->logit_rows + a, rows, r->w->final_norm,
                                        c->hidden_size, c->rms_norm_eps, r->stream);
    return st ? st : lm_head(r, rows);
}

/* After the step's device work: the cache's checks, then the bookkeeping of
 * the tokens the device cache now holds. */
static fr_status finish_step(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs)
{
    fr_status st = fr_kv_store_gpu_check(r->store, r->stream);
    for (int s = 0; s < n_seqs && !st; s++) st = fr_kv_append(r->book, seqs[s].seq, seqs[s].n, NULL, NULL, 0);
    return st;
}

fr_status fr_runner_cuda_step(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, float *logits)
{
    const int V = r->vocab;
    int n_logits = 0;
    fr_status st = forward_layers(r, seqs, n_seqs, &n_logits);
    /* The LM head on the rows that want logits, a slice at a time. */
    for (int a = 0; a < n_logits && !st; a += r->logit_cap) {
        int rows = n_logits - a < r->logit_cap ? n_logits - a : r->logit_cap;
        st = logits_slice(r, a, rows);
        if (!st) {
            cudaError_t e = cudaMemcpyAsync(logits + (size_t)a * V, r->logits, sizeof(float) * (size_t)rows * V,
                                            cudaMemcpyDeviceToHost, r->stream);
            if (e == cudaSuccess) e = cudaStreamSynchronize(r->stream);
            if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "CUDA step failed: %s", cudaGetErrorString(e));
        }
    }
    return st ? st : finish_step(r, seqs, n_seqs);
}

fr_status fr_runner_cuda_fill(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs)
{
    int n_logits = 0;
    r->fill_only = 1;
    fr_status st = forward_layers(r, seqs, n_seqs, &n_logits);
    r->fill_only = 0;
    if (!st && cudaStreamSynchronize(r->stream) != cudaSuccess)
        st = fr_fail(FR_EINTERNAL, "CUDA fill failed: %s", cudaGetErrorString(cudaGetLastError()));
    return st ? st : finish_step(r, seqs, n_seqs);
}

/* Samples the n gathered rows of r->draw_logits with r->h_sample_rows[0..n)
 * and stores draw slot_of[p]'s token and log-prob. */
static fr_status draw_gathered(fr_runner_cuda *r, int n, const int *slot_of, int *tokens, float *logprobs)
{
    if (n == 0) return FR_OK;
    FR_CUDA_TRY(cudaMemcpyAsync(r->sample_rows, r->h_sample_rows, sizeof(fr_sample_row) * (size_t)n,
                                cudaMemcpyHostToDevice, r->stream));
    fr_status st = fr_sampler_gpu_sample(r->sampler, r->draw_logits, r->sample_rows, n, r->tokens_out,
                                         r->logprobs_out, r->stream);
    if (st) return st;
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_tokens, r->tokens_out, sizeof(int) * (size_t)n, cudaMemcpyDeviceToHost,
                                r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_logprobs, r->logprobs_out, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost,
                                r->stream));
    FR_CUDA_TRY(cudaStreamSynchronize(r->stream));
    for (int p = 0; p < n; p++) {
        tokens[slot_of[p]] = r->h_tokens[p];
        if (logprobs) logprobs[slot_of[p]] = r->h_logprobs[p];
    }
    return FR_OK;
}

fr_status fr_runner_cuda_step_draw(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, const int *draw_rows,
                                   const fr_sample_row *draw_params, int n_draws, int *tokens, float *logprobs,
                                   const int *keep, int n_keep, float *kept_logits)
{
    const int V = r->vocab;
    int n_rows = 0;
    for (int s = 0; s < n_seqs; s++) n_rows += seqs[s].all_logits ? seqs[s].n : 1;
    if (n_draws < 0 || (n_draws && (!draw_rows || !draw_params || !tokens)) || n_keep < 0 ||
        (n_keep && (!keep || !kept_logits)))
        return fr_fail(FR_EINVAL, "step: bad list of draws or of rows whose logits to keep");
    for (int i = 0; i < n_draws; i++) {
        if (draw_rows[i] < 0 || draw_rows[i] >= n_rows)
            return fr_fail(FR_EINVAL, "step: draw %d reads logit row %d of %d", i, draw_rows[i], n_rows);
        fr_status st = fr_sample_row_check(&draw_params[i], V);
        if (st) return st;
    }
    for (int i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= n_rows)
            return fr_fail(FR_EINVAL, "step: logit row %d to keep is outside the step's %d", keep[i], n_rows);
    /* The rows drawn from are gathered here, since a slice of the LM head's
     * output is overwritten by the next; made on first use. */
    if (n_draws && !r->draw_logits && cudaMalloc((void **)&r->draw_logits, sizeof(float) * (size_t)r->max_seqs * V))
        return fr_fail(FR_ENOMEM, "CUDA runner: cannot allocate the sampling rows (%zu bytes) on the device",
                       sizeof(float) * (size_t)r->max_seqs * V);
    int *slot_of = malloc(sizeof(int) * (size_t)(r->max_seqs > 0 ? r->max_seqs : 1));
    if (!slot_of) return fr_fail(FR_ENOMEM, "out of memory");
    int n_logits = 0, gathered = 0;
    fr_status st = forward_layers(r, seqs, n_seqs, &n_logits);
    for (int a = 0; a < n_logits && !st; a += r->logit_cap) {
        int rows = n_logits - a < r->logit_cap ? n_logits - a : r->logit_cap;
        st = logits_slice(r, a, rows);
        for (int i = 0; i < n_keep && !st; i++)
            if (keep[i] >= a && keep[i] < a + rows) {
                cudaError_t e = cudaMemcpyAsync(kept_logits + (size_t)i * V, r->logits + (size_t)(keep[i] - a) * V,
                                                sizeof(float) * (size_t)V, cudaMemcpyDeviceToHost, r->stream);
                if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "CUDA step: %s", cudaGetErrorString(e));
            }
        for (int i = 0; i < n_draws && !st; i++) {
            if (draw_rows[i] < a || draw_rows[i] >= a + rows) continue;
            cudaError_t e = cudaMemcpyAsync(r->draw_logits + (size_t)gathered * V,
                                            r->logits + (size_t)(draw_rows[i] - a) * V, sizeof(float) * (size_t)V,
                                            cudaMemcpyDeviceToDevice, r->stream);
            if (e != cudaSuccess) {
                st = fr_fail(FR_EINTERNAL, "CUDA step: %s", cudaGetErrorString(e));
                break;
            }
            r->h_sample_rows[gathered] = draw_params[i];
            slot_of[gathered++] = i;
            if (gathered == r->max_seqs) {   /* the sampler's capacity: draw these, go on */
                st = draw_gathered(r, gathered, slot_of, tokens, logprobs);
                gathered = 0;
            }
        }
    }
    if (!st) st = draw_gathered(r, gathered, slot_of, tokens, logprobs);
    if (!st && cudaStreamSynchronize(r->stream) != cudaSuccess)
        st = fr_fail(FR_EINTERNAL, "CUDA step failed: %s", cudaGetErrorString(cudaGetLastError()));
    free(slot_of);
    return st ? st : finish_step(r, seqs, n_seqs);
}

/* The device work of a decode step over `rows` rows (one per sequence,
 * padding included), from the embedding to the sampled tokens: what a
 * decode graph holds. */
fr_status rcuda_enqueue_decode(fr_runner_cuda *r, int rows)
{
    const fr_model_config *c = &r->w->cfg;
    const int D = c->hidden_size, V = r->vocab, Mt = rows + r->riding;   /* a rider's rows follow ours */
    fr_status st = fr_cuda_embed(r->x, r->w->embed, r->ids, Mt, D, V, r->stream);
    for (int l = 0; l < c->num_layers && !st; l++) st = layer_forward(r, l, rows, rows, 1);
    if (rider_side(r)) {   /* the rider's last commits (a capture must end joined, even after a failure) */
        fr_status j = stream_after(r->stream, r->side, r->side_join);
        if (!st) st = j;
    }
    if (!st)
        st = fr_cuda_rmsnorm_rows(r->xn, r->x, Mt, r->logit_rows, Mt, r->w->final_norm, D, c->rms_norm_eps,
                                  r->stream);
    if (!st) st = lm_head(r, Mt);
    if (!st)
        st = fr_sampler_gpu_sample(r->sampler, r->logits, r->sample_rows, rows, r->tokens_out, r->logprobs_out,
                                   r->stream);
    return st;
}

