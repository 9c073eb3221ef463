/* Decode attention over an FP4 (NVFP4, MXFP4) or FP8 paged KV cache on Hopper: the
 * host side (checks, split plan, workspace, launches). The kernels are in
 * attn_fp4_kernels.cuh; docs/attention_gpu.md describes the data path;
 * attention/attn_fp4.h is the contract.
 *
 * A call checks everything the kernels take on trust (the shape they are built for,
 * the page layout, the alignment the bulk copies need), plans the split count from
 * the SM count and the workspace, and launches three kernels on the stream:
 * prep_kernel, then split_kernel and combine_kernel with programmatic dependent
 * launch. Nothing is allocated and nothing waits for the device, so the call can be
 * captured in a CUDA graph; the first call on a device sets the split kernel's
 * shared-memory limit and reads its occupancy (make it before capture:
 * fr_attn_fp4_workspace_bytes at start-up does). */
#include "attn_fp4.h"

#include <atomic>
#include <climits>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

#include "attn_fp4_kernels.cuh"
#include "cuda_check.h"

namespace {

using namespace fr_fp4;

/* The split plan's costs are in pages of one head (128 tokens). kSplitFixedPages is
 * what a split costs beyond its pages: its start (barriers, the query, the pipeline's
 * first pages), its partial's write and its share of the combine. kMaxDevices bounds
 * the per-device setup table; kAlign is the alignment of every workspace part (the
 * kernels need 16 bytes for their 16-byte loads). */
constexpr int kD = 128;                 /* the head_dim the decode kernels are built for */
constexpr int kMaxSplits = FR_ATTN_FP4_MAX_SPLITS;
constexpr long kSplitFixedPages = 2;    /* start-up cost of a split, in pages */
constexpr long kMinSplitPages = 6;      /* fewer pages per split cost more than the parallelism gives */
constexpr int kMaxDevices = 64;
constexpr size_t kAlign = 256;

/* ---- the kernel variants ---- */

/* One decode variant: format x quantized P x query n-tiles, i.e. one instantiation of
 * split_kernel. nq is 1, 2 or 4: G 9..12 run the 4-tile variant, whose last tile then
 * holds only zero columns of padding heads. */
struct Variant {
    int fmt;      /* kNVFP4, kMXFP4, kFP8 */
    bool exact;   /* P quantized */
    int nq;       /* QK^T n-tiles: ceil(2G / 8), 3 rounded up to 4 */
};

typedef void (*split_fn)(Params);
typedef void (*prep_fn)(Params);

template <int FMT, bool EX, int NQ> constexpr split_fn split_of() { return split_kernel<FMT, EX, NQ, kD>; }

/* The runtime variant to its compile-time instantiation: the format, the P mode and
 * the tile count shape the kernel's registers and loops, so each is a template
 * argument; everything else (query mode, scale search, recipe switches) is a runtime
 * field of Params. */
split_fn split_kernel_for(const Variant &v)
{
#define FR_NQ(F, E)                                                                       \
    return v.nq == 1 ? split_of<F, E, 1>() : v.nq == 2 ? split_of<F, E, 2>() : split_of<F, E, 4>()
    if (v.fmt == kNVFP4) {
        if (v.exact) FR_NQ(kNVFP4, true);
        FR_NQ(kNVFP4, false);
    }
    if (v.fmt == kMXFP4) {
        if (v.exact) FR_NQ(kMXFP4, true);
        FR_NQ(kMXFP4, false);
    }
    FR_NQ(kFP8, false);
#undef FR_NQ
}

/* The preparation kernel depends on the format only: the query mode and the group are
 * read at run time. */
prep_fn prep_kernel_for(int fmt)
{
    return fmt == kNVFP4 ? prep_kernel<kNVFP4, kD> : fmt == kMXFP4 ? prep_kernel<kMXFP4, kD> : prep_kernel<kFP8, kD>;
}

/* FP4: the page ring of the split CTAs or the BF16 CTA's tile, whichever is larger
 * (one launch runs both); FP8: the page-walking layout (its CTA x = 0 only writes an
 * empty partial, which needs no shared memory). */
/* Dynamic shared memory of a variant's split launch. One launch runs the BF16 CTA (x
 * = 0) and the split CTAs, so it is sized for the larger body. */
template <int F, int MT> constexpr int fp4_smem_bytes()
{
    constexpr int ring = SmemTok<F, MT, kD>::total, bf16 = SmemBf16<MT == 1 ? 2 : 4, kD>::total;
    return ring > bf16 ? ring : bf16;
}

int split_smem_bytes(const Variant &v)
{
    const bool two = v.nq > 2;
    if (v.fmt == kNVFP4) return two ? fp4_smem_bytes<kNVFP4, 2>() : fp4_smem_bytes<kNVFP4, 1>();
    if (v.fmt == kMXFP4) return two ? fp4_smem_bytes<kMXFP4, 2>() : fp4_smem_bytes<kMXFP4, 1>();
    return two ? Smem8<2, kD>::total : Smem8<1, kD>::total;
}

/* u32 of query fragments per (sequence, KV head): FP4 A fragments of
 * ceil(G / 8) m-tiles (four registers a lane), FP8 B fragments of nq
 * n-tiles (two). */
int qwords_of(const Variant &v)
{
    return v.fmt == kFP8 ? v.nq * (kD / 16) * 32 * 2 : (v.nq > 2 ? 2 : 1) * (kD / 16) * 32 * 4;
}

/* Bytes of one head page: the size of each on-the-fly page in the workspace. */
int page_bytes_of(int fmt)
{
    return fmt == kNVFP4 ? Geom<kNVFP4, kD>::page_bytes : fmt == kMXFP4 ? Geom<kMXFP4, kD>::page_bytes
                                                                         : Geom<kFP8, kD>::page_bytes;
}

/* Index of a variant in DevInfo::blocks (FP8 has no exact variants; their slots stay
 * unused). */
int variant_index(const Variant &v) { return (v.fmt * 2 + (v.exact ? 1 : 0)) * 3 + (v.nq == 1 ? 0 : v.nq == 2 ? 1 : 2); }
constexpr int kVariants = 3 * 2 * 3;

/* ---- per-device setup: shared-memory limits and occupancy, once ---- */

/* The FP8 split needs more than the default 48 KB of dynamic shared memory (the FP4
 * variants stay below it; the limit is set for every variant alike), which a kernel
 * must be granted once per device before its first launch; the occupancy query then
 * gives the CTAs per SM the split plan counts in waves. docs/attention_gpu.md asks
 * for the first call before any graph capture, which fr_attn_fp4_workspace_bytes at
 * start-up makes. The atomics make concurrent first calls safe: both do the same
 * idempotent work. */
/* Per device: the SM count and, per variant, the split CTAs that fit an SM (0: not
 * set up yet). A thread that reads a non-zero count with acquire also sees the
 * shared-memory attribute set before it was stored. */
struct DevInfo {
    std::atomic<int> sms;
    std::atomic<int> blocks[kVariants];   /* split-kernel CTAs per SM, 0: not set up */
};
DevInfo g_dev[kMaxDevices];

/* Sets the variant up on the current device if needed and returns its slots: the
 * split CTAs that run at once on the whole device, the unit the plan counts waves in. */
fr_status setup(const Variant &v, int *slots)
{
    int dev = 0;
    FR_CUDA_TRY(cudaGetDevice(&dev));
    if (dev < 0 || dev >= kMaxDevices)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4: device %d beyond the %d supported", dev, kMaxDevices);
    DevInfo &d = g_dev[dev];
    int sms = d.sms.load(std::memory_order_acquire);
    if (!sms) {
        FR_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        d.sms.store(sms, std::memory_order_release);
    }
    const int idx = variant_index(v);
    int blocks = d.blocks[idx].load(std::memory_order_acquire);
    if (!blocks) {   /* idempotent: a race only repeats it */
        const split_fn k = split_kernel_for(v);
        const int smem = split_smem_bytes(v);
        FR_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        FR_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, kThreads, smem));
        if (blocks < 1) blocks = 1;
        d.blocks[idx].store(blocks, std::memory_order_release);
    }
    *slots = sms * blocks;
    return FR_OK;
}

