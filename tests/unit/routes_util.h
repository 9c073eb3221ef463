/* Helpers of the tests that compare two paths of a mixture-of-experts model
 * (prefill and decode, CPU and GPU, F32 and BF16 KV). Where the two sides'
 * routers settle a near-tie of two experts differently, one side runs
 * another expert's MLP: its row differs by that expert's output, and so,
 * through attention, does every later row unless the flip is in the last MoE
 * layer. So logits are compared only on the rows no differing route
 * reaches, where both sides ran the same experts. They fail the calling
 * cmocka test on any error. */
#ifndef FR_TEST_ROUTES_UTIL_H
#define FR_TEST_ROUTES_UTIL_H

#include <stdint.h>

#include "rollout/engine/session.h"

/* Logits of every position of ids (n x vocab, malloc'd) and the experts each
 * MoE layer chose there (routes: n x layers x experts_per_tok): one prefill
 * step of all n tokens, or (decode 1) one step per token through the cache.
 * The sequence is freed afterwards. */
float *fr_test_logits_routes(fr_session *s, const int *ids, int n, int decode, uint16_t *routes);

/* How many (row, layer) expert sets differ between a and b ([rows][L][k],
 * sorted in place); reached[row] (when not NULL) is set where a differing
 * set can change the row's logits: in the row itself or, from a layer
 * before the last, in any earlier row; first[row][layer] (when not NULL)
 * where a set differs that no earlier difference reaches (none in an
 * earlier layer of the row, none before the last layer in an earlier row):
 * a flip of the router's own, not a consequence of another. */
int fr_test_route_sets_differ(uint16_t *a, uint16_t *b, int rows, int L, int k, uint8_t *reached, uint8_t *first);

/* a against b (the reference, rows x V) on the rows not reached: prints the
 * figures after `what` (with `differ`, of rows x L sets), and fails unless
 * some row is clean and max |a - b| there is at most bound x max |b|.
 * Returns max |a - b| on the clean rows. */
float fr_test_check_clean_rows(const char *what, const float *a, const float *b, int rows, int V,
                               const uint8_t *reached, int differ, int L, float bound);

#endif
