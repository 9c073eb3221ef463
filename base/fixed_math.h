/* Elementary functions of the engine's own, for the CPU forward pass and
 * the sampler.
 *
 * The C library picks code paths for exp, log, pow, sin and cos by CPU
 * features at load time (with or without FMA, say), and those paths may
 * round the last bit differently, so the same program on two x86-64 CPUs
 * could draw different tokens. These use only IEEE basic operations
 * (+, -, *, /, which round the same everywhere; the build forbids FMA
 * contraction) and exact helpers (floor, frexp, ldexp), so they give the
 * same bits on every CPU. They are accurate to a few units in the last
 * place of a double, so the float versions are almost always the correctly
 * rounded value (docs/determinism.md).
 */
#ifndef FR_FIXED_MATH_H
#define FR_FIXED_MATH_H

#ifdef __cplusplus
extern "C" {
#endif

double fr_exp(double x);
double fr_exp2(double x);
/* log and log2: -inf at 0, NaN below 0, +inf at +inf. */
double fr_log(double x);
double fr_log2(double x);
/* sin and cos of x in one call. Arguments beyond about 1e7 lose accuracy
 * (never bitwise reproducibility); the engine's angles stay far below. */
void fr_sincos(double x, double *s, double *c);

static inline float fr_expf(float x) { return (float)fr_exp((double)x); }
static inline float fr_exp2f(float x) { return (float)fr_exp2((double)x); }
static inline float fr_logf(float x) { return (float)fr_log((double)x); }
/* b^e for b > 0 (RoPE's frequencies); NaN for b <= 0. */
float fr_powf(float b, float e);

#ifdef __cplusplus
}
#endif

#endif
