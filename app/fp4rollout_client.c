/* fp4rollout-client: the C client library (trainer_bridge/client/client.h)
 * as a command line: the options before the command word, then the
 * command (app/client_commands.c lists them). */
#include <string.h>

#include "app/client_cli.h"

static const fr_client_command *command_named(const char *name)
{
    for (int k = 0; k < fr_client_n_commands; k++)
        if (strcmp(name, fr_client_commands[k].name) == 0) return &fr_client_commands[k];
    return NULL;
}

static int run(int argc, char **argv)
{
    for (int j = 1; j < argc; j++)
        if (strcmp(argv[j], "-h") == 0 || strcmp(argv[j], "--help") == 0) {
            fr_client_help(stdout);
            return 0;
        }
    fr_cli_values *g, *v;
    int rc;
    if (fr_cli_parse_head(FR_CMD_CLIENT, argc, argv, &g, &rc)) return rc;
    if (fr_opt_given(g, FR_O_VERSION)) {
        printf("fp4rollout-client %s\n", FR_VERSION);
        return 0;
    }
    if (g->next >= argc) return fr_cli_usage_error(FR_CMD_CLIENT, "a command is required");
    const fr_client_command *k = command_named(argv[g->next]);
    if (!k) return fr_cli_usage_error(FR_CMD_CLIENT, "unknown command '%s'", argv[g->next]);
    fr_client_ctx ctx = {.endpoint = fr_opt_str(g, FR_O_ENDPOINT), .timeout_ms = fr_opt_int(g, FR_O_TIMEOUT_MS),
                         .keys = {.server_public_key = fr_opt_str(g, FR_O_SERVER_KEY),
                                  .public_key = fr_opt_str(g, FR_O_PUBLIC_KEY),
                                  .secret_key = fr_opt_str(g, FR_O_SECRET_KEY)}};
    const int n_keys = !!ctx.keys.server_public_key + !!ctx.keys.public_key + !!ctx.keys.secret_key;
    if (n_keys != 0 && n_keys != 3 && k->cmd != FR_CMD_C_KEYGEN)
        return fr_cli_usage_error(FR_CMD_CLIENT, "CURVE needs --server-key, --public-key and --secret-key together");
    ctx.has_keys = n_keys == 3;
    if (fr_cli_parse(k->cmd, NULL, argc - g->next, argv + g->next, &v, &rc)) return rc;
    return k->run(&ctx, v);
}

int main(int argc, char **argv)
{
    int rc = run(argc, argv);
    fr_cli_args_release();
    return rc;
}
