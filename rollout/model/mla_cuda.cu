/* Latent attention's layer on the GPU: see mla_cuda.h. The kernels here are
 * the small per-row ones (the latent's norm, RoPE, the query's layout); the
 * products go through gemm_cuda.h and the attention through attn_mla.h. */
#include "rollout/model/mla_cuda.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attn_mla.h"
#include "attention/cuda_check.h"
#include "attention/fp4_device.cuh"
#include "rollout/model/ops_cuda.h"
#include "rollout/model/rope_yarn.h"

enum { ROW_THREADS = 256 };

struct fr_mla_gpu {
    fr_model_config c;
    int M, max_seqs;
    int H, dc, dr, dn, dv, ql, row, qh;
    float *lowrank;              /* [M][q_lora] */
    uint16_t *lowrank_bf16;      /* [M][q_lora], normed */
    float *q;                    /* [M][H][dn + dr] */
    uint16_t *qn;                /* [M][H][dn], the content query in BF16 */
    float *qcat;                 /* [M][H][dc + dr], the attention query */
    uint16_t *ctx;               /* [M][H][dc] */
    float *rope_cos, *rope_sin;  /* [max_position][dr / 2] */
    fr_attn_mla_config base;     /* every field but the layer's mean and FP8 scale */
    const float *mean;           /* device [layers][dc + dr] latent mean, or NULL: no smoothing */
    float *fp8;                  /* host [layers]: the layer's latent FP8 scale */
    uint8_t *ws;
    size_t ws_bytes;
};

/* ---- kernels ---------------------------------------------------------- */

struct rope_args {
    float *rows;                 /* [M][row] */
    const float *q;              /* [M][H][qh] */
    float *qcat;                 /* [M][H][row] */
    uint16_t *qn;                /* [M][H][dn] */
    const uint16_t *norm_w;      /* kv_a_layernorm [dc] */
    const int *pos;
    const float *cos_t, *sin_t;
    int H, dc, dr, dn, row, qh, max_pos, interleave;
    float eps;
};

/* Pair i of a RoPE vector x[dr] as mla_cpu.c reads it: with interleave the
 * pair (2i, 2i+1) moved to (i, i + dr/2) first. */
__device__ __forceinline__ void rope_pair(const float *x, int i, int dr, int interleave, float &a, float &b)
{
    if (interleave) {
        a = x[2 * i];
        b = x[2 * i + 1];
    } else {
        a = x[i];
        b = x[i + dr / 2];
    }
}

