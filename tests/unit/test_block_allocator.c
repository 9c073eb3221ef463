/* Block allocator and block tables: exhaustion, all-or-nothing allocation,
 * refcount errors, fork sharing, and a randomized run against a shadow model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "kvcache/block_allocator.h"
#include "kvcache/block_table.h"
#include "test_util.h"

static void test_new_rejects_bad_count(void **state)
{
    (void)state;
    fr_block_allocator *a = (fr_block_allocator *)&a;
    assert_int_equal(fr_block_allocator_new(0, &a), FR_EINVAL);
    assert_null(a);
    assert_int_equal(fr_block_allocator_new(-3, &a), FR_EINVAL);
    assert_int_equal(fr_block_allocator_new(4, NULL), FR_EINVAL);
    fr_block_allocator_destroy(&a);   /* NULL is a no-op */
    fr_block_allocator_destroy(NULL);
    assert_int_equal(fr_block_free_count(NULL), 0);
    assert_int_equal(fr_block_refcount(NULL, 0), -1);
}

static void test_alloc_until_exhausted(void **state)
{
    (void)state;
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(4, &a), FR_OK);
    assert_int_equal(fr_block_total(a), 4);
    for (int i = 0; i < 4; i++) {
        int b = -1;
        assert_int_equal(fr_block_alloc(a, &b), FR_OK);
        assert_int_equal(b, i);   /* documented: lowest ids first */
        assert_int_equal(fr_block_refcount(a, b), 1);
    }
    int b = 77;
    assert_int_equal(fr_block_alloc(a, &b), FR_ENOMEM);
    assert_string_equal(fr_last_error(), "no free KV block (4 in use)");
    assert_int_equal(b, 77);
    assert_int_equal(fr_block_free_count(a), 0);
    /* documented: freed blocks come back last-freed first */
    assert_int_equal(fr_block_decref(a, 1), FR_OK);
    assert_int_equal(fr_block_decref(a, 2), FR_OK);
    assert_int_equal(fr_block_alloc(a, &b), FR_OK);
    assert_int_equal(b, 2);
    assert_int_equal(fr_block_alloc(a, &b), FR_OK);
    assert_int_equal(b, 1);
    assert_int_equal(fr_block_alloc(NULL, &b), FR_EINVAL);
    assert_int_equal(fr_block_alloc(a, NULL), FR_EINVAL);
    fr_block_allocator_destroy(&a);
    assert_null(a);
}

static void test_alloc_n_all_or_nothing(void **state)
{
    (void)state;
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(8, &a), FR_OK);
    int got[8];
    assert_int_equal(fr_block_alloc_n(a, 5, got), FR_OK);
    int out[4] = {-7, -7, -7, -7};
    assert_int_equal(fr_block_alloc_n(a, 4, out), FR_ENOMEM);
    assert_non_null(strstr(fr_last_error(), "3 free (5 in use)"));
    assert_int_equal(fr_block_free_count(a), 3);
    for (int i = 0; i < 4; i++)
        assert_int_equal(out[i], -7);
    for (int i = 0; i < 8; i++)
        assert_int_equal(fr_block_refcount(a, i), i < 5 ? 1 : 0);
    assert_int_equal(fr_block_alloc_n(a, 0, NULL), FR_OK);
    assert_int_equal(fr_block_alloc_n(a, -1, out), FR_EINVAL);
    assert_int_equal(fr_block_alloc_n(a, 3, out), FR_OK);
    assert_int_equal(fr_block_free_count(a), 0);
    fr_block_allocator_destroy(&a);
}

