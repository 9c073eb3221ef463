/* Automatic recalibration of the key mean while serving (docs/metrics.md,
 * "Automatic recalibration"). New weights move the post-RoPE key mean the
 * FP4 recipe subtracts; when the monitored KL(BF16 || FP4) of the weight
 * version serving passes a threshold, the engine reruns Appendix B's key
 * mean on the current weights, recomputes the sequences in flight (a
 * sequence's keys must all subtract the same mean) and serves on with the
 * new mean; each new calibration can be recorded as a file --calib reads.
 *
 * With after_commit, every weight version committed after the start is
 * recalibrated at once, before its KL is known.
 *
 * At most once per weight version: the version's KL figures keep counting
 * the positions served before the change, so they are not judged again.
 * Serving pauses for the calibration (one prefill of `context` tokens plus
 * the seed continuations). One rank per engine (tp 1). */
#ifndef FR_RECALIBRATE_H
#define FR_RECALIBRATE_H

#include <stdint.h>
#include <stdio.h>

#include "rollout/engine/scheduler.h"
#include "rollout/engine/session.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    double kl_threshold;          /* nats: mean KL of the serving version that triggers it; 0: none */
    int after_commit;             /* 1: also recalibrate once for every version committed after the start */
    int min_positions;            /* monitored positions of the version before it is judged */
    int n_texts;
    const char *const *texts;     /* seed text files (as fp4rollout calibrate --texts) */
    const fr_tokenizer *tokenizer; /* what the files go through (fr_text_file_read; NULL: bytes) */
    int context, seed_tokens, continue_tokens;   /* calibrate's --context, --seed-tokens, --continue */
    const char *out_dir;          /* NULL or "": no files; else calib-v<version>.safetensors there */
    FILE *log;                    /* one line per recalibration; NULL: stderr */
} fr_recal_config;

typedef struct {
    long recalibrations;          /* done */
    long failures;                /* tried and failed (serving went on with the old mean) */
    uint64_t last_version;        /* weight version of the last one */
    double last_kl;               /* the mean KL that triggered it (nats) */
    double last_seconds;          /* its duration: calibration and the switch */
    int last_preempted;           /* sequences it recomputed */
} fr_recal_stats;

typedef struct fr_recal fr_recal;

/* Reads the texts now (a bad path fails here, not mid-serving) as texts of
 * model config mc (fr_text_file_read with cfg->tokenizer). */
fr_status fr_recal_new(const fr_recal_config *cfg, const fr_model_config *mc, fr_recal **out);
void fr_recal_destroy(fr_recal **r);

/* Between engine steps: judges the divergence of weight version `version`
 * (fr_scheduler_divergence) and recalibrates when it is due. *did (may be
 * NULL) is 1 when it did. A failed calibration is logged and counted, the
 * old mean stays, and FR_OK is returned: serving goes on. An error is
 * returned only when the engine is left unusable (the sequences could not
 * be recomputed). */
fr_status fr_recal_check(fr_recal *r, fr_session *s, fr_scheduler *sch, uint64_t version, int *did);

void fr_recal_stats_get(const fr_recal *r, fr_recal_stats *out);

#ifdef __cplusplus
}
#endif

#endif
