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

#include <stddef.h>
#include <stdint.h>

#include "comm/rank_wire.h"
#include "rollout/engine/divergence_summary.h"
#include "rollout/engine/stop_strings.h"
#include "rollout/model/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FR_FINISH_NONE = 0,   /* still running */
    FR_FINISH_STOP,       /* drew one of the stop ids (kept as the last token), or its text
                             completed a stop string (the token that completed it is the last) */
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
    /* Options trainers ask for (docs/sampling.md): min_tokens (0 to
     * max_tokens): the stop ids are barred from the draws until that many
     * tokens were generated; top_logprobs (0 to FR_MAX_TOP_LOGPROBS): every
     * generated token also reports the top_logprobs most likely tokens and
     * their log-probs; prompt_logprobs (0 or 1): the log-prob of every prompt
     * token after the first, reported with the request's first sample. */
    int min_tokens;
    int top_logprobs;
    int prompt_logprobs;
    /* min_p and the presence, frequency and repetition penalties
     * (rollout/model/sampler.h; zeroed: off). Rows with any of them are
     * drawn on the host, from their logits, on either backend. */
    fr_penalties penalties;
    /* Routed-expert replay (0 or 1; docs/deepseek_moe.md, "Routed-expert
     * replay"): 1 records, for every generated token, the experts each MoE
     * layer chose (fr_sample_result.routed_experts); 0, the default, records
     * nothing and costs nothing. A model without MoE layers refuses 1. */
    int return_routed_experts;
    /* Continuing a partial sample (docs/sampling.md, "Continuing a sample"):
     * the n_continue tokens it already made (copied), which the engine puts
     * in the KV cache after the prompt, as a prefill would, but counts as
     * generated: max_tokens and min_tokens include them, and the next draw
     * is step n_continue of the sample's Philox stream, as it would have
     * been had the sample never stopped. Needs n 1 (the sample is
     * first_sample), no forced tokens and no prompt log-probs, and room for
     * one token more within max_tokens. NULL: a sample from its start. */
    const int *continue_tokens;
    int n_continue;
    /* Text (docs/sampling.md, "Stop strings"; decoded with the scheduler's
     * tokenizer, special tokens skipped): a stop string ends a sample, with
     * reason stop, in the step whose token completes it in the sample's text
     * (copied); with_text 1 keeps every sample's text for its result and
     * the scheduler's on_text reports, without stop strings too. A
     * continuation's text is what its tokens add to the whole sample's
     * (the continued tokens decoded first; a stop string across the seam
     * matches). */
    fr_stop_strings stop_strings;
    int with_text;
    /* 1: the text holds the special tokens too (as vLLM's and SGLang's
     * skip_special_tokens false); 0, the default, leaves them out. */
    int keep_special;
} fr_request_spec;

/* One finished sample. tokens and logprobs hold n_tokens entries each; a
 * log-prob is the full-vocabulary log-softmax of logits / temperature at the
 * chosen token (temperature 1 when greedy). */
typedef struct {
    uint64_t request_id, group;
    int sample;                  /* index within the request, first_sample .. first_sample + n - 1 */
    /* The tokens of the request continued (its n_continue): the arrays below
     * hold the tokens it made itself, tokens[i] being token start + i of the
     * whole sample. 0 for a sample from its start. */
    int start;
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
    /* top_n > 0 (the request's top_logprobs): token i's top_n most likely
     * tokens, best first, at top_ids[i * top_n ..] with their log-probs */
    int top_n;
    int *top_ids;                /* [n_tokens * top_n] */
    float *top_logprobs;         /* [n_tokens * top_n] */
    /* prompt_logprobs[i]: the log-prob of prompt token i + 1 given the ones
     * before (logits / temperature, temperature 1 when greedy); in the result
     * of the request's first sample only, when asked; else NULL */
    float *prompt_logprobs;      /* [n_prompt_logprobs = n_prompt - 1] */
    int n_prompt_logprobs;
    /* Routed experts (when the request asked, else NULL and zeros): token
     * i's record is route_layers x route_k expert ids, each route_width
     * bytes (1: uint8, the model has at most 256 experts; 2: uint16 little
     * endian), at routed_experts + i * route_layers * route_k * route_width,
     * MoE layers in layer order, each layer's experts best first. Token i's
     * experts are those the forward pass that drew it chose: at the position
     * of the token before it (the prompt's last for i = 0), the position
     * whose logits give token i its log-prob. */
    uint8_t *routed_experts;     /* [n_tokens * route_layers * route_k * route_width] */
    int route_layers, route_k, route_width;
    /* The sample's text when its request asked for text or gave stop
     * strings (NUL-terminated, text_len bytes), else NULL: the tokens
     * decoded with special tokens skipped, cut where the stop string that
     * ended it starts (after it, with the request's include). */
    char *text;
    size_t text_len;
    int stop_string;             /* k + 1: stop string k of the request ended it; 0: none did */
} fr_sample_result;

/* Bytes of one token's routed-expert record in r (0 when it has none). */
static inline size_t fr_sample_route_bytes(const fr_sample_result *r)
{
    return r->routed_experts ? (size_t)r->route_layers * (size_t)r->route_k * (size_t)r->route_width : 0;
}
/* Expert j of MoE layer m for token i of r (which must have routes). */
static inline int fr_sample_route_id(const fr_sample_result *r, int i, int m, int j)
{
    const size_t at = ((size_t)i * (size_t)r->route_layers + (size_t)m) * (size_t)r->route_k + (size_t)j;
    const uint8_t *p = r->routed_experts + at * (size_t)r->route_width;
    return r->route_width == 1 ? p[0] : p[0] | p[1] << 8;
}

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
 * vocabulary, n and max_tokens >= 1, first_sample >= 0 with room for n,
 * min_tokens in [0, max_tokens], top_logprobs in [0, FR_MAX_TOP_LOGPROBS]
 * and at most the vocabulary, prompt_logprobs and return_routed_experts 0 or 1, valid
 * sampling parameters, stop ids in the vocabulary, stop strings as fr_stop_strings_check
 * wants them, continued tokens as the field says. FR_EINVAL with a message naming the field
 * otherwise. */
fr_status fr_request_spec_check(const fr_request_spec *r, int vocab);

#ifdef __cplusplus
}
#endif

#endif
