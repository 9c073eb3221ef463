/* Tests for the Philox RNG and the token sampler (rollout/model/philox.h,
 * rollout/model/sampler.h). The statistical tests use fixed seeds, so they are
 * deterministic: a pass is a pass every run, and the chi-square thresholds
 * (p = 0.001) say the sampler's frequencies fit the intended distribution. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/philox.h"
#include "rollout/model/sampler.h"
#include "test_util.h"

/* ---- Philox ---------------------------------------------------------- */

static void test_philox_known_answers(void **state)
{
    (void)state;
    /* Random123 kat_vectors, philox4x32_10. */
    static const struct { uint32_t ctr[4], key[2], expect[4]; } kat[] = {
        { {0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8} },
        { {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
          {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd} },
        { {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
          {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1} },
    };
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        fr_philox4x32_10(kat[i].ctr, kat[i].key, out);
        for (int j = 0; j < 4; j++)
            assert_int_equal(out[j], kat[i].expect[j]);
    }
}

/* Pins the documented mapping (seed, sequence, step) -> u that the GPU must
 * reproduce, including the high halves of the 64-bit inputs. */
static void test_philox_uniform_rule(void **state)
{
    (void)state;
    static const uint64_t vals[] = { 0, 1, 0xffffffffull, 0x100000000ull,
                                     0x0123456789abcdefull, ~0ull };
    const int nv = (int)(sizeof vals / sizeof vals[0]);
    for (int a = 0; a < nv; a++)
        for (int b = 0; b < nv; b++)
            for (int c = 0; c < nv; c++) {
                uint64_t seed = vals[a], seq = vals[b], step = vals[c];
                uint32_t ctr[4] = { (uint32_t)step, (uint32_t)(step >> 32),
                                    (uint32_t)seq, (uint32_t)(seq >> 32) };
                uint32_t key[2] = { (uint32_t)seed, (uint32_t)(seed >> 32) };
                uint32_t out[4];
                fr_philox4x32_10(ctr, key, out);
                float u = fr_philox_uniform(seed, seq, step);
                assert_true(u == (float)(out[0] >> 8) / 16777216.0f);
                assert_true(u >= 0.0f && u < 1.0f);
            }
    /* Counter 0, key 0: out[0] = 0x6627e8d5, so u = 0x6627e8 / 2^24. */
    assert_true(fr_philox_uniform(0, 0, 0) == (float)0x6627e8 / 16777216.0f);
}

/* ---- helpers ---------------------------------------------------------- */

static fr_sampling_params params(float temperature, int top_k, float top_p, uint64_t seed)
{
    fr_sampling_params p = { temperature, top_k, top_p, seed };
    return p;
}

/* Naive double-precision log-softmax of logits/t, the trainer's view. */
static double naive_logprob(const float *logits, int n, double t, int tok)
{
    double m = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++)
        if (logits[i] / t > m) m = logits[i] / t;
    for (int i = 0; i < n; i++)
        sum += exp(logits[i] / t - m);
    return logits[tok] / t - m - log(sum);
}

static void random_logits(float *x, int n, float scale, uint64_t seed)
{
    fr_test_rng r = { seed };
    for (int i = 0; i < n; i++)
        x[i] = scale * fr_test_normal(&r);
}

/* ---- greedy and logprob ---------------------------------------------- */

static void test_greedy_argmax_ties_to_lowest(void **state)
{
    (void)state;
    const float logits[6] = { 1.0f, 3.5f, -2.0f, 3.5f, 0.0f, 3.5f };
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(6, &s), FR_OK);
    fr_sampling_params p = params(0.0f, 0, 1.0f, 7);
    for (uint64_t step = 0; step < 50; step++) {   /* greedy draws nothing */
        int tok = -1;
        float lp = 0.0f;
        assert_int_equal(fr_sample(s, logits, &p, step * 31, step, &tok, &lp), FR_OK);
        assert_int_equal(tok, 1);
        assert_float_equal(lp, naive_logprob(logits, 6, 1.0, 1), 1e-6);
    }
    fr_sampler_destroy(&s);
    assert_null(s);
}

