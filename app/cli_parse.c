/* Reading a command line against the option table: the command's
 * getopt_long table is made from the rows that name it, every value is
 * read and checked as its row says, and a usage error names the option as
 * it was written and the reason. */
#include "app/cli.h"

#include <getopt.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* getopt_long's val for row r as written by its name (0) or alias (1). */
enum { VAL_BASE = 1000 };

static fr_cli_values *held_list;

void fr_cli_args_release(void)
{
    while (held_list) {
        fr_cli_values *v = held_list;
        held_list = v->held;
        for (int r = 0; r < FR_O_COUNT; r++) fr_opt_value_clear(&v->v[r]);
        free(v->operands);
        free(v);
    }
}

static void vprint_error(fr_cmd cmd, const char *fmt, va_list ap)
{
    const char *prog = fr_cmd_program(cmd), *name = fr_cmd_name(cmd), *sep = *name ? " " : "";
    fprintf(stderr, "%s%s%s: ", prog, sep, name);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(run '%s%s%s --help' for usage)\n", prog, sep, name);
}

int fr_cli_usage_error(fr_cmd cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprint_error(cmd, fmt, ap);
    va_end(ap);
    return 2;
}

int fr_cli_fail(fr_cmd cmd, int status)
{
    if (status == 2) return fr_cli_usage_error(cmd, "%s", fr_last_error());
    const char *name = fr_cmd_name(cmd);
    fprintf(stderr, "%s%s%s: %s\n", fr_cmd_program(cmd), *name ? " " : "", name, fr_last_error());
    return status;
}

/* The getopt_long table of cmd: each row's name and alias, val telling
 * them apart; short names go to optstring after its mode prefix. */
static struct option *long_table(fr_cmd cmd, char *optstring, size_t cap)
{
    struct option *t = calloc(2 * FR_O_COUNT + 1, sizeof *t);
    if (!t) return NULL;
    int k = 0;
    size_t s = strlen(optstring);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!fr_opt_takes(o, cmd)) continue;
        const int arg = o->type == FR_OPT_FLAG ? no_argument : required_argument;
        t[k++] = (struct option){o->name, arg, NULL, VAL_BASE + 2 * r};
        if (o->alias) t[k++] = (struct option){o->alias, arg, NULL, VAL_BASE + 2 * r + 1};
        if (o->short_name && s + 3 < cap) {
            optstring[s++] = o->short_name;
            if (arg == required_argument) optstring[s++] = ':';
            optstring[s] = '\0';
        }
    }
    return t;
}

static int row_of_short(fr_cmd cmd, int c)
{
    for (int r = 0; r < FR_O_COUNT; r++)
        if (fr_opt_takes(&fr_opts[r], cmd) && fr_opts[r].short_name == c) return r;
    return -1;
}

/* The message for an argument getopt refused: a missing value, a value
 * given to a flag, or a name no option of cmd has. */
static int refused(fr_cmd cmd, int c, const char *bad)
{
    if (c == ':') return fr_cli_usage_error(cmd, "%s needs a value", bad);
    const char *eq = strchr(bad, '=');
    if (strncmp(bad, "--", 2) == 0 && eq)
        for (int r = 0; r < FR_O_COUNT; r++) {
            const fr_opt *o = &fr_opts[r];
            size_t len = (size_t)(eq - bad - 2);
            if (fr_opt_takes(o, cmd) && o->type == FR_OPT_FLAG && strlen(o->name) == len &&
                strncmp(bad + 2, o->name, len) == 0)
                return fr_cli_usage_error(cmd, "--%s takes no value, got '%s'", o->name, bad);
        }
    return fr_cli_usage_error(cmd, "unknown or ambiguous option '%s'", bad);
}

static int add_operand(fr_cli_values *v, const char *arg)
{
    const char **grown = realloc(v->operands, sizeof *grown * (size_t)(v->n_operands + 1));
    if (!grown) return -1;
    v->operands = grown;
    v->operands[v->n_operands++] = arg;
    return 0;
}

/* One option getopt found: its value read as its row says. A FILES
 * option also takes the operands after it (*files_row). */
static int take(fr_cli_values *v, int r, int alias, const char *arg, int *files_row)
{
    const fr_opt *o = &fr_opts[r];
    char spelled[96];
    v->spelled[r] = alias ? o->alias : o->name;
    snprintf(spelled, sizeof spelled, "--%s", v->spelled[r]);
    fr_opt_value *val = &v->v[r];
    fr_status st;
    if ((o->type == FR_OPT_FILES || o->type == FR_OPT_KEYS) && val->given) {
        fr_opt_value one = {0};   /* --texts A --texts B: both */
        st = fr_opt_from_text(o, spelled, arg, &one);
        if (!st) st = fr_opt_add_file(val, one.list[0]);
        fr_opt_value_clear(&one);
    } else {
        st = fr_opt_from_text(o, spelled, arg, val);
    }
    if (!st && o->n_max && (o->type == FR_OPT_FILES || o->type == FR_OPT_KEYS) && val->n > o->n_max)
        st = fr_fail(FR_EINVAL, "%s takes at most %d values", spelled, o->n_max);
    if (st) return fr_cli_fail(v->cmd, 2);
    val->given = 1;
    *files_row = o->type == FR_OPT_FILES ? r : -1;
    return 0;
}

