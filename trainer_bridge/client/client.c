/* The C client library (trainer_bridge/client/client.h). */
#include "trainer_bridge/client/client.h"

#include "base/clock.h"
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>
#include <zmq.h>

#include "trainer_bridge/client/client_internal.h"
#include "trainer_bridge/protocol/wire.h"

typedef struct item {
    fr_msg m;
    struct item *next;
} item;

typedef struct {
    uint64_t id;
    int open;               /* samples without their done */
    fr_msg_generate g;      /* what was sent (arrays owned), for fr_client_resubmit */
} pending;

/* A sample being assembled for fr_client_next_sample. */
typedef struct {
    fr_client_sample *s;
    int cap;
} partial;

struct fr_client {
    void *ctx, *sock;
    char *endpoint;
    int curve;
    char server_key[41], public_key[41], secret_key[41];
    int timeout_ms;
    int heard;              /* a message ever came back: the endpoint has a server */
    item *head, *tail;      /* results received during synchronous calls */
    pending *p;
    int n_p, cap_p;
    int open_samples;
    partial *parts;         /* samples with deltas and no done yet */
    int n_parts, cap_parts;
    /* payload frames ZeroMQ still holds (zero-copy sends of a weight update) */
    atomic_long in_flight;
    void *nccl;             /* the NCCL weight group (client_nccl.c), NULL when none */
    void *monitor;          /* PAIR: the socket monitor's events, NULL when none */
    int lost;               /* the connection to the server ended with samples open */
    fr_msg delta;           /* the tokens delta fr_client_next_event handed out last (its arrays) */
};

/* ZMTP heartbeats: a server that stops answering (killed, frozen, or its
 * host gone) closes the connection after this long. */
#define HEARTBEAT_IVL_MS 1000
#define HEARTBEAT_TIMEOUT_MS 3000

/* A generate's arrays, owned: what fr_client_resubmit sends again. */
static int *copy_ints(const int *v, int n)
{
    if (!v) return NULL;
    int *c = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (c && n > 0) memcpy(c, v, sizeof(int) * (size_t)n);
    return c;
}

static void free_generate(fr_msg_generate *g)
{
    free(g->prompt);
    free(g->stop_token_ids);
    free(g->forced_tokens);
    memset(g, 0, sizeof *g);
}

static int copy_generate(const fr_msg_generate *g, fr_msg_generate *out)
{
    *out = *g;
    out->prompt = copy_ints(g->prompt, g->n_prompt);
    out->stop_token_ids = copy_ints(g->stop_token_ids, g->n_stop_token_ids);
    out->forced_tokens = copy_ints(g->forced_tokens, g->n_forced_tokens);
    if ((g->prompt && !out->prompt) || (g->stop_token_ids && !out->stop_token_ids) ||
        (g->forced_tokens && !out->forced_tokens)) {
        free_generate(out);
        return -1;
    }
    return 0;
}

/* Makes and connects the DEALER socket (with the CURVE keys when set). */
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
    int ivl = HEARTBEAT_IVL_MS, hb = HEARTBEAT_TIMEOUT_MS, unbounded = 0;
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &hb, sizeof hb);
    /* ZeroMQ stops reading a connection whose receive queue is full, and
     * with it the heartbeats: an unbounded queue keeps a busy caller (one
     * training between reads) from looking departed to the server */
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &unbounded, sizeof unbounded);
    /* the monitor says when the connection ends (docs/failures.md): then
     * the samples open on it will never end, and the client says so */
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://fp4rollout-client-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, ep, ZMQ_EVENT_DISCONNECTED) ||
        !(c->monitor = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->monitor, ep))
        return fr_fail(FR_EIO, "client: cannot watch the connection: %s", zmq_strerror(errno));
    if (zmq_connect(c->sock, c->endpoint))
        return fr_fail(FR_EIO, "client: cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof c->timeout_ms);
    return FR_OK;
}

