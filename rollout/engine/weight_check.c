/* The rules of a weight update (rollout/engine/weight_check.h). */
#include "rollout/engine/weight_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/tensor_table.h"

/* A tensor of the model, and what this update says of it. */
typedef struct {
    char name[FR_TENSOR_NAME_CAP];
    int ndim;
    int64_t shape[2];        /* the model's; shape[1] is 1 for a 1-D tensor */
    uint64_t count;          /* elements */
    int declared;            /* listed by the begin (an open update: a piece of it came) */
    fr_dtype dtype;          /* the dtype its bytes travel in */
    uint64_t bytes;          /* count x that dtype's size */
    uint64_t accepted;       /* bytes in buckets accepted */
    uint64_t received;       /* bytes in buckets done */
    uint64_t (*ranges)[2];   /* byte ranges accepted: sorted, disjoint, adjacent ones merged */
    int n_ranges, cap_ranges;
} entry;

struct fr_weight_check {
    entry *t;
    int n;
    int updating, open, partial;
    fr_weight_refusal fault;  /* a begun update that broke a rule: it takes nothing more */
    uint64_t version, bucket_bytes, done_bytes;
    int next_bucket, next_done;
};

const char *fr_weight_refusal_name(fr_weight_refusal r)
{
    switch (r) {
    case FR_WREF_NONE: return "ok";
    case FR_WREF_BAD_MESSAGE: return "bad_message";
    case FR_WREF_BAD_VERSION: return "bad_version";
    case FR_WREF_UNKNOWN_TENSOR: return "unknown_tensor";
    case FR_WREF_BAD_SHAPE: return "bad_shape";
    case FR_WREF_BAD_DTYPE: return "bad_dtype";
    case FR_WREF_BAD_BUCKET: return "bad_bucket";
    case FR_WREF_BAD_CHECKSUM: return "bad_checksum";
    case FR_WREF_NON_FINITE: return "non_finite";
    case FR_WREF_BAD_PIECE: return "bad_piece";
    case FR_WREF_MISSING_TENSOR: return "missing_tensor";
    case FR_WREF_UPDATE_STATE: return "update_state";
    case FR_WREF_OUT_OF_MEMORY: return "out_of_memory";
    case FR_WREF_FAILED: return "update_failed";
    case FR_WREF_NCCL_UNAVAILABLE: return "nccl_unavailable";
    case FR_WREF_NCCL_FAILED: return "nccl_failed";
    }
    return "update_failed";
}

/* Every refusal goes through here: a begun update is failed for good. */
static fr_status refuse(fr_weight_check *c, fr_weight_refusal *why, fr_weight_refusal r, fr_status st)
{
    if (why) *why = r;
    if (c && c->updating && !c->open && !c->fault) c->fault = r;
    return st;
}

static fr_status add_tensor(void *user, const fr_model_tensor *m)
{
    fr_weight_check *c = user;
    entry *x = &c->t[c->n++];
    snprintf(x->name, sizeof x->name, "%s", m->name);
    x->ndim = m->ndim;
    x->shape[0] = m->rows;
    x->shape[1] = m->ndim == 2 ? m->cols : 1;
    x->count = (uint64_t)x->shape[0] * (uint64_t)x->shape[1];
    return FR_OK;
}

fr_status fr_weight_check_new(const fr_model_config *cfg, fr_weight_check **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_weight_check_new: out is NULL");
    *out = NULL;
    if (!cfg) return fr_fail(FR_EINVAL, "fr_weight_check_new: cfg is NULL");
    fr_weight_check *c = calloc(1, sizeof *c);
    const size_t n = fr_model_tensor_count(cfg);
    if (!c || !(c->t = calloc(n ? n : 1, sizeof *c->t))) {
        free(c);
        return fr_fail(FR_ENOMEM, "weight update: out of memory");
    }
    const fr_weights none = {0};
    fr_model_tensors_each(cfg, &none, add_tensor, c);
    *out = c;
    return FR_OK;
}

void fr_weight_check_free(fr_weight_check **pc)
{
    fr_weight_check *c = pc ? *pc : NULL;
    if (!c) return;
    for (int i = 0; i < c->n; i++) free(c->t[i].ranges);
    free(c->t);
    free(c);
    *pc = NULL;
}

int fr_weight_check_tensor_count(const fr_weight_check *c) { return c ? c->n : 0; }

