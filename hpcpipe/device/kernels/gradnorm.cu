// Sums of squares of gradient pieces on the device, for the global norm (hpcpipe/optim/norm.py:
// one float64 sum per piece), in two passes of fixed shape — NORM_BLOCKS partial sums per
// piece, then one block per piece adding them in a fixed tree — so the bits never depend
// on timing or on the device, and the host fetches all pieces' sums in one transfer.
//
// Shapes: n gradient elements; K pieces; S the gradient's dtype; sums in float64.
//   grad (n,) S; offsets (K + 1,) int64: piece k is grad[offsets[k]:offsets[k + 1]]
//   partials (K, NORM_BLOCKS) float64; sums (K,) float64
// Launch: partials grid (NORM_BLOCKS, K), block NORM_THREADS; finish grid (K), block
// NORM_BLOCKS.
#include "common.cuh"

#define NORM_THREADS 256
#define NORM_BLOCKS 64

template <typename S>
__device__ void grad_sumsq_partials(double* partials, const S* grad, const long long* offsets) {
    __shared__ double scratch[WARP];
    const int k = blockIdx.y;
    const long long first = offsets[k], last = offsets[k + 1];
    double total = 0;
    for (long long i = first + (long long)blockIdx.x * NORM_THREADS + threadIdx.x; i < last;
         i += (long long)NORM_BLOCKS * NORM_THREADS) {
        const double g = (double)to_acc(grad[i]);
        total += g * g;
    }
    total = block_sum<NORM_THREADS>(total, scratch);
    if (threadIdx.x == 0) partials[(long long)k * NORM_BLOCKS + blockIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCKS)
    grad_sumsq_finish(double* sums, const double* partials) {
    __shared__ double scratch[WARP];
    const int k = blockIdx.x;
    const double total =
        block_sum<NORM_BLOCKS>(partials[(long long)k * NORM_BLOCKS + threadIdx.x], scratch);
    if (threadIdx.x == 0) sums[k] = total;
}

#define GRADNORM_KERNEL(S, suffix)                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS) grad_sumsq_partials_##suffix( \
        double* partials, const S* grad, const long long* offsets) {                        \
        grad_sumsq_partials<S>(partials, grad, offsets);                                    \
    }

GRADNORM_KERNEL(bf16, bf16)
GRADNORM_KERNEL(float, f32)
GRADNORM_KERNEL(double, f64)
