// The embedding's weight gradients, deterministic without atomics: d(wte)[v] is the sum
// of dx's rows at token v's positions, in batch order. The caller sorts the positions by
// token with a stable sort on the device (`xp.argsort(idx, kind="stable")`), so each
// token's positions form one run in batch order. The sorted positions are cut into fixed
// chunks of EMB_CHUNK (never the device's size: the order of every sum is the code's):
//   pass 1, a block per chunk (and 128 columns): each run that lies inside the chunk is
//     summed and added to its wte row at once (no other chunk holds any of it); a run that
//     crosses the chunk's start or end leaves its piece here as the chunk's head or tail
//     (carry (chunks, 2, C)), a run covering the whole chunk as its head;
//   pass 2, a block per chunk: the chunk where a crossing run starts adds its tail piece
//     and the heads of the chunks the run covers after it, in chunk order, to the row.
// A token in half of 16 × 1024 positions is 128 chunks summed in parallel, then 128 pieces
// in a row, where one block used to walk all 8192 positions. One launch each, no host
// sync, the same bits on every run.
//
// Shapes: N = B·T positions, C channels, V rows of wte here (a vocabulary shard passes
// its local ids: a token outside [0, V) belongs to another shard and is skipped);
// S storage of dx, G the gradients' dtype (float32 for 16-bit compute).
//   idx (N,) int64     token of each position; order (N,) int64: positions sorted by token
//   dx (B, T, C) S;    dwte (V, C) G;  dwpe (>= T, C) G: rows [0, T) accumulated (+=)
//   carry (ceil(N / EMB_CHUNK), 2, C) G: a workspace
// Launch: both wte passes grid (ceil(N / EMB_CHUNK), ceil(C / EMB_THREADS)); wpe grid
// (ceil(T·C / EMB_THREADS)); block EMB_THREADS.
#include "common.cuh"

#define EMB_THREADS 128
#define EMB_CHUNK 64  // sorted positions a block sums (fixed: the sums' order)

__device__ __forceinline__ long long token_at(const long long* idx, const long long* order,
                                              long long p) {
    return idx[order[p]];
}

template <typename S, typename G>
__device__ void embedding_wte_chunks(G* dwte, G* carry, const S* dx, const long long* idx,
                                     const long long* order, long long N, int C, long long V) {
    const int c = blockIdx.y * EMB_THREADS + threadIdx.x;
    const long long first = (long long)blockIdx.x * EMB_CHUNK;
    const long long end = first + EMB_CHUNK < N ? first + EMB_CHUNK : N;
    if (c >= C) return;
    G* head = carry + ((long long)blockIdx.x * 2) * C;
    G* tail = head + C;
    head[c] = tail[c] = 0;
    for (long long p = first; p < end;) {  // one run piece at a time
        const long long token = token_at(idx, order, p);
        G sum = to_acc(dx[order[p] * C + c]);
        long long q = p + 1;
        for (; q < end && token_at(idx, order, q) == token; ++q) sum += to_acc(dx[order[q] * C + c]);
        const bool from_before = p == first && p > 0 && token_at(idx, order, p - 1) == token;
        const bool goes_on = q == end && q < N && token_at(idx, order, q) == token;
        if (from_before)
            head[c] = sum;  // (a run covering the whole chunk too: its head)
        else if (goes_on)
            tail[c] = sum;
        else if (token >= 0 && token < V)
            dwte[token * C + c] += sum;
        p = q;
    }
}

template <typename G>
__device__ void embedding_wte_carry(G* dwte, const G* carry, const long long* idx,
                                    const long long* order, long long N, int C, long long V) {
    const int c = blockIdx.y * EMB_THREADS + threadIdx.x;
    const long long chunk = blockIdx.x, chunks = (N + EMB_CHUNK - 1) / EMB_CHUNK;
    const long long last = (chunk + 1) * EMB_CHUNK - 1;  // the chunk's last position
    if (c >= C || last + 1 >= N) return;
    const long long token = token_at(idx, order, last);
    if (token_at(idx, order, last + 1) != token) return;  // no run crosses the chunk's end
    // Does the run start here? Not if it covers the whole chunk from before.
    const long long first = chunk * EMB_CHUNK;
    if (first > 0 && token_at(idx, order, first) == token &&
        token_at(idx, order, first - 1) == token)
        return;
    if (token < 0 || token >= V) return;
    G sum = carry[(chunk * 2 + 1) * C + c];
    for (long long k = chunk + 1; k < chunks && token_at(idx, order, k * EMB_CHUNK) == token;
         ++k) {
        sum += carry[(k * 2) * C + c];
        const long long k_last = (k + 1) * EMB_CHUNK - 1;
        if (k_last + 1 >= N || token_at(idx, order, k_last + 1) != token) break;
    }
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
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_wte_chunks_##suffix( \
        G* dwte, G* carry, const S* dx, const long long* idx, const long long* order,        \
        long long N, int C, long long V) {                                                   \
        embedding_wte_chunks<S, G>(dwte, carry, dx, idx, order, N, C, V);                    \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(EMB_THREADS) embedding_backward_wpe_##suffix( \
        G* dwpe, const S* dx, int B, int T, int C) {                                         \
        embedding_backward_wpe<S, G>(dwpe, dx, B, T, C);                                     \
    }

EMBEDDING_KERNELS(bf16, float, bf16)
EMBEDDING_KERNELS(float, float, f32)
EMBEDDING_KERNELS(double, double, f64)

extern "C" __global__ void __launch_bounds__(EMB_THREADS)
    embedding_wte_carry_f32(float* dwte, const float* carry, const long long* idx,
                            const long long* order, long long N, int C, long long V) {
    embedding_wte_carry<float>(dwte, carry, idx, order, N, C, V);
}
extern "C" __global__ void __launch_bounds__(EMB_THREADS)
    embedding_wte_carry_f64(double* dwte, const double* carry, const long long* idx,
                            const long long* order, long long N, int C, long long V) {
    embedding_wte_carry<double>(dwte, carry, idx, order, N, C, V);
}
