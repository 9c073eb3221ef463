#include "rollout/model/moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/model/ops_cpu.h"

struct fr_moe_cpu {
    int max_tokens;
    float *logits, *p;        /* [T][E] */
    int *ids;                 /* [T][k] */
    float *weights;           /* [T][k] */
    int *rows;                /* [T]: the tokens routed to the expert at hand */
    float *row_w;             /* [T]: their routing weights */
    float *xs, *down;         /* [T][hidden] */
    float *gate, *up;         /* [T][Im] */
};

void fr_moe_cpu_destroy(fr_moe_cpu **ps)
{
    fr_moe_cpu *s = ps ? *ps : NULL;
    if (!s) return;
    free(s->logits); free(s->p); free(s->ids); free(s->weights); free(s->rows); free(s->row_w);
    free(s->xs); free(s->down); free(s->gate); free(s->up);
    free(s);
    *ps = NULL;
}

fr_status fr_moe_cpu_new(const fr_model_config *c, int max_tokens, fr_moe_cpu **out)
{
    *out = NULL;
    if (c->num_experts < 1 || max_tokens < 1) return fr_fail(FR_EINVAL, "moe: no experts or no tokens");
    fr_moe_cpu *s = calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "moe: out of memory");
    size_t T = (size_t)max_tokens, E = (size_t)c->num_experts, k = (size_t)c->experts_per_tok;
    size_t H = (size_t)c->hidden_size, Im = (size_t)c->moe_intermediate_size;
    s->max_tokens = max_tokens;
    s->logits = malloc(sizeof(float) * T * E);
    s->p = malloc(sizeof(float) * T * E);
    s->ids = malloc(sizeof(int) * T * k);
    s->weights = malloc(sizeof(float) * T * k);
    s->rows = malloc(sizeof(int) * T);
    s->row_w = malloc(sizeof(float) * T);
    s->xs = malloc(sizeof(float) * T * H);
    s->down = malloc(sizeof(float) * T * H);
    s->gate = malloc(sizeof(float) * T * Im);
    s->up = malloc(sizeof(float) * T * Im);
    if (!s->logits || !s->p || !s->ids || !s->weights || !s->rows || !s->row_w || !s->xs || !s->down ||
        !s->gate || !s->up) {
        fr_moe_cpu_destroy(&s);
        return fr_fail(FR_ENOMEM, "moe: cannot allocate expert scratch for %d tokens", max_tokens);
    }
    *out = s;
    return FR_OK;
}

void fr_moe_route(const float *logits, int E, int k, int norm_topk_prob, float *p, int *ids, float *weights)
{
    float mx = -INFINITY;
    for (int e = 0; e < E; e++) mx = fmaxf(mx, logits[e]);
    double sum = 0.0;
    for (int e = 0; e < E; e++) {
        p[e] = fr_expf(logits[e] - mx);
        sum += p[e];
    }
    float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) p[e] *= inv;
    /* k passes of a strict arg-max: the lower index wins a tie */
    float picked = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j && !taken; i++) taken = ids[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[j] = best;
        weights[j] = p[best];
        picked += p[best];
    }
    if (norm_topk_prob)
        for (int j = 0; j < k; j++) weights[j] /= picked;
}

static void matmul(float *y, const float *x, const float *w, int M, int N, int K, int deterministic)
{
    if (deterministic) fr_matmul_fixed(y, x, w, M, N, K);
    else fr_matmul(y, x, w, M, N, K);
}

/* Expert e on the rows routed to it, added into y with their weights. */
static void run_expert(fr_moe_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, int e, int n,
                       float *y, int deterministic)
{
    const int H = c->hidden_size, Im = c->moe_intermediate_size;
    const size_t per = (size_t)Im * (size_t)H;
    matmul(s->gate, s->xs, lw->expert_gate + (size_t)e * per, n, Im, H, deterministic);
    matmul(s->up, s->xs, lw->expert_up + (size_t)e * per, n, Im, H, deterministic);
    fr_swiglu(s->gate, s->gate, s->up, n * Im);
    matmul(s->down, s->gate, lw->expert_down + (size_t)e * per, n, H, Im, deterministic);
    for (int i = 0; i < n; i++) {
        float *yr = y + (size_t)s->rows[i] * H;
        const float *dr = s->down + (size_t)i * H;
        for (int j = 0; j < H; j++) yr[j] += dr[j] * s->row_w[i];
    }
}

void fr_moe_cpu_forward(fr_moe_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *x,
                        int M, float *y, int deterministic)
{
    const int E = c->num_experts, k = c->experts_per_tok, H = c->hidden_size;
    matmul(s->logits, x, lw->router, M, E, H, deterministic);
    for (int t = 0; t < M; t++)
        fr_moe_route(s->logits + (size_t)t * E, E, k, c->norm_topk_prob, s->p + (size_t)t * E,
                     s->ids + (size_t)t * k, s->weights + (size_t)t * k);
    memset(y, 0, sizeof(float) * (size_t)M * H);
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int t = 0; t < M; t++)
            for (int j = 0; j < k; j++)
                if (s->ids[(size_t)t * k + j] == e) {
                    s->rows[n] = t;
                    s->row_w[n] = s->weights[(size_t)t * k + j];
                    memcpy(s->xs + (size_t)n * H, x + (size_t)t * H, sizeof(float) * H);
                    n++;
                }
        if (n) run_expert(s, c, lw, e, n, y, deterministic);
    }
}
