/* Latent (MLA) attention: the host side (checks, split plan, workspace, launches).
 * The kernels are in attn_mla_kernels.cuh; attn_mla.h is the contract.
 *
 * A call plans the row groups (64 query rows each) and the split count from its
 * bounds only (n_seqs, max_new, max_ctx), never from the device-resident lengths, so
 * a decode step's launch shape is fixed and the step can be captured in a CUDA graph
 * and replayed. The workspace holds only the split partials; with one split there is
 * none. */
#include "attn_mla.h"

#include <climits>
#include <math.h>
#include <stdint.h>

#include "attn_mla_kernels.cuh"
#include "cuda_check.h"

namespace {

using namespace fr_mla;

/* Alignment of the workspace's parts (the partial outputs, then their LSEs). */
constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

/* The cache dtype as the kernels' Kind, -1 for one without a latent kernel. */
int kind_of(fr_kv_dtype t)
{
    return t == FR_KV_BF16 ? kBF16 : t == FR_KV_FP8 ? kFP8 : t == FR_KV_NVFP4 ? kNV : t == FR_KV_MXFP4 ? kMX : -1;
}

/* The kernels are instantiated for every latent width d_c that is a multiple of 64
 * from 128 to 512 (tqa's 256, DeepSeek-V3's 512, and the widths between) with d_r 64,
 * and the four latent dtypes; anything else is refused by name (FR_EUNSUPPORTED, so
 * --backend auto runs such a model on the CPU) rather than run through a kernel built
 * for another shape. The Hadamard rotation needs a power-of-two d_c, as the caches
 * do. The softmax scale must be positive, and so must FP8's layer scale, which
 * scales the query and the output and divides the on-the-fly latents. */
constexpr int kMinLatent = 128, kMaxLatent = 512, kLatentStep = 64, kRope = 64;

fr_status check_config(const fr_attn_mla_config *cfg)
{
    if (!cfg) return fr_fail(FR_EINVAL, "attn_mla: NULL config");
    if (kind_of(cfg->dtype) < 0)
        return fr_fail(FR_EUNSUPPORTED, "attn_mla: no latent kernel for KV dtype %s (bf16, fp8, nvfp4, mxfp4)",
                       fr_kv_dtype_name(cfg->dtype));
    const int dc = cfg->latent_dim;
    if (dc < kMinLatent || dc > kMaxLatent || dc % kLatentStep || cfg->rope_dim != kRope)
        return fr_fail(FR_EUNSUPPORTED, "attn_mla: latent width %d and RoPE width %d (built for latent widths %d to "
                       "%d in steps of %d, and RoPE width %d)", dc, cfg->rope_dim, kMinLatent, kMaxLatent,
                       kLatentStep, kRope);
    if (cfg->rotate && (dc & (dc - 1)))
        return fr_fail(FR_EINVAL, "attn_mla: the Hadamard rotation needs a power-of-two latent width, not %d", dc);
    if (cfg->n_heads < 1) return fr_fail(FR_EINVAL, "attn_mla: %d query heads", cfg->n_heads);
    if (!(cfg->scale > 0.0f) || (cfg->dtype == FR_KV_FP8 && !(cfg->fp8_scale > 0.0f)))
        return fr_fail(FR_EINVAL, "attn_mla: softmax scale %g and FP8 scale %g must be positive", cfg->scale,
                       cfg->fp8_scale);
    return FR_OK;
}

/* The current device's SM count, for the wave count of the plan. If the runtime
 * cannot say, the H200's 132 stands in: the plan then only loses efficiency, never
 * correctness. */
int sm_count()
{
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return 132;
    return n > 0 ? n : 132;
}

/* Workspace of a plan: per (sequence, row of every row group, split) a float output
 * row of d_c channels, then an LSE; nothing with one split. */
size_t partial_bytes(const fr_attn_mla_config *cfg, int n_seqs, int row_groups, int n_splits)
{
    if (n_splits <= 1) return 0;
    const size_t slots = (size_t)n_seqs * row_groups * kRows * n_splits;
    return align_up(slots * cfg->latent_dim * sizeof(float)) + align_up(slots * sizeof(float));
}

/* The split count that finishes soonest: a CTA fills a multiprocessor (shared
 * memory), so n splits of `work` row groups take ceil(work n / SMs) waves of
 * ceil(pages / n) + 2 pages each (2: a split's start-up and its share of the combine,
 * in pages); ties go to fewer splits. Only counts whose partials fit the workspace
 * are tried, and never more splits than max_ctx has pages. Counting waves of one CTA
 * per multiprocessor took BF16 latents at 128K batch 16 from 4.9 to 3.6 ms
 * (bench/RESULTS.md, "Latent (MLA) attention on one H200", the attempts). A sequence
 * with fewer full pages than splits leaves some splits without tiles: they write an
 * empty partial (LSE -inf), which the combine skips. */
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
    /* The kernel takes up to 217 KiB of dynamic shared memory, far above the default
     * 48 KB; the opt-in is made on an instance's first launch. The flag is per
     * instance, not per device, unlike the other attention files' setup: a process
     * that drove several devices would launch on the second one without the opt-in.
     * The engine runs one device per process (one rank per GPU). Two threads racing
     * here only set the same attribute twice. */
    static bool attr_set = false;   /* per device would be stricter; the attribute is the same everywhere */
    if (!attr_set) {
        FR_CUDA_TRY(cudaFuncSetAttribute(mla_kernel<DC, DR, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G::SMEM));
        attr_set = true;
    }
    /* Grid (splits, row groups, sequences); row groups past a sequence's rows exit.
     * The combine, only with more than one split, runs one warp per (sequence, row)
     * in stream order after the split kernel. */
    mla_kernel<DC, DR, KIND><<<dim3(P.n_splits, P.row_groups, n_seqs), kThreads, G::SMEM, stream>>>(P);
    FR_CUDA_LAUNCHED();
    if (P.n_splits > 1) {
        const size_t warps = (size_t)n_seqs * P.row_groups * kRows;
        mla_combine<DC, KIND><<<(unsigned)((warps + 7) / 8), kThreads, 0, stream>>>(P, n_seqs);
        FR_CUDA_LAUNCHED();
    }
    return FR_OK;
}

