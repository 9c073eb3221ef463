/* The C client's NCCL weight group (client.h, "weights over NCCL";
 * docs/protocol.md, "Weights over NCCL"): the trainer's side, rank 0.
 *
 * An update packs the caller's device tensors into two device buckets in
 * turn on a packing stream, checksums each there (comm/dev_checksum.h),
 * announces it with update_weights_nccl_bucket, and broadcasts it on the
 * NCCL stream; events let packing bucket k + 1 overlap broadcasting bucket
 * k and keep bucket k + 2 out of a buffer until bucket k has left it. The
 * group and the two buckets are comm/weight_group.h's, as on the server's
 * side. No wait here blocks without a deadline: every wait polls the event,
 * the group's state and the socket (so a server's refusal ends it at once).
 * Without CUDA the calls fail with FR_EUNSUPPORTED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "trainer_bridge/client/client_internal.h"

#ifdef FR_HAVE_CUDA
#include <cuda_runtime.h>

#include "comm/dev_checksum.h"
#include "comm/weight_group.h"

_Static_assert(FR_WEIGHT_GROUP_ID_BYTES == FR_PROTO_NCCL_ID_BYTES, "the protocol's unique id is the group's");

enum { ALIGN = 256 };   /* each piece starts at a multiple of this in a bucket */

typedef struct {
    fr_weight_group *wg;
    int device;
    int nranks;            /* the group: this client and every rank of the server */
    cudaStream_t pack, net;
    cudaEvent_t caller, packed[2], sent[2];
    fr_dev_buckets bk;
} group;

static fr_status cuda_fail(cudaError_t e, const char *what)
{
    return fr_fail(FR_EIO, "client: NCCL weight group: %s failed: %s", what, cudaGetErrorString(e));
}

/* A failure of the group (comm/weight_group.h's message), as the client's. */
static fr_status group_fail(void) { return fr_fail(FR_EIO, "client: %s", fr_last_error()); }

void fr_client_nccl_free_(void **slot)
{
    group *g = slot ? (group *)*slot : NULL;
    if (!g) return;
    cudaSetDevice(g->device);
    fr_weight_group_abort(&g->wg);   /* local; ends a broadcast the server will never receive */
    if (g->pack) cudaStreamSynchronize(g->pack);
    if (g->net) cudaStreamSynchronize(g->net);
    fr_dev_buckets_free(&g->bk);
    for (int i = 0; i < 2; i++) {
        if (g->packed[i]) cudaEventDestroy(g->packed[i]);
        if (g->sent[i]) cudaEventDestroy(g->sent[i]);
    }
    if (g->caller) cudaEventDestroy(g->caller);
    if (g->pack) cudaStreamDestroy(g->pack);
    if (g->net) cudaStreamDestroy(g->net);
    free(g);
    *slot = NULL;
}

/* Waits for the group to finish what is in progress (joining, or
 * enqueueing a call), up to the deadline. */
static fr_status settle(group *g, double deadline, const char *what)
{
    return fr_weight_group_wait(g->wg, deadline, what) ? group_fail() : FR_OK;
}

fr_status fr_client_nccl_group_init(fr_client *c, int cuda_device)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    void **slot = fr_client_nccl_slot_(c);
    fr_client_nccl_free_(slot);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || cuda_device < 0 || cuda_device >= n)
        return fr_fail(FR_EUNSUPPORTED, "client: NCCL weight group: no CUDA device %d (%s)", cuda_device,
                       e != cudaSuccess ? cudaGetErrorString(e) : "outside the devices present");
    if ((e = cudaSetDevice(cuda_device)) != cudaSuccess) return cuda_fail(e, "cudaSetDevice");
    group *g = calloc(1, sizeof *g);
    if (!g) return fr_fail(FR_ENOMEM, "client: out of memory");
    g->device = cuda_device;
    *slot = g;
    fr_status st = FR_OK;
    if ((e = cudaStreamCreateWithFlags(&g->pack, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g->net, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&g->caller, cudaEventDisableTiming)) != cudaSuccess)
        st = cuda_fail(e, "making streams");
    for (int i = 0; i < 2 && !st; i++)
        if ((e = cudaEventCreateWithFlags(&g->packed[i], cudaEventDisableTiming)) != cudaSuccess ||
            (e = cudaEventCreateWithFlags(&g->sent[i], cudaEventDisableTiming)) != cudaSuccess)
            st = cuda_fail(e, "making events");
    fr_msg m, reply;
    fr_msg_init(&m, FR_MSG_NCCL_INIT);
    if (!st && fr_weight_group_unique_id(m.u.nccl_init.unique_id)) st = group_fail();
    if (!st) st = fr_client_call_(c, &m, FR_MSG_NCCL_REPLY, &reply);
    if (!st && (reply.u.nccl_reply.state != FR_NCCL_JOINING || reply.u.nccl_reply.nranks < 2))
        st = fr_fail(FR_EFORMAT, "client: the server answered nccl_group_init without a group to join");
    /* the buckets are broadcast from this client: it must be the group's root */
    if (!st && reply.u.nccl_reply.rank != 0)
        st = fr_fail(FR_EFORMAT, "client: the server gave this client rank %d of its NCCL weight group; the sender "
                     "must be rank 0", reply.u.nccl_reply.rank);
    if (!st) g->nranks = reply.u.nccl_reply.nranks;
    /* joining is nonblocking: it waits with a deadline, below */
    if (!st && fr_weight_group_join(m.u.nccl_init.unique_id, reply.u.nccl_reply.nranks, reply.u.nccl_reply.rank,
                                    &g->wg))
        st = group_fail();
    const int t = fr_client_timeout_(c);
    if (!st) st = settle(g, fr_now_ms() + (t < 0 ? 600000 : t), "joining the group");
    if (st) fr_client_nccl_free_(slot);
    return st;
}

