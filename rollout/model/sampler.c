#include "rollout/model/sampler.h"

#include <math.h>
#include <stdlib.h>

#include "base/fixed_math.h"
#include "rollout/model/philox.h"

struct fr_sampler {
    int vocab;
    int *order;    /* candidate token ids, best first once selected */
    double *w;     /* unnormalized probability of order[i] */
    float *barred; /* the logits with the banned tokens at -inf and the penalties applied (fr_sample_ex) */
    int *count;    /* per token: times generated (penalties); all 0 between calls */
};

fr_status fr_sampling_params_check(const fr_sampling_params *p, int vocab)
{
    if (!p)
        return fr_fail(FR_EINVAL, "sampling params are NULL");
    if (vocab <= 0)
        return fr_fail(FR_EINVAL, "vocab %d must be positive", vocab);
    if (isnan(p->temperature) || p->temperature < 0.0f || isinf(p->temperature))
        return fr_fail(FR_EINVAL, "temperature %g must be finite and >= 0 (0 means greedy)",
                       (double)p->temperature);
    if (p->top_k < 0)
        return fr_fail(FR_EINVAL, "top_k %d must be >= 0 (0 means off)", p->top_k);
    if (isnan(p->top_p) || !(p->top_p > 0.0f && p->top_p <= 1.0f))
        return fr_fail(FR_EINVAL, "top_p %g must be in (0, 1] (1 means off)", (double)p->top_p);
    return FR_OK;
}

fr_status fr_sampler_new(int vocab, fr_sampler **out)
{
    if (!out)
        return fr_fail(FR_EINVAL, "fr_sampler_new: out is NULL");
    if (vocab <= 0)
        return fr_fail(FR_EINVAL, "fr_sampler_new: vocab %d must be positive", vocab);
    fr_sampler *s = calloc(1, sizeof *s);
    if (s) {
        s->vocab = vocab;
        s->order = malloc((size_t)vocab * sizeof *s->order);
        s->w = malloc((size_t)vocab * sizeof *s->w);
        s->barred = malloc((size_t)vocab * sizeof *s->barred);
        s->count = calloc((size_t)vocab, sizeof *s->count);
    }
    if (!s || !s->order || !s->w || !s->barred || !s->count) {
        fr_sampler_destroy(&s);
        return fr_fail(FR_ENOMEM, "fr_sampler_new: no memory for vocab %d", vocab);
    }
    *out = s;
    return FR_OK;
}

void fr_sampler_destroy(fr_sampler **s)
{
    if (!s || !*s)
        return;
    free((*s)->order);
    free((*s)->w);
    free((*s)->barred);
    free((*s)->count);
    free(*s);
    *s = NULL;
}

/* The full-vocabulary softmax, reduced to what every later step needs. */
typedef struct {
    int argmax;      /* lowest id among the largest logits */
    int n_posinf;    /* +inf logits; when > 0 they hold all the probability */
    double t;        /* temperature actually applied (1 for greedy) */
    double zmax;     /* largest logits[i] / t (when n_posinf == 0) */
    double log_sum;  /* log sum_i exp(z_i - zmax), or log(n_posinf) */
} softmax_stats;

/* Dividing in double keeps logit/t finite for every finite float logit and
 * positive float temperature, so tiny temperatures cannot overflow. */
static double scaled(float x, double t) { return (double)x / t; }

static fr_status softmax_scan(const float *logits, int vocab, float temperature,
                              softmax_stats *st)
{
    st->argmax = -1;
    st->n_posinf = 0;
    st->t = temperature > 0.0f ? (double)temperature : 1.0;
    for (int i = 0; i < vocab; i++) {
        float x = logits[i];
        if (isnan(x))
            return fr_fail(FR_EINVAL, "logit %d of %d is NaN", i, vocab);
        if (x == INFINITY)
            st->n_posinf++;
        if (x != -INFINITY && (st->argmax < 0 || x > logits[st->argmax]))
            st->argmax = i;
    }
    if (st->argmax < 0)
        return fr_fail(FR_EINVAL, "all %d logits are -inf: no token can be chosen", vocab);
    if (st->n_posinf > 0) {
        st->zmax = INFINITY;
        st->log_sum = fr_log((double)st->n_posinf);
        return FR_OK;
    }
    /* Summed in id order in double: a fixed order, and even over 152k terms
     * the rounding stays far below float resolution in the logprob. */
    st->zmax = scaled(logits[st->argmax], st->t);
    double sum = 0.0;
    for (int i = 0; i < vocab; i++)
        sum += fr_exp(scaled(logits[i], st->t) - st->zmax);   /* -inf gives 0 */
    st->log_sum = fr_log(sum);
    return FR_OK;
}