static void test_logprob_matches_naive(void **state)
{
    (void)state;
    enum { V = 1000 };
    float *logits = malloc(V * sizeof *logits), *ls = malloc(V * sizeof *ls);
    assert_non_null(logits);
    assert_non_null(ls);
    random_logits(logits, V, 4.0f, 11);
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(V, &s), FR_OK);
    static const float temps[] = { 0.25f, 0.7f, 1.0f, 1.6f };
    for (size_t ti = 0; ti < sizeof temps / sizeof temps[0]; ti++) {
        double t = temps[ti];
        /* Truncation must not change the reported logprob. */
        fr_sampling_params cfg[3] = { params(temps[ti], 0, 1.0f, 3),
                                      params(temps[ti], 1, 1.0f, 3),
                                      params(temps[ti], 20, 0.3f, 3) };
        for (int c = 0; c < 3; c++)
            for (uint64_t step = 0; step < 20; step++) {
                int tok;
                float lp;
                assert_int_equal(fr_sample(s, logits, &cfg[c], 5, step, &tok, &lp), FR_OK);
                double ref = naive_logprob(logits, V, t, tok);
                assert_float_equal(lp, ref, 1e-5 * fmax(1.0, fabs(ref)));
            }
        assert_int_equal(fr_log_softmax(logits, V, temps[ti], ls), FR_OK);
        for (int i = 0; i < V; i++) {
            double ref = naive_logprob(logits, V, t, i);
            assert_float_equal(ls[i], ref, 1e-5 * fmax(1.0, fabs(ref)));
        }
    }
    /* Temperature 0 means 1 for fr_log_softmax, matching greedy logprobs. */
    assert_int_equal(fr_log_softmax(logits, V, 0.0f, ls), FR_OK);
    assert_float_equal(ls[17], naive_logprob(logits, V, 1.0, 17), 1e-5);
    fr_sampler_destroy(&s);
    free(logits);
    free(ls);
}

/* ---- extras: barred tokens and top log-probs --------------------------- */

/* Barred tokens are never drawn, the other draws equal fr_sample's on logits
 * with the barred ones at -inf, and the log-prob stays the full
 * distribution's; the top-n are the n largest logits (ties to the lower id),
 * best first, with fr_log_softmax's values bit for bit; barring everything
 * and more than 20 top log-probs are refused. */
