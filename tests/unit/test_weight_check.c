/* The rules of a weight update (rollout/engine/weight_check.h), the one
 * place every bucket of every path is checked: each refusal reason comes
 * with its own message naming the update, bucket and tensor; a begun update
 * that broke a rule takes nothing more; an open update refuses a piece and
 * stays usable; buckets accepted ahead of their bytes are done in order;
 * the update is whole only when every declared tensor (and, unless
 * partial, every weight of the model) arrived. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "rollout/engine/weight_check.h"
#include "test_util.h"

/* synthetic:tiny's tensors used here, with their shapes. */
#define EMBED "model.embed_tokens.weight"
#define NORM "model.norm.weight"

typedef struct {
    fr_weight_check *c;
    fr_weight_tensor t[64];   /* every tensor of the model, f32 */
    int n;
} fixture;

/* why is read after the call under test ran (the arguments are evaluated first). */
static void expect(fr_status st, const fr_weight_refusal *pwhy, fr_weight_refusal want, const char *needle)
{
    const fr_weight_refusal why = *pwhy;
    if (st == FR_OK) fail_msg("accepted; wanted %s", fr_weight_refusal_name(want));
    if (why != want) fail_msg("refused as %s, wanted %s: %s", fr_weight_refusal_name(why), fr_weight_refusal_name(want),
                              fr_last_error());
    if (needle && !strstr(fr_last_error(), needle)) fail_msg("message \"%s\" lacks \"%s\"", fr_last_error(), needle);
}

static int setup(void **state)
{
    static fixture f;
    memset(&f, 0, sizeof f);
    fr_model_config cfg;
    fr_synthetic_tiny_config(&cfg);
    assert_int_equal(fr_weight_check_new(&cfg, &f.c), FR_OK);
    f.n = fr_weight_check_tensor_count(f.c);
    assert_true(f.n > 2 && f.n <= 64);
    for (int i = 0; i < f.n; i++) {
        int64_t shape[2];
        int ndim;
        const char *name;
        assert_int_equal(fr_weight_check_tensor(f.c, i, &name, &ndim, shape), FR_OK);
        f.t[i] = (fr_weight_tensor){.name = name, .dtype = FR_DTYPE_F32, .ndim = ndim, .shape = {shape[0], shape[1]}};
    }
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    fr_weight_check_free(&f->c);
    return 0;
}

static fr_weight_tensor *find(fixture *f, const char *name)
{
    const int i = fr_weight_check_find(f->c, name);
    assert_true(i >= 0);
    return &f->t[i];
}

static uint64_t bytes_of(const fr_weight_tensor *t)
{
    uint64_t n = 4;
    for (int d = 0; d < t->ndim; d++) n *= (uint64_t)t->shape[d];
    return n;
}

/* An update to version 2 of the given tensors (n_decl of them from decl). */
static fr_status begin(fixture *f, const fr_weight_tensor *decl, int n_decl, uint64_t bucket_bytes, int partial,
                       fr_weight_refusal *why)
{
    fr_weight_begin b = {.version = 2, .tensors = (fr_weight_tensor *)decl, .n_tensors = n_decl,
                         .bucket_bytes = bucket_bytes, .partial = partial};
    return fr_weight_check_begin(f->c, &b, why);
}

/* One piece of t: bytes [offset, offset + nbytes) at byte `at` of its bucket. */
static fr_weight_piece piece(const fr_weight_tensor *t, uint64_t offset, uint64_t nbytes, uint64_t at)
{
    return (fr_weight_piece){.t = *t, .offset = offset, .nbytes = nbytes, .at = at, .tensor = -1};
}

static fr_weight_bucket bucket(int k, fr_weight_piece *p, int n, uint64_t nbytes, int in_order)
{
    return (fr_weight_bucket){.version = 2, .bucket = k, .nbytes = nbytes, .checksum = 0x1234, .in_order = in_order,
                              .pieces = p, .n_pieces = n};
}

