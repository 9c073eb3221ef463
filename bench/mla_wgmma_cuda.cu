/* Checks and times the wgmma latent kernel (mla_wgmma.cuh) against the mainline
 * one (attention/attn_mla.h) on the same inputs: random latent pages of every
 * dtype, random slots, step rows, queries and latent mean, decode and a short
 * chunked prefill, with split partials and without. Prints, per case, the largest
 * row error between the two (relative to the row's largest value; both round P and
 * the output to BF16, so only their summation orders differ) and the time of each
 * over CUDA-graph replays, with TFLOP/s and GB/s as bench/mla_decode.c counts them.
 *
 * usage: build/bench/mla_wgmma [--latent 512] [--heads 128,16] [--batch 1,16,64]
 *                             [--ctx 4096,32768] [--dtypes bf16,fp8,nvfp4,mxfp4]
 *                             [--compute bf16|exact] [--iters 20] [--check-only]
 * A step over its own token alone (context 1) comes first: its output is that
 * token's latent whatever the scores, which tells a wrong context product from a
 * wrong scores product. Exit status 1 when any case's error is above 2e-2 or a
 * launch fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "attention/dev/mla_wgmma.cuh"
#include "attention/fp_formats.h"
#include "bench/bench_util.h"
#include "bench/graph_time.h"
#include "kvcache/page_layout.h"

namespace {

using namespace fr_mla;

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "mla_wgmma: %s: %s\n", #x, cudaGetErrorString(e_));              \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* ---- the experimental launch (fr_attn_mla's checks, plan and combine) ---- */

template <int DC, int KIND> cudaError_t launch_wg(const Params &P, int n_seqs, cudaStream_t st)
{
    using W = fr_mla_wg::GeoW<DC, 64, KIND>;
    static bool attr_set = false;
    if (!attr_set) {
        cudaError_t e = cudaFuncSetAttribute(fr_mla_wg::mla_wgmma_kernel<DC, 64, KIND>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, W::SMEM);
        if (e != cudaSuccess) return e;
        attr_set = true;
    }
    fr_mla_wg::mla_wgmma_kernel<DC, 64, KIND><<<dim3(P.n_splits, P.row_groups, n_seqs), kThreads, W::SMEM, st>>>(P);
    if (P.n_splits > 1) {
        const size_t warps = (size_t)n_seqs * P.row_groups * kRows;
        mla_combine<DC, KIND><<<(unsigned)((warps + 7) / 8), kThreads, 0, st>>>(P, n_seqs);
    }
    return cudaGetLastError();
}

template <int DC> cudaError_t launch_wg_dc(int kind, const Params &P, int n_seqs, cudaStream_t st)
{
    switch (kind) {
    case kBF16: return launch_wg<DC, kBF16>(P, n_seqs, st);
    case kFP8: return launch_wg<DC, kFP8>(P, n_seqs, st);
    case kNV: return launch_wg<DC, kNV>(P, n_seqs, st);
    default: return launch_wg<DC, kMX>(P, n_seqs, st);
    }
}

/* fr_attn_mla's contract, on the wgmma kernel (latent widths 256 and 512). */
fr_status attn_mla_wgmma(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs, int n_seqs,
                         int max_new, int max_ctx, const float *q, uint16_t *out, void *ws, size_t ws_bytes,
                         cudaStream_t st)
{
    Params P;
    int kind = 0;
    fr_status s = call_params(cfg, kv, seqs, n_seqs, max_new, max_ctx, q, out, ws, ws_bytes, &P, &kind);
    if (s || n_seqs == 0) return s;
    if (cfg->latent_dim != 512 && cfg->latent_dim != 256)
        return fr_fail(FR_EUNSUPPORTED, "wgmma latent kernel: latent width %d (built for 256 and 512)", cfg->latent_dim);
    const cudaError_t e = cfg->latent_dim == 512 ? launch_wg_dc<512>(kind, P, n_seqs, st)
                                                 : launch_wg_dc<256>(kind, P, n_seqs, st);
    return e == cudaSuccess ? FR_OK : fr_fail(FR_EINTERNAL, "wgmma latent kernel: %s", cudaGetErrorString(e));
}

/* ---- random inputs, made on the device ---- */

__device__ uint32_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

__device__ uint16_t rand_bf16(uint64_t i, float scale)
{
    const float v = scale * ((float)(mix(i) & 0xFFFFFF) / 8388608.0f - 1.0f);
    return (uint16_t)(__float_as_uint(v) >> 16);
}

