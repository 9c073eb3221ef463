#include "microscale.h"

#include <math.h>
#include <string.h>

#include "fp_formats.h"

int fr_fp4_block_size(fr_fp4_format f) { return f == FR_MXFP4 ? 32 : 16; }

const char *fr_fp4_format_name(fr_fp4_format f) { return f == FR_MXFP4 ? "mxfp4" : "nvfp4"; }

fr_status fr_fp4_format_parse(const char *s, fr_fp4_format *f)
{
    if (s && strcmp(s, "nvfp4") == 0) { *f = FR_NVFP4; return FR_OK; }
    if (s && strcmp(s, "mxfp4") == 0) { *f = FR_MXFP4; return FR_OK; }
    return fr_fail(FR_EINVAL, "unknown FP4 format '%s' (expected nvfp4 or mxfp4)", s ? s : "(null)");
}

float fr_fp4_scale_value(fr_fp4_format f, uint8_t code)
{
    return f == FR_MXFP4 ? fr_e8m0_decode(code) : fr_e4m3_decode(code);
}

/* Largest magnitude, NaN ignored (fmaxf returns the other operand). */
static float block_amax(const float *x, int n)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

static void encode_block(fr_fp4_format f, uint8_t scale_code, const float *x, uint8_t *codes)
{
    int n = fr_fp4_block_size(f);
    float s = fr_fp4_scale_value(f, scale_code);
    for (int i = 0; i < n; i++)
        codes[i] = s > 0.0f ? fr_e2m1_encode(x[i] / s) : 0;
}

float fr_fp4_block_sse(fr_fp4_format f, uint8_t scale_code, const float *x, const uint8_t *codes)
{
    int n = fr_fp4_block_size(f);
    float s = fr_fp4_scale_value(f, scale_code), sse = 0.0f;
    for (int i = 0; i < n; i++) {
        float xi = isnan(x[i]) ? 0.0f : x[i];
        float e = s * fr_e2m1_decode(codes[i]) - xi;
        sse += e * e;
    }
    return sse;
}

static uint8_t standard_scale(fr_fp4_format f, float amax)
{
    if (f == FR_NVFP4) return fr_e4m3_encode(amax / 6.0f);
    if (amax == 0.0f) return fr_e8m0_from_exp(-127);
    if (isinf(amax)) return fr_e8m0_from_exp(127);
    return fr_e8m0_from_exp(fr_floor_log2(amax) - 2);
}

static uint8_t alternative_scale(fr_fp4_format f, float amax, uint8_t standard)
{
    if (f == FR_NVFP4) return fr_e4m3_encode(amax / 4.0f);
    return standard < 254 ? (uint8_t)(standard + 1) : standard;
}

uint8_t fr_fp4_quantize_block(fr_fp4_format f, int search, const float *x, uint8_t *codes)
{
    float amax = block_amax(x, fr_fp4_block_size(f));
    uint8_t s0 = standard_scale(f, amax);
    encode_block(f, s0, x, codes);
    if (!search) return s0;
    uint8_t s1 = alternative_scale(f, amax, s0);
    if (s1 == s0) return s0;
    uint8_t alt[FR_MAX_FP4_BLOCK];
    encode_block(f, s1, x, alt);
    if (fr_fp4_block_sse(f, s1, x, alt) < fr_fp4_block_sse(f, s0, x, codes)) {
        memcpy(codes, alt, (size_t)fr_fp4_block_size(f));
        return s1;
    }
    return s0;
}

static fr_status check_row(fr_fp4_format f, const void *x, int n)
{
    if (!x) return fr_fail(FR_EINVAL, "%s: NULL buffer", fr_fp4_format_name(f));
    if (n <= 0 || n % fr_fp4_block_size(f) != 0)
        return fr_fail(FR_EINVAL, "%s: row length %d is not a positive multiple of the block size %d",
                       fr_fp4_format_name(f), n, fr_fp4_block_size(f));
    return FR_OK;
}

fr_status fr_fp4_quantize_row(fr_fp4_format f, int search, const float *x, int n,
                              uint8_t *packed, uint8_t *scales)
{
    fr_status st = check_row(f, x, n);
    if (st) return st;
    int b = fr_fp4_block_size(f);
    uint8_t codes[FR_MAX_FP4_BLOCK];
    for (int i = 0; i < n / b; i++) {
        scales[i] = fr_fp4_quantize_block(f, search, x + i * b, codes);
        fr_fp4_pack(codes, b, packed + i * b / 2);
    }
    return FR_OK;
}

