/* The matrix products on the GPU through cuBLASLt: see gemm_cuda.h.
 *
 * Row-major y[M][N] = x[M][K] . W[N][K]^T is, read column-major, y^T = W . x^T
 * with W^T stored (a K x N column-major matrix with ld K), so cuBLASLt sees
 * A = W (op T, K x N, ld K), B = x (op N, K x M, ld K), C = D = y (N x M,
 * ld N): the "TN" layout, the best supported one on Hopper.
 *
 * Plans live in an open-addressing hash table keyed by the shape, the output
 * type and the pointers' alignments; a hit costs a hash and a compare.
 */
#ifdef FR_HAVE_CUDA

#include "rollout/model/gemm_cuda.h"

#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/cuda_check.h"
#include "rollout/model/gemm_fixed_cuda.h"

#define SLOTS (2 * FR_GEMM_MAX_PLANS)   /* a power of two; at most half used */
#define HEURISTIC_RESULTS 8

/* What a plan is for: the shape, the output type, the mode, the pointers'
 * alignments, and for strided-batched products the batch, the transposition
 * of W, the leading dimensions and the batch strides (plain products: batch
 * 1, W transposed, dense leading dimensions, strides 0). */
typedef struct {
    int M, N, K, out_bf16, pinned;
    uint32_t ay, ax, aw;            /* alignment in bytes of y, x, w (1..256) */
    int batch, w_trans;
    int64_t ldx, ldw, ldy, sx, sw, sy;
} plan_key;

typedef struct {
    int used;
    plan_key k;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} plan;

struct fr_gemm {
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_size;
    plan *slots;                    /* [SLOTS] */
    int n_plans;
    long searches, flushes;
    fr_gemm_mode mode;
};

fr_status fr_gemm_set_mode(fr_gemm *g, fr_gemm_mode mode)
{
    if (!g) return fr_fail(FR_EINVAL, "gemm: NULL gemm context");
    if (mode != FR_GEMM_FAST && mode != FR_GEMM_FIXED && mode != FR_GEMM_PINNED)
        return fr_fail(FR_EINVAL, "gemm: unknown mode %d", (int)mode);
    g->mode = mode;
    return FR_OK;
}

fr_gemm_mode fr_gemm_get_mode(const fr_gemm *g) { return g ? g->mode : FR_GEMM_FAST; }

const char *fr_cublas_status_str(int status)
{
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED (library or handle not initialized)";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED (an allocation inside cuBLAS failed)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (unsupported or conflicting parameter)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (not available on this GPU)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR (GPU memory access failed)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED (the kernel failed to run)";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR (an internal operation failed)";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (configuration not supported)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    static _Thread_local char buf[48];
    snprintf(buf, sizeof buf, "cublasStatus_t %d", status);
    return buf;
}

/* Evaluates a cublasStatus_t expression; on failure returns a status naming
 * the call, where, and cuBLAS's status. */
#define LT_TRY(call)                                                                                    \
    do {                                                                                                \
        cublasStatus_t lt_st_ = (call);                                                                 \
        if (lt_st_ != CUBLAS_STATUS_SUCCESS)                                                            \
            return fr_fail(lt_st_ == CUBLAS_STATUS_NOT_SUPPORTED ? FR_EUNSUPPORTED : FR_EINTERNAL,     \
                           "%s failed at %s:%d: %s", #call, __FILE__, __LINE__,                         \
                           fr_cublas_status_str((int)lt_st_));                                          \
    } while (0)

static void plan_release(plan *p)
{
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    memset(p, 0, sizeof *p);
}

static void flush_plans(fr_gemm *g)
{
    for (int i = 0; i < SLOTS; i++)
        if (g->slots[i].used) plan_release(&g->slots[i]);
    g->n_plans = 0;
}

void fr_gemm_destroy(fr_gemm **pg)
{
    fr_gemm *g = pg ? *pg : NULL;
    if (!g) return;
    if (g->slots) {
        flush_plans(g);
        free(g->slots);
    }
    if (g->ws) cudaFree(g->ws);
    if (g->lt) cublasLtDestroy(g->lt);
    free(g);
    *pg = NULL;
}

