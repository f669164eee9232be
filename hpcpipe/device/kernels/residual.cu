// A projection's bias and the residual in one pass: GPT-2's block ends with
// out = (y + bias) + x1, y the MLP's c_proj GEMM output without its bias, x1 the residual
// stream. Each add is rounded to S before the next, as `y += bias` then `y += x1` round:
// the same bits as the two passes, in one read of y and x1 and one write.
//
// Shapes: N rows of D columns, (..., D) arrays, contiguous; S storage, computed in Acc<S>.
//   y (N, D) S       in: the GEMM output; out: the block's output (written over it)
//   bias (D,) S      column c adds bias[c]
//   residual (N, D) S
// Two-dimensional indexing (columns by x, rows by y in a grid-stride loop): no division or
// remainder per element, a row's offset once per row.
// Launch: grid (ceil(D / RES_THREADS), min(N, RES_ROW_BLOCKS)), block RES_THREADS.
#include "common.cuh"

#define RES_THREADS 256
#define RES_ROW_BLOCKS 4096

template <typename S>
__device__ void bias_residual(S* y, const S* bias, const S* residual, int N, int D) {
    const int c = blockIdx.x * RES_THREADS + threadIdx.x;
    if (c >= D) return;
    const auto b = to_acc(bias[c]);
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const long long i = (long long)r * D + c;
        const S biased = from_acc<S>(to_acc(y[i]) + b);
        y[i] = from_acc<S>(to_acc(biased) + to_acc(residual[i]));
    }
}

#define RESIDUAL_KERNELS(S, suffix)                                                         \
    extern "C" __global__ void __launch_bounds__(RES_THREADS)                               \
        bias_residual_##suffix(S* y, const S* bias, const S* residual, int N, int D) {      \
        bias_residual<S>(y, bias, residual, N, D);                                          \
    }

RESIDUAL_KERNELS(bf16, bf16)
RESIDUAL_KERNELS(float, f32)
RESIDUAL_KERNELS(double, f64)
