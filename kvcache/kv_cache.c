#include "kv_cache.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "attention/hadamard.h"
#include "block_allocator.h"
#include "block_table.h"

enum { T = FR_PAGE_TOKENS, SINK = FR_SINK_TOKENS };

typedef struct {
    int used;
    int len;
    fr_block_table table;
} kv_seq;

struct fr_kv_cache {
    fr_kv_cache_config cfg;
    fr_page_layout layout;
    size_t block_bytes;
    uint8_t *pool;              /* n_blocks * block_bytes */
    fr_block_allocator *alloc;
    kv_seq *seqs;               /* max_seqs */
    /* Slots hold float32 values already rounded to the slot precision (BF16,
     * or none for f32), so reading them back is a plain copy. */
    float *recent;              /* [max_seqs][layers][kvh][T][d] K then V */
    float *sink;                /* [max_seqs][layers][kvh][SINK][d] K then V */
    float *key_mean;            /* [layers][kvh][d] */
    float *fp8_scales;          /* [layers][kvh][2] */
    size_t slot_elems;          /* elements of one K (or V) recent slot per sequence */
    size_t sink_elems;
};

static int is_fp4(const fr_kv_cache *c) { return fr_kv_dtype_is_fp4(c->cfg.dtype); }
static int is_latent(const fr_kv_cache *c) { return c->cfg.latent_dim > 0; }
/* Slots per token: K and V, or a latent cache's row alone. */
static size_t halves(const fr_kv_cache *c) { return is_latent(c) ? 1 : 2; }
/* The channels the FP4 recipe smooths, rotates and quantizes: the head, or
 * a latent row's latent part. */
static int quant_dim(const fr_kv_cache *c) { return is_latent(c) ? c->cfg.latent_dim : c->cfg.head_dim; }
static int keeps_bf16(const fr_kv_cache *c) { return is_fp4(c) && c->cfg.recipe.sink_recent; }
static fr_fp4_format fmt(const fr_kv_cache *c) { return fr_kv_dtype_fp4_format(c->cfg.dtype); }
/* The precision of the slots and of the store form: BF16, except f32. */
static float slot_round(const fr_kv_cache *c, float x)
{
    return c->cfg.dtype == FR_KV_F32 ? x : fr_bf16_round(x);
}

fr_status fr_kv_cache_new(const fr_kv_cache_config *cfg, fr_kv_cache **out)
{
    *out = NULL;
    const int L = cfg->n_layers, H = cfg->n_kv_heads, d = cfg->head_dim;
    if (L < 1 || H < 1 || d < 1 || d > FR_MAX_HEAD_DIM || cfg->n_blocks < 1 || cfg->max_seqs < 1)
        return fr_fail(FR_EINVAL, "kv cache: invalid sizes (layers %d, kv heads %d, head_dim %d, "
                                  "blocks %d, sequences %d)", L, H, d, cfg->n_blocks, cfg->max_seqs);
    if (cfg->compute != FR_COMPUTE_EXACT && cfg->compute != FR_COMPUTE_BF16)
        return fr_fail(FR_EINVAL, "kv cache: fp4 compute mode %s (a cache takes exact or bf16; the engine "
                                  "resolves auto for its backend)", fr_fp4_compute_name(cfg->compute));
    const int dc = cfg->latent_dim;
    if (dc < 0 || (dc > 0 && (H != 1 || dc >= d)))
        return fr_fail(FR_EINVAL, "kv cache: a latent cache needs one KV head and a latent width below the row's "
                                  "%d (kv heads %d, latent %d)", d, H, dc);
    if (fr_kv_dtype_is_fp4(cfg->dtype)) {
        int B = fr_fp4_block_size(fr_kv_dtype_fp4_format(cfg->dtype)), qd = dc > 0 ? dc : d;
        const char *what = dc > 0 ? "latent width" : "head_dim";
        if (qd % B) return fr_fail(FR_EINVAL, "kv cache: %s %d is not a multiple of the %s block %d",
                                   what, qd, fr_kv_dtype_name(cfg->dtype), B);
        if (cfg->recipe.rotate && (qd & (qd - 1)))
            return fr_fail(FR_EINVAL, "kv cache: Hadamard rotation needs a power-of-two %s, not %d", what, qd);
    }
    fr_kv_cache *c = calloc(1, sizeof *c);
    if (!c) return fr_fail(FR_ENOMEM, "kv cache: out of memory");
    c->cfg = *cfg;
    c->cfg.key_mean = c->cfg.fp8_scales = NULL;
    c->layout = dc > 0 ? fr_page_layout_latent(cfg->dtype, dc, d - dc) : fr_page_layout_for(cfg->dtype, d);
    c->block_bytes = c->layout.head_page_bytes * (size_t)(L * H);
    c->slot_elems = (size_t)L * H * T * d;
    c->sink_elems = (size_t)L * H * SINK * d;
    /* One byte stands in for the storage of a bookkeeping-only cache, so
     * the allocation checks below stay uniform. */
    const size_t store = cfg->bookkeeping_only ? 0 : 1;
    c->pool = calloc(store ? (size_t)cfg->n_blocks : 1, store ? c->block_bytes : 1);
    c->seqs = calloc((size_t)cfg->max_seqs, sizeof *c->seqs);
    c->recent = malloc(store ? sizeof(float) * halves(c) * c->slot_elems * (size_t)cfg->max_seqs : 1);
    c->sink = malloc(store ? sizeof(float) * halves(c) * c->sink_elems * (size_t)cfg->max_seqs : 1);
    c->key_mean = calloc((size_t)(L * H * d), sizeof(float));
    c->fp8_scales = malloc(sizeof(float) * (size_t)(L * H * 2));
    fr_status st = FR_OK;
    if (!c->pool || !c->seqs || !c->recent || !c->sink || !c->key_mean || !c->fp8_scales)
        st = fr_fail(FR_ENOMEM, "kv cache: cannot allocate %d blocks of %zu bytes", cfg->n_blocks,
                     c->block_bytes);
    if (!st) st = fr_block_allocator_new(cfg->n_blocks, &c->alloc);
    if (st) {
        fr_kv_cache_destroy(&c);
        return st;
    }
    if (cfg->key_mean) memcpy(c->key_mean, cfg->key_mean, sizeof(float) * (size_t)(L * H * d));
    for (int i = 0; i < L * H * 2; i++) c->fp8_scales[i] = cfg->fp8_scales ? cfg->fp8_scales[i] : 1.0f;
    for (int i = 0; i < L * H * 2; i++)
        if (!(c->fp8_scales[i] > 0.0f)) {
            fr_kv_cache_destroy(&c);
            return fr_fail(FR_EINVAL, "kv cache: FP8 scale %d is not positive", i);
        }
    c->cfg.key_mean = c->key_mean;   /* the config now points at the cache's own copies */
    c->cfg.fp8_scales = c->fp8_scales;
    *out = c;
    return FR_OK;
}

