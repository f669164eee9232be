// LayerNorm over the channels, fused with the residual add that precedes it in GPT-2's
// pre-LN block (x1 = x + attn(ln_1(x)); then ln_2(x1)); eps 1e-5 and the formulas of
// hpcpipe/model/layers/layernorm.py.
//
// Shapes: N rows (B·T tokens), C channels, P = LN_CHUNKS row chunks; S storage, A = Acc<S>.
//   x, residual, xsum, y (N, C) S       F: xsum = x + residual (rounded to S), y = LN(xsum)
//   xbias (C,) S, optional with residual  F: xsum = (x + xbias) + residual, rounded after each
//                                         add: the projection's bias, bit for bit `y += b`
//   dy, dresidual, dx (N, C) S          B: dx = LN'(dy) + dresidual (dx may be dresidual or dy)
//   weight, bias (C,) S; mean, rstd (N,) A (F writes them for B; no normalised copy kept)
//   partials (P, K, C) A; dweight, dbias (C,) A, accumulated (+=), as the W contract wants
// Launch: F and B grid (N), block LN_THREADS. Weight gradients: partial grid
//   (ceil(C / LN_THREADS), P) then finish grid (ceil(C / LN_THREADS)), block LN_THREADS.
//
// B in row blocks (layernorm_backward_rows, C <= LN_THREADS · LN_COLS = 1024): each block takes
// LN_ROWS rows in order, and besides dx sums its rows' dy·xhat and dy per column into
// partials[p] (P = ceil(N / LN_ROWS), K = 2) — the weight gradients in pieces, so W reads
// neither dy nor x again — and with K = 3 also its dx, whose column sums are the bias
// gradient of the projection that made this LayerNorm's input (ln_2's dx is attn.c_proj's
// output gradient). The finish adds the pieces in order. Grid (P), block LN_THREADS.
#include "common.cuh"

#define LN_THREADS 256
#define LN_CHUNKS 32  // fixed, never the device's size: the sums' order is the code's
#define LN_ROWS 16    // rows per block of the row-block B (its chunks: also fixed)
#define LN_COLS 4     // channels a thread holds there: C up to 1024 (else the row kernel)
// Three blocks per SM at least (a cap of 85 registers; it takes 56 in bf16 and f32, 80 in
// f64, no spills): with the block size alone ptxas (CUDA 13.0) spilled at eight channels.
#define LN_ROWS_MIN_BLOCKS 3
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

// B over rows [LN_ROWS p, LN_ROWS p + LN_ROWS): each row's dx as layernorm_backward makes
// it (the same sums in the same order: the same bits), and per column, in row order, the
// sums of dy·xhat, dy and (K = 3) dx as stored into partials[p][0|1|2][c].
template <typename S>
__device__ void layernorm_backward_rows(S* dx, typename Acc<S>::type* partials,
                                        const S* dresidual, const S* dy, const S* x,
                                        const typename Acc<S>::type* mean,
                                        const typename Acc<S>::type* rstd, const S* weight,
                                        int N, int C, int K) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    const int p = blockIdx.x, first = p * LN_ROWS;
    const int last = first + LN_ROWS < N ? first + LN_ROWS : N;
    A w[LN_COLS], dw[LN_COLS], db[LN_COLS], ds[LN_COLS];
#pragma unroll
    for (int k = 0; k < LN_COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        w[k] = c < C ? to_acc(weight[c]) : (A)0;
        dw[k] = db[k] = ds[k] = 0;
    }
    for (long long row = first; row < last; ++row) {
        const S *dyr = dy + row * C, *xr = x + row * C;
        const A mu = mean[row], r = rstd[row];
        A d[LN_COLS], xhat[LN_COLS], sum_d = 0, sum_dx = 0;
#pragma unroll
        for (int k = 0; k < LN_COLS; ++k) {
            const int c = threadIdx.x + k * LN_THREADS;
            const A g = c < C ? to_acc(dyr[c]) : (A)0;
            xhat[k] = c < C ? (to_acc(xr[c]) - mu) * r : (A)0;
            d[k] = g * w[k];
            if (c < C) {
                sum_d += d[k];
                sum_dx += d[k] * xhat[k];
                dw[k] += g * xhat[k];
                db[k] += g;
            }
        }
        const A mean_d = block_sum<LN_THREADS>(sum_d, scratch) / (A)C;
        const A proj = block_sum<LN_THREADS>(sum_dx, scratch) / (A)C;
        S* dxr = dx + row * C;
        const S* drr = dresidual ? dresidual + row * C : nullptr;
#pragma unroll
        for (int k = 0; k < LN_COLS; ++k) {
            const int c = threadIdx.x + k * LN_THREADS;
            if (c >= C) continue;
            A g = (d[k] - mean_d - xhat[k] * proj) * r;
            if (drr) g += to_acc(drr[c]);
            const S out = from_acc<S>(g);
            dxr[c] = out;
            ds[k] += to_acc(out);
        }
    }
    A* mine = partials + (long long)p * K * C;
#pragma unroll
    for (int k = 0; k < LN_COLS; ++k) {
        const int c = threadIdx.x + k * LN_THREADS;
        if (c >= C) continue;
        mine[c] = dw[k];
        mine[C + c] = db[k];
        if (K == 3) mine[2 * C + c] = ds[k];
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

// dweight, dbias (and with K = 3, dsum) += partials (P, K, C) summed over the chunks.
template <typename A>
__device__ void layernorm_weight_finish(A* dweight, A* dbias, A* dsum, const A* partials,
                                        int P, int K, int C) {
    const int c = blockIdx.x * LN_THREADS + threadIdx.x;
    if (c >= C) return;
    const long long stride = (long long)K * C;  // between one chunk's pieces and the next's
    dweight[c] += chunks_sum(partials, P, stride, c);
    dbias[c] += chunks_sum(partials + C, P, stride, c);
    if (K == 3) dsum[c] += chunks_sum(partials + 2 * C, P, stride, c);
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
    extern "C" __global__ void __launch_bounds__(LN_THREADS, LN_ROWS_MIN_BLOCKS)           \
        layernorm_backward_rows_##suffix(S* dx, A* partials, const S* dresidual, const S* dy, \
                                         const S* x, const A* mean, const A* rstd,         \
                                         const S* weight, int N, int C, int K) {           \
        layernorm_backward_rows<S>(dx, partials, dresidual, dy, x, mean, rstd, weight, N, C, \
                                   K);                                                     \
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
    layernorm_weight_finish_f32(float* dweight, float* dbias, float* dsum, const float* partials,
                                int P, int K, int C) {
    layernorm_weight_finish<float>(dweight, dbias, dsum, partials, P, K, C);
}
extern "C" __global__ void __launch_bounds__(LN_THREADS)
    layernorm_weight_finish_f64(double* dweight, double* dbias, double* dsum,
                                const double* partials, int P, int K, int C) {
    layernorm_weight_finish<double>(dweight, dbias, dsum, partials, P, K, C);
}
