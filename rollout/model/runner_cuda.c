/* The CUDA runner (runner_cuda.h): creation with every buffer it will use,
 * destruction, modes (taps, deterministic mode, key mean), forks and what it
 * reports; the forward pass is runner_forward_cuda.c, decode graphs
 * runner_decode_cuda.c. */
#include "rollout/model/runner_cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#include "attention/attn_bf16.h"
#include "attention/attn_fixed.h"
#include "rollout/model/ops_cuda.h"

int fr_cuda_available(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

int fr_cuda_built(void) { return 1; }

const char *fr_cuda_absence(void) { return "no usable CUDA device"; }

#define DEV_ALLOC(ptr, count)                                                                     \
    do {                                                                                          \
        if (!st && cudaMalloc((void **)&(ptr), sizeof(*(ptr)) * (size_t)(count)) != cudaSuccess)  \
            st = fr_fail(FR_ENOMEM, "CUDA runner: cannot allocate %s (%zu bytes) on the device", \
                         #ptr, sizeof(*(ptr)) * (size_t)(count));                                 \
    } while (0)
#define HOST_ALLOC(ptr, count)                                                                         \
    do {                                                                                               \
        if (!st && cudaMallocHost((void **)&(ptr), sizeof(*(ptr)) * (size_t)(count)) != cudaSuccess)   \
            st = fr_fail(FR_ENOMEM, "CUDA runner: cannot allocate %s (%zu bytes) of pinned memory", #ptr, \
                         sizeof(*(ptr)) * (size_t)(count));                                            \
    } while (0)

fr_status fr_runner_cuda_new(const fr_weights_gpu *w, fr_kv_cache *book, int max_step_tokens,
                             fr_runner_cuda **out)
{
    return fr_runner_cuda_new_tp(w, book, max_step_tokens, NULL, out);
}

fr_status fr_runner_cuda_new_tp(const fr_weights_gpu *w, fr_kv_cache *book, int max_step_tokens,
                                struct fr_nccl_group *nccl, fr_runner_cuda **out)
{
    *out = NULL;
    if (w->tp_size > 1 && !nccl)
        return fr_fail(FR_EINVAL, "CUDA runner: a tensor-parallel shard (rank %d of %d) needs the engine's NCCL group",
                       w->tp_rank, w->tp_size);
    const fr_model_config *c = &w->cfg;
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(book);
    if (!kc->bookkeeping_only)
        return fr_fail(FR_EINVAL, "CUDA runner: the host cache must be bookkeeping-only");
    if (max_step_tokens < 1) return fr_fail(FR_EINVAL, "CUDA runner: max_step_tokens must be positive");
    if (kc->n_layers != c->num_layers || kc->n_kv_heads != c->num_kv_heads || kc->head_dim != c->head_dim)
        return fr_fail(FR_EINVAL, "CUDA runner: the cache's shape does not match the model's");
    if (kc->dtype == FR_KV_F32)
        return fr_fail(FR_EUNSUPPORTED, "CUDA runner: kv dtype f32 is the CPU backend's reference only%s",
                       fr_model_is_mla(c) ? " (a float32 latent cache runs with --backend cpu)" : "");
    if (fr_model_is_mla(c) != (kc->latent_dim > 0) || (kc->latent_dim > 0 && kc->latent_dim != c->kv_lora_rank))
        return fr_fail(FR_EINVAL, "CUDA runner: the KV cache's latent width %d does not match the model's %d (a "
                       "multi-head latent attention model needs a latent cache, and only it)", kc->latent_dim,
                       c->kv_lora_rank);
    fr_runner_cuda *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "CUDA runner: out of memory");
    static unsigned long long next_id = 1;   /* runners are made on one thread */
    r->id = next_id++;
    r->w = w;
    r->book = book;
    r->nccl = w->tp_size > 1 ? nccl : NULL;
    r->vocab = w->vocab_full > 0 ? w->vocab_full : c->vocab_size;
    r->max_tokens = max_step_tokens;
    r->max_seqs = kc->max_seqs;
    r->max_pages = (c->max_position + T - 1) / T;
    const int M = max_step_tokens, D = c->hidden_size, d = c->head_dim, mla = fr_model_is_mla(c);
    const size_t qd = (size_t)c->num_heads * d, kvd = (size_t)c->num_kv_heads * d;
    /* Latent attention: q and v stay unused (the query lives in the latent
     * layer's buffers, the cache row is k), att holds W_UV's output. */
    const size_t att = mla ? (size_t)c->num_heads * c->v_head_dim : qd;
    const int I = c->intermediate_size, V = r->vocab, Vl = c->vocab_size, tp = w->tp_size > 1 ? w->tp_size : 1;
    fr_status st = fr_kv_store_gpu_new(kc, &r->store);
    if (!st) st = fr_gemm_new(0, &r->gemm);
    if (!st && c->num_experts > 0) st = fr_moe_gpu_new(c, M, &r->moe);
    if (!st) st = fr_sampler_gpu_new(V, r->max_seqs, &r->sampler);
    r->use_graphs = getenv("FR_CUDA_GRAPHS") == NULL || strcmp(getenv("FR_CUDA_GRAPHS"), "0") != 0;
    r->rider_min_rows = getenv("FR_RIDER_MIN_ROWS") ? atoi(getenv("FR_RIDER_MIN_ROWS")) : 0;
    r->side_off = getenv("FR_RIDER_SIDE") && strcmp(getenv("FR_RIDER_SIDE"), "0") == 0;
    if (!st && cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking) != cudaSuccess)
        st = fr_fail(FR_EINTERNAL, "CUDA runner: cannot create a stream");
    DEV_ALLOC(r->x, (size_t)M * D);
    DEV_ALLOC(r->xn, (size_t)M * D);
    DEV_ALLOC(r->q, mla ? 1 : (size_t)M * qd);
    DEV_ALLOC(r->k, (size_t)M * kvd);
    DEV_ALLOC(r->v, mla ? 1 : (size_t)M * kvd);
    DEV_ALLOC(r->step_k, (size_t)M * kvd);
    DEV_ALLOC(r->step_v, mla ? 1 : (size_t)M * kvd);
    DEV_ALLOC(r->att, (size_t)M * att);
    /* the dense MLP's and DeepSeek's shared experts' (a dense MLP of Is rows) */
    const size_t wide = (size_t)(fr_model_shared_inter(c) > I ? fr_model_shared_inter(c) : I);
    DEV_ALLOC(r->gu, (size_t)M * 2 * wide);
    DEV_ALLOC(r->h, (size_t)M * wide);
    /* Full-vocabulary logits of a whole prefill chunk would not fit for a
     * large vocabulary: the LM head runs in slices of logit_cap rows. */
    r->logit_cap = M;
    if ((size_t)r->logit_cap * V > ((size_t)64 << 20)) r->logit_cap = (int)(((size_t)64 << 20) / V);
    if (r->logit_cap < r->max_seqs) r->logit_cap = r->max_seqs < M ? r->max_seqs : M;
    if (r->logit_cap < 1) r->logit_cap = 1;
    DEV_ALLOC(r->logits, (size_t)r->logit_cap * V);
    if (tp > 1) {
        DEV_ALLOC(r->partial, (size_t)M * D);
        DEV_ALLOC(r->logits_local, (size_t)r->logit_cap * Vl);
        DEV_ALLOC(r->logits_all, (size_t)tp * r->logit_cap * Vl);
    }
    DEV_ALLOC(r->ids, M);
    DEV_ALLOC(r->pos, M);
    DEV_ALLOC(r->logit_rows, M);
    DEV_ALLOC(r->seqs, r->max_seqs);
    DEV_ALLOC(r->tokens_out, r->max_seqs);
    DEV_ALLOC(r->logprobs_out, r->max_seqs);
    DEV_ALLOC(r->sample_rows, r->max_seqs);
    HOST_ALLOC(r->h_tokens, r->max_seqs);
    HOST_ALLOC(r->h_logprobs, r->max_seqs);
    HOST_ALLOC(r->h_sample_rows, r->max_seqs);
    DEV_ALLOC(r->tables, (size_t)r->max_seqs * r->max_pages);
    HOST_ALLOC(r->h_ids, M);
    HOST_ALLOC(r->h_pos, M);
    HOST_ALLOC(r->h_logit_rows, M);
    HOST_ALLOC(r->h_seqs, r->max_seqs);
    HOST_ALLOC(r->h_tables, (size_t)r->max_seqs * r->max_pages);
    if (!st && mla) {
        r->quantized_kv = kc->dtype != FR_KV_BF16;
        st = fr_mla_gpu_new(c, book, r->store, M, r->max_seqs, &r->mla);
    }
    if (!st && !mla) st = fr_cuda_rope_table_new(c->max_position, d, c->rope_theta, &c->rope_scaling, &r->rope_cos,
                                                   &r->rope_sin);
    if (!st && !mla) {
        st = fr_attn_bf16_workspace_bytes(r->max_seqs, c->num_heads, c->num_kv_heads, d, c->max_position,
                                          &r->attn_ws_bytes);
        DEV_ALLOC(r->attn_ws, r->attn_ws_bytes ? r->attn_ws_bytes : 1);
    }
    if (!st && !mla && kc->dtype != FR_KV_BF16) {
        const int G = c->num_heads / c->num_kv_heads, fp4 = fr_kv_dtype_is_fp4(kc->dtype);
        r->quantized_kv = 1;
        r->fp4 = (fr_attn_fp4_config){.dtype = kc->dtype, .p = fr_kv_attn_params(book, G),
                                      .rotate = fp4 && kc->recipe.rotate, .sink_recent = fp4 && kc->recipe.sink_recent,
                                      .fp8_scales = fr_kv_store_gpu_fp8_scales(r->store)};
        st = fr_attn_fp4_workspace_bytes(&r->fp4, r->max_seqs, c->num_heads, c->num_kv_heads, c->max_position,
                                         &r->fp4_ws_bytes);
        if (!st)
            st = fr_attn_fp4_prefill_workspace_bytes(&r->fp4, r->max_seqs, M, c->num_heads, c->num_kv_heads,
                                                     &r->prefill_ws_bytes);
        DEV_ALLOC(r->fp4_ws, r->fp4_ws_bytes ? r->fp4_ws_bytes : 1);
        DEV_ALLOC(r->prefill_ws, r->prefill_ws_bytes ? r->prefill_ws_bytes : 1);
    }
    if (st) {
        fr_runner_cuda_destroy(&r);
        return st;
    }
    *out = r;
    return FR_OK;
}

