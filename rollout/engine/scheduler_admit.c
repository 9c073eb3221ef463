/* Admission and preemption (docs/scheduler.md): prefill work admitted by
 * free KV blocks and sequence slots, a block for every running sample's
 * next token, the newest work preempted by recompute when there is none,
 * and aborts. */
#include "rollout/engine/scheduler_internal.h"

#include <stdlib.h>
#include <string.h>

void sch_remove_running(fr_scheduler *sch, sample *x)
{
    for (int i = 0; i < sch->n_running; i++)
        if (sch->running[i] == x) {
            memmove(&sch->running[i], &sch->running[i + 1], sizeof(sample *) * (size_t)(sch->n_running - i - 1));
            sch->n_running--;
            return;
        }
}

/* The samples a job stands for: [*lo, *hi). */
void sch_job_range(const job *j, int *lo, int *hi)
{
    *lo = j->sample >= 0 ? j->sample : j->lo;
    *hi = j->sample >= 0 ? j->sample + 1 : j->hi;
}

int sch_job_slots(const job *j)
{
    if (j->sample >= 0) return 1;
    int n = 0;
    for (int i = j->lo; i < j->hi; i++) n += !j->r->samples[i].done;
    return n;
}

int sch_push_waiting(fr_scheduler *sch, job j, int front)
{
    if (sch_grow((void **)&sch->waiting, &sch->cap_waiting, sch->n_waiting + 1, sizeof(job))) return -1;
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
void sch_fail_job_samples(fr_scheduler *sch, job *j, fr_finish_reason why)
{
    req *r = j->r;
    if (j->seq >= 0) fr_kv_seq_free(sch->s->kv, j->seq);
    free(j->buf);
    if (j->sample >= 0) {
        sch_finish(sch, &r->samples[j->sample], why);
        return;
    }
    int left = sch_job_slots(j), n = j->hi;   /* counted first: the last finish may free r */
    for (int i = j->lo; left > 0 && i < n; i++)
        if (!r->samples[i].done) {
            left--;
            sch_finish(sch, &r->samples[i], why);   /* the last one may free r */
        }
}

static void preempt_sample(fr_scheduler *sch, sample *x)
{
    req *r = x->r;
    sch_remove_running(sch, x);
    fr_kv_seq_free(sch->s->kv, x->seq);
    x->seq = -1;
    x->preemptions++;
    sch->st.preemptions++;
    job j = {.r = r, .sample = x->index, .seq = -1, .n_total = r->n_prompt + x->n, .started = 1};
    j.buf = malloc(sizeof(int) * (size_t)j.n_total);
    if (!j.buf || sch_push_waiting(sch, j, 1)) {
        free(j.buf);
        sch_finish(sch, x, FR_FINISH_ERROR);
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
    if (sch_push_waiting(sch, j, 1)) {
        j.seq = -1;
        sch_fail_job_samples(sch, &j, FR_FINISH_ERROR);
    }
}

/* Preempts the most recently admitted work (a running sample or a prefill);
 * returns the preempted sample, or NULL when it was a prefill or nothing. */
sample *sch_preempt_newest(fr_scheduler *sch, int *any)
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

/* Slots held or promised: running samples plus the samples prefills become. */
static int slots_committed(const fr_scheduler *sch)
{
    int n = sch->n_running;
    for (int k = 0; k < sch->n_prefill; k++) n += sch_job_slots(&sch->prefill[k]);
    return n;
}

/* Admits the waiting queue's head when its prefill fits: 1 admitted, 0 not. */
int sch_admit_head(fr_scheduler *sch)
{
    if (sch->n_waiting == 0) return 0;
    job *j = &sch->waiting[0];
    if (sch->mode == FR_SCHED_HOLD && !j->started) return 0;   /* a pause lets only what started go on */
    fr_kv_cache *kv = sch->s->kv;
    int slots = sch_job_slots(j), free_blocks = fr_kv_free_blocks(kv);
    if (slots_committed(sch) + slots > sch->cfg.max_seqs) return 0;
    int blocks = sch_blocks_for(j->n_total);
    int forks = j->sample < 0 && j->n_total % T ? slots - 1 : 0;   /* partial page copies */
    int alone = sch->n_running == 0 && sch->n_prefill == 0;
    if (blocks + forks + sch->cfg.reserve_blocks > free_blocks && !(alone && blocks <= free_blocks)) return 0;
    if (sch_grow((void **)&sch->prefill, &sch->cap_prefill, sch->n_prefill + 1, sizeof(job))) return 0;
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
    a.started = 1;
    sch->prefill[sch->n_prefill++] = a;
    return 1;
}

/* Every running sample gets the block its next token needs, newest work
 * preempted until it does (oldest first, so the oldest advance). */
fr_status sch_schedule_blocks(fr_scheduler *sch)
{
    fr_kv_cache *kv = sch->s->kv;
    for (int i = 0; i < sch->n_running;) {
        sample *x = sch->running[i];
        int need = fr_kv_blocks_needed(kv, x->seq, 1);
        if (need > fr_kv_free_blocks(kv)) {
            int any;
            sch_preempt_newest(sch, &any);
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

int sch_abort_matching(fr_scheduler *sch, int all, uint64_t id)
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
                sch_finish(sch, &r->samples[s], FR_FINISH_ABORT);   /* the last frees r and removes it */
            }
    }
    return ended;
}
