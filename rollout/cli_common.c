#include "cli.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

int fr_cli_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) return 1;
    return 0;
}

int fr_cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fp4rollout %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(run 'fp4rollout %s --help' for usage)\n", cmd);
    return 2;
}

int fr_cli_int(const char *cmd, const char *flag, const char *text, long lo, long hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = text ? strtol(text, &end, 10) : 0;
    if (!text || !*text || *end || errno || v < lo || v > hi) {
        fr_cli_usage_error(cmd, "%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi,
                           text ? text : "(nothing)");
        return -1;
    }
    *out = (int)v;
    return 0;
}

int fr_cli_float(const char *cmd, const char *flag, const char *text, float *out)
{
    char *end = NULL;
    errno = 0;
    float v = text ? strtof(text, &end) : 0.0f;
    if (!text || !*text || *end || errno) {
        fr_cli_usage_error(cmd, "%s expects a number, got '%s'", flag, text ? text : "(nothing)");
        return -1;
    }
    *out = v;
    return 0;
}
