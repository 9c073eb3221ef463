/* fp4rollout-client: the C client library (trainer_bridge/client.h) as a
 * command line. Each command does one protocol operation and prints JSON;
 * `generate` checks what it receives (contiguous deltas, one done per
 * sample, streamed tokens equal to the done's count) and prints each
 * sample as `fp4rollout rollout --json` does. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/client.h"

static const char usage_text[] =
    "usage: fp4rollout-client [--endpoint URL] [--timeout-ms MS] COMMAND [options]\n"
    "\n"
    "Talks to `fp4rollout serve` (protocol version 1, docs/protocol.md).\n"
    "  --endpoint URL     the server (default tcp://127.0.0.1:5555)\n"
    "  --timeout-ms MS    how long to wait for a reply or the next result (default 30000)\n"
    "\n"
    "commands:\n"
    "  hello                    the server's information, as JSON\n"
    "  stats                    the server's stats, as JSON\n"
    "  pause --mode abort|wait  pause the engine (abort: end the samples in flight now;\n"
    "                           wait: let them finish); prints the reply once paused\n"
    "  resume                   resume; prints the reply\n"
    "  generate --prompts FILE [options]\n"
    "                           one request per line of FILE (comma-separated token ids),\n"
    "                           request ids FIRST, FIRST+1, ...; prints each sample as a\n"
    "                           JSON line when it ends (request, sample, tokens, logprobs,\n"
    "                           finish_reason, n_tokens, preemptions, ttft_ms, total_ms)\n"
    "      --n N --max-tokens N --temperature T --top-k K --top-p P --seed S\n"
    "                           sampling (left out: the server's defaults)\n"
    "      --stop-ids IDS | --ignore-eos\n"
    "                           stop tokens (left out: the server's default); --ignore-eos\n"
    "                           sends an empty list\n"
    "      --first-id FIRST     the first request id (default 0)\n"
    "      --group-id G         the group id of every request (default: its request id)\n"
    "      --monitor-divergence ask for divergence figures (reported as null for now)\n"
    "      --abort-id ID --abort-after T\n"
    "                           abort request ID once T of its tokens have arrived\n"
    "  send-raw --hex HEX [--extra-frames N]\n"
    "                           send the bytes as frame 0 (and N empty frames after it),\n"
    "                           print the server's reply: for testing validation\n"
    "Exit status: 0 when everything came as the protocol says, 1 otherwise\n"
    "(an error reply, a timeout, a missing or repeated done), 2 for bad usage.\n";

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "fp4rollout-client: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(fp4rollout-client --help for usage)\n");
    return 2;
}

static int parse_long(const char *flag, const char *text, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) {
        fprintf(stderr, "fp4rollout-client: %s expects an integer in [%lld, %lld], got '%s'\n", flag, lo, hi, text);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_double(const char *flag, const char *text, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end) {
        fprintf(stderr, "fp4rollout-client: %s expects a number, got '%s'\n", flag, text);
        return -1;
    }
    *out = v;
    return 0;
}

/* Comma- and/or space-separated integers into a new array. */
static int parse_ids(const char *text, int **out, int *n)
{
    int cap = 16, k = 0;
    int *v = malloc(sizeof(int) * (size_t)cap);
    if (!v) return -1;
    const char *p = text;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > 0x7fffffff) {
            free(v);
            return -1;
        }
        if (k == cap) {
            cap *= 2;
            int *w = realloc(v, sizeof(int) * (size_t)cap);
            if (!w) {
                free(v);
                return -1;
            }
            v = w;
        }
        v[k++] = (int)x;
        p = end;
    }
    *out = v;
    *n = k;
    return 0;
}

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