static float logprob_at(const softmax_stats *st, float x)
{
    if (st->n_posinf > 0)
        return x == INFINITY ? (float)-st->log_sum : -INFINITY;
    return (float)((scaled(x, st->t) - st->zmax) - st->log_sum);
}

static double weight_at(const softmax_stats *st, float x)
{
    if (st->n_posinf > 0)
        return x == INFINITY ? 1.0 : 0.0;
    return fr_exp(scaled(x, st->t) - st->zmax);
}

/* The sampling order: larger logit first, ties to the lower id. Comparing raw
 * logits is the same as comparing logits/t because t > 0. */
static int worse(const float *logits, int a, int b)
{
    return logits[a] < logits[b] || (logits[a] == logits[b] && a > b);
}

/* Max-heap on "worse": the root is the worst of the heap. */
static void sift_down(int *h, int n, int i, const float *logits)
{
    for (;;) {
        int top = i, l = 2 * i + 1, r = l + 1;
        if (l < n && worse(logits, h[l], h[top])) top = l;
        if (r < n && worse(logits, h[r], h[top])) top = r;
        if (top == i)
            return;
        int tmp = h[i]; h[i] = h[top]; h[top] = tmp;
        i = top;
    }
}

/* Moves the best k of ids[0..n) to ids[0..k), sorted best first, in
 * O(n log k): a heap of the k best so far keeps its worst at the root, so each
 * newcomer is compared only with the token it would evict. With k == n this is
 * a plain heapsort. */
static void select_best(int *ids, int n, int k, const float *logits)
{
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(ids, k, i, logits);
    for (int j = k; j < n; j++) {
        if (worse(logits, ids[0], ids[j])) {
            ids[0] = ids[j];
            sift_down(ids, k, 0, logits);
        }
    }
    for (int end = k - 1; end > 0; end--) {
        int tmp = ids[0]; ids[0] = ids[end]; ids[end] = tmp;
        sift_down(ids, end, 0, logits);
    }
}

static int draw(fr_sampler *s, const float *logits, const fr_sampling_params *p,
                const softmax_stats *st, uint64_t sequence, uint64_t step, float min_p)
{
    /* Candidates are the tokens with nonzero probability in the limit: -inf
     * never, and only the +inf ones when there are any. */
    int n = 0;
    for (int i = 0; i < s->vocab; i++) {
        float x = logits[i];
        if (st->n_posinf > 0 ? x == INFINITY : x != -INFINITY)
            s->order[n++] = i;
    }
    int k = (p->top_k > 0 && p->top_k < n) ? p->top_k : n;
    select_best(s->order, n, k, logits);

    /* Every sum below runs over the kept tokens in sampling order, so the
     * running sum at the last kept token equals the total exactly and the
     * walk can always stop (order[0] has weight 1, so totals are >= 1). */
    double total_k = 0.0;
    for (int i = 0; i < k; i++) {
        s->w[i] = weight_at(st, logits[s->order[i]]);
        total_k += s->w[i];
    }
    double nucleus_mass = (double)p->top_p * total_k;
    double total = 0.0;
    int kept = 0;
    while (kept < k) {
        total += s->w[kept++];
        if (total >= nucleus_mass)
            break;
    }
    /* min_p: the weights are relative to the best token's (1), so the cut
     * is a prefix of the sampling order too, and the best always stays. */
    if (min_p > 0.0f) {
        int cut = 1;
        while (cut < kept && s->w[cut] >= (double)min_p) cut++;
        if (cut < kept) {
            kept = cut;
            total = 0.0;
            for (int i = 0; i < kept; i++) total += s->w[i];
        }
    }

    double target = (double)fr_philox_uniform(p->seed, sequence, step) * total;
    double cum = 0.0;
    for (int i = 0; i < kept; i++) {
        cum += s->w[i];
        if (cum > target)
            return s->order[i];
    }
    /* u <= 1 - 2^-24 keeps target below total, which cum reaches exactly at
     * kept - 1; the guard only makes that argument unnecessary to trust. */
    return s->order[kept - 1];
}

