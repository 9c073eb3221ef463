#include "rollout/model/runner_cuda.h"

#include <stdlib.h>
#include <string.h>

#include "attention/attn_bf16.h"
#include "attention/attn_fixed.h"
#include "attention/attn_fp4.h"
#include "attention/cuda_check.h"
#include "base/clock.h"
#include "kvcache/kv_store_cuda.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/mla_cuda.h"
#include "rollout/model/moe_cuda.h"
#include "rollout/model/ops_cuda.h"
#include "rollout/model/sampler_cuda.h"
#include "comm/nccl_group.h"

enum { T = FR_PAGE_TOKENS };

struct fr_runner_cuda {
    const fr_weights_gpu *w;
    fr_kv_cache *book;
    fr_kv_store_gpu *store;
    fr_gemm *gemm;
    fr_moe_gpu *moe;            /* expert scratch; NULL for a dense model */
    fr_mla_gpu *mla;            /* latent attention (DeepSeek-V3); NULL for Qwen3 attention */
    fr_sampler_gpu *sampler;
    cudaStream_t stream;
    /* Decode graphs, one per batch bucket (powers of two up to max_seqs). */
    cudaGraphExec_t graphs[FR_CUDA_GRAPH_BUCKETS];
    int graph_rows[FR_CUDA_GRAPH_BUCKETS];
    int use_graphs;
    int max_tokens, max_seqs, max_pages;
    int step_tokens;            /* rows of the residual stream in the step under way */
    int launched;               /* sequences of a decode launched and not yet waited for */
    /* A rider: another runner's decode carried in this one's batch (the
     * BF16-KV shadow of monitored samples): its rows follow ours in every
     * matrix product, and only attention and the cache are its own. */
    struct fr_runner_cuda *rider;
    const fr_step_seq *rider_seqs;
    int rider_n, rider_rows, rider_row0;  /* its sequences, padded rows, first row in our batch */
    int riding;                 /* rider rows in the forward being enqueued (0 but in a carrying decode) */
    int fill_only;              /* the step under way only writes keys and values (fr_runner_cuda_fill) */
    cudaGraphExec_t rgraphs[FR_CUDA_GRAPH_BUCKETS][FR_CUDA_GRAPH_BUCKETS];
    unsigned long long rgraph_rider[FR_CUDA_GRAPH_BUCKETS][FR_CUDA_GRAPH_BUCKETS];
    unsigned long long id;      /* unique per runner: a carrying graph names the rider it was captured with */
    cudaEvent_t rider_ready;
    /* The rider's own launches (cache staging, BF16 attention, commit) run
     * on a side stream beside ours when our cache is FP4/FP8 (rider_side):
     * forked after each layer's rotary embedding, joined before o_proj, and
     * its commits joined at the end of the decode. Made on first carry. */
    cudaStream_t side;
    cudaEvent_t side_fork, side_join;
    /* FR_RIDER_MIN_ROWS: a rider's rows padded to at least this many (then
     * to a power of two), to measure whether the matrix products of
     * 64 + 4 rows take slower kernels than a rounder count; 0 by default. */
    int rider_min_rows;
    int side_off;               /* FR_RIDER_SIDE=0: the rider's launches stay on our stream (for comparing) */
    int captures;               /* decode graphs captured, and the seconds their first uses took */
    double capture_s;
    /* device buffers */
    float *x, *q, *k, *v, *gu, *logits;
    float *draw_logits;         /* [max_seqs][vocab]: rows gathered for sampling in a step (made on first use) */
    int logit_cap;              /* rows of the logits buffer; the LM head runs in slices of it */
    uint16_t *xn, *att, *h, *step_k, *step_v;
    int *ids, *pos, *tables, *logit_rows, *tokens_out;
    float *logprobs_out;
    fr_sample_row *sample_rows;
    fr_paged_seq *seqs;
    float *rope_cos, *rope_sin;
    void *attn_ws;
    size_t attn_ws_bytes;
    /* FP4/FP8 caches: their decode and prefill kernels, with workspaces. */
    int quantized_kv;
    fr_attn_fp4_config fp4;
    void *fp4_ws, *prefill_ws;
    size_t fp4_ws_bytes, prefill_ws_bytes;
    /* Deterministic mode (fr_runner_cuda_set_deterministic): fixed-order
     * GEMMs, and with a BF16 cache one attention path for every token. */
    int deterministic;
    void *fixed_ws;
    size_t fixed_ws_bytes;
    /* pinned host mirrors of the step metadata */
    int *h_ids, *h_pos, *h_tables, *h_logit_rows, *h_tokens;
    float *h_logprobs;
    fr_sample_row *h_sample_rows;
    fr_paged_seq *h_seqs;
    /* Forward taps (fr_runner_cuda_set_observer): host copies of a layer's
     * post-RoPE q, k, v, made in fr_runner_cuda_step only. */
    fr_forward_observer obs;
    float *h_q, *h_k, *h_v;
    /* Tensor parallelism (w->tp_size > 1): the engine's NCCL group, the
     * row-parallel partial sums before their all-reduce, and the LM head's
     * vocabulary slice of every rank ([tp][logit_cap][vocab / tp]). */
    fr_nccl_group *nccl;
    float *partial, *logits_local, *logits_all;
    int vocab;                  /* the whole vocabulary (logits rows, sampling, ids) */
    const fr_step_seq *obs_seqs;   /* the step being observed, NULL otherwise */
    int obs_n_seqs;
};

