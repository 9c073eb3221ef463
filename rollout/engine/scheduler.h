/* The continuous-batching scheduler of one engine (docs/scheduler.md).
 *
 * It owns every KV sequence of the session it runs on. Each fr_scheduler_step
 * builds one fr_session_step batch: one decode token for every running
 * sample first, then prefill chunks of admitted prompts up to the token
 * budget (the chunk). A prompt is prefilled once and forked into its n
 * samples when its prefill completes; the first token of every sample comes
 * from the prefill's last logits. Tokens are drawn on the host with
 * fr_sample and the keys (seed, sample index, token index).
 *
 * Admission is by free KV blocks and sequence slots. When a decode step runs
 * out of blocks, the most recently admitted work is preempted by recompute:
 * its sequence is freed and it waits again with its tokens kept, to be
 * prefilled again (prompt + generated tokens) and continue with the same
 * keys. Every submitted sample ends exactly once: through the callback, or
 * queued for fr_scheduler_next_result when there is none. */
#ifndef FR_SCHEDULER_H
#define FR_SCHEDULER_H

#include "comm/rank_wire.h"
#include "rollout/engine/request.h"
#include "rollout/engine/session.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called once per sample when it ends. r and its arrays are valid during
 * the call only. The callback must not call back into the scheduler. */
typedef void (*fr_sample_done_fn)(void *user, const fr_sample_result *r);

/* Called once for every token a sample draws, right after the draw and
 * before the sample's end is reported when that token ends it: the request
 * id, the sample index, the token's index within the sample (0, 1, ... in
 * order), the token and its log-prob (as in fr_sample_result). Tokens kept
 * across a preemption are not reported again, so a sample's reports are
 * exactly the tokens of its result. Must not call back into the scheduler. */
typedef void (*fr_sample_token_fn)(void *user, uint64_t request_id, int sample, int index, int token,
                                   float logprob);

/* Called, for samples whose request asks for text (with_text), right after
 * the token report (above) of a token that made more of the sample's text
 * final (fr_sample_text_get's stable part): text[0, len) is
 * that new part, never a piece of a character nor anything a stop string
 * may still take. The pieces joined are a prefix of the result's text
 * (what was held back at the end comes only in the result). Must not call
 * back into the scheduler. */
typedef void (*fr_sample_text_fn)(void *user, uint64_t request_id, int sample, int index, const char *text,
                                  size_t len);

typedef struct {
    int max_seqs;          /* sequences at once; 0: the cache's slot count */
    int chunk;             /* tokens per step (decode + prefill); 0: 512. At
                              most the chunk the session was opened with. */
    int reserve_blocks;    /* blocks admission leaves free for growth; -1: auto
                              (one per 16 slots, at least 1) */
    fr_sample_done_fn on_done;   /* NULL: results queue for fr_scheduler_next_result */
    void *user;
    fr_sample_token_fn on_token; /* NULL: no per-token reports; called with user */
    /* Divergence monitoring (rollout/engine/divergence.h): the share of samples
     * (0..1) that also run a BF16-KV shadow, for requests that leave it to
     * the scheduler (monitor -1); the choice is a pure function of (request
     * id, sample index), so every rank of an engine makes the same one.
     * shadow_blocks: the shadow cache's blocks (0: what the session's memory
     * sizing left for it, fr_session's shadow_blocks, else as many as the cache). */
    double kl_sample_rate;
    int shadow_blocks;
    /* Text (rollout/engine/stop_strings.h): the tokenizer that decodes the
     * samples of requests with stop strings or asking for text (NULL:
     * such requests are refused; it must outlive the scheduler), and the
     * reports of their text as it becomes final (NULL: none). */
    const fr_tokenizer *tokenizer;
    fr_sample_text_fn on_text;
} fr_scheduler_config;

typedef struct {
    int running;           /* samples decoding (holding a sequence) */
    int prefilling;        /* admitted prompts still prefilling */
    int waiting;           /* samples not yet admitted, or preempted */
    long long preemptions; /* samples (or prefills) dropped and recomputed */
    long long tokens_generated;
    long long prefill_tokens;  /* recompute included */
    long long steps;
    long long finished;    /* samples ended, any reason */
    int kv_blocks_used, kv_blocks_free;
    /* Samples in flight: running, in an admitted prefill, or preempted
     * after their admission (waiting to be recomputed): what
     * FR_SCHED_HOLD lets finish. */
    int in_flight;
    uint64_t weight_version;   /* what new tokens are drawn with */
    int monitored;             /* running samples with a shadow */
    int shadow_blocks_free;    /* -1: no shadow open */
    /* Where the steps' wall time went (seconds since the scheduler began):
     * the forward steps (decode-only ones: decode_steps of them), the
     * shadow's steps, and the host's own work on logits (sampling, teacher
     * forcing, the KL of monitored rows; kl_s of it the KL measured there:
     * on the host, or on CUDA a prompt's first tokens sent to the device).
     * On CUDA a decode-only step measures on the device, inside its shadow
     * step: that time is in shadow_s. shadow_open_s: opening the
     * shadow (once, at the first monitored submit: outside any step);
     * shadow_start_s (part of host_s): the monitored prompts' shadow
     * prefills and forks when their prompts complete. */
    long long decode_steps;
    double forward_s, shadow_s, host_s, kl_s, shadow_open_s, shadow_start_s;
    /* Decode steps that carried the shadow's rows; decode graphs captured
     * by the serving and the shadow session, and the seconds their first
     * uses took (inside forward_s and shadow_s). */
    long long carried_steps;
    int graph_captures;
    double graph_capture_s;
} fr_scheduler_stats;