/* Reads the monitor's events; a disconnect with samples open marks them lost. */
static void read_monitor(fr_client *c)
{
    for (int more = 1; c->monitor && more;) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, c->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&f);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&f) == 6) memcpy(&event, zmq_msg_data(&f), 2);
        more = zmq_msg_more(&f);
        zmq_msg_close(&f);
        while (more) {   /* the event's endpoint frame */
            zmq_msg_init(&f);
            more = zmq_msg_recv(&f, c->monitor, 0) >= 0 && zmq_msg_more(&f);
            zmq_msg_close(&f);
        }
        more = 1;
        if (event == ZMQ_EVENT_DISCONNECTED && c->open_samples > 0) c->lost = 1;
    }
}

/* The error of a lost connection, naming the samples that will not end. */
static fr_status lost_error(fr_client *c)
{
    char list[600] = "";
    size_t o = 0;
    for (int i = 0; i < c->n_p && o + 64 < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s request %llu (%d of %d samples)", i ? "," : "",
                              (unsigned long long)c->p[i].id, c->p[i].open, c->p[i].g.n);
    if (o + 64 >= sizeof list) snprintf(list + o, sizeof list - o, ", ...");
    return fr_fail(FR_EIO, "client: the connection to %s was lost (the server ended, or was silent for %d ms): "
                           "%d samples will not end:%s; fr_client_resubmit sends these requests again",
                   c->endpoint, HEARTBEAT_TIMEOUT_MS, c->open_samples, list);
}

static int z85_key_ok(const char *k)
{
    uint8_t raw[32];
    return k && strlen(k) == 40 && zmq_z85_decode(raw, k) != NULL;
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

void fr_client_destroy(fr_client **pc)
{
    if (!pc || !*pc) return;
    fr_client *c = *pc;
    fr_client_nccl_free_(&c->nccl);
    for (item *i = c->head; i;) {
        item *next = i->next;
        fr_msg_free(&i->m);
        free(i);
        i = next;
    }
    for (int i = 0; i < c->n_p; i++) free_generate(&c->p[i].g);
    free(c->p);
    for (int i = 0; i < c->n_parts; i++) fr_client_sample_free(&c->parts[i].s);
    free(c->parts);
    fr_msg_free(&c->delta);
    if (c->sock) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->monitor) zmq_close(c->monitor);
    if (c->sock) zmq_close(c->sock);
    if (c->ctx) zmq_ctx_term(c->ctx);
    free(c->endpoint);
    free(c);
    *pc = NULL;
}

void fr_client_set_timeout(fr_client *c, int timeout_ms)
{
    if (!c) return;
    c->timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
    if (c->sock) zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof c->timeout_ms);
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
    free_generate(&c->p[i].g);
    c->p[i] = c->p[--c->n_p];
}

/* A server's error as the calling thread's failure (the one error store,
 * base/fr_status.h): what the client was doing, then the server's code and
 * message, which fr_client_last_error gives apart with the request id. */
static fr_status server_error(const fr_msg_error *e, const char *what)
{
    const long long id = e->has_request_id ? (long long)(e->request_id & 0x7fffffffffffffffull) : -1;
    return fr_fail_peer(FR_EINVAL, e->code, e->message, id, "%s: %s: %s", what, e->code, e->message);
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

/* Waits up to wait_ms (-1: for ever) for a message or a monitor event;
 * 1 when the socket has a message. */
static int wait_socket(fr_client *c, int wait_ms)
{
    zmq_pollitem_t it[2] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->monitor, .events = ZMQ_POLLIN}};
    const double end = fr_now_ms() + wait_ms;
    for (;;) {
        long left = wait_ms < 0 ? -1 : (long)(end - fr_now_ms());
        if (wait_ms >= 0 && left < 0) left = 0;
        int rc = zmq_poll(it, c->monitor ? 2 : 1, left);
        if (rc > 0 && (it[0].revents & ZMQ_POLLIN)) return 1;
        if (rc > 0) read_monitor(c);
        if (c->lost || (rc <= 0 && (wait_ms >= 0 && fr_now_ms() >= end))) return 0;
        if (rc < 0 && errno != EINTR) return 0;
    }
}

