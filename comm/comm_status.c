#include "comm_status.h"

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
