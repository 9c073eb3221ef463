/* Every CUDA op of the forward pass and of weight staging against its CPU
 * op, as one table of cases (op x dtype x shape), in the manner of ggml's
 * test-backend-ops: each case draws its inputs, runs the CPU op on the
 * values the GPU sees (BF16-rounded where the GPU reads BF16), runs the
 * CUDA op, and compares the two outputs by their normalized mean squared
 * error
 *
 *     NMSE = sum (gpu - cpu)^2 / sum cpu^2
 *
 * against the op's bound, or bit for bit for the ops that must agree
 * exactly. One line per case; a failing case fails its op's test after the
 * op's other cases ran. FR_GPU_TEST_FILTER=<op> runs one op (names below).
 *
 * Bounds, from the arithmetic (u = 2^-8, BF16's unit roundoff; the BF16-out
 * ops are also held to one rounding per element):
 *   exact        embed, f32_to_bf16, weights_unpack (F32, F16, BF16 to BF16
 *                with the non-finite flag): the same bits.
 *   BF16 out     rmsnorm, rmsnorm_rows, swiglu, swiglu_rows: one BF16
 *                rounding of the CPU's float32 value gives NMSE near
 *                u^2 / 12 = 2^-19.6; bound 2^-16.
 *   F32 out      rmsnorm_f32, qk_norm_rope: the same float32 operations in
 *                another order, a few float32 ulps: NMSE near 2^-46; bound
 *                2^-32, far below anything BF16-sized.
 *   gemm         the same exact BF16 products summed in FP32 in another
 *                order: bound 2^-24 (FP16/BF16 accumulation gives 2^-16 or
 *                worse); BF16 output 2^-14.
 *
 * Without a CUDA device every test is skipped with a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gpu_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "attention/fp_formats.h"
#include "base/safetensors.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/ops_cpu.h"
#include "rollout/model/ops_cuda.h"
#include "rollout/model/weights_unpack.h"
#include "tests/unit/test_util.h"

/* Qwen3-4B */
enum { H4 = 2560, HEADS4 = 32, KV4 = 8, D4 = 128, I4 = 9728, QKV4 = (HEADS4 + 2 * KV4) * D4 };
#define EPS 1e-6f
#define THETA 1000000.0
#define MAX_POS 4096

typedef enum {
    OP_EMBED, OP_F32_TO_BF16, OP_UNPACK, OP_RMSNORM, OP_RMSNORM_ROWS, OP_QK_NORM_ROPE, OP_SWIGLU, OP_SWIGLU_ROWS,
    OP_GEMM, N_OPS
} op_kind;

/* Case flags. */
enum { F_DELTA = 1, F_BETA = 2, F_MISALIGN = 4, F_NAN = 8 };

/* One row of the table. ne: the op's sizes (see each op's function); dtype:
 * the output's (F32 or BF16), for weights_unpack the input's. */
typedef struct {
    op_kind op;
    fr_dtype dtype;
    int64_t ne[4];
    int flags;
} op_case;

