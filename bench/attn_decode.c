/* Decode-attention kernel benchmark: the paged decode kernels of attention/
 * timed one call at a time, with the bytes each call must move.
 *
 * For every (shape, batch, context) and every kernel asked for:
 *   bf16         fr_attn_bf16 on a BF16 cache;
 *   fp8          fr_attn_fp4_decode, E4M3 cache, per-head scales 1;
 *   nvfp4-exact  fr_attn_fp4_decode, NVFP4 cache, fp4_compute exact;
 *   nvfp4-bf16   the same cache, fp4_compute bf16;
 *   mxfp4-exact, mxfp4-bf16 likewise on an MXFP4 cache;
 * the FP4/FP8 configurations take p from fr_ref_attn_params of
 * fr_ref_config_default(dtype) (tile 128) with the compute mode set, and
 * rotate / sink_recent from the full recipe (FP4 only; FP8 neither).
 *
 * The cache is filled directly in device memory, one pool per dtype per case
 * (one layer, the shape's KV heads): random but valid page bytes (FP4 codes any
 * nibble, E4M3 block scales 0x30..0x48, E8M0 scales 2^-3..2^3, E4M3 and BF16
 * elements of magnitude 2^-3..2^2), made on the host as a template of whole
 * blocks and replicated on the device; random BF16 sink, recent and staging
 * rows; random float32 queries; block tables a random permutation of the pool,
 * so no sequence's pages are contiguous. Each sequence is in a decode step:
 * n_new = 1, len = context - 1, so it reads len / 128 full pages, len % 128
 * recent-slot tokens, its staging row and, for FP4, the 16 sink tokens.
 *
 * Timing: one sample is the whole fr_attn_*_decode call (its split kernels and
 * its combine) between two CUDA events on one stream. After --warmup calls,
 * --runs calls are enqueued behind a host-side gate (a host function that holds
 * the stream until every call of the batch is enqueued), so the samples hold
 * GPU time only, no host launch gaps; the median is reported.
 * L2 is defeated by rotation: when one call moves less than the rotation size
 * (max(4 x L2, --rotate-mb)), the case holds copies = 1 + ceil(rotation / bytes)
 * independent caches (pools, slots, staging rows, queries, block tables) and
 * call i reads copy i mod copies, so between two reads of a copy at least the
 * rotation size of other cache data has been read; a call that moves more uses
 * one copy. Nothing is written between calls except the output and workspace.
 *
 * Bytes of one call (the "bytes" column, also split into three columns):
 *   page_bytes        full pages: head_page_bytes per 128 tokens per (sequence,
 *                     KV head), codes and block scales (kvcache/page_layout.h);
 *   bf16_token_bytes  BF16 K and V tokens read outside pages: recent-slot
 *                     tokens, the staging token and (FP4 full recipe) the 16
 *                     sink tokens, 4 * head_dim bytes per token per KV head;
 *   other_bytes       queries (float32), the BF16 output (written), block-table
 *                     entries, sequence records and FP8 scales.
 * Split partials in the workspace are not counted (they stay in L2).
 *
 * Output: CSV on stdout, one row per (shape, batch, context, kernel), after
 * '#' comment lines (device, L2, copy bandwidth, command); progress on stderr.
 * A kernel whose call fails (an unsupported shape, say) gets status n/a and
 * the error message; the other rows go on.
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "attention/attn_bf16.h"
#include "attention/attn_fp4.h"
#include "attention/kv_numerics.h"
#include "attention/ref_attention.h"
#include "kvcache/page_layout.h"
#include "bench/copy_bandwidth.h"
#include "base/clock.h"
#include "bench/bench_util.h"

enum { PAGE = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS, MAX_LIST = 32, GATE_CHUNK = 50, MAX_RUNS = 10000 };

/* ---- what can be run ---------------------------------------------------- */

typedef struct {
    const char *name;
    fr_kv_dtype dtype;
    fr_fp4_compute compute;
} kernel_spec;

/* Kernels of one dtype are adjacent: they share one cache per case. */
static const kernel_spec KERNELS[] = {
    {"bf16", FR_KV_BF16, FR_COMPUTE_BF16},
    {"fp8", FR_KV_FP8, FR_COMPUTE_EXACT},
    {"nvfp4-exact", FR_KV_NVFP4, FR_COMPUTE_EXACT},
    {"nvfp4-bf16", FR_KV_NVFP4, FR_COMPUTE_BF16},
    {"mxfp4-exact", FR_KV_MXFP4, FR_COMPUTE_EXACT},
    {"mxfp4-bf16", FR_KV_MXFP4, FR_COMPUTE_BF16},
};
#define N_KERNELS ((int)(sizeof KERNELS / sizeof KERNELS[0]))

