#include "base/fr_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[1024];

fr_status fr_vfail(fr_status st, const char *fmt, va_list ap)
{
    /* Formatted apart first: callers may pass fr_last_error() itself as an
     * argument to prefix it with context. */
    char message[sizeof last_error];
    vsnprintf(message, sizeof message, fmt, ap);
    memcpy(last_error, message, sizeof last_error);
    return st;
}

fr_status fr_fail(fr_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fr_vfail(st, fmt, ap);
    va_end(ap);
    return st;
}

const char *fr_last_error(void) { return last_error; }

const char *fr_status_name(fr_status st)
{
    switch (st) {
    case FR_OK: return "ok";
    case FR_EINVAL: return "invalid argument";
    case FR_ENOMEM: return "out of memory";
    case FR_EIO: return "I/O error";
    case FR_EFORMAT: return "malformed input";
    case FR_EUNSUPPORTED: return "unsupported";
    case FR_EINTERNAL: return "internal error";
    }
    return "unknown status";
}
