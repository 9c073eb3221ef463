/* The GPU store path of the KV cache (kv_store_cuda.h): staging, promotion
 * and slot writes, byte for byte what kv_cache.c writes. The number formats
 * and quantizers are attention/fp4_device.cuh; this file only decides which
 * values go where. */
#include "kv_store_cuda.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "attention/cuda_check.h"
#include "attention/fp4_device.cuh"

enum { T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS };
enum { STAGE_THREADS = 256, PROMOTE_THREADS = 256, SLOT_THREADS = 256, MAX_GRID_YZ = 65535 };

/* What commit found wrong on the device, or'ed into the error word. */
enum { ERR_SLOT = 1u, ERR_RECORD = 2u, ERR_PAGES = 4u, ERR_BLOCK = 8u };

struct fr_kv_store_gpu {
    fr_kv_cache_config cfg;   /* key_mean and fp8_scales NULL: the copies are on the device */
    fr_page_layout layout;
    size_t block_bytes, slot_elems, sink_elems;
    int halves;               /* slots per token: K and V, or a latent row alone */
    uint8_t *pool;            /* n_blocks * block_bytes */
    uint16_t *recent;         /* [max_seqs][halves][layers][kv_heads][128][d] BF16 (K, V) */
    uint16_t *sink;           /* [max_seqs][halves][layers][kv_heads][16][d] BF16 */
    float *key_mean;          /* [layers][kv_heads][d] */
    float *fp8_scales;        /* [layers][kv_heads][2] */
    unsigned *error;          /* ERR_* bits since the last check */
};

static bool is_fp4(const fr_kv_store_gpu *s) { return fr_kv_dtype_is_fp4(s->cfg.dtype) != 0; }

/* ================= stage: store form into the staging rows ================= */

struct stage_args {
    const float *k, *v;
    uint16_t *step_k, *step_v;
    const float *mean;   /* this layer's key mean [kv_heads][d], or NULL: no smoothing */
    int vectors;         /* rows * kv_heads */
    int n_kv_heads, d;
    int rotate;
};

/* One warp per (row, head) vector, element j in lane j % 32, register j / 32
 * (the striped layout of fr_dev_hadamard_warp): every load and store of a
 * warp is one contiguous run. E = ceil(d / 32). */
template <int E>
__global__ void __launch_bounds__(STAGE_THREADS) stage_kernel(stage_args a)
{
    const int vec = (int)((blockIdx.x * (unsigned)blockDim.x + threadIdx.x) >> 5);
    if (vec >= a.vectors) return;   /* whole warps leave together: the shuffles stay full */
    const int lane = threadIdx.x & 31, h = vec % a.n_kv_heads;
    const size_t base = (size_t)vec * a.d;
    float k[E];
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int j = e * 32 + lane;
        k[e] = 0.0f;
        if (j < a.d) {
            k[e] = a.k[base + j];
            if (a.mean) k[e] = __fsub_rn(k[e], a.mean[(size_t)h * a.d + j]);
            a.step_v[base + j] = fr_dev_bf16_encode(a.v[base + j]);
        }
    }
    /* Rotation needs a power-of-two d, hence a power-of-two E (the config
     * check guarantees it); other E never rotate. */
    if constexpr ((E & (E - 1)) == 0)
        if (a.rotate) fr_dev_hadamard_warp<E>(k, a.d);
#pragma unroll
    for (int e = 0; e < E; e++) {
        const int j = e * 32 + lane;
        if (j < a.d) a.step_k[base + j] = fr_dev_bf16_encode(k[e]);
    }
}

/* A latent row (latent_dim > 0): the latent part minus the mean, rotated
 * over latent_dim; the RoPE part as computed; all rounded to BF16. One
 * thread block per row, the row in shared memory; the butterflies are
 * fr_hadamard's (a + b, a - b for h = 1, 2, 4, ..., then one scaling), so
 * the bits are the CPU's. */
constexpr int kMaxLatentRow = 1024;
enum { LATENT_THREADS = 128 };

struct latent_stage_args {
    const float *rows;
    uint16_t *step;
    const float *mean;   /* this layer's [d] (the latent part used), or NULL */
    int d, dc, rotate;
};

__global__ void __launch_bounds__(LATENT_THREADS) latent_stage_kernel(latent_stage_args a)
{
    __shared__ float x[kMaxLatentRow];
    const size_t base = (size_t)blockIdx.x * (size_t)a.d;
    for (int j = threadIdx.x; j < a.d; j += blockDim.x) {
        float v = a.rows[base + j];
        if (a.mean && j < a.dc) v = __fsub_rn(v, a.mean[j]);
        x[j] = v;
    }
    if (a.rotate) {
        for (int h = 1; h < a.dc; h *= 2) {
            __syncthreads();
            for (int p = threadIdx.x; p < a.dc / 2; p += blockDim.x) {
                const int i = (p / h) * 2 * h + p % h;
                const float u = x[i], w = x[i + h];
                x[i] = __fadd_rn(u, w);
                x[i + h] = __fsub_rn(u, w);
            }
        }
        __syncthreads();
        const float sc = fr_dev_hadamard_scale(a.dc);
        for (int j = threadIdx.x; j < a.dc; j += blockDim.x) x[j] = __fmul_rn(x[j], sc);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < a.d; j += blockDim.x) a.step[base + j] = fr_dev_bf16_encode(x[j]);
}

/* ================= commit: promotion, then slot writes ================= */

