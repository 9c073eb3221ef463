/* One rank's cut of a weight update broadcast whole to every rank
 * (rollout/engine/wsync_rank.h). */
#include "rollout/engine/wsync_rank.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "comm/dev_checksum.h"
#include "rollout/model/tensor_table.h"

struct fr_wsync_rank {
    fr_model_config cfg;
    fr_tp_layout layout;
    fr_model_tensor *mt;     /* the model's tensors (names, whole shapes) */
    fr_tp_part *part;        /* this rank's part of each */
    int n_mt;
    float *shard;            /* host stage: every local part, one after another */
    size_t *shard_at;        /* where tensor i's part starts in shard */
    uint64_t kept;
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
    r->part = calloc(n ? n : 1, sizeof *r->part);
    r->shard_at = calloc(n + 1, sizeof *r->shard_at);
    if (!r->part || !r->shard_at) return fr_fail(FR_ENOMEM, "weight sync: out of memory");
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
    if (st) fr_wsync_rank_destroy(&r);   /* r is NULL then, as *out must be */
    *out = r;
    return st;
}

void fr_wsync_rank_destroy(fr_wsync_rank **pr)
{
    fr_wsync_rank *r = pr ? *pr : NULL;
    if (!r) return;
    free(r->mt);
    free(r->part);
    free(r->shard);
    free(r->shard_at);
    free(r->buf);
    free(r);
    *pr = NULL;
}

fr_status fr_wsync_rank_blocks(const fr_wsync_rank *r, const fr_weight_bucket *b, fr_wsync_block_fn fn, void *user)
{
    if (!r || !b || !fn || (b->n_pieces && !b->pieces)) return fr_fail(FR_EINVAL, "fr_wsync_rank_blocks: bad argument");
    fr_status st = FR_OK;
    for (int k = 0; k < b->n_pieces && !st; k++) {
        const fr_weight_piece *p = &b->pieces[k];
        const uint64_t es = fr_dtype_size(p->t.dtype);
        if (p->tensor < 0 || p->tensor >= r->n_mt || es == 0)
            return fr_fail(FR_EINVAL, "bucket %d: piece %d was not accepted by the update's rules", b->bucket, k);
        fr_tp_rect rect[FR_TP_PIECE_MAX_RECTS];
        const int nr = fr_tp_piece_rects(&r->part[p->tensor], p->offset / es, p->nbytes / es, rect);
        if (nr < 0) return fr_fail(FR_EINVAL, "bucket %d: piece %d lies outside its tensor", b->bucket, k);
        for (int j = 0; j < nr && !st; j++) {
            const fr_wsync_block blk = {.model_tensor = p->tensor, .piece = k, .dtype = p->t.dtype, .src_at = p->at,
                                        .rect = rect[j], .part = &r->part[p->tensor]};
            st = fn(user, &blk);
        }
    }
    return st;
}

/* Host stage: a block converted to float32 into the rank's shard. */
typedef struct {
    fr_wsync_rank *r;
    int bad_piece;        /* the first piece with a non-finite element, or -1 */
    uint64_t bad;         /* that element's index in the piece */
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
        for (uint64_t i = 0; i < x->width && h->bad_piece < 0; i++)
            if (!isfinite(out[i])) {
                h->bad_piece = blk->piece;
                h->bad = x->src + row * x->src_pitch + i;
            }
        r->kept += 4 * x->width;
    }
    return FR_OK;
}

/* Room for a bucket of n bytes in the host buffer. */
static int buffer_for(fr_wsync_rank *r, uint64_t n)
{
    if (n <= r->buf_bytes) return 1;
    unsigned char *b = n <= SIZE_MAX ? realloc(r->buf, (size_t)n) : NULL;
    if (!b) return 0;
    r->buf = b;
    r->buf_bytes = n;
    return 1;
}

fr_status fr_wsync_rank_bucket(fr_wsync_rank *r, fr_weight_check *rules, fr_weight_bucket *b,
                               const fr_wsync_transport *t, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!r || !rules || !b || !t || !t->recv) return fr_fail(FR_EINVAL, "fr_wsync_rank_bucket: bad argument");
    if (!r->shard) return fr_fail(FR_EINVAL, "fr_wsync_rank_bucket: this rank has no host stage");
    /* the rules first: a refused bucket is still received, so every rank
     * takes the same bytes off the transport and the group stays in step */
    fr_status st = fr_weight_check_bucket(rules, b, NULL, why);
    const int room = buffer_for(r, b->nbytes);
    fr_status rs = t->recv(t->ctx, b->bucket, r->buf, room ? (size_t)b->nbytes : 0);
    if (st) return st;
    const unsigned long long v = (unsigned long long)b->version;
    if (!room)
        return fr_weight_check_fail(rules, FR_WREF_OUT_OF_MEMORY, fr_fail(FR_ENOMEM, "weight sync: cannot allocate a "
                                    "bucket of %llu bytes", (unsigned long long)b->nbytes), why);
    if (rs)
        return fr_weight_check_fail(rules, FR_WREF_NCCL_FAILED, fr_fail(rs, "update to version %llu: bucket %d did not "
                                    "arrive: %s", v, b->bucket, fr_last_error()), why);
    uint64_t h = 0;
    if (fr_dev_checksum_host(r->buf, (size_t)b->nbytes, &h))
        return fr_weight_check_fail(rules, FR_WREF_OUT_OF_MEMORY, fr_fail(FR_ENOMEM, "weight sync: out of memory"), why);
    host_ctx c = {.r = r, .bad_piece = -1, .bad = 0};
    if ((st = fr_wsync_rank_blocks(r, b, host_block, &c))) return fr_weight_check_fail(rules, FR_WREF_FAILED, st, why);
    return fr_weight_check_done(rules, b, &h, c.bad_piece, c.bad, why);
}

uint64_t fr_wsync_rank_bytes_kept(const fr_wsync_rank *r) { return r ? r->kept : 0; }

const float *fr_wsync_rank_local(const fr_wsync_rank *r, int i, const fr_tp_part **part)
{
    if (!r || i < 0 || i >= r->n_mt) return NULL;
    if (part) *part = &r->part[i];
    return r->shard ? r->shard + r->shard_at[i] : NULL;
}
