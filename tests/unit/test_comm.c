/* Tests for comm/: the engine layout arithmetic, MPI bootstrap, the engine
 * split and the host collectives. Run plainly it is a world of one rank
 * (every collective an identity); under mpirun -np 2 or 4
 * (tests/integration/comm_mpi.sh) the same tests check real sums, gathers,
 * broadcasts and the split into engines of tp 2.
 *
 * Every test makes all its collective calls before it asserts anything, so
 * a failure on one rank cannot leave the others waiting in a collective;
 * main ends with a vote, so every rank exits non-zero when one failed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/engine_group.h"
#include "comm/mpi_world.h"
#include "test_util.h"

static fr_mpi_world *W;

/* The tp values worth testing in this world: 1, 2 and 4 where they divide
 * the world, and the whole world. */
static int tp_values(int *tps)
{
    int n = 0;
    for (int tp = 1; tp <= 4; tp *= 2)
        if (W->size % tp == 0) tps[n++] = tp;
    if (W->size > 4) tps[n++] = W->size;
    return n;
}

/* ---- layout (no MPI) -------------------------------------------------- */

static void test_layout_arithmetic(void **state)
{
    (void)state;
    fr_engine_layout l;
    assert_int_equal(fr_engine_layout_of(5, 8, 2, &l), FR_COMM_OK);
    assert_int_equal(l.engine, 2);
    assert_int_equal(l.n_engines, 4);
    assert_int_equal(l.tp_rank, 1);
    assert_int_equal(l.tp_size, 2);
    assert_int_equal(l.leader, 4);
    assert_int_equal(fr_engine_layout_of(0, 1, 1, &l), FR_COMM_OK);
    assert_int_equal(l.engine, 0);
    assert_int_equal(l.n_engines, 1);
    assert_int_equal(l.leader, 0);
    for (int r = 0; r < 12; r++) {
        assert_int_equal(fr_engine_layout_of(r, 12, 4, &l), FR_COMM_OK);
        assert_int_equal(l.engine * 4 + l.tp_rank, r);
        assert_int_equal(l.leader, r - l.tp_rank);
    }
}

static void test_layout_rejects(void **state)
{
    (void)state;
    fr_engine_layout l;
    assert_int_equal(fr_engine_layout_of(0, 6, 4, &l), FR_COMM_EINVAL);
    fr_test_error_has("6 ranks cannot form engines of tp 4");
    fr_test_error_has("multiple of tp");
    assert_int_equal(fr_engine_layout_of(0, 4, 0, &l), FR_COMM_EINVAL);
    fr_test_error_has("at least 1");
    assert_int_equal(fr_engine_layout_of(4, 4, 1, &l), FR_COMM_EINVAL);
    fr_test_error_has("outside");
    assert_int_equal(fr_engine_layout_of(-1, 4, 1, &l), FR_COMM_EINVAL);
    assert_int_equal(fr_engine_layout_of(0, 0, 1, &l), FR_COMM_EINVAL);
    assert_int_equal(fr_engine_layout_of(0, 4, 2, NULL), FR_COMM_EINVAL);
    assert_string_equal(fr_comm_status_name(FR_COMM_EMPI), "MPI error");
    assert_string_equal(fr_comm_status_name(FR_COMM_OK), "ok");
}

/* ---- the world -------------------------------------------------------- */

static void test_world(void **state)
{
    (void)state;
    int ranks_sum = 0, size_max = 0;
    MPI_Allreduce(&W->rank, &ranks_sum, 1, MPI_INT, MPI_SUM, W->comm);
    MPI_Allreduce(&W->size, &size_max, 1, MPI_INT, MPI_MAX, W->comm);
    /* A second world while MPI runs wraps it and leaves it running. */
    fr_mpi_world *again = NULL;
    fr_comm_status st = fr_mpi_world_init(NULL, NULL, &again);
    int again_rank = again ? again->rank : -1, again_owns = again ? again->owns_mpi : -1;
    fr_mpi_world_finalize(&again);
    int still_up = 0, ended = 0;
    MPI_Initialized(&still_up);
    MPI_Finalized(&ended);

    assert_true(W->size >= 1);
    assert_in_range(W->rank, 0, W->size - 1);
    assert_int_equal(ranks_sum, W->size * (W->size - 1) / 2);
    assert_int_equal(size_max, W->size);
    assert_in_range(W->local_rank, 0, W->local_size - 1);
    assert_true(W->local_size <= W->size);
    assert_true(W->thread_level >= MPI_THREAD_FUNNELED);
    assert_int_equal(W->owns_mpi, 1);
    assert_string_equal(fr_mpi_thread_level_name(MPI_THREAD_MULTIPLE), "multiple");
    assert_string_equal(fr_mpi_thread_level_name(MPI_THREAD_FUNNELED), "funneled");
    assert_int_equal(st, FR_COMM_OK);
    assert_int_equal(again_rank, W->rank);
    assert_int_equal(again_owns, 0);
    assert_null(again);
    assert_true(still_up && !ended);
}

