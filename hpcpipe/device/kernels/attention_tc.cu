// Causal self-attention on tensor cores, bfloat16 storage and float32 accumulation: the
// flash scheme of attention.cu (no T×T tensor, tiles above the diagonal skipped, B in a
// dq kernel and a dk/dv kernel that each own their outputs, so no sum needs an atomic),
// with every product a 16×16×16 WMMA multiply-add instead of a warp's scalar dot products.
//
// Each warp owns 16 rows (queries in F and dq, keys in dkv); a block of TC_WARPS warps
// shares each shared tile of TC_TILE rows of the other side. The products:
//   scores  S = Q K^T        (16 × TILE)  F, dq          S^T = K Q^T    dkv
//   dP = dY V^T              (16 × TILE)  dq             dP^T = V dY^T  dkv
//   y += P V, dq += dS K     (16 × HS)                   dv += P^T dY, dk += dS^T Q
// all of them `scores_of` (A times the transpose of a tile) or `accumulate` (A times a
// tile), fragments only filled, loaded, multiplied and stored: which lane holds which
// element of a fragment is the GPU's business (shim.h computes whole tiles per lane).
//
// F takes the softmax online, in one pass over the keys (FlashAttention-2's): per tile,
// each row's running maximum m and sum l, P = exp(s - m) unnormalised, y += P V, and
// y = y / l at the end. When a tile moves some row's maximum, the accumulator is first
// rescaled by exp(m_old - m_new) per row — through shared memory, a fragment at a time
// (tc_scale_rows), since which lane holds which element of a fragment is not ours to know.
//
// Rounding: P (unnormalised in F, normalised by the log-sum-exp in B) and dS are rounded
// to bfloat16 before their products (as every bfloat16 flash attention does), q·k is
// taken unscaled and the scale 1/sqrt(HS) applied to the float scores and to dq and dk
// at the end. Sums run in a fixed order: bitwise repeatable.
//
// Shapes as attention.cu: qkv (B, T, 3, NH, HS), bias (3, NH, HS) or null (as there: added
// to each element loaded, rounded), y, dy (B, T, NH, HS), lse, dd (B, NH, T) float; HS a
// multiple of 16, at most TC_MAX_HS. Launch: grid (ceil(T / TC_ROWS), NH, B), block
// TC_THREADS; the dkv kernel after the dq kernel (it reads dd).
#include "common.cuh"
#ifndef HPCPIPE_HOST_BUILD
#include <mma.h>
#endif

#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * WARP)
#define TC_ROWS (TC_WARPS * 16)  // a block's own rows: 16 per warp
#define TC_TILE 32               // rows of the other side per shared tile
#define TC_MAX_HS 64
// Two blocks per SM at least (a register cap of 256, no tighter): with the maximum block
// size alone, ptxas (CUDA 13.0) squeezed the forward at head size 64 into 80 registers
// and spilled once the bias loads came in; told this, it takes 116 and spills nothing.
#define TC_MIN_BLOCKS 2

typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, bf16,
                               nvcuda::wmma::row_major> FragA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, bf16,
                               nvcuda::wmma::row_major> FragB;
typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, bf16,
                               nvcuda::wmma::col_major> FragBt;  // rows of B^T
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> FragC;

// Where element (b, t, part, h, 0) of qkv (B, T, 3, NH, HS) lies.
__device__ __forceinline__ long long tc_at(int b, int t, int part, int h, int T, int NH,
                                           int HS) {
    return (((long long)b * T + t) * 3 + part) * NH * HS + (long long)h * HS;
}

// Rows [t0, t0 + rows) of `base` (row stride `stride`) into `dst` (row stride HS), zeros
// past T; threads `first`, `first` + 1, ... `first` + `count` - 1 share the copy.
__device__ __forceinline__ void tc_load(bf16* dst, const bf16* base, int t0, int rows, int T,
                                        long long stride, int HS, int me, int count,
                                        const bf16* bias = nullptr) {
    for (int e = me; e < rows * HS; e += count) {
        const int j = e / HS, d = e % HS;
        dst[e] = t0 + j < T ? plus_bias(base[(long long)(t0 + j) * stride + d], bias, d)
                            : __float2bfloat16(0.0f);
    }
}

