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

/* One line per refused handshake, at most one a second: a flood of
 * refusals writes one line a second, saying how many went unlogged. */
static void log_refusal(zap_handler *z, int n, zmq_msg_t *f)
{
    const double now = fr_now_ms();
    if (z->last_refusal_ms > 0 && now - z->last_refusal_ms < 1000.0) {
        z->refusals_unlogged++;
        return;
    }
    char key[41] = "none";
    if (n >= 7 && zmq_msg_size(&f[6]) == 32) zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
    fprintf(z->log, "serve: refused a client: %s key %s is not among the allowed keys", n >= 6 && frame_is(&f[5], "CURVE") ? "CURVE" : "its",
            key);
    if (z->refusals_unlogged) fprintf(z->log, " (and %lld more refused in the second before)", z->refusals_unlogged);
    fprintf(z->log, "\n");
    fflush(z->log);
    z->refusals_unlogged = 0;
    z->last_refusal_ms = now;
}

static void *zap_main(void *arg)
{
    zap_handler *z = arg;
    for (;;) {
        /* version, request id, domain, address, identity, mechanism, credentials */
        zmq_msg_t f[8];
        int n = zap_recv(z->sock, f, 8);
        if (n < 0) break;
        int ok = 0, trainer = 0;
        if (n >= 7 && frame_is(&f[0], "1.0") && frame_is(&f[5], "CURVE") && zmq_msg_size(&f[6]) == 32)
            for (int k = 0; k < z->n_keys && !ok; k++)
                if (memcmp(zmq_msg_data(&f[6]), z->keys[k], 32) == 0) {
                    ok = 1;
                    trainer = k < z->n_trainers;
                }
        if (!ok) log_refusal(z, n, f);
        /* reply: version, request id, status code, status text, user id, metadata */
        const char *code = ok ? "200" : "400", *text = ok ? "OK" : "client key not allowed";
        int sent = zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE) >= 0;
        if (sent && n >= 2) sent = zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE) >= 0;
        else if (sent) sent = zmq_send(z->sock, "", 0, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, code, 3, ZMQ_SNDMORE) >= 0;
        if (sent) sent = zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE) >= 0;
        /* the user id names the role; the server reads it off each message (User-Id) */
        const char *user = ok ? (trainer ? "trainer" : "rollout") : "";
        if (sent) sent = zmq_send(z->sock, user, strlen(user), ZMQ_SNDMORE) >= 0;
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
    const int nt = cfg->curve_trainer_keys ? cfg->n_curve_trainer_keys : 0;
    const int nc = cfg->curve_client_keys ? cfg->n_curve_client_keys : 0;
    if (nt + nc < 1) return fr_fail(FR_EINVAL, "serve: a CURVE server needs at least one allowed client public key");
    zap_handler *z = &srv->zap;
    z->keys = calloc((size_t)(nt + nc), sizeof *z->keys);
    if (!z->keys) return fr_fail(FR_ENOMEM, "serve: out of memory");
    /* trainers first: keys[0, n_trainers) have the trainer role; none
     * listed: every client key has it (as before roles existed) */
    for (int i = 0; i < nt + nc; i++) {
        const char *k = i < nt ? cfg->curve_trainer_keys[i] : cfg->curve_client_keys[i - nt];
        if (!k || strlen(k) != 40 || !zmq_z85_decode(z->keys[i], k))
            return fr_fail(FR_EINVAL, "serve: allowed %s key %d is not 40 Z85 characters", i < nt ? "trainer" : "client",
                           i < nt ? i : i - nt);
    }
    z->n_keys = nt + nc;
    z->n_trainers = nt > 0 ? nt : nt + nc;
    srv->roles = nt > 0;
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
    srv_log(srv, "CURVE authentication on: server public key %s, %d allowed client keys, %d with the trainer role%s", pub,
            z->n_keys, z->n_trainers, nt > 0 ? "" : " (no trainer_public_keys: every client key is a trainer)");
    return FR_OK;
}
