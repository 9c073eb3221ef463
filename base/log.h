/* log: the programs' one way of telling an operator what happens.
 *
 * Every line goes to stderr (or the stream given to fr_log_set_stream) as
 *
 *     2026-12-02T08:58:03.412Z INFO  serve: listening on tcp://127.0.0.1:5555
 *
 * a UTC timestamp with milliseconds, the level, and the message, written
 * with one fwrite so lines of several threads do not interleave. Lines
 * below the current level cost one comparison. The level is process-wide:
 * set it once at start (--log-level), before threads exist. */
#ifndef FR_LOG_H
#define FR_LOG_H

#include <stdio.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FR_LOG_DEBUG = 0, FR_LOG_INFO = 1, FR_LOG_WARN = 2, FR_LOG_ERROR = 3, FR_LOG_OFF = 4 } fr_log_level;

/* debug, info, warn (or warning), error, off; FR_EINVAL for anything else. */
fr_status fr_log_level_parse(const char *text, fr_log_level *out);
void fr_log_set_level(fr_log_level level);
fr_log_level fr_log_get_level(void);
/* Where lines go; NULL restores stderr. Not owned. */
void fr_log_set_stream(FILE *f);
/* Whether a line at this level would be written. */
int fr_log_enabled(fr_log_level level);

void fr_log_msg(fr_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define fr_debug(...) fr_log_msg(FR_LOG_DEBUG, __VA_ARGS__)
#define fr_info(...) fr_log_msg(FR_LOG_INFO, __VA_ARGS__)
#define fr_warn(...) fr_log_msg(FR_LOG_WARN, __VA_ARGS__)
#define fr_error(...) fr_log_msg(FR_LOG_ERROR, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