int fr_weight_check_find(const fr_weight_check *c, const char *name)
{
    for (int i = 0; c && name && i < c->n; i++)
        if (strcmp(c->t[i].name, name) == 0) return i;
    return -1;
}

fr_status fr_weight_check_tensor(const fr_weight_check *c, int i, const char **name, int *ndim, int64_t shape[2])
{
    if (!c || i < 0 || i >= c->n || !name || !ndim || !shape) return fr_fail(FR_EINVAL, "weight update: no tensor %d", i);
    *name = c->t[i].name;
    *ndim = c->t[i].ndim;
    shape[0] = c->t[i].shape[0];
    shape[1] = c->t[i].shape[1];
    return FR_OK;
}

fr_status fr_weight_check_version(uint64_t serving, uint64_t version, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NONE;
    if (version > serving) return FR_OK;
    return refuse(NULL, why, FR_WREF_BAD_VERSION,
                  fr_fail(FR_EINVAL, "update to version %llu: the version must be greater than the version serving, "
                          "%llu", (unsigned long long)version, (unsigned long long)serving));
}

static void declare(entry *x, fr_dtype dtype)
{
    x->declared = 1;
    x->dtype = dtype;
    x->bytes = x->count * fr_dtype_size(dtype);
}

static void reset(fr_weight_check *c)
{
    for (int i = 0; i < c->n; i++) {
        entry *x = &c->t[i];
        x->declared = 0;
        x->accepted = x->received = 0;
        x->n_ranges = 0;
    }
    c->updating = c->open = c->partial = 0;
    c->fault = FR_WREF_NONE;
    c->done_bytes = 0;
    c->next_bucket = c->next_done = 0;
}

void fr_weight_check_end(fr_weight_check *c)
{
    if (c) reset(c);
}

void fr_weight_check_open(fr_weight_check *c, uint64_t version)
{
    if (!c) return;
    reset(c);
    c->updating = c->open = 1;
    c->version = version;
    c->bucket_bytes = UINT64_MAX;
}

void fr_weight_check_set_partial(fr_weight_check *c, int partial)
{
    if (c) c->partial = partial != 0;
}

