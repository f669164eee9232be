// RMSNorm over the channels (the Llama family's), fused with the residual add that
// precedes it in the Llama block (x1 = x + attn(input_layernorm(x)); then
// post_attention_layernorm(x1)), with the formulas and the order of operations of
// hpcpipe/model/layers/rmsnorm.py: ms = (Σ x²) · (1/C), rstd = 1 / sqrt(ms + eps),
// y = (x · rstd) · w; B: dxhat = dy · w, proj = (Σ dxhat · xhat) · (1/C),
// dx = (dxhat − xhat · proj) · rstd (+ dresidual); W: dw = Σ_rows dy · xhat.
// F keeps no normalised copy: B recomputes xhat = x · rstd from the row's rstd.
//
// Shapes: N rows (B·T tokens), C channels; S storage, A = Acc<S>.
//   x, residual, xsum, y (N, C) S       F: xsum = x + residual (rounded to S), y = RMSNorm(xsum)
//   dy, dresidual, dx (N, C) S          B: dx = RMSNorm'(dy) + dresidual (dx may be dresidual or dy)
//   weight (C,) S; rstd (N,) A (F writes it for B); eps an A
//   partials (P, C) A; dweight (C,) A, accumulated (+=), as the W contract wants
// Launch: F and the row B grid (N), block RN_THREADS. B in row blocks
//   (rmsnorm_backward_rows, C <= RN_THREADS · RN_COLS = 1024): grid (ceil(N / RN_ROWS)),
//   each block its RN_ROWS rows in order, writing besides dx its rows' column sums of
//   dy·xhat into partials[p] (P = ceil(N / RN_ROWS)) — the weight gradient in pieces, so
//   W reads neither dy nor x. Wider rows: the row B, then rmsnorm_weight_partials grid
//   (ceil(C / RN_THREADS), RN_CHUNKS) over fixed chunks of rows (P = RN_CHUNKS). Either
//   way rmsnorm_weight_finish grid (ceil(C / RN_THREADS)) adds the pieces in order.
#include "common.cuh"

#define RN_THREADS 256
#define RN_CHUNKS 32  // fixed, never the device's size: the sums' order is the code's
#define RN_ROWS 16    // rows per block of the row-block B
#define RN_COLS 4     // channels a thread holds there: C up to 1024 (else the row kernels)
#define RN_ROWS_MIN_BLOCKS 3

template <typename S>
__device__ void rmsnorm_forward(S* y, S* xsum, typename Acc<S>::type* rstd, const S* x,
                                const S* residual, const S* weight,
                                typename Acc<S>::type eps, int C) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const long long row = blockIdx.x;
    const S* xr = x + row * C;
    // With a residual the normalised row is the sum as stored (rounded to S once): the
    // number the NumPy block's `y += residual` keeps; each thread rereads what it wrote.
    const S* in = xr;
    A squares = 0;
    if (residual) {
        S* out = xsum + row * C;
        const S* rr = residual + row * C;
        for (int c = threadIdx.x; c < C; c += RN_THREADS) {
            out[c] = from_acc<S>(to_acc(xr[c]) + to_acc(rr[c]));
            const A v = to_acc(out[c]);
            squares += v * v;
        }
        in = out;
    } else {
        for (int c = threadIdx.x; c < C; c += RN_THREADS) {
            const A v = to_acc(xr[c]);
            squares += v * v;
        }
    }
    const A ms = block_sum<RN_THREADS>(squares, scratch) * ((A)1 / (A)C);
    const A r = (A)1 / sqrt_acc(ms + eps);
    S* yr = y + row * C;
    for (int c = threadIdx.x; c < C; c += RN_THREADS)
        yr[c] = from_acc<S>((to_acc(in[c]) * r) * to_acc(weight[c]));
    if (threadIdx.x == 0) rstd[row] = r;
}

// dx of one row (any C): the Jacobian above, xhat recomputed.
template <typename S>
__device__ void rmsnorm_backward(S* dx, const S* dresidual, const S* dy, const S* x,
                                 const typename Acc<S>::type* rstd, const S* weight, int C) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const long long row = blockIdx.x;
    const S *dyr = dy + row * C, *xr = x + row * C;
    const A r = rstd[row];
    A sum_dx = 0;
    for (int c = threadIdx.x; c < C; c += RN_THREADS)
        sum_dx += (to_acc(dyr[c]) * to_acc(weight[c])) * (to_acc(xr[c]) * r);
    const A proj = block_sum<RN_THREADS>(sum_dx, scratch) * ((A)1 / (A)C);
    S* dxr = dx + row * C;
    const S* drr = dresidual ? dresidual + row * C : nullptr;
    for (int c = threadIdx.x; c < C; c += RN_THREADS) {
        const A d = to_acc(dyr[c]) * to_acc(weight[c]);
        A g = (d - (to_acc(xr[c]) * r) * proj) * r;
        if (drr) g += to_acc(drr[c]);
        dxr[c] = from_acc<S>(g);
    }
}

// B over rows [RN_ROWS p, RN_ROWS p + RN_ROWS): each row's dx as rmsnorm_backward makes it
// (the same sums in the same order: the same bits), and per column, in row order, the sum
// of dy·xhat into partials[p][c].
template <typename S>
__device__ void rmsnorm_backward_rows(S* dx, typename Acc<S>::type* partials,
                                      const S* dresidual, const S* dy, const S* x,
                                      const typename Acc<S>::type* rstd, const S* weight,
                                      int N, int C) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const int p = blockIdx.x, first = p * RN_ROWS;
    const int last = first + RN_ROWS < N ? first + RN_ROWS : N;
    A w[RN_COLS], dw[RN_COLS];