// out (16 × TC_TILE, row stride TC_TILE) = a (16 × HS) · tile^T, tile (TC_TILE × HS).
template <int NF>
__device__ __forceinline__ void scores_of(float* out, const bf16* a, const bf16* tile) {
    const int HS = NF * 16;
    for (int n = 0; n < TC_TILE; n += 16) {
        FragC acc;
        nvcuda::wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < HS; k += 16) {
            FragA fa;
            FragBt fb;
            nvcuda::wmma::load_matrix_sync(fa, a + k, HS);
            nvcuda::wmma::load_matrix_sync(fb, tile + n * HS + k, HS);
            nvcuda::wmma::mma_sync(acc, fa, fb, acc);
        }
        nvcuda::wmma::store_matrix_sync(out + n, acc, TC_TILE, nvcuda::wmma::mem_row_major);
    }
}

// acc[f] += p (16 × TC_TILE, row stride TC_TILE) · tile[:, 16f : 16f + 16], tile (TC_TILE × HS).
template <int NF>
__device__ __forceinline__ void accumulate(FragC (&acc)[NF], const bf16* p, const bf16* tile) {
    const int HS = NF * 16;
    for (int k = 0; k < TC_TILE; k += 16) {
        FragA fa;
        nvcuda::wmma::load_matrix_sync(fa, p + k, TC_TILE);
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            FragB fb;
            nvcuda::wmma::load_matrix_sync(fb, tile + k * HS + f * 16, HS);
            nvcuda::wmma::mma_sync(acc[f], fa, fb, acc[f]);
        }
    }
}

// The warp's 16 rows of acc, times `scale` (and row r times row_scale[r], shared, when
// given), into rows [row0, row0 + 16) of `out` (row stride `stride`, columns from 0),
// those below T; `scratch` holds 16 × 16 floats.
// With `sums` (shared, HS floats), sums[c] = the column sums of the rows as stored.
template <int NF>
__device__ __forceinline__ void tc_store(bf16* out, long long stride, const FragC (&acc)[NF],
                                         float* scratch, int row0, int T, float scale,
                                         const float* row_scale = nullptr,
                                         float* sums = nullptr) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        __syncwarp();  // the previous fragment's values are written out
        nvcuda::wmma::store_matrix_sync(scratch, acc[f], 16, nvcuda::wmma::mem_row_major);
        __syncwarp();
        float column = 0.0f;  // lane l: column l % 16, rows l / 16, l / 16 + 2, ... in order
        for (int e = lane; e < 256; e += WARP) {
            const int r = e / 16, c = e % 16;
            if (row0 + r < T) {
                const bf16 v = __float2bfloat16(
                    scratch[e] * scale * (row_scale ? row_scale[r] : 1.0f));
                out[(long long)(row0 + r) * stride + f * 16 + c] = v;
                column += to_acc(v);
            }
        }
        if (sums) {  // the even rows' lane, then the odd rows' (a + b == b + a: both agree)
            column += __shfl_xor_sync(0xffffffffu, column, 16);
            if (lane < 16) sums[f * 16 + lane] = column;
        }
    }
}

// The block's column sums of one part of dqkv into its row of `partials` (gridDim.x · B
// rows of 3·NH·HS floats, laid out like a token's qkv): each warp's `sums` (HS floats;
// zeros for a warp past T), added in warp order. Every thread of the block calls it.
template <int NF>
__device__ __forceinline__ void tc_block_sums(float* partials, const float (*sums)[TC_MAX_HS],
                                              int part, int b, int h, int NH) {
    const int HS = NF * 16;
    __syncthreads();
    if (threadIdx.x < HS) {
        float total = 0.0f;
        for (int w = 0; w < TC_WARPS; ++w) total += sums[w][threadIdx.x];
        const long long row = (long long)b * gridDim.x + blockIdx.x;
        partials[(row * 3 + part) * NH * HS + (long long)h * HS + threadIdx.x] = total;
    }
}

// A lane's place in a warp's 16 × TC_TILE tile: row lane / 2, 16 columns from `col0`; the
// two lanes of a row combine their halves with one shuffle.
struct Place {
    int row, col0;
    __device__ __forceinline__ Place() : row((threadIdx.x % WARP) / 2),
                                         col0((threadIdx.x % 2) * 16) {}
};

