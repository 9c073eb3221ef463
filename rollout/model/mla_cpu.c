#include "rollout/model/mla_cpu.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/model/ops_cpu.h"

enum { ROWS = 256 };   /* query rows per score block */

struct fr_mla_cpu {
    float *lowrank;    /* [T][q_lora] */
    float *qcat;       /* [ROWS][dc + dr]: absorbed content query, then the RoPE query */
    float *ctx;        /* [ROWS][dc] */
    float *tmp;        /* [dr] */
};

void fr_mla_cpu_destroy(fr_mla_cpu **ps)
{
    fr_mla_cpu *s = ps ? *ps : NULL;
    if (!s) return;
    free(s->lowrank); free(s->qcat); free(s->ctx); free(s->tmp);
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
    s->ctx = malloc(sizeof(float) * ROWS * (size_t)c->kv_lora_rank);
    s->tmp = malloc(sizeof(float) * (size_t)c->qk_rope_dim);
    if (!s->lowrank || !s->qcat || !s->ctx || !s->tmp) {
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
    fr_rope(x, 1, dr, pos, c->rope_theta);
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

void fr_mla_cpu_attend(fr_mla_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *q, int len,
                       int n, const float *keys, float *scores, float *out)
{
    const int H = c->num_heads, dc = c->kv_lora_rank, dr = c->qk_rope_dim, dn = c->qk_nope_dim, dv = c->v_head_dim;
    const int qh = dn + dr, row = dc + dr;
    const float scale = 1.0f / sqrtf((float)qh);
    for (int h = 0; h < H; h++) {
        const float *w_uk = lw->kv_b_proj + (size_t)h * (dn + dv) * dc, *w_uv = w_uk + (size_t)dn * dc;
        for (int i0 = 0; i0 < n; i0 += ROWS) {
            const int ni = n - i0 < ROWS ? n - i0 : ROWS, ctx = len + i0 + ni;
            const float *qr = q + (size_t)i0 * H * qh + (size_t)h * qh;
            /* qcat = [q_content . W_UK | q_rope] */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, dc, dn, 1.0f, qr, H * qh, w_uk, dc, 0.0f,
                        s->qcat, row);
            for (int i = 0; i < ni; i++)
                memcpy(s->qcat + (size_t)i * row + dc, qr + (size_t)i * H * qh + dn, sizeof(float) * (size_t)dr);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ctx, row, scale, s->qcat, row, keys, row, 0.0f,
                        scores, ctx);
            softmax_rows(scores, ni, ctx, len + i0);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, dc, ctx, 1.0f, scores, ctx, keys, row, 0.0f,
                        s->ctx, dc);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, dv, dc, 1.0f, s->ctx, dc, w_uv, dc, 0.0f,
                        out + (size_t)i0 * H * dv + (size_t)h * dv, H * dv);
        }
    }
}
