#include "rollout/model/mla_cpu.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "attention/hadamard.h"
#include "attention/microscale.h"
#include "base/fixed_math.h"
#include "rollout/model/ops_cpu.h"
#include "rollout/model/rope_yarn.h"

enum { ROWS = 256 };   /* query rows per score block */

struct fr_mla_cpu {
    float *lowrank;    /* [T][q_lora] */
    float *qcat;       /* [ROWS][dc + dr]: absorbed content query, then the RoPE query */
    float *qq1, *qq2;  /* [ROWS][dc + dr], [ROWS][dc]: qcat's terms on the FP4 pages */
    float *ctx;        /* [ROWS][dc] */
    float *tmp;        /* [dr] */
};

void fr_mla_cpu_destroy(fr_mla_cpu **ps)
{
    fr_mla_cpu *s = ps ? *ps : NULL;
    if (!s) return;
    free(s->lowrank); free(s->qcat); free(s->qq1); free(s->qq2); free(s->ctx); free(s->tmp);
    free(s);
    *ps = NULL;
}

fr_status fr_mla_cpu_new(const fr_model_config *c, int max_tokens, fr_mla_cpu **out)
{
    *out = NULL;
    fr_mla_cpu *s = calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "latent attention: out of memory");
    const size_t T = (size_t)max_tokens, row = (size_t)c->kv_lora_rank + (size_t)c->qk_rope_dim;
    s->lowrank = malloc(sizeof(float) * T * (size_t)(c->q_lora_rank > 0 ? c->q_lora_rank : 1));
    s->qcat = malloc(sizeof(float) * ROWS * row);
    s->qq1 = malloc(sizeof(float) * ROWS * row);
    s->qq2 = malloc(sizeof(float) * ROWS * (size_t)c->kv_lora_rank);
    s->ctx = malloc(sizeof(float) * ROWS * (size_t)c->kv_lora_rank);
    s->tmp = malloc(sizeof(float) * (size_t)c->qk_rope_dim);
    if (!s->lowrank || !s->qcat || !s->qq1 || !s->qq2 || !s->ctx || !s->tmp) {
        fr_mla_cpu_destroy(&s);
        return fr_fail(FR_ENOMEM, "latent attention: cannot allocate scratch for %d tokens", max_tokens);
    }
    *out = s;
    return FR_OK;
}

/* RoPE on dr values at position pos; interleaved pairs are first moved to
 * the halves (transformers' apply_rotary_pos_emb_interleave). */
static void rope(fr_mla_cpu *s, const fr_model_config *c, float *x, int pos)
{
    const int dr = c->qk_rope_dim;
    if (c->rope_interleave) {
        for (int i = 0; i < dr / 2; i++) {
            s->tmp[i] = x[2 * i];
            s->tmp[i + dr / 2] = x[2 * i + 1];
        }
        memcpy(x, s->tmp, sizeof(float) * (size_t)dr);
    }
    fr_rope(x, 1, dr, pos, c->rope_theta, &c->rope_scaling);
}

void fr_mla_cpu_project(fr_mla_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *xn, int M,
                        const int *pos, float *q, float *rows)
{
    const int H = c->num_heads, D = c->hidden_size, dc = c->kv_lora_rank, dr = c->qk_rope_dim;
    const int qh = c->qk_nope_dim + dr, ql = c->q_lora_rank;
    if (ql) {
        fr_matmul(s->lowrank, xn, lw->q_a_proj, M, ql, D);
        fr_rmsnorm(s->lowrank, s->lowrank, lw->q_a_norm, M, ql, c->rms_norm_eps);
        fr_matmul(q, s->lowrank, lw->q_b_proj, M, H * qh, ql);
    } else {
        fr_matmul(q, xn, lw->q_proj, M, H * qh, D);
    }
    fr_matmul(rows, xn, lw->kv_a_proj, M, dc + dr, D);
    for (int t = 0; t < M; t++) {
        float *row = rows + (size_t)t * (dc + dr);
        fr_rmsnorm(row, row, lw->kv_a_norm, 1, dc, c->rms_norm_eps);
        rope(s, c, row + dc, pos[t]);
        for (int h = 0; h < H; h++) rope(s, c, q + ((size_t)t * H + h) * qh + c->qk_nope_dim, pos[t]);
    }
}

/* Causal softmax of ni rows of scores (row i sees `first + i + 1` keys). */
static void softmax_rows(float *sc, int ni, int ctx, int first)
{
    for (int i = 0; i < ni; i++) {
        float *r = sc + (size_t)i * ctx;
        const int visible = first + i + 1;
        float mx = -INFINITY;
        for (int t = 0; t < visible; t++) mx = fmaxf(mx, r[t]);
        double sum = 0.0;
        for (int t = 0; t < visible; t++) {
            r[t] = fr_expf(r[t] - mx);
            sum += r[t];
        }
        const float inv = (float)(1.0 / sum);
        for (int t = 0; t < visible; t++) r[t] *= inv;
        for (int t = visible; t < ctx; t++) r[t] = 0.0f;
    }
}