__device__ __forceinline__ float pair_max(float v) {
    const float other = __shfl_xor_sync(0xffffffffu, v, 1);
    return other > v ? other : v;
}
__device__ __forceinline__ float pair_sum(float v) {  // a + b == b + a: both lanes agree
    return v + __shfl_xor_sync(0xffffffffu, v, 1);
}

// The warp's 16 rows of acc, row r times row_scale[r] (shared, 16 floats), in place:
// each fragment through `scratch` (16 × 16 floats), whose element layout the fragment's
// is not (that is the GPU's business): stored, its rows scaled, loaded back.
template <int NF>
__device__ __forceinline__ void tc_scale_rows(FragC (&acc)[NF], const float* row_scale,
                                              float* scratch) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        __syncwarp();
        nvcuda::wmma::store_matrix_sync(scratch, acc[f], 16, nvcuda::wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += WARP) scratch[e] *= row_scale[e / 16];
        __syncwarp();
        nvcuda::wmma::load_matrix_sync(acc[f], scratch, 16, nvcuda::wmma::mem_row_major);
    }
}

template <int NF>
__device__ void tc_forward(bf16* y, float* lse, const bf16* qkv, const bf16* bias, int T,
                           int NH) {
    const int HS = NF * 16;
    alignas(32) __shared__ bf16 keys[TC_TILE * TC_MAX_HS], values[TC_TILE * TC_MAX_HS];
    alignas(32) __shared__ bf16 queries[TC_WARPS][16 * TC_MAX_HS];
    alignas(32) __shared__ float scores[TC_WARPS][16 * TC_TILE];
    alignas(32) __shared__ bf16 probs[TC_WARPS][16 * TC_TILE];
    __shared__ float factors[TC_WARPS][16];  // per row: the rescale, then 1 / the sum
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first = blockIdx.x * TC_ROWS, row0 = first + warp * 16;
    const int last = first + TC_ROWS < T ? first + TC_ROWS - 1 : T - 1;
    const long long stride = 3LL * NH * HS;
    const float scale = (float)(1.0 / sqrt((double)HS));
    const Place at;
    const int i = row0 + at.row;
    float* s = scores[warp];
    float* factor = factors[warp];
    tc_load(queries[warp], qkv + tc_at(b, 0, 0, h, T, NH, HS), row0, 16, T, stride, HS, lane,
            WARP, qkv_bias(bias, 0, h, NH, HS));
    float top = -HP_INFINITY, total = 0.0f;
    FragC acc[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) nvcuda::wmma::fill_fragment(acc[f], 0.0f);
    for (int t0 = 0; t0 <= last; t0 += TC_TILE) {
        __syncthreads();
        tc_load(keys, qkv + tc_at(b, 0, 1, h, T, NH, HS), t0, TC_TILE, T, stride, HS,
                threadIdx.x, TC_THREADS, qkv_bias(bias, 1, h, NH, HS));
        tc_load(values, qkv + tc_at(b, 0, 2, h, T, NH, HS), t0, TC_TILE, T, stride, HS,
                threadIdx.x, TC_THREADS, qkv_bias(bias, 2, h, NH, HS));
        __syncthreads();
        if (row0 >= T || t0 > row0 + 15) continue;  // the whole warp: no key seen
        scores_of<NF>(s, queries[warp], keys);
        __syncwarp();
        float most = -HP_INFINITY;
        for (int c = 0; c < 16; ++c) {
            const int j = t0 + at.col0 + c;
            const float v = s[at.row * TC_TILE + at.col0 + c] * scale;
            if (j <= i && i < T && v > most) most = v;
        }
        most = pair_max(most);
        const float new_top = most > top ? most : top;
        float sum = 0.0f;
        for (int c = 0; c < 16; ++c) {
            const int j = t0 + at.col0 + c, e = at.row * TC_TILE + at.col0 + c;
            const float p = j <= i && i < T ? exp_acc(s[e] * scale - new_top) : 0.0f;
            probs[warp][e] = __float2bfloat16(p);
            sum += p;
        }
        sum = pair_sum(sum);
        float shrink = 1.0f;  // a row with no key yet (past T) keeps its zeros as they are
        if (new_top > -HP_INFINITY) {
            shrink = exp_acc(top - new_top);  // 0 at the first key: acc is still 0
            total = total * shrink + sum;
            top = new_top;
        }
        if (at.col0 == 0) factor[at.row] = shrink;
        __syncwarp();  // the probabilities and factors are written; the scores read
        bool moved = false;  // the same answer in every lane: one branch for the warp
        for (int r = 0; r < 16; ++r) moved |= factor[r] != 1.0f;
        if (moved && t0 > 0) tc_scale_rows<NF>(acc, factor, s);  // (at 0 acc is all zeros)
        accumulate<NF>(acc, probs[warp], values);
        __syncwarp();
    }
    if (row0 >= T) return;  // no barrier follows
    __syncwarp();
    if (at.col0 == 0) factor[at.row] = total > 0.0f ? 1.0f / total : 0.0f;
    tc_store<NF>(y + ((long long)b * T) * NH * HS + (long long)h * HS, (long long)NH * HS, acc,
                 s, row0, T, 1.0f, factor);
    if (at.col0 == 0 && i < T) lse[((long long)b * NH + h) * T + i] = top + log_acc(total);
}

