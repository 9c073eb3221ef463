/* fp4rollout-client generate: a file of prompts as requests, each sample
 * checked as it streams (contiguous deltas, one done per sample, streamed
 * tokens equal to the done's count, streamed text a prefix of the done's)
 * and printed as a JSON line when it ends, as `fp4rollout rollout --json`
 * prints it. */
#include <stdlib.h>
#include <string.h>

#include "app/client_cli.h"

typedef struct {
    int *tok;
    float *lp;
    int n, cap;
    int dones;
    fr_buf text;              /* the deltas' text joined */
} sample_acc;

typedef struct {
    long long first_id;
    int n_req, n, first_sample;
    sample_acc *acc;          /* [n_req][n]: samples first_sample .. first_sample + n - 1 */
    int failed;
    long long abort_id, abort_after;
    long long abort_seen;     /* tokens of abort_id received */
    int abort_due, abort_sent;
} gen_ctx;

static sample_acc *acc_of(gen_ctx *g, uint64_t request, int sample)
{
    long long r = (long long)request - g->first_id;
    sample -= g->first_sample;
    if (r < 0 || r >= g->n_req || sample < 0 || sample >= g->n) return NULL;
    return &g->acc[r * g->n + sample];
}

/* The accumulator of a sample, or NULL (the run failed) for one not asked for. */
static sample_acc *known_sample(gen_ctx *g, uint64_t request, int sample, const char *what)
{
    sample_acc *a = acc_of(g, request, sample);
    if (!a) {
        fprintf(stderr, "fp4rollout-client: %s for an unknown sample (%llu, %d)\n", what, (unsigned long long)request,
                sample);
        g->failed = 1;
    }
    return a;
}

static void on_tokens(void *user, const fr_msg_tokens *t)
{
    gen_ctx *g = user;
    sample_acc *a = known_sample(g, t->request_id, t->sample, "tokens");
    if (!a) return;
    if (t->start != a->n || a->dones) {
        fprintf(stderr, "fp4rollout-client: request %llu sample %d: delta starts at %d after %d tokens%s\n",
                (unsigned long long)t->request_id, t->sample, t->start, a->n, a->dones ? " and its done" : "");
        g->failed = 1;
    }
    if (a->n + t->n > a->cap) {
        int c = a->cap ? a->cap : 64;
        while (c < a->n + t->n) c *= 2;
        int *tk = realloc(a->tok, sizeof(int) * (size_t)c);
        if (tk) a->tok = tk;
        float *lp = tk ? realloc(a->lp, sizeof(float) * (size_t)c) : NULL;
        if (lp) a->lp = lp;
        if (!tk || !lp) {
            fprintf(stderr, "fp4rollout-client: out of memory\n");
            g->failed = 1;
            return;
        }
        a->cap = c;
    }
    memcpy(a->tok + a->n, t->token_ids, sizeof(int) * (size_t)t->n);
    memcpy(a->lp + a->n, t->logprobs, sizeof(float) * (size_t)t->n);
    a->n += t->n;
    if (t->has_text) fr_buf_put(&a->text, t->text, t->text_len);   /* UTF-8, or the decoder refused it */
    if (g->abort_id >= 0 && (long long)t->request_id == g->abort_id) {
        g->abort_seen += t->n;
        if (g->abort_seen >= g->abort_after && !g->abort_sent) g->abort_due = 1;
    }
}

