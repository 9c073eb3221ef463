#include "ref_attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "fp_formats.h"
#include "hadamard.h"

static fr_status check_params(const fr_attn_params *p)
{
    if (p->head_dim < 1 || p->head_dim > FR_MAX_HEAD_DIM)
        return fr_fail(FR_EINVAL, "attention: head_dim %d outside [1, %d]", p->head_dim, FR_MAX_HEAD_DIM);
    if (p->group < 1 || p->group > FR_MAX_GROUP)
        return fr_fail(FR_EINVAL, "attention: group %d outside [1, %d]", p->group, FR_MAX_GROUP);
    if (p->tile < 32 || p->tile % 32)
        return fr_fail(FR_EINVAL, "attention: tile %d is not a positive multiple of 32", p->tile);
    if (p->q_mode != FR_Q_UNQUANTIZED && p->head_dim % fr_fp4_block_size(p->fmt))
        return fr_fail(FR_EINVAL, "attention: head_dim %d is not a multiple of the %s block",
                       p->head_dim, fr_fp4_format_name(p->fmt));
    if (p->quantize_p && !p->p.underflow_aware && p->p.c != 1.0f)
        return fr_fail(FR_EINVAL, "attention: the plain P rule needs c = 1");
    return FR_OK;
}

/* Lines 3-4: the query terms the quantized tokens see. Row h of q1/q2 holds
 * head h; q2 is all zeros unless the query is dual. */
static void quantize_query(const fr_attn_params *p, const float *q, float *q1, float *q2)
{
    int d = p->head_dim;
    for (int h = 0; h < p->group; h++) {
        const float *x = q + h * d;
        if (p->q_mode == FR_Q_UNQUANTIZED) {
            memcpy(q1 + h * d, x, sizeof(float) * (size_t)d);
            memset(q2 + h * d, 0, sizeof(float) * (size_t)d);
        } else if (p->q_mode == FR_Q_SINGLE) {
            fr_fp4_fake_quantize(p->fmt, p->q_search, x, d, q1 + h * d);
            memset(q2 + h * d, 0, sizeof(float) * (size_t)d);
        } else {
            fr_fp4_quantize_dual(p->fmt, p->q_search, x, d, q1 + h * d, q2 + h * d);
        }
    }
}

static double dot(const float *a, const float *b, int d)
{
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)a[i] * b[i];
    return s;
}

static int masked(int t, int x0, int x1) { return t >= x0 && t < x1; }

/* Line 7-8's base-2 logit of key k for head h: both query terms, summed in
 * FP32 after the products. */
static float logit(const float *q1, const float *q2, const float *k, int d, float gamma)
{
    float s1 = (float)dot(q1, k, d), s2 = (float)dot(q2, k, d);
    return gamma * (s1 + s2);
}

/* The query terms a split sees: quantized (q2 zero unless dual) or plain. */
static void split_query(const fr_attn_params *p, const float *q, int quantized, float *q1, float *q2)
{
    if (quantized) {
        quantize_query(p, q, q1, q2);
    } else {
        memcpy(q1, q, sizeof(float) * (size_t)(p->group * p->head_dim));
        memset(q2, 0, sizeof(float) * (size_t)(p->group * p->head_dim));
    }
}

/* m0 (NULL: -inf, the online softmax) starts every head's running maximum:
 * a row maximum there makes every P block relative to it. */
static fr_status partial(const fr_attn_params *p, const float *q, const fr_kv_view *kv, int t0, int t1, int x0,
                         int x1, int quantized, const float *m0, float *o, float *lse);

fr_status fr_ref_attn_partial(const fr_attn_params *p, const float *q, const fr_kv_view *kv,
                              int t0, int t1, int x0, int x1, int quantized, float *o,
                              float *lse)
{
    return partial(p, q, kv, t0, t1, x0, x1, quantized, NULL, o, lse);
}

