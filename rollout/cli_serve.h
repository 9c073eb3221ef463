/* fp4rollout serve (rollout/cli_serve.c). Declared apart from cli.h because
 * it links into the binary beside main.c rather than into librollout: it
 * drives trainer_bridge/, which itself uses rollout/. */
#ifndef FR_CLI_SERVE_H
#define FR_CLI_SERVE_H

#ifdef __cplusplus
extern "C" {
#endif

int fr_cli_serve(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
