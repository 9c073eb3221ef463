#include "engine_group.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "comm_internal.h"

fr_comm_status fr_engine_layout_of(int world_rank, int world_size, int tp, fr_engine_layout *out)
{
    if (!out) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_layout_of: out is NULL");
    if (tp < 1) return fr_comm_fail(FR_COMM_EINVAL, "tp (tensor-parallel size) is %d; it must be at least 1", tp);
    if (world_size < 1) return fr_comm_fail(FR_COMM_EINVAL, "world size %d must be at least 1", world_size);
    if (world_rank < 0 || world_rank >= world_size)
        return fr_comm_fail(FR_COMM_EINVAL, "rank %d is outside a world of %d ranks", world_rank, world_size);
    if (world_size % tp != 0)
        return fr_comm_fail(FR_COMM_EINVAL,
                            "%d ranks cannot form engines of tp %d: the number of ranks (mpirun -np) must be "
                            "a multiple of tp",
                            world_size, tp);
    *out = (fr_engine_layout){.engine = world_rank / tp,
                              .n_engines = world_size / tp,
                              .tp_rank = world_rank % tp,
                              .tp_size = tp,
                              .leader = world_rank / tp * tp};
    return FR_COMM_OK;
}

fr_comm_status fr_engine_group_new(const fr_mpi_world *w, int tp, fr_engine_group **out)
{
    if (!out) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_group_new: out is NULL");
    *out = NULL;
    if (!w) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_group_new: world is NULL");
    fr_engine_layout lay;
    fr_comm_status st = fr_engine_layout_of(w->rank, w->size, tp, &lay);
    if (st) return st;
    fr_engine_group *g = calloc(1, sizeof *g);
    if (!g) return fr_comm_fail(FR_COMM_ENOMEM, "fr_engine_group_new: out of memory");
    g->layout = lay;
    g->is_leader = lay.tp_rank == 0;
    g->world = w;
    int rc = MPI_Comm_split(w->comm, lay.engine, lay.tp_rank, &g->comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        st = fr_comm_mpi_fail(rc, "MPI_Comm_split (engine communicator)");
        if (g->comm != MPI_COMM_NULL) MPI_Comm_free(&g->comm);
        free(g);
        return st;
    }
    *out = g;
    return FR_COMM_OK;
}

void fr_engine_group_destroy(fr_engine_group **gp)
{
    if (!gp || !*gp) return;
    int ended = 0;
    MPI_Finalized(&ended);
    if (!ended && (*gp)->comm != MPI_COMM_NULL) MPI_Comm_free(&(*gp)->comm);
    free(*gp);
    *gp = NULL;
}

fr_comm_status fr_engine_allreduce_sum_f32(const fr_engine_group *g, float *buf, size_t n)
{
    if (!g) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_allreduce_sum_f32: group is NULL");
    if (n && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_allreduce_sum_f32: buffer is NULL");
    for (size_t off = 0; off < n; off += FR_COMM_MPI_CHUNK) {
        size_t k = n - off < FR_COMM_MPI_CHUNK ? n - off : FR_COMM_MPI_CHUNK;
        FR_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, buf + off, (int)k, MPI_FLOAT, MPI_SUM, g->comm));
    }
    return FR_COMM_OK;
}

fr_comm_status fr_engine_allgather_f32(const fr_engine_group *g, const float *local, size_t rows, size_t cols,
                                       float *out)
{
    if (!g) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_allgather_f32: group is NULL");
    const size_t tp = (size_t)g->layout.tp_size;
    if (rows == 0 || cols == 0) return FR_COMM_OK;
    if (!local || !out) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_allgather_f32: buffer is NULL");
    if (rows > INT_MAX / cols || rows * cols > INT_MAX / tp)
        return fr_comm_fail(FR_COMM_EINVAL,
                            "fr_engine_allgather_f32: %zu x %zu floats per rank times tp %zu exceeds one MPI call",
                            rows, cols, tp);
    if ((const char *)local < (const char *)(out + rows * cols * tp) &&
        (const char *)out < (const char *)(local + rows * cols))
        return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_allgather_f32: local and out overlap");
    if (rows == 1) {
        FR_MPI_TRY(MPI_Allgather(local, (int)cols, MPI_FLOAT, out, (int)cols, MPI_FLOAT, g->comm));
        return FR_COMM_OK;
    }
    /* One rank's block in out: rows runs of cols floats, tp * cols apart,
     * resized so that rank t's block starts t * cols floats in. */
    MPI_Datatype strided = MPI_DATATYPE_NULL, block = MPI_DATATYPE_NULL;
    int rc = MPI_Type_vector((int)rows, (int)cols, (int)(cols * tp), MPI_FLOAT, &strided);
    if (rc == MPI_SUCCESS)
        rc = MPI_Type_create_resized(strided, 0, (MPI_Aint)(cols * sizeof(float)), &block);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&block);
    const char *what = "MPI_Type_vector/create_resized/commit (column block)";
    if (rc == MPI_SUCCESS) {
        rc = MPI_Allgather(local, (int)(rows * cols), MPI_FLOAT, out, 1, block, g->comm);
        what = "MPI_Allgather";
    }
    if (block != MPI_DATATYPE_NULL) MPI_Type_free(&block);
    if (strided != MPI_DATATYPE_NULL) MPI_Type_free(&strided);
    return rc == MPI_SUCCESS ? FR_COMM_OK : fr_comm_mpi_fail(rc, what);
}

/* bytes from the leader in int-sized pieces. */
static fr_comm_status bcast_bytes(const fr_engine_group *g, void *buf, size_t bytes)
{
    for (size_t off = 0; off < bytes; off += FR_COMM_MPI_CHUNK) {
        size_t k = bytes - off < FR_COMM_MPI_CHUNK ? bytes - off : FR_COMM_MPI_CHUNK;
        FR_MPI_TRY(MPI_Bcast((char *)buf + off, (int)k, MPI_BYTE, 0, g->comm));
    }
    return FR_COMM_OK;
}

fr_comm_status fr_engine_bcast(const fr_engine_group *g, void *buf, size_t bytes)
{
    if (!g) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_bcast: group is NULL");
    if (bytes && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_bcast: buffer is NULL");
    return bcast_bytes(g, buf, bytes);
}

fr_comm_status fr_engine_bcast_msg(const fr_engine_group *g, void **buf, size_t *len, size_t *cap)
{
    if (!g || !buf || !len || !cap)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_bcast_msg: group, buffer, length or capacity is NULL");
    if (g->is_leader && *len && !*buf)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_bcast_msg: the leader's message is NULL");
    uint64_t n = g->is_leader ? (uint64_t)*len : 0;
    FR_MPI_TRY(MPI_Bcast(&n, 1, MPI_UINT64_T, 0, g->comm));
    if (!g->is_leader) {
        if (n > SIZE_MAX)
            return fr_comm_fail(FR_COMM_EINVAL, "fr_engine_bcast_msg: a message of %llu bytes",
                                (unsigned long long)n);
        if (n > *cap || !*buf) {
            size_t want = n > 0 ? (size_t)n : 1;
            void *p = realloc(*buf, want);
            if (!p)
                return fr_comm_fail(FR_COMM_ENOMEM,
                                    "fr_engine_bcast_msg: no memory for a message of %zu bytes from the leader "
                                    "(the engine is now out of step)",
                                    want);
            *buf = p;
            *cap = want;
        }
        *len = (size_t)n;
    }
    return bcast_bytes(g, *buf, (size_t)n);
}