fr_status fr_kv_cache_set_key_mean(fr_kv_cache *c, const float *key_mean)
{
    if (!c) return fr_fail(FR_EINVAL, "fr_kv_cache_set_key_mean: no cache");
    const size_t n = (size_t)c->cfg.n_layers * c->cfg.n_kv_heads * c->cfg.head_dim;
    for (size_t i = 0; key_mean && i < n; i++)
        if (!isfinite(key_mean[i])) return fr_fail(FR_EINVAL, "kv cache: key mean element %zu is not finite", i);
    if (key_mean) memcpy(c->key_mean, key_mean, sizeof(float) * n);
    else memset(c->key_mean, 0, sizeof(float) * n);
    return FR_OK;
}

fr_status fr_kv_cache_release_memory(fr_kv_cache *c)
{
    if (!c) return fr_fail(FR_EINVAL, "fr_kv_cache_release_memory: no cache");
    for (int s = 0; s < c->cfg.max_seqs; s++)
        if (c->seqs[s].used) return fr_fail(FR_EINVAL, "kv cache: sequence %d is live; its memory cannot be released", s);
    if (c->cfg.bookkeeping_only || !c->pool) return FR_OK;
    free(c->pool);
    free(c->recent);
    free(c->sink);
    c->pool = NULL;
    c->recent = c->sink = NULL;
    return FR_OK;
}

fr_status fr_kv_cache_restore_memory(fr_kv_cache *c)
{
    if (!c) return fr_fail(FR_EINVAL, "fr_kv_cache_restore_memory: no cache");
    if (c->cfg.bookkeeping_only || c->pool) return FR_OK;
    c->pool = calloc((size_t)c->cfg.n_blocks, c->block_bytes);
    c->recent = malloc(sizeof(float) * halves(c) * c->slot_elems * (size_t)c->cfg.max_seqs);
    c->sink = malloc(sizeof(float) * halves(c) * c->sink_elems * (size_t)c->cfg.max_seqs);
    if (!c->pool || !c->recent || !c->sink) {
        free(c->pool);
        free(c->recent);
        free(c->sink);
        c->pool = NULL;
        c->recent = c->sink = NULL;
        return fr_fail(FR_ENOMEM, "kv cache: cannot allocate %d blocks of %zu bytes again", c->cfg.n_blocks,
                       c->block_bytes);
    }
    return FR_OK;
}

