/* fp4rollout-client: the C client library (trainer_bridge/client/client.h) as a
 * command line. Each command does one protocol operation and prints JSON;
 * `generate` checks what it receives (contiguous deltas, one done per
 * sample, streamed tokens equal to the done's count) and prints each
 * sample as `fp4rollout rollout --json` does. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "base/clock.h"
#include "rollout/model/model.h"
#include "rollout/model/tensor_table.h"
#include "rollout/engine/weight_update.h"
#include "trainer_bridge/client/client.h"
#include "trainer_bridge/client/metrics_sub.h"

static const char usage_text[] =
    "usage: fp4rollout-client [--endpoint URL] [--timeout-ms MS] [CURVE keys] COMMAND [options]\n"
    "\n"
    "Talks to `fp4rollout serve` (protocol version 1, docs/protocol.md).\n"
    "  --endpoint URL     the server (default tcp://127.0.0.1:5555)\n"
    "  --timeout-ms MS    how long to wait for a reply or the next result (default 30000)\n"
    "  --server-key K --public-key K --secret-key K\n"
    "                     CURVE authentication (Z85 keys, 40 characters): the server's public\n"
    "                     key and this client's key pair (all three or none)\n"
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
    "                           JSON line when it ends (request_id, sample, token_ids, logprobs,\n"
    "                           finish_reason, n_tokens, preemptions, ttft_ms, total_ms,\n"
    "                           seed: the seed that produced it)\n"
    "      --n N --max-tokens N --temperature T --top-k K --top-p P --seed S\n"
    "                           sampling (left out: the server's defaults; without --seed\n"
    "                           the server draws a fresh seed per request)\n"
    "      --min-tokens N       bar the stop tokens until N tokens were generated\n"
    "      --logprobs K         print every token's K (<= 20) most likely tokens and their\n"
    "                           log-probs (top_logprobs: [[id, logprob], ...] per token)\n"
    "      --prompt-logprobs    print the prompt tokens' log-probs with each request's\n"
    "                           first sample (prompt_logprobs: null, then one per token)\n"
    "      --first-sample I     number the samples I, I+1, ...: sample I draws from stream I\n"
    "                           of the seed, so --seed S --first-sample I --n 1 replays\n"
    "                           sample I of an earlier request with seed S (default 0)\n"
    "      --stop-ids IDS | --ignore-eos\n"
    "                           stop tokens (left out: the server's default); --ignore-eos\n"
    "                           sends an empty list\n"
    "      --first-id FIRST     the first request id (default 0)\n"
    "      --group-id G         the group id of every request (default: its request id)\n"
    "      --monitor-divergence | --no-monitor\n"
    "                           ask for the BF16-KV shadow of every sample, or for none\n"
    "                           (left out: the server's kl_sample_rate decides)\n"
    "      --abort-id ID --abort-after T\n"
    "                           abort request ID once T of its tokens have arrived\n"
    "  push-weights --model SPEC --version V [options]\n"
    "                           send a model's weights (a checkpoint folder or\n"
    "                           synthetic:NAME[:SEED]) as weight version V; prints one JSON\n"
    "                           line with the bytes, buckets and seconds once committed\n"
    "      --dtype f32|bf16     the dtype sent (default f32: sent without a copy)\n"
    "      --bucket-mib N       bucket size in MiB (default 512)\n"
    "      --bucket-bytes N     bucket size in bytes (overrides --bucket-mib)\n"
    "      --skip NAME | --nan NAME | --flatten NAME | --corrupt-bucket K\n"
    "                           for testing a server's checks: leave tensor NAME out, put a\n"
    "                           NaN into it, declare it flattened to one dimension, or send\n"
    "                           bucket K with a wrong checksum\n"
    "      --partial            a partial update: tensors left out (--skip) keep their\n"
    "                           serving values\n"
    "      --export FILE        send nothing: write the tensors (float32, in order) to FILE and\n"
    "                           print their names and shapes as JSON lines\n"
    "  watch-metrics [--count N]\n"
    "                           subscribe to the server's metrics PUB socket (--endpoint is\n"
    "                           then its metrics_pub_port, e.g. tcp://127.0.0.1:5558) and\n"
    "                           print each snapshot as a JSON line (the keys of\n"
    "                           /metrics.json, docs/metrics.md); ends after N snapshots\n"
    "                           (default: never), or with status 1 when none comes within\n"
    "                           --timeout-ms\n"
    "  keygen                   print a new CURVE key pair as JSON (public, secret)\n"
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

/* --min-tokens, --logprobs, --prompt-logprobs, --first-sample into g: 1
 * when argv[*i] was one (consumed), 0 when not, -1 after printing a usage
 * error. */
