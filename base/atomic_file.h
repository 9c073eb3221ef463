/* Output files that appear whole or not at all: writes go to PATH.tmp.PID,
 * which is renamed over PATH only when every write succeeded, so a failed
 * command never leaves a truncated result behind. */
#ifndef FR_ATOMIC_FILE_H
#define FR_ATOMIC_FILE_H

#include <stdio.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    FILE *f;              /* write here */
    char path[4096];
    char tmp[4200];
} fr_atomic_file;

fr_status fr_atomic_file_open(fr_atomic_file *a, const char *path);
/* ok != 0: close and rename into place (FR_EIO if that fails);
 * ok == 0: close and remove the temporary, returning FR_OK. */
fr_status fr_atomic_file_close(fr_atomic_file *a, int ok);

#ifdef __cplusplus
}
#endif

#endif
