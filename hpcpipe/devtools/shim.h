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
// Tensor cores and async copies, lane by lane (the section at the end; ptx.cuh calls it
// where a GPU build runs the PTX): mma.sync.m16n8k16 (bf16 in, f32 accumulator), ldmatrix
// (.x1/.x2/.x4, .trans) and cp.async (+ commit and wait groups). Each lane hands over its
// own registers and gets back its own, placed at the PTX ISA's documented fragment
// layouts, so the host build proves a kernel's lane mapping: a kernel that assumes the
// wrong layout computes wrong numbers here as on a GPU. The warp-collective instructions
// need all 32 lanes with the same qualifiers, else the block is reported; cp.async copies
// land only when the thread waits for their group (read the tile before the wait and you
// read what was there), and a thread leaving with copies it never waited for is reported.
//
// Not here: wgmma, TMA, a memory model (races are compute-sanitizer's on a GPU), speed.
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

// One cp.async: `bytes` to shared `dst`, the first `src_bytes` of them from `src`, the
// rest zeros. Done when the thread waits for its group (cp_async_wait), not before.
struct Copy {
    void* dst;
    const void* src;
    unsigned bytes, src_bytes;
};

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    Wait wait = Wait::Done;
    unsigned phase = 0;     // which of its warp's two exchange slot sets this lane uses next
    unsigned op_phase = 0;  // likewise for the warp-collective instructions' operand sets
    int collective = 0;     // the instruction (and qualifiers) it waits in, 0: none
    std::vector<Copy> open;                 // cp.async copies since the last commit
    std::vector<std::vector<Copy>> groups;  // committed groups, oldest first
};

// The operands and results of one warp-collective instruction (mma.sync, ldmatrix):
// each lane's operand registers in, each lane's result registers out.
struct WarpOp {
    uint32_t in[kWarp][10];
    uint32_t out[kWarp][4];
    bool done;
};

