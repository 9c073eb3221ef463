#include "rollout/model/moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/model/ops_cpu.h"

struct fr_moe_cpu {
    int max_tokens;
    float *logits, *scores;   /* [T][E] */
    float *choice;            /* [E]: one row's choices */
    int *ids;                 /* [T][k] */
    float *weights;           /* [T][k] */
    int *rows;                /* [T]: the tokens routed to the expert at hand */
    float *row_w;             /* [T]: their routing weights */
    float *xs, *down;         /* [T][hidden] */
    float *gate, *up;         /* [T][max(Im, Is)] */
};

void fr_moe_cpu_destroy(fr_moe_cpu **ps)
{
    fr_moe_cpu *s = ps ? *ps : NULL;
    if (!s) return;
    free(s->logits); free(s->scores); free(s->choice); free(s->ids); free(s->weights); free(s->rows);
    free(s->row_w); free(s->xs); free(s->down); free(s->gate); free(s->up);
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
    size_t Is = (size_t)fr_model_shared_inter(c), wide = Is > Im ? Is : Im;
    s->max_tokens = max_tokens;
    s->logits = malloc(sizeof(float) * T * E);
    s->scores = malloc(sizeof(float) * T * E);
    s->choice = malloc(sizeof(float) * E);
    s->ids = malloc(sizeof(int) * T * k);
    s->weights = malloc(sizeof(float) * T * k);
    s->rows = malloc(sizeof(int) * T);
    s->row_w = malloc(sizeof(float) * T);
    s->xs = malloc(sizeof(float) * T * H);
    s->down = malloc(sizeof(float) * T * H);
    s->gate = malloc(sizeof(float) * T * wide);
    s->up = malloc(sizeof(float) * T * wide);
    if (!s->logits || !s->scores || !s->choice || !s->ids || !s->weights || !s->rows || !s->row_w || !s->xs ||
        !s->down || !s->gate || !s->up) {
        fr_moe_cpu_destroy(&s);
        return fr_fail(FR_ENOMEM, "moe: cannot allocate expert scratch for %d tokens", max_tokens);
    }
    *out = s;
    return FR_OK;
}

fr_moe_routing fr_moe_routing_of(const fr_model_config *c, const float *bias)
{
    return (fr_moe_routing){.E = c->num_experts, .k = c->experts_per_tok, .scoring = c->scoring_func,
                            .method = c->topk_method, .n_group = fr_model_groups(c),
                            .topk_group = fr_model_topk_groups(c), .norm = c->norm_topk_prob,
                            .scale = fr_model_routed_scale(c), .bias = bias};
}

static void softmax_scores(const float *logits, int E, float *p)
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
}

/* The index of the largest of v[0..n) not yet taken (taken[i] != 0); the
 * lower index wins a tie. */
static int arg_max(const float *v, int n, const unsigned char *taken)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* Group-limited selection: every expert outside the topk_group best groups
 * gets the choice 0.0. A group's rank: its best choice (group_limited_greedy)
 * or its two best added (noaux_tc; the larger first, as torch.topk(2).sum). */
static void mask_groups(const fr_moe_routing *rt, float *choice)
{
    const int G = rt->n_group, per = rt->E / G;
    if (G <= 1 || rt->topk_group >= G || G > FR_MAX_EXPERT_GROUPS) return;
    float rank[FR_MAX_EXPERT_GROUPS];
    unsigned char keep[FR_MAX_EXPERT_GROUPS] = {0};
    for (int g = 0; g < G; g++) {
        const float *v = choice + (size_t)g * per;
        float a = -INFINITY, b = -INFINITY;   /* the best and second best */
        for (int i = 0; i < per; i++) {
            if (v[i] > a) {
                b = a;
                a = v[i];
            } else if (v[i] > b) {
                b = v[i];
            }
        }
        rank[g] = rt->method == FR_MOE_NOAUX_TC ? a + b : a;
    }
    for (int j = 0; j < rt->topk_group; j++) keep[arg_max(rank, G, keep)] = 1;
    for (int g = 0; g < G; g++)
        if (!keep[g])
            for (int i = 0; i < per; i++) choice[(size_t)g * per + i] = 0.0f;
}