struct commit_args {
    const fr_paged_seq *seqs;
    const uint16_t *step_k, *step_v;
    uint8_t *pool;
    uint16_t *recent, *sink;
    const float *fp8_scales;   /* this layer's [kv_heads][2] */
    unsigned *error;
    fr_page_layout layout;
    size_t block_bytes, slot_elems, sink_elems;
    int layer, n_kv_heads, d, n_blocks, max_seqs, max_pages;
    int halves;      /* 2: K and V slots; 1: latent rows */
    int dc;          /* latent pages: the latent width (the rest of a row is RoPE) */
    int search;      /* FP4 keys: scale search */
    int zero_sink;   /* FP4 keeping BF16 sink tokens: page 0's sink values are zeroed */
};

/* The problem that makes a record unusable (0: none). Both commit kernels
 * skip such a record, so a bad record never writes out of bounds; the slot
 * kernel reports it. */
__device__ unsigned record_problem(const fr_paged_seq &q, const commit_args &a)
{
    if (q.slot < 0 || q.slot >= a.max_seqs) return ERR_SLOT;
    if (q.len < 0 || q.n_new < 0 || q.q_row < 0 || q.len > INT_MAX - q.n_new) return ERR_RECORD;
    if ((q.len + q.n_new) / T - q.len / T > a.max_pages) return ERR_PAGES;
    return 0;
}

/* Where token t (0..127) of the page being promoted is, for one head: in the
 * recent slot when it was cached before the step (t < n_old), else in the
 * staging rows. Values are BF16 bits either way. */
struct page_source {
    const uint16_t *slot_k, *slot_v;   /* the (slot, layer, head) recent slot, [128][d] */
    const uint16_t *step_k, *step_v;   /* staging at this head of row 0 */
    size_t row_stride;                 /* kv_heads * d */
    int q_row;                         /* staging row of the sequence's first new token */
    int n_old;                         /* page tokens cached before the step (<= 0: none) */
    int d;

    /* page token t >= n_old is the sequence's new token t - n_old */
    __device__ size_t step_index(int t, int j) const
    {
        return (size_t)(q_row + t - n_old) * row_stride + (size_t)j;
    }
    __device__ float key(int t, int j) const
    {
        return fr_dev_bf16_decode(t < n_old ? slot_k[(size_t)t * d + j] : step_k[step_index(t, j)]);
    }
    __device__ float value(int t, int j) const
    {
        return fr_dev_bf16_decode(t < n_old ? slot_v[(size_t)t * d + j] : step_v[step_index(t, j)]);
    }
};

/* FP4 head page (kv_cache.c write_head_page): keys per token in blocks of B
 * channels with the recipe's scale search, values per channel in blocks of
 * B tokens with the standard scale. One quantization block per thread. */
template <fr_fp4_format F>
__device__ void promote_fp4(const page_source &src, uint8_t *page, const commit_args &a, bool zero_sink)
{
    constexpr int B = fr_dev_fp4<F>::block;
    const int d = a.d, kb = d / B;
    const fr_page_layout &l = a.layout;
    float x[B];
    uint8_t codes[B];
    for (int w = threadIdx.x; w < T * kb; w += blockDim.x) {   /* w = token * kb + block */
        const int t = w / kb, c0 = (w % kb) * B;
#pragma unroll
        for (int i = 0; i < B; i++) x[i] = src.key(t, c0 + i);
        page[l.k_scales + (size_t)w] = fr_dev_fp4_quantize_block<F>(a.search != 0, x, codes);
        uint32_t *dst = reinterpret_cast<uint32_t *>(page + l.k_codes + (size_t)t * (d / 2) + c0 / 2);
#pragma unroll
        for (int i = 0; i < B; i += 8) dst[i / 8] = fr_dev_fp4_word_pack(codes + i);
    }
    /* Adjacent threads take adjacent channels of the same tokens, so the
     * reads of a warp are contiguous. */
    for (int w = threadIdx.x; w < (T / B) * d; w += blockDim.x) {   /* w = block * d + channel */
        const int b = w / d, j = w % d;
#pragma unroll
        for (int i = 0; i < B; i++) {
            const int t = b * B + i;
            /* the sink's page copy is masked; zero values keep it out of the scales */
            x[i] = zero_sink && t < SINK ? 0.0f : src.value(t, j);
        }
        page[l.v_scales + (size_t)j * (T / B) + b] = fr_dev_fp4_quantize_block<F>(false, x, codes);
        uint32_t *dst = reinterpret_cast<uint32_t *>(page + l.v_codes + (size_t)j * (T / 2) + (size_t)(b * B) / 2);
#pragma unroll
        for (int i = 0; i < B; i += 8) dst[i / 8] = fr_dev_fp4_word_pack(codes + i);
    }
}

/* FP8 head page: E4M3(x / per-head scale), the quotient in float32. */
__device__ void promote_fp8(const page_source &src, uint8_t *page, const commit_args &a, int head)
{
    const float sk = a.fp8_scales[2 * head], sv = a.fp8_scales[2 * head + 1];
    for (int w = threadIdx.x; w < T * a.d; w += blockDim.x) {
        const int t = w / a.d, j = w % a.d;
        page[a.layout.k_codes + (size_t)w] = fr_dev_e4m3_encode(__fdiv_rn(src.key(t, j), sk));
        page[a.layout.v_codes + (size_t)w] = fr_dev_e4m3_encode(__fdiv_rn(src.value(t, j), sv));
    }
}

