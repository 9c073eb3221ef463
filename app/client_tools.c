/* fp4rollout-client send-raw (any bytes as a request, for testing a
 * server's validation) and watch-metrics (the metrics PUB socket's
 * snapshots as JSON lines). */
#include <stdlib.h>
#include <string.h>

#include "app/client_cli.h"
#include "trainer_bridge/client/metrics_sub.h"

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

int fr_client_cmd_send_raw(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    const char *hex = fr_opt_str(v, FR_O_HEX);
    const size_t n = strlen(hex);
    if (n % 2) return fr_cli_usage_error(v->cmd, "--hex needs an even number of digits, got '%s'", hex);
    unsigned char *bytes = malloc(n / 2 + 1);
    if (!bytes) return 1;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            free(bytes);
            return fr_cli_usage_error(v->cmd, "--hex holds a non-hex digit: '%s'", hex);
        }
        bytes[i] = (unsigned char)(hi * 16 + lo);
    }
    fr_client *c;
    if (fr_client_connect(ctx, v->cmd, &c)) {
        free(bytes);
        return 1;
    }
    fr_status st = fr_client_send_raw(c, bytes, n / 2, fr_opt_int(v, FR_O_EXTRA_FRAMES));
    free(bytes);
    fr_msg m;
    int got = 0;
    if (!st && !(st = fr_client_next(c, ctx->timeout_ms, &m, &got)) && !got) st = fr_fail(FR_EIO, "no reply");
    if (!st) {
        fr_client_print_reply(&m);
        fr_msg_free(&m);
    }
    fr_client_destroy(&c);
    return st ? fr_cli_fail(v->cmd, 1) : 0;
}

int fr_client_cmd_watch_metrics(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    const long long count = fr_opt_given(v, FR_O_WATCH_COUNT) ? fr_opt_long(v, FR_O_WATCH_COUNT) : -1;
    fr_metrics_sub *sub;
    if (fr_metrics_sub_new(ctx->endpoint, ctx->has_keys ? &ctx->keys : NULL, &sub)) return fr_cli_fail(v->cmd, 1);
    int rc = 0;
    for (long long got = 0; !rc && (count < 0 || got < count); got++) {
        char *json = NULL;
        if (fr_metrics_sub_next(sub, ctx->timeout_ms, &json)) {
            rc = fr_cli_fail(v->cmd, 1);
        } else if (!json) {
            fprintf(stderr, "fp4rollout-client watch-metrics: no metrics snapshot from %s within %d ms\n",
                    ctx->endpoint, ctx->timeout_ms);
            rc = 1;
        } else {
            printf("%s\n", json);
            fflush(stdout);
            fr_client_free_string(json);
        }
    }
    fr_metrics_sub_destroy(&sub);
    return rc;
}
