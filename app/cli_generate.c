/* fp4rollout generate: n sampled continuations of one prompt, sharing the
 * prompt's prefill and full KV pages, decoded together in one batch. */
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "base/log.h"
#include "rollout/model/sampler.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

const char fr_generate_usage[] =
    "usage: fp4rollout generate [--prompt TEXT | --prompt-text-file F | --prompt-ids IDS\n"
    "                           | --prompt-file F] [--n N] [--max-tokens N] [--stop S...]\n"
    "                           [--greedy | --temperature T --top-p P --top-k K]\n"
    "                           [--seed S [--first-sample I]] [--json]\n"
    "                           [more sampling options] [engine options]\n"
    "\n"
    "Samples N continuations of the prompt, sharing its prefill and full KV pages,\n"
    "decoded together. A prompt as text goes through the model's tokenizer (the\n"
    "checkpoint folder's tokenizer.json, --tokenizer, or bytes for byte-level\n"
    "models); without a prompt option the prompt is BOS and \"hello\" in bytes\n"
    "(256,104,101,108,108,111). Each token's log-prob is the full-vocabulary\n"
    "log-softmax of logits / temperature at that token (temperature 1 when greedy),\n"
    "whatever top-k and top-p kept: the quantity trainers recompute. With --tp N\n"
    "under mpirun, every rank runs the same steps and draws (on the full gathered\n"
    "logits) and world rank 0 prints. --json prints one line per sample: sample,\n"
    "token_ids, logprobs, finish_reason (stop | length), seed, with a tokenizer\n"
    "text (and stop_str when a stop string ended it), and with the log-prob\n"
    "options top_logprobs and prompt_logprobs.\n";

typedef struct {
    int seq, n, done;
    int *tokens;
    float *logprobs;
    const char *finish;
    int *top_ids;          /* [max_tokens * top_n] with --logprobs */
    float *top_lps;
    fr_sample_text *text;  /* with a tokenizer: its text and the stop strings */
} sample;

/* --min-tokens and --logprobs: every token is drawn on the host by the CPU
 * sampler with its extras, from logits the backend hands over. */
typedef struct {
    int on, min_tokens, top_n;
    const int *stop;
    int n_stop;
    float *kept;           /* [n_samples][vocab]: a decode step's logits */
    int *keep;             /* 0, 1, ...: every row of the step */
} host_draws;

/* Draws x's next token (index x->n) from logits with the options. */
static fr_status host_draw(const host_draws *h, fr_sampler *sampler, const float *logits,
                           const fr_sampling_params *sp, uint64_t sequence, const sample *x, int *tok, float *lp)
{
    const int bar = x->n < h->min_tokens;
    fr_sample_extras ex = {.banned = bar ? h->stop : NULL, .n_banned = bar ? h->n_stop : 0, .top_n = h->top_n,
                           .top_ids = h->top_n ? x->top_ids + (size_t)x->n * h->top_n : NULL,
                           .top_logprobs = h->top_n ? x->top_lps + (size_t)x->n * h->top_n : NULL};
    return fr_sample_ex(sampler, logits, sp, sequence, (uint64_t)x->n, &ex, tok, lp);
}

/* The log-probs of prompt tokens 1 .. n - 1 from every position's logits
 * (all [n][vocab]), at the sampling temperature (1 when greedy). */
static fr_status prompt_logprobs(const float *all, const int *ids, int n, int V, float temperature, float *lsm,
                                 float *out)
{
    fr_status st = FR_OK;
    for (int i = 0; i + 1 < n && !st; i++)
        if (!(st = fr_log_softmax(all + (size_t)i * V, V, temperature, lsm))) out[i] = lsm[ids[i + 1]];
    return st;
}

static int is_stop(int tok, const int *stop, int n_stop)
{
    for (int i = 0; i < n_stop; i++)
        if (stop[i] == tok) return 1;
    return 0;
}

/* What every sample's line says beside its own numbers. */
typedef struct {
    int json, top_n;
    uint64_t seed;
    const fr_stop_strings *stops;
} print_opts;

