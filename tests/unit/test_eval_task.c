/* eval-task's parts without an engine: the Wilson interval and McNemar's
 * exact test against hand-computed values, the cells of a report, the
 * task file's reading and refusals, exact-match scoring. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "rollout/monitor/eval_task.h"
#include "rollout/monitor/task_stats.h"
#include "test_util.h"

static void test_wilson(void **state)
{
    (void)state;
    double lo, hi;
    /* 8 of 10, z = 1.959964: centre (0.8 + z^2/20) / (1 + z^2/10) = 0.716738,
     * half z / (1 + z^2/10) * sqrt(0.016 + z^2/400) = 0.226578 (the published
     * 0.4902-0.9433). */
    fr_wilson95(8, 10, &lo, &hi);
    assert_true(fabs(lo - 0.4901625) < 1e-6);
    assert_true(fabs(hi - 0.9433178) < 1e-6);
    /* 0 of 10: [0, z^2 / (n + z^2)] = [0, 0.277532]; 10 of 10 mirrors it. */
    fr_wilson95(0, 10, &lo, &hi);
    assert_true(fabs(lo) < 1e-12 && fabs(hi - 0.2775328) < 1e-6);
    fr_wilson95(10, 10, &lo, &hi);
    assert_true(fabs(lo - 0.7224672) < 1e-6 && fabs(hi - 1.0) < 1e-12);
    /* 50 of 100: 0.5 -/+ z / (1 + z^2/100) * sqrt(0.0025 + z^2/40000) = 0.4038315, 0.5961685. */
    fr_wilson95(50, 100, &lo, &hi);
    assert_true(fabs(lo - 0.4038315) < 1e-6 && fabs(hi - 0.5961685) < 1e-6);
    fr_wilson95(0, 0, &lo, &hi);
    assert_true(lo == 0.0 && hi == 1.0);
}

static void test_mcnemar(void **state)
{
    (void)state;
    /* b 1, c 9: 2 (C(10,0) + C(10,1)) / 2^10 = 22 / 1024. */
    assert_true(fabs(fr_mcnemar_exact(1, 9) - 22.0 / 1024.0) < 1e-12);
    assert_true(fabs(fr_mcnemar_exact(9, 1) - 22.0 / 1024.0) < 1e-12);
    /* b 0, c 5: 2 / 32. */
    assert_true(fabs(fr_mcnemar_exact(0, 5) - 0.0625) < 1e-12);
    /* b 2, c 12: 2 (1 + 14 + 91) / 2^14 = 212 / 16384. */
    assert_true(fabs(fr_mcnemar_exact(2, 12) - 212.0 / 16384.0) < 1e-12);
    /* Balanced or no discordant pair: 1. */
    assert_true(fr_mcnemar_exact(3, 3) == 1.0);
    assert_true(fr_mcnemar_exact(0, 0) == 1.0);
    /* Far past where 2^-n underflows: finite, tiny, and symmetric. */
    const double p = fr_mcnemar_exact(100, 1100);
    assert_true(p > 0.0 && p < 1e-100 && p == fr_mcnemar_exact(1100, 100));
    /* b 500, c 600: 2 P[X <= 500], X ~ Bin(1100, 1/2) = 0.00281954499 (the sum
     * of binomial coefficients in exact integers; the normal approximation with
     * continuity correction gives 0.0030). */
    assert_true(fabs(fr_mcnemar_exact(500, 600) / 0.0028195449914 - 1.0) < 1e-9);
}

static void test_cells(void **state)
{
    (void)state;
    /* Three configurations, five prompts in two groups (a/4: 0, 1, 3; b/8: 2, 4). */
    const unsigned char correct[] = {1, 1, 0, 1, 1,    /* the first: 4 of 5 */
                                     1, 0, 1, 0, 1,    /* loses 1 and 3, wins 2 */
                                     1, 1, 0, 1, 1};   /* the same as the first */
    const char *variants[] = {"a", "a", "b", "a", "b"};
    const int contexts[] = {4, 4, 8, 4, 8};
    fr_task_group *g;
    fr_task_cell *c;
    int ng;
    assert_int_equal(fr_task_cells(correct, 3, 5, variants, contexts, &g, &ng, &c), FR_OK);
    assert_int_equal(ng, 3);
    assert_string_equal(g[0].variant, "a");
    assert_int_equal(g[0].context, 4);
    assert_string_equal(g[1].variant, "b");
    assert_int_equal(g[2].context, -1);
    assert_string_equal(g[2].variant, "all");
    assert_int_equal(c[0].n, 3);
    assert_int_equal(c[0].k, 3);
    assert_int_equal(c[2].n, 5);
    assert_int_equal(c[2].k, 4);
    assert_int_equal(c[2].b + c[2].c, 0);
    assert_true(c[2].p == 1.0);
    const fr_task_cell *a = &c[3], *b = &c[4], *all = &c[5];   /* the second configuration */
    assert_int_equal(a->k, 1);
    assert_int_equal(a->b, 2);
    assert_int_equal(a->c, 0);
    assert_true(fabs(a->diff + 2.0 / 3.0) < 1e-12);
    assert_true(fabs(a->p - 0.5) < 1e-12);   /* 2 (1/4) */
    assert_int_equal(b->k, 2);
    assert_int_equal(b->c, 1);
    assert_int_equal(all->k, 3);
    assert_int_equal(all->b, 2);
    assert_int_equal(all->c, 1);
    assert_true(fabs(all->diff + 0.2) < 1e-12);
    assert_true(fabs(all->p - 1.0) < 1e-12);   /* 2 (1 + 3) / 8 */
    double lo, hi;
    fr_wilson95(3, 5, &lo, &hi);
    assert_true(all->lo == lo && all->hi == hi && all->acc == 0.6);
    assert_true(memcmp(&c[6], &c[0], sizeof c[0]) == 0);   /* the third is the first again */
    free(g);
    free(c);
    assert_int_not_equal(fr_task_cells(correct, 0, 5, variants, contexts, &g, &ng, &c), FR_OK);
}

