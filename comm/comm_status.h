/* comm_status: how comm/ reports errors.
 *
 * The project's error convention (base/fr_status.h) with codes of its own
 * for what comm/ can meet (MPI, NCCL, CUDA): a public function returns
 * FR_COMM_OK or a failure code and, on failure, leaves a readable message
 * in the project's one error store, which fr_last_error() returns (per
 * thread). Callers in rollout/ and trainer_bridge/ turn a failure into their
 * own fr_status, keeping or prefixing the message, e.g.
 *     if (cs) return fr_fail(FR_EIO, "%s", fr_last_error());
 * Nothing here aborts on bad input; fr_mpi_world_abort() exists for callers
 * that decide a failure is fatal to the whole job. */
#ifndef FR_COMM_STATUS_H
#define FR_COMM_STATUS_H

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FR_COMM_OK = 0,
    FR_COMM_EINVAL,      /* bad argument or launch layout (e.g. world size not a multiple of tp) */
    FR_COMM_ENOMEM,      /* allocation failed */
    FR_COMM_EMPI,        /* an MPI call failed; the message holds MPI's own text */
    FR_COMM_ENCCL,       /* an NCCL call failed, or a communicator reported an asynchronous error */
    FR_COMM_ECUDA,       /* a CUDA runtime call failed (device selection, no device) */
    FR_COMM_EUNSUPPORTED, /* valid, but not offered by the MPI/NCCL/CUDA at hand */
    FR_COMM_ETIMEOUT     /* other ranks did not take part in a collective in time (fr_mpi_world_set_timeout) */
} fr_comm_status;

/* Records a printf-style message in the one error store (fr_fail's) and
 * evaluates to st:
 *     return fr_comm_fail(FR_COMM_EINVAL, "tp %d must be >= 1", tp); */
#define fr_comm_fail(st, ...) ((void)fr_fail(FR_EIO, __VA_ARGS__), (fr_comm_status)(st))

/* A short name for a status code ("MPI error", ...). */
const char *fr_comm_status_name(fr_comm_status st);

#ifdef __cplusplus
}
#endif

#endif