static void test_world_bcast_and_vote(void **state)
{
    (void)state;
    const int root = W->size - 1;
    enum { N = 1000 };
    unsigned char buf[N];
    for (int i = 0; i < N; i++) buf[i] = W->rank == root ? (unsigned char)(i * 7 + 3) : 0;
    fr_comm_status st_b = fr_mpi_world_bcast(W, buf, N, root);
    fr_comm_status st_e = fr_mpi_world_bcast(W, buf, 0, root);
    int all_yes = -1, one_no = -1;
    fr_comm_status st_v1 = fr_mpi_world_all_ok(W, 1, &all_yes);
    fr_comm_status st_v2 = fr_mpi_world_all_ok(W, W->rank != root, &one_no);
    fr_comm_status st_bar = fr_mpi_world_barrier(W);

    assert_int_equal(st_b, FR_COMM_OK);
    assert_int_equal(st_e, FR_COMM_OK);
    for (int i = 0; i < N; i++) assert_int_equal(buf[i], (unsigned char)(i * 7 + 3));
    assert_int_equal(st_v1, FR_COMM_OK);
    assert_int_equal(st_v2, FR_COMM_OK);
    assert_int_equal(all_yes, 1);
    assert_int_equal(one_no, 0);
    assert_int_equal(st_bar, FR_COMM_OK);
    /* Local argument checks (no collective is entered). */
    assert_int_equal(fr_mpi_world_bcast(W, buf, N, W->size), FR_COMM_EINVAL);
    fr_test_error_has("root");
    assert_int_equal(fr_mpi_world_bcast(W, NULL, 4, 0), FR_COMM_EINVAL);
    assert_int_equal(fr_mpi_world_all_ok(W, 1, NULL), FR_COMM_EINVAL);
}

static void test_world_gather_bytes(void **state)
{
    (void)state;
    const int root = W->size - 1;
    /* Rank r sends 3 r + 1 bytes, rank 0 none when the world has several. */
    size_t mine = W->size > 1 && W->rank == 0 ? 0 : (size_t)W->rank * 3 + 1;
    unsigned char send[256];
    for (size_t i = 0; i < mine; i++) send[i] = (unsigned char)(W->rank * 31 + (int)i);
    void *got = (void *)1, *none = (void *)1;
    size_t len = 99, none_len = 99, counts[64] = {0};
    fr_comm_status st_g = fr_mpi_world_gather_bytes(W, mine ? send : NULL, mine, root, &got, &len, counts);
    fr_comm_status st_e = fr_mpi_world_gather_bytes(W, NULL, 0, 0, &none, &none_len, NULL);

    assert_int_equal(st_g, FR_COMM_OK);
    assert_int_equal(st_e, FR_COMM_OK);
    assert_null(none);
    assert_int_equal(none_len, 0);
    if (W->rank != root) {
        assert_null(got);
        assert_int_equal(len, 0);
    } else {
        size_t at = 0;
        const unsigned char *b = got;
        for (int r = 0; r < W->size; r++) {
            size_t n = W->size > 1 && r == 0 ? 0 : (size_t)r * 3 + 1;
            assert_int_equal(counts[r], n);
            for (size_t i = 0; i < n; i++) assert_int_equal(b[at + i], (unsigned char)(r * 31 + (int)i));
            at += n;
        }
        assert_int_equal(len, at);
    }
    free(got);
    /* Local argument checks (no collective is entered). */
    assert_int_equal(fr_mpi_world_gather_bytes(W, send, 1, W->size, &got, &len, NULL), FR_COMM_EINVAL);
    fr_test_error_has("root");
    assert_int_equal(fr_mpi_world_gather_bytes(W, NULL, 4, 0, &got, &len, NULL), FR_COMM_EINVAL);
    assert_int_equal(fr_mpi_world_gather_bytes(W, send, 1, 0, NULL, &len, NULL), FR_COMM_EINVAL);
}

/* ---- engines ---------------------------------------------------------- */

/* The looped tests below run every tp's collectives first and assert after,
 * so a failure for one tp cannot skip the collectives of the next. */

typedef struct {
    fr_comm_status st;
    fr_engine_layout lay;
    int is_leader, comm_rank, comm_size;
    int members[64];
} split_result;

