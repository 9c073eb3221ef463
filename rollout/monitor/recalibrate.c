#include "rollout/monitor/recalibrate.h"

#include "base/clock.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "rollout/monitor/calibrate.h"
#include "rollout/engine/divergence_summary.h"

struct fr_recal {
    fr_recal_config cfg;
    char *out_dir;
    int n_texts;
    int **texts, *lens;
    int started;                  /* the first check has run ... */
    uint64_t start_version;       /* ... and seen this version (after_commit leaves it alone) */
    int judged;                   /* a version was judged (recalibrated or failed) ... */
    uint64_t judged_version;      /* ... this one */
    fr_recal_stats st;
};

void fr_recal_destroy(fr_recal **pr)
{
    if (!pr || !*pr) return;
    fr_recal *r = *pr;
    for (int i = 0; r->texts && i < r->n_texts; i++) free(r->texts[i]);
    free(r->texts);
    free(r->lens);
    free(r->out_dir);
    free(r);
    *pr = NULL;
}

fr_status fr_recal_new(const fr_recal_config *cfg, const fr_model_config *mc, fr_recal **out)
{
    if (!out) return fr_fail(FR_EINVAL, "recalibration: out is NULL");
    *out = NULL;
    if (!cfg || !mc) return fr_fail(FR_EINVAL, "recalibration: no config");
    if (!(cfg->kl_threshold >= 0) || (cfg->kl_threshold == 0 && !cfg->after_commit) || cfg->min_positions < 1 ||
        cfg->n_texts < 1 || !cfg->texts)
        return fr_fail(FR_EINVAL, "recalibration: needs kl_threshold > 0 or after_commit, min_positions >= 1 and texts");
    fr_recal *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "recalibration: out of memory");
    r->cfg = *cfg;
    r->cfg.texts = NULL;
    r->texts = calloc((size_t)cfg->n_texts, sizeof *r->texts);
    r->lens = calloc((size_t)cfg->n_texts, sizeof *r->lens);
    r->out_dir = cfg->out_dir && cfg->out_dir[0] ? strdup(cfg->out_dir) : NULL;
    fr_status st = !r->texts || !r->lens || (cfg->out_dir && cfg->out_dir[0] && !r->out_dir)
                       ? fr_fail(FR_ENOMEM, "recalibration: out of memory")
                       : FR_OK;
    for (int i = 0; !st && i < cfg->n_texts; i++) {
        st = fr_text_file_read(mc, cfg->tokenizer, cfg->texts[i], 0, &r->texts[i], &r->lens[i]);
        if (!st) r->n_texts = i + 1;
    }
    struct stat sb;
    if (!st && r->out_dir && (stat(r->out_dir, &sb) || !S_ISDIR(sb.st_mode)))
        st = fr_fail(FR_EINVAL, "recalibration: out_dir %s is not a folder", r->out_dir);
    if (st) {
        fr_recal_destroy(&r);
        return st;
    }
    *out = r;
    return FR_OK;
}

void fr_recal_stats_get(const fr_recal *r, fr_recal_stats *out)
{
    if (!out) return;
    if (r) *out = r->st;
    else memset(out, 0, sizeof *out);
}

/* The new calibration as a file: the new key mean with the tau and FP8
 * scales the session serves with. */
static fr_status record(const fr_recal *r, const fr_session *s, uint64_t version, char *path, size_t cap)
{
    int n = snprintf(path, cap, "%s/calib-v%llu.safetensors", r->out_dir, (unsigned long long)version);
    if (n < 0 || (size_t)n >= cap) return fr_fail(FR_EINVAL, "recalibration: out_dir path too long");
    return fr_calib_save(path, fr_model_calib_dims(&s->model->cfg), &s->calib);
}

fr_status fr_recal_check(fr_recal *r, fr_session *s, fr_scheduler *sch, uint64_t version, int *did)
{
    if (did) *did = 0;
    if (!r || !s || !sch) return fr_fail(FR_EINVAL, "fr_recal_check: NULL argument");
    if (!r->started) {
        r->started = 1;
        r->start_version = version;
    }
    if (r->judged && r->judged_version == version) return FR_OK;
    const fr_div_version *v = fr_div_aggregates_find(fr_scheduler_divergence(sch), version);
    const double kl = v ? fr_div_summary_mean(&v->all) : NAN;
    const int by_kl = r->cfg.kl_threshold > 0 && v && v->all.n >= r->cfg.min_positions && kl > r->cfg.kl_threshold;
    const int by_commit = r->cfg.after_commit && version != r->start_version;
    if (!by_kl && !by_commit) return FR_OK;
    r->judged = 1;
    r->judged_version = version;
    FILE *log = r->cfg.log ? r->cfg.log : stderr;
    if (by_kl)
        fprintf(log, "serve: weight version %llu: mean KL %.4g nats over %ld monitored positions is above %.4g: "
                     "recalibrating the key mean\n",
                (unsigned long long)version, kl, v->all.n, r->cfg.kl_threshold);
    else
        fprintf(log, "serve: weight version %llu committed: recalibrating the key mean\n", (unsigned long long)version);
    fflush(log);
    const double t0 = fr_now_s();
    fr_calib_opts o;
    fr_calib_opts_default(&o);
    o.context = r->cfg.context;
    o.seed_tokens = r->cfg.seed_tokens;
    o.continue_tokens = r->cfg.continue_tokens;
    o.tau_steps = 0;   /* the key mean only: tau stays what the session serves with */
    o.gpu = s->gpu_weights;   /* the passes run where the session does (NULL: the CPU) */
    fr_calib c = {0};
    fr_status st = fr_calibrate(s->model, &o, r->n_texts, (const int *const *)r->texts, r->lens, &c, NULL);
    if (st) {
        r->st.failures++;
        fprintf(log, "serve: warning: recalibration failed, the old key mean stays: %s\n", fr_last_error());
        fflush(log);
        return FR_OK;
    }
    int preempted = 0;
    st = fr_scheduler_recompute_all(sch, &preempted);
    if (!st) st = fr_session_set_key_mean(s, c.key_mean);
    fr_calib_free(&c);
    if (st) return st;   /* the sequences are gone or half-switched: the engine cannot go on */
    r->st.recalibrations++;
    r->st.last_version = version;
    r->st.last_kl = kl;
    r->st.last_seconds = fr_now_s() - t0;
    r->st.last_preempted = preempted;
    char path[4200] = "";
    if (r->out_dir && record(r, s, version, path, sizeof path)) {
        fprintf(log, "serve: warning: the new calibration could not be written: %s\n", fr_last_error());
        path[0] = 0;
    }
    fprintf(log, "serve: recalibrated the key mean for weight version %llu in %.2f s; %d sequences recomputed%s%s\n",
            (unsigned long long)version, r->st.last_seconds, preempted, path[0] ? "; written to " : "", path);
    fflush(log);
    if (did) *did = 1;
    return FR_OK;
}