static fr_status partial(const fr_attn_params *p, const float *q, const fr_kv_view *kv, int t0, int t1, int x0,
                         int x1, int quantized, const float *m0, float *o, float *lse)
{
    fr_status st = check_params(p);
    if (st) return st;
    if (!q || !kv || !kv->k || !kv->v || !o || !lse)
        return fr_fail(FR_EINVAL, "attention: NULL argument");
    if (t0 < 0 || t1 > kv->n_tokens || t0 > t1 || t0 % p->tile)
        return fr_fail(FR_EINVAL, "attention: split [%d, %d) invalid for %d tokens and tile %d",
                       t0, t1, kv->n_tokens, p->tile);

    const int d = p->head_dim, G = p->group, B = fr_fp4_block_size(p->fmt);
    const int qp = quantized && p->quantize_p;
    const float gamma = (float)(M_LOG2E / sqrt((double)d));
    const float c = qp ? p->p.c : 1.0f, log2c = (float)fr_log2(c);

    float *q1 = malloc(sizeof(float) * (size_t)(2 * G * d));
    float *S = malloc(sizeof(float) * (size_t)p->tile);
    float *P = malloc(sizeof(float) * (size_t)p->tile);
    double *acc = calloc((size_t)(G * d), sizeof(double));
    if (!q1 || !S || !P || !acc) {
        free(q1); free(S); free(P); free(acc);
        return fr_fail(FR_ENOMEM, "attention: out of memory");
    }
    float *q2 = q1 + G * d;
    split_query(p, q, quantized, q1, q2);

    for (int h = 0; h < G; h++) {
        float m = m0 ? m0[h] : -INFINITY;   /* running maximum, base-2 logits */
        double l = 0.0;           /* running sum of unquantized c p */
        double *oh = acc + h * d;
        for (int a = t0; a < t1; a += p->tile) {
            int b = a + p->tile < t1 ? a + p->tile : t1, n = b - a;
            /* Lines 7-8: both query terms, summed in FP32 after the products. */
            float tile_max = -INFINITY;
            for (int i = 0; i < n; i++) {
                int t = a + i;
                if (masked(t, x0, x1)) { S[i] = -INFINITY; continue; }
                S[i] = logit(q1 + h * d, q2 + h * d, kv->k + (size_t)t * d, d, gamma);
                tile_max = fmaxf(tile_max, S[i]);
            }
            if (tile_max == -INFINITY) continue;   /* every key masked: nothing changes */
            /* Lines 9-11. */
            float m_new = fmaxf(m, tile_max);
            float alpha = m == -INFINITY ? 0.0f : fr_exp2f(m - m_new);
            double sum = 0.0;
            for (int i = 0; i < n; i++) {
                P[i] = S[i] == -INFINITY ? 0.0f : fr_exp2f(S[i] - m_new + log2c);
                sum += P[i];
            }
            l = alpha * l + sum;
            /* Lines 12-14: P blocks of B keys, aligned to token multiples of B. */
            if (qp) {
                float blk[FR_MAX_FP4_BLOCK], deq[FR_MAX_FP4_BLOCK];
                for (int i0 = 0; i0 < n; i0 += B) {
                    float smax = -INFINITY;
                    for (int j = 0; j < B; j++) {
                        blk[j] = i0 + j < n ? P[i0 + j] : 0.0f;
                        if (i0 + j < n) smax = fmaxf(smax, S[i0 + j]);
                    }
                    float pmax = smax == -INFINITY ? 0.0f : fr_exp2f(smax - m_new);
                    fr_pquant_block(p->fmt, &p->p, blk, pmax, deq);
                    for (int j = 0; j < B && i0 + j < n; j++) P[i0 + j] = deq[j];
                }
            }
            /* Line 15. */
            for (int j = 0; j < d; j++) oh[j] *= alpha;
            for (int i = 0; i < n; i++) {
                if (P[i] == 0.0f) continue;
                const float *v = kv->v + (size_t)(a + i) * d;
                for (int j = 0; j < d; j++) oh[j] += (double)P[i] * v[j];
            }
            m = m_new;
        }
        /* Line 17, and the LSE without the factor c folded into P. */
        for (int j = 0; j < d; j++) o[h * d + j] = l > 0.0 ? (float)(oh[j] / l) : 0.0f;
        lse[h] = l > 0.0 ? m + (float)fr_log2(l) - log2c : -INFINITY;
    }
    free(q1); free(S); free(P); free(acc);
    return FR_OK;
}