int fr_client_nccl_group_size(fr_client *c)
{
    const group *g = c ? *fr_client_nccl_slot_(c) : NULL;
    return g ? g->nranks : 0;
}

fr_status fr_client_nccl_group_close(fr_client *c)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    void **slot = fr_client_nccl_slot_(c);
    if (!*slot) return FR_OK;
    fr_client_nccl_free_(slot);
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_NCCL_CLOSE);
    return fr_client_call_(c, &m, FR_MSG_NCCL_REPLY, &r);
}

/* A bucket: pieces [first, first + count) of the plan, nbytes in all. */
typedef struct {
    int first, count;
    uint64_t nbytes;
} bucket_plan;

typedef struct {
    fr_msg_piece *pieces;
    const char **src;      /* each piece's device bytes */
    int n, cap;
    bucket_plan *b;
    int nb, cap_b;
} plan;

static void plan_free(plan *p)
{
    free(p->pieces);
    free(p->src);
    free(p->b);
}

static uint64_t align_up(uint64_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

/* Cuts the tensors into buckets of at most `bucket` bytes, tensors in
 * order, split at element boundaries, each piece aligned in its bucket. */
static fr_status make_plan(const fr_msg_update_begin *b, const fr_client_tensor *t, uint64_t bucket, plan *p)
{
    memset(p, 0, sizeof *p);
    int ti = 0;
    uint64_t off = 0;
    while (ti < b->n_tensors) {
        if (p->nb == p->cap_b) {
            int cap = p->cap_b ? 2 * p->cap_b : 64;
            bucket_plan *v = realloc(p->b, sizeof *v * (size_t)cap);
            if (!v) return fr_fail(FR_ENOMEM, "client: out of memory");
            p->b = v;
            p->cap_b = cap;
        }
        bucket_plan *bp = &p->b[p->nb];
        *bp = (bucket_plan){.first = p->n};
        uint64_t used = 0;
        while (ti < b->n_tensors) {
            const fr_msg_tensor *x = &b->tensors[ti];
            const uint64_t es = fr_dtype_size(x->dtype), total = fr_msg_tensor_bytes(x);
            const uint64_t at = align_up(used);
            if (at >= bucket) break;
            uint64_t take = total - off;
            if (take > bucket - at) take = (bucket - at) / es * es;
            if (take == 0) break;   /* this bucket is full */
            if (p->n == p->cap) {
                int cap = p->cap ? 2 * p->cap : 1024;
                fr_msg_piece *v = realloc(p->pieces, sizeof *v * (size_t)cap);
                if (v) p->pieces = v;
                const char **s = v ? realloc(p->src, sizeof *s * (size_t)cap) : NULL;
                if (!s) return fr_fail(FR_ENOMEM, "client: out of memory");
                p->src = s;
                p->cap = cap;
            }
            p->pieces[p->n] = (fr_msg_piece){.t = *x, .offset = off, .nbytes = take, .at = at};
            p->src[p->n] = (const char *)t[ti].data + off;
            p->n++;
            bp->count++;
            used = at + take;
            off += take;
            if (off == total) {
                ti++;
                off = 0;
            }
        }
        if (bp->count == 0)
            return fr_fail(FR_EINVAL, "client: bucket_bytes %llu cannot hold one element of \"%s\"",
                           (unsigned long long)bucket, b->tensors[ti].name);
        bp->nbytes = used;
        p->nb++;
    }
    return FR_OK;
}


/* Replies counted while waiting: bucket replies, and the commit's. */
typedef struct {
    int buckets;
    int committed;
    fr_msg_update_reply commit;
} replies;

/* Reads what the server sent (at most wait_ms for the first message): a
 * refusal fails at once. */
static fr_status drain(fr_client *c, int wait_ms, replies *rp)
{
    for (int k = 0; k < 64; k++) {
        fr_msg r;
        int got = 0;
        fr_status st = fr_client_refused_(fr_client_take_(c, k ? 0 : wait_ms, FR_MSG_UPDATE_REPLY,
                                                             "the weight update over NCCL", &r, &got));
        if (st) return st;
        if (!got) return FR_OK;
        if (r.u.update_reply.stage == FR_UPD_BUCKET) rp->buckets++;
        else if (r.u.update_reply.stage == FR_UPD_COMMIT) {
            rp->committed = 1;
            rp->commit = r.u.update_reply;
        }
        fr_msg_free(&r);
    }
    return FR_OK;
}

/* Waits for event ev, watching the group and the socket, up to deadline. */
static fr_status wait_event(fr_client *c, group *g, cudaEvent_t ev, double deadline, replies *rp, const char *what)
{
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) return FR_OK;
        if (e != cudaErrorNotReady) return cuda_fail(e, what);
        int busy = 0;
        if (fr_weight_group_state(g->wg, &busy, what)) return group_fail();
        fr_status st = drain(c, 0, rp);
        if (st) return st;
        if (fr_now_ms() > deadline) return fr_fail(FR_EIO, "client: NCCL weight update: %s timed out", what);
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
}

