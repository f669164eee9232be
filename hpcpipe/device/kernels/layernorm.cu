// LayerNorm over the channels, fused with the residual add that precedes it in GPT-2's
// pre-LN block (x1 = x + attn(ln_1(x)); then ln_2(x1)); eps 1e-5 and the formulas of
// hpcpipe/layers/layernorm.py.
//
// Shapes: N rows (B·T tokens), C channels, P = LN_CHUNKS row chunks; S storage, A = Acc<S>.
//   x, residual, xsum, y (N, C) S       F: xsum = x + residual (rounded to S), y = LN(xsum)
//   xbias (C,) S, optional with residual  F: xsum = (x + xbias) + residual, rounded after each
//                                         add: the projection's bias, bit for bit `y += b`
//   dy, dresidual, dx (N, C) S          B: dx = LN'(dy) + dresidual (dx may be dresidual or dy)
//   weight, bias (C,) S; mean, rstd (N,) A (F writes them for B; no normalised copy kept)
//   partials (P, 2, C) A; dweight, dbias (C,) A, accumulated (+=), as the W contract wants
// Launch: F and B grid (N), block LN_THREADS. Weight gradients: partial grid
//   (ceil(C / LN_THREADS), P) then finish grid (ceil(C / LN_THREADS)), block LN_THREADS.
#include "common.cuh"

#define LN_THREADS 256
#define LN_CHUNKS 32  // fixed, never the device's size: the sums' order is the code's
#define LN_EPS 1e-5

template <typename S>
__device__ void layernorm_forward(S* y, S* xsum, typename Acc<S>::type* mean,
                                  typename Acc<S>::type* rstd, const S* x, const S* xbias,
                                  const S* residual, const S* weight, const S* bias, int C) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const long long row = blockIdx.x;
    const S* xr = x + row * C;
    // With a residual, the normalised row is the sum as stored (rounded to S once), the
    // number the NumPy block's `x1 += x` keeps; each thread rereads only what it wrote.
    // With xbias too, the GEMM output's bias is added first and rounded, as `y += bias`
    // before `x1 += x` rounds it: the same bits as the three separate passes.
    const S* in = xr;
    A total = 0;
    if (residual) {
        S* out = xsum + row * C;
        const S* rr = residual + row * C;
        for (int c = threadIdx.x; c < C; c += LN_THREADS) {
            const S v = xbias ? from_acc<S>(to_acc(xr[c]) + to_acc(xbias[c])) : xr[c];
            out[c] = from_acc<S>(to_acc(v) + to_acc(rr[c]));
            total += to_acc(out[c]);
        }
        in = out;
    } else {
        for (int c = threadIdx.x; c < C; c += LN_THREADS) total += to_acc(xr[c]);
    }
    const A mu = block_sum<LN_THREADS>(total, scratch) / (A)C;
    // The variance of the centred row (two passes, as the NumPy layer: no cancellation).
    A squares = 0;
    for (int c = threadIdx.x; c < C; c += LN_THREADS) {
        const A d = to_acc(in[c]) - mu;
        squares += d * d;
    }
    A var = block_sum<LN_THREADS>(squares, scratch) / (A)C;
    const A r = (A)1 / sqrt_acc(var + (A)LN_EPS);
    S* yr = y + row * C;
    for (int c = threadIdx.x; c < C; c += LN_THREADS)
        yr[c] = from_acc<S>((to_acc(in[c]) - mu) * r * to_acc(weight[c]) + to_acc(bias[c]));
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy weight, the
// LayerNorm Jacobian; xhat is recomputed from x, mean and rstd rather than stored.
template <typename S>
__device__ void layernorm_backward(S* dx, const S* dresidual, const S* dy, const S* x,
                                   const typename Acc<S>::type* mean,
                                   const typename Acc<S>::type* rstd, const S* weight, int C) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const long long row = blockIdx.x;
    const S *dyr = dy + row * C, *xr = x + row * C;
    const A mu = mean[row], r = rstd[row];
    A sum_d = 0, sum_dx = 0;
    for (int c = threadIdx.x; c < C; c += LN_THREADS) {
        const A d = to_acc(dyr[c]) * to_acc(weight[c]);
        sum_d += d;
        sum_dx += d * ((to_acc(xr[c]) - mu) * r);
    }
    const A mean_d = block_sum<LN_THREADS>(sum_d, scratch) / (A)C;
    const A proj = block_sum<LN_THREADS>(sum_dx, scratch) / (A)C;
    S* dxr = dx + row * C;
    const S* drr = dresidual ? dresidual + row * C : nullptr;
    for (int c = threadIdx.x; c < C; c += LN_THREADS) {
        const A d = to_acc(dyr[c]) * to_acc(weight[c]);
        const A xhat = (to_acc(xr[c]) - mu) * r;
        A g = (d - mean_d - xhat * proj) * r;
        if (drr) g += to_acc(drr[c]);
        dxr[c] = from_acc<S>(g);
    }
}