fr_status fr_sample(fr_sampler *s, const float *logits, const fr_sampling_params *p,
                    uint64_t sequence, uint64_t step, int *token, float *logprob)
{
    if (!s || !logits || !token)
        return fr_fail(FR_EINVAL, "fr_sample: sampler, logits and token must not be NULL");
    fr_status st = fr_sampling_params_check(p, s->vocab);
    if (st != FR_OK)
        return st;
    softmax_stats sm;
    st = softmax_scan(logits, s->vocab, p->temperature, &sm);
    if (st != FR_OK)
        return st;
    int tok = p->temperature == 0.0f ? sm.argmax : draw(s, logits, p, &sm, sequence, step, 0.0f);
    *token = tok;
    if (logprob)
        *logprob = logprob_at(&sm, logits[tok]);
    return FR_OK;
}

/* The top_n best tokens (sampling order over the whole vocabulary) and
 * their log-probs under sm. */
static void top_of(fr_sampler *s, const float *logits, const softmax_stats *sm, int top_n, int *ids, float *lps)
{
    for (int i = 0; i < s->vocab; i++) s->order[i] = i;
    select_best(s->order, s->vocab, top_n, logits);
    for (int i = 0; i < top_n; i++) {
        ids[i] = s->order[i];
        lps[i] = logprob_at(sm, logits[ids[i]]);
    }
}

int fr_penalties_active(const fr_penalties *p)
{
    return p && (p->min_p > 0.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f ||
                 (p->repetition_penalty != 0.0f && p->repetition_penalty != 1.0f));
}

fr_status fr_penalties_check(const fr_penalties *p)
{
    if (!p) return fr_fail(FR_EINVAL, "penalties are NULL");
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) return fr_fail(FR_EINVAL, "min_p %g must be in [0, 1]", (double)p->min_p);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return fr_fail(FR_EINVAL, "presence_penalty %g must be in [-2, 2]", (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return fr_fail(FR_EINVAL, "frequency_penalty %g must be in [-2, 2]", (double)p->frequency_penalty);
    if (!(p->repetition_penalty >= 0.0f && p->repetition_penalty <= 2.0f))
        return fr_fail(FR_EINVAL, "repetition_penalty %g must be in (0, 2] (1 means off)", (double)p->repetition_penalty);
    return FR_OK;
}

static fr_status check_history(const fr_sampler *s, const int *ids, int n, const char *what)
{
    if (n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "fr_sample_ex: bad list of %s tokens", what);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->vocab)
            return fr_fail(FR_EINVAL, "fr_sample_ex: %s token %d is outside the vocabulary of %d", what, ids[i],
                           s->vocab);
    return FR_OK;
}

/* The penalized logits into s->barred: the repetition penalty once per
 * token of the prompt or the output, then presence and frequency by the
 * output's counts (vLLM's and SGLang's order). s->count is left all 0. */
static void penalize(fr_sampler *s, const fr_sample_extras *x)
{
    const fr_penalties *p = &x->pen;
    const float rp = p->repetition_penalty;
    if (rp != 0.0f && rp != 1.0f) {
        /* count marks the tokens already penalized: 1 each, cleared below */
        for (int pass = 0; pass < 2; pass++) {
            const int *ids = pass ? x->output : x->prompt;
            const int n = pass ? x->n_output : x->n_prompt;
            for (int i = 0; i < n; i++) {
                int t = ids[i];
                if (s->count[t]) continue;
                s->count[t] = 1;
                s->barred[t] = s->barred[t] > 0.0f ? s->barred[t] / rp : s->barred[t] * rp;
            }
        }
        for (int i = 0; i < x->n_prompt; i++) s->count[x->prompt[i]] = 0;
        for (int i = 0; i < x->n_output; i++) s->count[x->output[i]] = 0;
    }
    if (p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f) return;
    for (int i = 0; i < x->n_output; i++) s->count[x->output[i]]++;
    for (int i = 0; i < x->n_output; i++) {
        int t = x->output[i];
        if (!s->count[t]) continue;   /* done at its first occurrence */
        s->barred[t] -= p->frequency_penalty * (float)s->count[t] + p->presence_penalty;
        s->count[t] = 0;
    }
}

static fr_status check_top(const fr_sampler *s, int top_n, int lo)
{
    if (top_n < lo || top_n > FR_MAX_TOP_LOGPROBS || top_n > s->vocab)
        return fr_fail(FR_EINVAL, "top log-probs: %d must be in [%d, %d] and at most the vocabulary of %d", top_n,
                       lo, FR_MAX_TOP_LOGPROBS, s->vocab);
    return FR_OK;
}

