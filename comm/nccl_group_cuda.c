#include "nccl_group.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nccl.h>

#include "comm_internal.h"

struct fr_nccl_group {
    ncclComm_t comm;
    int device;
    int tp_size;
};

/* What each rank reports before the communicator is made, so every rank can
 * fail alike and name the rank at fault. */
typedef struct {
    int ok;
    int device, device_count, local_size;
    char host[MPI_MAX_PROCESSOR_NAME];
    char err[256];
} rank_report;

/* The unique id, or the leader's failure to make one. */
typedef struct {
    int ok;
    ncclUniqueId id;
    char err[256];
} id_message;

static fr_comm_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *what)
{
    const char *detail = ncclGetLastError(comm);
    return fr_comm_fail(FR_COMM_ENCCL, "%s failed: %s%s%s", what, ncclGetErrorString(r),
                        detail && *detail ? ": " : "", detail ? detail : "");
}

/* Picks and selects this rank's device; on failure fills rep->err. */
static void pick_device(const fr_engine_group *g, rank_report *rep)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    rep->device = -1;
    rep->device_count = e == cudaSuccess ? n : 0;
    rep->local_size = g->world->local_size;
    if (e != cudaSuccess) {
        snprintf(rep->err, sizeof rep->err, "cudaGetDeviceCount failed: %s", cudaGetErrorString(e));
        return;
    }
    if (n < 1) {
        snprintf(rep->err, sizeof rep->err, "no CUDA device");
        return;
    }
    rep->device = g->world->local_rank % n;
    if ((e = cudaSetDevice(rep->device)) != cudaSuccess) {
        snprintf(rep->err, sizeof rep->err, "cudaSetDevice(%d) failed: %s", rep->device, cudaGetErrorString(e));
        return;
    }
    rep->ok = 1;
}

/* Gathers every rank's report and returns the first problem, the same on
 * every rank. */
static fr_comm_status agree_on_devices(const fr_engine_group *g, int *device)
{
    const int tp = g->layout.tp_size;
    rank_report mine;
    memset(&mine, 0, sizeof mine);
    pick_device(g, &mine);
    int len = 0;
    if (MPI_Get_processor_name(mine.host, &len) != MPI_SUCCESS) snprintf(mine.host, sizeof mine.host, "?");
    rank_report *all = calloc((size_t)tp, sizeof *all);
    if (!all) return fr_comm_fail(FR_COMM_ENOMEM, "fr_nccl_group_new: out of memory");
    int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, g->comm);
    if (rc != MPI_SUCCESS) {
        free(all);
        return fr_comm_mpi_fail(rc, "MPI_Allgather (device reports)");
    }
    fr_comm_status st = FR_COMM_OK;
    for (int t = 0; t < tp && !st; t++)
        if (!all[t].ok)
            st = fr_comm_fail(FR_COMM_ECUDA, "engine %d, tp rank %d (world rank %d, host %s): %s", g->layout.engine,
                              t, g->layout.leader + t, all[t].host, all[t].err);
    for (int a = 0; a < tp && !st; a++)
        for (int b = a + 1; b < tp && !st; b++)
            if (all[a].device == all[b].device && strcmp(all[a].host, all[b].host) == 0)
                st = fr_comm_fail(FR_COMM_ECUDA,
                                  "engine %d: tp ranks %d and %d would share GPU %d of host %s (%d ranks on the "
                                  "host, %d GPUs): start at most one rank per GPU",
                                  g->layout.engine, a, b, all[a].device, all[a].host, all[a].local_size,
                                  all[a].device_count);
    *device = mine.device;
    free(all);
    return st;
}

