/* CURVE for `fp4rollout serve` without keys in the JSON file
 * (configs/README.md, "CURVE without a file of keys"): the keys from the
 * environment, the server's secret key read from a file, and the refusal
 * of a bind beyond this host without CURVE, which says how to make keys. */
#ifndef FR_SERVE_CURVE_H
#define FR_SERVE_CURVE_H

#include "app/options.h"
#include "app/serve_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The variables read, below a file's keys and the flags: the secret key
 * itself, a file of it, and public keys with each role (separated by
 * commas or white space). */
#define FR_ENV_CURVE_SECRET_KEY "FP4ROLLOUT_CURVE_SECRET_KEY"
#define FR_ENV_CURVE_SECRET_KEY_FILE "FP4ROLLOUT_CURVE_SECRET_KEY_FILE"
#define FR_ENV_CURVE_TRAINER_KEYS "FP4ROLLOUT_CURVE_TRAINER_KEYS"
#define FR_ENV_CURVE_CLIENT_KEYS "FP4ROLLOUT_CURVE_CLIENT_KEYS"

/* Stores the variables that are set (and not empty) into c as their keys
 * would be, each value checked (FR_EINVAL naming the variable); the keys
 * are checked against each other after the file and the flags, which
 * come later and override them. */
fr_status fr_serve_curve_env(fr_serve_config *c);

/* Reads curve.server_secret_key_file, when set, into
 * curve.server_secret_key: the file holds the key (40 Z85 characters,
 * white space around it ignored) or the JSON object fp4rollout-client
 * keygen prints (its "secret"). FR_EIO when it cannot be read, FR_EINVAL
 * when it holds no key; the message names the file, never the key. */
fr_status fr_serve_curve_key_file(fr_serve_config *c);

/* Whether the configuration may bind where it says: with CURVE off, only
 * loopback. 0, or 2 after printing why and the commands that make and
 * pass keys. */
int fr_serve_curve_check_bind(fr_cmd cmd, const fr_serve_config *c);

#ifdef __cplusplus
}
#endif

#endif
