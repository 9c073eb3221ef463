/* One rank's side of a weight update broadcast whole to every rank
 * (rollout/engine/wsync_rank.h). */
#include "rollout/engine/wsync_rank.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "comm/dev_checksum.h"
#include "rollout/model/tensor_table.h"

/* A declared tensor: its model tensor and the bytes of it received. */
typedef struct {
    int model;
    fr_dtype dtype;
    uint64_t bytes, planned, received;   /* planned: in buckets accepted; received: in buckets done */
} declared;

struct fr_wsync_rank {
    fr_model_config cfg;
    fr_tp_layout layout;
    fr_model_tensor *mt;     /* the model's tensors (names, whole shapes) */
    fr_tp_part *part;        /* this rank's part of each */
    int n_mt;
    float *shard;            /* host stage: every local part, one after another */
    size_t *shard_at;        /* where tensor i's part starts in shard */
    unsigned char *touched;
    declared *d;
    int n_d;
    uint64_t version, bucket_bytes, received, kept;
    int partial, updating, next_bucket, next_done;   /* next_bucket: the next to accept; next_done: to finish */
    fr_wsync_fault fault;
    unsigned char *buf;      /* host stage: the bucket in flight */
    uint64_t buf_bytes;
};

static fr_status make_parts(fr_wsync_rank *r)
{
    size_t n = 0;
    fr_weights none;
    memset(&none, 0, sizeof none);
    fr_status st = fr_model_tensor_list(&r->cfg, &none, &r->mt, &n);
    if (st) return st;
    r->n_mt = (int)n;
    r->part = calloc(n, sizeof *r->part);
    r->touched = calloc(n, 1);
    r->shard_at = calloc(n + 1, sizeof *r->shard_at);
    if (!r->part || !r->touched || !r->shard_at) return fr_fail(FR_ENOMEM, "weight sync: out of memory");
    for (size_t i = 0; i < n && !st; i++) {
        st = fr_tp_part_of(&r->cfg, &r->layout, r->mt[i].name, r->mt[i].rows, r->mt[i].cols, &r->part[i]);
        r->shard_at[i + 1] = r->shard_at[i] + (size_t)fr_tp_part_elems(&r->part[i]);
    }
    return st;
}

fr_status fr_wsync_rank_new(const fr_model_config *cfg, int tp_rank, int tp_size, int host_stage,
                            fr_wsync_rank **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_wsync_rank_new: out is NULL");
    *out = NULL;
    if (!cfg) return fr_fail(FR_EINVAL, "fr_wsync_rank_new: cfg is NULL");
    fr_wsync_rank *r = calloc(1, sizeof *r);
    if (!r) return fr_fail(FR_ENOMEM, "weight sync: out of memory");
    r->cfg = *cfg;
    fr_status st = fr_tp_layout_of(cfg, tp_rank, tp_size, &r->layout);
    if (!st) st = make_parts(r);
    if (!st && host_stage && !(r->shard = malloc(sizeof(float) * (r->shard_at[r->n_mt] ? r->shard_at[r->n_mt] : 1))))
        st = fr_fail(FR_ENOMEM, "weight sync: cannot allocate rank %d's shard (%zu floats)", tp_rank,
                     r->shard_at[r->n_mt]);
    if (st) {
        fr_wsync_rank_destroy(&r);
        return st;
    }
    *out = r;
    return FR_OK;
}

void fr_wsync_rank_destroy(fr_wsync_rank **pr)
{
    fr_wsync_rank *r = pr ? *pr : NULL;
    if (!r) return;
    free(r->mt);
    free(r->part);
    free(r->shard);
    free(r->shard_at);
    free(r->touched);
    free(r->d);
    free(r->buf);
    free(r);
    *pr = NULL;
}

static int find_model(const fr_wsync_rank *r, const char *name)
{
    for (int i = 0; i < r->n_mt; i++)
        if (strcmp(r->mt[i].name, name) == 0) return i;
    return -1;
}

static fr_status fault(fr_wsync_rank *r, fr_wsync_fault f, fr_status st)
{
    r->fault = f;
    return st;
}