struct Warp {
    uint64_t slot[2][kWarp];  // two sets: a lane may write the next while others read
    WarpOp op[2];             // likewise
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

[[noreturn]] inline void deadlock(const char* why) {
    std::fprintf(stderr, "shim.h: block (%u, %u, %u) cannot proceed: %s\n", blockIdx.x,
                 blockIdx.y, blockIdx.z, why);
    std::abort();
}

inline void fiber_entry() {
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(nullptr, &block->scheduler_stack,
                                    &block->scheduler_stack_size);
#endif
    block->body(block->closure);
    if (!block->current->open.empty() || !block->current->groups.empty())
        deadlock("a thread exits with cp.async copies it never waited for");
    block->current->wait = Wait::Done;
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(nullptr, block->scheduler_stack, block->scheduler_stack_size);
#endif
    // returning resumes uc_link, the scheduler
}


// A warp-collective instruction (.sync.aligned) needs every lane of the warp, none exited,
// in the same instruction with the same qualifiers: otherwise its behaviour is undefined
// on a GPU, and here it is reported.
inline void check_collective(Block& b, unsigned w, unsigned live) {
    const int first = b.fibers[w * kWarp].collective;
    bool any = false, same = true;
    for (unsigned l = 0; l < kWarp; ++l) {
        any |= b.fibers[w * kWarp + l].collective != 0;
        same &= b.fibers[w * kWarp + l].collective == first;
    }
    if (any && (live != kWarp || !same))
        deadlock("a warp-collective instruction (mma.sync, ldmatrix) is not executed by all "
                 "32 lanes of a warp with the same qualifiers");
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
        f.phase = f.op_phase = 0;
        f.collective = 0;
        f.open.clear();
        f.groups.clear();
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
                check_collective(b, w, live);
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


// -- tensor-core and async-copy instructions, lane by lane (PTX ISA layouts) -------------
//
// ptx.cuh calls these where a GPU build runs the PTX instruction. Each lane passes its own
// registers, as on a GPU, and gets back its own: which element of which matrix a lane
// holds is the PTX ISA's documented layout ("Matrix Fragments for mma.m16n8k16 with
// floating point type"; ldmatrix's), implemented here once, so a kernel that assumes
// another layout computes wrong numbers on the CPU as it would on a GPU. With
// groupID g = lane / 4 and t = lane % 4, a 32-bit register holding two 16-bit elements
// (the lower index in the low half):
//   A 16×16 (row):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16×8 (col):   b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g)
//   C, D 16×8 f32:  c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
//   ldmatrix m8n8 .b16: lanes 8i..8i+7 give the row addresses of matrix i; lane l gets
//   elements 2t, 2t+1 of row g of each matrix, or with .trans elements g of rows 2t, 2t+1.
// All 32 lanes must take part (check_collective); the first lane to resume computes every
// lane's result, reading memory at one instant as the instruction does.
namespace hp {

enum : int { kMma = 1, kLdmatrix = 2 };

// The lane's collective: `fill` its operands in, every lane waits, `compute` (once, for
// the warp), then the lane's `words` result registers.
template <typename Fill, typename Compute>
inline void collective(int instruction, Fill fill, Compute compute, uint32_t* result,
                       int words) {
    Block* b = block;
    const unsigned rank = thread_rank();
    Warp& w = b->warps[rank / kWarp];
    Fiber& me = b->fibers[rank];
    const int lane = int(rank % kWarp);
    WarpOp& op = w.op[me.op_phase];
    me.op_phase ^= 1u;
    op.done = false;  // no lane still reads this set: all have passed the warp's last one
    fill(op.in[lane]);
    me.collective = instruction;
    yield(Wait::Warp);
    me.collective = 0;
    if (!op.done) {
        compute(op);
        op.done = true;
    }
    std::memcpy(result, op.out[lane], sizeof(uint32_t) * words);
}

inline float bf16_low(uint32_t r) { return __bfloat162float(__ushort_as_bfloat16(uint16_t(r))); }
inline float bf16_high(uint32_t r) { return __bfloat162float(__ushort_as_bfloat16(uint16_t(r >> 16))); }

// D = A B + C, 16×8×16, bf16 operands, f32 accumulator: each element of D is C's plus the
// exact sum of its 16 products (bf16 products are exact in double, and so is their sum
// at these magnitudes), rounded once to float.
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                              const float (&c)[4]) {
    auto fill = [&](uint32_t* in) {
        std::memcpy(in, a, 16);
        std::memcpy(in + 4, b, 8);
        std::memcpy(in + 6, c, 16);
    };
    auto compute = [](WarpOp& op) {
        double A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < kWarp; ++l) {
            const int g = l / 4, t = l % 4;
            const uint32_t* in = op.in[l];
            const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
            for (int r = 0; r < 4; ++r) {
                A[rows[r]][cols[r]] = bf16_low(in[r]);
                A[rows[r]][cols[r] + 1] = bf16_high(in[r]);
            }
            B[2 * t][g] = bf16_low(in[4]);
            B[2 * t + 1][g] = bf16_high(in[4]);
            B[2 * t + 8][g] = bf16_low(in[5]);
            B[2 * t + 9][g] = bf16_high(in[5]);
            float cf[4];
            std::memcpy(cf, in + 6, 16);
            C[g][2 * t] = cf[0], C[g][2 * t + 1] = cf[1];
            C[g + 8][2 * t] = cf[2], C[g + 8][2 * t + 1] = cf[3];
        }
        for (int l = 0; l < kWarp; ++l) {
            const int g = l / 4, t = l % 4;
            const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
            for (int r = 0; r < 4; ++r) {
                double sum = 0.0;
                for (int k = 0; k < 16; ++k) sum += A[rows[r]][k] * B[k][cols[r]];
                const float v = float(C[rows[r]][cols[r]] + sum);
                std::memcpy(&op.out[l][r], &v, 4);
            }
        }
    };
    uint32_t out[4];
    collective(kMma, fill, compute, out, 4);
    std::memcpy(d, out, 16);
}

// ldmatrix.sync.aligned.m8n8.x{count}{.trans}.shared.b16 into r[0 .. count).
inline void ldmatrix(uint32_t* r, const void* address, int count, bool trans) {
    auto fill = [&](uint32_t* in) {
        const uint64_t a = reinterpret_cast<uint64_t>(address);
        in[0] = uint32_t(a), in[1] = uint32_t(a >> 32);
    };
    auto compute = [count, trans](WarpOp& op) {
        const uint16_t* rows[32];
        for (int i = 0; i < 8 * count; ++i) {
            const uint64_t a = uint64_t(op.in[i][0]) | uint64_t(op.in[i][1]) << 32;
            if (a % 16) {
                std::fprintf(stderr, "shim.h: ldmatrix row address %#llx (lane %d) is not "
                             "16-byte aligned\n", (unsigned long long)a, i);
                std::abort();
            }
            rows[i] = reinterpret_cast<const uint16_t*>(a);
        }
        for (int l = 0; l < kWarp; ++l) {
            const int g = l / 4, t = l % 4;
            for (int m = 0; m < count; ++m) {
                const uint16_t* const* matrix = rows + 8 * m;
                const uint16_t lo = trans ? matrix[2 * t][g] : matrix[g][2 * t];
                const uint16_t hi = trans ? matrix[2 * t + 1][g] : matrix[g][2 * t + 1];
                op.out[l][m] = uint32_t(lo) | uint32_t(hi) << 16;
            }
        }
    };
    collective(kLdmatrix + 4 * count + (trans ? 32 : 0), fill, compute, r, count);
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: queued; done at the wait.
inline void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes > bytes ||
        reinterpret_cast<uintptr_t>(dst) % bytes ||
        (src_bytes && reinterpret_cast<uintptr_t>(src) % bytes)) {
        std::fprintf(stderr, "shim.h: cp.async of %u bytes (%u from the source) from %p to %p: "
                     "sizes or alignment not allowed\n", bytes, src_bytes, src, dst);
        std::abort();
    }
    block->fibers[thread_rank()].open.push_back({dst, src, bytes, src_bytes});
}

inline void cp_async_commit() {
    Fiber& me = block->fibers[thread_rank()];
    me.groups.push_back(std::move(me.open));
    me.open.clear();
}

// cp.async.wait_group n: this thread's copies land, all but the newest n groups.
inline void cp_async_wait(unsigned newest) {
    Fiber& me = block->fibers[thread_rank()];
    while (me.groups.size() > newest) {
        for (const Copy& c : me.groups.front()) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
        me.groups.erase(me.groups.begin());
    }
}

}  // namespace hp

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