static const op_case CASES[] = {
    /* embed: tokens, hidden, vocab */
    {OP_EMBED, FR_DTYPE_F32, {33, H4, 1000}, 0},
    {OP_EMBED, FR_DTYPE_F32, {5, H4, 300}, F_MISALIGN},
    {OP_EMBED, FR_DTYPE_F32, {9, 7, 50}, 0},
    {OP_EMBED, FR_DTYPE_F32, {300, 128, 272}, 0},
    /* f32_to_bf16: elements */
    {OP_F32_TO_BF16, FR_DTYPE_BF16, {1}, 0},
    {OP_F32_TO_BF16, FR_DTYPE_BF16, {4099}, 0},
    {OP_F32_TO_BF16, FR_DTYPE_BF16, {4099}, F_MISALIGN},
    {OP_F32_TO_BF16, FR_DTYPE_BF16, {1 << 20}, 0},
    /* weights_unpack: elements, in the input dtype */
    {OP_UNPACK, FR_DTYPE_BF16, {1}, 0},
    {OP_UNPACK, FR_DTYPE_BF16, {(int64_t)H4 * D4}, 0},
    {OP_UNPACK, FR_DTYPE_BF16, {100003}, F_NAN},
    {OP_UNPACK, FR_DTYPE_F32, {4097}, 0},
    {OP_UNPACK, FR_DTYPE_F32, {(int64_t)I4 * 64}, 0},
    {OP_UNPACK, FR_DTYPE_F32, {77777}, F_NAN},
    {OP_UNPACK, FR_DTYPE_F16, {4097}, 0},
    {OP_UNPACK, FR_DTYPE_F16, {(int64_t)I4 * 64}, F_NAN},
    /* rmsnorm: rows, width */
    {OP_RMSNORM, FR_DTYPE_BF16, {1, H4}, 0},
    {OP_RMSNORM, FR_DTYPE_BF16, {64, H4}, F_DELTA},
    {OP_RMSNORM, FR_DTYPE_BF16, {3, 7}, 0},
    {OP_RMSNORM, FR_DTYPE_BF16, {2, I4}, F_DELTA},
    {OP_RMSNORM, FR_DTYPE_BF16, {3, 30000}, 0},
    {OP_RMSNORM, FR_DTYPE_BF16, {4, H4}, F_DELTA | F_MISALIGN},
    {OP_RMSNORM, FR_DTYPE_F32, {1, H4}, 0},
    {OP_RMSNORM, FR_DTYPE_F32, {64, H4}, F_DELTA},
    {OP_RMSNORM, FR_DTYPE_F32, {3, 2561}, F_DELTA},
    {OP_RMSNORM, FR_DTYPE_F32, {4, 100}, F_MISALIGN},
    /* rmsnorm_rows: rows of x, width, rows out (every third id out of range) */
    {OP_RMSNORM_ROWS, FR_DTYPE_BF16, {10, H4, 7}, 0},
    {OP_RMSNORM_ROWS, FR_DTYPE_BF16, {10, 13, 7}, 0},
    {OP_RMSNORM_ROWS, FR_DTYPE_BF16, {64, H4, 64}, 0},
    /* qk_norm_rope: rows, q heads, kv heads, head dim */
    {OP_QK_NORM_ROPE, FR_DTYPE_F32, {1, HEADS4, KV4, D4}, 0},
    {OP_QK_NORM_ROPE, FR_DTYPE_F32, {17, HEADS4, KV4, D4}, 0},
    {OP_QK_NORM_ROPE, FR_DTYPE_F32, {3, 4, 2, 64}, 0},
    {OP_QK_NORM_ROPE, FR_DTYPE_F32, {5, 3, 1, 96}, 0},
    {OP_QK_NORM_ROPE, FR_DTYPE_F32, {4, 2, 2, 512}, 0},
    /* swiglu: elements */
    {OP_SWIGLU, FR_DTYPE_BF16, {1}, 0},
    {OP_SWIGLU, FR_DTYPE_BF16, {1000}, 0},
    {OP_SWIGLU, FR_DTYPE_BF16, {(int64_t)I4 * 3 + 5}, 0},
    /* swiglu_rows: rows, intermediate */
    {OP_SWIGLU_ROWS, FR_DTYPE_BF16, {1, I4}, 0},
    {OP_SWIGLU_ROWS, FR_DTYPE_BF16, {64, I4}, 0},
    {OP_SWIGLU_ROWS, FR_DTYPE_BF16, {3, 13}, 0},
    /* gemm: M, N, K (y = x . w^T, + y when beta) */
    {OP_GEMM, FR_DTYPE_F32, {1, QKV4, H4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {1, H4, HEADS4 * D4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {1, 2 * I4, H4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {1, H4, I4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {64, QKV4, H4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {256, 2 * I4, H4}, 0},
    {OP_GEMM, FR_DTYPE_F32, {13, 33, 129}, 0},
    {OP_GEMM, FR_DTYPE_F32, {17, 1000, 2559}, 0},
    {OP_GEMM, FR_DTYPE_F32, {1, 1, 1}, 0},
    {OP_GEMM, FR_DTYPE_F32, {33, H4, I4}, F_BETA},
    {OP_GEMM, FR_DTYPE_F32, {4, 1024, H4}, F_MISALIGN},
    {OP_GEMM, FR_DTYPE_BF16, {1, H4, HEADS4 * D4}, 0},
    {OP_GEMM, FR_DTYPE_BF16, {64, KV4 * D4, H4}, 0},
    {OP_GEMM, FR_DTYPE_BF16, {3, 5, 7}, F_BETA},
    {OP_GEMM, FR_DTYPE_BF16, {5, 64, 64}, F_MISALIGN},
};

static const char *const OP_NAMES[N_OPS] = {"embed", "f32_to_bf16", "weights_unpack", "rmsnorm", "rmsnorm_rows",
                                            "qk_norm_rope", "swiglu", "swiglu_rows", "gemm"};

/* The outputs of both sides as floats (BF16 decoded), n of them. */
typedef struct {
    float *got, *want;
    size_t n;
} outputs;

static cudaStream_t g_stream;
static fr_gemm *g_gemm;

/* ---- buffers ---------------------------------------------------------------- */

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return p;
}

static void *dmalloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

/* Copies and fills on the legacy default stream are not ordered with the
 * non-blocking g_stream the ops run on (and a copy from pageable memory may
 * still be in flight when cudaMemcpy returns): wait for the device. */
static void upload(void *d, const void *h, size_t bytes)
{
    CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
}

static void fill(void *d, int byte, size_t bytes)
{
    CUDA_OK(cudaMemset(d, byte, bytes));
    CUDA_OK(cudaDeviceSynchronize());
}

static void download(void *h, const void *d, size_t bytes)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

static float *randn(fr_test_rng *r, size_t n, float mean, float scale)
{
    float *p = xmalloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = mean + scale * fr_test_normal(r);
    return p;
}

/* BF16 values mean + scale * N(0, 1): bits in *bits, float32 values returned. */
static float *randn_bf16(fr_test_rng *r, size_t n, float mean, float scale, uint16_t **bits)
{
    float *f = xmalloc(n * sizeof *f);
    uint16_t *h = xmalloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) {
        h[i] = fr_bf16_encode(mean + scale * fr_test_normal(r));
        f[i] = fr_bf16_decode(h[i]);
    }
    *bits = h;
    return f;
}

/* A BF16 device output, decoded. */
static float *download_bf16(const uint16_t *d, size_t n)
{
    uint16_t *h = xmalloc(n * sizeof *h);
    download(h, d, n * sizeof *h);
    float *f = xmalloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = fr_bf16_decode(h[i]);
    free(h);
    return f;
}

static float *download_f32(const float *d, size_t n)
{
    float *f = xmalloc(n * sizeof *f);
    download(f, d, n * sizeof *f);
    return f;
}

/* ---- the ops ------------------------------------------------------------------ */

static outputs run_embed(const op_case *c, fr_test_rng *r)
{
    const int n = (int)c->ne[0], hidden = (int)c->ne[1], vocab = (int)c->ne[2];
    const size_t off = c->flags & F_MISALIGN ? 1 : 0, nx = (size_t)n * (size_t)hidden;
    uint16_t *table;
    float *tf = randn_bf16(r, (size_t)vocab * hidden, 0.0f, 0.05f, &table);
    int *ids = xmalloc((size_t)n * sizeof *ids), *cpu_ids = xmalloc((size_t)n * sizeof *ids);
    for (int t = 0; t < n; t++) {
        ids[t] = t == 1 ? -1 : t == 2 ? vocab : (int)(fr_test_u64(r) % (uint64_t)vocab);   /* out of range: zeros */
        cpu_ids[t] = ids[t] >= vocab ? -1 : ids[t];
    }
    outputs o = {NULL, xmalloc(nx * sizeof(float)), nx};
    fr_embed(o.want, tf, cpu_ids, n, hidden);
    uint16_t *dt = dmalloc((size_t)vocab * hidden * sizeof *dt);
    int *dids = dmalloc((size_t)n * sizeof *dids);
    float *dx = dmalloc((nx + off) * sizeof *dx);
    upload(dt, table, (size_t)vocab * hidden * sizeof *table);
    upload(dids, ids, (size_t)n * sizeof *ids);
    fill(dx, 0xff, (nx + off) * sizeof *dx);   /* NaN: every value must be written */
    FR_OK_OR_FAIL(fr_cuda_embed(dx + off, dt, dids, n, hidden, vocab, g_stream));
    o.got = download_f32(dx + off, nx);
    CUDA_OK(cudaFree(dt)); CUDA_OK(cudaFree(dids)); CUDA_OK(cudaFree(dx));
    free(table); free(tf); free(ids); free(cpu_ids);
    return o;
}

static outputs run_f32_to_bf16(const op_case *c, fr_test_rng *r)
{
    const size_t n = (size_t)c->ne[0], off = c->flags & F_MISALIGN ? 1 : 0;
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,   /* +-0, +-inf */
        0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu,   /* NaNs, signalling too */
        0x7f7fffffu, 0xff7fffffu, 0x7f7f7fffu, 0x7f7f8000u,   /* max float; just below and at a tie to inf */
        0x00000001u, 0x00008000u, 0x00018000u, 0x007fffffu,   /* subnormals, ties among them */
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu,   /* ties to even (down, up), just above/below */
        0xbf808000u, 0xbf818000u, 0x00800000u, 0x80800000u,
    };
    const size_t ns = sizeof special / sizeof special[0];
    float *in = xmalloc(n * sizeof *in);
    for (size_t i = 0; i < n; i++) {
        if (n >= ns && i < ns) {
            memcpy(&in[i], &special[i], 4);
        } else if (i % 3 == 0) {
            uint32_t u = (uint32_t)fr_test_u64(r);   /* any bit pattern: NaNs, infinities, subnormals */
            memcpy(&in[i], &u, 4);
        } else {
            in[i] = ldexpf(fr_test_normal(r), (int)(fr_test_u64(r) % 250) - 125);
        }
    }
    outputs o = {NULL, xmalloc(n * sizeof(float)), n};
    for (size_t i = 0; i < n; i++) o.want[i] = fr_bf16_decode(fr_bf16_encode(in[i]));
    float *din = dmalloc((n + off) * sizeof *din);
    uint16_t *dout = dmalloc((n + off) * sizeof *dout);
    upload(din + off, in, n * sizeof *in);
    FR_OK_OR_FAIL(fr_cuda_f32_to_bf16(dout + off, din + off, n, g_stream));
    o.got = download_bf16(dout + off, n);
    CUDA_OK(cudaFree(din)); CUDA_OK(cudaFree(dout));
    free(in);
    return o;
}

/* Weight staging's conversion (rollout/model/weights_unpack.h): values of
 * the case's dtype to BF16 as the host rounds them, and with F_NAN one
 * non-finite value whose index the flag must report. */
static outputs run_unpack(const op_case *c, fr_test_rng *r)
{
    const size_t n = (size_t)c->ne[0], es = fr_dtype_size(c->dtype);
    unsigned char *in = xmalloc(n * es);
    float *f = randn(r, n, 0.0f, 0.1f);
    const size_t bad_at = c->flags & F_NAN ? n / 3 : (size_t)-1;
    if (bad_at < n) f[bad_at] = c->dtype == FR_DTYPE_F16 ? INFINITY : NAN;
    for (size_t i = 0; i < n; i++) {
        if (c->dtype == FR_DTYPE_F32) {
            memcpy(in + 4 * i, &f[i], 4);
        } else if (c->dtype == FR_DTYPE_BF16) {
            const uint16_t h = fr_bf16_encode(f[i]);
            memcpy(in + 2 * i, &h, 2);
        } else {   /* F16 by hand: the values are normal and small, infinity aside */
            uint32_t u;
            memcpy(&u, &f[i], 4);
            const uint32_t sign = (u >> 16) & 0x8000u;
            const int e = (int)((u >> 23) & 0xff) - 127 + 15;
            uint16_t h = isinf(f[i]) ? (uint16_t)(sign | 0x7c00u)
                         : e <= 0 ? (uint16_t)sign : (uint16_t)(sign | (uint32_t)e << 10 | ((u >> 13) & 0x3ffu));
            memcpy(in + 2 * i, &h, 2);
        }
    }
    float *ref = xmalloc(n * sizeof *ref);
    fr_st_tensor t = {.name = "case", .dtype = c->dtype, .ndim = 1, .shape = {(int64_t)n}, .nbytes = n * es,
                      .data = in};
    FR_OK_OR_FAIL(fr_st_tensor_to_f32(&t, ref, n));
    outputs o = {NULL, xmalloc(n * sizeof(float)), n};
    /* BF16 passes through as it came (a bad value too, flagged); F32 and F16
     * round to nearest even, a bad value written as zero */
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, in + 2 * i, 2);
        o.want[i] = c->dtype == FR_DTYPE_BF16 ? fr_bf16_decode(h)
                    : isfinite(ref[i])         ? fr_bf16_decode(fr_bf16_encode(ref[i]))
                                               : 0.0f;
    }
    void *din = dmalloc(n * es);
    uint16_t *dout = dmalloc(n * sizeof *dout);
    unsigned long long *dbad = dmalloc(sizeof *dbad), bad = 0;
    upload(din, in, n * es);
    fill(dbad, 0xff, sizeof *dbad);
    FR_OK_OR_FAIL(fr_weights_unpack_launch(din, (int)c->dtype, n, dout, dbad, 5, g_stream));
    download(&bad, dbad, sizeof bad);
    if (bad_at < n) assert_true(bad == ((5ull << 40) | bad_at));
    else assert_true(bad == ~0ull);
    o.got = download_bf16(dout, n);
    CUDA_OK(cudaFree(din)); CUDA_OK(cudaFree(dout)); CUDA_OK(cudaFree(dbad));
    free(in); free(f); free(ref);
    return o;
}