fr_status fr_ref_attn_combine(int n, int group, int head_dim, const float *o_parts,
                              const float *lse_parts, float *o, float *lse)
{
    if (n < 1 || group < 1 || head_dim < 1 || !o_parts || !lse_parts || !o || !lse)
        return fr_fail(FR_EINVAL, "combine: invalid arguments");
    for (int h = 0; h < group; h++) {
        float mx = -INFINITY;
        for (int i = 0; i < n; i++) mx = fmaxf(mx, lse_parts[i * group + h]);
        double wsum = 0.0;
        for (int j = 0; j < head_dim; j++) o[h * head_dim + j] = 0.0f;
        if (mx == -INFINITY) { lse[h] = -INFINITY; continue; }
        for (int i = 0; i < n; i++) wsum += fr_exp2((double)lse_parts[i * group + h] - mx);
        for (int j = 0; j < head_dim; j++) {
            double s = 0.0;
            for (int i = 0; i < n; i++) {
                double w = fr_exp2((double)lse_parts[i * group + h] - mx) / wsum;
                s += w * o_parts[((size_t)i * group + h) * head_dim + j];
            }
            o[h * head_dim + j] = (float)s;
        }
        lse[h] = mx + (float)fr_log2(wsum);
    }
    return FR_OK;
}

void fr_ref_split_range(const fr_kv_view *kv, int tile, int n_splits, int i, int *t0, int *t1,
                        int *x0, int *x1)
{
    if (i == n_splits) {    /* the unquantized tokens: everything but the pages' live part */
        *t0 = 0; *t1 = kv->n_tokens;
        *x0 = kv->n_sink < kv->fp4_end ? kv->n_sink : 0;
        *x1 = kv->n_sink < kv->fp4_end ? kv->fp4_end : 0;
        return;
    }
    int tiles = (kv->fp4_end + tile - 1) / tile;
    int a = (int)((long)tiles * i / n_splits), b = (int)((long)tiles * (i + 1) / n_splits);
    *t0 = a * tile;
    *t1 = b * tile < kv->fp4_end ? b * tile : kv->fp4_end;
    if (*t1 < *t0) *t1 = *t0;
    *x0 = 0; *x1 = kv->n_sink;   /* the sink's quantized copy */
}

/* Every head's largest logit over all splits, each with its own query form. */
static fr_status row_maximum(const fr_attn_params *p, const float *q, const fr_kv_view *kv, int n_splits,
                             float *mx)
{
    const int G = p->group, d = p->head_dim;
    const float gamma = (float)(M_LOG2E / sqrt((double)d));
    float *q1 = malloc(sizeof(float) * (size_t)(2 * G * d));
    if (!q1) return fr_fail(FR_ENOMEM, "attention: out of memory");
    for (int h = 0; h < G; h++) mx[h] = -INFINITY;
    for (int i = 0; i <= n_splits; i++) {
        int t0, t1, x0, x1;
        fr_ref_split_range(kv, p->tile, n_splits, i, &t0, &t1, &x0, &x1);
        split_query(p, q, i < n_splits, q1, q1 + G * d);
        for (int t = t0; t < t1; t++)
            if (!masked(t, x0, x1))
                for (int h = 0; h < G; h++)
                    mx[h] = fmaxf(mx[h], logit(q1 + h * d, q1 + (G + h) * d, kv->k + (size_t)t * d, d, gamma));
    }
    free(q1);
    return FR_OK;
}

