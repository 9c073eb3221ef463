/* The continuous-batching scheduler (docs/scheduler.md states the policy):
 * creation, requests in, results and figures out. A step's concerns live
 * beside it: admission and preemption (scheduler_admit.c), the batch of a
 * step (scheduler_plan.c), running it (scheduler_run.c), what its tokens
 * do (scheduler_post.c), and the monitored samples' shadow
 * (scheduler_shadow.c); scheduler_internal.h is what they share. */
#include "rollout/engine/scheduler_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

int sch_grow(void **p, int *cap, int need, size_t elem)
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

static void free_req(req *r)
{
    for (int i = 0; i < r->n; i++) {
        free(r->samples[i].tokens);
        free(r->samples[i].logprobs);
        free(r->samples[i].versions);
        free(r->samples[i].kl);
        free(r->samples[i].top_ids);
        free(r->samples[i].top_lps);
        free(r->samples[i].routes);
        fr_sample_text_free(&r->samples[i].text);
    }
    free(r->samples);
    free(r->plp);
    free(r->prompt);
    free(r->stop);
    free(r->forced);
    free(r);
}

void sch_remove_req(fr_scheduler *sch, req *r)
{
    for (int i = 0; i < sch->n_reqs; i++)
        if (sch->reqs[i] == r) {
            memmove(&sch->reqs[i], &sch->reqs[i + 1], sizeof(req *) * (size_t)(sch->n_reqs - i - 1));
            sch->n_reqs--;
            sch->route_reqs -= r->routes;
            break;
        }
    free_req(r);
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
    sch->route_layers = fr_model_moe_layers(&s->model->cfg);
    sch->route_k = sch->route_layers ? s->model->cfg.experts_per_tok : 0;
    sch->route_width = s->model->cfg.num_experts > 256 ? 2 : 1;
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
    /* With monitoring on, the shadow opens with the scheduler, as the
     * serving session opened before it: its allocations and graph set-up
     * are then paid at start-up, not by the first monitored requests
     * (shadow_open_s still counts it). A failure only turns monitoring off,
     * as it does when the shadow is opened later. */
    if (c.kl_sample_rate > 0.0) (void)sch_shadow_of(sch);
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
    free(sch->route_at);
    free(sch->route_trow);
    free(sch->route_buf);
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

/* A continuation's sample begins with the tokens it already made; their
 * log-probs and versions are never reported (the result starts after them). */
static void load_continued(sample *x, const fr_request_spec *spec)
{
    memcpy(x->tokens, spec->continue_tokens, sizeof(int) * (size_t)spec->n_continue);
    for (int i = 0; i < spec->n_continue; i++) {
        x->logprobs[i] = NAN;
        x->versions[i] = 0;
    }
    x->n = x->start = spec->n_continue;
}

/* The request's samples and arrays; 0 when out of memory (r then holds
 * what was allocated, for free_req). */
static int alloc_samples(fr_scheduler *sch, req *r, const fr_request_spec *spec)
{
    const int max_tokens = r->max_tokens;
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
        x->monitored = spec->monitor == 1 || (spec->monitor != 0 && sch_chosen(spec->id, i, sch->cfg.kl_sample_rate));
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
        if (ok && r->routes) {
            const size_t route_bytes = (size_t)sch->route_layers * (size_t)sch->route_k * (size_t)sch->route_width;
            ok = (x->routes = malloc(route_bytes * (size_t)max_tokens)) != NULL;
        }
        if (ok && spec->n_continue > 0) load_continued(x, spec);
    }
    return ok;
}

/* The request's prefill work at the back of the waiting queue: a prefill
 * job per max_seqs samples, or a continuation's one job, which prefills the
 * prompt and the continued tokens (room made first, so that no push fails
 * halfway); 0 when out of memory. */
static int queue_jobs(fr_scheduler *sch, req *r, const fr_request_spec *spec)
{
    if (spec->n_continue > 0) {
        job j = {.r = r, .sample = 0, .seq = -1, .cont = 1, .n_total = r->n_prompt + spec->n_continue};
        if (!(j.buf = malloc(sizeof(int) * (size_t)j.n_total))) return 0;
        memcpy(j.buf, r->prompt, sizeof(int) * (size_t)r->n_prompt);
        memcpy(j.buf + r->n_prompt, spec->continue_tokens, sizeof(int) * (size_t)spec->n_continue);
        j.tokens = j.buf;
        if (!sch_push_waiting(sch, j, 0)) return 1;
        free(j.buf);
        return 0;
    }
    int jobs = (spec->n + sch->cfg.max_seqs - 1) / sch->cfg.max_seqs;
    int ok = !sch_grow((void **)&sch->waiting, &sch->cap_waiting, sch->n_waiting + jobs, sizeof(job));
    for (int lo = 0; ok && lo < spec->n; lo += sch->cfg.max_seqs) {
        int hi = spec->n - lo > sch->cfg.max_seqs ? lo + sch->cfg.max_seqs : spec->n;
        job j = {.r = r, .sample = -1, .lo = lo, .hi = hi, .tokens = r->prompt, .n_total = r->n_prompt, .seq = -1};
        ok = !sch_push_waiting(sch, j, 0);
    }
    return ok;
}

