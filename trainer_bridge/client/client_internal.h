/* What the C client's files share (client.c: the connection, the receiver
 * and the routing; client_requests.c: the request table; client_calls.c:
 * calls answered by a reply;
 * client_results.c: results by request; client_update.c and client_nccl.c:
 * weight updates); not part of the public API.
 *
 * Locking: every field below is guarded by `mu`. The socket is used by one
 * thread at a time, the one that set `sock_busy`; a thread that polls it
 * releases `mu` meanwhile, so other threads can read what was routed to
 * them, and one that needs the socket wakes the poller through the `wake`
 * pipe (client.c, "The socket"). Functions named *_locked expect `mu` held;
 * the others take it. */
#ifndef FR_CLIENT_INTERNAL_H
#define FR_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "trainer_bridge/client/client.h"

/* A received result (tokens, done, or an error naming a request) until a
 * reader takes it; also a reply nobody waits for (`stray`). */
typedef struct item {
    fr_msg m;
    uint64_t seq;                /* arrival order */
    struct req *q;               /* the open request it is about; NULL for none */
    struct item *prev, *next;    /* every waiting result, in arrival order */
    struct item *rnext;          /* the next result of the same request */
} item;

/* A request this client sent whose samples are not all handed out. */
typedef struct req {
    uint64_t id;
    int unreceived;              /* samples whose done has not arrived */
    int undelivered;             /* samples whose done the caller has not taken */
    int owned;                   /* its results go only to readers that name it */
    int discarded;               /* the caller gave it up: what arrives for it is dropped */
    int lost;                    /* sent on a connection that ended with samples still to come */
    fr_msg_generate g;           /* what was sent (arrays owned), for fr_client_resubmit */
    item *first, *last;          /* its results not yet taken */
    unsigned long counted;       /* the count (client's count_gen) that last took it: each once */
} req;

/* A call waiting for its reply; in the order the calls were sent. */
typedef struct ticket {
    fr_msg_type want;
    int state;                   /* TICKET_WAITING, TICKET_ANSWERED, TICKET_ABANDONED */
    fr_msg reply;                /* the reply, or an error naming no request; FR_MSG_NONE: the connection ended */
    uint64_t seq;                /* when the reply arrived */
    struct ticket *next;
} ticket;

enum { TICKET_WAITING, TICKET_ANSWERED, TICKET_ABANDONED };

/* A sample being assembled from its deltas. */
typedef struct {
    fr_client_sample *s;
    int cap;
} partial;

struct fr_client {
    pthread_mutex_t mu;
    pthread_cond_t cv;           /* something was routed, or the socket was given back */
    int sock_busy;               /* a thread uses or polls the socket */
    int sock_wanted;             /* threads waiting to send: a poller gives the socket to them first */
    int wake[2];                 /* pipe: asks the polling thread to give the socket back */
    void *ctx, *sock;
    char *endpoint;
    int curve;
    char server_key[41], public_key[41], secret_key[41];
    int timeout_ms;
    int heard;                   /* a message ever came back: the endpoint has a server */
    uint64_t seq;                /* messages received */
    item *head, *tail;           /* results waiting for their readers */
    item *stray_head, *stray_tail;   /* replies no call waits for */
    ticket *calls, *calls_tail;  /* calls waiting for replies, oldest first */
    req **reqs;
    int n_reqs, cap_reqs;
    req **by_id;                 /* reqs indexed by id (open addressing, a power of two of slots) */
    int cap_by_id;
    unsigned long count_gen;     /* one per count over a reader's requests */
    partial *parts;              /* samples with deltas and no done yet */
    int n_parts, cap_parts;
    /* the last error message from the server */
    atomic_long in_flight;       /* payload frames ZeroMQ still holds (zero-copy sends of an update) */
    int updating;                /* a weight update runs on this client */
    void *nccl;                  /* the NCCL weight group (client_nccl.c), NULL when none */
    void *monitor;               /* PAIR: the socket monitor's events, NULL when none */
    fr_msg delta;                /* the tokens delta fr_client_next_event handed out last (its arrays) */
};

/* ZMTP heartbeats: a server that stops answering (killed, frozen, or its
 * host gone) closes the connection after this long. */
#define FR_CLIENT_HEARTBEAT_TIMEOUT_MS 3000

/* ---- client.c -------------------------------------------------------------- */

/* Takes the socket for this thread (mu held; waits for a poller to give it
 * back), and gives it back. */
void fr_client_sock_take_locked(fr_client *c);
void fr_client_sock_give_locked(fr_client *c);
/* Encodes m and sends it (mu held; takes the socket). With t non-NULL, a
 * call record for its reply is queued in the same step, so replies meet
 * their calls in the order the messages left. */
fr_status fr_client_send_locked(fr_client *c, const fr_msg *m, ticket *t);
/* Receives for at most until_ms (fr_now_ms's clock; < 0: no limit) and
 * routes what came, or waits while another thread does (mu held). Returns
 * early when anything was routed; an error is a message that could not be
 * read. */
fr_status fr_client_pump_locked(fr_client *c, double until_ms);
/* Samples not yet handed out: of the requests named, or of every request
 * not owned by a reader (ids NULL). */
