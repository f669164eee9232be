// The embedding's weight gradients, deterministic without atomics: d(wte)[v] is the sum
// of dx's rows at token v's positions, in batch order. The caller sorts the positions by
// token with a stable sort on the device (`xp.argsort(idx, kind="stable")`), so each
// token's positions form one run in batch order. A run is cut into pieces by the batch:
// a piece is the token's positions within one span of EMB_CHUNK batch positions
// (position / EMB_CHUNK), so how a token's rows are grouped depends on its own positions
// only — not on the device, nor on other tokens (a vocabulary shard, whose other tokens
// sort elsewhere, groups its tokens' rows as one process does):
//   pass 1, a block per EMB_CHUNK sorted positions (and 128 columns): each piece starting
//     there (at most EMB_CHUNK rows) summed in batch order into its row of `carry`, its
//     length into `lengths`;
//   pass 2, likewise: each run starting there adds its pieces in order into its wte row.
// A token in half of 16 × 1024 positions is 128 pieces summed in parallel, then added in
// a row, where one block used to walk all 8192 positions; a token within one span is its
// rows in batch order, as before. One launch each, no host sync, the same bits every run.
//
// Shapes: N = B·T positions, C channels, V rows of wte here (a vocabulary shard passes
// its local ids: a token outside [0, V) belongs to another shard and is skipped);
// S storage of dx, G the gradients' dtype (float32 for 16-bit compute).
//   idx (N,) int64     token of each position; order (N,) int64: positions sorted by token
//   dx (B, T, C) S;    dwte (V, C) G;  dwpe (>= T, C) G: rows [0, T) accumulated (+=)
//   carry (N, C) G, lengths (N,) int32: workspaces (a piece's sum and length at its start)
// Launch: both wte passes grid (ceil(N / EMB_CHUNK), ceil(C / EMB_THREADS)); wpe grid
// (ceil(T·C / EMB_THREADS)); block EMB_THREADS.
#include "common.cuh"

#define EMB_THREADS 128
#define EMB_CHUNK 128  // batch positions a piece spans at most (fixed: the sums' order)

// Whether sorted position p starts a piece (first of its token, or of its batch span).
__device__ __forceinline__ bool piece_starts(const long long* idx, const long long* order,
                                             long long p) {
    return p == 0 || idx[order[p]] != idx[order[p - 1]] ||
           order[p] / EMB_CHUNK != order[p - 1] / EMB_CHUNK;
}

template <typename S, typename G>
__device__ void embedding_wte_pieces(G* carry, int* lengths, const S* dx, const long long* idx,
                                     const long long* order, long long N, int C) {
    const int c = blockIdx.y * EMB_THREADS + threadIdx.x;
    const long long first = (long long)blockIdx.x * EMB_CHUNK;
    const long long end = first + EMB_CHUNK < N ? first + EMB_CHUNK : N;
    if (c >= C) return;
    for (long long p = first; p < end; ++p) {
        if (!piece_starts(idx, order, p)) continue;
        const long long token = idx[order[p]], span = order[p] / EMB_CHUNK;
        G sum = to_acc(dx[order[p] * C + c]);
        long long q = p + 1;
        for (; q < N && idx[order[q]] == token && order[q] / EMB_CHUNK == span; ++q)
            sum += to_acc(dx[order[q] * C + c]);
        carry[p * C + c] = sum;
        if (c == 0) lengths[p] = (int)(q - p);
    }
}

template <typename G>
__device__ void embedding_wte_runs(G* dwte, const G* carry, const int* lengths,
                                   const long long* idx, const long long* order, long long N,
                                   int C, long long V) {
    const int c = blockIdx.y * EMB_THREADS + threadIdx.x;
    const long long first = (long long)blockIdx.x * EMB_CHUNK;
    const long long end = first + EMB_CHUNK < N ? first + EMB_CHUNK : N;
    if (c >= C) return;
    for (long long p = first; p < end; ++p) {
        const long long token = idx[order[p]];
        if ((p > 0 && idx[order[p - 1]] == token) || token < 0 || token >= V) continue;
        G total = carry[p * C + c];
        for (long long q = p + lengths[p]; q < N && idx[order[q]] == token; q += lengths[q])
            total += carry[q * C + c];
        dwte[token * C + c] += total;
    }
}

template <typename S, typename G>
__device__ void embedding_backward_wpe(G* dwpe, const S* dx, int B, int T, int C) {
    const long long e = (long long)blockIdx.x * EMB_THREADS + threadIdx.x;  // t·C + c
    if (e >= (long long)T * C) return;
    G sum = 0;
    for (int b = 0; b < B; ++b) sum += to_acc(dx[(long long)b * T * C + e]);  // batch order
    dwpe[e] += sum;
}

#define EMBEDDING_KERNELS(S, G, suffix)                                                      \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_wte_pieces_##suffix( \
        G* carry, int* lengths, const S* dx, const long long* idx, const long long* order,   \
        long long N, int C) {                                                                \
        embedding_wte_pieces<S, G>(carry, lengths, dx, idx, order, N, C);                    \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_backward_wpe_##suffix( \
        G* dwpe, const S* dx, int B, int T, int C) {                                         \
        embedding_backward_wpe<S, G>(dwpe, dx, B, T, C);                                     \
    }

EMBEDDING_KERNELS(bf16, float, bf16)
EMBEDDING_KERNELS(float, float, f32)
EMBEDDING_KERNELS(double, double, f64)

extern "C" __global__ void __launch_bounds__(EMB_THREADS)
    embedding_wte_runs_f32(float* dwte, const float* carry, const int* lengths,
                           const long long* idx, const long long* order, long long N, int C,
                           long long V) {
    embedding_wte_runs<float>(dwte, carry, lengths, idx, order, N, C, V);
}
extern "C" __global__ void __launch_bounds__(EMB_THREADS)
    embedding_wte_runs_f64(double* dwte, const double* carry, const int* lengths,
                           const long long* idx, const long long* order, long long N, int C,
                           long long V) {
    embedding_wte_runs<double>(dwte, carry, lengths, idx, order, N, C, V);
}
