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

const char fr_rollout_usage[] =
    "usage: fp4rollout rollout --prompts FILE [--n N] [--max-tokens N] [--stop S...]\n"
    "                          [--greedy | --temperature T --top-p P --top-k K]\n"
    "                          [--seed S [--first-sample I]] [--max-seqs N] [--kv-blocks N]\n"
    "                          [--kl-sample-rate R] [--json] [more sampling options]\n"
    "                          [engine options]\n"
    "\n"
    "Runs every prompt of FILE through the continuous-batching scheduler\n"
    "(docs/scheduler.md) and prints each sample as it ends; a stats line goes to\n"
    "stderr. Sample i of a request draws token t with the keys (seed, i, t), so\n"
    "the tokens do not depend on --max-seqs, --kv-blocks or the other prompts.\n"
    "Under mpirun -np W with --tp T, the W / T engines split the prompts (engine\n"
    "e takes prompts i with i % engines == e) and world rank 0 prints every\n"
    "sample at the end, in request order, and one stats line for all engines.\n"
    "A prompt given as a JSON string goes through the model's tokenizer (the\n"
    "checkpoint folder's tokenizer.json, --tokenizer, or bytes for byte-level\n"
    "models). --json prints one line per sample: request_id, sample, token_ids,\n"
    "logprobs, finish_reason (stop | length | abort | error), seed, with a\n"
    "tokenizer text (and stop_str when a stop string ended it), for monitored\n"
    "samples kl_mean, kl_max and top1_agreement, and with the log-prob options\n"
    "top_logprobs and prompt_logprobs; without it, a readable line per sample.\n";

/* Where finished samples go: printed at once (one process), kept as records
 * for world rank 0 (an engine leader under mpirun), or dropped (the other
 * ranks of an engine, which compute the same samples). */
enum { OUT_PRINT, OUT_KEEP, OUT_DROP };

typedef struct {
    int json, mode;
    uint64_t seed;
    const fr_stop_strings *stops;   /* to name the one that ended a sample */
    fr_buf line, records;
} out_ctx;

/* The engines' totals on world rank 0. Each engine leader sends its
 * request count, whether it failed, and its scheduler's stats
 * (fr_scheduler_stats_put) ahead of its samples. */
typedef struct {
    long long requests, failed;
    fr_scheduler_stats ss;
} engine_totals;

/* A sample's text, when it has one: ,"text" and ,"stop_str" of a JSON line,
 * or a line of text with \n for newlines. */
static void put_text(fr_buf *b, int json, const fr_stop_strings *stops, const fr_sample_result *r)
{
    if (!r->text) return;
    if (json) {
        fr_cli_json_string(b, "text", r->text, r->text_len);
        if (r->stop_string > 0 && stops && r->stop_string <= stops->n) {
            const char *s = stops->s[r->stop_string - 1];
            fr_cli_json_string(b, "stop_str", s, strlen(s));
        }
        return;
    }
    fr_buf_printf(b, "  text: ");
    for (size_t i = 0; i < r->text_len; i++) {
        if (r->text[i] == '\n') fr_buf_put(b, "\\n", 2);
        else fr_buf_put(b, r->text + i, 1);
    }
    fr_buf_printf(b, "\n");
}

/* A sample's output line: JSON or text. */
static void format_line(int json, uint64_t seed, const fr_stop_strings *stops, const fr_sample_result *r, fr_buf *b)
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
        put_text(b, 1, stops, r);
        fr_cli_json_logprobs(b, r->top_n, r->top_ids, r->top_logprobs, r->n_tokens, r->prompt_logprobs,
                             r->n_prompt_logprobs);
        fr_buf_printf(b, "}\n");
    } else {
        fr_buf_printf(b, "request %llu sample %d (%s, %d tokens):", (unsigned long long)r->request_id, r->sample,
                      fr_finish_reason_name(r->finish), r->n_tokens);
        for (int i = 0; i < r->n_tokens; i++) fr_buf_printf(b, " %d", r->tokens[i]);
        fr_buf_printf(b, "\n");
        put_text(b, 0, stops, r);
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
    format_line(o->json, o->seed, o->stops, r, &o->line);
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
static fr_status print_gathered(const char *all, const size_t *counts, int world_size, const out_ctx *oc,
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
            format_line(oc->json, oc->seed, oc->stops, &res[i], &line);
            if (!line.failed) fwrite(line.data, 1, line.len, stdout);
        }
        if (line.failed) st = fr_fail(FR_ENOMEM, "out of memory");
        fr_buf_free(&line);
    }
    for (size_t i = 0; i < n; i++) fr_sample_result_free(&res[i]);
    free(res);
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
        if (all_len) gst = print_gathered(all, counts, tl->world_size, oc, &sum);
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