/* The sample's text (with a tokenizer): ,"text":"..." and the stop string
 * that ended it in a JSON line, else a line of text with \n for newlines. */
static void put_text(fr_buf *b, const sample *s, const print_opts *po)
{
    if (!s->text) return;
    size_t len;
    const char *t = fr_sample_text_get(s->text, &len, NULL);
    const int k = fr_sample_text_matched(s->text);
    if (po->json) {
        fr_cli_json_string(b, "text", t, len);
        if (k >= 0) fr_cli_json_string(b, "stop_str", po->stops->s[k], strlen(po->stops->s[k]));
        return;
    }
    fr_buf_printf(b, "\n  text: ");
    for (size_t i = 0; i < len; i++) {
        if (t[i] == '\n') fr_buf_put(b, "\\n", 2);
        else fr_buf_put(b, t + i, 1);
    }
}

/* plp: the prompt log-probs to print with this sample (n_plp), or NULL. */
static void print_sample(const sample *s, int idx, const print_opts *po, const float *plp, int n_plp)
{
    fr_buf b = {0};
    if (po->json) {
        fr_buf_printf(&b, "{\"sample\":%d,\"token_ids\":[", idx);
        for (int i = 0; i < s->n; i++) fr_buf_printf(&b, "%s%d", i ? "," : "", s->tokens[i]);
        fr_buf_printf(&b, "],\"logprobs\":[");
        for (int i = 0; i < s->n; i++) fr_buf_printf(&b, "%s%.9g", i ? "," : "", s->logprobs[i]);   /* round-trips a float */
        fr_buf_printf(&b, "],\"finish_reason\":\"%s\",\"seed\":%llu", s->finish, (unsigned long long)po->seed);
        put_text(&b, s, po);
        fr_cli_json_logprobs(&b, po->top_n, s->top_ids, s->top_lps, s->n, plp, n_plp);
        fr_buf_printf(&b, "}\n");
    } else {
        fr_buf_printf(&b, "sample %d (%s, %d tokens):", idx, s->finish, s->n);
        for (int i = 0; i < s->n; i++) fr_buf_printf(&b, " %d", s->tokens[i]);
        put_text(&b, s, po);
        fr_buf_printf(&b, "\n");
    }
    if (!b.failed && b.len) fwrite(b.data, 1, b.len, stdout);
    fr_buf_free(&b);
}

/* One generate run: the session, the prompt and every sample's state. */
typedef struct {
    fr_session *s;
    const int *ids;
    int n_ids, n_samples, first, chunk, max_tokens;
    const int *stop;
    int n_stop;
    fr_sampling_params sp;
    host_draws h;
    fr_sampler *sampler;
    sample *smp;
    float *logits;         /* [vocab], or [n_ids][vocab] with prompt log-probs */
    int *step_tok, *owner, *new_tok;
    float *new_lp;
    fr_step_seq *steps;
    fr_decode_row *drows;
    const fr_tokenizer *tok;          /* NULL: no text */
    const fr_stop_strings *stops;
} gen_run;

static void gen_run_free(gen_run *g)
{
    for (int i = 0; g->smp && i < g->n_samples; i++) {
        free(g->smp[i].tokens); free(g->smp[i].logprobs); free(g->smp[i].top_ids); free(g->smp[i].top_lps);
        fr_sample_text_free(&g->smp[i].text);
    }
    free(g->smp); free(g->logits); free(g->step_tok); free(g->owner); free(g->new_tok); free(g->new_lp);
    free(g->steps); free(g->drows); free(g->h.kept); free(g->h.keep);
    fr_sampler_destroy(&g->sampler);
}

