/* fp4rollout rollout: an offline batch of prompts through the continuous-
 * batching scheduler, one JSON line per sample. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/buf.h"
#include "base/clock.h"
#include "base/log.h"
#include "app/cli.h"
#include "rollout/engine/scheduler.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

static const char usage_text[] =
    "usage: fp4rollout rollout --prompts FILE [--n N] [--max-tokens N]\n"
    "                          [--greedy | --temperature T --top-p P --top-k K]\n"
    "                          [--seed S [--first-sample I]] [--stop-ids IDS] [--ignore-eos]\n"
    "                          [--min-tokens N] [--logprobs K] [--prompt-logprobs]\n"
    "                          [--max-seqs N] [--kv-blocks N] [--kl-sample-rate R] [--json]\n"
    "                          [engine options]\n"
    "\n"
    "Runs every prompt of FILE through the continuous-batching scheduler\n"
    "(docs/scheduler.md) and prints each sample as it ends; a stats line goes to\n"
    "stderr. Sample i of a request draws token t with the keys (seed, i, t), so\n"
    "the tokens do not depend on --max-seqs, --kv-blocks or the other prompts.\n"
    "Under mpirun -np W with --tp T, the W / T engines split the prompts (engine\n"
    "e takes prompts i with i % engines == e) and world rank 0 prints every\n"
    "sample at the end, in request order, and one stats line for all engines.\n"
    "\n"
    "  --prompts FILE       one prompt per line, comma-separated token ids; blank\n"
    "                       lines are skipped (request indices count prompts)\n"
    "  --n N                samples per prompt, sharing its KV pages (default 1)\n"
    "  --max-tokens N       new tokens per sample (default 64)\n"
    "  --greedy             argmax decoding (the default when no temperature is set)\n"
    "  --temperature T      sampling temperature (> 0)\n"
    "  --top-p P            nucleus sampling (0 < P <= 1, default 1)\n"
    "  --top-k K            keep the K most likely tokens (0 = off, default)\n"
    "  --seed S             sampling seed, 0 to 2^64 - 1 (default: a fresh one from\n"
    "                       the operating system); the seed used is printed on\n"
    "                       stderr and in each JSON line: give it to replay a run\n"
    "  --first-sample I     number each prompt's samples I, I+1, ... (default 0):\n"
    "                       sample i draws from stream i of the seed, so --seed S\n"
    "                       --first-sample I --n 1 replays sample I alone\n"
    "  --stop-ids IDS       tokens that end a sample (default: the model's EOS ids)\n"
    "  --ignore-eos         do not stop at the model's EOS ids\n"
    "  --min-tokens N       bar the stop ids (EOS included) until N tokens were drawn\n"
    "  --logprobs K         with --json, every token's K (<= 20) most likely tokens\n"
    "                       and their log-probs: top_logprobs, [[id, logprob], ...]\n"
    "                       per token, best first (docs/sampling.md)\n"
    "  --prompt-logprobs    with --json, the prompt tokens' log-probs in each\n"
    "                       prompt's first sample: prompt_logprobs, null first\n"
    "  --max-seqs N         sequences decoded at once (default 16)\n"
    "  --kv-blocks N        KV cache pages of 128 tokens (default: enough for\n"
    "                       max-seqs sequences of the longest prompt + max-tokens);\n"
    "                       fewer makes the scheduler preempt and recompute\n"
    "  --kl-sample-rate R   share of samples (0..1, default 0) that also run a BF16-KV\n"
    "                       shadow: their divergence (KL over BF16's top-128, top-1\n"
    "                       agreement) is measured at every token (docs/scheduler.md)\n"
    "  --json               one JSON line per sample: request_id, sample, token_ids,\n"
    "                       logprobs, finish_reason (stop | length | abort | error),\n"
    "                       seed, and for monitored samples kl_mean, kl_max,\n"
    "                       top1_agreement\n"
    "                       (default: a readable line per sample)\n"
    "engine options:\n";

/* Where finished samples go: printed at once (one process), kept as records
 * for world rank 0 (an engine leader under mpirun), or dropped (the other
 * ranks of an engine, which compute the same samples). */
