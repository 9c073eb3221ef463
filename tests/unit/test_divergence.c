/* Divergence monitoring (rollout/engine/divergence.h): summaries and aggregates by
 * weight version and position bucket; the BF16 shadow over a serving
 * session's weights: a shadow of a BF16 session, teacher-forced beside it,
 * measures zero (to float rounding). The comparison with eval-kl on tq6
 * runs at the serving level (tests/unit/test_scheduler_monitor.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "rollout/engine/divergence.h"

static void test_summaries_and_buckets(void **state)
{
    (void)state;
    assert_int_equal(fr_div_bucket_of(0), 0);
    assert_int_equal(fr_div_bucket_of(1023), 0);
    assert_int_equal(fr_div_bucket_of(1024), 1);
    assert_int_equal(fr_div_bucket_of(4096), 2);
    assert_int_equal(fr_div_bucket_of(65535), 3);
    assert_int_equal(fr_div_bucket_of(1L << 20), 4);
    assert_string_equal(fr_div_bucket_name(2), "4K-16K");
    fr_div_summary s = {0};
    assert_true(isnan(fr_div_summary_mean(&s)));
    fr_kl_result r1 = {.kl = 0.002, .top1_match = 1, .logp_diff = -0.1}, r2 = {.kl = 0.006, .top1_match = 0};
    fr_div_summary_add(&s, &r1);
    fr_div_summary_add(&s, &r2);
    assert_int_equal(s.n, 2);
    assert_true(fabs(fr_div_summary_mean(&s) - 0.004) < 1e-12 && s.kl_max == 0.006 && s.top1_agree == 1);
    fr_div_aggregates a;
    memset(&a, 0, sizeof a);
    for (uint64_t v = 1; v <= FR_DIV_VERSIONS + 2; v++) fr_div_aggregates_add(&a, v, 5000, &r1);
    fr_div_aggregates_add(&a, FR_DIV_VERSIONS + 2, 10, &r2);
    assert_null(fr_div_aggregates_find(&a, 1));   /* the oldest versions were evicted */
    assert_null(fr_div_aggregates_find(&a, 2));
    const fr_div_version *e = fr_div_aggregates_find(&a, FR_DIV_VERSIONS + 2);
    assert_non_null(e);
    assert_int_equal(e->all.n, 2);
    assert_int_equal(e->bucket[2].n, 1);
    assert_int_equal(e->bucket[0].n, 1);
}

/* Teacher-forces n_texts texts through `main` and its shadow, one token of
 * every text per step; text_kl[i] gets text i's mean D_t. */
