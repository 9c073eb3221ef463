/* Calibration (paper Appendices B and C): the key mean against keys read
 * back from the runner's cache, the calibration file's round trip and its
 * rejection of bad files, and the tau choice against a brute-force search. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "attention/fp_formats.h"
#include "attention/prob_quant.h"
#include "rollout/monitor/calibrate.h"
#include "rollout/engine/session.h"
#include "test_util.h"

static int *random_text(fr_test_rng *rng, int n)
{
    int *t = malloc(sizeof(int) * (size_t)n);
    t[0] = 256;
    for (int i = 1; i < n; i++) t[i] = 'a' + (int)(fr_test_u64(rng) % 26);
    return t;
}

/* The key mean and FP8 scales equal those computed from the keys and values
 * the runner stores for the same sequence: an f32 cache keeps them raw, and
 * one prefill chunk of the whole sequence computes them as calibrate's
 * prefill and decode steps do (to float32 summation order). */
static void test_key_mean_matches_runner_keys(void **state)
{
    (void)state;
    fr_model *m;
    assert_int_equal(fr_model_load("synthetic:tiny", &m), FR_OK);
    fr_test_rng rng = {7};
    int lens[2] = {90, 60};
    int *texts[2] = {random_text(&rng, lens[0]), random_text(&rng, lens[1])};
    fr_calib_opts o;
    fr_calib_opts_default(&o);
    o.context = 300;
    o.seed_tokens = 40;
    o.continue_tokens = 8;
    o.tau_steps = 12;
    o.chunk = 1024;
    o.kv = FR_KV_F32;
    fr_calib c;
    fr_calib_report rep;
    if (fr_calibrate(m, &o, 2, (const int *const *)texts, lens, &c, &rep)) fail_msg("%s", fr_last_error());
    assert_int_equal(rep.n_tokens, 300);
    assert_int_equal(rep.prefill_tokens, 288);
    assert_int_equal(rep.tokens[0], 256);
    assert_int_equal(rep.tokens[1], texts[0][1]);   /* the joined text starts with seed 0 */
    assert_true(rep.tau_blocks > 0);
    assert_true(c.has_tau);
    assert_true(c.tau == fr_tau_candidate(rep.tau_code));

    /* Independently: prefill the calibration sequence, read the keys back. */
    const fr_model_config *mc = &m->cfg;
    const int L = mc->num_layers, H = mc->num_kv_heads, d = mc->head_dim, n = rep.n_tokens;
    fr_engine_opts eo = fr_test_engine_opts(FR_BACKEND_CPU, NULL, FR_KV_F32);
    eo.chunk = n;
    fr_session s;
    assert_int_equal(fr_session_open(&eo, n / 128 + 2, 1, &s), FR_OK);
    int seq;
    float *last = malloc(sizeof(float) * (size_t)mc->vocab_size);
    assert_int_equal(fr_session_prefill(&s, rep.tokens, n, n, &seq, last, NULL), FR_OK);
    free(last);
    float *k = malloc(sizeof(float) * (size_t)n * d), *v = malloc(sizeof(float) * (size_t)n * d);
    double worst = 0.0, worst_scale = 0.0;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            fr_kv_view view;
            assert_int_equal(fr_kv_gather(s.kv, seq, l, h, 0, NULL, NULL, k, v, &view), FR_OK);
            assert_int_equal(view.n_tokens, n);
            float amax_k = 0.0f, amax_v = 0.0f;
            for (int ch = 0; ch < d; ch++) {
                double sum = 0.0;
                for (int t = 0; t < n; t++) {
                    sum += k[(size_t)t * d + ch];
                    amax_k = fmaxf(amax_k, fabsf(k[(size_t)t * d + ch]));
                    amax_v = fmaxf(amax_v, fabsf(v[(size_t)t * d + ch]));
                }
                double want = sum / n, got = c.key_mean[((size_t)l * H + h) * d + ch];
                worst = fmax(worst, fabs(got - want));
            }
            const float *fs = c.fp8_scales + ((size_t)l * H + h) * 2;
            worst_scale = fmax(worst_scale, fabs(fs[0] * 448.0 - amax_k) / amax_k);
            worst_scale = fmax(worst_scale, fabs(fs[1] * 448.0 - amax_v) / amax_v);
        }
    printf("  key mean vs runner keys: max |diff| %.3g; FP8 scales: max relative diff %.3g\n", worst, worst_scale);
    assert_true(worst < 1e-5);
    assert_true(worst_scale < 1e-5);
    /* a mean that is not trivially zero */
    double mag = 0.0;
    for (int i = 0; i < L * H * d; i++) mag = fmax(mag, fabs(c.key_mean[i]));
    assert_true(mag > 1e-3);

    free(k); free(v);
    fr_session_close(&s);
    fr_calib_free(&c);
    fr_calib_report_free(&rep);
    free(texts[0]); free(texts[1]);
    fr_model_destroy(&m);
}

