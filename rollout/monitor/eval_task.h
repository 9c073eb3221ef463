/* Task accuracy per KV cache configuration (docs/eval_task.md): a file of
 * prompts with their exact answers (JSON lines, as models/retrieval's
 * generator writes them), each prompt run through the scheduler with
 * greedy decoding once per configuration, the continuation up to its first
 * newline compared with the answer. The cells and their statistics are
 * rollout/monitor/task_stats.h's. */
#ifndef FR_EVAL_TASK_H
#define FR_EVAL_TASK_H

#include <stddef.h>

#include "rollout/engine/session.h"
#include "rollout/monitor/eval_kl.h"
#include "tokenizer/tokenizer.h"

/* eval-task's list when --kv is not given: BF16 first, the pairs' baseline. */
#define FR_EVAL_TASK_DEFAULT_CONFIGS "bf16,fp8,nvfp4,nvfp4-vanilla,mxfp4,mxfp4-vanilla"

/* One prompt of a task file. */
typedef struct {
    char *prompt;          /* NUL-terminated, not empty */
    char *answer;          /* NUL-terminated, not empty, one line */
    char variant[32];
    int context;           /* the prompt length the generator aimed at, in tokens */
} fr_task_item;

typedef struct {
    fr_task_item *items;
    int n;
    size_t cap;
} fr_task_set;

/* JSON lines, each an object with the strings "prompt", "answer" and
 * "variant" and the whole number "context" (other keys are ignored); blank
 * lines skipped. FR_EIO when the file cannot be read (the system's reason),
 * FR_EFORMAT naming the path and line of a malformed one, or a file
 * without prompts. */
fr_status fr_task_set_read(const char *path, fr_task_set *out);
void fr_task_set_free(fr_task_set *t);

/* The prediction of a continuation: text up to its first newline, spaces,
 * tabs and carriage returns trimmed at both ends; 1 when it equals answer
 * (trimmed alike). */
int fr_task_match(const char *text, size_t len, const char *answer);

typedef struct {
    const fr_engine_opts *engine;    /* model, backend, calibration, chunk; each
                                        configuration replaces kv, compute and recipe */
    const fr_eval_config *configs;
    int n_configs;
    const fr_task_set *tasks;
    const int *const *prompt_ids;    /* [n] the prompts through the model's tokenizer */
    const int *prompt_lens;
    const int *max_tokens;           /* [n] new tokens each prompt may take */
    const fr_tokenizer *tok;         /* decodes the continuations (must not be NULL) */
    int max_seqs, kv_blocks;         /* kv_blocks 0: enough for max_seqs of the longest */
    int verbose;                     /* progress on stderr */
} fr_eval_task_params;

typedef struct {
    unsigned char *correct;          /* [n_configs * n] */
    double *seconds;                 /* [n_configs] */
    int n_configs, n;
} fr_eval_task_report;

/* Every configuration in turn: a session of its own (the model loaded
 * again), every prompt submitted to one scheduler (greedy, stop at a
 * newline or an EOS id), every continuation scored. */
fr_status fr_eval_task(const fr_eval_task_params *p, fr_eval_task_report *out);
void fr_eval_task_report_free(fr_eval_task_report *r);

#endif
