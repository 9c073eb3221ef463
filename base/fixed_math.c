#include "base/fixed_math.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Constants as exact doubles (hexadecimal), so no decimal conversion can
 * differ between compilers. LN2_HI has its low 11 bits zero, so n * LN2_HI
 * is exact for every exponent n a double can have. */
static const double LN2 = 0x1.62e42fefa39efp-1;
static const double LOG2E = 0x1.71547652b82fep+0;
static const double LN2_HI = 0x1.62e42fefa3800p-1;
static const double LN2_LO = 0x1.ef35793c7673p-45;
/* pi/2 in three parts of 30 significant bits or fewer: k * PIO2_1 and
 * k * PIO2_2 are exact for quadrant counts k below 2^23. */
static const double PIO2_1 = 0x1.921fb54000000p+0;
static const double PIO2_2 = 0x1.10b4611800000p-30;
static const double PIO2_3 = 0x1.313198a2e0370p-61;
static const double TWO_OVER_PI = 0x1.45f306dc9c883p-1;

/* e^r for |r| <= ln(2)/2, by its Taylor series to r^13: the first term left
 * out is below 4e-18, under half an ulp of the result. Horner's rule in a
 * fixed order. */
static double exp_reduced(double r)
{
    double p = 1.0 / 6227020800.0;                  /* 1/13! */
    static const double inv_fact[13] = {
        1.0, 1.0, 1.0 / 2.0, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0,
        1.0 / 40320.0, 1.0 / 362880.0, 1.0 / 3628800.0, 1.0 / 39916800.0, 1.0 / 479001600.0,
    };
    for (int i = 12; i >= 0; i--) p = p * r + inv_fact[i];
    return p;
}

/* 2^n * y, also where 2^n alone would overflow or underflow. */
static double scale2(double y, double n)
{
    if (n >= -1022.0 && n <= 1023.0) {   /* 2^n is a normal double: build it */
        uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
        double p;
        memcpy(&p, &bits, sizeof p);
        return y * p;
    }
    if (n > 2000.0) return y * INFINITY;
    if (n < -2200.0) return y * 0.0;
    return ldexp(y, (int)n);
}

double fr_exp2(double x)
{
    if (x != x) return x;
    if (x > 1100.0) return INFINITY;
    if (x < -1100.0) return 0.0;
    double n = floor(x + 0.5);
    double f = x - n;                  /* exact: |f| <= 1/2 */
    return scale2(exp_reduced(f * LN2), n);
}

double fr_exp(double x)
{
    if (x != x) return x;
    if (x > 760.0) return INFINITY;
    if (x < -760.0) return 0.0;
    double n = floor(x * LOG2E + 0.5);
    double r = (x - n * LN2_HI) - n * LN2_LO;
    return scale2(exp_reduced(r), n);
}

/* log(m) for m in [sqrt(1/2), sqrt(2)]: 2 atanh(s) with s = (m - 1) / (m + 1),
 * |s| <= 0.172, by its series to s^21 (the rest is below 4e-18). */
static double log_reduced(double m)
{
    double s = (m - 1.0) / (m + 1.0);
    double z = s * s;
    double p = 1.0 / 21.0;
    for (int k = 9; k >= 0; k--) p = p * z + 1.0 / (double)(2 * k + 1);
    return 2.0 * s * p;
}

/* x = m * 2^e with m in [sqrt(1/2), sqrt(2)); x finite and > 0. */
static double split_log(double x, int *e)
{
    double m = frexp(x, e);            /* [1/2, 1) */
    if (m < 0x1.6a09e667f3bcdp-1) {    /* sqrt(1/2) */
        m *= 2.0;
        --*e;
    }
    return m;
}

/* The arguments log and log2 answer without computing; 1 when *r is set. */
static int log_special(double x, double *r)
{
    if (x != x || x < 0.0) *r = NAN;
    else if (x == 0.0) *r = -INFINITY;
    else if (x == INFINITY) *r = x;
    else return 0;
    return 1;
}

double fr_log(double x)
{
    double r;
    if (log_special(x, &r)) return r;
    int e;
    double lm = log_reduced(split_log(x, &e));
    return (double)e * LN2_HI + (lm + (double)e * LN2_LO);
}

double fr_log2(double x)
{
    double r;
    if (log_special(x, &r)) return r;
    int e;
    double lm = log_reduced(split_log(x, &e));
    return (double)e + lm * LOG2E;
}

float fr_powf(float b, float e)
{
    if (!(b > 0.0f)) return NAN;
    return (float)fr_exp2((double)e * fr_log2((double)b));
}

/* sin and cos of r, |r| <= pi/4, by their Taylor series to r^19 and r^20
 * (the rest is below 1e-19). */
static double sin_reduced(double r)
{
    static const double c[9] = {   /* (-1)^k / (2k+1)!, k = 1..9 */
        -1.0 / 6.0, 1.0 / 120.0, -1.0 / 5040.0, 1.0 / 362880.0, -1.0 / 39916800.0,
        1.0 / 6227020800.0, -1.0 / 1307674368000.0, 1.0 / 355687428096000.0,
        -1.0 / 121645100408832000.0,
    };
    double z = r * r, p = c[8];
    for (int k = 7; k >= 0; k--) p = p * z + c[k];
    return r + r * (z * p);
}

static double cos_reduced(double r)
{
    static const double c[10] = {  /* (-1)^k / (2k)!, k = 1..10 */
        -1.0 / 2.0, 1.0 / 24.0, -1.0 / 720.0, 1.0 / 40320.0, -1.0 / 3628800.0,
        1.0 / 479001600.0, -1.0 / 87178291200.0, 1.0 / 20922789888000.0,
        -1.0 / 6402373705728000.0, 1.0 / 2432902008176640000.0,
    };
    double z = r * r, p = c[9];
    for (int k = 8; k >= 0; k--) p = p * z + c[k];
    return 1.0 + z * p;
}

void fr_sincos(double x, double *s, double *c)
{
    if (x != x || x == INFINITY || x == -INFINITY) {
        *s = *c = NAN;
        return;
    }
    double k = floor(x * TWO_OVER_PI + 0.5);
    double r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3;
    double sr = sin_reduced(r), cr = cos_reduced(r);
    switch ((long long)k & 3) {   /* the quadrant, also for negative k */
    case 0: *s = sr; *c = cr; break;
    case 1: *s = cr; *c = -sr; break;
    case 2: *s = -sr; *c = -cr; break;
    default: *s = -cr; *c = sr; break;
    }
}
