// AdamW over a flat master buffer, writing the 16-bit copy the model computes with, in
// one pass (each of p, g, m, v read and written once). Per element, in the order and
// rounding of hpcpipe/optim/adamw.py's AdamW._update (the scalars come rounded to M, as NumPy
// rounds a Python float against an M array; compiled with --fmad=false so that no
// multiply-add is contracted and the bits are NumPy's):
//   gs = g·grad_scale;  m = b1 m + (1 - b1) gs;  v = b2 v + (1 - b2) gs²
//   p -= decay · mask · p;  p -= m / (sqrt(v / bias2) + eps) · step
// with decay = lr·weight_decay and step = lr / bias1.
//
// Shapes: n elements; M the master dtype (float32, or float64 for the CPU's tests).
//   master, m, v, grad, mask (n,) M    mask: 1 where weight decay applies, else 0
//   copy (n,) bf16, or null for no 16-bit copy
// The _dev kernels read the scalars from device memory instead (s: b1, 1 - b1, b2, 1 - b2,
// bias2, eps, step, decay, grad_scale, in M): a captured CUDA graph replays a launch with
// the arguments it was captured with, so a step whose learning rate and step count change
// reads them where the host writes them before each replay.
// Launch: grid (ceil(n / ADAMW_THREADS)) or fewer (grid-stride), block ADAMW_THREADS.
#include "common.cuh"

#define ADAMW_THREADS 256

template <typename M, typename P>
__device__ void adamw(M* master, M* m, M* v, P* copy, const M* grad, const M* mask, long long n,
                      M b1, M one_minus_b1, M b2, M one_minus_b2, M bias2, M eps, M step,
                      M decay, M grad_scale) {
    const long long stride = (long long)gridDim.x * ADAMW_THREADS;
    for (long long i = (long long)blockIdx.x * ADAMW_THREADS + threadIdx.x; i < n; i += stride) {
        const M gs = grad[i] * grad_scale;
        M mi = m[i] * b1;
        mi = mi + gs * one_minus_b1;
        M vi = v[i] * b2;
        vi = vi + (gs * gs) * one_minus_b2;
        const M update = mi / (sqrt_acc(vi / bias2) + eps) * step;
        M p = master[i];
        p = p - (mask[i] * decay) * p;
        p = p - update;
        master[i] = p;
        m[i] = mi;
        v[i] = vi;
        if (copy) copy[i] = from_acc<P>(p);
    }
}

#define ADAMW_KERNEL(M, P, suffix)                                                          \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS) adamw_##suffix(             \
        M* master, M* m, M* v, P* copy, const M* grad, const M* mask, long long n, M b1,    \
        M one_minus_b1, M b2, M one_minus_b2, M bias2, M eps, M step, M decay,              \
        M grad_scale) {                                                                     \
        adamw<M, P>(master, m, v, copy, grad, mask, n, b1, one_minus_b1, b2, one_minus_b2,  \
                    bias2, eps, step, decay, grad_scale);                                   \
    }

ADAMW_KERNEL(float, bf16, f32)
ADAMW_KERNEL(double, double, f64)

#define ADAMW_DEV_KERNEL(M, P, suffix)                                                      \
    extern "C" __global__ void __launch_bounds__(ADAMW_THREADS) adamw_dev_##suffix(         \
        M* master, M* m, M* v, P* copy, const M* grad, const M* mask, long long n,          \
        const M* s) {                                                                       \
        adamw<M, P>(master, m, v, copy, grad, mask, n, s[0], s[1], s[2], s[3], s[4], s[5],  \
                    s[6], s[7], s[8]);                                                      \
    }

ADAMW_DEV_KERNEL(float, bf16, f32)
ADAMW_DEV_KERNEL(double, double, f64)
