// Builds an unchanged CUDA kernel for the host: g++ -std=c++20 -include shim.h kernel.cu.
//
// A launch runs the grid's blocks one after another; within a block every CUDA thread is
// a fiber (ucontext) of one OS thread, run in turn until it reaches a barrier.
// __syncthreads() releases the block once all its live threads have reached it; a warp
// shuffle writes the lane's value into its warp's exchange slot, waits for the warp's
// live lanes, then reads the source lane's slot, so a warp's lanes really do swap values.
// blockIdx / threadIdx / blockDim / gridDim are set for each fiber as it runs; __shared__
// variables are function statics, one copy for the block, reused by the next (hence one
// launch at a time per process: launches take a mutex).
//
// Why fibers, not one std::thread per CUDA thread: a barrier of 256 OS threads on two
// busy cores costs milliseconds (every thread must be scheduled once per barrier); fibers
// switch in well under a microsecond, which makes the attention kernels' per-key warp
// reductions affordable in a test. And a barrier that can never complete (a lane
// skipping a shuffle its warp takes, a thread leaving before a __syncthreads its block
// still reaches) is reported and aborts, where threads would hang.
//
// Tensor cores through the WMMA API (nvcuda::wmma, <mma.h>): the same calls, computed by
// each lane on the whole tile (every lane's fragment holds all of it; a GPU spreads it over
// the lanes in an unspecified order, which a kernel must not rely on -- so kernels here
// only fill, load, multiply and store fragments, never touch their elements). Each call
// is warp-collective as on a GPU: it waits for the warp's live lanes first; a store
// writes a lane's share of the elements only, so a lane reading a stored tile without a
// __syncwarp() first reads stale values, as it may on a GPU. Products of 16-bit operands
// are summed in float, k in order.
//
// Not here: the other tensor-core intrinsics (mma.sync PTX, ldmatrix, cp.async), a
// memory model (races are compute-sanitizer's on a GPU), speed.
#pragma once

#include <cuda_bf16.h>  // its host conversions; also dim3

#include <cassert>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/common_interface_defs.h>
#endif

// cuda_bf16.h defines these for its own host-compiler use; a kernel wants them empty.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__ [[gnu::used]]  // also how hostbuild.py finds the kernels
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define HPCPIPE_HOST_BUILD 1

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace hp {

constexpr int kWarp = 32;
constexpr size_t kStack = 256 << 10;  // per fiber; ASan's frames are several times larger

enum class Wait { Run, Block, Warp, Done };

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    Wait wait = Wait::Done;
    unsigned phase = 0;  // which of its warp's two exchange slot sets this lane uses next
};

struct Warp {
    uint64_t slot[2][kWarp];  // two sets: a lane may write the next while others read
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    ucontext_t scheduler;
    Fiber* current = nullptr;
    void (*body)(void*) = nullptr;
    void* closure = nullptr;
#ifdef __SANITIZE_ADDRESS__
    const void* scheduler_stack = nullptr;
    size_t scheduler_stack_size = 0;
#endif
};

inline thread_local Block* block = nullptr;
inline std::mutex launch_mutex;

inline unsigned thread_rank() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Back to the scheduler until released from `wait`.
inline void yield(Wait wait) {
    Block* b = block;
    b->current->wait = wait;
#ifdef __SANITIZE_ADDRESS__
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, b->scheduler_stack, b->scheduler_stack_size);
#endif
    swapcontext(&b->current->context, &b->scheduler);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

inline void fiber_entry() {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, &block->scheduler_stack,
                                    &block->scheduler_stack_size);
#endif
    block->body(block->closure);
    block->current->wait = Wait::Done;
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(nullptr, block->scheduler_stack, block->scheduler_stack_size);
#endif
    // returning resumes uc_link, the scheduler
}

[[noreturn]] inline void deadlock(const char* why) {
    std::fprintf(stderr, "shim.h: block (%u, %u, %u) cannot proceed: %s\n", blockIdx.x,
                 blockIdx.y, blockIdx.z, why);
    std::abort();
}

