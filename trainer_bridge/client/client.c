/* The C client library (trainer_bridge/client/client.h): the connection,
 * the one receiver at a time, and the routing of what arrives to the
 * request or the call it belongs to. */
#include "trainer_bridge/client/client_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "base/clock.h"
#include "trainer_bridge/protocol/wire.h"

/* ZMTP heartbeats: a server that stops answering (killed, frozen, or its
 * host gone) closes the connection after this long. */
#define HEARTBEAT_IVL_MS 1000
/* The most messages one receive turn routes before the waiting threads
 * get to look at them. */
enum { PUMP_BATCH = 256 };

/* ---- deadlines ------------------------------------------------------------- */

double fr_client_until(int ms) { return ms < 0 ? -1.0 : fr_now_ms() + ms; }

int fr_client_left_ms(double until)
{
    if (until < 0) return -1;
    const double left = until - fr_now_ms();
    return left <= 0 ? 0 : left > 1e9 ? 1000000000 : (int)left;
}

/* Waits on the client's condition until signalled or until (< 0: no limit). */
static void cond_wait_until(fr_client *c, double until)
{
    if (until < 0) {
        pthread_cond_wait(&c->cv, &c->mu);
        return;
    }
    struct timespec ts;
    const double ms = until;   /* fr_now_ms reads CLOCK_MONOTONIC, the condition's clock */
    ts.tv_sec = (time_t)(ms / 1000);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1000) * 1e6);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    if (ts.tv_nsec < 0) ts.tv_nsec = 0;
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
}

/* ---- the connection -------------------------------------------------------- */

/* Makes and connects the DEALER socket (with the CURVE keys when set) and
 * the monitor that says when its connection ends. */
static fr_status open_socket(fr_client *c)
{
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    int linger = 1000;
    if (!c->sock || zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger))
        return fr_fail(FR_EIO, "client: cannot make a ZeroMQ DEALER socket: %s", zmq_strerror(errno));
    if (c->curve && (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->server_key, 40) ||
                     zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->public_key, 40) ||
                     zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, c->secret_key, 40)))
        return fr_fail(FR_EINVAL, "client: the CURVE keys were refused: %s", zmq_strerror(errno));
    int ivl = HEARTBEAT_IVL_MS, hb = FR_CLIENT_HEARTBEAT_TIMEOUT_MS, unbounded = 0;
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &hb, sizeof hb);
    /* ZeroMQ stops reading a connection whose receive queue is full, and
     * with it the heartbeats: an unbounded queue keeps a busy caller (one
     * training between reads) from looking departed to the server */
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &unbounded, sizeof unbounded);
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://fp4rollout-client-monitor-%p", (void *)c);
    if (c->monitor) zmq_close(c->monitor);
    c->monitor = NULL;
    if (zmq_socket_monitor(c->sock, ep, ZMQ_EVENT_DISCONNECTED) ||
        !(c->monitor = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->monitor, ep))
        return fr_fail(FR_EIO, "client: cannot watch the connection: %s", zmq_strerror(errno));
    if (zmq_connect(c->sock, c->endpoint))
        return fr_fail(FR_EIO, "client: cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof c->timeout_ms);
    return FR_OK;
}

fr_status fr_client_reopen_locked(fr_client *c)
{
    int zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_socket_monitor(c->sock, NULL, 0);
    zmq_close(c->sock);
    c->sock = NULL;
    return open_socket(c);
}

void fr_client_unlink_ticket_locked(fr_client *c, ticket *t)
{
    ticket *prev = NULL;
    for (ticket *x = c->calls; x; prev = x, x = x->next)
        if (x == t) {
            if (prev) prev->next = t->next;
            else c->calls = t->next;
            if (c->calls_tail == t) c->calls_tail = prev;
            t->next = NULL;
            return;
        }
}

static fr_status receive_ready_locked(fr_client *c, int most);

/* The connection ended: samples still to come will not (the client is
 * lost), and calls sent on it are never answered. */
static void connection_ended_locked(fr_client *c)
{
    for (int i = 0; i < c->n_reqs;) {
        req *q = c->reqs[i];
        if (q->discarded && q->unreceived > 0) {
            q->unreceived = 0;
            fr_client_remove_req_locked(c, q);
            continue;
        }
        if (q->unreceived > 0) q->lost = 1;
        i++;
    }
    for (ticket *t = c->calls, *next; t; t = next) {
        next = t->next;
        if (t->state == TICKET_ABANDONED) {
            fr_client_unlink_ticket_locked(c, t);
            free(t);
        } else if (t->state == TICKET_WAITING) {
            fr_msg_init(&t->reply, FR_MSG_NONE);
            t->state = TICKET_ANSWERED;
        }
    }
    pthread_cond_broadcast(&c->cv);
}

