/* The rank side of a weight update broadcast whole to every rank
 * (rollout/engine/wsync_rank.h, rollout/model/tp_piece.h) under the
 * update's rules (rollout/engine/weight_check.h): every rank keeps exactly
 * its tensor-parallel shard of each piece, whatever the cut of tensors into
 * pieces and buckets; refused buckets, a wrong checksum on one rank and a
 * sender that stops mid-update leave the update not ready.
 *
 * Alone, the ranks of an engine live in this process and a fake transport
 * hands each the same bucket bytes. Under mpirun (tests/integration/
 * wsync_mpi.sh) world rank 0 plays the trainer, broadcasting each bucket over
 * MPI, the other ranks are engines of tp 2, and the commit is decided by
 * every rank's vote (fr_mpi_world_all_ok): all switch to the new version or
 * none does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/fp_formats.h"
#include "comm/dev_checksum.h"
#include "comm/mpi_world.h"
#include "rollout/engine/wsync_rank.h"
#include "rollout/model/tensor_table.h"
#include "rollout/model/tp_piece.h"
#include "tests/unit/test_util.h"

static fr_mpi_world *W;

/* ---- the trainer's side: tensors cut into pieces, pieces packed into buckets */

typedef struct {
    fr_weight_tensor *t;
    fr_model_tensor *mt;
    int n;
    fr_weight_piece *p;
    int n_p;
    fr_weight_bucket *b;
    int n_b;
    unsigned char **bytes;   /* each bucket's payload */
} sync_plan;

static void put_value(unsigned char *dst, fr_dtype dt, float v)
{
    if (dt == FR_DTYPE_F32) {
        memcpy(dst, &v, 4);
    } else {
        uint16_t h = fr_bf16_encode(v);
        memcpy(dst, &h, 2);
    }
}

/* Every tensor of m in dtype dt (BF16 for every third tensor when mixed),
 * cut into buckets of bucket_bytes: a tensor larger than the room left is
 * split at an element boundary, so pieces start mid-row. */
static void plan_new(const fr_model *m, uint64_t bucket_bytes, int mixed, sync_plan *s)
{
    memset(s, 0, sizeof *s);
    size_t n = 0;
    assert_int_equal(fr_model_tensor_list(&m->cfg, &m->w, &s->mt, &n), FR_OK);
    s->n = (int)n;
    s->t = calloc(n, sizeof *s->t);
    s->p = calloc(64 * n + 4096, sizeof *s->p);
    s->b = calloc(64 * n + 4096, sizeof *s->b);
    s->bytes = calloc(64 * n + 4096, sizeof *s->bytes);
    for (size_t i = 0; i < n; i++)
        s->t[i] = (fr_weight_tensor){.name = s->mt[i].name, .dtype = mixed && i % 3 == 1 ? FR_DTYPE_BF16 : FR_DTYPE_F32,
                                     .ndim = s->mt[i].ndim, .shape = {s->mt[i].rows, s->mt[i].cols}};
    uint64_t fill = bucket_bytes;   /* bytes used in the current bucket */
    for (int i = 0; i < s->n; i++) {
        const size_t es = fr_dtype_size(s->t[i].dtype);
        const uint64_t elems = (uint64_t)s->mt[i].rows * (uint64_t)(s->mt[i].cols ? s->mt[i].cols : 1);
        for (uint64_t e = 0; e < elems;) {
            if (bucket_bytes - fill < es) {
                s->b[s->n_b] = (fr_weight_bucket){.version = 2, .bucket = s->n_b, .in_order = 1,
                                                  .pieces = &s->p[s->n_p]};
                s->bytes[s->n_b] = calloc(1, (size_t)bucket_bytes);
                s->n_b++;
                fill = 0;
            }
            fr_weight_bucket *b = &s->b[s->n_b - 1];
            uint64_t take = (bucket_bytes - fill) / es;
            if (take > elems - e) take = elems - e;
            s->p[s->n_p++] = (fr_weight_piece){.t = s->t[i], .offset = e * es, .nbytes = take * es, .at = fill,
                                               .tensor = -1};
            for (uint64_t k = 0; k < take; k++)
                put_value(s->bytes[s->n_b - 1] + fill + k * es, s->t[i].dtype, s->mt[i].data[e + k]);
            b->n_pieces++;
            fill += take * es;
            b->nbytes = fill;
            e += take;
        }
    }
    for (int k = 0; k < s->n_b; k++)
        assert_int_equal(fr_dev_checksum_host(s->bytes[k], (size_t)s->b[k].nbytes, &s->b[k].checksum), FR_COMM_OK);
}

