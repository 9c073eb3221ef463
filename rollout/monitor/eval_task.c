/* eval-task's engine side: the task file, one scheduler run per KV cache
 * configuration, exact-match scoring. */
#include "rollout/monitor/eval_task.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "base/buf.h"
#include "base/clock.h"
#include "base/text_lines.h"
#include "rollout/engine/scheduler.h"

/* ---- the task file -------------------------------------------------------- */

static fr_status take_string(const cJSON *o, const char *key, int one_line, char **out)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(j)) return fr_fail(FR_EFORMAT, "\"%s\" must be a string", key);
    if (!j->valuestring[0]) return fr_fail(FR_EFORMAT, "\"%s\" is empty", key);
    /* A continuation is cut at its first newline, so an answer with one could never match. */
    if (one_line && strchr(j->valuestring, '\n')) return fr_fail(FR_EFORMAT, "\"%s\" holds a newline", key);
    if (!(*out = strdup(j->valuestring))) return fr_fail(FR_ENOMEM, "out of memory");
    return FR_OK;
}

static fr_status parse_item(const char *line, fr_task_item *it)
{
    memset(it, 0, sizeof *it);
    cJSON *o = cJSON_Parse(line);
    fr_status st = FR_OK;
    char *variant = NULL;
    if (!cJSON_IsObject(o)) st = fr_fail(FR_EFORMAT, "not a JSON object");
    if (!st) st = take_string(o, "prompt", 0, &it->prompt);
    if (!st) st = take_string(o, "answer", 1, &it->answer);
    if (!st) st = take_string(o, "variant", 1, &variant);
    if (!st && strlen(variant) >= sizeof it->variant)
        st = fr_fail(FR_EFORMAT, "\"variant\" is longer than %zu bytes", sizeof it->variant - 1);
    const cJSON *ctx = o ? cJSON_GetObjectItemCaseSensitive(o, "context") : NULL;
    if (!st && (!cJSON_IsNumber(ctx) || ctx->valuedouble < 0 || ctx->valuedouble > 1 << 30 ||
                ctx->valuedouble != (double)(int)ctx->valuedouble))
        st = fr_fail(FR_EFORMAT, "\"context\" must be a whole number of tokens in [0, 2^30]");
    if (!st) {
        snprintf(it->variant, sizeof it->variant, "%s", variant);
        it->context = (int)ctx->valuedouble;
    } else {
        free(it->prompt);
        free(it->answer);
        memset(it, 0, sizeof *it);
    }
    free(variant);
    cJSON_Delete(o);
    return st;
}

static fr_status set_add(fr_task_set *t, const fr_task_item *it)
{
    fr_task_item *v = fr_array_room(t->items, (size_t)t->n, &t->cap, sizeof *v, 64);
    if (!v) return fr_fail(FR_ENOMEM, "out of memory");
    t->items = v;
    t->items[t->n++] = *it;
    return FR_OK;
}

/* One line of a task file into t (a blank one adds nothing). */
static fr_status task_line(void *t, const char *line)
{
    if (line[strspn(line, " \t\r\n")] == '\0') return FR_OK;
    fr_task_item it;
    fr_status st = parse_item(line, &it);
    if (!st && (st = set_add(t, &it))) {
        free(it.prompt);
        free(it.answer);
    }
    return st;
}

fr_status fr_task_set_read(const char *path, fr_task_set *out)
{
    memset(out, 0, sizeof *out);
    fr_status st = fr_read_lines(path, task_line, out);
    if (!st && out->n == 0) st = fr_fail(FR_EFORMAT, "%s holds no prompt", path);
    if (st) fr_task_set_free(out);
    return st;
}

void fr_task_set_free(fr_task_set *t)
{
    for (int i = 0; t->items && i < t->n; i++) {
        free(t->items[i].prompt);
        free(t->items[i].answer);
    }
    free(t->items);
    memset(t, 0, sizeof *t);
}

/* ---- scoring -------------------------------------------------------------- */

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

int fr_task_match(const char *text, size_t len, const char *answer)
{
    const char *nl = memchr(text, '\n', len);
    size_t b = 0, e = nl ? (size_t)(nl - text) : len;
    while (b < e && is_blank(text[b])) b++;
    while (e > b && is_blank(text[e - 1])) e--;
    size_t ab = 0, ae = strlen(answer);
    while (ab < ae && is_blank(answer[ab])) ab++;
    while (ae > ab && is_blank(answer[ae - 1])) ae--;
    return e - b == ae - ab && memcmp(text + b, answer + ab, e - b) == 0;
}

/* ---- the runs ------------------------------------------------------------- */

typedef struct {
    const fr_task_set *tasks;
    unsigned char *correct;   /* this configuration's row */
    int done, right, failed, verbose;
    const char *name;
    double t0;
} run_ctx;

