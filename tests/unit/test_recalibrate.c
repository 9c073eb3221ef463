/* The automatic recalibration policy (rollout/monitor/recalibrate.h) on the CPU
 * backend with synthetic:tiny and an NVFP4 cache, every sample monitored:
 * nothing happens below min_positions or the threshold; past them the key
 * mean is recalibrated once for the version (equal to fr_calibrate's on the
 * same texts), the sequences in flight are recomputed and still finish, and
 * the file is written; a new version is judged again; after_commit acts on
 * a version change alone; a calibration that fails leaves the old mean and
 * serving goes on; bad configurations are refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rollout/monitor/calibrate.h"
#include "rollout/monitor/recalibrate.h"
#include "tests/unit/test_util.h"

static char dir[] = "/tmp/fr_recal_XXXXXX";
static char text_a[96], text_b[96];

static int setup(void **state)
{
    (void)state;
    if (!mkdtemp(dir)) return -1;
    snprintf(text_a, sizeof text_a, "%s/a.txt", dir);
    snprintf(text_b, sizeof text_b, "%s/b.txt", dir);
    const char *words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "ran"};
    fr_test_rng g = {9};
    for (int f = 0; f < 2; f++) {
        FILE *fp = fopen(f ? text_b : text_a, "w");
        if (!fp) return -1;
        for (int i = 0; i < 200; i++) fprintf(fp, "%s ", words[fr_test_u64(&g) % 8]);
        fclose(fp);
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    fr_test_clear_dir(dir, 1);
    return 0;
}

static void open_session(fr_session *s)
{
    fr_engine_opts o = fr_test_engine_opts(FR_BACKEND_CPU, NULL, FR_KV_NVFP4);
    assert_int_equal(fr_session_open(&o, 64, 8, s), FR_OK);
}

static void submit(fr_scheduler *sch, uint64_t id, int n_tokens)
{
    int prompt[40];
    prompt[0] = 256;
    for (int i = 1; i < 40; i++) prompt[i] = (int)((id * 31 + (uint64_t)i * 7) % 256);
    fr_request_spec q = {.id = id, .prompt = prompt, .n_prompt = 40, .n = 2, .max_tokens = n_tokens,
                         .params = {.temperature = 1.0f, .top_p = 1.0f, .seed = 11 + id}, .monitor = 1};
    assert_int_equal(fr_scheduler_submit(sch, &q), FR_OK);
}

static fr_recal_config config(double threshold, int min_positions, const char *out_dir)
{
    static const char *texts[2];
    texts[0] = text_a;
    texts[1] = text_b;
    return (fr_recal_config){.kl_threshold = threshold, .min_positions = min_positions, .n_texts = 2,
                             .texts = texts, .context = 256, .seed_tokens = 64, .continue_tokens = 4,
                             .out_dir = out_dir, .log = stderr};
}

/* The session's key mean (and its cache's) after a recalibration equals
 * fr_calibrate's on the same texts and settings, and the file recorded for
 * version 0 loads with it. */
static void check_recalibrated_mean(fr_session *s)
{
    fr_calib_opts o;
    fr_calib_opts_default(&o);
    o.context = 256;
    o.seed_tokens = 64;
    o.continue_tokens = 4;
    o.tau_steps = 0;
    int *ids[2], lens[2];
    assert_int_equal(fr_byte_text_read(&s->model->cfg, text_a, 0, &ids[0], &lens[0]), FR_OK);
    assert_int_equal(fr_byte_text_read(&s->model->cfg, text_b, 0, &ids[1], &lens[1]), FR_OK);
    fr_calib want = {0};
    assert_int_equal(fr_calibrate(s->model, &o, 2, (const int *const *)ids, lens, &want, NULL), FR_OK);
    const fr_model_config *mc = &s->model->cfg;
    const size_t n = (size_t)mc->num_layers * mc->num_kv_heads * mc->head_dim;
    assert_true(s->has_calib);
    assert_memory_equal(s->calib.key_mean, want.key_mean, sizeof(float) * n);
    assert_memory_equal(fr_kv_cache_config_of(s->kv)->key_mean, want.key_mean, sizeof(float) * n);
    char path[160];
    snprintf(path, sizeof path, "%s/calib-v0.safetensors", dir);
    fr_calib back = {0};
    assert_int_equal(fr_calib_load(path, fr_model_calib_dims(mc), &back), FR_OK);
    assert_memory_equal(back.key_mean, want.key_mean, sizeof(float) * n);
    fr_calib_free(&back);
    fr_calib_free(&want);
    free(ids[0]);
    free(ids[1]);
}

