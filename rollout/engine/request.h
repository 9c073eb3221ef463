/* A rollout request and the result of one of its samples.
 *
 * A request is a prompt (token ids), n samples that share the prompt's KV
 * pages, sampling parameters, a token limit, stop ids, and ids the caller
 * chooses (id, group). Sample i of a request (i = first_sample .. first_sample
 * + n - 1) draws its t-th token with the Philox keys (seed, sequence = i,
 * step = t) of rollout/model/sampler.h, so a sample's tokens do not depend on
 * what else runs beside it, and sample i of a request replays alone as a
 * request with the same seed, first_sample i and n 1. */
#ifndef FR_REQUEST_H
#define FR_REQUEST_H

#include <stdint.h>

#include "comm/rank_wire.h"
#include "rollout/engine/divergence_summary.h"
#include "rollout/model/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FR_FINISH_NONE = 0,   /* still running */
    FR_FINISH_STOP,       /* drew one of the stop ids (kept as the last token) */
    FR_FINISH_LENGTH,     /* reached max_tokens (or the context window) */
    FR_FINISH_ABORT,      /* aborted by the caller; partial tokens kept */
    FR_FINISH_ERROR       /* the engine failed on it; partial tokens kept */
} fr_finish_reason;

/* "stop", "length", "abort", "error" ("none" while running). */
const char *fr_finish_reason_name(fr_finish_reason r);

typedef struct {
    uint64_t id;                 /* the caller's id */
    uint64_t group;              /* the caller's group id (e.g. a GRPO group) */
    const int *prompt;           /* [n_prompt] token ids; copied on submit */
    int n_prompt;
    int n;                       /* samples, >= 1 */
    int first_sample;            /* index of the first sample (0 usually); first_sample + n <= INT_MAX */
    fr_sampling_params params;
    int max_tokens;              /* >= 1; lowered to fit the context window */
    const int *stop_ids;         /* [n_stop]; copied; none: never stops early */
    int n_stop;
    /* Divergence monitoring (rollout/engine/divergence.h): 1 runs a BF16-KV shadow of
     * every sample, 0 none, -1 (or anything else) the scheduler's
     * kl_sample_rate decides per sample. per_token_kl: keep D_t of every token
     * in the result, not only the summary. */
    int monitor;
    int per_token_kl;
    /* Teacher forcing, for evaluation: the samples emit these tokens in
     * order instead of sampling (their log-probs are still the model's), then
     * end with reason length; copied; NULL: sample as usual. */
    const int *forced;
    int n_forced;
    /* The id reports name the request by (the worst monitored samples of
     * the metrics) when it differs from id, as a server's own ids do from
     * its trainer's; has_report_id 0: id. */
    uint64_t report_id;
    int has_report_id;
} fr_request_spec;

/* One finished sample. tokens and logprobs hold n_tokens entries each; a
 * log-prob is the full-vocabulary log-softmax of logits / temperature at the
 * chosen token (temperature 1 when greedy). */
typedef struct {
    uint64_t request_id, group;
    int sample;                  /* index within the request, first_sample .. first_sample + n - 1 */
    int *tokens;
    float *logprobs;
    int n_tokens;
    fr_finish_reason finish;
    int preemptions;             /* times its KV was dropped and recomputed */
    uint64_t *versions;          /* [n_tokens] weight version that produced each token */
    /* divergence (when monitored): D_t etc. of every position whose next
     * token the sample drew (the prompt's last position included) */
    int monitored;
    fr_div_summary div;
    float *kl;                   /* [n_tokens] D_t in nats when per_token_kl, else NULL */
} fr_sample_result;

/* Frees the arrays of a result taken from fr_scheduler_next_result and
 * clears it; NULL-safe. */
void fr_sample_result_free(fr_sample_result *r);

/* A finished sample as a record between the ranks of a job, for the engine
 * leaders that hand their results to world rank 0 (`serve` and `rollout`
 * under mpirun): its ids, finish, counts, divergence summary and per-token
 * KL, and with with_tokens its tokens, log-probs and weight versions too
 * (`serve` streams those apart). An allocation failure is the buffer's
 * `failed` flag. */
void fr_sample_result_put(fr_rank_buf *b, const fr_sample_result *r, int with_tokens);
/* Reads one such record into *out (arrays malloc'ed: fr_sample_result_free;
 * NULL where the record had none). FR_EFORMAT when the record is truncated
 * or inconsistent, FR_ENOMEM; *out is then empty. */
fr_status fr_sample_result_get(fr_rank_reader *r, fr_sample_result *out);

/* Checks a request against a model's vocabulary: prompt non-empty and in the
 * vocabulary, n and max_tokens >= 1, first_sample >= 0 with room for n, valid sampling parameters, stop ids in
 * the vocabulary. FR_EINVAL with a message naming the field otherwise. */
fr_status fr_request_spec_check(const fr_request_spec *r, int vocab);

#ifdef __cplusplus
}
#endif

#endif