fr_status fr_scheduler_submit(fr_scheduler *sch, const fr_request_spec *spec)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    fr_status st = fr_request_spec_check(spec, sch->vocab);
    if (!st) st = sch_text_check(sch, spec);
    if (st) return st;
    const fr_model_config *mc = &sch->s->model->cfg;
    if (spec->return_routed_experts && !sch->route_layers)
        return fr_fail(FR_EINVAL, "request %llu: return_routed_experts: the model has no mixture-of-experts layer",
                       (unsigned long long)spec->id);
    if (spec->n_prompt >= mc->max_position)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) does not fit the context window of %d",
                       (unsigned long long)spec->id, spec->n_prompt, mc->max_position);
    int max_tokens = spec->max_tokens;
    if (max_tokens > mc->max_position - spec->n_prompt) max_tokens = mc->max_position - spec->n_prompt;
    if (sch_blocks_for(spec->n_prompt + max_tokens) > sch->n_blocks)
        return fr_fail(FR_EINVAL, "request %llu: prompt (%d) + max_tokens (%d) needs %d KV blocks, the cache has %d",
                       (unsigned long long)spec->id, spec->n_prompt, max_tokens,
                       sch_blocks_for(spec->n_prompt + max_tokens), sch->n_blocks);
    if (spec->n_continue >= max_tokens)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) and %d continued tokens leave nothing to "
                                  "generate in the context window of %d",
                       (unsigned long long)spec->id, spec->n_prompt, spec->n_continue, mc->max_position);
    req *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    if (spec->forced && spec->n_forced < max_tokens) max_tokens = spec->n_forced;
    *r = (req){.id = spec->id, .group = spec->group, .n_prompt = spec->n_prompt, .n = spec->n,
               .max_tokens = max_tokens, .params = spec->params, .n_stop = spec->n_stop, .open = spec->n,
               .monitor = spec->monitor, .per_token_kl = spec->per_token_kl, .t_submit = fr_now_s(),
               .report_id = spec->has_report_id ? spec->report_id : spec->id, .min_tokens = spec->min_tokens,
               .top_n = spec->top_logprobs, .routes = spec->return_routed_experts, .pen = spec->penalties};
    int ok = alloc_samples(sch, r, spec);
    if (ok) ok = !sch_text_open(sch, r, spec);
    if (ok) ok = !sch_grow((void **)&sch->reqs, &sch->cap_reqs, sch->n_reqs + 1, sizeof(req *));
    if (ok) {
        memcpy(r->prompt, spec->prompt, sizeof(int) * (size_t)spec->n_prompt);
        if (spec->n_stop > 0) memcpy(r->stop, spec->stop_ids, sizeof(int) * (size_t)spec->n_stop);
        ok = queue_jobs(sch, r, spec);
    }
    if (!ok) {
        if (r->samples) free_req(r);
        else { free(r->prompt); free(r->stop); free(r->plp); free(r); }
        return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    }
    sch->reqs[sch->n_reqs++] = r;
    sch->route_reqs += r->routes;
    for (int i = 0; i < r->n; i++)
        if (r->samples[i].monitored) {
            sch_shadow_of(sch);   /* a failure is the prompt's completion's to handle: monitoring off */
            break;
        }
    return FR_OK;
}

int fr_scheduler_idle(const fr_scheduler *sch) { return !sch || sch->n_reqs == 0; }

void fr_scheduler_set_mode(fr_scheduler *sch, fr_scheduler_mode mode)
{
    if (sch && (mode == FR_SCHED_RUN || mode == FR_SCHED_HOLD || mode == FR_SCHED_FREEZE)) sch->mode = mode;
}

fr_scheduler_mode fr_scheduler_mode_of(const fr_scheduler *sch) { return sch ? sch->mode : FR_SCHED_RUN; }

int fr_scheduler_in_flight(const fr_scheduler *sch)
{
    if (!sch) return 0;
    int n = sch->n_running;
    for (int k = 0; k < sch->n_prefill; k++) n += sch_job_slots(&sch->prefill[k]);
    for (int k = 0; k < sch->n_waiting; k++)
        if (sch->waiting[k].started) n += sch_job_slots(&sch->waiting[k]);
    return n;
}

/* Started work sits at the front of the waiting queue (preempted work
 * re-enters there), so under FR_SCHED_HOLD the head says whether any is
 * left to admit. */
int fr_scheduler_busy(const fr_scheduler *sch)
{
    if (!sch || sch->n_reqs == 0 || sch->mode == FR_SCHED_FREEZE) return 0;
    if (sch->mode == FR_SCHED_RUN) return 1;
    return sch->n_running > 0 || sch->n_prefill > 0 || (sch->n_waiting > 0 && sch->waiting[0].started);
}

fr_status fr_scheduler_run(fr_scheduler *sch)
{
    fr_status first = FR_OK;
    while (fr_scheduler_busy(sch)) {
        long long before = sch->st.steps + sch->st.finished;
        fr_status st = fr_scheduler_step(sch);
        if (st && !first) first = st;
        if (st && sch->st.steps + sch->st.finished == before) return st;   /* no progress possible */
    }
    return first;
}

fr_status fr_scheduler_abort(fr_scheduler *sch, uint64_t id, int *n_ended)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    int n = sch_abort_matching(sch, 0, id);
    if (n_ended) *n_ended = n;
    return FR_OK;
}

fr_status fr_scheduler_abort_all(fr_scheduler *sch, int *n_ended)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    int n = sch_abort_matching(sch, 1, 0);
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
    for (int k = 0; k < sch->n_waiting; k++) out->waiting += sch_job_slots(&sch->waiting[k]);
    out->kv_blocks_free = fr_kv_free_blocks(sch->s->kv);
    out->kv_blocks_used = sch->n_blocks - out->kv_blocks_free;
    out->in_flight = fr_scheduler_in_flight(sch);
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
        sch_preempt_newest(sch, &any);
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
    a->in_flight += s->in_flight;
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
    fr_rank_put_i32(b, s->in_flight);
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
    s->in_flight = fr_rank_get_i32(r);
    s->weight_version = fr_rank_get_u64(r);
    s->monitored = fr_rank_get_i32(r);
    s->shadow_blocks_free = fr_rank_get_i32(r);
}