/* The instance for the dtype at d_r 64 (the only RoPE width the checks let through). */
template <int DC> fr_status launch_dc(int kind, const Params &P, int n_seqs, cudaStream_t stream)
{
    switch (kind) {
    case kBF16: return launch<DC, kRope, kBF16>(P, n_seqs, stream);
    case kFP8: return launch<DC, kRope, kFP8>(P, n_seqs, stream);
    case kNV: return launch<DC, kRope, kNV>(P, n_seqs, stream);
    default: return launch<DC, kRope, kMX>(P, n_seqs, stream);
    }
}

/* The width's instances: the recursion walks DC = 128, 192, ... up to the checked
 * width and launches that one. */
template <int DC = kMinLatent> fr_status launch_width(int dc, int kind, const Params &P, int n_seqs, cudaStream_t stream)
{
    if constexpr (DC > kMaxLatent) {
        return fr_fail(FR_EINTERNAL, "attn_mla: no instance for latent width %d", dc);
    } else {
        return dc == DC ? launch_dc<DC>(kind, P, n_seqs, stream)
                        : launch_width<DC + kLatentStep>(dc, kind, P, n_seqs, stream);
    }
}

}   // namespace

/* The plan of one call: row groups of 64 query rows per sequence for max_new tokens
 * of n_heads heads, the split count fitted to the workspace, and the bytes that plan
 * uses. A call with no sequences plans one split and no workspace. */
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

/* The largest plan over 1 .. max_seqs sequences, with max_new 1 (decode) and max_new
 * itself, planned as if the workspace were unlimited. Intermediate chunk sizes are
 * not tried: a call whose plan would need more than the workspace it is given gets
 * fewer splits (splits_for stops at the first count that does not fit), so an
 * undersized estimate costs parallelism, never memory safety. */
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
        /* m takes 1, then max_new (once when they are equal). */
        for (int m = 1; m <= max_new; m = m == max_new ? max_new + 1 : max_new) {
            fr_attn_mla_plan p = {};
            if ((st = fr_attn_mla_plan_for(cfg, n, m, max_ctx, SIZE_MAX, &p))) return st;
            if (p.bytes > most) most = p.bytes;
        }
    *bytes = most;
    return FR_OK;
}

/* The checks, plan and parameter block of one call (attn_mla_kernels.cuh declares
 * it for attention/dev/'s kernels too). */
fr_status fr_mla::call_params(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs_dev,
                              int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, void *workspace,
                              size_t workspace_bytes, Params *out_params, int *kind)
{
    fr_attn_mla_plan plan = {};
    /* The plan first: it also checks the configuration and the bounds. Then the view:
     * the pool and the slots the recipe reads must exist (the sink slot only with
     * sink/recent), and the workspace whenever the plan has partials. */
    fr_status st = fr_attn_mla_plan_for(cfg, n_seqs, max_new, max_ctx, workspace_bytes, &plan);
    if (st) return st;
    if (!kv || !seqs_dev || !q || !out || (plan.bytes && !workspace))
        return fr_fail(FR_EINVAL, "attn_mla: NULL cache view, sequences, query, output or workspace");
    /* Every page part is copied in 16-byte cp.async pieces, hence the 16-byte
     * alignment of the page offsets, page and block sizes. */
    if (!kv->pool || !kv->recent || (cfg->sink_recent && !kv->sink) || ((kv->codes | kv->scales | kv->rope |
                                                                          kv->page_bytes | kv->block_bytes) % 16))
        return fr_fail(FR_EINVAL, "attn_mla: the cache view needs a pool, slots and 16-byte aligned page parts");
    /* The parameter block: the partials' two arrays at the workspace's start (o_part,
     * then lse_part at the next 256-byte boundary); the softmax scale in base-2
     * units; FP8's layer scale (1 for the other dtypes); sink/recent only for FP4
     * dtypes (the BF16 sink and recent rows are an FP4 recipe); the query's FP4 terms
     * as the recipe has them. */
    Params P = {};
    P.kv = *kv;
    P.seqs = seqs_dev;
    P.q = q;
    P.out = out;
    /* Partial slots: [sequence][row of the row groups][split], the layout mla_kernel
     * writes and mla_combine reads. */
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
    *out_params = P;
    *kind = kind_of(cfg->dtype);
    return FR_OK;
}

extern "C" fr_status fr_attn_mla(const fr_attn_mla_config *cfg, const fr_latent_kv *kv, const fr_paged_seq *seqs_dev,
                                 int n_seqs, int max_new, int max_ctx, const float *q, uint16_t *out, void *workspace,
                                 size_t workspace_bytes, cudaStream_t stream)
{
    Params P;
    int kind = 0;
    fr_status st = call_params(cfg, kv, seqs_dev, n_seqs, max_new, max_ctx, q, out, workspace, workspace_bytes, &P,
                               &kind);
    /* An empty step launches nothing, but its arguments were checked like any
     * other's. */
    if (st || n_seqs == 0) return st;
    return launch_width(cfg->latent_dim, kind, P, n_seqs, stream);
}
