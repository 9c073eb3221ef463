/* Online divergence between the serving engine (FP4/FP8 KV) and a BF16-KV
 * shadow of it, per sample and in aggregate (design.md "Divergence
 * monitoring"; paper Appendix A).
 *
 * A monitored sample owns a shadow sequence in a BF16-KV session over the
 * same weights (fr_session_open_shadow). The shadow is teacher-forced: it is
 * fed exactly the tokens the serving sample consumes, so after every step
 * both have the next-token distribution of the same prefix, and
 *   D_t = sum over BF16's top-128 tokens v of p(v) log(p(v) / q(v))
 * (fr_kl_topk, Eq. 9; p = BF16 shadow, q = serving), the top-1 agreement and
 * the chosen token's log-prob difference follow. Memory is spent only for
 * monitored samples, and a dropped sample frees its shadow sequence. */
#ifndef FR_DIVERGENCE_H
#define FR_DIVERGENCE_H

#include <stdint.h>

#include "rollout/engine/divergence_summary.h"
#include "rollout/engine/kl_metrics.h"
#include "rollout/engine/session.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the shadow ---- */

typedef struct fr_shadow fr_shadow;

/* A BF16 shadow of session main with max_seqs sequences and n_blocks KV
 * blocks (FR_PAGE_TOKENS tokens each). */
fr_status fr_shadow_open(fr_session *main, int max_seqs, int n_blocks, fr_shadow **out);
void fr_shadow_close(fr_shadow **sh);

/* Starts monitoring: prefills tokens[0, n) into a new shadow sequence in
 * chunks; ref_logits (vocab floats) receives the shadow's distribution after
 * the last token. FR_ENOMEM (and nothing kept) when the shadow is full. */
fr_status fr_shadow_start(fr_shadow *sh, const int *tokens, int n, int *shadow_seq, float *ref_logits);
/* One token for each of n shadow sequences (the tokens their serving samples
 * consume in this step); ref_logits [n][vocab] receives the shadow's next
 * distributions. */
fr_status fr_shadow_step(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n, float *ref_logits);
/* Whether the shadow measures on the device (the CUDA backend): then
 * fr_shadow_step_kl serves decode-only steps, and no logits cross to the
 * host. */
int fr_shadow_on_device(const fr_shadow *sh);
/* The same shadow step, then each sequence's D_t (kl_metrics.h, top
 * FR_KL_TOP_K) against the serving session's last decode on the device:
 * shadow row j against served row served_rows[j] (its index in that decode's
 * batch), with chosen[j] the token the serving sample drew; out[j] receives
 * the result. The serving decode must have finished (fr_session_decode_keep
 * returns when it has) and nothing may have stepped it since. */
fr_status fr_shadow_step_kl(fr_shadow *sh, fr_session *served, const int *shadow_seqs, const int *tokens, int n,
                            const int *served_rows, const int *chosen, fr_kl_result *out);
/* fr_shadow_step_kl in two halves: launch enqueues the shadow's step (the
 * serving decode may be running beside it); wait_kl finishes it and measures
 * against the serving session's finished decode. A launch must be waited for
 * (wait_kl with bad arguments still finishes it). */
fr_status fr_shadow_launch(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n);
fr_status fr_shadow_wait_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                            fr_kl_result *out);
/* The shadow's step carried inside the serving decode (one batch: the
 * weights are read once; rollout/model/runner_cuda.h): launches the serving
 * session's decode of seqs/rows with the shadow's n sequences riding in it.
 * Finish it with fr_session_decode_wait on the serving session, then
 * measure with fr_shadow_carried_kl before anything steps either again.
 * served_rows (may be NULL): the serving rows the shadow's rows will be
 * measured against; given, the measurement is enqueued behind the decode
 * on its stream with the tokens the decode samples, and the decode's wait
 * covers it, so fr_shadow_carried_kl only reads the results back (no host
 * round trip of its own) when it is called with the same rows and those
 * tokens; otherwise it measures then, as before. */
fr_status fr_shadow_launch_carried(fr_shadow *sh, fr_session *served, const fr_step_seq *seqs, const fr_decode_row *rows,
                                   int n_seqs, const int *shadow_seqs, const int *tokens, int n,
                                   const int *served_rows);
fr_status fr_shadow_carried_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                               fr_kl_result *out);
/* D_t of n rows given on the host (vocab floats each): the shadow's
 * distribution ref[j] against the served one served[j], chosen[j] the token
 * drawn (-1: none); out[j] receives the result. Rows may repeat (a prompt's
 * samples share its prefill's rows). On the device when the shadow is
 * there (each distinct row sent once, no vocabulary-sized work on the
 * host), else fr_kl_topk's. */
fr_status fr_shadow_measure_rows(fr_shadow *sh, const float *const *ref, const float *const *served, const int *chosen,
                                 int n, fr_kl_result *out);
/* A new shadow sequence holding src's tokens (for the n samples of one
 * prompt). */
fr_status fr_shadow_fork(fr_shadow *sh, int src, int *dst);
/* Blocks sequence seq needs for one more token (0 or 1). */
int fr_shadow_blocks_needed(const fr_shadow *sh, int seq);
/* Ends monitoring of a sequence and frees its blocks. */
void fr_shadow_drop(fr_shadow *sh, int shadow_seq);
/* The shadow session's decode graph captures (fr_session_capture_stats). */
void fr_shadow_capture_stats(const fr_shadow *sh, int *captures, double *seconds);
/* Free KV blocks of the shadow. */
int fr_shadow_free_blocks(const fr_shadow *sh);

#ifdef __cplusplus
}
#endif

#endif
