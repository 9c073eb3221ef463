/* fr_status: the error convention every public function of the project follows.
 *
 * A public function returns FR_OK or a failure code and, on failure, leaves a
 * readable message that fr_last_error() returns (per thread, so concurrent
 * engines do not overwrite each other's messages). Nothing aborts on bad input.
 */
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
 * failing path reads: return fr_fail(FR_EINVAL, "dim %d is not a power of two", d); */
fr_status fr_fail(fr_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* fr_fail with a va_list, for wrappers that add their own codes (comm/). */
fr_status fr_vfail(fr_status st, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

/* The calling thread's last message ("" when none was set). */
const char *fr_last_error(void);

/* A short name for a status code ("invalid argument", ...). */
const char *fr_status_name(fr_status st);

#ifdef __cplusplus
}
#endif

#endif