void fr_kv_cache_destroy(fr_kv_cache **pc)
{
    fr_kv_cache *c = pc ? *pc : NULL;
    if (!c) return;
    if (c->seqs)
        for (int s = 0; s < c->cfg.max_seqs; s++)
            if (c->seqs[s].used) fr_block_table_release(&c->seqs[s].table, c->alloc);
    fr_block_allocator_destroy(&c->alloc);
    free(c->pool); free(c->seqs); free(c->recent); free(c->sink); free(c->key_mean); free(c->fp8_scales);
    free(c);
    *pc = NULL;
}

const fr_kv_cache_config *fr_kv_cache_config_of(const fr_kv_cache *c) { return &c->cfg; }
const fr_page_layout *fr_kv_layout(const fr_kv_cache *c) { return &c->layout; }
size_t fr_kv_block_bytes(const fr_kv_cache *c) { return c->block_bytes; }
int fr_kv_free_blocks(const fr_kv_cache *c) { return fr_block_free_count(c->alloc); }

fr_attn_params fr_kv_attn_params(const fr_kv_cache *c, int group)
{
    fr_ref_config rc = fr_ref_config_default(c->cfg.dtype);
    rc.compute = c->cfg.compute;
    rc.recipe = c->cfg.recipe;
    rc.tau = c->cfg.tau;
    return fr_ref_attn_params(&rc, c->cfg.head_dim, group);
}

/* ---- slots ---- */

static float *slot_k(const fr_kv_cache *c, int seq, int layer, int head)
{
    size_t base = (size_t)seq * halves(c) * c->slot_elems;
    return c->recent + base + ((size_t)layer * c->cfg.n_kv_heads + head) * T * c->cfg.head_dim;
}
static float *slot_v(const fr_kv_cache *c, int seq, int layer, int head)
{
    return slot_k(c, seq, layer, head) + c->slot_elems;
}
static float *sink_k(const fr_kv_cache *c, int seq, int layer, int head)
{
    size_t base = (size_t)seq * halves(c) * c->sink_elems;
    return c->sink + base + ((size_t)layer * c->cfg.n_kv_heads + head) * SINK * c->cfg.head_dim;
}
static float *sink_v(const fr_kv_cache *c, int seq, int layer, int head)
{
    return sink_k(c, seq, layer, head) + c->sink_elems;
}

static uint8_t *head_page(const fr_kv_cache *c, int block, int layer, int head)
{
    return c->pool + (size_t)block * c->block_bytes +
           ((size_t)layer * c->cfg.n_kv_heads + head) * c->layout.head_page_bytes;
}

/* ---- sequences ---- */

static fr_status check_seq(const fr_kv_cache *c, int seq)
{
    if (seq < 0 || seq >= c->cfg.max_seqs || !c->seqs[seq].used)
        return fr_fail(FR_EINVAL, "kv cache: sequence %d does not exist", seq);
    return FR_OK;
}

fr_status fr_kv_seq_new(fr_kv_cache *c, int *seq)
{
    for (int s = 0; s < c->cfg.max_seqs; s++)
        if (!c->seqs[s].used) {
            c->seqs[s].used = 1;
            c->seqs[s].len = 0;
            fr_block_table_init(&c->seqs[s].table);
            *seq = s;
            return FR_OK;
        }
    return fr_fail(FR_ENOMEM, "kv cache: all %d sequence slots are in use", c->cfg.max_seqs);
}

fr_status fr_kv_seq_fork(fr_kv_cache *c, int src, int *dst)
{
    fr_status st = check_seq(c, src);
    if (st) return st;
    int d;
    if ((st = fr_kv_seq_new(c, &d))) return st;
    kv_seq *a = &c->seqs[src], *b = &c->seqs[d];
    st = fr_block_table_fork(&a->table, a->len / T, c->alloc, &b->table);
    if (st) {
        b->used = 0;
        return st;
    }
    b->len = a->len;
    if (c->cfg.bookkeeping_only) {
        *dst = d;
        return FR_OK;
    }
    memcpy(slot_k(c, d, 0, 0), slot_k(c, src, 0, 0), sizeof(float) * halves(c) * c->slot_elems);
    memcpy(sink_k(c, d, 0, 0), sink_k(c, src, 0, 0), sizeof(float) * halves(c) * c->sink_elems);
    *dst = d;
    return FR_OK;
}

void fr_kv_seq_free(fr_kv_cache *c, int seq)
{
    if (check_seq(c, seq)) return;
    fr_block_table_release(&c->seqs[seq].table, c->alloc);
    c->seqs[seq].used = 0;
}

