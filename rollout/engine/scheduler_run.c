/* One scheduler step (in the manner of nano-vllm: schedule, run,
 * postprocess) and the forward step in it: one batch handed to the
 * session, a decode-only batch carrying the monitored samples' shadow or
 * launched beside it where the backend can. */
#include "rollout/engine/scheduler_internal.h"

#include <string.h>

#include "base/clock.h"

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
        sch_fail_job_samples(sch, &j, FR_FINISH_ERROR);
    }
    for (int i = 0; i < p->n_dec; i++) sch_finish(sch, sch->row_samples[i], FR_FINISH_ERROR);
}

fr_status fr_scheduler_step(fr_scheduler *sch)
{
    if (!sch) return fr_fail(FR_EINVAL, "scheduler: NULL");
    if (sch->mode == FR_SCHED_FREEZE) return FR_OK;   /* frozen: every sample keeps its state, KV cache included */
    step_plan p = {0};
    fr_status st = sch_schedule_blocks(sch);
    if (!st) st = sch_schedule_batch(sch, &p);
    if (st || p.n_rows == 0) return st;
    if ((st = sch_schedule_outputs(sch, &p)) || (st = sch_schedule_routes(sch, &p))) return st;
    double t0 = fr_now_s();
    if ((st = run_forward(sch, &p)) || (st = sch_fetch_routes(sch, &p))) {
        fail_step(sch, &p);
        return st;
    }
    double t1 = fr_now_s();
    sch->st.forward_s += t1 - t0;
    sch->st.steps++;
    sch->st.decode_steps += p.fast;
    sch->st.carried_steps += p.carried;
    sch_run_shadow(sch, &p);
    double t2 = fr_now_s();
    sch->st.shadow_s += t2 - t1;
    sch_postprocess(sch, &p);
    sch->st.host_s += fr_now_s() - t2;
    return FR_OK;
}
