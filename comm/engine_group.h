/* Engines: the world split into groups of tp ranks that serve one model
 * replica together (tensor parallelism), and the host collectives the CPU
 * backend moves activations and step plans with.
 *
 * World rank r belongs to engine r / tp as tp rank r % tp; tp rank 0 is the
 * engine's leader (it talks to the coordinator and sends each step's plan to
 * its followers). mpirun -np N makes N / tp engines; N must be a multiple of
 * tp. On the GPU backend, nccl_group.h builds an NCCL communicator on top of
 * an engine group.
 *
 * Collectives here are called by every rank of the engine, in the same order
 * and with the same sizes; a rank that skips one leaves the others waiting.
 * Argument checks fail on every rank alike when the arguments match. A
 * failure of MPI itself may strike some ranks only: the engine is then out of
 * step and the caller should end the job (fr_mpi_world_abort). */
#ifndef FR_ENGINE_GROUP_H
#define FR_ENGINE_GROUP_H

#include <stddef.h>

#include <mpi.h>

#include "comm_status.h"
#include "mpi_world.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a world rank sits: pure arithmetic, no MPI. */
typedef struct {
    int engine;      /* engine id: world rank / tp */
    int n_engines;   /* world size / tp */
    int tp_rank;     /* rank inside the engine: world rank % tp */
    int tp_size;     /* tp */
    int leader;      /* world rank of the engine's leader (tp rank 0) */
} fr_engine_layout;

/* FR_COMM_EINVAL when tp < 1, world_size < 1, world_rank outside the world,
 * or world_size not a multiple of tp. */
fr_comm_status fr_engine_layout_of(int world_rank, int world_size, int tp, fr_engine_layout *out);

/* Read-only once made. */
typedef struct {
    fr_engine_layout layout;
    int is_leader;              /* layout.tp_rank == 0 */
    const fr_mpi_world *world;  /* not owned; outlives the group */
    MPI_Comm comm;              /* the engine's ranks, ranked by tp rank */
} fr_engine_group;

/* Collective over the world: every rank calls it with the same tp. */
fr_comm_status fr_engine_group_new(const fr_mpi_world *w, int tp, fr_engine_group **out);
/* Collective over the world. Frees *g, sets it to NULL; NULL-safe. */
void fr_engine_group_destroy(fr_engine_group **g);

/* In place: buf[i] becomes the sum over the engine's ranks of their buf[i]
 * (float32, n elements, any n). The row-parallel matmul's partial sums. */
fr_comm_status fr_engine_allreduce_sum_f32(const fr_engine_group *g, float *buf, size_t n);

/* Gathers column shards: every rank holds local[rows][cols]; out[rows][tp *
 * cols] receives rank t's block at columns [t * cols, (t + 1) * cols). With
 * rows == 1 it is a plain concatenation in tp-rank order (e.g. logits of a
 * vocabulary shard). local and out must not overlap; rows * cols * tp must
 * fit an int. */
fr_comm_status fr_engine_allgather_f32(const fr_engine_group *g, const float *local, size_t rows, size_t cols,
                                       float *out);

/* Sends `bytes` bytes of buf from the leader to the engine's other ranks
 * (fixed-size data: every rank knows the size). */
fr_comm_status fr_engine_bcast(const fr_engine_group *g, void *buf, size_t bytes);

/* Sends a message of any size from the leader (a step plan): the leader's
 * (*buf, *len) travels; on the other ranks *buf is grown with realloc to
 * hold it (*cap tracks its size, so a buffer reused step after step rarely
 * grows) and *len receives its length. *buf may start NULL with *cap 0.
 * The caller frees *buf. */
fr_comm_status fr_engine_bcast_msg(const fr_engine_group *g, void **buf, size_t *len, size_t *cap);

#ifdef __cplusplus
}
#endif

#endif
