/* Latent (MLA) attention: the host side (checks, split plan, workspace,
 * launches). The kernels are in attn_mla_kernels.cuh; attn_mla.h is the
 * contract. */
#include "attn_mla.h"

#include <climits>
#include <math.h>
#include <stdint.h>

#include "attn_mla_kernels.cuh"
#include "cuda_check.h"

namespace {

using namespace fr_mla;

constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int kind_of(fr_kv_dtype t)
{
    return t == FR_KV_BF16 ? kBF16 : t == FR_KV_FP8 ? kFP8 : t == FR_KV_NVFP4 ? kNV : t == FR_KV_MXFP4 ? kMX : -1;
}

fr_status check_config(const fr_attn_mla_config *cfg)
{
    if (!cfg) return fr_fail(FR_EINVAL, "attn_mla: NULL config");
    if (kind_of(cfg->dtype) < 0)
        return fr_fail(FR_EUNSUPPORTED, "attn_mla: no latent kernel for KV dtype %s (bf16, fp8, nvfp4, mxfp4)",
                       fr_kv_dtype_name(cfg->dtype));
    if (!((cfg->latent_dim == 512 || cfg->latent_dim == 256) && cfg->rope_dim == 64))
        return fr_fail(FR_EUNSUPPORTED, "attn_mla: latent width %d and RoPE width %d (built for 256 or 512, and 64)",
                       cfg->latent_dim, cfg->rope_dim);
    if (cfg->n_heads < 1) return fr_fail(FR_EINVAL, "attn_mla: %d query heads", cfg->n_heads);
    if (!(cfg->scale > 0.0f) || (cfg->dtype == FR_KV_FP8 && !(cfg->fp8_scale > 0.0f)))
        return fr_fail(FR_EINVAL, "attn_mla: softmax scale %g and FP8 scale %g must be positive", cfg->scale,
                       cfg->fp8_scale);
    return FR_OK;
}

int sm_count()
{
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 132;
    return n > 0 ? n : 132;
}

size_t partial_bytes(const fr_attn_mla_config *cfg, int n_seqs, int row_groups, int n_splits)
{
    if (n_splits <= 1) return 0;
    const size_t slots = (size_t)n_seqs * row_groups * kRows * n_splits;
    return align_up(slots * cfg->latent_dim * sizeof(float)) + align_up(slots * sizeof(float));
}

/* The split count that finishes soonest: a CTA fills a multiprocessor
 * (shared memory), so n splits of `work` row groups take
 * ceil(work n / SMs) waves of ceil(pages / n) + 2 pages each (2: a split's
 * start-up and its share of the combine, in pages); ties go to fewer
 * splits. Only counts whose partials fit the workspace are tried. */
int splits_for(const fr_attn_mla_config *cfg, int n_seqs, int row_groups, int max_ctx, size_t ws)
{
    const long work = (long)n_seqs * row_groups, sms = sm_count();
    const long pages = (max_ctx + kPage - 1) / kPage;
    int best = 1;
    long best_cost = LONG_MAX;
    for (int n = 1; n <= FR_ATTN_MLA_MAX_SPLITS && n <= pages; n++) {
        if (n > 1 && partial_bytes(cfg, n_seqs, row_groups, n) > ws) break;
        const long cost = (work * n + sms - 1) / sms * ((pages + n - 1) / n + 2);
        if (cost < best_cost) {
            best_cost = cost;
            best = n;
        }
    }
    return best;
}

template <int DC, int DR, int KIND> fr_status launch(const Params &P, int n_seqs, cudaStream_t stream)
{
    using G = Geo<DC, DR, KIND>;
    static bool attr_set = false;   /* per device would be stricter; the attribute is the same everywhere */
    if (!attr_set) {
        FR_CUDA_TRY(cudaFuncSetAttribute(mla_kernel<DC, DR, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G::SMEM));
        attr_set = true;
    }
    mla_kernel<DC, DR, KIND><<<dim3(P.n_splits, P.row_groups, n_seqs), kThreads, G::SMEM, stream>>>(P);
    FR_CUDA_LAUNCHED();
    if (P.n_splits > 1) {
        const size_t warps = (size_t)n_seqs * P.row_groups * kRows;
        mla_combine<DC, KIND><<<(unsigned)((warps + 7) / 8), kThreads, 0, stream>>>(P, n_seqs);
        FR_CUDA_LAUNCHED();
    }
    return FR_OK;
}

template <int DC> fr_status launch_dc(int kind, const Params &P, int n_seqs, cudaStream_t stream)
{
    switch (kind) {
    case kBF16: return launch<DC, 64, kBF16>(P, n_seqs, stream);
    case kFP8: return launch<DC, 64, kFP8>(P, n_seqs, stream);
    case kNV: return launch<DC, 64, kNV>(P, n_seqs, stream);
    default: return launch<DC, 64, kMX>(P, n_seqs, stream);
    }
}

}   // namespace

