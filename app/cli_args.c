/* The command line of every subcommand, read by getopt_long: `--opt value`
 * and `--opt=value` alike, unambiguous prefixes of long names, vLLM's names
 * as aliases, and one message and exit status 2 for every usage error.
 *
 * The subcommands' own loops then read a canonical argv: each option as its
 * full "--name" followed by its value when it takes one, every other
 * argument where it stood (so `--texts A B C` keeps its files after it). */
#include "app/cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* Options every subcommand takes; handled here, not passed on. */
static const struct option common_opts[] = {
    {"log-level", required_argument, 0, 0},
    {0, 0, 0, 0},
};

/* vLLM's name of a concept fp4rollout names otherwise: accepted as ours. */
static const struct { const char *alias, *name; } aliases[] = {
    {"kv-cache-dtype", "kv"},
    {"tensor-parallel-size", "tp"},
    {"max-num-seqs", "max-seqs"},
};

/* The canonical argvs made so far (a program's global options, then its
 * command's); main frees them all when the command returns. */
typedef struct held_argv {
    char **argv;
    char *names;
    struct held_argv *next;
} held_argv;
static held_argv *held_list;

void fr_cli_args_release(void)
{
    while (held_list) {
        held_argv *h = held_list;
        held_list = h->next;
        free(h->argv);
        free(h->names);
        free(h);
    }
}

static int count_opts(const struct option *const *tables)
{
    int n = 0;
    for (int t = 0; tables[t]; t++)
        for (const struct option *o = tables[t]; o->name; o++) n++;
    return n;
}

static int known(const struct option *const *tables, const char *name)
{
    for (int t = 0; tables[t]; t++)
        for (const struct option *o = tables[t]; o->name; o++)
            if (strcmp(o->name, name) == 0) return 1;
    return 0;
}

/* All tables, the common options and the aliases of known names as one
 * getopt_long table; val is the option's index in it. */
static struct option *merge(const struct option *const *tables, int *n_out)
{
    int n = count_opts(tables), k = 0;
    const int n_alias = (int)(sizeof aliases / sizeof aliases[0]);
    struct option *all = calloc((size_t)(n + n_alias + 2), sizeof *all);
    if (!all) return NULL;
    for (int t = 0; tables[t]; t++)
        for (const struct option *o = tables[t]; o->name; o++) all[k++] = *o;
    for (const struct option *o = common_opts; o->name; o++) all[k++] = *o;
    for (int a = 0; a < n_alias; a++) {
        if (!known(tables, aliases[a].name)) continue;
        for (int j = 0; j < k; j++)
            if (strcmp(all[j].name, aliases[a].name) == 0) {
                all[k] = all[j];
                all[k++].name = aliases[a].alias;
                break;
            }
    }
    for (int j = 0; j < k; j++) {
        all[j].flag = NULL;
        all[j].val = 1000 + j;
    }
    *n_out = k;
    return all;
}

/* The canonical spelling of an option: its own name, or its alias's. */
static const char *canonical(const char *name)
{
    for (size_t a = 0; a < sizeof aliases / sizeof aliases[0]; a++)
        if (strcmp(name, aliases[a].alias) == 0) return aliases[a].name;
    return name;
}

static int common_option(const char *cmd, const char *name, const char *value)
{
    fr_log_level level;
    if (strcmp(name, "log-level") != 0) return 0;
    if (fr_log_level_parse(value, &level)) {
        fr_cli_usage_error(cmd, "--log-level: %s", fr_last_error());
        return -1;
    }
    fr_log_set_level(level);
    return 1;
}

/* Room for every "--name" this argv can produce. */
static size_t names_room(const struct option *all, int n)
{
    size_t room = 0;
    for (int j = 0; j < n; j++) room += strlen(all[j].name) + 3;
    return room;
}

static int run_getopt(const char *cmd, int argc, char **argv, struct option *all, int n_all, const char *optstring,
                      held_argv *held, int *out_argc)
{
    size_t used = 0, room = names_room(all, n_all) * (size_t)argc;
    held->names = malloc(room ? room : 1);
    held->argv = calloc((size_t)argc * 2 + 1, sizeof *held->argv);
    if (!held->names || !held->argv) return fr_cli_usage_error(cmd, "out of memory");
    int k = 0, c, idx;
    held->argv[k++] = argv[0];
    optind = 0;   /* glibc: start afresh (tests parse several argvs) */
    opterr = 0;
    while ((c = getopt_long(argc, argv, optstring, all, &idx)) != -1) {
        if (c == 1) {
            held->argv[k++] = optarg;
            continue;
        }
        if (c == '?' || c == ':') {
            const char *bad = argv[optind - 1];
            if (c == ':') return fr_cli_usage_error(cmd, "%s needs a value", bad);
            return fr_cli_usage_error(cmd, "unknown or ambiguous option '%s'", bad);
        }
        const struct option *o = &all[c - 1000];
        int r = common_option(cmd, o->name, optarg);
        if (r < 0) return 2;
        if (r) continue;
        char *name = held->names + used;
        used += (size_t)snprintf(name, room - used, "--%s", canonical(o->name)) + 1;
        held->argv[k++] = name;
        if (o->has_arg != no_argument && optarg) held->argv[k++] = optarg;
    }
    for (; optind < argc; optind++) held->argv[k++] = argv[optind];   /* after "--", or the operands of "+" */
    held->argv[k] = NULL;
    *out_argc = k;
    return 0;
}

static int parse_with(const char *cmd, int *argc, char ***argv, const struct option *const *tables,
                      const char *optstring)
{
    int n_all = 0;
    struct option *all = merge(tables, &n_all);
    held_argv *held = calloc(1, sizeof *held);
    if (!all || !held) {
        free(all);
        free(held);
        return fr_cli_usage_error(cmd, "out of memory");
    }
    held->next = held_list;   /* on the list at once: release frees it whatever happens */
    held_list = held;
    int out_argc = 0;
    int rc = run_getopt(cmd, *argc, *argv, all, n_all, optstring, held, &out_argc);
    free(all);
    if (rc) return rc;
    *argc = out_argc;
    *argv = held->argv;
    return 0;
}

/* "-": operands come back in place; ":": a missing value is reported as such. */
int fr_cli_args(const char *cmd, int *argc, char ***argv, const struct option *const *tables)
{
    return parse_with(cmd, argc, argv, tables, "-:");
}

/* "+": the options before the first operand (a program's global options
 * before its command); the operand and all after it are kept as they are. */
int fr_cli_args_head(const char *cmd, int *argc, char ***argv, const struct option *const *tables)
{
    return parse_with(cmd, argc, argv, tables, "+:");
}