static void shape_text(int ndim, const int64_t *shape, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static int same_shape(const entry *x, const fr_weight_tensor *t)
{
    return t->ndim == x->ndim && t->shape[0] == x->shape[0] && (x->ndim != 2 || t->shape[1] == x->shape[1]);
}

/* bad_shape: t against x, the model's (against_begin: as the begin declared it). */
static fr_status shape_refused(fr_weight_check *c, fr_weight_refusal *why, const char *where, const entry *x,
                               const fr_weight_tensor *t, int against_begin)
{
    char got[160], want[64];
    shape_text(t->ndim > 0 && t->ndim <= FR_WEIGHT_MAX_NDIM ? t->ndim : 0, t->shape, got, sizeof got);
    shape_text(x->ndim, x->shape, want, sizeof want);
    return refuse(c, why, FR_WREF_BAD_SHAPE, fr_fail(FR_EINVAL, "%s\"%s\" has shape %s, the %s is %s", where, t->name,
                                                     got, against_begin ? "begin declared" : "model's", want));
}

fr_status fr_weight_check_begin(fr_weight_check *c, const fr_weight_begin *b, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NONE;
    if (!c || !b) return refuse(c, why, FR_WREF_BAD_MESSAGE, fr_fail(FR_EINVAL, "fr_weight_check_begin: NULL argument"));
    reset(c);
    const unsigned long long v = (unsigned long long)b->version;
    char where[64];
    snprintf(where, sizeof where, "update to version %llu: ", v);
    if (b->n_tensors < 1 || !b->tensors)
        return refuse(c, why, FR_WREF_BAD_MESSAGE, fr_fail(FR_EINVAL, "%sthe begin declares no tensor", where));
    if (b->bucket_bytes < 1)
        return refuse(c, why, FR_WREF_BAD_BUCKET, fr_fail(FR_EINVAL, "%sbucket_bytes must be at least 1", where));
    fr_status st = FR_OK;
    for (int i = 0; i < b->n_tensors && !st; i++) {
        const fr_weight_tensor *t = &b->tensors[i];
        const int k = fr_weight_check_find(c, t->name);
        entry *x = k >= 0 ? &c->t[k] : NULL;
        if (!x)
            st = refuse(c, why, FR_WREF_UNKNOWN_TENSOR, fr_fail(FR_EINVAL, "%s\"%s\" is not a weight of this model",
                                                                where, t->name ? t->name : "(null)"));
        else if (!fr_dtype_is_weight(t->dtype))
            st = refuse(c, why, FR_WREF_BAD_DTYPE, fr_fail(FR_EINVAL, "%s\"%s\" is declared as %s; weights travel as "
                                                           "f32, bf16 or f16", where, t->name, fr_dtype_name(t->dtype)));
        else if (!same_shape(x, t))
            st = shape_refused(c, why, where, x, t, 0);
        else if (x->declared)
            st = refuse(c, why, FR_WREF_BAD_MESSAGE, fr_fail(FR_EINVAL, "%s\"%s\" is declared twice", where, t->name));
        else
            declare(x, t->dtype);
    }
    if (st) {
        reset(c);
        return st;
    }
    c->updating = 1;
    c->partial = b->partial != 0;
    c->version = b->version;
    c->bucket_bytes = b->bucket_bytes;
    return FR_OK;
}

/* Whether bytes [a, b) of x overlap a range accepted before. */
static int overlaps(const entry *x, uint64_t a, uint64_t b)
{
    for (int i = 0; i < x->n_ranges; i++)
        if (x->ranges[i][0] < b && x->ranges[i][1] > a) return 1;
    return 0;
}

/* Records bytes [a, b) of x, which overlap nothing, merging neighbours.
 * Room for two more ranges is kept, so taking one back never allocates. */
static fr_status claim(entry *x, uint64_t a, uint64_t b)
{
    if (x->n_ranges + 2 > x->cap_ranges) {
        int cap = x->cap_ranges ? 2 * x->cap_ranges : 4;
        uint64_t(*r)[2] = realloc(x->ranges, sizeof *r * (size_t)cap);
        if (!r) return fr_fail(FR_ENOMEM, "weight update: out of memory");
        x->ranges = r;
        x->cap_ranges = cap;
    }
    int i = 0;
    while (i < x->n_ranges && x->ranges[i][1] < a) i++;
    if (i < x->n_ranges && x->ranges[i][1] == a) {
        x->ranges[i][1] = b;
        if (i + 1 < x->n_ranges && x->ranges[i + 1][0] == b) {
            x->ranges[i][1] = x->ranges[i + 1][1];
            memmove(&x->ranges[i + 1], &x->ranges[i + 2], sizeof x->ranges[0] * (size_t)(x->n_ranges - i - 2));
            x->n_ranges--;
        }
    } else if (i < x->n_ranges && x->ranges[i][0] == b) {
        x->ranges[i][0] = a;
    } else {
        memmove(&x->ranges[i + 1], &x->ranges[i], sizeof x->ranges[0] * (size_t)(x->n_ranges - i));
        x->ranges[i][0] = a;
        x->ranges[i][1] = b;
        x->n_ranges++;
    }
    x->accepted += b - a;
    return FR_OK;
}

/* Takes bytes [a, b) of x, claimed before, back. */
static void unclaim(entry *x, uint64_t a, uint64_t b)
{
    for (int i = 0; i < x->n_ranges; i++) {
        uint64_t *r = x->ranges[i];
        if (r[0] > a || r[1] < b) continue;
        if (r[0] == a && r[1] == b) {
            memmove(&x->ranges[i], &x->ranges[i + 1], sizeof x->ranges[0] * (size_t)(x->n_ranges - i - 1));
            x->n_ranges--;
        } else if (r[0] == a) {
            r[0] = b;
        } else if (r[1] == b) {
            r[1] = a;
        } else {   /* split in two: claim kept the room */
            memmove(&x->ranges[i + 2], &x->ranges[i + 1], sizeof x->ranges[0] * (size_t)(x->n_ranges - i - 1));
            x->ranges[i + 1][0] = b;
            x->ranges[i + 1][1] = r[1];
            r[1] = a;
            x->n_ranges++;
        }
        x->accepted -= b - a;
        return;
    }
}

/* The prefix of a bucket's messages. */
static void bucket_where(const fr_weight_check *c, int bucket, char *buf, size_t cap)
{
    if (c->open) snprintf(buf, cap, "update to version %llu: ", (unsigned long long)c->version);
    else snprintf(buf, cap, "update to version %llu: bucket %d: ", (unsigned long long)c->version, bucket);
}

/* The rules of one piece against its update and the pieces before it in
 * its bucket (*end: where the last one ended). Changes nothing. */
static fr_status check_piece(fr_weight_check *c, fr_weight_bucket *b, int k, uint64_t *end, fr_weight_refusal *why)
{
    fr_weight_piece *p = &b->pieces[k];
    char w[96];
    bucket_where(c, b->bucket, w, sizeof w);
    const char *name = p->t.name ? p->t.name : "(null)";
    const int i = fr_weight_check_find(c, p->t.name);
    entry *x = i >= 0 ? &c->t[i] : NULL;
    if (!x || (!c->open && !x->declared))
        return refuse(c, why, FR_WREF_UNKNOWN_TENSOR,
                      fr_fail(FR_EINVAL, "%s\"%s\" %s", w, name,
                              c->open ? "is not a weight of this model" : "was not listed in the begin"));
    if (!fr_dtype_is_weight(p->t.dtype))
        return refuse(c, why, FR_WREF_BAD_DTYPE, fr_fail(FR_EINVAL, "%s\"%s\" arrives as %s; weights travel as f32, "
                                                         "bf16 or f16", w, name, fr_dtype_name(p->t.dtype)));
    if (x->declared && p->t.dtype != x->dtype)
        return refuse(c, why, FR_WREF_BAD_DTYPE,
                      fr_fail(FR_EINVAL, "%s\"%s\" arrives as %s, %s %s", w, name, fr_dtype_name(p->t.dtype),
                              c->open ? "its first piece came as" : "the begin declared", fr_dtype_name(x->dtype)));
    if (!same_shape(x, &p->t)) return shape_refused(c, why, w, x, &p->t, !c->open);
    const uint64_t es = fr_dtype_size(p->t.dtype), tensor_bytes = x->count * es;
    const unsigned long long off = (unsigned long long)p->offset, to = off + (unsigned long long)p->nbytes;
    if (p->nbytes < 1 || p->offset % es || p->nbytes % es || (b->in_order && p->at % es))
        return refuse(c, why, FR_WREF_BAD_PIECE,
                      fr_fail(FR_EINVAL, "%s\"%s\": bytes [%llu, %llu) at byte %llu of the bucket: offsets and "
                              "lengths must be multiples of the %s size, %llu", w, name, off, to,
                              (unsigned long long)p->at, fr_dtype_name(p->t.dtype), (unsigned long long)es));
    if (p->at < *end || p->at > b->nbytes || p->nbytes > b->nbytes - p->at)
        return refuse(c, why, FR_WREF_BAD_PIECE,
                      fr_fail(FR_EINVAL, "%s\"%s\": the piece at byte %llu (%llu bytes) is not inside the bucket's "
                              "%llu bytes after the pieces before it", w, name, (unsigned long long)p->at,
                              (unsigned long long)p->nbytes, (unsigned long long)b->nbytes));
    if (p->offset > tensor_bytes || p->nbytes > tensor_bytes - p->offset)
        return refuse(c, why, FR_WREF_BAD_PIECE, fr_fail(FR_EINVAL, "%s\"%s\": bytes [%llu, %llu) run past the "
                                                         "tensor's %llu bytes", w, name, off, to,
                                                         (unsigned long long)tensor_bytes));
    if (b->in_order && p->offset != x->accepted)
        return refuse(c, why, FR_WREF_BAD_PIECE,
                      fr_fail(FR_EINVAL, "%s\"%s\": the piece starts at byte %llu; its pieces must come in order, "
                              "and %llu bytes of it arrived so far", w, name, off, (unsigned long long)x->accepted));
    if (overlaps(x, p->offset, p->offset + p->nbytes))
        return refuse(c, why, FR_WREF_BAD_PIECE, fr_fail(FR_EINVAL, "%s\"%s\": bytes [%llu, %llu) overlap bytes "
                                                         "received before", w, name, off, to));
    *end = p->at + p->nbytes;
    p->tensor = i;
    return FR_OK;
}

/* The rules of the bucket itself, before its pieces. */
static fr_status check_head(fr_weight_check *c, const fr_weight_bucket *b, const uint64_t *checksum,
                            fr_weight_refusal *why)
{
    const unsigned long long v = (unsigned long long)c->version;
    if (!c->updating)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "bucket %d for version %llu: no weight update "
                                                            "is in progress", b->bucket, (unsigned long long)b->version));
    if (c->fault)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "update to version %llu failed (%s); it takes "
                                                            "no more buckets", v, fr_weight_refusal_name(c->fault)));
    if (b->version != c->version)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "bucket %d is for version %llu, but the update "
                                                            "in progress is to version %llu", b->bucket,
                                                            (unsigned long long)b->version, v));
    if (b->bucket != c->next_bucket)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "update to version %llu: bucket %d arrived, "
                                                            "expected bucket %d", v, b->bucket, c->next_bucket));
    if (b->n_pieces < 1 || b->nbytes > c->bucket_bytes)
        return refuse(c, why, FR_WREF_BAD_BUCKET,
                      fr_fail(FR_EINVAL, "update to version %llu: bucket %d holds %llu bytes in %d pieces; a bucket "
                              "holds at least one piece and at most the bucket_bytes %llu of the begin", v, b->bucket,
                              (unsigned long long)b->nbytes, b->n_pieces, (unsigned long long)c->bucket_bytes));
    if (checksum && *checksum != b->checksum)
        return refuse(c, why, FR_WREF_BAD_CHECKSUM,
                      fr_fail(FR_EINVAL, "update to version %llu: bucket %d: the checksum of the bytes received is "
                              "%016llx, the message says %016llx", v, b->bucket, (unsigned long long)*checksum,
                              (unsigned long long)b->checksum));
    return FR_OK;
}