/* begin: bad_version, unknown_tensor, bad_dtype, bad_shape, bad_message
 * (twice, none), bad_bucket; each leaves no update in progress. */
static void test_begin_refusals(void **state)
{
    fixture *f = *state;
    fr_weight_refusal why;
    expect(fr_weight_check_version(5, 5, &why), &why, FR_WREF_BAD_VERSION, "greater than the version serving, 5");
    assert_int_equal(fr_weight_check_version(5, 6, &why), FR_OK);
    fr_weight_tensor t = *find(f, NORM);
    t.name = "model.norm.bias";
    expect(begin(f, &t, 1, 64, 1, &why), &why, FR_WREF_UNKNOWN_TENSOR, "\"model.norm.bias\" is not a weight");
    assert_false(fr_weight_check_updating(f->c));
    t = *find(f, NORM);
    t.dtype = FR_DTYPE_I8;
    expect(begin(f, &t, 1, 64, 1, &why), &why, FR_WREF_BAD_DTYPE, "weights travel as f32, bf16 or f16");
    t = *find(f, NORM);
    t.shape[0] += 1;
    expect(begin(f, &t, 1, 64, 1, &why), &why, FR_WREF_BAD_SHAPE, "the model's is");
    t = *find(f, NORM);
    t.ndim = 2;
    t.shape[1] = 1;
    expect(begin(f, &t, 1, 64, 1, &why), &why, FR_WREF_BAD_SHAPE, "has shape [");
    fr_weight_tensor two[2] = {*find(f, NORM), *find(f, NORM)};
    expect(begin(f, two, 2, 64, 1, &why), &why, FR_WREF_BAD_MESSAGE, "declared twice");
    expect(begin(f, two, 0, 64, 1, &why), &why, FR_WREF_BAD_MESSAGE, "declares no tensor");
    expect(begin(f, two, 1, 0, 1, &why), &why, FR_WREF_BAD_BUCKET, "bucket_bytes");
    assert_false(fr_weight_check_updating(f->c));
    assert_int_equal(begin(f, two, 1, 64, 1, &why), FR_OK);
    assert_true(fr_weight_check_updating(f->c));
}

/* A bucket: update_state (none in progress, another version, out of turn),
 * bad_bucket (no pieces, too many bytes), bad_checksum, unknown_tensor
 * (not declared), bad_dtype, bad_shape; and a begun update that broke a
 * rule takes nothing more. */
static void test_bucket_refusals(void **state)
{
    fixture *f = *state;
    fr_weight_refusal why;
    fr_weight_tensor *norm = find(f, NORM), *embed = find(f, EMBED);
    fr_weight_check_end(f->c);
    fr_weight_piece p = piece(norm, 0, 64, 0);
    fr_weight_bucket b = bucket(0, &p, 1, 64, 0);
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_UPDATE_STATE, "no weight update");
    const struct {
        int version_off, index, n_pieces, checksum_wrong;
        uint64_t nbytes;
        fr_weight_refusal want;
        const char *needle;
    } heads[] = {
        {1, 0, 1, 0, 64, FR_WREF_UPDATE_STATE, "is for version 3, but the update in progress is to version 2"},
        {0, 1, 1, 0, 64, FR_WREF_UPDATE_STATE, "bucket 1 arrived, expected bucket 0"},
        {0, 0, 0, 0, 64, FR_WREF_BAD_BUCKET, "at least one piece"},
        {0, 0, 1, 0, 128, FR_WREF_BAD_BUCKET, "at most the bucket_bytes 64"},
        {0, 0, 1, 1, 64, FR_WREF_BAD_CHECKSUM, "bucket 0: the checksum of the bytes received is"},
    };
    for (size_t k = 0; k < sizeof heads / sizeof heads[0]; k++) {
        fr_weight_tensor decl[2] = {*norm, *embed};
        assert_int_equal(begin(f, decl, 2, 64, 1, &why), FR_OK);
        b = bucket(heads[k].index, &p, heads[k].n_pieces, heads[k].nbytes, 0);
        b.version += (uint64_t)heads[k].version_off;
        const uint64_t sum = heads[k].checksum_wrong ? b.checksum ^ 1 : b.checksum;
        expect(fr_weight_check_bucket(f->c, &b, &sum, &why), &why, heads[k].want, heads[k].needle);
    }
    /* pieces: not declared, another dtype, another shape */
    fr_weight_tensor decl = *norm;
    assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
    fr_weight_piece q = piece(embed, 0, 64, 0);
    b = bucket(0, &q, 1, 64, 0);
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_UNKNOWN_TENSOR,
           "bucket 0: \"" EMBED "\" was not listed in the begin");
    /* failed for good: even a good bucket is refused now */
    p = piece(norm, 0, 64, 0);
    b = bucket(0, &p, 1, 64, 0);
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_UPDATE_STATE, "failed (unknown_tensor)");
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_UPDATE_STATE, "cannot commit");
    assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
    p.t.dtype = FR_DTYPE_BF16;
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_BAD_DTYPE,
           "arrives as bf16, the begin declared f32");
    assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
    p = piece(norm, 0, 64, 0);
    p.t.shape[0] = 32;
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_BAD_SHAPE, "the begin declared");
}

