// Causal self-attention, flash-attention style: scores are made a tile of keys at a time,
// the softmax is online (a running maximum and sum per query row), tiles above the
// diagonal are never visited, and no T×T tensor exists in F or B. B recomputes the
// probabilities from the log-sum-exp F keeps, in two kernels that each own their outputs
// (dq by query row; dk, dv by key row), so no sum needs an atomic. Arithmetic is scalar:
// A = Acc<S> in every product, one warp per row, its lanes splitting the head's channels.
// The formulas are hpcpipe/model/layers/attention.py's core: q scaled by 1/sqrt(HS) first,
// s = q k^T, y = softmax(s) v; dq = ds k · scale, dk = ds^T (scaled q), dv = p^T dy.
//
// Shapes: B batch, T time, NH heads, HS head size (a multiple of 32, at most 128),
// C = NH·HS; S storage; A = Acc<S>.
//   qkv (B, T, 3, NH, HS) S   c_attn's output as it lies: q, k, v side by side per token
//   bias (3, NH, HS) S        c_attn's bias, added to each element read (rounded to S as
//                             `qkv += bias` rounds); null when qkv has it. B gets it too.
//   y, dy (B, T, NH, HS) S    = (B, T, C): the layout c_proj reads and its B writes
//   lse (B, NH, T) A          log-sum-exp of each query row's scores (F → B)
//   dd (B, NH, T) A           dy_i · y_i per row (written by the dq kernel, read by dkv)
//   dqkv (B, T, 3, NH, HS) S  laid out like qkv: what c_attn's B and W multiply
// Launch: every kernel grid (ceil(T / ATT_ROWS), NH, B), block ATT_ROWS · 32; the dkv
// kernel after the dq kernel (it reads dd).
#include "common.cuh"

#define ATT_ROWS 8  // rows (warps) per block, which share each shared-memory tile
#define ATT_THREADS (ATT_ROWS * WARP)
#define ATT_MAX_HS 128
#define ATT_LANE_DIMS (ATT_MAX_HS / WARP)  // channels a lane holds at most
// Two blocks per SM at least: tells ptxas it may use up to 128 registers, where NVRTC 13.5
// otherwise squeezed the bf16 dq kernel into 40 and spilled.
#define ATT_MIN_BLOCKS 2

// Rows per shared tile: 32 KiB of tiles in float, the same bytes in double.
template <typename A> struct Tile { static const int rows = sizeof(A) == 8 ? 16 : 32; };

// Where element (b, t, part, h, 0) of qkv (B, T, 3, NH, HS) lies.
__device__ __forceinline__ long long qkv_at(int b, int t, int part, int h, int T, int NH,
                                            int HS) {
    return (((long long)b * T + t) * 3 + part) * NH * HS + (long long)h * HS;
}

// One row's channels, lane l holding l, l + 32, ... (zeros past HS).
template <typename S, typename A>
__device__ __forceinline__ void load_row(A (&out)[ATT_LANE_DIMS], const S* row, int HS, A scale,
                                         const S* bias = nullptr) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k) {
        const int d = lane + k * WARP;
        out[k] = d < HS ? to_acc(plus_bias(row[d], bias, d)) * scale : (A)0;
    }
}

template <typename A>
__device__ __forceinline__ A row_dot(const A (&a)[ATT_LANE_DIMS], const A* b, int HS) {
    const int lane = threadIdx.x % WARP;
    A partial = 0;
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k)
        if (lane + k * WARP < HS) partial += a[k] * b[lane + k * WARP];
    return warp_sum(partial);
}

template <typename A>
__device__ __forceinline__ A lane_dot(const A (&a)[ATT_LANE_DIMS], const A (&b)[ATT_LANE_DIMS]) {
    A partial = 0;
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k) partial += a[k] * b[k];
    return warp_sum(partial);
}

// Rows [t0, t0 + rows) of one part (q, k or v) of one head into a shared tile (zeros past
// T), scaled; the whole block takes part.
template <typename S, typename A>
__device__ __forceinline__ void load_tile(A* tile, const S* base, int t0, int rows, int T,
                                          long long row_stride, int HS, A scale,
                                          const S* bias = nullptr) {
    for (int e = threadIdx.x; e < rows * HS; e += ATT_THREADS) {
        const int j = e / HS, d = e % HS;
        tile[j * ATT_MAX_HS + d] =
            t0 + j < T ? to_acc(plus_bias(base[(t0 + j) * row_stride + d], bias, d)) * scale
                       : (A)0;
    }
}

