/* Connections of the ROUTER socket: ZMTP heartbeats, the message size
 * limit, and noticing a client whose connection ended (docs/protocol.md,
 * "Departed clients"). libzmq tells a ROUTER nothing when a peer goes
 * (ZMQ_ROUTER_NOTIFY is a draft option, absent from stable builds), so the
 * server watches its socket's monitor: each message carries the descriptor
 * of its connection (ZMQ_SRCFD), and a DISCONNECTED event names the
 * descriptor that closed. A connection that goes silent (a frozen or
 * unplugged client) is closed by the heartbeat timeout, so it is noticed
 * within heartbeat_timeout_ms. */
#include "trainer_bridge/server/server_internal.h"

#include <malloc.h>

/* The default limit of one frame: a weight bucket of twice the clients'
 * default bucket size (FR_CLIENT_BUCKET_BYTES, 512 MiB) is the largest
 * message a client sends; every other frame is far smaller. */
#define DEFAULT_MAX_MESSAGE ((long long)1 << 30)

long long srv_max_message_bytes(const fr_bridge_config *cfg)
{
    if (cfg->max_message_bytes > 0) return cfg->max_message_bytes;
    return DEFAULT_MAX_MESSAGE;
}

/* Before the socket binds: heartbeats, the size limit, the monitor. */
fr_status srv_conn_setup(fr_bridge_server *srv, const fr_bridge_config *cfg)
{
    int ivl = cfg->heartbeat_ms == 0 ? 1000 : cfg->heartbeat_ms > 0 ? cfg->heartbeat_ms : 0;
    int timeout = cfg->heartbeat_timeout_ms > 0 ? cfg->heartbeat_timeout_ms : 10 * ivl;
    int64_t max = srv_max_message_bytes(cfg);
    if (ivl > 0 && (zmq_setsockopt(srv->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl) ||
                    zmq_setsockopt(srv->sock, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof timeout) ||
                    zmq_setsockopt(srv->sock, ZMQ_HEARTBEAT_TTL, &timeout, sizeof timeout)))
        return fr_fail(FR_EIO, "serve: cannot set ZeroMQ heartbeats: %s", zmq_strerror(errno));
    if (zmq_setsockopt(srv->sock, ZMQ_MAXMSGSIZE, &max, sizeof max))
        return fr_fail(FR_EIO, "serve: cannot set the message size limit: %s", zmq_strerror(errno));
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://fp4rollout-serve-monitor-%p", (void *)srv);
    if (zmq_socket_monitor(srv->sock, ep, ZMQ_EVENT_DISCONNECTED) ||
        !(srv->monitor = zmq_socket(srv->zctx, ZMQ_PAIR)) || zmq_connect(srv->monitor, ep))
        return fr_fail(FR_EIO, "serve: cannot watch the socket's connections: %s", zmq_strerror(errno));
    srv->heartbeat_timeout_ms = ivl > 0 ? timeout : 0;
    return FR_OK;
}

/* Reads the monitor's events: every connection that closed makes its
 * peers gone. */
static void read_events(fr_bridge_server *srv)
{
    uint16_t event;
    int32_t fd;
    while (fr_wire_monitor_event(srv->monitor, &event, &fd))
        if (event == ZMQ_EVENT_DISCONNECTED) fr_peers_closed(srv->peers, fd);
}

void srv_conn_watch(fr_bridge_server *srv)
{
    if (srv->monitor) read_events(srv);
    srv_drop_gone_peers(srv);
}

/* A message from peer on connection fd: first the events up to now (its
 * connection's among them), then a peer whose earlier connection ended
 * loses what it had open before it is reachable on the new one. */
void srv_conn_arrived(fr_bridge_server *srv, int peer, int fd)
{
    if (srv->monitor) read_events(srv);
    fr_peers_arrived(srv->peers, peer, fd);
    srv_drop_gone_peers(srv);
    fr_peers_revive(srv->peers, peer, fd);
}

/* After a refused message of `bytes`: large refusals give their pages back
 * (glibc keeps freed heap memory otherwise). */
void srv_conn_refused(size_t bytes)
{
    if (bytes >= ((size_t)1 << 20)) malloc_trim(0);
}

void srv_conn_close(fr_bridge_server *srv)
{
    if (srv->sock) zmq_socket_monitor(srv->sock, NULL, 0);
    if (srv->monitor) zmq_close(srv->monitor);
    srv->monitor = NULL;
}
