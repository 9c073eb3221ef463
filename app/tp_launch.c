#include "app/tp_launch.h"

#include <stdlib.h>
#include <string.h>

int fr_tp_under_mpirun(void)
{
    const char *w = getenv("OMPI_COMM_WORLD_SIZE");
    return w && *w;
}

fr_status fr_tp_launch_open(int tp, fr_tp_launch *l)
{
    memset(l, 0, sizeof *l);
    l->world_size = 1;
    l->output_rank = 1;
    l->n_engines = 1;
    l->engine_leader = 1;
    if (tp < 1) return fr_fail(FR_EINVAL, "--tp %d must be >= 1", tp);
    if (tp == 1 && !fr_tp_under_mpirun()) return FR_OK;
    if (fr_mpi_world_init(NULL, NULL, &l->world)) return fr_fail(FR_EIO, "%s", fr_last_error());
    l->world_rank = l->world->rank;
    l->world_size = l->world->size;
    l->output_rank = l->world_rank == 0;
    l->engine = l->world_rank / tp;
    l->n_engines = l->world_size / tp;
    l->engine_leader = l->world_rank % tp == 0;
    fr_status st = FR_OK;
    if (l->world_size % tp)
        st = fr_fail(FR_EINVAL, "--tp %d: the %d rank(s) of this job do not form engines of %d ranks "
                                "(run mpirun -np with a multiple of %d)", tp, l->world_size, tp, tp);
    else if (tp > 1 && fr_engine_group_new(l->world, tp, &l->group))
        st = fr_fail(FR_EIO, "%s", fr_last_error());
    if (st) fr_tp_launch_close(l);
    return st;
}

fr_status fr_tp_launch_agree_seed(const fr_tp_launch *l, uint64_t *seed)
{
    if (!l || !seed) return fr_fail(FR_EINVAL, "agreeing on a seed needs the launch and the seed");
    if (!l->world) return FR_OK;
    if (fr_mpi_world_bcast(l->world, seed, sizeof *seed, 0))
        return fr_fail(FR_EIO, "broadcasting the sampling seed: %s", fr_last_error());
    return FR_OK;
}

void fr_tp_launch_close(fr_tp_launch *l)
{
    if (!l) return;
    fr_engine_group_destroy(&l->group);
    fr_mpi_world_finalize(&l->world);
}
