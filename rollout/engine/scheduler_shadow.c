/* Divergence monitoring in the scheduler (docs/scheduler.md, rollout/engine/
 * divergence.h): which samples run a BF16-KV shadow, the shadow's room and
 * steps, and D_t of the monitored tokens, measured on the device when the
 * shadow is there. */
#include "rollout/engine/scheduler_internal.h"

#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

/* Whether sample `index` of request `id` runs a shadow at rate `rate`: a
 * hash of the pair against the rate, the same on every rank. */
int sch_chosen(uint64_t id, int index, double rate)
{
    if (rate <= 0.0) return 0;
    if (rate >= 1.0) return 1;
    uint64_t z = id * 0x9e3779b97f4a7c15ull + (uint64_t)index * 0xbf58476d1ce4e5b9ull + 0x94d049bb133111ebull;
    z = (z ^ (z >> 31)) * 0xd6e8feb86659fd03ull;
    z ^= z >> 29;
    return (double)(z >> 11) * 0x1p-53 < rate;
}

/* The shadow: opened by fr_scheduler_new when kl_sample_rate > 0, else on
 * first use (fr_scheduler_submit asks for it with the first sample a
 * request marks monitored, so that its allocation is not paid in a step);
 * NULL (monitoring off) when it cannot be. */
fr_shadow *sch_shadow_of(fr_scheduler *sch)
{
    if (sch->shadow || sch->shadow_failed) return sch->shadow;
    /* the configuration's count, else what sizing the cache by memory left for
     * the shadow, else as many as the cache */
    int blocks = sch->cfg.shadow_blocks > 0 ? sch->cfg.shadow_blocks
                 : sch->s->shadow_blocks > 0 ? sch->s->shadow_blocks
                                             : sch->n_blocks;
    const double t0 = fr_now_s();
    if (fr_shadow_open(sch->s, sch->cfg.max_seqs, blocks, &sch->shadow)) {
        sch->shadow_failed = 1;
        sch->shadow = NULL;
    }
    sch->st.shadow_open_s += fr_now_s() - t0;
    return sch->shadow;
}

/* Room for n rows of shadow logits. */
int sch_ref_rows(fr_scheduler *sch, int n)
{
    if (n <= sch->ref_rows) return 1;
    float *g = realloc(sch->ref, sizeof(float) * (size_t)sch->vocab * (size_t)n);
    if (!g) return 0;
    sch->ref = g;
    sch->ref_rows = n;
    return 1;
}

/* Records D_t of x's last drawn token. */
void sch_record(fr_scheduler *sch, sample *x, const fr_kl_result *k)
{
    const int i = x->n - 1;
    fr_div_summary_add(&x->div, k);
    if (x->kl) x->kl[i] = (float)k->kl;
    fr_div_aggregates_add(&sch->agg, x->versions[i], (long)x->r->n_prompt + i, k);
}

/* D_t of x's last drawn token: the shadow's distribution ref against the
 * serving one, logits. */
void sch_measure(fr_scheduler *sch, sample *x, const float *logits, const float *ref)
{
    fr_kl_result k;
    double t0 = fr_now_s();
    fr_status st = fr_kl_topk(ref, logits, sch->vocab, FR_KL_TOP_K, x->tokens[x->n - 1], &k);
    sch->st.kl_s += fr_now_s() - t0;
    if (!st) sch_record(sch, x, &k);
}

/* Room for n rows measured from the host in one call. */
static int grow_batch(fr_scheduler *sch, int n)
{
    return !sch_grow((void **)&sch->mref, &sch->cap_mref, n, sizeof *sch->mref) &&
           !sch_grow((void **)&sch->mserved, &sch->cap_mserved, n, sizeof *sch->mserved) &&
           !sch_grow((void **)&sch->mtok, &sch->cap_mtok, n, sizeof(int)) &&
           !sch_grow((void **)&sch->mrow, &sch->cap_mrow, n, sizeof(int)) &&
           !sch_grow((void **)&sch->mres, &sch->cap_mres, n, sizeof(fr_kl_result));
}

/* D_t of the first tokens of the n samples xs of one prompt: the shadow's
 * prefill distribution (sch->ref) against the served one, logits; in one
 * call on the device when the shadow is there, else each on the host. */
void sch_measure_first(fr_scheduler *sch, sample **xs, int n, const float *logits)
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
        for (int j = 0; done && j < n; j++) sch_record(sch, xs[j], &sch->mres[j]);
    }
    for (int j = 0; !done && j < n; j++) sch_measure(sch, xs[j], logits, sch->ref);
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
void sch_shadow_catch_up(fr_scheduler *sch, sample *x, const float *logits)
{
    if (x->shadow_seq < 0 || x->n < 2) return;
    if (fr_shadow_blocks_needed(sch->shadow, x->shadow_seq) > fr_shadow_free_blocks(sch->shadow) ||
        !sch_ref_rows(sch, 1) || fr_shadow_step(sch->shadow, &x->shadow_seq, &x->tokens[x->n - 2], 1, sch->ref)) {
        stop_shadow(sch, x);
        return;
    }
    sch_measure(sch, x, logits, sch->ref);
}

/* The monitored decodes: each one's shadow sequence needs room for the
 * token, or its monitoring stops here. */
void sch_schedule_monitoring(fr_scheduler *sch, step_plan *p)
{
    const int n_dec = p->n_dec;
    /* A decode-only step measures on the device when the shadow can and
     * every monitored token is drawn there too. */
    p->dev_kl = p->fast && sch->shadow && fr_shadow_on_device(sch->shadow);
    for (int i = 0; i < n_dec && p->dev_kl; i++)
        if (sch->row_samples[i]->shadow_seq >= 0 && sch_host_drawn(sch->row_samples[i])) p->dev_kl = 0;
    p->n_mon = 0;
    if (sch->shadow && (sch_grow((void **)&sch->mon_seqs, &sch->cap_mon_seqs, n_dec, sizeof(int)) ||
                        sch_grow((void **)&sch->mon_toks, &sch->cap_mon_toks, n_dec, sizeof(int)) ||
                        sch_grow((void **)&sch->mon_rows, &sch->cap_mon_rows, n_dec, sizeof(int)) ||
                        sch_grow((void **)&sch->mon_served, &sch->cap_mon_served, n_dec, sizeof(int)) ||
                        sch_grow((void **)&sch->mon_chosen, &sch->cap_mon_chosen, n_dec, sizeof(int)) ||
                        sch_grow((void **)&sch->mon_kl, &sch->cap_mon_kl, n_dec, sizeof(fr_kl_result)) ||
                        (!p->dev_kl && !sch_ref_rows(sch, n_dec)))) {
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

/* The monitored decodes' shadow step (the same input tokens) unless it ran
 * with the forward step; on a failure their monitoring stops. */
void sch_run_shadow(fr_scheduler *sch, step_plan *p)
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

/* A step whose monitored rows' logits came to the host (prefill chunks in
 * it, or rows drawn on the host), on CUDA: the rows whose token is known
 * before postprocessing (drawn on the device, or teacher-forced) are
 * measured in one call on the device. Returns whether sch->mon_pre says
 * which rows have their result in sch->mres. */
int sch_premeasure(fr_scheduler *sch, const step_plan *p)
{
    const size_t V = (size_t)sch->vocab;
    if (!p->n_mon || p->dev_kl || !fr_shadow_on_device(sch->shadow) || !grow_batch(sch, p->n_mon) ||
        sch_grow((void **)&sch->mon_pre, &sch->cap_mon_pre, p->n_mon, sizeof(int)))
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