/* The buckets: pack, checksum, announce, broadcast, each in turn. */
static fr_status send_buckets(fr_client *c, group *g, const plan *p, uint64_t version, int corrupt, cudaStream_t caller,
                              double deadline, replies *rp)
{
    cudaError_t e = cudaEventRecord(g->caller, caller);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(g->pack, g->caller, 0);
    if (e != cudaSuccess) return cuda_fail(e, "ordering after the caller's stream");
    for (int k = 0; k < p->nb; k++) {
        const int i = k & 1;
        const bucket_plan *bp = &p->b[k];
        /* bucket k - 2 must have left this buffer */
        if (k >= 2 && (e = cudaStreamWaitEvent(g->pack, g->sent[i], 0)) != cudaSuccess)
            return cuda_fail(e, "ordering a bucket's packing");
        for (int j = bp->first; j < bp->first + bp->count; j++) {
            const fr_msg_piece *x = &p->pieces[j];
            e = cudaMemcpyAsync((char *)g->bk.buf[i] + x->at, p->src[j], (size_t)x->nbytes, cudaMemcpyDeviceToDevice,
                                g->pack);
            if (e != cudaSuccess) return cuda_fail(e, "packing a bucket (are the tensors on the group's device?)");
        }
        if (fr_dev_checksum_launch(g->bk.buf[i], (size_t)bp->nbytes, g->bk.dig[i], g->pack))
            return fr_fail(FR_EIO, "client: %s", fr_last_error());
        const size_t chunks = fr_dev_checksum_chunks((size_t)bp->nbytes);
        if ((e = cudaMemcpyAsync(g->bk.hdig[i], g->bk.dig[i], chunks * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                                 g->pack)) != cudaSuccess ||
            (e = cudaEventRecord(g->packed[i], g->pack)) != cudaSuccess)
            return cuda_fail(e, "checksumming a bucket");
        fr_status st = wait_event(c, g, g->packed[i], deadline, rp, "packing a bucket");
        if (st) return st;
        fr_msg m;
        fr_msg_init(&m, FR_MSG_NCCL_BUCKET);
        m.u.nccl_bucket = (fr_msg_nccl_bucket){.version = version, .bucket = k, .nbytes = bp->nbytes,
                                               .checksum = fr_dev_checksum_combine(g->bk.hdig[i], chunks),
                                               .pieces = p->pieces + bp->first, .n_pieces = bp->count};
        if (k == corrupt) m.u.nccl_bucket.checksum ^= 0x9e3779b97f4a7c15ull;
        if ((st = fr_client_send_(c, &m))) return st;
        if ((e = cudaStreamWaitEvent(g->net, g->packed[i], 0)) != cudaSuccess)
            return cuda_fail(e, "ordering a bucket's broadcast");
        int busy = 0;
        if (fr_weight_group_bcast(g->wg, g->bk.buf[i], (size_t)bp->nbytes, g->net, &busy)) return group_fail();
        if (busy && (st = settle(g, deadline, "ncclBroadcast"))) return st;
        if ((e = cudaEventRecord(g->sent[i], g->net)) != cudaSuccess) return cuda_fail(e, "recording a broadcast");
    }
    return FR_OK;
}

