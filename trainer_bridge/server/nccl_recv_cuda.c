/* The server's side of weights over NCCL (trainer_bridge/server/nccl_recv.h).
 *
 * The buckets are unpacked into the engine's device stage of the update
 * (rollout/engine/weight_update.h), the same stage ZeroMQ buckets go to, and
 * recorded there once checked; the commit is the engine's.
 *
 * Two bucket buffers, two streams: bucket k is received into buffer k % 2
 * on the receive stream, then checksummed and unpacked on the unpack
 * stream, which overlaps the receive of bucket k + 1. Events order the
 * reuse of a buffer: its next receive waits for its last unpack. The host
 * reads each bucket's chunk digests and bad-value flag (pinned memory)
 * when its unpack event has completed, never blocking. */
#include "trainer_bridge/server/nccl_recv.h"

#include "base/clock.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm/dev_checksum.h"
#include "rollout/engine/wsync_rank.h"
#include "rollout/model/weights_unpack.h"
#include "trainer_bridge/server/update.h"

_Static_assert(sizeof(ncclUniqueId) == FR_PROTO_NCCL_ID_BYTES, "the protocol's unique id is NCCL's");

/* A tensor the begin declared, and how much of it arrived (its pieces come
 * in order, so one count is its received range). */
typedef struct {
    fr_msg_tensor t;
    int table;            /* the tensor's index in the update */
    uint64_t bytes, received;
} declared;

/* A bucket in one of the two buffers, from its receive until the host has
 * checked it. */
typedef struct {
    int busy;
    int bucket;
    uint64_t nbytes, checksum;
    size_t n_chunks;
    fr_msg_piece *pieces;  /* owned: names for messages */
    int n_pieces;
    fr_wsync_piece *wp;    /* owned, shard stages: the same pieces for the rank logic */
} slot;

struct fr_nccl_recv {
    ncclComm_t comm;
    int nranks, rank;
    int joined;
    /* a tensor-parallel rank (fr_nccl_recv_set_shard): the rank logic that
     * cuts its part of each piece, and the BF16 scratch pieces go through */
    fr_wsync_rank *ws;
    void *scratch;
    uint64_t scratch_bytes;
    double timeout_ms, last_progress_ms;
    cudaStream_t rs, us;               /* receive, unpack */
    void *buf[2];
    uint64_t buf_bytes;
    uint64_t *dig[2], *hdig[2];        /* chunk digests: device, pinned host */
    unsigned long long *dbad[2], *hbad[2];
    cudaEvent_t unpacked[2];
    slot sl[2];
    int oldest;                        /* the slot to check first */
    /* buckets announced while both buffers were busy, in order (owned) */
    fr_msg_nccl_bucket *waiting;
    int n_waiting, cap_waiting;
    /* the update */
    int updating;
    fr_weight_update *u;               /* the engine's stage (borrowed) */
    uint64_t version, bucket_bytes, staged;
    declared *d;
    int n_d;
    int next_bucket;                   /* the next bucket number a message may carry */
};

static fr_status fail(const char **code, const char *c, fr_status st)
{
    if (code) *code = c;
    return st;
}

#define FAIL(c, st, ...) fail(code, c, fr_fail(st, __VA_ARGS__))

static fr_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *what)
{
    const char *detail = comm ? ncclGetLastError(comm) : NULL;
    return fr_fail(FR_EIO, "NCCL weight group: %s failed: %s%s%s", what, ncclGetErrorString(r),
                   detail && *detail ? ": " : "", detail ? detail : "");
}

static fr_status cuda_fail(cudaError_t e, const char *what)
{
    return fr_fail(e == cudaErrorMemoryAllocation ? FR_ENOMEM : FR_EINTERNAL, "NCCL weight group: %s failed: %s",
                   what, cudaGetErrorString(e));
}