/* ---- configuration checks ---- */

/* What check_config derives from a configuration. otf: the partial last page is
 * quantized on the fly (no BF16 recent slot in the view: vanilla FP4, FP4 without
 * sink, FP8). */
struct Shape {
    Variant v;
    int group, head_dim, n_kv_heads;
    bool otf;   /* the partial page is quantized on the fly */
};

/* The configuration checks: each refuses what the kernels cannot compute faithfully
 * rather than computing something else.
 * - head_dim 128: a lane's 16-byte key load is D / 4 = 32 dims, the preparation
 *   kernel holds a head in 4 registers of 32, and the combine's lanes take 4 dims
 *   each.
 * - n_kv_heads <= 65535: the split grid's y dimension. G <= 16: two m-tiles of 8
 *   heads, four n-tiles of 4.
 * - the tile is the 128-token page; the rowmax analysis switch needs the row's final
 *   maximum, which online softmax does not have.
 * - the params (scale search, query mode, P rule) must be for this head_dim and
 *   group, and the FP4 format the cache's.
 * - FP8: per-head scales are required, and the query and P stay unquantized (what the
 *   FP8 reference computes); sink/recent is an FP4 recipe.
 * - the plain P rule is E4M3(pmax / 6) with c = 1; the kernel's p_scale computes
 *   E4M3(c pmax / 6), the same only at c = 1. c must be positive for log2 c. */
