// GELU, tanh approximation, with the formulas of hpcpipe/model/layers/gelu.py (see its
// derivation): h = 1 / (1 + exp(min(-2u, 80))), u = K (x + A x³), y = x h, and
// dy/dx = h (1 + 2K x (1 + 3A x²) (1 - h)). F keeps nothing: B recomputes dy/dx from x,
// one read of x and dy instead of storing the derivative.
//
// The bias variants take c_fc's GEMM output without its bias, x, and add it as they read
// (x + bias rounded to S, as a separate `x += bias` rounds it): F writes only y, x stays
// as the GEMM left it and is B's stash; B adds the bias again and also sums its output
// dx down each column — c_fc's bias gradient — over GELU_CHUNKS fixed chunks of rows,
// which W then adds up in chunk order (gelu_bias_finish): no pass of its own over dx.
//
// Shapes: n = N·D elements of any (..., D) array, contiguous; S storage, A = Acc<S>.
//   x, y, dy, dx (n,) S    (dx may be dy: each element is read before it is written)
//   bias (D,) S            (the bias variants: row r, column c adds bias[c])
//   partials (GELU_CHUNKS, D) A; dbias (D,) A, accumulated (+=)
// Indexing: the plain kernels a flat grid-stride loop; the bias variants two dimensions
// (columns by x, rows by y, a row's offset once per row in 64 bits, the column in 32): no
// division or remainder per element (a 64-bit `i % D` is a few dozen instructions each).
// Launch: grid (ceil(n / GELU_THREADS)) or fewer (a grid-stride loop), block GELU_THREADS;
//   the bias F grid (ceil(D / GELU_THREADS), min(N, GELU_ROW_BLOCKS)); the bias B grid
//   (ceil(D / GELU_THREADS), GELU_CHUNKS), its finish (ceil(D / GELU_THREADS)).
#include "common.cuh"

#define GELU_THREADS 256
// Fixed, never the device's size (the sums' order is the code's), and enough that the
// bias B fills a GPU: 256 chunks × the columns' blocks (3072 at GPT-2's 4C), each thread
// a chunk of N / 256 rows (64 at 16 × 1024); 32 left 384 blocks walking 512 rows each.
#define GELU_CHUNKS 256
#define GELU_ROW_BLOCKS 4096  // the bias F's row blocks at most (a grid-stride loop)
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
__device__ void gelu_bias_forward(S* y, const S* x, const S* bias, int N, int D) {
    typedef typename Acc<S>::type A;
    const int c = blockIdx.x * GELU_THREADS + threadIdx.x;
    if (c >= D) return;
    const A b = to_acc(bias[c]);
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const long long i = (long long)r * D + c;
        const A v = to_acc(from_acc<S>(to_acc(x[i]) + b));
        y[i] = from_acc<S>(v * gelu_terms(v).h);
    }
}

// dy/dx at v: h (1 + 2K v (1 + 3A v²) (1 - h)).
template <typename A> __device__ __forceinline__ A gelu_slope(A v) {
    const GeluTerms<A> t = gelu_terms(v);
    A g = t.sq * (A)(6.0 * GELU_K * GELU_A) + (A)(2.0 * GELU_K);
    g *= v;  // 2K x (1 + 3A x²)
    return (g * ((A)1 - t.h) + (A)1) * t.h;
}

template <typename S> __device__ void gelu_backward(S* dx, const S* dy, const S* x, long long n) {
    const long long stride = (long long)gridDim.x * GELU_THREADS;
    for (long long i = (long long)blockIdx.x * GELU_THREADS + threadIdx.x; i < n; i += stride)
        dx[i] = from_acc<S>(to_acc(dy[i]) * gelu_slope(to_acc(x[i])));
}

// Column c of chunk p: dx = dy · gelu'(x + bias) down rows [first, last), and their sum
// (of dx as stored) into partials[p][c]. Threads take consecutive columns: each row's
// reads are coalesced.
template <typename S>
__device__ void gelu_bias_backward(S* dx, typename Acc<S>::type* partials, const S* dy,
                                   const S* x, const S* bias, int N, int D) {
    typedef typename Acc<S>::type A;
    const int c = blockIdx.x * GELU_THREADS + threadIdx.x, p = blockIdx.y;
    const int rows = (N + GELU_CHUNKS - 1) / GELU_CHUNKS;
    const int first = p * rows, last = first + rows < N ? first + rows : N;
    if (c >= D) return;  // no barrier follows
    const A b = to_acc(bias[c]);
    A sum = 0;
    for (long long n = first; n < last; ++n) {
        const long long i = n * D + c;
        const A v = to_acc(from_acc<S>(to_acc(x[i]) + b));  // x + bias as F rounded it
        const S out = from_acc<S>(to_acc(dy[i]) * gelu_slope(v));
        dx[i] = out;
        sum += to_acc(out);
    }
    partials[(long long)p * D + c] = sum;
}

template <typename A> __device__ void gelu_bias_finish(A* dbias, const A* partials, int D) {
    const int c = blockIdx.x * GELU_THREADS + threadIdx.x;
    if (c >= D) return;
    dbias[c] += chunks_sum(partials, GELU_CHUNKS, D, c);
}

#define GELU_KERNELS(S, A, suffix)                                                             \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_forward_##suffix(S* y, const S* x, long long n) {                              \
        gelu_forward<S>(y, x, n);                                                           \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_bias_forward_##suffix(S* y, const S* x, const S* bias, int N, int D) {         \
        gelu_bias_forward<S>(y, x, bias, N, D);                                             \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_bias_backward_##suffix(S* dx, A* partials, const S* dy, const S* x,            \
                                    const S* bias, int N, int D) {                          \
        gelu_bias_backward<S>(dx, partials, dy, x, bias, N, D);                             \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(GELU_THREADS)                              \
        gelu_backward_##suffix(S* dx, const S* dy, const S* x, long long n) {               \
        gelu_backward<S>(dx, dy, x, n);                                                     \
    }

GELU_KERNELS(bf16, float, bf16)
GELU_KERNELS(float, float, f32)
GELU_KERNELS(double, double, f64)

extern "C" __global__ void __launch_bounds__(GELU_THREADS)
    gelu_bias_finish_f32(float* dbias, const float* partials, int D) {
    gelu_bias_finish<float>(dbias, partials, D);
}
extern "C" __global__ void __launch_bounds__(GELU_THREADS)
    gelu_bias_finish_f64(double* dbias, const double* partials, int D) {
    gelu_bias_finish<double>(dbias, partials, D);
}