/* fr_rope's rotation of one pair, every product rounded on its own. */
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, float &lo, float &hi)
{
    lo = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

/* One block per row: the latent's RMS norm (fr_rmsnorm: float32 squares
 * summed in double, float32 scaling), RoPE on the row's RoPE part and on
 * every head's query, the query's content part to BF16 for the absorbing
 * product and its RoPE part into the attention query. A position outside
 * the table writes zeros (a caller bug made visible). */
__global__ void __launch_bounds__(ROW_THREADS) rope_kernel(rope_args a)
{
    __shared__ double part[ROW_THREADS];
    __shared__ float rp[64 * 16];   /* the row's RoPE part before rotation (dr <= 1024) */
    const int t = blockIdx.x, half = a.dr / 2;
    float *row = a.rows + (size_t)t * a.row;
    const int p = a.pos[t];
    const bool ok = p >= 0 && p < a.max_pos;
    double acc = 0.0;
    for (int j = threadIdx.x; j < a.dc; j += blockDim.x) {
        const float x = row[j];
        acc += (double)__fmul_rn(x, x);
    }
    part[threadIdx.x] = acc;
    for (int j = threadIdx.x; j < a.dr; j += blockDim.x) rp[j] = row[a.dc + j];
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    const float var = __fdiv_rn((float)part[0], (float)a.dc);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, a.eps)));
    for (int j = threadIdx.x; j < a.dc; j += blockDim.x)
        row[j] = ok ? __fmul_rn(__fmul_rn(row[j], inv), fr_dev_bf16_decode(a.norm_w[j])) : 0.0f;
    const float *ct = a.cos_t + (size_t)(ok ? p : 0) * half, *st = a.sin_t + (size_t)(ok ? p : 0) * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float x0, x1, lo, hi;
        rope_pair(rp, i, a.dr, a.interleave, x0, x1);
        rope_rotate(x0, x1, ct[i], st[i], lo, hi);
        row[a.dc + i] = ok ? lo : 0.0f;
        row[a.dc + i + half] = ok ? hi : 0.0f;
    }
    for (int w = threadIdx.x; w < a.H * half; w += blockDim.x) {
        const int h = w / half, i = w % half;
        const float *qr = a.q + ((size_t)t * a.H + h) * a.qh + a.dn;
        float *dst = a.qcat + ((size_t)t * a.H + h) * a.row + a.dc;
        float x0, x1, lo, hi;
        rope_pair(qr, i, a.dr, a.interleave, x0, x1);
        rope_rotate(x0, x1, ct[i], st[i], lo, hi);
        dst[i] = ok ? lo : 0.0f;
        dst[i + half] = ok ? hi : 0.0f;
    }
    for (int w = threadIdx.x; w < a.H * a.dn; w += blockDim.x) {
        const int h = w / a.dn, j = w % a.dn;
        const float x = a.q[((size_t)t * a.H + h) * a.qh + j];
        a.qn[(size_t)t * a.H * a.dn + w] = fr_dev_bf16_encode(ok ? x : 0.0f);
    }
}

/* ---- host side -------------------------------------------------------- */

static fr_attn_mla_config base_config(const fr_model_config *c, const fr_kv_cache_config *kc)
{
    fr_attn_mla_config cfg;
    memset(&cfg, 0, sizeof cfg);
    const int fp4 = fr_kv_dtype_is_fp4(kc->dtype);
    cfg.dtype = kc->dtype;
    cfg.n_heads = c->num_heads;
    cfg.latent_dim = c->kv_lora_rank;
    cfg.rope_dim = c->qk_rope_dim;
    cfg.scale = fr_mla_softmax_scale(c);   /* with DeepSeek's YaRN correction */
    cfg.rotate = fp4 && kc->recipe.rotate;
    cfg.sink_recent = fp4 && kc->recipe.sink_recent;
    cfg.q_search = kc->recipe.scale_search;
    cfg.q_mode = FR_Q_UNQUANTIZED;
    if (fp4 && kc->compute == FR_COMPUTE_EXACT) cfg.q_mode = kc->recipe.dual_query ? FR_Q_DUAL : FR_Q_SINGLE;
    else if (fp4) cfg.q_bf16 = 1;
    cfg.fp8_scale = 1.0f;
    return cfg;
}

/* The numerics of layer l (the mean pointer and FP8 scale are the layer's). */
static fr_attn_mla_config layer_config(const fr_mla_gpu *m, int l)
{
    fr_attn_mla_config cfg = m->base;
    cfg.mean = m->mean ? m->mean + (size_t)l * m->row : NULL;
    cfg.fp8_scale = m->fp8[l];
    return cfg;
}

void fr_mla_gpu_destroy(fr_mla_gpu **pm)
{
    fr_mla_gpu *m = pm ? *pm : NULL;
    if (!m) return;
    void *dev[] = {m->lowrank, m->lowrank_bf16, m->q, m->qn, m->qcat, m->ctx, m->ws};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    fr_cuda_rope_table_free(&m->rope_cos, &m->rope_sin);
    free(m->fp8);
    free(m);
    *pm = NULL;
}

#define MLA_ALLOC(ptr, count)                                                                              \
    do {                                                                                                   \
        if (!st && cudaMalloc((void **)&(ptr), sizeof(*(ptr)) * (size_t)(count)) != cudaSuccess)           \
            st = fr_fail(FR_ENOMEM, "latent attention (GPU): cannot allocate %s (%zu bytes) on the device", #ptr, \
                         sizeof(*(ptr)) * (size_t)(count));                                                \
    } while (0)