static outputs run_rmsnorm(const op_case *c, fr_test_rng *r)
{
    const int rows = (int)c->ne[0], n = (int)c->ne[1], f32 = c->dtype == FR_DTYPE_F32;
    const size_t nx = (size_t)rows * (size_t)n, off = c->flags & F_MISALIGN ? 1 : 0;
    float *x = randn(r, nx, 0.0f, 3.0f), *delta = c->flags & F_DELTA ? randn(r, nx, 0.0f, 1.0f) : NULL;
    uint16_t *w;
    float *wf = randn_bf16(r, (size_t)n, 1.0f, 0.2f, &w), *xs = xmalloc(nx * sizeof *xs);
    for (size_t i = 0; i < nx; i++) xs[i] = delta ? x[i] + delta[i] : x[i];
    outputs o = {NULL, xmalloc(nx * sizeof(float)), nx};
    fr_rmsnorm(o.want, xs, wf, rows, n, EPS);
    float *dx = dmalloc((nx + off) * sizeof *dx), *dd = delta ? dmalloc((nx + off) * sizeof *dd) : NULL;
    uint16_t *dw = dmalloc(((size_t)n + off) * sizeof *dw);
    void *dout = dmalloc((nx + off) * sizeof(float));
    upload(dx + off, x, nx * sizeof *x);
    if (dd) upload(dd + off, delta, nx * sizeof *delta);
    upload(dw + off, w, (size_t)n * sizeof *w);
    if (f32) {
        FR_OK_OR_FAIL(fr_cuda_rmsnorm_f32((float *)dout + off, dx + off, dd ? dd + off : NULL, dw + off, rows, n, EPS,
                                          g_stream));
        o.got = download_f32((float *)dout + off, nx);
    } else {
        FR_OK_OR_FAIL(fr_cuda_rmsnorm((uint16_t *)dout + off, dx + off, dd ? dd + off : NULL, dw + off, rows, n, EPS,
                                      g_stream));
        o.got = download_bf16((uint16_t *)dout + off, nx);
    }
    float *gx = download_f32(dx + off, nx);   /* the residual stream after the add: the CPU's bits */
    assert_memory_equal(gx, xs, nx * sizeof *xs);
    free(gx);
    CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dout));
    if (dd) CUDA_OK(cudaFree(dd));
    free(x); free(delta); free(w); free(wf); free(xs);
    return o;
}