fr_status fr_ref_attn_decode(const fr_attn_params *p, const float *q, const fr_kv_view *kv,
                             int n_splits, float *o, float *lse)
{
    fr_status st = check_params(p);
    if (st) return st;
    if (n_splits < 1) return fr_fail(FR_EINVAL, "attention: n_splits %d < 1", n_splits);
    if (!kv || kv->n_tokens < 1)
        return fr_fail(FR_EINVAL, "attention: the cache holds no token");
    if (kv->fp4_end < 0 || kv->fp4_end > kv->n_tokens || kv->n_sink < 0)
        return fr_fail(FR_EINVAL, "attention: token regions [%d, %d) invalid for %d tokens",
                       kv->n_sink, kv->fp4_end, kv->n_tokens);
    int G = p->group, d = p->head_dim, total = n_splits + 1;
    float *op = malloc(sizeof(float) * (size_t)(total * G * d));
    float *lp = malloc(sizeof(float) * (size_t)(total * G));
    float row_max[FR_MAX_GROUP];
    if (!op || !lp) { free(op); free(lp); return fr_fail(FR_ENOMEM, "attention: out of memory"); }
    if (p->p_row_max && (st = row_maximum(p, q, kv, n_splits, row_max))) { free(op); free(lp); return st; }
    for (int i = 0; i < total && !st; i++) {
        int t0, t1, x0, x1;
        fr_ref_split_range(kv, p->tile, n_splits, i, &t0, &t1, &x0, &x1);
        st = partial(p, q, kv, t0, t1, x0, x1, i < n_splits, p->p_row_max ? row_max : NULL,
                     op + (size_t)i * G * d, lp + (size_t)i * G);
    }
    if (!st) st = fr_ref_attn_combine(total, G, d, op, lp, o, lse);
    free(op); free(lp);
    return st;
}

/* ---- Algorithm 1 from raw tensors ---- */

fr_ref_config fr_ref_config_default(fr_kv_dtype t)
{
    return (fr_ref_config){.kv_dtype = t, .compute = FR_COMPUTE_EXACT, .recipe = fr_recipe_full(),
                           .tau = FR_P_TAU, .fp8_k_scale = 1.0f, .fp8_v_scale = 1.0f, .tile = 128};
}

fr_attn_params fr_ref_attn_params(const fr_ref_config *cfg, int head_dim, int group)
{
    fr_attn_params p = {.head_dim = head_dim, .group = group, .tile = cfg->tile,
                        .fmt = fr_kv_dtype_fp4_format(cfg->kv_dtype), .q_mode = FR_Q_UNQUANTIZED,
                        .q_search = cfg->recipe.scale_search, .quantize_p = 0,
                        .p = fr_pquant_plain(), .p_row_max = cfg->recipe.p_row_max};
    if (fr_kv_dtype_is_fp4(cfg->kv_dtype) && cfg->compute == FR_COMPUTE_EXACT) {
        p.q_mode = cfg->recipe.dual_query ? FR_Q_DUAL : FR_Q_SINGLE;
        p.quantize_p = 1;
        if (cfg->recipe.p_scaling) {
            p.p = fr_pquant_default();
            p.p.tau = cfg->tau;
        }
    }
    return p;
}

static int is_fp4(const fr_ref_config *cfg) { return fr_kv_dtype_is_fp4(cfg->kv_dtype); }

fr_status fr_ref_prepare_query(const fr_ref_config *cfg, int head_dim, int group, const float *q,
                               float *q_out)
{
    if (!q || !q_out || group < 1 || head_dim < 1)
        return fr_fail(FR_EINVAL, "prepare_query: invalid arguments");
    memmove(q_out, q, sizeof(float) * (size_t)(group * head_dim));
    if (!is_fp4(cfg) || !cfg->recipe.rotate) return FR_OK;
    for (int h = 0; h < group; h++) {
        fr_status st = fr_hadamard(q_out + h * head_dim, head_dim);
        if (st) return st;
    }
    return FR_OK;
}

/* Values of FP4 tokens: blocks of B along the token axis, channel by channel. */
static void quantize_values(fr_fp4_format f, int d, int t0, int t1, const float *v, float *out)
{
    int B = fr_fp4_block_size(f);
    float col[FR_MAX_FP4_BLOCK], deq[FR_MAX_FP4_BLOCK];
    for (int a = t0; a < t1; a += B)
        for (int j = 0; j < d; j++) {
            for (int i = 0; i < B; i++) col[i] = a + i < t1 ? v[(size_t)(a + i) * d + j] : 0.0f;
            fr_fp4_fake_quantize(f, 0, col, B, deq);
            for (int i = 0; i < B && a + i < t1; i++) out[(size_t)(a + i) * d + j] = deq[i];
        }
}