static void print_reply(const fr_msg *m)
{
    switch (m->type) {
    case FR_MSG_HELLO_REPLY: {
        const fr_msg_hello_reply *h = &m->u.hello_reply;
        printf("{\"type\":\"hello_reply\",\"server\":");
        json_str(h->server);
        printf(",\"model\":");
        json_str(h->model);
        printf(",\"backend\":");
        json_str(h->backend);
        printf(",\"kv_dtype\":");
        json_str(h->kv_dtype);
        printf(",\"tp\":%d,\"engines\":%d,\"weight_version\":%llu,\"max_seqs\":%d,\"kv_blocks\":%d,"
               "\"kv_block_tokens\":%d,\"max_model_len\":%d,\"vocab_size\":%d,\"chunk\":%d,\"eos_token_ids\":[",
               h->tp, h->engines, (unsigned long long)h->weight_version, h->max_seqs, h->kv_blocks,
               h->kv_block_tokens, h->max_model_len, h->vocab_size, h->chunk);
        for (int i = 0; i < h->n_eos_token_ids; i++) printf("%s%d", i ? "," : "", h->eos_token_ids[i]);
        printf("]}\n");
        break;
    }
    case FR_MSG_STATS_REPLY: {
        const fr_msg_stats_reply *s = &m->u.stats_reply;
        printf("{\"type\":\"stats_reply\",\"scheduler\":{\"running\":%d,\"prefilling\":%d,\"waiting\":%d,"
               "\"preemptions\":%llu,\"tokens_generated\":%llu,\"prefill_tokens\":%llu,\"steps\":%llu,"
               "\"finished\":%llu,\"kv_blocks_used\":%d,\"kv_blocks_free\":%d},\"server\":{\"state\":",
               s->running, s->prefilling, s->waiting, (unsigned long long)s->preemptions,
               (unsigned long long)s->tokens_generated, (unsigned long long)s->prefill_tokens,
               (unsigned long long)s->steps, (unsigned long long)s->finished, s->kv_blocks_used, s->kv_blocks_free);
        json_str(s->state);
        printf(",\"weight_version\":%llu,\"clients\":%d,\"open_requests\":%d,\"held_requests\":%d,"
               "\"messages_in\":%llu,\"messages_out\":%llu,\"bad_messages\":%llu,\"errors_sent\":%llu,"
               "\"requests_accepted\":%llu,\"requests_rejected\":%llu,\"samples_done\":%llu,"
               "\"tokens_streamed\":%llu,\"send_retries\":%llu,\"queued_messages\":%llu,"
               "\"undeliverable_messages\":%llu}}\n",
               (unsigned long long)s->weight_version, s->clients, s->open_requests, s->held_requests,
               (unsigned long long)s->messages_in, (unsigned long long)s->messages_out,
               (unsigned long long)s->bad_messages, (unsigned long long)s->errors_sent,
               (unsigned long long)s->requests_accepted, (unsigned long long)s->requests_rejected,
               (unsigned long long)s->samples_done, (unsigned long long)s->tokens_streamed,
               (unsigned long long)s->send_retries, (unsigned long long)s->queued_messages,
               (unsigned long long)s->undeliverable_messages);
        break;
    }
    case FR_MSG_PAUSE_REPLY:
        printf("{\"type\":\"pause_reply\",\"mode\":\"%s\",\"state\":\"paused\",\"aborted\":%d}\n",
               fr_pause_mode_name(m->u.pause_reply.mode), m->u.pause_reply.aborted);
        break;
    case FR_MSG_RESUME_REPLY:
        printf("{\"type\":\"resume_reply\",\"released\":%d}\n", m->u.resume_reply.released);
        break;
    case FR_MSG_ERROR:
        printf("{\"type\":\"error\",\"code\":");
        json_str(m->u.error.code);
        printf(",\"message\":");
        json_str(m->u.error.message);
        if (m->u.error.has_request_id) printf(",\"request_id\":%llu}\n", (unsigned long long)m->u.error.request_id);
        else printf(",\"request_id\":null}\n");
        break;
    default:
        printf("{\"type\":\"%s\"}\n", fr_msg_type_name(m->type));
        break;
    }
}

/* ---- generate ------------------------------------------------------------- */

typedef struct {
    int *tok;
    float *lp;
    int n, cap;
    int dones;
} sample_acc;

typedef struct {
    long long first_id;
    int n_req, n;
    sample_acc *acc;          /* [n_req][n] */
    int failed;
    long long abort_id, abort_after;
    long long abort_seen;     /* tokens of abort_id received */
    int abort_due, abort_sent;
} gen_ctx;

static sample_acc *acc_of(gen_ctx *g, uint64_t request, int sample)
{
    long long r = (long long)request - g->first_id;
    if (r < 0 || r >= g->n_req || sample < 0 || sample >= g->n) return NULL;
    return &g->acc[r * g->n + sample];
}

static void on_tokens(void *user, const fr_msg_tokens *t)
{
    gen_ctx *g = user;
    sample_acc *a = acc_of(g, t->request_id, t->sample);
    if (!a) {
        fprintf(stderr, "fp4rollout-client: tokens for an unknown sample (%llu, %d)\n",
                (unsigned long long)t->request_id, t->sample);
        g->failed = 1;
        return;
    }
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
    if (g->abort_id >= 0 && (long long)t->request_id == g->abort_id) {
        g->abort_seen += t->n;
        if (g->abort_seen >= g->abort_after && !g->abort_sent) g->abort_due = 1;
    }
}