// Runs one block: every fiber until it waits, then releases whatever barrier is complete.
inline void run_block(Block& b, dim3 block_dim) {
    const unsigned threads = unsigned(b.fibers.size());
    for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = b.fibers[t];
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = kStack;
        f.context.uc_link = &b.scheduler;
        makecontext(&f.context, fiber_entry, 0);
        f.wait = Wait::Run;
        f.phase = 0;
    }
    // Passes alternate between running the fibers first to last and last to first, and
    // neighbouring blocks start the other way round, so that two threads racing between
    // the same pair of barriers (one writing what the other reads) run in both orders in
    // some block: such a race then shows up as a wrong number on the CPU, as it might on
    // a GPU. (Deterministic: the same orders on every run.)
    const unsigned parity = blockIdx.x + blockIdx.y + blockIdx.z;
    for (unsigned pass = 0;; ++pass) {
        for (unsigned i = 0; i < threads; ++i) {
            const unsigned t = (pass + parity) % 2 ? threads - 1 - i : i;
            Fiber& f = b.fibers[t];
            if (f.wait != Wait::Run) continue;
            threadIdx = dim3(t % block_dim.x, t / block_dim.x % block_dim.y,
                             t / (block_dim.x * block_dim.y));
            b.current = &f;
#ifdef __SANITIZE_ADDRESS__
            void* fake = nullptr;
            __sanitizer_start_switch_fiber(&fake, f.stack.get(), kStack);
#endif
            swapcontext(&b.scheduler, &f.context);
#ifdef __SANITIZE_ADDRESS__
            __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
        }
        unsigned done = 0, at_block = 0;
        for (const Fiber& f : b.fibers) {
            done += f.wait == Wait::Done;
            at_block += f.wait == Wait::Block;
        }
        if (done == threads) return;
        bool released = false;
        for (unsigned w = 0; w < threads / kWarp; ++w) {
            unsigned at_warp = 0, live = 0;
            for (unsigned l = 0; l < kWarp; ++l) {
                const Wait s = b.fibers[w * kWarp + l].wait;
                at_warp += s == Wait::Warp;
                live += s != Wait::Done;
            }
            if (at_warp > 0 && at_warp == live) {
                for (unsigned l = 0; l < kWarp; ++l)
                    if (b.fibers[w * kWarp + l].wait == Wait::Warp)
                        b.fibers[w * kWarp + l].wait = Wait::Run;
                released = true;
            }
        }
        if (released) continue;
        if (at_block > 0 && at_block + done == threads) {
            for (Fiber& f : b.fibers)
                if (f.wait == Wait::Block) f.wait = Wait::Run;
            continue;
        }
        deadlock(at_block ? "some threads wait at __syncthreads while others are in a warp "
                            "shuffle or have exited"
                          : "a warp's lanes wait at different barriers");
    }
}

// Runs kernel(args...) over the grid; args as cuLaunchKernel takes them (an array of
// pointers to each argument's value).
template <typename... P, size_t... I>
void launch(void (*kernel)(P...), dim3 grid, dim3 block_dim, void** args,
            std::index_sequence<I...>) {
    using Values = std::tuple<std::decay_t<P>...>;
    Values values{*static_cast<std::decay_t<P>*>(args[I])...};
    const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
    assert(threads > 0 && threads % kWarp == 0 && threads <= 1024);
    std::lock_guard<std::mutex> one_launch_at_a_time(launch_mutex);
    struct Call {
        void (*kernel)(P...);
        Values* values;
    } call{kernel, &values};
    Block b;
    b.fibers.resize(threads);
    for (Fiber& f : b.fibers) f.stack.reset(new char[kStack]);
    b.warps.resize(threads / kWarp);
    b.body = [](void* c) {
        Call* call = static_cast<Call*>(c);
        std::apply(call->kernel, *call->values);
    };
    b.closure = &call;
    Block* outer = block;
    block = &b;
    blockDim = block_dim;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3(x, y, z);
                run_block(b, block_dim);
            }
    block = outer;
}

template <typename T> T exchange(T value, int source) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move at most 8 bytes");
    Block* b = block;
    const unsigned rank = thread_rank();
    Warp& w = b->warps[rank / kWarp];
    Fiber& me = b->fibers[rank];
    const int lane = int(rank % kWarp);
    uint64_t* slots = w.slot[me.phase];
    me.phase ^= 1u;
    std::memcpy(&slots[lane], &value, sizeof(T));
    yield(Wait::Warp);  // every live lane has written
    T result;
    std::memcpy(&result, &slots[source], sizeof(T));
    return result;
}

