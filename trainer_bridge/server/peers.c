/* Peers of the server's ROUTER socket and their send queues
 * (trainer_bridge/server/peers.h). */
#include "trainer_bridge/server/peers.h"

#include "base/clock.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "trainer_bridge/protocol/wire.h"

typedef struct frame {
    char *data;
    size_t len;
    struct frame *next;
} frame;

typedef struct {
    unsigned char id[FR_WIRE_PEER_MAX];
    size_t id_len;
    frame *head, *tail;
    int gone, reported;
    int fd;                  /* the connection its last message came on (ZMQ_SRCFD), -1 unknown */
} peer;

struct fr_peers {
    void *sock;
    peer *v;
    int n, cap;
    int *gone_list;          /* found gone, not yet taken */
    int n_gone, cap_gone;
    fr_peers_stats st;
    char name[2 * FR_WIRE_PEER_MAX + 1];
};

fr_status fr_peers_new(void *sock, fr_peers **out)
{
    if (!out) return fr_fail(FR_EINVAL, "peers: out is NULL");
    *out = NULL;
    if (!sock) return fr_fail(FR_EINVAL, "peers: socket is NULL");
    fr_peers *p = calloc(1, sizeof *p);
    if (!p) return fr_fail(FR_ENOMEM, "peers: out of memory");
    p->sock = sock;
    *out = p;
    return FR_OK;
}

static void drop_queue(fr_peers *p, peer *q)
{
    for (frame *f = q->head; f;) {
        frame *next = f->next;
        free(f->data);
        free(f);
        p->st.queued--;
        p->st.undeliverable++;
        f = next;
    }
    q->head = q->tail = NULL;
}

void fr_peers_destroy(fr_peers **pp)
{
    if (!pp || !*pp) return;
    fr_peers *p = *pp;
    for (int i = 0; i < p->n; i++) drop_queue(p, &p->v[i]);
    free(p->v);
    free(p->gone_list);
    free(p);
    *pp = NULL;
}

fr_status fr_peers_find_or_add(fr_peers *p, const unsigned char *id, size_t len, int *index)
{
    if (!p || !id || !index || len == 0 || len > FR_WIRE_PEER_MAX)
        return fr_fail(FR_EINVAL, "peers: bad routing id (%zu bytes)", len);
    for (int i = 0; i < p->n; i++)
        if (p->v[i].id_len == len && memcmp(p->v[i].id, id, len) == 0) {
            *index = i;
            return FR_OK;
        }
    if (p->n == p->cap) {
        int c = p->cap ? p->cap * 2 : 8;
        peer *v = realloc(p->v, sizeof *v * (size_t)c);
        if (!v) return fr_fail(FR_ENOMEM, "peers: out of memory");
        p->v = v;
        p->cap = c;
    }
    peer *q = &p->v[p->n];
    memset(q, 0, sizeof *q);
    memcpy(q->id, id, len);
    q->id_len = len;
    q->fd = -1;
    *index = p->n++;
    return FR_OK;
}

int fr_peers_count(const fr_peers *p) { return p ? p->n : 0; }

int fr_peers_gone(const fr_peers *p, int index) { return p && index >= 0 && index < p->n && p->v[index].gone; }

const char *fr_peers_name(fr_peers *p, int index)
{
    if (!p || index < 0 || index >= p->n) return "?";
    return fr_wire_peer_hex(p->v[index].id, p->v[index].id_len, p->name, sizeof p->name);
}

static void mark_gone(fr_peers *p, int index)
{
    peer *q = &p->v[index];
    if (q->gone) return;
    q->gone = 1;
    q->fd = -1;
    drop_queue(p, q);
    if (p->n_gone == p->cap_gone) {
        int c = p->cap_gone ? p->cap_gone * 2 : 8;
        int *g = realloc(p->gone_list, sizeof *g * (size_t)c);
        if (!g) return;   /* still marked gone; only the report is lost */
        p->gone_list = g;
        p->cap_gone = c;
    }
    p->gone_list[p->n_gone++] = index;
}

