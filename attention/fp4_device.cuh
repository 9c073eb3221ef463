/* Device versions of the KV cache's number formats, FP4 block quantizers and
 * normalized Hadamard transform: bit for bit the functions of fp_formats.c,
 * microscale.c and hadamard.c (rules in docs/formats.md), so pages the GPU
 * writes equal the pages the CPU writes byte for byte.
 *
 * How bit-exactness is kept:
 *  - nvcc contracts a * b + c into one fused multiply-add by default, which
 *    rounds once where the C code (built with -ffp-contract=off) rounds twice.
 *    Every float operation whose rounding reaches a result is therefore
 *    written with __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / __fsqrt_rn,
 *    which the compiler never fuses or reassociates.
 *  - Operations run in the C code's order (the block error is summed in
 *    float32, element 0 first; the Hadamard butterflies run h = 1, 2, 4, ...),
 *    with the same tie rules (E2M1 and E4M3 ties to the even code, the scale
 *    search keeps the standard scale on a tie).
 *  - Exact steps are done on the bits (floor(log2), powers of two, decoding),
 *    where the C code's library calls (frexpf, ldexpf) are exact too.
 *  - No library function whose device accuracy differs from the host's
 *    (log2f, exp2f, ...) appears anywhere.
 *
 * Everything is __device__ and inline: include this header from the .cu
 * files that quantize (the cache's store path, the FP4 attention kernels).
 */
#ifndef FR_FP4_DEVICE_CUH
#define FR_FP4_DEVICE_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#include "fp_formats.h"
#include "microscale.h"

/* Fast math flushes subnormals and approximates division and square roots:
 * E4M3 subnormal scales, tiny blocks and 1/sqrt(n) would then differ from
 * the C code. */
#if defined(__USE_FAST_MATH__)
#error "fp4_device.cuh needs IEEE float32 (no --use_fast_math): the quantizers must match the C code bit for bit"
#endif

#define FR_DEV __device__ __forceinline__

/* ---- float bits ---- */

FR_DEV bool fr_dev_isnan(float x) { return x != x; }

FR_DEV bool fr_dev_signbit(float x) { return (__float_as_uint(x) >> 31) != 0; }

/* 2^k for k in the normal range [-126, 127]: built from the bits, so it is
 * exact without relying on the accuracy of a device exp2f. */
FR_DEV float fr_dev_exp2i(int k) { return __uint_as_float((uint32_t)(k + 127) << 23); }

/* floor(log2(|x|)) for finite x != 0, read off the exponent bits (what
 * frexpf gives the C code), subnormals included. */
FR_DEV int fr_dev_floor_log2(float x)
{
    uint32_t u = __float_as_uint(x) & 0x7FFFFFFFu;
    int biased = (int)(u >> 23);
    if (biased) return biased - 127;
    return (31 - __clz((int)u)) - 149;   /* subnormal: u * 2^-149 */
}

/* ---- BF16 ---- */

