/* A trainer's NCCL weight group (comm/weight_group.h). */
#include "weight_group.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nccl.h>

#include "base/clock.h"
#include "dev_checksum.h"

_Static_assert(sizeof(ncclUniqueId) == FR_WEIGHT_GROUP_ID_BYTES, "the group's unique id is NCCL's");

struct fr_weight_group {
    ncclComm_t comm;
};

static fr_comm_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *what)
{
    const char *detail = comm ? ncclGetLastError(comm) : NULL;
    return fr_comm_fail(FR_COMM_ENCCL, "NCCL weight group: %s failed: %s%s%s", what, ncclGetErrorString(r),
                        detail && *detail ? ": " : "", detail ? detail : "");
}

fr_comm_status fr_weight_group_unique_id(unsigned char id[FR_WEIGHT_GROUP_ID_BYTES])
{
    if (!id) return fr_comm_fail(FR_COMM_EINVAL, "fr_weight_group_unique_id: NULL");
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) return nccl_fail(r, NULL, "ncclGetUniqueId");
    memcpy(id, &u, sizeof u);
    return FR_COMM_OK;
}

fr_comm_status fr_weight_group_join(const unsigned char id[FR_WEIGHT_GROUP_ID_BYTES], int nranks, int rank,
                                    fr_weight_group **out)
{
    if (!out) return fr_comm_fail(FR_COMM_EINVAL, "fr_weight_group_join: out is NULL");
    *out = NULL;
    if (!id || nranks < 2 || rank < 0 || rank >= nranks)
        return fr_comm_fail(FR_COMM_EINVAL, "fr_weight_group_join: rank %d of %d", rank, nranks);
    fr_weight_group *g = calloc(1, sizeof *g);
    if (!g) return fr_comm_fail(FR_COMM_ENOMEM, "NCCL weight group: out of memory");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;   /* joining must not hold up the caller's loop */
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclResult_t r = ncclCommInitRankConfig(&g->comm, nranks, u, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        free(g);
        return nccl_fail(r, NULL, "ncclCommInitRankConfig");
    }
    *out = g;
    return FR_COMM_OK;
}

fr_comm_status fr_weight_group_state(fr_weight_group *g, int *in_progress, const char *what)
{
    if (!g || !in_progress) return fr_comm_fail(FR_COMM_EINVAL, "fr_weight_group_state: NULL argument");
    ncclResult_t a = ncclInProgress;
    ncclResult_t q = ncclCommGetAsyncError(g->comm, &a);
    if (q != ncclSuccess) return nccl_fail(q, g->comm, "ncclCommGetAsyncError");
    *in_progress = a == ncclInProgress;
    if (a != ncclSuccess && a != ncclInProgress) return nccl_fail(a, g->comm, what);
    return FR_COMM_OK;
}

fr_comm_status fr_weight_group_wait(fr_weight_group *g, double deadline_ms, const char *what)
{
    for (;;) {
        int busy = 0;
        fr_comm_status cs = fr_weight_group_state(g, &busy, what);
        if (cs) return cs;
        if (!busy) return FR_COMM_OK;
        if (fr_now_ms() > deadline_ms)
            return fr_comm_fail(FR_COMM_ETIMEOUT, "NCCL weight group: %s did not finish in time", what);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

fr_comm_status fr_weight_group_bcast(fr_weight_group *g, void *buf, size_t bytes, cudaStream_t s, int *in_progress)
{
    if (!g || !in_progress) return fr_comm_fail(FR_COMM_EINVAL, "fr_weight_group_bcast: NULL argument");
    ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, 0, g->comm, s);
    *in_progress = r == ncclInProgress;
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(r, g->comm, "ncclBroadcast");
    return FR_COMM_OK;
}

void fr_weight_group_abort(fr_weight_group **pg)
{
    fr_weight_group *g = pg ? *pg : NULL;
    if (!g) return;
    if (g->comm) ncclCommAbort(g->comm);
    free(g);
    *pg = NULL;
}

void fr_dev_buckets_free(fr_dev_buckets *b)
{
    if (!b) return;
    for (int i = 0; i < 2; i++) {
        if (b->buf[i]) cudaFree(b->buf[i]);
        if (b->dig[i]) cudaFree(b->dig[i]);
        if (b->hdig[i]) cudaFreeHost(b->hdig[i]);
        b->buf[i] = NULL;
        b->dig[i] = b->hdig[i] = NULL;
    }
    b->bytes = 0;
}

fr_comm_status fr_dev_buckets_reserve(fr_dev_buckets *b, uint64_t bytes)
{
    if (!b || bytes < 1) return fr_comm_fail(FR_COMM_EINVAL, "fr_dev_buckets_reserve: no buckets of %llu bytes",
                                             (unsigned long long)bytes);
    if (b->buf[0] && b->bytes == bytes) return FR_COMM_OK;
    fr_dev_buckets_free(b);
    const size_t chunks = fr_dev_checksum_chunks((size_t)bytes);
    for (int i = 0; i < 2; i++) {
        cudaError_t e = cudaMalloc(&b->buf[i], (size_t)bytes);
        if (e == cudaSuccess) e = cudaMalloc((void **)&b->dig[i], chunks * sizeof(uint64_t));
        if (e == cudaSuccess) e = cudaMallocHost((void **)&b->hdig[i], chunks * sizeof(uint64_t));
        if (e != cudaSuccess) {
            fr_dev_buckets_free(b);
            return fr_comm_fail(e == cudaErrorMemoryAllocation ? FR_COMM_ENOMEM : FR_COMM_ECUDA,
                                "NCCL weight group: allocating the bucket buffers failed: %s", cudaGetErrorString(e));
        }
    }
    b->bytes = bytes;
    return FR_COMM_OK;
}
