/* The engine's side of weights over NCCL (rollout/engine/weight_recv.h).
 *
 * The buckets are unpacked into the device stage of the update
 * (weight_update.h), the same stage ZeroMQ buckets go to, and recorded
 * there once checked; the rules and the commit are the update's.
 *
 * Two bucket buffers, two streams: bucket k is received into buffer k % 2
 * on the receive stream, then checksummed and unpacked on the unpack
 * stream, which overlaps the receive of bucket k + 1. Events order the
 * reuse of a buffer: its next receive waits for its last unpack. The host
 * reads each bucket's chunk digests and bad-value flag (pinned memory)
 * when its unpack event has completed, never blocking. */
#include "rollout/engine/weight_recv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "base/clock.h"
#include "comm/dev_checksum.h"
#include "comm/weight_group.h"
#include "rollout/engine/wsync_rank.h"
#include "rollout/model/weights_unpack.h"

_Static_assert(FR_WEIGHT_RECV_ID_BYTES == FR_WEIGHT_GROUP_ID_BYTES, "the receiver's unique id is the group's");

/* A bucket from its announcement until the host has checked it: a copy of
 * the announced bucket (pieces and their names owned). */
typedef struct {
    int busy;
    fr_weight_bucket b;
    char *names;
    size_t n_chunks;
} slot;

struct fr_weight_recv {
    fr_weight_group *g;
    int joined;
    /* a tensor-parallel rank (fr_weight_recv_set_shard): the cut of each
     * piece it keeps, and the BF16 scratch pieces go through */
    fr_wsync_rank *ws;
    void *scratch;
    uint64_t scratch_bytes;
    double timeout_ms, last_progress_ms;
    cudaStream_t rs, us;               /* receive, unpack */
    fr_dev_buckets bk;
    unsigned long long *dbad[2], *hbad[2];
    cudaEvent_t unpacked[2];
    slot sl[2];
    int oldest;                        /* the slot to check first */
    slot *waiting;                     /* announced while both buffers were busy, in order */
    int n_waiting, cap_waiting;
    fr_weight_update *u;               /* the update in progress (borrowed), NULL when none */
};

static fr_status cuda_fail(cudaError_t e, const char *what)
{
    return fr_fail(e == cudaErrorMemoryAllocation ? FR_ENOMEM : FR_EINTERNAL, "NCCL weight group: %s failed: %s",
                   what, cudaGetErrorString(e));
}

/* A failure of this side's own (CUDA, memory): the update takes nothing more. */
static fr_status failed(fr_weight_recv *r, fr_weight_refusal code, fr_status st, fr_weight_refusal *why)
{
    return fr_weight_update_fail(r->u, code, st, why);
}

fr_status fr_weight_recv_new(const unsigned char unique_id[FR_WEIGHT_RECV_ID_BYTES], int nranks, int rank,
                             int timeout_ms, fr_weight_recv **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_weight_recv_new: out is NULL");
    *out = NULL;
    if (!unique_id) return fr_fail(FR_EINVAL, "fr_weight_recv_new: NULL argument");
    if (nranks < 2 || rank < 1 || rank >= nranks)
        return fr_fail(FR_EINVAL, "fr_weight_recv_new: rank %d of %d (the trainer is rank 0)", rank, nranks);
    fr_weight_recv *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "NCCL weight group: out of memory");
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
    if (e != cudaSuccess) st = cuda_fail(e, "making streams and events");
    if (!st && fr_weight_group_join(unique_id, nranks, rank, &r->g)) st = fr_fail(FR_EIO, "%s", fr_last_error());
    if (st) {
        fr_weight_recv_destroy(&r);
        return st;
    }
    r->last_progress_ms = fr_now_ms();
    *out = r;
    return FR_OK;
}

static void free_slot(slot *s)
{
    free(s->b.pieces);
    free(s->names);
    memset(s, 0, sizeof *s);
}

/* Forgets the update (and the buckets waiting for a buffer). */
static void clear_update(fr_weight_recv *r)
{
    r->u = NULL;
    for (int i = 0; i < r->n_waiting; i++) free_slot(&r->waiting[i]);
    r->n_waiting = 0;
}

