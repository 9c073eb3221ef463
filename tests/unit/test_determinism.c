/* Deterministic mode (docs/determinism.md):
 *  - fr_matmul_fixed: a row's outputs are bitwise the same computed alone or
 *    inside a batch of any size, equal fr_dot_fixed and the documented
 *    summation order written out in scalar code, and do not move with the
 *    BLAS thread count; fr_dot_fixed_rows and fr_axpy, attention's forms,
 *    agree with them;
 *  - the base/fixed_math functions stay within a few ulps of the C library;
 *  - an engine (tq6 when present, else synthetic:tiny; BF16 and f32 KV): a
 *    sample run alone, inside a batch of other requests, with another prefill
 *    chunk, and with 1 or 4 BLAS threads gives bitwise the same tokens and
 *    log-probs; in a cache so small that samples are preempted and
 *    recomputed, every sample equals the run with room for all. With NVFP4
 *    KV the same in a batch and after preemption, the chunk size kept;
 *  - sample k of a request of n samples replays alone, bitwise, as a request
 *    with the same seed, first_sample k and n 1 (docs/sampling.md, "Seeds"),
 *    and reports index k; a first_sample without room for n is refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/engine/scheduler.h"
#include "rollout/model/ops_cpu.h"
#include "tests/unit/test_util.h"

/* The order fr_dot_fixed documents, one scalar at a time. */
static float dot_documented(const float *x, const float *w, int K)
{
    float l[8] = {0};
    int k8 = K / 8 * 8;
    for (int k = 0; k < k8; k++) l[k % 8] += x[k] * w[k];
    for (int k = k8; k < K; k++) l[k - k8] += x[k] * w[k];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static float *random_floats(fr_test_rng *rng, size_t n)
{
    float *a = malloc(sizeof(float) * n);
    assert_non_null(a);
    for (size_t i = 0; i < n; i++) a[i] = fr_test_normal(rng);
    return a;
}

static void test_matmul_rows_invariant(void **state)
{
    (void)state;
    static const int Ks[] = {1, 7, 8, 9, 64, 100, 515};
    enum { M = 70, N = 13 };
    fr_test_rng rng = {.s = 3};
    for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
        const int K = Ks[ki];
        float *x = random_floats(&rng, (size_t)M * K), *w = random_floats(&rng, (size_t)N * K);
        float *all = malloc(sizeof(float) * M * N), *part = malloc(sizeof(float) * M * N), one[N];
        assert_non_null(all);
        assert_non_null(part);
        openblas_set_num_threads(4);
        fr_matmul_fixed(all, x, w, M, N, K);
        openblas_set_num_threads(1);
        for (int m = 0; m < M; m++) {
            fr_matmul_fixed(one, x + (size_t)m * K, w, 1, N, K);   /* the row alone */
            assert_memory_equal(one, all + (size_t)m * N, sizeof one);
            for (int n = 0; n < N; n++) {
                float want = dot_documented(x + (size_t)m * K, w + (size_t)n * K, K);
                assert_memory_equal(&want, &all[(size_t)m * N + n], sizeof want);
                float d = fr_dot_fixed(x + (size_t)m * K, w + (size_t)n * K, K);
                assert_memory_equal(&d, &want, sizeof d);
                double exact = 0.0, mag = 0.0;
                for (int k = 0; k < K; k++) {
                    exact += (double)x[(size_t)m * K + k] * w[(size_t)n * K + k];
                    mag += fabs((double)x[(size_t)m * K + k] * w[(size_t)n * K + k]);
                }
                assert_true(fabs(want - exact) <= 1e-6 * mag + 1e-30);
            }
        }
        /* Attention's form: one vector against runs of rows, and y += a x. */
        float *sc = malloc(sizeof(float) * M);
        assert_non_null(sc);
        for (int n = 1; n <= M; n += 11) {
            fr_dot_fixed_rows(sc, x, (size_t)K, n, w, K);
            for (int m = 0; m < n; m++) assert_memory_equal(&sc[m], &all[(size_t)m * N], sizeof(float));
        }
        free(sc);
        float acc[515], want[515];
        for (int j = 0; j < K; j++) acc[j] = want[j] = x[j];
        fr_axpy(acc, 0.37f, w, K);
        for (int j = 0; j < K; j++) want[j] += 0.37f * w[j];
        assert_memory_equal(acc, want, sizeof(float) * (size_t)K);
        /* Batches of every size from 1 to 9 starting at every row: the same rows. */
        for (int b = 1; b <= 9; b++)
            for (int m0 = 0; m0 + b <= M; m0 += 5) {
                fr_matmul_fixed(part, x + (size_t)m0 * K, w, b, N, K);
                assert_memory_equal(part, all + (size_t)m0 * N, sizeof(float) * b * N);
            }
        free(x); free(w); free(all); free(part);
    }
}