/* One rollout: the session of this rank's engine, the prompts, and the options. */
typedef struct {
    fr_session *s;
    const fr_tp_launch *tl;
    const fr_cli_prompts *pl;
    const fr_cli_sampling *so;
    int max_seqs, kv_blocks, chunk, tp;
    double kl_rate;
    const fr_tokenizer *tok;          /* NULL: no text */
    const fr_stop_strings *stops;
} rollout_run;

/* This engine's share of the prompts (under mpirun, engine e takes the
 * prompts i with i % n_engines == e; all ranks of an engine the same). */
static fr_status submit_all(fr_scheduler *sch, const rollout_run *run, int *n_requests)
{
    const fr_cli_prompts *pl = run->pl;
    const fr_cli_sampling *so = run->so;
    for (int i = 0; i < pl->n; i++) {
        if (i % run->tl->n_engines != run->tl->engine) continue;
        fr_request_spec r = {.id = (uint64_t)i, .group = (uint64_t)i, .prompt = pl->ids[i], .n_prompt = pl->len[i],
                             .n = so->n_samples, .first_sample = so->first_sample, .params = so->sp,
                             .max_tokens = so->max_tokens, .stop_ids = so->stop, .n_stop = so->n_stop,
                             .monitor = -1, .min_tokens = so->min_tokens, .top_logprobs = so->logprobs,
                             .prompt_logprobs = so->prompt_logprobs, .stop_strings = *run->stops,
                             .with_text = run->tok != NULL};
        fr_status st = fr_scheduler_submit(sch, &r);
        if (st) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            return fr_fail(st, "prompt %d: %s", i, msg);
        }
        (*n_requests)++;
    }
    return FR_OK;
}

/* The scheduler's stats and the divergence over every weight version,
 * then the scheduler gone (anything left in flight ends with reason abort). */
static void finish_scheduler(fr_scheduler **sch, fr_scheduler_stats *ss, fr_div_summary *div, long long *monitored)
{
    fr_scheduler_stats_get(*sch, ss);
    const fr_div_aggregates *agg = fr_scheduler_divergence(*sch);
    for (int v = 0; v < FR_DIV_VERSIONS; v++)
        if (agg->v[v].used) {
            div->n += agg->v[v].all.n;
            div->kl_sum += agg->v[v].all.kl_sum;
            div->kl_max = fmax(div->kl_max, agg->v[v].all.kl_max);
            div->top1_agree += agg->v[v].all.top1_agree;
        }
    *monitored = agg->samples;
    fr_scheduler_destroy(sch);
}


/* The prompts through the scheduler of this rank's engine; the samples
 * printed (one process) or gathered on world rank 0. */
static fr_status run_rollout(const rollout_run *run)
{
    fr_session *s = run->s;
    const fr_tp_launch *tl = run->tl;
    const fr_cli_prompts *pl = run->pl;
    const fr_cli_sampling *so = run->so;
    const int multi = tl->world != NULL, kv_blocks = run->kv_blocks;
    out_ctx oc = {.json = so->json, .mode = !multi ? OUT_PRINT : tl->engine_leader ? OUT_KEEP : OUT_DROP,
                  .seed = so->sp.seed, .stops = run->stops};
    fr_scheduler_config sc = {.max_seqs = run->max_seqs, .chunk = run->chunk, .reserve_blocks = -1,
                              .on_done = on_done, .user = &oc, .kl_sample_rate = run->kl_rate,
                              .tokenizer = run->tok};
    fr_scheduler *sch = NULL;
    int n_requests = 0;
    fr_status st = fr_scheduler_new(s, &sc, &sch);
    if (!st) st = submit_all(sch, run, &n_requests);
    const double t_run = fr_now_s();
    if (!st) st = fr_scheduler_run(sch);
    const double run_s = fr_now_s() - t_run;
    if (st && tl->engine_leader) {
        if (multi) fprintf(stderr, "fp4rollout rollout: engine %d: %s\n", tl->engine, fr_last_error());
        else fprintf(stderr, "fp4rollout rollout: %s\n", fr_last_error());
    }
    fr_scheduler_stats ss = {0};
    fr_div_summary div = {0};
    long long monitored = 0;
    const int had_sch = sch != NULL;
    if (sch) finish_scheduler(&sch, &ss, &div, &monitored);
    if (!multi && had_sch) stats_line(pl->n, &ss, kv_blocks, fr_backend_name(s->backend), run_s, monitored, &div);
    if (multi) st = gather_results(tl, &oc, &ss, n_requests, st, run->tp, kv_blocks, fr_backend_name(s->backend));
    free(oc.line.data);
    free(oc.records.data);
    fflush(stdout);
    return st;
}