static void on_done(void *user, const fr_msg_done *d)
{
    gen_ctx *g = user;
    sample_acc *a = acc_of(g, d->request_id, d->sample);
    if (!a) {
        fprintf(stderr, "fp4rollout-client: done for an unknown sample (%llu, %d)\n",
                (unsigned long long)d->request_id, d->sample);
        g->failed = 1;
        return;
    }
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
    printf("{\"request\":%llu,\"sample\":%d,\"tokens\":[", (unsigned long long)d->request_id, d->sample);
    for (int i = 0; i < a->n; i++) printf("%s%d", i ? "," : "", a->tok[i]);
    printf("],\"logprobs\":[");
    for (int i = 0; i < a->n; i++) printf("%s%.6g", i ? "," : "", (double)a->lp[i]);
    printf("],\"finish_reason\":\"%s\",\"n_tokens\":%d,\"preemptions\":%d,\"ttft_ms\":",
           fr_wire_finish_name(d->finish_reason), d->n_tokens, d->preemptions);
    if (d->has_ttft) printf("%.3f", d->ttft_ms);
    else printf("null");
    printf(",\"total_ms\":%.3f}\n", d->total_ms);
    fflush(stdout);
}

static void on_error(void *user, const fr_msg_error *e)
{
    gen_ctx *g = user;
    fprintf(stderr, "fp4rollout-client: request %llu: %s: %s\n", (unsigned long long)e->request_id, e->code,
            e->message);
    g->failed = 1;
}

typedef struct {
    int **ids;
    int *len;
    int n;
} prompts;

static void prompts_free(prompts *p)
{
    for (int i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    free(p->len);
}

static int read_prompts(const char *path, prompts *p)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fp4rollout-client: cannot read %s\n", path);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    int rc = 0, lineno = 0;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        int *ids, n;
        if (parse_ids(line, &ids, &n)) {
            fprintf(stderr, "fp4rollout-client: %s line %d: expected comma-separated token ids\n", path, lineno);
            rc = -1;
            break;
        }
        if (n == 0) {
            free(ids);
            continue;
        }
        int **a = realloc(p->ids, sizeof *a * (size_t)(p->n + 1));
        if (a) p->ids = a;
        int *b = a ? realloc(p->len, sizeof *b * (size_t)(p->n + 1)) : NULL;
        if (b) p->len = b;
        if (!a || !b) {
            free(ids);
            rc = -1;
            break;
        }
        p->ids[p->n] = ids;
        p->len[p->n++] = n;
    }
    free(line);
    fclose(f);
    if (!rc && p->n == 0) {
        fprintf(stderr, "fp4rollout-client: %s holds no prompt\n", path);
        rc = -1;
    }
    return rc;
}

