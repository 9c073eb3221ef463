#include "base/atomic_file.h"

#include <string.h>
#include <unistd.h>

fr_status fr_atomic_file_open(fr_atomic_file *a, const char *path)
{
    if (strlen(path) >= sizeof a->path) return fr_fail(FR_EINVAL, "path too long: %.64s...", path);
    strcpy(a->path, path);
    snprintf(a->tmp, sizeof a->tmp, "%s.tmp.%d", path, (int)getpid());
    a->f = fopen(a->tmp, "wb");
    if (!a->f) return fr_fail(FR_EIO, "cannot create %s", a->tmp);
    return FR_OK;
}

fr_status fr_atomic_file_close(fr_atomic_file *a, int ok)
{
    if (!a->f) return FR_OK;
    if (fclose(a->f) != 0) ok = 0;
    a->f = NULL;
    if (ok && rename(a->tmp, a->path) == 0) return FR_OK;
    unlink(a->tmp);
    return ok ? fr_fail(FR_EIO, "cannot write %s", a->path) : FR_OK;
}