int fr_kv_seq_len(const fr_kv_cache *c, int seq)
{
    return check_seq(c, seq) ? -1 : c->seqs[seq].len;
}

int fr_kv_blocks_needed(const fr_kv_cache *c, int seq, int n)
{
    if (check_seq(c, seq)) return 0;
    int need = (c->seqs[seq].len + n + T - 1) / T - c->seqs[seq].table.n;
    return need > 0 ? need : 0;
}

fr_status fr_kv_reserve(fr_kv_cache *c, int seq, int n)
{
    fr_status st = check_seq(c, seq);
    if (st) return st;
    int need = fr_kv_blocks_needed(c, seq, n);
    if (!need) return FR_OK;
    int *blocks = malloc(sizeof(int) * (size_t)need);
    if (!blocks) return fr_fail(FR_ENOMEM, "kv cache: out of memory");
    st = fr_block_alloc_n(c->alloc, need, blocks);
    for (int i = 0; !st && i < need; i++) {
        st = fr_block_table_push(&c->seqs[seq].table, blocks[i]);
        if (st)   /* give back what the table did not take */
            for (int j = i; j < need; j++) fr_block_decref(c->alloc, blocks[j]);
    }
    free(blocks);
    return st;
}

/* ---- numerics of storing ---- */

/* Smoothing and rotation of one head's key (a latent row: of its latent),
 * without rounding. */
static void transform_key(const fr_kv_cache *c, int layer, int head, float *x)
{
    const int d = c->cfg.head_dim, qd = quant_dim(c);
    if (!is_fp4(c)) return;
    if (c->cfg.recipe.smooth) {
        const float *mu = c->key_mean + ((size_t)layer * c->cfg.n_kv_heads + head) * d;
        for (int j = 0; j < qd; j++) x[j] -= mu[j];
    }
    if (c->cfg.recipe.rotate) fr_hadamard(x, qd);
}

void fr_kv_key_form(const fr_kv_cache *c, int layer, int n, float *k)
{
    const int H = c->cfg.n_kv_heads, d = c->cfg.head_dim;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) transform_key(c, layer, h, k + ((size_t)i * H + h) * d);
    size_t total = (size_t)n * c->cfg.n_kv_heads * c->cfg.head_dim;
    for (size_t i = 0; i < total; i++) k[i] = slot_round(c, k[i]);
}

void fr_kv_value_form(const fr_kv_cache *c, int n, float *v)
{
    size_t total = (size_t)n * c->cfg.n_kv_heads * c->cfg.head_dim;
    for (size_t i = 0; i < total; i++) v[i] = slot_round(c, v[i]);
}

void fr_kv_query_form(const fr_kv_cache *c, int rows, float *q)
{
    if (!is_fp4(c) || !c->cfg.recipe.rotate || is_latent(c)) return;
    for (int r = 0; r < rows; r++) fr_hadamard(q + (size_t)r * c->cfg.head_dim, c->cfg.head_dim);
}

/* Quantizes T tokens of one head (k, v as [T][d] floats) into a head page. */
static void write_head_page(const fr_kv_cache *c, int layer, int head, const float *k,
                            const float *v, uint8_t *page)
{
    const int d = c->cfg.head_dim;
    const fr_page_layout *l = &c->layout;
    if (c->cfg.dtype == FR_KV_BF16) {
        uint16_t *pk = (uint16_t *)(page + l->k_codes), *pv = (uint16_t *)(page + l->v_codes);
        for (int i = 0; i < T * d; i++) { pk[i] = fr_bf16_encode(k[i]); pv[i] = fr_bf16_encode(v[i]); }
        return;
    }
    if (c->cfg.dtype == FR_KV_F32) {
        memcpy(page + l->k_codes, k, sizeof(float) * T * (size_t)d);
        memcpy(page + l->v_codes, v, sizeof(float) * T * (size_t)d);
        return;
    }
    if (c->cfg.dtype == FR_KV_FP8) {
        const float *sc = c->fp8_scales + ((size_t)layer * c->cfg.n_kv_heads + head) * 2;
        for (int i = 0; i < T * d; i++) {
            page[l->k_codes + i] = fr_e4m3_encode(k[i] / sc[0]);
            page[l->v_codes + i] = fr_e4m3_encode(v[i] / sc[1]);
        }
        return;
    }
    fr_fp4_format f = fmt(c);
    const int B = fr_fp4_block_size(f);
    float col[FR_MAX_FP4_BLOCK];
    uint8_t codes[FR_MAX_FP4_BLOCK];
    for (int t = 0; t < T; t++)
        for (int b = 0; b < d / B; b++) {
            page[l->k_scales + (size_t)t * (d / B) + b] =
                fr_fp4_quantize_block(f, c->cfg.recipe.scale_search, k + (size_t)t * d + b * B, codes);
            fr_fp4_words_store(codes, B, page + l->k_codes + (size_t)t * d / 2 + b * B / 2);
        }
    for (int j = 0; j < d; j++)
        for (int b = 0; b < T / B; b++) {
            for (int i = 0; i < B; i++) col[i] = v[(size_t)(b * B + i) * d + j];
            page[l->v_scales + (size_t)j * (T / B) + b] = fr_fp4_quantize_block(f, 0, col, codes);
            fr_fp4_words_store(codes, B, page + l->v_codes + (size_t)j * T / 2 + b * B / 2);
        }
}

