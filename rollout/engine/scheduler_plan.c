/* A step's batch (docs/scheduler.md): one decode row for every running
 * sample, then prefill chunks within the token budget, and where each
 * row's output goes: tokens drawn on the backend, or logits brought to the
 * host for the rows drawn or measured there. */
#include "rollout/engine/scheduler_internal.h"

#include <stdlib.h>

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

/* The batch: decodes first, then prefill chunks within the budget. */
fr_status sch_schedule_batch(fr_scheduler *sch, step_plan *p)
{
    int max_rows = sch->n_running + sch->n_prefill + sch->n_waiting;
    if (max_rows == 0) return FR_OK;
    if (sch_grow((void **)&sch->rows, &sch->cap_rows, max_rows, sizeof(fr_step_seq))) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
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
        if (n_jobs == sch->n_prefill && (budget == 0 || !sch_admit_head(sch))) break;
        if (budget == 0) break;
        job *j = &sch->prefill[n_jobs];
        /* A recompute feeds the prompt in chunks, then its generated tokens
         * one per step, as they first ran: the decode path again. A
         * continuation's tokens go in chunks like the prompt, except where
         * that would change their numbers (deterministic mode with an FP4
         * or FP8 cache, whose prefill depends on its chunks: there they go
         * one per step too, so the sample stays bitwise the uninterrupted
         * one). */
        const int per_token = j->sample >= 0 && !(j->cont && !sch->aligned_chunks);
        int end = per_token && j->done < j->r->n_prompt ? j->r->n_prompt : j->n_total;
        int m = per_token && j->done >= j->r->n_prompt ? 1 : end - j->done;
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

/* Where each row's output goes: only rows teacher-forced or monitored bring
 * their logits to the host (sch->keep, keep_at); every other row's tokens
 * are drawn on the backend (sch->sdraws, dslot). A batch with prefill
 * chunks draws the first tokens of the prompts it completes as well. */
fr_status sch_schedule_outputs(fr_scheduler *sch, step_plan *p)
{
    const int n_dec = p->n_dec;
    int n_draws = n_dec;
    for (int k = 0; k < p->n_jobs; k++) {
        const job *j = &sch->prefill[k];
        int lo, hi;
        sch_job_range(j, &lo, &hi);
        if (j->done + sch->row_job_m[n_dec + k] >= j->n_total) n_draws += hi - lo;
    }
    if (grow_decode(sch, p->n_lrows > n_draws ? p->n_lrows : n_draws)) return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    sch_schedule_monitoring(sch, p);
    int n_keep = 0, d = 0;
    for (int i = 0; i < n_dec; i++) {
        const sample *x = sch->row_samples[i];
        const req *r = x->r;
        const int host = sch_host_drawn(x);
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
        sch_job_range(j, &lo, &hi);
        const int host = sch_host_drawn(&r->samples[lo]);   /* the job's samples alike: none has a token yet, or one */
        int wanted = host;
        for (int i = lo; i < hi; i++)
            wanted |= j->sample >= 0 && !j->cont ? r->samples[i].shadow_seq >= 0
                                                 : r->samples[i].monitored && !r->samples[i].done;
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
