/* In-process clients (server.h, fr_bridge_server_local_open): the HTTP API
 * of the same process talks to the serve loop through here. Its messages
 * are the protocol's own frames, queued by any thread and handled by the
 * loop exactly as a ZeroMQ client's (srv_handle_message), each local
 * client a peer of its own; what the server sends such a peer goes to the
 * sink on the loop's thread instead of the socket. Commands beyond the
 * protocol (releasing memory, flushing the cache) are queued the same way
 * and run between engine steps. */
#include "trainer_bridge/server/server_internal.h"

#include <sys/eventfd.h>
#include <unistd.h>

/* One queued message or command. */
typedef struct item {
    int client, trainer;
    int is_cmd;
    fr_bridge_cmd cmd;
    char *frame0;
    size_t len0;
    zmq_msg_t *payload;
    int n_payload;
    struct item *next;
} item;

struct srv_local {
    fr_bridge_local_sink sink;
    int n_clients;
    int *peer;               /* [n_clients]: the peer index of each client */
    int efd;                 /* eventfd: the loop's poll wakes when something is queued */
    pthread_mutex_t mu;
    item *head, *tail;
    int closed;              /* the loop has ended: sends are refused */
};

/* A local peer's routing id: a zero first byte and more than 5 bytes, which
 * no ZeroMQ client can have (generated ids are 5 bytes; ids a client sets
 * may not start with a zero byte). */
static size_t local_id(int client, unsigned char *id)
{
    int n = snprintf((char *)id + 1, FR_WIRE_PEER_MAX - 1, "local-%d", client);
    id[0] = 0;
    return (size_t)n + 1;
}

fr_status fr_bridge_server_local_open(fr_bridge_server *srv, int n_clients, const fr_bridge_local_sink *sink)
{
    if (!srv || n_clients < 1 || n_clients > 1024 || !sink || !sink->on_msg || !sink->on_command)
        return fr_fail(FR_EINVAL, "serve: local clients need a server, 1 to 1024 clients and a sink");
    if (srv->local) return fr_fail(FR_EINVAL, "serve: local clients are already open");
    if (!srv->peers) return fr_fail(FR_EINVAL, "serve: local clients talk to world rank 0 only");
    srv_local *l = calloc(1, sizeof *l);
    int *peer = l ? calloc((size_t)n_clients, sizeof(int)) : NULL;
    if (!l || !peer) {
        free(l);
        free(peer);
        return fr_fail(FR_ENOMEM, "serve: out of memory");
    }
    l->sink = *sink;
    l->n_clients = n_clients;
    l->peer = peer;
    l->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->efd < 0) {
        free(peer);
        free(l);
        return fr_fail(FR_EIO, "serve: cannot make an eventfd: %s", strerror(errno));
    }
    pthread_mutex_init(&l->mu, NULL);
    for (int c = 0; c < n_clients; c++) {
        unsigned char id[FR_WIRE_PEER_MAX];
        size_t len = local_id(c, id);
        fr_status st = fr_peers_find_or_add(srv->peers, id, len, &l->peer[c]);
        if (st) {
            srv->local = l;
            srv_local_close(srv);
            return st;
        }
    }
    srv->local = l;
    return FR_OK;
}

static void free_item(item *it)
{
    free(it->frame0);
    for (int i = 0; i < it->n_payload; i++) zmq_msg_close(&it->payload[i]);
    free(it->payload);
    free(it);
}

static fr_status enqueue(fr_bridge_server *srv, item *it)
{
    srv_local *l = srv->local;
    pthread_mutex_lock(&l->mu);
    const int closed = l->closed;
    if (!closed) {
        if (l->tail) l->tail->next = it;
        else l->head = it;
        l->tail = it;
    }
    pthread_mutex_unlock(&l->mu);
    if (closed) {
        free_item(it);
        return fr_fail(FR_EIO, "the server is shutting down");
    }
    uint64_t one = 1;
    ssize_t w = write(l->efd, &one, sizeof one);   /* EAGAIN: the counter is full, so the loop wakes anyway */
    (void)w;
    return FR_OK;
}