fr_status fr_nccl_recv_new(const unsigned char unique_id[FR_PROTO_NCCL_ID_BYTES], int nranks, int rank,
                           int timeout_ms, fr_nccl_recv **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_nccl_recv_new: out is NULL");
    *out = NULL;
    if (!unique_id) return fr_fail(FR_EINVAL, "fr_nccl_recv_new: NULL argument");
    if (nranks < 2 || rank < 1 || rank >= nranks)
        return fr_fail(FR_EINVAL, "fr_nccl_recv_new: rank %d of %d (the trainer is rank 0)", rank, nranks);
    fr_nccl_recv *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "NCCL weight group: out of memory");
    r->nranks = nranks;
    r->rank = rank;
    r->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
    fr_status st = FR_OK;
    cudaError_t e = cudaSuccess;
    if ((e = cudaStreamCreateWithFlags(&r->rs, cudaStreamNonBlocking)) == cudaSuccess &&
        (e = cudaStreamCreateWithFlags(&r->us, cudaStreamNonBlocking)) == cudaSuccess)
        for (int i = 0; i < 2 && e == cudaSuccess; i++) {
            e = cudaEventCreateWithFlags(&r->unpacked[i], cudaEventDisableTiming);
            if (e == cudaSuccess) e = cudaMallocHost((void **)&r->hbad[i], sizeof *r->hbad[i]);
            if (e == cudaSuccess) e = cudaMalloc((void **)&r->dbad[i], sizeof *r->dbad[i]);
        }
    if (!st && e != cudaSuccess) st = cuda_fail(e, "making streams and events");
    if (!st) {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;   /* joining must not hold up the serve loop */
        ncclUniqueId id;
        memcpy(&id, unique_id, sizeof id);
        ncclResult_t nr = ncclCommInitRankConfig(&r->comm, nranks, id, rank, &config);
        if (nr != ncclSuccess && nr != ncclInProgress) {
            st = nccl_fail(nr, NULL, "ncclCommInitRankConfig");
            r->comm = NULL;
        }
    }
    if (st) {
        fr_nccl_recv_destroy(&r);
        return st;
    }
    r->last_progress_ms = fr_now_ms();
    *out = r;
    return FR_OK;
}

static void free_slot(slot *s)
{
    free(s->pieces);
    free(s->wp);
    memset(s, 0, sizeof *s);
}

static void clear_update(fr_nccl_recv *r)
{
    r->updating = 0;
    r->u = NULL;
    free(r->d);
    r->d = NULL;
    r->n_d = 0;
    r->staged = 0;
    r->next_bucket = 0;
    for (int i = 0; i < r->n_waiting; i++) free(r->waiting[i].pieces);
    r->n_waiting = 0;
}

fr_status fr_nccl_recv_set_shard(fr_nccl_recv *r, const fr_model_config *cfg, int tp_rank, int tp_size)
{
    if (!r || !cfg) return fr_fail(FR_EINVAL, "fr_nccl_recv_set_shard: NULL argument");
    fr_wsync_rank_destroy(&r->ws);
    if (tp_size <= 1) return FR_OK;
    return fr_wsync_rank_new(cfg, tp_rank, tp_size, 0, &r->ws);
}

void fr_nccl_recv_destroy(fr_nccl_recv **pr)
{
    fr_nccl_recv *r = pr ? *pr : NULL;
    if (!r) return;
    /* Abort first: it ends any receive still waiting for a trainer that
     * will never send, so the streams can drain. */
    if (r->comm) ncclCommAbort(r->comm);
    if (r->rs) cudaStreamSynchronize(r->rs);
    if (r->us) cudaStreamSynchronize(r->us);
    clear_update(r);
    free(r->waiting);
    fr_wsync_rank_destroy(&r->ws);
    if (r->scratch) cudaFree(r->scratch);
    for (int i = 0; i < 2; i++) {
        free_slot(&r->sl[i]);
        if (r->buf[i]) cudaFree(r->buf[i]);
        if (r->dig[i]) cudaFree(r->dig[i]);
        if (r->hdig[i]) cudaFreeHost(r->hdig[i]);
        if (r->dbad[i]) cudaFree(r->dbad[i]);
        if (r->hbad[i]) cudaFreeHost(r->hbad[i]);
        if (r->unpacked[i]) cudaEventDestroy(r->unpacked[i]);
    }
    if (r->rs) cudaStreamDestroy(r->rs);
    if (r->us) cudaStreamDestroy(r->us);
    free(r);
    *pr = NULL;
}

int fr_nccl_recv_joined(const fr_nccl_recv *r) { return r && r->joined; }

