// Cross-entropy from logits, fused with its gradient: each row's maximum and sum of
// exponentials are taken in one online pass over the logits as stored (bf16 stays bf16 in
// memory, arithmetic in float), and the same block then writes the row's dlogits
// (softmax - onehot) · dscale — the full probabilities never exist. The formulas are
// hpcpipe/model/layers/loss.py's: loss_row = log(sum exp(x - max)) + max - x[target].
// The kernel reads the row once from memory (the second read, for dlogits, is the block's
// own recent row, from cache). Tensor parallelism's vocabulary shards take the loss
// through the array library instead (model/layers/loss.py).
//
// Shapes: N rows (B·T), V columns, Vp >= V the row stride (padded vocabulary: columns
// [V, Vp) are excluded from the softmax and get dlogits 0); A = Acc<S>.
//   logits, dlogits (N, Vp) S   dlogits may be logits itself (each element is read first)
//   targets (N,) int64          ids in the full vocabulary
//   losses (N,) A               per row; the loss is their mean
// dscale: scale / N_total, the factor on (softmax - onehot) (gradient accumulation's 1/k).
// Launch: grid (N), block CE_THREADS.
#include "common.cuh"

#define CE_THREADS 256

template <typename A> struct RowStats {
    A top, total;  // total = sum of exp(x - top)
};

template <typename S>
__device__ __forceinline__ RowStats<typename Acc<S>::type> row_stats(const S* row, int V) {
    typedef typename Acc<S>::type A;
    __shared__ A scratch[WARP];
    A top = -HP_INFINITY, total = 0;
    for (int c = threadIdx.x; c < V; c += CE_THREADS) {  // online: one read of each logit
        const A x = to_acc(row[c]);
        if (x > top) {
            total = total * exp_acc(top - x) + (A)1;
            top = x;
        } else {
            total += exp_acc(x - top);
        }
    }
    RowStats<A> stats;
    stats.top = block_max<CE_THREADS>(top, scratch);
    // A thread that saw no column has top -inf and total 0: it adds nothing.
    const A mine = total == (A)0 ? (A)0 : total * exp_acc(top - stats.top);
    stats.total = block_sum<CE_THREADS>(mine, scratch);
    return stats;
}

template <typename S>
__device__ __forceinline__ void write_dlogits(S* drow, const S* row, int V, int Vp,
                                              long long local_target,
                                              RowStats<typename Acc<S>::type> stats,
                                              typename Acc<S>::type dscale) {
    typedef typename Acc<S>::type A;
    const A inv = (A)1 / stats.total;  // one reciprocal a row, not a division a logit
    for (int c = threadIdx.x; c < Vp; c += CE_THREADS) {
        A g = 0;
        if (c < V) {
            g = exp_acc(to_acc(row[c]) - stats.top) * inv;
            if (c == local_target) g -= (A)1;
            g *= dscale;
        }
        drow[c] = from_acc<S>(g);
    }
}

template <typename S>
__device__ void cross_entropy_fused(typename Acc<S>::type* losses, S* dlogits, const S* logits,
                                    const long long* targets, int V, int Vp,
                                    typename Acc<S>::type dscale) {
    typedef typename Acc<S>::type A;
    const long long n = blockIdx.x;
    const S* row = logits + n * Vp;
    const long long target = targets[n];
    // Read before row_stats' barriers: once past them other threads may overwrite the
    // target's logit with its gradient (dlogits may be logits).
    const A target_logit = threadIdx.x == 0 ? to_acc(row[target]) : (A)0;
    const RowStats<A> stats = row_stats(row, V);
    if (threadIdx.x == 0) losses[n] = log_acc(stats.total) + stats.top - target_logit;
    write_dlogits(dlogits + n * Vp, row, V, Vp, target, stats, dscale);
}

#define CROSS_ENTROPY_KERNELS(S, A, suffix)                                                  \
    extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_fused_##suffix(   \
        A* losses, S* dlogits, const S* logits, const long long* targets, int V, int Vp,     \
        A dscale) {                                                                          \
        cross_entropy_fused<S>(losses, dlogits, logits, targets, V, Vp, dscale);             \
    }

CROSS_ENTROPY_KERNELS(bf16, float, bf16)
CROSS_ENTROPY_KERNELS(float, float, f32)
CROSS_ENTROPY_KERNELS(double, double, f64)
