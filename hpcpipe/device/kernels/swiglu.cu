// SwiGLU's elementwise part (the Llama family's MLP), with the formulas and the order of
// operations of hpcpipe/model/layers/swiglu.py: s = σ(g) = 1 / (exp(min(−g, 80)) + 1),
// silu(g) = g s, silu'(g) = (1 − s) silu(g) + s;
//   F: a = silu(g) · u
//   B: du = da · silu(g), dg = (da · u) · silu'(g)
// F keeps nothing of its own: B recomputes σ from g (one exp per element, where the NumPy
// path keeps silu and its derivative, two (N, I) arrays more), so the stash is g and u.
// Every product in A and rounded to S once, as the NumPy layer's 16-bit path rounds.
//
// Shapes: n = N·I elements of any (..., I) arrays, contiguous; S storage, A = Acc<S>.
//   g, u, a (n,) S;  da, dg, du (n,) S   (dg may be da: each element is read before it is
//   written)
// Launch: grid (ceil(n / SW_THREADS)) or fewer (a grid-stride loop), block SW_THREADS.
#include "common.cuh"

#define SW_THREADS 256

template <typename A> __device__ __forceinline__ A sigmoid(A g) {
    A e = -g;
    e = e < (A)80 ? e : (A)80;
    return (A)1 / (exp_acc(e) + (A)1);
}

template <typename S>
__device__ void swiglu_forward(S* a, const S* g, const S* u, long long n) {
    typedef typename Acc<S>::type A;
    const long long stride = (long long)gridDim.x * SW_THREADS;
    for (long long i = (long long)blockIdx.x * SW_THREADS + threadIdx.x; i < n; i += stride) {
        const A gv = to_acc(g[i]);
        a[i] = from_acc<S>((gv * sigmoid(gv)) * to_acc(u[i]));
    }
}

template <typename S>
__device__ void swiglu_backward(S* dg, S* du, const S* da, const S* g, const S* u,
                                long long n) {
    typedef typename Acc<S>::type A;
    const long long stride = (long long)gridDim.x * SW_THREADS;
    for (long long i = (long long)blockIdx.x * SW_THREADS + threadIdx.x; i < n; i += stride) {
        const A gv = to_acc(g[i]), d = to_acc(da[i]);
        const A s = sigmoid(gv), silu = gv * s;
        const A slope = ((A)1 - s) * silu + s;
        du[i] = from_acc<S>(d * silu);
        dg[i] = from_acc<S>((d * to_acc(u[i])) * slope);
    }
}

#define SWIGLU_KERNELS(S, suffix)                                                          \
    extern "C" __global__ void __launch_bounds__(SW_THREADS)                               \
        swiglu_forward_##suffix(S* a, const S* g, const S* u, long long n) {               \
        swiglu_forward<S>(a, g, u, n);                                                     \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(SW_THREADS)                               \
        swiglu_backward_##suffix(S* dg, S* du, const S* da, const S* g, const S* u,        \
                                 long long n) {                                            \
        swiglu_backward<S>(dg, du, da, g, u, n);                                           \
    }

SWIGLU_KERNELS(bf16, bf16)
SWIGLU_KERNELS(float, f32)
SWIGLU_KERNELS(double, f64)
