#include "hadamard.h"

#include <math.h>

fr_status fr_hadamard(float *x, int n)
{
    if (!x) return fr_fail(FR_EINVAL, "hadamard: NULL vector");
    if (n < 1 || n > FR_HADAMARD_MAX || (n & (n - 1)))
        return fr_fail(FR_EINVAL, "hadamard: size %d is not a power of two in [1, %d]", n,
                       FR_HADAMARD_MAX);
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    /* One scaling at the end keeps the butterflies exact for small inputs;
     * 1/sqrt(n) is exact for even log2(n) and correctly rounded otherwise. */
    float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= s;
    return FR_OK;
}
