/* Helpers of the tests that compare a session's logits with another path's
 * or with a checkpoint's golden file (golden.safetensors next to the
 * checkpoint: tensors p<prompt>.<what>, such as p3.ids, p3.logits_f32,
 * p3.greedy). They fail the calling cmocka test on any error. */
#ifndef FR_TEST_LOGITS_UTIL_H
#define FR_TEST_LOGITS_UTIL_H

#include <stddef.h>

#include "base/safetensors.h"
#include "rollout/engine/session.h"
#include "rollout/model/sampler.h"

/* Logits at every position of ids (n x vocab, malloc'd): a prefill in chunks
 * of `chunk` tokens, or (chunk 0) the decode path, one step per token
 * through the cache. The sequence is freed afterwards. */
float *fr_test_logits(fr_session *s, const int *ids, int n, int chunk);

float fr_test_max_abs(const float *x, size_t n);
float fr_test_max_diff(const float *a, const float *b, size_t n);
/* max |got - ref| over n values, printed after the printf-style label with
 * its ratio to max |ref| ("  LABEL: max |diff| D, ratio R"); fails the test
 * unless it is at most bound x max |ref|. Returns the difference. */
float fr_test_within(const float *ref, const float *got, size_t n, float bound, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* The golden file of checkpoint `name` (fr_test_require_model), open, with
 * the checkpoint loaded into *model unless it is already (the cases of one
 * binary share it; the caller frees it); NULL, after a SKIP message, when the
 * checkpoint is absent. */
fr_st_file *fr_test_golden_open(const char *name, fr_model **model);

/* Tensor p<p>.<what> of a golden file, or NULL when it has none. */
const fr_st_tensor *fr_test_golden(const fr_st_file *g, int p, const char *what);
/* Its integers (U8 or I32), malloc'd; fails the test when it is absent. */
int *fr_test_golden_ints(const fr_st_file *g, int p, const char *what, int *n);

/* A CPU session over a model the caller keeps (shared by several cases),
 * with room for n_tokens; fr_test_shared_close hands the model back. */
void fr_test_shared_open(fr_model *m, fr_kv_dtype kv, int n_tokens, int chunk, fr_session *s);
void fr_test_shared_close(fr_session *s);

/* Prefill logits `ours` (n x V) of prompt p within 1e-3 x max |golden|;
 * prints the figures. */
void fr_test_check_golden_logits(const fr_st_tensor *golden, const float *ours, int p, int n, int V);

/* Greedy continuation of sequence seq from its last logits (V floats,
 * overwritten) against want[n_want]: how many tokens match before the first
 * that differs (printed). */
int fr_test_greedy_matches(fr_session *s, int seq, float *logits, const int *want, int n_want, int p);

#endif
