/* Records between the ranks of a multi-rank job (comm/rank_wire.h). */
#include "comm/rank_wire.h"

#include <stdlib.h>
#include <string.h>

void fr_rank_put(fr_rank_buf *b, const void *data, size_t n) { fr_buf_put(b, data, n); }

void fr_rank_put_u8(fr_rank_buf *b, unsigned v)
{
    unsigned char c = (unsigned char)v;
    fr_rank_put(b, &c, 1);
}
void fr_rank_put_i32(fr_rank_buf *b, int v)
{
    int32_t x = (int32_t)v;
    fr_rank_put(b, &x, sizeof x);
}
void fr_rank_put_u64(fr_rank_buf *b, uint64_t v) { fr_rank_put(b, &v, sizeof v); }
void fr_rank_put_f32(fr_rank_buf *b, float v) { fr_rank_put(b, &v, sizeof v); }
void fr_rank_put_f64(fr_rank_buf *b, double v) { fr_rank_put(b, &v, sizeof v); }

void fr_rank_put_bytes(fr_rank_buf *b, const void *data, size_t n)
{
    fr_rank_put_u64(b, (uint64_t)n);
    fr_rank_put(b, data, n);
}

void fr_rank_put_i32s(fr_rank_buf *b, const int *v, int n)
{
    fr_rank_put_i32(b, n);
    for (int i = 0; i < n; i++) fr_rank_put_i32(b, v[i]);
}

void fr_rank_buf_clear(fr_rank_buf *b)
{
    b->len = 0;
    b->failed = 0;
}

void fr_rank_buf_free(fr_rank_buf *b)
{
    if (b) fr_buf_free(b);
}

int fr_rank_more(const fr_rank_reader *r) { return !r->bad && r->pos < r->len; }

static const void *take(fr_rank_reader *r, size_t n)
{
    if (r->bad || n > r->len - r->pos) {
        r->bad = 1;
        return NULL;
    }
    const void *p = r->p + r->pos;
    r->pos += n;
    return p;
}

int fr_rank_get(fr_rank_reader *r, void *dst, size_t n)
{
    const void *p = take(r, n);
    if (!p) return -1;
    if (n) memcpy(dst, p, n);
    return 0;
}

unsigned fr_rank_get_u8(fr_rank_reader *r)
{
    const unsigned char *p = take(r, 1);
    return p ? *p : 0;
}
int fr_rank_get_i32(fr_rank_reader *r)
{
    int32_t x = 0;
    const void *p = take(r, sizeof x);
    if (p) memcpy(&x, p, sizeof x);
    return (int)x;
}
uint64_t fr_rank_get_u64(fr_rank_reader *r)
{
    uint64_t x = 0;
    const void *p = take(r, sizeof x);
    if (p) memcpy(&x, p, sizeof x);
    return x;
}
float fr_rank_get_f32(fr_rank_reader *r)
{
    float x = 0;
    const void *p = take(r, sizeof x);
    if (p) memcpy(&x, p, sizeof x);
    return x;
}
double fr_rank_get_f64(fr_rank_reader *r)
{
    double x = 0;
    const void *p = take(r, sizeof x);
    if (p) memcpy(&x, p, sizeof x);
    return x;
}

const void *fr_rank_get_bytes(fr_rank_reader *r, size_t *n)
{
    uint64_t len = fr_rank_get_u64(r);
    if (r->bad || len > r->len - r->pos) {
        r->bad = 1;
        *n = 0;
        return NULL;
    }
    *n = (size_t)len;
    return take(r, (size_t)len);
}

int *fr_rank_get_i32s(fr_rank_reader *r, int *n, int *oom)
{
    *n = -1;
    if (oom) *oom = 0;
    int k = fr_rank_get_i32(r);
    if (r->bad || k < 0 || (size_t)k > (r->len - r->pos) / sizeof(int32_t)) {
        r->bad = 1;
        return NULL;
    }
    int *v = malloc(sizeof(int) * (size_t)(k > 0 ? k : 1));
    if (!v) {
        if (oom) *oom = 1;
        r->pos += sizeof(int32_t) * (size_t)k;
        return NULL;
    }
    for (int i = 0; i < k; i++) v[i] = fr_rank_get_i32(r);
    *n = k;
    return v;
}