static void read_head_page(const fr_kv_cache *c, int layer, int head, const uint8_t *page,
                           float *k, float *v)
{
    const int d = c->cfg.head_dim;
    const fr_page_layout *l = &c->layout;
    if (c->cfg.dtype == FR_KV_BF16) {
        const uint16_t *pk = (const uint16_t *)(page + l->k_codes), *pv = (const uint16_t *)(page + l->v_codes);
        for (int i = 0; i < T * d; i++) { k[i] = fr_bf16_decode(pk[i]); v[i] = fr_bf16_decode(pv[i]); }
        return;
    }
    if (c->cfg.dtype == FR_KV_F32) {
        memcpy(k, page + l->k_codes, sizeof(float) * T * (size_t)d);
        memcpy(v, page + l->v_codes, sizeof(float) * T * (size_t)d);
        return;
    }
    if (c->cfg.dtype == FR_KV_FP8) {
        const float *sc = c->fp8_scales + ((size_t)layer * c->cfg.n_kv_heads + head) * 2;
        for (int i = 0; i < T * d; i++) {
            k[i] = sc[0] * fr_e4m3_decode(page[l->k_codes + i]);
            v[i] = sc[1] * fr_e4m3_decode(page[l->v_codes + i]);
        }
        return;
    }
    fr_fp4_format f = fmt(c);
    const int B = fr_fp4_block_size(f);
    uint8_t codes[FR_PAGE_TOKENS > FR_MAX_HEAD_DIM ? FR_PAGE_TOKENS : FR_MAX_HEAD_DIM];
    for (int t = 0; t < T; t++) {
        const uint8_t *scales = page + l->k_scales + (size_t)t * (d / B);
        fr_fp4_words_load(page + l->k_codes + (size_t)t * d / 2, d, codes);
        for (int j = 0; j < d; j++) k[(size_t)t * d + j] = fr_fp4_scale_value(f, scales[j / B]) * fr_e2m1_decode(codes[j]);
    }
    for (int j = 0; j < d; j++) {
        const uint8_t *scales = page + l->v_scales + (size_t)j * (T / B);
        fr_fp4_words_load(page + l->v_codes + (size_t)j * T / 2, T, codes);
        for (int t = 0; t < T; t++)
            v[(size_t)t * d + j] = fr_fp4_scale_value(f, scales[t / B]) * fr_e2m1_decode(codes[t]);
    }
}

/* The FP8 scale of a latent (the k entry of its layer). */
static float latent_fp8_scale(const fr_kv_cache *c, int layer) { return c->fp8_scales[(size_t)layer * 2]; }

/* Quantizes T latent rows (store form, [T][head_dim]) into a latent page:
 * the latent per token along its channels, the RoPE part in BF16. */
static void write_latent_page(const fr_kv_cache *c, int layer, const float *rows, uint8_t *page)
{
    const int d = c->cfg.head_dim, dc = c->cfg.latent_dim, dr = d - dc;
    const fr_page_layout *l = &c->layout;
    for (int t = 0; t < T; t++) {
        const float *x = rows + (size_t)t * d;
        if (c->cfg.dtype == FR_KV_F32) {
            memcpy(page + l->k_codes + (size_t)t * dc * 4, x, sizeof(float) * (size_t)dc);
            memcpy(page + l->rope + (size_t)t * dr * 4, x + dc, sizeof(float) * (size_t)dr);
            continue;
        }
        uint16_t *pr = (uint16_t *)(page + l->rope) + (size_t)t * dr;
        for (int j = 0; j < dr; j++) pr[j] = fr_bf16_encode(x[dc + j]);
        if (c->cfg.dtype == FR_KV_BF16) {
            uint16_t *pc = (uint16_t *)(page + l->k_codes) + (size_t)t * dc;
            for (int j = 0; j < dc; j++) pc[j] = fr_bf16_encode(x[j]);
        } else if (c->cfg.dtype == FR_KV_FP8) {
            const float sc = latent_fp8_scale(c, layer);
            for (int j = 0; j < dc; j++) page[l->k_codes + (size_t)t * dc + j] = fr_e4m3_encode(x[j] / sc);
        } else {
            fr_fp4_format f = fmt(c);
            const int B = fr_fp4_block_size(f);
            uint8_t codes[FR_MAX_FP4_BLOCK];
            for (int b = 0; b < dc / B; b++) {
                page[l->k_scales + (size_t)t * (dc / B) + b] =
                    fr_fp4_quantize_block(f, c->cfg.recipe.scale_search, x + b * B, codes);
                fr_fp4_words_store(codes, B, page + l->k_codes + (size_t)t * dc / 2 + b * B / 2);
            }
        }
    }
}