/* Reads the monitor's events (the socket held by this thread). */
void fr_client_read_monitor_locked(fr_client *c)
{
    uint16_t event;
    while (c->monitor && fr_wire_monitor_event(c->monitor, &event, NULL)) {
        if (event == ZMQ_EVENT_DISCONNECTED) {
            /* what the ended connection brought is still queued: read it all
             * now, so nothing of it is taken for what a resubmission brings */
            (void)receive_ready_locked(c, INT_MAX);
            connection_ended_locked(c);
        }
    }
}

static int z85_key_ok(const char *k)
{
    uint8_t raw[32];
    return k && strlen(k) == 40 && zmq_z85_decode(raw, k) != NULL;
}

/* The mutex, its condition (on the monotonic clock, as deadlines are) and
 * the wake pipe. */
static int init_sync(fr_client *c)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a)) return -1;
    int bad = pthread_condattr_setclock(&a, CLOCK_MONOTONIC) || pthread_cond_init(&c->cv, &a);
    pthread_condattr_destroy(&a);
    if (bad) return -1;
    if (pthread_mutex_init(&c->mu, NULL)) {
        pthread_cond_destroy(&c->cv);
        return -1;
    }
    if (pipe2(c->wake, O_NONBLOCK | O_CLOEXEC)) {
        c->wake[0] = c->wake[1] = -1;
        return -1;
    }
    return 0;
}

fr_status fr_client_new_curve(const char *endpoint, const fr_client_curve *keys, fr_client **out)
{
    if (!out) return fr_fail(FR_EINVAL, "client: out is NULL");
    *out = NULL;
    if (!endpoint) return fr_fail(FR_EINVAL, "client: endpoint is NULL");
    if (keys) {
        if (!zmq_has("curve")) return fr_fail(FR_EUNSUPPORTED, "client: this libzmq has no CURVE support");
        if (!z85_key_ok(keys->server_public_key) || !z85_key_ok(keys->public_key) || !z85_key_ok(keys->secret_key))
            return fr_fail(FR_EINVAL, "client: CURVE keys must be 40 Z85 characters each (server public key, "
                                      "client public and secret keys)");
    }
    fr_client *c = calloc(1, sizeof *c);
    if (!c) return fr_fail(FR_ENOMEM, "client: out of memory");
    c->wake[0] = c->wake[1] = -1;
    if (init_sync(c)) {
        if (c->wake[0] >= 0) close(c->wake[0]);
        free(c);
        return fr_fail(FR_ENOMEM, "client: cannot make its lock and wake pipe: %s", strerror(errno));
    }
    atomic_init(&c->in_flight, 0);
    c->timeout_ms = 30000;
    c->endpoint = strdup(endpoint);
    if (keys) {
        c->curve = 1;
        memcpy(c->server_key, keys->server_public_key, 41);
        memcpy(c->public_key, keys->public_key, 41);
        memcpy(c->secret_key, keys->secret_key, 41);
    }
    c->ctx = zmq_ctx_new();
    fr_status st = !c->endpoint || !c->ctx ? fr_fail(FR_ENOMEM, "client: out of memory") : open_socket(c);
    if (st) {
        fr_client_destroy(&c);
        return st;
    }
    *out = c;
    return FR_OK;
}

fr_status fr_client_new(const char *endpoint, fr_client **out) { return fr_client_new_curve(endpoint, NULL, out); }

fr_status fr_client_keypair(char public_key[41], char secret_key[41])
{
    if (!public_key || !secret_key) return fr_fail(FR_EINVAL, "client: keypair needs two buffers");
    if (zmq_curve_keypair(public_key, secret_key))
        return fr_fail(FR_EUNSUPPORTED, "client: cannot make a CURVE key pair: %s", zmq_strerror(errno));
    return FR_OK;
}

static void free_items(item *i, int global)
{
    while (i) {
        item *next = global ? i->next : i->rnext;
        fr_msg_free(&i->m);
        free(i);
        i = next;
    }
}

