/* The continuous-batching scheduler: docs/scheduler.md states the policy. */
#include "rollout/engine/scheduler.h"

#include "base/clock.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    float *plp;            /* [n_prompt - 1] prompt log-probs when asked (sample 0's job fills them), else NULL */
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
} job;

struct fr_scheduler {
    fr_session *s;
    fr_scheduler_config cfg;
    int aligned_chunks;              /* deterministic mode with an FP4/FP8 cache: see schedule_batch */
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
    /* How a decode-only step runs the shadow on CUDA: carried in the serving
     * batch (default), else beside it on its own stream, else after it;
     * FR_SHADOW_CARRY=0 and FR_SHADOW_OVERLAP=0 step down, for measuring. */
    int carry, overlap;
};

static int blocks_for(int tokens) { return (tokens + T - 1) / T; }

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap) return 0;
    int c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    void *q = realloc(*p, elem * (size_t)c);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* Room for n rows in the decode-path arrays; the capacity moves only once
 * every array has it, so a failure leaves them all usable at the old one. */
static int grow_decode(fr_scheduler *sch, int n)
{
    if (n <= sch->cap_dec) return 0;
    int c = sch->cap_dec ? sch->cap_dec : 8;
    while (c < n) c *= 2;
    void *p;
    if (!(p = realloc(sch->drows, sizeof(fr_decode_row) * (size_t)c))) return -1;
    sch->drows = p;
    if (!(p = realloc(sch->dtok, sizeof(int) * (size_t)c))) return -1;
    sch->dtok = p;
    if (!(p = realloc(sch->keep, sizeof(int) * (size_t)c))) return -1;
    sch->keep = p;
    if (!(p = realloc(sch->keep_at, sizeof(int) * (size_t)c))) return -1;
    sch->keep_at = p;
    if (!(p = realloc(sch->dlp, sizeof(float) * (size_t)c))) return -1;
    sch->dlp = p;
    if (!(p = realloc(sch->sdraws, sizeof(fr_step_draw) * (size_t)c))) return -1;
    sch->sdraws = p;
    if (!(p = realloc(sch->dslot, sizeof(int) * (size_t)c))) return -1;
    sch->dslot = p;
    sch->cap_dec = c;
    return 0;
}

static void free_req(req *r)
{
    for (int i = 0; i < r->n; i++) {
        free(r->samples[i].tokens);
        free(r->samples[i].logprobs);
        free(r->samples[i].versions);
        free(r->samples[i].kl);
        free(r->samples[i].top_ids);
        free(r->samples[i].top_lps);
    }
    free(r->samples);
    free(r->plp);
    free(r->prompt);
    free(r->stop);
    free(r->forced);
    free(r);
}

static void remove_req(fr_scheduler *sch, req *r)
{
    for (int i = 0; i < sch->n_reqs; i++)
        if (sch->reqs[i] == r) {
            memmove(&sch->reqs[i], &sch->reqs[i + 1], sizeof(req *) * (size_t)(sch->n_reqs - i - 1));
            sch->n_reqs--;
            break;
        }
    free_req(r);
}

static void remove_running(fr_scheduler *sch, sample *x)
{
    for (int i = 0; i < sch->n_running; i++)
        if (sch->running[i] == x) {
            memmove(&sch->running[i], &sch->running[i + 1], sizeof(sample *) * (size_t)(sch->n_running - i - 1));
            sch->n_running--;
            return;
        }
}

/* The serving figures of a sample that ends now: its reason, latencies, and
 * (monitored) its mean KL under the version of its last token. */
static void count_end(fr_scheduler *sch, const sample *x, fr_finish_reason why)
{
    fr_serving_stats *v = &sch->serving;
    if ((int)why > 0 && (int)why < FR_FINISH_KINDS) v->finished[why]++;
    const double now = fr_now_s();
    fr_hist_add(&v->e2e, now - x->r->t_submit);
    if (x->n >= 2) fr_hist_add(&v->tpot, (now - x->t_first) / (double)(x->n - 1));
    if (x->monitored && x->n > 0)
        fr_div_aggregates_add_sample(&sch->agg, x->versions[x->n - 1], x->r->report_id, (int)x->stream, &x->div);
}

/* Ends a sample: frees its sequence, delivers its result, and frees the
 * request with its last sample (the request must not be used after). */
static void finish(fr_scheduler *sch, sample *x, fr_finish_reason why)
{
    if (x->done) return;
    x->done = 1;
    if (x->seq >= 0) {
        remove_running(sch, x);
        fr_kv_seq_free(sch->s->kv, x->seq);
        x->seq = -1;
    }
    req *r = x->r;
    if (x->shadow_seq >= 0) {
        fr_shadow_drop(sch->shadow, x->shadow_seq);
        x->shadow_seq = -1;
    }
    if (x->monitored) sch->agg.samples++;
    count_end(sch, x, why);
    fr_sample_result res = {.request_id = r->id, .group = r->group, .sample = (int)x->stream, .tokens = x->tokens,
                            .logprobs = x->logprobs, .n_tokens = x->n, .finish = why,
                            .preemptions = x->preemptions, .versions = x->versions,
                            .monitored = x->monitored, .div = x->div, .kl = x->kl, .top_n = r->top_n,
                            .top_ids = x->top_ids, .top_logprobs = x->top_lps};
    if (x->index == 0 && r->plp) {   /* the request's first sample carries them */
        res.prompt_logprobs = r->plp;
        res.n_prompt_logprobs = r->n_prompt - 1;
        r->plp = NULL;
    }
    x->tokens = NULL;
    x->logprobs = NULL;
    x->versions = NULL;
    x->kl = NULL;
    x->top_ids = NULL;
    x->top_lps = NULL;
    sch->st.finished++;
    if (sch->cfg.on_done) {
        sch->cfg.on_done(sch->cfg.user, &res);
        fr_sample_result_free(&res);
    } else {
        if (sch->first_result > 0 && sch->n_results == sch->cap_results) {
            memmove(sch->results, sch->results + sch->first_result,
                    sizeof *sch->results * (size_t)(sch->n_results - sch->first_result));
            sch->n_results -= sch->first_result;
            sch->first_result = 0;
        }
        if (grow((void **)&sch->results, &sch->cap_results, sch->n_results + 1, sizeof *sch->results)) {
            /* Out of memory: the result cannot be kept; drop its arrays but
             * never the accounting (the caller still sees the count). */
            fr_sample_result_free(&res);
        } else {
            sch->results[sch->n_results++] = res;
        }
    }
    if (--r->open == 0) remove_req(sch, r);
}

static int is_stop(const req *r, int tok)
{
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop[i] == tok) return 1;
    return 0;
}

/* x's first token: time to it, and its request's prompt once. */
static void first_token(fr_scheduler *sch, sample *x)
{
    x->t_first = fr_now_s();
    fr_hist_add(&sch->serving.ttft, x->t_first - x->r->t_submit);
    if (!x->r->prompt_counted) sch->serving.prompt_tokens += x->r->n_prompt;
    x->r->prompt_counted = 1;
}

/* Records tok (drawn with log-prob lp) as x's next token; returns its finish
 * reason, or FR_FINISH_NONE when it goes on. */
static fr_finish_reason accept(fr_scheduler *sch, sample *x, int tok, float lp)
{
    const req *r = x->r;
    if (tok < 0 || tok >= sch->vocab) return FR_FINISH_ERROR;   /* the device sampler's row error */
    x->tokens[x->n] = tok;
    x->versions[x->n] = sch->version;
    x->logprobs[x->n++] = lp;
    sch->st.tokens_generated++;
    if (x->n == 1) first_token(sch, x);
    if (sch->cfg.on_token) sch->cfg.on_token(sch->cfg.user, r->id, (int)x->stream, x->n - 1, tok, lp);
    if (is_stop(r, tok)) return FR_FINISH_STOP;
    if (x->n >= r->max_tokens) return FR_FINISH_LENGTH;
    return FR_FINISH_NONE;
}