typedef struct {
    char name[48];
    int q_heads, kv_heads, head_dim;
} shape_spec;

static const shape_spec SHAPES[] = {
    {"qwen3-4b", 32, 8, 128},
    {"qwen3-14b", 40, 8, 128},
    {"qwen3-30b-a3b", 32, 4, 128},
};
#define N_SHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

typedef struct {
    shape_spec shapes[MAX_LIST];
    int n_shapes;
    int batches[MAX_LIST], n_batches;
    int contexts[MAX_LIST], n_contexts;
    int use_kernel[N_KERNELS];
    int runs, warmup;
    double rotate_mb;
    uint64_t seed;
} options;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: attn_decode [--shapes LIST] [--batches LIST] [--contexts LIST] [--kernels LIST]\n"
            "                   [--runs N] [--warmup N] [--rotate-mb MB] [--seed N]\n"
            "Times the paged decode-attention kernels (one decode step, one layer) and prints CSV.\n"
            "  --shapes    qwen3-4b (32 q / 8 kv heads, d 128), qwen3-14b (40 / 8), qwen3-30b-a3b (32 / 4),\n"
            "              or Q:KV[:D]\n"
            "              (default qwen3-4b,qwen3-30b-a3b)\n"
            "  --batches   sequences per step (default 1,4,16,64)\n"
            "  --contexts  tokens attended per sequence incl. the new one; K = 1024\n"
            "              (default 4K,16K,32K,128K)\n"
            "  --kernels   any of bf16,fp8,nvfp4-exact,nvfp4-bf16,mxfp4-exact,mxfp4-bf16, or all (default all)\n"
            "  --runs      timed calls per kernel, median reported (default 30, at least 20 advised)\n"
            "  --warmup    untimed calls first (default 5)\n"
            "  --rotate-mb cache bytes read between two reads of the same data, at least 4 x L2\n"
            "              whatever is given (default 256)\n"
            "  --seed      fill seed (default 1)\n");
}

/* ---- small helpers ------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s)   /* splitmix64 */
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* BF16 of magnitude in [2^-3, 2^2), either sign. */
static uint16_t rand_bf16(uint64_t *s)
{
    uint64_t r = rng_next(s);
    return (uint16_t)(((r >> 8) & 1u) << 15 | (124u + (unsigned)((r >> 16) % 5u)) << 7 | (r & 0x7Fu));
}

/* E4M3 element of magnitude in [2^-3, 2^2): exponent field 4..8, never NaN. */
static uint8_t rand_e4m3(uint64_t r)
{
    return (uint8_t)((r & 1u) << 7 | (4u + (unsigned)((r >> 1) % 5u)) << 3 | ((r >> 8) & 7u));
}

static void fill_bytes(uint8_t *p, size_t n, uint64_t *s)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t r = rng_next(s);
        memcpy(p + i, &r, 8);
    }
    if (i < n) {
        uint64_t r = rng_next(s);
        memcpy(p + i, &r, n - i);
    }
}

/* A block scale: E4M3 0x30..0x48 (0.5 .. 4) for NVFP4, E8M0 124..130
 * (2^-3 .. 2^3) for MXFP4. */
static void fill_scales(uint8_t *p, size_t n, fr_kv_dtype t, uint64_t *s)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next(s);
        p[i] = t == FR_KV_NVFP4 ? (uint8_t)(0x30u + r % 0x19u) : (uint8_t)(124u + r % 7u);
    }
}

static void fill_head_page(uint8_t *p, fr_kv_dtype t, const fr_page_layout *l, uint64_t *s)
{
    const size_t n = l->head_page_bytes;
    if (t == FR_KV_BF16) {
        for (size_t i = 0; i + 2 <= n; i += 2) {
            uint16_t x = rand_bf16(s);
            memcpy(p + i, &x, 2);
        }
    } else if (t == FR_KV_FP8) {
        for (size_t i = 0; i < n; i++) p[i] = rand_e4m3(rng_next(s));
    } else {
        fill_bytes(p + l->k_codes, l->k_scales - l->k_codes, s);
        fill_scales(p + l->k_scales, l->v_codes - l->k_scales, t, s);
        fill_bytes(p + l->v_codes, l->v_scales - l->v_codes, s);
        fill_scales(p + l->v_scales, n - l->v_scales, t, s);
    }
}

/* Writes total bytes at dev: the host pattern (pat bytes) once, then doubling
 * device-to-device copies of what is already there. */