static outputs run_rmsnorm_rows(const op_case *c, fr_test_rng *r)
{
    const int x_rows = (int)c->ne[0], n = (int)c->ne[1], n_out = (int)c->ne[2];
    float *x = randn(r, (size_t)x_rows * n, 0.0f, 2.0f);
    uint16_t *w;
    float *wf = randn_bf16(r, (size_t)n, 1.0f, 0.2f, &w);
    int *ids = xmalloc((size_t)n_out * sizeof *ids);
    for (int i = 0; i < n_out; i++) ids[i] = i % 3 == 2 ? (i % 2 ? -1 : x_rows) : (int)(fr_test_u64(r) % (uint64_t)x_rows);
    const size_t no = (size_t)n_out * (size_t)n;
    outputs o = {NULL, xmalloc(no * sizeof(float)), no};
    for (int i = 0; i < n_out; i++) {
        float *dst = o.want + (size_t)i * n;
        if (ids[i] < 0 || ids[i] >= x_rows) memset(dst, 0, (size_t)n * sizeof *dst);
        else fr_rmsnorm(dst, x + (size_t)ids[i] * n, wf, 1, n, EPS);
    }
    float *dx = dmalloc((size_t)x_rows * n * sizeof *dx);
    uint16_t *dw = dmalloc((size_t)n * sizeof *dw), *dout = dmalloc(no * sizeof *dout);
    int *dids = dmalloc((size_t)n_out * sizeof *dids);
    upload(dx, x, (size_t)x_rows * n * sizeof *x);
    upload(dw, w, (size_t)n * sizeof *w);
    upload(dids, ids, (size_t)n_out * sizeof *ids);
    FR_OK_OR_FAIL(fr_cuda_rmsnorm_rows(dout, dx, x_rows, dids, n_out, dw, n, EPS, g_stream));
    o.got = download_bf16(dout, no);
    CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dout)); CUDA_OK(cudaFree(dids));
    free(x); free(w); free(wf); free(ids);
    return o;
}