/* Receives and decodes one message from the socket. What the server sent
 * before the connection ended is read first; then a lost connection with
 * samples open is an error naming them. */
static fr_status recv_one(fr_client *c, int wait_ms, fr_msg *m, int *got)
{
    fr_wire_msg w;
    *got = 0;
    read_monitor(c);
    fr_status st = fr_wire_recv(c->sock, 0, 0, &w, got);
    if (!st && !*got && !c->lost && wait_ms != 0 && wait_socket(c, wait_ms))
        st = fr_wire_recv(c->sock, 0, 0, &w, got);
    if (!st && !*got && c->lost && c->open_samples > 0) return lost_error(c);
    if (st || !*got) return st;
    *got = 0;
    st = w.n_frames == 1 ? fr_msg_decode(w.frame0, w.len0, m)
                         : fr_fail(FR_EFORMAT, "client: the server sent %d frames", w.n_frames);
    fr_wire_msg_free(&w);
    if (st) return st;
    track(c, m);
    *got = 1;
    c->heard = 1;
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

/* Waits for a reply of type want to a message m already sent (kept in
 * *reply); other messages are kept for later. An error that names no
 * request is the reply to this call. */
static fr_status await_reply(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply)
{
    fr_status st;
    double end = fr_now_ms() + c->timeout_ms;
    for (;;) {
        int left = c->timeout_ms < 0 ? -1 : (int)(end - fr_now_ms());
        if (c->timeout_ms >= 0 && left <= 0 && !c->heard)
            return fr_fail(FR_EIO, "client: cannot reach a server at %s: nothing answered within %d ms "
                                   "(is fp4rollout serve running there?)",
                           c->endpoint, c->timeout_ms);
        if (c->timeout_ms >= 0 && left <= 0)
            return fr_fail(FR_EIO, "client: no %s from %s within %d ms", fr_msg_type_name(want), c->endpoint,
                           c->timeout_ms);
        fr_msg r;
        int got;
        if ((st = recv_one(c, left, &r, &got))) return st;
        if (!got) continue;
        if (r.type == want) {
            *reply = r;
            return FR_OK;
        }
        if (r.type == FR_MSG_ERROR && !r.u.error.has_request_id) {
            char what[96];
            snprintf(what, sizeof what, "server refused %s", fr_msg_type_name(m->type));
            st = server_error(&r.u.error, what);
            fr_msg_free(&r);
            return st;
        }
        if ((st = keep(c, &r))) return st;
    }
}

/* Sends m and waits for its reply (await_reply). */
static fr_status call(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply)
{
    fr_status st = send_msg(c, m);
    if (st) return st;
    return await_reply(c, m, want, reply);
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
    pending p = {.id = g->request_id, .open = g->n};
    if (copy_generate(g, &p.g)) return fr_fail(FR_ENOMEM, "client: out of memory");
    fr_status st = send_msg(c, &m);
    if (st) {
        free_generate(&p.g);
        return st;
    }
    c->p[c->n_p++] = p;
    c->open_samples += g->n;
    return FR_OK;
}

fr_status fr_client_resubmit(fr_client *c, int *n_requests)
{
    if (n_requests) *n_requests = 0;
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    read_monitor(c);
    for (int i = 0; i < c->n_p; i++) {
        /* the server starts the sample again: drop what was streamed of it */
        for (int k = 0; k < c->n_parts;)
            if (c->parts[k].s->request_id == c->p[i].id) {
                fr_client_sample_free(&c->parts[k].s);
                c->parts[k] = c->parts[--c->n_parts];
            } else k++;
        fr_msg m;
        fr_msg_init(&m, FR_MSG_GENERATE);
        m.u.generate = c->p[i].g;
        fr_status st = send_msg(c, &m);
        if (st) return st;
        c->open_samples += c->p[i].g.n - c->p[i].open;
        c->p[i].open = c->p[i].g.n;
        if (n_requests) (*n_requests)++;
    }
    c->lost = 0;
    return FR_OK;
}

int fr_client_lost(const fr_client *c) { return c ? c->lost : 0; }

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

/* ---- weight updates -------------------------------------------------------- */

int fr_client_last_error(const fr_client *c, const char **code, const char **message, long long *request_id)
{
    return c ? fr_last_error_peer(code, message, request_id) : 0;
}

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
    double end = fr_now_ms() + (c->timeout_ms < 0 ? 30000 : c->timeout_ms);
    while (atomic_load(&c->in_flight) > 0 && fr_now_ms() < end) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    if (atomic_load(&c->in_flight) == 0) return FR_OK;
    int zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(c->sock);
    c->sock = NULL;
    while (atomic_load(&c->in_flight) > 0) {   /* closing drops them promptly */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return open_socket(c);
}

/* Sends frame 0 of m followed by the payload regions, zero-copy. */
static fr_status send_with_payload(fr_client *c, const fr_msg *m, const void *const *data, const uint64_t *len,
                                   int n)
{
    char *f0;
    size_t l0;
    fr_status st = fr_msg_encode(m, &f0, &l0);
    if (st) return st;
    st = send_frame(c, f0, l0, n > 0 ? ZMQ_SNDMORE : 0);
    free(f0);
    for (int i = 0; !st && i < n; i++) {
        zmq_msg_t part;
        atomic_fetch_add(&c->in_flight, 1);
        if (zmq_msg_init_data(&part, (void *)data[i], (size_t)len[i], release_frame, &c->in_flight)) {
            atomic_fetch_sub(&c->in_flight, 1);
            return fr_fail(FR_ENOMEM, "client: cannot make a payload frame: %s", zmq_strerror(errno));
        }
        if (zmq_msg_send(&part, c->sock, i + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
            int e = errno;
            zmq_msg_close(&part);   /* releases it */
            st = fr_fail(FR_EIO, "client: sending a weight bucket failed: %s",
                         e == EAGAIN ? "timed out" : zmq_strerror(e));
        }
    }
    return st;
}

/* The server's refusal of an update message, with its code. */
static fr_status update_refused(fr_status st)
{
    const char *code, *msg;
    long long id;
    if (st == FR_EINVAL && fr_last_error_peer(&code, &msg, &id))
        return fr_fail_peer(FR_EINVAL, code, msg, id, "weight update refused by the server: %s: %s", code, msg);
    return st;
}

/* Whether the calling thread's last failure was the server's answer. */
static int refused_by_server(void) { return fr_last_error_peer(NULL, NULL, NULL); }

/* The reply to the oldest bucket in flight; after a refusal the server
 * dropped the update, so the answer to the bucket still in flight (if any)
 * is read and dropped too, keeping the first refusal as the client's last
 * error. */
static fr_status await_bucket(fr_client *c, const fr_msg *bm, int *in_flight)
{
    fr_msg r;
    fr_status st = update_refused(await_reply(c, bm, FR_MSG_UPDATE_REPLY, &r));
    (*in_flight)--;
    if (!st || !refused_by_server() || *in_flight == 0) return st;
    fr_error_copy first;
    fr_error_keep(&first);
    (void)await_reply(c, bm, FR_MSG_UPDATE_REPLY, &r);
    (*in_flight)--;
    return fr_error_restore(&first, st, NULL);
}

fr_status fr_client_update_weights(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                   const fr_client_update_opts *opts, fr_msg_update_reply *out)
{
    if (!c || !tensors || n < 1 || n > FR_PROTO_MAX_TENSORS)
        return fr_fail(FR_EINVAL, "client: update_weights needs 1 to %d tensors", FR_PROTO_MAX_TENSORS);
    const uint64_t bucket = opts && opts->bucket_bytes ? opts->bucket_bytes : FR_CLIENT_BUCKET_BYTES;
    const int corrupt = opts ? opts->corrupt_bucket : -1;
    if (bucket < 4) return fr_fail(FR_EINVAL, "client: bucket_bytes must be at least 4 (one float32)");
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    fr_msg_update_begin *b = &m.u.update_begin;
    fr_status st = fr_client_begin_tensors_(b, tensors, n, version, bucket, "update_weights");
    if (st == FR_ENOMEM) return st;
    b->partial = opts && opts->partial;
    if (!st) st = update_refused(call(c, &m, FR_MSG_UPDATE_REPLY, &r));
    if (st) {
        free(b->tensors);
        return st;
    }
    /* The buckets: pieces of at most `bucket` bytes in all, tensors in order,
     * split at element boundaries. */
    fr_msg_piece *pieces = malloc(sizeof *pieces * 1024);
    const void **data = malloc(sizeof *data * 1024);
    uint64_t *lens = malloc(sizeof *lens * 1024);
    int cap = 1024;
    if (!pieces || !data || !lens) st = fr_fail(FR_ENOMEM, "client: out of memory");
    int ti = 0, k = 0, in_flight = 0;
    uint64_t off = 0;
    fr_msg bm;
    fr_msg_init(&bm, FR_MSG_UPDATE_BUCKET);
    XXH64_state_t *h = st ? NULL : XXH64_createState();
    if (!st && !h) st = fr_fail(FR_ENOMEM, "client: out of memory");
    while (!st && ti < n) {
        int np = 0;
        uint64_t used = 0;
        XXH64_reset(h, 0);
        while (ti < n) {
            const fr_msg_tensor *x = &b->tensors[ti];
            const uint64_t es = fr_dtype_size(x->dtype), total = fr_msg_tensor_bytes(x);
            uint64_t take = total - off;
            if (take > bucket - used) take = (bucket - used) / es * es;
            if (take == 0) break;   /* this bucket is full */
            if (np == cap) {
                cap *= 2;
                fr_msg_piece *p2 = realloc(pieces, sizeof *pieces * (size_t)cap);
                if (p2) pieces = p2;
                const void **d2 = p2 ? realloc(data, sizeof *data * (size_t)cap) : NULL;
                if (d2) data = d2;
                uint64_t *l2 = d2 ? realloc(lens, sizeof *lens * (size_t)cap) : NULL;
                if (l2) lens = l2;
                if (!l2) {
                    st = fr_fail(FR_ENOMEM, "client: out of memory");
                    break;
                }
            }
            pieces[np] = (fr_msg_piece){.t = *x, .offset = off, .nbytes = take};
            data[np] = (const char *)tensors[ti].data + off;
            lens[np] = take;
            XXH64_update(h, data[np], (size_t)take);
            np++;
            used += take;
            off += take;
            if (off == total) {
                ti++;
                off = 0;
            }
        }
        if (st) break;
        bm.u.update_bucket = (fr_msg_update_bucket){.version = version, .bucket = k, .xxh64 = XXH64_digest(h),
                                                    .pieces = pieces, .n_pieces = np};
        if (k == corrupt) bm.u.update_bucket.xxh64 ^= 0x9e3779b97f4a7c15ull;
        st = send_with_payload(c, &bm, data, lens, np);
        if (!st) in_flight++;
        /* Two buckets in flight: the server stages one while the next
         * travels (and this side hashes the one after). */
        if (!st && in_flight == 2) st = await_bucket(c, &bm, &in_flight);
        k++;
    }
    while (!st && in_flight > 0) st = await_bucket(c, &bm, &in_flight);
    fr_error_copy failure;
    fr_error_keep(&failure);
    const int refused = st && refused_by_server();   /* else it failed on this side */
    if (st && in_flight > 0) {   /* failed on this side: the answer in flight must not pass for the abort's */
        for (; in_flight > 0; in_flight--) (void)await_reply(c, &bm, FR_MSG_UPDATE_REPLY, &r);
        fr_error_restore(&failure, st, NULL);
    }
    XXH64_freeState(h);
    free(pieces);
    free(data);
    free(lens);
    fr_status settled = settle_frames(c);
    if (!st && settled) st = settled;
    if (!st) {
        fr_msg cm;
        fr_msg_init(&cm, FR_MSG_UPDATE_COMMIT);
        cm.u.update_end.version = version;
        st = update_refused(call(c, &cm, FR_MSG_UPDATE_REPLY, &r));
        if (!st && out) *out = r.u.update_reply;
    } else if (!refused) {
        /* A failure on this side (the server may still stage the update):
         * tell it to drop it, best effort. */
        fr_msg am;
        fr_msg_init(&am, FR_MSG_UPDATE_ABORT);
        am.u.update_end.version = version;
        int t = c->timeout_ms;
        c->timeout_ms = t < 0 || t > 2000 ? 2000 : t;
        (void)call(c, &am, FR_MSG_UPDATE_REPLY, &r);
        c->timeout_ms = t;
        fr_error_restore(&failure, st, NULL);
    } else {
        fr_error_restore(&failure, st, NULL);   /* the server's refusal, whatever settling the frames said */
    }
    free(b->tensors);
    return st;
}

/* ---- finished samples ------------------------------------------------------ */

void fr_client_sample_free(fr_client_sample **ps)
{
    if (!ps || !*ps) return;
    fr_client_sample *s = *ps;
    free(s->token_ids);
    free(s->logprobs);
    free(s->weight_versions);
    free(s->divergence.kl);
    free(s->top_token_ids);
    free(s->top_logprobs);
    free(s->prompt_logprobs);
    free(s);
    *ps = NULL;
}

static partial *find_part(fr_client *c, uint64_t id, int sample, int add)
{
    for (int i = 0; i < c->n_parts; i++)
        if (c->parts[i].s->request_id == id && c->parts[i].s->sample == sample) return &c->parts[i];
    if (!add) return NULL;
    if (c->n_parts == c->cap_parts) {
        int cap = c->cap_parts ? c->cap_parts * 2 : 64;
        partial *v = realloc(c->parts, sizeof *v * (size_t)cap);
        if (!v) return NULL;
        c->parts = v;
        c->cap_parts = cap;
    }
    fr_client_sample *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->request_id = id;
    s->sample = sample;
    c->parts[c->n_parts] = (partial){.s = s, .cap = 0};
    return &c->parts[c->n_parts++];
}

static fr_status add_tokens(fr_client *c, const fr_msg_tokens *t)
{
    partial *p = find_part(c, t->request_id, t->sample, 1);
    if (!p) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
    fr_client_sample *s = p->s;
    if (t->start != s->n_tokens)
        return fr_fail(FR_EFORMAT, "client: request %llu sample %d: a delta starts at token %d after %d tokens",
                       (unsigned long long)t->request_id, t->sample, t->start, s->n_tokens);
    if (s->n_tokens + t->n > p->cap) {
        int cap = p->cap ? p->cap : 64;
        while (cap < s->n_tokens + t->n) cap *= 2;
        int *a = realloc(s->token_ids, sizeof(int) * (size_t)cap);
        if (a) s->token_ids = a;
        float *l = a ? realloc(s->logprobs, sizeof(float) * (size_t)cap) : NULL;
        if (l) s->logprobs = l;
        uint64_t *v = l ? realloc(s->weight_versions, sizeof(uint64_t) * (size_t)cap) : NULL;
        if (v) s->weight_versions = v;
        if (!v) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
        p->cap = cap;
    }
    memcpy(s->token_ids + s->n_tokens, t->token_ids, sizeof(int) * (size_t)t->n);
    memcpy(s->logprobs + s->n_tokens, t->logprobs, sizeof(float) * (size_t)t->n);
    memcpy(s->weight_versions + s->n_tokens, t->weight_versions, sizeof(uint64_t) * (size_t)t->n);
    s->n_tokens += t->n;
    return FR_OK;
}

/* The finished sample of a done (taken out of the partial list). */
static fr_status finish_sample(fr_client *c, fr_msg_done *d, fr_client_sample **out)
{
    partial *p = find_part(c, d->request_id, d->sample, 1);
    if (!p) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
    fr_client_sample *s = p->s;
    *p = c->parts[--c->n_parts];
    if (s->n_tokens != d->n_tokens) {
        fr_status st = fr_fail(FR_EFORMAT, "client: request %llu sample %d: %d tokens streamed, the done says %d",
                               (unsigned long long)d->request_id, d->sample, s->n_tokens, d->n_tokens);
        fr_client_sample_free(&s);
        return st;
    }
    s->group_id = d->group_id;
    snprintf(s->finish_reason, sizeof s->finish_reason, "%s", fr_wire_finish_name(d->finish_reason));
    s->n_prompt = d->n_prompt;
    s->preemptions = d->preemptions;
    s->has_ttft = d->has_ttft;
    s->ttft_ms = d->ttft_ms;
    s->total_ms = d->total_ms;
    s->divergence = d->divergence;
    s->has_seed = d->has_seed;
    s->seed = d->seed;
    d->divergence.kl = NULL;   /* moved */
    d->divergence.n_kl = 0;
    s->top_k = d->top_k;
    s->top_token_ids = d->top_token_ids;
    s->top_logprobs = d->top_logprobs;
    s->prompt_logprobs = d->prompt_logprobs;
    s->n_prompt_logprobs = d->n_prompt_logprobs;
    d->top_token_ids = NULL;   /* moved */
    d->top_logprobs = NULL;
    d->prompt_logprobs = NULL;
    *out = s;
    return FR_OK;
}

/* The loop of fr_client_next_sample and fr_client_next_event: deltas are
 * assembled into samples, and handed out too when delta is non-NULL
 * (*got 1); a done gives its finished sample (*got 2). */
static fr_status next_event(fr_client *c, int timeout_ms, fr_client_delta *delta, fr_client_sample **out, int *got)
{
    *out = NULL;
    *got = 0;
    fr_msg_free(&c->delta);   /* the arrays of the delta handed out last */
    double end = fr_now_ms() + timeout_ms;
    for (;;) {
        int left = timeout_ms < 0 ? -1 : (int)(end - fr_now_ms());
        if (timeout_ms >= 0 && left < 0) left = 0;
        fr_msg m;
        int g;
        fr_status st = fr_client_next(c, left, &m, &g);
        if (st) return st;
        if (!g) {
            if (timeout_ms >= 0 && fr_now_ms() >= end) return FR_OK;
            continue;
        }
        if (m.type == FR_MSG_TOKENS && !(st = add_tokens(c, &m.u.tokens)) && delta) {
            const fr_msg_tokens *t = &m.u.tokens;
            *delta = (fr_client_delta){.request_id = t->request_id, .sample = t->sample, .start = t->start, .n = t->n,
                                       .token_ids = t->token_ids, .logprobs = t->logprobs,
                                       .weight_versions = t->weight_versions};
            c->delta = m;   /* kept until the next call */
            *got = 1;
            return FR_OK;
        }
        if (m.type == FR_MSG_DONE && !st && !(st = finish_sample(c, &m.u.done, out))) *got = 2;
        else if (m.type == FR_MSG_ERROR)
            st = server_error(&m.u.error, m.u.error.has_request_id ? "server error about a request" : "server error");
        fr_msg_free(&m);
        if (st || *got) return st;
    }
}

fr_status fr_client_next_sample(fr_client *c, int timeout_ms, fr_client_sample **out, int *got)
{
    if (!c || !out || !got) return fr_fail(FR_EINVAL, "client: next_sample needs out and got");
    fr_status st = next_event(c, timeout_ms, NULL, out, got);
    *got = *got != 0;
    return st;
}

fr_status fr_client_next_event(fr_client *c, int timeout_ms, fr_client_delta *delta, fr_client_sample **out,
                               int *got)
{
    if (!c || !delta || !out || !got) return fr_fail(FR_EINVAL, "client: next_event needs delta, out and got");
    return next_event(c, timeout_ms, delta, out, got);
}

/* ---- JSON ------------------------------------------------------------------ */

static fr_status json_of(fr_status st, fr_msg *r, char **json)
{
    if (!st) st = fr_msg_to_json(r, json);
    if (r->type != FR_MSG_NONE) fr_msg_free(r);
    return st;
}

fr_status fr_client_hello_json(fr_client *c, const char *name, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&r, FR_MSG_NONE);
    fr_msg_init(&m, FR_MSG_HELLO);
    if (name) snprintf(m.u.hello.client, sizeof m.u.hello.client, "%s", name);
    return json_of(call(c, &m, FR_MSG_HELLO_REPLY, &r), &r, json);
}

fr_status fr_client_stats_json(fr_client *c, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&r, FR_MSG_NONE);
    fr_msg_init(&m, FR_MSG_STATS);
    return json_of(call(c, &m, FR_MSG_STATS_REPLY, &r), &r, json);
}