// Chunk p's column sums of dy·xhat and dy, rows in order: partials[p][0|1][c].
template <typename S>
__device__ void layernorm_weight_partials(typename Acc<S>::type* partials, const S* dy,
                                          const S* x, const typename Acc<S>::type* mean,
                                          const typename Acc<S>::type* rstd, int N, int C) {
    typedef typename Acc<S>::type A;
    const int c = blockIdx.x * LN_THREADS + threadIdx.x, p = blockIdx.y;
    const int rows = (N + LN_CHUNKS - 1) / LN_CHUNKS;
    const int first = p * rows, last = first + rows < N ? first + rows : N;
    if (c >= C) return;  // no barrier follows
    A dw = 0, db = 0;
    for (long long n = first; n < last; ++n) {
        const A d = to_acc(dy[n * C + c]);
        dw += d * ((to_acc(x[n * C + c]) - mean[n]) * rstd[n]);
        db += d;
    }
    partials[(long long)p * 2 * C + c] = dw;
    partials[(long long)p * 2 * C + C + c] = db;
}

template <typename A>
__device__ void layernorm_weight_finish(A* dweight, A* dbias, const A* partials, int C) {
    const int c = blockIdx.x * LN_THREADS + threadIdx.x;
    if (c >= C) return;
    A dw = 0, db = 0;
    for (int p = 0; p < LN_CHUNKS; ++p) {  // in chunk order: the same bits every run
        dw += partials[(long long)p * 2 * C + c];
        db += partials[(long long)p * 2 * C + C + c];
    }
    dweight[c] += dw;
    dbias[c] += db;
}

#define LAYERNORM_KERNELS(S, A, suffix)                                                    \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) layernorm_forward_##suffix(   \
        S* y, S* xsum, A* mean, A* rstd, const S* x, const S* xbias, const S* residual,    \
        const S* weight, const S* bias, int C) {                                           \
        layernorm_forward<S>(y, xsum, mean, rstd, x, xbias, residual, weight, bias, C);    \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(LN_THREADS) layernorm_backward_##suffix(  \
        S* dx, const S* dresidual, const S* dy, const S* x, const A* mean, const A* rstd,  \
        const S* weight, int C) {                                                          \
        layernorm_backward<S>(dx, dresidual, dy, x, mean, rstd, weight, C);                \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(LN_THREADS)                               \
        layernorm_weight_partials_##suffix(A* partials, const S* dy, const S* x,           \
                                           const A* mean, const A* rstd, int N, int C) {   \
        layernorm_weight_partials<S>(partials, dy, x, mean, rstd, N, C);                   \
    }

LAYERNORM_KERNELS(bf16, float, bf16)
LAYERNORM_KERNELS(float, float, f32)
LAYERNORM_KERNELS(double, double, f64)

extern "C" __global__ void __launch_bounds__(LN_THREADS)
    layernorm_weight_finish_f32(float* dweight, float* dbias, const float* partials, int C) {
    layernorm_weight_finish<float>(dweight, dbias, partials, C);
}
extern "C" __global__ void __launch_bounds__(LN_THREADS)
    layernorm_weight_finish_f64(double* dweight, double* dbias, const double* partials, int C) {
    layernorm_weight_finish<double>(dweight, dbias, partials, C);
}