static void test_fixed_math(void **state)
{
    (void)state;
    double worst = 0.0;
    for (int i = 0; i <= 20000; i++) {
        double x = -80.0 + 160.0 * i / 20000.0;
        worst = fmax(worst, fabs(fr_exp(x) - exp(x)) / exp(x));
        worst = fmax(worst, fabs(fr_exp2(x) - exp2(x)) / exp2(x));
        double y = ldexp(1.0 + i / 20000.0, i % 120 - 60);
        worst = fmax(worst, fabs(fr_log(y) - log(y)) / fmax(fabs(log(y)), 1.0));
        worst = fmax(worst, fabs(fr_log2(y) - log2(y)) / fmax(fabs(log2(y)), 1.0));
        double a = -40000.0 + 80000.0 * i / 20000.0 + 0.1234, s, c;
        fr_sincos(a, &s, &c);
        worst = fmax(worst, fmax(fabs(s - sin(a)), fabs(c - cos(a))));
        float e = (float)(i % 64) / 64.0f;
        worst = fmax(worst, fabs(fr_powf(1e6f, e) - pow(1e6, e)) / pow(1e6, e) - 6e-8);
    }
    printf("  worst relative error against the C library: %.3g\n", worst);
    assert_true(worst < 1e-13);
    assert_true(fr_exp(-800.0) == 0.0 && isinf(fr_exp(800.0)) && isnan(fr_exp(NAN)));
    assert_true(fr_log(0.0) == -INFINITY && isnan(fr_log(-1.0)) && fr_log(1.0) == 0.0 && fr_log2(8.0) == 3.0);
}

/* ---- the engine ---- */

enum { MAX_REQ = 8, MAX_NEW = 24 };
enum { PROMPT_MAX = 250 };

typedef struct {
    int n[MAX_REQ];
    int tokens[MAX_REQ][MAX_NEW];
    float logprobs[MAX_REQ][MAX_NEW];
} outcome;

static void on_done(void *user, const fr_sample_result *r)
{
    outcome *o = user;
    assert_true(r->request_id < MAX_REQ && r->sample == 0 && r->n_tokens <= MAX_NEW);
    o->n[r->request_id] = r->n_tokens;
    memcpy(o->tokens[r->request_id], r->tokens, sizeof(int) * (size_t)r->n_tokens);
    memcpy(o->logprobs[r->request_id], r->logprobs, sizeof(float) * (size_t)r->n_tokens);
}

typedef struct {
    int others;     /* requests 1..others run beside request 0 */
    int chunk;
    int n_blocks;
    int threads;
} scenario;

/* The engine model, loaded once (main): every run borrows it, and loading
 * converts every weight. */
static fr_model *engine_model;

/* Request 0: a PROMPT_MAX-token prompt (past one page end, and the next one crossed
 * while decoding), 24 tokens drawn at temperature 1; the others: prompts of
 * 108..126 tokens, which cross a page end while decoding too, so a small
 * cache runs out of blocks and preempts. */