static int cmd_generate(fr_client *c, int timeout_ms, int argc, char **argv)
{
    const char *path = NULL;
    fr_msg_generate base;
    memset(&base, 0, sizeof base);
    base.n = 1;
    long long first_id = 0, group = -1, abort_id = -1, abort_after = 1, v;
    int *stop = NULL, n_stop = 0, rc = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        double d;
        if (strcmp(a, "--prompts") == 0 && val) path = argv[++i];
        else if (strcmp(a, "--n") == 0 && val) {
            bad = parse_long(a, argv[++i], 1, 65536, &v);
            base.n = (int)v;
        } else if (strcmp(a, "--max-tokens") == 0 && val) {
            bad = parse_long(a, argv[++i], 1, 1 << 30, &v);
            base.has_max_tokens = 1;
            base.max_tokens = (int)v;
        } else if (strcmp(a, "--temperature") == 0 && val) {
            bad = parse_double(a, argv[++i], &d);
            base.has_temperature = 1;
            base.temperature = d;
        } else if (strcmp(a, "--top-p") == 0 && val) {
            bad = parse_double(a, argv[++i], &d);
            base.has_top_p = 1;
            base.top_p = d;
        } else if (strcmp(a, "--top-k") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, 1 << 30, &v);
            base.has_top_k = 1;
            base.top_k = (int)v;
        } else if (strcmp(a, "--seed") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, (1ll << 53), &v);
            base.has_seed = 1;
            base.seed = (uint64_t)v;
        } else if (strcmp(a, "--stop-ids") == 0 && val) {
            free(stop);
            stop = NULL;
            if (parse_ids(argv[++i], &stop, &n_stop)) {
                rc = usage_error("--stop-ids expects comma-separated token ids, got '%s'", argv[i]);
                goto out;
            }
            base.has_stop_token_ids = 1;
        } else if (strcmp(a, "--ignore-eos") == 0) {
            base.has_stop_token_ids = 1;
            n_stop = 0;
        } else if (strcmp(a, "--first-id") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, 1ll << 62, &first_id);
        } else if (strcmp(a, "--group-id") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, 1ll << 62, &group);
        } else if (strcmp(a, "--monitor-divergence") == 0) {
            base.monitor_divergence = 1;
        } else if (strcmp(a, "--abort-id") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, 1ll << 62, &abort_id);
        } else if (strcmp(a, "--abort-after") == 0 && val) {
            bad = parse_long(a, argv[++i], 1, 1ll << 40, &abort_after);
        } else {
            rc = usage_error("generate: unknown or incomplete option '%s'", a);
            goto out;
        }
        if (bad) {
            rc = 2;
            goto out;
        }
    }
    if (!path) {
        rc = usage_error("generate: %s is required", "--prompts");
        goto out;
    }
    prompts p = {0};
    if (read_prompts(path, &p)) {
        prompts_free(&p);
        rc = 1;
        goto out;
    }
    gen_ctx g = {.first_id = first_id, .n_req = p.n, .n = base.n, .abort_id = abort_id, .abort_after = abort_after};
    g.acc = calloc((size_t)p.n * (size_t)base.n, sizeof *g.acc);
    if (!g.acc) {
        fprintf(stderr, "fp4rollout-client: out of memory\n");
        prompts_free(&p);
        rc = 1;
        goto out;
    }
    for (int i = 0; i < p.n && !rc; i++) {
        fr_msg_generate r = base;
        r.request_id = (uint64_t)(first_id + i);
        r.prompt = p.ids[i];
        r.n_prompt = p.len[i];
        r.stop_token_ids = stop;
        r.n_stop_token_ids = n_stop;
        if (group >= 0) {
            r.has_group_id = 1;
            r.group_id = (uint64_t)group;
        }
        if (fr_client_generate(c, &r)) {
            fprintf(stderr, "fp4rollout-client: request %lld: %s\n", first_id + i, fr_last_error());
            rc = 1;
        }
    }
    fr_client_handlers h = {.on_tokens = on_tokens, .on_done = on_done, .on_error = on_error, .user = &g};
    while (!rc && fr_client_open_samples(c) > 0) {
        int handled = 0;
        if (fr_client_dispatch(c, &h, timeout_ms, &handled)) {
            fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
            rc = 1;
            break;
        }
        if (g.abort_due && !g.abort_sent) {
            uint64_t id = (uint64_t)abort_id;
            int ended = 0, missing = 0;
            g.abort_sent = 1;
            if (fr_client_abort(c, &id, 1, &ended, &missing)) {
                fprintf(stderr, "fp4rollout-client: abort: %s\n", fr_last_error());
                rc = 1;
            } else {
                fprintf(stderr, "fp4rollout-client: aborted request %llu: %d samples ended, %d not found\n",
                        (unsigned long long)id, ended, missing);
            }
        }
        if (!handled && !rc) {
            fprintf(stderr, "fp4rollout-client: nothing arrived for %d ms with %d samples open\n", timeout_ms,
                    fr_client_open_samples(c));
            rc = 1;
        }
    }
    /* With no request refused, every sample has exactly one done by now. */
    for (int i = 0; !rc && !g.failed && i < p.n * base.n; i++)
        if (g.acc[i].dones != 1) {
            fprintf(stderr, "fp4rollout-client: request %lld sample %d got %d done messages\n",
                    first_id + i / base.n, i % base.n, g.acc[i].dones);
            rc = 1;
        }
    if (g.failed) rc = 1;
    for (int i = 0; i < p.n * base.n; i++) {
        free(g.acc[i].tok);
        free(g.acc[i].lp);
    }
    free(g.acc);
    prompts_free(&p);
