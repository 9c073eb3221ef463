/* BF16-KV attention kernels (attention/attn_bf16.h) against a float32 CPU
 * reference on the same BF16 values.
 *
 * Each case builds a paged cache directly in device memory as
 * attention/paged_kv.h lays it out: random, non-contiguous block tables,
 * layer 1 of 2, shuffled recent slots and staging rows. Everything the kernels
 * must not read (other layers, unused blocks, recent rows past len, other
 * staging rows, the output before it is written) holds BF16 NaN, so a stray
 * read or a missing write shows as NaN.
 *
 * The reference rounds the queries to BF16 as the kernels do and computes
 * softmax(q.k / sqrt(d)) v in float32 (OpenBLAS) with the exponentials and
 * sums in double. Rule: for every (token, query head), the largest |gpu - ref|
 * over the head's channels is at most 1e-2 times the largest |ref| there
 * (a few BF16 ulps: the kernels round P to BF16 for the tensor cores and the
 * output to BF16), and no output is NaN.
 *
 * Cases: decode batches mixing len 0 .. 33000 for G = 1, 3, 4, 5, 6, 7, 8, 16;
 * the split plan cut by the workspace and by a small max_ctx; a captured CUDA
 * graph replayed with new lengths and block tables; prefill chunks of 1, 7,
 * 128, 300, 512 tokens over len 0 and len > 0 mixed with decode rows; head_dim
 * 64; argument checks; deterministic mode's kernel (attn_fixed.h) for every
 * G from 1 to 16, against the reference and bitwise the same for a
 * sequence alone and in a batch. A timing printout (not asserted) covers decode at
 * batch 1/16/64 and 4K/32K context, 32 query and 8 KV heads, d = 128.
 * Without a GPU every case but the argument checks is skipped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "attention/attn_bf16.h"
#include "attention/attn_fixed.h"
#include "attention/fp_formats.h"
#include "tests/unit/test_util.h"

enum { PAGE = 128, N_LAYERS = 2, LAYER = 1 };
static const uint16_t BF16_NAN = 0xFFC1;
static const double TOL = 1e-2;

/* ---- a paged cache in device memory ------------------------------------- */

typedef struct {
    int len, n_new;
} seq_spec;

typedef struct {
    int d, kvh, G, n_heads, n_seqs;
    int cap_rows, cap_pages, cap_blocks, rows;
    size_t head_page_bytes, block_bytes, slot_elems;
    seq_spec *spec;
    fr_paged_seq *seqs;   /* host copy of seqs_dev */
    float **k, **v;       /* [seq * kvh + head] -> [len + n_new][d], the BF16 values */
    float *q;             /* [rows][n_heads][d] as given to the kernels */
    uint8_t *pool;
    uint16_t *recent, *step_k, *step_v, *out_dev;
    int *bt_dev;
    fr_paged_seq *seqs_dev;
    float *q_dev;
    fr_paged_kv kv;
} acase;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static void fill_u16(uint16_t *p, size_t n, uint16_t x)
{
    for (size_t i = 0; i < n; i++) p[i] = x;
}

/* Close to N(0, 1) and cheap: the sum of four uniforms, centred and scaled. */
static float rnd(fr_test_rng *r)
{
    float s = fr_test_uniform(r) + fr_test_uniform(r) + fr_test_uniform(r) + fr_test_uniform(r);
    return (s - 2.0f) * 1.7320508f;
}

