#include "base/buf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The first allocation: small enough for a short message, large enough
 * that a typical encoded reply needs no second one. */
enum { FIRST_CAP = 256 };

int fr_buf_reserve(fr_buf *b, size_t extra)
{
    if (b->failed) return -1;
    if (extra > (size_t)-1 / 2 - b->len) {
        b->failed = 1;
        return -1;
    }
    const size_t need = b->len + extra + 1;
    if (need <= b->cap) return 0;
    size_t c = b->cap ? b->cap : FIRST_CAP;
    while (c < need) c *= 2;
    char *d = realloc(b->data, c);
    if (!d) {
        b->failed = 1;
        return -1;
    }
    b->data = d;
    b->cap = c;
    return 0;
}

void fr_buf_put(fr_buf *b, const void *p, size_t n)
{
    if (fr_buf_reserve(b, n)) return;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void fr_buf_vprintf(fr_buf *b, const char *fmt, va_list ap)
{
    if (b->failed) return;
    va_list again;
    va_copy(again, ap);
    const size_t room = b->data ? b->cap - b->len : 0;
    const int n = vsnprintf(b->data ? b->data + b->len : NULL, room, fmt, ap);
    if (n < 0) {
        b->failed = 1;
    } else if ((size_t)n < room) {
        b->len += (size_t)n;
    } else if (fr_buf_reserve(b, (size_t)n) == 0) {
        vsnprintf(b->data + b->len, b->cap - b->len, fmt, again);
        b->len += (size_t)n;
    }
    va_end(again);
}

void fr_buf_printf(fr_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fr_buf_vprintf(b, fmt, ap);
    va_end(ap);
}

void fr_buf_free(fr_buf *b)
{
    free(b->data);
    *b = (fr_buf){0};
}

void *fr_array_room(void *items, size_t n, size_t *cap, size_t elem, size_t first)
{
    if (n < *cap) return items;
    size_t c = *cap ? 2 * *cap : first;
    if (c <= n) c = n + 1;
    if (elem && c > SIZE_MAX / elem) return NULL;
    void *v = realloc(items, c * elem);
    if (v) *cap = c;
    return v;
}