/* One page region kind per byte range of a page: latents (codes), scales, RoPE. */
struct PageFill {
    uint8_t *pool;
    size_t n_pages, page_bytes, codes, codes_bytes, scales, scales_bytes, rope;
    int kind;
    uint64_t seed;
};

__global__ void fill_pages(PageFill f)
{
    const size_t total = f.n_pages * f.page_bytes;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t off = i % f.page_bytes;
        const uint32_t r = mix(f.seed * 0x9E3779B97F4A7C15ull + i);
        uint8_t b = (uint8_t)r;
        if (off >= f.codes && off < f.codes + f.codes_bytes) {
            if (f.kind == kBF16) {   /* BF16 latents: whole halves */
                const uint16_t h = rand_bf16(f.seed + (i & ~(size_t)1), 1.0f);
                b = (uint8_t)((i & 1) ? h >> 8 : h);
            } else if (f.kind == kFP8 && (b & 0x7F) == 0x7F) {
                b = 0;   /* no E4M3 NaN */
            }
        } else if (off >= f.scales && off < f.scales + f.scales_bytes) {
            b = f.kind == kNV ? (uint8_t)(0x2C + r % 24) : (uint8_t)(124 + r % 7);   /* E4M3 0.375-1.75; 2^-3..2^3 */
        } else if (off >= f.rope) {
            const uint16_t h = rand_bf16(f.seed + (i & ~(size_t)1), 1.0f);
            b = (uint8_t)((i & 1) ? h >> 8 : h);
        }
        f.pool[i] = b;
    }
}

__global__ void fill_bf16(uint16_t *x, size_t n, uint64_t seed, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = rand_bf16(seed * 0x9E3779B97F4A7C15ull + i, scale);
}

__global__ void fill_f32(float *x, size_t n, uint64_t seed, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = scale * ((float)(mix(seed * 0x9E3779B97F4A7C15ull + i) & 0xFFFFFF) / 8388608.0f - 1.0f);
}

/* ---- one case ---- */

struct Opts {
    int dc, iters, exact, check_only;
};

struct Case {
    fr_kv_dtype dt;
    int heads, batch, ctx, n_new;
};

int kind_of_dt(fr_kv_dtype t) { return t == FR_KV_BF16 ? kBF16 : t == FR_KV_FP8 ? kFP8 : t == FR_KV_NVFP4 ? kNV : kMX; }

typedef fr_status (*attn_fn)(const fr_attn_mla_config *, const fr_latent_kv *, const fr_paged_seq *, int, int, int,
                             const float *, uint16_t *, void *, size_t, cudaStream_t);

/* One call's arguments and kernel, for the timed graph. */
struct Call {
    attn_fn f;
    const fr_attn_mla_config *cfg;
    const fr_latent_kv *kv;
    const fr_paged_seq *seqs;
    Case c;
    const float *q;
    uint16_t *out;
    void *ws;
    size_t ws_bytes;
};

void enqueue_call(void *user, cudaStream_t st)
{
    const Call *k = static_cast<const Call *>(user);
    k->f(k->cfg, k->kv, k->seqs, k->c.batch, k->c.n_new, k->c.ctx, k->q, k->out, k->ws, k->ws_bytes, st);
}

double time_calls(attn_fn f, const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs,
                  const Case &c, const float *q, uint16_t *out, void *ws, size_t ws_bytes, int iters, cudaStream_t st)
{
    Call k = {f, cfg, kv, seqs, c, q, out, ws, ws_bytes};
    const double ms = fr_bench_graph_ms(enqueue_call, &k, iters, st);
    CK(cudaGetLastError());
    return ms;
}

