/* Normalized fast Walsh-Hadamard transform (Sylvester order), used to rotate
 * keys and queries before FP4 quantization (paper Section 3.3, Eq. 5). The
 * matrix H / sqrt(n) is symmetric and orthonormal, so applying it twice is
 * the identity and inner products are preserved. */
#ifndef FR_HADAMARD_H
#define FR_HADAMARD_H

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_HADAMARD_MAX 512

/* In place on x[n], n a power of two from 1 to 512. */
fr_status fr_hadamard(float *x, int n);

#ifdef __cplusplus
}
#endif

#endif