static void forced_kl(fr_session *main, int n_texts, int *const *texts, const int *lens, double *text_kl)
{
    const int V = main->model->cfg.vocab_size;
    int max_len = 0;
    for (int i = 0; i < n_texts; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    fr_shadow *sh;
    assert_int_equal(fr_shadow_open(main, n_texts, n_texts * (max_len / FR_PAGE_TOKENS + 2) + 1, &sh), FR_OK);
    int seq[4], shadow_seq[4], tok[4], sseq[4];
    fr_div_summary sum[4];
    memset(sum, 0, sizeof sum);
    float *q = malloc(sizeof(float) * (size_t)V * n_texts), *p = malloc(sizeof(float) * (size_t)V * n_texts);
    assert_non_null(q);
    assert_non_null(p);
    fr_step_seq steps[4];
    for (int i = 0; i < n_texts; i++) {
        assert_int_equal(fr_kv_seq_new(main->kv, &seq[i]), FR_OK);
        /* the shadow starts from the first token, the main sequence steps it below */
        assert_int_equal(fr_shadow_start(sh, texts[i], 1, &shadow_seq[i], p + (size_t)i * V), FR_OK);
    }
    for (int t = 0; t < max_len; t++) {
        int ns = 0;
        for (int i = 0; i < n_texts; i++)
            if (t < lens[i]) {
                tok[ns] = texts[i][t];
                steps[ns] = (fr_step_seq){.seq = seq[i], .n = 1, .tokens = &tok[ns]};
                sseq[ns] = shadow_seq[i];
                ns++;
            }
        assert_int_equal(fr_session_step(main, steps, ns, q), FR_OK);
        if (t > 0) assert_int_equal(fr_shadow_step(sh, sseq, tok, ns, p), FR_OK);
        for (int i = 0, r = 0; i < n_texts; i++)
            if (t < lens[i]) {
                fr_kl_result k;
                assert_int_equal(fr_kl_topk(p + (size_t)r * V, q + (size_t)r * V, V, FR_KL_TOP_K,
                                            t + 1 < lens[i] ? texts[i][t + 1] : -1, &k), FR_OK);
                fr_div_summary_add(&sum[i], &k);
                r++;
            }
    }
    for (int i = 0; i < n_texts; i++) {
        text_kl[i] = fr_div_summary_mean(&sum[i]);
        fr_kv_seq_free(main->kv, seq[i]);
        fr_shadow_drop(sh, shadow_seq[i]);
    }
    free(q);
    free(p);
    fr_shadow_close(&sh);
}

/* Finished samples: the per-sample histogram, the worst list (highest mean
 * first, at most FR_DIV_WORST, ties keep the earlier), per-position
 * histograms and the running totals that survive eviction. */
static void test_samples_and_worst(void **state)
{
    (void)state;
    fr_div_aggregates a;
    memset(&a, 0, sizeof a);
    const double means[] = {3e-3, 1e-3, 7e-3, 2e-3, 5e-3, 4e-3, 6e-3, 0.5e-3};
    for (int i = 0; i < 8; i++) {
        fr_div_summary s = {.n = 10, .kl_sum = 10 * means[i]};
        fr_div_aggregates_add_sample(&a, 2, 100 + (uint64_t)i, i % 3, &s);
    }
    fr_div_summary empty = {0};
    fr_div_aggregates_add_sample(&a, 2, 999, 0, &empty);   /* no position: not a sample */
    const fr_div_version *e = fr_div_aggregates_find(&a, 2);
    assert_non_null(e);
    assert_int_equal(e->sample_kl.n, 8);
    assert_int_equal(e->n_worst, FR_DIV_WORST);
    const uint64_t want[FR_DIV_WORST] = {102, 106, 104, 105, 100};   /* 7, 6, 5, 4, 3 (1e-3 nats) */
    for (int i = 0; i < FR_DIV_WORST; i++) {
        assert_int_equal(e->worst[i].request_id, want[i]);
        assert_int_equal(e->worst[i].positions, 10);
    }
    assert_int_equal(e->worst[0].sample, 2);
    assert_true(fabs(e->worst[0].kl_mean - 7e-3) < 1e-15);
    /* the median of 0.5 .. 7 (1e-3 nats) lies in the (2e-3, 5e-3] bucket */
    const double med = fr_hist_quantile(&e->sample_kl, 0.5);
    assert_true(med > 2e-3 && med <= 5e-3);
    /* positions: the histogram, and totals that outlive an evicted version */
    fr_kl_result k = {.kl = 3e-4, .top1_match = 1};
    for (uint64_t v = 0; v < FR_DIV_VERSIONS + 2; v++) fr_div_aggregates_add(&a, 10 + v, 5, &k);
    assert_null(fr_div_aggregates_find(&a, 10));
    assert_int_equal(a.positions_total, FR_DIV_VERSIONS + 2);
    assert_true(fabs(a.kl_sum_total - (FR_DIV_VERSIONS + 2) * 3e-4) < 1e-15);
    const fr_div_version *last = fr_div_aggregates_find(&a, 10 + FR_DIV_VERSIONS + 1);
    assert_non_null(last);
    assert_int_equal(last->kl.n, 1);
    assert_int_equal(last->kl.count[8], 1);   /* (2e-4, 5e-4]: the ninth bucket */
}

static void test_bf16_shadow_of_bf16_is_zero(void **state)
{
    (void)state;
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.backend = FR_BACKEND_CPU;
    fr_session s;
    assert_int_equal(fr_session_open(&o, 16, 2, &s), FR_OK);
    int a[] = {256, 72, 101, 108, 108, 111, 10, 84, 104, 101, 32, 101, 110, 100, 46}, b[] = {256, 49, 50, 51};
    int *texts[2] = {a, b}, lens[2] = {15, 4};
    double kl[2];
    forced_kl(&s, 2, texts, lens, kl);
    printf("  BF16 shadow of a BF16 session: mean KL %.3g and %.3g nats\n", kl[0], kl[1]);
    /* not exactly 0: the shadow's first step has one row, the session's two,
     * and BLAS rounds a one-row product differently */
    assert_true(fabs(kl[0]) < 1e-6 && fabs(kl[1]) < 1e-6);
    fr_session_close(&s);
}

int main(void)
{
    /* one-token steps: OpenBLAS threads only add synchronization */
    openblas_set_num_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_summaries_and_buckets),
        cmocka_unit_test(test_samples_and_worst),
        cmocka_unit_test(test_bf16_shadow_of_bf16_is_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
