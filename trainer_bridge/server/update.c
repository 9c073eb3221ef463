/* Staging of one update_weights (trainer_bridge/server/update.h). */
#include "trainer_bridge/server/update.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* A tensor the begin declared: what its pieces must say, and how many of
 * its bytes arrived. */
typedef struct {
    fr_msg_tensor t;
    uint64_t bytes, received;
} declared;

struct fr_bridge_update {
    fr_weight_update *w;
    declared *d;
    int n;
    uint64_t bucket_bytes, staged;
    int next_bucket;
};

static fr_status fail(const char **code, const char *c, fr_status st)
{
    if (code) *code = c;
    return st;
}

#define FAIL(c, st, ...) fail(code, c, fr_fail(st, __VA_ARGS__))

static void shape_text(const fr_msg_tensor *t, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static const declared *find_declared(const fr_bridge_update *u, const char *name)
{
    for (int i = 0; i < u->n; i++)
        if (strcmp(u->d[i].t.name, name) == 0) return &u->d[i];
    return NULL;
}

fr_status fr_bridge_update_begin(fr_weight_update *staged, const fr_msg_update_begin *b, fr_bridge_update **out,
                                 const char **code)
{
    if (code) *code = "bad_message";
    if (!out) return fr_fail(FR_EINVAL, "update: out is NULL");
    *out = NULL;
    if (!staged || !b || b->n_tensors < 1 || !b->tensors) return fr_fail(FR_EINVAL, "update: begin needs tensors");
    for (int i = 0; i < b->n_tensors; i++) {
        const fr_msg_tensor *t = &b->tensors[i];
        const int k = fr_weight_update_find(staged, t->name);
        int ndim = 0;
        int64_t shape[2] = {0, 0};
        const char *name;
        if (k < 0 || fr_weight_update_tensor(staged, k, &name, &ndim, shape))
            return FAIL("unknown_tensor", FR_EINVAL, "update to version %llu: \"%s\" is not a weight of this model",
                        (unsigned long long)b->version, t->name);
        fr_status st = fr_bridge_check_model_shape(t, ndim, shape, b->version, code);
        if (st) return st;
    }
    fr_bridge_update *u = calloc(1, sizeof *u);
    if (!u || !(u->d = calloc((size_t)b->n_tensors, sizeof *u->d))) {
        free(u);
        return FAIL("out_of_memory", FR_ENOMEM, "update to version %llu: out of memory",
                    (unsigned long long)b->version);
    }
    fr_status st = fr_weight_update_restart(staged, b->version);
    if (!st) st = fr_weight_update_set_partial(staged, b->partial);
    if (st) {
        free(u->d);
        free(u);
        return fail(code, "update_state", st);
    }
    u->w = staged;
    u->n = b->n_tensors;
    u->bucket_bytes = b->bucket_bytes;
    for (int i = 0; i < b->n_tensors; i++) {
        u->d[i].t = b->tensors[i];
        u->d[i].bytes = fr_msg_tensor_bytes(&b->tensors[i]);
    }
    *out = u;
    return FR_OK;
}

fr_status fr_bridge_check_model_shape(const fr_msg_tensor *t, int ndim, const int64_t *shape, uint64_t version,
                                      const char **code)
{
    if (t->ndim == ndim && t->shape[0] == shape[0] && (ndim != 2 || t->shape[1] == shape[1])) return FR_OK;
    char got[128], want[128];
    fr_msg_tensor m = {.ndim = ndim, .shape = {shape[0], ndim == 2 ? shape[1] : 0}};
    shape_text(t, got, sizeof got);
    shape_text(&m, want, sizeof want);
    return FAIL("bad_shape", FR_EINVAL, "update to version %llu: \"%s\" has shape %s, the model's is %s",
                (unsigned long long)version, t->name, got, want);
}

fr_status fr_bridge_check_piece(const fr_msg_tensor *piece, const fr_msg_tensor *declared, uint64_t version,
                                int bucket, const char **code)
{
    const unsigned long long ver = (unsigned long long)version;
    if (piece->dtype != declared->dtype)
        return FAIL("bad_dtype", FR_EINVAL, "update to version %llu: bucket %d: \"%s\" arrives as %s, the begin "
                    "declared %s", ver, bucket, piece->name, fr_dtype_name(piece->dtype),
                    fr_dtype_name(declared->dtype));
    int same = piece->ndim == declared->ndim;
    for (int k = 0; same && k < piece->ndim; k++) same = piece->shape[k] == declared->shape[k];
    if (same) return FR_OK;
    char got[128], want[128];
    shape_text(piece, got, sizeof got);
    shape_text(declared, want, sizeof want);
    return FAIL("bad_shape", FR_EINVAL, "update to version %llu: bucket %d: \"%s\" has shape %s, the begin "
                "declared %s", ver, bucket, piece->name, got, want);
}

uint64_t fr_bridge_payload_xxh64(const fr_wire_msg *w)
{
    XXH64_state_t *s = XXH64_createState();
    if (!s) {   /* the one-shot form needs no state; only a single frame can use it */
        size_t len = 0;
        const void *p = fr_wire_payload(w, 0, &len);
        return XXH64(p ? p : "", len, 0);
    }
    XXH64_reset(s, 0);
    for (int i = 0; i < w->n_payload; i++) {
        size_t len;
        const void *p = fr_wire_payload(w, i, &len);
        if (len) XXH64_update(s, p, len);
    }
    uint64_t h = XXH64_digest(s);
    XXH64_freeState(s);
    return h;
}

fr_status fr_bridge_update_bucket(fr_bridge_update *u, const fr_msg_update_bucket *b, const fr_wire_msg *w,
                                  const char **code)
{
    if (code) *code = "bad_message";
    if (!u || !b || !w) return fr_fail(FR_EINVAL, "update: bucket needs the update, the message and its frames");
    const unsigned long long ver = (unsigned long long)fr_weight_update_version(u->w);
    if (b->version != fr_weight_update_version(u->w))
        return FAIL("update_state", FR_EINVAL, "update_weights_bucket: version %llu, but the update staged is %llu",
                    (unsigned long long)b->version, ver);
    if (b->bucket != u->next_bucket)
        return FAIL("update_state", FR_EINVAL, "update to version %llu: bucket %d arrived, expected bucket %d", ver,
                    b->bucket, u->next_bucket);
    if (w->n_payload != b->n_pieces || w->n_frames != b->n_pieces + 1)
        return FAIL("bad_bucket", FR_EINVAL, "update to version %llu: bucket %d lists %d pieces but carries %d payload "
                    "frames (one per piece)", ver, b->bucket, b->n_pieces, w->n_frames - 1);
    uint64_t total = 0;
    for (int i = 0; i < b->n_pieces; i++) {
        size_t len;
        fr_wire_payload(w, i, &len);
        if ((uint64_t)len != b->pieces[i].nbytes)
            return FAIL("bad_bucket", FR_EINVAL, "update to version %llu: bucket %d: piece %d of \"%s\" says %llu bytes, "
                        "its frame holds %zu", ver, b->bucket, i, b->pieces[i].t.name,
                        (unsigned long long)b->pieces[i].nbytes, len);
        total += len;
    }
    if (total > u->bucket_bytes)
        return FAIL("bad_bucket", FR_EINVAL, "update to version %llu: bucket %d holds %llu bytes, more than the "
                    "bucket_bytes %llu of the begin", ver, b->bucket, (unsigned long long)total,
                    (unsigned long long)u->bucket_bytes);
    const uint64_t h = fr_bridge_payload_xxh64(w);
    if (h != b->xxh64)
        return FAIL("bad_checksum", FR_EINVAL, "update to version %llu: bucket %d: the payload's xxh64 is %016llx, the "
                    "message says %016llx", ver, b->bucket, (unsigned long long)h, (unsigned long long)b->xxh64);
    /* every piece's name, dtype and shape checked before any is staged */
    for (int i = 0; i < b->n_pieces; i++) {
        const fr_msg_piece *p = &b->pieces[i];
        const declared *d = find_declared(u, p->t.name);
        if (!d)
            return FAIL("unknown_tensor", FR_EINVAL, "update to version %llu: bucket %d: \"%s\" was not listed in the "
                        "begin", ver, b->bucket, p->t.name);
        fr_status st = fr_bridge_check_piece(&p->t, &d->t, ver, b->bucket, code);
        if (st) return st;
    }
    for (int i = 0; i < b->n_pieces; i++) {
        const fr_msg_piece *p = &b->pieces[i];
        int64_t shape[FR_PROTO_MAX_NDIM];
        for (int k = 0; k < p->t.ndim; k++) shape[k] = p->t.shape[k];
        fr_status st = fr_weight_update_put(u->w, p->t.name, p->t.dtype, shape, p->t.ndim, p->offset,
                                            fr_wire_payload(w, i, NULL), (size_t)p->nbytes);
        if (st) {   /* values are checked as they are staged, in the same pass (weight_update.h) */
            char msg[FR_PROTO_TEXT_MAX - 128];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            return FAIL(st == FR_ENOMEM ? "out_of_memory" : st == FR_EFORMAT ? "non_finite" : "bad_piece",
                        st == FR_EFORMAT ? FR_EINVAL : st, "update to version %llu: bucket %d: %s", ver, b->bucket, msg);
        }
        declared *d = (declared *)find_declared(u, p->t.name);
        d->received += p->nbytes;
    }
    u->staged += total;
    u->next_bucket++;
    return FR_OK;
}

fr_status fr_bridge_update_ready(const fr_bridge_update *u, const char **code)
{
    if (code) *code = "bad_message";
    if (!u) return fr_fail(FR_EINVAL, "update: NULL");
    const unsigned long long ver = (unsigned long long)fr_weight_update_version(u->w);
    for (int i = 0; i < u->n; i++)
        if (u->d[i].received != u->d[i].bytes)
            return FAIL("missing_tensor", FR_EINVAL, "update to version %llu: \"%s\" has %llu of its %llu bytes", ver,
                        u->d[i].t.name, (unsigned long long)u->d[i].received, (unsigned long long)u->d[i].bytes);
    fr_status st = fr_weight_update_complete(u->w);
    if (st) {
        char msg[FR_PROTO_TEXT_MAX - 64];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return FAIL("missing_tensor", st, "%s (%s)", msg, fr_weight_update_is_partial(u->w) ? "a partial update "
                    "sends at least one tensor" : "every weight of the model must be sent, or the begin says partial");
    }
    return FR_OK;
}

fr_weight_update *fr_bridge_update_staged(fr_bridge_update *u) { return u ? u->w : NULL; }

fr_weight_update *fr_bridge_update_release_staged(fr_bridge_update *u)
{
    if (!u) return NULL;
    fr_weight_update *w = u->w;
    u->w = NULL;
    return w;
}
uint64_t fr_bridge_update_version(const fr_bridge_update *u) { return u ? fr_weight_update_version(u->w) : 0; }
uint64_t fr_bridge_update_bytes(const fr_bridge_update *u) { return u ? u->staged : 0; }
int fr_bridge_update_next_bucket(const fr_bridge_update *u) { return u ? u->next_bucket : 0; }

void fr_bridge_update_free(fr_bridge_update **pu)
{
    if (!pu || !*pu) return;
    fr_weight_update_free(&(*pu)->w);
    free((*pu)->d);
    free(*pu);
    *pu = NULL;
}
