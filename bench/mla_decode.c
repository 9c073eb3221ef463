/* The latent (MLA) decode kernel (attention/attn_mla.h) at DeepSeek-V3's
 * attention shape: every latent dtype against the BF16 latent kernel, with
 * the bytes it must move and the ratios to the measured copy bandwidth and
 * to the tensor-core work.
 *
 * usage: build/bench/mla_decode [--heads H] [--latent 512] [--ctx 32768,131072]
 *                               [--batch 1,16,64] [--dtypes bf16,fp8,nvfp4,mxfp4] [--iters N]
 *                               [--compute bf16|exact] [--no-rotate]
 *
 * Per configuration: a pool of pages filled with one valid byte pattern,
 * every sequence ctx - 1 cached tokens plus its step token, a CUDA graph of
 * N kernel calls replayed after a warm-up; the time is the replay's mean.
 * Bytes per step: every cached token's latent page row once (d_c and d_r
 * parts in the dtype's format), the slots' BF16 rows and the queries and
 * outputs; two groups of 64 heads read each page, the second from L2 when
 * they run close in time, so the bytes count it once. FLOPs: the scores
 * (2 H (d_c + d_r) per token, plus 2 H d_c for the dual FP4 query's second
 * term, --compute exact) and the context (2 H d_c per token) on BF16 tensor
 * cores. FP4 runs in bf16 compute unless --compute exact. --no-rotate runs
 * FP4 latents without the kernel's Hadamard and mean steps (the query's
 * rotation before the scores, the context's back after the combine): the
 * kernel's share of a rotation folded into W_UK and W_UV at load. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "attention/attn_mla.h"
#include "attention/kv_numerics.h"
#include "bench/bench_util.h"
#include "bench/copy_bandwidth.h"
#include "bench/graph_time.h"
#include "kvcache/page_layout.h"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "mla_decode: %s: %s\n", #x, cudaGetErrorString(e_));                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct {
    int heads, dc, dr, iters;
    int exact;   /* FP4 exact compute (dual FP4 query) instead of bf16 compute (CUDA's default) */
    int no_rotate;   /* FP4 without the in-kernel rotation and mean */
    double copy_bw;
} bench_cfg;

/* One fr_attn_mla call's arguments, for the timed graph. */
typedef struct {
    const fr_attn_mla_config *cfg;
    const fr_latent_kv *kv;
    const fr_paged_seq *seqs;
    int batch, ctx;
    const float *q;
    uint16_t *out;
    void *ws;
    size_t ws_bytes;
} mla_call;

static void enqueue_mla(void *user, cudaStream_t st)
{
    const mla_call *c = (const mla_call *)user;
    fr_attn_mla(c->cfg, c->kv, c->seqs, c->batch, 1, c->ctx, c->q, c->out, c->ws, c->ws_bytes, st);
}