fr_status fr_wsync_rank_begin(fr_wsync_rank *r, uint64_t version, const fr_wsync_tensor *t, int n,
                              uint64_t bucket_bytes, int partial)
{
    if (!r || (!t && n) || n < 1 || bucket_bytes < 1) return fr_fail(FR_EINVAL, "fr_wsync_rank_begin: bad argument");
    free(r->d);
    r->d = calloc((size_t)n, sizeof *r->d);
    memset(r->touched, 0, (size_t)r->n_mt);
    r->n_d = 0;
    r->updating = 1;
    r->version = version;
    r->bucket_bytes = bucket_bytes;
    r->partial = partial;
    r->next_bucket = r->next_done = 0;
    r->received = r->kept = 0;
    r->fault = FR_WSYNC_OK;
    if (!r->d) return fault(r, FR_WSYNC_NO_MEMORY, fr_fail(FR_ENOMEM, "weight sync: out of memory"));
    for (int i = 0; i < n; i++) {
        const int k = t[i].name ? find_model(r, t[i].name) : -1;
        if (k < 0)
            return fault(r, FR_WSYNC_BAD_TENSOR, fr_fail(FR_EINVAL, "update to version %llu: \"%s\" is not a weight "
                         "of this model", (unsigned long long)version, t[i].name ? t[i].name : "(null)"));
        const fr_model_tensor *m = &r->mt[k];
        if (t[i].rows != m->rows || (t[i].cols ? t[i].cols : 0) != m->cols || !fr_dtype_is_weight(t[i].dtype))
            return fault(r, FR_WSYNC_BAD_TENSOR, fr_fail(FR_EINVAL, "update to version %llu: \"%s\" is %lld x %lld "
                         "in the model, declared %lld x %lld", (unsigned long long)version, t[i].name,
                         (long long)m->rows, (long long)m->cols, (long long)t[i].rows, (long long)t[i].cols));
        if (r->touched[k])
            return fault(r, FR_WSYNC_BAD_TENSOR, fr_fail(FR_EINVAL, "update to version %llu: \"%s\" is declared "
                         "twice", (unsigned long long)version, t[i].name));
        r->touched[k] = 1;
        const uint64_t elems = (uint64_t)m->rows * (uint64_t)(m->cols ? m->cols : 1);
        r->d[r->n_d++] = (declared){.model = k, .dtype = t[i].dtype, .bytes = elems * fr_dtype_size(t[i].dtype)};
    }
    if (r->shard && r->buf_bytes != bucket_bytes) {
        free(r->buf);
        r->buf_bytes = 0;
        if (!(r->buf = malloc((size_t)bucket_bytes)))
            return fault(r, FR_WSYNC_NO_MEMORY, fr_fail(FR_ENOMEM, "weight sync: cannot allocate a bucket of %llu "
                         "bytes", (unsigned long long)bucket_bytes));
        r->buf_bytes = bucket_bytes;
    }
    return FR_OK;
}

/* The checks of one piece against the bucket and the pieces before it. */
static fr_status check_piece(fr_wsync_rank *r, const fr_wsync_bucket *b, int k, uint64_t *end, uint64_t *expect)
{
    const fr_wsync_piece *p = &b->pieces[k];
    const unsigned long long v = (unsigned long long)r->version;
    if (p->tensor < 0 || p->tensor >= r->n_d)
        return fr_fail(FR_EINVAL, "update to version %llu: bucket %d: piece %d names no declared tensor", v, b->bucket, k);
    const declared *d = &r->d[p->tensor];
    const char *name = r->mt[d->model].name;
    const uint64_t es = fr_dtype_size(d->dtype);
    if (p->nbytes < 1 || p->at < *end || p->at > b->nbytes || p->nbytes > b->nbytes - p->at || p->at % es ||
        p->offset % es || p->nbytes % es)
        return fr_fail(FR_EINVAL, "update to version %llu: bucket %d: the piece of \"%s\" at byte %llu (%llu bytes) "
                       "is not inside the bucket's %llu bytes after the pieces before it, on element bounds", v,
                       b->bucket, name, (unsigned long long)p->at, (unsigned long long)p->nbytes,
                       (unsigned long long)b->nbytes);
    if (p->offset != expect[p->tensor] || p->nbytes > d->bytes - p->offset)
        return fr_fail(FR_EINVAL, "update to version %llu: bucket %d: the piece of \"%s\" covers bytes %llu..%llu; "
                       "its pieces must come in order, and %llu of its %llu bytes arrived so far", v, b->bucket, name,
                       (unsigned long long)p->offset, (unsigned long long)(p->offset + p->nbytes),
                       (unsigned long long)expect[p->tensor], (unsigned long long)d->bytes);
    *end = p->at + p->nbytes;
    expect[p->tensor] += p->nbytes;
    return FR_OK;
}

