/* fr_status: the error convention every public function of the project follows.
 *
 * A public function returns FR_OK or a failure code and, on failure, leaves a
 * readable message that fr_last_error() returns (per thread, so concurrent
 * engines do not overwrite each other's messages). Nothing aborts on bad input.
 *
 * This is the project's one error store: comm/ records its messages here too
 * (fr_comm_fail, comm/comm_status.h), and so do the client library's calls,
 * a server's refusal included (fr_fail_peer keeps the server's own code,
 * message and request id beside the message: fr_client_last_error reads
 * them, trainer_bridge/client/client.h). */
#ifndef FR_STATUS_H
#define FR_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FR_OK = 0,
    FR_EINVAL,      /* bad argument or request */
    FR_ENOMEM,      /* allocation failed or capacity exhausted */
    FR_EIO,         /* file or socket I/O failed */
    FR_EFORMAT,     /* malformed file or message */
    FR_EUNSUPPORTED,/* valid, but not supported by this build or backend */
    FR_EINTERNAL    /* a broken invariant: a bug, reported rather than hidden */
} fr_status;

/* Records a printf-style message for the calling thread and returns st, so a
 * failing path reads: return fr_fail(FR_EINVAL, "dim %d is not a power of two", d);
 * The arguments may be what fr_last_error() returned (to prefix it). */
fr_status fr_fail(fr_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* fr_fail with a va_list, for wrappers. */
fr_status fr_vfail(fr_status st, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

/* A failure a peer reported (a server's error reply): the message is fmt's,
 * and the peer's own account is kept beside it until the thread's next
 * failure: its error code (a short name, the protocol's), its message, and
 * the id of what it is about (-1: nothing). The arguments may be what
 * fr_last_error_peer() gave. */
fr_status fr_fail_peer(fr_status st, const char *code, const char *peer_message, long long subject,
                       const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* The calling thread's last message ("" when none was set). */
const char *fr_last_error(void);

/* 1 when the calling thread's last failure was a peer's (fr_fail_peer),
 * with its code, message and subject through the non-NULL pointers (valid
 * until the thread's next failure); else 0. */
int fr_last_error_peer(const char **code, const char **message, long long *subject);

/* A copy of the calling thread's last failure (its message and a peer's
 * account), for a caller that makes more calls, which may fail too, before
 * it returns that failure: fr_error_restore makes it the last one again,
 * with suffix (may be NULL) appended to its message, and returns st. */
typedef struct {
    char message[1024];
    int peer;
    char code[256];
    char peer_message[1024];
    long long subject;
} fr_error_copy;
void fr_error_keep(fr_error_copy *e);
fr_status fr_error_restore(const fr_error_copy *e, fr_status st, const char *suffix);

/* A short name for a status code ("invalid argument", ...). */
const char *fr_status_name(fr_status st);

#ifdef __cplusplus
}
#endif

#endif