/* Round to nearest even on the bits, as fr_bf16_encode; NaN stays a quiet NaN. */
FR_DEV uint16_t fr_dev_bf16_encode(float x)
{
    uint32_t u = __float_as_uint(x);
    if (fr_dev_isnan(x)) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

FR_DEV float fr_dev_bf16_decode(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

FR_DEV float fr_dev_bf16_round(float x) { return fr_dev_bf16_decode(fr_dev_bf16_encode(x)); }

/* ---- E2M1 ---- */

/* Nearest magnitude with ties to the even code: the thresholds are the
 * midpoints, <= where the lower neighbour has the even code, < where the
 * upper one has. Comparisons only, so nothing can round differently. */
FR_DEV uint8_t fr_dev_e2m1_encode(float x)
{
    if (fr_dev_isnan(x)) return 0;
    const uint8_t sign = fr_dev_signbit(x) ? 0x8 : 0x0;
    const float a = fabsf(x);
    const uint8_t m = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
                    : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
    return sign | m;
}

/* Built from the bits instead of a table, so no local-memory array is
 * needed: codes 2..7 are (1 + m/2) * 2^(e-1), code 1 is 0.5. Code 8 gives
 * -0.0, as the C table does. */
FR_DEV float fr_dev_e2m1_decode(uint8_t code)
{
    const uint32_t e = (code >> 1) & 3u, m = code & 1u;
    const uint32_t mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
    return __uint_as_float(mag | ((uint32_t)(code & 0x8) << 28));
}

/* ---- E4M3 ---- */

FR_DEV uint8_t fr_dev_e4m3_encode(float x)
{
    if (fr_dev_isnan(x)) return (uint8_t)FR_E4M3_NAN;
    const uint8_t sign = fr_dev_signbit(x) ? 0x80 : 0x00;
    const float a = fabsf(x);
    if (a >= FR_E4M3_MAX) return sign | 0x7E;
    if (a == 0.0f) return sign;
    int e = fr_dev_floor_log2(a);
    if (e < -6) e = -6;   /* the subnormal range shares the 2^-9 step */
    /* a * 2^(3-e) is exact (3 - e lies in [-5, 9]); __float2int_rn rounds
     * half to even like rintf, giving the mantissa count in [0, 16]. */
    const int q = __float2int_rn(__fmul_rn(a, fr_dev_exp2i(3 - e)));
    /* q == 16 carries into the exponent; e == -6 with q < 8 is a subnormal. */
    int code = ((e + 6) << 3) + q;
    if (code > 0x7E) code = 0x7E;
    return sign | (uint8_t)code;
}

FR_DEV float fr_dev_e4m3_decode(uint8_t code)
{
    const uint32_t exp = (code >> 3) & 0xFu, man = code & 0x7u;
    if (exp == 0xF && man == 0x7) return __uint_as_float(0x7FC00000u);   /* NAN, unsigned like the C */
    const float v = exp == 0 ? __fmul_rn((float)man, 1.0f / 512.0f)      /* man * 2^-9, exact */
                             : __uint_as_float(((exp + 120u) << 23) | (man << 20));
    return (code & 0x80) ? -v : v;
}

/* E4M3 rounding as a float (fr_e4m3_round): what an FP8 element holds. */
FR_DEV float fr_dev_e4m3_round(float x) { return fr_dev_e4m3_decode(fr_dev_e4m3_encode(x)); }

/* ---- E8M0 ---- */

FR_DEV uint8_t fr_dev_e8m0_from_exp(int e)
{
    if (e < -127) e = -127;
    if (e > 127) e = 127;
    return (uint8_t)(e + 127);
}

/* 2^(code - 127); code 0 is 2^-127, a float32 subnormal (bit 22). */
FR_DEV float fr_dev_e8m0_decode(uint8_t code)
{
    if (code == FR_E8M0_NAN) return __uint_as_float(0x7FC00000u);
    return __uint_as_float(code ? (uint32_t)code << 23 : 0x00400000u);
}

/* ---- NVFP4 / MXFP4 blocks ---- */

/* The block size as a compile-time constant, so a block's values, codes and
 * loops live in registers. */
template <fr_fp4_format F> struct fr_dev_fp4 {
    static constexpr int block = F == FR_MXFP4 ? 32 : 16;
};

template <fr_fp4_format F> FR_DEV float fr_dev_fp4_scale_value(uint8_t scale_code)
{
    return F == FR_MXFP4 ? fr_dev_e8m0_decode(scale_code) : fr_dev_e4m3_decode(scale_code);
}

/* A dequantized element, s * E2M1(code), as the C computes it (exact in
 * float32, but kept unfused so it never merges with a following add). */
FR_DEV float fr_dev_fp4_dequant(float scale, uint8_t code)
{
    return __fmul_rn(scale, fr_dev_e2m1_decode(code));
}

/* Largest magnitude, NaN ignored: fmaxf returns the other operand, as on the
 * host, and max is exact, so the order does not matter. */
template <fr_fp4_format F> FR_DEV float fr_dev_fp4_amax(const float *x)
{
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < fr_dev_fp4<F>::block; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

/* NVFP4: E4M3(amax / 6). MXFP4: 2^(floor(log2 amax) - 2), saturating. */
template <fr_fp4_format F> FR_DEV uint8_t fr_dev_fp4_standard_scale(float amax)
{
    if (F == FR_NVFP4) return fr_dev_e4m3_encode(__fdiv_rn(amax, 6.0f));
    if (amax == 0.0f) return fr_dev_e8m0_from_exp(-127);
    if (__float_as_uint(amax) == 0x7F800000u) return fr_dev_e8m0_from_exp(127);   /* +inf */
    return fr_dev_e8m0_from_exp(fr_dev_floor_log2(amax) - 2);
}

/* The searched candidate: NVFP4 E4M3(amax / 4), MXFP4 the next power of two. */
template <fr_fp4_format F> FR_DEV uint8_t fr_dev_fp4_alternative_scale(float amax, uint8_t standard)
{
    if (F == FR_NVFP4) return fr_dev_e4m3_encode(__fdiv_rn(amax, 4.0f));
    return standard < 254 ? (uint8_t)(standard + 1) : standard;
}

/* Elements E2M1(x / s), the quotient correctly rounded in float32; a zero
 * scale gives all zero codes. */
template <fr_fp4_format F>
FR_DEV void fr_dev_fp4_encode_block(uint8_t scale_code, const float *x, uint8_t *codes)
{
    const float s = fr_dev_fp4_scale_value<F>(scale_code);
#pragma unroll
    for (int i = 0; i < fr_dev_fp4<F>::block; i++)
        codes[i] = s > 0.0f ? fr_dev_e2m1_encode(__fdiv_rn(x[i], s)) : 0;
}

/* Sum of (s * E2M1(code) - x)^2 in float32, element 0 first, every product
 * and sum rounded on its own (fr_fp4_block_sse): the search compares two of
 * these, so one differently rounded term could flip the choice. */
template <fr_fp4_format F>
FR_DEV float fr_dev_fp4_block_sse(uint8_t scale_code, const float *x, const uint8_t *codes)
{
    const float s = fr_dev_fp4_scale_value<F>(scale_code);
    float sse = 0.0f;
#pragma unroll
    for (int i = 0; i < fr_dev_fp4<F>::block; i++) {
        const float xi = fr_dev_isnan(x[i]) ? 0.0f : x[i];
        const float e = __fsub_rn(fr_dev_fp4_dequant(s, codes[i]), xi);
        sse = __fadd_rn(sse, __fmul_rn(e, e));
    }
    return sse;
}

/* One block of fr_dev_fp4<F>::block values into unpacked codes; returns the
 * scale code (fr_fp4_quantize_block). With search, the alternative scale
 * wins only with a strictly lower error. One thread per block: x and codes
 * are meant to be the caller's register arrays. */
template <fr_fp4_format F>
FR_DEV uint8_t fr_dev_fp4_quantize_block(bool search, const float *x, uint8_t *codes)
{
    constexpr int B = fr_dev_fp4<F>::block;
    const float amax = fr_dev_fp4_amax<F>(x);
    const uint8_t s0 = fr_dev_fp4_standard_scale<F>(amax);
    fr_dev_fp4_encode_block<F>(s0, x, codes);
    if (!search) return s0;
    const uint8_t s1 = fr_dev_fp4_alternative_scale<F>(amax, s0);
    if (s1 == s0) return s0;
    uint8_t alt[B];
    fr_dev_fp4_encode_block<F>(s1, x, alt);
    if (!(fr_dev_fp4_block_sse<F>(s1, x, alt) < fr_dev_fp4_block_sse<F>(s0, x, codes))) return s0;
#pragma unroll
    for (int i = 0; i < B; i++) codes[i] = alt[i];
    return s1;
}

/* The warp's lanes hold one row of values, element j in lane j % 32,
 * register j / 32. fr_dev_fp4_fake_quant_warp quantizes the blocks of B elements
 * (half-warps for NVFP4, whole registers for MXFP4) as
 * fr_fp4_quantize_block does, bit for bit: amax over the block, the
 * standard scale, with search the alternative and the squared errors
 * summed in element order. Returns this lane's dequantized value and its
 * code and scale code. Every lane of the warp must call it. */
template <fr_fp4_format FF>
FR_DEV float fr_dev_fp4_fake_quant_warp(float x, bool search, uint8_t &code, uint8_t &scode)
{
    constexpr int B = fr_dev_fp4<FF>::block;
    const int lane = threadIdx.x & 31, base = lane & ~(B - 1);
    float amax = fmaxf(0.0f, fabsf(x));
#pragma unroll
    for (int o = 1; o < B; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const uint8_t s0 = fr_dev_fp4_standard_scale<FF>(amax);
    const float v0 = fr_dev_fp4_scale_value<FF>(s0);
    const uint8_t c0 = v0 > 0.0f ? fr_dev_e2m1_encode(__fdiv_rn(x, v0)) : 0;
    code = c0;
    scode = s0;
    if (!search) return fr_dev_fp4_dequant(v0, c0);
    /* the two halves of a warp may hold different NVFP4 blocks: every lane
     * runs the error sums (they shuffle), the choice is per block */
    const uint8_t s1 = fr_dev_fp4_alternative_scale<FF>(amax, s0);
    const float v1 = fr_dev_fp4_scale_value<FF>(s1);
    const uint8_t c1 = v1 > 0.0f ? fr_dev_e2m1_encode(__fdiv_rn(x, v1)) : 0;
    const float xi = fr_dev_isnan(x) ? 0.0f : x;
    const float e0 = __fsub_rn(fr_dev_fp4_dequant(v0, c0), xi), e1 = __fsub_rn(fr_dev_fp4_dequant(v1, c1), xi);
    const float q0 = __fmul_rn(e0, e0), q1 = __fmul_rn(e1, e1);
    float sse0 = 0.0f, sse1 = 0.0f;
#pragma unroll
    for (int k = 0; k < B; k++) {   /* element order, as the C loop */
        sse0 = __fadd_rn(sse0, __shfl_sync(0xFFFFFFFFu, q0, base + k));
        sse1 = __fadd_rn(sse1, __shfl_sync(0xFFFFFFFFu, q1, base + k));
    }
    if (s1 != s0 && sse1 < sse0) {
        code = c1;
        scode = s1;
        return fr_dev_fp4_dequant(v1, c1);
    }
    return fr_dev_fp4_dequant(v0, c0);
}

/* Code c placed at element e (0..7) of a page code word
 * (fr_fp4_word_pack): sign and magnitude at the element's slot. */
FR_DEV uint32_t fr_dev_fp4_word_place(uint32_t c, int e)
{
    const int h = 16 * (e >> 2), s = e & 3;
    const int sign_bit = s == 0 ? 15 : s == 1 ? 14 : s == 2 ? 12 : 13;
    const int mag_bit = s == 0 ? 9 : s == 1 ? 0 : s == 2 ? 6 : 3;
    return (((c >> 3) & 1u) << (h + sign_bit)) | ((c & 7u) << (h + mag_bit));
}

/* Eight codes as one page code word (fr_fp4_word_pack). */
FR_DEV uint32_t fr_dev_fp4_word_pack(const uint8_t *codes)
{
    uint32_t w = 0;
#pragma unroll
    for (int e = 0; e < 8; e++) w |= fr_dev_fp4_word_place(codes[e], e);
    return w;
}

/* x & MASK as an AND the compiler keeps: left to itself it folds the mask
 * into a neighbouring shift, (x << k) & m, which costs one more instruction
 * per slot of the unpacking below. */
template <uint32_t MASK> FR_DEV uint32_t fr_dev_and_pinned(uint32_t x)
{
    uint32_t d;
    asm("and.b32 %0, %1, %2;\n" : "=r"(d) : "r"(x), "n"(MASK));
    return d;
}

/* One page code word to four FP16x2 registers holding value * 2^-14, by bit
 * placement alone: in each half a code's sign lands on bit 15 and its
 * magnitude on bits 11..9, which reads as exponent e1e0 and mantissa m,
 * subnormal e = 0 (code 1, 0.5) included. The word keeps every slot's sign
 * and magnitude at the distance they have in FP16, so slot A needs one AND,
 * slot B a shift and an AND, and slots C and D an AND, one multiply that
 * adds two shifted copies (they never overlap: no carries) and an AND:
 * 9 integer instructions for 8 codes. r0 = elements (0, 4), r1 = (2, 6),
 * r2 = (1, 5), r3 = (3, 7), the low half's element first. */
FR_DEV void fr_dev_fp4_word_to_f16x2(uint32_t w, uint32_t (&r)[4])
{
    constexpr uint32_t M = 0x8E008E00u;
    r[0] = fr_dev_and_pinned<M>(w);
    r[1] = fr_dev_and_pinned<M>(w << 3);
    r[2] = fr_dev_and_pinned<M>(fr_dev_and_pinned<0x40074007u>(w) * 0x202u);
    r[3] = fr_dev_and_pinned<M>(fr_dev_and_pinned<0x20382038u>(w) * 0x44u);
}

/* ---- normalized Walsh-Hadamard transform ---- */

/* 1 / sqrt(n), both steps correctly rounded as in fr_hadamard. */
FR_DEV float fr_dev_hadamard_scale(int n) { return __fdiv_rn(1.0f, __fsqrt_rn((float)n)); }

/* One thread, x[n] in place, n a power of two: fr_hadamard's butterflies
 * (x[j] = a + b, x[j + h] = a - b for h = 1, 2, 4, ...) then one scaling. */
FR_DEV void fr_dev_hadamard(float *x, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = __fadd_rn(a, b);
                x[j + h] = __fsub_rn(a, b);
            }
    const float s = fr_dev_hadamard_scale(n);
    for (int i = 0; i < n; i++) x[i] = __fmul_rn(x[i], s);
}

/* One warp, one vector of n elements (n a power of two, 1 <= n <= 32 E), element j
 * held by lane j % 32 in x[j / 32]. With this striped layout a warp's loads
 * and stores of the vector are contiguous, butterflies with h < 32 pair lanes
 * (one shuffle each) and h >= 32 pair registers of one lane. The stages run
 * in fr_hadamard's order (h = 1, 2, 4, ...) and each butterfly computes
 * a + b and a - b with a the lower index, so the result is fr_hadamard's bit
 * for bit. For n < 32 only lanes below n hold the vector; the other lanes
 * must take part (all 32 call this) and their values are don't-care. The
 * lane is threadIdx.x % 32: 1-D thread blocks. */
template <int E> FR_DEV void fr_dev_hadamard_warp(float (&x)[E], int n)
{
    static_assert(E >= 1 && E <= 16 && (E & (E - 1)) == 0, "E: a power of two up to 16");
    const int lane = threadIdx.x & 31;
    for (int h = 1; h < n && h < 32; h *= 2) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            const float other = __shfl_xor_sync(0xFFFFFFFFu, x[e], h);
            x[e] = (lane & h) ? __fsub_rn(other, x[e]) : __fadd_rn(x[e], other);
        }
    }
#pragma unroll
    for (int hh = 1; hh < E; hh *= 2) {   /* h = 32 hh */
        if (32 * hh >= n) break;
#pragma unroll
        for (int e = 0; e < E; e++)
            if (!(e & hh)) {
                const float a = x[e], b = x[e + hh];
                x[e] = __fadd_rn(a, b);
                x[e + hh] = __fsub_rn(a, b);
            }
    }
    const float s = fr_dev_hadamard_scale(n);
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = __fmul_rn(x[e], s);
}

#undef FR_DEV

#endif
