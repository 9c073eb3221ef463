/* After a step (docs/scheduler.md): each row's token accepted (drawn on the
 * backend, or here from its logits: teacher forcing, barred stop ids, top
 * log-probs), its divergence recorded, finished samples ended with their
 * results, prefills advanced and completed prompts started as samples. */
#include "rollout/engine/scheduler_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

/* The serving figures of a sample that ends now: its reason, latencies, and
 * (monitored) its mean KL under the version of its last token. */
static void count_end(fr_scheduler *sch, const sample *x, fr_finish_reason why)
{
    fr_serving_stats *v = &sch->serving;
    if ((int)why > 0 && (int)why < FR_FINISH_KINDS) v->finished[why]++;
    const double now = fr_now_s();
    const int made = x->n - x->start;
    fr_hist_add(&v->e2e, now - x->r->t_submit);
    if (made >= 2) fr_hist_add(&v->tpot, (now - x->t_first) / (double)(made - 1));
    if (x->monitored && made > 0)
        fr_div_aggregates_add_sample(&sch->agg, x->versions[x->n - 1], x->r->report_id, (int)x->stream, &x->div);
}

/* A continuation's result holds the tokens it made, not the ones it began
 * with: its per-token arrays move down by x->start. */
static void drop_continued(const fr_scheduler *sch, sample *x)
{
    const size_t k = (size_t)x->start, n = (size_t)(x->n - x->start), top = (size_t)x->r->top_n;
    const size_t route = (size_t)sch->route_layers * (size_t)sch->route_k * (size_t)sch->route_width;
    memmove(x->tokens, x->tokens + k, sizeof(int) * n);
    memmove(x->logprobs, x->logprobs + k, sizeof(float) * n);
    memmove(x->versions, x->versions + k, sizeof(uint64_t) * n);
    if (x->kl) memmove(x->kl, x->kl + k, sizeof(float) * n);
    if (x->top_ids) memmove(x->top_ids, x->top_ids + k * top, sizeof(int) * n * top);
    if (x->top_lps) memmove(x->top_lps, x->top_lps + k * top, sizeof(float) * n * top);
    if (x->routes) memmove(x->routes, x->routes + k * route, n * route);
}

/* Ends a sample: frees its sequence, delivers its result, and frees the
 * request with its last sample (the request must not be used after). */
void sch_finish(fr_scheduler *sch, sample *x, fr_finish_reason why)
{
    if (x->done) return;
    x->done = 1;
    if (x->seq >= 0) {
        sch_remove_running(sch, x);
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
    if (x->start > 0) drop_continued(sch, x);
    fr_sample_result res = {.request_id = r->id, .group = r->group, .sample = (int)x->stream, .start = x->start,
                            .tokens = x->tokens, .logprobs = x->logprobs, .n_tokens = x->n - x->start, .finish = why,
                            .preemptions = x->preemptions, .versions = x->versions,
                            .monitored = x->monitored, .div = x->div, .kl = x->kl, .top_n = r->top_n,
                            .top_ids = x->top_ids, .top_logprobs = x->top_lps};
    if (x->routes) {
        res.routed_experts = x->routes;
        res.route_layers = sch->route_layers;
        res.route_k = sch->route_k;
        res.route_width = sch->route_width;
        x->routes = NULL;
    }
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
    sch_text_result(x, &res);
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
        if (sch_grow((void **)&sch->results, &sch->cap_results, sch->n_results + 1, sizeof *sch->results)) {
            /* Out of memory: the result cannot be kept; drop its arrays but
             * never the accounting (the caller still sees the count). */
            fr_sample_result_free(&res);
        } else {
            sch->results[sch->n_results++] = res;
        }
    }
    if (--r->open == 0) sch_remove_req(sch, r);
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

/* Records tok (drawn with log-prob lp, by a row whose routed experts are
 * route, or NULL) as x's next token; returns its finish reason, or
 * FR_FINISH_NONE when it goes on. */
static fr_finish_reason accept(fr_scheduler *sch, sample *x, int tok, float lp, const uint16_t *route)
{
    const req *r = x->r;
    if (tok < 0 || tok >= sch->vocab) return FR_FINISH_ERROR;   /* the device sampler's row error */
    sch_keep_route(sch, x, route);
    x->tokens[x->n] = tok;
    x->versions[x->n] = sch->version;
    x->logprobs[x->n++] = lp;
    sch->st.tokens_generated++;
    if (x->n == x->start + 1) first_token(sch, x);
    if (sch->cfg.on_token) sch->cfg.on_token(sch->cfg.user, r->id, (int)x->stream, x->n - 1, tok, lp);
    const fr_finish_reason by_text = sch_text_token(sch, x, tok);   /* a stop string, before the stop ids */
    if (by_text) return by_text;
    if (is_stop(r, tok)) return FR_FINISH_STOP;
    if (x->n >= r->max_tokens) return FR_FINISH_LENGTH;
    return FR_FINISH_NONE;
}

/* Whether x's next token is drawn on the host, from its logits: teacher
 * forcing, top log-probs, stop ids barred by min_tokens, min_p and the
 * penalties need the CPU sampler's extras (the backend's sampler draws the
 * rest). */
int sch_host_drawn(const sample *x)
{
    const req *r = x->r;
    return r->forced || r->top_n > 0 || (r->n_stop > 0 && x->n < r->min_tokens) || fr_penalties_active(&r->pen);
}

/* Draws the next token of x from logits (host), then accepts it. */
static fr_finish_reason draw(fr_scheduler *sch, sample *x, const float *logits, const uint16_t *route)
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
                               .top_ids = top_ids, .top_logprobs = top_lps, .pen = r->pen, .prompt = r->prompt,
                               .n_prompt = r->n_prompt, .output = x->tokens, .n_output = x->n};
        if (fr_sample_ex(sch->sampler, logits, &r->params, x->stream, (uint64_t)x->n, &ex, &tok, &lp))
            return FR_FINISH_ERROR;
    }
    return accept(sch, x, tok, lp, route);
}