void fr_runner_cuda_destroy(fr_runner_cuda **pr)
{
    fr_runner_cuda *r = pr ? *pr : NULL;
    if (!r) return;
    if (r->stream) cudaStreamSynchronize(r->stream);
    for (int b = 0; b < FR_CUDA_GRAPH_BUCKETS; b++) {
        if (r->graphs[b]) cudaGraphExecDestroy(r->graphs[b]);
        for (int b2 = 0; b2 < FR_CUDA_GRAPH_BUCKETS; b2++)
            if (r->rgraphs[b][b2]) cudaGraphExecDestroy(r->rgraphs[b][b2]);
    }
    if (r->rider_ready) cudaEventDestroy(r->rider_ready);
    if (r->side) cudaStreamSynchronize(r->side);
    if (r->side_fork) cudaEventDestroy(r->side_fork);
    if (r->side_join) cudaEventDestroy(r->side_join);
    if (r->side) cudaStreamDestroy(r->side);
    void *dev[] = {r->x, r->xn, r->q, r->k, r->v, r->step_k, r->step_v, r->att, r->gu, r->h, r->logits,
                   r->partial, r->logits_local, r->logits_all,
                   r->ids, r->pos, r->logit_rows, r->seqs, r->tables, r->attn_ws, r->tokens_out,
                   r->logprobs_out, r->sample_rows, r->fp4_ws, r->prefill_ws, r->draw_logits};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    void *host[] = {r->h_ids, r->h_pos, r->h_logit_rows, r->h_seqs, r->h_tables, r->h_tokens, r->h_logprobs,
                    r->h_sample_rows};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) cudaFreeHost(host[i]);
    free(r->h_q);
    free(r->h_k);
    free(r->h_v);
    fr_cuda_rope_table_free(&r->rope_cos, &r->rope_sin);
    cudaFree(r->fixed_ws);
    fr_gemm_destroy(&r->gemm);
    fr_moe_gpu_destroy(&r->moe);
    fr_mla_gpu_destroy(&r->mla);
    fr_sampler_gpu_destroy(&r->sampler);
    fr_kv_store_gpu_destroy(&r->store);
    if (r->stream) cudaStreamDestroy(r->stream);
    free(r);
    *pr = NULL;
}