/* Whether x's next token is drawn on the host, from its logits: teacher
 * forcing, top log-probs, and stop ids barred by min_tokens need the CPU
 * sampler's extras (the backend's sampler draws the rest). */
static int host_drawn(const sample *x)
{
    const req *r = x->r;
    return r->forced || r->top_n > 0 || (r->n_stop > 0 && x->n < r->min_tokens);
}

/* Draws the next token of x from logits (host), then accepts it. */
static fr_finish_reason draw(fr_scheduler *sch, sample *x, const float *logits)
{
    const req *r = x->r;
    int tok;
    float lp;
    int *top_ids = r->top_n ? x->top_ids + (size_t)x->n * (size_t)r->top_n : NULL;
    float *top_lps = r->top_n ? x->top_lps + (size_t)x->n * (size_t)r->top_n : NULL;
    if (!logits) return FR_FINISH_ERROR;
    if (r->forced) {   /* teacher forcing: the given token, the model's log-prob of it */
        tok = r->forced[x->n];
        if (fr_log_softmax(logits, sch->vocab, r->params.temperature, sch->lsm)) return FR_FINISH_ERROR;
        lp = sch->lsm[tok];
        if (r->top_n && fr_top_logprobs(sch->sampler, logits, r->params.temperature, r->top_n, top_ids, top_lps))
            return FR_FINISH_ERROR;
    } else {
        const int bar = x->n < r->min_tokens;
        fr_sample_extras ex = {.banned = bar ? r->stop : NULL, .n_banned = bar ? r->n_stop : 0, .top_n = r->top_n,
                               .top_ids = top_ids, .top_logprobs = top_lps};
        if (fr_sample_ex(sch->sampler, logits, &r->params, x->stream, (uint64_t)x->n, &ex, &tok, &lp))
            return FR_FINISH_ERROR;
    }
    return accept(sch, x, tok, lp);
}

/* x's next token: the one drawn for it on the backend (pre_tok[i], pre_lp[i])
 * when there is one, else drawn here from logits. */
static fr_finish_reason take(fr_scheduler *sch, sample *x, const float *logits, const int *pre_tok,
                             const float *pre_lp, int i)
{
    return pre_tok ? accept(sch, x, pre_tok[i], pre_lp[i]) : draw(sch, x, logits);
}

/* ---- divergence monitoring ---- */

/* Whether sample `index` of request `id` runs a shadow at rate `rate`: a
 * hash of the pair against the rate, the same on every rank. */
static int chosen(uint64_t id, int index, double rate)
{
    if (rate <= 0.0) return 0;
    if (rate >= 1.0) return 1;
    uint64_t z = id * 0x9e3779b97f4a7c15ull + (uint64_t)index * 0xbf58476d1ce4e5b9ull + 0x94d049bb133111ebull;
    z = (z ^ (z >> 31)) * 0xd6e8feb86659fd03ull;
    z ^= z >> 29;
    return (double)(z >> 11) * 0x1p-53 < rate;
}

/* The shadow, opened on first use (fr_scheduler_submit asks for it with the
 * first monitored sample, so that its allocation is not paid in a step);
 * NULL (monitoring off) when it cannot be. */
static fr_shadow *shadow_of(fr_scheduler *sch)
{
    if (sch->shadow || sch->shadow_failed) return sch->shadow;
    int blocks = sch->cfg.shadow_blocks > 0 ? sch->cfg.shadow_blocks : sch->n_blocks;
    const double t0 = fr_now_s();
    if (fr_shadow_open(sch->s, sch->cfg.max_seqs, blocks, &sch->shadow)) {
        sch->shadow_failed = 1;
        sch->shadow = NULL;
    }
    sch->st.shadow_open_s += fr_now_s() - t0;
    return sch->shadow;
}

/* Room for n rows of shadow logits. */
static int ref_rows(fr_scheduler *sch, int n)
{
    if (n <= sch->ref_rows) return 1;
    float *g = realloc(sch->ref, sizeof(float) * (size_t)sch->vocab * (size_t)n);
    if (!g) return 0;
    sch->ref = g;
    sch->ref_rows = n;
    return 1;
}

/* D_t of x's last drawn token: the shadow's distribution ref against the
 * serving one, logits. */
/* Records D_t of x's last drawn token. */
static void record(fr_scheduler *sch, sample *x, const fr_kl_result *k)
{
    const int i = x->n - 1;
    fr_div_summary_add(&x->div, k);
    if (x->kl) x->kl[i] = (float)k->kl;
    fr_div_aggregates_add(&sch->agg, x->versions[i], (long)x->r->n_prompt + i, k);
}

static void measure(fr_scheduler *sch, sample *x, const float *logits, const float *ref)
{
    fr_kl_result k;
    double t0 = fr_now_s();
    fr_status st = fr_kl_topk(ref, logits, sch->vocab, FR_KL_TOP_K, x->tokens[x->n - 1], &k);
    sch->st.kl_s += fr_now_s() - t0;
    if (!st) record(sch, x, &k);
}

/* Room for n rows measured from the host in one call. */
static int grow_batch(fr_scheduler *sch, int n)
{
    return !grow((void **)&sch->mref, &sch->cap_mref, n, sizeof *sch->mref) &&
           !grow((void **)&sch->mserved, &sch->cap_mserved, n, sizeof *sch->mserved) &&
           !grow((void **)&sch->mtok, &sch->cap_mtok, n, sizeof(int)) &&
           !grow((void **)&sch->mrow, &sch->cap_mrow, n, sizeof(int)) &&
           !grow((void **)&sch->mres, &sch->cap_mres, n, sizeof(fr_kl_result));
}

/* D_t of the first tokens of the n samples xs of one prompt: the shadow's
 * prefill distribution (sch->ref) against the served one, logits; in one
 * call on the device when the shadow is there, else each on the host. */
static void measure_first(fr_scheduler *sch, sample **xs, int n, const float *logits)
{
    if (n == 0) return;
    int done = 0;
    if (fr_shadow_on_device(sch->shadow) && grow_batch(sch, n)) {
        const double t0 = fr_now_s();
        for (int j = 0; j < n; j++) {
            sch->mref[j] = sch->ref;
            sch->mserved[j] = logits;
            sch->mtok[j] = xs[j]->tokens[xs[j]->n - 1];
        }
        done = !fr_shadow_measure_rows(sch->shadow, sch->mref, sch->mserved, sch->mtok, n, sch->mres);
        sch->st.kl_s += fr_now_s() - t0;
        for (int j = 0; done && j < n; j++) record(sch, xs[j], &sch->mres[j]);
    }
    for (int j = 0; !done && j < n; j++) measure(sch, xs[j], logits, sch->ref);
}

/* Stops x's shadow (out of room or failed): the figures so far stay. */
static void stop_shadow(fr_scheduler *sch, sample *x)
{
    fr_shadow_drop(sch->shadow, x->shadow_seq);
    x->shadow_seq = -1;
}

/* One shadow token for sample x (the token its serving sequence consumed
 * last: tokens[n - 2] once tokens[n - 1] is drawn) and its D_t; used after a
 * recompute. */
static void shadow_catch_up(fr_scheduler *sch, sample *x, const float *logits)
{
    if (x->shadow_seq < 0 || x->n < 2) return;
    if (fr_shadow_blocks_needed(sch->shadow, x->shadow_seq) > fr_shadow_free_blocks(sch->shadow) ||
        !ref_rows(sch, 1) || fr_shadow_step(sch->shadow, &x->shadow_seq, &x->tokens[x->n - 2], 1, sch->ref)) {
        stop_shadow(sch, x);
        return;
    }
    measure(sch, x, logits, sch->ref);
}

/* The samples a job stands for: [*lo, *hi). */
static void job_range(const job *j, int *lo, int *hi)
{
    *lo = j->sample >= 0 ? j->sample : j->lo;
    *hi = j->sample >= 0 ? j->sample + 1 : j->hi;
}

