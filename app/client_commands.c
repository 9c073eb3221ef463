/* fp4rollout-client's commands: the list, --help, the connection, and the
 * commands of one request and its reply (hello, stats, pause, resume) or
 * none (keygen). */
#include "app/client_cli.h"


static const char usage_text[] =
    "usage: fp4rollout-client [--endpoint URL] [--timeout-ms MS] [CURVE keys] COMMAND [options]\n"
    "\n"
    "Talks to `fp4rollout serve` (protocol version 1, docs/protocol.md). Each\n"
    "command does one protocol operation and prints JSON; generate checks what it\n"
    "receives (contiguous deltas, one done per sample, streamed tokens equal to the\n"
    "done's count, streamed text a prefix of the done's) and prints each sample as\n"
    "`fp4rollout rollout --json` does.\n"
    "Exit status: 0 when everything came as the protocol says, 1 otherwise\n"
    "(an error reply, a timeout, a missing or repeated done), 2 for bad usage.\n";

static int cmd_reply(const fr_client_ctx *ctx, const fr_cli_values *v);
static int cmd_keygen(const fr_client_ctx *ctx, const fr_cli_values *v);

const fr_client_command fr_client_commands[] = {
    {"hello", FR_CMD_C_HELLO, "hello", "the server's information", cmd_reply},
    {"stats", FR_CMD_C_STATS, "stats", "the server's stats", cmd_reply},
    {"pause", FR_CMD_C_PAUSE, "pause --mode abort|wait|keep [--recompute]",
     "pause the engine; prints the reply once paused", cmd_reply},
    {"resume", FR_CMD_C_RESUME, "resume [--recompute]", "resume; prints the reply", cmd_reply},
    {"generate", FR_CMD_C_GENERATE, "generate --prompts FILE [options]",
     "one request per line of FILE (comma-separated token ids, or a JSON string: text for the server's "
     "tokenizer), request ids FIRST, FIRST+1, ...; prints each sample as a JSON line when it ends (request_id, "
     "sample, token_ids, logprobs, finish_reason, n_tokens, preemptions, ttft_ms, total_ms, seed: the seed that "
     "produced it; with text: text, stop_str, prompt_token_ids; with --return-routed-experts: routed_experts, per "
     "token a list per MoE layer of its k expert ids)",
     fr_client_cmd_generate},
    {"push-weights", FR_CMD_C_PUSH_WEIGHTS, "push-weights --model SPEC --version V [options]",
     "send a model's weights (a checkpoint folder or synthetic:NAME[:SEED]) as weight version V; prints one JSON "
     "line with the bytes, buckets and seconds once committed",
     fr_client_cmd_push_weights},
    {"watch-metrics", FR_CMD_C_WATCH_METRICS, "watch-metrics [--count N]",
     "subscribe to the server's metrics PUB socket (--endpoint is then its metrics_pub_port, e.g. "
     "tcp://127.0.0.1:5558) and print each snapshot as a JSON line (the keys of /metrics.json, docs/metrics.md); "
     "status 1 when none comes within --timeout-ms",
     fr_client_cmd_watch_metrics},
    {"keygen", FR_CMD_C_KEYGEN, "keygen", "print a new CURVE key pair as JSON (public, secret)", cmd_keygen},
    {"send-raw", FR_CMD_C_SEND_RAW, "send-raw --hex HEX [--extra-frames N]",
     "send the bytes as frame 0 (and N empty frames after it), print the server's reply: for testing validation",
     fr_client_cmd_send_raw},
};
const int fr_client_n_commands = (int)(sizeof fr_client_commands / sizeof fr_client_commands[0]);

void fr_client_help(FILE *out)
{
    fputs(usage_text, out);
    fr_cli_print_options(out, FR_CMD_CLIENT, "global ", 1);
    fprintf(out, "\ncommands:\n");
    for (int i = 0; i < fr_client_n_commands; i++) {
        const fr_client_command *k = &fr_client_commands[i];
        char title[64];
        fprintf(out, "\n  %s\n    ", k->synopsis);
        fr_cli_wrap(out, k->summary, 4, 4);
        snprintf(title, sizeof title, "%s ", k->name);
        fr_cli_print_options(out, k->cmd, title, 0);
    }
}

int fr_client_connect(const fr_client_ctx *ctx, fr_cmd cmd, fr_client **c)
{
    if (fr_client_new_curve(ctx->endpoint, ctx->has_keys ? &ctx->keys : NULL, c)) return fr_cli_fail(cmd, 1);
    fr_client_set_timeout(*c, ctx->timeout_ms);
    return 0;
}

void fr_client_print_reply(const fr_msg *m)
{
    char *json = NULL;
    if (fr_msg_to_json(m, &json)) {
        printf("{\"type\":\"%s\"}\n", fr_msg_type_name(m->type));
        return;
    }
    printf("%s\n", json);
    fr_client_free_string(json);
}

/* hello, stats, pause, resume: one request, its reply printed. */
static int cmd_reply(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    fr_client *c;
    if (fr_client_connect(ctx, v->cmd, &c)) return 1;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_NONE);
    fr_status st;
    if (v->cmd == FR_CMD_C_HELLO) {
        m.type = FR_MSG_HELLO_REPLY;
        st = fr_client_hello(c, "fp4rollout-client", &m.u.hello_reply);
    } else if (v->cmd == FR_CMD_C_STATS) {
        m.type = FR_MSG_STATS_REPLY;
        st = fr_client_stats(c, &m.u.stats_reply);
    } else if (v->cmd == FR_CMD_C_RESUME) {
        m.type = FR_MSG_RESUME_REPLY;
        st = fr_client_resume_ex(c, (int)fr_opt_int(v, FR_O_RECOMPUTE), &m.u.resume_reply);
    } else {
        m.type = FR_MSG_PAUSE_REPLY;
        const fr_pause_mode mode = (fr_pause_mode)fr_opt_int(v, FR_O_MODE);
        if (fr_opt_int(v, FR_O_RECOMPUTE) && mode != FR_PAUSE_KEEP) {
            fr_client_destroy(&c);
            return fr_cli_usage_error(v->cmd, "--recompute goes with --mode keep");
        }
        st = fr_client_pause_ex(c, mode, (int)fr_opt_int(v, FR_O_RECOMPUTE), &m.u.pause_reply);
    }
    int rc = st ? fr_cli_fail(v->cmd, 1) : 0;
    if (!st) fr_client_print_reply(&m);
    fflush(stdout);
    fr_msg_free(&m);
    fr_client_destroy(&c);
    return rc;
}

static int cmd_keygen(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    (void)ctx;
    char pub[41], sec[41];
    if (fr_client_keypair(pub, sec)) return fr_cli_fail(v->cmd, 1);
    printf("{\"public\":\"%s\",\"secret\":\"%s\"}\n", pub, sec);
    return 0;
}
