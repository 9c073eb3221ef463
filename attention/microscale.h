/* Microscaling FP4 block quantizers: NVFP4 (blocks of 16, E4M3 scale) and
 * MXFP4 (blocks of 32, E8M0 scale), with the paper's scale search, packing,
 * and the dual-residual query of Section 3.1.
 *
 * Codes are E2M1 (fp_formats.h). Packed rows hold two codes per byte, element
 * 0 in the low nibble; scales are one byte per block.
 */
#ifndef FR_MICROSCALE_H
#define FR_MICROSCALE_H

#include <stdint.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FR_NVFP4 = 0, FR_MXFP4 = 1 } fr_fp4_format;

#define FR_MAX_FP4_BLOCK 32

/* 16 for NVFP4, 32 for MXFP4. */
int fr_fp4_block_size(fr_fp4_format f);
const char *fr_fp4_format_name(fr_fp4_format f);
/* Parses "nvfp4" / "mxfp4". */
fr_status fr_fp4_format_parse(const char *s, fr_fp4_format *f);

/* The value of a scale code: E4M3 for NVFP4, E8M0 for MXFP4. */
float fr_fp4_scale_value(fr_fp4_format f, uint8_t scale_code);

/* Quantizes one block of fr_fp4_block_size(f) values into unpacked E2M1 codes
 * and returns the scale code.
 *  NVFP4: scale = E4M3(amax / 6); with search also E4M3(amax / 4), keeping the
 *         candidate with the lower sum of squared error, ties to amax / 6.
 *  MXFP4: scale = 2^(floor(log2 amax) - 2) (OCP); with search also the next
 *         power of two, lower squared error wins, ties to the OCP scale.
 * Elements are E2M1(x / scale) with the quotient in float32; a block whose
 * scale is 0 (amax 0, or an E4M3 underflow) is all zeros. NaN elements count
 * as 0; infinities saturate (docs/formats.md). */
uint8_t fr_fp4_quantize_block(fr_fp4_format f, int search, const float *x, uint8_t *codes);

/* Sum over the block of (scale * E2M1(code) - x)^2, accumulated in float32 in
 * element order (the rule the scale search uses; GPU writers repeat it). */
float fr_fp4_block_sse(fr_fp4_format f, uint8_t scale_code, const float *x, const uint8_t *codes);

/* A row of n values (n a multiple of the block size) into packed[n / 2] and
 * scales[n / block]. */
fr_status fr_fp4_quantize_row(fr_fp4_format f, int search, const float *x, int n,
                              uint8_t *packed, uint8_t *scales);
fr_status fr_fp4_dequantize_row(fr_fp4_format f, const uint8_t *packed, const uint8_t *scales,
                                int n, float *out);
/* Quantize then dequantize (what the MMA sees), out may alias x. */
fr_status fr_fp4_fake_quantize(fr_fp4_format f, int search, const float *x, int n, float *out);

/* Dual-residual query (Section 3.1): q1 = Q(x), q2 = Q(x - q1), each with
 * its own scales; out1 and out2 receive the dequantized terms (either may be
 * NULL). x - q1 is formed in float32. */
fr_status fr_fp4_quantize_dual(fr_fp4_format f, int search, const float *x, int n,
                               float *out1, float *out2);

/* Two codes per byte, element 0 in the low nibble; n even. The interchange
 * form of `fp4rollout quant`; cache pages use the code words below. */
void fr_fp4_pack(const uint8_t *codes, int n, uint8_t *packed);
void fr_fp4_unpack(const uint8_t *packed, int n, uint8_t *codes);

/* Eight codes as one 32-bit code word of a cache page (docs/formats.md,
 * "FP4 code words"): elements 0-3 in the low half, 4-7 in the high half,
 * each half's signs in bits 15..12 and magnitudes in bits 11..0, placed so
 * that four AND / shift / multiply-add steps turn a word into FP16 pairs.
 * Stored little-endian. The eight codes must share one scale block. */
uint32_t fr_fp4_word_pack(const uint8_t codes[8]);
void fr_fp4_word_unpack(uint32_t word, uint8_t codes[8]);

/* n codes (a multiple of 8) as n / 8 little-endian code words at out. */
void fr_fp4_words_store(const uint8_t *codes, int n, uint8_t *out);
/* n codes from n / 8 little-endian code words at in. */
void fr_fp4_words_load(const uint8_t *in, int n, uint8_t *codes);

#ifdef __cplusplus
}
#endif

#endif
