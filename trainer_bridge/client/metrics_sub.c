#include "trainer_bridge/client/metrics_sub.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

struct fr_metrics_sub {
    void *ctx, *sock;
};

static int z85_key_ok(const char *k)
{
    uint8_t raw[32];
    return k && strlen(k) == 40 && zmq_z85_decode(raw, k) != NULL;
}

fr_status fr_metrics_sub_new(const char *endpoint, const fr_client_curve *keys, fr_metrics_sub **out)
{
    if (!out) return fr_fail(FR_EINVAL, "metrics subscriber: out is NULL");
    *out = NULL;
    if (!endpoint || !endpoint[0]) return fr_fail(FR_EINVAL, "metrics subscriber: no endpoint");
    if (keys && (!z85_key_ok(keys->server_public_key) || !z85_key_ok(keys->public_key) || !z85_key_ok(keys->secret_key)))
        return fr_fail(FR_EINVAL, "metrics subscriber: CURVE keys must be 40 Z85 characters each");
    fr_metrics_sub *s = calloc(1, sizeof *s);
    if (!s) return fr_fail(FR_ENOMEM, "metrics subscriber: out of memory");
    s->ctx = zmq_ctx_new();
    s->sock = s->ctx ? zmq_socket(s->ctx, ZMQ_SUB) : NULL;
    int zero = 0;
    fr_status st = FR_OK;
    if (!s->sock || zmq_setsockopt(s->sock, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(s->sock, ZMQ_SUBSCRIBE, FR_METRICS_TOPIC, strlen(FR_METRICS_TOPIC))) {
        st = fr_fail(FR_EIO, "metrics subscriber: cannot make a SUB socket: %s", zmq_strerror(errno));
    } else if (keys && (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVERKEY, keys->server_public_key, 40) ||
                        zmq_setsockopt(s->sock, ZMQ_CURVE_PUBLICKEY, keys->public_key, 40) ||
                        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, keys->secret_key, 40))) {
        st = fr_fail(FR_EIO, "metrics subscriber: cannot set the CURVE keys: %s", zmq_strerror(errno));
    } else if (zmq_connect(s->sock, endpoint)) {
        st = fr_fail(FR_EINVAL, "metrics subscriber: cannot connect to %s: %s", endpoint, zmq_strerror(errno));
    }
    if (st) {
        fr_metrics_sub_destroy(&s);
        return st;
    }
    *out = s;
    return FR_OK;
}

/* Receives one frame into a new message; 0 on success, -1 with errno. */
static int recv_frame(void *sock, zmq_msg_t *m, int flags)
{
    zmq_msg_init(m);
    if (zmq_msg_recv(m, sock, flags) >= 0) return 0;
    int e = errno;
    zmq_msg_close(m);
    errno = e;
    return -1;
}

fr_status fr_metrics_sub_next(fr_metrics_sub *s, int timeout_ms, char **json)
{
    if (!json) return fr_fail(FR_EINVAL, "fr_metrics_sub_next: json is NULL");
    *json = NULL;
    if (!s) return fr_fail(FR_EINVAL, "fr_metrics_sub_next: subscriber is NULL");
    for (;;) {
        zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, timeout_ms < 0 ? -1 : timeout_ms);
        if (n < 0) return fr_fail(FR_EIO, "metrics subscriber: poll failed: %s", zmq_strerror(errno));
        if (n == 0) return FR_OK;   /* timed out */
        zmq_msg_t topic, body;
        if (recv_frame(s->sock, &topic, 0)) return fr_fail(FR_EIO, "metrics subscriber: receive failed: %s", zmq_strerror(errno));
        int more = zmq_msg_more(&topic);
        zmq_msg_close(&topic);
        if (!more) continue;   /* not a snapshot: skip it */
        if (recv_frame(s->sock, &body, 0)) return fr_fail(FR_EIO, "metrics subscriber: receive failed: %s", zmq_strerror(errno));
        while (zmq_msg_more(&body)) {   /* a longer message than a snapshot: drain and skip it */
            zmq_msg_close(&body);
            if (recv_frame(s->sock, &body, 0)) return fr_fail(FR_EIO, "metrics subscriber: receive failed: %s", zmq_strerror(errno));
            if (!zmq_msg_more(&body)) {
                zmq_msg_close(&body);
                goto next;
            }
        }
        fr_status st = fr_msgpack_to_json(zmq_msg_data(&body), zmq_msg_size(&body), json);
        zmq_msg_close(&body);
        return st;
    next:;
    }
}

void fr_metrics_sub_destroy(fr_metrics_sub **ps)
{
    if (!ps || !*ps) return;
    fr_metrics_sub *s = *ps;
    if (s->sock) zmq_close(s->sock);
    if (s->ctx) zmq_ctx_term(s->ctx);
    free(s);
    *ps = NULL;
}