#pragma unroll
    for (int k = 0; k < RN_COLS; ++k) {
        const int c = threadIdx.x + k * RN_THREADS;
        w[k] = c < C ? to_acc(weight[c]) : (A)0;
        dw[k] = 0;
    }
    for (long long row = first; row < last; ++row) {
        const S *dyr = dy + row * C, *xr = x + row * C;
        const A r = rstd[row];
        A d[RN_COLS], xhat[RN_COLS], sum_dx = 0;
#pragma unroll
        for (int k = 0; k < RN_COLS; ++k) {
            const int c = threadIdx.x + k * RN_THREADS;
            const A g = c < C ? to_acc(dyr[c]) : (A)0;
            xhat[k] = c < C ? to_acc(xr[c]) * r : (A)0;
            d[k] = g * w[k];
            if (c < C) {
                sum_dx += d[k] * xhat[k];
                dw[k] += g * xhat[k];
            }
        }
        const A proj = block_sum<RN_THREADS>(sum_dx, scratch) * ((A)1 / (A)C);
        S* dxr = dx + row * C;
        const S* drr = dresidual ? dresidual + row * C : nullptr;
#pragma unroll
        for (int k = 0; k < RN_COLS; ++k) {
            const int c = threadIdx.x + k * RN_THREADS;
            if (c >= C) continue;
            A g = (d[k] - xhat[k] * proj) * r;
            if (drr) g += to_acc(drr[c]);
            dxr[c] = from_acc<S>(g);
        }
    }
    A* mine = partials + (long long)p * C;
#pragma unroll
    for (int k = 0; k < RN_COLS; ++k) {
        const int c = threadIdx.x + k * RN_THREADS;
        if (c < C) mine[c] = dw[k];
    }
}

// Chunk p's column sums of dy·xhat, rows in order: partials[p][c].
template <typename S>
__device__ void rmsnorm_weight_partials(typename Acc<S>::type* partials, const S* dy,
                                        const S* x, const typename Acc<S>::type* rstd, int N,
                                        int C) {
    typedef typename Acc<S>::type A;
    const int c = blockIdx.x * RN_THREADS + threadIdx.x, p = blockIdx.y;
    const int rows = (N + RN_CHUNKS - 1) / RN_CHUNKS;
    const int first = p * rows, last = first + rows < N ? first + rows : N;
    if (c >= C) return;  // no barrier follows
    A dw = 0;
    for (long long n = first; n < last; ++n)
        dw += to_acc(dy[n * C + c]) * (to_acc(x[n * C + c]) * rstd[n]);
    partials[(long long)p * C + c] = dw;
}

// dweight (C,) += partials (P, C) summed over P in order.
template <typename A>
__device__ void rmsnorm_weight_finish(A* dweight, const A* partials, int P, int C) {
    const int c = blockIdx.x * RN_THREADS + threadIdx.x;
    if (c >= C) return;
    dweight[c] += chunks_sum(partials, P, C, c);
}

#define RMSNORM_KERNELS(S, A, suffix)                                                      \
    extern "C" __global__ void __launch_bounds__(RN_THREADS) rmsnorm_forward_##suffix(     \
        S* y, S* xsum, A* rstd, const S* x, const S* residual, const S* weight, A eps,     \
        int C) {                                                                           \
        rmsnorm_forward<S>(y, xsum, rstd, x, residual, weight, eps, C);                    \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(RN_THREADS) rmsnorm_backward_##suffix(    \
        S* dx, const S* dresidual, const S* dy, const S* x, const A* rstd, const S* weight, \
        int C) {                                                                           \
        rmsnorm_backward<S>(dx, dresidual, dy, x, rstd, weight, C);                        \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(RN_THREADS, RN_ROWS_MIN_BLOCKS)           \
        rmsnorm_backward_rows_##suffix(S* dx, A* partials, const S* dresidual, const S* dy, \
                                       const S* x, const A* rstd, const S* weight, int N,  \
                                       int C) {                                            \
        rmsnorm_backward_rows<S>(dx, partials, dresidual, dy, x, rstd, weight, N, C);      \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(RN_THREADS)                               \
        rmsnorm_weight_partials_##suffix(A* partials, const S* dy, const S* x,             \
                                         const A* rstd, int N, int C) {                    \
        rmsnorm_weight_partials<S>(partials, dy, x, rstd, N, C);                           \
    }

RMSNORM_KERNELS(bf16, float, bf16)
RMSNORM_KERNELS(float, float, f32)
RMSNORM_KERNELS(double, double, f64)

extern "C" __global__ void __launch_bounds__(RN_THREADS)
    rmsnorm_weight_finish_f32(float* dweight, const float* partials, int P, int C) {
    rmsnorm_weight_finish<float>(dweight, partials, P, C);
}
extern "C" __global__ void __launch_bounds__(RN_THREADS)
    rmsnorm_weight_finish_f64(double* dweight, const double* partials, int P, int C) {
    rmsnorm_weight_finish<double>(dweight, partials, P, C);
}