extern "C" fr_status fr_attn_mla_plan_for(const fr_attn_mla_config *cfg, int n_seqs, int max_new, int max_ctx,
                                          size_t workspace_bytes, fr_attn_mla_plan *plan)
{
    fr_status st = check_config(cfg);
    if (st) return st;
    if (!plan || n_seqs < 0 || max_new < 1 || max_ctx < max_new)
        return fr_fail(FR_EINVAL, "attn_mla: plan for %d sequences of up to %d new tokens and %d positions", n_seqs,
                       max_new, max_ctx);
    plan->row_groups = (int)(((long)max_new * cfg->n_heads + kRows - 1) / kRows);
    plan->n_splits = n_seqs > 0 ? splits_for(cfg, n_seqs, plan->row_groups, max_ctx, workspace_bytes) : 1;
    plan->bytes = partial_bytes(cfg, n_seqs, plan->row_groups, plan->n_splits);
    return FR_OK;
}

extern "C" fr_status fr_attn_mla_workspace_bytes(const fr_attn_mla_config *cfg, int max_seqs, int max_new,
                                                 int max_ctx, size_t *bytes)
{
    fr_status st = check_config(cfg);
    if (st) return st;
    if (!bytes || max_seqs < 1 || max_new < 1 || max_ctx < max_new)
        return fr_fail(FR_EINVAL, "attn_mla: workspace for %d sequences of up to %d new tokens and %d positions",
                       max_seqs, max_new, max_ctx);
    size_t most = 0;
    for (int n = 1; n <= max_seqs; n++)
        for (int m = 1; m <= max_new; m = m == max_new ? max_new + 1 : max_new) {
            fr_attn_mla_plan p = {};
            if ((st = fr_attn_mla_plan_for(cfg, n, m, max_ctx, SIZE_MAX, &p))) return st;
            if (p.bytes > most) most = p.bytes;
        }
    *bytes = most;
    return FR_OK;
}

extern "C" fr_status fr_attn_mla(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs_dev,
                                 int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, void *workspace,
                                 size_t workspace_bytes, cudaStream_t stream)
{
    fr_attn_mla_plan plan = {};
    fr_status st = fr_attn_mla_plan_for(cfg, n_seqs, max_new, max_ctx, workspace_bytes, &plan);
    if (st) return st;
    if (!kv || !seqs_dev || !q || !out || (plan.bytes && !workspace))
        return fr_fail(FR_EINVAL, "attn_mla: NULL cache view, sequences, query, output or workspace");
    if (!kv->pool || !kv->recent || (cfg->sink_recent && !kv->sink) || ((kv->codes | kv->scales | kv->rope |
                                                                          kv->page_bytes | kv->block_bytes) % 16))
        return fr_fail(FR_EINVAL, "attn_mla: the cache view needs a pool, slots and 16-byte aligned page parts");
    if (n_seqs == 0) return FR_OK;
    Params P = {};
    P.kv = *kv;
    P.seqs = seqs_dev;
    P.q = q;
    P.out = out;
    const size_t slots = (size_t)n_seqs * plan.row_groups * kRows * plan.n_splits;
    P.o_part = plan.n_splits > 1 ? static_cast<float *>(workspace) : nullptr;
    P.lse_part = plan.n_splits > 1
                     ? reinterpret_cast<float *>(static_cast<uint8_t *>(workspace) +
                                                 align_up(slots * cfg->latent_dim * sizeof(float)))
                     : nullptr;
    P.mean = cfg->mean;
    P.n_heads = cfg->n_heads;
    P.n_splits = plan.n_splits;
    P.row_groups = plan.row_groups;
    P.scale_log2 = cfg->scale * 1.4426950408889634f;
    P.fp8_scale = cfg->dtype == FR_KV_FP8 ? cfg->fp8_scale : 1.0f;
    P.rotate = cfg->rotate;
    P.sink_recent = cfg->sink_recent && fr_kv_dtype_is_fp4(cfg->dtype);
    P.q_mode = cfg->q_mode;
    P.q_search = cfg->q_search;
    P.q_bf16 = cfg->q_bf16;
    const int kind = kind_of(cfg->dtype);
    return cfg->latent_dim == 512 ? launch_dc<512>(kind, P, n_seqs, stream) : launch_dc<256>(kind, P, n_seqs, stream);
}