/* The getopt_long loop; head: stop at the first operand. */
static int read_args(fr_cli_values *v, int argc, char **argv, int head)
{
    char optstring[64] = "";
    snprintf(optstring, sizeof optstring, "%s", head ? "+:" : "-:");
    struct option *table = long_table(v->cmd, optstring, sizeof optstring);
    if (!table) return fr_cli_usage_error(v->cmd, "out of memory");
    int c, idx, rc = 0, files_row = -1;
    optind = 0;   /* glibc: start afresh (a program and the tests parse several argvs) */
    opterr = 0;
    while (!rc && (c = getopt_long(argc, argv, optstring, table, &idx)) != -1) {
        if (c == 1) {   /* an operand, in its place */
            if (files_row >= 0) rc = take(v, files_row, 0, optarg, &files_row);
            else rc = add_operand(v, optarg) ? 2 : 0;
        } else if (c == '?' || c == ':') {
            rc = refused(v->cmd, c, argv[optind - 1]);
        } else if (c >= VAL_BASE) {
            rc = take(v, (c - VAL_BASE) / 2, (c - VAL_BASE) % 2, optarg, &files_row);
        } else {
            rc = take(v, row_of_short(v->cmd, c), 0, optarg, &files_row);
        }
    }
    free(table);
    if (rc) return rc;
    v->next = optind;
    for (int i = optind; !head && i < argc; i++)   /* after "--" */
        if (add_operand(v, argv[i])) return fr_cli_usage_error(v->cmd, "out of memory");
    return 0;
}

/* Every row of cmd at its default: the table's own text, read as a
 * command-line value would be. */
static int defaults(fr_cli_values *v)
{
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!fr_opt_takes(o, v->cmd) || !o->def) continue;
        char spelled[96];
        snprintf(spelled, sizeof spelled, "--%s", o->name);
        if (fr_opt_from_text(o, spelled, o->def, &v->v[r]))
            return fr_cli_usage_error(v->cmd, "the option table's default of %s: %s", spelled, fr_last_error());
    }
    return 0;
}

/* What the whole command line must hold: required options, FILES with
 * enough files, no more operands than the command takes. */
static int complete(const fr_cli_values *v)
{
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!fr_opt_takes(o, v->cmd)) continue;
        const fr_opt_value *val = &v->v[r];
        if (o->type == FR_OPT_FILES && (val->given || (o->required >> v->cmd & 1u)) && val->n < o->n_min)
            return fr_cli_usage_error(v->cmd, "--%s needs at least %s", o->name,
                                      o->n_min == 1 ? "one file" : "more files");
        if ((o->required >> v->cmd & 1u) && !val->given) return fr_cli_usage_error(v->cmd, "--%s is required", o->name);
    }
    if (v->n_operands > fr_cmd_max_operands(v->cmd))
        return fr_cli_usage_error(v->cmd, "unexpected argument '%s'", v->operands[fr_cmd_max_operands(v->cmd)]);
    return 0;
}

static int wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) return 1;
    return 0;
}

static int parse(fr_cmd cmd, int argc, char **argv, int head, fr_cli_values **out)
{
    fr_cli_values *v = calloc(1, sizeof *v);
    if (!v) return fr_cli_usage_error(cmd, "out of memory");
    v->cmd = cmd;
    v->held = held_list;   /* on the list at once: release frees it whatever happens */
    held_list = v;
    int rc = defaults(v);
    if (!rc) rc = read_args(v, argc, argv, head);
    if (!rc && !head) rc = complete(v);
    if (!rc && v->v[FR_O_LOG_LEVEL].given) fr_log_set_level((fr_log_level)v->v[FR_O_LOG_LEVEL].i);
    *out = v;
    return rc;
}

int fr_cli_parse(fr_cmd cmd, const char *usage, int argc, char **argv, fr_cli_values **out, int *rc)
{
    if (wants_help(argc, argv)) {
        fr_cli_help(stdout, cmd, usage ? usage : "");
        *rc = 0;
        return 1;
    }
    *rc = parse(cmd, argc, argv, 0, out);
    return *rc != 0;
}

int fr_cli_parse_head(fr_cmd cmd, int argc, char **argv, fr_cli_values **out, int *rc)
{
    *rc = parse(cmd, argc, argv, 1, out);
    return *rc != 0;
}

/* ---- the values ---------------------------------------------------------- */

const fr_opt_value *fr_opt_val(const fr_cli_values *v, fr_opt_id id)
{
    return &v->v[id];
}

int fr_opt_given(const fr_cli_values *v, fr_opt_id id)
{
    return v->v[id].given;
}

int fr_opt_int(const fr_cli_values *v, fr_opt_id id)
{
    return (int)v->v[id].i;
}

long long fr_opt_long(const fr_cli_values *v, fr_opt_id id)
{
    return v->v[id].i;
}

double fr_opt_num(const fr_cli_values *v, fr_opt_id id)
{
    return v->v[id].d;
}

const char *fr_opt_str(const fr_cli_values *v, fr_opt_id id)
{
    return v->v[id].s;
}