static int parse_request_opt(int argc, char **argv, int *i, fr_msg_generate *g)
{
    const char *a = argv[*i];
    long long v;
    if (strcmp(a, "--prompt-logprobs") == 0) {
        g->prompt_logprobs = 1;
        return 1;
    }
    int min = strcmp(a, "--min-tokens") == 0, lp = strcmp(a, "--logprobs") == 0;
    int first = strcmp(a, "--first-sample") == 0;
    if ((!min && !lp && !first) || *i + 1 >= argc) return 0;
    long long hi = min ? 1 << 30 : lp ? FR_PROTO_MAX_LOGPROBS : INT_MAX - 65536;
    if (parse_long(a, argv[++*i], 0, hi, &v)) return -1;
    *(min ? &g->min_tokens : lp ? &g->logprobs : &g->first_sample) = (int)v;
    return 1;
}

/* Any 64-bit seed: the server reports seeds of the whole range. */
static int parse_seed(const char *flag, const char *text, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || *end || text[0] == '-' || text[0] == '+') {
        fprintf(stderr, "fp4rollout-client: %s expects an integer in [0, 2^64), got '%s'\n", flag, text);
        return -1;
    }
    *out = (uint64_t)v;
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

static void print_reply(const fr_msg *m)
{
    char *json = NULL;
    if (fr_msg_to_json(m, &json)) {
        printf("{\"type\":\"%s\"}\n", fr_msg_type_name(m->type));
        return;
    }
    printf("%s\n", json);
    fr_client_free_string(json);
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
    fr_cli_json_logprobs(&extra, d->top_k, d->top_token_ids, d->top_logprobs, d->n_tokens, d->prompt_logprobs,
                         d->n_prompt_logprobs);
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
    base.monitor_divergence = -1;
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
            bad = parse_seed(a, argv[++i], &base.seed);
            base.has_seed = 1;
        } else if ((bad = parse_request_opt(argc, argv, &i, &base)) != 0) {
            bad = bad < 0;
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
        } else if (strcmp(a, "--no-monitor") == 0) {
            base.monitor_divergence = 0;
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
    gen_ctx g = {.first_id = first_id, .n_req = p.n, .n = base.n, .first_sample = base.first_sample,
                 .abort_id = abort_id, .abort_after = abort_after};
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

/* ---- push-weights ---------------------------------------------------------- */

/* float32 -> bfloat16, round to nearest even (finite inputs). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static int cmd_push_weights(fr_client *c, int argc, char **argv)
{
    const char *spec = NULL, *skip = NULL, *nan_name = NULL, *flat = NULL, *export_path = NULL;
    long long version = -1, v;
    long long bucket = 512ll << 20;
    fr_client_update_opts opts = {.bucket_bytes = 0, .corrupt_bucket = -1};
    int bf16 = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--model") == 0 && val) spec = argv[++i];
        else if (strcmp(a, "--version") == 0 && val) bad = parse_long(a, argv[++i], 1, 1ll << 62, &version);
        else if (strcmp(a, "--bucket-mib") == 0 && val) {
            bad = parse_long(a, argv[++i], 1, 1 << 20, &v);
            bucket = v << 20;
        } else if (strcmp(a, "--bucket-bytes") == 0 && val) bad = parse_long(a, argv[++i], 4, 1ll << 50, &bucket);
        else if (strcmp(a, "--dtype") == 0 && val) {
            i++;
            if (strcmp(argv[i], "bf16") == 0) bf16 = 1;
            else if (strcmp(argv[i], "f32") != 0) return usage_error("push-weights: --dtype must be f32 or bf16, got '%s'", argv[i]);
        } else if (strcmp(a, "--skip") == 0 && val) skip = argv[++i];
        else if (strcmp(a, "--partial") == 0) opts.partial = 1;
        else if (strcmp(a, "--nan") == 0 && val) nan_name = argv[++i];
        else if (strcmp(a, "--flatten") == 0 && val) flat = argv[++i];
        else if (strcmp(a, "--export") == 0 && val) export_path = argv[++i];
        else if (strcmp(a, "--corrupt-bucket") == 0 && val) {
            bad = parse_long(a, argv[++i], 0, 1 << 30, &v);
            opts.corrupt_bucket = (int)v;
        } else return usage_error("push-weights: unknown or incomplete option '%s'", a);
        if (bad) return 2;
    }
    if (!spec || (version < 0 && !export_path))
        return usage_error("push-weights: %s are required", "--model and --version");
    opts.bucket_bytes = (uint64_t)bucket;
    fr_model *m = NULL;
    fr_model_tensor *mt = NULL;   /* the model's tensors (rollout/model/tensor_table.h) */
    size_t n_mt = 0;
    if (fr_model_load(spec, &m) || fr_model_tensor_list(&m->cfg, &m->w, &mt, &n_mt)) {
        fprintf(stderr, "fp4rollout-client: push-weights: %s\n", fr_last_error());
        fr_model_destroy(&m);
        return 1;
    }
    int n = (int)n_mt, k = 0, rc = 0;
    fr_client_tensor *t = calloc((size_t)n, sizeof *t);
    int64_t (*shapes)[2] = calloc((size_t)n, sizeof *shapes);
    void **owned = calloc((size_t)n, sizeof *owned);   /* converted or altered copies */
    uint64_t bytes = 0;
    if (!t || !shapes || !owned) {
        fprintf(stderr, "fp4rollout-client: out of memory\n");
        rc = 1;
    }
    for (int i = 0; !rc && i < n; i++) {
        const char *name = mt[i].name;
        int ndim = mt[i].ndim;
        shapes[k][0] = mt[i].rows;
        shapes[k][1] = ndim == 2 ? mt[i].cols : 1;
        const float *src = mt[i].data;
        if (!src) {
            fprintf(stderr, "fp4rollout-client: push-weights: the model has no tensor %s\n", name);
            rc = 1;
            break;
        }
        if (skip && strcmp(skip, name) == 0) continue;
        size_t count = (size_t)shapes[k][0] * (size_t)(ndim == 2 ? shapes[k][1] : 1);
        int altered = nan_name && strcmp(nan_name, name) == 0;
        const void *data = src;
        if (bf16 || altered) {
            owned[k] = malloc(count * (bf16 ? 2 : 4));
            if (!owned[k]) {
                fprintf(stderr, "fp4rollout-client: out of memory\n");
                rc = 1;
                break;
            }
            if (bf16)
                for (size_t e = 0; e < count; e++) ((uint16_t *)owned[k])[e] = to_bf16(src[e]);
            else memcpy(owned[k], src, count * 4);
            if (altered) {
                if (bf16) ((uint16_t *)owned[k])[count / 2] = 0x7fc0;
                else ((float *)owned[k])[count / 2] = NAN;
            }
            data = owned[k];
        }
        if (flat && strcmp(flat, name) == 0 && ndim == 2) {
            shapes[k][0] *= shapes[k][1];
            ndim = 1;
        }
        t[k] = (fr_client_tensor){.name = name, .dtype = bf16 ? FR_DTYPE_BF16 : FR_DTYPE_F32, .ndim = ndim,
                                  .shape = shapes[k], .data = data};
        bytes += count * (bf16 ? 2 : 4);
        k++;
    }
    if (!rc && export_path) {
        FILE *f = fopen(export_path, "wb");
        for (int i = 0; f && i < k; i++) {
            size_t count = (size_t)t[i].shape[0] * (size_t)(t[i].ndim == 2 ? t[i].shape[1] : 1);
            if (fwrite(t[i].data, bf16 ? 2 : 4, count, f) != count) break;
            printf("{\"name\":\"%s\",\"shape\":[%lld", t[i].name, (long long)t[i].shape[0]);
            if (t[i].ndim == 2) printf(",%lld", (long long)t[i].shape[1]);
            printf("]}\n");
        }
        if (!f || fclose(f)) {
            fprintf(stderr, "fp4rollout-client: cannot write %s\n", export_path);
            rc = 1;
        }
    } else if (!rc) {
        double t0 = fr_now_s();
        fr_msg_update_reply r;
        if (fr_client_update_weights(c, t, k, (uint64_t)version, &opts, &r)) {
            const char *code = "", *msg = "";
            fr_client_last_error(c, &code, &msg, NULL);
            fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
            printf("{\"committed\":false,\"code\":\"%s\"}\n", code);
            rc = 1;
        } else {
            double dt = fr_now_s() - t0;
            uint64_t nb = (bytes + (uint64_t)bucket - 1) / (uint64_t)bucket;
            printf("{\"committed\":true,\"version\":%llu,\"weight_version\":%llu,\"tensors\":%d,\"bytes\":%llu,"
                   "\"buckets_at_least\":%llu,\"seconds\":%.6f,\"mib_per_s\":%.1f}\n",
                   (unsigned long long)r.version, (unsigned long long)r.weight_version, k,
                   (unsigned long long)bytes, (unsigned long long)nb, dt, (double)bytes / (1 << 20) / dt);
        }
    }
    for (int i = 0; owned && i < n; i++) free(owned[i]);
    free(owned);
    free(shapes);
    free(mt);
    free(t);
    fr_model_destroy(&m);
    return rc;
}

