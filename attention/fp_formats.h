/* Scalar number formats of the KV cache: E2M1 (FP4 elements), E4M3 (NVFP4
 * block scales and FP8 KV), E8M0 (MXFP4 block scales) and BF16.
 *
 * Every encoder rounds to nearest with ties to the even code and saturates;
 * the exact rules, including NaN and infinity, are in docs/formats.md. The GPU
 * kernels must reproduce these functions bit for bit.
 */
#ifndef FR_FP_FORMATS_H
#define FR_FP_FORMATS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FR_E2M1_MAX 6.0f
#define FR_E4M3_MAX 448.0f
#define FR_E4M3_NAN 0x7Fu   /* the canonical E4M3 NaN code (0xFF is NaN too) */
#define FR_E8M0_NAN 0xFFu

/* E2M1: 1 sign bit, 2 exponent bits, 1 mantissa bit; magnitudes
 * 0, 0.5, 1, 1.5, 2, 3, 4, 6. Code bit 3 is the sign. NaN encodes as +0
 * (E2M1 has no NaN); magnitudes above 6, infinity included, saturate to 6. */
uint8_t fr_e2m1_encode(float x);
float fr_e2m1_decode(uint8_t code);

/* E4M3 (OCP "FN" variant): bias 7, finite only, max 448, subnormals
 * m * 2^-9. Saturates to +-448 (infinity too); NaN encodes as 0x7F. */
uint8_t fr_e4m3_encode(float x);
float fr_e4m3_decode(uint8_t code);
/* E4M3 rounding as a float: fr_e4m3_decode(fr_e4m3_encode(x)). */
float fr_e4m3_round(float x);

/* E8M0: an unsigned power of two 2^(code - 127), code 0..254; 255 is NaN.
 * fr_e8m0_from_exp clamps the exponent to [-127, 127]. */
uint8_t fr_e8m0_from_exp(int e);
float fr_e8m0_decode(uint8_t code);

/* BF16: round to nearest even; NaN stays NaN (quiet). */
uint16_t fr_bf16_encode(float x);
float fr_bf16_decode(uint16_t h);
float fr_bf16_round(float x);

/* floor(log2(|x|)) for finite x != 0, exact (no log2f rounding). */
int fr_floor_log2(float x);

#ifdef __cplusplus
}
#endif

#endif