static int job_slots(const job *j)
{
    if (j->sample >= 0) return 1;
    int n = 0;
    for (int i = j->lo; i < j->hi; i++) n += !j->r->samples[i].done;
    return n;
}

static int push_waiting(fr_scheduler *sch, job j, int front)
{
    if (grow((void **)&sch->waiting, &sch->cap_waiting, sch->n_waiting + 1, sizeof(job))) return -1;
    if (front) {
        memmove(sch->waiting + 1, sch->waiting, sizeof(job) * (size_t)sch->n_waiting);
        sch->waiting[0] = j;
    } else {
        sch->waiting[sch->n_waiting] = j;
    }
    sch->n_waiting++;
    return 0;
}

/* Ends every open sample a job stands for (after its removal). */
static void fail_job_samples(fr_scheduler *sch, job *j, fr_finish_reason why)
{
    req *r = j->r;
    if (j->seq >= 0) fr_kv_seq_free(sch->s->kv, j->seq);
    free(j->buf);
    if (j->sample >= 0) {
        finish(sch, &r->samples[j->sample], why);
        return;
    }
    int left = job_slots(j), n = j->hi;   /* counted first: the last finish may free r */
    for (int i = j->lo; left > 0 && i < n; i++)
        if (!r->samples[i].done) {
            left--;
            finish(sch, &r->samples[i], why);   /* the last one may free r */
        }
}

static void preempt_sample(fr_scheduler *sch, sample *x)
{
    req *r = x->r;
    remove_running(sch, x);
    fr_kv_seq_free(sch->s->kv, x->seq);
    x->seq = -1;
    x->preemptions++;
    sch->st.preemptions++;
    job j = {.r = r, .sample = x->index, .seq = -1, .n_total = r->n_prompt + x->n};
    j.buf = malloc(sizeof(int) * (size_t)j.n_total);
    if (!j.buf || push_waiting(sch, j, 1)) {
        free(j.buf);
        finish(sch, x, FR_FINISH_ERROR);
        return;
    }
    memcpy(j.buf, r->prompt, sizeof(int) * (size_t)r->n_prompt);
    memcpy(j.buf + r->n_prompt, x->tokens, sizeof(int) * (size_t)x->n);
    sch->waiting[0].buf = j.buf;
    sch->waiting[0].tokens = j.buf;
}

static void preempt_job(fr_scheduler *sch, int k)
{
    job j = sch->prefill[k];
    memmove(&sch->prefill[k], &sch->prefill[k + 1], sizeof(job) * (size_t)(sch->n_prefill - k - 1));
    sch->n_prefill--;
    fr_kv_seq_free(sch->s->kv, j.seq);
    j.seq = -1;
    j.done = 0;
    if (j.sample >= 0) j.r->samples[j.sample].preemptions++;
    sch->st.preemptions++;
    if (push_waiting(sch, j, 1)) {
        j.seq = -1;
        fail_job_samples(sch, &j, FR_FINISH_ERROR);
    }
}

/* Preempts the most recently admitted work (a running sample or a prefill);
 * returns the preempted sample, or NULL when it was a prefill or nothing. */
static sample *preempt_newest(fr_scheduler *sch, int *any)
{
    int best_run = -1, best_job = -1;
    uint64_t best = 0;
    for (int i = 0; i < sch->n_running; i++)
        if (best_run < 0 || sch->running[i]->admit >= best) { best = sch->running[i]->admit; best_run = i; }
    for (int k = 0; k < sch->n_prefill; k++)
        if ((best_run < 0 && best_job < 0) || sch->prefill[k].admit >= best) {
            best = sch->prefill[k].admit;
            best_job = k;
            best_run = -1;
        }
    *any = best_run >= 0 || best_job >= 0;
    if (best_job >= 0) {
        preempt_job(sch, best_job);
        return NULL;
    }
    if (best_run < 0) return NULL;
    sample *x = sch->running[best_run];
    preempt_sample(sch, x);
    return x;
}

fr_status fr_scheduler_new(fr_session *s, const fr_scheduler_config *cfg, fr_scheduler **out)
{
    if (!out) return fr_fail(FR_EINVAL, "scheduler: out is NULL");
    *out = NULL;
    if (!s || !s->kv || !s->model || !cfg) return fr_fail(FR_EINVAL, "scheduler: session or config is NULL");
    const fr_kv_cache_config *kc = fr_kv_cache_config_of(s->kv);
    fr_scheduler_config c = *cfg;
    if (c.max_seqs == 0) c.max_seqs = kc->max_seqs;
    if (c.chunk == 0) c.chunk = 512;
    if (c.max_seqs < 1 || c.max_seqs > kc->max_seqs)
        return fr_fail(FR_EINVAL, "scheduler: max_seqs %d outside [1, %d] (the cache's slots)", c.max_seqs,
                       kc->max_seqs);
    if (c.chunk < 1) return fr_fail(FR_EINVAL, "scheduler: chunk must be >= 1 (got %d)", c.chunk);
    if (c.reserve_blocks < 0) c.reserve_blocks = c.max_seqs / 16 > 1 ? c.max_seqs / 16 : 1;
    if (c.reserve_blocks >= kc->n_blocks)
        return fr_fail(FR_EINVAL, "scheduler: reserve_blocks %d leaves nothing of %d blocks", c.reserve_blocks,
                       kc->n_blocks);
    fr_scheduler *sch = calloc(1, sizeof *sch);
    if (!sch) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    sch->s = s;
    sch->cfg = c;
    sch->aligned_chunks = s->deterministic && kc->dtype != FR_KV_BF16 && kc->dtype != FR_KV_F32;
    sch->vocab = s->model->cfg.vocab_size;
    sch->n_blocks = kc->n_blocks;
    fr_serving_stats_init(&sch->serving);
    const char *ov = getenv("FR_SHADOW_OVERLAP"), *ca = getenv("FR_SHADOW_CARRY");
    sch->overlap = !ov || strcmp(ov, "0") != 0;
    sch->carry = !ca || strcmp(ca, "0") != 0;
    sch->running = malloc(sizeof(sample *) * (size_t)c.max_seqs);
    sch->lsm = malloc(sizeof(float) * (size_t)sch->vocab);
    fr_status st = sch->running && sch->lsm ? fr_sampler_new(sch->vocab, &sch->sampler)
                                            : fr_fail(FR_ENOMEM, "scheduler: out of memory");
    if (st) {
        fr_scheduler_destroy(&sch);
        return st;
    }
    *out = sch;
    return FR_OK;
}

void fr_scheduler_destroy(fr_scheduler **p)
{
    if (!p || !*p) return;
    fr_scheduler *sch = *p;
    if (sch->sampler) fr_scheduler_abort_all(sch, NULL);
    for (int i = sch->first_result; i < sch->n_results; i++) fr_sample_result_free(&sch->results[i]);
    free(sch->results);
    free(sch->reqs);
    free(sch->waiting);
    free(sch->prefill);
    free(sch->running);
    free(sch->logits);
    free(sch->rows);
    free(sch->row_samples);
    free(sch->row_job_m);
    free(sch->lrow);
    free(sch->plp_at);
    free(sch->drows);
    free(sch->sdraws);
    free(sch->dslot);
    free(sch->dtok);
    free(sch->keep);
    free(sch->keep_at);
    free(sch->dlp);
    fr_sampler_destroy(&sch->sampler);
    fr_shadow_close(&sch->shadow);
    free(sch->ref);
    free(sch->lsm);
    free(sch->mon_seqs);
    free(sch->mon_toks);
    free(sch->mon_rows);
    free(sch->mon_served);
    free(sch->mon_chosen);
    free(sch->mon_kl);
    free(sch->mref);
    free(sch->mserved);
    free(sch->mtok);
    free(sch->mrow);
    free(sch->mon_pre);
    free(sch->mres);
    free(sch);
    *p = NULL;
}