fr_status fr_bridge_server_local_send(fr_bridge_server *srv, int client, int trainer, const void *frame0,
                                      size_t len0, const fr_bridge_frame *payload, int n_payload)
{
    if (!srv || !srv->local || client < 0 || client >= srv->local->n_clients || !frame0 || n_payload < 0 ||
        (n_payload > 0 && !payload))
        return fr_fail(FR_EINVAL, "serve: bad local message");
    item *it = calloc(1, sizeof *it);
    if (it) it->frame0 = malloc(len0 ? len0 : 1);
    if (it && it->frame0 && n_payload) it->payload = calloc((size_t)n_payload, sizeof(zmq_msg_t));
    if (!it || !it->frame0 || (n_payload && !it->payload)) {
        if (it) free(it->frame0);
        free(it);
        return fr_fail(FR_ENOMEM, "serve: out of memory queueing a local message");
    }
    memcpy(it->frame0, frame0, len0);
    it->len0 = len0;
    it->client = client;
    it->trainer = trainer;
    /* the payload is the sender's memory, not copied: it stays valid until
     * the server answers the message (the sender waits for that) */
    for (int i = 0; i < n_payload; i++) {
        zmq_msg_init_data(&it->payload[i], (void *)payload[i].data, payload[i].len, NULL, NULL);
        it->n_payload++;
    }
    return enqueue(srv, it);
}

fr_status fr_bridge_server_local_command(fr_bridge_server *srv, int client, const fr_bridge_cmd *cmd)
{
    if (!srv || !srv->local || client < 0 || client >= srv->local->n_clients || !cmd)
        return fr_fail(FR_EINVAL, "serve: bad local command");
    item *it = calloc(1, sizeof *it);
    if (!it) return fr_fail(FR_ENOMEM, "serve: out of memory queueing a local command");
    it->client = client;
    it->is_cmd = 1;
    it->cmd = *cmd;
    return enqueue(srv, it);
}

int srv_local_client_of(const fr_bridge_server *srv, int peer)
{
    const srv_local *l = srv->local;
    for (int c = 0; l && c < l->n_clients; c++)
        if (l->peer[c] == peer) return c;
    return -1;
}

void srv_local_deliver(fr_bridge_server *srv, int client, const fr_msg *m)
{
    srv->local->sink.on_msg(srv->local->sink.user, client, m);
}

/* ---- commands ---------------------------------------------------------------- */