static void on_done(void *user, const fr_sample_result *r)
{
    run_ctx *x = user;
    const int i = (int)r->request_id;
    if (i < 0 || i >= x->tasks->n) return;
    if (r->finish == FR_FINISH_ERROR || r->finish == FR_FINISH_ABORT) x->failed++;
    const int ok = r->text && fr_task_match(r->text, r->text_len, x->tasks->items[i].answer);
    x->correct[i] = (unsigned char)ok;
    x->right += ok;
    x->done++;
    /* About twenty progress lines per configuration, and the last. */
    const int every = x->tasks->n / 20 > 0 ? x->tasks->n / 20 : 1;
    if (x->verbose && (x->done % every == 0 || x->done == x->tasks->n))
        fprintf(stderr, "eval-task: %s: %d/%d prompts, %d exact, %.1f s\n", x->name, x->done, x->tasks->n, x->right,
                fr_now_s() - x->t0);
}

static fr_status submit_all(fr_scheduler *sch, const fr_eval_task_params *p, const fr_model_config *mc)
{
    static const char *const newline[] = {"\n"};
    for (int i = 0; i < p->tasks->n; i++) {
        fr_request_spec r = {.id = (uint64_t)i, .group = (uint64_t)i, .prompt = p->prompt_ids[i],
                             .n_prompt = p->prompt_lens[i], .n = 1, .params = {.temperature = 0.0f, .top_p = 1.0f},
                             .max_tokens = p->max_tokens[i], .stop_ids = mc->eos_ids, .n_stop = mc->n_eos,
                             .monitor = 0, .stop_strings = {.s = newline, .n = 1}, .with_text = 1};
        fr_status st = fr_scheduler_submit(sch, &r);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            return fr_fail(st, "prompt %d: %s", i, msg);
        }
    }
    return FR_OK;
}

/* The blocks of max_seqs sequences of the longest prompt and its tokens. */
static int blocks_for(const fr_eval_task_params *p)
{
    if (p->kv_blocks > 0) return p->kv_blocks;
    int longest = 0;
    for (int i = 0; i < p->tasks->n; i++)
        if (p->prompt_lens[i] + p->max_tokens[i] > longest) longest = p->prompt_lens[i] + p->max_tokens[i];
    return p->max_seqs * ((longest + 127) / 128);
}

static fr_status run_config(const fr_eval_task_params *p, int c, unsigned char *correct)
{
    const fr_eval_config *cfg = &p->configs[c];
    fr_engine_opts eo = *p->engine;
    eo.kv = cfg->kv;
    eo.compute = cfg->compute;
    eo.recipe = cfg->recipe;
    fr_session s;
    fr_status st = fr_session_open(&eo, blocks_for(p), p->max_seqs, &s);
    if (st) return st;
    run_ctx x = {.tasks = p->tasks, .correct = correct, .verbose = p->verbose, .name = cfg->name, .t0 = fr_now_s()};
    fr_scheduler_config sc = {.max_seqs = p->max_seqs, .chunk = eo.chunk, .reserve_blocks = -1, .on_done = on_done,
                              .user = &x, .tokenizer = p->tok};
    fr_scheduler *sch = NULL;
    st = fr_scheduler_new(&s, &sc, &sch);
    if (!st) st = submit_all(sch, p, &s.model->cfg);
    if (!st) st = fr_scheduler_run(sch);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
    if (!st && (x.failed || x.done != p->tasks->n))
        st = fr_fail(FR_EINTERNAL, "%s: %d of %d prompts ended without an answer", cfg->name,
                     x.failed + p->tasks->n - x.done, p->tasks->n);
    return st;
}

fr_status fr_eval_task(const fr_eval_task_params *p, fr_eval_task_report *out)
{
    memset(out, 0, sizeof *out);
    if (!p->tok) return fr_fail(FR_EINVAL, "eval-task needs a tokenizer to read the continuations");
    if (p->n_configs < 1 || p->tasks->n < 1) return fr_fail(FR_EINVAL, "no configuration or no prompt");
    const size_t n = (size_t)p->tasks->n;
    out->correct = calloc((size_t)p->n_configs * n, 1);
    out->seconds = calloc((size_t)p->n_configs, sizeof *out->seconds);
    if (!out->correct || !out->seconds) {
        fr_eval_task_report_free(out);
        return fr_fail(FR_ENOMEM, "out of memory");
    }
    out->n_configs = p->n_configs;
    out->n = p->tasks->n;
    for (int c = 0; c < p->n_configs; c++) {
        const double t0 = fr_now_s();
        fr_status st = run_config(p, c, out->correct + (size_t)c * n);
        if (st) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            fr_eval_task_report_free(out);
            return fr_fail(st, "configuration %s: %s", p->configs[c].name, msg);
        }
        out->seconds[c] = fr_now_s() - t0;
    }
    return FR_OK;
}

void fr_eval_task_report_free(fr_eval_task_report *r)
{
    free(r->correct);
    free(r->seconds);
    memset(r, 0, sizeof *r);
}
