/* Building blocks of a flash-attention prefill kernel on Hopper (sm_90a):
 * PTX wrappers (cp.async, ldmatrix, mma.sync m16n8k16 BF16 -> FP32), the
 * XOR-swizzled shared-memory tile layout, the query fragments (optionally
 * Hadamard-rotated on the way) and one online-softmax step of 16 query rows
 * over a tile of keys. The structure is the one of the BF16 prefill kernel
 * (attention/attn_bf16_cuda.cu, docs/attention_gpu.md); the FP4/FP8 prefill
 * (attention/attn_fp4_prefill_cuda.cu) builds on these pieces.
 *
 * Tiles are [rows][D] BF16 with 16-byte piece c of row r stored at
 * c ^ (r & 7), so ldmatrix (plain for K and Q, .trans for V) reads them
 * without bank conflicts. Softmax runs in base 2 on S = gamma q.k. */
#ifndef FR_ATTN_PREFILL_COMMON_CUH
#define FR_ATTN_PREFILL_COMMON_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#include "fp4_device.cuh"

namespace fr_pf {

constexpr float kNegInf = -__builtin_huge_valf();

/* ---- PTX wrappers ------------------------------------------------------- */

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* 16 bytes global -> shared, through L2 only; src_bytes 0 writes zeros. The zero fill
 * pads tiles past their last key: masked keys then hold zeros, and a zero value row
 * cannot put NaN into P.V the way stale shared memory could. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/* Waits until at most N of this thread's committed groups are still in flight. It
 * covers the calling thread's copies only: a barrier after it is what makes every
 * thread's copies visible to all. Every stage of a pipeline commits a group, empty or
 * not, so that N counts stages. */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Four 8 x 8 matrices: lane i addresses row i % 8 of matrix i / 8, and r[k] gets
 * matrix k with lane 4g + t holding row g, elements 2t and 2t + 1 (the mma fragment
 * order; attn_fp4_ptx.cuh, "Fragment ownership"). The .trans form gives lane 4g + t
 * column g, rows 2t and 2t + 1: B fragments of V out of [token][dim] rows. */
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* One 16-byte piece of a swizzled tile (the FP4/FP8 prefill's dequantized rows). */
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d)
{
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

/* c += A (16x16, row) * B (16x8, col), BF16 in, FP32 accumulate. A lane (4g + t)
 * holds A's rows g and g + 8 at columns 2t, 2t + 1 (a0, a1) and 2t + 8, 2t + 9 (a2,
 * a3), B's rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of column g, and C's rows g
 * (c0, c1) and g + 8 (c2, c3) at columns 2t, 2t + 1. */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats -> BF16x2 (round to nearest even), lo in the low half (cvt takes the
 * upper half's source first). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Byte permute: bytes of {b, a} (a = bytes 0..3, b = 4..7) picked by the nibbles of
 * sel, nibble i giving result byte i. 0x5410 joins the low halves of a and b, 0x7632
 * the high halves. */
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel)
{
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

/* 2^x on the MUFU unit (relative error about 2^-22, results below 2^-126 flushed to
 * 0): the softmax weights, whose error then disappears in P's BF16 rounding. */
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Byte offset of 16-byte piece c of row r in a swizzled [rows][P] tile. An ldmatrix
 * matrix is 8 consecutive rows at one piece; with piece c of row r at c ^ (r & 7)
 * those rows sit on 8 different 16-byte bank groups, so plain and transposed reads
 * are conflict-free. Needs P >= 8 (D >= 64). */
template <int P> __device__ __forceinline__ uint32_t swz(int r, int c)
{
    return static_cast<uint32_t>((r * P + (c ^ (r & 7))) * 16);
}

/* ---- query fragments ------------------------------------------------------ */

/* One warp stages its 16 query rows in the swizzled [16][D] tile at sq as
 * BF16 (row r from row_of(r), a float32 row; NULL: a padding row of zeros), rotated by the
 * normalized Hadamard first when `rotate` (fr_dev_hadamard_warp: the C
 * code's butterflies in its order, in float32, before the one rounding to
 * BF16), then reads the MMA A fragments back with ldmatrix. sq is this
 * warp's own 16 rows; the caller keeps other writers away until the
 * fragments are read (the function ends with the ldmatrix). */
template <int D, class RowOf>
__device__ __forceinline__ void stage_query(uint32_t sq, const RowOf &row_of, bool rotate,
                                            uint32_t (&qa)[D / 16][4], int lane)
{
    constexpr int P = D / 8, E = D / 32;
    /* Rows go through shared memory because the Hadamard works on a row striped over
     * the warp (element j in lane j % 32, fp4_device.cuh) while the A fragment needs
     * elements 2t, 2t + 1, 2t + 8, 2t + 9 of rows g and g + 8: the tile transposes
     * between the two layouts. One row at a time (unroll 1): each row is a full
     * warp-wide transform. */
#pragma unroll 1
    for (int r = 0; r < 16; r++) {
        float x[E];
        const float *src = row_of(r);
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = src ? __ldg(src + e * 32 + lane) : 0.0f;
        if (rotate) fr_dev_hadamard_warp<E>(x, D);
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int ch = e * 32 + lane;
            const uint16_t h = static_cast<uint16_t>(pack_bf16(x[e], 0.0f) & 0xFFFFu);
            asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(sq + swz<P>(r, ch >> 3) + (ch & 7) * 2), "h"(h)
                         : "memory");
        }
    }
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldsm_x4(sq + swz<P>(lane & 15, 2 * kk + (lane >> 4)), qa[kk]);
}

/* ---- one warp, 16 query rows, one tile of keys --------------------------- */

/* The online-softmax state of the lane's rows g and g + 8 before any key:
 * no output, maxima at -inf, empty sums (as attend_tile takes them). */
template <int D>
__device__ __forceinline__ void softmax_start(float (&o)[D / 8][4], float &m_a, float &m_b, float &l_a, float &l_b)
{
#pragma unroll
    for (int j = 0; j < D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    m_a = m_b = kNegInf;
    l_a = l_b = 0.0f;
}

/* The quad's lanes hold different keys of a row: after attend_tile, their
 * shares of l_a and l_b add up to the rows' sums. */
__device__ __forceinline__ void quad_sums(float &l_a, float &l_b)
{
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
}

/* Online-softmax step over KEYS keys at tb held in swizzled shared tiles sk/sv
 * ([KEYS][D] BF16 each). Key t is visible to the lane's row g iff t < lim_a
 * (row g + 8: lim_b); need_mask = 0 promises every key is visible. o holds
 * the unnormalized output (this lane's C fragments), m the running maxima,
 * l this lane's share of the running sums. S = gamma q.k. */
template <int D, int KEYS>
__device__ __forceinline__ void attend_tile(uint32_t sk, uint32_t sv, const uint32_t (&qa)[D / 16][4],
                                            float (&o)[D / 8][4], float &m_a, float &m_b, float &l_a,
                                            float &l_b, int tb, int lim_a, int lim_b, bool need_mask,
                                            float gamma, int lane)
{
    constexpr int P = D / 8, NT = KEYS / 8;
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;

    /* S = Q K^T: B fragments straight from K rows (non-transposed ldmatrix). Lanes
     * 0-7 address keys 0-7 of the k-step's first 8 dims, 8-15 the same keys' next 8
     * dims, 16-31 keys 8-15 likewise: b[0], b[1] are n-tile 2 np (keys np*16 .. + 7),
     * b[2], b[3] n-tile 2 np + 1. */
    const int krow = (lane & 7) + ((lane >> 4) << 3), khi = (lane >> 3) & 1;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
        for (int np = 0; np < KEYS / 16; np++) {
            uint32_t b[4];
            ldsm_x4(sk + swz<P>(np * 16 + krow, 2 * kk + khi), b);
            mma_bf16(s[2 * np], qa[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], qa[kk], b[2], b[3]);
        }
    }

    /* s[n] is the C fragment of keys tb + 8n .. + 7: element e is key tb + 8n + 2t +
     * (e & 1) for row g (e < 2) or g + 8 (e >= 2). Masked keys become -inf; the row
     * maxima are then reduced over the quad (xor 1, 2), the four lanes that share a
     * row. */
    const int c2 = (lane & 3) * 2;
    float mx_a = kNegInf, mx_b = kNegInf;
#pragma unroll
    for (int n = 0; n < NT; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float x = s[n][e] * gamma;
            if (need_mask && tb + n * 8 + c2 + (e & 1) >= (e < 2 ? lim_a : lim_b)) x = kNegInf;
            s[n][e] = x;
        }
        mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
    /* A row with no visible key yet keeps m = -inf; exponentiate against 0. */
    const float ref_a = new_a == kNegInf ? 0.0f : new_a, ref_b = new_b == kNegInf ? 0.0f : new_b;
    const float alpha_a = fast_exp2(m_a - ref_a), alpha_b = fast_exp2(m_b - ref_b);
    m_a = new_a;
    m_b = new_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        s[n][0] = fast_exp2(s[n][0] - ref_a);
        s[n][1] = fast_exp2(s[n][1] - ref_a);
        s[n][2] = fast_exp2(s[n][2] - ref_b);
        s[n][3] = fast_exp2(s[n][3] - ref_b);
        sum_a += s[n][0] + s[n][1];
        sum_b += s[n][2] + s[n][3];
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        o[j][0] *= alpha_a;
        o[j][1] *= alpha_a;
        o[j][2] *= alpha_b;
        o[j][3] *= alpha_b;
    }