fr_status fr_weight_check_bucket(fr_weight_check *c, fr_weight_bucket *b, const uint64_t *checksum,
                                 fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NONE;
    if (!c || !b || (b->n_pieces > 0 && !b->pieces))
        return refuse(c, why, FR_WREF_BAD_MESSAGE, fr_fail(FR_EINVAL, "fr_weight_check_bucket: bad argument"));
    fr_status st = check_head(c, b, checksum, why);
    uint64_t end = 0;
    for (int k = 0; k < b->n_pieces && !st; k++) {
        st = check_piece(c, b, k, &end, why);
        entry *x = st ? NULL : &c->t[b->pieces[k].tensor];
        if (x && !x->declared) declare(x, b->pieces[k].t.dtype);   /* an open update's first piece of it */
        if (x && claim(x, b->pieces[k].offset, b->pieces[k].offset + b->pieces[k].nbytes))
            st = refuse(c, why, FR_WREF_OUT_OF_MEMORY, FR_ENOMEM);
    }
    if (!st) c->next_bucket++;
    return st;
}

void fr_weight_check_unaccept(fr_weight_check *c, const fr_weight_bucket *b)
{
    if (!c || !b || b->bucket != c->next_bucket - 1 || c->next_done > b->bucket) return;
    for (int k = b->n_pieces - 1; k >= 0; k--) {
        const fr_weight_piece *p = &b->pieces[k];
        if (p->tensor < 0 || p->tensor >= c->n) continue;
        entry *x = &c->t[p->tensor];
        unclaim(x, p->offset, p->offset + p->nbytes);
        if (c->open && x->accepted == 0) x->declared = 0;   /* its dtype is free again */
    }
    c->next_bucket--;
}