fr_status fr_scheduler_submit(fr_scheduler *sch, const fr_request_spec *spec)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    fr_status st = fr_request_spec_check(spec, sch->vocab);
    if (st) return st;
    const fr_model_config *mc = &sch->s->model->cfg;
    if (spec->n_prompt >= mc->max_position)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) does not fit the context window of %d",
                       (unsigned long long)spec->id, spec->n_prompt, mc->max_position);
    int max_tokens = spec->max_tokens;
    if (max_tokens > mc->max_position - spec->n_prompt) max_tokens = mc->max_position - spec->n_prompt;
    if (blocks_for(spec->n_prompt + max_tokens) > sch->n_blocks)
        return fr_fail(FR_EINVAL, "request %llu: prompt (%d) + max_tokens (%d) needs %d KV blocks, the cache has %d",
                       (unsigned long long)spec->id, spec->n_prompt, max_tokens,
                       blocks_for(spec->n_prompt + max_tokens), sch->n_blocks);
    req *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    if (spec->forced && spec->n_forced < max_tokens) max_tokens = spec->n_forced;
    *r = (req){.id = spec->id, .group = spec->group, .n_prompt = spec->n_prompt, .n = spec->n,
               .max_tokens = max_tokens, .params = spec->params, .n_stop = spec->n_stop, .open = spec->n,
               .monitor = spec->monitor, .per_token_kl = spec->per_token_kl, .t_submit = fr_now_s(),
               .report_id = spec->has_report_id ? spec->report_id : spec->id, .min_tokens = spec->min_tokens,
               .top_n = spec->top_logprobs};
    r->prompt = malloc(sizeof(int) * (size_t)spec->n_prompt);
    r->stop = malloc(sizeof(int) * (size_t)(spec->n_stop > 0 ? spec->n_stop : 1));
    r->samples = calloc((size_t)spec->n, sizeof(sample));
    int ok = r->prompt && r->stop && r->samples;
    if (ok && spec->prompt_logprobs) {
        r->plp = malloc(sizeof(float) * (size_t)(spec->n_prompt > 1 ? spec->n_prompt - 1 : 1));
        ok = r->plp != NULL;
        for (int i = 0; ok && i < spec->n_prompt - 1; i++) r->plp[i] = NAN;   /* until its prefill ran */
    }
    if (ok && spec->forced) {
        r->forced = malloc(sizeof(int) * (size_t)max_tokens);
        if ((ok = r->forced != NULL)) memcpy(r->forced, spec->forced, sizeof(int) * (size_t)max_tokens);
        r->n_forced = max_tokens;
    }
    for (int i = 0; ok && i < spec->n; i++) {
        sample *x = &r->samples[i];
        *x = (sample){.r = r, .index = i, .stream = (uint64_t)spec->first_sample + (uint64_t)i, .seq = -1,
                      .shadow_seq = -1};
        x->monitored = spec->monitor == 1 || (spec->monitor != 0 && chosen(spec->id, i, sch->cfg.kl_sample_rate));
        x->tokens = malloc(sizeof(int) * (size_t)max_tokens);
        x->logprobs = malloc(sizeof(float) * (size_t)max_tokens);
        x->versions = malloc(sizeof(uint64_t) * (size_t)max_tokens);
        if (x->monitored && spec->per_token_kl) x->kl = calloc((size_t)max_tokens, sizeof(float));
        ok = x->tokens && x->logprobs && x->versions && (!x->monitored || !spec->per_token_kl || x->kl);
        if (ok && r->top_n) {
            x->top_ids = malloc(sizeof(int) * (size_t)max_tokens * (size_t)r->top_n);
            x->top_lps = malloc(sizeof(float) * (size_t)max_tokens * (size_t)r->top_n);
            ok = x->top_ids && x->top_lps;
        }
    }
    if (ok) ok = !grow((void **)&sch->reqs, &sch->cap_reqs, sch->n_reqs + 1, sizeof(req *));
    if (ok) {
        memcpy(r->prompt, spec->prompt, sizeof(int) * (size_t)spec->n_prompt);
        if (spec->n_stop > 0) memcpy(r->stop, spec->stop_ids, sizeof(int) * (size_t)spec->n_stop);
        /* more samples than the engine runs at once: queued max_seqs at a time
         * (room made first, so that no push fails halfway) */
        int jobs = (spec->n + sch->cfg.max_seqs - 1) / sch->cfg.max_seqs;
        ok = !grow((void **)&sch->waiting, &sch->cap_waiting, sch->n_waiting + jobs, sizeof(job));
        for (int lo = 0; ok && lo < spec->n; lo += sch->cfg.max_seqs) {
            int hi = spec->n - lo > sch->cfg.max_seqs ? lo + sch->cfg.max_seqs : spec->n;
            job j = {.r = r, .sample = -1, .lo = lo, .hi = hi, .tokens = r->prompt, .n_total = r->n_prompt, .seq = -1};
            ok = !push_waiting(sch, j, 0);
        }
    }
    if (!ok) {
        if (r->samples) free_req(r);
        else { free(r->prompt); free(r->stop); free(r->plp); free(r); }
        return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    }
    sch->reqs[sch->n_reqs++] = r;
    for (int i = 0; i < r->n; i++)
        if (r->samples[i].monitored) {
            shadow_of(sch);   /* a failure is the prompt's completion's to handle: monitoring off */
            break;
        }
    return FR_OK;
}

int fr_scheduler_idle(const fr_scheduler *sch) { return !sch || sch->n_reqs == 0; }

/* Slots held or promised: running samples plus the samples prefills become. */
static int slots_committed(const fr_scheduler *sch)
{
    int n = sch->n_running;
    for (int k = 0; k < sch->n_prefill; k++) n += job_slots(&sch->prefill[k]);
    return n;
}

/* Admits the waiting queue's head when its prefill fits: 1 admitted, 0 not. */
static int admit_head(fr_scheduler *sch)
{
    if (sch->n_waiting == 0) return 0;
    job *j = &sch->waiting[0];
    fr_kv_cache *kv = sch->s->kv;
    int slots = job_slots(j), free_blocks = fr_kv_free_blocks(kv);
    if (slots_committed(sch) + slots > sch->cfg.max_seqs) return 0;
    int blocks = blocks_for(j->n_total);
    int forks = j->sample < 0 && j->n_total % T ? slots - 1 : 0;   /* partial page copies */
    int alone = sch->n_running == 0 && sch->n_prefill == 0;
    if (blocks + forks + sch->cfg.reserve_blocks > free_blocks && !(alone && blocks <= free_blocks)) return 0;
    if (grow((void **)&sch->prefill, &sch->cap_prefill, sch->n_prefill + 1, sizeof(job))) return 0;
    int seq;
    if (fr_kv_seq_new(kv, &seq)) return 0;
    if (fr_kv_reserve(kv, seq, j->n_total)) {
        fr_kv_seq_free(kv, seq);
        return 0;
    }
    job a = *j;
    memmove(sch->waiting, sch->waiting + 1, sizeof(job) * (size_t)(sch->n_waiting - 1));
    sch->n_waiting--;
    a.seq = seq;
    a.done = 0;
    a.admit = ++sch->next_admit;
    sch->prefill[sch->n_prefill++] = a;
    return 1;
}

/* A prefill's last chunk ran: its samples start. logits: the chunk's last
 * row (NULL when no sample needs it on the host); pre_tok/pre_lp: the first
 * tokens drawn on the backend, by sample index (NULL: draw here). */
