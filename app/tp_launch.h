/* Starting the ranks of a command-line job: MPI and the engine group, when
 * the job is tensor parallel (--tp > 1) or was launched under mpirun.
 *
 *     fr_tp_launch l;
 *     if (fr_tp_launch_open(eo.tp, &l)) { report fr_last_error(); }
 *     eo.group = l.group;             // NULL when tp == 1
 *     ... every rank runs the same steps; only l.output_rank writes ...
 *     fr_tp_launch_close(&l);
 *
 * With world size W and tp N, the ranks form W / N engines
 * (comm/engine_group.h). generate and score are one request, so every engine
 * runs it alike and world rank 0 (the leader of engine 0) alone prints or
 * writes the result; rollout splits its prompts across the engines (engine
 * e takes prompts i with i % n_engines == e) and gathers the results on
 * world rank 0. Without mpirun and with tp 1, MPI is not started. */
#ifndef FR_TP_LAUNCH_H
#define FR_TP_LAUNCH_H

#include <stdint.h>

#include "base/fr_status.h"
#include "comm/engine_group.h"
#include "comm/mpi_world.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    fr_mpi_world *world;        /* NULL when MPI was not started */
    fr_engine_group *group;     /* this rank's engine; NULL when tp == 1 */
    int world_rank, world_size; /* 0 and 1 without MPI */
    int output_rank;            /* 1 on the rank that prints and writes results */
    int engine, n_engines;      /* this rank's engine and the engine count (0 and 1 without MPI) */
    int engine_leader;          /* 1 on tp rank 0 of its engine (and without MPI) */
} fr_tp_launch;

/* 1 when the process was started by mpirun (OMPI_COMM_WORLD_SIZE is set). */
int fr_tp_under_mpirun(void);

/* Collective over the world when MPI starts. FR_EINVAL for tp < 1 or a world
 * size that is not a multiple of tp (the message names both), FR_EIO for MPI
 * failures; *l is then closed (MPI finalized). */
fr_status fr_tp_launch_open(int tp, fr_tp_launch *l);
/* Collective: world rank 0's *seed on every rank, so that ranks which each
 * drew their own fresh seed sample alike (a no-op without MPI). FR_EIO for
 * an MPI failure. */
fr_status fr_tp_launch_agree_seed(const fr_tp_launch *l, uint64_t *seed);
/* Collective. Destroys the group and finalizes MPI; NULL-safe, idempotent. */
void fr_tp_launch_close(fr_tp_launch *l);

#ifdef __cplusplus
}
#endif

#endif
