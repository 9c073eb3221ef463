/* What the files of the CUDA runner share (rollout/model/runner_cuda.h): the
 * runner's state and the functions one file calls in another. Private to
 * runner_cuda.c (creation, modes, accessors), runner_forward_cuda.c (the
 * forward pass, eager steps) and runner_decode_cuda.c (decode graphs,
 * launch and wait, riders); built only with CUDA. Functions here take the
 * rcuda_ prefix: they are visible to the whole library. */
#ifndef FR_RUNNER_CUDA_INTERNAL_H
#define FR_RUNNER_CUDA_INTERNAL_H

#include "rollout/model/runner_cuda.h"

#include "attention/attn_fp4.h"
#include "comm/nccl_group.h"
#include "kvcache/kv_store_cuda.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/mla_cuda.h"
#include "rollout/model/moe_cuda.h"
#include "rollout/model/sampler_cuda.h"

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
    int route_rows;             /* token rows of the last step whose routed experts can be read */
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

/* The shared checks and block reservation (fr_step_admit), within the
 * runner's sequence bound. */
fr_status rcuda_admit(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *M_out);
/* Fills the pinned step metadata and sends it on the stream (no sync): token
 * ids, positions, the fr_paged_seq of each sequence and its block table, and
 * the rows whose logits are wanted. With pad_to > n_seqs (a graph's batch
 * bucket), the missing sequences get no tokens (n_new 0: attention and the
 * cache skip them) and one dummy row each, whose logits are computed and
 * ignored. *n_logits receives the number of logit rows. */
fr_status rcuda_upload_metadata(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int pad_to, int M,
                                int *n_logits);
/* The device work of a decode step over `rows` rows (one per sequence,
 * padding included), from the embedding to the sampled tokens: what a
 * decode graph holds. */
fr_status rcuda_enqueue_decode(fr_runner_cuda *r, int rows);
/* Drops the captured decode graphs: they hold the kernels of the mode they
 * were captured in, and the workspaces they were captured with. */
void rcuda_drop_graphs(fr_runner_cuda *r);

#endif