static void test_extras(void **state)
{
    (void)state;
    enum { V = 300 };
    float logits[V], masked[V], ls[V];
    random_logits(logits, V, 3.0f, 23);
    logits[40] = logits[41];   /* a tie inside the top 20 */
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(V, &s), FR_OK);
    int argmax = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[argmax]) argmax = i;
    int banned[] = {argmax, 7, 41};
    memcpy(masked, logits, sizeof masked);
    for (int b = 0; b < 3; b++) masked[banned[b]] = -INFINITY;
    static const float temps[] = {0.0f, 0.6f, 1.0f};
    for (size_t ti = 0; ti < 3; ti++) {
        fr_sampling_params p = params(temps[ti], ti == 2 ? 40 : 0, ti == 1 ? 0.9f : 1.0f, 99);
        assert_int_equal(fr_log_softmax(logits, V, temps[ti], ls), FR_OK);
        for (uint64_t step = 0; step < 200; step++) {
            int ids[20], tok, want;
            float lps[20], lp;
            fr_sample_extras x = {.banned = banned, .n_banned = 3, .top_n = 20, .top_ids = ids, .top_logprobs = lps};
            assert_int_equal(fr_sample_ex(s, logits, &p, 4, step, &x, &tok, &lp), FR_OK);
            assert_int_equal(fr_sample(s, masked, &p, 4, step, &want, NULL), FR_OK);
            assert_int_equal(tok, want);
            assert_true(tok != argmax && tok != 7 && tok != 41);
            assert_memory_equal(&lp, &ls[tok], sizeof lp);
            for (int k = 0; k < 20; k++) {
                assert_memory_equal(&lps[k], &ls[ids[k]], sizeof(float));
                if (k) assert_true(logits[ids[k]] < logits[ids[k - 1]] ||
                                   (logits[ids[k]] == logits[ids[k - 1]] && ids[k] > ids[k - 1]));
                int better = 0;   /* exactly k tokens come before ids[k] */
                for (int i = 0; i < V; i++)
                    better += logits[i] > logits[ids[k]] || (logits[i] == logits[ids[k]] && i < ids[k]);
                assert_int_equal(better, k);
            }
            assert_int_equal(ids[0], argmax);   /* the top list is the unbarred distribution's */
            /* Without extras, the same draw as fr_sample. */
            fr_sample_extras none = {0};
            assert_int_equal(fr_sample_ex(s, logits, &p, 4, step, &none, &tok, &lp), FR_OK);
            assert_int_equal(fr_sample(s, logits, &p, 4, step, &want, NULL), FR_OK);
            assert_int_equal(tok, want);
        }
        int ids[5];
        float lps[5];
        assert_int_equal(fr_top_logprobs(s, logits, temps[ti], 5, ids, lps), FR_OK);
        assert_int_equal(ids[0], argmax);
        assert_memory_equal(&lps[0], &ls[argmax], sizeof(float));
    }
    int all[V];
    for (int i = 0; i < V; i++) all[i] = i;
    fr_sampling_params p = params(1.0f, 0, 1.0f, 1);
    int tok = -5, ids[21];
    float lps[21];
    fr_sample_extras x = {.banned = all, .n_banned = V};
    assert_int_equal(fr_sample_ex(s, logits, &p, 0, 0, &x, &tok, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "every token is barred"));
    assert_int_equal(tok, -5);
    x = (fr_sample_extras){.top_n = 21, .top_ids = ids, .top_logprobs = lps};
    assert_int_equal(fr_sample_ex(s, logits, &p, 0, 0, &x, &tok, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "must be in [0, 20]"));
    assert_int_equal(fr_top_logprobs(s, logits, 1.0f, 0, ids, lps), FR_EINVAL);
    fr_sampler_destroy(&s);
}

/* ---- reproducibility -------------------------------------------------- */

static void test_reproducible_and_streams_differ(void **state)
{
    (void)state;
    enum { V = 1000, N = 1000 };
    float *logits = malloc(V * sizeof *logits);
    assert_non_null(logits);
    random_logits(logits, V, 0.5f, 5);   /* nearly flat: collisions are rare */
    fr_sampler *s1 = NULL, *s2 = NULL;
    assert_int_equal(fr_sampler_new(V, &s1), FR_OK);
    assert_int_equal(fr_sampler_new(V, &s2), FR_OK);
    fr_sampling_params p = params(1.0f, 0, 1.0f, 1234), q = params(1.0f, 0, 1.0f, 1235);
    int same_seq = 0, same_step = 0, same_seed = 0;
    for (uint64_t i = 0; i < N; i++) {
        int a, b, c, d, e;
        assert_int_equal(fr_sample(s1, logits, &p, 9, i, &a, NULL), FR_OK);
        assert_int_equal(fr_sample(s2, logits, &p, 9, i, &b, NULL), FR_OK);
        assert_int_equal(a, b);   /* same triple, fresh scratch: same token */
        assert_int_equal(fr_sample(s1, logits, &p, 10, i, &c, NULL), FR_OK);
        assert_int_equal(fr_sample(s1, logits, &p, 9, i + N, &d, NULL), FR_OK);
        assert_int_equal(fr_sample(s1, logits, &q, 9, i, &e, NULL), FR_OK);
        same_seq += a == c;
        same_step += a == d;
        same_seed += a == e;
    }
    /* Independent streams agree about N * sum p^2 ~ 1.3 times; 20 would mean
     * the stream ignores that input. */
    assert_true(same_seq < 20);
    assert_true(same_step < 20);
    assert_true(same_seed < 20);
    fr_sampler_destroy(&s1);
    fr_sampler_destroy(&s2);
    free(logits);
}

/* ---- statistics ------------------------------------------------------- */