static void plan_free(sync_plan *s)
{
    for (int k = 0; k < s->n_b; k++) free(s->bytes[k]);
    free(s->bytes);
    free(s->b);
    free(s->p);
    free(s->t);
    free(s->mt);
}

/* ---- a rank's shard against tp_shard.h's cut of the same model ---------- */

static float expected(fr_dtype dt, float v) { return dt == FR_DTYPE_BF16 ? fr_bf16_round(v) : v; }

/* Every tensor rank r holds equals tp_shard's (or, whole, the model's) values
 * of m, in the dtype they travelled in. */
static void check_shard(const fr_wsync_rank *r, const fr_model *m, const sync_plan *s, int rank, int tp)
{
    fr_tp_shard *sh = NULL;
    assert_int_equal(fr_tp_shard_new(m, rank, tp, &sh), FR_OK);
    fr_model_tensor *lt = NULL;
    size_t n = 0;
    assert_int_equal(fr_model_tensor_list(&sh->cfg, &sh->w, &lt, &n), FR_OK);
    assert_int_equal((int)n, s->n);
    for (int i = 0; i < s->n; i++) {
        const fr_tp_part *part = NULL;
        const float *got = fr_wsync_rank_local(r, i, &part);
        assert_non_null(got);
        assert_string_equal(lt[i].name, s->mt[i].name);
        const float *want = part->split == FR_TP_WHOLE ? s->mt[i].data : lt[i].data;
        const int64_t elems = fr_tp_part_elems(part);
        if (part->split != FR_TP_WHOLE) assert_int_equal(elems, lt[i].rows * (lt[i].cols ? lt[i].cols : 1));
        for (int64_t e = 0; e < elems; e++)
            if (got[e] != expected(s->t[i].dtype, want[e]))
                fail_msg("rank %d of %d: %s element %lld: %g, want %g", rank, tp, s->mt[i].name, (long long)e,
                         got[e], expected(s->t[i].dtype, want[e]));
    }
    free(lt);
    fr_tp_shard_destroy(&sh);
}

/* ---- transports --------------------------------------------------------- */

typedef struct {
    const sync_plan *s;
    int corrupt_bucket;   /* flips a byte of this bucket (-1: none) */
    int die_at;           /* the sender is gone from this bucket on (-1: never) */
} fake_ctx;

static fr_status fake_recv(void *ctx, int bucket, void *buf, size_t nbytes)
{
    fake_ctx *f = ctx;
    if (f->die_at >= 0 && bucket >= f->die_at) return fr_fail(FR_EIO, "the sender is gone");
    memcpy(buf, f->s->bytes[bucket], nbytes);
    if (bucket == f->corrupt_bucket) ((unsigned char *)buf)[nbytes / 2] ^= 0x10;
    return FR_OK;
}

/* Begins an update to `version` of the plan's first n tensors. */
static fr_status begin(fr_weight_check *c, const sync_plan *s, uint64_t version, int n, uint64_t bb, int partial)
{
    fr_weight_begin b = {.version = version, .tensors = s->t, .n_tensors = n, .bucket_bytes = bb, .partial = partial};
    fr_weight_refusal why;
    return fr_weight_check_begin(c, &b, &why);
}

/* Bucket k of the plan, for the update to `version`. */
static fr_weight_bucket bucket_of(const sync_plan *s, int k, uint64_t version)
{
    fr_weight_bucket b = s->b[k];
    b.version = version;
    return b;
}

/* Runs the update (version 2) through a rank; returns whether it is ready,
 * and *first (may be NULL) the first refusal. */
static int sync_rank(fr_wsync_rank *r, fr_weight_check *c, const sync_plan *s, const fr_wsync_transport *t,
                     uint64_t bb, int partial, fr_weight_refusal *first)
{
    assert_int_equal(begin(c, s, 2, s->n, bb, partial), FR_OK);
    int ok = 1;
    if (first) *first = FR_WREF_NONE;
    for (int k = 0; k < s->n_b; k++) {
        fr_weight_bucket b = bucket_of(s, k, 2);
        fr_weight_refusal why;
        const int done = fr_wsync_rank_bucket(r, c, &b, t, &why) == FR_OK;
        if (!done && ok && first) *first = why;
        ok &= done;
    }
    return ok && fr_weight_check_ready(c, NULL) == FR_OK;
}

