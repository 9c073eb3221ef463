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

void fr_cli_sampling_default(fr_cli_sampling *o)
{
    *o = (fr_cli_sampling){.n_samples = 1, .max_tokens = 64,
                           .sp = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0}};
}

int fr_cli_sampling_parse(const char *cmd, int argc, char **argv, int *i, fr_cli_sampling *o)
{
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    int bad = 0;
    if (strcmp(a, "--greedy") == 0) o->greedy = 1;
    else if (strcmp(a, "--json") == 0) o->json = 1;
    else if (strcmp(a, "--ignore-eos") == 0) o->ignore_eos = 1;
    else if (!v) return 0;
    else if (strcmp(a, "--stop-ids") == 0) o->stop_text = argv[++*i];
    else if (strcmp(a, "--n") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 1, 4096, &o->n_samples);
    else if (strcmp(a, "--max-tokens") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 1, 1 << 24, &o->max_tokens);
    else if (strcmp(a, "--top-k") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 0, 1 << 30, &o->sp.top_k);
    else if (strcmp(a, "--seed") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 0, 0x7fffffff, &o->seed);
    else if (strcmp(a, "--temperature") == 0) bad = fr_cli_float(cmd, a, argv[++*i], &o->sp.temperature);
    else if (strcmp(a, "--top-p") == 0) bad = fr_cli_float(cmd, a, argv[++*i], &o->sp.top_p);
    else return 0;
    return bad ? -1 : 1;
}

int fr_cli_sampling_finish(const char *cmd, fr_cli_sampling *o)
{
    if (o->greedy && o->sp.temperature > 0.0f) return fr_cli_usage_error(cmd, "--greedy contradicts --temperature");
    if (o->greedy) o->sp.temperature = 0.0f;
    o->sp.seed = (uint64_t)o->seed;
    return 0;
}
