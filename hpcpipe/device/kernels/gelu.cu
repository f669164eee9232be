// GELU, tanh approximation, with the formulas of hpcpipe/layers/gelu.py (see its
// derivation): h = 1 / (1 + exp(min(-2u, 80))), u = K (x + A x³), y = x h, and
// dy/dx = h (1 + 2K x (1 + 3A x²) (1 - h)). F keeps nothing: B recomputes dy/dx from x,
// one read of x and dy instead of storing the derivative.
//
// The bias variant takes c_fc's GEMM output without its bias: x += bias (rounded to S,
// as a separate `x += bias` rounds it) is written back over x, the stash B reads, and y
// is the GELU of that: one pass where the bias add and GELU were two.
//
// Shapes: n elements of any (..., D) array, contiguous; S storage, computed in Acc<S>.
//   x, y, dy, dx (n,) S    (dx may be dy: each element is read before it is written)
//   bias (D,) S            (the bias variant: element i adds bias[i % D])
// Launch: grid (ceil(n / GELU_THREADS)) or fewer (a grid-stride loop), block GELU_THREADS.
#include "common.cuh"

#define GELU_THREADS 256
#define GELU_K 0.7978845608028654  // sqrt(2 / pi)
#define GELU_A 0.044715

template <typename A> struct GeluTerms {
    A sq, h;  // x², h
};

// Each constant rounded to A once, as NumPy rounds a Python float against an A array.
template <typename A> __device__ __forceinline__ GeluTerms<A> gelu_terms(A x) {
    GeluTerms<A> t;
    t.sq = x * x;
    A e = t.sq * (A)(-2.0 * GELU_K * GELU_A) - (A)(2.0 * GELU_K);
    e *= x;  // -2u
    e = e < (A)80 ? e : (A)80;
    t.h = (A)1 / (exp_acc(e) + (A)1);
    return t;
}

template <typename S> __device__ void gelu_forward(S* y, const S* x, long long n) {
    typedef typename Acc<S>::type A;
    const long long stride = (long long)gridDim.x * GELU_THREADS;
    for (long long i = (long long)blockIdx.x * GELU_THREADS + threadIdx.x; i < n; i += stride) {
        const A v = to_acc(x[i]);
        y[i] = from_acc<S>(v * gelu_terms(v).h);
    }
}

template <typename S>
__device__ void gelu_bias_forward(S* y, S* x, const S* bias, long long n, int D) {
    typedef typename Acc<S>::type A;
    const long long stride = (long long)gridDim.x * GELU_THREADS;
    for (long long i = (long long)blockIdx.x * GELU_THREADS + threadIdx.x; i < n; i += stride) {
        const S biased = from_acc<S>(to_acc(x[i]) + to_acc(bias[i % D]));
        x[i] = biased;
        const A v = to_acc(biased);
        y[i] = from_acc<S>(v * gelu_terms(v).h);
    }
}

template <typename S> __device__ void gelu_backward(S* dx, const S* dy, const S* x, long long n) {
    typedef typename Acc<S>::type A;
    const long long stride = (long long)gridDim.x * GELU_THREADS;
    for (long long i = (long long)blockIdx.x * GELU_THREADS + threadIdx.x; i < n; i += stride) {
        const A v = to_acc(x[i]);
        const GeluTerms<A> t = gelu_terms(v);
        A g = t.sq * (A)(6.0 * GELU_K * GELU_A) + (A)(2.0 * GELU_K);
        g *= v;  // 2K x (1 + 3A x²)
        g = (g * ((A)1 - t.h) + (A)1) * t.h;
        dx[i] = from_acc<S>(to_acc(dy[i]) * g);
    }
}

#define GELU_KERNELS(S, suffix)                                                             \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_forward_##suffix(S* y, const S* x, long long n) {                              \
        gelu_forward<S>(y, x, n);                                                           \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_bias_forward_##suffix(S* y, S* x, const S* bias, long long n, int D) {         \
        gelu_bias_forward<S>(y, x, bias, n, D);                                             \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_backward_##suffix(S* dx, const S* dy, const S* x, long long n) {               \
        gelu_backward<S>(dx, dy, x, n);                                                     \
    }

GELU_KERNELS(bf16, bf16)
GELU_KERNELS(float, f32)
GELU_KERNELS(double, f64)