fr_status check_config(const fr_attn_fp4_config *cfg, int n_heads, int n_kv_heads, int head_dim, Shape *sh)
{
    if (!cfg) return fr_fail(FR_EINVAL, "attn_fp4: NULL config");
    const fr_attn_params *p = &cfg->p;
    if (cfg->dtype != FR_KV_NVFP4 && cfg->dtype != FR_KV_MXFP4 && cfg->dtype != FR_KV_FP8)
        return fr_fail(FR_EINVAL, "attn_fp4: kv dtype %s has no FP4/FP8 decode kernel", fr_kv_dtype_name(cfg->dtype));
    if (head_dim != kD)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4: head_dim %d (the decode kernels are built for %d)", head_dim, kD);
    if (n_kv_heads < 1 || n_kv_heads > 65535 || n_heads < n_kv_heads || n_heads % n_kv_heads)
        return fr_fail(FR_EINVAL, "attn_fp4: %d query heads do not group over %d KV heads", n_heads, n_kv_heads);
    const int G = n_heads / n_kv_heads;
    if (G > kMaxGroup) return fr_fail(FR_EINVAL, "attn_fp4: group %d above %d", G, kMaxGroup);
    if (p->tile != kPage) return fr_fail(FR_EINVAL, "attn_fp4: tile %d (the kernels walk 128-token pages)", p->tile);
    if (p->p_row_max)
        return fr_fail(FR_EUNSUPPORTED, "attn_fp4: the rowmax switch (P against the row's final maximum) is an "
                                        "analysis of the CPU reference; the kernels run online softmax");
    if (p->head_dim != head_dim || p->group != G)
        return fr_fail(FR_EINVAL, "attn_fp4: params are for head_dim %d and group %d, the call has %d and %d",
                       p->head_dim, p->group, head_dim, G);
    const bool fp8 = cfg->dtype == FR_KV_FP8;
    if (fp8) {
        if (!cfg->fp8_scales) return fr_fail(FR_EINVAL, "attn_fp4: FP8 needs the per-head scales");
        if (cfg->sink_recent) return fr_fail(FR_EINVAL, "attn_fp4: sink_recent is an FP4 recipe");
        if (p->q_mode != FR_Q_UNQUANTIZED || p->quantize_p)
            return fr_fail(FR_EINVAL, "attn_fp4: FP8 keeps the query and P unquantized");
    } else if (p->fmt != fr_kv_dtype_fp4_format(cfg->dtype)) {
        return fr_fail(FR_EINVAL, "attn_fp4: params quantize in %s for a %s cache", fr_fp4_format_name(p->fmt),
                       fr_kv_dtype_name(cfg->dtype));
    }
    if (p->quantize_p && !p->p.underflow_aware && p->p.c != 1.0f)
        return fr_fail(FR_EINVAL, "attn_fp4: the plain P rule needs c = 1");
    if (p->quantize_p && !(p->p.c > 0.0f))
        return fr_fail(FR_EINVAL, "attn_fp4: P factor c %g is not positive", p->p.c);
    sh->v.fmt = cfg->dtype == FR_KV_NVFP4 ? kNVFP4 : cfg->dtype == FR_KV_MXFP4 ? kMXFP4 : kFP8;
    sh->v.exact = p->quantize_p != 0;
    sh->v.nq = G <= 4 ? 1 : G <= 8 ? 2 : 4;
    sh->group = G;
    sh->head_dim = head_dim;
    sh->n_kv_heads = n_kv_heads;
    sh->otf = !cfg->sink_recent;
    return FR_OK;
}