fr_status fr_weight_recv_set_shard(fr_weight_recv *r, const fr_model_config *cfg, int tp_rank, int tp_size)
{
    if (!r || !cfg) return fr_fail(FR_EINVAL, "fr_weight_recv_set_shard: NULL argument");
    fr_wsync_rank_destroy(&r->ws);
    if (tp_size <= 1) return FR_OK;
    return fr_wsync_rank_new(cfg, tp_rank, tp_size, 0, &r->ws);
}

void fr_weight_recv_destroy(fr_weight_recv **pr)
{
    fr_weight_recv *r = pr ? *pr : NULL;
    if (!r) return;
    /* Abort first: it ends any receive still waiting for a trainer that
     * will never send, so the streams can drain. */
    fr_weight_group_abort(&r->g);
    if (r->rs) cudaStreamSynchronize(r->rs);
    if (r->us) cudaStreamSynchronize(r->us);
    clear_update(r);
    free(r->waiting);
    fr_wsync_rank_destroy(&r->ws);
    if (r->scratch) cudaFree(r->scratch);
    fr_dev_buckets_free(&r->bk);
    for (int i = 0; i < 2; i++) {
        free_slot(&r->sl[i]);
        if (r->dbad[i]) cudaFree(r->dbad[i]);
        if (r->hbad[i]) cudaFreeHost(r->hbad[i]);
        if (r->unpacked[i]) cudaEventDestroy(r->unpacked[i]);
    }
    if (r->rs) cudaStreamDestroy(r->rs);
    if (r->us) cudaStreamDestroy(r->us);
    free(r);
    *pr = NULL;
}

int fr_weight_recv_joined(const fr_weight_recv *r) { return r && r->joined; }
int fr_weight_recv_busy(const fr_weight_recv *r) { return r && (r->sl[0].busy || r->sl[1].busy || r->n_waiting > 0); }

fr_status fr_weight_recv_wait_joined(fr_weight_recv *r)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_weight_recv_wait_joined: NULL");
    if (r->joined) return FR_OK;
    if (fr_weight_group_wait(r->g, fr_now_ms() + r->timeout_ms, "joining the group"))
        return fr_fail(FR_EIO, "%s", fr_last_error());
    r->joined = 1;
    r->last_progress_ms = fr_now_ms();
    return FR_OK;
}

/* A shard rank's scratch: each piece is converted to BF16 there (at its
 * byte offset in the bucket: BF16 never takes more room than the piece),
 * then the rank's blocks are copied into the stage. */
static fr_status ensure_scratch(fr_weight_recv *r, uint64_t bytes)
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

fr_status fr_weight_recv_begin(fr_weight_recv *r, fr_weight_update *u, uint64_t bucket_bytes, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!r || !u || bucket_bytes < 1) return fr_fail(FR_EINVAL, "fr_weight_recv_begin: bad argument");
    const unsigned long long v = (unsigned long long)fr_weight_update_version(u);
    if (why) *why = FR_WREF_NCCL_UNAVAILABLE;
    if (!fr_weight_update_on_device(u))
        return fr_fail(FR_EINVAL, "update to version %llu: weights over NCCL need a device stage", v);
    int busy = 1;
    if (!r->joined && !fr_weight_group_state(r->g, &busy, "joining the group") && !busy) {
        /* the trainer's side returns once joined; this side may not have polled yet */
        r->joined = 1;
        r->last_progress_ms = fr_now_ms();
    }
    if (!r->joined)
        return fr_fail(FR_EINVAL, "update to version %llu: the NCCL group is still joining (every member must have "
                       "called its init)", v);
    if (why) *why = FR_WREF_UPDATE_STATE;
    if (fr_weight_recv_busy(r))
        return fr_fail(FR_EINVAL, "update to version %llu: buckets of the previous update are still in flight", v);
    if (why) *why = FR_WREF_FAILED;
    if (r->ws && !fr_weight_update_is_shard(u))
        return fr_fail(FR_EINTERNAL, "NCCL weight group: a tensor-parallel rank needs a shard stage");
    clear_update(r);
    fr_status st = fr_dev_buckets_reserve(&r->bk, bucket_bytes) ? fr_fail(FR_ENOMEM, "%s", fr_last_error()) : FR_OK;
    if (!st) st = ensure_scratch(r, bucket_bytes);
    if (st) {
        if (why) *why = st == FR_ENOMEM ? FR_WREF_OUT_OF_MEMORY : FR_WREF_FAILED;
        return st;
    }
    if (why) *why = FR_WREF_NONE;
    r->oldest = 0;
    r->u = u;
    return FR_OK;
}