static void test_incref_decref(void **state)
{
    (void)state;
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(3, &a), FR_OK);
    int b;
    assert_int_equal(fr_block_alloc(a, &b), FR_OK);
    assert_int_equal(fr_block_incref(a, b), FR_OK);
    assert_int_equal(fr_block_refcount(a, b), 2);
    assert_int_equal(fr_block_decref(a, b), FR_OK);
    assert_int_equal(fr_block_free_count(a), 2);   /* still held once */
    assert_int_equal(fr_block_decref(a, b), FR_OK);
    assert_int_equal(fr_block_refcount(a, b), 0);
    assert_int_equal(fr_block_free_count(a), 3);

    assert_int_equal(fr_block_decref(a, b), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "already free"));
    assert_int_equal(fr_block_incref(a, b), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "is free"));
    const int bad[] = {-1, 3, 1 << 30};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fr_block_incref(a, bad[i]), FR_EINVAL);
        assert_non_null(strstr(fr_last_error(), "out of range"));
        assert_int_equal(fr_block_decref(a, bad[i]), FR_EINVAL);
        assert_int_equal(fr_block_refcount(a, bad[i]), -1);
    }
    /* rejected calls changed nothing: the pool is intact */
    assert_int_equal(fr_block_free_count(a), 3);
    int all[3];
    assert_int_equal(fr_block_alloc_n(a, 3, all), FR_OK);
    assert_int_equal(fr_block_incref(NULL, 0), FR_EINVAL);
    assert_int_equal(fr_block_decref(NULL, 0), FR_EINVAL);
    fr_block_allocator_destroy(&a);
}

static void test_table_push_grows(void **state)
{
    (void)state;
    fr_block_table t;
    fr_block_table_init(&t);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(fr_block_table_push(&t, i), FR_OK);
    assert_int_equal(t.n, 1000);
    assert_true(t.cap >= 1000);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(t.blocks[i], i);
    assert_int_equal(fr_block_table_push(&t, -1), FR_EINVAL);
    assert_int_equal(fr_block_table_push(NULL, 0), FR_EINVAL);
    assert_int_equal(t.n, 1000);
    /* ids were never allocated, so release just the memory by hand */
    t.n = 0;
    fr_block_table_release(&t, NULL);
    assert_null(t.blocks);
}

static void test_fork_shares_and_release_returns_all(void **state)
{
    (void)state;
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(16, &a), FR_OK);
    fr_block_table p, s1, s2;
    fr_block_table_init(&p);
    fr_block_table_init(&s1);
    fr_block_table_init(&s2);
    for (int i = 0; i < 4; i++) {
        int b;
        assert_int_equal(fr_block_alloc(a, &b), FR_OK);
        assert_int_equal(fr_block_table_push(&p, b), FR_OK);
    }
    /* samples share the 3 full prompt pages, each gets its own last page */
    assert_int_equal(fr_block_table_fork(&p, 3, a, &s1), FR_OK);
    assert_int_equal(fr_block_table_fork(&p, 3, a, &s2), FR_OK);
    assert_int_equal(s1.n, 3);
    assert_memory_equal(s1.blocks, p.blocks, 3 * sizeof(int));
    for (int i = 0; i < 3; i++)
        assert_int_equal(fr_block_refcount(a, p.blocks[i]), 3);
    assert_int_equal(fr_block_refcount(a, p.blocks[3]), 1);
    int b;
    assert_int_equal(fr_block_alloc(a, &b), FR_OK);
    assert_int_equal(fr_block_table_push(&s1, b), FR_OK);
    assert_int_equal(fr_block_free_count(a), 11);

    /* rejected forks change no refcount */
    fr_block_table bad;
    fr_block_table_init(&bad);
    assert_int_equal(fr_block_table_fork(&p, 5, a, &bad), FR_EINVAL);
    assert_int_equal(fr_block_table_fork(&p, -1, a, &bad), FR_EINVAL);
    assert_int_equal(fr_block_table_fork(&p, 2, a, &s1), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "release it first"));
    assert_int_equal(fr_block_table_fork(&p, 2, NULL, &bad), FR_EINVAL);
    assert_int_equal(bad.n, 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(fr_block_refcount(a, p.blocks[i]), 3);

    fr_block_table_release(&p, a);
    assert_int_equal(p.n, 0);
    assert_null(p.blocks);
    assert_int_equal(fr_block_refcount(a, s1.blocks[0]), 2);
    assert_int_equal(fr_block_free_count(a), 12);   /* only p's own last page */
    fr_block_table_release(&s1, a);
    fr_block_table_release(&s2, a);
    assert_int_equal(fr_block_free_count(a), fr_block_total(a));
    fr_block_table_release(&s2, a);   /* releasing an empty table is harmless */
    fr_block_allocator_destroy(&a);
}

