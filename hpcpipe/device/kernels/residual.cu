// A projection's bias and the residual in one pass: GPT-2's block ends with
// out = (y + bias) + x1, y the MLP's c_proj GEMM output without its bias, x1 the residual
// stream. Each add is rounded to S before the next, as `y += bias` then `y += x1` round:
// the same bits as the two passes, in one read of y and x1 and one write.
//
// Shapes: n elements of (..., D) arrays, contiguous; S storage, computed in Acc<S>.
//   y (n,) S         in: the GEMM output; out: the block's output (written over it)
//   bias (D,) S      element i adds bias[i % D]
//   residual (n,) S
// Launch: grid (ceil(n / RES_THREADS)) or fewer (a grid-stride loop), block RES_THREADS.
#include "common.cuh"

#define RES_THREADS 256

template <typename S>
__device__ void bias_residual(S* y, const S* bias, const S* residual, long long n, int D) {
    const long long stride = (long long)gridDim.x * RES_THREADS;
    for (long long i = (long long)blockIdx.x * RES_THREADS + threadIdx.x; i < n; i += stride) {
        const S biased = from_acc<S>(to_acc(y[i]) + to_acc(bias[i % D]));
        y[i] = from_acc<S>(to_acc(biased) + to_acc(residual[i]));
    }
}

#define RESIDUAL_KERNELS(S, suffix)                                                         \
    extern "C" __global__ void __launch_bounds__(RES_THREADS)                               \
        bias_residual_##suffix(S* y, const S* bias, const S* residual, long long n, int D) { \
        bias_residual<S>(y, bias, residual, n, D);                                          \
    }

RESIDUAL_KERNELS(bf16, bf16)
RESIDUAL_KERNELS(float, f32)
RESIDUAL_KERNELS(double, f64)