static fr_status gen_run_alloc(gen_run *g, int V, int all_logits)
{
    const size_t n = (size_t)g->n_samples, T = (size_t)g->max_tokens, K = (size_t)g->h.top_n;
    g->smp = calloc(n, sizeof *g->smp);
    g->logits = malloc(sizeof(float) * (size_t)V * (all_logits ? (size_t)g->n_ids : 1));
    g->step_tok = malloc(sizeof(int) * n);
    g->owner = malloc(sizeof(int) * n);
    g->new_tok = malloc(sizeof(int) * n);
    g->new_lp = malloc(sizeof(float) * n);
    g->steps = malloc(sizeof *g->steps * n);
    g->drows = malloc(sizeof *g->drows * n);
    int ok = g->smp && g->logits && g->step_tok && g->owner && g->new_tok && g->new_lp && g->steps && g->drows;
    if (ok && g->h.on) {
        g->h.kept = malloc(sizeof(float) * (size_t)V * n);
        g->h.keep = malloc(sizeof(int) * n);
        ok = g->h.kept && g->h.keep;
        for (int i = 0; ok && i < g->n_samples; i++) g->h.keep[i] = i;
    }
    for (size_t i = 0; ok && i < n; i++) {
        g->smp[i].seq = -1;
        g->smp[i].tokens = malloc(sizeof(int) * T);
        g->smp[i].logprobs = malloc(sizeof(float) * T);
        ok = g->smp[i].tokens && g->smp[i].logprobs;
        if (ok && K) {
            g->smp[i].top_ids = malloc(sizeof(int) * T * K);
            g->smp[i].top_lps = malloc(sizeof(float) * T * K);
            ok = g->smp[i].top_ids && g->smp[i].top_lps;
        }
        if (ok && g->tok && fr_sample_text_new(g->tok, g->stops, 1, &g->smp[i].text)) return FR_ENOMEM;
    }
    if (!ok) return fr_fail(FR_ENOMEM, "out of memory");
    return fr_sampler_new(V, &g->sampler);
}

/* The first token of sample i from logits. */
static fr_status first_token(gen_run *g, const float *logits, int i)
{
    const uint64_t q = (uint64_t)g->first + (uint64_t)i;
    if (g->h.on) return host_draw(&g->h, g->sampler, logits, &g->sp, q, &g->smp[i], &g->new_tok[i], &g->new_lp[i]);
    return fr_sample(g->sampler, logits, &g->sp, q, 0, &g->new_tok[i], &g->new_lp[i]);
}

/* Records tok (log-prob lp) as x's next token: its text, and whether it
 * ends x (a stop id, a stop string its text completes, the length). */
static fr_status record(gen_run *g, sample *x, int tok, float lp)
{
    x->tokens[x->n] = tok;
    x->logprobs[x->n++] = lp;
    int matched = -1;
    fr_status st = x->text ? fr_sample_text_push(x->text, tok, x->n >= g->h.min_tokens, &matched) : FR_OK;
    const int stops = matched >= 0 || is_stop(tok, g->stop, g->n_stop);
    if (st || (!stops && x->n < g->max_tokens)) return st;
    x->done = 1;
    x->finish = stops ? "stop" : "length";
    fr_kv_seq_free(g->s->kv, x->seq);
    return x->text ? fr_sample_text_finish(x->text) : FR_OK;
}

/* One prefill; the other samples fork it (full pages shared, the partial
 * page copied), then batched decode steps, which sample on the backend
 * (the GPU when it runs there) with the same draws, or hand their logits
 * over for host draws. plp (NULL: not asked) receives the prompt's
 * log-probs. */
