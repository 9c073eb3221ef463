/* A weight update's messages in the engine's terms (trainer_bridge/server/update.h). */
#include "trainer_bridge/server/update.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

_Static_assert(FR_PROTO_MAX_NDIM == FR_WEIGHT_MAX_NDIM, "the wire's shapes are the engine's");

static fr_weight_tensor tensor_of(const fr_msg_tensor *t)
{
    fr_weight_tensor x = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim};
    for (int d = 0; d < t->ndim && d < FR_WEIGHT_MAX_NDIM; d++) x.shape[d] = t->shape[d];
    return x;
}

fr_status fr_bridge_begin_of(const fr_msg_update_begin *b, fr_weight_begin *out)
{
    memset(out, 0, sizeof *out);
    if (!b || b->n_tensors < 0 || (b->n_tensors > 0 && !b->tensors))
        return fr_fail(FR_EINVAL, "update: a begin needs its tensors");
    out->tensors = malloc(sizeof *out->tensors * (size_t)(b->n_tensors ? b->n_tensors : 1));
    if (!out->tensors) return fr_fail(FR_ENOMEM, "update to version %llu: out of memory", (unsigned long long)b->version);
    for (int i = 0; i < b->n_tensors; i++) out->tensors[i] = tensor_of(&b->tensors[i]);
    out->n_tensors = b->n_tensors;
    out->version = b->version;
    out->bucket_bytes = b->bucket_bytes;
    out->partial = b->partial;
    return FR_OK;
}

/* The xxHash64 (seed 0) of w's payload frames, concatenated. */
static uint64_t payload_xxh64(const fr_wire_msg *w)
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

/* The pieces of a bucket message as the engine's (bytes and `at` left to the caller). */
static fr_status pieces_of(const fr_msg_piece *m, int n, fr_weight_bucket *out)
{
    out->pieces = calloc(n > 0 ? (size_t)n : 1, sizeof *out->pieces);
    if (!out->pieces) return fr_fail(FR_ENOMEM, "update: out of memory taking a bucket");
    for (int i = 0; i < n; i++)
        out->pieces[i] = (fr_weight_piece){.t = tensor_of(&m[i].t), .offset = m[i].offset, .nbytes = m[i].nbytes,
                                           .at = m[i].at, .tensor = -1};
    out->n_pieces = n;
    return FR_OK;
}

fr_status fr_bridge_bucket_of(const fr_msg_update_bucket *b, const fr_wire_msg *w, fr_weight_bucket *out,
                              uint64_t *xxh64)
{
    memset(out, 0, sizeof *out);
    if (!b || !w || !xxh64) return fr_fail(FR_EINVAL, "update: a bucket needs its message and its frames");
    const unsigned long long v = (unsigned long long)b->version;
    if (w->n_payload != b->n_pieces || w->n_frames != b->n_pieces + 1)
        return fr_fail(FR_EINVAL, "update to version %llu: bucket %d lists %d pieces but carries %d payload frames "
                       "(one per piece)", v, b->bucket, b->n_pieces, w->n_frames - 1);
    uint64_t at = 0;
    for (int i = 0; i < b->n_pieces; i++) {
        size_t len;
        fr_wire_payload(w, i, &len);
        if ((uint64_t)len != b->pieces[i].nbytes)
            return fr_fail(FR_EINVAL, "update to version %llu: bucket %d: piece %d of \"%s\" says %llu bytes, its "
                           "frame holds %zu", v, b->bucket, i, b->pieces[i].t.name,
                           (unsigned long long)b->pieces[i].nbytes, len);
    }
    fr_status st = pieces_of(b->pieces, b->n_pieces, out);
    if (st) return st;
    for (int i = 0; i < b->n_pieces; i++) {   /* each piece is a frame of its own: laid end to end */
        out->pieces[i].bytes = fr_wire_payload(w, i, NULL);
        out->pieces[i].at = at;
        at += out->pieces[i].nbytes;
    }
    *out = (fr_weight_bucket){.version = b->version, .bucket = b->bucket, .nbytes = at, .checksum = b->xxh64,
                              .in_order = 0, .pieces = out->pieces, .n_pieces = b->n_pieces};
    *xxh64 = payload_xxh64(w);
    return FR_OK;
}

fr_status fr_bridge_nccl_bucket_of(const fr_msg_nccl_bucket *b, fr_weight_bucket *out)
{
    memset(out, 0, sizeof *out);
    if (!b) return fr_fail(FR_EINVAL, "update: a bucket needs its message");
    fr_status st = pieces_of(b->pieces, b->n_pieces, out);
    if (st) return st;
    *out = (fr_weight_bucket){.version = b->version, .bucket = b->bucket, .nbytes = b->nbytes,
                              .checksum = b->checksum, .in_order = 1, .pieces = out->pieces,
                              .n_pieces = b->n_pieces};
    return FR_OK;
}
