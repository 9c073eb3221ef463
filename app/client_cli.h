/* fp4rollout-client's commands (app/fp4rollout_client.c dispatches them):
 * each connects to the server it is given, does one protocol operation
 * and prints JSON. Their options are the option table's rows for
 * FR_CMD_CLIENT (before the command word) and FR_CMD_C_*. */
#ifndef FR_CLIENT_CLI_H
#define FR_CLIENT_CLI_H

#include <stdio.h>

#include "app/cli.h"
#include "trainer_bridge/client/client.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the options before the command word say. */
typedef struct {
    const char *endpoint;
    fr_client_curve keys;
    int has_keys;            /* all three CURVE keys given */
    int timeout_ms;
} fr_client_ctx;

typedef struct {
    const char *name;
    fr_cmd cmd;
    const char *synopsis;    /* the command with its required options */
    const char *summary;
    int (*run)(const fr_client_ctx *ctx, const fr_cli_values *v);   /* the exit status */
} fr_client_command;

extern const fr_client_command fr_client_commands[];
extern const int fr_client_n_commands;

/* fp4rollout-client --help: the usage, then every command and its options. */
void fr_client_help(FILE *out);

/* A reply as JSON on stdout. */
void fr_client_print_reply(const fr_msg *m);

/* A client of ctx's server (the timeout set); 1 after printing why not. */
int fr_client_connect(const fr_client_ctx *ctx, fr_cmd cmd, fr_client **c);

int fr_client_cmd_generate(const fr_client_ctx *ctx, const fr_cli_values *v);
int fr_client_cmd_push_weights(const fr_client_ctx *ctx, const fr_cli_values *v);
int fr_client_cmd_send_raw(const fr_client_ctx *ctx, const fr_cli_values *v);
int fr_client_cmd_watch_metrics(const fr_client_ctx *ctx, const fr_cli_values *v);

#ifdef __cplusplus
}
#endif

#endif