void fr_client_destroy(fr_client **pc)
{
    if (!pc || !*pc) return;
    fr_client *c = *pc;
    fr_client_nccl_free_(&c->nccl);
    free_items(c->head, 1);
    free_items(c->stray_head, 1);
    for (ticket *t = c->calls, *next; t; t = next) {
        next = t->next;
        fr_msg_free(&t->reply);
        free(t);
    }
    for (int i = 0; i < c->n_reqs; i++) {
        fr_client_free_generate(&c->reqs[i]->g);
        free(c->reqs[i]);
    }
    free(c->reqs);
    free(c->by_id);
    for (int i = 0; i < c->n_parts; i++) fr_client_sample_free(&c->parts[i].s);
    free(c->parts);
    fr_msg_free(&c->delta);
    if (c->sock) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->monitor) zmq_close(c->monitor);
    if (c->sock) zmq_close(c->sock);
    if (c->ctx) zmq_ctx_term(c->ctx);
    for (int i = 0; i < 2; i++)
        if (c->wake[i] >= 0) close(c->wake[i]);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->endpoint);
    free(c);
    *pc = NULL;
}

void fr_client_set_timeout(fr_client *c, int timeout_ms)
{
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
    fr_client_sock_take_locked(c);
    if (c->sock) zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof c->timeout_ms);
    fr_client_sock_give_locked(c);
    pthread_mutex_unlock(&c->mu);
}

/* ---- the socket: one user at a time ---------------------------------------- */

void fr_client_sock_take_locked(fr_client *c)
{
    c->sock_wanted++;
    while (c->sock_busy) {
        /* the poller leaves zmq_poll when this byte arrives */
        const char one = 1;
        if (write(c->wake[1], &one, 1) < 0 && errno != EAGAIN) break;
        pthread_cond_wait(&c->cv, &c->mu);
    }
    c->sock_wanted--;
    c->sock_busy = 1;
}

void fr_client_sock_give_locked(fr_client *c)
{
    c->sock_busy = 0;
    pthread_cond_broadcast(&c->cv);
}

static fr_status send_frame(fr_client *c, const char *data, size_t len, int flags)
{
    if (zmq_send(c->sock, data, len, flags) < 0) {
        if (errno == EAGAIN) return fr_fail(FR_EIO, "client: send timed out after %d ms", c->timeout_ms);
        return fr_fail(FR_EIO, "client: send failed: %s", zmq_strerror(errno));
    }
    return FR_OK;
}

fr_status fr_client_send_locked(fr_client *c, const fr_msg *m, ticket *t)
{
    char *data;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st) return st;
    fr_client_sock_take_locked(c);
    st = send_frame(c, data, len, 0);
    fr_client_sock_give_locked(c);
    free(data);
    if (!st && t) {
        t->state = TICKET_WAITING;
        t->next = NULL;
        if (c->calls_tail) c->calls_tail->next = t;
        else c->calls = t;
        c->calls_tail = t;
    }
    return st;
}

