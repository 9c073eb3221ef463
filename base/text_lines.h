/* Files of one record a line (prompt files, task files): each line handed
 * to a callback, and a failure named by the file and the line it came from. */
#ifndef FR_TEXT_LINES_H
#define FR_TEXT_LINES_H

#include "base/fr_status.h"

/* Called with each line, its newline kept, blank lines included; a status
 * other than FR_OK stops the reading. */
typedef fr_status (*fr_line_fn)(void *user, const char *line);

/* FR_EIO with the system's reason when path cannot be opened or read; a
 * line's failure comes back as "PATH line N: message" with its status
 * (FR_ENOMEM as it is). */
fr_status fr_read_lines(const char *path, fr_line_fn fn, void *user);

#endif
