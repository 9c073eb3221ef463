#include "fp_formats.h"

#include <math.h>
#include <string.h>

static const float e2m1_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

uint8_t fr_e2m1_encode(float x)
{
    if (isnan(x)) return 0;
    uint8_t sign = signbit(x) ? 0x8 : 0x0;
    float a = fabsf(x);
    /* Thresholds are the midpoints between neighbours; a midpoint goes to the
     * even code (codes 0, 2, 4, 6 sit at 0, 1, 2, 4), hence <= vs <. */
    uint8_t m = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
              : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
    return sign | m;
}

float fr_e2m1_decode(uint8_t code)
{
    float v = e2m1_values[code & 0x7];
    return (code & 0x8) ? -v : v;
}

int fr_floor_log2(float x)
{
    int e;
    frexpf(x, &e);      /* |x| = m * 2^e with m in [0.5, 1) */
    return e - 1;
}

uint8_t fr_e4m3_encode(float x)
{
    if (isnan(x)) return FR_E4M3_NAN;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= FR_E4M3_MAX) return sign | 0x7E;
    if (a == 0.0f) return sign;
    int e = fr_floor_log2(a);
    if (e < -6) e = -6;                 /* subnormal range shares the 2^-9 step */
    /* Scaling by a power of two is exact, and rintf rounds half to even in the
     * default rounding mode, so q is the correctly rounded mantissa count. */
    float q = rintf(ldexpf(a, 3 - e));  /* in [0, 16] */
    /* Normal codes are ((e + 7) << 3) | (q - 8); q == 16 carries into the
     * exponent, and the subnormal case (e == -6, q < 8) falls out as code q. */
    int code = ((e + 6) << 3) + (int)q;
    if (code > 0x7E) code = 0x7E;
    return sign | (uint8_t)code;
}

float fr_e4m3_decode(uint8_t code)
{
    int exp = (code >> 3) & 0xF, man = code & 0x7;
    if (exp == 0xF && man == 0x7) return NAN;
    float v = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.0f + man / 8.0f, exp - 7);
    return (code & 0x80) ? -v : v;
}

float fr_e4m3_round(float x) { return fr_e4m3_decode(fr_e4m3_encode(x)); }

uint8_t fr_e8m0_from_exp(int e)
{
    if (e < -127) e = -127;
    if (e > 127) e = 127;
    return (uint8_t)(e + 127);
}

float fr_e8m0_decode(uint8_t code)
{
    return code == FR_E8M0_NAN ? NAN : ldexpf(1.0f, (int)code - 127);
}

uint16_t fr_bf16_encode(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

float fr_bf16_decode(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

float fr_bf16_round(float x) { return fr_bf16_decode(fr_bf16_encode(x)); }