int fr_cuda_available(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

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
    DEV_ALLOC(r->gu, (size_t)M * 2 * I);
    DEV_ALLOC(r->h, (size_t)M * I);
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
    if (!st && !mla) st = fr_cuda_rope_table_new(c->max_position, d, c->rope_theta, &r->rope_cos, &r->rope_sin);
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

/* The shared checks and block reservation (fr_step_admit), within the
 * runner's sequence bound. */
static fr_status admit(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *M_out)
{
    const fr_model_config *c = &r->w->cfg;
    if (n_seqs < 1 || n_seqs > r->max_seqs)
        return fr_fail(FR_EINVAL, "step: %d sequences (1..%d allowed)", n_seqs, r->max_seqs);
    return fr_step_admit(r->book, seqs, n_seqs, r->vocab, c->max_position, r->max_tokens, M_out);
}

/* Fills the pinned step metadata and sends it on the stream (no sync): token
 * ids, positions, the fr_paged_seq of each sequence and its block table, and
 * the rows whose logits are wanted. With pad_to > n_seqs (a graph's batch
 * bucket), the missing sequences get no tokens (n_new 0: attention and the
 * cache skip them) and one dummy row each, whose logits are computed and
 * ignored. Returns the number of logit rows. */
static fr_status upload_metadata(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int pad_to, int M,
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
 * experts (rollout/model/moe_cuda.h). */
static fr_status mlp(fr_runner_cuda *r, const fr_layer_weights_gpu *lw, int l, int M)
{
    const fr_model_config *c = &r->w->cfg;
    const int D = c->hidden_size, I = c->intermediate_size;
    fr_status st;
    if (lw->router) {
        if (!r->nccl) return fr_moe_gpu_forward(r->moe, r->gemm, lw, l, r->xn, M, r->x, 1, r->stream);
        st = fr_moe_gpu_forward(r->moe, r->gemm, lw, l, r->xn, M, r->partial, 0, r->stream);
        return st ? st : residual_allreduce(r, M);
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

static void drop_graphs(fr_runner_cuda *r);

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
    if (!st && grew) drop_graphs(r);   /* they hold the old workspace */
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
    fr_status st = admit(r, seqs, n_seqs, &M);
    for (int s = 0; s < n_seqs; s++) max_new = seqs[s].n > max_new ? seqs[s].n : max_new;
    if (!st) st = upload_metadata(r, seqs, n_seqs, 0, M, n_logits);
    if (!st) st = fr_cuda_embed(r->x, r->w->embed, r->ids, M, D, V, r->stream);
    if (r->obs.layer_kv || r->obs.layer_q) {
        r->obs_seqs = seqs;
        r->obs_n_seqs = n_seqs;
    }
    for (int l = 0; l < c->num_layers && !st; l++) st = layer_forward(r, l, M, n_seqs, max_new);
    r->obs_seqs = NULL;
    r->step_tokens = M;
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
static fr_status enqueue_decode(fr_runner_cuda *r, int rows)
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

/* The smallest bucket (a power of two, capped at max_seqs) holding n rows. */
static int bucket_of(const fr_runner_cuda *r, int n, int *rows)
{
    int b = 0, size = 1;
    while (size < n) size *= 2, b++;
    *rows = size < r->max_seqs ? size : r->max_seqs;
    return b;
}

fr_status fr_runner_cuda_decode(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                int n_seqs, int *tokens, float *logprobs)
{
    return fr_runner_cuda_decode_keep(r, seqs, params, n_seqs, tokens, logprobs, NULL, 0, NULL);
}

/* Enqueues the decode of `rows` rows (and r->riding rows of rider rd, when
 * carrying one) by replaying its graph, capturing it on first use. A
 * carrying decode's graph is kept per pair of buckets and names the rider it
 * was captured with (its cache and buffers are in the graph). */
static fr_status run_decode(fr_runner_cuda *r, int rows, int b, int b2, const fr_runner_cuda *rd)
{
    if (!r->use_graphs) return enqueue_decode(r, rows);
    cudaGraphExec_t *slot = rd ? &r->rgraphs[b][b2] : &r->graphs[b];
    const int fresh = *slot && (rd ? r->rgraph_rider[b][b2] == rd->id : r->graph_rows[b] == rows);
    if (fresh) {
        FR_CUDA_TRY(cudaGraphLaunch(*slot, r->stream));
        return FR_OK;
    }
    /* First use: run it directly (which also prepares the matrix-product
     * plans and kernel attributes a capture must not create), then capture
     * the same launches for the next steps. */
    const double t0 = fr_now_s();
    r->captures++;
    fr_status st = enqueue_decode(r, rows);
    if (st) return st;
    FR_CUDA_TRY(cudaStreamSynchronize(r->stream));
    FR_CUDA_TRY(cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t g = NULL;
    fr_status cap = enqueue_decode(r, rows);
    cudaError_t e = cudaStreamEndCapture(r->stream, &g);
    if (cap) st = cap;
    else if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "decode graph capture failed: %s", cudaGetErrorString(e));
    if (!st) {
        if (*slot) cudaGraphExecDestroy(*slot);
        *slot = NULL;
        if (cudaGraphInstantiate(slot, g, 0) != cudaSuccess) {
            *slot = NULL;
            st = fr_fail(FR_EINTERNAL, "decode graph instantiation failed: %s", cudaGetErrorString(cudaGetLastError()));
        } else if (rd) {
            r->rgraph_rider[b][b2] = rd->id;
        } else {
            r->graph_rows[b] = rows;
        }
    }
    if (g) cudaGraphDestroy(g);
    r->capture_s += fr_now_s() - t0;
    return st;
}

/* The rider's metadata, sent on its stream, then its token ids and
 * positions placed after our rows and its rows added to the logit rows, on
 * ours: what a carrying decode reads besides our own metadata. */
static fr_status upload_rider(fr_runner_cuda *r, int rows, fr_runner_cuda *rd, const fr_step_seq *rseqs, int n_r,
                              int r_rows)
{
    int Mr = 0, n_logits = 0;
    fr_status st = admit(rd, rseqs, n_r, &Mr);
    if (!st) st = upload_metadata(rd, rseqs, n_r, r_rows, Mr, &n_logits);
    if (st) return st;
    if (!r->rider_ready && cudaEventCreateWithFlags(&r->rider_ready, cudaEventDisableTiming) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "decode: cannot create an event");
    FR_CUDA_TRY(cudaEventRecord(r->rider_ready, rd->stream));
    FR_CUDA_TRY(cudaStreamWaitEvent(r->stream, r->rider_ready, 0));
    FR_CUDA_TRY(cudaMemcpyAsync(r->ids + rows, rd->ids, sizeof(int) * (size_t)r_rows, cudaMemcpyDeviceToDevice,
                                r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->pos + rows, rd->pos, sizeof(int) * (size_t)r_rows, cudaMemcpyDeviceToDevice,
                                r->stream));
    for (int j = 0; j < r_rows; j++) r->h_logit_rows[rows + j] = rows + j;
    FR_CUDA_TRY(cudaMemcpyAsync(r->logit_rows + rows, r->h_logit_rows + rows, sizeof(int) * (size_t)r_rows,
                                cudaMemcpyHostToDevice, r->stream));
    return FR_OK;
}

/* The side stream and its events, made before the first carrying decode
 * (never inside a capture); without them the rider's launches stay on our
 * stream. */
static void side_stream(fr_runner_cuda *r)
{
    if (cudaStreamCreateWithFlags(&r->side, cudaStreamNonBlocking) == cudaSuccess &&
        cudaEventCreateWithFlags(&r->side_fork, cudaEventDisableTiming) == cudaSuccess &&
        cudaEventCreateWithFlags(&r->side_join, cudaEventDisableTiming) == cudaSuccess)
        return;
    cudaGetLastError();
    if (r->side_fork) cudaEventDestroy(r->side_fork);
    if (r->side) cudaStreamDestroy(r->side);
    r->side = NULL;
    r->side_fork = r->side_join = NULL;
}

static fr_status decode_launch(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params, int n_seqs,
                               fr_runner_cuda *rd, const fr_step_seq *rseqs, int n_r)
{
    const int V = r->vocab;
    if (r->launched) return fr_fail(FR_EINVAL, "decode: the last launch has not been waited for");
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].n != 1) return fr_fail(FR_EINVAL, "decode: sequence %d has %d new tokens, not 1", seqs[s].seq, seqs[s].n);
        fr_status st = fr_sample_row_check(&params[s], V);
        if (st) return st;
    }
    if (r->logit_cap < n_seqs) return fr_fail(FR_EINTERNAL, "decode: logits buffer smaller than the batch");
    int M = 0, rows, n_logits, r_rows = 0, b2 = 0;
    if (rd) {
        int want = n_r;
        if (want < r->rider_min_rows) want = r->rider_min_rows < rd->max_seqs ? r->rider_min_rows : rd->max_seqs;
        b2 = bucket_of(rd, want, &r_rows);
        if (!r->use_graphs) r_rows = n_r;
    }
    int b = bucket_of(r, n_seqs, &rows);
    if (!r->use_graphs) rows = n_seqs;
    if (rd && (rows + r_rows > r->max_tokens || rows + r_rows > r->logit_cap))
        return fr_fail(FR_EINVAL, "decode: %d rows and %d of a rider exceed the step's %d", rows, r_rows,
                       r->max_tokens < r->logit_cap ? r->max_tokens : r->logit_cap);
    fr_status st = admit(r, seqs, n_seqs, &M);
    if (st) return st;
    if ((st = upload_metadata(r, seqs, n_seqs, rows, M, &n_logits))) return st;
    if (rd && (st = upload_rider(r, rows, rd, rseqs, n_r, r_rows))) return st;
    if (rd && r->quantized_kv && !r->side && !r->side_off) side_stream(r);
    r->riding = r_rows;
    r->rider = rd;
    memcpy(r->h_sample_rows, params, sizeof(fr_sample_row) * (size_t)n_seqs);
    for (int s = n_seqs; s < rows; s++)   /* padding rows: greedy, never read */
        r->h_sample_rows[s] = (fr_sample_row){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
    FR_CUDA_TRY(cudaMemcpyAsync(r->sample_rows, r->h_sample_rows, sizeof(fr_sample_row) * (size_t)rows,
                                cudaMemcpyHostToDevice, r->stream));
    st = run_decode(r, rows, b, b2, rd);
    r->riding = 0;
    if (st) {
        r->rider = NULL;
        return st;
    }
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_tokens, r->tokens_out, sizeof(int) * (size_t)n_seqs, cudaMemcpyDeviceToHost,
                                r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_logprobs, r->logprobs_out, sizeof(float) * (size_t)n_seqs,
                                cudaMemcpyDeviceToHost, r->stream));
    r->launched = n_seqs;
    r->rider_seqs = rd ? rseqs : NULL;
    r->rider_n = rd ? n_r : 0;
    r->rider_rows = r_rows;
    r->rider_row0 = rows;
    return FR_OK;
}