fr_status fr_nccl_recv_wait_joined(fr_nccl_recv *r)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_nccl_recv_wait_joined: NULL");
    const double until = fr_now_ms() + r->timeout_ms;
    while (!r->joined) {
        ncclResult_t a = ncclInProgress;
        ncclResult_t q = ncclCommGetAsyncError(r->comm, &a);
        if (q != ncclSuccess) return nccl_fail(q, r->comm, "ncclCommGetAsyncError");
        if (a == ncclSuccess) {
            r->joined = 1;
            r->last_progress_ms = fr_now_ms();
        } else if (a != ncclInProgress) {
            return nccl_fail(a, r->comm, "joining the group");
        } else if (fr_now_ms() > until) {
            return fr_fail(FR_EIO, "NCCL weight group: this rank did not finish joining within %.0f s",
                           r->timeout_ms / 1e3);
        }
    }
    return FR_OK;
}
int fr_nccl_recv_updating(const fr_nccl_recv *r) { return r && r->updating; }
uint64_t fr_nccl_recv_version(const fr_nccl_recv *r) { return r && r->updating ? r->version : 0; }
uint64_t fr_nccl_recv_bytes(const fr_nccl_recv *r) { return r ? r->staged : 0; }
int fr_nccl_recv_busy(const fr_nccl_recv *r) { return r && (r->sl[0].busy || r->sl[1].busy || r->n_waiting > 0); }

/* Bucket buffers of the begin's bucket_bytes (kept while that size is). */
static fr_status ensure_buffers(fr_nccl_recv *r, uint64_t bytes)
{
    if (r->buf[0] && r->buf_bytes == bytes) return FR_OK;
    for (int i = 0; i < 2; i++) {
        if (r->buf[i]) cudaFree(r->buf[i]);
        if (r->dig[i]) cudaFree(r->dig[i]);
        if (r->hdig[i]) cudaFreeHost(r->hdig[i]);
        r->buf[i] = NULL;
        r->dig[i] = r->hdig[i] = NULL;
    }
    r->buf_bytes = 0;
    const size_t chunks = fr_dev_checksum_chunks((size_t)bytes);
    for (int i = 0; i < 2; i++) {
        cudaError_t e = cudaMalloc(&r->buf[i], (size_t)bytes);
        if (e == cudaSuccess) e = cudaMalloc((void **)&r->dig[i], chunks * sizeof(uint64_t));
        if (e == cudaSuccess) e = cudaMallocHost((void **)&r->hdig[i], chunks * sizeof(uint64_t));
        if (e != cudaSuccess) return cuda_fail(e, "allocating the bucket buffers");
    }
    r->buf_bytes = bytes;
    return FR_OK;
}

/* A shard rank's scratch: each piece is converted to BF16 there (at its
 * byte offset in the bucket: BF16 never takes more room than the piece),
 * then the rank's blocks are copied into the stage. */
static fr_status ensure_scratch(fr_nccl_recv *r, uint64_t bytes)
{
    if (!r->ws || (r->scratch && r->scratch_bytes == bytes)) return FR_OK;
    if (r->scratch) cudaFree(r->scratch);
    r->scratch = NULL;
    r->scratch_bytes = 0;
    cudaError_t e = cudaMalloc(&r->scratch, (size_t)bytes);
    if (e != cudaSuccess) return cuda_fail(e, "allocating the unpacking scratch");
    r->scratch_bytes = bytes;
    return FR_OK;
}

/* The rank logic's view of the declared tensors. */
static fr_status begin_shard(fr_nccl_recv *r, const fr_msg_update_begin *b, const fr_weight_update *staged,
                             const char **code)
{
    if (!r->ws) return FR_OK;
    if (!fr_weight_update_is_shard(staged))
        return FAIL("update_failed", FR_EINTERNAL, "NCCL weight group: a tensor-parallel rank needs a shard stage");
    fr_wsync_tensor *t = calloc((size_t)b->n_tensors, sizeof *t);
    if (!t) return FAIL("out_of_memory", FR_ENOMEM, "NCCL weight group: out of memory");
    for (int i = 0; i < b->n_tensors; i++)
        t[i] = (fr_wsync_tensor){.name = b->tensors[i].name, .dtype = b->tensors[i].dtype,
                                 .rows = b->tensors[i].shape[0],
                                 .cols = b->tensors[i].ndim == 2 ? b->tensors[i].shape[1] : 0};
    fr_status st = fr_wsync_rank_begin(r->ws, b->version, t, b->n_tensors, b->bucket_bytes, b->partial);
    free(t);
    return st ? fail(code, "bad_shape", st) : FR_OK;
}

static declared *find_declared(fr_nccl_recv *r, const char *name)
{
    for (int i = 0; i < r->n_d; i++)
        if (strcmp(r->d[i].t.name, name) == 0) return &r->d[i];
    return NULL;
}