static fr_status run_samples(gen_run *g, float *plp)
{
    const int V = g->s->model->cfg.vocab_size;
    fr_status st = gen_run_alloc(g, V, plp != NULL);
    float *last = g->logits + (plp ? (size_t)(g->n_ids - 1) * (size_t)V : 0);
    if (!st) st = fr_session_prefill(g->s, g->ids, g->n_ids, g->chunk, &g->smp[0].seq, last, plp ? g->logits : NULL);
    if (!st && plp) {   /* the vocabulary's row of scratch: the new tokens' buffer is big enough only for n */
        float *lsm = malloc(sizeof(float) * (size_t)V);
        st = lsm ? prompt_logprobs(g->logits, g->ids, g->n_ids, V, g->sp.temperature, lsm, plp)
                 : fr_fail(FR_ENOMEM, "out of memory");
        free(lsm);
    }
    for (int i = 1; !st && i < g->n_samples; i++) st = fr_session_fork(g->s, g->smp[0].seq, &g->smp[i].seq);
    int active = g->n_samples;
    for (int i = 0; !st && i < g->n_samples; i++) {
        st = first_token(g, last, i);
        g->owner[i] = i;
    }
    int n_new = g->n_samples;
    while (!st) {
        int n_step = 0;
        for (int k = 0; k < n_new && !st; k++) {   /* record the tokens just drawn */
            sample *x = &g->smp[g->owner[k]];
            st = record(g, x, g->new_tok[k], g->new_lp[k]);
            active -= x->done;
        }
        if (st || active == 0) break;
        for (int i = 0; i < g->n_samples; i++) {
            sample *x = &g->smp[i];
            if (x->done) continue;
            g->step_tok[i] = x->tokens[x->n - 1];
            g->steps[n_step] = (fr_step_seq){.seq = x->seq, .n = 1, .tokens = &g->step_tok[i], .all_logits = 0};
            g->drows[n_step] = (fr_decode_row){.params = g->sp, .sequence = (uint64_t)g->first + (uint64_t)i,
                                               .step = (uint64_t)x->n};
            g->owner[n_step++] = i;
        }
        if (!g->h.on) {
            st = fr_session_decode(g->s, g->steps, g->drows, n_step, g->new_tok, g->new_lp);
        } else {
            st = fr_session_decode_keep(g->s, g->steps, g->drows, n_step, NULL, NULL, g->h.keep, n_step, g->h.kept);
            for (int k = 0; k < n_step && !st; k++)
                st = host_draw(&g->h, g->sampler, g->h.kept + (size_t)k * V, &g->sp, g->drows[k].sequence,
                               &g->smp[g->owner[k]], &g->new_tok[k], &g->new_lp[k]);
        }
        n_new = n_step;
    }
    return st;
}


/* The request against the model: what the command line asks that this
 * model cannot do is a usage error (2); a prompt file it refuses, a
 * runtime failure (1). 0 when it can run. */
static int check_request(fr_cmd cmd, const fr_cli_values *v, const fr_model_config *mc, gen_run *g)
{
    const int from_file = fr_opt_given(v, FR_O_PROMPT_FILE);
    if (fr_check_prompt(mc, g->ids, g->n_ids, 0)) return fr_cli_fail(cmd, from_file ? 1 : 2);
    if (g->n_ids + g->max_tokens > mc->max_position) g->max_tokens = mc->max_position - g->n_ids;
    if (g->h.min_tokens > g->max_tokens)
        return fr_cli_usage_error(cmd, "--min-tokens %d exceeds the %d tokens the context window leaves",
                                  g->h.min_tokens, g->max_tokens);
    if (fr_sampling_params_check(&g->sp, mc->vocab_size)) return fr_cli_fail(cmd, 2);
    if (g->h.top_n > mc->vocab_size)
        return fr_cli_usage_error(cmd, "--logprobs %d exceeds the vocabulary of %d", g->h.top_n, mc->vocab_size);
    return 0;
}

/* Every sample drawn, then printed on the output rank. */
static int generate(fr_cmd cmd, const fr_cli_sampling *so, const fr_tp_launch *tl, gen_run *g)
{
    const print_opts po = {.json = so->json, .top_n = so->logprobs, .seed = g->sp.seed, .stops = g->stops};
    float *plp = NULL;
    fr_status st = FR_OK;
    if (so->prompt_logprobs && !(plp = malloc(sizeof(float) * (size_t)(g->n_ids > 1 ? g->n_ids - 1 : 1))))
        st = fr_fail(FR_ENOMEM, "out of memory");
    if (!st) st = run_samples(g, plp);
    if (!st && tl->output_rank)
        for (int i = 0; i < g->n_samples; i++)
            print_sample(&g->smp[i], g->first + i, &po, i == 0 ? plp : NULL, g->n_ids - 1);
    free(plp);
    return st ? fr_cli_fail(cmd, 1) : 0;
}

