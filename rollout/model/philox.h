/* Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3", SC 2011), the generator behind cuRAND's
 * curandStatePhilox4_32_10_t.
 *
 * Counter-based means a draw is a pure function of (counter, key): the sampler
 * needs no RNG state per sample, and a CUDA kernel reproduces the CPU draws bit
 * for bit by evaluating the same function on the same inputs.
 */
#ifndef FR_PHILOX_H
#define FR_PHILOX_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Ten rounds with the standard multipliers 0xD2511F53, 0xCD9E8D57 and Weyl
 * key increments 0x9E3779B9, 0xBB67AE85. Matches the Random123 known-answer
 * vectors (checked in tests/unit/test_sampler.c). */
void fr_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* One uniform float in [0, 1), the exact rule the GPU sampler reproduces:
 *   key     = (seed low 32, seed high 32)
 *   counter = (step low 32, step high 32, sequence low 32, sequence high 32)
 *   u       = (out[0] >> 8) * 2^-24
 * The top 24 bits fit a float's mantissa exactly, so u is a multiple of 2^-24
 * in [0, 1 - 2^-24] with no rounding, on any compiler or device. Only out[0]
 * is used; out[1..3] are discarded. */
float fr_philox_uniform(uint64_t seed, uint64_t sequence, uint64_t step);

#ifdef __cplusplus
}
#endif

#endif