static void complete_job(fr_scheduler *sch, job *j, const float *logits, const int *pre_tok, const float *pre_lp)
{
    req *r = j->r;
    if (j->sample >= 0) {
        sample *x = &r->samples[j->sample];
        free(j->buf);
        x->seq = j->seq;
        x->admit = j->admit;
        sch->running[sch->n_running++] = x;
        fr_finish_reason why = take(sch, x, logits, pre_tok, pre_lp, 0);
        if (why != FR_FINISH_ERROR && logits) shadow_catch_up(sch, x, logits);
        if (why) finish(sch, x, why);
        return;
    }
    /* The monitored samples' shadow: one prefill of the prompt, forked. */
    int shadow_src = -1;
    const int lo = j->lo, hi = j->hi;
    const double t_start = fr_now_s();
    for (int i = lo; i < hi; i++) {
        sample *x = &r->samples[i];
        if (x->done || !x->monitored || !shadow_of(sch)) continue;
        if (!ref_rows(sch, 1)) break;
        int need = (r->n_prompt + T - 1) / T + 1;
        if (shadow_src < 0) {
            if (fr_shadow_free_blocks(sch->shadow) < need ||
                fr_shadow_start(sch->shadow, r->prompt, r->n_prompt, &shadow_src, sch->ref))
                break;   /* no room: these samples go unmonitored */
            x->shadow_seq = shadow_src;
        } else if (fr_shadow_free_blocks(sch->shadow) < 1 || fr_shadow_fork(sch->shadow, shadow_src, &x->shadow_seq)) {
            x->shadow_seq = -1;
        }
    }
    sch->st.shadow_start_s += fr_now_s() - t_start;
    /* Samples that end on their first token are finished last: the last
     * finish frees the request. */
    sample **end = malloc(sizeof(sample *) * (size_t)(hi - lo));
    sample **mon = malloc(sizeof(sample *) * (size_t)(hi - lo));
    fr_finish_reason *whys = malloc(sizeof *whys * (size_t)(hi - lo));
    if (!end || !mon || !whys) {
        free(end);
        free(mon);
        free(whys);
        fail_job_samples(sch, j, FR_FINISH_ERROR);
        return;
    }
    int n_end = 0, n_mon = 0, seq = j->seq;
    for (int i = lo; i < hi; i++) {
        sample *x = &r->samples[i];
        if (x->done) continue;
        fr_finish_reason why = take(sch, x, logits, pre_tok, pre_lp, i - lo);
        if (why != FR_FINISH_ERROR && x->shadow_seq >= 0 && logits) mon[n_mon++] = x;   /* measured below, before any finish */
        if (!why && seq >= 0) {        /* the first one keeps the prefill's sequence */
            x->seq = seq;
            seq = -1;
        } else if (!why && fr_session_fork(sch->s, j->seq, &x->seq)) {
            why = FR_FINISH_ERROR;
        }
        if (why) {
            x->seq = -1;
            end[n_end] = x;
            whys[n_end++] = why;
            continue;
        }
        x->admit = j->admit;
        sch->running[sch->n_running++] = x;
    }
    if (seq >= 0) fr_kv_seq_free(sch->s->kv, seq);   /* every sample ended on its first token */
    measure_first(sch, mon, n_mon, logits);
    for (int k = 0; k < n_end; k++) finish(sch, end[k], whys[k]);   /* the last may free r */
    free(end);
    free(mon);
    free(whys);
}

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
    int shadow_launched; /* the shadow's step ran beside the serving one */
} step_plan;

/* Every running sample gets the block its next token needs, newest work
 * preempted until it does (oldest first, so the oldest advance). */
static fr_status schedule_blocks(fr_scheduler *sch)
{
    fr_kv_cache *kv = sch->s->kv;
    for (int i = 0; i < sch->n_running;) {
        sample *x = sch->running[i];
        int need = fr_kv_blocks_needed(kv, x->seq, 1);
        if (need > fr_kv_free_blocks(kv)) {
            int any;
            preempt_newest(sch, &any);
            if (!any) return fr_fail(FR_EINTERNAL, "scheduler: no block for a decode and nothing to preempt");
            i = 0;   /* the list changed: start over (reserved ones need nothing) */
            continue;
        }
        if (need && fr_kv_reserve(kv, x->seq, 1))
            return fr_fail(FR_EINTERNAL, "scheduler: a decode block could not be reserved");
        i++;
    }
    return FR_OK;
}

/* The batch: decodes first, then prefill chunks within the budget. */
static fr_status schedule_batch(fr_scheduler *sch, step_plan *p)
{
    int max_rows = sch->n_running + sch->n_prefill + sch->n_waiting;
    if (max_rows == 0) return FR_OK;
    if (grow((void **)&sch->rows, &sch->cap_rows, max_rows, sizeof(fr_step_seq))) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    int cap = sch->cap_rows;
    sample **rs = realloc(sch->row_samples, sizeof(sample *) * (size_t)cap);
    if (rs) sch->row_samples = rs;
    int *rm = rs ? realloc(sch->row_job_m, sizeof(int) * (size_t)cap) : NULL;
    if (rm) sch->row_job_m = rm;
    int *lr = rm ? realloc(sch->lrow, sizeof(int) * (size_t)cap) : NULL;
    if (lr) sch->lrow = lr;
    int *pa = lr ? realloc(sch->plp_at, sizeof(int) * (size_t)cap) : NULL;
    if (pa) sch->plp_at = pa;
    if (!rs || !rm || !lr || !pa) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    int n_dec = sch->n_running, n_rows = 0, n_lrows = 0;
    for (int i = 0; i < n_dec; i++) {
        sample *x = sch->running[i];
        sch->row_samples[n_rows] = x;
        sch->lrow[n_rows] = n_lrows++;
        sch->rows[n_rows++] = (fr_step_seq){.seq = x->seq, .n = 1, .tokens = &x->tokens[x->n - 1]};
    }
    int budget = sch->cfg.chunk - n_dec;
    if (budget < 1) budget = 1;   /* a prefill always advances (it holds a slot, so the runner has room) */
    int n_jobs = 0;
    for (;;) {
        if (n_jobs == sch->n_prefill && (budget == 0 || !admit_head(sch))) break;
        if (budget == 0) break;
        job *j = &sch->prefill[n_jobs];
        /* A recompute feeds the prompt in chunks, then its generated tokens
         * one per step, as they first ran: the decode path again. */
        int end = j->sample >= 0 && j->done < j->r->n_prompt ? j->r->n_prompt : j->n_total;
        int m = j->sample >= 0 && j->done >= j->r->n_prompt ? 1 : end - j->done;
        if (sch->aligned_chunks && m > 1) {
            /* Cut at multiples of the chunk from the prompt's start whatever
             * the load: an FP4/FP8 prefill's numbers depend on its chunks. A
             * piece that does not fit waits for decodes to finish. */
            const int stop = (j->done / sch->cfg.chunk + 1) * sch->cfg.chunk;
            if (stop < end) m = stop - j->done;
            if (m > budget) break;
        }
        if (m > budget) m = budget;
        budget -= m;
        /* The prefill of a request's first samples fills its prompt log-probs:
         * every position's logits, not the last one's alone. */
        const int all = j->r->plp && j->sample < 0 && j->lo == 0;
        sch->row_job_m[n_rows] = m;
        sch->lrow[n_rows] = n_lrows;
        n_lrows += all ? m : 1;
        sch->rows[n_rows++] = (fr_step_seq){.seq = j->seq, .n = m, .tokens = j->tokens + j->done, .all_logits = all};
        n_jobs++;
    }
    p->n_lrows = n_lrows;
    p->n_dec = n_dec;
    p->n_rows = n_rows;
    p->n_jobs = n_jobs;
    p->fast = n_jobs == 0;
    return FR_OK;
}

/* The monitored decodes: each one's shadow sequence needs room for the
 * token, or its monitoring stops here. */