static void answer(fr_bridge_server *srv, int client, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void answer(fr_bridge_server *srv, int client, const char *code, const char *fmt, ...)
{
    char msg[FR_PROTO_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    srv->local->sink.on_command(srv->local->sink.user, client, code, msg);
}

/* Memory can be given back only by an idle engine of one rank: its KV
 * pages hold nothing then. */
static int memory_refused(fr_bridge_server *srv, int client, const char *what)
{
    if (srv->multi) {
        answer(srv, client, "unsupported", "%s: serving on several ranks keeps its memory (one rank only)", what);
        return 1;
    }
    if (!fr_scheduler_idle(srv->sch) || srv_engine_samples(srv) > 0) {
        answer(srv, client, "busy", "%s: the engine has samples in flight; pause it first (pause_generation)", what);
        return 1;
    }
    return 0;
}

static void run_command(fr_bridge_server *srv, int client, const fr_bridge_cmd *c)
{
    switch (c->kind) {
    case FR_BRIDGE_CMD_FLUSH_CACHE:
        /* Prompt pages are shared within a request only: an idle engine
         * holds no page, so there is nothing to drop. */
        if (srv->multi ? srv_engine_samples(srv) > 0 : !fr_scheduler_idle(srv->sch))
            answer(srv, client, "busy", "flush_cache: requests are open; the cache holds their pages");
        else answer(srv, client, "ok", "the KV cache holds no pages");
        return;
    case FR_BRIDGE_CMD_RELEASE_MEMORY:
        if (memory_refused(srv, client, "release_memory_occupation")) return;
        if (srv->released) {
            answer(srv, client, "ok", "already released");
            return;
        }
        if (fr_session_release_memory(srv->sess, c->weights)) {
            answer(srv, client, "failed", "%s", fr_last_error());
            return;
        }
        srv->released = 1 + (c->weights != 0);
        srv_log(srv, "memory released (KV cache%s): generates are refused until it is resumed",
                c->weights ? " and weights" : "");
        answer(srv, client, "ok", "released the KV cache%s", c->weights ? " and the weights" : "");
        return;
    case FR_BRIDGE_CMD_RESUME_MEMORY:
        if (!srv->released) {
            answer(srv, client, "ok", "nothing was released");
            return;
        }
        if (fr_session_resume_memory(srv->sess)) {
            answer(srv, client, "failed", "%s", fr_last_error());
            return;
        }
        srv->released = 0;
        srv_log(srv, "memory resumed: serving");
        answer(srv, client, "ok", "resumed");
        return;
    }
    answer(srv, client, "bad_command", "unknown command %d", (int)c->kind);
}

/* ---- the loop's side ------------------------------------------------------------ */

void srv_local_drain(fr_bridge_server *srv, const volatile sig_atomic_t *stop, int at_barrier)
{
    srv_local *l = srv->local;
    if (!l) return;
    uint64_t v;
    ssize_t r = read(l->efd, &v, sizeof v);   /* EAGAIN: nothing was signalled since */
    (void)r;
    for (int k = 0; k < 4096 && !*stop && !(at_barrier && srv->turn_barrier); k++) {
        pthread_mutex_lock(&l->mu);
        item *it = l->head;
        if (it) {
            l->head = it->next;
            if (!l->head) l->tail = NULL;
        }
        pthread_mutex_unlock(&l->mu);
        if (!it) return;
        if (it->is_cmd) {
            run_command(srv, it->client, &it->cmd);
        } else {
            fr_wire_msg w = {.fd = -1, .frame0 = it->frame0, .len0 = it->len0, .n_frames = 1 + it->n_payload,
                             .payload = it->payload, .n_payload = it->n_payload};
            w.peer_len = local_id(it->client, w.peer);
            snprintf(w.user_id, sizeof w.user_id, "%s", it->trainer ? "trainer" : "rollout");
            srv_handle_message(srv, &w);
            it->frame0 = NULL;
            it->payload = NULL;
            it->n_payload = 0;
            fr_wire_msg_free(&w);
        }
        free_item(it);
    }
    /* more than one turn's share is waiting: wake the next poll at once */
    uint64_t one = 1;
    ssize_t w = write(l->efd, &one, sizeof one);
    (void)w;
}

int srv_poll(fr_bridge_server *srv, long wait_ms)
{
    zmq_pollitem_t it[2] = {{.socket = srv->sock, .events = ZMQ_POLLIN},
                            {.socket = NULL, .fd = srv->local ? srv->local->efd : -1, .events = ZMQ_POLLIN}};
    return zmq_poll(it, srv->local ? 2 : 1, wait_ms);
}

void srv_local_close(fr_bridge_server *srv)
{
    srv_local *l = srv->local;
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    item *it = l->head;
    l->head = l->tail = NULL;
    pthread_mutex_unlock(&l->mu);
    while (it) {
        item *next = it->next;
        free_item(it);
        it = next;
    }
}

void srv_local_destroy(fr_bridge_server *srv)
{
    srv_local *l = srv->local;
    if (!l) return;
    srv_local_close(srv);
    close(l->efd);
    pthread_mutex_destroy(&l->mu);
    free(l->peer);
    free(l);
    srv->local = NULL;
}