out:
    free(stop);
    return rc;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static int cmd_send_raw(fr_client *c, int timeout_ms, int argc, char **argv)
{
    const char *hex = NULL;
    long long extra = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--hex") == 0 && i + 1 < argc) hex = argv[++i];
        else if (strcmp(argv[i], "--extra-frames") == 0 && i + 1 < argc) {
            if (parse_long(argv[i], argv[i + 1], 0, 16, &extra)) return 2;
            i++;
        } else return usage_error("send-raw: unknown or incomplete option '%s'", argv[i]);
    }
    if (!hex) return usage_error("send-raw: %s is required", "--hex");
    size_t n = strlen(hex);
    if (n % 2) return usage_error("send-raw: --hex needs an even number of digits, got '%s'", hex);
    unsigned char *bytes = malloc(n / 2 + 1);
    if (!bytes) return 1;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            free(bytes);
            return usage_error("send-raw: --hex holds a non-hex digit: '%s'", hex);
        }
        bytes[i] = (unsigned char)(hi * 16 + lo);
    }
    fr_status st = fr_client_send_raw(c, bytes, n / 2, (int)extra);
    free(bytes);
    if (st) {
        fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
        return 1;
    }
    fr_msg m;
    int got = 0;
    if ((st = fr_client_next(c, timeout_ms, &m, &got)) || !got) {
        fprintf(stderr, "fp4rollout-client: %s\n", st ? fr_last_error() : "no reply");
        return 1;
    }
    print_reply(&m);
    fr_msg_free(&m);
    return 0;
}

int main(int argc, char **argv)
{
    const char *endpoint = "tcp://127.0.0.1:5555";
    long long timeout = 30000;
    int i = 1;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            printf("%s", usage_text);
            return 0;
        }
        if (strcmp(argv[i], "--endpoint") == 0 && i + 1 < argc) endpoint = argv[++i];
        else if (strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc) {
            if (parse_long(argv[i], argv[i + 1], 1, 1 << 30, &timeout)) return 2;
            i++;
        } else break;
    }
    if (i >= argc) return usage_error("%s", "a command is required");
    const char *cmd = argv[i++];
    for (int j = i; j < argc; j++)
        if (strcmp(argv[j], "-h") == 0 || strcmp(argv[j], "--help") == 0) {
            printf("%s", usage_text);
            return 0;
        }
    static const char *const known[] = {"hello", "stats", "pause", "resume", "generate", "send-raw"};
    int ok = 0;
    for (int k = 0; k < 6; k++) ok |= strcmp(cmd, known[k]) == 0;
    if (!ok) return usage_error("unknown command '%s'", cmd);
    fr_client *c;
    if (fr_client_new(endpoint, &c)) {
        fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
        return 1;
    }
    fr_client_set_timeout(c, (int)timeout);
    int rc = 0;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NONE);
    fr_status st = FR_OK;
    if (strcmp(cmd, "generate") == 0) rc = cmd_generate(c, (int)timeout, argc - i, argv + i);
    else if (strcmp(cmd, "send-raw") == 0) rc = cmd_send_raw(c, (int)timeout, argc - i, argv + i);
    else if (i < argc && strcmp(cmd, "pause") != 0) rc = usage_error("%s takes no options", cmd);
    else if (strcmp(cmd, "hello") == 0) {
        m.type = FR_MSG_HELLO_REPLY;
        st = fr_client_hello(c, "fp4rollout-client", &m.u.hello_reply);
    } else if (strcmp(cmd, "stats") == 0) {
        m.type = FR_MSG_STATS_REPLY;
        st = fr_client_stats(c, &m.u.stats_reply);
    } else if (strcmp(cmd, "resume") == 0) {
        m.type = FR_MSG_RESUME_REPLY;
        st = fr_client_resume(c, &m.u.resume_reply);
    } else {
        fr_pause_mode mode = FR_PAUSE_ABORT;
        if (argc - i != 2 || strcmp(argv[i], "--mode") != 0) rc = usage_error("pause: %s is required", "--mode abort|wait");
        else if (strcmp(argv[i + 1], "wait") == 0) mode = FR_PAUSE_WAIT;
        else if (strcmp(argv[i + 1], "abort") != 0) rc = usage_error("pause: --mode must be abort or wait, got '%s'", argv[i + 1]);
        if (!rc) {
            m.type = FR_MSG_PAUSE_REPLY;
            st = fr_client_pause(c, mode, &m.u.pause_reply);
        }
    }
    if (st) {
        fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
        rc = 1;
    } else if (m.type != FR_MSG_NONE && !rc) {
        print_reply(&m);
    }
    fflush(stdout);
    fr_client_destroy(&c);
    return rc;
}