/* A copy of b that outlives the message it came in. */
static fr_status copy_bucket(const fr_weight_bucket *b, slot *out)
{
    memset(out, 0, sizeof *out);
    size_t room = 0;
    for (int k = 0; k < b->n_pieces; k++) room += strlen(b->pieces[k].t.name) + 1;
    out->b = *b;
    out->b.pieces = malloc(sizeof *out->b.pieces * (size_t)b->n_pieces);
    out->names = malloc(room ? room : 1);
    if (!out->b.pieces || !out->names) {
        free_slot(out);
        return fr_fail(FR_ENOMEM, "NCCL weight group: out of memory");
    }
    size_t at = 0;
    for (int k = 0; k < b->n_pieces; k++) {
        const size_t n = strlen(b->pieces[k].t.name) + 1;
        out->b.pieces[k] = b->pieces[k];
        out->b.pieces[k].t.name = memcpy(out->names + at, b->pieces[k].t.name, n);
        out->b.pieces[k].bytes = NULL;
        at += n;
    }
    return FR_OK;
}

typedef struct {
    fr_weight_recv *r;
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

/* Every piece of bucket b in buffer i converted (and checked) to BF16:
 * straight into the stage, or for a tensor-parallel rank whole into the
 * scratch (so every rank flags the same values) and then the rank's blocks
 * of it into its shard stage. */
static fr_status unpack(fr_weight_recv *r, int i, const fr_weight_bucket *b)
{
    fr_status st = FR_OK;
    for (int k = 0; k < b->n_pieces && !st; k++) {
        const fr_weight_piece *p = &b->pieces[k];
        const size_t es = fr_dtype_size(p->t.dtype);
        uint16_t *dst = r->ws ? (uint16_t *)((char *)r->scratch + p->at) : NULL;
        if (!r->ws) {
            uint16_t *base = fr_weight_update_device_dst(r->u, p->tensor);
            if (!base) return fr_fail(FR_EINTERNAL, "NCCL weight group: the update has no device stage");
            dst = base + p->offset / es;
        }
        st = fr_weights_unpack_launch((const char *)r->bk.buf[i] + p->at, (int)p->t.dtype, (size_t)(p->nbytes / es),
                                      dst, r->dbad[i], (unsigned long long)k, r->us);
    }
    block_ctx c = {r, r->us};
    if (!st && r->ws) st = fr_wsync_rank_blocks(r->ws, b, copy_block, &c);
    return st;
}

/* The broadcast of bucket b into buffer i, enqueued on the receive stream.
 * A nonblocking communicator may still be enqueueing the call. The first
 * broadcast of a group also sets up its connection to the trainer, which
 * needs the trainer: a dead one keeps the call in progress until the
 * group's deadline, and the serve loop waits here that long (the one place
 * it does; a continuation polled from the loop would remove it). */
static fr_status receive(fr_weight_recv *r, int i, const fr_weight_bucket *b, fr_weight_refusal *why)
{
    int busy = 0;
    if (fr_weight_group_bcast(r->g, r->bk.buf[i], (size_t)b->nbytes, r->rs, &busy))
        return failed(r, FR_WREF_NCCL_FAILED, fr_fail(FR_EIO, "%s", fr_last_error()), why);
    const double until = fr_now_ms() + r->timeout_ms;
    while (busy && fr_now_ms() < until)
        if (fr_weight_group_state(r->g, &busy, "ncclBroadcast"))
            return failed(r, FR_WREF_NCCL_FAILED, fr_fail(FR_EIO, "%s", fr_last_error()), why);
    if (busy)
        return failed(r, FR_WREF_NCCL_FAILED,
                      fr_fail(FR_EIO, "NCCL weight group: bucket %d's broadcast did not start within %.0f s (the "
                              "trainer is gone or stalled)", b->bucket, r->timeout_ms / 1e3), why);
    return FR_OK;
}

/* Enqueues the receive, checksum and unpacking of the bucket in *s into
 * slot i, which takes it over. */
static fr_status launch(fr_weight_recv *r, int i, slot *s, fr_weight_refusal *why)
{
    const fr_weight_bucket *b = &s->b;
    cudaError_t e = cudaStreamWaitEvent(r->rs, r->unpacked[i], 0);   /* the buffer's last unpack */
    if (e != cudaSuccess) return failed(r, FR_WREF_FAILED, cuda_fail(e, "ordering a bucket's receive"), why);
    fr_status st = receive(r, i, b, why);
    if (st) return st;
    cudaEvent_t received;
    if ((e = cudaEventCreateWithFlags(&received, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventRecord(received, r->rs)) != cudaSuccess || (e = cudaStreamWaitEvent(r->us, received, 0)))
        return failed(r, FR_WREF_FAILED, cuda_fail(e, "ordering a bucket's unpacking"), why);
    cudaEventDestroy(received);   /* released once the stream is done with it */
    if ((e = cudaMemsetAsync(r->dbad[i], 0xff, sizeof *r->dbad[i], r->us)) != cudaSuccess)
        return failed(r, FR_WREF_FAILED, cuda_fail(e, "clearing the bad-value flag"), why);
    if (fr_dev_checksum_launch(r->bk.buf[i], (size_t)b->nbytes, r->bk.dig[i], r->us))
        return failed(r, FR_WREF_FAILED, fr_fail(FR_EINTERNAL, "NCCL weight group: %s", fr_last_error()), why);
    if ((st = unpack(r, i, b))) return failed(r, FR_WREF_FAILED, st, why);
    const size_t chunks = fr_dev_checksum_chunks((size_t)b->nbytes);
    if ((e = cudaMemcpyAsync(r->bk.hdig[i], r->bk.dig[i], chunks * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                             r->us)) ||
        (e = cudaMemcpyAsync(r->hbad[i], r->dbad[i], sizeof *r->hbad[i], cudaMemcpyDeviceToHost, r->us)) ||
        (e = cudaEventRecord(r->unpacked[i], r->us)))
        return failed(r, FR_WREF_FAILED, cuda_fail(e, "enqueueing a bucket's checks"), why);
    free_slot(&r->sl[i]);
    r->sl[i] = *s;
    r->sl[i].busy = 1;
    r->sl[i].n_chunks = chunks;
    memset(s, 0, sizeof *s);
    return FR_OK;
}

/* The slot bucket k goes to. */
static int slot_of(int bucket) { return bucket & 1; }

fr_status fr_weight_recv_bucket(fr_weight_recv *r, fr_weight_bucket *b, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!r || !b) return fr_fail(FR_EINVAL, "fr_weight_recv_bucket: NULL argument");
    if (!r->u) {
        if (why) *why = FR_WREF_UPDATE_STATE;
        return fr_fail(FR_EINVAL, "bucket %d for version %llu: no weight update over NCCL is in progress", b->bucket,
                       (unsigned long long)b->version);
    }
    fr_status st = fr_weight_update_plan(r->u, b, why);
    if (st) return st;
    slot own;
    if ((st = copy_bucket(b, &own))) return failed(r, FR_WREF_OUT_OF_MEMORY, st, why);
    r->last_progress_ms = fr_now_ms();
    const int i = slot_of(b->bucket);
    if (!r->sl[i].busy && r->n_waiting == 0) {
        st = launch(r, i, &own, why);
        free_slot(&own);
        return st;
    }
    if (r->n_waiting == r->cap_waiting) {
        int cap = r->cap_waiting ? 2 * r->cap_waiting : 4;
        slot *w = realloc(r->waiting, sizeof *w * (size_t)cap);
        if (!w) {
            free_slot(&own);
            return failed(r, FR_WREF_OUT_OF_MEMORY, fr_fail(FR_ENOMEM, "NCCL weight group: out of memory"), why);
        }
        r->waiting = w;
        r->cap_waiting = cap;
    }
    r->waiting[r->n_waiting++] = own;
    return FR_OK;
}

/* Checks the oldest busy slot if its unpacking finished: 1 and *ok when it
 * was checked (ok 0: *why and fr_last_error say why), 0 when not done. */
static int check_slot(fr_weight_recv *r, int *bucket, int *ok, fr_weight_refusal *why)
{
    const int i = r->oldest;
    slot *s = &r->sl[i];
    if (!s->busy) return 0;
    cudaError_t e = cudaEventQuery(r->unpacked[i]);
    if (e == cudaErrorNotReady) return 0;
    *bucket = s->b.bucket;
    r->last_progress_ms = fr_now_ms();
    if (e != cudaSuccess) {
        failed(r, FR_WREF_FAILED, cuda_fail(e, "receiving a bucket"), why);
        *ok = 0;
    } else {
        const uint64_t h = fr_dev_checksum_combine(r->bk.hdig[i], s->n_chunks);
        const unsigned long long bad = *r->hbad[i];
        const int bad_piece = bad == ~0ull ? -1 : (int)(bad >> 40);
        *ok = fr_weight_update_done(r->u, &s->b, &h, bad_piece, bad & ((1ull << 40) - 1), why) == FR_OK;
    }
    free_slot(s);
    r->oldest ^= 1;
    return 1;
}

/* Launches the waiting buckets, in order, while their buffers are free. */
static fr_status launch_waiting(fr_weight_recv *r, fr_weight_refusal *why)
{
    while (r->n_waiting > 0 && !r->sl[slot_of(r->waiting[0].b.bucket)].busy) {
        slot next = r->waiting[0];
        memmove(r->waiting, r->waiting + 1, sizeof *r->waiting * (size_t)(r->n_waiting - 1));
        r->n_waiting--;
        fr_status st = launch(r, slot_of(next.b.bucket), &next, why);
        free_slot(&next);
        if (st) return st;
    }
    return FR_OK;
}

fr_weight_recv_event fr_weight_recv_poll(fr_weight_recv *r, int *bucket, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NCCL_FAILED;
    if (!r) return FR_WR_NOTHING;
    int busy = 0;
    if (fr_weight_group_state(r->g, &busy, r->joined ? "a receive in flight" : "joining the group")) {
        fr_fail(FR_EIO, "%s", fr_last_error());
        return FR_WR_GROUP_FAILED;
    }
    if (!r->joined) {
        if (!busy) {
            r->joined = 1;
            r->last_progress_ms = fr_now_ms();
            return FR_WR_JOINED;
        }
        if (fr_now_ms() - r->last_progress_ms > r->timeout_ms) {
            fr_fail(FR_EIO, "NCCL weight group: the trainer did not join within %.0f s", r->timeout_ms / 1e3);
            return FR_WR_GROUP_FAILED;
        }
        return FR_WR_NOTHING;
    }
    if (launch_waiting(r, why)) return FR_WR_UPDATE_FAILED;
    int ok = 0;
    if (check_slot(r, bucket, &ok, why)) {
        if (!ok) return FR_WR_UPDATE_FAILED;
        if (launch_waiting(r, why)) return FR_WR_UPDATE_FAILED;   /* the freed buffer takes the next waiting bucket */
        return FR_WR_BUCKET_OK;
    }
    if (fr_weight_recv_busy(r) && fr_now_ms() - r->last_progress_ms > r->timeout_ms) {
        if (why) *why = FR_WREF_NCCL_FAILED;
        fr_fail(FR_EIO, "NCCL weight group: no bucket arrived for %.0f s (the trainer stopped sending or died)",
                r->timeout_ms / 1e3);
        return FR_WR_GROUP_FAILED;
    }
    return FR_WR_NOTHING;
}

void fr_weight_recv_finish(fr_weight_recv *r)
{
    if (r && !fr_weight_recv_busy(r)) clear_update(r);
}

fr_status fr_weight_recv_drop(fr_weight_recv *r)
{
    if (!r) return FR_OK;
    const int busy = fr_weight_recv_busy(r);
    clear_update(r);
    if (busy) return fr_fail(FR_EIO, "NCCL weight group: an update was dropped with buckets in flight");
    return FR_OK;
}