/* Invalid options are refused with messages. */
static void test_calibrate_rejects_bad_options(void **state)
{
    (void)state;
    fr_model *m;
    assert_int_equal(fr_model_load("synthetic:tiny", &m), FR_OK);
    int t[3] = {256, 'a', 'b'}, len = 3;
    const int *texts[1] = {t};
    fr_calib c;
    fr_calib_opts o;
    fr_calib_opts_default(&o);
    o.kv = FR_KV_NVFP4;
    assert_int_equal(fr_calibrate(m, &o, 1, texts, &len, &c, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "bf16 or f32"));
    fr_calib_opts_default(&o);
    o.context = 5000;
    assert_int_equal(fr_calibrate(m, &o, 1, texts, &len, &c, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "context"));
    fr_calib_opts_default(&o);
    o.context = 64;
    o.tau_steps = 64;
    assert_int_equal(fr_calibrate(m, &o, 1, texts, &len, &c, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "tau steps"));
    int only_bos = 256, one = 1;
    const int *bos_text[1] = {&only_bos};
    fr_calib_opts_default(&o);
    o.context = 64;
    o.continue_tokens = 0;
    assert_int_equal(fr_calibrate(m, &o, 1, bos_text, &one, &c, NULL), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "no token after BOS"));
    fr_model_destroy(&m);
}

/* ---- the calibration file ---- */

static char tmpdir[256];

static int make_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/fr_test_calib_%d", (int)getpid());
    fr_test_clear_dir(tmpdir, 1);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", tmpdir);
    return system(cmd);
}

static int remove_dir(void **state)
{
    (void)state;
    fr_test_clear_dir(tmpdir, 1);
    return 0;
}

static fr_model_config small_cfg(void)
{
    fr_model_config c;
    memset(&c, 0, sizeof c);
    c.num_layers = 2;
    c.num_kv_heads = 3;
    c.head_dim = 16;
    return c;
}

/* Writes a safetensors file of F32 tensors given by name, shape and values. */
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[3];
    const float *data;
} tensor_spec;

static void write_st(const char *path, const tensor_spec *t, int n)
{
    char header[2048];
    int len = snprintf(header, sizeof header, "{");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t numel = 1;
        len += snprintf(header + len, sizeof header - (size_t)len, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[",
                        i ? "," : "", t[i].name);
        for (int j = 0; j < t[i].ndim; j++) {
            len += snprintf(header + len, sizeof header - (size_t)len, "%s%lld", j ? "," : "",
                            (long long)t[i].shape[j]);
            numel *= (size_t)t[i].shape[j];
        }
        len += snprintf(header + len, sizeof header - (size_t)len, "],\"data_offsets\":[%zu,%zu]}", off,
                        off + 4 * numel);
        off += 4 * numel;
    }
    len += snprintf(header + len, sizeof header - (size_t)len, "}");
    while (len % 8) header[len++] = ' ';
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t hl = (uint64_t)len;
    fwrite(&hl, 8, 1, f);
    fwrite(header, 1, (size_t)len, f);
    for (int i = 0; i < n; i++) {
        size_t numel = 1;
        for (int j = 0; j < t[i].ndim; j++) numel *= (size_t)t[i].shape[j];
        fwrite(t[i].data, 4, numel, f);
    }
    fclose(f);
}