fr_status fr_wsync_rank_plan(fr_wsync_rank *r, const fr_wsync_bucket *b)
{
    if (!r || !b || (b->n_pieces && !b->pieces)) return fr_fail(FR_EINVAL, "fr_wsync_rank_plan: bad argument");
    if (!r->updating || r->fault)
        return fr_fail(FR_EINVAL, "bucket %d: no weight update is in progress on this rank", b->bucket);
    const unsigned long long v = (unsigned long long)r->version;
    if (b->bucket != r->next_bucket || b->nbytes < 1 || b->nbytes > r->bucket_bytes || b->n_pieces < 1)
        return fault(r, FR_WSYNC_BAD_BUCKET, fr_fail(FR_EINVAL, "update to version %llu: bucket %d (%llu bytes, %d "
                     "pieces) arrived; expected bucket %d of 1 to %llu bytes", v, b->bucket,
                     (unsigned long long)b->nbytes, b->n_pieces, r->next_bucket, (unsigned long long)r->bucket_bytes));
    uint64_t *expect = malloc(sizeof *expect * (size_t)r->n_d);
    if (!expect) return fault(r, FR_WSYNC_NO_MEMORY, fr_fail(FR_ENOMEM, "weight sync: out of memory"));
    for (int i = 0; i < r->n_d; i++) expect[i] = r->d[i].planned;
    uint64_t end = 0;
    fr_status st = FR_OK;
    for (int k = 0; k < b->n_pieces && !st; k++) st = check_piece(r, b, k, &end, expect);
    if (!st) {
        for (int i = 0; i < r->n_d; i++) r->d[i].planned = expect[i];
        r->next_bucket++;
    }
    free(expect);
    return st ? fault(r, FR_WSYNC_BAD_BUCKET, st) : FR_OK;
}

fr_status fr_wsync_rank_blocks(const fr_wsync_rank *r, const fr_wsync_bucket *b, fr_wsync_block_fn fn, void *user)
{
    if (!r || !b || !fn || (b->n_pieces && !b->pieces)) return fr_fail(FR_EINVAL, "fr_wsync_rank_blocks: bad argument");
    fr_status st = FR_OK;
    for (int k = 0; k < b->n_pieces && !st; k++) {
        const fr_wsync_piece *p = &b->pieces[k];
        if (p->tensor < 0 || p->tensor >= r->n_d)
            return fr_fail(FR_EINVAL, "bucket %d: piece %d names no declared tensor", b->bucket, k);
        const declared *d = &r->d[p->tensor];
        const uint64_t es = fr_dtype_size(d->dtype);
        fr_tp_rect rect[FR_TP_PIECE_MAX_RECTS];
        const int nr = fr_tp_piece_rects(&r->part[d->model], p->offset / es, p->nbytes / es, rect);
        if (nr < 0) return fr_fail(FR_EINVAL, "bucket %d: piece %d lies outside its tensor", b->bucket, k);
        for (int j = 0; j < nr && !st; j++) {
            const fr_wsync_block blk = {.model_tensor = d->model, .dtype = d->dtype, .src_at = p->at, .rect = rect[j],
                                        .part = &r->part[d->model]};
            st = fn(user, &blk);
        }
    }
    return st;
}

fr_status fr_wsync_rank_bucket_done(fr_wsync_rank *r, const fr_wsync_bucket *b, int ok, fr_wsync_fault f)
{
    if (!r || !b) return fr_fail(FR_EINVAL, "fr_wsync_rank_bucket_done: NULL argument");
    if (!r->updating || r->fault) return fr_fail(FR_EINVAL, "bucket %d: no weight update is in progress", b->bucket);
    if (b->bucket != r->next_done || b->bucket >= r->next_bucket)
        return fault(r, FR_WSYNC_BAD_BUCKET, fr_fail(FR_EINVAL, "bucket %d finished, but bucket %d is the oldest in "
                     "flight", b->bucket, r->next_done));
    if (!ok) return fault(r, f ? f : FR_WSYNC_TRANSPORT, FR_EINVAL);
    for (int k = 0; k < b->n_pieces; k++) r->d[b->pieces[k].tensor].received += b->pieces[k].nbytes;
    r->received += b->nbytes;
    r->next_done++;
    return FR_OK;
}

/* Host stage: a block converted to float32 into the rank's shard. */
typedef struct {
    fr_wsync_rank *r;
    long long bad;   /* the first non-finite element's index in its tensor, or -1 */
    int bad_tensor;
} host_ctx;

static fr_status host_block(void *user, const fr_wsync_block *blk)
{
    host_ctx *h = user;
    fr_wsync_rank *r = h->r;
    const size_t es = fr_dtype_size(blk->dtype);
    const fr_tp_rect *x = &blk->rect;
    float *dst = r->shard + r->shard_at[blk->model_tensor] + x->dst;
    for (uint64_t row = 0; row < x->rows; row++) {
        fr_st_tensor v = {.name = "weight", .dtype = blk->dtype, .ndim = 1, .shape = {(int64_t)x->width},
                          .nbytes = es * x->width, .data = r->buf + blk->src_at + es * (x->src + row * x->src_pitch)};
        float *out = dst + row * x->dst_pitch;
        fr_status st = fr_st_tensor_to_f32(&v, out, (size_t)x->width);
        if (st) return st;
        for (uint64_t i = 0; i < x->width && h->bad < 0; i++)
            if (!isfinite(out[i])) {
                h->bad = (long long)(x->src + row * x->src_pitch + i);
                h->bad_tensor = blk->model_tensor;
            }
        r->kept += 4 * x->width;
    }
    return FR_OK;
}

