#include "prob_quant.h"

#include "fp_formats.h"

fr_pquant_params fr_pquant_default(void)
{
    return (fr_pquant_params){.underflow_aware = 1, .c = FR_P_SCALE_C, .tau = FR_P_TAU};
}

fr_pquant_params fr_pquant_plain(void)
{
    return (fr_pquant_params){.underflow_aware = 0, .c = 1.0f, .tau = 0.0f};
}

uint8_t fr_pquant_scale(fr_fp4_format f, const fr_pquant_params *pp, float p_max)
{
    float cmax = pp->c * p_max;
    if (f == FR_MXFP4)
        return cmax > 0.0f ? fr_e8m0_from_exp(fr_floor_log2(cmax) - 2) : fr_e8m0_from_exp(-127);
    float kappa = (pp->underflow_aware && cmax <= pp->tau) ? 2.0f : 6.0f;
    return fr_e4m3_encode(cmax / kappa);
}

float fr_pquant_block(fr_fp4_format f, const fr_pquant_params *pp, const float *cp, float p_max,
                      float *out)
{
    uint8_t code = fr_pquant_scale(f, pp, p_max);
    float s = fr_fp4_scale_value(f, code);
    int n = fr_fp4_block_size(f);
    for (int i = 0; i < n; i++) out[i] = s > 0.0f ? s * fr_e2m1_decode(fr_e2m1_encode(cp[i] / s)) : 0.0f;
    return s;
}