static char *write_tmp(const char *text)
{
    char *path = strdup("/tmp/fr_eval_task_XXXXXX");
    const int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_task_file(void **state)
{
    (void)state;
    char *path = write_tmp("{\"prompt\":\"key A = 1\\nAnswer: \",\"answer\":\"1\",\"variant\":\"single\","
                           "\"context\":4096,\"depth\":0.5}\n"
                           "\n"
                           "{\"context\":8192,\"variant\":\"multikey\",\"answer\":\"x, y\",\"prompt\":\"p\"}\n");
    fr_task_set ts;
    assert_int_equal(fr_task_set_read(path, &ts), FR_OK);
    assert_int_equal(ts.n, 2);
    assert_string_equal(ts.items[0].prompt, "key A = 1\nAnswer: ");
    assert_string_equal(ts.items[0].answer, "1");
    assert_string_equal(ts.items[0].variant, "single");
    assert_int_equal(ts.items[0].context, 4096);
    assert_string_equal(ts.items[1].answer, "x, y");
    assert_int_equal(ts.items[1].context, 8192);
    fr_task_set_free(&ts);
    unlink(path);
    free(path);

    static const struct {
        const char *text, *why;
    } bad[] = {
        {"{\"prompt\":\"p\",\"answer\":\"a\",\"variant\":\"v\",\"context\":1}\n{\"prompt\":\"p\",", "line 2: not a JSON"},
        {"{\"answer\":\"a\",\"variant\":\"v\",\"context\":1}\n", "line 1: \"prompt\" must be a string"},
        {"{\"prompt\":\"p\",\"answer\":\"a\\nb\",\"variant\":\"v\",\"context\":1}\n", "\"answer\" holds a newline"},
        {"{\"prompt\":\"p\",\"answer\":\"\",\"variant\":\"v\",\"context\":1}\n", "\"answer\" is empty"},
        {"{\"prompt\":\"p\",\"answer\":\"a\",\"variant\":\"v\",\"context\":1.5}\n", "\"context\" must be a whole"},
        {"{\"prompt\":\"p\",\"answer\":\"a\",\"variant\":\"v\"}\n", "\"context\" must be a whole"},
        {"[1, 2]\n", "line 1: not a JSON object"},
        {"\n\n", "holds no prompt"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *p = write_tmp(bad[i].text);
        assert_int_equal(fr_task_set_read(p, &ts), FR_EFORMAT);
        if (!strstr(fr_last_error(), bad[i].why) || !strstr(fr_last_error(), p)) fail_msg("%s", fr_last_error());
        assert_null(ts.items);
        unlink(p);
        free(p);
    }
    assert_int_equal(fr_task_set_read("/nonexistent/tasks.jsonl", &ts), FR_EIO);
    assert_non_null(strstr(fr_last_error(), "No such file"));
}

static void test_match(void **state)
{
    (void)state;
    assert_true(fr_task_match("abc", 3, "abc"));
    assert_true(fr_task_match(" abc\nmore", 9, "abc"));
    assert_true(fr_task_match("abc \r\n", 6, " abc"));
    assert_true(fr_task_match("x1, y2", 6, "x1, y2"));
    assert_false(fr_task_match("abcd", 4, "abc"));
    assert_false(fr_task_match("ab", 2, "abc"));
    assert_false(fr_task_match("\nabc", 4, "abc"));
    assert_false(fr_task_match("", 0, "abc"));
    assert_false(fr_task_match("x1,y2", 5, "x1, y2"));
}

FR_TEST_MAIN(NULL, NULL, cmocka_unit_test(test_wilson), cmocka_unit_test(test_mcnemar), cmocka_unit_test(test_cells),
             cmocka_unit_test(test_task_file), cmocka_unit_test(test_match))