fr_status fr_runner_cuda_decode_launch(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                       int n_seqs)
{
    return decode_launch(r, seqs, params, n_seqs, NULL, NULL, 0);
}

fr_status fr_runner_cuda_decode_launch_carrying(fr_runner_cuda *r, const fr_step_seq *seqs,
                                                const fr_sample_row *params, int n_seqs, fr_runner_cuda *rider,
                                                const fr_step_seq *rider_seqs, int n_rider)
{
    if (!rider || rider == r || n_rider < 1 || !rider_seqs)
        return fr_fail(FR_EINVAL, "decode: a rider needs its own runner and at least one sequence");
    if (rider->w != r->w || rider->quantized_kv || r->nccl || !rider->mla != !r->mla)
        return fr_fail(FR_EUNSUPPORTED, "decode: a rider must share the weights, keep a BF16 cache, and run "
                                        "without tensor parallelism");
    if (rider->launched) return fr_fail(FR_EINVAL, "decode: the rider has a decode of its own in flight");
    return decode_launch(r, seqs, params, n_seqs, rider, rider_seqs, n_rider);
}

int fr_runner_cuda_rider_first_row(const fr_runner_cuda *r) { return r ? r->rider_row0 : 0; }

/* A decode's list of rows whose logits go to the host: rows of its batch. */
static fr_status check_keep(const int *keep, int n_keep, const float *kept_logits, int n_seqs)
{
    if (n_keep < 0 || n_keep > n_seqs || (n_keep && (!keep || !kept_logits)))
        return fr_fail(FR_EINVAL, "decode: bad list of rows whose logits to keep");
    for (int i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= n_seqs)
            return fr_fail(FR_EINVAL, "decode: row %d to keep is outside the batch of %d", keep[i], n_seqs);
    return FR_OK;
}