    /* O += P V: the S accumulators are P's A fragments; V's B fragments come from
     * transposed ldmatrix of the [token][d] rows. The C layout of S (rows g, g + 8;
     * keys 2t, 2t + 1 of each n-tile) is the A layout of P for k-step ks over n-tiles
     * 2 ks and 2 ks + 1, so P never leaves the lane; it is rounded to BF16 here,
     * while l above summed the FP32 values. For V, lanes 0-7 address keys 0-7 of dims
     * 16 jj .. + 7, 8-15 keys 8-15 of them, 16-31 the same for dims + 8: b[0], b[1]
     * feed output n-tile 2 jj, b[2], b[3] n-tile 2 jj + 1. */
    const int vrow = (lane & 7) + (((lane >> 3) & 1) << 3), vhi = lane >> 4;
#pragma unroll
    for (int ks = 0; ks < KEYS / 16; ks++) {
        const uint32_t pa[4] = {pack_bf16(s[2 * ks][0], s[2 * ks][1]), pack_bf16(s[2 * ks][2], s[2 * ks][3]),
                                pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
        for (int jj = 0; jj < D / 16; jj++) {
            uint32_t b[4];
            ldsm_x4_trans(sv + swz<P>(ks * 16 + vrow, 2 * jj + vhi), b);
            mma_bf16(o[2 * jj], pa, b[0], b[1]);
            mma_bf16(o[2 * jj + 1], pa, b[2], b[3]);
        }
    }
}

} // namespace fr_pf

#endif