/* A table listing a block it does not own (a bug elsewhere) must not leave a
 * half-done fork behind. */
static void test_fork_rolls_back(void **state)
{
    (void)state;
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(4, &a), FR_OK);
    int ids[3];
    assert_int_equal(fr_block_alloc_n(a, 3, ids), FR_OK);
    assert_int_equal(fr_block_decref(a, ids[2]), FR_OK);
    fr_block_table src, dst;
    fr_block_table_init(&src);
    fr_block_table_init(&dst);
    for (int i = 0; i < 3; i++)
        assert_int_equal(fr_block_table_push(&src, ids[i]), FR_OK);
    assert_int_equal(fr_block_table_fork(&src, 3, a, &dst), FR_EINVAL);
    assert_int_equal(dst.n, 0);
    assert_int_equal(fr_block_refcount(a, ids[0]), 1);
    assert_int_equal(fr_block_refcount(a, ids[1]), 1);
    fr_block_table_release(&dst, a);
    src.n = 2;   /* drop the id it never owned */
    fr_block_table_release(&src, a);
    assert_int_equal(fr_block_free_count(a), 4);
    fr_block_allocator_destroy(&a);
}

/* ---- randomized run against an independent model ---- */

enum { S_BLOCKS = 48, S_TABLES = 24, S_OPS = 10000 };

typedef struct {
    int ref[S_BLOCKS];
    int stack[S_BLOCKS];   /* expected free order, top last */
    int n_free;
} shadow;

static void shadow_decref(shadow *m, int b)
{
    assert_true(m->ref[b] > 0);
    if (--m->ref[b] == 0)
        m->stack[m->n_free++] = b;
}

/* Three views must agree: the allocator, the shadow, and the tables' own
 * contents (each listed id is one reference). */
static void check(const fr_block_allocator *a, const shadow *m, const fr_block_table *t)
{
    int held[S_BLOCKS] = {0};
    for (int i = 0; i < S_TABLES; i++)
        for (int j = 0; j < t[i].n; j++) {
            assert_in_range(t[i].blocks[j], 0, S_BLOCKS - 1);
            held[t[i].blocks[j]]++;
        }
    for (int b = 0; b < S_BLOCKS; b++) {
        assert_int_equal(fr_block_refcount(a, b), m->ref[b]);
        assert_int_equal(held[b], m->ref[b]);
    }
    assert_int_equal(fr_block_free_count(a), m->n_free);
}