/* A rank and the rules of its update. */
static void rank_new(const fr_model_config *cfg, int rank, int tp, int host_stage, fr_wsync_rank **r,
                     fr_weight_check **c)
{
    assert_int_equal(fr_wsync_rank_new(cfg, rank, tp, host_stage, r), FR_OK);
    assert_int_equal(fr_weight_check_new(cfg, c), FR_OK);
}

static void rank_free(fr_wsync_rank **r, fr_weight_check **c)
{
    fr_wsync_rank_destroy(r);
    fr_weight_check_free(c);
}

static void test_parts_cover_the_shard(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    const uint64_t sizes[] = {1000, 4096, 1 << 20};   /* pieces that cut rows anywhere, and whole tensors */
    for (int tp = 1; tp <= 4; tp *= 2)
        for (int z = 0; z < 3; z++) {
            sync_plan s;
            plan_new(m, sizes[z], z == 1, &s);
            fake_ctx f = {&s, -1, -1};
            fr_wsync_transport t = {fake_recv, &f};
            uint64_t kept = 0;
            for (int rank = 0; rank < tp; rank++) {
                fr_wsync_rank *r = NULL;
                fr_weight_check *c = NULL;
                rank_new(&m->cfg, rank, tp, 1, &r, &c);
                assert_true(sync_rank(r, c, &s, &t, sizes[z], 0, NULL));
                check_shard(r, m, &s, rank, tp);
                kept = fr_wsync_rank_bytes_kept(r);
                rank_free(&r, &c);
            }
            /* no rank keeps the whole model once it is split */
            if (tp > 1) assert_true(kept < 4 * fr_model_param_count(m));
            plan_free(&s);
        }
    fr_model_destroy(&m);
}

/* A model of config c with random weights (fr_model_alloc's layout). */
static fr_model *random_model(const fr_model_config *c, uint64_t seed)
{
    fr_model *m = NULL;
    assert_int_equal(fr_model_alloc(c, "random", &m), FR_OK);
    size_t n;
    float *w = fr_model_data(m, &n);
    fr_test_rng rng = {seed};
    for (size_t i = 0; i < n; i++) w[i] = 0.1f * fr_test_normal(&rng);
    return m;
}

/* Experts (rows of gate and up, columns of down, the router whole), an
 * untied lm_head, latent attention (with and without a query LoRA), and
 * DeepSeek's experts (the router's bias whole, the shared experts' rows
 * and columns) in both tiny DeepSeek models. */
static void test_parts_of_other_layers(void **state)
{
    (void)state;
    fr_model_config c[5];
    fr_synthetic_tiny_config(&c[0]);
    snprintf(c[0].architecture, sizeof c[0].architecture, "Qwen3MoeForCausalLM");
    c[0].num_experts = 4;
    c[0].experts_per_tok = 2;
    c[0].moe_intermediate_size = 64;
    c[0].norm_topk_prob = 1;
    c[0].decoder_sparse_step = 1;
    c[0].tie_word_embeddings = 0;
    for (int k = 1; k < 3; k++) {
        fr_synthetic_tiny_config(&c[k]);
        c[k].kv_lora_rank = 32;
        c[k].qk_nope_dim = 16;
        c[k].qk_rope_dim = 8;
        c[k].v_head_dim = 16;
        c[k].q_lora_rank = k == 2 ? 24 : 0;
    }
    fr_synthetic_tiny_dsmoe_config(&c[3], 0);
    fr_synthetic_tiny_dsmoe_config(&c[4], 1);
    for (int k = 0; k < 5; k++) {
        fr_model *m = random_model(&c[k], 11 + (uint64_t)k);
        sync_plan s;
        plan_new(m, 1000, 1, &s);
        fake_ctx f = {&s, -1, -1};
        fr_wsync_transport t = {fake_recv, &f};
        for (int rank = 0; rank < 2; rank++) {
            fr_wsync_rank *r = NULL;
            fr_weight_check *c = NULL;
            rank_new(&m->cfg, rank, 2, 1, &r, &c);
            assert_true(sync_rank(r, c, &s, &t, 1000, 0, NULL));
            check_shard(r, m, &s, rank, 2);
            rank_free(&r, &c);
        }
        plan_free(&s);
        fr_model_destroy(&m);
    }
}