static long long run(fr_kv_dtype kv, const scenario *sc, outcome *out)
{
    openblas_set_num_threads(sc->threads);
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, NULL, kv);
    o.deterministic = 1;
    fr_session s;
    if (fr_session_open_model(&o, engine_model, sc->n_blocks, 8, &s)) fail_msg("%s", fr_last_error());
    fr_scheduler_config c = {.chunk = sc->chunk, .reserve_blocks = -1, .on_done = on_done, .user = out};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    int prompt[PROMPT_MAX];
    for (int i = 0; i <= sc->others; i++) {
        fr_test_rng rng = {.s = 17 + (uint64_t)i};
        const int n = i == 0 ? PROMPT_MAX : 105 + 3 * i;
        prompt[0] = 256;
        for (int k = 1; k < n; k++) prompt[k] = (int)(fr_test_u64(&rng) % 256);
        fr_request_spec q = {.id = (uint64_t)i, .prompt = prompt, .n_prompt = n, .n = 1, .max_tokens = MAX_NEW,
                             .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 9 + (uint64_t)i}};
        assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    }
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    fr_scheduler_destroy(&sch);
    s.model = NULL;   /* engine_model's: not the session's to free */
    fr_session_close(&s);
    openblas_set_num_threads(1);
    return st.preemptions;
}

static void test_engine_batch_invariant(void **state)
{
    (void)state;
    static const scenario alone = {.others = 0, .chunk = 512, .n_blocks = 64, .threads = 1};
    static const scenario cases[] = {
        {.others = 7, .chunk = 512, .n_blocks = 64, .threads = 1},   /* in a batch */
        {.others = 0, .chunk = 48, .n_blocks = 64, .threads = 1},    /* other prefill chunks */
        {.others = 0, .chunk = 512, .n_blocks = 64, .threads = 4},   /* more BLAS threads */
        {.others = 7, .chunk = 64, .n_blocks = 10, .threads = 2},    /* preempted: few KV blocks */
    };
    static const char *const what[] = {"in a batch of 8", "chunk 48", "4 BLAS threads", "preempted"};
    static const fr_kv_dtype kvs[] = {FR_KV_BF16, FR_KV_F32, FR_KV_NVFP4};
    printf("  model %s\n", engine_model->name);
    for (int d = 0; d < 3; d++) {
        /* An FP4 prefill's numbers depend on its chunks by the recipe
         * (docs/determinism.md): with FP4 the chunk size stays, and the
         * scheduler cuts prompts at its multiples whatever the load. */
        const int fp4 = kvs[d] == FR_KV_NVFP4;
        static outcome ref, batch, got;
        memset(&ref, 0, sizeof ref);
        run(kvs[d], &alone, &ref);
        assert_int_equal(ref.n[0], MAX_NEW);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            if (fp4 && (i == 1 || i == 2)) continue;   /* another chunk; threads: the BF16 runs show them */
            scenario sc = cases[i];
            if (fp4) sc.chunk = alone.chunk;
            memset(&got, 0, sizeof got);
            long long pre = run(kvs[d], &sc, &got);
            printf("  %s KV, %s: %d tokens, %lld preemptions\n", fr_kv_dtype_name(kvs[d]), what[i], got.n[0], pre);
            assert_int_equal(got.n[0], ref.n[0]);
            assert_memory_equal(got.tokens[0], ref.tokens[0], sizeof(int) * (size_t)ref.n[0]);
            assert_memory_equal(got.logprobs[0], ref.logprobs[0], sizeof(float) * (size_t)ref.n[0]);
            if (i == 0) batch = got;
            if (i != 3) continue;
            /* Preempted and recomputed samples (whichever they were) equal the
             * same batch run with room for all. */
            assert_true(pre > 0);
            for (int k = 0; k < MAX_REQ; k++) {
                assert_int_equal(got.n[k], batch.n[k]);
                assert_memory_equal(got.tokens[k], batch.tokens[k], sizeof(int) * (size_t)batch.n[k]);
                assert_memory_equal(got.logprobs[k], batch.logprobs[k], sizeof(float) * (size_t)batch.n[k]);
            }
        }
    }
}

/* The samples of one request, by reported index. */
typedef struct {
    int got[8], n[8];
    int tokens[8][MAX_NEW];
    float logprobs[8][MAX_NEW];
} by_index;