/* Sends the peer's queue while its pipe takes frames: 1 when the peer was
 * found gone, 0 otherwise, or -1 with fr_fail on a socket failure. */
static int pump_one(fr_peers *p, int index)
{
    peer *q = &p->v[index];
    while (q->head) {
        fr_wire_result r;
        if (fr_wire_send(p->sock, q->id, q->id_len, q->head->data, q->head->len, &r)) return -1;
        if (r == FR_WIRE_AGAIN) {
            p->st.retries++;
            return 0;
        }
        if (r == FR_WIRE_UNREACHABLE) {
            mark_gone(p, index);
            return 1;
        }
        frame *f = q->head;
        q->head = f->next;
        if (!q->head) q->tail = NULL;
        free(f->data);
        free(f);
        p->st.queued--;
        p->st.sent++;
    }
    return 0;
}

fr_status fr_peers_send(fr_peers *p, int index, char *data, size_t len)
{
    if (!p || index < 0 || index >= p->n || !data) {
        free(data);
        return fr_fail(FR_EINVAL, "peers: bad send (peer %d)", index);
    }
    peer *q = &p->v[index];
    if (q->gone) {
        free(data);
        p->st.undeliverable++;
        return FR_OK;
    }
    frame *f = malloc(sizeof *f);
    if (!f) {
        free(data);
        p->st.undeliverable++;
        return fr_fail(FR_ENOMEM, "peers: out of memory queueing a message for %s", fr_peers_name(p, index));
    }
    *f = (frame){.data = data, .len = len};
    if (q->tail) q->tail->next = f;
    else q->head = f;
    q->tail = f;
    p->st.queued++;
    return pump_one(p, index) < 0 ? FR_EIO : FR_OK;
}

void fr_peers_arrived(fr_peers *p, int index, int fd)
{
    if (!p || index < 0 || index >= p->n || fd < 0) return;
    peer *q = &p->v[index];
    /* ZeroMQ gives a routing id to one live connection at a time: a message
     * on another connection means the one this peer had has ended */
    if (!q->gone && q->fd >= 0 && q->fd != fd) mark_gone(p, index);
}

void fr_peers_revive(fr_peers *p, int index, int fd)
{
    if (!p || index < 0 || index >= p->n) return;
    p->v[index].gone = 0;
    if (fd >= 0) p->v[index].fd = fd;
}

int fr_peers_closed(fr_peers *p, int fd)
{
    int n = 0;
    for (int i = 0; p && fd >= 0 && i < p->n; i++)
        if (!p->v[i].gone && p->v[i].fd == fd) {
            mark_gone(p, i);
            n++;
        }
    return n;
}

fr_status fr_peers_pump(fr_peers *p, int *newly_gone)
{
    if (newly_gone) *newly_gone = 0;
    if (!p) return fr_fail(FR_EINVAL, "peers: NULL");
    /* peers found gone by a send or a closed connection since the last
     * pump count too: their requests must end even when nothing is queued */
    if (newly_gone) *newly_gone = p->n_gone;
    if (p->st.queued == 0) return FR_OK;
    for (int i = 0; i < p->n; i++) {
        if (!p->v[i].head) continue;
        int r = pump_one(p, i);
        if (r < 0) return FR_EIO;
    }
    if (newly_gone) *newly_gone = p->n_gone;
    return FR_OK;
}

int fr_peers_take_gone(fr_peers *p, int *index)
{
    if (!p || p->n_gone == 0) return 0;
    *index = p->gone_list[0];
    memmove(p->gone_list, p->gone_list + 1, sizeof(int) * (size_t)(p->n_gone - 1));
    p->n_gone--;
    return 1;
}

void fr_peers_flush(fr_peers *p, int ms)
{
    if (!p) return;
    double end = fr_now_ms() + ms;
    while (p->st.queued > 0) {
        if (fr_peers_pump(p, NULL)) return;
        if (p->st.queued == 0 || fr_now_ms() >= end) return;
        struct timespec nap = {0, 2000000};
        nanosleep(&nap, NULL);
    }
}

void fr_peers_stats_get(const fr_peers *p, fr_peers_stats *out)
{
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (p) *out = p->st;
}