static void test_engine_split(void **state)
{
    (void)state;
    int tps[4], n = tp_values(tps);
    split_result r[4];
    memset(r, 0, sizeof r);
    for (int k = 0; k < n; k++) {
        fr_engine_group *g = NULL;
        r[k].st = fr_engine_group_new(W, tps[k], &g);
        r[k].comm_rank = r[k].comm_size = -1;
        if (!r[k].st) {
            r[k].lay = g->layout;
            r[k].is_leader = g->is_leader;
            MPI_Comm_rank(g->comm, &r[k].comm_rank);
            MPI_Comm_size(g->comm, &r[k].comm_size);
            if (tps[k] <= 64) MPI_Allgather(&W->rank, 1, MPI_INT, r[k].members, 1, MPI_INT, g->comm);
        }
        fr_engine_group_destroy(&g);
        assert_null(g);
    }
    for (int k = 0; k < n; k++) {
        const int tp = tps[k];
        const fr_engine_layout *lay = &r[k].lay;
        assert_int_equal(r[k].st, FR_COMM_OK);
        assert_int_equal(lay->tp_size, tp);
        assert_int_equal(lay->engine, W->rank / tp);
        assert_int_equal(lay->tp_rank, W->rank % tp);
        assert_int_equal(lay->n_engines, W->size / tp);
        assert_int_equal(lay->leader, W->rank / tp * tp);
        assert_int_equal(r[k].is_leader, W->rank % tp == 0);
        assert_int_equal(r[k].comm_rank, lay->tp_rank);
        assert_int_equal(r[k].comm_size, tp);
        for (int t = 0; t < tp && tp <= 64; t++) assert_int_equal(r[k].members[t], lay->leader + t);
    }
}

static void test_engine_split_rejects(void **state)
{
    (void)state;
    fr_engine_group *g = (fr_engine_group *)&g; /* must be reset to NULL */
    /* W->size + 1 never divides W->size (for size 1 it is tp 2 on 1 rank). */
    assert_int_equal(fr_engine_group_new(W, W->size + 1, &g), FR_COMM_EINVAL);
    assert_null(g);
    fr_test_error_has("multiple of tp");
    assert_int_equal(fr_engine_group_new(W, 0, &g), FR_COMM_EINVAL);
    assert_int_equal(fr_engine_group_new(NULL, 1, &g), FR_COMM_EINVAL);
    assert_int_equal(fr_engine_group_new(W, 1, NULL), FR_COMM_EINVAL);
    fr_engine_group_destroy(NULL);
    fr_engine_group_destroy(&g);
}

enum { AR_N = 1031 };
typedef struct {
    fr_comm_status st_new, st_exact, st_noisy, st_empty, st_gather;
    fr_engine_layout lay;
    float exact[AR_N], noisy[AR_N];
    float *all; /* every engine rank's noisy result, [tp][AR_N] */
} allreduce_result;