/* q then k of every row, normalized and rotated; rows at positions out of
 * the table are zeros. */
static void ref_norm_rope(float *x, const float *wf, const int *pos, int rows, int heads, int d)
{
    for (int t = 0; t < rows; t++) {
        float *xr = x + (size_t)t * heads * d;
        if (pos[t] < 0 || pos[t] >= MAX_POS) {
            memset(xr, 0, (size_t)heads * d * sizeof *xr);
            continue;
        }
        fr_rmsnorm(xr, xr, wf, heads, d, EPS);
        fr_rope(xr, heads, d, pos[t], THETA, NULL);
    }
}

static outputs run_qk_norm_rope(const op_case *c, fr_test_rng *r)
{
    const int rows = (int)c->ne[0], H = (int)c->ne[1], KVH = (int)c->ne[2], d = (int)c->ne[3];
    const size_t nq = (size_t)rows * H * d, nk = (size_t)rows * KVH * d;
    float *q = randn(r, nq, 0.0f, 2.0f), *k = randn(r, nk, 0.0f, 2.0f);
    uint16_t *qw, *kw;
    float *qwf = randn_bf16(r, (size_t)d, 1.0f, 0.3f, &qw), *kwf = randn_bf16(r, (size_t)d, 1.0f, 0.3f, &kw);
    int *pos = xmalloc((size_t)rows * sizeof *pos);
    for (int t = 0; t < rows; t++) pos[t] = t == 3 ? MAX_POS : (int)(fr_test_u64(r) % MAX_POS);
    outputs o = {NULL, xmalloc((nq + nk) * sizeof(float)), nq + nk};
    memcpy(o.want, q, nq * sizeof *q);
    memcpy(o.want + nq, k, nk * sizeof *k);
    ref_norm_rope(o.want, qwf, pos, rows, H, d);
    ref_norm_rope(o.want + nq, kwf, pos, rows, KVH, d);
    float *dc, *ds;
    FR_OK_OR_FAIL(fr_cuda_rope_table_new(MAX_POS, d, THETA, NULL, &dc, &ds));
    float *dq = dmalloc(nq * sizeof *dq), *dk = dmalloc(nk * sizeof *dk);
    uint16_t *dqw = dmalloc((size_t)d * sizeof *dqw), *dkw = dmalloc((size_t)d * sizeof *dkw);
    int *dpos = dmalloc((size_t)rows * sizeof *dpos);
    upload(dq, q, nq * sizeof *q);
    upload(dk, k, nk * sizeof *k);
    upload(dqw, qw, (size_t)d * sizeof *qw);
    upload(dkw, kw, (size_t)d * sizeof *kw);
    upload(dpos, pos, (size_t)rows * sizeof *pos);
    FR_OK_OR_FAIL(fr_cuda_qk_norm_rope(dq, dk, dqw, dkw, dpos, rows, H, KVH, d, EPS, dc, ds, MAX_POS, g_stream));
    o.got = xmalloc((nq + nk) * sizeof(float));
    download(o.got, dq, nq * sizeof(float));
    download(o.got + nq, dk, nk * sizeof(float));
    fr_cuda_rope_table_free(&dc, &ds);
    CUDA_OK(cudaFree(dq)); CUDA_OK(cudaFree(dk)); CUDA_OK(cudaFree(dqw)); CUDA_OK(cudaFree(dkw));
    CUDA_OK(cudaFree(dpos));
    free(q); free(k); free(qw); free(kw); free(qwf); free(kwf); free(pos);
    return o;
}

