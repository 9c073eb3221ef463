#include "base/log.h"

#include <stdarg.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static fr_log_level current = FR_LOG_INFO;
static FILE *stream = NULL;   /* NULL: stderr (not a constant initializer) */

static const char *const names[] = {"DEBUG", "INFO", "WARN", "ERROR"};

fr_status fr_log_level_parse(const char *text, fr_log_level *out)
{
    static const struct { const char *name; fr_log_level level; } table[] = {
        {"debug", FR_LOG_DEBUG}, {"info", FR_LOG_INFO}, {"warn", FR_LOG_WARN},
        {"warning", FR_LOG_WARN}, {"error", FR_LOG_ERROR}, {"off", FR_LOG_OFF},
    };
    for (size_t i = 0; text && i < sizeof table / sizeof table[0]; i++)
        if (strcmp(text, table[i].name) == 0) {
            *out = table[i].level;
            return FR_OK;
        }
    return fr_fail(FR_EINVAL, "unknown log level '%s' (expected debug, info, warn, error or off)",
                   text ? text : "(nothing)");
}

void fr_log_set_level(fr_log_level level) { current = level; }
fr_log_level fr_log_get_level(void) { return current; }
void fr_log_set_stream(FILE *f) { stream = f; }
int fr_log_enabled(fr_log_level level) { return level >= current && level < FR_LOG_OFF; }

void fr_log_msg(fr_log_level level, const char *fmt, ...)
{
    if (!fr_log_enabled(level)) return;
    char line[2048];
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    int n = (int)strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
    n += snprintf(line + n, sizeof line - (size_t)n, ".%03dZ %-5s ", (int)(tv.tv_usec / 1000), names[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* a message longer than the line is cut, never dropped */
    n = m < 0 ? n : (n + m < (int)sizeof line - 1 ? n + m : (int)sizeof line - 2);
    if (n > 0 && line[n - 1] != '\n') line[n++] = '\n';
    fwrite(line, 1, (size_t)n, stream ? stream : stderr);
    fflush(stream ? stream : stderr);
}