static cudaError_t fill_pattern(void *dev, size_t total, const void *host, size_t pat, cudaStream_t st)
{
    size_t n = pat < total ? pat : total;
    cudaError_t e = cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, st);
    while (e == cudaSuccess && n < total) {
        size_t m = n < total - n ? n : total - n;
        e = cudaMemcpyAsync((uint8_t *)dev + n, dev, m, cudaMemcpyDeviceToDevice, st);
        n += m;
    }
    return e == cudaSuccess ? cudaStreamSynchronize(st) : e;
}

/* Host to device, ordered on the stream, done on return. */
static cudaError_t upload(void *dev, const void *host, size_t n, cudaStream_t st)
{
    cudaError_t e = cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, st);
    return e == cudaSuccess ? cudaStreamSynchronize(st) : e;
}

/* Random BF16 at dev (elems of them) from a pattern of at most 4 Mi values. */
static cudaError_t fill_bf16(uint16_t *dev, size_t elems, uint64_t *s, cudaStream_t st)
{
    size_t pat = elems < ((size_t)4 << 20) ? elems : ((size_t)4 << 20);
    uint16_t *h = malloc(sizeof(uint16_t) * (pat ? pat : 1));
    if (!h) return cudaErrorMemoryAllocation;
    for (size_t i = 0; i < pat; i++) h[i] = rand_bf16(s);
    cudaError_t e = fill_pattern(dev, elems * 2, h, pat * 2, st);
    free(h);
    return e;
}

/* ---- one cache (one dtype, one case, `copies` independent copies) ------- */

typedef struct {
    fr_kv_dtype dtype;
    int qh, kvh, d, batch, ctx, len, pages, tbl, copies, sink_recent;
    fr_page_layout lay;
    size_t block_bytes, slot_elems, sink_elems, n_blocks;
    double page_bytes, bf16_bytes, other_bytes;   /* one call */
    uint8_t *pool;
    uint16_t *recent, *sink, *step_k, *step_v, *out;
    float *q, *fp8_scales;
    int *bt;
    fr_paged_seq *seqs;
} kv_case;

static double call_bytes(const kv_case *c) { return c->page_bytes + c->bf16_bytes + c->other_bytes; }

/* Shape, step and bytes of one call; nothing allocated. */
static void case_plan(kv_case *c, fr_kv_dtype t, const shape_spec *sh, int batch, int ctx, double rotate_bytes)
{
    memset(c, 0, sizeof *c);
    c->dtype = t;
    c->qh = sh->q_heads; c->kvh = sh->kv_heads; c->d = sh->head_dim;
    c->batch = batch; c->ctx = ctx;
    c->len = ctx - 1;
    c->pages = c->len / PAGE;
    c->tbl = c->pages + 1;   /* plus the block reserved for the partial page, as the engine holds it */
    c->sink_recent = fr_kv_dtype_is_fp4(t) ? fr_recipe_full().sink_recent : 0;
    c->lay = fr_page_layout_for(t, c->d);
    c->block_bytes = c->lay.head_page_bytes * (size_t)c->kvh;   /* one layer */
    c->slot_elems = (size_t)c->kvh * PAGE * (size_t)c->d;
    c->sink_elems = (size_t)c->kvh * SINK * (size_t)c->d;

    const double heads = (double)batch * c->kvh, tok = 4.0 * c->d;
    const int sink = c->sink_recent && c->pages > 0 ? SINK : 0;
    c->page_bytes = heads * c->pages * (double)c->lay.head_page_bytes;
    c->bf16_bytes = heads * (sink + c->len % PAGE + 1) * tok;
    c->other_bytes = (double)batch * ((double)c->qh * c->d * 4.0 + (double)c->qh * c->d * 2.0 + 4.0 * c->pages +
                                      (double)sizeof(fr_paged_seq)) +
                     (t == FR_KV_FP8 ? 8.0 * c->kvh : 0.0);
    const double b = call_bytes(c);
    c->copies = b >= rotate_bytes ? 1 : 1 + (int)ceil(rotate_bytes / b);
    c->n_blocks = (size_t)c->copies * (size_t)batch * (size_t)c->tbl;
}

static void case_free(kv_case *c)
{
    cudaFree(c->pool); cudaFree(c->recent); cudaFree(c->sink); cudaFree(c->step_k); cudaFree(c->step_v);
    cudaFree(c->out); cudaFree(c->q); cudaFree(c->fp8_scales); cudaFree(c->bt); cudaFree(c->seqs);
    c->pool = NULL; c->recent = c->sink = c->step_k = c->step_v = c->out = NULL;
    c->q = c->fp8_scales = NULL; c->bt = NULL; c->seqs = NULL;
}

