/* base/: the growable buffer, the dtype enum, the clock, atomic files and seeds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/atomic_file.h"
#include "base/buf.h"
#include "base/clock.h"
#include "base/dtype.h"
#include "base/fr_status.h"
#include "base/seed.h"
#include "test_util.h"

static void test_buf_grows_and_stays_terminated(void **state)
{
    (void)state;
    fr_buf b = {0};
    fr_buf_put(&b, "ab", 2);
    assert_int_equal(b.len, 2);
    assert_string_equal(b.data, "ab");
    /* Far past the first allocation, so printf has to grow and retry. */
    for (int i = 0; i < 1000; i++) fr_buf_printf(&b, "%04d", i);
    assert_false(b.failed);
    assert_int_equal(b.len, 2 + 4000);
    assert_int_equal(strlen(b.data), b.len);
    assert_memory_equal(b.data + 2 + 4 * 999, "0999", 4);
    char big[1000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    fr_buf_printf(&b, "%s|", big);
    assert_int_equal(b.len, 2 + 4000 + 1000);
    assert_int_equal(b.data[b.len - 1], '|');
    fr_buf_put(&b, NULL, 0);
    assert_int_equal(b.len, 5002);
    fr_buf_free(&b);
    assert_null(b.data);
    assert_int_equal(b.len, 0);
}

static void test_buf_failure_is_sticky(void **state)
{
    (void)state;
    fr_buf b = {0};
    assert_int_equal(fr_buf_reserve(&b, (size_t)-1), -1);
    assert_true(b.failed);
    fr_buf_put(&b, "x", 1);
    fr_buf_printf(&b, "%d", 1);
    assert_int_equal(b.len, 0);
    fr_buf_free(&b);
    assert_false(b.failed);
}

static void test_array_room(void **state)
{
    (void)state;
    int *a = NULL;
    size_t n = 0, cap = 0;
    for (int i = 0; i < 100; i++) {
        int *v = fr_array_room(a, n, &cap, sizeof *v, 4);
        assert_non_null(v);
        a = v;
        a[n++] = i;
        assert_true(n <= cap);
    }
    assert_int_equal(cap, 128);   /* 4, 8, ..., 128: doubled only when full */
    for (int i = 0; i < 100; i++) assert_int_equal(a[i], i);
    assert_ptr_equal(fr_array_room(a, 5, &cap, sizeof *a, 4), a);   /* room left: untouched */
    size_t huge = SIZE_MAX / 2;
    assert_null(fr_array_room(a, huge, &huge, sizeof *a, 4));   /* too large: refused, nothing changed */
    assert_int_equal(huge, SIZE_MAX / 2);
    free(a);
}

static void test_dtype(void **state)
{
    (void)state;
    /* The client ABI passes these as integers. */
    assert_int_equal(FR_DTYPE_F32, 0);
    assert_int_equal(FR_DTYPE_BF16, 1);
    assert_int_equal(FR_DTYPE_F16, 2);
    assert_int_equal(fr_dtype_size(FR_DTYPE_F32), 4);
    assert_int_equal(fr_dtype_size(FR_DTYPE_BF16), 2);
    assert_int_equal(fr_dtype_size(FR_DTYPE_I64), 8);
    assert_int_equal(fr_dtype_size((fr_dtype)-1), 0);
    assert_int_equal(fr_dtype_size(FR_DTYPE_COUNT), 0);
    assert_string_equal(fr_dtype_name(FR_DTYPE_BF16), "bf16");
    assert_string_equal(fr_dtype_file_name(FR_DTYPE_BF16), "BF16");
    assert_string_equal(fr_dtype_name((fr_dtype)99), "?");
    fr_dtype t = FR_DTYPE_COUNT;
    assert_true(fr_dtype_from_file_name("BOOL", 4, &t));
    assert_int_equal(t, FR_DTYPE_BOOL);
    assert_true(fr_dtype_from_file_name("F16xyz", 3, &t));
    assert_int_equal(t, FR_DTYPE_F16);
    assert_false(fr_dtype_from_file_name("F1", 2, &t));
    assert_false(fr_dtype_from_file_name("f32", 3, &t));
    assert_int_equal(t, FR_DTYPE_F16);
    assert_true(fr_dtype_is_weight(FR_DTYPE_F16));
    assert_false(fr_dtype_is_weight(FR_DTYPE_F64));
}

static void test_clock(void **state)
{
    (void)state;
    const double a = fr_now_s(), ms = fr_now_ms();
    usleep(2000);
    const double b = fr_now_s();
    assert_true(b - a >= 0.0015);
    assert_true(ms >= a * 1e3 - 1.0 && ms <= b * 1e3 + 1.0);
}