/* The prompts given as text, encoded; 0 or the exit status after printing why. */
static int encode_prompts(fr_cmd cmd, const fr_cli_text *tx, const char *path, fr_cli_prompts *pl)
{
    for (int i = 0; i < pl->n; i++) {
        if (!pl->text[i]) continue;
        char what[64];
        snprintf(what, sizeof what, "prompt %d", i);
        if (fr_cli_text_encode(tx, what, pl->text[i], strlen(pl->text[i]), &pl->ids[i], &pl->len[i])) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            fr_fail(FR_EINVAL, "%s: %s", path, msg);
            return fr_cli_fail(cmd, tx->tok ? 1 : 2);
        }
    }
    return 0;
}

/* The tokenizer, the stop strings and the prompts (text ones encoded). 0,
 * or the exit status after printing why. */
static int read_inputs(fr_cmd cmd, const fr_cli_values *v, const fr_engine_opts *eo, fr_cli_text *tx,
                       fr_stop_strings *stops, fr_cli_prompts *pl)
{
    int rc = fr_cli_text_open(cmd, eo->model, fr_opt_str(v, FR_O_MODEL_TOKENIZER), tx);
    if (!rc && fr_cli_stops_of(v, FR_O_STOP, fr_opt_int(v, FR_O_INCLUDE_STOP), stops)) rc = fr_cli_fail(cmd, 2);
    if (!rc && stops->n > 0 && !tx->tok) {
        fr_cli_text_none(tx, "--stop");
        rc = fr_cli_fail(cmd, 2);
    }
    const char *path = fr_opt_str(v, FR_O_PROMPTS);
    if (!rc && fr_cli_prompts_read(path, pl)) rc = fr_cli_fail(cmd, 1);
    if (!rc) rc = encode_prompts(cmd, tx, path, pl);
    return rc;
}

int fr_cli_rollout(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_ROLLOUT;
    fr_cli_sampling so;
    fr_engine_opts eo;
    fr_cli_prompts pl = {0};
    fr_cli_text tx = {0};
    fr_stop_strings stop_strings;
    int rc, *stops = NULL;
    if ((rc = fr_cli_sampling_get(cmd, v, &so))) return rc;
    fr_cli_engine_opts_get(v, &eo);
    const int max_seqs = fr_opt_int(v, FR_O_MAX_SEQS);
    int kv_blocks = fr_opt_int(v, FR_O_KV_BLOCKS);
    if ((rc = read_inputs(cmd, v, &eo, &tx, &stop_strings, &pl))) {
        fr_cli_prompts_free(&pl);
        fr_cli_text_close(&tx);
        return rc;
    }
    if (kv_blocks == 0) {   /* enough for max_seqs sequences of the longest prompt */
        int longest = 0;
        for (int i = 0; i < pl.n; i++) longest = pl.len[i] > longest ? pl.len[i] : longest;
        kv_blocks = max_seqs * ((longest + so.max_tokens + 127) / 128);
    }
    fr_tp_launch tl;
    if ((rc = fr_cli_launch(cmd, eo.tp, &tl))) {
        fr_cli_prompts_free(&pl);
        fr_cli_text_close(&tx);
        return rc;
    }
    eo.group = tl.group;
    /* Every rank drew its own seed when none was given: rank 0's is the run's. */
    fr_status st = fr_tp_launch_agree_seed(&tl, &so.sp.seed);
    if (!st && tl.output_rank) fr_info("rollout: seed %llu", (unsigned long long)so.sp.seed);
    fr_session s;
    if (st || (st = fr_session_open(&eo, kv_blocks, max_seqs, &s))) {
        fr_cli_prompts_free(&pl);
        fr_cli_text_close(&tx);
        fr_tp_launch_close(&tl);
        return fr_cli_fail(cmd, 1);
    }
    if ((st = fr_cli_default_stops(&s.model->cfg, &so, &stops))) fr_cli_fail(cmd, 1);
    const rollout_run run = {.s = &s, .tl = &tl, .pl = &pl, .so = &so, .max_seqs = max_seqs, .kv_blocks = kv_blocks,
                             .chunk = eo.chunk, .tp = eo.tp, .kl_rate = fr_opt_num(v, FR_O_KL_SAMPLE_RATE),
                             .tok = tx.tok, .stops = &stop_strings};
    if (!st) st = run_rollout(&run);
    fr_session_close(&s);
    fr_tp_launch_close(&tl);
    fr_cli_prompts_free(&pl);
    fr_cli_text_close(&tx);
    free(stops);
    return st ? 1 : 0;
}
