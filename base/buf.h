/* buf: the project's growable byte buffer, for encoders and text builders.
 *
 * Appends never fail loudly: an allocation failure sets `failed`, later
 * appends do nothing, and the owner checks the flag once at the end, so a
 * builder of many small pieces needs one error check instead of one per
 * piece. The bytes stay NUL-terminated (the terminator is not counted in
 * len), so a text buffer can be handed out as a C string.
 *
 *     fr_buf b = {0};
 *     fr_buf_printf(&b, "%d tokens", n);
 *     if (b.failed) { fr_buf_free(&b); return fr_fail(FR_ENOMEM, ...); }
 */
#ifndef FR_BUF_H
#define FR_BUF_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    char *data;   /* NULL until the first append */
    size_t len;   /* bytes written, excluding the terminator */
    size_t cap;   /* bytes allocated */
    int failed;   /* an allocation failed: the contents are incomplete */
} fr_buf;

/* Makes room for `extra` more bytes (and the terminator); 0 on success, -1
 * (and `failed` set) when memory ran out or the buffer had failed before. */
int fr_buf_reserve(fr_buf *b, size_t extra);

/* Appends n bytes of p. */
void fr_buf_put(fr_buf *b, const void *p, size_t n);

/* Appends printf-formatted text. */
void fr_buf_printf(fr_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fr_buf_vprintf(fr_buf *b, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

/* Releases the memory and resets *b to empty; accepts an empty buffer. */
void fr_buf_free(fr_buf *b);

/* Room for one more element of a growing array of n used elements of elem
 * bytes (capacity *cap): the array itself while n < *cap, else the array
 * reallocated to twice *cap elements (first when empty), *cap updated.
 * NULL when memory ran out; the array and *cap are then as they were. */
void *fr_array_room(void *items, size_t n, size_t *cap, size_t elem, size_t first);

#ifdef __cplusplus
}
#endif

#endif