/* bad_piece: off element bounds, outside its bucket, past its tensor, out
 * of order (in-order buckets), bytes sent twice (any-order buckets, also
 * within one bucket). */
static void test_piece_refusals(void **state)
{
    fixture *f = *state;
    fr_weight_refusal why;
    fr_weight_tensor *norm = find(f, NORM), decl = *norm;
    const uint64_t nb = bytes_of(norm);
    const struct {
        uint64_t offset, nbytes, at, bucket_bytes;
        int in_order;
        const char *needle;
    } cases[] = {
        {2, 8, 0, 64, 0, "multiples of the f32 size"},
        {0, 6, 0, 64, 0, "multiples of the f32 size"},
        {0, 8, 2, 64, 1, "multiples of the f32 size"},   /* `at` counts in an in-order bucket only */
        {0, 8, 60, 64, 0, "not inside the bucket's 64 bytes"},
        {nb - 4, 8, 0, 64, 0, "run past the tensor's"},
        {8, 8, 0, 64, 1, "its pieces must come in order"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
        fr_weight_piece p = piece(norm, cases[k].offset, cases[k].nbytes, cases[k].at);
        fr_weight_bucket b = bucket(0, &p, 1, cases[k].bucket_bytes, cases[k].in_order);
        expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_BAD_PIECE, cases[k].needle);
    }
    /* the same bytes twice: in a later bucket, and inside one bucket */
    assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
    fr_weight_piece p[2] = {piece(norm, 8, 16, 0), piece(norm, 16, 8, 16)};
    fr_weight_bucket b = bucket(0, p, 1, 16, 0);
    assert_int_equal(fr_weight_check_bucket(f->c, &b, NULL, &why), FR_OK);
    assert_int_equal(p[0].tensor, fr_weight_check_find(f->c, NORM));
    fr_weight_piece later = piece(norm, 16, 8, 0);
    b = bucket(1, &later, 1, 8, 0);
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_BAD_PIECE, "bytes [16, 24) overlap");
    assert_int_equal(begin(f, &decl, 1, 1 << 20, 1, &why), FR_OK);
    b = bucket(0, p, 2, 24, 0);
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_BAD_PIECE, "overlap bytes received before");
}

/* Buckets accepted before their bytes: done in order (update_state out of
 * turn), bad_checksum and non_finite at done, still in flight at ready;
 * missing_tensor for a declared tensor not whole, and for one not sent
 * unless partial; a whole update is ready and counts its bytes. */