fr_status fr_client_pause_json(fr_client *c, fr_pause_mode mode, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&r, FR_MSG_NONE);
    fr_msg_init(&m, FR_MSG_PAUSE);
    m.u.pause.mode = mode;
    return json_of(call(c, &m, FR_MSG_PAUSE_REPLY, &r), &r, json);
}

fr_status fr_client_resume_json(fr_client *c, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg m, r;
    fr_msg_init(&r, FR_MSG_NONE);
    fr_msg_init(&m, FR_MSG_RESUME);
    return json_of(call(c, &m, FR_MSG_RESUME_REPLY, &r), &r, json);
}

fr_status fr_client_abort_json(fr_client *c, const uint64_t *ids, int n, char **json)
{
    if (!c || !json || n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "client: bad abort arguments");
    fr_msg m, r;
    fr_msg_init(&r, FR_MSG_NONE);
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.all = n == 0;
    m.u.abort.request_ids = (uint64_t *)ids;
    m.u.abort.n_request_ids = n;
    return json_of(call(c, &m, FR_MSG_ABORT_REPLY, &r), &r, json);
}

void fr_client_free_string(char *s) { free(s); }

const char *fr_client_error_text(void) { return fr_last_error(); }

/* ---- for client_nccl.c (client_internal.h) -------------------------------- */

