// The tensor-core and async-copy instructions the flash attention kernels use, one inline
// function each: the PTX instruction on a GPU; in the host build (hpcpipe/devtools/shim.h)
// the shim's lane-by-lane emulation of the same instruction at the PTX ISA's documented
// fragment layouts, so the kernels that call these are the same code in both builds.
//
//   mma_bf16(d, a, b)        d += a b   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
//   ldmatrix_x4(r, p)        ldmatrix.sync.aligned.m8n8.x4.shared.b16, .trans: ldmatrix_x4_t
//                            (x1, x2 and x2_t likewise: the tests' probes use them)
//   cp_async16(dst, src, n)  cp.async.cg.shared.global, 16 bytes, the first n from src
//   cp_async4(dst, src, n)   cp.async.ca.shared.global, 4 bytes, likewise
//   cp_async_commit(); cp_async_wait<N>()   cp.async.commit_group; cp.async.wait_group N
//
// Fragment layouts (g = lane / 4, t = lane % 4; two bf16 per 32-bit register, the lower
// index in the low half):
//   A 16×16:  a[0] (row g, cols 2t, 2t+1)   a[1] (g+8, 2t..)   a[2] (g, 2t+8..)   a[3] (g+8, 2t+8..)
//   B 16×8:   b[0] (rows 2t, 2t+1; col g)   b[1] (rows 2t+8, 2t+9; col g)
//   C 16×8:   c[0] (g, 2t)   c[1] (g, 2t+1)   c[2] (g+8, 2t)   c[3] (g+8, 2t+1)
// ldmatrix: lanes 8i .. 8i+7 give the addresses of the 8 rows (16 bytes each) of matrix i;
// register i of lane l holds elements 2t, 2t+1 of row g of matrix i (.trans: element g of
// rows 2t and 2t+1), so a row-major 16×16 tile read as four 8×8 matrices is an A
// fragment, and K (keys × channels) read row by row a B fragment of K^T.
#ifndef HPCPIPE_PTX_CUH
#define HPCPIPE_PTX_CUH

typedef unsigned int u32;

// Two floats as the bf16 pair of one register (round to nearest even), x in the low half.
__device__ __forceinline__ u32 pack_bf16(float x, float y) {
    const bf16 lo = __float2bfloat16(x), hi = __float2bfloat16(y);
    return (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ float low_bf16(u32 r) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r & 0xffffu)));
}
__device__ __forceinline__ float high_bf16(u32 r) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r >> 16)));
}

#ifdef HPCPIPE_HOST_BUILD

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    const float c[4] = {d[0], d[1], d[2], d[3]};
    hp::mma_m16n8k16_bf16(d, a, b, c);
}
__device__ __forceinline__ void ldmatrix_x1(u32 (&r)[1], const bf16* p) {
    hp::ldmatrix(r, p, 1, false);
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const bf16* p) {
    hp::ldmatrix(r, p, 2, false);
}
__device__ __forceinline__ void ldmatrix_x2_t(u32 (&r)[2], const bf16* p) {
    hp::ldmatrix(r, p, 2, true);
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const bf16* p) {
    hp::ldmatrix(r, p, 4, false);
}
__device__ __forceinline__ void ldmatrix_x4_t(u32 (&r)[4], const bf16* p) {
    hp::ldmatrix(r, p, 4, true);
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    hp::cp_async(dst, src, 16, (unsigned)src_bytes);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    hp::cp_async(dst, src, 4, (unsigned)src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { hp::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { hp::cp_async_wait(N); }

#else

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ldmatrix_x1(u32 (&r)[1], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x2_t(u32 (&r)[2], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_t(u32 (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(shared_address(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(shared_address(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

#endif  // HPCPIPE_HOST_BUILD
#endif  // HPCPIPE_PTX_CUH