/* Time of one decode step (ms), or a negative number when it cannot run. */
static double time_step(const bench_cfg *b, fr_kv_dtype dt, int batch, int ctx, double *bytes, double *flops)
{
    const int T = FR_PAGE_TOKENS, row = b->dc + b->dr, len = ctx - 1, pages = len / T, rest = len - pages * T;
    const fr_page_layout lay = fr_page_layout_latent(dt, b->dc, b->dr);
    const size_t page_bytes = lay.head_page_bytes, pool_bytes = page_bytes * (size_t)pages * batch;
    const int fp4 = fr_kv_dtype_is_fp4(dt);
    fr_attn_mla_config cfg = {.dtype = dt, .n_heads = b->heads, .latent_dim = b->dc, .rope_dim = b->dr,
                              .scale = 1.0f / 13.856406f, .rotate = fp4 && !b->no_rotate, .sink_recent = fp4,
                              .q_mode = fp4 && b->exact ? FR_Q_DUAL : FR_Q_UNQUANTIZED, .q_search = 1,
                              .q_bf16 = fp4 && !b->exact, .fp8_scale = 1.0f};
    uint8_t *pool = NULL;
    uint16_t *recent = NULL, *sink = NULL, *step = NULL, *out = NULL;
    float *q = NULL, *mean = NULL;
    int *tables = NULL;
    fr_paged_seq *seqs = NULL;
    void *ws = NULL;
    size_t ws_bytes = 0;
    if (cudaMalloc((void **)&pool, pool_bytes ? pool_bytes : 16) != cudaSuccess) {
        cudaGetLastError();
        return -1.0;
    }
    CK(cudaMemset(pool, 0x38, pool_bytes));   /* BF16 4.4e-5, E2M1 codes with E4M3 scale 1, E4M3 1 */
    CK(cudaMalloc((void **)&recent, sizeof(uint16_t) * (size_t)batch * T * row));
    CK(cudaMalloc((void **)&sink, sizeof(uint16_t) * (size_t)batch * 16 * row));
    CK(cudaMalloc((void **)&step, sizeof(uint16_t) * (size_t)batch * row));
    CK(cudaMemset(recent, 0x38, sizeof(uint16_t) * (size_t)batch * T * row));
    CK(cudaMemset(sink, 0x38, sizeof(uint16_t) * (size_t)batch * 16 * row));
    CK(cudaMemset(step, 0x38, sizeof(uint16_t) * (size_t)batch * row));
    CK(cudaMalloc((void **)&q, sizeof(float) * (size_t)batch * b->heads * row));
    CK(cudaMalloc((void **)&out, sizeof(uint16_t) * (size_t)batch * b->heads * b->dc));
    CK(cudaMalloc((void **)&mean, sizeof(float) * b->dc));
    CK(cudaMemset(mean, 0, sizeof(float) * b->dc));
    cfg.mean = fp4 && !b->no_rotate ? mean : NULL;
    float *hq = malloc(sizeof(float) * (size_t)batch * b->heads * row);
    for (size_t i = 0; i < (size_t)batch * b->heads * row; i++) hq[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    CK(cudaMemcpy(q, hq, sizeof(float) * (size_t)batch * b->heads * row, cudaMemcpyHostToDevice));
    free(hq);
    int *ht = malloc(sizeof(int) * (size_t)(pages ? pages : 1) * batch);
    for (int i = 0; i < pages * batch; i++) ht[i] = i;
    CK(cudaMalloc((void **)&tables, sizeof(int) * (size_t)(pages ? pages : 1) * batch));
    CK(cudaMemcpy(tables, ht, sizeof(int) * (size_t)pages * batch, cudaMemcpyHostToDevice));
    free(ht);
    fr_paged_seq *hs = malloc(sizeof(fr_paged_seq) * batch);
    for (int s = 0; s < batch; s++)
        hs[s] = (fr_paged_seq){.block_table = tables + (size_t)s * pages, .len = len, .n_new = 1, .q_row = s, .slot = s};
    CK(cudaMalloc((void **)&seqs, sizeof(fr_paged_seq) * batch));
    CK(cudaMemcpy(seqs, hs, sizeof(fr_paged_seq) * batch, cudaMemcpyHostToDevice));
    free(hs);
    const fr_latent_kv kv = {.pool = pool, .block_bytes = page_bytes, .page_bytes = page_bytes, .codes = lay.k_codes,
                             .scales = lay.k_scales, .rope = lay.rope, .recent = recent, .sink = sink,
                             .slot_elems = (size_t)T * row, .sink_elems = (size_t)16 * row, .step_rows = step,
                             .layer = 0};
    if (fr_attn_mla_workspace_bytes(&cfg, batch, 1, ctx, &ws_bytes)) {
        fprintf(stderr, "mla_decode: %s\n", fr_last_error());
        exit(1);
    }
    if (ws_bytes) CK(cudaMalloc(&ws, ws_bytes));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    fr_attn_mla_plan plan;
    fr_attn_mla_plan_for(&cfg, batch, 1, ctx, ws_bytes, &plan);
    for (int w = 0; w < 3; w++)
        if (fr_attn_mla(&cfg, &kv, seqs, batch, 1, ctx, q, out, ws, ws_bytes, st)) {
            fprintf(stderr, "mla_decode: %s\n", fr_last_error());
            exit(1);
        }
    mla_call call = {&cfg, &kv, seqs, batch, ctx, q, out, ws, ws_bytes};
    const double ms = fr_bench_graph_ms(enqueue_mla, &call, b->iters, st);
    CK(cudaGetLastError());
    const double paged = (double)pages * T * (page_bytes / T), unpaged = (double)(rest + (fp4 ? 16 : 0) + 1) * row * 2;
    *bytes = batch * (paged + unpaged + (double)b->heads * row * 4 + (double)b->heads * b->dc * 2);
    *flops = (double)batch * ctx * b->heads * 2.0 * (row + b->dc + (fp4 && b->exact ? b->dc : 0));
    cudaStreamDestroy(st);
    cudaFree(pool); cudaFree(recent); cudaFree(sink); cudaFree(step); cudaFree(q); cudaFree(out); cudaFree(mean);
    cudaFree(tables); cudaFree(seqs); cudaFree(ws);
    printf("    (%s batch %d ctx %d: %d splits)\n", fr_kv_dtype_name(dt), batch, ctx, plan.n_splits);
    return ms;
}

int main(int argc, char **argv)
{
    bench_cfg b = {.heads = 128, .dc = 512, .dr = 64, .iters = 20};
    int ctxs[8] = {32768, 131072}, n_ctx = 2, batches[8] = {1, 16, 64}, n_batch = 3;
    const char *dtypes = "bf16,fp8,nvfp4,mxfp4";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: mla_decode [--heads H] [--latent D] [--ctx LIST] [--batch LIST] [--dtypes LIST] [--iters N]\n"
                   "                  [--compute bf16|exact] [--no-rotate]\n"
                   "The latent decode kernel at DeepSeek-V3's attention shape (128 heads, d_c 512, d_r 64):\n"
                   "time per step, bytes moved, ratio to the copy bandwidth and to the BF16 latent kernel.\n");
            return 0;
        }
        if (!strcmp(argv[i], "--no-rotate")) {
            b.no_rotate = 1;
            continue;
        }
        if (i + 1 >= argc) { fprintf(stderr, "mla_decode: %s needs a value (see --help)\n", argv[i]); return 2; }
        if (!strcmp(argv[i], "--heads")) b.heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--latent")) b.dc = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ctx")) n_ctx = fr_bench_int_list(argv[++i], ctxs, 8);
        else if (!strcmp(argv[i], "--batch")) n_batch = fr_bench_int_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--dtypes")) dtypes = argv[++i];
        else if (!strcmp(argv[i], "--iters")) b.iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--compute")) b.exact = !strcmp(argv[++i], "exact");
        else { fprintf(stderr, "mla_decode: unknown option %s (see --help)\n", argv[i]); return 2; }
    }
    b.copy_bw = fr_bench_copy_bandwidth((size_t)1 << 30, 0);
    printf("copy bandwidth %.0f GB/s; heads %d, d_c %d, d_r %d; FP4 %s compute\n\n", b.copy_bw / 1e9, b.heads, b.dc, b.dr,
           b.exact ? "exact (dual FP4 query)" : "bf16");
    if (b.no_rotate) printf("FP4 latents without the kernel's rotation and mean (--no-rotate)\n\n");
    printf("| dtype | batch | context | ms/step | bytes/token | GB moved | GB/s | of copy bw | TFLOP/s | vs bf16 |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (int ci = 0; ci < n_ctx; ci++)
        for (int bi = 0; bi < n_batch; bi++) {
            double bf16_ms = 0.0;
            char list[64];
            snprintf(list, sizeof list, "%s", dtypes);
            for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
                fr_kv_dtype dt;
                if (fr_kv_dtype_parse(tok, &dt)) { fprintf(stderr, "mla_decode: %s\n", fr_last_error()); return 2; }
                double bytes = 0, flops = 0;
                const double ms = time_step(&b, dt, batches[bi], ctxs[ci], &bytes, &flops);
                if (ms < 0) {
                    printf("| %s | %d | %d | does not fit | | | | | | |\n", tok, batches[bi], ctxs[ci]);
                    continue;
                }
                if (dt == FR_KV_BF16) bf16_ms = ms;
                const fr_page_layout lay = fr_page_layout_latent(dt, b.dc, b.dr);
                const double gbs = bytes / (ms * 1e-3) / 1e9;
                char vs[32] = "";
                if (bf16_ms > 0) snprintf(vs, sizeof vs, "%.2fx", bf16_ms / ms);
                printf("| %s | %d | %d | %.3f | %zu | %.2f | %.0f | %.2f | %.0f | %s |\n", tok, batches[bi], ctxs[ci], ms,
                       lay.head_page_bytes / FR_PAGE_TOKENS, bytes / 1e9, gbs, gbs * 1e9 / b.copy_bw,
                       flops / (ms * 1e-3) / 1e12, vs);
                fflush(stdout);
            }
        }
    return 0;
}