/* Whether the element at p (little-endian) is a NaN: all-ones exponent,
 * nonzero mantissa. */
static int is_nan(fr_dtype t, const unsigned char *p)
{
    uint32_t v = 0;
    memcpy(&v, p, fr_dtype_size(t));
    if (t == FR_DTYPE_F32) return (v & 0x7f800000u) == 0x7f800000u && (v & 0x7fffffu);
    if (t == FR_DTYPE_BF16) return (v & 0x7f80u) == 0x7f80u && (v & 0x7fu);
    return (v & 0x7c00u) == 0x7c00u && (v & 0x3ffu);
}

fr_status fr_weight_check_done(fr_weight_check *c, const fr_weight_bucket *b, const uint64_t *checksum, int bad_piece,
                               uint64_t bad_element, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NONE;
    if (!c || !b) return refuse(c, why, FR_WREF_BAD_MESSAGE, fr_fail(FR_EINVAL, "fr_weight_check_done: NULL argument"));
    const unsigned long long v = (unsigned long long)c->version;
    if (!c->updating || c->fault)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "bucket %d: no weight update is in progress",
                                                            b->bucket));
    if (b->bucket != c->next_done || c->next_done >= c->next_bucket)
        return refuse(c, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "update to version %llu: bucket %d finished, "
                                                            "but bucket %d is the oldest in flight", v, b->bucket,
                                                            c->next_done));
    if (checksum && *checksum != b->checksum)
        return refuse(c, why, FR_WREF_BAD_CHECKSUM,
                      fr_fail(FR_EINVAL, "update to version %llu: bucket %d: the checksum of the bytes received is "
                              "%016llx, the message says %016llx", v, b->bucket, (unsigned long long)*checksum,
                              (unsigned long long)b->checksum));
    if (bad_piece >= 0) {
        const fr_weight_piece *p = bad_piece < b->n_pieces ? &b->pieces[bad_piece] : NULL;
        const size_t es = p ? fr_dtype_size(p->t.dtype) : 1;
        const char *what = !p || !p->bytes ? "NaN or infinite (in BF16)"
                           : is_nan(p->t.dtype, (const unsigned char *)p->bytes + bad_element * es)
                               ? "NaN" : "infinite (or rounds to infinity in BF16)";
        char w[96];
        bucket_where(c, b->bucket, w, sizeof w);
        return refuse(c, why, FR_WREF_NON_FINITE,
                      fr_fail(FR_EINVAL, "%s\"%s\": element %llu is %s", w, p ? p->t.name : "?",
                              (unsigned long long)(p ? bad_element + p->offset / es : bad_element), what));
    }
    for (int k = 0; k < b->n_pieces; k++)
        if (b->pieces[k].tensor < 0 || b->pieces[k].tensor >= c->n)
            return refuse(c, why, FR_WREF_FAILED, fr_fail(FR_EINTERNAL, "update to version %llu: bucket %d: piece %d "
                                                          "was not accepted by fr_weight_check_bucket", v, b->bucket, k));
    for (int k = 0; k < b->n_pieces; k++) c->t[b->pieces[k].tensor].received += b->pieces[k].nbytes;
    c->done_bytes += b->nbytes;
    c->next_done++;
    return FR_OK;
}