/* Ten tokens with known probabilities, placed out of id order so the sort is
 * exercised. Descending: id1 .25, id5 .20, id7 .15, id3 .12, id9 .09, id0 .07,
 * id6 .05, id8 .04, id2 .02, id4 .01. */
static const double base_p[10] = { 0.07, 0.25, 0.02, 0.12, 0.01,
                                   0.20, 0.05, 0.15, 0.04, 0.09 };
enum { NSAMPLES = 200000 };

/* Draws NSAMPLES tokens (varying step, or sequence when by_sequence) and
 * checks them against base_p^(1/T) renormalized over `kept`: tokens outside it
 * must never appear, and the chi-square statistic must stay under crit, the
 * p = 0.001 critical value for (kept count - 1) degrees of freedom. */
static void check_frequencies(const fr_sampling_params *p, const int *kept, int nkept,
                              double crit, int by_sequence)
{
    float logits[10];
    for (int i = 0; i < 10; i++)
        logits[i] = (float)log(base_p[i]);
    double expect[10] = { 0 }, total = 0.0;
    for (int j = 0; j < nkept; j++)
        total += expect[kept[j]] = pow(base_p[kept[j]], 1.0 / p->temperature);
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(10, &s), FR_OK);
    long count[10] = { 0 };
    for (uint64_t i = 0; i < NSAMPLES; i++) {
        int tok = -1;
        assert_int_equal(fr_sample(s, logits, p, by_sequence ? i : 42, by_sequence ? 3 : i,
                                   &tok, NULL), FR_OK);
        assert_true(tok >= 0 && tok < 10);
        count[tok]++;
    }
    double chi2 = 0.0;
    for (int i = 0; i < 10; i++) {
        if (expect[i] == 0.0) {
            assert_int_equal(count[i], 0);
            continue;
        }
        double e = NSAMPLES * expect[i] / total;
        chi2 += (count[i] - e) * (count[i] - e) / e;
    }
    if (chi2 >= crit)
        fail_msg("chi-square %.2f >= %.3f for %d kept tokens", chi2, crit, nkept);
    fr_sampler_destroy(&s);
}

static void test_stats_top_p(void **state)
{
    (void)state;
    /* Cumulative .25 .45 .60 .72 .81: the fifth token reaches 0.8. */
    const int kept[] = { 1, 5, 7, 3, 9 };
    fr_sampling_params p = params(1.0f, 0, 0.8f, 99);
    check_frequencies(&p, kept, 5, 18.467, 0);
}

static void test_stats_top_p_over_sequences(void **state)
{
    (void)state;
    /* Same distribution drawn across sequences at one step: each sequence is
     * its own stream, and the streams together are as random as one stream. */
    const int kept[] = { 1, 5, 7, 3, 9 };
    fr_sampling_params p = params(1.0f, 0, 0.8f, 99);
    check_frequencies(&p, kept, 5, 18.467, 1);
}

static void test_stats_top_k(void **state)
{
    (void)state;
    const int kept[] = { 1, 5, 7 };
    fr_sampling_params p = params(1.0f, 3, 1.0f, 100);
    check_frequencies(&p, kept, 3, 13.816, 0);
}

static void test_stats_top_k_then_top_p(void **state)
{
    (void)state;
    /* top_p applies after renormalizing over the top 5 (mass .81): cumulative
     * .309 .556 .741 .889, so 4 tokens, where top_p alone keeps 5. */
    const int kept[] = { 1, 5, 7, 3 };
    fr_sampling_params p = params(1.0f, 5, 0.8f, 101);
    check_frequencies(&p, kept, 4, 16.266, 0);
}

static void test_stats_temperature(void **state)
{
    (void)state;
    const int kept[] = { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 };
    fr_sampling_params p = params(0.7f, 0, 1.0f, 102);
    check_frequencies(&p, kept, 10, 27.877, 0);
}

/* ---- ties and boundaries ---------------------------------------------- */

