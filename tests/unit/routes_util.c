#include "routes_util.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

float *fr_test_logits_routes(fr_session *s, const int *ids, int n, int decode, uint16_t *routes)
{
    const fr_model_config *c = &s->model->cfg;
    const size_t V = (size_t)c->vocab_size, per_row = (size_t)fr_model_moe_layers(c) * c->experts_per_tok;
    float *logits = malloc(sizeof(float) * (size_t)n * V);
    int seq, *rows = malloc(sizeof(int) * (size_t)n);
    assert_non_null(logits);
    assert_non_null(rows);
    for (int i = 0; i < n; i++) rows[i] = i;
    FR_OK_OR_FAIL(fr_session_capture_routes(s, 1));
    FR_OK_OR_FAIL(fr_kv_seq_new(s->kv, &seq));
    if (decode) {
        for (int i = 0; i < n; i++) {
            fr_step_seq st = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 1};
            FR_OK_OR_FAIL(fr_session_step(s, &st, 1, logits + (size_t)i * V));
            FR_OK_OR_FAIL(fr_session_routes(s, rows, 1, routes + (size_t)i * per_row));
        }
    } else {
        fr_step_seq st = {.seq = seq, .n = n, .tokens = ids, .all_logits = 1};
        FR_OK_OR_FAIL(fr_session_step(s, &st, 1, logits));
        FR_OK_OR_FAIL(fr_session_routes(s, rows, n, routes));
    }
    FR_OK_OR_FAIL(fr_session_capture_routes(s, 0));
    fr_kv_seq_free(s->kv, seq);
    free(rows);
    return logits;
}

static int cmp_u16(const void *a, const void *b) { return *(const uint16_t *)a - *(const uint16_t *)b; }

int fr_test_route_sets_differ(uint16_t *a, uint16_t *b, int rows, int L, int k, uint8_t *reached, uint8_t *first)
{
    int differ = 0, early = 0;
    for (int r = 0; r < rows; r++) {
        int here = 0;
        for (int m = 0; m < L; m++) {
            const size_t at = ((size_t)r * L + m) * k;
            qsort(a + at, (size_t)k, sizeof(uint16_t), cmp_u16);
            qsort(b + at, (size_t)k, sizeof(uint16_t), cmp_u16);
            const int same = memcmp(a + at, b + at, sizeof(uint16_t) * (size_t)k) == 0;
            if (first) first[(size_t)r * L + m] = (uint8_t)(!same && !here && !early);
            if (same) continue;
            differ++;
            here = 1;
            if (m < L - 1) early = 1;
        }
        if (reached) reached[r] = (uint8_t)(here || early);
    }
    return differ;
}

float fr_test_check_clean_rows(const char *what, const float *a, const float *b, int rows, int V,
                               const uint8_t *reached, int differ, int L, float bound)
{
    float md = 0, top = 0;
    int clean = 0;
    for (int r = 0; r < rows; r++) {
        if (reached[r]) continue;
        clean++;
        for (int v = 0; v < V; v++) {
            md = fmaxf(md, fabsf(a[(size_t)r * V + v] - b[(size_t)r * V + v]));
            top = fmaxf(top, fabsf(b[(size_t)r * V + v]));
        }
    }
    printf("  %s: routes differ in %d of %d (row, layer); on the %d of %d rows they do not reach "
           "max |diff| %.4g of max |logit| %.3g (%.2e)\n", what, differ, rows * L, clean, rows, md, top,
           top > 0 ? md / top : 0.0);
    assert_true(clean > 0);
    assert_true(md <= bound * top);
    return md;
}