template <typename S>
__device__ void attention_forward(S* y, typename Acc<S>::type* lse, const S* qkv,
                                  const S* bias, int T, int NH, int HS) {
    typedef typename Acc<S>::type A;
    const int TILE = Tile<A>::rows;
    __shared__ A keys[Tile<A>::rows * ATT_MAX_HS], values[Tile<A>::rows * ATT_MAX_HS];
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP;
    const int first = blockIdx.x * ATT_ROWS, i = first + warp;
    const int last = first + ATT_ROWS - 1 < T - 1 ? first + ATT_ROWS - 1 : T - 1;
    const bool active = i < T;  // the same for a whole warp
    const long long stride = 3LL * NH * HS;  // between tokens in qkv
    const A scale = (A)(1.0 / sqrt((double)HS));
    A q[ATT_LANE_DIMS], acc[ATT_LANE_DIMS];
    load_row(q, qkv + qkv_at(b, active ? i : 0, 0, h, T, NH, HS), HS, scale,
             qkv_bias(bias, 0, h, NH, HS));
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k) acc[k] = 0;
    A top = -HP_INFINITY, total = 0;
    for (int t0 = 0; t0 <= last; t0 += TILE) {  // tiles past the block's last row: skipped
        __syncthreads();  // the previous tile is no longer read
        load_tile(keys, qkv + qkv_at(b, 0, 1, h, T, NH, HS), t0, TILE, T, stride, HS, (A)1,
                  qkv_bias(bias, 1, h, NH, HS));
        load_tile(values, qkv + qkv_at(b, 0, 2, h, T, NH, HS), t0, TILE, T, stride, HS, (A)1,
                  qkv_bias(bias, 2, h, NH, HS));
        __syncthreads();
        const int seen = active ? (i - t0 + 1 < TILE ? i - t0 + 1 : TILE) : 0;  // keys <= i
        for (int j = 0; j < seen; ++j) {
            const A s = row_dot(q, keys + j * ATT_MAX_HS, HS);
            const A new_top = s > top ? s : top;
            const A shrink = exp_acc(top - new_top), p = exp_acc(s - new_top);
            total = total * shrink + p;
            const int lane = threadIdx.x % WARP;
#pragma unroll
            for (int k = 0; k < ATT_LANE_DIMS; ++k) {
                const int d = lane + k * WARP;
                acc[k] = acc[k] * shrink + p * (d < HS ? values[j * ATT_MAX_HS + d] : (A)0);
            }
            top = new_top;
        }
    }
    if (!active) return;  // no barrier follows
    const int lane = threadIdx.x % WARP;
    S* out = y + ((long long)b * T + i) * NH * HS + (long long)h * HS;
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k)
        if (lane + k * WARP < HS) out[lane + k * WARP] = from_acc<S>(acc[k] / total);
    if (lane == 0) lse[((long long)b * NH + h) * T + i] = top + log_acc(total);
}

// dq for each query row i, and dd_i = dy_i · y_i, which the dkv kernel needs.
template <typename S>
__device__ void attention_backward_dq(S* dqkv, typename Acc<S>::type* dd, const S* dy,
                                      const S* y, const S* qkv, const S* bias,
                                      const typename Acc<S>::type* lse, int T, int NH, int HS) {
    typedef typename Acc<S>::type A;
    const int TILE = Tile<A>::rows;
    __shared__ A keys[Tile<A>::rows * ATT_MAX_HS], values[Tile<A>::rows * ATT_MAX_HS];
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first = blockIdx.x * ATT_ROWS, i = first + warp;
    const int last = first + ATT_ROWS - 1 < T - 1 ? first + ATT_ROWS - 1 : T - 1;
    const bool active = i < T;
    const int row = active ? i : 0;
    const long long stride = 3LL * NH * HS;
    const A scale = (A)(1.0 / sqrt((double)HS));
    const long long at = ((long long)b * T + row) * NH * HS + (long long)h * HS;  // in y, dy
    A q[ATT_LANE_DIMS], g[ATT_LANE_DIMS], o[ATT_LANE_DIMS], dq[ATT_LANE_DIMS];
    load_row(q, qkv + qkv_at(b, row, 0, h, T, NH, HS), HS, scale, qkv_bias(bias, 0, h, NH, HS));
    load_row(g, dy + at, HS, (A)1);
    load_row(o, y + at, HS, (A)1);
    const A d_i = lane_dot(g, o);
    const A lse_i = lse[((long long)b * NH + h) * T + row];
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k) dq[k] = 0;
    for (int t0 = 0; t0 <= last; t0 += TILE) {
        __syncthreads();
        load_tile(keys, qkv + qkv_at(b, 0, 1, h, T, NH, HS), t0, TILE, T, stride, HS, (A)1,
                  qkv_bias(bias, 1, h, NH, HS));
        load_tile(values, qkv + qkv_at(b, 0, 2, h, T, NH, HS), t0, TILE, T, stride, HS, (A)1,
                  qkv_bias(bias, 2, h, NH, HS));
        __syncthreads();
        const int seen = active ? (i - t0 + 1 < TILE ? i - t0 + 1 : TILE) : 0;
        for (int j = 0; j < seen; ++j) {
            const A p = exp_acc(row_dot(q, keys + j * ATT_MAX_HS, HS) - lse_i);
            const A ds = p * (row_dot(g, values + j * ATT_MAX_HS, HS) - d_i);
#pragma unroll
            for (int k = 0; k < ATT_LANE_DIMS; ++k)
                if (lane + k * WARP < HS) dq[k] += ds * keys[j * ATT_MAX_HS + lane + k * WARP];
        }
    }
    if (!active) return;
    S* out = dqkv + qkv_at(b, i, 0, h, T, NH, HS);
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k)
        if (lane + k * WARP < HS) out[lane + k * WARP] = from_acc<S>(dq[k] * scale);
    if (lane == 0) dd[((long long)b * NH + h) * T + i] = d_i;
}