static void expect_load_error(const char *path, const fr_model_config *cfg, const char *needle)
{
    fr_calib c;
    fr_status st = fr_calib_load(path, fr_model_calib_dims(cfg), &c);
    if (st == FR_OK) fail_msg("%s loaded, expected an error with '%s'", path, needle);
    if (!strstr(fr_last_error(), needle)) fail_msg("error '%s' lacks '%s'", fr_last_error(), needle);
    assert_null(c.key_mean);
    assert_null(c.fp8_scales);
}

static void test_calib_file_round_trip(void **state)
{
    (void)state;
    fr_model_config cfg = small_cfg();
    const int nk = 2 * 3 * 16, nf = 2 * 3 * 2;
    float km[2 * 3 * 16], fs[2 * 3 * 2];
    fr_test_rng rng = {3};
    for (int i = 0; i < nk; i++) km[i] = fr_test_normal(&rng);
    for (int i = 0; i < nf; i++) fs[i] = 0.01f + fr_test_uniform(&rng);
    char path[300];
    snprintf(path, sizeof path, "%s/calib.safetensors", tmpdir);

    fr_calib c = {.key_mean = km, .tau = fr_tau_candidate(7), .has_tau = 1, .fp8_scales = fs}, back;
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(&cfg), &c), FR_OK);
    assert_int_equal(fr_calib_load(path, fr_model_calib_dims(&cfg), &back), FR_OK);
    assert_memory_equal(back.key_mean, km, sizeof km);
    assert_non_null(back.fp8_scales);
    assert_memory_equal(back.fp8_scales, fs, sizeof fs);
    assert_true(back.has_tau);
    assert_true(back.tau == c.tau);
    fr_calib_free(&back);

    /* without FP8 scales */
    c.fp8_scales = NULL;
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(&cfg), &c), FR_OK);
    assert_int_equal(fr_calib_load(path, fr_model_calib_dims(&cfg), &back), FR_OK);
    assert_memory_equal(back.key_mean, km, sizeof km);
    assert_null(back.fp8_scales);
    assert_true(back.tau == c.tau);
    fr_calib_free(&back);

    /* the saver refuses what the loader would refuse */
    c.tau = 7.0f;
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(&cfg), &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "tau"));
    c.tau = FR_P_TAU;
    km[5] = NAN;
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(&cfg), &c), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "not finite"));
    km[5] = 0.0f;
    c.key_mean = NULL;
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(&cfg), &c), FR_EINVAL);
    /* a failed save leaves the earlier file whole */
    assert_int_equal(fr_calib_load(path, fr_model_calib_dims(&cfg), &back), FR_OK);
    fr_calib_free(&back);

    /* loaded by the engine: generate/score open a session with --calib */
    fr_model *m;
    assert_int_equal(fr_model_load("synthetic:tiny", &m), FR_OK);
    const fr_model_config *mc = &m->cfg;
    size_t mk = (size_t)mc->num_layers * mc->num_kv_heads * mc->head_dim;
    float *mean = calloc(mk, sizeof(float));
    fr_calib mcal = {.key_mean = mean, .tau = fr_tau_candidate(9), .has_tau = 1};
    assert_int_equal(fr_calib_save(path, fr_model_calib_dims(mc), &mcal), FR_OK);
    fr_engine_opts eo = fr_test_engine_opts(FR_BACKEND_CPU, NULL, FR_KV_NVFP4);
    eo.calib = path;
    fr_session s;
    assert_int_equal(fr_session_open_model(&eo, m, 4, 1, &s), FR_OK);
    assert_true(s.has_calib);
    assert_true(fr_kv_cache_config_of(s.kv)->tau == fr_tau_candidate(9));
    fr_session_close(&s);
    free(mean);
}