fr_status fr_client_send_raw(fr_client *c, const void *data, size_t len, int extra_frames)
{
    if (!c || (len && !data) || extra_frames < 0) return fr_fail(FR_EINVAL, "client: bad raw send");
    pthread_mutex_lock(&c->mu);
    fr_client_sock_take_locked(c);
    fr_status st = send_frame(c, data, len, extra_frames ? ZMQ_SNDMORE : 0);
    for (int i = 0; !st && i < extra_frames; i++) st = send_frame(c, "", 0, i + 1 < extra_frames ? ZMQ_SNDMORE : 0);
    fr_client_sock_give_locked(c);
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_server_error_(const fr_msg_error *e, const char *what)
{
    const long long id = e->has_request_id ? (long long)(e->request_id & 0x7fffffffffffffffull) : -1;
    return fr_fail_peer(FR_EINVAL, e->code, e->message, id, "%s: %s: %s", what, e->code, e->message);
}

/* ---- routing ------------------------------------------------------------------ */

/* Codes only a weight update or the NCCL group gets (docs/protocol.md). */
static int update_code(const char *code)
{
    static const char *const codes[] = {"bad_version", "unknown_tensor", "bad_shape", "bad_dtype", "bad_bucket",
                                        "bad_checksum", "non_finite", "bad_piece", "missing_tensor", "update_state",
                                        "update_failed", "nccl_unavailable", "nccl_failed"};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (strcmp(code, codes[i]) == 0) return 1;
    return 0;
}

/* The call a reply answers: the oldest one waiting for its type. An error
 * naming no request answers the oldest call that can get it: an update's
 * codes go to the update, a pause's to the pause, any other to the oldest
 * call. NULL: no call waits for it. */
static ticket *ticket_for_locked(fr_client *c, const fr_msg *m)
{
    const int err = m->type == FR_MSG_ERROR;
    const int upd = err && update_code(m->u.error.code);
    const int pause = err && (strcmp(m->u.error.code, "pause_cancelled") == 0 ||
                              strcmp(m->u.error.code, "shutdown") == 0);
    for (ticket *t = c->calls; t; t = t->next) {
        if (t->state == TICKET_ANSWERED) continue;
        if (!err ? t->want == m->type
                 : upd ? t->want == FR_MSG_UPDATE_REPLY || t->want == FR_MSG_NCCL_REPLY
                       : !pause || t->want == FR_MSG_PAUSE_REPLY)
            return t;
    }
    return NULL;
}

static item *new_item(fr_msg *m, uint64_t seq)
{
    item *it = calloc(1, sizeof *it);
    if (!it) {
        fr_msg_free(m);
        return NULL;
    }
    it->m = *m;
    it->seq = seq;
    return it;
}

static fr_status route_result_locked(fr_client *c, fr_msg *m, uint64_t seq)
{
    req *q = fr_client_find_locked(c, fr_client_result_id(m));
    if (q && m->type == FR_MSG_DONE) q->unreceived--;
    if (q && fr_client_closes_request(m)) q->unreceived = 0;
    if (q && q->discarded) {
        fr_msg_free(m);
        fr_client_settle_req_locked(c, q);
        return FR_OK;
    }
    item *it = new_item(m, seq);
    if (!it) return fr_fail(FR_ENOMEM, "client: out of memory keeping a result");
    it->q = q;
    it->prev = c->tail;
    if (c->tail) c->tail->next = it;
    else c->head = it;
    c->tail = it;
    if (q) {
        if (q->last) q->last->rnext = it;
        else q->first = it;
        q->last = it;
    }
    return FR_OK;
}

static fr_status route_locked(fr_client *c, fr_msg *m)
{
    const uint64_t seq = ++c->seq;
    c->heard = 1;
    if (m->type == FR_MSG_TOKENS || m->type == FR_MSG_DONE || (m->type == FR_MSG_ERROR && m->u.error.has_request_id))
        return route_result_locked(c, m, seq);
    ticket *t = ticket_for_locked(c, m);
    if (t && t->state == TICKET_ABANDONED) {   /* its caller gave up waiting */
        fr_client_unlink_ticket_locked(c, t);
        free(t);
        fr_msg_free(m);
        return FR_OK;
    }
    if (t) {
        t->reply = *m;
        t->seq = seq;
        t->state = TICKET_ANSWERED;
        return FR_OK;
    }
    item *it = new_item(m, seq);
    if (!it) return fr_fail(FR_ENOMEM, "client: out of memory keeping a reply");
    if (c->stray_tail) c->stray_tail->next = it;
    else c->stray_head = it;
    c->stray_tail = it;
    return FR_OK;
}

/* Reads and routes what the socket holds now, `most` messages at most (the
 * socket held by this thread). */
static fr_status receive_ready_locked(fr_client *c, int most)
{
    for (int k = 0; k < most; k++) {
        fr_wire_msg w;
        int got = 0;
        fr_status st = fr_wire_recv(c->sock, 0, 0, &w, &got);
        if (st || !got) return st;
        fr_msg m;
        st = w.n_frames == 1 ? fr_msg_decode(w.frame0, w.len0, &m)
                             : fr_fail(FR_EFORMAT, "client: the server sent %d frames", w.n_frames);
        fr_wire_msg_free(&w);
        if (!st) st = route_locked(c, &m);
        if (st) return st;
    }
    return FR_OK;
}

fr_status fr_client_pump_locked(fr_client *c, double until)
{
    /* Another thread receives (it wakes this one when it routed something),
     * or wants to send: a poller that took the socket straight back would
     * starve a sender for as long as its own wait lasts (a pause in mode
     * wait: minutes). */
    if (c->sock_busy || c->sock_wanted) {
        cond_wait_until(c, until);
        return FR_OK;
    }
    c->sock_busy = 1;
    pthread_mutex_unlock(&c->mu);
    zmq_pollitem_t it[3] = {{.socket = c->sock, .events = ZMQ_POLLIN},
                            {.socket = NULL, .fd = c->wake[0], .events = ZMQ_POLLIN},
                            {.socket = c->monitor, .events = ZMQ_POLLIN}};
    (void)zmq_poll(it, c->monitor ? 3 : 2, fr_client_left_ms(until));
    pthread_mutex_lock(&c->mu);
    char drain[64];
    while (read(c->wake[0], drain, sizeof drain) > 0) {
    }
    fr_status st = receive_ready_locked(c, PUMP_BATCH);
    fr_client_read_monitor_locked(c);
    fr_client_sock_give_locked(c);
    return st;
}