fr_status fr_nccl_recv_begin(fr_nccl_recv *r, const fr_msg_update_begin *b, fr_weight_update *staged,
                             const char **code)
{
    if (code) *code = "bad_message";
    if (!r || !b || b->n_tensors < 1 || !b->tensors || !staged)
        return fr_fail(FR_EINVAL, "fr_nccl_recv_begin: bad argument");
    if (!fr_weight_update_on_device(staged))
        return FAIL("nccl_unavailable", FR_EINVAL, "update to version %llu: weights over NCCL need a device stage",
                    (unsigned long long)b->version);
    if (!r->joined) {   /* the trainer's side returns once joined; this side may not have polled yet */
        ncclResult_t a = ncclInProgress;
        if (ncclCommGetAsyncError(r->comm, &a) == ncclSuccess && a == ncclSuccess) r->joined = 1;
    }
    if (!r->joined)
        return FAIL("nccl_unavailable", FR_EINVAL, "update to version %llu: the NCCL group is still joining (every "
                    "member must have called its init)", (unsigned long long)b->version);
    if (fr_nccl_recv_busy(r))
        return FAIL("update_state", FR_EINVAL, "update to version %llu: buckets of the previous update are still "
                    "in flight", (unsigned long long)b->version);
    clear_update(r);
    declared *d = calloc((size_t)b->n_tensors, sizeof *d);
    if (!d) return FAIL("out_of_memory", FR_ENOMEM, "NCCL weight group: out of memory");
    for (int i = 0; i < b->n_tensors; i++) {
        const fr_msg_tensor *t = &b->tensors[i];
        const int k = fr_weight_update_find(staged, t->name);
        const char *name;
        int ndim = 0;
        int64_t shape[2] = {0, 0};
        if (k < 0 || fr_weight_update_tensor(staged, k, &name, &ndim, shape)) {
            free(d);
            return FAIL("unknown_tensor", FR_EINVAL, "update to version %llu: \"%s\" is not a weight of this model",
                        (unsigned long long)b->version, t->name);
        }
        fr_status sst = fr_bridge_check_model_shape(t, ndim, shape, b->version, code);
        if (sst) {
            free(d);
            return sst;
        }
        d[i] = (declared){.t = *t, .table = k, .bytes = fr_msg_tensor_bytes(t)};
    }
    fr_status st = ensure_buffers(r, b->bucket_bytes);
    if (!st) st = ensure_scratch(r, b->bucket_bytes);
    if (!st && (st = begin_shard(r, b, staged, code))) {
        free(d);
        return st;
    }
    if (!st) st = fr_weight_update_restart(staged, b->version);
    if (!st) st = fr_weight_update_set_partial(staged, b->partial);
    if (st) {
        free(d);
        return fail(code, st == FR_ENOMEM ? "out_of_memory" : "update_failed", st);
    }
    r->d = d;
    r->n_d = b->n_tensors;
    r->oldest = 0;
    r->version = b->version;
    r->bucket_bytes = b->bucket_bytes;
    r->updating = 1;
    r->u = staged;
    return FR_OK;
}

/* Every check of a bucket that needs no device: in order, within the
 * buffer, declared tensors, each tensor's pieces contiguous and in order.
 * Counts the pieces as received. */
static fr_status check_bucket(fr_nccl_recv *r, const fr_msg_nccl_bucket *b, const char **code)
{
    const unsigned long long ver = (unsigned long long)r->version;
    if (!r->updating)
        return FAIL("update_state", FR_EINVAL, "update_weights_nccl_bucket for version %llu: no NCCL weight update "
                    "is in progress", (unsigned long long)b->version);
    if (b->version != r->version)
        return FAIL("update_state", FR_EINVAL, "update_weights_nccl_bucket: version %llu, but the update in "
                    "progress is to version %llu", (unsigned long long)b->version, ver);
    if (b->bucket != r->next_bucket)
        return FAIL("update_state", FR_EINVAL, "update to version %llu: bucket %d arrived, expected bucket %d", ver,
                    b->bucket, r->next_bucket);
    if (b->nbytes > r->bucket_bytes)
        return FAIL("bad_bucket", FR_EINVAL, "update to version %llu: bucket %d holds %llu bytes, more than the "
                    "bucket_bytes %llu of the begin", ver, b->bucket, (unsigned long long)b->nbytes,
                    (unsigned long long)r->bucket_bytes);
    for (int i = 0; i < b->n_pieces; i++) {
        const fr_msg_piece *p = &b->pieces[i];
        declared *d = find_declared(r, p->t.name);
        if (!d)
            return FAIL("unknown_tensor", FR_EINVAL, "update to version %llu: bucket %d: \"%s\" was not listed in "
                        "the begin", ver, b->bucket, p->t.name);
        fr_status st = fr_bridge_check_piece(&p->t, &d->t, r->version, b->bucket, code);
        if (st) return st;
        if (p->offset != d->received)
            return FAIL("bad_piece", FR_EINVAL, "update to version %llu: bucket %d: the piece of \"%s\" starts at "
                        "byte %llu; its pieces must come in order, and %llu bytes of it arrived so far", ver,
                        b->bucket, p->t.name, (unsigned long long)p->offset, (unsigned long long)d->received);
        d->received += p->nbytes;
    }
    return FR_OK;
}

