#include "logits_util.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

float *fr_test_logits(fr_session *s, const int *ids, int n, int chunk)
{
    const int V = s->model->cfg.vocab_size;
    int seq;
    float *out = malloc(sizeof(float) * (size_t)n * V);
    assert_non_null(out);
    if (chunk) {
        if (fr_session_prefill(s, ids, n, chunk, &seq, NULL, out)) fail_msg("prefill: %s", fr_last_error());
    } else {
        assert_int_equal(fr_kv_seq_new(s->kv, &seq), FR_OK);
        for (int i = 0; i < n; i++) {
            fr_step_seq st = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 1};
            if (fr_session_step(s, &st, 1, out + (size_t)i * V)) fail_msg("decode: %s", fr_last_error());
        }
    }
    fr_kv_seq_free(s->kv, seq);
    return out;
}

float fr_test_max_abs(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

float fr_test_max_diff(const float *a, const float *b, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

fr_st_file *fr_test_golden_open(const char *name, fr_model **model)
{
    const char *d = fr_test_require_model(name);
    if (!d) return NULL;
    char path[4200];
    snprintf(path, sizeof path, "%s/golden.safetensors", d);
    printf("  %s:\n", name);
    if (!*model && fr_model_load(d, model)) fail_msg("%s: %s", name, fr_last_error());
    fr_st_file *g = NULL;
    if (fr_st_file_open(path, &g)) fail_msg("%s: %s", path, fr_last_error());
    return g;
}

float fr_test_within(const float *ref, const float *got, size_t n, float bound, const char *fmt, ...)
{
    float d = fr_test_max_diff(ref, got, n), m = fr_test_max_abs(ref, n);
    va_list ap;
    va_start(ap, fmt);
    printf("  ");
    vprintf(fmt, ap);
    va_end(ap);
    printf(": max |diff| %.3g, ratio %.2e\n", d, d / m);
    assert_true(d <= bound * m);
    return d;
}

const fr_st_tensor *fr_test_golden(const fr_st_file *g, int p, const char *what)
{
    char name[64];
    snprintf(name, sizeof name, "p%d.%s", p, what);
    return fr_st_file_find(g, name);
}

int *fr_test_golden_ints(const fr_st_file *g, int p, const char *what, int *n)
{
    const fr_st_tensor *t = fr_test_golden(g, p, what);
    if (!t) fail_msg("the golden file has no p%d.%s", p, what);
    *n = (int)fr_st_tensor_numel(t);
    int *out = malloc(sizeof(int) * (size_t)(*n > 0 ? *n : 1));
    assert_non_null(out);
    for (int i = 0; i < *n; i++) {
        if (t->dtype == FR_DTYPE_U8) out[i] = ((const uint8_t *)t->data)[i];
        else if (t->dtype == FR_DTYPE_I32) memcpy(&out[i], (const char *)t->data + 4 * (size_t)i, 4);
        else fail_msg("golden integers p%d.%s of dtype %d", p, what, (int)t->dtype);
    }
    return out;
}

void fr_test_shared_open(fr_model *m, fr_kv_dtype kv, int n_tokens, int chunk, fr_session *s)
{
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.backend = FR_BACKEND_CPU;   /* these tests check the CPU engine, also where a GPU is present */
    o.kv = kv;
    o.chunk = chunk;
    if (fr_session_open_model(&o, m, n_tokens / 128 + 2, 2, s)) fail_msg("session: %s", fr_last_error());
}

void fr_test_shared_close(fr_session *s)
{
    s->model = NULL;   /* the model outlives the session: its owner frees it */
    fr_session_close(s);
}

void fr_test_check_golden_logits(const fr_st_tensor *golden, const float *ours, int p, int n, int V)
{
    size_t count = fr_st_tensor_numel(golden);
    assert_int_equal(count, (size_t)n * V);
    float *ref = malloc(sizeof(float) * count);
    assert_non_null(ref);
    assert_int_equal(fr_st_tensor_to_f32(golden, ref, count), FR_OK);
    float d = fr_test_max_diff(ours, ref, count), m = fr_test_max_abs(ref, count);
    printf("  p%d (%5d tokens): prefill max |diff| %.3g, max |golden| %.3g, ratio %.2e\n", p, n, d, m, d / m);
    free(ref);
    assert_true(m > 0.0f && d <= 1e-3f * m);
}

int fr_test_greedy_matches(fr_session *s, int seq, float *logits, const int *want, int n_want, int p)
{
    const fr_sampling_params greedy = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};
    fr_sampler *smp;
    assert_int_equal(fr_sampler_new(s->model->cfg.vocab_size, &smp), FR_OK);
    int matched = 0, tok;
    for (int i = 0; i < n_want && matched == i; i++) {
        assert_int_equal(fr_sample(smp, logits, &greedy, 0, (uint64_t)i, &tok, NULL), FR_OK);
        if (tok != want[i]) {
            printf("  p%d: greedy token %d is %d, transformers has %d\n", p, i, tok, want[i]);
            break;
        }
        matched++;
        fr_step_seq step = {.seq = seq, .n = 1, .tokens = &tok, .all_logits = 0};
        assert_int_equal(fr_session_step(s, &step, 1, logits), FR_OK);
    }
    printf("  p%d: %d/%d greedy tokens equal\n", p, matched, n_want);
    fr_sampler_destroy(&smp);
    return matched;
}