static void test_stress_against_shadow(void **state)
{
    (void)state;
    fr_test_rng rng = {0x6b76636163686521ull};
    fr_block_allocator *a = NULL;
    assert_int_equal(fr_block_allocator_new(S_BLOCKS, &a), FR_OK);
    fr_block_table t[S_TABLES];
    for (int i = 0; i < S_TABLES; i++)
        fr_block_table_init(&t[i]);
    shadow m = {.n_free = S_BLOCKS};
    for (int i = 0; i < S_BLOCKS; i++)
        m.stack[i] = S_BLOCKS - 1 - i;
    int n_enomem = 0, n_shared_forks = 0, n_freed_by_release = 0;
    char want[64];

    for (int op = 0; op < S_OPS; op++) {
        fr_block_table *x = &t[fr_test_u64(&rng) % S_TABLES];
        int kind = (int)(fr_test_u64(&rng) % 10);
        if (kind < 4) {                                   /* push one new page */
            int b = -1;
            fr_status st = fr_block_alloc(a, &b);
            if (m.n_free == 0) {
                assert_int_equal(st, FR_ENOMEM);
                snprintf(want, sizeof want, "no free KV block (%d in use)", S_BLOCKS);
                assert_string_equal(fr_last_error(), want);
                n_enomem++;
            } else {
                assert_int_equal(st, FR_OK);
                assert_int_equal(b, m.stack[--m.n_free]);
                assert_int_equal(m.ref[b], 0);
                m.ref[b] = 1;
                assert_int_equal(fr_block_table_push(x, b), FR_OK);
            }
        } else if (kind < 5) {                            /* push several pages */
            int n = (int)(fr_test_u64(&rng) % 5), ids[4];
            fr_status st = fr_block_alloc_n(a, n, ids);
            if (n > m.n_free) {
                assert_int_equal(st, FR_ENOMEM);
                n_enomem++;
            } else {
                assert_int_equal(st, FR_OK);
                for (int i = 0; i < n; i++) {
                    assert_int_equal(ids[i], m.stack[--m.n_free]);
                    m.ref[ids[i]] = 1;
                    assert_int_equal(fr_block_table_push(x, ids[i]), FR_OK);
                }
            }
        } else if (kind < 7) {                            /* fork a sample */
            const fr_block_table *src = &t[fr_test_u64(&rng) % S_TABLES];
            int n_shared = (int)(fr_test_u64(&rng) % (uint64_t)(src->n + 1));
            fr_status st = fr_block_table_fork(src, n_shared, a, x);
            if (x->n != 0 && st != FR_OK) {
                assert_int_equal(st, FR_EINVAL);          /* target in use */
            } else {
                assert_int_equal(st, FR_OK);
                assert_int_equal(x->n, n_shared);
                for (int i = 0; i < n_shared; i++)
                    m.ref[src->blocks[i]]++;
                n_shared_forks += n_shared > 0;
            }
        } else if (kind < 9) {                            /* sample finished */
            int before = m.n_free;
            for (int i = 0; i < x->n; i++)
                shadow_decref(&m, x->blocks[i]);
            n_freed_by_release += m.n_free - before;
            fr_block_table_release(x, a);
            assert_int_equal(x->n, 0);
        } else {                                          /* misuse is rejected */
            int b = (int)(fr_test_u64(&rng) % (S_BLOCKS + 2)) - 1;
            if (b < 0 || b >= S_BLOCKS || m.ref[b] == 0) {
                assert_int_equal(fr_block_incref(a, b), FR_EINVAL);
                assert_int_equal(fr_block_decref(a, b), FR_EINVAL);
            } else {
                assert_int_equal(fr_block_incref(a, b), FR_OK);
                assert_int_equal(fr_block_refcount(a, b), m.ref[b] + 1);
                assert_int_equal(fr_block_decref(a, b), FR_OK);
            }
        }
        check(a, &m, t);
    }
    /* the run must have exercised exhaustion, sharing and real frees */
    assert_true(n_enomem > 0);
    assert_true(n_shared_forks > 0);
    assert_true(n_freed_by_release > 0);

    for (int i = 0; i < S_TABLES; i++) {
        for (int j = 0; j < t[i].n; j++)
            shadow_decref(&m, t[i].blocks[j]);
        fr_block_table_release(&t[i], a);
        check(a, &m, t);
    }
    assert_int_equal(fr_block_free_count(a), fr_block_total(a));
    fr_block_allocator_destroy(&a);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_new_rejects_bad_count),
             cmocka_unit_test(test_alloc_until_exhausted),
             cmocka_unit_test(test_alloc_n_all_or_nothing),
             cmocka_unit_test(test_incref_decref),
             cmocka_unit_test(test_table_push_grows),
             cmocka_unit_test(test_fork_shares_and_release_returns_all),
             cmocka_unit_test(test_fork_rolls_back),
             cmocka_unit_test(test_stress_against_shadow))