fr_status fr_runner_cuda_decode_wait(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *tokens,
                                     float *logprobs, const int *keep, int n_keep, float *kept_logits)
{
    const int V = r->vocab;
    if (r->launched != n_seqs || n_seqs < 1)
        return fr_fail(FR_EINVAL, "decode: waiting for %d sequences, %d were launched", n_seqs, r->launched);
    r->launched = 0;
    fr_status st = check_keep(keep, n_keep, kept_logits, n_seqs);
    /* Only the rows asked for cross to the host: a full batch of logits is
     * tens of MB per step at a 152k vocabulary. */
    for (int i = 0; i < n_keep && !st; i++) {
        cudaError_t e = cudaMemcpyAsync(kept_logits + (size_t)i * V, r->logits + (size_t)keep[i] * V,
                                        sizeof(float) * (size_t)V, cudaMemcpyDeviceToHost, r->stream);
        if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "decode: %s", cudaGetErrorString(e));
    }
    /* Waits for the stream; the tokens enter the bookkeeping even after a
     * bad keep list, since the device cache holds them now. */
    fr_status chk = fr_kv_store_gpu_check(r->store, r->stream);
    fr_runner_cuda *rd = r->rider;
    const fr_step_seq *rseqs = r->rider_seqs;
    const int n_r = r->rider_n;
    r->rider = NULL;
    r->rider_seqs = NULL;
    r->rider_n = 0;
    if (!chk && rd) chk = fr_kv_store_gpu_check(rd->store, r->stream);
    for (int s = 0; s < n_r && !chk; s++) chk = fr_kv_append(rd->book, rseqs[s].seq, 1, NULL, NULL, 0);
    if (chk) return chk;
    if (tokens && !st) memcpy(tokens, r->h_tokens, sizeof(int) * (size_t)n_seqs);
    if (logprobs && !st) memcpy(logprobs, r->h_logprobs, sizeof(float) * (size_t)n_seqs);
    for (int s = 0; s < n_seqs; s++) {
        fr_status a = fr_kv_append(r->book, seqs[s].seq, 1, NULL, NULL, 0);
        if (a && !st) st = a;
    }
    return st;
}

