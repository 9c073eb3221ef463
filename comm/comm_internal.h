/* Private to comm/: turning MPI return codes into comm status messages. */
#ifndef FR_COMM_INTERNAL_H
#define FR_COMM_INTERNAL_H

#include <mpi.h>

#include "comm_status.h"

/* FR_COMM_EMPI with "<what> failed: <MPI's error string>". */
fr_comm_status fr_comm_mpi_fail(int rc, const char *what);

/* Evaluates an MPI call; on failure records its text and MPI's message and
 * returns FR_COMM_EMPI from the calling function. */
#define FR_MPI_TRY(call)                                          \
    do {                                                          \
        int fr_mpi_rc_ = (call);                                  \
        if (fr_mpi_rc_ != MPI_SUCCESS)                            \
            return fr_comm_mpi_fail(fr_mpi_rc_, #call);           \
    } while (0)

/* The largest element count handed to one MPI call: counts are ints, so
 * larger buffers travel in pieces of this many elements. */
#define FR_COMM_MPI_CHUNK ((size_t)1 << 30)

#endif