static void shuffle(fr_test_rng *r, int *a, int n)
{
    for (int i = 0; i < n; i++) a[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(fr_test_u64(r) % (uint64_t)(i + 1)), t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

static void case_alloc(acase *c, int d, int kvh, int G, int n_seqs, int cap_rows, int cap_pages)
{
    memset(c, 0, sizeof *c);
    c->d = d; c->kvh = kvh; c->G = G; c->n_heads = G * kvh; c->n_seqs = n_seqs;
    c->cap_rows = cap_rows; c->cap_pages = cap_pages;
    c->cap_blocks = cap_pages + cap_pages / 4 + 3;
    c->head_page_bytes = (size_t)4 * PAGE * d;
    c->block_bytes = c->head_page_bytes * N_LAYERS * kvh;
    c->slot_elems = (size_t)N_LAYERS * kvh * PAGE * d;
    c->spec = xmalloc(sizeof(seq_spec) * n_seqs);
    c->seqs = xmalloc(sizeof(fr_paged_seq) * n_seqs);
    c->k = calloc((size_t)n_seqs * kvh, sizeof(float *));
    c->v = calloc((size_t)n_seqs * kvh, sizeof(float *));
    assert_true(c->k && c->v);
    c->q = xmalloc(sizeof(float) * cap_rows * c->n_heads * d);
    CUDA_OK(cudaMalloc((void **)&c->pool, c->block_bytes * c->cap_blocks));
    CUDA_OK(cudaMalloc((void **)&c->recent, sizeof(uint16_t) * 2 * c->slot_elems * n_seqs));
    CUDA_OK(cudaMalloc((void **)&c->step_k, sizeof(uint16_t) * cap_rows * kvh * d));
    CUDA_OK(cudaMalloc((void **)&c->step_v, sizeof(uint16_t) * cap_rows * kvh * d));
    CUDA_OK(cudaMalloc((void **)&c->bt_dev, sizeof(int) * (cap_pages + 1)));
    CUDA_OK(cudaMalloc((void **)&c->seqs_dev, sizeof(fr_paged_seq) * n_seqs));
    CUDA_OK(cudaMalloc((void **)&c->q_dev, sizeof(float) * cap_rows * c->n_heads * d));
    CUDA_OK(cudaMalloc((void **)&c->out_dev, sizeof(uint16_t) * cap_rows * c->n_heads * d));
    c->kv = (fr_paged_kv){.pool = c->pool, .block_bytes = c->block_bytes,
                          .head_page_bytes = c->head_page_bytes, .k_codes = 0, .k_scales = 0,
                          .v_codes = (size_t)2 * PAGE * d, .v_scales = 0, .recent = c->recent,
                          .sink = NULL, .slot_elems = c->slot_elems, .sink_elems = 0,
                          .step_k = c->step_k, .step_v = c->step_v, .layer = LAYER,
                          .n_layers = N_LAYERS, .n_kv_heads = kvh, .head_dim = d};
}

static void case_free(acase *c)
{
    for (int i = 0; i < c->n_seqs * c->kvh; i++) { free(c->k[i]); free(c->v[i]); }
    free(c->k); free(c->v); free(c->q); free(c->spec); free(c->seqs);
    cudaFree(c->pool); cudaFree(c->recent); cudaFree(c->step_k); cudaFree(c->step_v);
    cudaFree(c->bt_dev); cudaFree(c->seqs_dev); cudaFree(c->q_dev); cudaFree(c->out_dev);
    memset(c, 0, sizeof *c);
}

/* Writes random BF16 keys and values for spec into the cache (same device
 * buffers every time, so a captured graph sees the new contents) and random
 * queries; the output is reset to NaN. */
static void case_fill(acase *c, const seq_spec *spec, uint64_t seed)
{
    fr_test_rng r = {seed};
    const int d = c->d, kvh = c->kvh, n = c->n_seqs;
    int rows = 0, pages = 0;
    for (int s = 0; s < n; s++) {
        c->spec[s] = spec[s];
        rows += spec[s].n_new;
        pages += spec[s].len / PAGE;
    }
    assert_true(rows <= c->cap_rows && pages <= c->cap_pages);
    c->rows = rows;

    size_t pool_elems = c->block_bytes * c->cap_blocks / 2, slot_all = 2 * c->slot_elems * n;
    size_t step_elems = (size_t)c->cap_rows * kvh * d;
    uint16_t *pool = xmalloc(pool_elems * 2), *rec = xmalloc(slot_all * 2);
    uint16_t *sk = xmalloc(step_elems * 2), *sv = xmalloc(step_elems * 2);
    fill_u16(pool, pool_elems, BF16_NAN);
    fill_u16(rec, slot_all, BF16_NAN);
    fill_u16(sk, step_elems, BF16_NAN);
    fill_u16(sv, step_elems, BF16_NAN);
    int *perm = xmalloc(sizeof(int) * c->cap_blocks), *slots = xmalloc(sizeof(int) * n);
    int *order = xmalloc(sizeof(int) * n), *bt = xmalloc(sizeof(int) * (c->cap_pages + 1));
    shuffle(&r, perm, c->cap_blocks);
    shuffle(&r, slots, n);
    shuffle(&r, order, n);   /* staging rows in a shuffled sequence order */
    int *q_row = xmalloc(sizeof(int) * n);
    for (int i = 0, row = 0; i < n; i++) { q_row[order[i]] = row; row += spec[order[i]].n_new; }

    for (int s = 0, page0 = 0; s < n; s++) {
        const int len = spec[s].len, ctx = len + spec[s].n_new, np = len / PAGE, full_end = np * PAGE;
        for (int p = 0; p < np; p++) bt[page0 + p] = perm[page0 + p];
        c->seqs[s] = (fr_paged_seq){.block_table = c->bt_dev + page0, .len = len,
                                    .n_new = spec[s].n_new, .q_row = q_row[s], .slot = slots[s]};
        for (int h = 0; h < kvh; h++) {
            float **kp = &c->k[s * kvh + h], **vp = &c->v[s * kvh + h];
            free(*kp); free(*vp);
            *kp = xmalloc(sizeof(float) * ((size_t)ctx * d + 1));
            *vp = xmalloc(sizeof(float) * ((size_t)ctx * d + 1));
            const size_t lh = (size_t)LAYER * kvh + h;
            for (int t = 0; t < ctx; t++) {
                uint16_t *kd, *vd;
                if (t < full_end) {
                    size_t off = ((size_t)bt[page0 + t / PAGE] * c->block_bytes + lh * c->head_page_bytes) / 2 +
                                 (size_t)(t % PAGE) * d;
                    kd = pool + off;
                    vd = pool + off + (size_t)PAGE * d;
                } else if (t < len) {
                    kd = rec + (size_t)slots[s] * 2 * c->slot_elems + lh * PAGE * d + (size_t)(t % PAGE) * d;
                    vd = kd + c->slot_elems;
                } else {
                    kd = sk + ((size_t)(q_row[s] + t - len) * kvh + h) * d;
                    vd = sv + ((size_t)(q_row[s] + t - len) * kvh + h) * d;
                }
                for (int j = 0; j < d; j++) {
                    kd[j] = fr_bf16_encode(rnd(&r));
                    vd[j] = fr_bf16_encode(rnd(&r));
                    (*kp)[(size_t)t * d + j] = fr_bf16_decode(kd[j]);
                    (*vp)[(size_t)t * d + j] = fr_bf16_decode(vd[j]);
                }
            }
        }
        page0 += np;
    }
    /* Queries with a spread that makes the softmax neither flat nor one-hot. */
    for (size_t i = 0; i < (size_t)rows * c->n_heads * d; i++) c->q[i] = 1.5f * rnd(&r);

    CUDA_OK(cudaMemcpy(c->pool, pool, pool_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->recent, rec, slot_all * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->step_k, sk, step_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->step_v, sv, step_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->bt_dev, bt, sizeof(int) * (c->cap_pages + 1), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->seqs_dev, c->seqs, sizeof(fr_paged_seq) * n, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(c->q_dev, c->q, sizeof(float) * rows * c->n_heads * d, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(c->out_dev, 0xFF, sizeof(uint16_t) * c->cap_rows * c->n_heads * d));
    free(pool); free(rec); free(sk); free(sv); free(perm); free(slots); free(order); free(bt); free(q_row);
}

static int max_ctx_of(const acase *c)
{
    int m = 1;
    for (int s = 0; s < c->n_seqs; s++)
        if (c->spec[s].len + c->spec[s].n_new > m) m = c->spec[s].len + c->spec[s].n_new;
    return m;
}

static int max_new_of(const acase *c)
{
    int m = 1;
    for (int s = 0; s < c->n_seqs; s++)
        if (c->spec[s].n_new > m) m = c->spec[s].n_new;
    return m;
}

/* ---- reference and check ------------------------------------------------ */

/* ref [rows][n_heads][d]: causal softmax attention of each sequence's rows. */
static void reference(const acase *c, float *ref)
{
    const int d = c->d, G = c->G, H = c->n_heads;
    const float scale = 1.0f / sqrtf((float)d);
    for (int s = 0; s < c->n_seqs; s++) {
        const int len = c->spec[s].len, n = c->spec[s].n_new, ctx = len + n, m = n * G;
        if (n == 0) continue;
        float *qg = xmalloc(sizeof(float) * m * d), *S = xmalloc(sizeof(float) * m * ctx);
        float *og = xmalloc(sizeof(float) * m * d);
        for (int h = 0; h < c->kvh; h++) {
            for (int i = 0; i < n; i++)
                for (int g = 0; g < G; g++)
                    for (int j = 0; j < d; j++)
                        qg[((size_t)i * G + g) * d + j] =
                            fr_bf16_round(c->q[((size_t)(c->seqs[s].q_row + i) * H + h * G + g) * d + j]);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, ctx, d, scale, qg, d,
                        c->k[s * c->kvh + h], d, 0.0f, S, ctx);
            for (int rI = 0; rI < m; rI++) {
                float *row = S + (size_t)rI * ctx;
                const int visible = len + rI / G + 1;
                float mx = -INFINITY;
                for (int t = 0; t < visible; t++) mx = fmaxf(mx, row[t]);
                double sum = 0.0;
                for (int t = 0; t < visible; t++) sum += exp((double)row[t] - mx);
                for (int t = 0; t < visible; t++) row[t] = (float)(exp((double)row[t] - mx) / sum);
                for (int t = visible; t < ctx; t++) row[t] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, d, ctx, 1.0f, S, ctx,
                        c->v[s * c->kvh + h], d, 0.0f, og, d);
            for (int i = 0; i < n; i++)
                for (int g = 0; g < G; g++)
                    memcpy(ref + ((size_t)(c->seqs[s].q_row + i) * H + h * G + g) * d,
                           og + ((size_t)i * G + g) * d, sizeof(float) * d);
        }
        free(qg); free(S); free(og);
    }
}

/* Compares the device output with the reference; returns the worst ratio
 * max|diff| / max|ref| over (token, head) rows. */
static double check(const acase *c, const char *label)
{
    const size_t n = (size_t)c->rows * c->n_heads * c->d;
    uint16_t *gpu = xmalloc(n * 2);
    float *ref = xmalloc(n * 4);
    CUDA_OK(cudaMemcpy(gpu, c->out_dev, n * 2, cudaMemcpyDeviceToHost));
    reference(c, ref);
    double worst = 0.0;
    int bad = 0;
    for (size_t r = 0; r < (size_t)c->rows * c->n_heads; r++) {
        double mref = 0.0, mdiff = 0.0;
        int nan = 0;
        for (int j = 0; j < c->d; j++) {
            float g = fr_bf16_decode(gpu[r * c->d + j]), x = ref[r * c->d + j];
            if (isnan(g)) nan = 1;
            mref = fmax(mref, fabs(x));
            mdiff = fmax(mdiff, fabs((double)g - x));
        }
        double ratio = nan ? INFINITY : mdiff / fmax(mref, 1e-30);
        if (ratio > worst) worst = ratio;
        if ((nan || mdiff > TOL * mref + 1e-6) && bad++ < 5)
            fprintf(stderr, "  %s: row %zu head %zu: max|diff| %.3g, max|ref| %.3g%s\n", label,
                    r / c->n_heads, r % c->n_heads, mdiff, mref, nan ? " (NaN)" : "");
    }
    printf("  %-40s worst row error %.2e of max|out| (limit %.0e)\n", label, worst, TOL);
    free(gpu); free(ref);
    assert_int_equal(bad, 0);
    return worst;
}

static void run(acase *c, int max_new, int max_ctx, void *ws, size_t ws_bytes)
{
    fr_status st = fr_attn_bf16(&c->kv, c->seqs_dev, c->n_seqs, max_new, max_ctx, c->q_dev, c->out_dev,
                                c->n_heads, ws, ws_bytes, 0);
    if (st) fail_msg("fr_attn_bf16: %s", fr_last_error());
    CUDA_OK(cudaDeviceSynchronize());
}

static void *alloc_workspace(const acase *c, int max_ctx, size_t *bytes)
{
    fr_status st = fr_attn_bf16_workspace_bytes(c->n_seqs, c->n_heads, c->kvh, c->d, max_ctx, bytes);
    if (st) fail_msg("workspace_bytes: %s", fr_last_error());
    void *ws = NULL;
    if (*bytes) CUDA_OK(cudaMalloc(&ws, *bytes));
    return ws;
}

/* Builds, runs with the full split plan, checks. */
static void run_case(int d, int kvh, int G, const seq_spec *spec, int n, uint64_t seed, const char *what)
{
    int rows = 0, pages = 0;
    for (int s = 0; s < n; s++) { rows += spec[s].n_new; pages += spec[s].len / PAGE; }
    acase c;
    case_alloc(&c, d, kvh, G, n, rows, pages);
    case_fill(&c, spec, seed);
    size_t ws_bytes;
    void *ws = alloc_workspace(&c, max_ctx_of(&c), &ws_bytes);
    int splits = 0;
    assert_int_equal(fr_attn_bf16_splits(n, kvh, d, max_ctx_of(&c), &splits), FR_OK);
    run(&c, max_new_of(&c), max_ctx_of(&c), ws, ws_bytes);
    char label[96];
    snprintf(label, sizeof label, "%s d=%d G=%d (%d splits)", what, d, G, splits);
    check(&c, label);
    cudaFree(ws);
    case_free(&c);
}

static const int GROUPS[] = {1, 3, 4, 5, 6, 7, 8, 16};
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- tests ---------------------------------------------------------------- */

static void test_decode_lengths(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const seq_spec spec[] = {{0, 1},   {1, 1},    {15, 1},   {127, 1},  {128, 1},
                                    {129, 1}, {1000, 1}, {4096, 1}, {33000, 1}};
    for (int i = 0; i < N_OF(GROUPS); i++)
        run_case(128, 2, GROUPS[i], spec, N_OF(spec), 100 + i, "decode mixed len");
    static const seq_spec one[] = {{33000, 1}};   /* batch 1: the widest split */
    run_case(128, 1, 8, one, 1, 7, "decode batch 1 len 33000");
}

/* The plan cut by a small workspace, no workspace at all, and a max_ctx
 * hint far below the real contexts: all must give the same answer. */
static void test_decode_split_fallbacks(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const seq_spec spec[] = {{1000, 1}, {33000, 1}, {5, 1}, {129, 1}};
    acase c;
    case_alloc(&c, 128, 2, 4, N_OF(spec), N_OF(spec), 300);
    case_fill(&c, spec, 11);
    size_t full;
    void *ws = alloc_workspace(&c, 33001, &full);
    assert_true(full > 0);
    size_t per_split = (size_t)c.n_seqs * c.kvh * c.G * (c.d + 1) * sizeof(float);

    run(&c, 1, 33001, NULL, 0);
    check(&c, "decode without workspace (1 split)");
    CUDA_OK(cudaMemset(c.out_dev, 0xFF, (size_t)c.rows * c.n_heads * c.d * 2));
    run(&c, 1, 33001, ws, 2 * per_split + 7);
    check(&c, "decode with room for 2 splits");
    CUDA_OK(cudaMemset(c.out_dev, 0xFF, (size_t)c.rows * c.n_heads * c.d * 2));
    run(&c, 1, 4096, ws, full);
    check(&c, "decode, max_ctx hint 4096 < 33001");
    CUDA_OK(cudaMemset(c.out_dev, 0xFF, (size_t)c.rows * c.n_heads * c.d * 2));
    run(&c, 1, 1, ws, full);
    check(&c, "decode, max_ctx hint 1");
    cudaFree(ws);
    case_free(&c);
}

/* A decode step captured once and replayed with other lengths, slots, rows
 * and block tables: the kernels read everything from device memory. */
static void test_decode_graph_replay(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const seq_spec a[] = {{100, 1}, {5000, 1}, {33000, 1}};
    static const seq_spec b[] = {{129, 1}, {40000, 1}, {7, 1}};   /* 40001 > the captured bound */
    acase c;
    case_alloc(&c, 128, 2, 8, 3, 3, 320);
    case_fill(&c, a, 21);
    size_t ws_bytes;
    void *ws = alloc_workspace(&c, 33001, &ws_bytes);   /* also sets the kernels up before capture */
    cudaStream_t st;
    CUDA_OK(cudaStreamCreate(&st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    fr_status s = fr_attn_bf16(&c.kv, c.seqs_dev, c.n_seqs, 1, 33001, c.q_dev, c.out_dev, c.n_heads, ws,
                               ws_bytes, st);
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    if (s) fail_msg("fr_attn_bf16 under capture: %s", fr_last_error());
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    check(&c, "graph, captured lengths");
    case_fill(&c, b, 22);
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    check(&c, "graph replay, new lengths");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    cudaFree(ws);
    case_free(&c);
}

static void test_prefill_chunks(void **state)
{
    (void)state;
    REQUIRE_GPU();
    /* Chunks of 1, 7, 128, 300, 512 over empty and filled caches; the n_new
     * == 1 sequences take the decode path within the same call. */
    static const seq_spec spec[] = {{0, 1},    {0, 7},     {0, 128},   {0, 300},
                                    {0, 512},  {1, 7},     {127, 128}, {128, 300},
                                    {129, 1},  {1000, 7},  {1000, 512}, {4096, 300}};
    for (int i = 0; i < N_OF(GROUPS); i++)
        run_case(128, 2, GROUPS[i], spec, N_OF(spec), 200 + i, "prefill chunks");
    static const seq_spec single[] = {{0, 512}};
    run_case(128, 2, 5, single, 1, 31, "prefill one chunk len 0");
    static const seq_spec longctx[] = {{33000, 64}, {0, 2}};
    run_case(128, 2, 7, longctx, 2, 32, "prefill after 33000 cached");
}

/* Deterministic mode's kernel (attention/attn_fixed.h) for every group
 * from 1 to 16: decode and prefill rows against the reference, and each
 * sequence's rows computed alone (the decode kernel for its one row) bitwise
 * equal to the same rows computed in the mixed batch (the kernel of
 * prefill blocks): a row's numbers must not depend on its neighbours. */
static void test_fixed_every_group(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const seq_spec spec[] = {{0, 1},    {1, 1},    {127, 1},  {128, 1}, {129, 1},
                                    {1000, 1}, {5000, 1}, {0, 7},    {130, 37}};
    const int n = N_OF(spec);
    int rows = 0, pages = 0;
    for (int s = 0; s < n; s++) { rows += spec[s].n_new; pages += spec[s].len / PAGE; }
    for (int G = 1; G <= 16; G++) {
        acase c;
        case_alloc(&c, 128, 2, G, n, rows, pages);
        case_fill(&c, spec, 300 + (uint64_t)G);
        const int max_ctx = max_ctx_of(&c), max_new = max_new_of(&c);
        size_t ws_bytes;
        FR_OK_OR_FAIL(fr_attn_fixed_workspace_bytes(c.n_heads, c.d, max_ctx, c.rows, &ws_bytes));
        void *ws;
        CUDA_OK(cudaMalloc(&ws, ws_bytes));
        FR_OK_OR_FAIL(fr_attn_fixed(&c.kv, c.seqs_dev, c.n_seqs, c.rows, max_new, max_ctx, c.q_dev, c.out_dev,
                                    c.n_heads, ws, ws_bytes, 0));
        CUDA_OK(cudaDeviceSynchronize());
        char label[96];
        snprintf(label, sizeof label, "fixed (deterministic) G=%d, mixed batch", G);
        check(&c, label);
        const size_t row_elems = (size_t)c.n_heads * c.d, all = (size_t)c.rows * row_elems;
        uint16_t *batch = xmalloc(all * 2), *alone = xmalloc(all * 2);
        CUDA_OK(cudaMemcpy(batch, c.out_dev, all * 2, cudaMemcpyDeviceToHost));
        int differ = 0;
        for (int s = 0; s < n; s++) {
            CUDA_OK(cudaMemset(c.out_dev, 0xFF, all * 2));
            FR_OK_OR_FAIL(fr_attn_fixed(&c.kv, c.seqs_dev + s, 1, c.rows, spec[s].n_new, max_ctx, c.q_dev,
                                        c.out_dev, c.n_heads, ws, ws_bytes, 0));
            CUDA_OK(cudaMemcpy(alone, c.out_dev, all * 2, cudaMemcpyDeviceToHost));
            const size_t at = (size_t)c.seqs[s].q_row * row_elems, cnt = (size_t)spec[s].n_new * row_elems;
            if (memcmp(alone + at, batch + at, cnt * 2)) {
                fprintf(stderr, "  G=%d: sequence %d (len %d, %d rows) differs alone and in the batch\n", G, s,
                        spec[s].len, spec[s].n_new);
                differ++;
            }
        }
        printf("  fixed G=%d: %d of %d sequences bitwise equal alone and in the batch\n", G, n - differ, n);
        assert_int_equal(differ, 0);
        free(batch);
        free(alone);
        cudaFree(ws);
        case_free(&c);
    }
}

static void test_head_dim_64(void **state)
{
    (void)state;
    REQUIRE_GPU();
    static const seq_spec dec[] = {{0, 1}, {129, 1}, {4096, 1}, {33000, 1}};
    run_case(64, 2, 4, dec, N_OF(dec), 41, "decode");
    static const seq_spec pre[] = {{0, 300}, {1000, 128}, {129, 1}, {5, 7}};
    run_case(64, 2, 5, pre, N_OF(pre), 42, "prefill");
}

static void test_bad_arguments(void **state)
{
    (void)state;
    static uint8_t dummy[64] __attribute__((aligned(16)));
    float *q = (float *)dummy;
    uint16_t *out = (uint16_t *)dummy;
    const fr_paged_seq *seqs = (const fr_paged_seq *)dummy;
    fr_paged_kv kv = {.pool = dummy, .block_bytes = 4 * PAGE * 128 * 2, .head_page_bytes = 4 * PAGE * 128,
                      .v_codes = 2 * PAGE * 128, .recent = (const uint16_t *)dummy,
                      .slot_elems = 2 * PAGE * 128, .step_k = (const uint16_t *)dummy,
                      .step_v = (const uint16_t *)dummy, .layer = 0, .n_layers = 1, .n_kv_heads = 2,
                      .head_dim = 128};
    assert_int_equal(fr_attn_bf16(&kv, seqs, 0, 1, 1, q, out, 8, NULL, 0, 0), FR_OK);   /* nothing to do */
    assert_int_equal(fr_attn_bf16(NULL, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_bf16(&kv, seqs, 1, 1, 1, NULL, out, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_bf16(&kv, seqs, 1, 1, 1, q, out, 7, NULL, 0, 0), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "group"));
    assert_int_equal(fr_attn_bf16(&kv, seqs, 1, 1, 1, q, out, 34, NULL, 0, 0), FR_EINVAL);   /* G 17 */
    assert_int_equal(fr_attn_bf16(&kv, seqs, 1, 0, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    assert_int_equal(fr_attn_bf16(&kv, seqs, -1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    fr_paged_kv bad = kv;
    bad.head_dim = 96;
    assert_int_equal(fr_attn_bf16(&bad, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EUNSUPPORTED);
    bad = kv;
    bad.layer = 1;
    assert_int_equal(fr_attn_bf16(&bad, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    bad = kv;
    bad.pool = dummy + 4;
    assert_int_equal(fr_attn_bf16(&bad, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "aligned"));
    bad = kv;
    bad.v_codes = 3 * PAGE * 128;   /* V would run past the head page */
    assert_int_equal(fr_attn_bf16(&bad, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    bad = kv;
    bad.recent = NULL;
    assert_int_equal(fr_attn_bf16(&bad, seqs, 1, 1, 1, q, out, 8, NULL, 0, 0), FR_EINVAL);
    size_t b;
    assert_int_equal(fr_attn_bf16_workspace_bytes(4, 8, 2, 80, 100, &b), FR_EUNSUPPORTED);
    assert_int_equal(fr_attn_bf16_workspace_bytes(4, 9, 2, 128, 100, &b), FR_EINVAL);
    assert_int_equal(fr_attn_bf16_workspace_bytes(4, 8, 2, 128, 100, NULL), FR_EINVAL);
}

/* Decode timing, not asserted: 32 query / 8 KV heads, d = 128, one layer;
 * KV bytes read = sum of contexts x 8 heads x 128 x 2 (K, V) x 2 bytes. */
static void test_decode_timing(void **state)
{
    (void)state;
    REQUIRE_GPU();
    const int d = 128, kvh = 8, H = 32, iters = 20;
    const int batches[] = {1, 16, 64}, ctxs[] = {4096, 32768};
    const size_t hpb = (size_t)4 * PAGE * d, block_bytes = hpb * kvh, slot_elems = (size_t)kvh * PAGE * d;
    const int max_b = 64, max_pages = (32768 - 1) / PAGE;
    const int n_blocks = max_b * max_pages;
    uint8_t *pool = NULL;
    if (cudaMalloc((void **)&pool, block_bytes * n_blocks) != cudaSuccess) {
        cudaGetLastError();
        printf("  timing skipped: cannot allocate %.1f GB of KV pool\n", block_bytes * (double)n_blocks / 1e9);
        return;
    }
    uint16_t *recent, *stk, *stv, *out;
    float *q;
    int *bt;
    fr_paged_seq *seqs_dev;
    CUDA_OK(cudaMemset(pool, 0x3C, block_bytes * n_blocks));   /* BF16 0x3C3C: finite */
    CUDA_OK(cudaMalloc((void **)&recent, 2 * slot_elems * max_b * 2));
    CUDA_OK(cudaMemset(recent, 0x3C, 2 * slot_elems * max_b * 2));
    CUDA_OK(cudaMalloc((void **)&stk, (size_t)max_b * kvh * d * 2));
    CUDA_OK(cudaMalloc((void **)&stv, (size_t)max_b * kvh * d * 2));
    CUDA_OK(cudaMemset(stk, 0x3C, (size_t)max_b * kvh * d * 2));
    CUDA_OK(cudaMemset(stv, 0x3C, (size_t)max_b * kvh * d * 2));
    CUDA_OK(cudaMalloc((void **)&q, (size_t)max_b * H * d * 4));
    CUDA_OK(cudaMemset(q, 0, (size_t)max_b * H * d * 4));
    CUDA_OK(cudaMalloc((void **)&out, (size_t)max_b * H * d * 2));
    CUDA_OK(cudaMalloc((void **)&bt, sizeof(int) * n_blocks));
    CUDA_OK(cudaMalloc((void **)&seqs_dev, sizeof(fr_paged_seq) * max_b));
    int *perm = xmalloc(sizeof(int) * n_blocks);
    fr_test_rng r = {5};
    shuffle(&r, perm, n_blocks);
    CUDA_OK(cudaMemcpy(bt, perm, sizeof(int) * n_blocks, cudaMemcpyHostToDevice));
    free(perm);
    fr_paged_kv kv = {.pool = pool, .block_bytes = block_bytes, .head_page_bytes = hpb, .k_codes = 0,
                      .v_codes = (size_t)2 * PAGE * d, .recent = recent, .slot_elems = slot_elems,
                      .step_k = stk, .step_v = stv, .layer = 0, .n_layers = 1, .n_kv_heads = kvh,
                      .head_dim = d};
    size_t ws_bytes = 0;
    assert_int_equal(fr_attn_bf16_workspace_bytes(max_b, H, kvh, d, 32768, &ws_bytes), FR_OK);
    void *ws = NULL;
    if (ws_bytes) CUDA_OK(cudaMalloc(&ws, ws_bytes));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    printf("  decode timing, 32 q / 8 kv heads, d 128 (one layer):\n");
    for (int ci = 0; ci < 2; ci++)
        for (int bi = 0; bi < 3; bi++) {
            const int B = batches[bi], ctx = ctxs[ci], len = ctx - 1;
            fr_paged_seq seqs[64];
            for (int s = 0; s < B; s++)
                seqs[s] = (fr_paged_seq){.block_table = bt + (size_t)s * max_pages, .len = len, .n_new = 1,
                                         .q_row = s, .slot = s};
            CUDA_OK(cudaMemcpy(seqs_dev, seqs, sizeof(fr_paged_seq) * B, cudaMemcpyHostToDevice));
            int splits = 0;
            assert_int_equal(fr_attn_bf16_splits(B, kvh, d, ctx, &splits), FR_OK);
            for (int it = 0; it < 3; it++)
                assert_int_equal(fr_attn_bf16(&kv, seqs_dev, B, 1, ctx, q, out, H, ws, ws_bytes, 0), FR_OK);
            CUDA_OK(cudaEventRecord(e0, 0));
            for (int it = 0; it < iters; it++)
                assert_int_equal(fr_attn_bf16(&kv, seqs_dev, B, 1, ctx, q, out, H, ws, ws_bytes, 0), FR_OK);
            CUDA_OK(cudaEventRecord(e1, 0));
            CUDA_OK(cudaEventSynchronize(e1));
            float ms = 0.0f;
            CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
            const double us = 1e3 * ms / iters;
            const double bytes = (double)B * ctx * kvh * d * 2 * 2 + (double)B * H * d * (4 + 2);
            printf("    batch %2d ctx %5d: %3d splits %9.1f us %9.1f MB %7.0f GB/s\n", B, ctx, splits, us,
                   bytes / 1e6, bytes / (us * 1e3));
        }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(ws); cudaFree(pool); cudaFree(recent); cudaFree(stk); cudaFree(stv); cudaFree(q);
    cudaFree(out); cudaFree(bt); cudaFree(seqs_dev);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_bad_arguments),
                 cmocka_unit_test(test_decode_lengths),
                 cmocka_unit_test(test_decode_split_fallbacks),
                 cmocka_unit_test(test_decode_graph_replay),
                 cmocka_unit_test(test_prefill_chunks),
                 cmocka_unit_test(test_fixed_every_group),
                 cmocka_unit_test(test_head_dim_64),
                 cmocka_unit_test(test_decode_timing))
