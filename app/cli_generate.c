/* fp4rollout generate: n sampled continuations of one prompt, sharing the
 * prompt's prefill and full KV pages, decoded together in one batch. */
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "base/log.h"
#include "rollout/model/sampler.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

static const char usage_text[] =
    "usage: fp4rollout generate [--model M] (--prompt TEXT | --prompt-ids IDS | --prompt-file F)\n"
    "                           [--n N] [--max-tokens N] [--greedy | --temperature T\n"
    "                           --top-p P --top-k K] [--seed S [--first-sample I]]\n"
    "                           [--stop-ids IDS]\n"
    "                           [--ignore-eos] [--json] [engine options]\n"
    "\n"
    "Samples N continuations of the prompt. Each token's log-prob is the\n"
    "full-vocabulary log-softmax of logits / temperature at that token (temperature\n"
    "1 when greedy), whatever top-k and top-p kept: the quantity trainers recompute.\n"
    "With --tp N under mpirun, every rank runs the same steps and draws (on the\n"
    "full gathered logits) and world rank 0 prints.\n"
    "\n"
    "  --prompt TEXT        the prompt as text, for byte-level models (the bundled\n"
    "                       demo model, tq6): BOS, then the text's bytes. Other\n"
    "                       models need token ids (--prompt-ids, --prompt-file)\n"
    "  --prompt-ids IDS     comma-separated token ids (default: 256,104,101,108,108,111,\n"
    "                       BOS and \"hello\" in bytes)\n"
    "  --prompt-file F      a file of token ids\n"
    "  --n N                samples (default 1)\n"
    "  --max-tokens N       new tokens per sample (default 64)\n"
    "  --greedy             argmax decoding (the default when no temperature is set)\n"
    "  --temperature T      sampling temperature (> 0)\n"
    "  --top-p P            nucleus sampling (0 < P <= 1, default 1)\n"
    "  --top-k K            keep the K most likely tokens (0 = off, default)\n"
    "  --seed S             sampling seed, 0 to 2^64 - 1 (default: a fresh one from\n"
    "                       the operating system); same seed, same tokens. The seed\n"
    "                       used is printed on stderr and in each JSON line\n"
    "  --first-sample I     number the samples I, I+1, ... (default 0): sample i draws\n"
    "                       from stream i of the seed, so --seed S --first-sample I\n"
    "                       --n 1 replays sample I of a run with seed S\n"
    "  --stop-ids IDS       tokens that end a sample (default: the model's EOS ids)\n"
    "  --ignore-eos         do not stop at the model's EOS ids\n"
    "  --json               one JSON line per sample: sample, token_ids, logprobs,\n"
    "                       finish_reason (stop | length), seed\n"
    "engine options:\n";

typedef struct {
    int seq, n, done;
    int *tokens;
    float *logprobs;
    const char *finish;
} sample;

static int is_stop(int tok, const int *stop, int n_stop)
{
    for (int i = 0; i < n_stop; i++)
        if (stop[i] == tok) return 1;
    return 0;
}

static void print_sample(const sample *s, int idx, int json, uint64_t seed, int byte_vocab)
{
    if (json) {
        printf("{\"sample\":%d,\"token_ids\":[", idx);
        for (int i = 0; i < s->n; i++) printf("%s%d", i ? "," : "", s->tokens[i]);
        printf("],\"logprobs\":[");
        for (int i = 0; i < s->n; i++) printf("%s%.9g", i ? "," : "", s->logprobs[i]);   /* round-trips a float */
        printf("],\"finish_reason\":\"%s\",\"seed\":%llu}\n", s->finish, (unsigned long long)seed);
        return;
    }
    printf("sample %d (%s, %d tokens):", idx, s->finish, s->n);
    for (int i = 0; i < s->n; i++) printf(" %d", s->tokens[i]);
    if (byte_vocab) {
        printf("\n  text: ");
        for (int i = 0; i < s->n; i++) {
            int t = s->tokens[i];
            if (t >= 32 && t < 127) putchar(t);
            else if (t == '\n') printf("\\n");
            else printf("<%d>", t);
        }
    }
    putchar('\n');
}

/* The options of this command (app/cli_args.c reads them with getopt_long). */
static const struct option own_opts[] = {
    {"prompt-ids", required_argument, 0, 0}, {"prompt-file", required_argument, 0, 0},
    {"prompt", required_argument, 0, 0}, {0, 0, 0, 0},
};