static void test_ties_break_to_lower_ids(void **state)
{
    (void)state;
    const float flat[8] = { 0 };
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(8, &s), FR_OK);
    /* top_k cuts through a tie: the lowest ids stay. */
    fr_sampling_params k3 = params(1.0f, 3, 1.0f, 1);
    /* Equal weights, top_p 0.5: 2 of 8 tokens would be 0.25, 4 of 8 reach
     * 0.5 exactly, and "reaches" means >=, so tokens 0..3 and nothing more. */
    fr_sampling_params p50 = params(1.0f, 0, 0.5f, 1);
    fr_sampling_params p50up = params(1.0f, 0, 0.5001f, 1);
    int seen_k3[8] = { 0 }, seen_p50[8] = { 0 }, seen_p50up[8] = { 0 };
    for (uint64_t step = 0; step < 2000; step++) {
        int tok;
        float lp;
        assert_int_equal(fr_sample(s, flat, &k3, 0, step, &tok, &lp), FR_OK);
        seen_k3[tok] = 1;
        assert_float_equal(lp, -log(8.0), 1e-6);   /* full vocabulary */
        assert_int_equal(fr_sample(s, flat, &p50, 0, step, &tok, NULL), FR_OK);
        seen_p50[tok] = 1;
        assert_int_equal(fr_sample(s, flat, &p50up, 0, step, &tok, NULL), FR_OK);
        seen_p50up[tok] = 1;
    }
    for (int i = 0; i < 8; i++) {
        assert_int_equal(seen_k3[i], i < 3);
        assert_int_equal(seen_p50[i], i < 4);
        assert_int_equal(seen_p50up[i], i < 5);
    }
    /* The walk stops where the cumulative probability strictly exceeds u.
     * At this step u is exactly 0.5 (found by search), so with two equal
     * tokens the cumulative 0.5 after token 0 does not exceed it: token 1. */
    assert_true(fr_philox_uniform(0, 0, 9297664) == 0.5f);
    fr_sampling_params k2 = params(1.0f, 2, 1.0f, 0);
    int tok = -1;
    assert_int_equal(fr_sample(s, flat, &k2, 0, 9297664, &tok, NULL), FR_OK);
    assert_int_equal(tok, 1);
    fr_sampler_destroy(&s);
}

static void test_infinities(void **state)
{
    (void)state;
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(6, &s), FR_OK);
    fr_sampling_params p = params(1.0f, 0, 1.0f, 8), g = params(0.0f, 0, 1.0f, 8);
    int tok;
    float lp, out[6];

    /* -inf tokens are never chosen, even when they hold low ids. */
    const float neg[6] = { -INFINITY, 0.0f, -INFINITY, 0.0f, -INFINITY, -INFINITY };
    for (uint64_t step = 0; step < 500; step++) {
        assert_int_equal(fr_sample(s, neg, &p, 0, step, &tok, &lp), FR_OK);
        assert_true(tok == 1 || tok == 3);
        assert_float_equal(lp, -log(2.0), 1e-6);
    }

    /* +inf tokens share all the probability. */
    const float pos[6] = { 5.0f, INFINITY, 1e30f, INFINITY, -INFINITY, INFINITY };
    int seen[6] = { 0 };
    for (uint64_t step = 0; step < 500; step++) {
        assert_int_equal(fr_sample(s, pos, &p, 0, step, &tok, &lp), FR_OK);
        seen[tok] = 1;
        assert_float_equal(lp, -log(3.0), 1e-6);
    }
    assert_true(seen[1] && seen[3] && seen[5] && !seen[0] && !seen[2] && !seen[4]);
    assert_int_equal(fr_sample(s, pos, &g, 0, 0, &tok, &lp), FR_OK);
    assert_int_equal(tok, 1);
    assert_int_equal(fr_log_softmax(pos, 6, 1.0f, out), FR_OK);
    assert_float_equal(out[3], -log(3.0), 1e-6);
    assert_true(isinf(out[0]) && out[0] < 0 && isinf(out[4]) && out[4] < 0);

    /* A tiny temperature must not overflow logits/temperature. */
    const float big[6] = { 3e38f, -3e38f, 2.9e38f, 0.0f, 1.0f, 2.0f };
    fr_sampling_params cold = params(1e-30f, 0, 1.0f, 8);
    assert_int_equal(fr_sample(s, big, &cold, 0, 0, &tok, &lp), FR_OK);
    assert_int_equal(tok, 0);
    assert_float_equal(lp, 0.0f, 1e-6);

    /* Nothing left to choose. */
    const float none[6] = { -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY };
    tok = 77;
    assert_int_equal(fr_sample(s, none, &p, 0, 0, &tok, &lp), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "-inf"));
    assert_int_equal(tok, 77);
    assert_int_equal(fr_sample(s, none, &g, 0, 0, &tok, &lp), FR_EINVAL);
    assert_int_equal(fr_log_softmax(none, 6, 1.0f, out), FR_EINVAL);
    fr_sampler_destroy(&s);
}