/* BF16 head page: the slot values re-encoded, as the CPU does (the same
 * bits, since they already are BF16). */
__device__ void promote_bf16(const page_source &src, uint8_t *page, const commit_args &a)
{
    uint16_t *pk = (uint16_t *)(page + a.layout.k_codes), *pv = (uint16_t *)(page + a.layout.v_codes);
    for (int w = threadIdx.x; w < T * a.d; w += blockDim.x) {
        const int t = w / a.d, j = w % a.d;
        pk[w] = fr_dev_bf16_encode(src.key(t, j));
        pv[w] = fr_dev_bf16_encode(src.value(t, j));
    }
}

/* Grid (sequence, k-th page the step completes, head): one head page of
 * this layer per thread block; blocks past the sequence's last completed
 * page leave at once. */
template <fr_kv_dtype DT>
__global__ void __launch_bounds__(PROMOTE_THREADS) promote_kernel(commit_args a)
{
    const fr_paged_seq q = a.seqs[blockIdx.x];
    if (record_problem(q, a)) return;
    const int p = q.len / T + (int)blockIdx.y;
    if (p >= (q.len + q.n_new) / T) return;
    const int block = q.block_table ? q.block_table[p] : -1;
    if (block < 0 || block >= a.n_blocks) {
        if (threadIdx.x == 0) atomicOr(a.error, (unsigned)ERR_BLOCK);
        return;
    }
    const int h = (int)blockIdx.z;
    const size_t lh = (size_t)a.layer * a.n_kv_heads + (size_t)h;
    const uint16_t *slot = a.recent + (size_t)q.slot * 2 * a.slot_elems + lh * T * (size_t)a.d;
    page_source src;
    src.slot_k = slot;
    src.slot_v = slot + a.slot_elems;
    src.step_k = a.step_k + (size_t)h * a.d;
    src.step_v = a.step_v + (size_t)h * a.d;
    src.row_stride = (size_t)a.n_kv_heads * a.d;
    src.q_row = q.q_row;
    src.n_old = q.len - p * T;
    src.d = a.d;
    uint8_t *page = a.pool + (size_t)block * a.block_bytes + lh * a.layout.head_page_bytes;
    if constexpr (DT == FR_KV_NVFP4)
        promote_fp4<FR_NVFP4>(src, page, a, p == 0 && a.zero_sink);
    else if constexpr (DT == FR_KV_MXFP4)
        promote_fp4<FR_MXFP4>(src, page, a, p == 0 && a.zero_sink);
    else if constexpr (DT == FR_KV_FP8)
        promote_fp8(src, page, a, h);
    else
        promote_bf16(src, page, a);
}

/* A latent page (kv_cache.c write_latent_page): per token the latent in
 * the dtype's format (FP4: blocks along the channels with the recipe's
 * scale search, one block per thread; FP8: E4M3 of x / the layer's scale)
 * and the RoPE part in BF16. */
template <fr_kv_dtype DT>
__device__ void promote_latent(const page_source &src, uint8_t *page, const commit_args &a)
{
    const fr_page_layout &l = a.layout;
    const int dc = a.dc, dr = a.d - a.dc;
    uint16_t *pr = reinterpret_cast<uint16_t *>(page + l.rope);
    for (int w = threadIdx.x; w < T * dr; w += blockDim.x) pr[w] = fr_dev_bf16_encode(src.key(w / dr, dc + w % dr));
    if constexpr (DT == FR_KV_NVFP4 || DT == FR_KV_MXFP4) {
        constexpr fr_fp4_format F = DT == FR_KV_NVFP4 ? FR_NVFP4 : FR_MXFP4;
        constexpr int B = fr_dev_fp4<F>::block;
        const int kb = dc / B;
        float x[B];
        uint8_t codes[B];
        for (int w = threadIdx.x; w < T * kb; w += blockDim.x) {   /* w = token * kb + block */
            const int t = w / kb, c0 = (w % kb) * B;
#pragma unroll
            for (int i = 0; i < B; i++) x[i] = src.key(t, c0 + i);
            page[l.k_scales + (size_t)w] = fr_dev_fp4_quantize_block<F>(a.search != 0, x, codes);
            uint32_t *dst = reinterpret_cast<uint32_t *>(page + l.k_codes + (size_t)t * (dc / 2) + c0 / 2);
#pragma unroll
            for (int i = 0; i < B; i += 8) dst[i / 8] = fr_dev_fp4_word_pack(codes + i);
        }
    } else if constexpr (DT == FR_KV_FP8) {
        const float sc = a.fp8_scales[0];   /* the layer's K entry */
        for (int w = threadIdx.x; w < T * dc; w += blockDim.x)
            page[l.k_codes + (size_t)w] = fr_dev_e4m3_encode(__fdiv_rn(src.key(w / dc, w % dc), sc));
    } else {
        uint16_t *pc = reinterpret_cast<uint16_t *>(page + l.k_codes);
        for (int w = threadIdx.x; w < T * dc; w += blockDim.x) pc[w] = fr_dev_bf16_encode(src.key(w / dc, w % dc));
    }
}

/* Grid (sequence, k-th page the step completes): one latent page of this
 * layer per thread block. */