enum { OUT_PRINT, OUT_KEEP, OUT_DROP };

typedef struct {
    int json, mode;
    uint64_t seed;
    fr_buf line, records;
} out_ctx;

/* The engines' totals on world rank 0. Each engine leader sends its
 * request count, whether it failed, and its scheduler's stats
 * (fr_scheduler_stats_put) ahead of its samples. */
typedef struct {
    long long requests, failed;
    fr_scheduler_stats ss;
} engine_totals;

/* A sample's output line: JSON or text. */
static void format_line(int json, uint64_t seed, const fr_sample_result *r, fr_buf *b)
{
    b->len = 0;
    if (json) {
        fr_buf_printf(b, "{\"request_id\":%llu,\"sample\":%d,\"token_ids\":[", (unsigned long long)r->request_id, r->sample);
        for (int i = 0; i < r->n_tokens; i++) fr_buf_printf(b, "%s%d", i ? "," : "", r->tokens[i]);
        fr_buf_printf(b, "],\"logprobs\":[");
        for (int i = 0; i < r->n_tokens; i++) fr_buf_printf(b, "%s%.9g", i ? "," : "", r->logprobs[i]);   /* round-trips a float */
        fr_buf_printf(b, "],\"finish_reason\":\"%s\",\"seed\":%llu", fr_finish_reason_name(r->finish),
                      (unsigned long long)seed);
        if (r->monitored && r->div.n > 0)
            fr_buf_printf(b, ",\"kl_mean\":%.6g,\"kl_max\":%.6g,\"top1_agreement\":%.6g", fr_div_summary_mean(&r->div),
                          r->div.kl_max, (double)r->div.top1_agree / (double)r->div.n);
        fr_cli_json_logprobs(b, r->top_n, r->top_ids, r->top_logprobs, r->n_tokens, r->prompt_logprobs,
                             r->n_prompt_logprobs);
        fr_buf_printf(b, "}\n");
    } else {
        fr_buf_printf(b, "request %llu sample %d (%s, %d tokens):", (unsigned long long)r->request_id, r->sample,
                      fr_finish_reason_name(r->finish), r->n_tokens);
        for (int i = 0; i < r->n_tokens; i++) fr_buf_printf(b, " %d", r->tokens[i]);
        fr_buf_printf(b, "\n");
    }
}

static void on_done(void *user, const fr_sample_result *r)
{
    out_ctx *o = user;
    if (o->mode == OUT_DROP) return;
    if (o->mode == OUT_KEEP) {
        fr_sample_result_put(&o->records, r, 1);
        return;
    }
    format_line(o->json, o->seed, r, &o->line);
    if (!o->line.failed) fwrite(o->line.data, 1, o->line.len, stdout);
}

static int result_cmp(const void *a, const void *b)
{
    const fr_sample_result *x = a, *y = b;
    if (x->request_id != y->request_id) return x->request_id < y->request_id ? -1 : 1;
    return (x->sample > y->sample) - (x->sample < y->sample);
}

/* World rank 0: every engine's samples in request order on stdout, and the
 * engines' totals summed into *sum. */
