/* fp4rollout: entry point; dispatches to the commands of cli_commands.c. */
#include <stdio.h>
#include <string.h>

#include "app/cli.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: fp4rollout COMMAND [options]   (fp4rollout COMMAND --help for details)\n"
                 "       fp4rollout --version\n\n"
                 "An RL rollout engine with a 4-bit microscaling KV cache.\n"
                 "Options take '--opt value' or '--opt=value'; every command takes --log-level\n"
                 "(debug, info, warn, error, off). Exit status: 0 done, 1 failed, 2 usage error.\n\n"
                 "commands:\n");
    for (int i = 0; i < fr_cli_n_commands; i++)
        fprintf(out, "  %-10s %s\n", fr_cli_commands[i].name, fr_cli_commands[i].summary);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("fp4rollout %s\n", FR_VERSION);
        return 0;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    for (int i = 0; i < fr_cli_n_commands; i++)
        if (strcmp(argv[1], fr_cli_commands[i].name) == 0) {
            const fr_cli_command *c = &fr_cli_commands[i];
            fr_cli_values *v;
            int rc;
            if (!fr_cli_parse(c->cmd, c->usage, argc - 1, argv + 1, &v, &rc)) rc = c->run(v);
            fr_cli_args_release();
            return rc;
        }
    fprintf(stderr, "fp4rollout: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