static void test_calib_file_rejects_bad_files(void **state)
{
    (void)state;
    fr_model_config cfg = small_cfg();
    float km[2 * 3 * 16] = {0}, fs[2 * 3 * 2], tau_ok = FR_P_TAU, tau_bad = 7.0f;
    for (int i = 0; i < 12; i++) fs[i] = 1.0f;
    char path[300];
    snprintf(path, sizeof path, "%s/bad.safetensors", tmpdir);

    expect_load_error("/nonexistent/calib.safetensors", &cfg, "/nonexistent/calib.safetensors");

    write_st(path, (tensor_spec[]){{"tau", 1, {1}, &tau_ok}}, 1);
    expect_load_error(path, &cfg, "missing tensor key_mean");

    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 8}, km}}, 1);
    expect_load_error(path, &cfg, "key_mean");

    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 16}, km}, {"tau", 1, {1}, &tau_bad}}, 2);
    expect_load_error(path, &cfg, "tau 7 out of range");

    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 16}, km}, {"fp8_scales", 3, {2, 3, 1}, fs}}, 2);
    expect_load_error(path, &cfg, "fp8_scales");

    fs[4] = 0.0f;
    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 16}, km}, {"fp8_scales", 3, {2, 3, 2}, fs}}, 2);
    expect_load_error(path, &cfg, "positive finite");
    fs[4] = 1.0f;

    km[3] = INFINITY;
    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 16}, km}}, 1);
    expect_load_error(path, &cfg, "not finite");
    km[3] = 0.0f;

    /* truncated: the header promises more data than the file holds */
    write_st(path, (tensor_spec[]){{"key_mean", 3, {2, 3, 16}, km}}, 1);
    assert_int_equal(truncate(path, 8 + 64), 0);
    expect_load_error(path, &cfg, path);

    FILE *f = fopen(path, "wb");
    fputs("not a safetensors file at all", f);
    fclose(f);
    expect_load_error(path, &cfg, path);

    /* a file for another model shape */
    fr_model_config other = cfg;
    other.head_dim = 32;
    expect_load_error(path, &other, path);
}

/* ---- tau ---- */

static void test_tau_candidates(void **state)
{
    (void)state;
    assert_true(fr_tau_candidate(FR_TAU_DEFAULT_CODE) == FR_P_TAU);   /* 21/1024 is code 10 */
    assert_true(fr_tau_candidate(10) > fr_e4m3_decode(10) && fr_tau_candidate(10) < fr_e4m3_decode(11));
    for (int k = 1; k < FR_TAU_CODES; k++) assert_true(fr_tau_candidate(k) > fr_tau_candidate(k - 1));
    assert_true(fr_tau_candidate(FR_TAU_CODES - 1) < 6.0f);
    fr_tau_stats s;
    fr_tau_stats_init(&s);
    assert_int_equal(fr_tau_stats_select(&s), FR_TAU_DEFAULT_CODE);
}

/* The error of one block under the real rule with threshold tau. */
static double rule_sse(const float *cp, float p_max, float tau)
{
    fr_pquant_params pp = fr_pquant_default();
    pp.tau = tau;
    float deq[16];
    fr_pquant_block(FR_NVFP4, &pp, cp, p_max, deq);
    double e = 0.0;
    for (int i = 0; i < 16; i++) e += ((double)deq[i] - cp[i]) * ((double)deq[i] - cp[i]);
    return e;
}

/* On constructed probability blocks, the chosen candidate minimizes the total
 * error computed by brute force with the production quantizer at every
 * candidate threshold. Two sets: blocks spread over the whole range, and
 * blocks concentrated just above 20/1024, where the choice is sharp. */
