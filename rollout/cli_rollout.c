/* fp4rollout rollout: an offline batch of prompts through the continuous-
 * batching scheduler, one JSON line per sample. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "scheduler.h"
#include "session.h"

static const char usage_text[] =
    "usage: fp4rollout rollout --prompts FILE [--n N] [--max-tokens N]\n"
    "                          [--greedy | --temperature T --top-p P --top-k K]\n"
    "                          [--seed S] [--stop-ids IDS] [--ignore-eos]\n"
    "                          [--max-seqs N] [--kv-blocks N] [--json] [engine options]\n"
    "\n"
    "Runs every prompt of FILE through the continuous-batching scheduler\n"
    "(docs/scheduler.md) and prints each sample as it ends; a stats line goes to\n"
    "stderr. Sample i of a request draws token t with the keys (seed, i, t), so\n"
    "the tokens do not depend on --max-seqs, --kv-blocks or the other prompts.\n"
    "\n"
    "  --prompts FILE       one prompt per line, comma-separated token ids; blank\n"
    "                       lines are skipped (request indices count prompts)\n"
    "  --n N                samples per prompt, sharing its KV pages (default 1)\n"
    "  --max-tokens N       new tokens per sample (default 64)\n"
    "  --greedy             argmax decoding (the default when no temperature is set)\n"
    "  --temperature T      sampling temperature (> 0)\n"
    "  --top-p P            nucleus sampling (0 < P <= 1, default 1)\n"
    "  --top-k K            keep the K most likely tokens (0 = off, default)\n"
    "  --seed S             sampling seed (default 0)\n"
    "  --stop-ids IDS       tokens that end a sample (default: the model's EOS ids)\n"
    "  --ignore-eos         do not stop at the model's EOS ids\n"
    "  --max-seqs N         sequences decoded at once (default 16)\n"
    "  --kv-blocks N        KV cache pages of 128 tokens (default: enough for\n"
    "                       max-seqs sequences of the longest prompt + max-tokens);\n"
    "                       fewer makes the scheduler preempt and recompute\n"
    "  --json               one JSON line per sample: request, sample, tokens,\n"
    "                       logprobs, finish_reason (stop | length | abort | error)\n"
    "                       (default: a readable line per sample)\n"
    "engine options:\n";

typedef struct {
    int json;
} out_ctx;

static void on_done(void *user, const fr_sample_result *r)
{
    const out_ctx *o = user;
    if (o->json) {
        printf("{\"request\":%llu,\"sample\":%d,\"tokens\":[", (unsigned long long)r->request_id, r->sample);
        for (int i = 0; i < r->n_tokens; i++) printf("%s%d", i ? "," : "", r->tokens[i]);
        printf("],\"logprobs\":[");
        for (int i = 0; i < r->n_tokens; i++) printf("%s%.6g", i ? "," : "", r->logprobs[i]);
        printf("],\"finish_reason\":\"%s\"}\n", fr_finish_reason_name(r->finish));
        return;
    }
    printf("request %llu sample %d (%s, %d tokens):", (unsigned long long)r->request_id, r->sample,
           fr_finish_reason_name(r->finish), r->n_tokens);
    for (int i = 0; i < r->n_tokens; i++) printf(" %d", r->tokens[i]);
    putchar('\n');
}

typedef struct {
    int **ids;
    int *len;
    int n, cap;
} prompt_list;

static void prompts_free(prompt_list *p)
{
    for (int i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    free(p->len);
    memset(p, 0, sizeof *p);
}

static fr_status read_prompts(const char *path, prompt_list *p)
{
    FILE *f = fopen(path, "r");
    if (!f) return fr_fail(FR_EIO, "cannot read %s", path);
    char *line = NULL;
    size_t cap = 0;
    fr_status st = FR_OK;
    for (int lineno = 1; !st && getline(&line, &cap, f) >= 0; lineno++) {
        int *ids, n;
        if ((st = fr_parse_ids(line, &ids, &n))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            st = fr_fail(st, "%s line %d: %s", path, lineno, msg);
            break;
        }
        if (n == 0) {
            free(ids);
            continue;
        }
        if (p->n == p->cap) {
            int c = p->cap ? p->cap * 2 : 16;
            int **a = realloc(p->ids, sizeof *a * (size_t)c);
            if (a) p->ids = a;
            int *b = a ? realloc(p->len, sizeof *b * (size_t)c) : NULL;
            if (b) p->len = b;
            if (!a || !b) {
                free(ids);
                st = fr_fail(FR_ENOMEM, "out of memory");
                break;
            }
            p->cap = c;
        }
        p->ids[p->n] = ids;
        p->len[p->n++] = n;
    }
    free(line);
    fclose(f);
    if (!st && p->n == 0) st = fr_fail(FR_EINVAL, "%s holds no prompt", path);
    return st;
}

int fr_cli_rollout(int argc, char **argv)
{
    const char *cmd = "rollout", *path = NULL, *stop_text = NULL;
    int n_samples = 1, max_tokens = 64, json = 0, ignore_eos = 0, greedy = 0, seed = 0, max_seqs = 16, kv_blocks = 0;
    fr_sampling_params sp = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};
    fr_engine_opts eo;
    fr_engine_opts_default(&eo);
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s%s", usage_text, fr_engine_opts_usage);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        int r = fr_engine_opts_parse(cmd, argc, argv, &i, &eo);
        if (r < 0) return 2;
        if (r) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--prompts") == 0 && v) path = argv[++i];
        else if (strcmp(a, "--stop-ids") == 0 && v) stop_text = argv[++i];
        else if (strcmp(a, "--n") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 4096, &n_samples);
        else if (strcmp(a, "--max-tokens") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 24, &max_tokens);
        else if (strcmp(a, "--max-seqs") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 16, &max_seqs);
        else if (strcmp(a, "--kv-blocks") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 24, &kv_blocks);
        else if (strcmp(a, "--top-k") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 0, 1 << 30, &sp.top_k);
        else if (strcmp(a, "--seed") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 0, 0x7fffffff, &seed);
        else if (strcmp(a, "--temperature") == 0 && v) bad = fr_cli_float(cmd, a, argv[++i], &sp.temperature);
        else if (strcmp(a, "--top-p") == 0 && v) bad = fr_cli_float(cmd, a, argv[++i], &sp.top_p);
        else if (strcmp(a, "--greedy") == 0) greedy = 1;
        else if (strcmp(a, "--json") == 0) json = 1;
        else if (strcmp(a, "--ignore-eos") == 0) ignore_eos = 1;
        else return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", a);
        if (bad) return 2;
    }
    if (!path) return fr_cli_usage_error(cmd, "--prompts is required");
    if (greedy && sp.temperature > 0.0f) return fr_cli_usage_error(cmd, "--greedy contradicts --temperature");
    if (n_samples > max_seqs) return fr_cli_usage_error(cmd, "--n %d exceeds --max-seqs %d", n_samples, max_seqs);
    if (greedy) sp.temperature = 0.0f;
    sp.seed = (uint64_t)seed;

    prompt_list pl = {0};
    int *stop = NULL, n_stop = 0;
    fr_status st = read_prompts(path, &pl);
    if (!st && stop_text) st = fr_parse_ids(stop_text, &stop, &n_stop);
    if (st) {
        fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
        prompts_free(&pl);
        free(stop);
        return 2;
    }
    if (kv_blocks == 0) {
        int longest = 0;
        for (int i = 0; i < pl.n; i++) longest = pl.len[i] > longest ? pl.len[i] : longest;
        kv_blocks = max_seqs * ((longest + max_tokens + 127) / 128);
    }
    fr_session s;
    if ((st = fr_session_open(&eo, kv_blocks, max_seqs, &s))) {
        fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
        prompts_free(&pl);
        free(stop);
        return 1;
    }
    const fr_model_config *mc = &s.model->cfg;
    if (!stop_text && !ignore_eos && mc->n_eos > 0) {
        stop = malloc(sizeof(int) * (size_t)mc->n_eos);
        if (stop) {
            memcpy(stop, mc->eos_ids, sizeof(int) * (size_t)mc->n_eos);
            n_stop = mc->n_eos;
        }
    }
    out_ctx oc = {.json = json};
    fr_scheduler_config sc = {.max_seqs = max_seqs, .chunk = eo.chunk, .reserve_blocks = -1, .on_done = on_done,
                              .user = &oc};
    fr_scheduler *sch = NULL;
    st = fr_scheduler_new(&s, &sc, &sch);
    for (int i = 0; !st && i < pl.n; i++) {
        fr_request_spec r = {.id = (uint64_t)i, .group = (uint64_t)i, .prompt = pl.ids[i], .n_prompt = pl.len[i],
                             .n = n_samples, .params = sp, .max_tokens = max_tokens, .stop_ids = stop,
                             .n_stop = n_stop};
        if ((st = fr_scheduler_submit(sch, &r))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            st = fr_fail(st, "prompt %d: %s", i, msg);
        }
    }
    if (!st) st = fr_scheduler_run(sch);
    if (st) fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
    if (sch) {
        fr_scheduler_stats ss;
        fr_scheduler_stats_get(sch, &ss);
        fr_scheduler_destroy(&sch);   /* anything left in flight ends with reason abort */
        fprintf(stderr,
                "rollout: requests %d samples %lld tokens %lld prefill_tokens %lld steps %lld preemptions %lld "
                "kv_blocks %d backend %s\n",
                pl.n, ss.finished, ss.tokens_generated, ss.prefill_tokens, ss.steps, ss.preemptions, kv_blocks,
                fr_backend_name(s.backend));
    }
    fflush(stdout);
    fr_session_close(&s);
    prompts_free(&pl);
    free(stop);
    return st ? 1 : 0;
}