static void read_latent_page(const fr_kv_cache *c, int layer, const uint8_t *page, float *rows)
{
    const int d = c->cfg.head_dim, dc = c->cfg.latent_dim, dr = d - dc;
    const fr_page_layout *l = &c->layout;
    fr_fp4_format f = fmt(c);
    const int B = fr_fp4_block_size(f);
    uint8_t codes[FR_MAX_HEAD_DIM];
    for (int t = 0; t < T; t++) {
        float *x = rows + (size_t)t * d;
        if (c->cfg.dtype == FR_KV_F32) {
            memcpy(x, page + l->k_codes + (size_t)t * dc * 4, sizeof(float) * (size_t)dc);
            memcpy(x + dc, page + l->rope + (size_t)t * dr * 4, sizeof(float) * (size_t)dr);
            continue;
        }
        const uint16_t *pr = (const uint16_t *)(page + l->rope) + (size_t)t * dr;
        for (int j = 0; j < dr; j++) x[dc + j] = fr_bf16_decode(pr[j]);
        if (c->cfg.dtype == FR_KV_BF16) {
            const uint16_t *pc = (const uint16_t *)(page + l->k_codes) + (size_t)t * dc;
            for (int j = 0; j < dc; j++) x[j] = fr_bf16_decode(pc[j]);
        } else if (c->cfg.dtype == FR_KV_FP8) {
            const float sc = latent_fp8_scale(c, layer);
            for (int j = 0; j < dc; j++) x[j] = sc * fr_e4m3_decode(page[l->k_codes + (size_t)t * dc + j]);
        } else {
            const uint8_t *scales = page + l->k_scales + (size_t)t * (dc / B);
            fr_fp4_words_load(page + l->k_codes + (size_t)t * dc / 2, dc, codes);
            for (int b = 0; b < dc / B; b++) {   /* every step reads every page: one scale per block */
                const float s = fr_fp4_scale_value(f, scales[b]);
                for (int j = b * B; j < (b + 1) * B; j++) x[j] = s * fr_e2m1_decode(codes[j]);
            }
        }
    }
}

static fr_status promote(fr_kv_cache *c, int seq, int page)
{
    const int d = c->cfg.head_dim;
    float *k = malloc(sizeof(float) * 2 * T * (size_t)d), *v = k ? k + T * d : NULL;
    if (!k) return fr_fail(FR_ENOMEM, "kv cache: out of memory");
    int block = c->seqs[seq].table.blocks[page];
    for (int l = 0; l < c->cfg.n_layers && is_latent(c); l++)
        write_latent_page(c, l, slot_k(c, seq, l, 0), head_page(c, block, l, 0));
    for (int l = 0; l < c->cfg.n_layers && !is_latent(c); l++)
        for (int h = 0; h < c->cfg.n_kv_heads; h++) {
            memcpy(k, slot_k(c, seq, l, h), sizeof(float) * T * (size_t)d);
            memcpy(v, slot_v(c, seq, l, h), sizeof(float) * T * (size_t)d);
            /* The sink's page copy is masked; zeroing its values keeps them
             * out of the value scales of tokens 16..B-1 (MXFP4 blocks span 32). */
            if (page == 0 && keeps_bf16(c)) memset(v, 0, sizeof(float) * SINK * (size_t)d);
            write_head_page(c, l, h, k, v, head_page(c, block, l, h));
        }
    free(k);
    return FR_OK;
}