fr_status fr_runner_cuda_set_observer(fr_runner_cuda *r, const fr_forward_observer *obs)
{
    if (obs && obs->decode_query)
        return fr_fail(FR_EUNSUPPORTED, "CUDA runner: the decode_query tap exists on the CPU backend only "
                                        "(use layer_q and layer_kv)");
    if (obs && (obs->layer_kv || obs->layer_q) && !r->h_q) {
        const fr_model_config *c = &r->w->cfg;
        const size_t M = (size_t)r->max_tokens, qd = (size_t)c->num_heads * c->head_dim,
                     kvd = (size_t)c->num_kv_heads * c->head_dim;
        r->h_q = malloc(sizeof(float) * M * qd);
        r->h_k = malloc(sizeof(float) * M * kvd);
        r->h_v = malloc(sizeof(float) * M * kvd);
        if (!r->h_q || !r->h_k || !r->h_v) {
            free(r->h_q); free(r->h_k); free(r->h_v);
            r->h_q = r->h_k = r->h_v = NULL;
            return fr_fail(FR_ENOMEM, "CUDA runner: out of host memory for the observer's buffers");
        }
    }
    if (obs) r->obs = *obs;
    else memset(&r->obs, 0, sizeof r->obs);
    return FR_OK;
}

const float *fr_runner_cuda_decode_logits(const fr_runner_cuda *r) { return r ? r->logits : NULL; }
const int *fr_runner_cuda_decode_tokens(const fr_runner_cuda *r) { return r ? r->tokens_out : NULL; }
cudaStream_t fr_runner_cuda_stream(const fr_runner_cuda *r) { return r ? r->stream : 0; }