int fr_cli_generate(int argc, char **argv)
{
    const char *cmd = "generate", *ids_text = NULL, *ids_file = NULL, *prompt_text = NULL;
    fr_cli_sampling so;
    fr_cli_sampling_default(&so);
    fr_engine_opts eo;
    fr_cli_engine_opts_default(&eo);
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s%s", usage_text, fr_engine_opts_usage);
        return 0;
    }
    if (fr_cli_args(cmd, &argc, &argv,
                    (const struct option *const[]){own_opts, fr_cli_engine_longopts, fr_cli_sampling_longopts, NULL}))
        return 2;
    for (int i = 1; i < argc; i++) {
        int r = fr_engine_opts_parse(cmd, argc, argv, &i, &eo);
        if (r < 0) return 2;
        if (r) continue;
        if ((r = fr_cli_sampling_parse(cmd, argc, argv, &i, &so)) < 0) return 2;
        if (r) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--prompt-ids") == 0 && v) ids_text = argv[++i];
        else if (strcmp(a, "--prompt-file") == 0 && v) ids_file = argv[++i];
        else if (strcmp(a, "--prompt") == 0 && v) prompt_text = argv[++i];
        else return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", a);
    }
    if (!!ids_text + !!ids_file + !!prompt_text > 1)
        return fr_cli_usage_error(cmd, "give one of --prompt, --prompt-ids and --prompt-file");
    if (fr_cli_sampling_finish(cmd, &so)) return 2;
    const char *stop_text = so.stop_text;
    int n_samples = so.n_samples, max_tokens = so.max_tokens, json = so.json, ignore_eos = so.ignore_eos;
    fr_sampling_params sp = so.sp;
    const int first = so.first_sample;

    int *ids = NULL, n_ids = 0, *stop = NULL, n_stop = 0;
    fr_status st = FR_OK;
    if (ids_file) st = fr_read_ids_file(ids_file, &ids, &n_ids);
    else if (prompt_text) st = fr_cli_byte_prompt(prompt_text, &ids, &n_ids);
    else st = fr_parse_ids(ids_text ? ids_text : "256,104,101,108,108,111", &ids, &n_ids);
    if (!st && stop_text) st = fr_parse_ids(stop_text, &stop, &n_stop);
    if (st) {
        fprintf(stderr, "fp4rollout generate: %s\n", fr_last_error());
        free(ids);
        return 2;
    }

    fr_tp_launch tl;
    if ((st = fr_tp_launch_open(eo.tp, &tl))) {
        fprintf(stderr, "fp4rollout generate: %s\n", fr_last_error());
        free(ids); free(stop);
        return 1;
    }
    eo.group = tl.group;
    /* Every rank drew its own seed when none was given: rank 0's is the run's. */
    st = fr_tp_launch_agree_seed(&tl, &sp.seed);
    if (!st && tl.output_rank) fr_info("generate: seed %llu", (unsigned long long)sp.seed);
    fr_session s;
    int pages = (n_ids + max_tokens + 127) / 128 + 1;
    if (!st) st = fr_session_open(&eo, pages * n_samples + 1, n_samples, &s);
    if (st) {
        fprintf(stderr, "fp4rollout generate: %s\n", fr_last_error());
        free(ids); free(stop);
        fr_tp_launch_close(&tl);
        return 1;
    }
    const fr_model_config *mc = &s.model->cfg;
    const int V = mc->vocab_size;
    if (prompt_text && !fr_cli_byte_model(mc)) {
        fprintf(stderr, "fp4rollout generate: --prompt TEXT needs a byte-level model (ids 0-255 bytes, BOS 256); "
                        "this model has its own tokenizer: give the prompt's ids with --prompt-ids or --prompt-file\n");
        free(ids); free(stop);
        fr_session_close(&s);
        fr_tp_launch_close(&tl);
        return 2;
    }
    if (!stop_text && !ignore_eos) {
        stop = malloc(sizeof(int) * (size_t)(mc->n_eos > 0 ? mc->n_eos : 1));
        if (stop) { memcpy(stop, mc->eos_ids, sizeof(int) * (size_t)mc->n_eos); n_stop = mc->n_eos; }
    }
    sample *smp = calloc((size_t)n_samples, sizeof *smp);
    float *logits = malloc(sizeof(float) * (size_t)V);
    int *step_tok = malloc(sizeof(int) * (size_t)n_samples), *owner = malloc(sizeof(int) * (size_t)n_samples);
    int *new_tok = malloc(sizeof(int) * (size_t)n_samples);
    float *new_lp = malloc(sizeof(float) * (size_t)n_samples);
    fr_step_seq *steps = malloc(sizeof *steps * (size_t)n_samples);
    fr_decode_row *drows = malloc(sizeof *drows * (size_t)n_samples);
    fr_sampler *sampler = NULL;
    if (!smp || !logits || !step_tok || !owner || !new_tok || !new_lp || !steps || !drows)
        st = fr_fail(FR_ENOMEM, "out of memory");
    if (!st) st = fr_check_prompt(mc, ids, n_ids, 0);
    if (!st && n_ids + max_tokens > mc->max_position) max_tokens = mc->max_position - n_ids;
    if (!st) st = fr_sampling_params_check(&sp, V);
    if (!st) st = fr_sampler_new(V, &sampler);
    for (int i = 0; !st && i < n_samples; i++) {
        smp[i].tokens = malloc(sizeof(int) * (size_t)max_tokens);
        smp[i].logprobs = malloc(sizeof(float) * (size_t)max_tokens);
        smp[i].seq = -1;
        if (!smp[i].tokens || !smp[i].logprobs) st = fr_fail(FR_ENOMEM, "out of memory");
    }
    /* One prefill; the other samples fork it (full pages shared, the partial
     * page copied). Each sample's first token comes from the prefill's
     * logits; the following ones from batched decode steps, which sample on
     * the backend (the GPU when it runs there) with the same draws. */
    if (!st) st = fr_session_prefill(&s, ids, n_ids, eo.chunk, &smp[0].seq, logits, NULL);
    for (int i = 1; !st && i < n_samples; i++) st = fr_session_fork(&s, smp[0].seq, &smp[i].seq);
    int active = n_samples;
    for (int i = 0; !st && i < n_samples; i++) {
        st = fr_sample(sampler, logits, &sp, (uint64_t)first + (uint64_t)i, 0, &new_tok[i], &new_lp[i]);
        owner[i] = i;
    }
    int n_new = n_samples;
    while (!st) {
        int n_step = 0;
        for (int k = 0; k < n_new; k++) {   /* record the tokens just drawn */
            sample *x = &smp[owner[k]];
            x->tokens[x->n] = new_tok[k];
            x->logprobs[x->n++] = new_lp[k];
            if (is_stop(new_tok[k], stop, n_stop) || x->n == max_tokens) {
                x->done = 1;
                x->finish = is_stop(new_tok[k], stop, n_stop) ? "stop" : "length";
                fr_kv_seq_free(s.kv, x->seq);
                active--;
            }
        }
        if (active == 0) break;
        for (int i = 0; i < n_samples; i++) {
            sample *x = &smp[i];
            if (x->done) continue;
            step_tok[i] = x->tokens[x->n - 1];
            steps[n_step] = (fr_step_seq){.seq = x->seq, .n = 1, .tokens = &step_tok[i], .all_logits = 0};
            drows[n_step] = (fr_decode_row){.params = sp, .sequence = (uint64_t)first + (uint64_t)i, .step = (uint64_t)x->n};
            owner[n_step++] = i;
        }
        st = fr_session_decode(&s, steps, drows, n_step, new_tok, new_lp);
        n_new = n_step;
    }
    if (!st && tl.output_rank)
        for (int i = 0; i < n_samples; i++) print_sample(&smp[i], first + i, json, sp.seed, fr_cli_byte_model(mc));
    if (st) fprintf(stderr, "fp4rollout generate: %s\n", fr_last_error());
    for (int i = 0; smp && i < n_samples; i++) { free(smp[i].tokens); free(smp[i].logprobs); }
    free(smp); free(logits); free(step_tok); free(owner); free(new_tok); free(new_lp); free(steps); free(drows); free(ids); free(stop);
    fr_sampler_destroy(&sampler);
    fr_session_close(&s);
    fr_tp_launch_close(&tl);
    return st ? 1 : 0;
}
