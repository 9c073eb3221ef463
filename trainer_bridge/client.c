/* The C client library (trainer_bridge/client.h). */
#include "client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "wire.h"

typedef struct item {
    fr_msg m;
    struct item *next;
} item;

typedef struct {
    uint64_t id;
    int open;               /* samples without their done */
} pending;

struct fr_client {
    void *ctx, *sock;
    int timeout_ms;
    item *head, *tail;      /* results received during synchronous calls */
    pending *p;
    int n_p, cap_p;
    int open_samples;
};

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

fr_status fr_client_new(const char *endpoint, fr_client **out)
{
    if (!out) return fr_fail(FR_EINVAL, "client: out is NULL");
    *out = NULL;
    if (!endpoint) return fr_fail(FR_EINVAL, "client: endpoint is NULL");
    fr_client *c = calloc(1, sizeof *c);
    if (!c) return fr_fail(FR_ENOMEM, "client: out of memory");
    c->timeout_ms = 30000;
    c->ctx = zmq_ctx_new();
    c->sock = c->ctx ? zmq_socket(c->ctx, ZMQ_DEALER) : NULL;
    int linger = 1000;
    fr_status st = FR_OK;
    if (!c->sock || zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger))
        st = fr_fail(FR_EIO, "client: cannot make a ZeroMQ DEALER socket: %s", zmq_strerror(errno));
    else if (zmq_connect(c->sock, endpoint))
        st = fr_fail(FR_EIO, "client: cannot connect to %s: %s", endpoint, zmq_strerror(errno));
    if (st) {
        fr_client_destroy(&c);
        return st;
    }
    fr_client_set_timeout(c, c->timeout_ms);
    *out = c;
    return FR_OK;
}

void fr_client_destroy(fr_client **pc)
{
    if (!pc || !*pc) return;
    fr_client *c = *pc;
    for (item *i = c->head; i;) {
        item *next = i->next;
        fr_msg_free(&i->m);
        free(i);
        i = next;
    }
    free(c->p);
    if (c->sock) zmq_close(c->sock);
    if (c->ctx) zmq_ctx_term(c->ctx);
    free(c);
    *pc = NULL;
}

void fr_client_set_timeout(fr_client *c, int timeout_ms)
{
    if (!c) return;
    c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof c->timeout_ms);
}

int fr_client_open_samples(const fr_client *c) { return c ? c->open_samples : 0; }

static int find_pending(const fr_client *c, uint64_t id)
{
    for (int i = 0; i < c->n_p; i++)
        if (c->p[i].id == id) return i;
    return -1;
}

static void drop_pending(fr_client *c, int i)
{
    c->open_samples -= c->p[i].open;
    c->p[i] = c->p[--c->n_p];
}

/* Bookkeeping of a received message: dones close samples; an error about
 * an open request means the server refused it (no done will come). */
static void track(fr_client *c, const fr_msg *m)
{
    if (m->type == FR_MSG_DONE) {
        int i = find_pending(c, m->u.done.request_id);
        if (i < 0) return;
        c->p[i].open--;
        c->open_samples--;
        if (c->p[i].open <= 0) drop_pending(c, i);
    } else if (m->type == FR_MSG_ERROR && m->u.error.has_request_id &&
               strcmp(m->u.error.code, "duplicate_request_id") != 0) {
        int i = find_pending(c, m->u.error.request_id);
        if (i >= 0) drop_pending(c, i);
    }
}

static fr_status send_frame(fr_client *c, const char *data, size_t len, int flags)
{
    if (zmq_send(c->sock, data, len, flags) < 0) {
        if (errno == EAGAIN) return fr_fail(FR_EIO, "client: send timed out after %d ms", c->timeout_ms);
        return fr_fail(FR_EIO, "client: send failed: %s", zmq_strerror(errno));
    }
    return FR_OK;
}

static fr_status send_msg(fr_client *c, const fr_msg *m)
{
    char *data;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st) return st;
    st = send_frame(c, data, len, 0);
    free(data);
    return st;
}

fr_status fr_client_send_raw(fr_client *c, const void *data, size_t len, int extra_frames)
{
    if (!c || (len && !data) || extra_frames < 0) return fr_fail(FR_EINVAL, "client: bad raw send");
    fr_status st = send_frame(c, data, len, extra_frames ? ZMQ_SNDMORE : 0);
    for (int i = 0; !st && i < extra_frames; i++) st = send_frame(c, "", 0, i + 1 < extra_frames ? ZMQ_SNDMORE : 0);
    return st;
}

/* Receives and decodes one message from the socket. */
static fr_status recv_one(fr_client *c, int wait_ms, fr_msg *m, int *got)
{
    fr_wire_msg w;
    *got = 0;
    fr_status st = fr_wire_recv(c->sock, 0, wait_ms, &w, got);
    if (st || !*got) return st;
    *got = 0;
    st = w.n_frames == 1 ? fr_msg_decode(w.frame0, w.len0, m)
                         : fr_fail(FR_EFORMAT, "client: the server sent %d frames", w.n_frames);
    fr_wire_msg_free(&w);
    if (st) return st;
    track(c, m);
    *got = 1;
    return FR_OK;
}

static fr_status keep(fr_client *c, fr_msg *m)
{
    item *i = malloc(sizeof *i);
    if (!i) {
        fr_msg_free(m);
        return fr_fail(FR_ENOMEM, "client: out of memory keeping a message");
    }
    i->m = *m;
    i->next = NULL;
    if (c->tail) c->tail->next = i;
    else c->head = i;
    c->tail = i;
    return FR_OK;
}