// dq for each query row i, and dd_i = dy_i · y_i, which the dkv kernel needs.
template <int NF>
__device__ void tc_backward_dq(bf16* dqkv, float* dd, float* bias_sums, const bf16* dy,
                               const bf16* y, const bf16* qkv, const bf16* bias,
                               const float* lse, int T, int NH) {
    const int HS = NF * 16;
    alignas(32) __shared__ bf16 keys[TC_TILE * TC_MAX_HS], values[TC_TILE * TC_MAX_HS];
    alignas(32) __shared__ bf16 queries[TC_WARPS][16 * TC_MAX_HS];
    alignas(32) __shared__ bf16 grads[TC_WARPS][16 * TC_MAX_HS];
    alignas(32) __shared__ float scores[TC_WARPS][16 * TC_TILE];
    alignas(32) __shared__ bf16 dscores[TC_WARPS][16 * TC_TILE];
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first = blockIdx.x * TC_ROWS, row0 = first + warp * 16;
    const int last = first + TC_ROWS < T ? first + TC_ROWS - 1 : T - 1;
    const long long stride = 3LL * NH * HS, y_stride = (long long)NH * HS;
    const float scale = (float)(1.0 / sqrt((double)HS));
    const Place at;
    const int i = row0 + at.row;
    float* s = scores[warp];
    const long long head = (long long)b * T * y_stride + (long long)h * HS;  // row 0 in y, dy
    tc_load(queries[warp], qkv + tc_at(b, 0, 0, h, T, NH, HS), row0, 16, T, stride, HS, lane,
            WARP, qkv_bias(bias, 0, h, NH, HS));
    tc_load(grads[warp], dy + head, row0, 16, T, y_stride, HS, lane, WARP);
    float d_i = 0.0f, lse_i = 0.0f;  // each lane of the pair sums half of the channels
    if (i < T) {
        for (int d = at.col0 / 16 * (HS / 2); d < (at.col0 / 16 + 1) * (HS / 2); ++d)
            d_i += to_acc(dy[head + i * y_stride + d]) * to_acc(y[head + i * y_stride + d]);
        lse_i = lse[((long long)b * NH + h) * T + i];
    }
    d_i = pair_sum(d_i);
    FragC dq[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) nvcuda::wmma::fill_fragment(dq[f], 0.0f);
    for (int t0 = 0; t0 <= last; t0 += TC_TILE) {
        __syncthreads();
        tc_load(keys, qkv + tc_at(b, 0, 1, h, T, NH, HS), t0, TC_TILE, T, stride, HS,
                threadIdx.x, TC_THREADS, qkv_bias(bias, 1, h, NH, HS));
        tc_load(values, qkv + tc_at(b, 0, 2, h, T, NH, HS), t0, TC_TILE, T, stride, HS,
                threadIdx.x, TC_THREADS, qkv_bias(bias, 2, h, NH, HS));
        __syncthreads();
        if (row0 >= T || t0 > row0 + 15) continue;
        scores_of<NF>(s, queries[warp], keys);
        __syncwarp();
        float p[16];
        for (int c = 0; c < 16; ++c) {
            const int j = t0 + at.col0 + c;
            p[c] = j <= i && i < T ? exp_acc(s[at.row * TC_TILE + at.col0 + c] * scale - lse_i)
                                   : 0.0f;
        }
        __syncwarp();  // every lane has its probabilities before dP overwrites the scores
        scores_of<NF>(s, grads[warp], values);
        __syncwarp();
        for (int c = 0; c < 16; ++c) {
            const int e = at.row * TC_TILE + at.col0 + c;
            dscores[warp][e] = __float2bfloat16(p[c] * (s[e] - d_i));
        }
        __syncwarp();
        accumulate<NF>(dq, dscores[warp], keys);
        __syncwarp();
    }
    __shared__ float sums[TC_WARPS][TC_MAX_HS];
    float* mine = bias_sums ? sums[warp] : nullptr;  // column sums only when asked for
    if (row0 < T) {
        tc_store<NF>(dqkv + tc_at(b, 0, 0, h, T, NH, HS), stride, dq, s, row0, T, scale,
                     nullptr, mine);
        if (at.col0 == 0 && i < T) dd[((long long)b * NH + h) * T + i] = d_i;
    } else if (mine) {
        for (int d = lane; d < HS; d += WARP) mine[d] = 0.0f;
    }
    if (bias_sums) tc_block_sums<NF>(bias_sums, sums, 0, b, h, NH);  // the same in every thread
}