static int cmd_watch_metrics(const char *endpoint, const fr_client_curve *keys, int timeout_ms, int argc, char **argv)
{
    long long count = -1;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            if (parse_long(argv[i], argv[i + 1], 1, 1LL << 40, &count)) return 2;
            i++;
        } else return usage_error("watch-metrics: unknown or incomplete option '%s'", argv[i]);
    }
    fr_metrics_sub *sub;
    if (fr_metrics_sub_new(endpoint, keys, &sub)) {
        fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
        return 1;
    }
    int rc = 0;
    for (long long got = 0; count < 0 || got < count; got++) {
        char *json = NULL;
        if (fr_metrics_sub_next(sub, timeout_ms, &json)) {
            fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
            rc = 1;
            break;
        }
        if (!json) {
            fprintf(stderr, "fp4rollout-client: no metrics snapshot from %s within %d ms\n", endpoint, timeout_ms);
            rc = 1;
            break;
        }
        printf("%s\n", json);
        fflush(stdout);
        fr_client_free_string(json);
    }
    fr_metrics_sub_destroy(&sub);
    return rc;
}

#define REQ(name) {name, required_argument, 0, 0}
#define FLAG(name) {name, no_argument, 0, 0}
static const struct option global_opts[] = {
    REQ("endpoint"), REQ("server-key"), REQ("public-key"), REQ("secret-key"), REQ("timeout-ms"), {0, 0, 0, 0}};