/* ---- workspace ---- */

/* The workspace's parts in order, each 256-byte aligned: the query fragments of every
 * (sequence, KV head) (FP4 A or FP8 B), the BF16 query's fragments (with sink/recent
 * only), the per-head factors [pairs][16], the on-the-fly pages (without sink/recent
 * only), then the partial outputs [seq][kvh][n_splits + 1][G][128] and their LSEs.
 * Only the partials grow with the split count. */
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Layout {
    size_t qfrag, qfrag_bf, qscale, otf, o_part, lse_part, total;
};

Layout layout_for(const Shape &sh, bool sink_recent, int n_seqs, int n_splits)
{
    const size_t pairs = (size_t)n_seqs * sh.n_kv_heads;
    const size_t frag = pairs * qwords_of(sh.v) * 4, frag_bf = pairs * sh.v.nq * (kD / 16) * 32 * 8;
    Layout l;
    l.qfrag = 0;
    l.qfrag_bf = align_up(l.qfrag + frag);
    l.qscale = align_up(l.qfrag_bf + (sink_recent ? frag_bf : 0));
    l.otf = align_up(l.qscale + pairs * kMaxGroup * sizeof(float));
    l.o_part = align_up(l.otf + (sh.otf ? pairs * page_bytes_of(sh.v.fmt) : 0));
    const size_t rows = pairs * (n_splits + 1) * sh.group;
    l.lse_part = align_up(l.o_part + rows * kD * sizeof(float));
    l.total = align_up(l.lse_part + rows * sizeof(float));
    return l;
}

/* The split count minimizing (waves of CTAs) x (pages per split + fixed cost); ties
 * keep fewer splits. The BF16 CTA of each (sequence, head) and the combine are the
 * same for every count. No split gets fewer than kMinSplitPages pages: at batch 1 and
 * 32K (256 pages a head) a split of two pages spends as long on its start, its
 * partial and the combine's share of it as on its pages (bench/RESULTS.md, "FP4
 * decode: the latency path", the split-count sweep with FR_ATTN_FP4_SPLITS). The plan
 * uses max_ctx, not the lengths (which live on the device): a graph replayed with
 * shorter contexts runs the same grid, and its surplus splits write empty partials. */
int plan_splits(int n_seqs, int n_kv_heads, int max_ctx, int slots)
{
    const long pages = max_ctx > 0 ? ((long)max_ctx + kPage - 1) / kPage : 1;
    const long pairs = (long)(n_seqs > 0 ? n_seqs : 1) * n_kv_heads;
    const long cap = (pages + kMinSplitPages - 1) / kMinSplitPages;
    const int n_max = (int)(cap < kMaxSplits ? cap : kMaxSplits);
    int best = 1;
    long best_cost = LONG_MAX;
    for (int n = 1; n <= n_max; n++) {
        const long waves = (pairs * n + slots - 1) / slots;
        const long cost = waves * ((pages + n - 1) / n + kSplitFixedPages);
        if (cost < best_cost) {
            best_cost = cost;
            best = n;
        }
    }
    return best;
}

/* FR_ATTN_FP4_SPLITS=N replaces the planned split count by N (capped as
 * deterministic mode's is): a benchmarking knob for measuring the plan's
 * cost model (bench/attn_decode), not a setting. 0: the plan. */
int forced_splits()
{
    static const int n = [] {
        const char *e = getenv("FR_ATTN_FP4_SPLITS");
        return e ? atoi(e) : 0;
    }();
    return n;
}

/* Deterministic mode's count: the requested one, capped by the kernels' limit
 * and by the pages of max_ctx (a constant of the runner, not of the batch). */
int fixed_split_count(int requested, int max_ctx)
{
    const long pages = max_ctx > 0 ? ((long)max_ctx + kPage - 1) / kPage : 1;
    int n = requested < kMaxSplits ? requested : kMaxSplits;
    return pages < n ? (int)pages : n;
}