static void on_sample(void *user, const fr_sample_result *r)
{
    by_index *o = user;
    assert_true(r->sample >= 0 && r->sample < 8 && r->n_tokens <= MAX_NEW && !o->got[r->sample]);
    o->got[r->sample] = 1;
    o->n[r->sample] = r->n_tokens;
    memcpy(o->tokens[r->sample], r->tokens, sizeof(int) * (size_t)r->n_tokens);
    memcpy(o->logprobs[r->sample], r->logprobs, sizeof(float) * (size_t)r->n_tokens);
}

/* One request of n samples numbered from first, run to its end. */
static void run_samples(fr_session *s, int n, int first, by_index *out)
{
    fr_scheduler_config c = {.chunk = 512, .reserve_blocks = -1, .on_done = on_sample, .user = out};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(s, &c, &sch), FR_OK);
    static const int prompt[] = {256, 100, 101, 102, 32, 40, 115, 101, 108, 102};
    fr_request_spec q = {.id = 1, .prompt = prompt, .n_prompt = 10, .n = n, .first_sample = first,
                         .max_tokens = MAX_NEW, .stop_ids = NULL, .n_stop = 0,
                         .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 0x123456789abcdefull}};
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_scheduler_destroy(&sch);
}

static void test_sample_replays_alone(void **state)
{
    (void)state;
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.backend = FR_BACKEND_CPU;
    o.deterministic = 1;
    fr_session s;
    if (fr_session_open_model(&o, engine_model, 32, 8, &s)) fail_msg("%s", fr_last_error());
    static by_index group, one;
    memset(&group, 0, sizeof group);
    run_samples(&s, 4, 0, &group);
    int differ = 0;
    for (int k = 0; k < 4; k++) {
        assert_true(group.got[k]);
        differ |= k > 0 && memcmp(group.tokens[k], group.tokens[0], sizeof(int) * MAX_NEW) != 0;
        memset(&one, 0, sizeof one);
        run_samples(&s, 1, k, &one);
        for (int j = 0; j < 8; j++) assert_int_equal(one.got[j], j == k);   /* reported as sample k */
        assert_int_equal(one.n[k], group.n[k]);
        assert_memory_equal(one.tokens[k], group.tokens[k], sizeof(int) * (size_t)group.n[k]);
        assert_memory_equal(one.logprobs[k], group.logprobs[k], sizeof(float) * (size_t)group.n[k]);
    }
    assert_true(differ);   /* the streams of one seed are different samples */
    /* Two samples numbered from 2 are the group's samples 2 and 3. */
    memset(&one, 0, sizeof one);
    run_samples(&s, 2, 2, &one);
    for (int k = 2; k < 4; k++) assert_memory_equal(one.tokens[k], group.tokens[k], sizeof(int) * (size_t)group.n[k]);
    /* No room for n samples above first_sample, or a negative one: refused. */
    fr_scheduler_config c = {.chunk = 512, .reserve_blocks = -1};
    fr_scheduler *sch;
    assert_int_equal(fr_scheduler_new(&s, &c, &sch), FR_OK);
    static const int prompt[] = {256, 100};
    fr_request_spec q = {.id = 2, .prompt = prompt, .n_prompt = 2, .n = 2, .first_sample = INT_MAX - 1,
                         .max_tokens = 4, .params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f}};
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "first_sample"));
    q.first_sample = -1;
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_EINVAL);
    q.first_sample = INT_MAX - 2;
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
    fr_scheduler_destroy(&sch);
    s.model = NULL;
    fr_session_close(&s);
}

int main(void)
{
    const char *model = fr_test_tq6_dir() ? fr_test_tq6_dir() : "synthetic:tiny";
    if (fr_model_load(model, &engine_model)) {
        fprintf(stderr, "test_determinism: %s\n", fr_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_rows_invariant),
        cmocka_unit_test(test_fixed_math),
        cmocka_unit_test(test_engine_batch_invariant),
        cmocka_unit_test(test_sample_replays_alone),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    fr_model_destroy(&engine_model);
    return failed;
}