static void test_done_and_ready(void **state)
{
    fixture *f = *state;
    fr_weight_refusal why;
    fr_weight_tensor *norm = find(f, NORM), decl = *norm;
    const uint64_t nb = bytes_of(norm);
    assert_int_equal(begin(f, &decl, 1, nb, 1, &why), FR_OK);
    fr_weight_piece p[2] = {piece(norm, 0, nb / 2, 0), piece(norm, nb / 2, nb / 2, 0)};
    fr_weight_bucket b0 = bucket(0, &p[0], 1, nb / 2, 1), b1 = bucket(1, &p[1], 1, nb / 2, 1);
    assert_int_equal(fr_weight_check_bucket(f->c, &b0, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b1, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_in_flight(f->c), 2);
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_UPDATE_STATE, "bucket 0 is still in flight");
    expect(fr_weight_check_done(f->c, &b1, NULL, -1, 0, &why), &why, FR_WREF_UPDATE_STATE,
           "bucket 1 finished, but bucket 0 is the oldest in flight");
    assert_int_equal(begin(f, &decl, 1, nb, 1, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b0, NULL, &why), FR_OK);
    const uint64_t wrong = b0.checksum ^ 8;
    expect(fr_weight_check_done(f->c, &b0, &wrong, -1, 0, &why), &why, FR_WREF_BAD_CHECKSUM, "the message says");
    assert_int_equal(begin(f, &decl, 1, nb, 1, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b0, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b1, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_done(f->c, &b0, &b0.checksum, -1, 0, &why), FR_OK);
    /* element 3 of the second piece: element nb / 8 + 3 of the tensor */
    expect(fr_weight_check_done(f->c, &b1, NULL, 0, 3, &why), &why, FR_WREF_NON_FINITE, "NaN or infinite (in BF16)");
    char want[64];
    snprintf(want, sizeof want, "element %llu", (unsigned long long)(nb / 8 + 3));
    assert_non_null(strstr(fr_last_error(), want));
    /* host bytes tell a NaN from an infinity */
    float v[2] = {1, NAN};
    assert_int_equal(begin(f, &decl, 1, nb, 1, &why), FR_OK);
    fr_weight_piece h = piece(norm, 0, 8, 0);
    h.bytes = v;
    fr_weight_bucket hb = bucket(0, &h, 1, 8, 0);
    assert_int_equal(fr_weight_check_bucket(f->c, &hb, NULL, &why), FR_OK);
    expect(fr_weight_check_done(f->c, &hb, NULL, 0, 1, &why), &why, FR_WREF_NON_FINITE, "element 1 is NaN");
    /* missing: the declared tensor in part; a model tensor not sent */
    assert_int_equal(begin(f, &decl, 1, nb, 1, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b0, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_done(f->c, &b0, NULL, -1, 0, &why), FR_OK);
    char part[96];
    snprintf(part, sizeof part, "\"%s\" has %llu of its %llu bytes", NORM, (unsigned long long)(nb / 2),
             (unsigned long long)nb);
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_MISSING_TENSOR, part);
    assert_int_equal(fr_weight_check_bucket(f->c, &b1, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_done(f->c, &b1, NULL, -1, 0, &why), FR_OK);
    assert_int_equal(fr_weight_check_ready(f->c, &why), FR_OK);   /* partial: the norm alone */
    assert_true(fr_weight_check_bytes(f->c) == nb);
    assert_true(fr_weight_check_received(f->c, fr_weight_check_find(f->c, NORM)));
    assert_false(fr_weight_check_received(f->c, fr_weight_check_find(f->c, EMBED)));
    assert_int_equal(begin(f, &decl, 1, nb, 0, &why), FR_OK);   /* the same, not partial */
    assert_int_equal(fr_weight_check_bucket(f->c, &b0, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_bucket(f->c, &b1, NULL, &why), FR_OK);
    assert_int_equal(fr_weight_check_done(f->c, &b0, NULL, -1, 0, &why), FR_OK);
    assert_int_equal(fr_weight_check_done(f->c, &b1, NULL, -1, 0, &why), FR_OK);
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_MISSING_TENSOR, "\"" EMBED "\" was not sent");
    /* every tensor of the model, whole */
    assert_int_equal(begin(f, f->t, f->n, 1 << 20, 0, &why), FR_OK);
    for (int i = 0; i < f->n; i++) {
        fr_weight_piece q = piece(&f->t[i], 0, bytes_of(&f->t[i]), 0);
        fr_weight_bucket b = bucket(i, &q, 1, q.nbytes, 1);
        assert_int_equal(fr_weight_check_bucket(f->c, &b, NULL, &why), FR_OK);
        assert_int_equal(fr_weight_check_done(f->c, &b, NULL, -1, 0, &why), FR_OK);
    }
    assert_int_equal(fr_weight_check_ready(f->c, &why), FR_OK);
    /* a failure found elsewhere fails the update */
    expect(fr_weight_check_fail(f->c, FR_WREF_NCCL_FAILED, fr_fail(FR_EIO, "the group ended"), &why), &why,
           FR_WREF_NCCL_FAILED, "the group ended");
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_UPDATE_STATE, "failed (nccl_failed)");
}

/* An open update (no begin list): any weight, its dtype fixed by its first
 * piece; a refused piece leaves the update usable, and a piece taken back
 * counts as never sent. */
static void test_open_update(void **state)
{
    fixture *f = *state;
    fr_weight_refusal why;
    fr_weight_tensor *norm = find(f, NORM);
    const uint64_t nb = bytes_of(norm);
    fr_weight_check_open(f->c, 7);
    fr_weight_tensor other = *norm;
    other.name = "lm_head.bias";
    fr_weight_piece p = piece(&other, 0, 8, 0);
    fr_weight_bucket b = bucket(0, &p, 1, 8, 0);
    b.version = 7;
    expect(fr_weight_check_bucket(f->c, &b, NULL, &why), &why, FR_WREF_UNKNOWN_TENSOR, "not a weight of this model");
    p = piece(norm, 0, 8, 0);
    assert_int_equal(fr_weight_check_bucket(f->c, &b, NULL, &why), FR_OK);   /* usable after a refusal */
    assert_int_equal(fr_weight_check_done(f->c, &b, NULL, -1, 0, &why), FR_OK);
    fr_weight_piece q = piece(norm, 8, 8, 0);
    q.t.dtype = FR_DTYPE_BF16;
    q.nbytes = 4;
    fr_weight_bucket c = bucket(1, &q, 1, 4, 0);
    c.version = 7;
    expect(fr_weight_check_bucket(f->c, &c, NULL, &why), &why, FR_WREF_BAD_DTYPE, "its first piece came as f32");
    q = piece(norm, 8, nb - 8, 0);
    c.nbytes = q.nbytes;
    assert_int_equal(fr_weight_check_bucket(f->c, &c, NULL, &why), FR_OK);
    fr_weight_check_unaccept(f->c, &c);   /* not stored after all */
    fr_weight_check_set_partial(f->c, 1);
    expect(fr_weight_check_ready(f->c, &why), &why, FR_WREF_MISSING_TENSOR, "has 8 of its");
    assert_int_equal(fr_weight_check_bucket(f->c, &c, NULL, &why), FR_OK);   /* the same bytes again */
    assert_int_equal(fr_weight_check_done(f->c, &c, NULL, -1, 0, &why), FR_OK);
    assert_int_equal(fr_weight_check_ready(f->c, &why), FR_OK);
    assert_string_equal(fr_weight_refusal_name(FR_WREF_MISSING_TENSOR), "missing_tensor");
    assert_string_equal(fr_weight_refusal_name(FR_WREF_FAILED), "update_failed");
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test_setup_teardown(test_begin_refusals, setup, teardown),
             cmocka_unit_test_setup_teardown(test_bucket_refusals, setup, teardown),
             cmocka_unit_test_setup_teardown(test_piece_refusals, setup, teardown),
             cmocka_unit_test_setup_teardown(test_done_and_ready, setup, teardown),
             cmocka_unit_test_setup_teardown(test_open_update, setup, teardown))
