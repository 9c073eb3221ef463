/* The clients of the server's ROUTER socket and their outgoing queues
 * (docs/protocol.md, "Flow control"). A peer is a routing id; each has a
 * FIFO of encoded frames, so one slow client never holds up another and
 * a client's messages keep their order. A message is handed to ZeroMQ
 * when its peer's pipe has room (ZMQ_ROUTER_MANDATORY makes a full pipe
 * fail with EAGAIN instead of dropping); until then it waits here. A peer
 * that ZeroMQ no longer knows (EHOSTUNREACH: it disconnected) is marked
 * gone: its queue is discarded and counted as undeliverable, and later
 * messages to it are counted the same way, never dropped unseen. */
#ifndef FR_PEERS_H
#define FR_PEERS_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_peers fr_peers;

/* sock: a ROUTER socket with ZMQ_ROUTER_MANDATORY set (not owned). */
fr_status fr_peers_new(void *sock, fr_peers **out);
void fr_peers_destroy(fr_peers **p);

/* The index of the peer with this routing id, added when new (a peer
 * found gone stays so: see fr_peers_revive); call it for every message
 * received. */
fr_status fr_peers_find_or_add(fr_peers *p, const unsigned char *id, size_t len, int *index);
int fr_peers_count(const fr_peers *p);
/* 1 once the peer was found gone. */
int fr_peers_gone(const fr_peers *p, int index);
/* Connections (docs/protocol.md, "Departed clients"). fr_peers_arrived:
 * the peer's message came on connection fd (ZMQ_SRCFD); when its last one
 * came on another, that connection has ended and the peer is found gone
 * (listed by fr_peers_take_gone: the caller ends its requests), and then
 * fr_peers_revive makes it reachable on fd. fr_peers_closed: connection fd
 * ended (the socket monitor said so): every peer on it is found gone;
 * returns how many. A peer found gone is never reachable again until it
 * sends on a new connection. */
void fr_peers_arrived(fr_peers *p, int index, int fd);
void fr_peers_revive(fr_peers *p, int index, int fd);
int fr_peers_closed(fr_peers *p, int fd);
/* The routing id as hex (for logs); valid until the next call. */
const char *fr_peers_name(fr_peers *p, int index);

/* Queues data (owned from now on, whatever the result) for the peer and
 * sends what its pipe takes. To a gone peer: freed and counted
 * undeliverable. FR_EIO only on an unexpected socket failure. */
fr_status fr_peers_send(fr_peers *p, int index, char *data, size_t len);

/* Sends what the pipes take, oldest first per peer. *newly_gone (may be
 * NULL) gets the number of peers found gone by this call; their indices
 * are then listed by fr_peers_take_gone. */
fr_status fr_peers_pump(fr_peers *p, int *newly_gone);
/* Peers found gone since the last call, one per call: 1 and *index, or 0. */
int fr_peers_take_gone(fr_peers *p, int *index);

/* Tries for up to ms milliseconds to empty every queue (shutdown). */
void fr_peers_flush(fr_peers *p, int ms);

typedef struct {
    uint64_t sent;            /* frames handed to ZeroMQ */
    uint64_t retries;         /* sends that found a full pipe (EAGAIN) */
    uint64_t queued;          /* frames waiting now */
    uint64_t undeliverable;   /* frames for peers found gone */
} fr_peers_stats;
void fr_peers_stats_get(const fr_peers *p, fr_peers_stats *out);

#ifdef __cplusplus
}
#endif

#endif