fr_status fr_fp4_dequantize_row(fr_fp4_format f, const uint8_t *packed, const uint8_t *scales,
                                int n, float *out)
{
    fr_status st = check_row(f, packed, n);
    if (st) return st;
    int b = fr_fp4_block_size(f);
    for (int i = 0; i < n; i++) {
        uint8_t byte = packed[i / 2];
        uint8_t code = (i & 1) ? byte >> 4 : byte & 0xF;
        out[i] = fr_fp4_scale_value(f, scales[i / b]) * fr_e2m1_decode(code);
    }
    return FR_OK;
}

fr_status fr_fp4_fake_quantize(fr_fp4_format f, int search, const float *x, int n, float *out)
{
    fr_status st = check_row(f, x, n);
    if (st) return st;
    int b = fr_fp4_block_size(f);
    uint8_t codes[FR_MAX_FP4_BLOCK];
    for (int i = 0; i < n; i += b) {
        float s = fr_fp4_scale_value(f, fr_fp4_quantize_block(f, search, x + i, codes));
        for (int j = 0; j < b; j++) out[i + j] = s * fr_e2m1_decode(codes[j]);
    }
    return FR_OK;
}

fr_status fr_fp4_quantize_dual(fr_fp4_format f, int search, const float *x, int n,
                               float *out1, float *out2)
{
    fr_status st = check_row(f, x, n);
    if (st) return st;
    int b = fr_fp4_block_size(f);
    float q1[FR_MAX_FP4_BLOCK], r[FR_MAX_FP4_BLOCK], q2[FR_MAX_FP4_BLOCK];
    for (int i = 0; i < n; i += b) {
        fr_fp4_fake_quantize(f, search, x + i, b, q1);
        for (int j = 0; j < b; j++) r[j] = (isnan(x[i + j]) ? 0.0f : x[i + j]) - q1[j];
        fr_fp4_fake_quantize(f, search, r, b, q2);
        if (out1) memcpy(out1 + i, q1, sizeof(float) * (size_t)b);
        if (out2) memcpy(out2 + i, q2, sizeof(float) * (size_t)b);
    }
    return FR_OK;
}

void fr_fp4_pack(const uint8_t *codes, int n, uint8_t *packed)
{
    for (int i = 0; i < n; i += 2)
        packed[i / 2] = (uint8_t)((codes[i] & 0xF) | ((codes[i + 1] & 0xF) << 4));
}

void fr_fp4_unpack(const uint8_t *packed, int n, uint8_t *codes)
{
    for (int i = 0; i < n; i += 2) {
        codes[i] = packed[i / 2] & 0xF;
        codes[i + 1] = packed[i / 2] >> 4;
    }
}

/* Bit positions of one half's four codes (element order 0, 1, 2, 3 of the
 * half): sign bit and lowest magnitude bit. Element 0 and 2 (the A and B
 * slots) and 1 and 3 (C and D) are the pairs the GPU unpacks together. */
static const int word_sign_bit[4] = {15, 14, 12, 13};
static const int word_mag_bit[4] = {9, 0, 6, 3};

uint32_t fr_fp4_word_pack(const uint8_t codes[8])
{
    uint32_t w = 0;
    for (int e = 0; e < 8; e++) {
        const int h = 16 * (e >> 2), s = e & 3;
        const uint32_t c = codes[e] & 0xFu;
        w |= ((c >> 3) << (h + word_sign_bit[s])) | ((c & 7u) << (h + word_mag_bit[s]));
    }
    return w;
}

void fr_fp4_word_unpack(uint32_t word, uint8_t codes[8])
{
    for (int e = 0; e < 8; e++) {
        const int h = 16 * (e >> 2), s = e & 3;
        codes[e] = (uint8_t)((((word >> (h + word_sign_bit[s])) & 1u) << 3) | ((word >> (h + word_mag_bit[s])) & 7u));
    }
}

void fr_fp4_words_store(const uint8_t *codes, int n, uint8_t *out)
{
    for (int i = 0; i < n; i += 8) {
        const uint32_t w = fr_fp4_word_pack(codes + i);
        for (int b = 0; b < 4; b++) out[i / 2 + b] = (uint8_t)(w >> (8 * b));
    }
}

void fr_fp4_words_load(const uint8_t *in, int n, uint8_t *codes)
{
    for (int i = 0; i < n; i += 8) {
        const uint32_t w = (uint32_t)in[i / 2] | ((uint32_t)in[i / 2 + 1] << 8) | ((uint32_t)in[i / 2 + 2] << 16) |
                           ((uint32_t)in[i / 2 + 3] << 24);
        fr_fp4_word_unpack(w, codes + i);
    }
}
