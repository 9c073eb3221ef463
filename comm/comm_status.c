#include "comm_status.h"

#include <stdarg.h>

#include "base/fr_status.h"

/* The message lives where every other module's does (base/fr_status), so a
 * caller that crosses into fr_status keeps it; only the codes are comm's. */
fr_comm_status fr_comm_fail(fr_comm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fr_vfail(FR_EIO, fmt, ap);
    va_end(ap);
    return st;
}

const char *fr_comm_last_error(void) { return fr_last_error(); }

const char *fr_comm_status_name(fr_comm_status st)
{
    switch (st) {
    case FR_COMM_OK: return "ok";
    case FR_COMM_EINVAL: return "invalid argument";
    case FR_COMM_ENOMEM: return "out of memory";
    case FR_COMM_EMPI: return "MPI error";
    case FR_COMM_ENCCL: return "NCCL error";
    case FR_COMM_ECUDA: return "CUDA error";
    case FR_COMM_EUNSUPPORTED: return "unsupported";
    case FR_COMM_ETIMEOUT: return "timeout";
    }
    return "unknown status";
}
