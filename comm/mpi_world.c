#include "mpi_world.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_internal.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

void fr_mpi_world_set_timeout(fr_mpi_world *w, int ms)
{
    if (w) w->timeout_ms = ms > 0 ? ms : 0;
}

/* Completes a non-blocking call started with rc: spins on MPI_Test (as a
 * blocking call would), napping once the wait is long, and gives up after
 * the world's timeout. A timed-out request is left behind: the job ends. */
static fr_comm_status finish(const fr_mpi_world *w, int rc, MPI_Request *req, const char *what)
{
    if (rc != MPI_SUCCESS) return fr_comm_mpi_fail(rc, what);
    const double t0 = now_ms();
    for (long spin = 0;; spin++) {
        int done = 0;
        rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return fr_comm_mpi_fail(rc, what);
        if (done) return FR_COMM_OK;
        if ((spin & 255) == 0 && spin > 0) {
            const double waited = now_ms() - t0;
            if (w->timeout_ms > 0 && waited > w->timeout_ms)
                return fr_comm_fail(FR_COMM_ETIMEOUT, "%s: another rank did not take part within %d ms (killed, "
                                                      "stopped or hung)", what, w->timeout_ms);
            if (waited > 2.0) {
                struct timespec nap = {0, 20000};
                nanosleep(&nap, NULL);
            }
        }
    }
}

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
        MPI_Request r;
        fr_comm_status st = finish(w, MPI_Ibcast((char *)buf + off, (int)n, MPI_BYTE, root, w->comm, &r), &r, "MPI_Bcast");
        if (st) return st;
    }
    return FR_COMM_OK;
}

fr_comm_status fr_mpi_world_all_ok(const fr_mpi_world *w, int ok, int *all_ok)
{
    if (!w || !all_ok) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_all_ok: world or result is NULL");
    int mine = ok != 0, all = 0;
    MPI_Request r;
    fr_comm_status st = finish(w, MPI_Iallreduce(&mine, &all, 1, MPI_INT, MPI_LAND, w->comm, &r), &r, "MPI_Allreduce");
    if (st) return st;
    *all_ok = all != 0;
    return FR_COMM_OK;
}

fr_comm_status fr_mpi_world_barrier(const fr_mpi_world *w)
{
    if (!w) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_barrier: world is NULL");
    MPI_Request r;
    return finish(w, MPI_Ibarrier(w->comm, &r), &r, "MPI_Barrier");
}

fr_comm_status fr_mpi_world_gather_bytes(const fr_mpi_world *w, const void *buf, size_t bytes, int root,
                                         void **out, size_t *out_len, size_t *counts)
{
    if (!w || !out || !out_len)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_gather_bytes: world or result is NULL");
    *out = NULL;
    *out_len = 0;
    if (root < 0 || root >= w->size)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_gather_bytes: root %d outside the world of %d ranks",
                            root, w->size);
    if (bytes && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_mpi_world_gather_bytes: buffer is NULL");
    const int is_root = w->rank == root;
    uint64_t mine = bytes, *sizes = NULL;
    if (is_root && !(sizes = malloc(sizeof *sizes * (size_t)w->size)))
        return fr_comm_fail(FR_COMM_ENOMEM, "fr_mpi_world_gather_bytes: out of memory");
    MPI_Request req;
    fr_comm_status gst = finish(w, MPI_Igather(&mine, 1, MPI_UINT64_T, sizes, 1, MPI_UINT64_T, root, w->comm, &req),
                                &req, "MPI_Gather");
    if (gst) {
        free(sizes);
        return gst;
    }
    /* The root allocates, then tells everyone whether it could, so that no
     * rank is left sending to a root that gave up. */
    char *all = NULL;
    size_t total = 0;
    int ok = 1;
    if (is_root) {
        for (int r = 0; r < w->size; r++) total += (size_t)sizes[r];
        if (total && !(all = malloc(total))) ok = 0;
    }
    gst = finish(w, MPI_Ibcast(&ok, 1, MPI_INT, root, w->comm, &req), &req, "MPI_Bcast");
    if (gst || !ok) {
        free(sizes);
        free(all);
        if (gst) return gst;
        return fr_comm_fail(FR_COMM_ENOMEM, "fr_mpi_world_gather_bytes: rank %d cannot hold %zu bytes", root,
                            total);
    }
    enum { TAG = 0x6762 };
    fr_comm_status st = FR_COMM_OK;
    if (!is_root) {
        for (size_t off = 0; !st && off < bytes; off += FR_COMM_MPI_CHUNK) {
            size_t n = bytes - off < FR_COMM_MPI_CHUNK ? bytes - off : FR_COMM_MPI_CHUNK;
            st = finish(w, MPI_Isend((const char *)buf + off, (int)n, MPI_BYTE, root, TAG, w->comm, &req), &req,
                        "MPI_Send");
        }
        return st;
    }
    size_t at = 0;
    for (int r = 0; r < w->size; r++) {
        size_t len = (size_t)sizes[r];
        if (r == root) {
            if (len) memcpy(all + at, buf, len);
        } else {
            for (size_t off = 0; !st && off < len; off += FR_COMM_MPI_CHUNK) {
                size_t n = len - off < FR_COMM_MPI_CHUNK ? len - off : FR_COMM_MPI_CHUNK;
                st = finish(w, MPI_Irecv(all + at + off, (int)n, MPI_BYTE, r, TAG, w->comm, &req), &req, "MPI_Recv");
            }
        }
        at += len;
    }
    if (!st && counts)
        for (int r = 0; r < w->size; r++) counts[r] = (size_t)sizes[r];
    free(sizes);
    if (st) {
        free(all);
        return st;
    }
    *out = all;
    *out_len = total;
    return FR_COMM_OK;
}
