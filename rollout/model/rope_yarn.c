#include "rollout/model/rope_yarn.h"

#include <math.h>

#include "base/fixed_math.h"

double fr_yarn_mscale(double factor, double m)
{
    return factor <= 1.0 ? 1.0 : 0.1 * m * fr_log(factor) + 1.0;
}

/* math.pi, spelled out: M_PI is not C11. */
static const double PI = 3.141592653589793;

/* The pair index whose wavelength turns `rotations` times in the original
 * window. */
static double correction_dim(double rotations, int dim, double theta, int original)
{
    return (double)dim * fr_log((double)original / (rotations * 2.0 * PI)) / (2.0 * fr_log(theta));
}

void fr_yarn_range(const fr_rope_scaling *y, int dim, double theta, double *low, double *high)
{
    double lo = correction_dim(y->beta_fast, dim, theta, y->original_max_position);
    double hi = correction_dim(y->beta_slow, dim, theta, y->original_max_position);
    if (y->truncate) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    *low = lo > 0.0 ? lo : 0.0;
    *high = hi < (double)(dim - 1) ? hi : (double)(dim - 1);
}

void fr_rope_inv_freq(float *out, int i0, int len, int dim, double theta, const fr_rope_scaling *y)
{
    const float base = (float)theta;
    const int yarn = y && y->yarn;
    double low = 0.0, high = 0.0;
    if (yarn) {
        fr_yarn_range(y, dim, theta, &low, &high);
        if (low == high) high += 0.001;
    }
    const float flow = (float)low, width = (float)(high - low), factor = yarn ? (float)y->factor : 1.0f;
    for (int j = 0; j < len; j++) {
        const float pf = fr_powf(base, (float)(2 * (i0 + j)) / (float)dim);
        const float extra = 1.0f / pf;
        if (!yarn) {
            out[j] = extra;
            continue;
        }
        const float inter = 1.0f / (factor * pf);
        float ramp = ((float)(i0 + j) - flow) / width;
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        const float e = 1.0f - ramp;
        const float ie = inter * (1.0f - e), ee = extra * e;
        out[j] = ie + ee;
    }
}

double fr_rope_attention_factor(const fr_rope_scaling *y)
{
    if (!y || !y->yarn) return 1.0;
    if (y->attention_factor > 0.0) return y->attention_factor;
    if (y->mscale != 0.0 && y->mscale_all_dim != 0.0)
        return fr_yarn_mscale(y->factor, y->mscale) / fr_yarn_mscale(y->factor, y->mscale_all_dim);
    return fr_yarn_mscale(y->factor, 1.0);
}

float fr_mla_softmax_scale(const fr_model_config *c)
{
    const int qh = c->qk_nope_dim + c->qk_rope_dim;
    const fr_rope_scaling *y = &c->rope_scaling;
    if (!y->yarn || y->mscale_all_dim == 0.0) return 1.0f / sqrtf((float)qh);
    const double m = fr_yarn_mscale(y->factor, y->mscale_all_dim);
    return (float)(1.0 / sqrt((double)qh) * m * m);
}
