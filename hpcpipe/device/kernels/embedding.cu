// The embedding's weight gradients, deterministic without atomics: d(wte)[v] is the sum
// of dx's rows at token v's positions, added in batch order. The caller sorts the
// positions by token with a stable sort on the device (`xp.argsort(idx, kind="stable")`),
// so each token's positions form one run in batch order; the block at the start of a run
// adds the whole run, every other block leaves at once. One launch, no host sync, the
// same bits on every run — the order of hpcpipe/layers/embedding.py's reduceat.
//
// Shapes: N = B·T positions, C channels, V rows of wte here (a vocabulary shard passes
// its local ids: a token outside [0, V) belongs to another shard and is skipped);
// S storage of dx, G the gradients' dtype (float32 for 16-bit compute).
//   idx (N,) int64     token of each position; order (N,) int64: positions sorted by token
//   dx (B, T, C) S;    dwte (V, C) G;  dwpe (>= T, C) G: rows [0, T) accumulated (+=)
// Launch: wte grid (N, ceil(C / EMB_THREADS)); wpe grid (ceil(T·C / EMB_THREADS));
// block EMB_THREADS.
#include "common.cuh"

#define EMB_THREADS 128

template <typename S, typename G>
__device__ void embedding_backward_wte(G* dwte, const S* dx, const long long* idx,
                                       const long long* order, long long N, int C, long long V) {
    const long long p = blockIdx.x;
    const int c = blockIdx.y * EMB_THREADS + threadIdx.x;
    const long long token = idx[order[p]];
    if (c >= C || (p > 0 && idx[order[p - 1]] == token) || token < 0 || token >= V) return;
    G sum = to_acc(dx[order[p] * C + c]);
    for (long long q = p + 1; q < N && idx[order[q]] == token; ++q)
        sum += to_acc(dx[order[q] * C + c]);
    dwte[token * C + c] += sum;
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
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_backward_wte_##suffix( \
        G* dwte, const S* dx, const long long* idx, const long long* order, long long N,     \
        int C, long long V) {                                                                \
        embedding_backward_wte<S, G>(dwte, dx, idx, order, N, C, V);                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_backward_wpe_##suffix( \
        G* dwpe, const S* dx, int B, int T, int C) {                                         \
        embedding_backward_wpe<S, G>(dwpe, dx, B, T, C);                                     \
    }

EMBEDDING_KERNELS(bf16, float, bf16)
EMBEDDING_KERNELS(float, float, f32)
EMBEDDING_KERNELS(double, double, f64)