static fr_status check_shape(const fr_model_config *c, const fr_kv_cache_config *kc)
{
    if (!fr_model_is_mla(c)) return fr_fail(FR_EINVAL, "latent attention (GPU): the model has no latent attention");
    if (kc->latent_dim != c->kv_lora_rank || kc->head_dim != c->kv_lora_rank + c->qk_rope_dim || kc->n_kv_heads != 1)
        return fr_fail(FR_EINVAL, "latent attention (GPU): the cache's rows (latent %d of %d, %d heads) are not the "
                       "model's (latent %d, RoPE %d)", kc->latent_dim, kc->head_dim, kc->n_kv_heads, c->kv_lora_rank,
                       c->qk_rope_dim);
    if (c->qk_rope_dim % 2 || c->qk_rope_dim > 1024)
        return fr_fail(FR_EINVAL, "latent attention (GPU): RoPE width %d must be even and at most 1024",
                       c->qk_rope_dim);
    return FR_OK;
}

/* The attention workspace for decode steps of max_seqs sequences (every
 * captured graph's shape), and a check that the kernel takes the cache. */
static fr_status decode_workspace(fr_mla_gpu *m)
{
    fr_status st = fr_attn_mla_workspace_bytes(&m->base, m->max_seqs, 1, m->c.max_position, &m->ws_bytes);
    if (st) return st;
    if (m->ws_bytes < 1) m->ws_bytes = 1;
    MLA_ALLOC(m->ws, m->ws_bytes);
    return st;
}

fr_status fr_mla_gpu_new(const fr_model_config *c, const fr_kv_cache *book, const fr_kv_store_gpu *store,
                         int max_tokens, int max_seqs, fr_mla_gpu **out)
{
    if (!c || !book || !store || !out || max_tokens < 1 || max_seqs < 1)
        return fr_fail(FR_EINVAL, "latent attention (GPU): bad arguments");
    *out = NULL;
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(book);
    fr_status st = check_shape(c, kc);
    if (st) return st;
    fr_mla_gpu *m = (fr_mla_gpu *)calloc(1, sizeof *m);
    if (!m) return fr_fail(FR_ENOMEM, "latent attention (GPU): out of memory");
    m->c = *c;
    m->M = max_tokens;
    m->max_seqs = max_seqs;
    m->H = c->num_heads;
    m->dc = c->kv_lora_rank;
    m->dr = c->qk_rope_dim;
    m->dn = c->qk_nope_dim;
    m->dv = c->v_head_dim;
    m->ql = c->q_lora_rank;
    m->row = m->dc + m->dr;
    m->qh = m->dn + m->dr;
    m->base = base_config(c, kc);
    const int fp4 = fr_kv_dtype_is_fp4(kc->dtype);
    m->mean = fp4 && kc->recipe.smooth ? fr_kv_store_gpu_key_mean(store) : NULL;
    m->fp8 = (float *)malloc(sizeof(float) * (size_t)c->num_layers);
    if (!m->fp8) st = fr_fail(FR_ENOMEM, "latent attention (GPU): out of memory");
    for (int l = 0; !st && l < c->num_layers; l++) m->fp8[l] = kc->fp8_scales ? kc->fp8_scales[(size_t)l * 2] : 1.0f;
    const size_t M = (size_t)max_tokens, H = (size_t)m->H;
    if (m->ql) {
        MLA_ALLOC(m->lowrank, M * m->ql);
        MLA_ALLOC(m->lowrank_bf16, M * m->ql);
    }
    MLA_ALLOC(m->q, M * H * m->qh);
    MLA_ALLOC(m->qn, M * H * m->dn);
    MLA_ALLOC(m->qcat, M * H * m->row);
    MLA_ALLOC(m->ctx, M * H * m->dc);
    /* Zeroed once: rows of a graph's padding sequences are never written by
     * attention, and their W_UV products should read numbers, not garbage. */
    if (!st && (cudaMemset(m->qcat, 0, sizeof(float) * M * H * m->row) != cudaSuccess ||
                cudaMemset(m->ctx, 0, sizeof(uint16_t) * M * H * m->dc) != cudaSuccess ||
                cudaDeviceSynchronize() != cudaSuccess))   /* memsets run async to the runner's stream */
        st = fr_fail(FR_EINTERNAL, "latent attention (GPU): cannot clear the attention buffers");
    if (!st) st = fr_cuda_rope_table_new(c->max_position, m->dr, c->rope_theta, &c->rope_scaling, &m->rope_cos,
                                           &m->rope_sin);
    if (!st) st = decode_workspace(m);
    if (st) {
        fr_mla_gpu_destroy(&m);
        return st;
    }
    *out = m;
    return FR_OK;
}