template <fr_kv_dtype DT>
__global__ void __launch_bounds__(PROMOTE_THREADS) latent_promote_kernel(commit_args a)
{
    const fr_paged_seq q = a.seqs[blockIdx.x];
    if (record_problem(q, a)) return;
    const int p = q.len / T + (int)blockIdx.y;
    if (p >= (q.len + q.n_new) / T) return;
    const int block = q.block_table ? q.block_table[p] : -1;
    if (block < 0 || block >= a.n_blocks) {
        if (threadIdx.x == 0) atomicOr(a.error, (unsigned)ERR_BLOCK);
        return;
    }
    const uint16_t *slot = a.recent + (size_t)q.slot * a.slot_elems + (size_t)a.layer * T * (size_t)a.d;
    page_source src;
    src.slot_k = src.slot_v = slot;
    src.step_k = src.step_v = a.step_k;
    src.row_stride = (size_t)a.d;
    src.q_row = q.q_row;
    src.n_old = q.len - p * T;
    src.d = a.d;
    promote_latent<DT>(src, a.pool + (size_t)block * a.block_bytes + (size_t)a.layer * a.layout.head_page_bytes, a);
}

/* Copies the step's tokens [t0, t1) of sequence q, every head, from the
 * staging rows to a slot whose (layer, head) part has rows_per_head rows
 * (token t at row t % rows_per_head); dst_k is the slot's (layer, head 0)
 * K, V lies v_offset further. The source run is contiguous. */
__device__ void copy_tokens(const commit_args &a, const fr_paged_seq &q, int t0, int t1, uint16_t *dst_k,
                            size_t v_offset, int rows_per_head)
{
    if (t1 <= t0) return;
    const size_t row = (size_t)a.n_kv_heads * a.d, n = (size_t)(t1 - t0) * row;
    const size_t src0 = (size_t)(q.q_row + t0 - q.len) * row;
    for (size_t w = threadIdx.x; w < n; w += blockDim.x) {
        const int t = t0 + (int)(w / row), rem = (int)(w % row), h = rem / a.d, j = rem % a.d;
        const size_t o = ((size_t)h * rows_per_head + (size_t)(t % rows_per_head)) * a.d + (size_t)j;
        dst_k[o] = a.step_k[src0 + w];
        if (a.halves == 2) dst_k[o + v_offset] = a.step_v[src0 + w];
    }
}

/* One thread block per sequence: the new tokens of the last partial page to
 * the recent slot, new tokens below 16 to the sink. Runs after promotion,
 * which reads the rows this overwrites. */
__global__ void __launch_bounds__(SLOT_THREADS) slot_kernel(commit_args a)
{
    const fr_paged_seq q = a.seqs[blockIdx.x];
    const unsigned bad = record_problem(q, a);
    if (bad) {
        if (threadIdx.x == 0) atomicOr(a.error, bad);
        return;
    }
    const int end = q.len + q.n_new;
    const int partial = max(q.len, end / T * T);   /* first new token of the last partial page */
    const size_t layer_off = (size_t)a.layer * a.n_kv_heads * a.d;
    uint16_t *recent = a.recent + (size_t)q.slot * a.halves * a.slot_elems + layer_off * T;
    uint16_t *sink = a.sink + (size_t)q.slot * a.halves * a.sink_elems + layer_off * SINK;
    copy_tokens(a, q, partial, end, recent, a.slot_elems, T);
    copy_tokens(a, q, q.len, min(end, (int)SINK), sink, a.sink_elems, SINK);
}

/* ================= host side ================= */

/* The store's kernels give a lane at most 8 elements of a head. */
constexpr int kMaxStoreDim = 256;

static fr_status check_config(const fr_kv_cache_config *cfg)
{
    if (!cfg) return fr_fail(FR_EINVAL, "kv store (GPU): NULL config");
    const int L = cfg->n_layers, H = cfg->n_kv_heads, d = cfg->head_dim;
    const int max_d = cfg->latent_dim > 0 ? kMaxLatentRow : kMaxStoreDim;
    if (L < 1 || H < 1 || d < 1 || d > max_d || cfg->n_blocks < 1 || cfg->max_seqs < 1)
        return fr_fail(FR_EINVAL, "kv store (GPU): invalid sizes (layers %d, kv heads %d, head_dim %d, "
                                  "blocks %d, sequences %d)", L, H, d, cfg->n_blocks, cfg->max_seqs);
    const int dc = cfg->latent_dim;
    if (dc < 0 || (dc > 0 && (H != 1 || dc >= d)))
        return fr_fail(FR_EINVAL, "kv store (GPU): a latent cache needs one KV head and a latent width below the "
                                  "row's %d (kv heads %d, latent %d)", d, H, dc);
    if (H > MAX_GRID_YZ)
        return fr_fail(FR_EINVAL, "kv store (GPU): %d kv heads exceed the %d a launch allows", H, MAX_GRID_YZ);
    if (cfg->dtype == FR_KV_F32)
        return fr_fail(FR_EUNSUPPORTED, "kv store (GPU): kv dtype f32 is the CPU reference only; "
                                        "the GPU stores bf16, fp8, nvfp4 or mxfp4");
    if (cfg->dtype != FR_KV_BF16 && cfg->dtype != FR_KV_FP8 && cfg->dtype != FR_KV_NVFP4 &&
        cfg->dtype != FR_KV_MXFP4)
        return fr_fail(FR_EINVAL, "kv store (GPU): unknown kv dtype %d", (int)cfg->dtype);
    if (fr_kv_dtype_is_fp4(cfg->dtype)) {
        /* the channels the recipe quantizes and rotates: the head, or a latent row's latent */
        const int B = fr_fp4_block_size(fr_kv_dtype_fp4_format(cfg->dtype)), qd = dc > 0 ? dc : d;
        const char *what = dc > 0 ? "latent width" : "head_dim";
        if (qd % B)
            return fr_fail(FR_EINVAL, "kv store (GPU): %s %d is not a multiple of the %s block %d", what, qd,
                           fr_kv_dtype_name(cfg->dtype), B);
        if (cfg->recipe.rotate && (qd & (qd - 1)))
            return fr_fail(FR_EINVAL, "kv store (GPU): Hadamard rotation needs a power-of-two %s, not %d", what, qd);
    }
    if (cfg->fp8_scales)
        for (int i = 0; i < L * H * 2; i++)
            if (!(cfg->fp8_scales[i] > 0.0f))
                return fr_fail(FR_EINVAL, "kv store (GPU): FP8 scale %d is not positive", i);
    return FR_OK;
}