/* Runs one case; returns the largest row error (negative: a failure). */
double run_case(const Opts &o, const Case &c, uint64_t seed)
{
    const int T = FR_PAGE_TOKENS, dc = o.dc, dr = 64, row = dc + dr, fp4 = fr_kv_dtype_is_fp4(c.dt);
    const int kind = kind_of_dt(c.dt);
    /* sequence s: ctx - n_new - (s * 37) % 200 cached tokens (partial pages of every
     * length), then its n_new step tokens */
    int *lens = (int *)malloc(sizeof(int) * c.batch);
    int max_pages = 0;
    for (int s = 0; s < c.batch; s++) {
        lens[s] = c.ctx - c.n_new - (s * 37) % 200;
        if (lens[s] < 0) lens[s] = 0;
        if (lens[s] / T > max_pages) max_pages = lens[s] / T;
    }
    const fr_page_layout lay = fr_page_layout_latent(c.dt, dc, dr);
    const size_t page_bytes = lay.head_page_bytes, n_pages = (size_t)(max_pages ? max_pages : 1) * c.batch;
    fr_attn_mla_config cfg = {.dtype = c.dt, .n_heads = c.heads, .latent_dim = dc, .rope_dim = dr,
                              .scale = 1.0f / sqrtf(192.0f), .rotate = fp4, .mean = NULL, .sink_recent = fp4,
                              .q_mode = fp4 && o.exact ? FR_Q_DUAL : FR_Q_UNQUANTIZED, .q_search = 1,
                              .q_bf16 = fp4 && !o.exact, .fp8_scale = 0.05f};
    uint8_t *pool = NULL;
    uint16_t *recent = NULL, *sink = NULL, *step = NULL, *out_a = NULL, *out_b = NULL;
    float *q = NULL, *mean = NULL;
    int *tables = NULL;
    fr_paged_seq *seqs = NULL;
    void *ws = NULL;
    size_t ws_bytes = 0;
    CK(cudaMalloc((void **)&pool, n_pages * page_bytes));
    const size_t bpl = (size_t)T * dc;   /* latent elements of a page */
    PageFill f = {pool, n_pages, page_bytes, lay.k_codes,
                  fp4 ? bpl / 2 : kind == kFP8 ? bpl : bpl * 2, lay.k_scales,
                  fp4 ? bpl / (c.dt == FR_KV_MXFP4 ? 32 : 16) : 0, lay.rope, kind, seed};
    fill_pages<<<1024, 256>>>(f);
    const size_t n_recent = (size_t)c.batch * T * row, n_sink = (size_t)c.batch * 16 * row;
    const size_t n_step = (size_t)c.batch * c.n_new * row, n_q = (size_t)c.batch * c.n_new * c.heads * row;
    const size_t n_out = (size_t)c.batch * c.n_new * c.heads * dc;
    CK(cudaMalloc((void **)&recent, 2 * n_recent));
    CK(cudaMalloc((void **)&sink, 2 * n_sink));
    CK(cudaMalloc((void **)&step, 2 * n_step));
    CK(cudaMalloc((void **)&q, 4 * n_q));
    CK(cudaMalloc((void **)&mean, 4 * (size_t)dc));
    CK(cudaMalloc((void **)&out_a, 2 * n_out));
    CK(cudaMalloc((void **)&out_b, 2 * n_out));
    fill_bf16<<<256, 256>>>(recent, n_recent, seed + 1, 1.0f);
    fill_bf16<<<256, 256>>>(sink, n_sink, seed + 2, 1.0f);
    fill_bf16<<<256, 256>>>(step, n_step, seed + 3, 1.0f);
    fill_f32<<<256, 256>>>(q, n_q, seed + 4, 1.0f);
    fill_f32<<<16, 256>>>(mean, dc, seed + 5, 0.3f);
    CK(cudaGetLastError());
    cfg.mean = fp4 ? mean : NULL;
    int *ht = (int *)malloc(sizeof(int) * n_pages);
    for (size_t i = 0; i < n_pages; i++) ht[i] = (int)((i * 7919) % n_pages);   /* scattered blocks */
    CK(cudaMalloc((void **)&tables, sizeof(int) * n_pages));
    CK(cudaMemcpy(tables, ht, sizeof(int) * n_pages, cudaMemcpyHostToDevice));
    free(ht);
    fr_paged_seq *hs = (fr_paged_seq *)malloc(sizeof(fr_paged_seq) * c.batch);
    for (int s = 0; s < c.batch; s++)
        hs[s] = (fr_paged_seq){.block_table = tables + (size_t)s * (max_pages ? max_pages : 1), .len = lens[s],
                               .n_new = c.n_new, .q_row = s * c.n_new, .slot = s};
    CK(cudaMalloc((void **)&seqs, sizeof(fr_paged_seq) * c.batch));
    CK(cudaMemcpy(seqs, hs, sizeof(fr_paged_seq) * c.batch, cudaMemcpyHostToDevice));
    free(hs);
    free(lens);
    const fr_latent_kv kv = {.pool = pool, .block_bytes = page_bytes, .page_bytes = page_bytes, .codes = lay.k_codes,
                             .scales = lay.k_scales, .rope = lay.rope, .recent = recent, .sink = sink,
                             .slot_elems = (size_t)T * row, .sink_elems = (size_t)16 * row, .step_rows = step,
                             .layer = 0};
    if (fr_attn_mla_workspace_bytes(&cfg, c.batch, c.n_new, c.ctx, &ws_bytes)) {
        fprintf(stderr, "mla_wgmma: %s\n", fr_last_error());
        exit(1);
    }
    if (ws_bytes) CK(cudaMalloc(&ws, ws_bytes));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaDeviceSynchronize());
    double worst = 0.0;
    /* with the workspace (split partials when the plan has them), then without (one
     * split, rows finished in the kernel) */
    for (int pass = 0; pass < 2 && worst >= 0.0; pass++) {
        const size_t wb = pass == 0 ? ws_bytes : 0;
        CK(cudaMemset(out_a, 0xFF, 2 * n_out));
        CK(cudaMemset(out_b, 0xFF, 2 * n_out));
        if (fr_attn_mla(&cfg, &kv, seqs, c.batch, c.n_new, c.ctx, q, out_a, ws, wb, st) ||
            attn_mla_wgmma(&cfg, &kv, seqs, c.batch, c.n_new, c.ctx, q, out_b, ws, wb, st)) {
            fprintf(stderr, "mla_wgmma: %s\n", fr_last_error());
            worst = -1.0;
            break;
        }
        const cudaError_t e = cudaStreamSynchronize(st);
        if (e != cudaSuccess) {
            fprintf(stderr, "mla_wgmma: %s\n", cudaGetErrorString(e));
            exit(1);
        }
        uint16_t *a = (uint16_t *)malloc(2 * n_out), *b = (uint16_t *)malloc(2 * n_out);
        CK(cudaMemcpy(a, out_a, 2 * n_out, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b, out_b, 2 * n_out, cudaMemcpyDeviceToHost));
        for (size_t r = 0; r < n_out / dc; r++) {
            double top = 0.0, d = 0.0;
            for (int j = 0; j < dc; j++) {
                const double x = fr_bf16_decode(a[r * dc + j]), y = fr_bf16_decode(b[r * dc + j]);
                top = fmax(top, fabs(x));
                d = isfinite(y) ? fmax(d, fabs(x - y)) : INFINITY;
            }
            const double rel = top > 0.0 ? d / top : d;
            if (!(rel <= worst)) worst = rel;
        }
        free(a);
        free(b);
    }
    fr_attn_mla_plan plan;
    fr_attn_mla_plan_for(&cfg, c.batch, c.n_new, c.ctx, ws_bytes, &plan);
    double t_main = 0.0, t_wg = 0.0;
    if (!o.check_only && worst >= 0.0) {
        t_main = time_calls(fr_attn_mla, &cfg, &kv, seqs, c, q, out_a, ws, ws_bytes, o.iters, st);
        t_wg = time_calls(attn_mla_wgmma, &cfg, &kv, seqs, c, q, out_b, ws, ws_bytes, o.iters, st);
    }
    /* bench/mla_decode.c's counts: every cached latent row once, the dual query's
     * second content product in exact compute */
    const double tokens = (double)c.batch * c.ctx, row_bytes = (double)page_bytes / T;
    const double bytes = tokens * row_bytes + (double)c.batch * c.n_new * c.heads * (row * 4 + dc * 2);
    const double flops = tokens * c.n_new * c.heads * 2.0 * (row + dc + (fp4 && o.exact ? dc : 0));
    printf("%-6s %4d %5d %7d %3d %6d | %9.4f %9.4f %6.2fx | %7.1f %7.1f TFLOP/s | %7.0f %7.0f GB/s | %.2e\n",
           fr_kv_dtype_name(c.dt), c.heads, c.batch, c.ctx, c.n_new, plan.n_splits, t_main, t_wg,
           t_wg > 0 ? t_main / t_wg : 0.0, t_main > 0 ? flops / t_main * 1e-9 : 0.0,
           t_wg > 0 ? flops / t_wg * 1e-9 : 0.0, t_main > 0 ? bytes / t_main * 1e-6 : 0.0,
           t_wg > 0 ? bytes / t_wg * 1e-6 : 0.0, worst);
    fflush(stdout);
    cudaStreamDestroy(st);
    cudaFree(pool); cudaFree(recent); cudaFree(sink); cudaFree(step); cudaFree(q); cudaFree(mean);
    cudaFree(out_a); cudaFree(out_b); cudaFree(tables); cudaFree(seqs); cudaFree(ws);
    return worst;
}

}   // namespace