fr_status fr_mla_gpu_project(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, const uint16_t *xn,
                             const int *pos, int M, float *rows, cudaStream_t stream)
{
    if (!m || !g || !lw || !xn || !pos || !rows || M < 0 || M > m->M)
        return fr_fail(FR_EINVAL, "latent attention (GPU) project: bad arguments (%d rows of %d)", M, m ? m->M : 0);
    if (M == 0) return FR_OK;
    const fr_model_config *c = &m->c;
    const int D = c->hidden_size, Hq = m->H * m->qh;
    fr_status st = FR_OK;
    if (m->ql) {
        st = fr_gemm_bf16(g, m->lowrank, xn, lw->q_a_proj, M, m->ql, D, 0.0f, stream);
        if (!st) st = fr_cuda_rmsnorm(m->lowrank_bf16, m->lowrank, NULL, lw->q_a_norm, M, m->ql, c->rms_norm_eps, stream);
        if (!st) st = fr_gemm_bf16(g, m->q, m->lowrank_bf16, lw->q_b_proj, M, Hq, m->ql, 0.0f, stream);
    } else {
        st = fr_gemm_bf16(g, m->q, xn, lw->q_proj, M, Hq, D, 0.0f, stream);
    }
    if (!st) st = fr_gemm_bf16(g, rows, xn, lw->kv_a_proj, M, m->row, D, 0.0f, stream);
    if (st) return st;
    rope_args a;
    a.rows = rows;
    a.q = m->q;
    a.qcat = m->qcat;
    a.qn = m->qn;
    a.norm_w = lw->kv_a_norm;
    a.pos = pos;
    a.cos_t = m->rope_cos;
    a.sin_t = m->rope_sin;
    a.H = m->H;
    a.dc = m->dc;
    a.dr = m->dr;
    a.dn = m->dn;
    a.row = m->row;
    a.qh = m->qh;
    a.max_pos = c->max_position;
    a.interleave = c->rope_interleave;
    a.eps = c->rms_norm_eps;
    rope_kernel<<<(unsigned)M, ROW_THREADS, 0, stream>>>(a);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

/* One product per head over kv_b_proj, whose head h holds W_UK_h [dn][dc]
 * then W_UV_h [dv][dc]: x and y rows hold every head's x_w and y_w elements
 * side by side. */
static fr_gemm_batch per_head(const fr_mla_gpu *m, int M, int N, int K, int w_trans, int x_w, int y_w)
{
    fr_gemm_batch b;
    memset(&b, 0, sizeof b);
    b.M = M;
    b.N = N;
    b.K = K;
    b.batch = m->H;
    b.w_trans = w_trans;
    b.ldx = (long long)m->H * x_w;
    b.x_stride = x_w;
    b.ldw = m->dc;
    b.w_stride = (long long)(m->dn + m->dv) * m->dc;
    b.ldy = (long long)m->H * y_w;
    b.y_stride = y_w;
    return b;
}

fr_status fr_mla_gpu_absorb(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, int M, cudaStream_t stream)
{
    if (!m || !g || !lw || M < 0 || M > m->M) return fr_fail(FR_EINVAL, "latent attention (GPU) absorb: bad arguments");
    /* per head h: qcat_h[M][dc] = qn_h[M][dn] . W_UK_h[dn][dc], W_UK_h not transposed */
    const fr_gemm_batch b = per_head(m, M, m->dc, m->dn, 0, m->dn, m->row);
    return fr_gemm_bf16_batched(g, &b, m->qcat, m->qn, lw->kv_b_proj, 0.0f, stream);
}

/* A prefill call (several rows per sequence, never captured) gets the
 * split count it would take with room to spare: the workspace grows when
 * that needs more than the decode workspace holds (the kernel would
 * otherwise fit fewer splits into it). */
static fr_status fit_workspace(fr_mla_gpu *m, const fr_attn_mla_config *cfg, int n_seqs, int max_new, int *grew,
                               cudaStream_t stream)
{
    fr_attn_mla_plan ideal;
    fr_status st = fr_attn_mla_plan_for(cfg, n_seqs, max_new, m->c.max_position, SIZE_MAX, &ideal);
    if (st || ideal.bytes <= m->ws_bytes) return st;
    const size_t need = ideal.bytes;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone)
        return fr_fail(FR_EINTERNAL, "latent attention (GPU): the workspace cannot grow inside a graph capture");
    uint8_t *ws = NULL;
    FR_CUDA_TRY(cudaStreamSynchronize(stream));
    if (cudaMalloc((void **)&ws, need) != cudaSuccess) {
        (void)cudaGetLastError();   /* no room: the kernel fits fewer splits into the workspace there is */
        return FR_OK;
    }
    cudaFree(m->ws);
    m->ws = ws;
    m->ws_bytes = need;
    if (grew) *grew = 1;
    return FR_OK;
}