/* The key mean to the device in place (NULL: zeros). */
static fr_status upload_key_mean(fr_kv_store_gpu *s, const float *key_mean)
{
    const size_t n = (size_t)s->cfg.n_layers * s->cfg.n_kv_heads * s->cfg.head_dim;
    if (key_mean)
        FR_CUDA_TRY(cudaMemcpy(s->key_mean, key_mean, sizeof(float) * n, cudaMemcpyHostToDevice));
    else
        FR_CUDA_TRY(cudaMemset(s->key_mean, 0, sizeof(float) * n));
    return FR_OK;
}

fr_status fr_kv_store_gpu_set_key_mean(fr_kv_store_gpu *s, const float *key_mean)
{
    if (!s) return fr_fail(FR_EINVAL, "fr_kv_store_gpu_set_key_mean: no store");
    fr_status st = upload_key_mean(s, key_mean);
    if (st) return st;
    FR_CUDA_TRY(cudaDeviceSynchronize());
    return FR_OK;
}

/* The key mean (zeros when absent) and FP8 scales (1.0 when absent) to the device. */
static fr_status upload_calibration(fr_kv_store_gpu *s, const fr_kv_cache_config *cfg)
{
    const size_t n_scales = (size_t)cfg->n_layers * cfg->n_kv_heads * 2;
    fr_status st = upload_key_mean(s, cfg->key_mean);
    if (st) return st;
    float *scales = (float *)malloc(sizeof(float) * n_scales);
    if (!scales) return fr_fail(FR_ENOMEM, "kv store (GPU): out of memory");
    for (size_t i = 0; i < n_scales; i++) scales[i] = cfg->fp8_scales ? cfg->fp8_scales[i] : 1.0f;
    cudaError_t e = cudaMemcpy(s->fp8_scales, scales, sizeof(float) * n_scales, cudaMemcpyHostToDevice);
    free(scales);
    if (e != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "kv store (GPU): copying the FP8 scales failed: %s", cudaGetErrorString(e));
    return FR_OK;
}

static fr_status alloc_device(fr_kv_store_gpu *s, const fr_kv_cache_config *cfg)
{
    const size_t pool = (size_t)cfg->n_blocks * s->block_bytes;
    const size_t recent = sizeof(uint16_t) * (size_t)s->halves * s->slot_elems * (size_t)cfg->max_seqs;
    const size_t sink = sizeof(uint16_t) * (size_t)s->halves * s->sink_elems * (size_t)cfg->max_seqs;
    const size_t n_lh = (size_t)cfg->n_layers * cfg->n_kv_heads;
    FR_CUDA_TRY(cudaMalloc((void **)&s->pool, pool));
    FR_CUDA_TRY(cudaMalloc((void **)&s->recent, recent));
    FR_CUDA_TRY(cudaMalloc((void **)&s->sink, sink));
    FR_CUDA_TRY(cudaMalloc((void **)&s->key_mean, sizeof(float) * n_lh * cfg->head_dim));
    FR_CUDA_TRY(cudaMalloc((void **)&s->fp8_scales, sizeof(float) * n_lh * 2));
    FR_CUDA_TRY(cudaMalloc((void **)&s->error, sizeof(unsigned)));
    /* Zeroed so that bytes nobody wrote compare equal on both sides. */
    FR_CUDA_TRY(cudaMemset(s->pool, 0, pool));
    FR_CUDA_TRY(cudaMemset(s->recent, 0, recent));
    FR_CUDA_TRY(cudaMemset(s->sink, 0, sink));
    FR_CUDA_TRY(cudaMemset(s->error, 0, sizeof(unsigned)));
    fr_status st = upload_calibration(s, cfg);
    if (st) return st;
    FR_CUDA_TRY(cudaDeviceSynchronize());   /* the memsets run async to the host */
    return FR_OK;
}