/* The query terms the FP4 pages meet, for ni rows of qcat: qq1 = [first
 * term | RoPE query], qq2 = the dual residual (unused otherwise). Returns
 * whether there is a second term. */
static int quantized_query(fr_mla_cpu *s, const fr_kv_latent_form *f, int ni, int dc, int row)
{
    for (int i = 0; i < ni; i++) {
        const float *x = s->qcat + (size_t)i * row;
        float *q1 = s->qq1 + (size_t)i * row, *q2 = s->qq2 + (size_t)i * dc;
        memcpy(q1 + dc, x + dc, sizeof(float) * (size_t)(row - dc));
        if (f->q_mode == FR_Q_DUAL) fr_fp4_quantize_dual(f->fmt, f->q_search, x, dc, q1, q2);
        else if (f->q_mode == FR_Q_SINGLE) fr_fp4_fake_quantize(f->fmt, f->q_search, x, dc, q1);
        else if (f->q_bf16) for (int j = 0; j < dc; j++) q1[j] = fr_bf16_round(x[j]);
        else memcpy(q1, x, sizeof(float) * (size_t)dc);
    }
    return f->q_mode == FR_Q_DUAL;
}

/* Scores of ni rows (query rows of qcat) over ctx cache rows, each with the
 * query form its token's storage calls for. */
static void latent_scores(fr_mla_cpu *s, const fr_kv_latent_form *f, const fr_kv_view *view, int ni, int ctx,
                          int dc, int row, float scale, float *scores)
{
    const float *keys = view->k;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ctx, row, scale, s->qcat, row, keys, row, 0.0f, scores,
                ctx);
    const int a = view->n_sink, b = view->fp4_end < ctx ? view->fp4_end : ctx;
    if (!f || b <= a || (f->q_mode == FR_Q_UNQUANTIZED && !f->q_bf16)) return;
    /* The FP4 pages' tokens: both query terms, each product in float32. */
    const int dual = quantized_query(s, f, ni, dc, row);
    const float *kp = keys + (size_t)a * row;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, b - a, row, scale, s->qq1, row, kp, row, 0.0f,
                scores + a, ctx);
    if (dual)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, b - a, dc, scale, s->qq2, dc, kp, row, 1.0f,
                    scores + a, ctx);
}

void fr_mla_cpu_attend(fr_mla_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *q, int len,
                       int n, const fr_kv_view *view, const fr_kv_latent_form *form, float *scores, float *out)
{
    const int H = c->num_heads, dc = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    const int qh = dn + dr, row = dc + dr;
    const float scale = fr_mla_softmax_scale(c);
    const float *keys = view->k;
    const int rotate = form && form->rotate;
    const float *mean = form ? form->mean : NULL;
    for (int h = 0; h < H; h++) {
        const float *w_uk = lw->kv_b_proj + (size_t)h * (dn + dv) * dc, *w_uv = w_uk + (size_t)dn * dc;
        for (int i0 = 0; i0 < n; i0 += ROWS) {
            const int ni = n - i0 < ROWS ? n - i0 : ROWS, ctx = len + i0 + ni;
            const float *qr = q + (size_t)i0 * H * qh + (size_t)h * qh;
            /* qcat = [q_content . W_UK | q_rope], the content part rotated as the latents are */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, dc, dn, 1.0f, qr, H * qh, w_uk, dc, 0.0f,
                        s->qcat, row);
            for (int i = 0; i < ni; i++) {
                memcpy(s->qcat + (size_t)i * row + dc, qr + (size_t)i * H * qh + dn, sizeof(float) * (size_t)dr);
                if (rotate) fr_hadamard(s->qcat + (size_t)i * row, dc);
            }
            latent_scores(s, form, view, ni, ctx, dc, row, scale, scores);
            softmax_rows(scores, ni, ctx, len + i0);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, dc, ctx, 1.0f, scores, ctx, keys, row, 0.0f,
                        s->ctx, dc);
            /* Back from the store form: H is its own inverse, and the
             * probabilities sum to 1, so the mean comes back whole. */
            for (int i = 0; i < ni && (rotate || mean); i++) {
                float *x = s->ctx + (size_t)i * dc;
                if (rotate) fr_hadamard(x, dc);
                for (int j = 0; mean && j < dc; j++) x[j] += mean[j];
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, dv, dc, 1.0f, s->ctx, dc, w_uv, dc, 0.0f,
                        out + (size_t)i0 * H * dv + (size_t)h * dv, H * dv);
        }
    }
}