// dk and dv for each key row j, from the query rows i >= j.
template <int NF>
__device__ void tc_backward_dkv(bf16* dqkv, float* bias_sums, const bf16* dy, const bf16* qkv,
                                const bf16* bias, const float* lse, const float* dd, int T,
                                int NH) {
    const int HS = NF * 16;
    alignas(32) __shared__ bf16 queries[TC_TILE * TC_MAX_HS], grads[TC_TILE * TC_MAX_HS];
    alignas(32) __shared__ bf16 keys[TC_WARPS][16 * TC_MAX_HS];
    alignas(32) __shared__ bf16 values[TC_WARPS][16 * TC_MAX_HS];
    alignas(32) __shared__ float scores[TC_WARPS][16 * TC_TILE];
    alignas(32) __shared__ bf16 probs[TC_WARPS][16 * TC_TILE];
    __shared__ float lses[TC_TILE], dds[TC_TILE];
    const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int first = blockIdx.x * TC_ROWS, row0 = first + warp * 16;
    const long long stride = 3LL * NH * HS, y_stride = (long long)NH * HS;
    const float scale = (float)(1.0 / sqrt((double)HS));
    const Place at;
    const int j = row0 + at.row;  // this lane's key row
    float* s = scores[warp];
    tc_load(keys[warp], qkv + tc_at(b, 0, 1, h, T, NH, HS), row0, 16, T, stride, HS, lane, WARP,
            qkv_bias(bias, 1, h, NH, HS));
    tc_load(values[warp], qkv + tc_at(b, 0, 2, h, T, NH, HS), row0, 16, T, stride, HS, lane,
            WARP, qkv_bias(bias, 2, h, NH, HS));
    const float* stats = lse + ((long long)b * NH + h) * T;
    const float* dstats = dd + ((long long)b * NH + h) * T;
    FragC dk[NF], dv[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        nvcuda::wmma::fill_fragment(dk[f], 0.0f);
        nvcuda::wmma::fill_fragment(dv[f], 0.0f);
    }
    // Query tiles from the block's first key on: those before see none of its keys.
    for (int t0 = first; t0 < T; t0 += TC_TILE) {
        __syncthreads();
        tc_load(queries, qkv + tc_at(b, 0, 0, h, T, NH, HS), t0, TC_TILE, T, stride, HS,
                threadIdx.x, TC_THREADS, qkv_bias(bias, 0, h, NH, HS));
        tc_load(grads, dy + (long long)b * T * y_stride + (long long)h * HS, t0, TC_TILE, T,
                y_stride, HS, threadIdx.x, TC_THREADS);
        for (int e = threadIdx.x; e < TC_TILE; e += TC_THREADS) {
            lses[e] = t0 + e < T ? stats[t0 + e] : 0.0f;
            dds[e] = t0 + e < T ? dstats[t0 + e] : 0.0f;
        }
        __syncthreads();
        if (row0 >= T || t0 + TC_TILE - 1 < row0) continue;  // no query at or after a key
        scores_of<NF>(s, keys[warp], queries);  // S^T: row r is key j, column c query t0 + c
        __syncwarp();
        float p[16];
        for (int c = 0; c < 16; ++c) {
            const int q = at.col0 + c, e = at.row * TC_TILE + q;
            p[c] = t0 + q >= j && t0 + q < T && j < T ? exp_acc(s[e] * scale - lses[q]) : 0.0f;
            probs[warp][e] = __float2bfloat16(p[c]);
        }
        __syncwarp();
        accumulate<NF>(dv, probs[warp], grads);  // dv += P^T dY
        __syncwarp();  // P^T is read before dS^T overwrites it, the scores before dP^T
        scores_of<NF>(s, values[warp], grads);  // dP^T
        __syncwarp();
        for (int c = 0; c < 16; ++c) {
            const int q = at.col0 + c, e = at.row * TC_TILE + q;
            probs[warp][e] = __float2bfloat16(p[c] * (s[e] - dds[q]));
        }
        __syncwarp();
        accumulate<NF>(dk, probs[warp], queries);  // dk += dS^T Q (scaled at the end)
        __syncwarp();
    }
    __shared__ float sums[2][TC_WARPS][TC_MAX_HS];  // dk's, dv's
    float* mine_k = bias_sums ? sums[0][warp] : nullptr;  // column sums only when asked for
    float* mine_v = bias_sums ? sums[1][warp] : nullptr;
    if (row0 < T) {
        tc_store<NF>(dqkv + tc_at(b, 0, 1, h, T, NH, HS), stride, dk, s, row0, T, scale,
                     nullptr, mine_k);
        tc_store<NF>(dqkv + tc_at(b, 0, 2, h, T, NH, HS), stride, dv, s, row0, T, 1.0f,
                     nullptr, mine_v);
    } else if (bias_sums) {
        for (int d = lane; d < HS; d += WARP) mine_k[d] = mine_v[d] = 0.0f;
    }
    if (bias_sums) {  // the same in every thread
        tc_block_sums<NF>(bias_sums, sums[0], 1, b, h, NH);
        tc_block_sums<NF>(bias_sums, sums[1], 2, b, h, NH);
    }
}

