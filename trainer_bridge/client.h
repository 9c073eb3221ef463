/* The C client of the trainer bridge (libfp4rollout_client; docs/protocol.md).
 * It needs nothing but libzmq, msgpack-c and the protocol codec.
 *
 *     fr_client *c;
 *     fr_client_new("tcp://127.0.0.1:5555", &c);
 *     fr_msg_hello_reply info;
 *     fr_client_hello(c, "my-trainer", &info);
 *     fr_client_generate(c, &request);            // returns at once
 *     while (fr_client_open_samples(c) > 0)
 *         fr_client_dispatch(c, &handlers, 1000, NULL);   // callbacks ...
 *     // ... or poll: fr_client_next(c, 1000, &msg, &got), then fr_msg_free
 *     fr_client_destroy(&c);
 *
 * Results (tokens, done, and errors about a request) arrive asynchronously.
 * The synchronous calls (hello, abort, pause, resume, stats) wait for their
 * reply; whatever else arrives meanwhile is kept, in order, for the next
 * fr_client_next or fr_client_dispatch. One client is used by one thread at
 * a time. */
#ifndef FR_CLIENT_H
#define FR_CLIENT_H

#include "protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_client fr_client;

/* Connects a DEALER socket to endpoint (ZeroMQ connects lazily: a server
 * that is not up yet is reached when it is). */
fr_status fr_client_new(const char *endpoint, fr_client **out);
void fr_client_destroy(fr_client **c);

/* How long synchronous calls and sends wait, in ms (default 30000). */
void fr_client_set_timeout(fr_client *c, int timeout_ms);

fr_status fr_client_hello(fr_client *c, const char *name, fr_msg_hello_reply *out);
fr_status fr_client_stats(fr_client *c, fr_msg_stats_reply *out);
/* Pause: abort mode ends the samples in flight now (their done messages
 * come first); wait mode returns once the engine has finished them. */
fr_status fr_client_pause(fr_client *c, fr_pause_mode mode, fr_msg_pause_reply *out);
fr_status fr_client_resume(fr_client *c, fr_msg_resume_reply *out);

/* Sends a generate. FR_EINVAL when request_id is already open on this
 * client (ids must be unique among open requests) or the message is
 * invalid; nothing is sent then. */
fr_status fr_client_generate(fr_client *c, const fr_msg_generate *g);

/* Aborts the given requests (n >= 1), or every open request of this
 * client (ids NULL, n 0), and waits for the reply: *samples_ended (may be
 * NULL) gets the samples it ended, *not_found (may be NULL) the number of
 * ids the server had no open request for (finished already, or unknown).
 * The done messages of the ended samples arrive before the reply. */
fr_status fr_client_abort(fr_client *c, const uint64_t *ids, int n, int *samples_ended, int *not_found);

/* Samples this client sent and has not seen the done of (requests the
 * server refused with an error are not counted). */
int fr_client_open_samples(const fr_client *c);

/* Polling: the next tokens, done or error message, waiting up to
 * timeout_ms (0: do not wait, -1: forever). *got 0 when none came. The
 * caller frees *out with fr_msg_free. */
fr_status fr_client_next(fr_client *c, int timeout_ms, fr_msg *out, int *got);

/* Sends bytes as frame 0, unchecked, followed by extra_frames empty
 * frames: for testing how a server handles malformed messages. */
fr_status fr_client_send_raw(fr_client *c, const void *data, size_t len, int extra_frames);

typedef struct {
    void (*on_tokens)(void *user, const fr_msg_tokens *t);
    void (*on_done)(void *user, const fr_msg_done *d);
    void (*on_error)(void *user, const fr_msg_error *e);   /* errors about requests */
    void *user;
} fr_client_handlers;

/* Callbacks: hands every message that is ready to its handler (a NULL
 * handler skips it); waits up to timeout_ms for the first one. *handled
 * (may be NULL) gets the count. Callbacks may call fr_client_generate but
 * not the synchronous calls. */
fr_status fr_client_dispatch(fr_client *c, const fr_client_handlers *h, int timeout_ms, int *handled);

#ifdef __cplusplus
}
#endif

#endif