/* Sends m and waits for a reply of type want (kept in *reply); other
 * messages are kept for later. An error that names no request is the
 * reply to this call. */
static fr_status call(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply)
{
    fr_status st = send_msg(c, m);
    if (st) return st;
    double end = now_ms() + c->timeout_ms;
    for (;;) {
        int left = c->timeout_ms < 0 ? -1 : (int)(end - now_ms());
        if (c->timeout_ms >= 0 && left <= 0)
            return fr_fail(FR_EIO, "client: no %s within %d ms", fr_msg_type_name(want), c->timeout_ms);
        fr_msg r;
        int got;
        if ((st = recv_one(c, left, &r, &got))) return st;
        if (!got) continue;
        if (r.type == want) {
            *reply = r;
            return FR_OK;
        }
        if (r.type == FR_MSG_ERROR && !r.u.error.has_request_id) {
            st = fr_fail(FR_EINVAL, "server refused %s: %s: %s", fr_msg_type_name(m->type), r.u.error.code,
                         r.u.error.message);
            fr_msg_free(&r);
            return st;
        }
        if ((st = keep(c, &r))) return st;
    }
}

fr_status fr_client_hello(fr_client *c, const char *name, fr_msg_hello_reply *out)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_HELLO);
    if (name) snprintf(m.u.hello.client, sizeof m.u.hello.client, "%s", name);
    fr_status st = call(c, &m, FR_MSG_HELLO_REPLY, &r);
    if (!st && out) *out = r.u.hello_reply;
    return st;
}

fr_status fr_client_stats(fr_client *c, fr_msg_stats_reply *out)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_STATS);
    fr_status st = call(c, &m, FR_MSG_STATS_REPLY, &r);
    if (!st && out) *out = r.u.stats_reply;
    return st;
}

fr_status fr_client_pause(fr_client *c, fr_pause_mode mode, fr_msg_pause_reply *out)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_PAUSE);
    m.u.pause.mode = mode;
    fr_status st = call(c, &m, FR_MSG_PAUSE_REPLY, &r);
    if (!st && out) *out = r.u.pause_reply;
    return st;
}

fr_status fr_client_resume(fr_client *c, fr_msg_resume_reply *out)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_RESUME);
    fr_status st = call(c, &m, FR_MSG_RESUME_REPLY, &r);
    if (!st && out) *out = r.u.resume_reply;
    return st;
}

fr_status fr_client_abort(fr_client *c, const uint64_t *ids, int n, int *samples_ended, int *not_found)
{
    if (!c || n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "client: bad abort arguments");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.all = n == 0;
    m.u.abort.request_ids = (uint64_t *)ids;
    m.u.abort.n_request_ids = n;
    fr_status st = call(c, &m, FR_MSG_ABORT_REPLY, &r);
    if (st) return st;
    if (samples_ended) *samples_ended = r.u.abort_reply.samples;
    if (not_found) *not_found = r.u.abort_reply.n_not_found;
    fr_msg_free(&r);
    return FR_OK;
}

fr_status fr_client_generate(fr_client *c, const fr_msg_generate *g)
{
    if (!c || !g) return fr_fail(FR_EINVAL, "client: NULL");
    if (find_pending(c, g->request_id) >= 0)
        return fr_fail(FR_EINVAL, "client: request_id %llu is still open", (unsigned long long)g->request_id);
    if (c->n_p == c->cap_p) {
        int cap = c->cap_p ? c->cap_p * 2 : 64;
        pending *p = realloc(c->p, sizeof *p * (size_t)cap);
        if (!p) return fr_fail(FR_ENOMEM, "client: out of memory");
        c->p = p;
        c->cap_p = cap;
    }
    fr_msg m;
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate = *g;
    fr_status st = send_msg(c, &m);
    if (st) return st;
    c->p[c->n_p++] = (pending){.id = g->request_id, .open = g->n};
    c->open_samples += g->n;
    return FR_OK;
}

fr_status fr_client_next(fr_client *c, int timeout_ms, fr_msg *out, int *got)
{
    if (!c || !out || !got) return fr_fail(FR_EINVAL, "client: next needs out and got");
    *got = 0;
    if (c->head) {
        item *i = c->head;
        c->head = i->next;
        if (!c->head) c->tail = NULL;
        *out = i->m;
        free(i);
        *got = 1;
        return FR_OK;
    }
    return recv_one(c, timeout_ms, out, got);
}

fr_status fr_client_dispatch(fr_client *c, const fr_client_handlers *h, int timeout_ms, int *handled)
{
    if (handled) *handled = 0;
    if (!c || !h) return fr_fail(FR_EINVAL, "client: dispatch needs handlers");
    int wait = timeout_ms;
    for (;;) {
        fr_msg m;
        int got;
        fr_status st = fr_client_next(c, wait, &m, &got);
        if (st || !got) return st;
        wait = 0;   /* then everything already waiting, without blocking */
        if (m.type == FR_MSG_TOKENS && h->on_tokens) h->on_tokens(h->user, &m.u.tokens);
        else if (m.type == FR_MSG_DONE && h->on_done) h->on_done(h->user, &m.u.done);
        else if (m.type == FR_MSG_ERROR && h->on_error) h->on_error(h->user, &m.u.error);
        fr_msg_free(&m);
        if (handled) (*handled)++;
    }
}