fr_status fr_weight_check_fail(fr_weight_check *c, fr_weight_refusal r, fr_status st, fr_weight_refusal *why)
{
    return refuse(c, why, r, st ? st : FR_EINTERNAL);
}

fr_status fr_weight_check_ready(const fr_weight_check *c, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_NONE;
    if (!c || !c->updating)
        return refuse(NULL, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "no weight update is in progress"));
    const unsigned long long v = (unsigned long long)c->version;
    if (c->fault)
        return refuse(NULL, why, FR_WREF_UPDATE_STATE, fr_fail(FR_EINVAL, "update to version %llu failed (%s) and "
                                                               "cannot commit", v, fr_weight_refusal_name(c->fault)));
    if (c->next_done != c->next_bucket)
        return refuse(NULL, why, FR_WREF_UPDATE_STATE,
                      fr_fail(FR_EINVAL, "update to version %llu: bucket %d is still in flight", v, c->next_done));
    int any = 0;
    for (int i = 0; i < c->n; i++) {
        const entry *x = &c->t[i];
        any |= x->declared;
        if (x->declared && x->received != x->bytes)
            return refuse(NULL, why, FR_WREF_MISSING_TENSOR,
                          fr_fail(FR_EINVAL, "update to version %llu: \"%s\" has %llu of its %llu bytes", v, x->name,
                                  (unsigned long long)x->received, (unsigned long long)x->bytes));
        if (!x->declared && !c->partial)
            return refuse(NULL, why, FR_WREF_MISSING_TENSOR,
                          fr_fail(FR_EINVAL, "update to version %llu: \"%s\" was not sent (every weight of the model "
                                  "must be, unless the update is partial)", v, x->name));
    }
    if (!any)
        return refuse(NULL, why, FR_WREF_MISSING_TENSOR,
                      fr_fail(FR_EINVAL, "update to version %llu: no tensor arrived (a partial update sends at least "
                              "one)", v));
    return FR_OK;
}

int fr_weight_check_updating(const fr_weight_check *c) { return c && c->updating; }
int fr_weight_check_buckets(const fr_weight_check *c) { return c ? c->next_bucket : 0; }
int fr_weight_check_in_flight(const fr_weight_check *c) { return c ? c->next_bucket - c->next_done : 0; }
int fr_weight_check_partial(const fr_weight_check *c) { return c && c->partial; }
uint64_t fr_weight_check_version_of(const fr_weight_check *c) { return c ? c->version : 0; }
uint64_t fr_weight_check_bytes(const fr_weight_check *c) { return c ? c->done_bytes : 0; }
int fr_weight_check_received(const fr_weight_check *c, int i) { return c && i >= 0 && i < c->n && c->t[i].received > 0; }