int fr_runner_cuda_rider_first_row(const fr_runner_cuda *r) { return r ? r->rider_row0 : 0; }

void fr_runner_cuda_capture_stats(const fr_runner_cuda *r, int *captures, double *seconds)
{
    *captures = r ? r->captures : 0;
    *seconds = r ? r->capture_s : 0.0;
}

fr_status fr_runner_cuda_memory(fr_runner_cuda *r, int release)
{
    if (!r) return fr_fail(FR_EINVAL, "CUDA runner: NULL runner");
    if (r->launched) return fr_fail(FR_EINVAL, "CUDA runner: memory released while a decode is in flight");
    rcuda_drop_graphs(r);   /* they hold the pages' and the weights' addresses */
    return release ? fr_kv_store_gpu_release(r->store) : fr_kv_store_gpu_restore(r->store);
}

void rcuda_drop_graphs(fr_runner_cuda *r)
{
    for (int b = 0; b < FR_CUDA_GRAPH_BUCKETS; b++) {
        if (r->graphs[b]) cudaGraphExecDestroy(r->graphs[b]);
        r->graphs[b] = NULL;
        r->graph_rows[b] = 0;
        for (int b2 = 0; b2 < FR_CUDA_GRAPH_BUCKETS; b2++) {
            if (r->rgraphs[b][b2]) cudaGraphExecDestroy(r->rgraphs[b][b2]);
            r->rgraphs[b][b2] = NULL;
            r->rgraph_rider[b][b2] = 0;
        }
    }
}