fr_status fr_gemm_new(size_t workspace_bytes, fr_gemm **out)
{
    if (!out) return fr_fail(FR_EINVAL, "gemm: NULL output pointer");
    *out = NULL;
    fr_gemm *g = calloc(1, sizeof *g);
    if (!g) return fr_fail(FR_ENOMEM, "gemm: out of memory");
    g->slots = calloc(SLOTS, sizeof *g->slots);
    if (!g->slots) {
        free(g);
        return fr_fail(FR_ENOMEM, "gemm: out of memory");
    }
    g->ws_size = workspace_bytes ? workspace_bytes : FR_GEMM_DEFAULT_WORKSPACE;
    cublasStatus_t st = cublasLtCreate(&g->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        g->lt = NULL;
        fr_gemm_destroy(&g);
        return fr_fail(FR_EINTERNAL, "gemm: cublasLtCreate failed: %s", fr_cublas_status_str((int)st));
    }
    cudaError_t e = cudaMalloc(&g->ws, g->ws_size);
    if (e != cudaSuccess) {
        g->ws = NULL;
        size_t sz = g->ws_size;
        fr_gemm_destroy(&g);
        return fr_fail(e == cudaErrorMemoryAllocation ? FR_ENOMEM : FR_EINTERNAL,
                       "gemm: cannot allocate a %zu-byte workspace: %s", sz, cudaGetErrorString(e));
    }
    *out = g;
    return FR_OK;
}

fr_gemm_stats fr_gemm_get_stats(const fr_gemm *g)
{
    fr_gemm_stats s = {0, 0, 0};
    if (g) {
        s.plans = g->n_plans;
        s.searches = g->searches;
        s.flushes = g->flushes;
    }
    return s;
}

/* The largest power of two dividing the address, at most 256 (NULL: 256). */
static uint32_t align_of(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    if (!a) return 256;
    uint32_t al = 1;
    while (al < 256 && !(a & al)) al <<= 1;
    return al;
}

static uint32_t hash_key(const plan_key *k)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    const uint64_t parts[11] = {(uint32_t)k->M, (uint32_t)k->N, (uint64_t)k->pinned << 32 | (uint32_t)k->K,
                                (uint64_t)k->out_bf16 << 32 | (uint64_t)k->ay << 16 | k->ax, k->aw,
                                (uint64_t)k->w_trans << 32 | (uint32_t)k->batch, (uint64_t)k->ldx,
                                (uint64_t)k->ldw, (uint64_t)k->ldy, (uint64_t)k->sx ^ ((uint64_t)k->sw << 21),
                                (uint64_t)k->sy};
    for (int i = 0; i < 11; i++) {
        h ^= parts[i] + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 31;
    }
    return (uint32_t)h;
}

/* Fills p (key already set): descriptors, layouts and the heuristic's choice. */
/* A layout's batch count and stride (nothing to set for one matrix). */
static cublasStatus_t set_batch(cublasLtMatrixLayout_t l, int batch, int64_t stride)
{
    if (batch <= 1) return CUBLAS_STATUS_SUCCESS;
    const int32_t n = batch;
    cublasStatus_t st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
    return st;
}

static fr_status plan_build(fr_gemm *g, plan *p)
{
    const plan_key *k = &p->k;
    const cudaDataType_t yt = k->out_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    /* W [N][K] read column-major is K x N: transposed to N x K; W [K][N]
     * read column-major is already N x K. */
    const int32_t ta = k->w_trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    LT_TRY(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (k->w_trans) LT_TRY(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, (uint64_t)k->K, (uint64_t)k->N, k->ldw));
    else LT_TRY(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, (uint64_t)k->N, (uint64_t)k->K, k->ldw));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, (uint64_t)k->K, (uint64_t)k->M, k->ldx));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->lc, yt, (uint64_t)k->N, (uint64_t)k->M, k->ldy));
    LT_TRY(set_batch(p->la, k->batch, k->sw));
    LT_TRY(set_batch(p->lb, k->batch, k->sx));
    LT_TRY(set_batch(p->lc, k->batch, k->sy));

    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = g->ws_size;
    const uint32_t aa = k->aw, ab = k->ax, ac = k->ay;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    cublasLtMatmulHeuristicResult_t res[HEURISTIC_RESULTS];
    int n_res = 0;
    /* Pinned: the search runs at FR_GEMM_PIN_M whatever M is, so every M of
     * an (N, K) gets the same algorithm. */
    cublasLtMatrixLayout_t pin_b = NULL, pin_c = NULL;
    if (st == CUBLAS_STATUS_SUCCESS && k->pinned) {
        st = cublasLtMatrixLayoutCreate(&pin_b, CUDA_R_16BF, (uint64_t)k->K, FR_GEMM_PIN_M, k->ldx);
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatrixLayoutCreate(&pin_c, yt, (uint64_t)k->N, FR_GEMM_PIN_M, k->ldy);
        if (st == CUBLAS_STATUS_SUCCESS) st = set_batch(pin_b, k->batch, k->sx);
        if (st == CUBLAS_STATUS_SUCCESS) st = set_batch(pin_c, k->batch, k->sy);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
        g->searches++;
        st = cublasLtMatmulAlgoGetHeuristic(g->lt, p->op, p->la, k->pinned ? pin_b : p->lb, k->pinned ? pin_c : p->lc,
                                            k->pinned ? pin_c : p->lc, pref, HEURISTIC_RESULTS, res, &n_res);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (pin_b) cublasLtMatrixLayoutDestroy(pin_b);
    if (pin_c) cublasLtMatrixLayoutDestroy(pin_c);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED)
        return fr_fail(FR_EINTERNAL, "gemm: the algorithm search for M %d N %d K %d (batch %d) failed: %s", k->M,
                       k->N, k->K, k->batch, fr_cublas_status_str((int)st));
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < n_res; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > g->ws_size) continue;
        p->algo = res[i].algo;
        if (!k->pinned) return FR_OK;
        const int32_t one = 1;
        const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        cublasLtMatmulHeuristicResult_t chk;
        if (cublasLtMatmulAlgoConfigSetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulAlgoConfigSetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                                                 sizeof none) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulAlgoCheck(g->lt, p->op, p->la, p->lb, p->lc, p->lc, &p->algo, &chk) ==
                CUBLAS_STATUS_SUCCESS &&
            chk.workspaceSize <= g->ws_size)
            return FR_OK;
    }
    return fr_fail(FR_EUNSUPPORTED,
                   "gemm: cuBLASLt has no algorithm for M %d N %d K %d (batch %d, %s output, alignments y %u x %u "
                   "w %u, workspace %zu bytes)", k->M, k->N, k->K, k->batch, k->out_bf16 ? "BF16" : "FP32", k->ay,
                   k->ax, k->aw, g->ws_size);
}