static void test_tau_selection_brute_force(void **state)
{
    (void)state;
    enum { NB = 3000 };
    static float cp[NB][16], pmax[NB];
    for (int set = 0; set < 2; set++) {
        fr_test_rng rng = {11 + (uint64_t)set};
        fr_tau_stats s;
        fr_tau_stats_init(&s);
        for (int b = 0; b < NB; b++) {
            /* c p_max spread log-uniformly over [2^-12, 8], or in [0.02, 0.03] */
            float x = set == 0 ? exp2f(-12.0f + 15.0f * fr_test_uniform(&rng)) : 0.02f + 0.01f * fr_test_uniform(&rng);
            pmax[b] = x / FR_P_SCALE_C;
            int at = (int)(fr_test_u64(&rng) % 16);
            for (int i = 0; i < 16; i++) cp[b][i] = i == at ? x : x * fr_test_uniform(&rng) * fr_test_uniform(&rng);
            fr_tau_stats_add_block(&s, cp[b], pmax[b]);
        }
        assert_int_equal(s.blocks, NB);
        double err[FR_TAU_CODES], best = INFINITY;
        for (int k = 0; k < FR_TAU_CODES; k++) {
            err[k] = 0.0;
            for (int b = 0; b < NB; b++) err[k] += rule_sse(cp[b], pmax[b], fr_tau_candidate(k));
            double mine = fr_tau_stats_error(&s, k);
            assert_true(fabs(mine - err[k]) <= 1e-9 * err[k] + 1e-15);
            best = fmin(best, err[k]);
        }
        /* the minimizers (equal up to summation order); ties go to the one
         * nearest the default code, the lower one at equal distance */
        int best_k = -1;
        for (int k = 0; k < FR_TAU_CODES; k++)
            if (err[k] <= best * (1 + 1e-12) &&
                (best_k < 0 || abs(k - FR_TAU_DEFAULT_CODE) < abs(best_k - FR_TAU_DEFAULT_CODE)))
                best_k = k;
        int chosen = fr_tau_stats_select(&s);
        printf("  set %d: chosen code %d (tau %.6g), brute-force minimum at code %d, error %.6g "
               "(default code: %+.3g)\n", set, chosen, fr_tau_candidate(chosen), best_k, best,
               err[FR_TAU_DEFAULT_CODE] - best);
        assert_int_equal(chosen, best_k);
    }
}

/* The replay visits every block of unmasked keys once, with the running
 * maximum of online softmax: p_max <= 1 and the tile's own maximum block has
 * p_max = 1 when the maximum does not move. */
static void test_tau_replay_counts_blocks(void **state)
{
    (void)state;
    enum { N = 300, D = 32 };
    static float k[N * D], q[D], scratch[N];
    fr_test_rng rng = {5};
    for (int i = 0; i < N * D; i++) k[i] = fr_test_normal(&rng);
    for (int i = 0; i < D; i++) q[i] = fr_test_normal(&rng);
    fr_tau_stats s;
    fr_tau_stats_init(&s);
    assert_int_equal(fr_tau_replay_query(&s, q, k, N, D, 16, 128, scratch), FR_OK);
    assert_int_equal(s.blocks, (N + 15) / 16 - 1);   /* every block but the masked sink */
    fr_tau_stats_init(&s);
    assert_int_equal(fr_tau_replay_query(&s, q, k, N, D, 0, 128, scratch), FR_OK);
    assert_int_equal(s.blocks, (N + 15) / 16);
    assert_int_equal(fr_tau_replay_query(&s, q, k, N, D, 0, 100, scratch), FR_EINVAL);
}

/* An observer sees the step without changing it. */
typedef struct { long kv_rows, queries; } counts;
static fr_status count_kv(void *u, int layer, const fr_step_seq *seqs, int n_seqs, const float *k, const float *v)
{
    (void)k; (void)v;
    counts *c = u;
    if (layer == 0)
        for (int s = 0; s < n_seqs; s++) c->kv_rows += seqs[s].n;
    return FR_OK;
}
static fr_status count_q(void *u, int layer, int s, int head, const float *q, int group, const fr_kv_view *view)
{
    (void)layer; (void)s; (void)head; (void)q; (void)group; (void)view;
    ((counts *)u)->queries++;
    return FR_OK;
}
static fr_status refuse(void *u, int layer, int s, int head, const float *q, int group, const fr_kv_view *view)
{
    (void)u; (void)layer; (void)s; (void)head; (void)q; (void)group; (void)view;
    return fr_fail(FR_EINTERNAL, "observer says stop");
}

