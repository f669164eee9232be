// What every kernel shares: the storage types, their compute types, and reductions
// whose order is fixed by the code alone (never by timing), so sums are bitwise stable.
//
// Storage dtype S and its compute dtype Acc<S>: bf16 and float32 compute in float32
// (as the NumPy layers' `wide` does), float64 in float64 (the finite-difference tests).
#ifndef HPCPIPE_COMMON_CUH
#define HPCPIPE_COMMON_CUH
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

template <typename S> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_acc(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

// Rounded once, to nearest even, into the storage type.
template <typename S> __device__ __forceinline__ S from_acc(float v);
template <> __device__ __forceinline__ bf16 from_acc<bf16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename S> __device__ __forceinline__ S from_acc(double v) { return (S)v; }

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
__device__ __forceinline__ float log_acc(float v) { return logf(v); }
__device__ __forceinline__ double log_acc(double v) { return log(v); }
__device__ __forceinline__ float sqrt_acc(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_acc(double v) { return sqrt(v); }

#define WARP 32

// v + bias[d] rounded to S, the bits a separate `x += bias` pass leaves; v when bias is
// null (the input has its bias already).
template <typename S>
__device__ __forceinline__ S plus_bias(S v, const S* bias, int d) {
    return bias ? from_acc<S>(to_acc(v) + to_acc(bias[d])) : v;
}

// c_attn's bias for part (0 q, 1 k, 2 v) of head h, laid out (3, NH, HS) like a token's
// qkv; null when qkv has its bias already.
template <typename S>
__device__ __forceinline__ const S* qkv_bias(const S* bias, int part, int h, int NH, int HS) {
    return bias ? bias + ((long long)part * NH + h) * HS : nullptr;
}

// +inf without math.h, which NVRTC lacks.
#ifdef HPCPIPE_HOST_BUILD
#define HP_INFINITY INFINITY
#else
#define HP_INFINITY __int_as_float(0x7f800000)
#endif

// Column c of pieces partials[p · stride + c], p = 0 .. P - 1, added in that order: a
// column sum that a kernel made in fixed chunks of rows, finished in an order fixed by
// the code (the same bits on every run).
template <typename A>
__device__ __forceinline__ A chunks_sum(const A* partials, int P, long long stride, int c) {
    A total = 0;
    for (int p = 0; p < P; ++p) total += partials[p * stride + c];
    return total;
}

// Sum over a warp by a butterfly: every lane ends with the same total, added in the same
// order on every run.
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename A> __device__ __forceinline__ A warp_max(A v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        A other = __shfl_xor_sync(0xffffffffu, v, offset);
        v = other > v ? other : v;
    }
    return v;
}

// Sum over a block of `THREADS` threads (a multiple of 32, at most 1024): warp sums, then
// the first warp sums those. Every thread gets the total. `scratch` holds 32 values; the
// leading barrier lets a caller reuse it right after a previous call.
template <int THREADS, typename A> __device__ __forceinline__ A block_sum(A v, A* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / WARP ? scratch[lane] : (A)0;
    return warp_sum(v);
}

template <int THREADS, typename A> __device__ __forceinline__ A block_max(A v, A* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < THREADS / WARP ? scratch[lane] : scratch[0];
    return warp_max(v);
}

#endif  // HPCPIPE_COMMON_CUH