static fr_status print_gathered(const char *all, const size_t *counts, int world_size, int json, uint64_t seed,
                                engine_totals *sum)
{
    size_t n = 0, cap = 0;
    fr_sample_result *res = NULL;
    fr_status st = FR_OK;
    memset(sum, 0, sizeof *sum);
    const char *p = all;
    for (int r = 0; !st && r < world_size; p += counts[r], r++) {
        if (counts[r] == 0) continue;   /* a rank that is not an engine leader */
        fr_rank_reader rd = {(const unsigned char *)p, counts[r], 0, 0};
        sum->requests += (long long)fr_rank_get_u64(&rd);
        sum->failed += fr_rank_get_u8(&rd);
        fr_scheduler_stats ss;
        fr_scheduler_stats_read(&rd, &ss);
        fr_scheduler_stats_add(&sum->ss, &ss);
        if (rd.bad) {
            st = fr_fail(FR_EIO, "rank %d sent %zu bytes, too few for its totals", r, counts[r]);
            break;
        }
        while (!st && fr_rank_more(&rd)) {
            if (n == cap) {
                size_t c = cap ? cap * 2 : 256;
                fr_sample_result *v = realloc(res, sizeof *v * c);
                if (!v) {
                    st = fr_fail(FR_ENOMEM, "out of memory");
                    break;
                }
                res = v;
                cap = c;
            }
            if (fr_sample_result_get(&rd, &res[n])) st = fr_fail(FR_EIO, "rank %d sent a bad result: %s", r, fr_last_error());
            else n++;
        }
    }
    if (!st) {
        qsort(res, n, sizeof *res, result_cmp);
        fr_buf line = {0};
        for (size_t i = 0; i < n; i++) {
            format_line(json, seed, &res[i], &line);
            if (!line.failed) fwrite(line.data, 1, line.len, stdout);
        }
        if (line.failed) st = fr_fail(FR_ENOMEM, "out of memory");
        fr_buf_free(&line);
    }
    for (size_t i = 0; i < n; i++) fr_sample_result_free(&res[i]);
    free(res);
    return st;
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

/* Under mpirun: every rank enters the gather, failed or not; the engine
 * leaders send their engine's totals and samples (fr_sample_result_put),
 * the other ranks nothing, and world rank 0 prints every sample in request
 * order with the totals. Every rank then returns alike: a failure when any
 * engine failed. */
static fr_status gather_results(const fr_tp_launch *tl, const out_ctx *oc, const fr_scheduler_stats *ss,
                                int n_requests, fr_status st, int tp, int kv_blocks, const char *backend)
{
    const fr_buf *records = &oc->records;
    if (records->failed && !st) st = fr_fail(FR_ENOMEM, "out of memory keeping the results");
    fr_buf mine = {0};
    if (tl->engine_leader) {
        fr_rank_put_u64(&mine, (uint64_t)n_requests);
        fr_rank_put_u8(&mine, st != FR_OK);
        fr_scheduler_stats_put(&mine, ss);
        fr_buf_put(&mine, records->data, records->len);
        if (mine.failed) {
            if (!st) st = fr_fail(FR_ENOMEM, "out of memory sending the results");
            mine.len = 0;
        }
    }
    size_t *counts = tl->output_rank ? calloc((size_t)tl->world_size, sizeof *counts) : NULL;
    void *all = NULL;
    size_t all_len = 0;
    fr_status gst = FR_OK;
    if (fr_mpi_world_gather_bytes(tl->world, mine.data, mine.len, 0, &all, &all_len, counts))
        gst = fr_fail(FR_EIO, "%s", fr_last_error());
    else if (tl->output_rank && !counts)
        gst = fr_fail(FR_ENOMEM, "out of memory");
    else if (tl->output_rank) {
        engine_totals sum = {0};
        if (all_len) gst = print_gathered(all, counts, tl->world_size, oc->json, oc->seed, &sum);
        if (!gst)
            fprintf(stderr,
                    "rollout: engines %d x tp %d (world %d) requests %lld samples %lld tokens %lld "
                    "prefill_tokens %lld steps %lld preemptions %lld kv_blocks %d backend %s\n",
                    tl->n_engines, tp, tl->world_size, sum.requests, sum.ss.finished, sum.ss.tokens_generated,
                    sum.ss.prefill_tokens, sum.ss.steps, sum.ss.preemptions, kv_blocks, backend);
    }
    if (gst) {
        fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
        if (!st) st = gst;
    }
    int all_ok = 0;
    if (fr_mpi_world_all_ok(tl->world, st == FR_OK, &all_ok)) all_ok = 0;
    if (!all_ok && !st) st = FR_EIO;
    free(all);
    free(counts);
    fr_buf_free(&mine);
    return st;
}

/* The options of this command (app/cli_args.c reads them with getopt_long). */
static const struct option own_opts[] = {
    {"prompts", required_argument, 0, 0}, {"max-seqs", required_argument, 0, 0},
    {"kv-blocks", required_argument, 0, 0}, {"kl-sample-rate", required_argument, 0, 0}, {0, 0, 0, 0},
};

/* The one-engine run's stats line (bench/monitor_cost.sh reads it). */
static void stats_line(int n_prompts, const fr_scheduler_stats *ss, int kv_blocks, const char *backend, double run_s,
                       long long monitored, const fr_div_summary *div)
{
    fprintf(stderr,
            "rollout: requests %d samples %lld tokens %lld prefill_tokens %lld steps %lld preemptions %lld "
            "kv_blocks %d backend %s seconds %.3f tokens/s %.0f monitored %lld kl_mean %.6g kl_max %.6g "
            "top1_agreement %.4f decode_steps %lld forward_s %.3f shadow_s %.3f host_s %.3f kl_s %.3f "
            "shadow_open_s %.3f shadow_start_s %.3f carried_steps %lld graph_captures %d graph_capture_s %.3f\n",
            n_prompts, ss->finished, ss->tokens_generated, ss->prefill_tokens, ss->steps, ss->preemptions, kv_blocks,
            backend, run_s, run_s > 0 ? (double)ss->tokens_generated / run_s : 0.0, monitored,
            fr_div_summary_mean(div), div->kl_max, div->n ? (double)div->top1_agree / (double)div->n : 0.0,
            ss->decode_steps, ss->forward_s, ss->shadow_s, ss->host_s, ss->kl_s, ss->shadow_open_s,
            ss->shadow_start_s, ss->carried_steps, ss->graph_captures, ss->graph_capture_s);
}

int fr_cli_rollout(int argc, char **argv)
{
    const char *cmd = "rollout", *path = NULL;
    int max_seqs = 16, kv_blocks = 0;
    double kl_rate = 0.0;
    fr_cli_sampling so;
    fr_cli_sampling_default(&so);
    fr_engine_opts eo;
    fr_cli_engine_opts_default(&eo);
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s%s", usage_text, fr_engine_opts_usage);
        return 0;
    }
    static const struct option *const tables[] = {own_opts, fr_cli_engine_longopts, fr_cli_sampling_longopts, NULL};
    if (fr_cli_args(cmd, &argc, &argv, tables)) return 2;
    for (int i = 1; i < argc; i++) {
        int r = fr_engine_opts_parse(cmd, argc, argv, &i, &eo);
        if (r < 0) return 2;
        if (r) continue;
        if ((r = fr_cli_sampling_parse(cmd, argc, argv, &i, &so)) < 0) return 2;
        if (r) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--prompts") == 0 && v) path = argv[++i];
        else if (strcmp(a, "--max-seqs") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 16, &max_seqs);
        else if (strcmp(a, "--kv-blocks") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 24, &kv_blocks);
        else if (strcmp(a, "--kl-sample-rate") == 0 && v) {
            char *end;
            kl_rate = strtod(argv[++i], &end);
            if (*end || !(kl_rate >= 0.0 && kl_rate <= 1.0))
                return fr_cli_usage_error(cmd, "--kl-sample-rate expects a number in [0, 1], got '%s'", argv[i]);
        }
        else return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", a);
        if (bad) return 2;
    }
    if (!path) return fr_cli_usage_error(cmd, "--prompts is required");
    if (fr_cli_sampling_finish(cmd, &so)) return 2;
    const char *stop_text = so.stop_text;
    int n_samples = so.n_samples, max_tokens = so.max_tokens, json = so.json, ignore_eos = so.ignore_eos;
    fr_sampling_params sp = so.sp;

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
    fr_tp_launch tl;
    if ((st = fr_tp_launch_open(eo.tp, &tl))) {
        fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
        prompts_free(&pl);
        free(stop);
        return 1;
    }
    eo.group = tl.group;
    /* Every rank drew its own seed when none was given: rank 0's is the run's. */
    st = fr_tp_launch_agree_seed(&tl, &sp.seed);
    if (!st && tl.output_rank) fr_info("rollout: seed %llu", (unsigned long long)sp.seed);
    fr_session s;
    if (st || (st = fr_session_open(&eo, kv_blocks, max_seqs, &s))) {
        fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
        prompts_free(&pl);
        free(stop);
        fr_tp_launch_close(&tl);
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
    /* Under mpirun, engine e serves prompts i with i % n_engines == e; all
     * ranks of an engine run the same scheduler on the same share. */
    const int multi = tl.world != NULL;
    out_ctx oc = {.json = json, .mode = !multi ? OUT_PRINT : tl.engine_leader ? OUT_KEEP : OUT_DROP, .seed = sp.seed};
    fr_scheduler_config sc = {.max_seqs = max_seqs, .chunk = eo.chunk, .reserve_blocks = -1, .on_done = on_done,
                              .user = &oc, .kl_sample_rate = kl_rate};
    fr_scheduler *sch = NULL;
    int n_requests = 0;
    st = fr_scheduler_new(&s, &sc, &sch);
    for (int i = 0; !st && i < pl.n; i++) {
        if (i % tl.n_engines != tl.engine) continue;
        fr_request_spec r = {.id = (uint64_t)i, .group = (uint64_t)i, .prompt = pl.ids[i], .n_prompt = pl.len[i],
            .n = n_samples, .first_sample = so.first_sample, .params = sp, .max_tokens = max_tokens, .stop_ids = stop,
            .n_stop = n_stop, .monitor = -1, .min_tokens = so.min_tokens, .top_logprobs = so.logprobs,
            .prompt_logprobs = so.prompt_logprobs};
        if ((st = fr_scheduler_submit(sch, &r))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            st = fr_fail(st, "prompt %d: %s", i, msg);
        } else {
            n_requests++;
        }
    }
    const double t_run = fr_now_s();
    if (!st) st = fr_scheduler_run(sch);
    const double run_s = fr_now_s() - t_run;
    if (st && tl.engine_leader) {
        if (multi) fprintf(stderr, "fp4rollout rollout: engine %d: %s\n", tl.engine, fr_last_error());
        else fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
    }
    fr_scheduler_stats ss = {0};
    const int had_sch = sch != NULL;
    fr_div_summary div = {0};
    long long monitored = 0;
    if (sch) {
        fr_scheduler_stats_get(sch, &ss);
        const fr_div_aggregates *agg = fr_scheduler_divergence(sch);
        for (int v = 0; v < FR_DIV_VERSIONS; v++)
            if (agg->v[v].used) {
                div.n += agg->v[v].all.n;
                div.kl_sum += agg->v[v].all.kl_sum;
                div.kl_max = fmax(div.kl_max, agg->v[v].all.kl_max);
                div.top1_agree += agg->v[v].all.top1_agree;
            }
        monitored = agg->samples;
        fr_scheduler_destroy(&sch);   /* anything left in flight ends with reason abort */
    }
    if (!multi && had_sch) stats_line(pl.n, &ss, kv_blocks, fr_backend_name(s.backend), run_s, monitored, &div);
    if (multi)
        st = gather_results(&tl, &oc, &ss, n_requests, st, eo.tp, kv_blocks, fr_backend_name(s.backend));
    free(oc.line.data);
    free(oc.records.data);
    fflush(stdout);
    fr_session_close(&s);
    fr_tp_launch_close(&tl);
    prompts_free(&pl);
    free(stop);
    return st ? 1 : 0;
}