fr_status fr_client_update_weights_nccl(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                        void *stream, const fr_client_update_opts *opts, fr_msg_update_reply *out)
{
    if (!c || !tensors || n < 1 || n > FR_PROTO_MAX_TENSORS)
        return fr_fail(FR_EINVAL, "client: update_weights_nccl needs 1 to %d tensors", FR_PROTO_MAX_TENSORS);
    void **slot = fr_client_nccl_slot_(c);
    group *g = (group *)*slot;
    if (!g) return fr_fail(FR_EINVAL, "client: update_weights_nccl needs an NCCL weight group (nccl_group_init)");
    const uint64_t bucket = opts && opts->bucket_bytes ? opts->bucket_bytes : FR_CLIENT_BUCKET_BYTES;
    const int corrupt = opts ? opts->corrupt_bucket : -1;
    if (bucket < ALIGN) return fr_fail(FR_EINVAL, "client: bucket_bytes must be at least %d", ALIGN);
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    fr_msg_update_begin *b = &m.u.update_begin;
    fr_status st = fr_client_begin_tensors_(b, tensors, n, version, bucket, "update_weights_nccl");
    if (st == FR_ENOMEM) return st;
    b->nccl = 1;
    b->partial = opts && opts->partial;
    plan p;
    memset(&p, 0, sizeof p);
    if (!st) st = make_plan(b, tensors, bucket, &p);
    if (!st && fr_dev_buckets_reserve(&g->bk, bucket)) st = group_fail();
    if (!st) st = fr_client_refused_(fr_client_call_(c, &m, FR_MSG_UPDATE_REPLY, &r));
    int begun = !st;
    const int t = fr_client_timeout_(c);
    const double wait = t < 0 ? 600000.0 : (double)t;
    replies rp = {0};
    if (!st) st = send_buckets(c, g, &p, version, corrupt, (cudaStream_t)stream, fr_now_ms() + wait, &rp);
    if (!st) {
        fr_msg cm;
        fr_msg_init(&cm, FR_MSG_UPDATE_COMMIT);
        cm.u.update_end.version = version;
        st = fr_client_send_(c, &cm);
    }
    /* the commit reply comes after every bucket's; the deadline restarts with each reply */
    double deadline = fr_now_ms() + wait;
    int seen = rp.buckets;
    while (!st && !rp.committed) {
        st = drain(c, 20, &rp);
        if (rp.buckets != seen) {
            seen = rp.buckets;
            deadline = fr_now_ms() + wait;
        }
        int busy = 0;
        if (!st && fr_weight_group_state(g->wg, &busy, "a broadcast in flight")) st = group_fail();
        if (!st && !rp.committed && fr_now_ms() > deadline)
            st = fr_fail(FR_EIO, "client: no commit reply for the weight update over NCCL within %d ms", t);
    }
    if (!st && rp.buckets != p.nb)
        st = fr_fail(FR_EFORMAT, "client: the server committed after %d of %d bucket replies", rp.buckets, p.nb);
    if (!st && (e = cudaStreamSynchronize(g->net)) != cudaSuccess) st = cuda_fail(e, "finishing the broadcasts");
    if (!st && out) *out = rp.commit;
    if (st && begun) {
        /* The group may be out of step (a broadcast the server never took):
         * it ends here and on the server. */
        fr_error_copy failure;   /* the server's refusal stays the caller's error (fr_client_last_error) */
        fr_error_keep(&failure);
        int saved = fr_client_timeout_(c);
        /* Buckets sent before the refusal still get answers (update_state,
         * once the server dropped the update): read them first, or the close
         * below, and then the caller, would take one for their own answer
         * and report it instead of the refusal. */
        (void)fr_client_settle_(c, saved < 0 || saved > 5000 ? 5000 : saved);
        fr_client_set_timeout(c, saved < 0 || saved > 2000 ? 2000 : saved);
        (void)fr_client_nccl_group_close(c);
        fr_client_set_timeout(c, saved);
        fr_error_restore(&failure, st, " (the NCCL weight group was closed: make a new one)");
    }
    plan_free(&p);
    free(b->tensors);
    return st;
}

#else /* no CUDA */

void fr_client_nccl_free_(void **slot)
{
    if (slot) *slot = NULL;
}

fr_status fr_client_nccl_group_init(fr_client *c, int cuda_device)
{
    (void)c;
    return fr_fail(FR_EUNSUPPORTED, "client: NCCL weight group on device %d: this client library was built without "
                   "CUDA", cuda_device);
}

fr_status fr_client_nccl_group_close(fr_client *c)
{
    return c ? FR_OK : fr_fail(FR_EINVAL, "client: NULL");
}

int fr_client_nccl_group_size(fr_client *c)
{
    (void)c;
    return 0;
}

fr_status fr_client_update_weights_nccl(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                        void *stream, const fr_client_update_opts *opts, fr_msg_update_reply *out)
{
    (void)c;
    (void)tensors;
    (void)n;
    (void)stream;
    (void)opts;
    (void)out;
    return fr_fail(FR_EUNSUPPORTED, "client: weight update %llu over NCCL: this client library was built without "
                   "CUDA", (unsigned long long)version);
}

#endif
