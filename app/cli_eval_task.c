/* fp4rollout eval-task: exact-match accuracy of prompts with known answers
 * per KV cache configuration (docs/eval_task.md). */
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "rollout/monitor/eval_task.h"
#include "rollout/monitor/task_stats.h"

const char fr_eval_task_usage[] =
    "usage: fp4rollout eval-task --model M --tasks FILE [--kv LIST] [--ablation]\n"
    "                            [--answer-margin N] [--max-seqs N] [--json] [--quiet]\n"
    "                            [--calib FILE] [--backend B] [engine options]\n"
    "\n"
    "Task accuracy per KV cache configuration (docs/eval_task.md). FILE holds JSON\n"
    "lines {\"prompt\": ..., \"answer\": ..., \"variant\": ..., \"context\": ...}\n"
    "(models/retrieval/retrieval_tasks.py writes long-context retrieval ones). For\n"
    "every configuration of --kv, a session of its own runs every prompt through\n"
    "the continuous-batching scheduler with greedy decoding, at most the answer's\n"
    "tokens plus --answer-margin new tokens, stopping at a newline or an EOS id.\n"
    "A prompt is answered when its continuation up to the first newline, spaces\n"
    "trimmed, equals the answer. Per configuration and (variant, context) cell,\n"
    "and over all prompts: n, exact answers, accuracy with its 95% Wilson score\n"
    "interval, and against the first configuration on the same prompts the\n"
    "paired difference in accuracy, the discordant pairs b (first right, this\n"
    "one wrong) and c (first wrong, this one right), and McNemar's exact\n"
    "two-sided p-value. Progress goes to stderr; a markdown table (or with\n"
    "--json one JSON object per configuration and cell) to stdout.\n"
    "\n"
    "Configurations are eval-kl's names: bf16, f32, fp8; nvfp4 and mxfp4 (full\n"
    "recipe, exact compute), -vanilla, -kv (bf16 compute), -no-X (X: smooth,\n"
    "rotate, search, dual, pscale, sink; see fp4rollout eval-kl --help).\n";

static void print_table(const fr_eval_task_report *r, const fr_eval_config *cfgs, const fr_task_group *groups,
                        int ng, const fr_task_cell *cells, const char *model, const char *tasks)
{
    printf("Task accuracy: exact match of greedy continuations per KV cache configuration\n");
    printf("model %s; tasks %s, %d prompts; 95%% Wilson intervals; paired against %s by McNemar's exact test\n\n",
           model, tasks, r->n, cfgs[0].name);
    printf("| configuration | variant | context | n | exact | accuracy %% | 95%% CI %% | vs %s (pp) | b / c | p |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n", cfgs[0].name);
    for (int c = 0; c < r->n_configs; c++)
        for (int g = 0; g < ng; g++) {
            const fr_task_cell *x = &cells[(size_t)c * (size_t)ng + (size_t)g];
            char ctx[24];
            if (groups[g].context < 0) snprintf(ctx, sizeof ctx, "all");
            else snprintf(ctx, sizeof ctx, "%d", groups[g].context);
            printf("| %s | %s | %s | %ld | %ld | %.1f | %.1f-%.1f |", cfgs[c].name, groups[g].variant, ctx, x->n, x->k,
                   100.0 * x->acc, 100.0 * x->lo, 100.0 * x->hi);
            if (c == 0) printf(" - | - | - |\n");
            else printf(" %+.1f | %ld / %ld | %.3g |\n", 100.0 * x->diff, x->b, x->c, x->p);
        }
    printf("\n");
    for (int c = 0; c < r->n_configs; c++) printf("%s%s %.1f s", c ? ", " : "time: ", cfgs[c].name, r->seconds[c]);
    printf("\n");
}

static void print_json(const fr_eval_task_report *r, const fr_eval_config *cfgs, const fr_task_group *groups, int ng,
                       const fr_task_cell *cells, const char *model, const char *tasks)
{
    fr_buf b = {0};
    for (int c = 0; c < r->n_configs; c++)
        for (int g = 0; g < ng; g++) {
            const fr_task_cell *x = &cells[(size_t)c * (size_t)ng + (size_t)g];
            char desc[160];
            fr_eval_config_describe(&cfgs[c], desc, (int)sizeof desc);
            b.len = 0;
            fr_buf_printf(&b, "{\"config\":\"%s\",\"description\":\"%s\"", cfgs[c].name, desc);
            fr_cli_json_string(&b, "model", model, strlen(model));
            fr_cli_json_string(&b, "tasks", tasks, strlen(tasks));
            fr_cli_json_string(&b, "variant", groups[g].variant, strlen(groups[g].variant));
            if (groups[g].context < 0) fr_buf_printf(&b, ",\"context\":null");
            else fr_buf_printf(&b, ",\"context\":%d", groups[g].context);
            fr_buf_printf(&b, ",\"n\":%ld,\"exact\":%ld,\"accuracy\":%.6g,\"ci95\":[%.6g,%.6g]", x->n, x->k, x->acc,
                          x->lo, x->hi);
            fr_buf_printf(&b, ",\"baseline\":\"%s\",\"diff\":%.6g,\"b\":%ld,\"c\":%ld,\"p_mcnemar\":%.6g", cfgs[0].name,
                          x->diff, x->b, x->c, x->p);
            fr_buf_printf(&b, ",\"seconds\":%.3f}\n", r->seconds[c]);
            if (!b.failed) fwrite(b.data, 1, b.len, stdout);
        }
    fr_buf_free(&b);
}