static int key_equal(const plan_key *a, const plan_key *b)
{
    return a->M == b->M && a->N == b->N && a->K == b->K && a->out_bf16 == b->out_bf16 && a->pinned == b->pinned &&
           a->ay == b->ay && a->ax == b->ax && a->aw == b->aw && a->batch == b->batch && a->w_trans == b->w_trans &&
           a->ldx == b->ldx && a->ldw == b->ldw && a->ldy == b->ldy && a->sx == b->sx && a->sw == b->sw &&
           a->sy == b->sy;
}

/* The key of a plain product y[M][N] = x[M][K] . w[N][K]^T. */
static plan_key plain_key(const fr_gemm *g, int M, int N, int K, int out_bf16, const void *y, const void *x,
                          const void *w)
{
    plan_key k;
    memset(&k, 0, sizeof k);   /* the padding too: keys are compared field by field, but stay tidy */
    k.M = M; k.N = N; k.K = K; k.out_bf16 = out_bf16; k.pinned = g->mode == FR_GEMM_PINNED;
    k.ay = align_of(y); k.ax = align_of(x); k.aw = align_of(w);
    k.batch = 1; k.w_trans = 1; k.ldx = K; k.ldw = K; k.ldy = N;
    return k;
}

/* The plan for a key, built on a miss. */
static fr_status plan_get(fr_gemm *g, const plan_key *key, const plan **out)
{
    uint32_t i = hash_key(key) & (SLOTS - 1);
    for (;; i = (i + 1) & (SLOTS - 1)) {
        plan *p = &g->slots[i];
        if (!p->used) break;
        if (key_equal(&p->k, key)) {
            *out = p;
            return FR_OK;
        }
    }
    if (g->n_plans >= FR_GEMM_MAX_PLANS) {   /* full: start over */
        flush_plans(g);
        g->flushes++;
        i = hash_key(key) & (SLOTS - 1);
    }
    plan *p = &g->slots[i];
    memset(p, 0, sizeof *p);
    p->k = *key;
    fr_status st = plan_build(g, p);
    if (st) {
        plan_release(p);
        return st;
    }
    p->used = 1;
    g->n_plans++;
    *out = p;
    return FR_OK;
}

static fr_status check_args(const char *what, const fr_gemm *g, const void *y, const void *x, const void *w,
                            int M, int N, int K, float beta)
{
    if (!g) return fr_fail(FR_EINVAL, "%s: NULL gemm context", what);
    if (M < 0 || N < 0 || K < 1)
        return fr_fail(FR_EINVAL, "%s: bad size: M %d, N %d, K %d (M, N >= 0, K >= 1)", what, M, N, K);
    if (beta != beta) return fr_fail(FR_EINVAL, "%s: beta is NaN", what);
    if (M > 0 && N > 0 && (!y || !x || !w)) return fr_fail(FR_EINVAL, "%s: NULL matrix pointer", what);
    return FR_OK;
}

