#include "base/fr_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* The one store: a thread's last message, and a peer's account of it when
 * the failure was a peer's. */
static _Thread_local fr_error_copy last;

fr_status fr_vfail(fr_status st, const char *fmt, va_list ap)
{
    /* Formatted apart first: callers may pass fr_last_error() itself as an
     * argument to prefix it with context. */
    char message[sizeof last.message];
    vsnprintf(message, sizeof message, fmt, ap);
    memcpy(last.message, message, sizeof last.message);
    last.peer = 0;
    return st;
}

fr_status fr_fail(fr_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fr_vfail(st, fmt, ap);
    va_end(ap);
    return st;
}

fr_status fr_fail_peer(fr_status st, const char *code, const char *peer_message, long long subject,
                       const char *fmt, ...)
{
    /* Copied apart first, like the message: they may point into the store. */
    char c[sizeof last.code], m[sizeof last.peer_message];
    snprintf(c, sizeof c, "%s", code ? code : "");
    snprintf(m, sizeof m, "%s", peer_message ? peer_message : "");
    va_list ap;
    va_start(ap, fmt);
    fr_vfail(st, fmt, ap);
    va_end(ap);
    memcpy(last.code, c, sizeof c);
    memcpy(last.peer_message, m, sizeof m);
    last.subject = subject;
    last.peer = 1;
    return st;
}

const char *fr_last_error(void) { return last.message; }

int fr_last_error_peer(const char **code, const char **message, long long *subject)
{
    if (!last.peer) return 0;
    if (code) *code = last.code;
    if (message) *message = last.peer_message;
    if (subject) *subject = last.subject;
    return 1;
}

void fr_error_keep(fr_error_copy *e)
{
    if (e) *e = last;
}

fr_status fr_error_restore(const fr_error_copy *e, fr_status st, const char *suffix)
{
    if (!e) return st;
    if (e->peer) return fr_fail_peer(st, e->code, e->peer_message, e->subject, "%s%s", e->message, suffix ? suffix : "");
    return fr_fail(st, "%s%s", e->message, suffix ? suffix : "");
}

const char *fr_status_name(fr_status st)
{
    switch (st) {
    case FR_OK: return "ok";
    case FR_EINVAL: return "invalid argument";
    case FR_ENOMEM: return "out of memory";
    case FR_EIO: return "I/O error";
    case FR_EFORMAT: return "malformed input";
    case FR_EUNSUPPORTED: return "unsupported";
    case FR_EINTERNAL: return "internal error";
    }
    return "unknown status";
}
