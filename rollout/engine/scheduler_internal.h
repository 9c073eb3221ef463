/* What the files of the scheduler share (rollout/engine/scheduler.h): its
 * requests, samples and prefill work, its state, one step's plan, and the
 * functions one concern calls in another. Private to rollout/engine/
 * scheduler*.c; the public interface is scheduler.h. Functions here take
 * the sch_ prefix: they are visible to the whole library. */
#ifndef FR_SCHEDULER_INTERNAL_H
#define FR_SCHEDULER_INTERNAL_H

#include "rollout/engine/scheduler.h"

#include <stddef.h>
#include <stdint.h>

#include "rollout/engine/divergence.h"

enum { T = FR_PAGE_TOKENS };

typedef struct req req;

/* A sample: its tokens so far and, while it decodes, its KV sequence. */
typedef struct {
    req *r;
    int index;             /* 0 .. n-1 within the request */
    uint64_t stream;       /* first_sample + index: the Philox sequence, and the index results report */
    int seq;               /* -1 when it holds no sequence */
    int *tokens;           /* [r->max_tokens] */
    float *logprobs;
    int n;
    int start;             /* tokens a continuation began with (fr_request_spec.n_continue): never reported */
    int done;
    int preemptions;
    uint64_t admit;        /* admission number of the work that gave it its sequence */
    uint64_t *versions;    /* [r->max_tokens] weight version of each token */
    /* divergence monitoring: the shadow sequence (-1: not monitored, or
     * stopped when the shadow ran out of room), figures so far */
    int monitored, shadow_seq;
    fr_div_summary div;
    float *kl;             /* [r->max_tokens] when per_token_kl */
    double t_first;        /* when its first token was drawn (fr_now_s) */
    int *top_ids;          /* [r->max_tokens * r->top_n] when the request asks for top log-probs */
    float *top_lps;
    uint8_t *routes;       /* [r->max_tokens] records of the routed experts when the request asks for them */
    /* its text (scheduler_text.c) when the request gives stop strings or asks for text, else NULL */
    fr_sample_text *text;
    size_t text_sent;      /* bytes of it reported to on_text */
    size_t text_from;      /* a continuation: the bytes its continued tokens decoded to, not this request's */
    int stop_string;       /* k + 1 once stop string k ended it */
} sample;

struct req {
    uint64_t id, group;
    int *prompt, n_prompt;
    int n, max_tokens;
    fr_sampling_params params;
    int *stop, n_stop;
    sample *samples;
    int open;              /* samples not yet ended */
    int monitor, per_token_kl;
    int *forced, n_forced; /* teacher forcing: emitted instead of sampled */
    uint64_t report_id;    /* the id metrics name it by */
    double t_submit;       /* fr_now_s at submit: latencies count from here */
    int prompt_counted;    /* its prompt tokens are in the serving figures */
    int min_tokens, top_n; /* the stop ids are barred before min_tokens; top log-probs per token */
    fr_penalties pen;      /* min_p and penalties (zeroed: none) */
    float *plp;            /* [n_prompt - 1] prompt log-probs when asked (sample 0's job fills them), else NULL */
    int routes;            /* return_routed_experts */
    int with_text;         /* on_text reports its samples' text */
};

/* Prefill work: a prompt for samples [lo, hi) of a request (sample -1; a
 * request of more samples than max_seqs has one such job per max_seqs
 * samples, each its own prefill), or the recompute of one preempted sample
 * (its prompt and generated tokens). */
typedef struct {
    req *r;
    int sample;
    int lo, hi;            /* sample -1: the samples it starts */
    int *buf;              /* recompute: prompt + generated tokens (owned) */
    const int *tokens;
    int n_total, done, seq;
    uint64_t admit;
    int started;           /* admitted once (what FR_SCHED_HOLD lets go on) */
    int cont;              /* a continuation's first prefill (fr_request_spec.continue_tokens) */
} job;