static fr_status gemm_run(const char *what, fr_gemm *g, void *y, int out_bf16, const uint16_t *x,
                          const uint16_t *w, int M, int N, int K, float beta, cudaStream_t stream)
{
    fr_status st = check_args(what, g, y, x, w, M, N, K, beta);
    if (st || M == 0 || N == 0) return st;
    if (g->mode == FR_GEMM_FIXED) return fr_gemm_fixed_bf16(y, out_bf16, x, w, M, N, K, beta, g->ws, g->ws_size, stream);
    const plan *p = NULL;
    const plan_key key = plain_key(g, M, N, K, out_bf16, y, x, w);
    if ((st = plan_get(g, &key, &p))) return st;
    const float alpha = 1.0f;
    LT_TRY(cublasLtMatmul(g->lt, p->op, &alpha, w, p->la, x, p->lb, &beta, y, p->lc, y, p->lc, &p->algo, g->ws,
                          g->ws_size, stream));
    return FR_OK;
}

fr_status fr_gemm_bf16(fr_gemm *g, float *y, const uint16_t *x_bf16, const uint16_t *w_bf16, int M, int N, int K,
                       float beta, cudaStream_t stream)
{
    return gemm_run("gemm bf16", g, y, 0, x_bf16, w_bf16, M, N, K, beta, stream);
}

fr_status fr_gemm_bf16_out(fr_gemm *g, uint16_t *y_bf16, const uint16_t *x_bf16, const uint16_t *w_bf16, int M,
                           int N, int K, float beta, cudaStream_t stream)
{
    return gemm_run("gemm bf16_out", g, y_bf16, 1, x_bf16, w_bf16, M, N, K, beta, stream);
}

fr_status fr_gemm_prepare(fr_gemm *g, int M, int N, int K, int bf16_out, const void *y, const void *x_bf16,
                          const void *w_bf16)
{
    if (!g) return fr_fail(FR_EINVAL, "gemm prepare: NULL gemm context");
    if (M < 0 || N < 0 || K < 1)
        return fr_fail(FR_EINVAL, "gemm prepare: bad size: M %d, N %d, K %d (M, N >= 0, K >= 1)", M, N, K);
    if (M == 0 || N == 0 || g->mode == FR_GEMM_FIXED) return FR_OK;
    const plan *p = NULL;
    const plan_key key = plain_key(g, M, N, K, bf16_out ? 1 : 0, y, x_bf16, w_bf16);
    return plan_get(g, &key, &p);
}

fr_status fr_gemm_bf16_batched(fr_gemm *g, const fr_gemm_batch *b, void *y, const uint16_t *x_bf16,
                               const uint16_t *w_bf16, float beta, cudaStream_t stream)
{
    if (!b) return fr_fail(FR_EINVAL, "gemm batched: NULL shape");
    fr_status st = check_args("gemm batched", g, y, x_bf16, w_bf16, b->M, b->N, b->K, beta);
    if (st) return st;
    const int64_t w_cols = b->w_trans ? b->K : b->N;
    if (b->batch < 1 || b->ldx < b->K || b->ldw < w_cols || b->ldy < b->N || b->x_stride < 0 || b->w_stride < 0 ||
        b->y_stride < 0)
        return fr_fail(FR_EINVAL, "gemm batched: batch %d, leading dimensions x %lld w %lld y %lld or strides do not "
                       "fit M %d N %d K %d", b->batch, b->ldx, b->ldw, b->ldy, b->M, b->N, b->K);
    if (b->M == 0 || b->N == 0) return FR_OK;
    if (g->mode == FR_GEMM_FIXED)
        return fr_fail(FR_EUNSUPPORTED, "gemm batched: the fixed-order kernel has no batched form");
    plan_key key = plain_key(g, b->M, b->N, b->K, b->y_bf16 ? 1 : 0, y, x_bf16, w_bf16);
    key.batch = b->batch;
    key.w_trans = b->w_trans ? 1 : 0;
    key.ldx = b->ldx; key.ldw = b->ldw; key.ldy = b->ldy;
    if (b->batch > 1) {
        key.sx = b->x_stride; key.sw = b->w_stride; key.sy = b->y_stride;
    }
    const plan *p = NULL;
    if ((st = plan_get(g, &key, &p))) return st;
    const float alpha = 1.0f;
    LT_TRY(cublasLtMatmul(g->lt, p->op, &alpha, w_bf16, p->la, x_bf16, p->lb, &beta, y, p->lc, y, p->lc, &p->algo,
                          g->ws, g->ws_size, stream));
    return FR_OK;
}

#else

/* Without CUDA this file is empty; the GPU backend is not built. */
typedef int fr_gemm_cuda_unused;

#endif
