/* Token sampler: temperature, top-k, top-p (nucleus) over one logit vector,
 * driven by the counter-based Philox RNG so a (seed, sequence, step) triple
 * always picks the same token. docs/sampling.md states the rules in full;
 * the CUDA sampler reproduces the random draws of this CPU reference exactly.
 */
#ifndef FR_SAMPLER_H
#define FR_SAMPLER_H

#include <stdint.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature;   /* 0 means greedy; otherwise finite and > 0 */
    int top_k;           /* 0 or >= vocab means off */
    float top_p;         /* 1.0 means off; must be in (0, 1] */
    uint64_t seed;
} fr_sampling_params;

/* FR_EINVAL with a message for: p NULL, vocab <= 0, temperature negative,
 * NaN or infinite, top_k < 0, top_p NaN or outside (0, 1]. */
fr_status fr_sampling_params_check(const fr_sampling_params *p, int vocab);

/* Owns scratch (an index and a weight per token) sized for one vocabulary, so
 * fr_sample allocates nothing. One sampler per thread: fr_sample writes it. */
typedef struct fr_sampler fr_sampler;

fr_status fr_sampler_new(int vocab, fr_sampler **out);
void fr_sampler_destroy(fr_sampler **s);   /* frees *s, sets it to NULL; NULL-safe */

/* Picks one token from logits[vocab] (vocab as given to fr_sampler_new).
 *
 * Greedy (temperature 0): argmax, ties to the lowest id; no random draw.
 * Otherwise: z = logits / temperature; order tokens by z descending, ties by
 * lower id; keep the first top_k; keep the shortest prefix of those whose
 * cumulative probability (renormalized over the top-k) reaches top_p; draw
 * u = fr_philox_uniform(seed, sequence, step) and return the first kept token
 * at which the cumulative renormalized probability exceeds u.
 *
 * sequence identifies the sample's stream (e.g. a request-derived sample id),
 * step the token position being generated.
 *
 * *logprob (may be NULL) is the log-softmax of logits/temperature over the
 * FULL vocabulary at the chosen token (temperature 1 when greedy), ignoring
 * top-k/top-p: what a trainer recomputes.
 *
 * Non-finite logits: NaN is FR_EINVAL; -inf tokens are never chosen; if any
 * logit is +inf, the +inf tokens share all the probability equally (the limit
 * of softmax as they grow together). All -inf is FR_EINVAL.
 * On failure *token and *logprob are left unchanged. */
fr_status fr_sample(fr_sampler *s, const float *logits, const fr_sampling_params *p,
                    uint64_t sequence, uint64_t step, int *token, float *logprob);

/* The most top log-probs a step reports (docs/sampling.md, "Top log-probs"). */
#define FR_MAX_TOP_LOGPROBS 20

/* Penalties and min_p (docs/sampling.md, "Penalties and min_p"), SGLang's
 * and vLLM's options of the same names. Zeroed: all off (a repetition
 * penalty of 0 or 1 is off). They change which token is drawn, never a
 * reported log-prob: those stay the full-vocabulary log-softmax of the
 * unpenalized logits / temperature, the quantity a trainer recomputes. */
typedef struct {
    float min_p;              /* [0, 1]: after top-k and top-p, keep the tokens at least min_p times as likely as the best */
    float presence_penalty;   /* [-2, 2]: subtracted from the logit of every token generated so far */
    float frequency_penalty;  /* [-2, 2]: subtracted once per time a token was generated so far */
    float repetition_penalty; /* 0 or (0, 2]: the logit of a token of the prompt or generated so far is divided by
                                 it when positive, multiplied when not */
} fr_penalties;

/* 1 when any of p changes a draw. */
int fr_penalties_active(const fr_penalties *p);
/* FR_EINVAL naming the field when one is out of its range (NaN included). */
fr_status fr_penalties_check(const fr_penalties *p);

/* What a draw can do beyond fr_sample (all optional; zeroed: nothing).
 * banned: token ids the draw never picks, as if their logits were -inf
 * (min_tokens bars the stop ids this way); the log-probs are still those of
 * the unbarred distribution, the quantity a trainer recomputes. top_n (0 to
 * FR_MAX_TOP_LOGPROBS, at most vocab): top_ids and top_logprobs receive the
 * top_n tokens with the largest logits (ties to the lower id), best first,
 * and their log-probs, the same full-vocabulary log-softmax as *logprob. */
typedef struct {
    const int *banned;
    int n_banned;
    int top_n;
    int *top_ids;          /* [top_n] */
    float *top_logprobs;   /* [top_n] */
    /* Penalties (above): they read the prompt (the repetition penalty) and
     * the tokens generated so far. */
    fr_penalties pen;
    const int *prompt, *output;
    int n_prompt, n_output;
} fr_sample_extras;

/* fr_sample with extras (NULL: fr_sample). Barring every token that could
 * be drawn is FR_EINVAL ("every token is barred"). */
fr_status fr_sample_ex(fr_sampler *s, const float *logits, const fr_sampling_params *p, uint64_t sequence,
                       uint64_t step, const fr_sample_extras *x, int *token, float *logprob);

/* The top_n (1 to FR_MAX_TOP_LOGPROBS, at most vocab) most likely tokens of
 * logits/temperature (temperature 0 means 1) and their log-probs, as
 * fr_sample_extras fills them; for teacher-forced rows, which draw nothing. */
fr_status fr_top_logprobs(fr_sampler *s, const float *logits, float temperature, int top_n, int *ids,
                          float *logprobs);

/* Full-vocabulary log-softmax of logits/temperature into out[vocab], with the
 * same numerics and non-finite rules as fr_sample's logprob (+inf tokens get
 * -log(count of +inf), the rest -inf). temperature 0 means 1, as for a greedy
 * fr_sample, so logprobs and KL checks agree on greedy requests. */
fr_status fr_log_softmax(const float *logits, int vocab, float temperature, float *out);

#ifdef __cplusplus
}
#endif

#endif
