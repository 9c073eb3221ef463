/* Weight updates over ZeroMQ (trainer_bridge/client/client.h,
 * fr_client_update_weights; docs/protocol.md, "update_weights"): the
 * tensors cut into buckets, each sent zero-copy with its xxHash64, two in
 * flight, then the commit. */
#include "trainer_bridge/client/client_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>
#include <zmq.h>

#include "base/clock.h"

/* ZeroMQ is done with a zero-copy payload frame. */
static void release_frame(void *data, void *hint)
{
    (void)data;
    atomic_fetch_sub((atomic_long *)hint, 1);
}

/* Waits until ZeroMQ has released every payload frame; when it does not
 * within the timeout (the server went away with frames queued), the socket
 * is closed at once, which drops them, and a new one is connected. */
static fr_status settle_frames(fr_client *c)
{
    const double end = fr_now_ms() + (c->timeout_ms < 0 ? 30000 : c->timeout_ms);
    while (atomic_load(&c->in_flight) > 0 && fr_now_ms() < end) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    if (atomic_load(&c->in_flight) == 0) return FR_OK;
    pthread_mutex_lock(&c->mu);
    fr_client_sock_take_locked(c);
    int zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_socket_monitor(c->sock, NULL, 0);
    zmq_close(c->sock);
    c->sock = NULL;
    while (atomic_load(&c->in_flight) > 0) {   /* closing drops them promptly */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    fr_status st = fr_client_reopen_locked(c);
    fr_client_sock_give_locked(c);
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Sends frame 0 of m followed by the payload regions, zero-copy, and queues
 * t for its reply (mu held). */
static fr_status send_with_payload(fr_client *c, const fr_msg *m, const void *const *data, const uint64_t *len, int n,
                                   ticket *t)
{
    char *f0;
    size_t l0;
    fr_status st = fr_msg_encode(m, &f0, &l0);
    if (st) return st;
    fr_client_sock_take_locked(c);
    if (zmq_send(c->sock, f0, l0, n > 0 ? ZMQ_SNDMORE : 0) < 0)
        st = fr_fail(FR_EIO, "client: sending a weight bucket failed: %s",
                     errno == EAGAIN ? "timed out" : zmq_strerror(errno));
    free(f0);
    for (int i = 0; !st && i < n; i++) {
        zmq_msg_t part;
        atomic_fetch_add(&c->in_flight, 1);
        if (zmq_msg_init_data(&part, (void *)data[i], (size_t)len[i], release_frame, &c->in_flight)) {
            atomic_fetch_sub(&c->in_flight, 1);
            st = fr_fail(FR_ENOMEM, "client: cannot make a payload frame: %s", zmq_strerror(errno));
        } else if (zmq_msg_send(&part, c->sock, i + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
            int e = errno;
            zmq_msg_close(&part);   /* releases it */
            st = fr_fail(FR_EIO, "client: sending a weight bucket failed: %s",
                         e == EAGAIN ? "timed out" : zmq_strerror(e));
        }
    }
    fr_client_sock_give_locked(c);
    if (!st) {
        t->state = TICKET_WAITING;
        if (c->calls_tail) c->calls_tail->next = t;
        else c->calls = t;
        c->calls_tail = t;
    }
    return st;
}

/* One bucket: its pieces, their bytes in the caller's tensors, and the
 * running position in the tensor list. */
typedef struct {
    fr_msg_piece *pieces;
    const void **data;
    uint64_t *lens;
    int n, cap;
    int ti;             /* the tensor the next piece starts in */
    uint64_t off;       /* and the byte in it */
    XXH64_state_t *h;
} bucketing;

static void bucketing_free(bucketing *b)
{
    free(b->pieces);
    free(b->data);
    free(b->lens);
    if (b->h) XXH64_freeState(b->h);
}

static fr_status grow_pieces(bucketing *bk)
{
    const int cap = bk->cap ? bk->cap * 2 : 1024;
    fr_msg_piece *p = realloc(bk->pieces, sizeof *p * (size_t)cap);
    if (p) bk->pieces = p;
    const void **d = p ? realloc(bk->data, sizeof *d * (size_t)cap) : NULL;
    if (d) bk->data = d;
    uint64_t *l = d ? realloc(bk->lens, sizeof *l * (size_t)cap) : NULL;
    if (l) bk->lens = l;
    if (!l) return fr_fail(FR_ENOMEM, "client: out of memory");
    bk->cap = cap;
    return FR_OK;
}

/* The next bucket: pieces of at most `bucket` bytes in all, tensors in
 * order, split at element boundaries; *xxh: the hash of its bytes. */
static fr_status next_bucket(bucketing *bk, const fr_msg_update_begin *b, const fr_client_tensor *tensors,
                             uint64_t bucket, uint64_t *xxh)
{
    bk->n = 0;
    uint64_t used = 0;
    XXH64_reset(bk->h, 0);
    while (bk->ti < b->n_tensors) {
        const fr_msg_tensor *x = &b->tensors[bk->ti];
        const uint64_t es = fr_dtype_size(x->dtype), total = fr_msg_tensor_bytes(x);
        uint64_t take = total - bk->off;
        if (take > bucket - used) take = (bucket - used) / es * es;
        if (take == 0) break;   /* this bucket is full */
        if (bk->n == bk->cap && grow_pieces(bk)) return FR_ENOMEM;
        bk->pieces[bk->n] = (fr_msg_piece){.t = *x, .offset = bk->off, .nbytes = take};
        bk->data[bk->n] = (const char *)tensors[bk->ti].data + bk->off;
        bk->lens[bk->n] = take;
        XXH64_update(bk->h, bk->data[bk->n], (size_t)take);
        bk->n++;
        used += take;
        bk->off += take;
        if (bk->off == total) {
            bk->ti++;
            bk->off = 0;
        }
    }
    *xxh = XXH64_digest(bk->h);
    return FR_OK;
}

/* The reply to the oldest bucket in flight (mu held). After a refusal the
 * server dropped the update, so the answer to the bucket still in flight
 * (if any) is read and dropped too, keeping the first refusal as the
 * client's last error. */
static fr_status await_bucket(fr_client *c, ticket **fifo, int *in_flight)
{
    fr_msg r;
    fr_status st = fr_client_refused_(fr_client_await_locked(c, fifo[0], -1, "update_weights_bucket", &r));
    if (!st) fr_msg_free(&r);
    fifo[0] = fifo[1];
    (*in_flight)--;
    if (!st || *in_flight == 0) return st;
    fr_error_copy first;
    fr_error_keep(&first);
    if (!fr_client_await_locked(c, fifo[0], -1, "update_weights_bucket", &r)) fr_msg_free(&r);
    (*in_flight)--;
    return fr_error_restore(&first, st, NULL);
}

/* Every bucket, two in flight: the server stages one while the next
 * travels (and this side hashes the one after). mu held. */
static fr_status send_buckets(fr_client *c, const fr_msg_update_begin *b, const fr_client_tensor *tensors,
                              uint64_t bucket, int corrupt)
{
    bucketing bk = {.h = XXH64_createState()};
    fr_status st = bk.h ? FR_OK : fr_fail(FR_ENOMEM, "client: out of memory");
    ticket *fifo[2] = {NULL, NULL};
    int in_flight = 0;
    fr_msg bm;
    fr_msg_init(&bm, FR_MSG_UPDATE_BUCKET);
    for (int k = 0; !st && bk.ti < b->n_tensors; k++) {
        uint64_t xxh;
        if ((st = next_bucket(&bk, b, tensors, bucket, &xxh))) break;
        bm.u.update_bucket = (fr_msg_update_bucket){.version = b->version, .bucket = k, .xxh64 = xxh,
                                                    .pieces = bk.pieces, .n_pieces = bk.n};
        if (k == corrupt) bm.u.update_bucket.xxh64 ^= 0x9e3779b97f4a7c15ull;
        ticket *t = calloc(1, sizeof *t);
        if (!t) st = fr_fail(FR_ENOMEM, "client: out of memory");
        else t->want = FR_MSG_UPDATE_REPLY;
        if (!st && (st = send_with_payload(c, &bm, bk.data, bk.lens, bk.n, t))) free(t);
        if (!st) fifo[in_flight++] = t;
        if (!st && in_flight == 2) st = await_bucket(c, fifo, &in_flight);
    }
    while (!st && in_flight > 0) st = await_bucket(c, fifo, &in_flight);
    if (st && in_flight > 0) {   /* failed on this side: the answer in flight must not pass for the abort's */
        fr_error_copy failure;
        fr_error_keep(&failure);
        fr_msg r;
        for (int i = 0; i < in_flight; i++)
            if (!fr_client_await_locked(c, fifo[i], -1, "update_weights_bucket", &r)) fr_msg_free(&r);
        fr_error_restore(&failure, st, NULL);
    }
    bucketing_free(&bk);
    return st;
}

/* The update's end: the commit, or (after a failure on this side, while
 * the server may still stage the update) an update_weights_abort, best
 * effort. mu held. */
static fr_status finish_update(fr_client *c, uint64_t version, fr_status st, fr_msg_update_reply *out)
{
    fr_msg m, r;
    if (!st) {
        fr_msg_init(&m, FR_MSG_UPDATE_COMMIT);
        m.u.update_end.version = version;
        st = fr_client_refused_(fr_client_call_locked(c, &m, FR_MSG_UPDATE_REPLY, -1, &r));
        if (!st && out) *out = r.u.update_reply;
        return st;
    }
    if (fr_last_error_peer(NULL, NULL, NULL)) return st;   /* the server's refusal: it dropped the update */
    fr_error_copy failure;
    fr_error_keep(&failure);
    fr_msg_init(&m, FR_MSG_UPDATE_ABORT);
    m.u.update_end.version = version;
    const int t = c->timeout_ms;
    (void)fr_client_call_locked(c, &m, FR_MSG_UPDATE_REPLY, t < 0 || t > 2000 ? 2000 : t, &r);
    return fr_error_restore(&failure, st, NULL);
}

static fr_status update_weights(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                const fr_client_update_opts *opts, fr_msg_update_reply *out)
{
    const uint64_t bucket = opts && opts->bucket_bytes ? opts->bucket_bytes : FR_CLIENT_BUCKET_BYTES;
    if (bucket < 4) return fr_fail(FR_EINVAL, "client: bucket_bytes must be at least 4 (one float32)");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    fr_msg_update_begin *b = &m.u.update_begin;
    fr_status st = fr_client_begin_tensors_(b, tensors, n, version, bucket, "update_weights");
    b->partial = opts && opts->partial;
    pthread_mutex_lock(&c->mu);
    int begun = 0;
    if (!st) begun = !(st = fr_client_refused_(fr_client_call_locked(c, &m, FR_MSG_UPDATE_REPLY, -1, &r)));
    if (begun) st = send_buckets(c, b, tensors, bucket, opts ? opts->corrupt_bucket : -1);
    pthread_mutex_unlock(&c->mu);
    if (begun) {
        fr_status settled = settle_frames(c);
        if (!st && settled) st = settled;
        pthread_mutex_lock(&c->mu);
        st = finish_update(c, version, st, out);
        pthread_mutex_unlock(&c->mu);
    }
    free(b->tensors);
    return st;
}

fr_status fr_client_update_weights(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                   const fr_client_update_opts *opts, fr_msg_update_reply *out)
{
    if (!c || !tensors || n < 1 || n > FR_PROTO_MAX_TENSORS)
        return fr_fail(FR_EINVAL, "client: update_weights needs 1 to %d tensors", FR_PROTO_MAX_TENSORS);
    fr_status st = fr_client_update_begin_(c, "update_weights");
    if (st) return st;
    st = update_weights(c, tensors, n, version, opts, out);
    fr_client_update_end_(c);
    return st;
}

fr_status fr_client_begin_tensors_(fr_msg_update_begin *b, const fr_client_tensor *tensors, int n, uint64_t version,
                                   uint64_t bucket, const char *what)
{
    b->tensors = calloc((size_t)n, sizeof *b->tensors);
    if (!b->tensors) return fr_fail(FR_ENOMEM, "client: out of memory");
    b->n_tensors = n;
    b->version = version;
    b->bucket_bytes = bucket;
    for (int i = 0; i < n; i++) {
        const fr_client_tensor *t = &tensors[i];
        fr_msg_tensor *x = &b->tensors[i];
        if (!t->name || strlen(t->name) >= sizeof x->name || t->ndim < 1 || t->ndim > FR_PROTO_MAX_NDIM ||
            !t->shape || !t->data)
            return fr_fail(FR_EINVAL, "client: %s: tensor %d needs a name (< %d bytes), 1 to %d dimensions and data",
                           what, i, FR_PROTO_NAME_MAX, FR_PROTO_MAX_NDIM);
        snprintf(x->name, sizeof x->name, "%s", t->name);
        x->dtype = t->dtype;
        x->ndim = t->ndim;
        for (int d = 0; d < t->ndim; d++) x->shape[d] = t->shape[d];
        uint64_t nb = fr_msg_tensor_bytes(x);
        if (!nb) return fr_fail(FR_EINVAL, "client: %s: tensor \"%s\" has an invalid dtype or shape", what, t->name);
        b->total_bytes += nb;
    }
    return FR_OK;
}