static void test_atomic_file(void **state)
{
    (void)state;
    char path[64];
    snprintf(path, sizeof path, "/tmp/fr_test_base.%d", (int)getpid());
    fr_atomic_file a;
    assert_int_equal(fr_atomic_file_open(&a, path), FR_OK);
    fputs("kept", a.f);
    assert_int_equal(access(path, F_OK), -1);   /* nothing at PATH until the rename */
    assert_int_equal(fr_atomic_file_close(&a, 1), FR_OK);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char got[8] = {0};
    assert_int_equal(fread(got, 1, sizeof got, f), 4);
    fclose(f);
    assert_string_equal(got, "kept");
    /* A failed write leaves the old file as it was. */
    assert_int_equal(fr_atomic_file_open(&a, path), FR_OK);
    fputs("lost", a.f);
    assert_int_equal(fr_atomic_file_close(&a, 0), FR_OK);
    assert_int_equal(access(a.tmp, F_OK), -1);
    f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fread(got, 1, sizeof got, f), 4);
    fclose(f);
    assert_string_equal(got, "kept");
    unlink(path);
}

/* A given seed replays its stream; the operating system's streams differ. */
static void test_seed_stream(void **state)
{
    (void)state;
    fr_seed_stream a, b;
    assert_int_equal(fr_seed_stream_init(&a, 1, 0), FR_OK);
    /* SplitMix64's published first output from state 0 */
    assert_true(fr_seed_stream_next(&a) == 0xE220A8397B1DCDAFull);
    assert_int_equal(fr_seed_stream_init(&a, 1, 42), FR_OK);
    assert_int_equal(fr_seed_stream_init(&b, 1, 42), FR_OK);
    uint64_t first = 0;
    for (int i = 0; i < 100; i++) {
        uint64_t x = fr_seed_stream_next(&a);
        assert_true(x == fr_seed_stream_next(&b));
        if (i == 0) first = x;
        else assert_true(x != first);
    }
    assert_int_equal(fr_seed_stream_init(&a, 0, 0), FR_OK);
    assert_int_equal(fr_seed_stream_init(&b, 0, 0), FR_OK);
    assert_true(fr_seed_stream_next(&a) != fr_seed_stream_next(&b));   /* 2^-64 to fail */
    uint64_t x = 0, y = 0;
    assert_int_equal(fr_seed_from_os(&x), FR_OK);
    assert_int_equal(fr_seed_from_os(&y), FR_OK);
    assert_true(x != y);
    assert_int_equal(fr_seed_from_os(NULL), FR_EINVAL);
    assert_int_equal(fr_seed_stream_init(NULL, 1, 0), FR_EINVAL);
    assert_true(fr_seed_stream_next(NULL) == 0);
}

/* The one error store: a message per thread; a peer's failure keeps the
 * peer's own code, message and subject until the next failure clears them;
 * a kept copy comes back whole, the peer's account included, after other
 * failures; arguments may point into the store itself. */
static void test_error_store(void **state)
{
    (void)state;
    assert_int_equal(fr_fail(FR_EINVAL, "dim %d", 3), FR_EINVAL);
    assert_string_equal(fr_last_error(), "dim 3");
    const char *code = NULL, *msg = NULL;
    long long id = 0;
    assert_int_equal(fr_last_error_peer(&code, &msg, &id), 0);
    assert_int_equal(fr_fail_peer(FR_EINVAL, "bad_shape", "x has shape [2]", 7, "server refused %s: %s", "begin",
                                  "bad_shape"), FR_EINVAL);
    assert_string_equal(fr_last_error(), "server refused begin: bad_shape");
    assert_int_equal(fr_last_error_peer(&code, &msg, &id), 1);
    assert_string_equal(code, "bad_shape");
    assert_string_equal(msg, "x has shape [2]");
    assert_int_equal(id, 7);
    /* its own account as arguments: copied before the store is written */
    fr_fail_peer(FR_EINVAL, code, msg, id, "refused: %s: %s", code, msg);
    assert_string_equal(fr_last_error(), "refused: bad_shape: x has shape [2]");
    assert_int_equal(fr_last_error_peer(&code, &msg, NULL), 1);
    assert_string_equal(msg, "x has shape [2]");
    fr_error_copy kept;
    fr_error_keep(&kept);
    fr_fail(FR_EIO, "%s, then a local failure", fr_last_error());
    assert_string_equal(fr_last_error(), "refused: bad_shape: x has shape [2], then a local failure");
    assert_int_equal(fr_last_error_peer(NULL, NULL, NULL), 0);   /* a failure of one's own clears it */
    assert_int_equal(fr_error_restore(&kept, FR_EINVAL, " (kept)"), FR_EINVAL);
    assert_string_equal(fr_last_error(), "refused: bad_shape: x has shape [2] (kept)");
    assert_int_equal(fr_last_error_peer(&code, NULL, &id), 1);
    assert_string_equal(code, "bad_shape");
    assert_int_equal(id, 7);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_buf_grows_and_stays_terminated),
             cmocka_unit_test(test_buf_failure_is_sticky),
             cmocka_unit_test(test_array_room),
             cmocka_unit_test(test_dtype),
             cmocka_unit_test(test_clock),
             cmocka_unit_test(test_atomic_file),
             cmocka_unit_test(test_seed_stream),
             cmocka_unit_test(test_error_store))
