/* The keys of the serve configuration as the option table types them
 * (the rows with a key, app/options.def): reading a key's JSON value,
 * putting a value (from JSON or from a serve flag) into the
 * configuration, and writing it back as JSON. Used by serve_config.c and
 * serve_flags.c only. */
#ifndef FR_SERVE_KEYS_H
#define FR_SERVE_KEYS_H

#include <cjson/cJSON.h>

#include "app/options.h"
#include "app/serve_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads item as the row's value; failures are FR_EINVAL with the message
 * "LABEL: PATH: reason". *v holds allocations (fr_opt_value_clear). */
fr_status fr_serve_key_read(const fr_opt *o, const cJSON *item, const char *label, const char *path,
                            fr_opt_value *v);
/* Puts a value read by fr_serve_key_read or fr_opt_from_text into c. */
void fr_serve_key_store(const fr_opt *o, const fr_opt_value *v, fr_serve_config *c);
/* The key's value in c as a new JSON item (NULL when out of memory). */
cJSON *fr_serve_key_json(const fr_opt *o, const fr_serve_config *c);

/* "a string", "an object": what a JSON value is, for messages. */
const char *fr_serve_json_type(const cJSON *v);

/* After the keys of one text (a file, or the flags) were stored: what
 * follows from which were given (metrics_port given: no longer the
 * default that gives way), then the checks of values against each other
 * (configs/README.md, "Contradictions"), named by label. */
fr_status fr_serve_config_settle(const char *label, const unsigned char given[FR_O_COUNT], fr_serve_config *c);

#ifdef __cplusplus
}
#endif

#endif
