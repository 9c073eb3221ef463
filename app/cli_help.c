/* --help: a command's usage text, then its options as the option table
 * describes them, grouped (the command's own, sampling, engine, common),
 * each with its default or "(required)", and in serve's help the
 * configuration key it sets. */
#include "app/cli.h"

#include <string.h>

enum { WIDTH = 79, HELP_COLUMN = 26 };

static const char *meta_of(const fr_opt *o)
{
    if (o->meta) return o->meta;
    switch (o->type) {
    case FR_OPT_INT:
    case FR_OPT_LONG: return "N";
    case FR_OPT_NUM:
    case FR_OPT_FLOAT: return "X";
    case FR_OPT_IDS: return "IDS";
    case FR_OPT_FILES: return "FILE...";
    case FR_OPT_KEY: return "K";
    default: return "S";
    }
}

/* "  -h, --help", "  --kv T, --kv-cache-dtype T". */
static int left_column(const fr_opt *o, char *buf, size_t cap)
{
    const char *meta = o->type == FR_OPT_FLAG ? "" : meta_of(o), *sp = *meta ? " " : "";
    int n = o->short_name ? snprintf(buf, cap, "  -%c, --%s%s%s", o->short_name, o->name, sp, meta)
                          : snprintf(buf, cap, "  --%s%s%s", o->name, sp, meta);
    if (o->alias && n > 0 && (size_t)n < cap) n += snprintf(buf + n, cap - (size_t)n, ", --%s%s%s", o->alias, sp, meta);
    return n;
}

void fr_cli_wrap(FILE *out, const char *text, int at, int indent)
{
    for (int first = 1; *text; first = 0) {
        while (*text == ' ') text++;
        const size_t word = strcspn(text, " ");
        if (!first && at + 1 + (int)word > WIDTH) {
            fprintf(out, "\n%*s", indent, "");
            at = indent;
        } else if (!first) {
            fputc(' ', out);
            at++;
        }
        fwrite(text, 1, word, out);
        at += (int)word;
        text += word;
    }
    fputc('\n', out);
}

static void print_row(FILE *out, const fr_opt *o, fr_cmd cmd)
{
    char left[160], text[1024];
    int n = left_column(o, left, sizeof left);
    fputs(left, out);
    if (n + 2 > HELP_COLUMN) fprintf(out, "\n%*s", HELP_COLUMN, "");
    else fprintf(out, "%*s", HELP_COLUMN - n, "");
    size_t k = (size_t)snprintf(text, sizeof text, "%s", o->help);
    if (o->required >> cmd & 1u) k += (size_t)snprintf(text + k, sizeof text - k, " (required)");
    else if (o->def_note) k += (size_t)snprintf(text + k, sizeof text - k, " (default: %s)", o->def_note);
    else if (o->def) k += (size_t)snprintf(text + k, sizeof text - k, " (default %s)", o->def);
    if (cmd == FR_CMD_SERVE && o->key && k < sizeof text) snprintf(text + k, sizeof text - k, " [%s]", o->key);
    fr_cli_wrap(out, text, HELP_COLUMN, HELP_COLUMN);
}

void fr_cli_print_options(FILE *out, fr_cmd cmd, const char *title, int with_common)
{
    static const char *const headings[] = {"options", "sampling options", "engine options", "common options"};
    for (int g = FR_OG_OWN; g <= FR_OG_COMMON; g++) {
        if (g == FR_OG_COMMON && !with_common) continue;
        int first = 1;
        for (int r = 0; r < FR_O_COUNT; r++) {
            const fr_opt *o = &fr_opts[r];
            if (!fr_opt_takes(o, cmd) || (int)o->group != g) continue;
            if (first) fprintf(out, "\n%s%s:\n", g == FR_OG_COMMON ? "" : title, headings[g]);
            first = 0;
            print_row(out, o, cmd);
        }
    }
}

void fr_cli_help(FILE *out, fr_cmd cmd, const char *usage)
{
    fputs(usage, out);
    fr_cli_print_options(out, cmd, "", 1);
}