/* One rank's bytes corrupted: that rank is not ready, so the vote fails. */
static void test_wrong_checksum_on_one_rank(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    sync_plan s;
    plan_new(m, 4096, 0, &s);
    int all = 1;
    for (int rank = 0; rank < 2; rank++) {
        fake_ctx f = {&s, rank == 1 ? 3 : -1, -1};
        fr_wsync_transport t = {fake_recv, &f};
        fr_wsync_rank *r = NULL;
        fr_weight_check *c = NULL;
        rank_new(&m->cfg, rank, 2, 1, &r, &c);
        fr_weight_refusal why;
        const int ready = sync_rank(r, c, &s, &t, 4096, 0, &why);
        assert_int_equal(ready, rank == 0);
        if (rank == 1) assert_int_equal(why, FR_WREF_BAD_CHECKSUM);
        all &= ready;
        rank_free(&r, &c);
    }
    assert_false(all);
    plan_free(&s);
    fr_model_destroy(&m);
}

/* The sender is gone mid-update, or stops sending: never ready. */
static void test_sender_gone(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    sync_plan s;
    plan_new(m, 4096, 0, &s);
    fake_ctx f = {&s, -1, s.n_b / 2};
    fr_wsync_transport t = {fake_recv, &f};
    fr_wsync_rank *r = NULL;
    fr_weight_check *c = NULL;
    rank_new(&m->cfg, 0, 2, 1, &r, &c);
    fr_weight_refusal why;
    assert_false(sync_rank(r, c, &s, &t, 4096, 0, &why));
    assert_int_equal(why, FR_WREF_NCCL_FAILED);
    /* stopped: the buckets before the last arrived, the last never did */
    f.die_at = -1;
    assert_int_equal(begin(c, &s, 3, s.n, 4096, 0), FR_OK);
    for (int k = 0; k + 1 < s.n_b; k++) {
        fr_weight_bucket b = bucket_of(&s, k, 3);
        assert_int_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    }
    assert_int_not_equal(fr_weight_check_ready(c, &why), FR_OK);
    assert_int_equal(why, FR_WREF_MISSING_TENSOR);
    assert_non_null(strstr(fr_last_error(), "bytes"));
    /* a partial update of only the tensors sent is ready */
    int n_sent = 0;   /* tensors before the last bucket's first were sent whole */
    while (strcmp(s.t[n_sent].name, s.b[s.n_b - 1].pieces[0].t.name) != 0) n_sent++;
    assert_int_equal(begin(c, &s, 4, n_sent, 4096, 1), FR_OK);
    for (int k = 0; k + 1 < s.n_b; k++) {
        fr_weight_bucket b = bucket_of(&s, k, 4);
        int np = 0;
        while (np < b.n_pieces && fr_weight_check_find(c, b.pieces[np].t.name) < n_sent) np++;
        if (np == 0) break;
        b.n_pieces = np;
        b.nbytes = b.pieces[np - 1].at + b.pieces[np - 1].nbytes;
        assert_int_equal(fr_dev_checksum_host(s.bytes[k], (size_t)b.nbytes, &b.checksum), FR_COMM_OK);
        assert_int_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    }
    assert_int_equal(fr_weight_check_ready(c, &why), FR_OK);
    rank_free(&r, &c);
    plan_free(&s);
    fr_model_destroy(&m);
}

/* Refusals: a tensor the model lacks or of another shape, a bucket out of
 * order, pieces out of order or outside the bucket, a NaN. */