static void schedule_monitoring(fr_scheduler *sch, step_plan *p)
{
    const int n_dec = p->n_dec;
    /* A decode-only step measures on the device when the shadow can and
     * every monitored token is drawn there too. */
    p->dev_kl = p->fast && sch->shadow && fr_shadow_on_device(sch->shadow);
    for (int i = 0; i < n_dec && p->dev_kl; i++)
        if (sch->row_samples[i]->shadow_seq >= 0 && host_drawn(sch->row_samples[i])) p->dev_kl = 0;
    p->n_mon = 0;
    if (sch->shadow && (grow((void **)&sch->mon_seqs, &sch->cap_mon_seqs, n_dec, sizeof(int)) ||
                        grow((void **)&sch->mon_toks, &sch->cap_mon_toks, n_dec, sizeof(int)) ||
                        grow((void **)&sch->mon_rows, &sch->cap_mon_rows, n_dec, sizeof(int)) ||
                        grow((void **)&sch->mon_served, &sch->cap_mon_served, n_dec, sizeof(int)) ||
                        grow((void **)&sch->mon_chosen, &sch->cap_mon_chosen, n_dec, sizeof(int)) ||
                        grow((void **)&sch->mon_kl, &sch->cap_mon_kl, n_dec, sizeof(fr_kl_result)) ||
                        (!p->dev_kl && !ref_rows(sch, n_dec)))) {
        for (int i = 0; i < n_dec; i++)   /* out of memory: monitoring stops, serving goes on */
            if (sch->row_samples[i]->shadow_seq >= 0) stop_shadow(sch, sch->row_samples[i]);
    } else if (sch->shadow) {
        int room = fr_shadow_free_blocks(sch->shadow);
        for (int i = 0; i < n_dec; i++) {
            sample *x = sch->row_samples[i];
            if (x->shadow_seq < 0) continue;
            int need = fr_shadow_blocks_needed(sch->shadow, x->shadow_seq);
            if (need > room) {
                stop_shadow(sch, x);
                continue;
            }
            room -= need;
            sch->mon_seqs[p->n_mon] = x->shadow_seq;
            sch->mon_toks[p->n_mon] = x->tokens[x->n - 1];
            sch->mon_served[p->n_mon] = i;
            sch->mon_rows[i] = p->n_mon++;
        }
    }
}

/* Where each row's output goes: only rows teacher-forced or monitored bring
 * their logits to the host (sch->keep, keep_at); every other row's tokens
 * are drawn on the backend (sch->sdraws, dslot). A batch with prefill
 * chunks draws the first tokens of the prompts it completes as well. */
