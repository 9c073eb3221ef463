/* Byte records passed between the ranks of a multi-rank job (`fp4rollout serve`,
 * `fp4rollout rollout`)
 * (docs/protocol.md, "Serving on several ranks"): a growable writer and a
 * bounds-checked reader of fixed-width little-endian-as-the-host fields.
 * All ranks of a job run the same binary on the same kind of host, so the
 * host byte order is the wire's.
 *
 *     fr_rank_buf b = {0};
 *     fr_rank_put_u64(&b, sid); fr_rank_put_i32s(&b, ids, n);
 *     if (b.failed) { out of memory }
 *     fr_rank_reader r = {(const unsigned char *)b.data, b.len, 0, 0};
 *     uint64_t sid = fr_rank_get_u64(&r); ... if (r.bad) { truncated }
 *     fr_rank_buf_free(&b);
 */
#ifndef FR_RANK_WIRE_H
#define FR_RANK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The writer is the project's growable buffer: `failed` is set when a put
 * could not grow it (the put is dropped). */
typedef fr_buf fr_rank_buf;

void fr_rank_put(fr_rank_buf *b, const void *data, size_t n);
void fr_rank_put_u8(fr_rank_buf *b, unsigned v);
void fr_rank_put_i32(fr_rank_buf *b, int v);
void fr_rank_put_u64(fr_rank_buf *b, uint64_t v);
void fr_rank_put_f32(fr_rank_buf *b, float v);
void fr_rank_put_f64(fr_rank_buf *b, double v);
/* n (as a u64), then the bytes. */
void fr_rank_put_bytes(fr_rank_buf *b, const void *data, size_t n);
/* n (as an i32), then n ints. */
void fr_rank_put_i32s(fr_rank_buf *b, const int *v, int n);
/* Empties the buffer, keeping its memory. */
void fr_rank_buf_clear(fr_rank_buf *b);
void fr_rank_buf_free(fr_rank_buf *b);

typedef struct {
    const unsigned char *p;
    size_t len, pos;
    int bad;            /* set when a get ran past the end (it then returns 0) */
} fr_rank_reader;

int fr_rank_more(const fr_rank_reader *r);   /* bytes left and nothing went wrong */
/* Copies the next n bytes into dst: 0, or -1 when truncated (dst untouched). */
int fr_rank_get(fr_rank_reader *r, void *dst, size_t n);
unsigned fr_rank_get_u8(fr_rank_reader *r);
int fr_rank_get_i32(fr_rank_reader *r);
uint64_t fr_rank_get_u64(fr_rank_reader *r);
float fr_rank_get_f32(fr_rank_reader *r);
double fr_rank_get_f64(fr_rank_reader *r);
/* A pointer into the reader's bytes (no copy) and its length; NULL when
 * truncated. */
const void *fr_rank_get_bytes(fr_rank_reader *r, size_t *n);
/* A malloc'd copy of an int array (*n its count, NULL and -1 on failure:
 * truncated, or out of memory when *oom is then 1). An empty array gives a
 * 1-element allocation, so NULL always means failure. */
int *fr_rank_get_i32s(fr_rank_reader *r, int *n, int *oom);

#ifdef __cplusplus
}
#endif

#endif