static const struct option generate_opts[] = {
    REQ("prompts"),  REQ("n"),         REQ("max-tokens"),        REQ("temperature"),   REQ("top-p"),
    REQ("top-k"),    REQ("seed"),      REQ("stop-ids"),          FLAG("ignore-eos"),   REQ("first-id"),
    REQ("group-id"), REQ("abort-id"),  FLAG("monitor-divergence"), FLAG("no-monitor"), REQ("abort-after"),
    REQ("first-sample"), REQ("min-tokens"), REQ("logprobs"), FLAG("prompt-logprobs"), {0, 0, 0, 0}};
static const struct option send_raw_opts[] = {REQ("hex"), REQ("extra-frames"), {0, 0, 0, 0}};
static const struct option push_opts[] = {
    REQ("model"), REQ("version"), REQ("bucket-mib"), REQ("bucket-bytes"), REQ("dtype"), REQ("skip"),
    REQ("nan"),   REQ("flatten"), REQ("export"),     REQ("corrupt-bucket"), FLAG("partial"), {0, 0, 0, 0}};
static const struct option watch_opts[] = {REQ("count"), {0, 0, 0, 0}};
static const struct option pause_opts[] = {REQ("mode"), {0, 0, 0, 0}};
static const struct option no_opts[] = {{0, 0, 0, 0}};