static fr_status schedule_outputs(fr_scheduler *sch, step_plan *p)
{
    const int n_dec = p->n_dec;
    int n_draws = n_dec;
    for (int k = 0; k < p->n_jobs; k++) {
        const job *j = &sch->prefill[k];
        int lo, hi;
        job_range(j, &lo, &hi);
        if (j->done + sch->row_job_m[n_dec + k] >= j->n_total) n_draws += hi - lo;
    }
    if (grow_decode(sch, p->n_lrows > n_draws ? p->n_lrows : n_draws)) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    schedule_monitoring(sch, p);
    int n_keep = 0, d = 0;
    for (int i = 0; i < n_dec; i++) {
        const sample *x = sch->row_samples[i];
        const req *r = x->r;
        const int host = host_drawn(x);
        sch->keep_at[i] = -1;
        if (host || (x->shadow_seq >= 0 && !p->dev_kl)) {
            sch->keep_at[i] = n_keep;
            sch->keep[n_keep++] = sch->lrow[i];
        }
        /* A host-drawn row's draw on the backend (greedy) keeps the decode
         * batch whole; unused. */
        fr_decode_row dr = {.params = r->params, .sequence = x->stream, .step = (uint64_t)x->n};
        if (host) dr.params = (fr_sampling_params){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
        sch->drows[i] = dr;
        sch->dslot[i] = host ? -1 : d;
        if (p->fast || !host) sch->sdraws[d++] = (fr_step_draw){.row = sch->lrow[i], .d = dr};
    }
    for (int k = 0; k < p->n_jobs; k++) {
        const job *j = &sch->prefill[k];
        const int row = n_dec + k;
        const req *r = j->r;
        const int m = sch->row_job_m[row], last = sch->lrow[row] + (sch->rows[row].all_logits ? m - 1 : 0);
        sch->keep_at[row] = sch->dslot[row] = sch->plp_at[row] = -1;
        if (sch->rows[row].all_logits) {   /* every position's logits: the prompt log-probs */
            sch->plp_at[row] = n_keep;
            for (int t = 0; t < m; t++) sch->keep[n_keep++] = sch->lrow[row] + t;
        }
        if (j->done + m < j->n_total) continue;   /* not its last chunk: logits unused */
        int lo, hi;
        job_range(j, &lo, &hi);
        const int host = host_drawn(&r->samples[lo]);   /* the job's samples alike: none has a token yet, or one */
        int wanted = host;
        for (int i = lo; i < hi; i++)
            wanted |= j->sample >= 0 ? r->samples[i].shadow_seq >= 0 : r->samples[i].monitored && !r->samples[i].done;
        if (wanted && sch->plp_at[row] >= 0) {
            sch->keep_at[row] = sch->plp_at[row] + m - 1;
        } else if (wanted) {
            sch->keep_at[row] = n_keep;
            sch->keep[n_keep++] = last;
        }
        if (host) continue;
        sch->dslot[row] = d;
        for (int i = lo; i < hi; i++)
            sch->sdraws[d++] = (fr_step_draw){
                .row = last,
                .d = {.params = r->params, .sequence = r->samples[i].stream, .step = (uint64_t)r->samples[i].n}};
    }
    if (n_keep > sch->logit_rows) {
        float *g = realloc(sch->logits, sizeof(float) * (size_t)sch->vocab * (size_t)n_keep);
        if (!g) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
        sch->logits = g;
        sch->logit_rows = n_keep;
    }
    p->n_keep = n_keep;
    p->n_draws = d;
    return FR_OK;
}

/* The forward step, sampled where the logits are (on CUDA, the device). A
 * batch of decodes alone replays a decode graph, with the monitored
 * decodes' shadow carried in it or launched beside it when it can. */
static fr_status run_forward(fr_scheduler *sch, step_plan *p)
{
    const int n_dec = p->n_dec, n_mon = p->n_mon, n_keep = p->n_keep;
    fr_status st = FR_OK;
    int done = 0;
    if (p->dev_kl && n_mon && sch->carry) {
        /* The shadow's rows ride in the serving batch: one read of the
         * weights for both (rollout/model/runner_cuda.h). */
        st = fr_shadow_launch_carried(sch->shadow, sch->s, sch->rows, sch->drows, n_dec, sch->mon_seqs, sch->mon_toks,
                                      n_mon, sch->mon_served);
        if (st == FR_EUNSUPPORTED) {   /* refused before anything ran (tensor parallel): step it apart from now on */
            sch->carry = 0;
            st = FR_OK;
        } else {
            if (!st) st = fr_session_decode_wait(sch->s, sch->rows, n_dec, sch->dtok, sch->dlp, sch->keep, n_keep,
                                                 sch->logits);
            p->carried = !st;
            done = 1;
        }
    }
    if (!done && p->dev_kl && n_mon && sch->overlap) {
        /* The shadow's step runs beside the serving one on its own stream. */
        st = fr_session_decode_launch(sch->s, sch->rows, sch->drows, n_dec);
        if (!st && !fr_shadow_launch(sch->shadow, sch->mon_seqs, sch->mon_toks, n_mon)) p->shadow_launched = 1;
        if (!st) st = fr_session_decode_wait(sch->s, sch->rows, n_dec, sch->dtok, sch->dlp, sch->keep, n_keep,
                                             sch->logits);
        if (st && p->shadow_launched) {   /* finish the shadow's step; its monitoring ends with the failed step */
            fr_shadow_wait_kl(sch->shadow, sch->s, NULL, NULL, n_mon, NULL);
            p->shadow_launched = 0;
        }
        done = 1;
    }
    if (!done)
        st = p->fast ? fr_session_decode_keep(sch->s, sch->rows, sch->drows, n_dec, sch->dtok, sch->dlp, sch->keep,
                                              n_keep, sch->logits)
                     : fr_session_step_draw(sch->s, sch->rows, p->n_rows, sch->sdraws, p->n_draws, sch->dtok, sch->dlp,
                                            sch->keep, n_keep, sch->logits);
    return st;
}

/* A failed forward step: the step's work ends with reason error; nothing
 * else changes. */
static void fail_step(fr_scheduler *sch, const step_plan *p)
{
    int n_jobs = p->n_jobs;
    while (n_jobs > 0) {
        job j = sch->prefill[0];
        memmove(sch->prefill, sch->prefill + 1, sizeof(job) * (size_t)(sch->n_prefill - 1));
        sch->n_prefill--;
        n_jobs--;
        fail_job_samples(sch, &j, FR_FINISH_ERROR);
    }
    for (int i = 0; i < p->n_dec; i++) finish(sch, sch->row_samples[i], FR_FINISH_ERROR);
}

/* The monitored decodes' shadow step (the same input tokens) unless it ran
 * with the forward step; on a failure their monitoring stops. */
static void run_shadow(fr_scheduler *sch, step_plan *p)
{
    const int n_mon = p->n_mon;
    for (int m = 0; m < n_mon; m++) {
        const sample *x = sch->row_samples[sch->mon_served[m]];
        const int slot = sch->dslot[sch->mon_served[m]];
        sch->mon_chosen[m] = x->r->forced ? x->r->forced[x->n] : slot >= 0 ? sch->dtok[slot] : -1;
    }
    fr_status ms = FR_OK;
    if (p->carried) ms = fr_shadow_carried_kl(sch->shadow, sch->s, sch->mon_served, sch->mon_chosen, n_mon, sch->mon_kl);
    else if (p->shadow_launched)
        ms = fr_shadow_wait_kl(sch->shadow, sch->s, sch->mon_served, sch->mon_chosen, n_mon, sch->mon_kl);
    else if (n_mon && p->dev_kl)
        ms = fr_shadow_step_kl(sch->shadow, sch->s, sch->mon_seqs, sch->mon_toks, n_mon, sch->mon_served, sch->mon_chosen,
                               sch->mon_kl);
    else if (n_mon) ms = fr_shadow_step(sch->shadow, sch->mon_seqs, sch->mon_toks, n_mon, sch->ref);
    if (ms) {
        for (int i = 0; i < p->n_dec; i++)
            if (sch->row_samples[i]->shadow_seq >= 0) stop_shadow(sch, sch->row_samples[i]);
        p->n_mon = 0;
    }
}

/* The log-probs of the prompt tokens that follow the m positions a chunk of
 * job j ran (logits: their rows), from logits / temperature as a sampled
 * token's. A failure leaves NaN there (never expected: the logits are the
 * model's). */
static void prompt_logprobs(fr_scheduler *sch, const job *j, int m, const float *logits)
{
    req *r = j->r;
    for (int t = 0; r->plp && t < m; t++) {
        const int pos = j->done + t;
        if (pos + 1 >= r->n_prompt) break;
        const float *row = logits + (size_t)t * (size_t)sch->vocab;
        r->plp[pos] = fr_log_softmax(row, sch->vocab, r->params.temperature, sch->lsm) ? NAN : sch->lsm[r->prompt[pos + 1]];
    }
}

/* A step whose monitored rows' logits came to the host (prefill chunks in
 * it, or rows drawn on the host), on CUDA: the rows whose token is known
 * before postprocessing (drawn on the device, or teacher-forced) are
 * measured in one call on the device. Returns whether sch->mon_pre says
 * which rows have their result in sch->mres. */
static int premeasure(fr_scheduler *sch, const step_plan *p)
{
    const size_t V = (size_t)sch->vocab;
    if (!p->n_mon || p->dev_kl || !fr_shadow_on_device(sch->shadow) || !grow_batch(sch, p->n_mon) ||
        grow((void **)&sch->mon_pre, &sch->cap_mon_pre, p->n_mon, sizeof(int)))
        return 0;
    memset(sch->mon_pre, 0, sizeof(int) * (size_t)p->n_mon);
    int n = 0;
    for (int i = 0; i < p->n_dec; i++) {
        const sample *x = sch->row_samples[i];
        if (x->shadow_seq < 0 || sch->keep_at[i] < 0) continue;
        const int slot = sch->dslot[i];
        const int tok = slot >= 0 ? sch->dtok[slot] : x->r->forced ? x->r->forced[x->n] : -1;
        if (tok < 0 || tok >= sch->vocab) continue;   /* drawn on the host below: measured there */
        sch->mref[n] = sch->ref + (size_t)sch->mon_rows[i] * V;
        sch->mserved[n] = sch->logits + (size_t)sch->keep_at[i] * V;
        sch->mtok[n] = tok;
        sch->mrow[n++] = sch->mon_rows[i];
    }
    if (n == 0) return 1;
    const double t0 = fr_now_s();
    const int ok = !fr_shadow_measure_rows(sch->shadow, sch->mref, sch->mserved, sch->mtok, n, sch->mres);
    sch->st.kl_s += fr_now_s() - t0;
    for (int j = 0; ok && j < n; j++) sch->mon_pre[sch->mrow[j]] = j + 1;
    return 1;
}

/* After the step: decode tokens and their D_t, then the prefills' progress
 * (a job whose last chunk ran starts its samples). */
static void postprocess(fr_scheduler *sch, const step_plan *p)
{
    const size_t V = (size_t)sch->vocab;
    const int n_dec = p->n_dec, pre = premeasure(sch, p);
    for (int i = 0; i < n_dec; i++) {
        sample *x = sch->row_samples[i];
        const float *lg = sch->keep_at[i] >= 0 ? sch->logits + (size_t)sch->keep_at[i] * V : NULL;
        const int slot = sch->dslot[i];
        fr_finish_reason why = slot >= 0 ? accept(sch, x, sch->dtok[slot], sch->dlp[slot]) : draw(sch, x, lg);
        if (p->n_mon && x->shadow_seq >= 0 && why != FR_FINISH_ERROR) {
            const int m = sch->mon_rows[i], at = pre ? sch->mon_pre[m] - 1 : -1;
            if (p->dev_kl) record(sch, x, &sch->mon_kl[m]);
            else if (at >= 0 && sch->mtok[at] == x->tokens[x->n - 1]) record(sch, x, &sch->mres[at]);
            else if (lg) measure(sch, x, lg, sch->ref + (size_t)m * V);
        }
        if (why) finish(sch, x, why);
    }
    /* The batch's jobs are the first n_jobs of the prefill list. */
    int kept = 0;
    for (int k = 0; k < p->n_jobs; k++) {
        job j = sch->prefill[kept];
        int m = sch->row_job_m[n_dec + k];
        if (sch->plp_at[n_dec + k] >= 0) prompt_logprobs(sch, &j, m, sch->logits + (size_t)sch->plp_at[n_dec + k] * V);
        j.done += m;
        sch->st.prefill_tokens += m;
        if (j.done < j.n_total) {
            sch->prefill[kept++].done = j.done;
            continue;
        }
        memmove(&sch->prefill[kept], &sch->prefill[kept + 1], sizeof(job) * (size_t)(sch->n_prefill - kept - 1));
        sch->n_prefill--;
        const int row = n_dec + k, slot = sch->dslot[row];
        complete_job(sch, &j, sch->keep_at[row] >= 0 ? sch->logits + (size_t)sch->keep_at[row] * V : NULL,
                     slot >= 0 ? sch->dtok + slot : NULL, slot >= 0 ? sch->dlp + slot : NULL);
    }
}

fr_status fr_scheduler_step(fr_scheduler *sch)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    step_plan p = {0};
    fr_status st = schedule_blocks(sch);
    if (!st) st = schedule_batch(sch, &p);
    if (st || p.n_rows == 0) return st;
    if ((st = schedule_outputs(sch, &p))) return st;
    double t0 = fr_now_s();
    if ((st = run_forward(sch, &p))) {
        fail_step(sch, &p);
        return st;
    }
    double t1 = fr_now_s();
    sch->st.forward_s += t1 - t0;
    sch->st.steps++;
    sch->st.decode_steps += p.fast;
    sch->st.carried_steps += p.carried;
    run_shadow(sch, &p);
    double t2 = fr_now_s();
    sch->st.shadow_s += t2 - t1;
    postprocess(sch, &p);
    sch->st.host_s += fr_now_s() - t2;
    return FR_OK;
}