fr_status fr_runner_cuda_decode_keep(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                     int n_seqs, int *tokens, float *logprobs, const int *keep, int n_keep,
                                     float *kept_logits)
{
    fr_status st = check_keep(keep, n_keep, kept_logits, n_seqs);   /* refused before anything runs */
    if (st || n_seqs == 0) return st;
    st = fr_runner_cuda_decode_launch(r, seqs, params, n_seqs);
    return st ? st : fr_runner_cuda_decode_wait(r, seqs, n_seqs, tokens, logprobs, keep, n_keep, kept_logits);
}

const float *fr_runner_cuda_decode_logits(const fr_runner_cuda *r) { return r ? r->logits : NULL; }
const int *fr_runner_cuda_decode_tokens(const fr_runner_cuda *r) { return r ? r->tokens_out : NULL; }
cudaStream_t fr_runner_cuda_stream(const fr_runner_cuda *r) { return r ? r->stream : 0; }

void fr_runner_cuda_capture_stats(const fr_runner_cuda *r, int *captures, double *seconds)
{
    *captures = r ? r->captures : 0;
    *seconds = r ? r->capture_s : 0.0;
}

/* Drops the captured decode graphs: they hold the kernels of the mode they
 * were captured in. */
static void drop_graphs(fr_runner_cuda *r)
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
    drop_graphs(r);
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

fr_status fr_runner_cuda_moe_usage(fr_runner_cuda *r, int *active_per_layer, int *last_layer_counts)
{
    if (!r->moe) return fr_fail(FR_EINVAL, "CUDA runner: the model has no experts");
    fr_status st = active_per_layer ? fr_moe_gpu_active(r->moe, active_per_layer, r->stream) : FR_OK;
    if (!st && last_layer_counts) st = fr_moe_gpu_counts(r->moe, last_layer_counts, r->stream);
    return st;
}