struct fr_scheduler {
    fr_session *s;
    fr_scheduler_config cfg;
    int aligned_chunks;              /* deterministic mode with an FP4/FP8 cache: see schedule_batch */
    fr_scheduler_mode mode;          /* run, hold or freeze (scheduler.h) */
    int vocab, n_blocks;
    req **reqs;
    int n_reqs, cap_reqs;
    job *waiting, *prefill;          /* waiting: front first; prefill: in admission order */
    int n_waiting, cap_waiting, n_prefill, cap_prefill;
    sample **running;                /* in admission order */
    int n_running;
    fr_sample_result *results;       /* queued results (no callback) */
    int n_results, cap_results, first_result;
    float *logits;
    int logit_rows;
    fr_step_seq *rows;
    sample **row_samples;
    int *row_job_m;
    int *lrow;                       /* a row's first logit row in the step (fr_step_logit_rows' numbering) */
    int *plp_at;                     /* a job row's first kept logit row when it fills prompt log-probs, else -1 */
    int cap_rows;
    /* a decode-only batch: sampled on the backend, logits kept for few rows */
    fr_decode_row *drows;
    fr_step_draw *sdraws;            /* a mixed batch's draws */
    int *dtok, *keep, *keep_at, *dslot;
    float *dlp;
    int cap_dec;
    fr_sampler *sampler;
    uint64_t next_admit;
    fr_scheduler_stats st;
    uint64_t version;
    /* divergence monitoring */
    fr_shadow *shadow;               /* opened on the first monitored sample */
    int shadow_failed;               /* could not open: monitoring off, said once */
    float *ref, *lsm;                /* shadow logits [rows][vocab]; log-softmax scratch */
    int ref_rows;
    int *mon_seqs, *mon_toks, *mon_rows, cap_mon_seqs, cap_mon_toks, cap_mon_rows;
    int *mon_served, *mon_chosen, cap_mon_served, cap_mon_chosen;   /* measuring on the device */
    fr_kl_result *mon_kl;
    int cap_mon_kl;
    /* rows measured from the host in one call (fr_shadow_measure_rows):
     * their reference and served rows, tokens, the monitored row each
     * stands for, the results; mon_pre[m]: 1 + the batch index of monitored
     * row m's result, 0 when it has none */
    const float **mref, **mserved;
    int *mtok, *mrow, *mon_pre;
    fr_kl_result *mres;
    int cap_mref, cap_mserved, cap_mtok, cap_mrow, cap_mon_pre, cap_mres;
    fr_div_aggregates agg;
    fr_serving_stats serving;        /* latencies, prompt tokens, ends by reason */
    /* Routed-expert replay (scheduler_routes.c): one token's record is
     * route_layers x route_k ids of route_width bytes (0 layers: the model
     * has no MoE layer); route_reqs open requests ask for them, and the
     * runner captures while any does; route_at[row] is a batch row's record
     * in route_buf (-1: none wanted), route_trow the token rows fetched. */
    int route_layers, route_k, route_width, route_reqs, capturing;
    int *route_at, *route_trow;
    uint16_t *route_buf;
    int cap_route_at, cap_route_trow, cap_route_buf;
    /* How a decode-only step runs the shadow on CUDA: carried in the serving
     * batch (default), else beside it on its own stream, else after it;
     * FR_SHADOW_CARRY=0 and FR_SHADOW_OVERLAP=0 step down, for measuring. */
    int carry, overlap;
};

static inline int sch_blocks_for(int tokens) { return (tokens + T - 1) / T; }

/* One step in the manner of nano-vllm: schedule (blocks for the running
 * samples, then the batch), run (the forward step, sampled where the
 * logits are, with the monitored decodes' shadow), postprocess (tokens,
 * divergence, prefill progress). step_plan carries what the phases share. */
typedef struct {
    int n_dec;           /* decode rows: the running samples, rows [0, n_dec) */
    int n_rows;          /* decode rows, then one row per prefill job */
    int n_jobs;          /* prefill jobs in the batch: sch->prefill[0..n_jobs) */
    int fast;            /* decodes alone: a decode graph's replay */
    int dev_kl;          /* the monitored decodes' KL is measured on the device */
    int n_mon;           /* monitored decodes (sch->mon_*) */
    int n_keep;          /* logit rows that come to the host (sch->keep) */
    int n_lrows;         /* logit rows of the step: one per row, a prompt's every row when it fills prompt log-probs */
    int n_draws;         /* tokens drawn on the backend (sch->sdraws) */
    int carried;         /* the shadow's rows rode in the serving batch */
    int n_routes;        /* rows whose routed experts the step fetches (sch->route_trow) */
    int shadow_launched; /* the shadow's step ran beside the serving one */
} step_plan;

/* ---- scheduler.c ---- */

/* Room for need elements of elem bytes in *p (capacity *cap, doubled as
 * needed); -1 when out of memory, the old array intact. */
int sch_grow(void **p, int *cap, int need, size_t elem);
/* Removes request r from the list and frees it. */
void sch_remove_req(fr_scheduler *sch, req *r);

/* ---- scheduler_admit.c: admission, preemption, aborts ---- */

void sch_remove_running(fr_scheduler *sch, sample *x);
/* The samples a job stands for: [*lo, *hi). */
void sch_job_range(const job *j, int *lo, int *hi);
/* Sequence slots a job takes: its open samples. */
int sch_job_slots(const job *j);
/* Queues j at the front or the back of the waiting queue; -1 when out of memory. */
int sch_push_waiting(fr_scheduler *sch, job j, int front);
/* Ends every open sample a job stands for (after its removal). */
void sch_fail_job_samples(fr_scheduler *sch, job *j, fr_finish_reason why);
/* Preempts the most recently admitted work (a running sample or a prefill);
 * returns the preempted sample, or NULL when it was a prefill or nothing
 * (*any says whether anything was). */