/* getopt_long over a command's own options (app/cli.h); argv[i - 1] is the
 * command word. Leaves *i at the first canonical argument. */
static int command_args(const char *cmd, int *argc, char ***argv, int *i)
{
    static const struct { const char *cmd; const struct option *opts; } table[] = {
        {"generate", generate_opts}, {"send-raw", send_raw_opts}, {"push-weights", push_opts},
        {"watch-metrics", watch_opts}, {"pause", pause_opts},
    };
    const struct option *opts = no_opts;
    for (size_t k = 0; k < sizeof table / sizeof table[0]; k++)
        if (strcmp(cmd, table[k].cmd) == 0) opts = table[k].opts;
    int n = *argc - *i + 1;
    char **av = *argv + *i - 1;
    if (fr_cli_args(cmd, &n, &av, (const struct option *const[]){opts, NULL})) return 2;
    *argc = n;
    *argv = av;
    *i = 1;
    return 0;
}

static int run(int argc, char **argv);

int main(int argc, char **argv)
{
    fr_cli_program = "fp4rollout-client";
    int rc = run(argc, argv);
    fr_cli_args_release();
    return rc;
}

static int run(int argc, char **argv)
{
    const char *endpoint = "tcp://127.0.0.1:5555";
    fr_client_curve keys = {NULL, NULL, NULL};
    long long timeout = 30000;
    int i = 1;
    for (int j = 1; j < argc; j++)
        if (strcmp(argv[j], "-h") == 0 || strcmp(argv[j], "--help") == 0) {
            printf("%s", usage_text);
            return 0;
        }
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        printf("fp4rollout-client %s\n", FR_VERSION);
        return 0;
    }
    if (fr_cli_args_head("", &argc, &argv, (const struct option *const[]){global_opts, NULL})) return 2;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--endpoint") == 0 && i + 1 < argc) endpoint = argv[++i];
        else if (strcmp(argv[i], "--server-key") == 0 && i + 1 < argc) keys.server_public_key = argv[++i];
        else if (strcmp(argv[i], "--public-key") == 0 && i + 1 < argc) keys.public_key = argv[++i];
        else if (strcmp(argv[i], "--secret-key") == 0 && i + 1 < argc) keys.secret_key = argv[++i];
        else if (strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc) {
            if (parse_long(argv[i], argv[i + 1], 1, 1 << 30, &timeout)) return 2;
            i++;
        } else break;
    }
    if (i >= argc) return usage_error("%s", "a command is required");
    const char *cmd = argv[i++];
    static const char *const known[] = {"hello", "stats", "pause", "resume", "generate", "send-raw", "push-weights"};
    int ok = 0;
    for (int k = 0; k < 7; k++) ok |= strcmp(cmd, known[k]) == 0;
    if (strcmp(cmd, "keygen") == 0) {
        char pub[41], sec[41];
        if (fr_client_keypair(pub, sec)) {
            fprintf(stderr, "fp4rollout-client: %s\n", fr_last_error());
            return 1;
        }
        printf("{\"public\":\"%s\",\"secret\":\"%s\"}\n", pub, sec);
        return 0;
    }
    int n_keys = !!keys.server_public_key + !!keys.public_key + !!keys.secret_key;
    if (n_keys != 0 && n_keys != 3)
        return usage_error("%s", "CURVE needs --server-key, --public-key and --secret-key together");
    if (strcmp(cmd, "watch-metrics") == 0)
        return command_args(cmd, &argc, &argv, &i) ? 2 : cmd_watch_metrics(endpoint, n_keys ? &keys : NULL, (int)timeout, argc - i, argv + i);
    if (!ok) return usage_error("unknown command '%s'", cmd);
    if (command_args(cmd, &argc, &argv, &i)) return 2;
    fr_client *c;
    if (fr_client_new_curve(endpoint, n_keys ? &keys : NULL, &c)) {
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
    else if (strcmp(cmd, "push-weights") == 0) rc = cmd_push_weights(c, argc - i, argv + i);
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