static double case_device_bytes(const kv_case *c)
{
    const double cb = (double)c->copies * c->batch;
    return (double)c->n_blocks * c->block_bytes + cb * 2.0 * (c->slot_elems + c->sink_elems) * 2.0 +
           cb * c->kvh * c->d * 4.0 + cb * c->qh * c->d * 4.0;
}

/* Allocates and fills every copy; 0 or a message in err. */
static int case_alloc(kv_case *c, uint64_t seed, cudaStream_t st, char *err, size_t err_len)
{
    const size_t cb = (size_t)c->copies * (size_t)c->batch, d = (size_t)c->d;
    const size_t rows_kv = cb * (size_t)c->kvh * d, rows_q = cb * (size_t)c->qh * d;
    if (c->n_blocks > (size_t)INT32_MAX) {
        snprintf(err, err_len, "%zu blocks do not fit an int block table", c->n_blocks);
        return -1;
    }
    cudaError_t e = cudaSuccess;
#define ALLOC(ptr, bytes) \
    if (e == cudaSuccess) e = cudaMalloc((void **)&(ptr), (bytes))
    ALLOC(c->pool, c->n_blocks * c->block_bytes);
    ALLOC(c->recent, sizeof(uint16_t) * 2 * c->slot_elems * cb);
    if (fr_kv_dtype_is_fp4(c->dtype) || c->dtype == FR_KV_FP8) ALLOC(c->sink, sizeof(uint16_t) * 2 * c->sink_elems * cb);
    ALLOC(c->step_k, sizeof(uint16_t) * rows_kv);
    ALLOC(c->step_v, sizeof(uint16_t) * rows_kv);
    ALLOC(c->out, sizeof(uint16_t) * (size_t)c->batch * c->qh * d);
    ALLOC(c->q, sizeof(float) * rows_q);
    ALLOC(c->fp8_scales, sizeof(float) * 2 * (size_t)c->kvh);
    ALLOC(c->bt, sizeof(int) * c->n_blocks);
    ALLOC(c->seqs, sizeof(fr_paged_seq) * cb);
#undef ALLOC
    if (e != cudaSuccess) {
        cudaGetLastError();
        snprintf(err, err_len, "cannot allocate %.2f GB on the device: %s", case_device_bytes(c) / 1e9,
                 cudaGetErrorString(e));
        case_free(c);
        return -1;
    }

    uint64_t s = seed;
    /* Pool: a template of whole blocks, replicated. */
    size_t tmpl = ((size_t)16 << 20) / c->block_bytes;
    if (tmpl < 1) tmpl = 1;
    if (tmpl > c->n_blocks) tmpl = c->n_blocks;
    uint8_t *h = malloc(tmpl * c->block_bytes);
    float *hq = malloc(sizeof(float) * rows_q);
    int *perm = malloc(sizeof(int) * c->n_blocks);
    fr_paged_seq *hs = malloc(sizeof(fr_paged_seq) * cb);
    float *ones = malloc(sizeof(float) * 2 * (size_t)c->kvh);
    if (!h || !hq || !perm || !hs || !ones) {
        free(h); free(hq); free(perm); free(hs); free(ones);
        snprintf(err, err_len, "host allocation failed");
        case_free(c);
        return -1;
    }
    for (size_t b = 0; b < tmpl * (size_t)c->kvh; b++) fill_head_page(h + b * c->lay.head_page_bytes, c->dtype, &c->lay, &s);
    e = fill_pattern(c->pool, c->n_blocks * c->block_bytes, h, tmpl * c->block_bytes, st);
    if (e == cudaSuccess) e = fill_bf16(c->recent, 2 * c->slot_elems * cb, &s, st);
    if (e == cudaSuccess && c->sink) e = fill_bf16(c->sink, 2 * c->sink_elems * cb, &s, st);
    if (e == cudaSuccess) e = fill_bf16(c->step_k, rows_kv, &s, st);
    if (e == cudaSuccess) e = fill_bf16(c->step_v, rows_kv, &s, st);
    for (size_t i = 0; i < rows_q; i++) hq[i] = (float)((double)(rng_next(&s) >> 11) * 0x1.0p-53 * 4.0 - 2.0);
    if (e == cudaSuccess) e = upload(c->q, hq, sizeof(float) * rows_q, st);
    for (int i = 0; i < 2 * c->kvh; i++) ones[i] = 1.0f;
    if (e == cudaSuccess) e = upload(c->fp8_scales, ones, sizeof(float) * 2 * (size_t)c->kvh, st);
    /* Block tables: a random permutation of every block of every copy. */
    for (size_t i = 0; i < c->n_blocks; i++) perm[i] = (int)i;
    for (size_t i = c->n_blocks - 1; i > 0; i--) {
        size_t j = (size_t)(rng_next(&s) % (uint64_t)(i + 1));
        int t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    if (e == cudaSuccess) e = upload(c->bt, perm, sizeof(int) * c->n_blocks, st);
    /* Copy k, sequence b: slot b, staging/query row b of the copy's buffers. */
    for (size_t i = 0; i < cb; i++)
        hs[i] = (fr_paged_seq){.block_table = c->bt + i * (size_t)c->tbl, .len = c->len, .n_new = 1,
                               .q_row = (int)(i % (size_t)c->batch), .slot = (int)(i % (size_t)c->batch)};
    if (e == cudaSuccess) e = upload(c->seqs, hs, sizeof(fr_paged_seq) * cb, st);
    if (e == cudaSuccess) e = cudaMemsetAsync(c->out, 0, sizeof(uint16_t) * (size_t)c->batch * c->qh * d, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    free(h); free(hq); free(perm); free(hs); free(ones);
    if (e != cudaSuccess) {
        snprintf(err, err_len, "filling the cache failed: %s", cudaGetErrorString(e));
        case_free(c);
        return -1;
    }
    return 0;
}

/* The attention view of copy k: its own slots and staging rows. */
static fr_paged_kv case_view(const kv_case *c, int k)
{
    const size_t cb = (size_t)k * (size_t)c->batch;
    fr_paged_kv v;
    memset(&v, 0, sizeof v);
    v.pool = c->pool;
    v.block_bytes = c->block_bytes;
    v.head_page_bytes = c->lay.head_page_bytes;
    v.k_codes = c->lay.k_codes;
    v.k_scales = c->lay.k_scales;
    v.v_codes = c->lay.v_codes;
    v.v_scales = c->lay.v_scales;
    v.recent = c->recent + cb * 2 * c->slot_elems;
    v.sink = c->sink ? c->sink + cb * 2 * c->sink_elems : NULL;
    v.slot_elems = c->slot_elems;
    v.sink_elems = c->sink ? c->sink_elems : 0;
    v.step_k = c->step_k + cb * (size_t)c->kvh * (size_t)c->d;
    v.step_v = c->step_v + cb * (size_t)c->kvh * (size_t)c->d;
    v.layer = 0;
    v.n_layers = 1;
    v.n_kv_heads = c->kvh;
    v.head_dim = c->d;
    return v;
}

/* ---- timing -------------------------------------------------------------- */

typedef struct {
    const kv_case *c;
    const kernel_spec *k;
    fr_attn_fp4_config cfg;
    void *ws;
    size_t ws_bytes;
    cudaStream_t st;
} runner;

static fr_status run_call(const runner *r, int copy)
{
    const kv_case *c = r->c;
    const fr_paged_kv kv = case_view(c, copy);
    const fr_paged_seq *seqs = c->seqs + (size_t)copy * (size_t)c->batch;
    const float *q = c->q + (size_t)copy * (size_t)c->batch * (size_t)c->qh * (size_t)c->d;
    if (r->k->dtype == FR_KV_BF16)
        return fr_attn_bf16(&kv, seqs, c->batch, 1, c->ctx, q, c->out, c->qh, r->ws, r->ws_bytes, r->st);
    return fr_attn_fp4_decode(&r->cfg, &kv, seqs, c->batch, c->ctx, q, c->out, c->qh, r->ws, r->ws_bytes, r->st);
}

/* Holds the stream until the host has enqueued a batch of calls (bounded
 * wait, so a full launch queue cannot dead-lock). */
typedef struct {
    atomic_int open, timed_out;
} gate;

static void gate_wait(void *arg)
{
    gate *g = arg;
    const double t0 = fr_now_s();
    while (!atomic_load(&g->open))
        if (fr_now_s() - t0 > 5.0) { atomic_store(&g->timed_out, 1); break; }
        else sched_yield();
}

typedef struct {
    int ok;      /* 1: timed; 0: n/a (err says why) */
    int fatal;   /* the CUDA context is unusable */
    char err[512];
    double med_us, min_us, max_us;
} timing;

static void fail_status(timing *t, fr_status s)
{
    t->ok = 0;
    snprintf(t->err, sizeof t->err, "%s: %s", fr_status_name(s), fr_last_error());
}

static int check_cuda(timing *t, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 0;
    t->ok = 0;
    t->fatal = 1;
    snprintf(t->err, sizeof t->err, "%s: %s", what, cudaGetErrorString(e));
    return -1;
}

static void time_kernel(const runner *r, int warmup, int runs, timing *t)
{
    const int copies = r->c->copies;
    memset(t, 0, sizeof *t);
    fr_status s = run_call(r, 0);
    if (s != FR_OK) { fail_status(t, s); return; }
    if (check_cuda(t, cudaStreamSynchronize(r->st), "first call")) return;
    for (int i = 1; i < warmup; i++)
        if ((s = run_call(r, i % copies)) != FR_OK) { fail_status(t, s); return; }
    if (check_cuda(t, cudaStreamSynchronize(r->st), "warm-up")) return;

    cudaEvent_t *ev = calloc((size_t)2 * runs, sizeof(cudaEvent_t));
    double *us = malloc(sizeof(double) * (size_t)runs);
    int made = 0;
    if (!ev || !us) { snprintf(t->err, sizeof t->err, "host allocation failed"); goto done; }
    for (; made < 2 * runs; made++)
        if (check_cuda(t, cudaEventCreate(&ev[made]), "cudaEventCreate")) goto done;
    for (int r0 = 0; r0 < runs; r0 += GATE_CHUNK) {
        const int r1 = r0 + GATE_CHUNK < runs ? r0 + GATE_CHUNK : runs;
        gate g;
        atomic_init(&g.open, 0);
        atomic_init(&g.timed_out, 0);
        if (check_cuda(t, cudaLaunchHostFunc(r->st, gate_wait, &g), "cudaLaunchHostFunc")) goto done;
        s = FR_OK;
        for (int i = r0; i < r1 && s == FR_OK; i++) {
            cudaEventRecord(ev[2 * i], r->st);
            s = run_call(r, (warmup + i) % copies);
            cudaEventRecord(ev[2 * i + 1], r->st);
        }
        atomic_store(&g.open, 1);
        if (check_cuda(t, cudaStreamSynchronize(r->st), "timed calls")) goto done;
        if (s != FR_OK) { fail_status(t, s); goto done; }
        if (atomic_load(&g.timed_out))
            fprintf(stderr, "attn_decode: note: the calls were not all enqueued within 5 s (does a call wait "
                            "for the stream?); host gaps may be in these samples\n");
    }
    for (int i = 0; i < runs; i++) {
        float ms = 0.0f;
        if (check_cuda(t, cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime")) goto done;
        us[i] = 1e3 * (double)ms;
    }
    qsort(us, (size_t)runs, sizeof(double), fr_bench_cmp_double);
    t->ok = 1;
    t->med_us = runs % 2 ? us[runs / 2] : 0.5 * (us[runs / 2 - 1] + us[runs / 2]);
    t->min_us = us[0];
    t->max_us = us[runs - 1];
done:
    for (int i = 0; i < made; i++) cudaEventDestroy(ev[i]);
    free(ev);
    free(us);
}

/* ---- output -------------------------------------------------------------- */

static void print_csv_text(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        if (*s == '"') putchar('"');
        putchar(*s == '\n' || *s == '\r' ? ' ' : *s);
    }
    putchar('"');
}

static void print_row(const shape_spec *sh, const kv_case *c, const kernel_spec *k, int runs, const timing *t)
{
    printf("%s,%d,%d,%d,%d,%d,%s,", sh->name, sh->q_heads, sh->kv_heads, sh->head_dim, c->batch, c->ctx, k->name);
    const double bytes = call_bytes(c);
    if (t->ok)
        printf("ok,%.3f,%.3f,%.3f,%d,%d,%.0f,%.0f,%.0f,%.0f,%.4f,", t->med_us, t->min_us, t->max_us, runs, c->copies,
               bytes, c->page_bytes, c->bf16_bytes, c->other_bytes, bytes / (t->med_us * 1e-6) / 1e12);
    else
        printf("n/a,,,,%d,%d,%.0f,%.0f,%.0f,%.0f,,", runs, c->copies, bytes, c->page_bytes, c->bf16_bytes,
               c->other_bytes);
    print_csv_text(t->ok ? "" : t->err);
    putchar('\n');
    fflush(stdout);
    if (t->ok)
        fprintf(stderr, "%-14s batch %2d ctx %6d %-12s %10.2f us %8.1f MB %6.2f TB/s (copies %d)\n", sh->name, c->batch,
                c->ctx, k->name, t->med_us, bytes / 1e6, bytes / (t->med_us * 1e-6) / 1e12, c->copies);
    else
        fprintf(stderr, "%-14s batch %2d ctx %6d %-12s n/a: %s\n", sh->name, c->batch, c->ctx, k->name, t->err);
}

/* ---- argument parsing ---------------------------------------------------- */

/* Comma-separated positive integers, K (x1024) or M (x1048576) suffix allowed. */
static int parse_ints(const char *text, int *out, int *n)
{
    *n = 0;
    const char *p = text;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0) return -1;
        if (*end == 'K' || *end == 'k') { v *= 1024; end++; }
        else if (*end == 'M' || *end == 'm') { v *= 1048576; end++; }
        if (v > (1L << 24) || *n >= MAX_LIST) return -1;
        out[(*n)++] = (int)v;
        if (*end == ',') end++;
        else if (*end) return -1;
        p = end;
    }
    return *n > 0 ? 0 : -1;
}

static int parse_shapes(const char *text, options *o)
{
    char buf[512];
    if (strlen(text) >= sizeof buf) return -1;
    strcpy(buf, text);
    o->n_shapes = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_shapes >= MAX_LIST) return -1;
        shape_spec *sh = &o->shapes[o->n_shapes];
        int found = 0;
        for (int i = 0; i < N_SHAPES; i++)
            if (strcmp(tok, SHAPES[i].name) == 0) { *sh = SHAPES[i]; found = 1; }
        if (!found) {
            int q = 0, kv = 0, d = 128, used = 0;
            if (sscanf(tok, "%d:%d%n", &q, &kv, &used) != 2) return -1;
            if (tok[used] == ':' && sscanf(tok + used + 1, "%d", &d) != 1) return -1;
            if (q < 1 || kv < 1 || q % kv || d < 16 || d > FR_MAX_HEAD_DIM) return -1;
            sh->q_heads = q; sh->kv_heads = kv; sh->head_dim = d;
            snprintf(sh->name, sizeof sh->name, "q%dkv%dd%d", q, kv, d);
        }
        o->n_shapes++;
    }
    return o->n_shapes > 0 ? 0 : -1;
}