/* The rank logic's view of bucket b (pieces by declared index). */
static fr_wsync_bucket wsync_bucket(const fr_nccl_recv *r, const fr_msg_nccl_bucket *b, fr_wsync_piece *wp)
{
    for (int k = 0; k < b->n_pieces; k++) {
        const fr_msg_piece *p = &b->pieces[k];
        wp[k] = (fr_wsync_piece){.tensor = (int)(find_declared((fr_nccl_recv *)r, p->t.name) - r->d),
                                 .offset = p->offset, .nbytes = p->nbytes, .at = p->at};
    }
    return (fr_wsync_bucket){.bucket = b->bucket, .nbytes = b->nbytes, .checksum = b->checksum, .pieces = wp,
                             .n_pieces = b->n_pieces};
}

typedef struct {
    fr_nccl_recv *r;
    cudaStream_t s;
} block_ctx;

/* One block of a piece, already BF16 in the scratch, into the shard stage. */
static fr_status copy_block(void *user, const fr_wsync_block *blk)
{
    block_ctx *c = user;
    uint16_t *dst = fr_weight_update_device_dst(c->r->u, blk->model_tensor);
    if (!dst) return fr_fail(FR_EINTERNAL, "NCCL weight group: the update has no device stage");
    const fr_tp_rect *x = &blk->rect;
    const uint16_t *src = (const uint16_t *)((const char *)c->r->scratch + blk->src_at);
    /* one run (a row range, a whole tensor) may be longer than a 2-D copy's pitch allows */
    cudaError_t e = x->rows == 1 ? cudaMemcpyAsync(dst + x->dst, src + x->src, 2 * x->width, cudaMemcpyDeviceToDevice,
                                                   c->s)
                                 : cudaMemcpy2DAsync(dst + x->dst, 2 * x->dst_pitch, src + x->src, 2 * x->src_pitch,
                                                     2 * x->width, x->rows, cudaMemcpyDeviceToDevice, c->s);
    return e == cudaSuccess ? FR_OK : cuda_fail(e, "copying a rank's part of a piece");
}

/* A tensor-parallel rank: every piece converted (and checked) whole into
 * the scratch, so every rank flags the same values, then the rank's blocks
 * of it copied into its shard stage. *wp: the pieces for the rank logic. */
static fr_status unpack_shard(fr_nccl_recv *r, int i, const fr_msg_nccl_bucket *b, fr_wsync_piece **wp)
{
    *wp = malloc(sizeof **wp * (size_t)b->n_pieces);
    if (!*wp) return fr_fail(FR_ENOMEM, "NCCL weight group: out of memory");
    const fr_wsync_bucket wb = wsync_bucket(r, b, *wp);
    fr_status st = fr_wsync_rank_plan(r->ws, &wb);
    for (int k = 0; k < b->n_pieces && !st; k++) {
        const fr_msg_piece *p = &b->pieces[k];
        const size_t es = fr_dtype_size(p->t.dtype);
        st = fr_weights_unpack_launch((const char *)r->buf[i] + p->at, (int)p->t.dtype, (size_t)(p->nbytes / es),
                                      (uint16_t *)((char *)r->scratch + p->at), r->dbad[i], (unsigned long long)k,
                                      r->us);
    }
    block_ctx c = {r, r->us};
    if (!st) st = fr_wsync_rank_blocks(r->ws, &wb, copy_block, &c);
    return st;
}