static void test_policy(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s);
    fr_scheduler_config sc = {.max_seqs = 8, .chunk = 64, .reserve_blocks = -1, .kl_sample_rate = 1.0};
    fr_scheduler *sch = NULL;
    assert_int_equal(fr_scheduler_new(&s, &sc, &sch), FR_OK);
    fr_recal_config rc = config(1e-12, 60, dir);
    fr_recal *r = NULL;
    assert_int_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_OK);

    /* too few positions: nothing */
    submit(sch, 0, 8);
    submit(sch, 1, 40);
    int did = -1;
    for (int k = 0; k < 6; k++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
    assert_int_equal(fr_recal_check(r, &s, sch, 0, &did), FR_OK);
    assert_int_equal(did, 0);
    /* past min_positions with samples in flight: one recalibration */
    for (int k = 0; k < 30; k++) assert_int_equal(fr_scheduler_step(sch), FR_OK);
    fr_scheduler_stats st;
    fr_scheduler_stats_get(sch, &st);
    assert_true(st.running > 0);
    assert_int_equal(fr_recal_check(r, &s, sch, 0, &did), FR_OK);
    assert_int_equal(did, 1);
    fr_recal_stats rs;
    fr_recal_stats_get(r, &rs);
    assert_int_equal(rs.recalibrations, 1);
    assert_int_equal(rs.failures, 0);
    assert_int_equal(rs.last_preempted, st.running + st.prefilling);
    assert_true(rs.last_kl > 1e-12);
    fr_scheduler_stats_get(sch, &st);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.kv_blocks_used, 0);
    check_recalibrated_mean(&s);
    const fr_model_config *mc = &s.model->cfg;
    const size_t n = (size_t)mc->num_layers * mc->num_kv_heads * mc->head_dim;
    /* once per version */
    assert_int_equal(fr_recal_check(r, &s, sch, 0, &did), FR_OK);
    assert_int_equal(did, 0);
    /* the preempted samples still finish */
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    fr_sample_result res;
    int done = 0;
    while (fr_scheduler_next_result(sch, &res)) {
        assert_int_equal(res.finish, FR_FINISH_LENGTH);
        assert_int_equal(res.n_tokens, res.request_id == 0 ? 8 : 40);
        fr_sample_result_free(&res);
        done++;
    }
    assert_int_equal(done, 4);
    /* a new version is judged on its own positions */
    fr_scheduler_set_weight_version(sch, 1);
    assert_int_equal(fr_recal_check(r, &s, sch, 1, &did), FR_OK);
    assert_int_equal(did, 0);
    submit(sch, 2, 40);
    assert_int_equal(fr_scheduler_run(sch), FR_OK);
    while (fr_scheduler_next_result(sch, &res)) fr_sample_result_free(&res);
    /* judged on version 1's figures alone (with the recalibrated mean they may
     * be at rounding level, where the top-128 sum of Eq. 9 can dip below 0) */
    const fr_div_version *dv = fr_div_aggregates_find(fr_scheduler_divergence(sch), 1);
    assert_non_null(dv);
    assert_int_equal(dv->all.n, 80);
    const int due = fr_div_summary_mean(&dv->all) > 1e-12;
    assert_int_equal(fr_recal_check(r, &s, sch, 1, &did), FR_OK);
    assert_int_equal(did, due);
    fr_recal_stats_get(r, &rs);
    assert_int_equal(rs.recalibrations, 1 + due);
    fr_recal_destroy(&r);
    assert_null(r);

    /* after_commit alone: the starting version is left alone, a new one is done at once */
    rc = config(0, 60, NULL);
    rc.after_commit = 1;
    assert_int_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_OK);
    assert_int_equal(fr_recal_check(r, &s, sch, 1, &did), FR_OK);
    assert_int_equal(did, 0);
    assert_int_equal(fr_recal_check(r, &s, sch, 2, &did), FR_OK);
    assert_int_equal(did, 1);
    fr_recal_destroy(&r);

    /* a calibration that fails (a window past the model's) is counted; the mean stays */
    float *before = malloc(sizeof(float) * n);
    assert_non_null(before);
    memcpy(before, s.calib.key_mean, sizeof(float) * n);
    rc = config(0, 60, NULL);
    rc.after_commit = 1;
    rc.context = mc->max_position + 1000;
    assert_int_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_OK);
    assert_int_equal(fr_recal_check(r, &s, sch, 2, &did), FR_OK);
    assert_int_equal(fr_recal_check(r, &s, sch, 3, &did), FR_OK);
    assert_int_equal(did, 0);
    fr_recal_stats_get(r, &rs);
    assert_int_equal(rs.failures, 1);
    assert_int_equal(rs.recalibrations, 0);
    assert_memory_equal(s.calib.key_mean, before, sizeof(float) * n);
    fr_recal_destroy(&r);

    free(before);
    fr_scheduler_destroy(&sch);
    fr_session_close(&s);
}

static void test_refused(void **state)
{
    (void)state;
    fr_session s;
    open_session(&s);
    fr_recal *r = (fr_recal *)1;
    fr_recal_config rc = config(0, 60, NULL);
    assert_int_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_EINVAL);   /* neither threshold nor after_commit */
    assert_null(r);
    rc = config(0.1, 60, "/nonexistent/folder");
    assert_int_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_EINVAL);
    assert_non_null(strstr(fr_last_error(), "not a folder"));
    rc = config(0.1, 60, NULL);
    const char *missing[1] = {"/nonexistent/text.txt"};
    rc.texts = missing;
    rc.n_texts = 1;
    assert_int_not_equal(fr_recal_new(&rc, &s.model->cfg, &r), FR_OK);
    assert_null(r);
    assert_int_equal(fr_recal_check(NULL, &s, NULL, 0, NULL), FR_EINVAL);
    fr_recal_destroy(NULL);
    fr_session_close(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_policy), cmocka_unit_test(test_refused)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