/* The run's text: the tokenizer, the prompt (as text or ids) and the stop
 * strings. 0, or the exit status after printing why. */
static int read_text(fr_cmd cmd, const fr_cli_values *v, const fr_engine_opts *eo, fr_cli_text *tx,
                     fr_stop_strings *stops, const int **ids, int *n_ids, int **owned)
{
    int rc = fr_cli_text_open(cmd, eo->model, fr_opt_str(v, FR_O_MODEL_TOKENIZER), tx);
    if (!rc && fr_cli_stops_of(v, FR_O_STOP, fr_opt_int(v, FR_O_INCLUDE_STOP), stops)) rc = fr_cli_fail(cmd, 2);
    if (!rc && stops->n > 0 && !tx->tok) {
        fr_cli_text_none(tx, "--stop");
        rc = fr_cli_fail(cmd, 2);
    }
    if (!rc) rc = fr_cli_read_prompt(cmd, v, tx, "256,104,101,108,108,111", ids, n_ids, owned);
    return rc;
}

int fr_cli_generate(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_GENERATE;
    fr_cli_sampling so;
    fr_engine_opts eo;
    fr_cli_text tx;
    fr_stop_strings stop_strings;
    const int *ids = NULL;
    int *owned = NULL, *stops = NULL, n_ids = 0, rc;
    if ((rc = fr_cli_sampling_get(cmd, v, &so))) return rc;
    fr_cli_engine_opts_get(v, &eo);
    if ((rc = read_text(cmd, v, &eo, &tx, &stop_strings, &ids, &n_ids, &owned))) {
        fr_cli_text_close(&tx);
        free(owned);
        return rc;
    }
    fr_tp_launch tl;
    if ((rc = fr_cli_launch(cmd, eo.tp, &tl))) {
        fr_cli_text_close(&tx);
        free(owned);
        return rc;
    }
    eo.group = tl.group;
    /* Every rank drew its own seed when none was given: rank 0's is the run's. */
    fr_status st = fr_tp_launch_agree_seed(&tl, &so.sp.seed);
    if (!st && tl.output_rank) fr_info("generate: seed %llu", (unsigned long long)so.sp.seed);
    fr_session s;
    const int pages = (n_ids + so.max_tokens + 127) / 128 + 1;
    if (!st) st = fr_session_open(&eo, pages * so.n_samples + 1, so.n_samples, &s);
    if (st) {
        fr_cli_text_close(&tx);
        free(owned);
        fr_tp_launch_close(&tl);
        return fr_cli_fail(cmd, 1);
    }
    /* Every sample's first token comes from the prefill's logits (all of
     * its positions' with --prompt-logprobs); with --min-tokens or
     * --logprobs every token is drawn on the host (host_draws). */
    if (fr_cli_default_stops(&s.model->cfg, &so, &stops)) rc = fr_cli_fail(cmd, 1);
    gen_run g = {.s = &s, .ids = ids, .n_ids = n_ids, .n_samples = so.n_samples, .first = so.first_sample,
                 .chunk = eo.chunk, .max_tokens = so.max_tokens, .stop = so.stop, .n_stop = so.n_stop, .sp = so.sp,
                 .h = {.on = so.min_tokens > 0 || so.logprobs > 0, .min_tokens = so.min_tokens, .top_n = so.logprobs,
                       .stop = so.stop, .n_stop = so.n_stop},
                 .tok = tx.tok, .stops = &stop_strings};
    if (!rc) rc = check_request(cmd, v, &s.model->cfg, &g);
    if (!rc) rc = generate(cmd, &so, &tl, &g);
    gen_run_free(&g);
    free(owned);
    free(stops);
    fr_session_close(&s);
    fr_tp_launch_close(&tl);
    fr_cli_text_close(&tx);
    return rc;
}