static void test_observer_does_not_change_logits(void **state)
{
    (void)state;
    int ids[40];
    for (int i = 0; i < 40; i++) ids[i] = i == 0 ? 256 : 'a' + i % 20;
    float a[272], b[272];
    counts cnt = {0, 0};
    for (int pass = 0; pass < 2; pass++) {
        fr_engine_opts eo;
        fr_engine_opts_default(&eo);
    eo.backend = FR_BACKEND_CPU;
        eo.kv = FR_KV_NVFP4;
        fr_session s;
        assert_int_equal(fr_session_open(&eo, 4, 1, &s), FR_OK);
        fr_forward_observer obs = {.user = &cnt, .layer_kv = count_kv, .decode_query = count_q};
        if (pass) assert_int_equal(fr_runner_set_observer(s.runner, &obs), FR_OK);
        int seq;
        float *out = pass ? b : a;
        assert_int_equal(fr_session_prefill(&s, ids, 30, 16, &seq, out, NULL), FR_OK);
        for (int i = 30; i < 40; i++) {
            fr_step_seq st = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 0};
            assert_int_equal(fr_session_step(&s, &st, 1, out), FR_OK);
        }
        if (pass) {
            fr_forward_observer stop = {.decode_query = refuse};
            assert_int_equal(fr_runner_set_observer(s.runner, &stop), FR_OK);
            fr_step_seq st = {.seq = seq, .n = 1, .tokens = ids, .all_logits = 0};
            assert_int_equal(fr_session_step(&s, &st, 1, out), FR_EINTERNAL);
            assert_non_null(strstr(fr_last_error(), "observer says stop"));
        }
        fr_session_close(&s);
    }
    assert_memory_equal(a, b, sizeof a);
    assert_int_equal(cnt.kv_rows, 40);
    assert_int_equal(cnt.queries, 10 * 2 * 2);   /* 10 decode steps x 2 layers x 2 KV heads */
}

static void test_byte_text_read(void **state)
{
    (void)state;
    char path[300];
    snprintf(path, sizeof path, "%s/t.txt", tmpdir);
    FILE *f = fopen(path, "wb");
    fputs("hi\xff", f);
    fclose(f);
    fr_model_config cfg = {.vocab_size = 272, .bos_id = 256, .max_position = 4096};
    int *ids, n;
    assert_int_equal(fr_byte_text_read(&cfg, path, 0, &ids, &n), FR_OK);
    assert_int_equal(n, 4);
    assert_int_equal(ids[0], 256);
    assert_int_equal(ids[1], 'h');
    assert_int_equal(ids[3], 255);
    free(ids);
    assert_int_equal(fr_byte_text_read(&cfg, path, 2, &ids, &n), FR_OK);
    assert_int_equal(n, 2);
    free(ids);
    cfg.bos_id = -1;
    assert_int_equal(fr_byte_text_read(&cfg, path, 0, &ids, &n), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "BOS"));
    cfg.bos_id = 256;
    assert_int_equal(fr_byte_text_read(&cfg, "/nonexistent/x.txt", 0, &ids, &n), FR_EIO);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_key_mean_matches_runner_keys),
             cmocka_unit_test(test_calibrate_rejects_bad_options),
             cmocka_unit_test_setup_teardown(test_calib_file_round_trip, make_dir, remove_dir),
             cmocka_unit_test_setup_teardown(test_calib_file_rejects_bad_files, make_dir, remove_dir),
             cmocka_unit_test(test_tau_candidates),
             cmocka_unit_test(test_tau_selection_brute_force),
             cmocka_unit_test(test_tau_replay_counts_blocks),
             cmocka_unit_test(test_observer_does_not_change_logits),
             cmocka_unit_test_setup_teardown(test_byte_text_read, make_dir, remove_dir))
