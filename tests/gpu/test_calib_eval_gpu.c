/* Calibration and the teacher-forced KL evaluation on the CUDA backend
 * (rollout/monitor/calibrate.h and rollout/monitor/eval_kl.h with device weights) against
 * the same runs on the CPU backend, on tq6.
 *
 * Calibration (window 1024, one seed text continued for 32 tokens, 32 tau
 * steps): both backends tile the same text only if their greedy
 * continuations agree, so the tiled tokens are compared first; then the key
 * mean (max |gpu - cpu| <= 2e-2 of max |mean|: keys come from BF16 GEMMs on
 * the GPU and float32 ones on the CPU), the FP8 scales (within 3%), and the
 * tau code (equal, or a neighbour when the two error totals at the CPU's
 * code differ by less than 1%).
 *
 * Evaluation (2 texts x 512 tokens, fp8, nvfp4 full recipe, nvfp4 vanilla,
 * each against its own backend's BF16 pass): the KL figures agree within
 * 25% per configuration, and the ordering the CPU test asserts holds on the
 * GPU too (vanilla far above the full recipe). Figures are printed. Skipped
 * without a GPU or without tq6. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "gpu_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout/monitor/calibrate.h"
#include "rollout/monitor/eval_kl.h"
#include "rollout/model/weights_cuda.h"
#include "tests/unit/test_util.h"

typedef struct {
    fr_model *m;
    fr_weights_gpu *w;
    const char *dir;
} tq6_rig;

static int rig_open(tq6_rig *r)
{
    memset(r, 0, sizeof *r);
    if (!fr_gpu_test_available()) return 0;
    if (!(r->dir = fr_test_require_tq6())) return 0;
    FR_OK_OR_FAIL(fr_model_load(r->dir, &r->m));
    FR_OK_OR_FAIL(fr_weights_gpu_from_model(r->m, &r->w));
    return 1;
}

static void rig_close(tq6_rig *r)
{
    fr_weights_gpu_destroy(&r->w);
    fr_model_destroy(&r->m);
}

static int *read_text(const tq6_rig *r, const char *name, int max_tokens, int *n)
{
    char path[4200];
    int *ids;
    snprintf(path, sizeof path, "%s/texts/%s", r->dir, name);
    FR_OK_OR_FAIL(fr_byte_text_read(&r->m->cfg, path, max_tokens, &ids, n));
    return ids;
}

static void test_calibrate_gpu_vs_cpu(void **state)
{
    (void)state;
    tq6_rig r;
    if (!rig_open(&r)) skip();
    int n;
    int *text = read_text(&r, "calib_0.txt", 0, &n);
    fr_calib_opts co;
    fr_calib_opts_default(&co);
    co.context = 1024;
    co.continue_tokens = 32;
    co.tau_steps = 32;
    fr_calib cc, gc;
    fr_calib_report cr, gr;
    double t0 = fr_now_s();
    FR_OK_OR_FAIL(fr_calibrate(r.m, &co, 1, (const int *const *)&text, &n, &cc, &cr));
    double t1 = fr_now_s();
    co.gpu = r.w;
    FR_OK_OR_FAIL(fr_calibrate(r.m, &co, 1, (const int *const *)&text, &n, &gc, &gr));
    double t2 = fr_now_s();
    printf("  window 1024: CPU %.2f s, GPU %.2f s\n", t1 - t0, t2 - t1);

    assert_int_equal(cr.n_tokens, gr.n_tokens);
    int first_diff = -1;
    for (int i = 0; i < cr.n_tokens && first_diff < 0; i++)
        if (cr.tokens[i] != gr.tokens[i]) first_diff = i;
    printf("  calibration tokens: %s", first_diff < 0 ? "all equal\n" : "");
    if (first_diff >= 0) printf("first difference at %d of %d\n", first_diff, cr.n_tokens);
    assert_int_equal(first_diff, -1);

    const fr_model_config *c = &r.m->cfg;
    const size_t nk = (size_t)c->num_layers * c->num_kv_heads * c->head_dim;
    double mx = 0.0, md = 0.0;
    for (size_t i = 0; i < nk; i++) {
        mx = fmax(mx, fabs(cc.key_mean[i]));
        md = fmax(md, fabs(cc.key_mean[i] - gc.key_mean[i]));
    }
    double sd = 0.0;
    for (int i = 0; i < 2 * c->num_layers * c->num_kv_heads; i++)
        sd = fmax(sd, fabs(gc.fp8_scales[i] / cc.fp8_scales[i] - 1.0));
    printf("  key mean: max |gpu - cpu| %.3g of max |mean| %.3g (%.2e); FP8 scales within %.2f%%\n", md, mx,
           md / mx, 100.0 * sd);
    printf("  tau code: CPU %d (%.6g), GPU %d (%.6g); error totals at the CPU's code %.6g / %.6g\n", cr.tau_code,
           cc.tau, gr.tau_code, gc.tau, cr.tau_err, gr.tau_err_by_code[cr.tau_code]);
    assert_true(md <= 2e-2 * mx);
    assert_true(sd <= 0.03);
    if (gr.tau_code != cr.tau_code) {
        assert_true(abs(gr.tau_code - cr.tau_code) == 1);
        assert_true(fabs(gr.tau_err_by_code[cr.tau_code] - gr.tau_err) <= 0.01 * gr.tau_err);
    }
    fr_calib_free(&cc);
    fr_calib_free(&gc);
    fr_calib_report_free(&cr);
    fr_calib_report_free(&gr);
    free(text);
    rig_close(&r);
}

static void test_eval_kl_gpu_vs_cpu(void **state)
{
    (void)state;
    tq6_rig r;
    if (!rig_open(&r)) skip();
    int cn, *ctext = read_text(&r, "calib_0.txt", 0, &cn);
    int *ev[2], ev_len[2];
    ev[0] = read_text(&r, "eval_0.txt", 512, &ev_len[0]);
    ev[1] = read_text(&r, "eval_1.txt", 512, &ev_len[1]);
    fr_calib_opts co;
    fr_calib_opts_default(&co);
    co.context = 1024;
    co.continue_tokens = 32;
    co.tau_steps = 16;
    fr_calib calib;
    fr_calib_report crep;
    FR_OK_OR_FAIL(fr_calibrate(r.m, &co, 1, (const int *const *)&ctext, &cn, &calib, &crep));

    fr_eval_config *cfgs;
    int n;
    FR_OK_OR_FAIL(fr_eval_config_list("fp8,nvfp4,nvfp4-vanilla", 0, &cfgs, &n));
    fr_eval_kl_params p = {.n_texts = 2, .texts = (const int *const *)ev, .lens = ev_len, .configs = cfgs,
                           .n_configs = n, .calib = &calib};
    fr_eval_kl_report cpu, gpu;
    double t0 = fr_now_s();
    FR_OK_OR_FAIL(fr_eval_kl(r.m, &p, &cpu));
    double t1 = fr_now_s();
    p.gpu = r.w;
    FR_OK_OR_FAIL(fr_eval_kl(r.m, &p, &gpu));
    double t2 = fr_now_s();
    printf("  2 texts x 512 tokens, 3 configurations: CPU %.1f s, GPU %.1f s\n", t1 - t0, t2 - t1);
    printf("  | configuration | CPU KL (1e-3) | GPU KL (1e-3) | CPU top-1 mismatch %% | GPU |\n");
    for (int c = 0; c < n; c++)
        printf("  | %-13s | %13.3f | %13.3f | %20.2f | %5.2f |\n", cfgs[c].name, 1e3 * cpu.results[c].kl,
               1e3 * gpu.results[c].kl, 100.0 * cpu.results[c].top1_mismatch,
               100.0 * gpu.results[c].top1_mismatch);
    for (int c = 0; c < n; c++)
        assert_true(fabs(gpu.results[c].kl / cpu.results[c].kl - 1.0) <= 0.25);
    assert_true(gpu.results[2].kl > 4.0 * gpu.results[1].kl);
    assert_true(gpu.results[2].kl > 4.0 * gpu.results[0].kl);

    fr_eval_kl_report_free(&cpu);
    fr_eval_kl_report_free(&gpu);
    free(cfgs);
    fr_calib_free(&calib);
    fr_calib_report_free(&crep);
    free(ctext); free(ev[0]); free(ev[1]);
    rig_close(&r);
}

FR_GPU_TEST_MAIN(NULL, NULL,
                 cmocka_unit_test(test_calibrate_gpu_vs_cpu),
                 cmocka_unit_test(test_eval_kl_gpu_vs_cpu))