/* Gates with the saturating values among normal ones. */
static void fill_gate(fr_test_rng *r, float *g, size_t n)
{
    static const float special[] = {-100.0f, -20.0f, -0.0f, 0.0f, 20.0f, 100.0f, -87.0f, 88.5f};
    for (size_t i = 0; i < n; i++) g[i] = i < 8 && n > 64 ? special[i] : 3.0f * fr_test_normal(r);
}

static outputs run_swiglu(const op_case *c, fr_test_rng *r)
{
    const int rows = c->op == OP_SWIGLU_ROWS ? (int)c->ne[0] : 1;
    const size_t I = (size_t)(c->op == OP_SWIGLU_ROWS ? c->ne[1] : c->ne[0]), n = (size_t)rows * I;
    float *g = xmalloc(n * sizeof *g), *u = randn(r, n, 0.0f, 2.0f), *gu = xmalloc(2 * n * sizeof *gu);
    for (int t = 0; t < rows; t++) {
        fill_gate(r, g + (size_t)t * I, I);
        memcpy(gu + (size_t)t * 2 * I, g + (size_t)t * I, I * sizeof *g);       /* [gate | up] per row */
        memcpy(gu + (size_t)t * 2 * I + I, u + (size_t)t * I, I * sizeof *u);
    }
    outputs o = {NULL, xmalloc(n * sizeof(float)), n};
    fr_swiglu(o.want, g, u, (int)n);
    uint16_t *dout = dmalloc(n * sizeof *dout);
    if (c->op == OP_SWIGLU_ROWS) {
        float *dgu = dmalloc(2 * n * sizeof *dgu);
        upload(dgu, gu, 2 * n * sizeof *gu);
        FR_OK_OR_FAIL(fr_cuda_swiglu_rows(dout, dgu, rows, (int)I, g_stream));
        o.got = download_bf16(dout, n);
        CUDA_OK(cudaFree(dgu));
    } else {
        float *dg = dmalloc(n * sizeof *dg), *du = dmalloc(n * sizeof *du);
        upload(dg, g, n * sizeof *g);
        upload(du, u, n * sizeof *u);
        FR_OK_OR_FAIL(fr_cuda_swiglu(dout, dg, du, n, g_stream));
        o.got = download_bf16(dout, n);
        CUDA_OK(cudaFree(dg)); CUDA_OK(cudaFree(du));
    }
    CUDA_OK(cudaFree(dout));
    free(g); free(u); free(gu);
    return o;
}

