/* ZeroMQ framing of the protocol (docs/protocol.md, "Framing"): receiving
 * one whole multipart message, with the sender's routing id on a ROUTER
 * socket, sending frame 0 to a peer without blocking, and reading a
 * socket monitor's events. Shared by the server and the client library. */
#ifndef FR_WIRE_H
#define FR_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_WIRE_PEER_MAX 255   /* a ZeroMQ routing id is 1 to 255 bytes */

typedef struct {
    unsigned char peer[FR_WIRE_PEER_MAX];   /* ROUTER: the sender's routing id */
    size_t peer_len;                        /* 0 on a DEALER socket */
    int fd;                                 /* the connection it came on (ZMQ_SRCFD), -1 when unknown */
    char user_id[16];                       /* the ZAP handler's user id for its connection ("" none), cut */
    char *frame0;                           /* malloc'ed copy of frame 0 */
    size_t len0;
    int n_frames;                           /* frames after the routing id, frame 0 included */
    void *payload;                          /* the frames after frame 0, as received (not copied) */
    int n_payload;                          /* kept: n_frames - 1, or FR_WIRE_MAX_PAYLOAD at most */
} fr_wire_msg;

#define FR_WIRE_MAX_PAYLOAD (1 << 20)   /* payload frames kept of one message; more are counted, dropped */

/* Receives one message when one is ready (router: the socket is a ROUTER and
 * the first frame is the routing id). *got is 0 when nothing was waiting
 * (or, with wait_ms > 0, nothing came within wait_ms; -1 waits forever).
 * Frames after frame 0 (the payload of update_weights_bucket) are kept as
 * ZeroMQ received them, without a copy (fr_wire_payload). FR_EIO on socket
 * failures; an interrupted wait returns FR_OK with *got 0. Free with
 * fr_wire_msg_free. */
fr_status fr_wire_recv(void *sock, int router, int wait_ms, fr_wire_msg *out, int *got);
void fr_wire_msg_free(fr_wire_msg *m);

/* Payload frame i (0: the frame after frame 0): its bytes and length;
 * NULL when there is no such frame. Valid until fr_wire_msg_free. */
const void *fr_wire_payload(const fr_wire_msg *m, int i, size_t *len);

typedef enum {
    FR_WIRE_SENT = 0,       /* queued in ZeroMQ for the peer */
    FR_WIRE_AGAIN,          /* the peer's pipe is full: nothing was sent, try later */
    FR_WIRE_UNREACHABLE     /* ROUTER: no connected peer has this routing id */
} fr_wire_result;

/* Sends one frame (to peer on a ROUTER socket; peer_len 0 on a DEALER)
 * without blocking. FR_OK with *res telling what happened, FR_EIO on any
 * other failure. */
fr_status fr_wire_send(void *sock, const void *peer, size_t peer_len, const void *data, size_t len,
                       fr_wire_result *res);

/* The routing id as hex text into buf (for logs). */
const char *fr_wire_peer_hex(const unsigned char *peer, size_t len, char *buf, size_t cap);

/* One event of a socket monitor (zmq_socket_monitor's PAIR end), without
 * waiting: *event, and *value (for ZMQ_EVENT_DISCONNECTED the connection's
 * file descriptor; value may be NULL), its endpoint frame read past.
 * 1 with an event, 0 when none is queued. */
int fr_wire_monitor_event(void *monitor, uint16_t *event, int32_t *value);

#ifdef __cplusplus
}
#endif

#endif