fr_comm_status fr_nccl_group_new(const fr_engine_group *g, fr_nccl_group **out)
{
    if (!out) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_group_new: out is NULL");
    *out = NULL;
    if (!g) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_group_new: engine group is NULL");
    int device = -1;
    fr_comm_status st = agree_on_devices(g, &device);
    if (st) return st;

    id_message msg;
    memset(&msg, 0, sizeof msg);
    if (g->is_leader) {
        ncclResult_t r = ncclGetUniqueId(&msg.id);
        msg.ok = r == ncclSuccess;
        if (!msg.ok) snprintf(msg.err, sizeof msg.err, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
    }
    FR_MPI_TRY(MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, 0, g->comm));
    if (!msg.ok) return fr_comm_fail(FR_COMM_ENCCL, "engine %d leader: %s", g->layout.engine, msg.err);

    fr_nccl_group *n = calloc(1, sizeof *n);
    if (!n) return fr_comm_fail(FR_COMM_ENOMEM, "fr_nccl_group_new: out of memory");
    n->device = device;
    n->tp_size = g->layout.tp_size;
    ncclResult_t r = ncclCommInitRank(&n->comm, g->layout.tp_size, msg.id, g->layout.tp_rank);
    if (r != ncclSuccess) {
        st = nccl_fail(r, NULL, "ncclCommInitRank");
        free(n);
        return st;
    }
    *out = n;
    return FR_COMM_OK;
}

void fr_nccl_group_destroy(fr_nccl_group **np)
{
    if (!np || !*np) return;
    fr_nccl_group *n = *np;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(n->comm, &async) != ncclSuccess || async != ncclSuccess)
        ncclCommAbort(n->comm);
    else
        ncclCommDestroy(n->comm);
    free(n);
    *np = NULL;
}

int fr_nccl_group_device(const fr_nccl_group *n) { return n ? n->device : -1; }

fr_comm_status fr_nccl_allreduce_sum(fr_nccl_group *n, void *buf, size_t count, fr_dtype t, cudaStream_t s)
{
    if (!n) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_allreduce_sum: group is NULL");
    if (count && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_allreduce_sum: buffer is NULL");
    ncclDataType_t dt;
    switch (t) {
    case FR_DTYPE_F32: dt = ncclFloat32; break;
    case FR_DTYPE_BF16: dt = ncclBfloat16; break;
    default: return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_allreduce_sum: unknown dtype %d", (int)t);
    }
    ncclResult_t r = ncclAllReduce(buf, buf, count, dt, ncclSum, n->comm, s);
    return r == ncclSuccess ? FR_COMM_OK : nccl_fail(r, n->comm, "ncclAllReduce");
}

fr_comm_status fr_nccl_allgather_f32(fr_nccl_group *n, const float *local, float *all, size_t count, cudaStream_t s)
{
    if (!n) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_allgather_f32: group is NULL");
    if (count && (!local || !all)) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_allgather_f32: buffer is NULL");
    ncclResult_t r = ncclAllGather(local, all, count, ncclFloat32, n->comm, s);
    return r == ncclSuccess ? FR_COMM_OK : nccl_fail(r, n->comm, "ncclAllGather");
}

fr_comm_status fr_nccl_bcast(fr_nccl_group *n, void *buf, size_t bytes, int root, cudaStream_t s)
{
    if (!n) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_bcast: group is NULL");
    if (bytes && !buf) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_bcast: buffer is NULL");
    if (root < 0 || root >= n->tp_size)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_bcast: root %d outside the engine's %d ranks", root,
                            n->tp_size);
    ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, n->comm, s);
    return r == ncclSuccess ? FR_COMM_OK : nccl_fail(r, n->comm, "ncclBroadcast");
}

fr_comm_status fr_nccl_group_check(fr_nccl_group *n)
{
    if (!n) return fr_comm_fail(FR_COMM_EINVAL, "fr_nccl_group_check: group is NULL");
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(n->comm, &async);
    if (r != ncclSuccess) return nccl_fail(r, n->comm, "ncclCommGetAsyncError");
    if (async != ncclSuccess) return nccl_fail(async, n->comm, "an NCCL operation in flight");
    return FR_COMM_OK;
}