static outputs run_gemm(const op_case *c, fr_test_rng *r)
{
    const int M = (int)c->ne[0], N = (int)c->ne[1], K = (int)c->ne[2], bf16 = c->dtype == FR_DTYPE_BF16;
    const float beta = c->flags & F_BETA ? 1.0f : 0.0f;
    const size_t nx = (size_t)M * K, nw = (size_t)N * K, ny = (size_t)M * N, off = c->flags & F_MISALIGN ? 1 : 0;
    uint16_t *hx, *hw;
    float *fx = randn_bf16(r, nx, 0.0f, 1.0f, &hx), *fw = randn_bf16(r, nw, 0.0f, 0.05f, &hw);
    float *y0 = beta != 0.0f ? randn(r, ny, 0.0f, 1.0f) : NULL;
    outputs o = {NULL, xmalloc(ny * sizeof(float)), ny};
    fr_matmul(o.want, fx, fw, M, N, K);
    const size_t ysz = bf16 ? sizeof(uint16_t) : sizeof(float);
    uint16_t *dx = dmalloc((nx + off) * sizeof *dx), *dw = dmalloc((nw + off) * sizeof *dw);
    char *dy = dmalloc((ny + off) * ysz);
    upload(dx + off, hx, nx * sizeof *hx);
    upload(dw + off, hw, nw * sizeof *hw);
    if (y0) {
        uint16_t *t = xmalloc(ny * sizeof *t);
        for (size_t i = 0; i < ny; i++) {
            if (bf16) y0[i] = fr_bf16_round(y0[i]);
            t[i] = fr_bf16_encode(y0[i]);
            o.want[i] += y0[i];
        }
        upload(dy + off * ysz, bf16 ? (const void *)t : (const void *)y0, ny * ysz);
        free(t);
    } else {
        fill(dy, 0xff, (ny + off) * ysz);   /* NaN: beta = 0 must not read y */
    }
    if (bf16)
        FR_OK_OR_FAIL(fr_gemm_bf16_out(g_gemm, (uint16_t *)(dy + off * ysz), dx + off, dw + off, M, N, K, beta,
                                       g_stream));
    else
        FR_OK_OR_FAIL(fr_gemm_bf16(g_gemm, (float *)(dy + off * ysz), dx + off, dw + off, M, N, K, beta, g_stream));
    o.got = bf16 ? download_bf16((uint16_t *)(dy + off * ysz), ny) : download_f32((float *)(dy + off * ysz), ny);
    CUDA_OK(cudaFree(dx)); CUDA_OK(cudaFree(dw)); CUDA_OK(cudaFree(dy));
    free(hx); free(hw); free(fx); free(fw); free(y0);
    return o;
}

typedef outputs (*op_fn)(const op_case *, fr_test_rng *);
static const op_fn RUN[N_OPS] = {run_embed, run_f32_to_bf16, run_unpack, run_rmsnorm, run_rmsnorm_rows,
                                 run_qk_norm_rope, run_swiglu, run_swiglu, run_gemm};

/* The NMSE bound of a case; 0: bit for bit. */
static double bound_of(const op_case *c)
{
    switch (c->op) {
    case OP_EMBED: case OP_F32_TO_BF16: case OP_UNPACK: return 0;
    case OP_GEMM: return c->dtype == FR_DTYPE_BF16 ? 0x1p-14 : 0x1p-24;
    case OP_QK_NORM_ROPE: return 0x1p-32;
    case OP_RMSNORM: return c->dtype == FR_DTYPE_F32 ? 0x1p-32 : 0x1p-16;
    default: return 0x1p-16;
    }
}

