/* One record a line, failures named by their line. */
#include "base/text_lines.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fr_status fr_read_lines(const char *path, fr_line_fn fn, void *user)
{
    FILE *f = fopen(path, "r");
    if (!f) return fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    fr_status st = FR_OK;
    for (int lineno = 1; !st && getline(&line, &cap, f) >= 0; lineno++) {
        if ((st = fn(user, line)) && st != FR_ENOMEM) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            st = fr_fail(st, "%s line %d: %s", path, lineno, msg);
        }
    }
    if (!st && ferror(f)) st = fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    free(line);
    fclose(f);
    return st;
}
