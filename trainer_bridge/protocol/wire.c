/* ZeroMQ framing helpers (trainer_bridge/protocol/wire.h). */
#include "trainer_bridge/protocol/wire.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

void fr_wire_msg_free(fr_wire_msg *m)
{
    if (!m) return;
    free(m->frame0);
    zmq_msg_t *p = m->payload;
    for (int i = 0; i < m->n_payload; i++) zmq_msg_close(&p[i]);
    free(p);
    memset(m, 0, sizeof *m);
}

const void *fr_wire_payload(const fr_wire_msg *m, int i, size_t *len)
{
    if (len) *len = 0;
    if (!m || i < 0 || i >= m->n_payload) return NULL;
    zmq_msg_t *p = (zmq_msg_t *)m->payload + i;
    if (len) *len = zmq_msg_size(p);
    return zmq_msg_data(p);
}

/* Keeps one more payload frame (moved from part, which is left empty):
 * 0, or -1 out of memory. */
static int keep_payload(fr_wire_msg *m, zmq_msg_t *part, int *cap)
{
    if (m->n_payload == *cap) {
        int c = *cap ? *cap * 2 : 8;
        zmq_msg_t *v = realloc(m->payload, sizeof *v * (size_t)c);
        if (!v) return -1;
        m->payload = v;
        *cap = c;
    }
    zmq_msg_t *slot = (zmq_msg_t *)m->payload + m->n_payload;
    zmq_msg_init(slot);
    zmq_msg_move(slot, part);
    m->n_payload++;
    return 0;
}

/* Reads and drops what is left of a multipart message. */
static void drain(void *sock)
{
    int more = 1;
    size_t sz = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        int rc = zmq_msg_recv(&part, sock, 0);
        zmq_msg_close(&part);
        if (rc < 0) return;
        sz = sizeof more;
    }
}

fr_status fr_wire_recv(void *sock, int router, int wait_ms, fr_wire_msg *out, int *got)
{
    if (!sock || !out || !got) return fr_fail(FR_EINVAL, "wire: recv needs a socket, out and got");
    memset(out, 0, sizeof *out);
    *got = 0;
    if (wait_ms != 0) {
        zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&it, 1, wait_ms < 0 ? -1 : wait_ms);
        if (rc < 0 && errno == EINTR) return FR_OK;
        if (rc < 0) return fr_fail(FR_EIO, "wire: poll failed: %s", zmq_strerror(errno));
        if (rc == 0) return FR_OK;
    }
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, sock, ZMQ_DONTWAIT) < 0) {
        int e = errno;
        zmq_msg_close(&part);
        if (e == EAGAIN || e == EINTR) return FR_OK;
        return fr_fail(FR_EIO, "wire: receive failed: %s", zmq_strerror(e));
    }
    out->fd = zmq_msg_get(&part, ZMQ_SRCFD);   /* -1 (inproc, say) when there is no descriptor */
    if (router) {
        size_t n = zmq_msg_size(&part);
        if (n > FR_WIRE_PEER_MAX) n = FR_WIRE_PEER_MAX;
        memcpy(out->peer, zmq_msg_data(&part), n);
        out->peer_len = n;
        int more = zmq_msg_more(&part);
        zmq_msg_close(&part);
        zmq_msg_init(&part);
        if (!more) {   /* a routing id alone: an empty message */
            *got = 1;
            return FR_OK;
        }
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            int e = errno;
            zmq_msg_close(&part);
            return fr_fail(FR_EIO, "wire: receive failed: %s", zmq_strerror(e));
        }
    }
    if (out->fd < 0) out->fd = zmq_msg_get(&part, ZMQ_SRCFD);   /* a ROUTER may leave it off the routing id */
    const char *user = zmq_msg_gets(&part, "User-Id");
    if (user) snprintf(out->user_id, sizeof out->user_id, "%s", user);
    size_t n = zmq_msg_size(&part);
    out->frame0 = malloc(n ? n : 1);
    if (!out->frame0) {
        int more = zmq_msg_more(&part);
        zmq_msg_close(&part);
        if (more) drain(sock);
        return fr_fail(FR_ENOMEM, "wire: out of memory receiving %zu bytes", n);
    }
    if (n) memcpy(out->frame0, zmq_msg_data(&part), n);
    out->len0 = n;
    out->n_frames = 1;
    int more = zmq_msg_more(&part);
    zmq_msg_close(&part);
    int cap = 0;
    while (more) {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            int e = errno;
            zmq_msg_close(&part);
            fr_wire_msg_free(out);
            return fr_fail(FR_EIO, "wire: receive failed: %s", zmq_strerror(e));
        }
        more = zmq_msg_more(&part);
        if (out->n_payload < FR_WIRE_MAX_PAYLOAD && keep_payload(out, &part, &cap)) {
            zmq_msg_close(&part);
            if (more) drain(sock);
            fr_wire_msg_free(out);
            return fr_fail(FR_ENOMEM, "wire: out of memory receiving a message's frames");
        }
        zmq_msg_close(&part);
        out->n_frames++;
    }
    *got = 1;
    return FR_OK;
}

