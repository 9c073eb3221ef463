/* An update's begin and buckets between ranks (rollout/engine/weight_wire.h). */
#include "rollout/engine/weight_wire.h"

#include <stdlib.h>
#include <string.h>

/* The name travels with its NUL, so a reader can point at it. */
static void put_tensor(fr_rank_buf *b, const fr_weight_tensor *t)
{
    const char *name = t->name ? t->name : "";
    fr_rank_put_bytes(b, name, strlen(name) + 1);
    fr_rank_put_i32(b, (int)t->dtype);
    fr_rank_put_i32(b, t->ndim);
    for (int k = 0; k < t->ndim && k < FR_WEIGHT_MAX_NDIM; k++) fr_rank_put_u64(b, (uint64_t)t->shape[k]);
}

static void get_tensor(fr_rank_reader *r, fr_weight_tensor *t)
{
    size_t n = 0;
    const char *name = fr_rank_get_bytes(r, &n);
    memset(t, 0, sizeof *t);
    t->dtype = (fr_dtype)fr_rank_get_i32(r);
    t->ndim = fr_rank_get_i32(r);
    if (r->bad || !name || n < 1 || name[n - 1] != 0 || t->ndim < 1 || t->ndim > FR_WEIGHT_MAX_NDIM) {
        r->bad = 1;
        return;
    }
    t->name = name;
    for (int k = 0; k < t->ndim; k++) t->shape[k] = (int64_t)fr_rank_get_u64(r);
}

/* A count of records that each take at least one byte of what is left. */
static int count_of(fr_rank_reader *r)
{
    const int n = fr_rank_get_i32(r);
    if (r->bad || n < 0 || (size_t)n > r->len - r->pos) r->bad = 1;
    return r->bad ? 0 : n;
}

void fr_weight_begin_put(fr_rank_buf *b, const fr_weight_begin *x)
{
    fr_rank_put_u64(b, x->version);
    fr_rank_put_u64(b, x->bucket_bytes);
    fr_rank_put_u8(b, (unsigned)(x->partial != 0));
    fr_rank_put_i32(b, x->n_tensors);
    for (int i = 0; i < x->n_tensors; i++) put_tensor(b, &x->tensors[i]);
}

fr_status fr_weight_begin_get(fr_rank_reader *r, fr_weight_begin *x)
{
    memset(x, 0, sizeof *x);
    x->version = fr_rank_get_u64(r);
    x->bucket_bytes = fr_rank_get_u64(r);
    x->partial = (int)fr_rank_get_u8(r);
    const int n = count_of(r);
    x->tensors = calloc(n ? (size_t)n : 1, sizeof *x->tensors);
    for (int i = 0; i < n && !r->bad; i++) {
        fr_weight_tensor spare;   /* out of memory: read past it alike, so every rank stays in step */
        get_tensor(r, x->tensors ? &x->tensors[i] : &spare);
    }
    x->n_tensors = n;
    if (r->bad) return fr_fail(FR_EFORMAT, "weight update: a malformed begin record");
    if (!x->tensors) return fr_fail(FR_ENOMEM, "weight update: out of memory taking a begin");
    return FR_OK;
}

void fr_weight_bucket_put(fr_rank_buf *b, const fr_weight_bucket *x)
{
    fr_rank_put_u64(b, x->version);
    fr_rank_put_i32(b, x->bucket);
    fr_rank_put_u64(b, x->nbytes);
    fr_rank_put_u64(b, x->checksum);
    fr_rank_put_u8(b, (unsigned)(x->in_order != 0));
    fr_rank_put_i32(b, x->n_pieces);
    for (int i = 0; i < x->n_pieces; i++) {
        const fr_weight_piece *p = &x->pieces[i];
        put_tensor(b, &p->t);
        fr_rank_put_u64(b, p->offset);
        fr_rank_put_u64(b, p->nbytes);
        fr_rank_put_u64(b, p->at);
        fr_rank_put_u8(b, (unsigned)(p->bytes != NULL));
        if (p->bytes) fr_rank_put_bytes(b, p->bytes, (size_t)p->nbytes);
    }
}

fr_status fr_weight_bucket_get(fr_rank_reader *r, fr_weight_bucket *x)
{
    memset(x, 0, sizeof *x);
    x->version = fr_rank_get_u64(r);
    x->bucket = fr_rank_get_i32(r);
    x->nbytes = fr_rank_get_u64(r);
    x->checksum = fr_rank_get_u64(r);
    x->in_order = (int)fr_rank_get_u8(r);
    const int n = count_of(r);
    x->pieces = calloc(n ? (size_t)n : 1, sizeof *x->pieces);
    for (int i = 0; i < n && !r->bad; i++) {
        fr_weight_piece spare, *p = x->pieces ? &x->pieces[i] : &spare;
        get_tensor(r, &p->t);
        p->offset = fr_rank_get_u64(r);
        p->nbytes = fr_rank_get_u64(r);
        p->at = fr_rank_get_u64(r);
        p->bytes = NULL;
        p->tensor = -1;
        if (fr_rank_get_u8(r)) {
            size_t len = 0;
            p->bytes = fr_rank_get_bytes(r, &len);
            if (!r->bad && len != p->nbytes) r->bad = 1;
        }
    }
    x->n_pieces = n;
    if (r->bad) return fr_fail(FR_EFORMAT, "weight update: a malformed bucket record");
    if (!x->pieces) return fr_fail(FR_ENOMEM, "weight update: out of memory taking a bucket");
    return FR_OK;
}