fr_status fr_client_call_(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply)
{
    return call(c, m, want, reply);
}

fr_status fr_client_send_(fr_client *c, const fr_msg *m) { return send_msg(c, m); }

fr_status fr_client_take_(fr_client *c, int wait_ms, fr_msg_type want, const char *what, fr_msg *reply, int *got)
{
    *got = 0;
    fr_msg r;
    int g;
    fr_status st = recv_one(c, wait_ms, &r, &g);
    if (st || !g) return st;
    if (r.type == want) {
        *reply = r;
        *got = 1;
        return FR_OK;
    }
    if (r.type == FR_MSG_ERROR && !r.u.error.has_request_id) {
        char text[160];
        snprintf(text, sizeof text, "server refused %s", what);
        st = server_error(&r.u.error, text);
        fr_msg_free(&r);
        return st;
    }
    return keep(c, &r);
}

fr_status fr_client_settle_(fr_client *c, int wait_ms)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS);
    fr_status st = send_msg(c, &m);
    const double end = fr_now_ms() + wait_ms;
    while (!st) {
        const double left = end - fr_now_ms();
        if (left <= 0) return fr_fail(FR_EIO, "client: the server did not answer within %d ms", wait_ms);
        fr_msg r;
        int g = 0;
        st = recv_one(c, (int)left, &r, &g);
        if (st || !g) continue;
        if (r.type == FR_MSG_STATS_REPLY) {
            fr_msg_free(&r);
            return FR_OK;
        }
        /* Answers to earlier update or group messages are dropped; results
         * of requests are kept for their readers. */
        if (r.type == FR_MSG_UPDATE_REPLY || r.type == FR_MSG_NCCL_REPLY ||
            (r.type == FR_MSG_ERROR && !r.u.error.has_request_id)) {
            fr_msg_free(&r);
            continue;
        }
        st = keep(c, &r);
    }
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

fr_status fr_client_refused_(fr_status st) { return update_refused(st); }
int fr_client_timeout_(const fr_client *c) { return c->timeout_ms; }
void **fr_client_nccl_slot_(fr_client *c) { return &c->nccl; }