void fr_moe_route_row(const fr_moe_routing *rt, const float *logits, float *scores, float *choice, int *ids,
                      float *weights)
{
    const int E = rt->E < FR_MAX_EXPERTS ? rt->E : FR_MAX_EXPERTS, k = rt->k;
    if (rt->scoring == FR_MOE_SIGMOID)
        for (int e = 0; e < E; e++) scores[e] = (float)(1.0 / (1.0 + fr_exp(-(double)logits[e])));
    else
        softmax_scores(logits, E, scores);
    for (int e = 0; e < E; e++)
        choice[e] = rt->method == FR_MOE_NOAUX_TC && rt->bias ? scores[e] + rt->bias[e] : scores[e];
    if (rt->method != FR_MOE_GREEDY) mask_groups(rt, choice);
    /* k passes of a strict arg-max: the lower index wins a tie */
    unsigned char taken[FR_MAX_EXPERTS];
    memset(taken, 0, (size_t)E);
    float picked = 0.0f;
    for (int j = 0; j < k; j++) {
        const int best = arg_max(choice, E, taken);
        taken[best] = 1;
        ids[j] = best;
        weights[j] = scores[best];
        picked += scores[best];
    }
    const float denom = picked + 1e-20f;
    for (int j = 0; j < k; j++) {
        if (rt->norm) weights[j] /= denom;
        weights[j] *= rt->scale;
    }
}

void fr_moe_route(const float *logits, int E, int k, int norm_topk_prob, float *p, int *ids, float *weights)
{
    const fr_moe_routing rt = {.E = E, .k = k, .scoring = FR_MOE_SOFTMAX, .method = FR_MOE_GREEDY, .n_group = 1,
                               .topk_group = 1, .norm = norm_topk_prob, .scale = 1.0f, .bias = NULL};
    /* greedy without a bias chooses by the scores themselves */
    fr_moe_route_row(&rt, logits, p, p, ids, weights);
}

const int *fr_moe_cpu_ids(const fr_moe_cpu *s) { return s->ids; }

static void matmul(float *y, const float *x, const float *w, int M, int N, int K, int deterministic)
{
    if (deterministic) fr_matmul_fixed(y, x, w, M, N, K);
    else fr_matmul(y, x, w, M, N, K);
}

/* down[n][H] = down_w . silu(gate_w . xs) * (up_w . xs) for n rows of xs
 * through an MLP of I rows. */
static void swiglu_mlp(fr_moe_cpu *s, const float *xs, const float *gate_w, const float *up_w, const float *down_w,
                       int n, int H, int I, float *down, int deterministic)
{
    matmul(s->gate, xs, gate_w, n, I, H, deterministic);
    matmul(s->up, xs, up_w, n, I, H, deterministic);
    fr_swiglu(s->gate, s->gate, s->up, n * I);
    matmul(down, s->gate, down_w, n, H, I, deterministic);
}

/* Expert e on the rows routed to it, added into y with their weights. */
static void run_expert(fr_moe_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, int e, int n,
                       float *y, int deterministic)
{
    const int H = c->hidden_size, Im = c->moe_intermediate_size;
    const size_t per = (size_t)Im * (size_t)H;
    swiglu_mlp(s, s->xs, lw->expert_gate + (size_t)e * per, lw->expert_up + (size_t)e * per,
               lw->expert_down + (size_t)e * per, n, H, Im, s->down, deterministic);
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
    const fr_moe_routing rt = fr_moe_routing_of(c, lw->router_bias);
    matmul(s->logits, x, lw->router, M, E, H, deterministic);
    for (int t = 0; t < M; t++)
        fr_moe_route_row(&rt, s->logits + (size_t)t * E, s->scores + (size_t)t * E, s->choice,
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
    /* The shared experts run on every row and are added last (transformers:
     * routed output + shared_experts(x)). */
    const int Is = fr_model_shared_inter(c);
    if (!Is || !lw->shared_gate) return;
    swiglu_mlp(s, x, lw->shared_gate, lw->shared_up, lw->shared_down, M, H, Is, s->down, deterministic);
    for (size_t i = 0; i < (size_t)M * H; i++) y[i] += s->down[i];
}