fr_status fr_kv_append(fr_kv_cache *c, int seq, int n, const float *k, const float *v,
                       size_t layer_stride)
{
    fr_status st = check_seq(c, seq);
    if (st) return st;
    if (n < 0 || (n > 0 && !c->cfg.bookkeeping_only && (!k || (!v && !is_latent(c)))))
        return fr_fail(FR_EINVAL, "kv append: invalid arguments");
    if (fr_kv_blocks_needed(c, seq, n))
        return fr_fail(FR_EINTERNAL, "kv append: sequence %d has no block reserved for %d more tokens", seq, n);
    if (c->cfg.bookkeeping_only) {
        c->seqs[seq].len += n;
        return FR_OK;
    }
    const int H = c->cfg.n_kv_heads, d = c->cfg.head_dim;
    float *row = malloc(sizeof(float) * (size_t)(H * d) * 2), *vrow = row ? row + H * d : NULL;
    if (!row) return fr_fail(FR_ENOMEM, "kv cache: out of memory");
    kv_seq *s = &c->seqs[seq];
    for (int i = 0; i < n && !st; i++) {
        int pos = s->len, t = pos % T;
        for (int l = 0; l < c->cfg.n_layers; l++) {
            size_t off = (size_t)l * layer_stride + (size_t)i * H * d;
            memcpy(row, k + off, sizeof(float) * (size_t)(H * d));
            fr_kv_key_form(c, l, 1, row);
            if (is_latent(c)) {
                memcpy(slot_k(c, seq, l, 0) + (size_t)t * d, row, sizeof(float) * (size_t)d);
                if (pos < SINK) memcpy(sink_k(c, seq, l, 0) + (size_t)pos * d, row, sizeof(float) * (size_t)d);
                continue;
            }
            memcpy(vrow, v + off, sizeof(float) * (size_t)(H * d));
            for (int h = 0; h < H; h++) {
                const float *kr = row + h * d, *vr = vrow + h * d;
                float *dk = slot_k(c, seq, l, h) + (size_t)t * d, *dv = slot_v(c, seq, l, h) + (size_t)t * d;
                for (int j = 0; j < d; j++) { dk[j] = kr[j]; dv[j] = slot_round(c, vr[j]); }
                if (pos < SINK) {
                    memcpy(sink_k(c, seq, l, h) + (size_t)pos * d, dk, sizeof(float) * (size_t)d);
                    memcpy(sink_v(c, seq, l, h) + (size_t)pos * d, dv, sizeof(float) * (size_t)d);
                }
            }
        }
        s->len++;
        if (s->len % T == 0) st = promote(c, seq, s->len / T - 1);
    }
    free(row);
    return st;
}

/* Unpaged tokens read as a page would hold them (vanilla FP4, FP8): keys per
 * token, values per block of B tokens from the page start, zero padded. */
static void latent_on_the_fly(const fr_kv_cache *c, int layer, int n, float *rows)
{
    const int d = c->cfg.head_dim, dc = c->cfg.latent_dim;
    const float sc = latent_fp8_scale(c, layer);
    for (int t = 0; t < n; t++) {
        float *x = rows + (size_t)t * d;
        if (c->cfg.dtype == FR_KV_FP8)
            for (int j = 0; j < dc; j++) x[j] = sc * fr_e4m3_round(x[j] / sc);
        else
            fr_fp4_fake_quantize(fmt(c), c->cfg.recipe.scale_search, x, dc, x);
        for (int j = dc; j < d; j++) x[j] = fr_bf16_round(x[j]);   /* the RoPE part as a page keeps it */
    }
}

static void quantize_on_the_fly(const fr_kv_cache *c, int layer, int head, int n, float *k, float *v)
{
    const int d = c->cfg.head_dim;
    if (is_latent(c)) {
        latent_on_the_fly(c, layer, n, k);
        return;
    }
    if (c->cfg.dtype == FR_KV_FP8) {
        const float *sc = c->fp8_scales + ((size_t)layer * c->cfg.n_kv_heads + head) * 2;
        for (int i = 0; i < n * d; i++) {
            k[i] = sc[0] * fr_e4m3_round(k[i] / sc[0]);
            v[i] = sc[1] * fr_e4m3_round(v[i] / sc[1]);
        }
        return;
    }
    fr_fp4_format f = fmt(c);
    const int B = fr_fp4_block_size(f);
    for (int t = 0; t < n; t++)
        fr_fp4_fake_quantize(f, c->cfg.recipe.scale_search, k + (size_t)t * d, d, k + (size_t)t * d);
    float col[FR_MAX_FP4_BLOCK];
    for (int a = 0; a < n; a += B)
        for (int j = 0; j < d; j++) {
            for (int i = 0; i < B; i++) col[i] = a + i < n ? v[(size_t)(a + i) * d + j] : 0.0f;
            fr_fp4_fake_quantize(f, 0, col, B, col);
            for (int i = 0; i < B && a + i < n; i++) v[(size_t)(a + i) * d + j] = col[i];
        }
}

