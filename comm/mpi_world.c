#include "mpi_world.h"

#include <stdlib.h>

#include "comm_internal.h"

fr_comm_status fr_comm_mpi_fail(int rc, const char *what)
{
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
    text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
    return fr_comm_fail(FR_COMM_EMPI, "%s failed: %s (MPI error %d)", what, len ? text : "no description", rc);
}

const char *fr_mpi_thread_level_name(int level)
{
    if (level == MPI_THREAD_SINGLE) return "single";
    if (level == MPI_THREAD_FUNNELED) return "funneled";
    if (level == MPI_THREAD_SERIALIZED) return "serialized";
    if (level == MPI_THREAD_MULTIPLE) return "multiple";
    return "unknown";
}

/* Everything after MPI is up: the world's own communicators and this
 * process's place. */
static fr_comm_status setup(fr_mpi_world *w)
{
    FR_MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &w->comm));
    FR_MPI_TRY(MPI_Comm_set_errhandler(w->comm, MPI_ERRORS_RETURN));
    FR_MPI_TRY(MPI_Comm_rank(w->comm, &w->rank));
    FR_MPI_TRY(MPI_Comm_size(w->comm, &w->size));
    FR_MPI_TRY(MPI_Comm_split_type(w->comm, MPI_COMM_TYPE_SHARED, w->rank, MPI_INFO_NULL, &w->local));
    FR_MPI_TRY(MPI_Comm_set_errhandler(w->local, MPI_ERRORS_RETURN));
    FR_MPI_TRY(MPI_Comm_rank(w->local, &w->local_rank));
    FR_MPI_TRY(MPI_Comm_size(w->local, &w->local_size));
    return FR_COMM_OK;
}

fr_comm_status fr_mpi_world_init(int *argc, char ***argv, fr_mpi_world **out)
{
    if (!out) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_init: out is NULL");
    *out = NULL;
    int started = 0, ended = 0;
    MPI_Initialized(&started);
    MPI_Finalized(&ended);
    if (ended)
        return fr_comm_fail(FR_COMM_EUNSUPPORTED,
                            "MPI was already finalized in this process and cannot start again");
    fr_mpi_world *w = calloc(1, sizeof *w);
    if (!w) return fr_comm_fail(FR_COMM_ENOMEM, "fr_mpi_world_init: out of memory");
    w->comm = MPI_COMM_NULL;
    w->local = MPI_COMM_NULL;
    int provided = MPI_THREAD_SINGLE;
    fr_comm_status st = FR_COMM_OK;
    if (!started) {
        int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) {
            free(w);
            return fr_comm_mpi_fail(rc, "MPI_Init_thread");
        }
        w->owns_mpi = 1;
        /* Errors of calls tied to no communicator are raised on the world. */
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    } else {
        MPI_Query_thread(&provided);
    }
    w->thread_level = provided;
    if (provided < MPI_THREAD_FUNNELED)
        st = fr_comm_fail(FR_COMM_EUNSUPPORTED,
                          "MPI provides thread level '%s'; fp4rollout needs at least 'funneled'",
                          fr_mpi_thread_level_name(provided));
    if (!st) st = setup(w);
    if (st) {
        fr_mpi_world_finalize(&w);
        return st;
    }
    *out = w;
    return FR_COMM_OK;
}

void fr_mpi_world_finalize(fr_mpi_world **wp)
{
    if (!wp || !*wp) return;
    fr_mpi_world *w = *wp;
    int ended = 0;
    MPI_Finalized(&ended);
    if (!ended) {
        if (w->local != MPI_COMM_NULL) MPI_Comm_free(&w->local);
        if (w->comm != MPI_COMM_NULL) MPI_Comm_free(&w->comm);
        if (w->owns_mpi) MPI_Finalize();
    }
    free(w);
    *wp = NULL;
}

void fr_mpi_world_abort(const fr_mpi_world *w, int code)
{
    MPI_Abort(w && w->comm != MPI_COMM_NULL ? w->comm : MPI_COMM_WORLD, code);
}

fr_comm_status fr_mpi_world_bcast(const fr_mpi_world *w, void *buf, size_t bytes, int root)
{
    if (!w) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_bcast: world is NULL");
    if (root < 0 || root >= w->size)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_bcast: root %d outside the world of %d ranks", root,
                            w->size);
    if (bytes && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_bcast: buffer is NULL");
    for (size_t off = 0; off < bytes; off += FR_COMM_MPI_CHUNK) {
        size_t n = bytes - off < FR_COMM_MPI_CHUNK ? bytes - off : FR_COMM_MPI_CHUNK;
        FR_MPI_TRY(MPI_Bcast((char *)buf + off, (int)n, MPI_BYTE, root, w->comm));
    }
    return FR_COMM_OK;
}

fr_comm_status fr_mpi_world_all_ok(const fr_mpi_world *w, int ok, int *all_ok)
{
    if (!w || !all_ok) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_all_ok: world or result is NULL");
    int mine = ok != 0, all = 0;
    FR_MPI_TRY(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_LAND, w->comm));
    *all_ok = all != 0;
    return FR_COMM_OK;
}

fr_comm_status fr_mpi_world_barrier(const fr_mpi_world *w)
{
    if (!w) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_barrier: world is NULL");
    FR_MPI_TRY(MPI_Barrier(w->comm));
    return FR_COMM_OK;
}