/* x's next token: the one drawn for it on the backend (pre_tok[i], pre_lp[i])
 * when there is one, else drawn here from logits. */
static fr_finish_reason take(fr_scheduler *sch, sample *x, const float *logits, const int *pre_tok,
                             const float *pre_lp, int i, const uint16_t *route)
{
    return pre_tok ? accept(sch, x, pre_tok[i], pre_lp[i], route) : draw(sch, x, logits, route);
}

/* A monitored continuation's shadow: one prefill of its prompt and
 * continued tokens (their distribution for its next token in sch->ref);
 * 1 when it has one. */
static int start_shadow(fr_scheduler *sch, sample *x, const job *j)
{
    if (!x->monitored || x->shadow_seq >= 0 || !sch_shadow_of(sch) || !sch_ref_rows(sch, 1)) return 0;
    const double t0 = fr_now_s();
    const int need = (j->n_total + T - 1) / T + 1;
    int ok = fr_shadow_free_blocks(sch->shadow) >= need &&
             !fr_shadow_start(sch->shadow, j->tokens, j->n_total, &x->shadow_seq, sch->ref);
    if (!ok) x->shadow_seq = -1;   /* no room: it goes unmonitored */
    sch->st.shadow_start_s += fr_now_s() - t0;
    return ok;
}

/* A prefill's last chunk ran: its samples start. logits: the chunk's last
 * row (NULL when no sample needs it on the host); pre_tok/pre_lp: the first
 * tokens drawn on the backend, by sample index (NULL: draw here); route: the
 * routed experts of the chunk's last row (NULL when not recorded). */
static void complete_job(fr_scheduler *sch, job *j, const float *logits, const int *pre_tok, const float *pre_lp,
                         const uint16_t *route)
{
    req *r = j->r;
    if (j->sample >= 0) {
        sample *x = &r->samples[j->sample];
        const int shadow = j->cont && logits && start_shadow(sch, x, j);
        free(j->buf);
        x->seq = j->seq;
        x->admit = j->admit;
        sch->running[sch->n_running++] = x;
        fr_finish_reason why = take(sch, x, logits, pre_tok, pre_lp, 0, route);
        if (why != FR_FINISH_ERROR && shadow) sch_measure_first(sch, &x, 1, logits);
        else if (why != FR_FINISH_ERROR && logits && !j->cont) sch_shadow_catch_up(sch, x, logits);
        if (why) sch_finish(sch, x, why);
        return;
    }
    /* The monitored samples' shadow: one prefill of the prompt, forked. */
    int shadow_src = -1;
    const int lo = j->lo, hi = j->hi;
    const double t_start = fr_now_s();
    for (int i = lo; i < hi; i++) {
        sample *x = &r->samples[i];
        if (x->done || !x->monitored || !sch_shadow_of(sch)) continue;
        if (!sch_ref_rows(sch, 1)) break;
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
        sch_fail_job_samples(sch, j, FR_FINISH_ERROR);
        return;
    }
    int n_end = 0, n_mon = 0, seq = j->seq;
    for (int i = lo; i < hi; i++) {
        sample *x = &r->samples[i];
        if (x->done) continue;
        fr_finish_reason why = take(sch, x, logits, pre_tok, pre_lp, i - lo, route);
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
    sch_measure_first(sch, mon, n_mon, logits);
    for (int k = 0; k < n_end; k++) sch_finish(sch, end[k], whys[k]);   /* the last may free r */
    free(end);
    free(mon);
    free(whys);
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

/* After the step: decode tokens and their D_t, then the prefills' progress
 * (a job whose last chunk ran starts its samples). */
void sch_postprocess(fr_scheduler *sch, const step_plan *p)
{
    const size_t V = (size_t)sch->vocab;
    const int n_dec = p->n_dec, pre = sch_premeasure(sch, p);
    for (int i = 0; i < n_dec; i++) {
        sample *x = sch->row_samples[i];
        const float *lg = sch->keep_at[i] >= 0 ? sch->logits + (size_t)sch->keep_at[i] * V : NULL;
        const int slot = sch->dslot[i];
        const uint16_t *route = sch_route_of(sch, i);
        fr_finish_reason why =
            slot >= 0 ? accept(sch, x, sch->dtok[slot], sch->dlp[slot], route) : draw(sch, x, lg, route);
        if (p->n_mon && x->shadow_seq >= 0 && why != FR_FINISH_ERROR) {
            const int m = sch->mon_rows[i], at = pre ? sch->mon_pre[m] - 1 : -1;
            if (p->dev_kl) sch_record(sch, x, &sch->mon_kl[m]);
            else if (at >= 0 && sch->mtok[at] == x->tokens[x->n - 1]) sch_record(sch, x, &sch->mres[at]);
            else if (lg) sch_measure(sch, x, lg, sch->ref + (size_t)m * V);
        }
        if (why) sch_finish(sch, x, why);
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
                     slot >= 0 ? sch->dtok + slot : NULL, slot >= 0 ? sch->dlp + slot : NULL, sch_route_of(sch, row));
    }
}