fr_status fr_kv_store_gpu_new(const fr_kv_cache_config *cfg, fr_kv_store_gpu **out)
{
    if (!out) return fr_fail(FR_EINVAL, "kv store (GPU): NULL output");
    *out = NULL;
    fr_status st = check_config(cfg);
    if (st) return st;
    fr_kv_store_gpu *s = (fr_kv_store_gpu *)calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "kv store (GPU): out of memory");
    s->cfg = *cfg;
    s->cfg.key_mean = s->cfg.fp8_scales = NULL;
    s->cfg.bookkeeping_only = 0;
    s->halves = cfg->latent_dim > 0 ? 1 : 2;
    s->layout = cfg->latent_dim > 0 ? fr_page_layout_latent(cfg->dtype, cfg->latent_dim, cfg->head_dim - cfg->latent_dim)
                                    : fr_page_layout_for(cfg->dtype, cfg->head_dim);
    s->block_bytes = s->layout.head_page_bytes * (size_t)cfg->n_layers * (size_t)cfg->n_kv_heads;
    s->slot_elems = (size_t)cfg->n_layers * cfg->n_kv_heads * T * cfg->head_dim;
    s->sink_elems = (size_t)cfg->n_layers * cfg->n_kv_heads * SINK * cfg->head_dim;
    st = alloc_device(s, cfg);
    if (st) {
        fr_kv_store_gpu_destroy(&s);
        return st;
    }
    *out = s;
    return FR_OK;
}

fr_status fr_kv_store_gpu_release(fr_kv_store_gpu *s)
{
    if (!s) return fr_fail(FR_EINVAL, "kv store (GPU): NULL store");
    if (!s->pool) return FR_OK;
    FR_CUDA_TRY(cudaDeviceSynchronize());   /* nothing in flight may still read them */
    cudaFree(s->pool);
    cudaFree(s->recent);
    cudaFree(s->sink);
    s->pool = NULL;
    s->recent = s->sink = NULL;
    return FR_OK;
}

fr_status fr_kv_store_gpu_restore(fr_kv_store_gpu *s)
{
    if (!s) return fr_fail(FR_EINVAL, "kv store (GPU): NULL store");
    if (s->pool) return FR_OK;
    const size_t pool = (size_t)s->cfg.n_blocks * s->block_bytes;
    const size_t recent = sizeof(uint16_t) * (size_t)s->halves * s->slot_elems * (size_t)s->cfg.max_seqs;
    const size_t sink = sizeof(uint16_t) * (size_t)s->halves * s->sink_elems * (size_t)s->cfg.max_seqs;
    if (cudaMalloc((void **)&s->pool, pool) != cudaSuccess || cudaMalloc((void **)&s->recent, recent) != cudaSuccess ||
        cudaMalloc((void **)&s->sink, sink) != cudaSuccess) {
        cudaFree(s->pool);
        cudaFree(s->recent);
        cudaFree(s->sink);
        s->pool = NULL;
        s->recent = s->sink = NULL;
        return fr_fail(FR_ENOMEM, "kv store (GPU): cannot allocate the pages again (%zu bytes): is the memory still "
                                  "in another process's use?", pool + recent + sink);
    }
    FR_CUDA_TRY(cudaMemset(s->pool, 0, pool));
    FR_CUDA_TRY(cudaMemset(s->recent, 0, recent));
    FR_CUDA_TRY(cudaMemset(s->sink, 0, sink));
    FR_CUDA_TRY(cudaDeviceSynchronize());
    return FR_OK;
}

void fr_kv_store_gpu_destroy(fr_kv_store_gpu **ps)
{
    fr_kv_store_gpu *s = ps ? *ps : NULL;
    if (!s) return;
    cudaFree(s->pool);
    cudaFree(s->recent);
    cudaFree(s->sink);
    cudaFree(s->key_mean);
    cudaFree(s->fp8_scales);
    cudaFree(s->error);
    free(s);
    *ps = NULL;
}

/* What both views (per-head pages, latent rows) say alike: the pool, the
 * recent and sink slots, and the layer. */
template <class View> static void view_pages(const fr_kv_store_gpu *s, int layer, View &v)
{
    v.pool = s->pool;
    v.block_bytes = s->block_bytes;
    v.recent = s->recent;
    v.sink = s->sink;
    v.slot_elems = s->slot_elems;
    v.sink_elems = s->sink_elems;
    v.layer = layer;
}

fr_paged_kv fr_kv_store_gpu_view(const fr_kv_store_gpu *s, int layer, const uint16_t *step_k,
                                 const uint16_t *step_v)
{
    fr_paged_kv v;
    memset(&v, 0, sizeof v);
    if (!s || layer < 0 || layer >= s->cfg.n_layers) return v;
    view_pages(s, layer, v);
    v.head_page_bytes = s->layout.head_page_bytes;
    v.k_codes = s->layout.k_codes;
    v.k_scales = s->layout.k_scales;
    v.v_codes = s->layout.v_codes;
    v.v_scales = s->layout.v_scales;
    v.step_k = step_k;
    v.step_v = step_v;
    v.n_layers = s->cfg.n_layers;
    v.n_kv_heads = s->cfg.n_kv_heads;
    v.head_dim = s->cfg.head_dim;
    return v;
}

fr_latent_kv fr_kv_store_gpu_latent_view(const fr_kv_store_gpu *s, int layer, const uint16_t *step_rows)
{
    fr_latent_kv v;
    memset(&v, 0, sizeof v);
    if (!s || s->cfg.latent_dim <= 0 || layer < 0 || layer >= s->cfg.n_layers) return v;
    view_pages(s, layer, v);
    v.page_bytes = s->layout.head_page_bytes;
    v.codes = s->layout.k_codes;
    v.scales = s->layout.k_scales;
    v.rope = s->layout.rope;
    v.step_rows = step_rows;
    return v;
}

