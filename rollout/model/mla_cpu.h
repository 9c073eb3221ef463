/* mla_cpu: multi-head latent attention (DeepSeek-V3) on the CPU in float32,
 * the reference for latent caches (paper Appendix G).
 *
 * Per token, with H heads, latent width dc, RoPE width dr, content width dn
 * and value width dv:
 *   q      = q_b(rmsnorm(q_a(x)))  (or q_proj(x) without a query low rank),
 *            per head [dn content | dr RoPE]
 *   row    = kv_a(x): [dc latent | dr RoPE key]; the latent RMS-normed
 *   RoPE   on the RoPE parts of q and of the row; with rope_interleave the
 *          pairs (2i, 2i+1) are first moved to (i, i + dr/2), as transformers
 *          does, and stay in that order (q and keys alike, so the dot
 *          products are those of interleaved RoPE)
 *   cache  the row [c | r] of every token, shared by all heads
 * Attention in the absorbed form (one code path for prefill and decode):
 *   q_c    = W_UK_h^T q_content   (W_UK_h: kv_b rows h(dn+dv) .. +dn, [dn][dc])
 *   s_t    = (q_c . c_t + q_rope . r_t) / sqrt(dn + dr), causal softmax
 *   o_h    = W_UV_h (sum_t p_t c_t)  (W_UV_h: the next dv rows of kv_b)
 * which equals transformers' expanded form (keys k = W_UK c, values
 * v = W_UV c) up to float32 summation order.
 *
 * Over a latent cache in FP4 store form (kvcache/kv_cache.h, paper
 * Algorithm 2) the rows hold c' = H (c - mu): the content query is rotated
 * (H q_c), meets the FP4 pages as its dual-residual FP4 terms (exact
 * compute) or in BF16 (bf16 compute), the RoPE scores stay float32, the
 * probabilities are not quantized, and the context sum_t p_t c'_t is rotated
 * back and mu added before W_UV. */
#ifndef FR_MLA_CPU_H
#define FR_MLA_CPU_H

#include "base/fr_status.h"
#include "kvcache/kv_cache.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_mla_cpu fr_mla_cpu;

/* Scratch for steps of up to max_tokens rows (c: the rank's local config). */
fr_status fr_mla_cpu_new(const fr_model_config *c, int max_tokens, fr_mla_cpu **out);
void fr_mla_cpu_destroy(fr_mla_cpu **s);

/* q[M][H*(dn+dr)] and cache rows[M][dc+dr] of xn[M][hidden] (normed input)
 * at positions pos[M]. */
void fr_mla_cpu_project(fr_mla_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *xn, int M,
                        const int *pos, float *q, float *rows);

/* Attention of one sequence's n query rows q[n][H*(dn+dr)] at positions
 * len .. len + n - 1 over the cache rows view->k[len + n][dc+dr] (causal),
 * in the store form `form` describes (NULL: rows as computed, no quantized
 * region): out[n][H*dv]. scores: scratch of at least min(n, 256) x (len + n)
 * floats. */
void fr_mla_cpu_attend(fr_mla_cpu *s, const fr_model_config *c, const fr_layer_weights *lw, const float *q, int len,
                       int n, const fr_kv_view *view, const fr_kv_latent_form *form, float *scores, float *out);

#ifdef __cplusplus
}
#endif

#endif