// dbias (3·NH·HS,) += partials (P, 3·NH·HS) summed over P in order: c_attn's bias gradient.
__device__ void tc_bias_finish(float* dbias, const float* partials, int P, int D) {
    const int c = blockIdx.x * TC_THREADS + threadIdx.x;
    if (c >= D) return;
    dbias[c] += chunks_sum(partials, P, D, c);
}

// One set per head size the tensor-core path takes: NF fragments of 16 channels.
#define TC_ATTENTION_KERNELS(NF, HS)                                                           \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)                  \
        attention_tc_forward_hs##HS(bf16* y, float* lse, const bf16* qkv, const bf16* bias,  \
                                    int T, int NH) {                                         \
        tc_forward<NF>(y, lse, qkv, bias, T, NH);                                            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)                  \
        attention_tc_backward_dq_hs##HS(bf16* dqkv, float* dd, float* bias_sums,             \
                                        const bf16* dy, const bf16* y, const bf16* qkv,      \
                                        const bf16* bias, const float* lse, int T, int NH) { \
        tc_backward_dq<NF>(dqkv, dd, bias_sums, dy, y, qkv, bias, lse, T, NH);               \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)                  \
        attention_tc_backward_dkv_hs##HS(bf16* dqkv, float* bias_sums, const bf16* dy,       \
                                         const bf16* qkv, const bf16* bias, const float* lse, \
                                         const float* dd, int T, int NH) {                   \
        tc_backward_dkv<NF>(dqkv, bias_sums, dy, qkv, bias, lse, dd, T, NH);                 \
    }

TC_ATTENTION_KERNELS(1, 16)
TC_ATTENTION_KERNELS(2, 32)
TC_ATTENTION_KERNELS(3, 48)
TC_ATTENTION_KERNELS(4, 64)

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    attention_tc_bias_finish(float* dbias, const float* partials, int P, int D) {
    tc_bias_finish(dbias, partials, P, D);
}