/* Programmatic dependent launch of the split and combine kernels (each
 * may be scheduled while the grid before it finishes; docs/attention_gpu.md
 * "Three launches per step"). FR_ATTN_PDL=0 launches them plainly, for
 * measuring what the overlap gives. */
bool use_pdl()
{
    static const bool on = [] {
        const char *e = getenv("FR_ATTN_PDL");
        return !(e && e[0] == '0' && e[1] == '\0');
    }();
    return on;
}

/* A launch with the programmatic-stream-serialization attribute may start once every
 * CTA of the previous kernel in the stream has executed
 * griddepcontrol.launch_dependents (or exited), instead of when that kernel ends; the
 * kernel's griddepcontrol.wait then blocks until the previous grid has completed and
 * its writes are visible. In a captured graph the attribute becomes a programmatic
 * edge with the same meaning. prep_kernel triggers at its start, the split CTAs after
 * their last page: the split kernel's pages and the combine's launch overlap the
 * kernel before them. */
cudaError_t launch(void (*kernel)(Params), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                   const Params &P)
{
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t c = {};
    c.gridDim = grid;
    c.blockDim = dim3(threads);
    c.dynamicSmemBytes = (size_t)smem;
    c.stream = stream;
    c.attrs = pdl ? attr : nullptr;
    c.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&c, kernel, P);
}

bool misaligned(const void *p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0; }

/* The cache view: the layer in range, every pointer the chosen path reads, 16-byte
 * alignment of the pool, blocks and head pages (cp.async.bulk copies whole head pages
 * or halves, and the kernels read them with 16-byte loads) and of the slots and
 * staging rows (the BF16 CTA copies their rows 16 bytes at a time: 8 BF16), and the
 * page layout of Geom (the kernels compute offsets from the format, they do not read
 * the view's). */
fr_status check_view(const fr_attn_fp4_config *cfg, const fr_paged_kv *kv, int fmt)
{
    if (kv->layer < 0 || kv->layer >= kv->n_layers)
        return fr_fail(FR_EINVAL, "attn_fp4: layer %d outside [0, %d)", kv->layer, kv->n_layers);
    if (!kv->pool || !kv->recent || !kv->step_k || !kv->step_v || (cfg->sink_recent && !kv->sink))
        return fr_fail(FR_EINVAL, "attn_fp4: the cache view lacks a pool, slots or staging rows");
    if (misaligned(kv->pool, 16) || misaligned(kv->recent, 16) || misaligned(kv->step_k, 16) ||
        misaligned(kv->step_v, 16) || (kv->sink && misaligned(kv->sink, 16)) || kv->block_bytes % 16 ||
        kv->head_page_bytes % 16 || kv->slot_elems % 8 || kv->sink_elems % 8)
        return fr_fail(FR_EINVAL, "attn_fp4: pointers, blocks and pages must be 16-byte aligned");
    size_t ks, vc, vs, hp;
    if (fmt == kNVFP4) {
        ks = Geom<kNVFP4, kD>::k_scales; vc = Geom<kNVFP4, kD>::v_codes;
        vs = Geom<kNVFP4, kD>::v_scales; hp = Geom<kNVFP4, kD>::page_bytes;
    } else if (fmt == kMXFP4) {
        ks = Geom<kMXFP4, kD>::k_scales; vc = Geom<kMXFP4, kD>::v_codes;
        vs = Geom<kMXFP4, kD>::v_scales; hp = Geom<kMXFP4, kD>::page_bytes;
    } else {
        ks = vs = vc = Geom<kFP8, kD>::v_codes; hp = Geom<kFP8, kD>::page_bytes;
    }
    if (kv->k_codes != 0 || kv->v_codes != vc || (fmt != kFP8 && (kv->k_scales != ks || kv->v_scales != vs)) ||
        kv->head_page_bytes != hp)
        return fr_fail(FR_EINVAL, "attn_fp4: the view's page layout is not the %s layout of kvcache/page_layout.h",
                       fr_kv_dtype_name(cfg->dtype));
    return FR_OK;
}

} // namespace