/* Enqueues the receive, checksum and unpacking of bucket b into slot i. */
static fr_status launch(fr_nccl_recv *r, int i, fr_msg_nccl_bucket *b, const char **code)
{
    slot *s = &r->sl[i];
    cudaError_t e = cudaStreamWaitEvent(r->rs, r->unpacked[i], 0);   /* the buffer's last unpack */
    if (e != cudaSuccess) return fail(code, "update_failed", cuda_fail(e, "ordering a bucket's receive"));
    ncclResult_t nr = ncclBroadcast(r->buf[i], r->buf[i], (size_t)b->nbytes, ncclUint8, 0, r->comm, r->rs);
    /* A nonblocking communicator may still be enqueueing the call. The first
     * broadcast of a group also sets up its connection to the trainer, which
     * needs the trainer: a dead one keeps the call in progress until the
     * group's deadline, and the serve loop waits here that long (the one
     * place it does; a continuation polled from the loop would remove it). */
    const double until = fr_now_ms() + r->timeout_ms;
    while (nr == ncclInProgress && fr_now_ms() < until) {
        ncclResult_t a = ncclSuccess;
        if (ncclCommGetAsyncError(r->comm, &a) != ncclSuccess) break;
        nr = a;
    }
    if (nr == ncclInProgress)
        return FAIL("nccl_failed", FR_EIO,
                    "NCCL weight group: bucket %d's broadcast did not start within %.0f s (the trainer is gone or "
                    "stalled)", b->bucket, r->timeout_ms / 1e3);
    if (nr != ncclSuccess) return fail(code, "nccl_failed", nccl_fail(nr, r->comm, "ncclBroadcast"));
    cudaEvent_t received;
    if ((e = cudaEventCreateWithFlags(&received, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventRecord(received, r->rs)) != cudaSuccess || (e = cudaStreamWaitEvent(r->us, received, 0)))
        return fail(code, "update_failed", cuda_fail(e, "ordering a bucket's unpacking"));
    cudaEventDestroy(received);   /* released once the stream is done with it */
    fr_status st = FR_OK;
    e = cudaMemsetAsync(r->dbad[i], 0xff, sizeof *r->dbad[i], r->us);
    if (e != cudaSuccess) return fail(code, "update_failed", cuda_fail(e, "clearing the bad-value flag"));
    if (fr_dev_checksum_launch(r->buf[i], (size_t)b->nbytes, r->dig[i], r->us))
        return FAIL("update_failed", FR_EINTERNAL, "NCCL weight group: %s", fr_comm_last_error());
    fr_wsync_piece *wp = NULL;
    if (r->ws) {
        st = unpack_shard(r, i, b, &wp);
    } else {
        for (int k = 0; k < b->n_pieces && !st; k++) {
            const fr_msg_piece *p = &b->pieces[k];
            const declared *d = find_declared(r, p->t.name);
            const size_t es = fr_dtype_size(p->t.dtype);
            uint16_t *dst = fr_weight_update_device_dst(r->u, d->table);
            if (!dst) return FAIL("update_failed", FR_EINTERNAL, "NCCL weight group: the update has no device stage");
            st = fr_weights_unpack_launch((const char *)r->buf[i] + p->at, (int)p->t.dtype, (size_t)(p->nbytes / es),
                                          dst + p->offset / es, r->dbad[i], (unsigned long long)k, r->us);
        }
    }
    if (st) {
        free(wp);
        return fail(code, "update_failed", st);
    }
    const size_t chunks = fr_dev_checksum_chunks((size_t)b->nbytes);
    if ((e = cudaMemcpyAsync(r->hdig[i], r->dig[i], chunks * sizeof(uint64_t), cudaMemcpyDeviceToHost, r->us)) ||
        (e = cudaMemcpyAsync(r->hbad[i], r->dbad[i], sizeof *r->hbad[i], cudaMemcpyDeviceToHost, r->us)) ||
        (e = cudaEventRecord(r->unpacked[i], r->us)))
    {
        free(wp);
        return fail(code, "update_failed", cuda_fail(e, "enqueueing a bucket's checks"));
    }
    free_slot(s);
    *s = (slot){.busy = 1, .bucket = b->bucket, .nbytes = b->nbytes, .checksum = b->checksum, .n_chunks = chunks,
                .pieces = b->pieces, .n_pieces = b->n_pieces, .wp = wp};
    b->pieces = NULL;   /* the slot owns them now */
    b->n_pieces = 0;
    return FR_OK;
}

/* The slot bucket k goes to. */
static int slot_of(int bucket) { return bucket & 1; }

fr_status fr_nccl_recv_bucket(fr_nccl_recv *r, const fr_msg_nccl_bucket *b, const char **code)
{
    if (code) *code = "bad_message";
    if (!r || !b) return fr_fail(FR_EINVAL, "fr_nccl_recv_bucket: NULL argument");
    fr_status st = check_bucket(r, b, code);
    if (st) return st;
    fr_msg_nccl_bucket own = *b;
    own.pieces = malloc(sizeof *own.pieces * (size_t)b->n_pieces);
    if (!own.pieces) return FAIL("out_of_memory", FR_ENOMEM, "NCCL weight group: out of memory");
    memcpy(own.pieces, b->pieces, sizeof *own.pieces * (size_t)b->n_pieces);
    r->next_bucket++;
    r->last_progress_ms = fr_now_ms();
    const int i = slot_of(b->bucket);
    if (!r->sl[i].busy && r->n_waiting == 0) {
        st = launch(r, i, &own, code);
        free(own.pieces);
        return st;
    }
    if (r->n_waiting == r->cap_waiting) {
        int cap = r->cap_waiting ? 2 * r->cap_waiting : 4;
        fr_msg_nccl_bucket *w = realloc(r->waiting, sizeof *w * (size_t)cap);
        if (!w) {
            free(own.pieces);
            return FAIL("out_of_memory", FR_ENOMEM, "NCCL weight group: out of memory");
        }
        r->waiting = w;
        r->cap_waiting = cap;
    }
    r->waiting[r->n_waiting++] = own;
    return FR_OK;
}

/* A checked bucket's pieces, recorded in the update as received. */
static fr_status record(fr_nccl_recv *r, const slot *s, const char **code)
{
    for (int k = 0; k < s->n_pieces; k++) {
        const fr_msg_piece *p = &s->pieces[k];
        const declared *d = find_declared(r, p->t.name);
        if (!d || fr_weight_update_mark(r->u, d->table, p->t.dtype, p->offset, p->nbytes))
            return FAIL("bad_piece", FR_EINVAL, "update to version %llu: bucket %d: \"%s\": %s",
                        (unsigned long long)r->version, s->bucket, p->t.name, d ? fr_last_error() : "not declared");
    }
    return FR_OK;
}

/* Checks the oldest busy slot if its unpacking finished: 1 and *ok when it
 * was checked (ok 0: *code and fr_last_error say why), 0 when not done. */
static int check_slot(fr_nccl_recv *r, int *bucket, int *ok, const char **code)
{
    const int i = r->oldest;
    slot *s = &r->sl[i];
    if (!s->busy) return 0;
    cudaError_t e = cudaEventQuery(r->unpacked[i]);
    if (e == cudaErrorNotReady) return 0;
    *bucket = s->bucket;
    *ok = 0;
    r->last_progress_ms = fr_now_ms();
    if (e != cudaSuccess) {
        fail(code, "update_failed", cuda_fail(e, "receiving a bucket"));
    } else {
        const uint64_t h = fr_dev_checksum_combine(r->hdig[i], s->n_chunks);
        const unsigned long long bad = *r->hbad[i];
        if (h != s->checksum) {
            FAIL("bad_checksum", FR_EINVAL, "update to version %llu: bucket %d: the received bytes' checksum is "
                 "%016llx, the message says %016llx", (unsigned long long)r->version, s->bucket,
                 (unsigned long long)h, (unsigned long long)s->checksum);
        } else if (bad != ~0ull) {
            const int k = (int)(bad >> 40);
            const unsigned long long el = bad & ((1ull << 40) - 1);
            const fr_msg_piece *p = k < s->n_pieces ? &s->pieces[k] : NULL;
            FAIL("non_finite", FR_EINVAL, "update to version %llu: bucket %d: \"%s\": element %llu is NaN or "
                 "infinite (in BF16)", (unsigned long long)r->version, s->bucket, p ? p->t.name : "?",
                 p ? el + p->offset / fr_dtype_size(p->t.dtype) : el);
        } else {
            *ok = record(r, s, code) == FR_OK;
            if (*ok) r->staged += s->nbytes;
        }
    }
    if (r->ws && s->wp) {   /* the rank logic's record of the bucket */
        const fr_wsync_bucket wb = {.bucket = s->bucket, .nbytes = s->nbytes, .checksum = s->checksum,
                                    .pieces = s->wp, .n_pieces = s->n_pieces};
        if (fr_wsync_rank_bucket_done(r->ws, &wb, *ok, FR_WSYNC_BAD_CHECKSUM) && *ok) {
            *ok = 0;
            fail(code, "update_failed", FR_EINTERNAL);
        }
    }
    free_slot(s);
    r->oldest ^= 1;
    return 1;
}

/* Launches the waiting buckets, in order, while their buffers are free. */
static fr_status launch_waiting(fr_nccl_recv *r, const char **code)
{
    while (r->n_waiting > 0 && !r->sl[slot_of(r->waiting[0].bucket)].busy) {
        fr_msg_nccl_bucket next = r->waiting[0];
        memmove(r->waiting, r->waiting + 1, sizeof *r->waiting * (size_t)(r->n_waiting - 1));
        r->n_waiting--;
        fr_status st = launch(r, slot_of(next.bucket), &next, code);
        free(next.pieces);
        if (st) return st;
    }
    return FR_OK;
}

fr_nr_event fr_nccl_recv_poll(fr_nccl_recv *r, int *bucket, const char **code)
{
    if (code) *code = "nccl_failed";
    if (!r) return FR_NR_NOTHING;
    ncclResult_t a = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(r->comm, &a);
    if (q != ncclSuccess) {
        nccl_fail(q, r->comm, "ncclCommGetAsyncError");
        return FR_NR_GROUP_FAILED;
    }
    if (!r->joined) {
        if (a == ncclSuccess) {
            r->joined = 1;
            r->last_progress_ms = fr_now_ms();
            return FR_NR_JOINED;
        }
        if (a != ncclInProgress) {
            nccl_fail(a, r->comm, "joining the group");
            return FR_NR_GROUP_FAILED;
        }
        if (fr_now_ms() - r->last_progress_ms > r->timeout_ms) {
            fr_fail(FR_EIO, "NCCL weight group: the trainer did not join within %.0f s", r->timeout_ms / 1e3);
            return FR_NR_GROUP_FAILED;
        }
        return FR_NR_NOTHING;
    }
    if (a != ncclSuccess && a != ncclInProgress) {
        nccl_fail(a, r->comm, "a receive in flight");
        return FR_NR_GROUP_FAILED;
    }
    const char *c2 = NULL;
    if (launch_waiting(r, &c2)) {
        if (code) *code = c2;
        return FR_NR_UPDATE_FAILED;
    }
    int ok = 0;
    if (check_slot(r, bucket, &ok, code)) {
        if (!ok) return FR_NR_UPDATE_FAILED;
        if (launch_waiting(r, &c2)) {   /* the freed buffer takes the next waiting bucket */
            if (code) *code = c2;
            return FR_NR_UPDATE_FAILED;
        }
        return FR_NR_BUCKET_OK;
    }
    if (fr_nccl_recv_busy(r) && fr_now_ms() - r->last_progress_ms > r->timeout_ms) {
        fr_fail(FR_EIO, "NCCL weight group: no bucket arrived for %.0f s (the trainer stopped sending or died)",
                r->timeout_ms / 1e3);
        return FR_NR_GROUP_FAILED;
    }
    return FR_NR_NOTHING;
}

fr_status fr_nccl_recv_ready(fr_nccl_recv *r, int *ready, const char **code)
{
    if (code) *code = "update_state";
    if (!r || !ready) return fr_fail(FR_EINVAL, "fr_nccl_recv_ready: NULL argument");
    *ready = 0;
    if (!r->updating) return fr_fail(FR_EINVAL, "no NCCL weight update is in progress");
    if (fr_nccl_recv_busy(r)) return FR_OK;
    for (int i = 0; i < r->n_d; i++)
        if (r->d[i].received != r->d[i].bytes)
            return FAIL("missing_tensor", FR_EINVAL, "update to version %llu: \"%s\" has %llu of its %llu bytes",
                        (unsigned long long)r->version, r->d[i].t.name, (unsigned long long)r->d[i].received,
                        (unsigned long long)r->d[i].bytes);
    if (r->ws && fr_wsync_rank_ready(r->ws))
        return FAIL("missing_tensor", FR_EINVAL, "%s", fr_last_error());
    if (fr_weight_update_complete(r->u)) {
        char msg[FR_PROTO_TEXT_MAX - 64];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return FAIL("missing_tensor", FR_EINVAL, "%s (%s)", msg, fr_weight_update_is_partial(r->u) ? "a partial "
                    "update sends at least one tensor" : "every weight of the model must be sent, or the begin says "
                    "partial");
    }
    *ready = 1;
    return FR_OK;
}

fr_weight_update *fr_nccl_recv_finish(fr_nccl_recv *r)
{
    if (!r || !r->updating || fr_nccl_recv_busy(r)) return NULL;
    fr_weight_update *u = r->u;
    clear_update(r);
    return u;
}

fr_status fr_nccl_recv_drop(fr_nccl_recv *r)
{
    if (!r) return FR_OK;
    const int busy = fr_nccl_recv_busy(r);
    clear_update(r);
    if (busy) return fr_fail(FR_EIO, "NCCL weight group: an update was dropped with buckets in flight");
    return FR_OK;
}