static int parse_kernels(const char *text, options *o)
{
    char buf[512];
    if (strlen(text) >= sizeof buf) return -1;
    strcpy(buf, text);
    memset(o->use_kernel, 0, sizeof o->use_kernel);
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int i = 0; i < N_KERNELS; i++)
            if (strcmp(tok, "all") == 0 || strcmp(tok, KERNELS[i].name) == 0) { o->use_kernel[i] = 1; found = 1; }
        if (!found) return -1;
        n++;
    }
    return n > 0 ? 0 : -1;
}

/* ---- main ---------------------------------------------------------------- */

/* The command line into o; 0, or the exit status (0 after --help). */
static int parse_args(int argc, char **argv, options *o, int *exit_now)
{
    *exit_now = 0;
    memset(o, 0, sizeof *o);
    o->runs = 30;
    o->warmup = 5;
    o->rotate_mb = 256.0;
    o->seed = 1;
    if (parse_shapes("qwen3-4b,qwen3-30b-a3b", o) || parse_ints("1,4,16,64", o->batches, &o->n_batches) ||
        parse_ints("4K,16K,32K,128K", o->contexts, &o->n_contexts) || parse_kernels("all", o))
        return 2;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { usage(stdout); *exit_now = 1; return 0; }
        else if (!v) bad = 1;
        else if (strcmp(a, "--shapes") == 0) bad = parse_shapes(v, o);
        else if (strcmp(a, "--batches") == 0) bad = parse_ints(v, o->batches, &o->n_batches);
        else if (strcmp(a, "--contexts") == 0) bad = parse_ints(v, o->contexts, &o->n_contexts);
        else if (strcmp(a, "--kernels") == 0) bad = parse_kernels(v, o);
        else if (strcmp(a, "--runs") == 0) bad = (o->runs = atoi(v)) < 1 || o->runs > MAX_RUNS;
        else if (strcmp(a, "--warmup") == 0) bad = (o->warmup = atoi(v)) < 1;
        else if (strcmp(a, "--rotate-mb") == 0) bad = (o->rotate_mb = atof(v)) < 0.0;
        else if (strcmp(a, "--seed") == 0) o->seed = strtoull(v, NULL, 10);
        else bad = 1;
        if (bad) {
            fprintf(stderr, "attn_decode: bad argument %s%s%s\n", a, v ? " " : "", v ? v : "");
            usage(stderr);
            return 2;
        }
    }
    for (int i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] < 2) { fprintf(stderr, "attn_decode: a context needs at least 2 tokens\n"); return 2; }
    if (o->runs < 20) fprintf(stderr, "attn_decode: note: --runs %d is below 20\n", o->runs);

    return 0;
}