/* The plan: the split count (fixed_splits for deterministic mode, else the cost model
 * or the FR_ATTN_FP4_SPLITS knob), then fewer splits until the workspace holds them.
 * Deterministic mode never shrinks its count: a smaller plan would change split
 * boundaries and so the rounding, and the call fails instead. */
extern "C" fr_status fr_attn_fp4_plan_for(const fr_attn_fp4_config *cfg, int n_seqs, int n_heads, int n_kv_heads,
                                          int head_dim, int max_ctx, size_t workspace_bytes, fr_attn_fp4_plan *plan)
{
    if (!plan) return fr_fail(FR_EINVAL, "attn_fp4_plan_for: NULL result");
    Shape sh;
    fr_status st = check_config(cfg, n_heads, n_kv_heads, head_dim, &sh);
    if (st) return st;
    if (n_seqs < 1) return fr_fail(FR_EINVAL, "attn_fp4_plan_for: %d sequences", n_seqs);
    int slots;
    if ((st = setup(sh.v, &slots))) return st;
    int n = cfg->fixed_splits > 0 ? fixed_split_count(cfg->fixed_splits, max_ctx)
                                  : plan_splits(n_seqs, n_kv_heads, max_ctx, slots);
    if (cfg->fixed_splits <= 0 && forced_splits() > 0) n = fixed_split_count(forced_splits(), max_ctx);
    Layout l = layout_for(sh, cfg->sink_recent != 0, n_seqs, n);
    while (cfg->fixed_splits <= 0 && n > 1 && l.total > workspace_bytes) {   /* fit the plan to the workspace */
        n--;
        l = layout_for(sh, cfg->sink_recent != 0, n_seqs, n);
    }
    if (l.total > workspace_bytes)
        return fr_fail(FR_EINVAL, "attn_fp4: the workspace of %zu bytes is below the %zu one split needs",
                       workspace_bytes, l.total);
    plan->n_splits = n;
    plan->o_part_offset = l.o_part;
    plan->lse_part_offset = l.lse_part;
    plan->bytes = l.total;
    return FR_OK;
}

/* The largest layout over 1 .. max_seqs sequences: the split count falls as the batch
 * grows, but not in proportion, so the largest partial area need not be at max_seqs.
 * Also the per-device setup (shared-memory limit, occupancy): docs/attention_gpu.md
 * asks for this call before any graph capture. */
extern "C" fr_status fr_attn_fp4_workspace_bytes(const fr_attn_fp4_config *cfg, int max_seqs, int n_heads,
                                                 int n_kv_heads, int max_ctx, size_t *bytes)
{
    if (!bytes) return fr_fail(FR_EINVAL, "attn_fp4_workspace_bytes: NULL result");
    *bytes = 0;
    Shape sh;
    const int d = cfg ? cfg->p.head_dim : 0;
    fr_status st = check_config(cfg, n_heads, n_kv_heads, d, &sh);
    if (st) return st;
    if (max_seqs < 0) return fr_fail(FR_EINVAL, "attn_fp4_workspace_bytes: max_seqs %d < 0", max_seqs);
    int slots;
    if ((st = setup(sh.v, &slots))) return st;
    size_t need = 0;
    for (int n = 1; n <= max_seqs; n++) {
        int splits = cfg->fixed_splits > 0 ? fixed_split_count(cfg->fixed_splits, max_ctx)
                                           : plan_splits(n, n_kv_heads, max_ctx, slots);
        if (cfg->fixed_splits <= 0 && forced_splits() > 0) splits = fixed_split_count(forced_splits(), max_ctx);
        const Layout l = layout_for(sh, cfg->sink_recent != 0, n, splits);
        if (l.total > need) need = l.total;
    }
    *bytes = need;
    return FR_OK;
}