fr_status fr_wire_send(void *sock, const void *peer, size_t peer_len, const void *data, size_t len,
                       fr_wire_result *res)
{
    if (!sock || !res || (len && !data)) return fr_fail(FR_EINVAL, "wire: send needs a socket, data and res");
    *res = FR_WIRE_SENT;
    if (peer_len > 0) {
        /* With ZMQ_ROUTER_MANDATORY the routing-id frame fails (EAGAIN or
         * EHOSTUNREACH) before anything is queued, so a message goes whole
         * or not at all. */
        if (zmq_send(sock, peer, peer_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            int e = errno;
            if (e == EAGAIN || e == EINTR) *res = FR_WIRE_AGAIN;
            else if (e == EHOSTUNREACH) *res = FR_WIRE_UNREACHABLE;
            else return fr_fail(FR_EIO, "wire: send failed: %s", zmq_strerror(e));
            return FR_OK;
        }
        if (zmq_send(sock, data, len, 0) < 0)
            return fr_fail(FR_EIO, "wire: send of frame 0 failed: %s", zmq_strerror(errno));
        return FR_OK;
    }
    if (zmq_send(sock, data, len, ZMQ_DONTWAIT) < 0) {
        int e = errno;
        if (e == EAGAIN || e == EINTR) *res = FR_WIRE_AGAIN;
        else return fr_fail(FR_EIO, "wire: send failed: %s", zmq_strerror(e));
    }
    return FR_OK;
}

const char *fr_wire_peer_hex(const unsigned char *peer, size_t len, char *buf, size_t cap)
{
    if (!buf || cap == 0) return "";
    buf[0] = 0;
    size_t o = 0;
    for (size_t i = 0; i < len && o + 3 <= cap; i++) o += (size_t)snprintf(buf + o, cap - o, "%02x", peer[i]);
    return buf;
}

int fr_wire_monitor_event(void *monitor, uint16_t *event, int32_t *value)
{
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, monitor, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&f);
        return 0;
    }
    /* frame 1: 6 bytes, the event (16 bits) then its value (32 bits) */
    *event = 0;
    if (value) *value = -1;
    if (zmq_msg_size(&f) == 6) {
        memcpy(event, zmq_msg_data(&f), 2);
        if (value) memcpy(value, (char *)zmq_msg_data(&f) + 2, 4);
    }
    int more = zmq_msg_more(&f);
    zmq_msg_close(&f);
    while (more) {   /* frame 2: the endpoint */
        zmq_msg_init(&f);
        more = zmq_msg_recv(&f, monitor, 0) >= 0 && zmq_msg_more(&f);
        zmq_msg_close(&f);
    }
    return 1;
}