fr_status fr_runner_cuda_set_deterministic(fr_runner_cuda *r, int on)
{
    if (!r) return fr_fail(FR_EINVAL, "CUDA runner: NULL runner");
    on = on != 0;
    if (on == r->deterministic) return FR_OK;
    if (r->launched) return fr_fail(FR_EINVAL, "CUDA runner: deterministic mode changed while a decode is in flight");
    if (on && r->mla)
        return fr_fail(FR_EUNSUPPORTED, "deterministic mode on the GPU is not built for multi-head latent attention "
                                        "models (its attention has no batch-invariant path yet): use --backend cpu, "
                                        "or leave --deterministic off");
    if (on && r->nccl)
        return fr_fail(FR_EUNSUPPORTED, "deterministic mode on the GPU runs with one GPU per engine (--tp 1): NCCL's "
                                        "all-reduce order depends on the message size (docs/determinism.md)");
    const fr_model_config *c = &r->w->cfg;
    /* cuBLASLt with pinned algorithms: as fast as the heuristic and
     * row-invariant in every shape tests/gpu/test_determinism_gpu.c checks;
     * FR_DETERMINISTIC_GEMM=fixed picks the project's fixed-order kernel,
     * invariant by construction (bench/RESULTS.md measures both). */
    const char *env = getenv("FR_DETERMINISTIC_GEMM");
    const fr_gemm_mode det_gemm = env && strcmp(env, "fixed") == 0 ? FR_GEMM_FIXED : FR_GEMM_PINNED;
    fr_status st = fr_gemm_set_mode(r->gemm, on ? det_gemm : FR_GEMM_FAST);
    if (!st && on && !r->quantized_kv && !r->fixed_ws) {
        /* rows per launch within 64 MiB of split partials; more run in turns */
        size_t one = 0;
        st = fr_attn_fixed_workspace_bytes(c->num_heads, c->head_dim, c->max_position, 1, &one);
        const size_t fit = one ? ((size_t)64 << 20) / one : 1;
        const int rows = fit < 1 ? 1 : fit < (size_t)r->max_tokens ? (int)fit : r->max_tokens;
        if (!st) st = fr_attn_fixed_workspace_bytes(c->num_heads, c->head_dim, c->max_position, rows, &r->fixed_ws_bytes);
        DEV_ALLOC(r->fixed_ws, r->fixed_ws_bytes);
    }
    if (!st && r->quantized_kv) {
        fr_attn_fp4_config cfg = r->fp4;
        cfg.fixed_splits = on ? FR_ATTN_FP4_DETERMINISTIC_SPLITS : 0;
        size_t need = 0;
        st = fr_attn_fp4_workspace_bytes(&cfg, r->max_seqs, c->num_heads, c->num_kv_heads, c->max_position, &need);
        if (!st && need > r->fp4_ws_bytes) {
            void *ws = NULL;
            if (cudaMalloc(&ws, need) != cudaSuccess)
                st = fr_fail(FR_ENOMEM, "CUDA runner: cannot allocate the %zu-byte attention workspace of "
                             "deterministic mode", need);
            else {
                cudaFree(r->fp4_ws);
                r->fp4_ws = ws;
                r->fp4_ws_bytes = need;
            }
        }
        if (!st) r->fp4 = cfg;
    }
    if (st) {
        fr_gemm_set_mode(r->gemm, r->deterministic ? det_gemm : FR_GEMM_FAST);
        return st;
    }
    rcuda_drop_graphs(r);
    r->deterministic = on;
    return FR_OK;
}

fr_status fr_runner_cuda_set_key_mean(fr_runner_cuda *r, const float *key_mean)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_cuda_set_key_mean: no runner");
    if (cudaStreamSynchronize(r->stream) != cudaSuccess)
        return fr_fail(FR_EIO, "CUDA runner: a step failed before the key mean changed: %s",
                       cudaGetErrorString(cudaGetLastError()));
    return fr_kv_store_gpu_set_key_mean(r->store, key_mean);
}

fr_status fr_runner_cuda_fork(fr_runner_cuda *r, int src_seq, int dst_seq)
{
    return fr_kv_store_gpu_copy_slot(r->store, src_seq, dst_seq, r->stream);
}

const fr_model_config *fr_runner_cuda_config(const fr_runner_cuda *r) { return &r->w->cfg; }

fr_status fr_runner_cuda_routes(fr_runner_cuda *r, const int *rows, int n, uint16_t *out)
{
    if (!r->moe) return fr_fail(FR_EINVAL, "routed experts: the model has no mixture-of-experts layer");
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= r->route_rows)
            return fr_fail(FR_EINVAL, "routed experts: token row %d is not in the last step's %d", rows[i],
                           r->route_rows);
    return fr_moe_gpu_routes(r->moe, rows, n, out, r->stream);
}

fr_status fr_runner_cuda_moe_usage(fr_runner_cuda *r, int *active_per_layer, int *last_layer_counts)
{
    if (!r->moe) return fr_fail(FR_EINVAL, "CUDA runner: the model has no experts");
    fr_status st = active_per_layer ? fr_moe_gpu_active(r->moe, active_per_layer, r->stream) : FR_OK;
    if (!st && last_layer_counts) st = fr_moe_gpu_counts(r->moe, last_layer_counts, r->stream);
    return st;
}
