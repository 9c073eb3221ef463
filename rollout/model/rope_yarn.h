/* rope_yarn: the RoPE frequencies and scales of a model's RoPE scaling,
 * plain or YaRN (docs/mla.md, "YaRN"), as transformers computes them
 * (_compute_yarn_parameters, and DeepSeek's softmax-scale correction).
 *
 * For a rotary width dim (head_dim for Qwen3, qk_rope_head_dim for latent
 * attention) and pair i < dim/2, in float32 unless said:
 *   pf_i    = powf((float)theta, (float)(2i) / (float)dim)
 *   plain   inv_freq_i = 1 / pf_i
 *   YaRN    extra_i = 1 / pf_i, inter_i = 1 / ((float)factor * pf_i),
 *           ramp_i  = clamp(((float)i - (float)low) / (float)(high - low), 0, 1),
 *           e_i     = 1 - ramp_i,
 *           inv_freq_i = inter_i * (1 - e_i) + extra_i * e_i
 * with the correction range (double) low = d(beta_fast), high = d(beta_slow),
 *   d(r) = dim * ln(original_max_position / (2 pi r)) / (2 ln theta),
 * floored and ceiled when truncate, then low >= 0 and high <= dim - 1 (high
 * gains 0.001 when equal to low). So pairs below low keep the trained
 * frequency and pairs above high are interpolated by factor.
 * Logarithms are base/fixed_math.h's, the same bits on every CPU.
 */
#ifndef FR_ROPE_YARN_H
#define FR_ROPE_YARN_H

#include "rollout/model/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* YaRN's mscale: 0.1 * m * ln(factor) + 1, or 1 when factor <= 1. */
double fr_yarn_mscale(double factor, double m);

/* The correction range above (y must be YaRN). */
void fr_yarn_range(const fr_rope_scaling *y, int dim, double theta, double *low, double *high);

/* inv_freq of pairs i0 .. i0 + len - 1 into out[0, len). y NULL or not
 * YaRN: plain RoPE, bit for bit the frequencies of unscaled RoPE. */
void fr_rope_inv_freq(float *out, int i0, int len, int dim, double theta, const fr_rope_scaling *y);

/* The factor on cos and sin (transformers' attention_factor): the one the
 * config gives, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
 * when both are set (DeepSeek), else mscale(factor, 1); 1 for plain RoPE. */
double fr_rope_attention_factor(const fr_rope_scaling *y);

/* The softmax scale of latent attention: 1 / sqrtf(qk_nope + qk_rope), and
 * with YaRN and mscale_all_dim set, (float)(mscale(factor,
 * mscale_all_dim)^2 / sqrt(qk_nope + qk_rope)) in double (DeepSeek-V2/V3's
 * correction; Qwen3's attention has none). */
float fr_mla_softmax_scale(const fr_model_config *c);

#ifdef __cplusplus
}
#endif

#endif