int fr_client_open_locked(const fr_client *c, const uint64_t *ids, int n);
void fr_client_unlink_ticket_locked(fr_client *c, ticket *t);
/* Closes the socket at once, dropping what it still holds, and connects a
 * new one (the socket held by this thread). */
fr_status fr_client_reopen_locked(fr_client *c);
/* Reads the socket monitor's events (the socket held by this thread): a
 * connection that ended makes the client lost when samples are still to
 * come, and fails the calls waiting on it. */
void fr_client_read_monitor_locked(fr_client *c);
/* A server's error as the calling thread's failure (the one error store,
 * base/fr_status.h): `what` the client was doing, then the server's code
 * and message, which fr_client_last_error gives apart with the request id. */
fr_status fr_client_server_error_(const fr_msg_error *e, const char *what);
/* A deadline `ms` from now (-1: none), and what is left of it (-1: no limit). */
double fr_client_until(int ms);
int fr_client_left_ms(double until);

/* ---- client_requests.c ---------------------------------------------------- */

void fr_client_free_generate(fr_msg_generate *g);
/* out's own copies of g's prompt text and stop strings (both NULL where g
 * has none); -1 when out of memory, what was copied left for the caller's
 * free. */
int fr_client_copy_generate_text(const fr_msg_generate *g, fr_msg_generate *out);
/* The request with this id, or NULL. */
req *fr_client_find_locked(const fr_client *c, uint64_t id);
void fr_client_remove_req_locked(fr_client *c, req *q);
/* Removes the request once nothing of it is left to hand out (or, given
 * up, once nothing of it is left to arrive). */
void fr_client_settle_req_locked(fr_client *c, req *q);
/* The request a result is about; whether it closes it (an error naming it,
 * other than duplicate_request_id, which refuses only the copy). */
uint64_t fr_client_result_id(const fr_msg *m);
int fr_client_closes_request(const fr_msg *m);
/* Unlinks the request's first result (the caller owns it after). */
item *fr_client_pop_locked(fr_client *c, req *q, item *it);
/* Bookkeeping of a result handed to the caller: a done closes a sample, an
 * error about a request closes it (no done will come); the request leaves
 * the table once nothing of it is left. */
void fr_client_delivered_locked(fr_client *c, const fr_msg *m);
/* Samples still to come of lost requests: of those named, or of every
 * request not owned by a reader (ids NULL). */
int fr_client_lost_locked(const fr_client *c, const uint64_t *ids, int n);
/* The error of a lost connection, naming the lost requests that will not
 * end (of those named, or all when ids is NULL). */
fr_status fr_client_lost_error_locked(fr_client *c, const uint64_t *ids, int n);
/* Drops the assembled part of every sample of request id. */
void fr_client_drop_parts_locked(fr_client *c, uint64_t id);

/* ---- client_calls.c ------------------------------------------------------- */

/* Sends m and waits for its reply of type want, at most the client's
 * timeout (wait_ms -1), or wait_ms (-2: no limit). An error naming no
 * request fails the call with the server's code and message. mu held. */
fr_status fr_client_call_locked(fr_client *c, const fr_msg *m, fr_msg_type want, int wait_ms, fr_msg *reply);
/* Waits for t's reply (queued by fr_client_send_locked) within wait_ms
 * (as above); `what` names the message in errors. The ticket is unlinked
 * on success and failure (abandoned when its reply has not come). */
fr_status fr_client_await_locked(fr_client *c, ticket *t, int wait_ms, const char *what, fr_msg *reply);

/* ---- for client_nccl.c and client_update.c --------------------------------- */

/* Sends m and waits for its reply of type want (the client's timeout). */
fr_status fr_client_call_(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply);
fr_status fr_client_send_(fr_client *c, const fr_msg *m);
/* Waits up to wait_ms for a reply no call waits for: *got 1 and *reply
 * when it is of type want; an error naming no request fails (the server's
 * answer to `what`). */
fr_status fr_client_take_(fr_client *c, int wait_ms, fr_msg_type want, const char *what, fr_msg *reply, int *got);
/* A server refusal of an update message, with its code in the text. */
fr_status fr_client_refused_(fr_status st);
/* Fills an update_weights_begin with the tensors' names, dtypes and shapes,
 * its version and bucket size (b->tensors allocated, even on a refusal of a
 * tensor: the caller frees it); `what` names the call in messages. */
fr_status fr_client_begin_tensors_(fr_msg_update_begin *b, const fr_client_tensor *tensors, int n, uint64_t version,
                                   uint64_t bucket, const char *what);
/* After a failed pipelined exchange: sends a stats request and waits for
 * its reply, then drops the replies to earlier update and group messages
 * that no call waits for (the server answers in order, so none is left
 * after it), so that they cannot be taken for the answers to the next call. */
fr_status fr_client_settle_(fr_client *c, int wait_ms);
int fr_client_timeout_(const fr_client *c);
/* Marks a weight update running on c: FR_EINVAL when one already is. */
fr_status fr_client_update_begin_(fr_client *c, const char *what);
void fr_client_update_end_(fr_client *c);
/* Where the client keeps its NCCL group. */
void **fr_client_nccl_slot_(fr_client *c);
/* Ends and frees the group in *slot (client_nccl.c); NULL-safe. */
void fr_client_nccl_free_(void **slot);

#endif