extern "C" fr_status fr_attn_fp4_decode(const fr_attn_fp4_config *cfg, const fr_paged_kv *kv,
                                        const fr_paged_seq *seqs_dev, int n_seqs, int max_ctx, const float *q,
                                        uint16_t *out, int n_heads, void *workspace, size_t workspace_bytes,
                                        cudaStream_t stream)
{
    if (!cfg || !kv || !seqs_dev || !q || !out) return fr_fail(FR_EINVAL, "attn_fp4: NULL argument");
    /* The sequences are the split grid's z dimension (at most 65535). */
    if (n_seqs < 0 || n_seqs > 65535) return fr_fail(FR_EINVAL, "attn_fp4: %d sequences outside [0, 65535]", n_seqs);
    if (n_seqs == 0) return FR_OK;
    Shape sh;
    fr_status st = check_config(cfg, n_heads, kv->n_kv_heads, kv->head_dim, &sh);
    if (st) return st;
    if ((st = check_view(cfg, kv, sh.v.fmt))) return st;
    /* q and out are read and written element by element (q by the preparation kernel,
     * out by the combine), hence only natural alignment; the workspace parts are
     * 256-byte aligned from its start. */
    if (misaligned(q, 4) || misaligned(out, 2) || !workspace || misaligned(workspace, kAlign))
        return fr_fail(FR_EINVAL, "attn_fp4: the workspace must be %zu-byte aligned (and q, out aligned)", kAlign);
    fr_attn_fp4_plan plan;
    if ((st = fr_attn_fp4_plan_for(cfg, n_seqs, n_heads, kv->n_kv_heads, kv->head_dim, max_ctx, workspace_bytes,
                                   &plan)))
        return st;
    const Layout l = layout_for(sh, cfg->sink_recent != 0, n_seqs, plan.n_splits);

    /* The parameter block, passed by value: every kernel reads the same one. c and
     * the P rule come from the params only when P is quantized; otherwise c = 1 and
     * nothing is folded into the exponentials. gamma = log2(e) / sqrt(128), the
     * base-2 logit scale. */
    Params P;
    P.kv = *kv;
    P.seqs = seqs_dev;
    P.q = q;
    P.out = out;
    P.fp8_scales = cfg->fp8_scales;
    P.n_heads = n_heads;
    P.group = sh.group;
    P.n_splits = plan.n_splits;
    P.nq = sh.v.nq;
    P.qwords = qwords_of(sh.v);
    P.sink_recent = cfg->sink_recent != 0;
    P.rotate = cfg->rotate != 0;
    P.q_mode = cfg->p.q_mode;
    P.q_search = cfg->p.q_search;
    P.quantize_p = cfg->p.quantize_p;
    P.underflow_aware = cfg->p.quantize_p ? cfg->p.p.underflow_aware : 0;
    P.c = cfg->p.quantize_p ? cfg->p.p.c : 1.0f;
    P.log2c = log2f(P.c);
    P.tau = cfg->p.p.tau;
    P.gamma = (float)(M_LOG2E / sqrt((double)kD));
    uint8_t *ws = static_cast<uint8_t *>(workspace);
    P.qfrag = reinterpret_cast<uint32_t *>(ws + l.qfrag);
    P.qfrag_bf = reinterpret_cast<uint32_t *>(ws + l.qfrag_bf);
    P.qscale = reinterpret_cast<float *>(ws + l.qscale);
    P.otf = ws + l.otf;
    P.o_part = reinterpret_cast<float *>(ws + l.o_part);
    P.lse_part = reinterpret_cast<float *>(ws + l.lse_part);

    /* The launches, in stream order. prep_kernel starts only when the kernel before
     * it (the one that stages the step's keys and values) has ended; it writes the
     * query fragments and, without sink/recent, the on-the-fly pages in 1 + slices
     * z-blocks (one per value block of the partial page: 8 for NVFP4 and FP8, 4 for
     * MXFP4). split_kernel and combine_kernel are launched programmatically
     * (docs/attention_gpu.md, "Three launches per step"). */
    const int slices = sh.otf ? (sh.v.fmt == kMXFP4 ? kPage / 32 : kPage / 16) : 0;
    prep_kernel_for(sh.v.fmt)<<<dim3(n_seqs, kv->n_kv_heads, 1 + slices), kPrepThreads, 0, stream>>>(P);
    FR_CUDA_LAUNCHED();
    const bool pdl = use_pdl();
    FR_CUDA_TRY(launch(split_kernel_for(sh.v), dim3(plan.n_splits + 1, kv->n_kv_heads, n_seqs), kThreads,
                       split_smem_bytes(sh.v), stream, pdl, P));
    FR_CUDA_TRY(launch(combine_kernel<kD>, dim3(n_heads, n_seqs), kCombineThreads, 0, stream, pdl, P));
    return FR_OK;
}
