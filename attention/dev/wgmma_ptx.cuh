/* PTX wrappers for the warpgroup MMA (wgmma) of sm_90a, for the experimental
 * kernels of attention/dev/. One wgmma is issued by the 128 threads of a warpgroup
 * together; its accumulators are the m64nN C layout (warp w of the group holds rows
 * 16 w .. 16 w + 15, laid out per n8 tile as mma.sync's m16n8 C fragments).
 *
 * Shared-memory operands are described by 64-bit descriptors (PTX ISA, "Matrix
 * Descriptor Format"): start address, leading and stride byte offsets (all >> 4)
 * and the swizzle mode. Every operand here uses the 128-byte swizzle: 8 rows of 128
 * bytes make a 1024-byte atom (1024-byte aligned), and 16-byte chunk c of row r sits
 * at chunk c ^ (r % 8). K-major (the scores' Q and K): rows are M or N, 64 BF16
 * channels a row, 8-row groups SBO bytes apart (1024 when dense); a k-step of 16
 * channels starts 32 bytes further in the row. MN-major (the context's V): rows are
 * K (tokens), 64 channels of N a row; blocks of 64 N-channels LBO bytes apart,
 * 8-row K groups SBO bytes apart.
 *
 * Not yet run on a GPU: attention/dev/README.md. */
#ifndef FR_DEV_WGMMA_PTX_CUH
#define FR_DEV_WGMMA_PTX_CUH

#include <stdint.h>

#define FR_WG __device__ __forceinline__

namespace fr_wgmma {

/* A 128-byte-swizzle descriptor of the operand at smem_ptr. */
FR_WG uint64_t sw128_desc(const void *smem_ptr, uint32_t lbo_bytes, uint32_t sbo_bytes)
{
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
    uint64_t d = (uint64_t)((a & 0x3FFFFu) >> 4);
    d |= (uint64_t)((lbo_bytes >> 4) & 0x3FFFu) << 16;
    d |= (uint64_t)((sbo_bytes >> 4) & 0x3FFFu) << 32;
    d |= (uint64_t)1 << 62;   /* swizzle mode 1: 128 bytes */
    return d;
}

/* Registers the wgmmas read (accumulators, A fragments) are final before they
 * issue. */
FR_WG void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FR_WG void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> FR_WG void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

/* Pins registers a wgmma group uses (accumulators) so that the compiler neither
 * moves nor copies them between the group's fence and its wait; without it ptxas
 * may have to add a warpgroup.arrive of its own (note C7519). */
template <int N> FR_WG void pin(float (&r)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

/* Ordinary shared-memory stores (st.shared, cp.async) become visible to the async
 * proxy that wgmma reads through. Each writing thread fences, then the barrier. */
FR_WG void fence_smem_for_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* D[64 x 32] (+)= A[64 x 16] B[16 x 32]: A and B from shared memory, both K-major
 * (B's rows are the 32 columns of D). scale_d 0 overwrites D. */
FR_WG void m64n32k16_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/* D[64 x 64] += A[64 x 16] B[16 x 64]: A from registers (each warp's m16k16 A
 * fragment, mma.sync's order), B from shared memory MN-major (imm-trans-b 1). */
FR_WG void m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

}   // namespace fr_wgmma

#undef FR_WG

#endif