/* The prompts through the tokenizer, and each one's token budget. */
typedef struct {
    int **ids, *lens, *max_tokens, n;
} encoded_tasks;

static void encoded_free(encoded_tasks *e)
{
    for (int i = 0; e->ids && i < e->n; i++) free(e->ids[i]);
    free(e->ids);
    free(e->lens);
    free(e->max_tokens);
}

/* 0, or the exit status after printing why. */
static int encode_tasks(fr_cmd cmd, const fr_cli_text *tx, const fr_task_set *ts, int margin, encoded_tasks *e)
{
    e->n = ts->n;
    e->ids = calloc((size_t)ts->n, sizeof *e->ids);
    e->lens = calloc((size_t)ts->n, sizeof(int));
    e->max_tokens = calloc((size_t)ts->n, sizeof(int));
    if (!e->ids || !e->lens || !e->max_tokens) {
        fr_fail(FR_ENOMEM, "out of memory");
        return fr_cli_fail(cmd, 1);
    }
    for (int i = 0; i < ts->n; i++) {
        char what[64];
        snprintf(what, sizeof what, "prompt %d", i);
        const fr_task_item *it = &ts->items[i];
        int *a = NULL, na = 0;
        fr_status st = fr_cli_text_encode(tx, what, it->prompt, strlen(it->prompt), &e->ids[i], &e->lens[i]);
        if (!st) st = fr_cli_text_encode(tx, what, it->answer, strlen(it->answer), &a, &na);
        free(a);
        if (st) return fr_cli_fail(cmd, 1);
        e->max_tokens[i] = na + margin;
    }
    return 0;
}

typedef struct {
    const fr_cli_values *v;
    const fr_engine_opts *eo;
    const fr_cli_text *tx;
    const fr_eval_config *cfgs;
    int n_cfgs;
} task_run;

/* The cells of the report, printed: 0 or the exit status. */
static int report(fr_cmd cmd, const task_run *t, const fr_task_set *ts, const fr_eval_task_report *rep)
{
    const char **variants = calloc((size_t)ts->n, sizeof *variants);
    int *contexts = calloc((size_t)ts->n, sizeof(int)), ng = 0;
    fr_task_group *groups = NULL;
    fr_task_cell *cells = NULL;
    fr_status st = variants && contexts ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    for (int i = 0; !st && i < ts->n; i++) {
        variants[i] = ts->items[i].variant;
        contexts[i] = ts->items[i].context;
    }
    if (!st) st = fr_task_cells(rep->correct, rep->n_configs, rep->n, variants, contexts, &groups, &ng, &cells);
    const char *path = fr_opt_str(t->v, FR_O_TASKS);
    if (!st && fr_opt_int(t->v, FR_O_JSON)) print_json(rep, t->cfgs, groups, ng, cells, t->eo->model, path);
    else if (!st) print_table(rep, t->cfgs, groups, ng, cells, t->eo->model, path);
    free(variants);
    free(contexts);
    free(groups);
    free(cells);
    return st ? fr_cli_fail(cmd, 1) : 0;
}

/* The tasks read and encoded, every configuration run, the report printed:
 * 0 or the exit status. */
static int evaluate(fr_cmd cmd, const task_run *t)
{
    const fr_cli_values *v = t->v;
    fr_task_set ts;
    if (fr_task_set_read(fr_opt_str(v, FR_O_TASKS), &ts)) return fr_cli_fail(cmd, 1);
    encoded_tasks e = {0};
    int rc = encode_tasks(cmd, t->tx, &ts, fr_opt_int(v, FR_O_ANSWER_MARGIN), &e);
    fr_eval_task_report rep = {0};
    const fr_eval_task_params p = {.engine = t->eo, .configs = t->cfgs, .n_configs = t->n_cfgs, .tasks = &ts,
                                   .prompt_ids = (const int *const *)e.ids, .prompt_lens = e.lens,
                                   .max_tokens = e.max_tokens, .tok = t->tx->tok,
                                   .max_seqs = fr_opt_int(v, FR_O_MAX_SEQS), .kv_blocks = fr_opt_int(v, FR_O_KV_BLOCKS),
                                   .verbose = !fr_opt_int(v, FR_O_QUIET)};
    if (!rc && fr_eval_task(&p, &rep)) rc = fr_cli_fail(cmd, 1);
    if (!rc) rc = report(cmd, t, &ts, &rep);
    fr_eval_task_report_free(&rep);
    encoded_free(&e);
    fr_task_set_free(&ts);
    return rc;
}

int fr_cli_eval_task(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_EVAL_TASK;
    fr_eval_config *cfgs = NULL;
    int n_cfgs = 0, rc;
    if (fr_eval_config_list(fr_opt_str(v, FR_O_TASK_KV), fr_opt_int(v, FR_O_ABLATION), &cfgs, &n_cfgs))
        return fr_cli_fail(cmd, 2);
    fr_engine_opts eo;
    fr_cli_engine_opts_get(v, &eo);
    fr_cli_text tx;
    if ((rc = fr_cli_text_open(cmd, eo.model, fr_opt_str(v, FR_O_MODEL_TOKENIZER), &tx))) {
        free(cfgs);
        return rc;
    }
    if (!tx.tok) {
        fr_cli_text_none(&tx, "eval-task");
        rc = fr_cli_fail(cmd, 2);
    }
    const task_run t = {.v = v, .eo = &eo, .tx = &tx, .cfgs = cfgs, .n_cfgs = n_cfgs};
    if (!rc) rc = evaluate(cmd, &t);
    fr_cli_text_close(&tx);
    free(cfgs);
    fflush(stdout);
    return rc;
}