fr_status fr_sample_ex(fr_sampler *s, const float *logits, const fr_sampling_params *p, uint64_t sequence,
                       uint64_t step, const fr_sample_extras *x, int *token, float *logprob)
{
    if (!x) return fr_sample(s, logits, p, sequence, step, token, logprob);
    if (!s || !logits || !token)
        return fr_fail(FR_EINVAL, "fr_sample: sampler, logits and token must not be NULL");
    fr_status st = check_top(s, x->top_n, 0);
    if (st) return st;
    if (x->top_n > 0 && (!x->top_ids || !x->top_logprobs))
        return fr_fail(FR_EINVAL, "fr_sample_ex: top_ids and top_logprobs must not be NULL");
    if (x->n_banned < 0 || (x->n_banned > 0 && !x->banned))
        return fr_fail(FR_EINVAL, "fr_sample_ex: bad list of barred tokens");
    for (int i = 0; i < x->n_banned; i++)
        if (x->banned[i] < 0 || x->banned[i] >= s->vocab)
            return fr_fail(FR_EINVAL, "fr_sample_ex: barred token %d is outside the vocabulary of %d", x->banned[i],
                           s->vocab);
    if ((st = fr_sampling_params_check(p, s->vocab)) || (st = fr_penalties_check(&x->pen))) return st;
    const int pen = fr_penalties_active(&x->pen);
    if (pen && ((st = check_history(s, x->prompt, x->n_prompt, "prompt")) ||
                (st = check_history(s, x->output, x->n_output, "output"))))
        return st;
    softmax_stats full;
    if ((st = softmax_scan(logits, s->vocab, p->temperature, &full))) return st;
    int tok;
    const int changed = x->n_banned > 0 || x->pen.presence_penalty != 0.0f || x->pen.frequency_penalty != 0.0f ||
                        (x->pen.repetition_penalty != 0.0f && x->pen.repetition_penalty != 1.0f);
    if (!changed) {
        tok = p->temperature == 0.0f ? full.argmax : draw(s, logits, p, &full, sequence, step, x->pen.min_p);
    } else {
        /* The draw sees the penalized logits with the barred tokens at
         * -inf: the rules of fr_sample on the rest, renormalized; the
         * log-probs stay the full, unpenalized distribution's. */
        for (int i = 0; i < s->vocab; i++) s->barred[i] = logits[i];
        if (pen) penalize(s, x);
        for (int i = 0; i < x->n_banned; i++) s->barred[x->banned[i]] = -INFINITY;
        softmax_stats kept;
        if (softmax_scan(s->barred, s->vocab, p->temperature, &kept))
            return fr_fail(FR_EINVAL, "every token is barred (%d barred of %d, the rest -inf)", x->n_banned,
                           s->vocab);
        tok = p->temperature == 0.0f ? kept.argmax : draw(s, s->barred, p, &kept, sequence, step, x->pen.min_p);
    }
    if (x->top_n > 0) top_of(s, logits, &full, x->top_n, x->top_ids, x->top_logprobs);
    *token = tok;
    if (logprob) *logprob = logprob_at(&full, logits[tok]);
    return FR_OK;
}

fr_status fr_top_logprobs(fr_sampler *s, const float *logits, float temperature, int top_n, int *ids,
                          float *logprobs)
{
    if (!s || !logits || !ids || !logprobs) return fr_fail(FR_EINVAL, "fr_top_logprobs: NULL argument");
    fr_status st = check_top(s, top_n, 1);
    if (st) return st;
    if (isnan(temperature) || temperature < 0.0f || isinf(temperature))
        return fr_fail(FR_EINVAL, "fr_top_logprobs: temperature %g must be finite and >= 0", (double)temperature);
    softmax_stats sm;
    if ((st = softmax_scan(logits, s->vocab, temperature, &sm))) return st;
    top_of(s, logits, &sm, top_n, ids, logprobs);
    return FR_OK;
}

fr_status fr_log_softmax(const float *logits, int vocab, float temperature, float *out)
{
    if (!logits || !out)
        return fr_fail(FR_EINVAL, "fr_log_softmax: logits and out must not be NULL");
    if (vocab <= 0)
        return fr_fail(FR_EINVAL, "fr_log_softmax: vocab %d must be positive", vocab);
    if (isnan(temperature) || temperature < 0.0f || isinf(temperature))
        return fr_fail(FR_EINVAL, "fr_log_softmax: temperature %g must be finite and >= 0",
                       (double)temperature);
    softmax_stats sm;
    fr_status st = softmax_scan(logits, vocab, temperature, &sm);
    if (st != FR_OK)
        return st;
    for (int i = 0; i < vocab; i++)
        out[i] = logprob_at(&sm, logits[i]);
    return FR_OK;
}