/* ---- large vocabulary against a plain full-sort reference -------------- */

static const float *ref_logits;

static int ref_cmp(const void *a, const void *b)
{
    int i = *(const int *)a, j = *(const int *)b;
    if (ref_logits[i] != ref_logits[j])
        return ref_logits[i] > ref_logits[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* The documented rule written the obvious way: qsort everything. */
static int reference_sample(const float *logits, int n, const fr_sampling_params *p,
                            uint64_t seq, uint64_t step, int *ids)
{
    for (int i = 0; i < n; i++)
        ids[i] = i;
    ref_logits = logits;
    qsort(ids, (size_t)n, sizeof *ids, ref_cmp);
    int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    double t = p->temperature, zmax = logits[ids[0]] / t, mass = 0.0;
    for (int i = 0; i < k; i++)
        mass += exp(logits[ids[i]] / t - zmax);
    double cum = 0.0;
    int kept = 0;
    while (kept < k) {
        cum += exp(logits[ids[kept++]] / t - zmax);
        if (cum >= (double)p->top_p * mass)
            break;
    }
    double target = fr_philox_uniform(p->seed, seq, step) * cum, c = 0.0;
    for (int i = 0; i < kept; i++) {
        c += exp(logits[ids[i]] / t - zmax);
        if (c > target)
            return ids[i];
    }
    return ids[kept - 1];
}

static void test_large_vocab_matches_reference(void **state)
{
    (void)state;
    enum { V = 151936 };
    float *logits = malloc(V * sizeof *logits);
    int *ids = malloc(V * sizeof *ids);
    assert_non_null(logits);
    assert_non_null(ids);
    random_logits(logits, V, 3.0f, 77);
    for (int i = 0; i < V; i += 97)   /* plant ties across the whole range */
        logits[i] = logits[i / 2];
    fr_sampler *s = NULL;
    assert_int_equal(fr_sampler_new(V, &s), FR_OK);
    const fr_sampling_params cfg[] = { params(0.8f, 50, 0.9f, 5), params(1.0f, 1, 1.0f, 5),
                                       params(1.2f, 0, 0.95f, 5), params(1.0f, 0, 1.0f, 5) };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
        for (uint64_t step = 0; step < 4; step++) {
            int tok;
            assert_int_equal(fr_sample(s, logits, &cfg[c], 3, step, &tok, NULL), FR_OK);
            assert_int_equal(tok, reference_sample(logits, V, &cfg[c], 3, step, ids));
        }
    fr_sampler_destroy(&s);
    free(logits);
    free(ids);
}

/* ---- bad input -------------------------------------------------------- */

static void expect_einval(fr_status st, const char *needle)
{
    assert_int_equal(st, FR_EINVAL);
    if (!strstr(fr_last_error(), needle))
        fail_msg("message \"%s\" does not mention \"%s\"", fr_last_error(), needle);
}

static void test_bad_params_rejected(void **state)
{
    (void)state;
    fr_sampling_params p;
    p = params(-0.5f, 0, 1.0f, 0); expect_einval(fr_sampling_params_check(&p, 10), "temperature");
    p = params(NAN, 0, 1.0f, 0);   expect_einval(fr_sampling_params_check(&p, 10), "temperature");
    p = params(INFINITY, 0, 1.0f, 0); expect_einval(fr_sampling_params_check(&p, 10), "temperature");
    p = params(1.0f, -1, 1.0f, 0); expect_einval(fr_sampling_params_check(&p, 10), "top_k");
    p = params(1.0f, 0, 0.0f, 0);  expect_einval(fr_sampling_params_check(&p, 10), "top_p");
    p = params(1.0f, 0, 1.01f, 0); expect_einval(fr_sampling_params_check(&p, 10), "top_p");
    p = params(1.0f, 0, -0.5f, 0); expect_einval(fr_sampling_params_check(&p, 10), "top_p");
    p = params(1.0f, 0, NAN, 0);   expect_einval(fr_sampling_params_check(&p, 10), "top_p");
    p = params(1.0f, 0, 1.0f, 0);
    expect_einval(fr_sampling_params_check(&p, 0), "vocab");
    expect_einval(fr_sampling_params_check(NULL, 10), "NULL");
    p = params(1.0f, 50, 1.0f, 0);   /* top_k above vocab just means off */
    assert_int_equal(fr_sampling_params_check(&p, 10), FR_OK);

    fr_sampler *s = NULL;
    expect_einval(fr_sampler_new(0, &s), "vocab");
    expect_einval(fr_sampler_new(-3, &s), "vocab");
    expect_einval(fr_sampler_new(10, NULL), "NULL");
    assert_null(s);
    assert_int_equal(fr_sampler_new(4, &s), FR_OK);

    float logits[4] = { 0.0f, 1.0f, NAN, 2.0f }, out[4];
    int tok = 55;
    float lp = 5.0f;
    p = params(1.0f, 0, 1.0f, 0);
    expect_einval(fr_sample(s, logits, &p, 0, 0, &tok, &lp), "logit 2 of 4 is NaN");
    expect_einval(fr_log_softmax(logits, 4, 1.0f, out), "NaN");
    logits[2] = 0.5f;
    p = params(1.0f, 0, 2.0f, 0);
    expect_einval(fr_sample(s, logits, &p, 0, 0, &tok, &lp), "top_p");
    assert_int_equal(tok, 55);   /* outputs untouched on failure */
    assert_true(lp == 5.0f);
    p = params(1.0f, 0, 1.0f, 0);
    expect_einval(fr_sample(NULL, logits, &p, 0, 0, &tok, &lp), "NULL");
    expect_einval(fr_sample(s, NULL, &p, 0, 0, &tok, &lp), "NULL");
    expect_einval(fr_sample(s, logits, &p, 0, 0, NULL, &lp), "NULL");
    expect_einval(fr_sample(s, logits, NULL, 0, 0, &tok, &lp), "NULL");
    expect_einval(fr_log_softmax(logits, 0, 1.0f, out), "vocab");
    expect_einval(fr_log_softmax(logits, 4, -1.0f, out), "temperature");
    expect_einval(fr_log_softmax(NULL, 4, 1.0f, out), "NULL");
    expect_einval(fr_log_softmax(logits, 4, 1.0f, NULL), "NULL");
    assert_int_equal(fr_sample(s, logits, &p, 0, 0, &tok, NULL), FR_OK);   /* logprob optional */

    fr_sampler_destroy(&s);
    fr_sampler_destroy(&s);      /* already NULL: no-op */
    fr_sampler_destroy(NULL);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_philox_known_answers),
             cmocka_unit_test(test_philox_uniform_rule),
             cmocka_unit_test(test_greedy_argmax_ties_to_lowest),
             cmocka_unit_test(test_logprob_matches_naive),
             cmocka_unit_test(test_extras),
             cmocka_unit_test(test_reproducible_and_streams_differ),
             cmocka_unit_test(test_stats_top_p),
             cmocka_unit_test(test_stats_top_p_over_sequences),
             cmocka_unit_test(test_stats_top_k),
             cmocka_unit_test(test_stats_top_k_then_top_p),
             cmocka_unit_test(test_stats_temperature),
             cmocka_unit_test(test_ties_break_to_lower_ids),
             cmocka_unit_test(test_infinities),
             cmocka_unit_test(test_large_vocab_matches_reference),
             cmocka_unit_test(test_bad_params_rejected))