void fr_scheduler_stats_add(fr_scheduler_stats *a, const fr_scheduler_stats *s)
{
    a->running += s->running;
    a->prefilling += s->prefilling;
    a->waiting += s->waiting;
    a->preemptions += s->preemptions;
    a->tokens_generated += s->tokens_generated;
    a->prefill_tokens += s->prefill_tokens;
    a->steps += s->steps;
    a->finished += s->finished;
    a->kv_blocks_used += s->kv_blocks_used;
    a->kv_blocks_free += s->kv_blocks_free;
    a->monitored += s->monitored;
    /* -1 says no shadow is open: it counts as none once another engine has one */
    if (s->shadow_blocks_free >= 0)
        a->shadow_blocks_free = (a->shadow_blocks_free > 0 ? a->shadow_blocks_free : 0) + s->shadow_blocks_free;
}

void fr_scheduler_stats_put(fr_rank_buf *b, const fr_scheduler_stats *s)
{
    fr_rank_put_i32(b, s->running);
    fr_rank_put_i32(b, s->prefilling);
    fr_rank_put_i32(b, s->waiting);
    fr_rank_put_u64(b, (uint64_t)s->preemptions);
    fr_rank_put_u64(b, (uint64_t)s->tokens_generated);
    fr_rank_put_u64(b, (uint64_t)s->prefill_tokens);
    fr_rank_put_u64(b, (uint64_t)s->steps);
    fr_rank_put_u64(b, (uint64_t)s->finished);
    fr_rank_put_i32(b, s->kv_blocks_used);
    fr_rank_put_i32(b, s->kv_blocks_free);
    fr_rank_put_u64(b, s->weight_version);
    fr_rank_put_i32(b, s->monitored);
    fr_rank_put_i32(b, s->shadow_blocks_free);
}

void fr_scheduler_stats_read(fr_rank_reader *r, fr_scheduler_stats *s)
{
    memset(s, 0, sizeof *s);
    s->running = fr_rank_get_i32(r);
    s->prefilling = fr_rank_get_i32(r);
    s->waiting = fr_rank_get_i32(r);
    s->preemptions = (long long)fr_rank_get_u64(r);
    s->tokens_generated = (long long)fr_rank_get_u64(r);
    s->prefill_tokens = (long long)fr_rank_get_u64(r);
    s->steps = (long long)fr_rank_get_u64(r);
    s->finished = (long long)fr_rank_get_u64(r);
    s->kv_blocks_used = fr_rank_get_i32(r);
    s->kv_blocks_free = fr_rank_get_i32(r);
    s->weight_version = fr_rank_get_u64(r);
    s->monitored = fr_rank_get_i32(r);
    s->shadow_blocks_free = fr_rank_get_i32(r);
}

fr_status fr_scheduler_run(fr_scheduler *sch)
{
    fr_status first = FR_OK;
    while (!fr_scheduler_idle(sch)) {
        long long before = sch->st.steps + sch->st.finished;
        fr_status st = fr_scheduler_step(sch);
        if (st && !first) first = st;
        if (st && sch->st.steps + sch->st.finished == before) return st;   /* no progress possible */
    }
    return first;
}

static int abort_matching(fr_scheduler *sch, int all, uint64_t id)
{
    int ended = 0;
    for (int i = 0; i < sch->n_reqs;) {
        req *r = sch->reqs[i];
        if (!all && r->id != id) { i++; continue; }
        /* Drop its prefill work, then end its open samples. */
        for (int k = 0; k < sch->n_waiting;)
            if (sch->waiting[k].r == r) {
                free(sch->waiting[k].buf);
                memmove(&sch->waiting[k], &sch->waiting[k + 1], sizeof(job) * (size_t)(sch->n_waiting - k - 1));
                sch->n_waiting--;
            } else k++;
        for (int k = 0; k < sch->n_prefill;)
            if (sch->prefill[k].r == r) {
                fr_kv_seq_free(sch->s->kv, sch->prefill[k].seq);
                free(sch->prefill[k].buf);
                memmove(&sch->prefill[k], &sch->prefill[k + 1], sizeof(job) * (size_t)(sch->n_prefill - k - 1));
                sch->n_prefill--;
            } else k++;
        int left = r->open, n = r->n;
        ended += left;
        for (int s = 0; left > 0 && s < n; s++)
            if (!r->samples[s].done) {
                left--;
                finish(sch, &r->samples[s], FR_FINISH_ABORT);   /* the last frees r and removes it */
            }
    }
    return ended;
}

fr_status fr_scheduler_abort(fr_scheduler *sch, uint64_t id, int *n_ended)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    int n = abort_matching(sch, 0, id);
    if (n_ended) *n_ended = n;
    return FR_OK;
}

fr_status fr_scheduler_abort_all(fr_scheduler *sch, int *n_ended)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    int n = abort_matching(sch, 1, 0);
    if (n_ended) *n_ended = n;
    return FR_OK;
}

int fr_scheduler_next_result(fr_scheduler *sch, fr_sample_result *out)
{
    if (!sch || !out || sch->first_result >= sch->n_results) return 0;
    *out = sch->results[sch->first_result++];
    if (sch->first_result == sch->n_results) sch->first_result = sch->n_results = 0;
    return 1;
}

void fr_scheduler_stats_get(const fr_scheduler *sch, fr_scheduler_stats *out)
{
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!sch) return;
    *out = sch->st;
    out->running = sch->n_running;
    out->prefilling = sch->n_prefill;
    out->waiting = 0;
    for (int k = 0; k < sch->n_waiting; k++) out->waiting += job_slots(&sch->waiting[k]);
    out->kv_blocks_free = fr_kv_free_blocks(sch->s->kv);
    out->kv_blocks_used = sch->n_blocks - out->kv_blocks_free;
    out->weight_version = sch->version;
    out->monitored = 0;
    for (int i = 0; i < sch->n_running; i++) out->monitored += sch->running[i]->shadow_seq >= 0;
    out->shadow_blocks_free = sch->shadow ? fr_shadow_free_blocks(sch->shadow) : -1;
    int n_main, n_shadow = 0;
    double s_main, s_shadow = 0.0;
    fr_session_capture_stats(sch->s, &n_main, &s_main);
    if (sch->shadow) fr_shadow_capture_stats(sch->shadow, &n_shadow, &s_shadow);
    out->graph_captures = n_main + n_shadow;
    out->graph_capture_s = s_main + s_shadow;
}

fr_status fr_scheduler_recompute_all(fr_scheduler *sch, int *n_preempted)
{
    if (n_preempted) *n_preempted = 0;
    if (!sch) return fr_fail(FR_EINVAL, "fr_scheduler_recompute_all: no scheduler");
    int any = 1, n = 0;
    /* newest first, each to the front of the queue: the oldest ends up first again */
    while (any) {
        preempt_newest(sch, &any);
        n += any;
    }
    if (n_preempted) *n_preempted = n;
    return FR_OK;
}

void fr_scheduler_set_weight_version(fr_scheduler *sch, uint64_t version)
{
    if (sch) sch->version = version;
}

const fr_div_aggregates *fr_scheduler_divergence(const fr_scheduler *sch) { return sch ? &sch->agg : NULL; }

const fr_serving_stats *fr_scheduler_serving(const fr_scheduler *sch) { return sch ? &sch->serving : NULL; }