int main(int argc, char **argv)
{
    Opts o = {512, 20, 0, 0};
    int heads[8] = {128, 16}, nh = 2, batch[8] = {1, 16, 64}, nb = 3, ctx[8] = {4096, 32768}, nc = 2;
    fr_kv_dtype dts[4] = {FR_KV_BF16, FR_KV_FP8, FR_KV_NVFP4, FR_KV_MXFP4};
    int nd = 4;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: %s [--latent 512|256] [--heads 128,16] [--batch 1,16,64] [--ctx 4096,32768]\n"
                   "          [--dtypes bf16,fp8,nvfp4,mxfp4] [--compute bf16|exact] [--iters 20] [--check-only]\n"
                   "The wgmma latent kernel (attention/dev/mla_wgmma.cuh) against attn_mla.h's on the same\n"
                   "random inputs: row error and time of each. Exit 1 when an error is above 2e-2.\n",
                   argv[0]);
            return 0;
        } else if (!strcmp(a, "--check-only")) {
            o.check_only = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "%s: %s needs a value (--help)\n", argv[0], a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--latent")) o.dc = atoi(v);
        else if (!strcmp(a, "--heads")) nh = fr_bench_int_list(v, heads, 8);
        else if (!strcmp(a, "--batch")) nb = fr_bench_int_list(v, batch, 8);
        else if (!strcmp(a, "--ctx")) nc = fr_bench_int_list(v, ctx, 8);
        else if (!strcmp(a, "--iters")) o.iters = atoi(v);
        else if (!strcmp(a, "--compute")) o.exact = !strcmp(v, "exact");
        else if (!strcmp(a, "--dtypes")) {
            nd = 0;
            char buf[128];
            snprintf(buf, sizeof buf, "%s", v);
            for (char *t = strtok(buf, ","); t && nd < 4; t = strtok(NULL, ","))
                if (fr_kv_dtype_parse(t, &dts[nd]) == FR_OK) nd++;
                else {
                    fprintf(stderr, "%s: unknown dtype %s\n", argv[0], t);
                    return 2;
                }
        } else {
            fprintf(stderr, "%s: unknown option %s (--help)\n", argv[0], a);
            return 2;
        }
    }
    if ((o.dc != 256 && o.dc != 512) || o.iters < 1) {
        fprintf(stderr, "%s: --latent 256 or 512, --iters >= 1\n", argv[0]);
        return 2;
    }
    printf("dtype  heads batch     ctx new splits | main ms   wgmma ms  speedup | main   wgmma           | main    wgmma        | max row err\n");
    int bad = 0;
    uint64_t seed = 1;
    /* First, a step whose only token is its own (context 1): its softmax weight is
     * 1 whatever the scores, so the output is that token's latent. Right here and
     * wrong below points at the scores' product; wrong here, at the context's (the
     * V descriptor or the register A fragments of P). */
    Opts one = o;
    one.check_only = 1;
    int bad_one = 0;
    for (int d = 0; d < nd; d++) {
        const double e = run_case(one, Case{dts[d], heads[0], 1, 1, 1}, seed++);
        bad_one += !(e >= 0.0 && e <= 2e-2);
    }
    printf("context-1 cases (the context product alone): %s\n", bad_one ? "FAIL" : "ok");
    bad += bad_one;
    for (int d = 0; d < nd; d++)
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < nc; c++) {
                for (int b = 0; b < nb; b++) {
                    const double e = run_case(o, Case{dts[d], heads[h], batch[b], ctx[c], 1}, seed++);
                    bad += !(e >= 0.0 && e <= 2e-2);
                }
                /* a chunked prefill of 5 tokens, check only */
                Opts oc = o;
                oc.check_only = 1;
                const double e = run_case(oc, Case{dts[d], heads[h], 2, ctx[c], 5}, seed++);
                bad += !(e >= 0.0 && e <= 2e-2);
            }
    printf("%s: %d case(s) above the 2e-2 rule or failed\n", bad ? "FAIL" : "ok", bad);
    return bad ? 1 : 0;
}