static void describe(const op_case *c, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "%-14s %-4s [", OP_NAMES[c->op], fr_dtype_name(c->dtype));
    for (int d = 0; d < 4 && c->ne[d] && o < cap; d++) o += (size_t)snprintf(buf + o, cap - o, d ? ", %lld" : "%lld", (long long)c->ne[d]);
    if (o < cap)
        snprintf(buf + o, cap - o, "]%s%s%s%s", c->flags & F_DELTA ? " +delta" : "", c->flags & F_BETA ? " beta=1" : "",
                 c->flags & F_MISALIGN ? " misaligned" : "", c->flags & F_NAN ? " +non-finite" : "");
}

/* The ops whose BF16 output is the CPU's float32 value rounded once: each
 * element is also held to |gpu - cpu| <= (2^-8 + 2^-16) |cpu| + 2^-133 (one
 * rounding, float32-level differences before it, half a subnormal step). */
static int elementwise_bf16(const op_case *c)
{
    return c->dtype == FR_DTYPE_BF16 &&
           (c->op == OP_RMSNORM || c->op == OP_RMSNORM_ROWS || c->op == OP_SWIGLU || c->op == OP_SWIGLU_ROWS);
}

/* The first element past that bound, or o->n. */
static size_t worst_bf16_element(const outputs *o)
{
    for (size_t i = 0; i < o->n; i++) {
        const double want = o->want[i];
        if (!(fabs((double)o->got[i] - want) <= (0x1p-8 + 0x1p-16) * fabs(want) + 0x1p-133)) return i;
    }
    return o->n;
}

/* Runs a case; 1 when it passed. */
static int run_case(const op_case *c, fr_test_rng *r)
{
    char what[128];
    describe(c, what, sizeof what);
    outputs o = RUN[c->op](c, r);
    const double bound = bound_of(c);
    int ok;
    if (bound == 0) {
        size_t i = 0;
        while (i < o.n && memcmp(&o.got[i], &o.want[i], sizeof(float)) == 0) i++;
        ok = i == o.n;
        if (ok) printf("  %-56s bit-exact                 OK\n", what);
        else printf("  %-56s element %zu: %.9g, CPU %.9g  FAIL\n", what, i, o.got[i], o.want[i]);
    } else {
        double se = 0, sw = 0;
        for (size_t i = 0; i < o.n; i++) {
            const double d = (double)o.got[i] - (double)o.want[i];
            se += d * d;
            sw += (double)o.want[i] * o.want[i];
        }
        const double nmse = sw > 0 ? se / sw : se;
        ok = nmse <= bound;   /* false for NaN */
        size_t worst = 0;
        const int one_rounding = elementwise_bf16(c);
        if (one_rounding) worst = worst_bf16_element(&o);
        printf("  %-56s NMSE %.2e <= %.2e  %s\n", what, nmse, bound, ok ? "OK" : "FAIL");
        if (one_rounding && worst < o.n) {
            printf("  %-56s element %zu: %.9g, CPU %.9g: more than one BF16 rounding apart  FAIL\n", what, worst,
                   o.got[worst], o.want[worst]);
            ok = 0;
        }
    }
    free(o.got);
    free(o.want);
    return ok;
}

/* One cmocka test per op: its rows of the table, all of them, then the
 * verdict. */
static void test_op(void **state)
{
    REQUIRE_GPU();
    const op_kind op = *(const op_kind *)*state;
    fr_test_rng r = {1000 + (uint64_t)op};
    int n = 0, failed = 0;
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        if (CASES[i].op == op) {
            n++;
            failed += !run_case(&CASES[i], &r);
        }
    assert_true(n > 0);
    if (failed) fail_msg("%s: %d of %d cases failed", OP_NAMES[op], failed, n);
}

static int group_setup(void **state)
{
    (void)state;
    if (!fr_gpu_test_available()) return 0;
    if (cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) != cudaSuccess) return -1;
    if (fr_gemm_new(0, &g_gemm) != FR_OK) {
        fprintf(stderr, "fr_gemm_new: %s\n", fr_last_error());
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    fr_gemm_destroy(&g_gemm);
    if (g_stream) cudaStreamDestroy(g_stream);
    return 0;
}

int main(void)
{
    static op_kind ops[N_OPS];
    struct CMUnitTest tests[N_OPS];
    for (int op = 0; op < N_OPS; op++) {
        ops[op] = (op_kind)op;
        tests[op] = (struct CMUnitTest){.name = OP_NAMES[op], .test_func = test_op, .initial_state = &ops[op]};
    }
    fr_gpu_test_filter();
    return _cmocka_run_group_tests("backend_ops", tests, N_OPS, group_setup, group_teardown);
}