/* Several engines' stats as one: counts and block figures summed (the
 * weight version and the timings are left as in *a), for the engines of a
 * job under mpirun. */
void fr_scheduler_stats_add(fr_scheduler_stats *a, const fr_scheduler_stats *s);
/* The stats as a record between ranks (comm/rank_wire.h): the counts, block
 * figures and weight version, not the timings. _read leaves the timings 0;
 * a truncated record sets the reader's `bad`. */
void fr_scheduler_stats_put(fr_rank_buf *b, const fr_scheduler_stats *s);
void fr_scheduler_stats_read(fr_rank_reader *r, fr_scheduler_stats *s);

typedef struct fr_scheduler fr_scheduler;

/* The session must stay open while the scheduler lives, and no one else may
 * create sequences in its cache. */
fr_status fr_scheduler_new(fr_session *s, const fr_scheduler_config *cfg, fr_scheduler **out);
/* Ends what is still in flight with reason abort (callback or queue), then
 * frees everything, queued results included. NULL-safe. */
void fr_scheduler_destroy(fr_scheduler **sch);

/* Accepts a request (copied) or fails with FR_EINVAL and accepts nothing:
 * invalid fields, n above the slot count, one sample that could never fit
 * the cache (prompt + max_tokens), or stop strings or text without a
 * tokenizer. Request ids should be unique; abort ends
 * every request with the id. */
fr_status fr_scheduler_submit(fr_scheduler *sch, const fr_request_spec *r);

/* One engine step. Does nothing when idle. On a failed forward step, the
 * samples in it end with reason error and the step's status is returned;
 * the scheduler stays usable. */
fr_status fr_scheduler_step(fr_scheduler *sch);
/* Steps while there is work the mode lets run (FR_SCHED_RUN: until every
 * sample has ended); the first failing step's status. */
fr_status fr_scheduler_run(fr_scheduler *sch);
/* No request open (held or frozen ones count as open). */
int fr_scheduler_idle(const fr_scheduler *sch);

/* What the engine does while a trainer pauses it (docs/protocol.md,
 * "pause"):
 * - FR_SCHED_RUN: every step as usual;
 * - FR_SCHED_HOLD: the samples in flight (stats.in_flight) go on to their
 *   end; nothing that has not started is admitted (queued samples and new
 *   requests wait);
 * - FR_SCHED_FREEZE: no step at all: running samples keep their KV cache
 *   and tokens, queued ones stay queued. Weights may be switched meanwhile
 *   (fr_scheduler_set_weight_version): back in FR_SCHED_RUN, the samples
 *   go on where they stopped, their new tokens drawn with the new weights,
 *   over the KV cache of the old ones unless fr_scheduler_recompute_all
 *   recomputes it.
 * Submits and aborts work in every mode. */
typedef enum { FR_SCHED_RUN = 0, FR_SCHED_HOLD, FR_SCHED_FREEZE } fr_scheduler_mode;
void fr_scheduler_set_mode(fr_scheduler *sch, fr_scheduler_mode mode);
fr_scheduler_mode fr_scheduler_mode_of(const fr_scheduler *sch);
/* Whether a step would do anything: work the mode lets run. */
int fr_scheduler_busy(const fr_scheduler *sch);
/* stats.in_flight, without the rest of the stats. */
int fr_scheduler_in_flight(const fr_scheduler *sch);

/* Ends every unfinished sample of request `id` (or of every request) with
 * reason abort and its partial tokens; *n_ended (may be NULL) gets the count. */
fr_status fr_scheduler_abort(fr_scheduler *sch, uint64_t id, int *n_ended);
fr_status fr_scheduler_abort_all(fr_scheduler *sch, int *n_ended);

/* Preempts every running sample and prefill by recompute (their tokens so
 * far are prefilled again when they are readmitted; nothing is lost or
 * drawn again) and frees their KV sequences: what a change of the cache's
 * key mean needs (rollout/monitor/recalibrate.h). *n_preempted (may be NULL) counts
 * them. */
fr_status fr_scheduler_recompute_all(fr_scheduler *sch, int *n_preempted);

/* The weight version of every token drawn from now on (the caller switches
 * the session's weights between steps, rollout/engine/weight_update.h). */
void fr_scheduler_set_weight_version(fr_scheduler *sch, uint64_t version);
/* Divergence aggregates of the monitored samples (by weight version and
 * position bucket); valid until the next scheduler call. */
const fr_div_aggregates *fr_scheduler_divergence(const fr_scheduler *sch);
/* Latencies, prompt tokens and ends by reason (rollout/engine/histogram.h);
 * valid until the next scheduler call. */
const fr_serving_stats *fr_scheduler_serving(const fr_scheduler *sch);

/* Takes the oldest queued result (no callback configured): 1 and *out filled
 * (free with fr_sample_result_free), or 0 when none is queued. */
int fr_scheduler_next_result(fr_scheduler *sch, fr_sample_result *out);

void fr_scheduler_stats_get(const fr_scheduler *sch, fr_scheduler_stats *out);

#ifdef __cplusplus
}
#endif

#endif