static void test_allreduce(void **state)
{
    (void)state;
    int tps[4], n = tp_values(tps);
    allreduce_result *r = calloc(4, sizeof *r);
    assert_non_null(r);
    for (int k = 0; k < n; k++) {
        fr_engine_group *g = NULL;
        r[k].st_new = fr_engine_group_new(W, tps[k], &g);
        if (r[k].st_new) continue; /* fails alike on every rank */
        r[k].lay = g->layout;
        uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(W->rank + 1);
        for (int i = 0; i < AR_N; i++) {
            r[k].exact[i] = (float)((W->rank + 1) * (i - 500));
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            r[k].noisy[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * 3.7f;
        }
        r[k].st_exact = fr_engine_allreduce_sum_f32(g, r[k].exact, AR_N);
        r[k].st_noisy = fr_engine_allreduce_sum_f32(g, r[k].noisy, AR_N);
        r[k].st_empty = fr_engine_allreduce_sum_f32(g, NULL, 0);
        /* Every rank of the engine must hold the same bits. */
        r[k].all = malloc(sizeof(float) * AR_N * (size_t)tps[k]);
        r[k].st_gather = r[k].all ? fr_engine_allgather_f32(g, r[k].noisy, 1, AR_N, r[k].all) : FR_COMM_ENOMEM;
        fr_engine_group_destroy(&g);
    }
    int ok = 1;
    for (int k = 0; k < n && ok; k++) {
        ok = r[k].st_new == FR_COMM_OK && r[k].st_exact == FR_COMM_OK && r[k].st_noisy == FR_COMM_OK &&
             r[k].st_empty == FR_COMM_OK && r[k].st_gather == FR_COMM_OK;
        int rank_sum = 0; /* sum of (world rank + 1) over the engine */
        for (int t = 0; t < r[k].lay.tp_size; t++) rank_sum += r[k].lay.leader + t + 1;
        for (int i = 0; i < AR_N && ok; i++) ok = r[k].exact[i] == (float)(rank_sum * (i - 500));
        for (int t = 0; t < r[k].lay.tp_size && ok; t++)
            ok = memcmp(r[k].all + (size_t)t * AR_N, r[k].noisy, sizeof(float) * AR_N) == 0;
        if (!ok) print_error("tp %d: all-reduce failed or differs between ranks: %s\n", tps[k], fr_last_error());
    }
    for (int k = 0; k < n; k++) free(r[k].all);
    free(r);
    assert_true(ok);
}

enum { AG_ROWS = 3, AG_COLS = 5 };
typedef struct {
    fr_comm_status st_new, st_matrix, st_row, st_overlap, st_null;
    int leader;
    float *out, *cat;
} allgather_result;

static void test_allgather(void **state)
{
    (void)state;
    int tps[4], n = tp_values(tps);
    allgather_result r[4];
    memset(r, 0, sizeof r);
    float local[AG_ROWS * AG_COLS], row[AG_COLS];
    for (int i = 0; i < AG_ROWS; i++)
        for (int c = 0; c < AG_COLS; c++) local[i * AG_COLS + c] = (float)(W->rank * 1000 + i * 10 + c);
    for (int c = 0; c < AG_COLS; c++) row[c] = (float)(W->rank * 100 + c);
    for (int k = 0; k < n; k++) {
        const int tp = tps[k];
        fr_engine_group *g = NULL;
        r[k].st_new = fr_engine_group_new(W, tp, &g);
        if (r[k].st_new) continue;
        r[k].leader = g->layout.leader;
        r[k].out = calloc((size_t)AG_ROWS * AG_COLS * tp, sizeof(float));
        r[k].cat = calloc((size_t)AG_COLS * tp, sizeof(float));
        /* An allocation failure here would desynchronize the ranks; the
         * sizes are tiny. */
        r[k].st_matrix = fr_engine_allgather_f32(g, local, AG_ROWS, AG_COLS, r[k].out);
        r[k].st_row = fr_engine_allgather_f32(g, row, 1, AG_COLS, r[k].cat);
        /* Local checks, no collective entered. */
        r[k].st_overlap = fr_engine_allgather_f32(g, r[k].out, 1, 1, r[k].out);
        r[k].st_null = fr_engine_allgather_f32(g, NULL, 2, 2, r[k].out);
        fr_engine_group_destroy(&g);
    }
    int ok = 1;
    for (int k = 0; k < n && ok; k++) {
        const int tp = tps[k], leader = r[k].leader;
        ok = !r[k].st_new && !r[k].st_matrix && !r[k].st_row && r[k].st_overlap == FR_COMM_EINVAL &&
             r[k].st_null == FR_COMM_EINVAL;
        for (int i = 0; i < AG_ROWS && ok; i++)
            for (int t = 0; t < tp && ok; t++)
                for (int c = 0; c < AG_COLS && ok; c++)
                    ok = r[k].out[i * AG_COLS * tp + t * AG_COLS + c] == (float)((leader + t) * 1000 + i * 10 + c);
        for (int t = 0; t < tp && ok; t++)
            for (int c = 0; c < AG_COLS && ok; c++) ok = r[k].cat[t * AG_COLS + c] == (float)((leader + t) * 100 + c);
        if (!ok) print_error("tp %d: all-gather wrong\n", tp);
    }
    for (int k = 0; k < n; k++) {
        free(r[k].out);
        free(r[k].cat);
    }
    assert_true(ok);
}

typedef struct {
    fr_comm_status st_new, st_fixed, st_1, st_2, st_0;
    int engine, leader;
    unsigned char plan[300];
    char first[64], second[16], got1[64], got2[16];
    size_t len1, len2, len0, cap;
} bcast_result;

static void test_bcast(void **state)
{
    (void)state;
    int tps[4], n = tp_values(tps);
    bcast_result r[4];
    memset(r, 0, sizeof r);
    for (int k = 0; k < n; k++) {
        fr_engine_group *g = NULL;
        bcast_result *b = &r[k];
        b->st_new = fr_engine_group_new(W, tps[k], &g);
        if (b->st_new) continue;
        b->engine = g->layout.engine;
        b->leader = g->is_leader;
        /* Fixed size. */
        for (int i = 0; i < 300; i++) b->plan[i] = b->leader ? (unsigned char)(i + b->engine) : 0xEE;
        b->st_fixed = fr_engine_bcast(g, b->plan, sizeof b->plan);
        /* Two messages of different lengths, then an empty one, through one
         * reused buffer. */
        snprintf(b->first, sizeof b->first, "step 1 of engine %d: a longer plan ..........", b->engine);
        snprintf(b->second, sizeof b->second, "step 2/e%d", b->engine);
        void *buf = NULL;
        size_t len = 0, cap = 0;
        if (b->leader) {
            buf = b->first;
            len = cap = strlen(b->first) + 1;
        }
        b->st_1 = fr_engine_bcast_msg(g, &buf, &len, &cap);
        b->len1 = len;
        if (!b->st_1 && len <= sizeof b->got1) memcpy(b->got1, buf, len);
        if (b->leader) {
            buf = b->second;
            len = strlen(b->second) + 1;
        }
        b->st_2 = fr_engine_bcast_msg(g, &buf, &len, &cap);
        b->len2 = len;
        if (!b->st_2 && len <= sizeof b->got2) memcpy(b->got2, buf, len);
        if (b->leader) len = 0;
        b->st_0 = fr_engine_bcast_msg(g, &buf, &len, &cap);
        b->len0 = len;
        b->cap = cap;
        if (!b->leader) free(buf);
        fr_engine_group_destroy(&g);
    }
    for (int k = 0; k < n; k++) {
        const bcast_result *b = &r[k];
        assert_int_equal(b->st_new, FR_COMM_OK);
        assert_int_equal(b->st_fixed, FR_COMM_OK);
        for (int i = 0; i < 300; i++) assert_int_equal(b->plan[i], (unsigned char)(i + b->engine));
        assert_int_equal(b->st_1, FR_COMM_OK);
        assert_int_equal(b->st_2, FR_COMM_OK);
        assert_int_equal(b->st_0, FR_COMM_OK);
        assert_int_equal(b->len1, strlen(b->first) + 1);
        assert_string_equal(b->got1, b->first);
        assert_int_equal(b->len2, strlen(b->second) + 1);
        assert_string_equal(b->got2, b->second);
        assert_int_equal(b->len0, 0);
        if (!b->leader) assert_true(b->cap >= b->len1);
    }
}

/* MPI's own failures come back as FR_COMM_EMPI with MPI's text. */
static void test_mpi_error_message(void **state)
{
    (void)state;
    fr_engine_group fake = {.layout = {.tp_size = 1}, .is_leader = 1, .world = W, .comm = MPI_COMM_NULL};
    float x = 1;
    assert_int_equal(fr_engine_allreduce_sum_f32(&fake, &x, 1), FR_COMM_EMPI);
    fr_test_error_has("MPI_Allreduce");
    fr_test_error_has("failed: ");
    fr_test_error_has("communicator");
    assert_int_equal(fr_engine_allreduce_sum_f32(NULL, &x, 1), FR_COMM_EINVAL);
    assert_int_equal(fr_engine_bcast_msg(&fake, NULL, NULL, NULL), FR_COMM_EINVAL);
}

int main(int argc, char **argv)
{
    if (fr_mpi_world_init(&argc, &argv, &W)) {
        fprintf(stderr, "test_comm: %s\n", fr_last_error());
        return 1;
    }
    if (W->rank == 0) printf("test_comm: %d rank(s), MPI thread level %s\n", W->size,
                             fr_mpi_thread_level_name(W->thread_level));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_arithmetic),
        cmocka_unit_test(test_layout_rejects),
        cmocka_unit_test(test_world),
        cmocka_unit_test(test_world_bcast_and_vote),
        cmocka_unit_test(test_world_gather_bytes),
        cmocka_unit_test(test_engine_split),
        cmocka_unit_test(test_engine_split_rejects),
        cmocka_unit_test(test_allreduce),
        cmocka_unit_test(test_allgather),
        cmocka_unit_test(test_bcast),
        cmocka_unit_test(test_mpi_error_message),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    /* Did any rank fail? Every rank exits non-zero if so. */
    int any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, W->comm);
    fr_mpi_world_finalize(&W);
    /* MPI cannot start twice in one process: a clear error, not a crash. */
    fr_mpi_world *again = NULL;
    if (fr_mpi_world_init(NULL, NULL, &again) != FR_COMM_EUNSUPPORTED || again ||
        !strstr(fr_last_error(), "cannot start again")) {
        fprintf(stderr, "test_comm: init after finalize did not fail cleanly: %s\n", fr_last_error());
        return 1;
    }
    return any ? 1 : 0;
}