static void test_refusals(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    sync_plan s;
    plan_new(m, 4096, 0, &s);
    fake_ctx f = {&s, -1, -1};
    fr_wsync_transport t = {fake_recv, &f};
    fr_wsync_rank *r = NULL;
    fr_weight_check *c = NULL;
    rank_new(&m->cfg, 1, 2, 1, &r, &c);
    fr_weight_refusal why;
    fr_weight_tensor bad = s.t[1];
    bad.shape[0] += 1;
    fr_weight_begin one = {.version = 2, .tensors = &bad, .n_tensors = 1, .bucket_bytes = 4096, .partial = 1};
    assert_int_not_equal(fr_weight_check_begin(c, &one, &why), FR_OK);
    assert_int_equal(why, FR_WREF_BAD_SHAPE);
    bad = s.t[1];
    bad.name = "model.layers.99.mlp.up_proj.weight";
    assert_int_not_equal(fr_weight_check_begin(c, &one, &why), FR_OK);
    assert_int_equal(why, FR_WREF_UNKNOWN_TENSOR);
    assert_non_null(strstr(fr_last_error(), "not a weight"));
    /* bucket 1 before bucket 0 */
    assert_int_equal(begin(c, &s, 2, s.n, 4096, 0), FR_OK);
    fr_weight_bucket b = bucket_of(&s, 1, 2);
    assert_int_not_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    assert_int_equal(why, FR_WREF_UPDATE_STATE);
    b = bucket_of(&s, 0, 2);
    assert_int_not_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);   /* a failed update takes no more */
    /* a piece that skips bytes of its tensor */
    assert_int_equal(begin(c, &s, 2, s.n, 4096, 0), FR_OK);
    b = bucket_of(&s, 0, 2);
    assert_int_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    b = bucket_of(&s, 1, 2);
    fr_weight_piece *pp = malloc(sizeof *pp * (size_t)b.n_pieces);
    memcpy(pp, b.pieces, sizeof *pp * (size_t)b.n_pieces);
    pp[0].offset += 4;
    b.pieces = pp;
    assert_int_not_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    assert_int_equal(why, FR_WREF_BAD_PIECE);
    assert_non_null(strstr(fr_last_error(), "in order"));
    /* a piece past the bucket's end */
    assert_int_equal(begin(c, &s, 2, s.n, 4096, 0), FR_OK);
    b = bucket_of(&s, 0, 2);
    memcpy(pp, b.pieces, sizeof *pp * (size_t)b.n_pieces);
    b.pieces = pp;
    pp[b.n_pieces - 1].nbytes += 4;
    assert_int_not_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    assert_non_null(strstr(fr_last_error(), "inside the bucket"));
    free(pp);
    /* a NaN in bucket 0 (its checksum made to match) */
    assert_int_equal(begin(c, &s, 2, s.n, 4096, 0), FR_OK);
    const float nan = NAN;
    memcpy(s.bytes[0] + 8, &nan, 4);
    b = bucket_of(&s, 0, 2);
    assert_int_equal(fr_dev_checksum_host(s.bytes[0], (size_t)b.nbytes, &b.checksum), FR_COMM_OK);
    assert_int_not_equal(fr_wsync_rank_bucket(r, c, &b, &t, &why), FR_OK);
    assert_int_equal(why, FR_WREF_NON_FINITE);
    assert_non_null(strstr(fr_last_error(), "model.embed_tokens.weight"));
    rank_free(&r, &c);
    plan_free(&s);
    fr_model_destroy(&m);
}

static fr_status count_block(void *user, const fr_wsync_block *blk)
{
    *(uint64_t *)user += blk->rect.width * blk->rect.rows;
    return FR_OK;
}

/* A receiver that overlaps buckets (the CUDA one) accepts bucket k + 1
 * before bucket k is done; the update is ready only when every accepted
 * bucket is done, in order; the blocks of all buckets are this rank's
 * shard, element for element. */
