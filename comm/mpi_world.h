/* The MPI world of a rollout job: bootstrap, this process's place in the
 * world and on its host, world-level collectives (weight broadcast, an
 * all-ranks agreement), and finalize.
 *
 *     fr_mpi_world *w;
 *     if (fr_mpi_world_init(&argc, &argv, &w)) { report fr_last_error(); }
 *     ... fr_engine_group_new(w, tp, &g) ... fr_engine_group_destroy(&g);
 *     fr_mpi_world_finalize(&w);
 *
 * Every communicator made here returns errors to the caller
 * (MPI_ERRORS_RETURN), and every failing MPI call becomes FR_COMM_EMPI with
 * MPI's own message. Functions marked "collective" must be called by every
 * rank of the world (in the same order, with matching arguments); a rank
 * that skips one leaves the others waiting. */
#ifndef FR_MPI_WORLD_H
#define FR_MPI_WORLD_H

#include <stddef.h>

#include <mpi.h>

#include "comm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int rank, size;             /* this process in the world */
    int local_rank, local_size; /* among the ranks of this host (MPI_COMM_TYPE_SHARED) */
    int thread_level;           /* provided: MPI_THREAD_MULTIPLE when the library offers it,
                                 * else at least MPI_THREAD_FUNNELED (only the main thread
                                 * may then call comm/) */
    MPI_Comm comm;              /* a duplicate of MPI_COMM_WORLD */
    MPI_Comm local;             /* the ranks of this host, ordered by world rank */
    int owns_mpi;               /* 1 when fr_mpi_world_init started MPI (finalize ends it) */
    int timeout_ms;             /* the collectives below fail after this long without the
                                 * other ranks (0: they wait for ever); fr_mpi_world_set_timeout */
} fr_mpi_world;

/* Collective. Starts MPI with MPI_Init_thread asking for MPI_THREAD_MULTIPLE
 * (argc/argv may be NULL) and records the level provided; fails with
 * FR_COMM_EUNSUPPORTED, MPI ended again, when it is below FUNNELED. When MPI
 * is already running, the world wraps it and leaves it running at finalize.
 * A process started without mpirun is a world of one. MPI can start only once
 * per process: after fr_mpi_world_finalize has ended it, init fails. */
fr_comm_status fr_mpi_world_init(int *argc, char ***argv, fr_mpi_world **out);

/* Collective. Frees the world's communicators and ends MPI when init started
 * it; sets *w to NULL; NULL-safe. Destroy engine and NCCL groups first. */
void fr_mpi_world_finalize(fr_mpi_world **w);

/* A lost rank (killed, or stopped) would leave the others waiting in a
 * collective for ever. With ms > 0, bcast, all_ok, barrier and
 * gather_bytes wait at most ms for the other ranks, then fail with
 * FR_COMM_ETIMEOUT naming the wait; the ranks can then no longer agree,
 * so the caller ends the job (after telling its clients). */
void fr_mpi_world_set_timeout(fr_mpi_world *w, int ms);

/* Ends every process of the job with exit code `code` (MPI_Abort): for a
 * caller that decides an error is fatal to the whole job, typically when
 * ranks can no longer agree (a collective failed on some ranks only). */
void fr_mpi_world_abort(const fr_mpi_world *w, int code);

/* Collective. Sends `bytes` bytes of buf from world rank `root` to every
 * rank (weights, configuration); any size (pieces of 1 GiB on the wire). */
fr_comm_status fr_mpi_world_bcast(const fr_mpi_world *w, void *buf, size_t bytes, int root);

/* Collective. *all_ok = 1 when every rank passed ok != 0, else 0: the vote
 * behind all-or-nothing steps such as switching to new weights. */
fr_comm_status fr_mpi_world_all_ok(const fr_mpi_world *w, int ok, int *all_ok);

/* Collective. Concatenates every rank's `bytes` bytes of buf (each rank its
 * own size, 0 allowed) on world rank `root`, in world-rank order: there
 * *out receives a malloc'd buffer (free it; NULL when the total is 0),
 * *out_len the total, and counts (may be NULL; w->size entries) each rank's
 * size. On the other ranks *out is NULL, *out_len 0 and counts untouched.
 * Any size (pieces of 1 GiB on the wire). When the root cannot allocate,
 * every rank fails with FR_COMM_ENOMEM. */
fr_comm_status fr_mpi_world_gather_bytes(const fr_mpi_world *w, const void *buf, size_t bytes, int root,
                                         void **out, size_t *out_len, size_t *counts);

/* Collective. Waits until every rank has arrived. */
fr_comm_status fr_mpi_world_barrier(const fr_mpi_world *w);

/* "single", "funneled", "serialized" or "multiple". */
const char *fr_mpi_thread_level_name(int level);

#ifdef __cplusplus
}
#endif

#endif