fr_status fr_ref_prepare_kv(const fr_ref_config *cfg, int head_dim, int n, const float *k,
                            const float *v, const float *mu, float *k_out, float *v_out,
                            fr_kv_view *view)
{
    const int d = head_dim;
    if (!k || !v || !k_out || !v_out || !view || n < 1 || d < 1 || d > FR_MAX_HEAD_DIM)
        return fr_fail(FR_EINVAL, "prepare_kv: invalid arguments");
    fr_fp4_format f = fr_kv_dtype_fp4_format(cfg->kv_dtype);
    if (is_fp4(cfg) && d % fr_fp4_block_size(f))
        return fr_fail(FR_EINVAL, "prepare_kv: head_dim %d is not a multiple of the %s block", d,
                       fr_fp4_format_name(f));
    if (is_fp4(cfg) && cfg->recipe.rotate && (d & (d - 1)))
        return fr_fail(FR_EINVAL, "prepare_kv: Hadamard rotation needs a power-of-two head_dim, not %d", d);

    *view = (fr_kv_view){.n_tokens = n, .k = k_out, .v = v_out};
    if (is_fp4(cfg)) {
        view->n_sink = cfg->recipe.sink_recent ? (n < FR_SINK_TOKENS ? n : FR_SINK_TOKENS) : 0;
        view->fp4_end = cfg->recipe.sink_recent ? n / FR_PAGE_TOKENS * FR_PAGE_TOKENS : n;
    }
    for (int t = 0; t < n; t++) {
        float *kt = k_out + (size_t)t * d;
        memmove(kt, k + (size_t)t * d, sizeof(float) * (size_t)d);
        if (!is_fp4(cfg)) {
            for (int j = 0; j < d; j++) {
                float kv = kt[j], vv = v[(size_t)t * d + j];
                if (cfg->kv_dtype == FR_KV_FP8) {
                    kt[j] = cfg->fp8_k_scale * fr_e4m3_round(kv / cfg->fp8_k_scale);
                    v_out[(size_t)t * d + j] = cfg->fp8_v_scale * fr_e4m3_round(vv / cfg->fp8_v_scale);
                } else if (cfg->kv_dtype == FR_KV_F32) {
                    v_out[(size_t)t * d + j] = vv;
                } else {
                    kt[j] = fr_bf16_round(kv);
                    v_out[(size_t)t * d + j] = fr_bf16_round(vv);
                }
            }
            continue;
        }
        /* Line 1, for every token: the shift must be the same for all keys. */
        if (cfg->recipe.smooth && mu)
            for (int j = 0; j < d; j++) kt[j] -= mu[j];
        if (cfg->recipe.rotate) fr_hadamard(kt, d);
        int in_pages = t >= view->n_sink && t < view->fp4_end;
        if (in_pages) {
            fr_fp4_fake_quantize(f, cfg->recipe.scale_search, kt, d, kt);   /* line 2, keys */
        } else {
            for (int j = 0; j < d; j++) kt[j] = fr_bf16_round(kt[j]);
        }
    }
    if (is_fp4(cfg)) {
        /* Line 2, values: the quantized range starts at token 0 (page aligned)
         * so the blocks match the cache's; sink values are kept in BF16. */
        memmove(v_out, v, sizeof(float) * (size_t)n * d);
        /* The sink's quantized copy is masked: its values are zeroed before
         * quantizing so they do not set the scales of their block-mates. */
        for (int t = 0; t < view->n_sink && t < view->fp4_end; t++)
            memset(v_out + (size_t)t * d, 0, sizeof(float) * (size_t)d);
        quantize_values(f, d, 0, view->fp4_end, v_out, v_out);
        for (int t = 0; t < n; t++)
            if (t < view->n_sink || t >= view->fp4_end)
                for (int j = 0; j < d; j++) v_out[(size_t)t * d + j] = fr_bf16_round(v[(size_t)t * d + j]);
    }
    return FR_OK;
}