sample *sch_preempt_newest(fr_scheduler *sch, int *any);
/* Admits the waiting queue's head when its prefill fits: 1 admitted, 0 not. */
int sch_admit_head(fr_scheduler *sch);
/* Every running sample gets the block its next token needs, newest work
 * preempted until it does. */
fr_status sch_schedule_blocks(fr_scheduler *sch);
/* Ends the unfinished samples of request id (or of all) with reason abort;
 * returns how many. */
int sch_abort_matching(fr_scheduler *sch, int all, uint64_t id);

/* ---- scheduler_plan.c: the step's batch ---- */

/* The batch: decodes first, then prefill chunks within the budget. */
fr_status sch_schedule_batch(fr_scheduler *sch, step_plan *p);
/* Where each row's output goes (tokens drawn on the backend, logits to the
 * host), the monitored rows included. */
fr_status sch_schedule_outputs(fr_scheduler *sch, step_plan *p);

/* ---- scheduler_post.c: tokens, results, prefill progress ---- */

/* Ends a sample: frees its sequence, delivers its result, and frees the
 * request with its last sample (the request must not be used after). */
void sch_finish(fr_scheduler *sch, sample *x, fr_finish_reason why);
/* Whether x's next token is drawn on the host, from its logits. */
int sch_host_drawn(const sample *x);
/* After the step: decode tokens and their D_t, then the prefills' progress. */
void sch_postprocess(fr_scheduler *sch, const step_plan *p);

/* ---- scheduler_routes.c: routed-expert replay ---- */

/* The rows whose tokens are drawn this step for samples that record their
 * routed experts (sch->route_at, route_trow), the runner's capture switched
 * on while any open request asks and off after. */
fr_status sch_schedule_routes(fr_scheduler *sch, step_plan *p);
/* After the forward step: the planned rows' routed experts from the runner. */
fr_status sch_fetch_routes(fr_scheduler *sch, const step_plan *p);
/* Batch row `row`'s routed experts this step, or NULL. */
const uint16_t *sch_route_of(const fr_scheduler *sch, int row);
/* Keeps route as x's record of its next token (x->n), when x records them. */
void sch_keep_route(const fr_scheduler *sch, sample *x, const uint16_t *route);

/* ---- scheduler_text.c: the samples' text and stop strings ---- */

/* Whether the request's samples keep a text state. */
int sch_text_wanted(const fr_request_spec *spec);
/* FR_EINVAL when the request wants text and the scheduler has no tokenizer. */
fr_status sch_text_check(const fr_scheduler *sch, const fr_request_spec *spec);
/* The text states of r's samples when the request wants them: 0, or -1
 * when one could not be made. */
int sch_text_open(fr_scheduler *sch, req *r, const fr_request_spec *spec);
/* x's newest token (x->n - 1, just accepted) into its text: its report to
 * on_text, and FR_FINISH_STOP when it completed a stop string (NONE
 * otherwise, ERROR when the text failed). Nothing for a sample without text. */
fr_finish_reason sch_text_token(fr_scheduler *sch, sample *x, int tok);
/* The ending sample's text into its result (and its state freed). */
void sch_text_result(sample *x, fr_sample_result *res);

/* ---- scheduler_shadow.c: divergence monitoring ---- */

/* Whether sample `index` of request `id` runs a shadow at rate `rate`. */
int sch_chosen(uint64_t id, int index, double rate);
/* The shadow, opened on first use; NULL (monitoring off) when it cannot be. */
fr_shadow *sch_shadow_of(fr_scheduler *sch);
/* Room for n rows of shadow logits (sch->ref): 1, or 0 when out of memory. */
int sch_ref_rows(fr_scheduler *sch, int n);
void sch_record(fr_scheduler *sch, sample *x, const fr_kl_result *k);
void sch_measure(fr_scheduler *sch, sample *x, const float *logits, const float *ref);
/* D_t of the first tokens of the n samples xs of one prompt. */
void sch_measure_first(fr_scheduler *sch, sample **xs, int n, const float *logits);
/* One shadow token for x after a recompute, and its D_t. */
void sch_shadow_catch_up(fr_scheduler *sch, sample *x, const float *logits);
/* The monitored decodes of the batch, each with room for its token. */
void sch_schedule_monitoring(fr_scheduler *sch, step_plan *p);
/* The monitored decodes' shadow step unless it ran with the forward step. */
void sch_run_shadow(fr_scheduler *sch, step_plan *p);
/* Measures on the device, before postprocessing, the monitored rows whose
 * tokens are known; returns whether sch->mon_pre says which. */
int sch_premeasure(fr_scheduler *sch, const step_plan *p);

#endif