static void on_done(void *user, const fr_msg_done *d)
{
    gen_ctx *g = user;
    sample_acc *a = known_sample(g, d->request_id, d->sample, "done");
    if (!a) return;
    if (++a->dones > 1) {
        fprintf(stderr, "fp4rollout-client: request %llu sample %d: a second done\n",
                (unsigned long long)d->request_id, d->sample);
        g->failed = 1;
    }
    if (d->n_tokens != a->n) {
        fprintf(stderr, "fp4rollout-client: request %llu sample %d: %d tokens streamed, done says %d\n",
                (unsigned long long)d->request_id, d->sample, a->n, d->n_tokens);
        g->failed = 1;
    }
    if (d->has_text && (a->text.failed || a->text.len > d->text_len ||
                        (a->text.len && memcmp(a->text.data, d->text, a->text.len) != 0))) {
        fprintf(stderr, "fp4rollout-client: request %llu sample %d: the streamed text is not a prefix of the done's\n",
                (unsigned long long)d->request_id, d->sample);
        g->failed = 1;
    }
    printf("{\"request_id\":%llu,\"sample\":%d,\"token_ids\":[", (unsigned long long)d->request_id, d->sample);
    for (int i = 0; i < a->n; i++) printf("%s%d", i ? "," : "", a->tok[i]);
    printf("],\"logprobs\":[");
    for (int i = 0; i < a->n; i++) printf("%s%.9g", i ? "," : "", (double)a->lp[i]);   /* round-trips a float */
    printf("],\"finish_reason\":\"%s\",\"n_tokens\":%d,\"preemptions\":%d,\"ttft_ms\":",
           fr_wire_finish_name(d->finish_reason), d->n_tokens, d->preemptions);
    if (d->has_ttft) printf("%.3f", d->ttft_ms);
    else printf("null");
    printf(",\"total_ms\":%.3f", d->total_ms);
    if (d->has_seed) printf(",\"seed\":%llu", (unsigned long long)d->seed);
    fr_buf extra = {0};
    if (d->has_text) fr_cli_json_string(&extra, "text", d->text, d->text_len);
    if (d->stop_str) fr_cli_json_string(&extra, "stop_str", d->stop_str, strlen(d->stop_str));
    if (d->prompt_token_ids) {
        fr_buf_printf(&extra, ",\"prompt_token_ids\":[");
        for (int i = 0; i < d->n_prompt_token_ids; i++) fr_buf_printf(&extra, "%s%d", i ? "," : "", d->prompt_token_ids[i]);
        fr_buf_printf(&extra, "]");
    }
    fr_cli_json_logprobs(&extra, d->top_k, d->top_token_ids, d->top_logprobs, d->n_tokens, d->prompt_logprobs,
                         d->n_prompt_logprobs);
    fr_cli_json_routes(&extra, d->routed_experts, d->n_tokens, d->route_layers, d->route_k, d->route_width);
    if (extra.failed) g->failed = 1;
    else if (extra.len) fwrite(extra.data, 1, extra.len, stdout);
    fr_buf_free(&extra);
    printf("}\n");
    fflush(stdout);
}

static void on_error(void *user, const fr_msg_error *e)
{
    gen_ctx *g = user;
    fprintf(stderr, "fp4rollout-client: request %llu: %s: %s\n", (unsigned long long)e->request_id, e->code,
            e->message);
    g->failed = 1;
}

/* The request every prompt becomes: the options given, the rest left to
 * the server's defaults. */
static fr_msg_generate request_of(const fr_cli_values *v)
{
    fr_msg_generate g;
    memset(&g, 0, sizeof g);
    g.n = fr_opt_int(v, FR_O_C_N);
    g.monitor_divergence = fr_opt_given(v, FR_O_MONITOR_DIVERGENCE) ? 1 : fr_opt_given(v, FR_O_NO_MONITOR) ? 0 : -1;
    g.has_max_tokens = fr_opt_given(v, FR_O_C_MAX_TOKENS);
    g.max_tokens = fr_opt_int(v, FR_O_C_MAX_TOKENS);
    g.has_temperature = fr_opt_given(v, FR_O_C_TEMPERATURE);
    g.temperature = fr_opt_num(v, FR_O_C_TEMPERATURE);
    g.has_top_p = fr_opt_given(v, FR_O_C_TOP_P);
    g.top_p = fr_opt_num(v, FR_O_C_TOP_P);
    g.has_top_k = fr_opt_given(v, FR_O_C_TOP_K);
    g.top_k = fr_opt_int(v, FR_O_C_TOP_K);
    g.has_seed = fr_opt_given(v, FR_O_C_SEED);
    g.seed = fr_opt_val(v, FR_O_C_SEED)->u;
    g.min_tokens = fr_opt_int(v, FR_O_MIN_TOKENS);
    g.logprobs = fr_opt_int(v, FR_O_LOGPROBS);
    g.prompt_logprobs = fr_opt_int(v, FR_O_PROMPT_LOGPROBS);
    g.return_routed_experts = fr_opt_int(v, FR_O_RETURN_ROUTES);
    g.first_sample = fr_opt_int(v, FR_O_FIRST_SAMPLE);
    const fr_opt_value *stop = fr_opt_val(v, FR_O_C_STOP_IDS);
    g.has_stop_token_ids = stop->given || fr_opt_given(v, FR_O_IGNORE_EOS);   /* --ignore-eos: an empty list */
    if (stop->given) {
        g.stop_token_ids = stop->ids;
        g.n_stop_token_ids = stop->n;
    }
    if (fr_opt_given(v, FR_O_GROUP_ID)) {
        g.has_group_id = 1;
        g.group_id = (uint64_t)fr_opt_long(v, FR_O_GROUP_ID);
    }
    const fr_opt_value *stops = fr_opt_val(v, FR_O_STOP);
    if (stops->given) {   /* the option's strings, as char * for the struct (the encoder only reads them) */
        g.stop = (char **)stops->list;
        g.n_stop = stops->n;
    }
    g.include_stop_str_in_output = fr_opt_int(v, FR_O_INCLUDE_STOP);
    g.return_text = fr_opt_int(v, FR_O_RETURN_TEXT) || stops->given;
    return g;
}