fr_status fr_wsync_rank_bucket(fr_wsync_rank *r, const fr_wsync_bucket *b, const fr_wsync_transport *t)
{
    if (!r || !b || !t || !t->recv) return fr_fail(FR_EINVAL, "fr_wsync_rank_bucket: bad argument");
    if (!r->shard) return fr_fail(FR_EINVAL, "fr_wsync_rank_bucket: this rank has no host stage");
    /* the checks first: a refused bucket is still received, so every rank
     * takes the same bytes off the transport and the group stays in step */
    fr_status st = fr_wsync_rank_plan(r, b);
    const int refused = st != FR_OK;
    const uint64_t n = b->nbytes <= r->buf_bytes ? b->nbytes : 0;
    fr_status rs = t->recv(t->ctx, b->bucket, r->buf, (size_t)n);
    if (refused) return st;
    if (rs) return fault(r, FR_WSYNC_TRANSPORT, fr_fail(rs, "update to version %llu: bucket %d did not arrive: %s",
                         (unsigned long long)r->version, b->bucket, fr_last_error()));
    uint64_t h = 0;
    if (fr_dev_checksum_host(r->buf, (size_t)b->nbytes, &h))
        return fault(r, FR_WSYNC_NO_MEMORY, fr_fail(FR_ENOMEM, "weight sync: out of memory"));
    if (h != b->checksum)
        return fault(r, FR_WSYNC_BAD_CHECKSUM, fr_fail(FR_EINVAL, "update to version %llu: bucket %d: the received "
                     "bytes' checksum is %016llx, the message says %016llx", (unsigned long long)r->version,
                     b->bucket, (unsigned long long)h, (unsigned long long)b->checksum));
    host_ctx c = {.r = r, .bad = -1, .bad_tensor = -1};
    st = fr_wsync_rank_blocks(r, b, host_block, &c);
    if (st) return fault(r, FR_WSYNC_BAD_BUCKET, st);
    if (c.bad >= 0)
        return fault(r, FR_WSYNC_NON_FINITE, fr_fail(FR_EFORMAT, "update to version %llu: bucket %d: \"%s\": a "
                     "value of the piece (element %lld of it) is NaN or infinite", (unsigned long long)r->version,
                     b->bucket, r->mt[c.bad_tensor].name, c.bad));
    return fr_wsync_rank_bucket_done(r, b, 1, FR_WSYNC_OK);
}

fr_status fr_wsync_rank_ready(const fr_wsync_rank *r)
{
    if (!r || !r->updating) return fr_fail(FR_EINVAL, "no weight update is in progress on this rank");
    if (r->fault) return fr_fail(FR_EINVAL, "update to version %llu failed on this rank", (unsigned long long)r->version);
    if (r->next_done != r->next_bucket)
        return fr_fail(FR_EINVAL, "update to version %llu: bucket %d is still in flight", (unsigned long long)r->version,
                       r->next_done);
    for (int i = 0; i < r->n_d; i++)
        if (r->d[i].received != r->d[i].bytes)
            return fr_fail(FR_EINVAL, "update to version %llu: \"%s\" has %llu of its %llu bytes",
                           (unsigned long long)r->version, r->mt[r->d[i].model].name,
                           (unsigned long long)r->d[i].received, (unsigned long long)r->d[i].bytes);
    if (!r->partial)
        for (int i = 0; i < r->n_mt; i++)
            if (!r->touched[i])
                return fr_fail(FR_EINVAL, "update to version %llu: \"%s\" was not sent (every weight of the model "
                               "must be, or the update is partial)", (unsigned long long)r->version, r->mt[i].name);
    return FR_OK;
}

fr_wsync_fault fr_wsync_rank_fault(const fr_wsync_rank *r) { return r ? r->fault : FR_WSYNC_OK; }
uint64_t fr_wsync_rank_version(const fr_wsync_rank *r) { return r ? r->version : 0; }
uint64_t fr_wsync_rank_bytes_received(const fr_wsync_rank *r) { return r ? r->received : 0; }
uint64_t fr_wsync_rank_bytes_kept(const fr_wsync_rank *r) { return r ? r->kept : 0; }
int fr_wsync_rank_touched(const fr_wsync_rank *r, int i) { return r && i >= 0 && i < r->n_mt && r->touched[i]; }

const float *fr_wsync_rank_local(const fr_wsync_rank *r, int i, const fr_tp_part **part)
{
    if (!r || i < 0 || i >= r->n_mt) return NULL;
    if (part) *part = &r->part[i];
    return r->shard ? r->shard + r->shard_at[i] : NULL;
}