fr_status fr_mla_gpu_attend(fr_mla_gpu *m, const fr_kv_store_gpu *store, int layer, const uint16_t *step_rows,
                            const fr_paged_seq *seqs, int n_seqs, int max_new, const float *q, uint16_t *ctx,
                            int *grew, cudaStream_t stream)
{
    if (grew) *grew = 0;
    if (!m || !store || layer < 0 || layer >= m->c.num_layers || n_seqs < 0 || max_new < 0)
        return fr_fail(FR_EINVAL, "latent attention (GPU) attend: bad arguments");
    if (n_seqs == 0 || max_new == 0) return FR_OK;
    const fr_latent_kv kv = fr_kv_store_gpu_latent_view(store, layer, step_rows);
    if (!kv.pool) return fr_fail(FR_EINVAL, "latent attention (GPU) attend: the store holds no latent pages");
    const fr_attn_mla_config cfg = layer_config(m, layer);
    fr_status st = max_new > 1 ? fit_workspace(m, &cfg, n_seqs, max_new, grew, stream) : FR_OK;
    if (st) return st;
    return fr_attn_mla(&cfg, &kv, seqs, n_seqs, max_new, m->c.max_position, q, ctx, m->ws, m->ws_bytes, stream);
}

fr_status fr_mla_gpu_values(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, int M, uint16_t *out,
                            cudaStream_t stream)
{
    if (!m || !g || !lw || !out || M < 0 || M > m->M)
        return fr_fail(FR_EINVAL, "latent attention (GPU) values: bad arguments");
    /* per head h: out_h[M][dv] = ctx_h[M][dc] . W_UV_h[dv][dc]^T */
    fr_gemm_batch b = per_head(m, M, m->dv, m->dc, 1, m->dc, m->dv);
    b.y_bf16 = 1;
    return fr_gemm_bf16_batched(g, &b, out, m->ctx, lw->kv_b_proj + (size_t)m->dn * m->dc, 0.0f, stream);
}

float *fr_mla_gpu_attn_query(const fr_mla_gpu *m) { return m ? m->qcat : NULL; }
uint16_t *fr_mla_gpu_context(const fr_mla_gpu *m) { return m ? m->ctx : NULL; }
