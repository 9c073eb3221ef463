/* CURVE authentication: the ZAP handler that admits listed client keys
 * (docs/protocol.md, "Authentication"). */
#include "trainer_bridge/server/server_internal.h"

/* Receives one multipart request into up to cap frames: the number of
 * frames, or -1 when the context is ending or the socket fails. */
static int zap_recv(void *sock, zmq_msg_t *f, int cap)
{
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            if (errno == EINTR) continue;
            for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
            return -1;
        }
        more = zmq_msg_more(&part);
        if (n < cap) {
            zmq_msg_init(&f[n]);
            zmq_msg_move(&f[n++], &part);
        }
        zmq_msg_close(&part);
    }
    return n;
}

static int frame_is(zmq_msg_t *f, const char *s)
{
    size_t n = strlen(s);
    return zmq_msg_size(f) == n && memcmp(zmq_msg_data(f), s, n) == 0;
}

static void *zap_main(void *arg)
{
    zap_handler *z = arg;
    for (;;) {
        /* version, request id, domain, address, identity, mechanism, credentials */
        zmq_msg_t f[8];
        int n = zap_recv(z->sock, f, 8);
        if (n < 0) break;
        int ok = 0;
        if (n >= 7 && frame_is(&f[0], "1.0") && frame_is(&f[5], "CURVE") && zmq_msg_size(&f[6]) == 32)
            for (int k = 0; k < z->n_keys && !ok; k++) ok = memcmp(zmq_msg_data(&f[6]), z->keys[k], 32) == 0;
        if (!ok) {
            char key[41] = "none";
            if (n >= 7 && zmq_msg_size(&f[6]) == 32) zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
            fprintf(z->log, "serve: refused a client: %s key %s is not among the allowed keys\n",
                    n >= 6 && frame_is(&f[5], "CURVE") ? "CURVE" : "its", key);
            fflush(z->log);
        }
        /* reply: version, request id, status code, status text, user id, metadata */
        const char *code = ok ? "200" : "400", *text = ok ? "OK" : "client key not allowed";
        int sent = zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE) >= 0;
        if (sent && n >= 2) sent = zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE) >= 0;
        else if (sent) sent = zmq_send(z->sock, "", 0, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, code, 3, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, "", 0, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, "", 0, 0) >= 0;
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        if (!sent && errno == ETERM) break;
    }
    zmq_close(z->sock);
    z->sock = NULL;
    return NULL;
}

/* Makes the ROUTER socket a CURVE server with the listed client keys and
 * starts the ZAP handler; before the socket binds. */
fr_status srv_setup_curve(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    if (!zmq_has("curve"))
        return fr_fail(FR_EUNSUPPORTED, "serve: a CURVE key is configured, but this libzmq has no CURVE support");
    uint8_t secret[32];
    char pub[41];
    if (strlen(cfg->curve_secret_key) != 40 || !zmq_z85_decode(secret, cfg->curve_secret_key) ||
        zmq_curve_public(pub, cfg->curve_secret_key))
        return fr_fail(FR_EINVAL, "serve: the CURVE server secret key must be 40 Z85 characters");
    if (cfg->n_curve_client_keys < 1 || !cfg->curve_client_keys)
        return fr_fail(FR_EINVAL, "serve: a CURVE server needs at least one allowed client public key");
    zap_handler *z = &srv->zap;
    z->keys = calloc((size_t)cfg->n_curve_client_keys, sizeof *z->keys);
    if (!z->keys) return fr_fail(FR_ENOMEM, "serve: out of memory");
    for (int i = 0; i < cfg->n_curve_client_keys; i++) {
        const char *k = cfg->curve_client_keys[i];
        if (!k || strlen(k) != 40 || !zmq_z85_decode(z->keys[i], k))
            return fr_fail(FR_EINVAL, "serve: allowed client key %d is not 40 Z85 characters", i);
    }
    z->n_keys = cfg->n_curve_client_keys;
    z->log = srv->log;
    z->sock = zmq_socket(srv->zctx, ZMQ_REP);
    if (!z->sock || zmq_bind(z->sock, "inproc://zeromq.zap.01"))
        return fr_fail(FR_EIO, "serve: cannot start the ZAP handler: %s", zmq_strerror(errno));
    if (pthread_create(&z->thread, NULL, zap_main, z)) {
        zmq_close(z->sock);
        z->sock = NULL;
        return fr_fail(FR_EIO, "serve: cannot start the ZAP handler thread");
    }
    z->started = 1;
    int one = 1;
    if (zmq_setsockopt(srv->sock, ZMQ_CURVE_SERVER, &one, sizeof one) ||
        zmq_setsockopt(srv->sock, ZMQ_CURVE_SECRETKEY, cfg->curve_secret_key, 40))
        return fr_fail(FR_EIO, "serve: cannot make the socket a CURVE server: %s", zmq_strerror(errno));
    srv_log(srv, "CURVE authentication on: server public key %s, %d allowed client keys", pub, z->n_keys);
    return FR_OK;
}
