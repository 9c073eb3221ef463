#include "comm_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[1024];

fr_comm_status fr_comm_fail(fr_comm_status st, const char *fmt, ...)
{
    char message[sizeof last_error];   /* the arguments may include fr_comm_last_error() */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    memcpy(last_error, message, sizeof last_error);
    return st;
}

const char *fr_comm_last_error(void) { return last_error; }

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
    }
    return "unknown status";
}
