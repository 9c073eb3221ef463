/* The few PTX instructions the FP4/FP8 decode kernels (attn_fp4_cuda.cu) and the latent
 * kernels (attn_mla_cuda.cu) use, each behind a small inline function, so the kernels read
 * as plain code and every hardware-specific step is named once. Device code only.
 *
 * The arithmetic wrappers (hmul2, the conversions, ex2) are plain asm: the compiler
 * may schedule or drop them like any pure expression, and an asm block is never fused
 * with a neighbouring add, so each rounds exactly once. The MMAs are asm volatile on
 * registers only. Everything that touches shared memory, barriers or the grid
 * (ldmatrix, the copies, the mbarriers, griddepcontrol) is asm volatile with a
 * "memory" clobber, so the compiler moves no ordinary load or store across it. */
#ifndef FR_ATTN_FP4_PTX_CUH
#define FR_ATTN_FP4_PTX_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#define FR_PTX __device__ __forceinline__

namespace fr_fp4_ptx {

FR_PTX uint32_t smem_u32(const void *p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

/* ---- tensor cores: D = A (16x16, row) * B (16x8, col) + C, FP32 accumulate ---- */

/* Fragment ownership of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"),
 * for lane = 4 g + t (g = lane / 4, t = lane % 4). Each 32-bit register holds two
 * 16-bit elements, the lower column (A, C) or row (B) in the low half:
 * - A (16 x 16, row-major): a0 = row g, columns 2t, 2t+1; a1 = row g+8, the same
 *   columns; a2 = row g, columns 2t+8, 2t+9; a3 = row g+8, columns 2t+8, 2t+9;
 * - B (16 x 8, column-major): b0 = rows 2t, 2t+1 of column g; b1 = rows 2t+8, 2t+9;
 * - C (16 x 8, FP32): c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g+8, the same
 *   columns.
 * A lane's A and B registers cover the same four k indices (2t, 2t+1, 2t+8, 2t+9), so
 * any permutation of the k axis applied to both operands leaves the product
 * unchanged: the FP4/FP8 kernels use that to let a lane load its keys with one
 * contiguous load (qk_dim_slot in attn_fp4_prep.cuh). And a lane's C elements sit
 * where its A elements do (rows g, g+8, column pairs 2t, 2t+1): a product's C can be
 * the next product's A without leaving the lane (P in the BF16 and latent kernels);
 * read transposed, its row g is the column g the lane supplies to B (P in the FP4
 * split).
 *
 * The FP4/FP8 kernels multiply in FP16: its 11 significant bits hold every E2M1 x
 * E4M3 product (at most 6 significant bits) exactly and give a query split into FP16
 * hi + lo 22 bits; values are moved into FP16's range by powers of two undone in FP32
 * (2^-14 on code words, 2^7 on NVFP4 scales, 2^11 on P). BF16 (8 bits, FP32's
 * exponent range) serves the BF16 tokens and the latent kernels' BF16 tiles. */
FR_PTX void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                    uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

FR_PTX void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                     uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Four 8 x 8 matrices of 16-bit elements from shared memory: lane i gives the address
 * of row i % 8 of matrix i / 8 (16 contiguous bytes), and r[k] receives matrix k in
 * the C/A fragment order (lane 4g + t: row g, elements 2t, 2t+1). Rows of one matrix
 * on eight distinct 16-byte bank groups read without conflict, which is what the XOR
 * swizzles and the padded pitches of the callers arrange. The .trans form transposes
 * each matrix on the way: lane 4g + t gets column g, rows 2t, 2t+1, i.e. a B fragment
 * out of a row-major [token][dim] tile. */
FR_PTX void ldsm_x4(const void *p, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

FR_PTX void ldsm_x4_trans(const void *p, uint32_t (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

/* ---- bit and packed-half arithmetic ---- */

/* Two FP16 products, each rounded once (never fused into a later add). */
FR_PTX uint32_t hmul2(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* Two E4M3 bytes (element 0 in the low byte) to FP16x2, exactly. */
/* Every E4M3 value (subnormals and 448 included) is an FP16 number, so the conversion
 * is exact; NaN codes do not occur in pages the cache writes. */
FR_PTX uint32_t e4m3x2_to_f16x2(uint32_t two_bytes)
{
    uint32_t d;
    asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(d) : "r"(two_bytes));
    return d;
}

/* x >= 0 rounded to E4M3 (nearest, ties to even, saturating at 448: the
 * rule of fr_e4m3_encode) and back to float, by the hardware conversions
 * (both exact on the way back: every E4M3 value is an FP16 number). */
/* Used for the NVFP4 P block scale (p_scale): the hardware's rounding is
 * fr_e4m3_encode's, so the kernel picks the scale the CPU reference picks for the
 * same input. */
FR_PTX float e4m3_round(float x)
{
    uint32_t h;
    asm("{\n .reg .b16 b;\n cvt.rn.satfinite.e4m3x2.f32 b, %1, %1;\n cvt.rn.f16x2.e4m3x2 %0, b;\n}\n"
        : "=r"(h)
        : "f"(x));
    float y;
    asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %1;\n cvt.f32.f16 %0, l;\n}\n" : "=f"(y) : "r"(h));
    return y;
}

/* float pairs to packed halves, round to nearest even; lo in the low half. */
/* cvt.f16x2.f32 puts its first source in the upper half, hence hi before lo in the
 * operand list. */
FR_PTX uint32_t pack_f16x2(float lo, float hi)
{
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

/* One float to FP16 bits (round to nearest even, subnormals kept). */
FR_PTX uint16_t f32_to_f16(float x) { uint16_t d; asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(d) : "f"(x)); return d; }

FR_PTX float f16_to_f32(uint16_t h) { float d; asm("cvt.f32.f16 %0, %1;\n" : "=f"(d) : "h"(h)); return d; }

/* 2^x, MUFU (relative error about 2^-22; -inf gives 0). */
/* The split kernels' softmax exponentials: one MUFU instruction, whose error is far
 * below the FP16 or E2M1 rounding P goes through next (docs/attention_gpu.md,
 * "Precision"). .ftz flushes results below 2^-126 to 0: weights negligible next to
 * the running maximum's 1. */
FR_PTX float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x)); return y; }

/* ---- asynchronous copies ---- */

/* 16 bytes global -> shared through L2; src_bytes 0 writes zeros. */
/* .cg caches in L2 only: a page is read once per CTA, so keeping it in L1 would only
 * evict what the CTA reuses. The zero fill (src_bytes 0) is how callers pad a tile
 * past its last token: masked rows then hold zeros, never stale shared memory, whose
 * bit patterns could be NaN or infinity and poison a P.V sum even at zero weight. */
FR_PTX void cp_async16(void *dst, const void *src, uint32_t src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

FR_PTX void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

FR_PTX void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* An mbarrier completes a phase when `count` arrivals have been made and every byte
 * announced by expect_tx has landed; then it starts the next phase. The split kernels
 * give their full barriers a count of 1 (the producer thread's arrive.expect_tx) and
 * the FP4 empty barriers one arrival per thread. */
FR_PTX void mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

/* Makes the initialized barriers visible to the copy engine (the async proxy), which
 * signals them. PTX has this fence at cluster scope only; a CTA launched without a
 * cluster is a cluster of one, so it costs nothing more. A __syncthreads after it
 * publishes the barriers to the other threads. */
FR_PTX void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

/* Orders this thread's earlier shared-memory accesses (and those a barrier
 * made visible to it) before later bulk copies into shared memory. */
FR_PTX void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* One arrival that also raises the phase's expected byte count by `bytes`. Issued
 * just before the bulk copy it announces, by the thread that issues the copy, so the
 * phase cannot complete before the copy's bytes are counted. */
FR_PTX void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

/* One arrival on the barrier (the consumer's "slot free" signal). */
FR_PTX void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

/* One contiguous copy global -> shared (16-byte aligned, size a multiple of 16) that
 * signals its bytes on bar. The shared::cluster destination takes this CTA's own
 * shared address (a CTA's window is part of its cluster's). The alignment is why the
 * hosts refuse pools, blocks and head pages that are not 16-byte aligned. */
FR_PTX void bulk_copy_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

/* Waits until the barrier's phase with the given parity has completed. Phases
 * alternate parity 0, 1, 0, ..., so the n-th use of a barrier (n from 0) waits with
 * parity n & 1; this is unambiguous as long as no waiter falls two phases behind,
 * which the rings guarantee (a slot is not refilled before every reader has released
 * it). */
FR_PTX void mbar_wait(uint64_t *bar, uint32_t parity)
{
    asm volatile("{\n"
                 " .reg .pred done;\n"
                 "wait_%=:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra wait_%=;\n"
                 "}\n" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}

/* ---- programmatic dependent launch ---- */

/* Lets the next kernel of the stream, when it was launched with the
 * programmatic-serialization attribute, be scheduled before this grid
 * ends: its CTAs start their own set-up while this grid finishes. A no-op
 * when nothing waits on this grid that way. */
FR_PTX void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

/* Waits until the grids this one depends on programmatically have ended
 * and their memory is visible; returns at once for a kernel launched
 * without the attribute. Everything before it must not read what the
 * previous kernel writes. */
FR_PTX void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

} // namespace fr_fp4_ptx

#undef FR_PTX

#endif