// dk and dv for each key row j, from the query rows i >= j.
template <typename S>
__device__ void attention_backward_dkv(S* dqkv, const S* dy, const S* qkv, const S* bias,
                                       const typename Acc<S>::type* lse,
                                       const typename Acc<S>::type* dd, int T, int NH, int HS) {
    typedef typename Acc<S>::type A;
    const int TILE = Tile<A>::rows;
    __shared__ A queries[Tile<A>::rows * ATT_MAX_HS], grads[Tile<A>::rows * ATT_MAX_HS];
    __shared__ A lses[Tile<A>::rows], dds[Tile<A>::rows];
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first = blockIdx.x * ATT_ROWS, j = first + warp;
    const bool active = j < T;
    const int row = active ? j : 0;
    const long long stride = 3LL * NH * HS, y_stride = (long long)NH * HS;
    const A scale = (A)(1.0 / sqrt((double)HS));
    A k_j[ATT_LANE_DIMS], v_j[ATT_LANE_DIMS], dk[ATT_LANE_DIMS], dv[ATT_LANE_DIMS];
    load_row(k_j, qkv + qkv_at(b, row, 1, h, T, NH, HS), HS, (A)1, qkv_bias(bias, 1, h, NH, HS));
    load_row(v_j, qkv + qkv_at(b, row, 2, h, T, NH, HS), HS, (A)1, qkv_bias(bias, 2, h, NH, HS));
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k) dk[k] = dv[k] = 0;
    const A* stats = lse + ((long long)b * NH + h) * T;
    const A* dstats = dd + ((long long)b * NH + h) * T;
    // Query tiles from the one holding the block's first key: those before see none of it.
    for (int t0 = first / TILE * TILE; t0 < T; t0 += TILE) {
        __syncthreads();
        load_tile(queries, qkv + qkv_at(b, 0, 0, h, T, NH, HS), t0, TILE, T, stride, HS, scale,
                  qkv_bias(bias, 0, h, NH, HS));
        load_tile(grads, dy + (long long)b * T * y_stride + (long long)h * HS, t0, TILE, T,
                  y_stride, HS, (A)1);
        for (int e = threadIdx.x; e < TILE; e += ATT_THREADS) {
            lses[e] = t0 + e < T ? stats[t0 + e] : (A)0;
            dds[e] = t0 + e < T ? dstats[t0 + e] : (A)0;
        }
        __syncthreads();
        const int from = active ? (j > t0 ? j - t0 : 0) : TILE;  // query rows i >= j
        const int to = T - t0 < TILE ? T - t0 : TILE;
        for (int r = from; r < to; ++r) {
            const A p = exp_acc(row_dot(k_j, queries + r * ATT_MAX_HS, HS) - lses[r]);
            const A ds = p * (row_dot(v_j, grads + r * ATT_MAX_HS, HS) - dds[r]);
#pragma unroll
            for (int k = 0; k < ATT_LANE_DIMS; ++k) {
                const int d = lane + k * WARP;
                if (d < HS) {
                    dv[k] += p * grads[r * ATT_MAX_HS + d];
                    dk[k] += ds * queries[r * ATT_MAX_HS + d];
                }
            }
        }
    }
    if (!active) return;
    S* out_k = dqkv + qkv_at(b, j, 1, h, T, NH, HS);
    S* out_v = dqkv + qkv_at(b, j, 2, h, T, NH, HS);
#pragma unroll
    for (int k = 0; k < ATT_LANE_DIMS; ++k)
        if (lane + k * WARP < HS) {
            out_k[lane + k * WARP] = from_acc<S>(dk[k]);
            out_v[lane + k * WARP] = from_acc<S>(dv[k]);
        }
}

#define ATTENTION_KERNELS(S, A, suffix)                                                     \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS)               \
        attention_forward_##suffix(S* y, A* lse, const S* qkv, const S* bias, int T, int NH, \
                                   int HS) {                                                \
        attention_forward<S>(y, lse, qkv, bias, T, NH, HS);                                 \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS)               \
        attention_backward_dq_##suffix(S* dqkv, A* dd, const S* dy, const S* y,             \
                                       const S* qkv, const S* bias, const A* lse, int T,    \
                                       int NH, int HS) {                                    \
        attention_backward_dq<S>(dqkv, dd, dy, y, qkv, bias, lse, T, NH, HS);               \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS)               \
        attention_backward_dkv_##suffix(S* dqkv, const S* dy, const S* qkv, const S* bias,  \
                                        const A* lse, const A* dd, int T, int NH, int HS) { \
        attention_backward_dkv<S>(dqkv, dy, qkv, bias, lse, dd, T, NH, HS);                 \
    }

ATTENTION_KERNELS(bf16, float, bf16)
ATTENTION_KERNELS(float, float, f32)
ATTENTION_KERNELS(double, double, f64)