int main(int argc, char **argv)
{
    options o;
    int exit_now;
    const int prc = parse_args(argc, argv, &o, &exit_now);
    if (prc || exit_now) return prc;
    int dev = 0, l2 = 0, sms = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        fprintf(stderr, "attn_decode: no CUDA device\n");
        return 1;
    }
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const double rotate_bytes = fmax(4.0 * l2, o.rotate_mb * 1048576.0);
    cudaStream_t st;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "attn_decode: cannot create a stream\n");
        return 1;
    }
    const double bw = fr_bench_copy_bandwidth((size_t)1 << 30, st);

    printf("# bench: attn_decode (paged decode attention, one layer, n_new 1, len = context - 1)\n");
    printf("# command:");
    for (int i = 0; i < argc; i++) printf(" %s", argv[i]);
    printf("\n# device: %s, %d SMs, %.1f GB, L2 %.1f MB\n", prop.name, sms, (double)prop.totalGlobalMem / 1e9,
           l2 / 1048576.0);
    printf("# copy_bandwidth_tb_s: %.3f (device-to-device copy of 1 GiB, read + write)\n", bw / 1e12);
    printf("# l2: rotation over cache copies, >= %.0f MB of other cache data read between two reads of a copy\n",
           rotate_bytes / 1048576.0);
    printf("# timing: CUDA events around each call, %d warm-up calls, median of %d, calls enqueued ahead\n",
           o.warmup, o.runs);
    printf("shape,q_heads,kv_heads,head_dim,batch,context,kernel,status,median_us,min_us,max_us,runs,copies,"
           "bytes,page_bytes,bf16_token_bytes,other_bytes,tb_s,error\n");
    fflush(stdout);

    int rc = 0;
    for (int si = 0; si < o.n_shapes && !rc; si++) {
        const shape_spec *sh = &o.shapes[si];
        for (int ci = 0; ci < o.n_contexts && !rc; ci++) {
            for (int bi = 0; bi < o.n_batches && !rc; bi++) {
                for (int k0 = 0; k0 < N_KERNELS && !rc;) {
                    int k1 = k0, any = 0;   /* [k0, k1): the kernels of one dtype */
                    while (k1 < N_KERNELS && KERNELS[k1].dtype == KERNELS[k0].dtype) any |= o.use_kernel[k1++];
                    if (!any) { k0 = k1; continue; }
                    kv_case c;
                    case_plan(&c, KERNELS[k0].dtype, sh, o.batches[bi], o.contexts[ci], rotate_bytes);
                    timing t;
                    memset(&t, 0, sizeof t);
                    int have = case_alloc(&c, o.seed + 7919u * (uint64_t)(si * 1000 + ci * 100 + bi), st, t.err,
                                          sizeof t.err) == 0;
                    for (int k = k0; k < k1 && !rc; k++) {
                        if (!o.use_kernel[k]) continue;
                        if (!have) { print_row(sh, &c, &KERNELS[k], o.runs, &t); continue; }
                        runner r = {.c = &c, .k = &KERNELS[k], .st = st};
                        fr_status s;
                        if (KERNELS[k].dtype == FR_KV_BF16) {
                            s = fr_attn_bf16_workspace_bytes(c.batch, c.qh, c.kvh, c.d, c.ctx, &r.ws_bytes);
                        } else {
                            fr_ref_config rcfg = fr_ref_config_default(KERNELS[k].dtype);
                            rcfg.compute = KERNELS[k].compute;
                            rcfg.tile = PAGE;
                            const int fp4 = fr_kv_dtype_is_fp4(KERNELS[k].dtype);
                            r.cfg = (fr_attn_fp4_config){.dtype = KERNELS[k].dtype,
                                                         .p = fr_ref_attn_params(&rcfg, c.d, c.qh / c.kvh),
                                                         .rotate = fp4 ? rcfg.recipe.rotate : 0,
                                                         .sink_recent = fp4 ? rcfg.recipe.sink_recent : 0,
                                                         .fp8_scales = c.fp8_scales};
                            s = fr_attn_fp4_workspace_bytes(&r.cfg, c.batch, c.qh, c.kvh, c.ctx, &r.ws_bytes);
                        }
                        timing tk;
                        memset(&tk, 0, sizeof tk);
                        if (s != FR_OK) {
                            fail_status(&tk, s);
                        } else if (r.ws_bytes && cudaMalloc(&r.ws, r.ws_bytes) != cudaSuccess) {
                            cudaGetLastError();
                            snprintf(tk.err, sizeof tk.err, "cannot allocate a %zu-byte workspace", r.ws_bytes);
                        } else {
                            time_kernel(&r, o.warmup, o.runs, &tk);
                        }
                        print_row(sh, &c, &KERNELS[k], o.runs, &tk);
                        cudaFree(r.ws);
                        if (tk.fatal) rc = 1;
                    }
                    case_free(&c);
                    k0 = k1;
                }
            }
        }
    }
    if (rc) fprintf(stderr, "attn_decode: stopped after a CUDA error (the context is unusable)\n");
    cudaStreamDestroy(st);
    return rc;
}
