/* The command-line flags of `fp4rollout serve`, each a serve configuration
 * key (configs/README.md lists which). */
#ifndef FR_SERVE_FLAGS_H
#define FR_SERVE_FLAGS_H

#include <getopt.h>

#include "app/serve_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The flags for fr_cli_args: --config and one per mapped key. */
extern const struct option fr_serve_longopts[];

/* Applies the flags of a canonical argv (fr_cli_args's: "--name" then its
 * value) over c, checked as the configuration's keys are; --config is
 * skipped (the caller loads it first). On failure c is unchanged. */
fr_status fr_serve_flags_apply(int argc, char **argv, fr_serve_config *c);

#ifdef __cplusplus
}
#endif

#endif
