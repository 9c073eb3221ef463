/* Probability quantization for the P.V product (paper Section 3.2, Eq. 4).
 *
 * Online softmax hands over a block of B keys (16 for NVFP4, 32 for MXFP4)
 * whose probabilities already carry the factor c, folded into the exponent:
 * cp_i = 2^(S_i - m + log2 c), together with the block maximum without c,
 * p_max = 2^(max_b S - m).
 *  underflow-aware: kappa = 2 if p_max <= tau / c else 6; scale = c p_max / kappa
 *  plain:           c = 1, kappa = 6; scale = p_max / 6
 * NVFP4 rounds the scale to E4M3 (where the underflow happens); MXFP4 uses the
 * OCP power of two of c p_max (E8M0 cannot underflow at these magnitudes, so
 * kappa plays no part). Elements are E2M1(cp_i / scale).
 */
#ifndef FR_PROB_QUANT_H
#define FR_PROB_QUANT_H

#include "microscale.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_P_SCALE_C 8.0f
#define FR_P_TAU (21.0f / 1024.0f)

typedef struct {
    int underflow_aware; /* 0: plain rule (c must then be 1) */
    float c;             /* the factor folded into exp2, 8 in the paper */
    float tau;           /* threshold on c * p_max, 21/1024 unless calibrated */
} fr_pquant_params;

/* The default underflow-aware parameters (c = 8, tau = 21/1024) and the plain rule. */
fr_pquant_params fr_pquant_default(void);
fr_pquant_params fr_pquant_plain(void);

/* Scale code for a block with maximum p_max (without c). */
uint8_t fr_pquant_scale(fr_fp4_format f, const fr_pquant_params *pp, float p_max);

/* Quantizes cp[n] (n = block size) with the scale for p_max, writing the
 * dequantized values (what the MMA multiplies) to out[n]; returns the scale. */
float fr_pquant_block(fr_fp4_format f, const fr_pquant_params *pp, const float *cp, float p_max,
                      float *out);

#ifdef __cplusplus
}
#endif

#endif
