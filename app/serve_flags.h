/* The flags of `fp4rollout serve`: the option table's serve options with
 * a configuration key (configs/README.md, "Flags instead of a file"). */
#ifndef FR_SERVE_FLAGS_H
#define FR_SERVE_FLAGS_H

#include "app/cli.h"
#include "app/serve_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Puts every serve flag given in v (fr_cli_parse's values, checked there
 * as their rows say) into c, over what c holds (the defaults, or a file's
 * values), then checks the whole as a configuration file's keys are
 * checked against each other, naming "command line". On failure c is
 * unchanged. */
fr_status fr_serve_flags_apply(const fr_cli_values *v, fr_serve_config *c);

#ifdef __cplusplus
}
#endif

#endif