inline int lane() { return int(thread_rank() % kWarp); }

}  // namespace hp

inline void __syncthreads() { hp::yield(hp::Wait::Block); }
inline void __syncwarp(unsigned = 0xffffffffu) { hp::yield(hp::Wait::Warp); }

template <typename T> T __shfl_xor_sync(unsigned, T value, int mask, int = hp::kWarp) {
    return hp::exchange(value, hp::lane() ^ mask);
}
template <typename T> T __shfl_down_sync(unsigned, T value, unsigned delta, int = hp::kWarp) {
    const int source = hp::lane() + int(delta);
    return hp::exchange(value, source < hp::kWarp ? source : hp::lane());
}
template <typename T> T __shfl_sync(unsigned, T value, int source, int = hp::kWarp) {
    return hp::exchange(value, source & (hp::kWarp - 1));
}


// -- nvcuda::wmma on the host (see the top of this file) ------------------------------------
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct tile_shape;
template <int M, int N, int K> struct tile_shape<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct tile_shape<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct tile_shape<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

// The whole tile, row by row, whatever the layout it was loaded from.
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static constexpr int rows = tile_shape<Use, M, N, K>::rows;
    static constexpr int cols = tile_shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols;
    T x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, const V& value) {
    __syncwarp();
    for (int e = 0; e < f.num_elements; ++e) f.x[e] = T(value);
}

template <typename Use, int M, int N, int K, typename T, typename L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm) {
    static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>,
                  "an operand fragment names its layout");
    __syncwarp();
    for (int r = 0; r < f.rows; ++r)
        for (int c = 0; c < f.cols; ++c)
            f.x[r * f.cols + c] = std::is_same_v<L, row_major> ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                             layout_t layout) {
    __syncwarp();
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c)
            f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t layout) {
    __syncwarp();
    for (int e = hp::lane(); e < M * N; e += hp::kWarp) {  // this lane's share
        const int r = e / N, c = e % N;
        (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[e];
    }
}

inline float operand(float v) { return v; }
inline float operand(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int M, int N, int K, typename T, typename LA, typename LB, typename C>
inline void mma_sync(fragment<accumulator, M, N, K, C>& d,
                     const fragment<matrix_a, M, N, K, T, LA>& a,
                     const fragment<matrix_b, M, N, K, T, LB>& b,
                     const fragment<accumulator, M, N, K, C>& c) {
    __syncwarp();
    C out[M * N];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            C sum = c.x[i * N + j];
            for (int k = 0; k < K; ++k)
                sum += C(operand(a.x[i * K + k])) * C(operand(b.x[k * N + j]));
            out[i * N + j] = sum;
        }
    std::memcpy(d.x, out, sizeof(out));
}

}  // namespace wmma
}  // namespace nvcuda

namespace hp {
template <typename... P> std::tuple<P...> parameters(void (*)(P...));

template <typename... P> int parameter_sizes(void (*)(P...), size_t* sizes) {
    int i = 0;
    ((sizes[i++] = sizeof(std::decay_t<P>)), ...);
    return int(sizeof...(P));
}
}  // namespace hp

// The C entry points ctypes calls: hp_launch_NAME(grid x, y, z, block x, y, z, args) and
// hp_parameters_NAME(sizes) -> count, the byte size of each parameter (so that a caller
// can refuse an argument of the wrong width instead of reading garbage).
#define HP_EXPORT(name)                                                                  \
    extern "C" void hp_launch_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx,  \
                                     unsigned by, unsigned bz, void** args) {             \
        hp::launch(name, dim3(gx, gy, gz), dim3(bx, by, bz), args,                        \
                   std::make_index_sequence<std::tuple_size_v<                           \
                       decltype(hp::parameters(name))>>{});                               \
    }                                                                                    \
    extern "C" int hp_parameters_##name(size_t* sizes) {                                  \
        return hp::parameter_sizes(name, sizes);                                          \
    }