static void test_overlapped_buckets(void **state)
{
    (void)state;
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    sync_plan s;
    plan_new(m, 4096, 1, &s);
    fr_wsync_rank *r = NULL;
    fr_weight_check *c = NULL;
    rank_new(&m->cfg, 1, 2, 0, &r, &c);
    assert_null(fr_wsync_rank_local(r, 0, NULL));   /* no host stage */
    fr_weight_refusal why;
    assert_int_equal(begin(c, &s, 2, s.n, 4096, 0), FR_OK);
    assert_int_equal(fr_weight_check_bucket(c, &s.b[0], NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(c, &s.b[1], NULL, &why), FR_OK);
    assert_int_not_equal(fr_weight_check_ready(c, &why), FR_OK);
    assert_int_equal(why, FR_WREF_UPDATE_STATE);
    assert_non_null(strstr(fr_last_error(), "in flight"));
    uint64_t elems = 0;
    for (int k = 0; k < s.n_b; k++) {
        if (k >= 2) assert_int_equal(fr_weight_check_bucket(c, &s.b[k], NULL, &why), FR_OK);
        assert_int_equal(fr_wsync_rank_blocks(r, &s.b[k], count_block, &elems), FR_OK);
        assert_int_equal(fr_weight_check_done(c, &s.b[k], &s.b[k].checksum, -1, 0, &why), FR_OK);
    }
    assert_int_equal(fr_weight_check_ready(c, &why), FR_OK);
    uint64_t want = 0;
    for (int i = 0; i < s.n; i++) {
        const fr_tp_part *part = NULL;
        fr_wsync_rank_local(r, i, &part);
        want += (uint64_t)fr_tp_part_elems(part);
    }
    assert_int_equal(elems, want);
    /* done out of order */
    fr_weight_bucket b0 = bucket_of(&s, 0, 3), b1 = bucket_of(&s, 1, 3);
    assert_int_equal(begin(c, &s, 3, s.n, 4096, 0), FR_OK);
    assert_int_equal(fr_weight_check_bucket(c, &b0, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(c, &b1, NULL, &why), FR_OK);
    assert_int_not_equal(fr_weight_check_done(c, &b1, NULL, -1, 0, &why), FR_OK);
    assert_int_equal(why, FR_WREF_UPDATE_STATE);
    /* a bucket that failed its checks on the device: its checksum */
    b0 = bucket_of(&s, 0, 4);
    assert_int_equal(begin(c, &s, 4, s.n, 4096, 0), FR_OK);
    assert_int_equal(fr_weight_check_bucket(c, &b0, NULL, &why), FR_OK);
    const uint64_t wrong = b0.checksum ^ 1;
    assert_int_not_equal(fr_weight_check_done(c, &b0, &wrong, -1, 0, &why), FR_OK);
    assert_int_equal(why, FR_WREF_BAD_CHECKSUM);
    assert_int_not_equal(fr_weight_check_ready(c, &why), FR_OK);
    rank_free(&r, &c);
    plan_free(&s);
    fr_model_destroy(&m);
}

/* The rectangles of a column part: a piece cutting rows mid-way. */
static void test_piece_rects(void **state)
{
    (void)state;
    const fr_tp_part p = {.split = FR_TP_COLS, .rows = 4, .cols = 10, .start = 4, .len = 3};
    fr_tp_rect x[FR_TP_PIECE_MAX_RECTS];
    /* elements 5 .. 35: row 0 cols 5..9, rows 1-2 whole, row 3 cols 0..5 */
    assert_int_equal(fr_tp_piece_rects(&p, 5, 31, x), 3);
    assert_int_equal(x[0].src, 0);
    assert_int_equal(x[0].dst, 1);
    assert_int_equal(x[0].width, 2);
    assert_int_equal(x[1].src, 14 - 5);
    assert_int_equal(x[1].dst, 3);
    assert_int_equal(x[1].rows, 2);
    assert_int_equal(x[1].src_pitch, 10);
    assert_int_equal(x[1].dst_pitch, 3);
    assert_int_equal(x[2].src, 34 - 5);
    assert_int_equal(x[2].dst, 9);
    assert_int_equal(x[2].width, 2);
    /* inside one row, outside the part: nothing */
    assert_int_equal(fr_tp_piece_rects(&p, 10, 4, x), 0);
    /* past the end */
    assert_int_equal(fr_tp_piece_rects(&p, 39, 2, x), -1);
    const fr_tp_part q = {.split = FR_TP_ROWS, .rows = 4, .cols = 10, .start = 2, .len = 1};
    assert_int_equal(fr_tp_piece_rects(&q, 15, 10, x), 1);
    assert_int_equal(x[0].src, 5);
    assert_int_equal(x[0].dst, 0);
    assert_int_equal(x[0].width, 5);
}

/* ---- under mpirun: world rank 0 is the trainer -------------------------- */

typedef struct {
    const sync_plan *s;
    int corrupt_here;     /* this rank flips a byte of bucket 1 */
} mpi_ctx;

/* Each bucket is preceded by the trainer's flag: 1 it follows, 0 the
 * trainer is gone (the bytes never come). */
static fr_status mpi_recv(void *ctx, int bucket, void *buf, size_t nbytes)
{
    mpi_ctx *c = ctx;
    int alive = 0;
    if (fr_mpi_world_bcast(W, &alive, sizeof alive, 0)) return fr_fail(FR_EIO, "%s", fr_last_error());
    if (!alive) return fr_fail(FR_EIO, "the trainer is gone");
    if (fr_mpi_world_bcast(W, buf, nbytes, 0)) return fr_fail(FR_EIO, "%s", fr_last_error());
    if (c->corrupt_here && bucket == 1) ((unsigned char *)buf)[0] ^= 1;
    return FR_OK;
}

/* One update from the trainer to every other rank; returns the version
 * serving afterwards, decided by every rank's vote. */
static uint64_t mpi_round(const sync_plan *s, const fr_model_config *cfg, int die_at, int corrupt_rank)
{
    const uint64_t serving = 1;
    int ready = 1;
    if (W->rank == 0) {
        for (int k = 0; k < s->n_b; k++) {
            int alive = die_at < 0 || k < die_at;
            assert_int_equal(fr_mpi_world_bcast(W, &alive, sizeof alive, 0), FR_COMM_OK);
            if (!alive) break;
            assert_int_equal(fr_mpi_world_bcast(W, s->bytes[k], (size_t)s->b[k].nbytes, 0), FR_COMM_OK);
        }
    } else {
        const int tp = 2, server_rank = W->rank - 1;
        fr_wsync_rank *r = NULL;
        fr_weight_check *rules = NULL;
        rank_new(cfg, server_rank % tp, tp, 1, &r, &rules);
        mpi_ctx c = {s, W->rank == corrupt_rank};
        fr_wsync_transport t = {mpi_recv, &c};
        assert_int_equal(begin(rules, s, 2, s->n, 4096, 0), FR_OK);
        for (int k = 0; k < s->n_b; k++) {
            fr_weight_bucket b = bucket_of(s, k, 2);
            fr_weight_refusal why;
            if (fr_wsync_rank_bucket(r, rules, &b, &t, &why) && why == FR_WREF_NCCL_FAILED) break;
        }
        ready = fr_weight_check_ready(rules, NULL) == FR_OK;
        rank_free(&r, &rules);
    }
    int all = 0;
    assert_int_equal(fr_mpi_world_all_ok(W, ready, &all), FR_COMM_OK);
    return all ? 2 : serving;
}

static void test_mpi_all_or_nothing(void **state)
{
    (void)state;
    if (W->size < 3 || (W->size - 1) % 2) {
        if (W->rank == 0) printf("test_wsync_rank: SKIP mpi case (needs mpirun -np 1 + 2k)\n");
        return;
    }
    fr_model *m = NULL;
    assert_int_equal(fr_model_synthetic_tiny(7, &m), FR_OK);
    sync_plan s;
    plan_new(m, 4096, 1, &s);
    assert_int_equal(mpi_round(&s, &m->cfg, -1, -1), 2);            /* every rank switches */
    assert_int_equal(mpi_round(&s, &m->cfg, -1, W->size - 1), 1);   /* the last rank's bytes are wrong */
    assert_int_equal(mpi_round(&s, &m->cfg, s.n_b / 2, -1), 1);     /* the trainer dies mid-sync */
    assert_int_equal(mpi_round(&s, &m->cfg, -1, -1), 2);            /* and a new trainer succeeds */
    if (W->rank == 0) printf("test_wsync_rank: %d server ranks, all-or-nothing checked\n", W->size - 1);
    plan_free(&s);
    fr_model_destroy(&m);
}

FR_MPI_TEST_MAIN(W, NULL, NULL,
                 cmocka_unit_test(test_piece_rects),
                 cmocka_unit_test(test_parts_cover_the_shard),
                 cmocka_unit_test(test_parts_of_other_layers),
                 cmocka_unit_test(test_wrong_checksum_on_one_rank),
                 cmocka_unit_test(test_sender_gone),
                 cmocka_unit_test(test_refusals),
                 cmocka_unit_test(test_overlapped_buckets),
                 cmocka_unit_test(test_mpi_all_or_nothing))