/* Sends every prompt as a request; 0, or 1 after printing why one failed. */
static int send_all(fr_client *c, const fr_msg_generate *base, const fr_cli_prompts *p, long long first_id)
{
    for (int i = 0; i < p->n; i++) {
        fr_msg_generate r = *base;
        r.request_id = (uint64_t)(first_id + i);
        r.prompt = p->ids[i];
        r.n_prompt = p->len[i];
        if (p->text[i]) {   /* for the server's tokenizer, and its text back */
            r.prompt_text = p->text[i];
            r.prompt_text_len = strlen(p->text[i]);
            r.return_text = 1;
        }
        if (fr_client_generate(c, &r)) {
            fprintf(stderr, "fp4rollout-client generate: request %lld: %s\n", first_id + i, fr_last_error());
            return 1;
        }
    }
    return 0;
}

/* --abort-id's request aborted once its tokens came. */
static int abort_due(fr_client *c, gen_ctx *g)
{
    uint64_t id = (uint64_t)g->abort_id;
    int ended = 0, missing = 0;
    g->abort_sent = 1;
    if (fr_client_abort(c, &id, 1, &ended, &missing)) {
        fprintf(stderr, "fp4rollout-client generate: abort: %s\n", fr_last_error());
        return 1;
    }
    fprintf(stderr, "fp4rollout-client: aborted request %llu: %d samples ended, %d not found\n",
            (unsigned long long)id, ended, missing);
    return 0;
}

/* Every result until no sample is open; then every sample must have had
 * exactly one done (no request was refused). */
static int receive_all(fr_client *c, int timeout_ms, gen_ctx *g)
{
    fr_client_handlers h = {.on_tokens = on_tokens, .on_done = on_done, .on_error = on_error, .user = g};
    int rc = 0;
    while (!rc && fr_client_open_samples(c) > 0) {
        int handled = 0;
        if (fr_client_dispatch(c, &h, timeout_ms, &handled)) {
            fprintf(stderr, "fp4rollout-client generate: %s\n", fr_last_error());
            return 1;
        }
        if (g->abort_due && !g->abort_sent) rc = abort_due(c, g);
        if (!handled && !rc) {
            fprintf(stderr, "fp4rollout-client generate: nothing arrived for %d ms with %d samples open\n",
                    timeout_ms, fr_client_open_samples(c));
            rc = 1;
        }
    }
    for (int i = 0; !rc && !g->failed && i < g->n_req * g->n; i++)
        if (g->acc[i].dones != 1) {
            fprintf(stderr, "fp4rollout-client generate: request %lld sample %d got %d done messages\n",
                    g->first_id + i / g->n, g->first_sample + i % g->n, g->acc[i].dones);
            rc = 1;
        }
    return rc || g->failed;
}

int fr_client_cmd_generate(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    const fr_cmd cmd = v->cmd;
    fr_cli_prompts p = {0};
    if (fr_cli_prompts_read(fr_opt_str(v, FR_O_PROMPTS), &p)) {
        fr_cli_prompts_free(&p);
        return fr_cli_fail(cmd, 1);
    }
    const fr_msg_generate base = request_of(v);
    gen_ctx g = {.first_id = fr_opt_long(v, FR_O_FIRST_ID), .n_req = p.n, .n = base.n,
                 .first_sample = base.first_sample,
                 .abort_id = fr_opt_given(v, FR_O_ABORT_ID) ? fr_opt_long(v, FR_O_ABORT_ID) : -1,
                 .abort_after = fr_opt_long(v, FR_O_ABORT_AFTER)};
    g.acc = calloc((size_t)p.n * (size_t)base.n, sizeof *g.acc);
    fr_client *c = NULL;
    int rc = 0;
    if (!g.acc) {
        fr_fail(FR_ENOMEM, "out of memory");
        rc = fr_cli_fail(cmd, 1);
    }
    if (!rc) rc = fr_client_connect(ctx, cmd, &c);
    if (!rc) rc = send_all(c, &base, &p, g.first_id);
    if (!rc) rc = receive_all(c, ctx->timeout_ms, &g);
    for (int i = 0; g.acc && i < p.n * base.n; i++) {
        free(g.acc[i].tok);
        free(g.acc[i].lp);
        fr_buf_free(&g.acc[i].text);
    }
    free(g.acc);
    fr_cli_prompts_free(&p);
    fflush(stdout);
    fr_client_destroy(&c);
    return rc;
}