static fr_status check_layer(const fr_kv_store_gpu *s, const char *what, int layer)
{
    if (!s) return fr_fail(FR_EINVAL, "kv store (GPU) %s: NULL store", what);
    if (layer < 0 || layer >= s->cfg.n_layers)
        return fr_fail(FR_EINVAL, "kv store (GPU) %s: layer %d is outside [0, %d)", what, layer, s->cfg.n_layers);
    return FR_OK;
}

template <int E> static void launch_stage(const stage_args &a, cudaStream_t stream)
{
    const int warps_per_block = STAGE_THREADS / 32;
    const unsigned blocks = (unsigned)((a.vectors + warps_per_block - 1) / warps_per_block);
    stage_kernel<E><<<blocks, STAGE_THREADS, 0, stream>>>(a);
}

fr_status fr_kv_store_gpu_stage(const fr_kv_store_gpu *s, int layer, int rows, const float *k,
                                const float *v, uint16_t *step_k, uint16_t *step_v, cudaStream_t stream)
{
    fr_status st = check_layer(s, "stage", layer);
    if (st) return st;
    const int H = s->cfg.n_kv_heads, d = s->cfg.head_dim;
    if (rows < 0 || (long long)rows * H > INT_MAX / 32)
        return fr_fail(FR_EINVAL, "kv store (GPU) stage: invalid row count %d", rows);
    if (rows == 0) return FR_OK;
    const int latent = s->cfg.latent_dim > 0;
    if (!k || !step_k || (!latent && (!v || !step_v)))
        return fr_fail(FR_EINVAL, "kv store (GPU) stage: NULL input or staging buffer");
    if (latent) {
        latent_stage_args la;
        la.rows = k;
        la.step = step_k;
        la.mean = is_fp4(s) && s->cfg.recipe.smooth ? s->key_mean + (size_t)layer * d : NULL;
        la.d = d;
        la.dc = s->cfg.latent_dim;
        la.rotate = is_fp4(s) && s->cfg.recipe.rotate;
        latent_stage_kernel<<<(unsigned)rows, LATENT_THREADS, 0, stream>>>(la);
        FR_CUDA_LAUNCHED();
        return FR_OK;
    }
    stage_args a;
    a.k = k;
    a.v = v;
    a.step_k = step_k;
    a.step_v = step_v;
    a.mean = is_fp4(s) && s->cfg.recipe.smooth ? s->key_mean + (size_t)layer * H * d : NULL;
    a.rotate = is_fp4(s) && s->cfg.recipe.rotate;
    a.vectors = rows * H;
    a.n_kv_heads = H;
    a.d = d;
    switch ((d + 31) / 32) {   /* d <= kMaxStoreDim = 256: at most 8 elements a lane */
    case 1: launch_stage<1>(a, stream); break;
    case 2: launch_stage<2>(a, stream); break;
    case 3: launch_stage<3>(a, stream); break;
    case 4: launch_stage<4>(a, stream); break;
    case 5: launch_stage<5>(a, stream); break;
    case 6: launch_stage<6>(a, stream); break;
    case 7: launch_stage<7>(a, stream); break;
    default: launch_stage<8>(a, stream); break;
    }
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

/* Grid (sequence, page, head) for heads, (sequence, page) for latent rows. */
template <fr_kv_dtype DT> static void launch_promote(int latent, dim3 grid, const commit_args &a, cudaStream_t stream)
{
    if (latent)
        latent_promote_kernel<DT><<<grid, PROMOTE_THREADS, 0, stream>>>(a);
    else
        promote_kernel<DT><<<grid, PROMOTE_THREADS, 0, stream>>>(a);
}

fr_status fr_kv_store_gpu_commit(const fr_kv_store_gpu *s, int layer, const fr_paged_seq *seqs, int n_seqs,
                                 int max_pages_per_seq, const uint16_t *step_k, const uint16_t *step_v,
                                 cudaStream_t stream)
{
    fr_status st = check_layer(s, "commit", layer);
    if (st) return st;
    if (n_seqs < 0 || n_seqs > s->cfg.max_seqs)
        return fr_fail(FR_EINVAL, "kv store (GPU) commit: %d sequences, expected 0..%d (the slots)", n_seqs,
                       s->cfg.max_seqs);
    if (max_pages_per_seq < 0 || max_pages_per_seq > MAX_GRID_YZ)
        return fr_fail(FR_EINVAL, "kv store (GPU) commit: pages per sequence %d outside [0, %d]",
                       max_pages_per_seq, MAX_GRID_YZ);
    if (n_seqs == 0) return FR_OK;
    const int latent = s->cfg.latent_dim > 0;
    if (!seqs || !step_k || (!latent && !step_v))
        return fr_fail(FR_EINVAL, "kv store (GPU) commit: NULL sequence records or staging buffer");
    const int H = s->cfg.n_kv_heads;
    commit_args a;
    a.seqs = seqs;
    a.step_k = step_k;
    a.step_v = latent ? step_k : step_v;
    a.pool = s->pool;
    a.recent = s->recent;
    a.sink = s->sink;
    a.fp8_scales = s->fp8_scales + (size_t)layer * H * 2;
    a.error = s->error;
    a.layout = s->layout;
    a.block_bytes = s->block_bytes;
    a.slot_elems = s->slot_elems;
    a.sink_elems = s->sink_elems;
    a.layer = layer;
    a.n_kv_heads = H;
    a.d = s->cfg.head_dim;
    a.n_blocks = s->cfg.n_blocks;
    a.max_seqs = s->cfg.max_seqs;
    a.max_pages = max_pages_per_seq;
    a.halves = s->halves;
    a.dc = s->cfg.latent_dim;
    a.search = s->cfg.recipe.scale_search;
    a.zero_sink = is_fp4(s) && s->cfg.recipe.sink_recent;
    /* Promotion first: it reads recent slot rows the slot writes replace. */
    if (max_pages_per_seq > 0) {
        const dim3 grid((unsigned)n_seqs, (unsigned)max_pages_per_seq, latent ? 1u : (unsigned)H);
        switch (s->cfg.dtype) {
        case FR_KV_NVFP4: launch_promote<FR_KV_NVFP4>(latent, grid, a, stream); break;
        case FR_KV_MXFP4: launch_promote<FR_KV_MXFP4>(latent, grid, a, stream); break;
        case FR_KV_FP8: launch_promote<FR_KV_FP8>(latent, grid, a, stream); break;
        default: launch_promote<FR_KV_BF16>(latent, grid, a, stream); break;
        }
        FR_CUDA_LAUNCHED();
    }
    slot_kernel<<<(unsigned)n_seqs, SLOT_THREADS, 0, stream>>>(a);
    FR_CUDA_LAUNCHED();
    return FR_OK;
}

fr_status fr_kv_store_gpu_copy_slot(const fr_kv_store_gpu *s, int src_slot, int dst_slot, cudaStream_t stream)
{
    if (!s) return fr_fail(FR_EINVAL, "kv store (GPU) copy_slot: NULL store");
    if (src_slot < 0 || src_slot >= s->cfg.max_seqs || dst_slot < 0 || dst_slot >= s->cfg.max_seqs)
        return fr_fail(FR_EINVAL, "kv store (GPU) copy_slot: slots %d -> %d outside [0, %d)", src_slot, dst_slot,
                       s->cfg.max_seqs);
    if (src_slot == dst_slot) return FR_OK;
    const size_t recent = (size_t)s->halves * s->slot_elems, sink = (size_t)s->halves * s->sink_elems;
    FR_CUDA_TRY(cudaMemcpyAsync(s->recent + (size_t)dst_slot * recent, s->recent + (size_t)src_slot * recent,
                                sizeof(uint16_t) * recent, cudaMemcpyDeviceToDevice, stream));
    FR_CUDA_TRY(cudaMemcpyAsync(s->sink + (size_t)dst_slot * sink, s->sink + (size_t)src_slot * sink,
                                sizeof(uint16_t) * sink, cudaMemcpyDeviceToDevice, stream));
    return FR_OK;
}

fr_status fr_kv_store_gpu_check(const fr_kv_store_gpu *s, cudaStream_t stream)
{
    if (!s) return fr_fail(FR_EINVAL, "kv store (GPU) check: NULL store");
    unsigned flags = 0;
    FR_CUDA_TRY(cudaMemcpyAsync(&flags, s->error, sizeof flags, cudaMemcpyDeviceToHost, stream));
    FR_CUDA_TRY(cudaStreamSynchronize(stream));
    if (!flags) return FR_OK;
    FR_CUDA_TRY(cudaMemsetAsync(s->error, 0, sizeof(unsigned), stream));
    FR_CUDA_TRY(cudaStreamSynchronize(stream));
    return fr_fail(FR_EINTERNAL, "kv store (GPU): commit skipped sequences with%s%s%s%s",
                   flags & ERR_SLOT ? " a slot out of range" : "",
                   flags & ERR_RECORD ? " a negative length, new-token count or staging row" : "",
                   flags & ERR_PAGES ? " more completed pages than max_pages_per_seq" : "",
                   flags & ERR_BLOCK ? " a missing or out-of-range block id" : "");
}

/* ---- accessors ---- */

const fr_kv_cache_config *fr_kv_store_gpu_config(const fr_kv_store_gpu *s) { return &s->cfg; }
const fr_page_layout *fr_kv_store_gpu_layout(const fr_kv_store_gpu *s) { return &s->layout; }
size_t fr_kv_store_gpu_block_bytes(const fr_kv_store_gpu *s) { return s->block_bytes; }
const float *fr_kv_store_gpu_fp8_scales(const fr_kv_store_gpu *s) { return s->fp8_scales; }
const float *fr_kv_store_gpu_key_mean(const fr_kv_store_gpu *s) { return s->key_mean; }

uint8_t *fr_kv_store_gpu_pool(const fr_kv_store_gpu *s) { return s->pool; }
size_t fr_kv_store_gpu_slot_elems(const fr_kv_store_gpu *s) { return s->slot_elems; }
size_t fr_kv_store_gpu_sink_elems(const fr_kv_store_gpu *s) { return s->sink_elems; }

uint8_t *fr_kv_store_gpu_block(const fr_kv_store_gpu *s, int block)
{
    if (!s || block < 0 || block >= s->cfg.n_blocks) return NULL;
    return s->pool + (size_t)block * s->block_bytes;
}

uint16_t *fr_kv_store_gpu_recent(const fr_kv_store_gpu *s, int slot)
{
    if (!s || slot < 0 || slot >= s->cfg.max_seqs) return NULL;
    return s->recent + (size_t)slot * s->halves * s->slot_elems;
}

uint16_t *fr_kv_store_gpu_sink(const fr_kv_store_gpu *s, int slot)
{
    if (!s || slot < 0 || slot >= s->cfg.max_seqs) return NULL;
    return s->sink + (size_t)slot * s->halves * s->sink_elems;
}