fr_status fr_kv_gather(const fr_kv_cache *c, int seq, int layer, int head, int n_step,
                       const float *step_k, const float *step_v, float *k_out, float *v_out,
                       fr_kv_view *view)
{
    fr_status st = check_seq(c, seq);
    if (st) return st;
    if (c->cfg.bookkeeping_only) return fr_fail(FR_EINVAL, "kv gather: this cache keeps no storage");
    const int lat = is_latent(c);
    if (layer < 0 || layer >= c->cfg.n_layers || head < 0 || head >= c->cfg.n_kv_heads || n_step < 0 ||
        (n_step > 0 && (!step_k || (!step_v && !lat))) || (!v_out && !lat))
        return fr_fail(FR_EINVAL, "kv gather: invalid layer %d, head %d or step of %d tokens", layer, head, n_step);
    const int d = c->cfg.head_dim, H = c->cfg.n_kv_heads;
    const kv_seq *s = &c->seqs[seq];
    const int len = s->len, n = len + n_step, full = len / T * T;
    for (int p = 0; p < len / T; p++) {
        const uint8_t *page = head_page(c, s->table.blocks[p], layer, head);
        if (lat) read_latent_page(c, layer, page, k_out + (size_t)p * T * d);
        else read_head_page(c, layer, head, page, k_out + (size_t)p * T * d, v_out + (size_t)p * T * d);
    }
    memcpy(k_out + (size_t)full * d, slot_k(c, seq, layer, head), sizeof(float) * (size_t)(len - full) * d);
    if (!lat)
        memcpy(v_out + (size_t)full * d, slot_v(c, seq, layer, head), sizeof(float) * (size_t)(len - full) * d);
    for (int i = 0; i < n_step; i++) {   /* only this head's rows: no work for the others */
        float *kt = k_out + (size_t)(len + i) * d;
        memcpy(kt, step_k + ((size_t)i * H + head) * d, sizeof(float) * (size_t)d);
        transform_key(c, layer, head, kt);
        if (!lat)
            memcpy(v_out + (size_t)(len + i) * d, step_v + ((size_t)i * H + head) * d, sizeof(float) * (size_t)d);
    }
    *view = (fr_kv_view){.n_tokens = n, .k = k_out, .v = lat ? k_out : v_out};
    if (keeps_bf16(c)) {
        view->n_sink = n < SINK ? n : SINK;
        view->fp4_end = full;
        int ns = len < SINK ? len : SINK;   /* stored sink tokens; step tokens stay as computed */
        memcpy(k_out, sink_k(c, seq, layer, head), sizeof(float) * (size_t)ns * d);
        if (!lat) memcpy(v_out, sink_v(c, seq, layer, head), sizeof(float) * (size_t)ns * d);
    } else if (c->cfg.dtype != FR_KV_BF16 && c->cfg.dtype != FR_KV_F32) {
        quantize_on_the_fly(c, layer, head, n - full, k_out + (size_t)full * d,
                            lat ? NULL : v_out + (size_t)full * d);
        if (is_fp4(c)) view->fp4_end = n;
    }
    return FR_OK;
}

fr_kv_latent_form fr_kv_latent_form_of(const fr_kv_cache *c, int layer)
{
    fr_kv_latent_form f = {.latent_dim = c->cfg.latent_dim, .fmt = fmt(c), .q_search = c->cfg.recipe.scale_search};
    if (!is_latent(c) || !is_fp4(c)) return f;
    if (c->cfg.recipe.smooth) f.mean = c->key_mean + (size_t)layer * c->cfg.head_dim;
    f.rotate = c->cfg.recipe.rotate;
    if (c->cfg.compute == FR_COMPUTE_EXACT) f.q_mode = c->cfg.recipe.dual_query ? FR_Q_DUAL : FR_Q_SINGLE;
    else f.q_bf16 = 1;
    return f;
}

const uint8_t *fr_kv_page(const fr_kv_cache *c, int seq, int page)
{
    if (check_seq(c, seq) || c->cfg.bookkeeping_only || page < 0 || page >= c->seqs[seq].len / T) return NULL;
    return c->pool + (size_t)c->seqs[seq].table.blocks[page] * c->block_bytes;
}

const int *fr_kv_seq_blocks(const fr_kv_cache *c, int seq, int *n_blocks)
{
    static const int no_blocks[1] = {-1};   /* a valid sequence never gets NULL, even with no block yet */
    if (check_seq(c, seq)) return NULL;
    if (n_blocks) *n_blocks = c->seqs[seq].table.n;
    return c->seqs[seq].table.blocks ? c->seqs[seq].table.blocks : no_blocks;
}
