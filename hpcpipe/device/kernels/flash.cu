// Causal self-attention the FlashAttention-2 way, bfloat16 storage, float32 accumulation,
// on mma.sync.m16n8k16 tensor-core instructions (ptx.cuh), for head sizes 16, 32, 48, 64;
// grouped-query heads and rotary embeddings optional (the Llama family), c_attn's bias
// added as the tiles are read (GPT-2).
//
// F, per block of FA_ROWS = 64 query rows of one head (FA_Q_WARPS = 2 warps of 32 rows:
// two 16-row m-tiles each, so that every K and V fragment a warp loads from shared memory
// feeds two mma — half the ldmatrix per FLOP of one m-tile a warp, the shared-memory
// wavefronts the kernel model found binding):
//   Q's tile is staged in shared memory once (in key buffer 1, free until tile 1), its A
//   fragments (ldmatrix) then held in registers; key/value tiles of 64 rows stream
//   through two shared buffers by cp.async (tile j + 1 copies while tile j computes);
//   S = Q K^T lands in the accumulator registers (each lane: rows g and g + 8 of each of
//   its warp's m-tiles, columns 2t, 2t + 1 of each 8 keys), the online softmax runs on
//   those registers (row maximum and sum over a lane's values, then across the lane's quad
//   with two shuffles), P is rounded to bfloat16 and repacked in registers as the A
//   fragment of P V (the accumulator layout of two 16×8 tiles is the A layout of one
//   16×16), O rescaled and accumulated in registers. Key tiles above the diagonal are
//   never loaded; in the diagonal tile each m-tile skips the 8-key groups past its last
//   row. y = O / l leaves through shared memory in 16-byte stores; lse = m·scale + ln l
//   (natural log) for B. A row's arithmetic is the same, in the same order, whatever the
//   rows per warp: the rounding model (flashmodel.py) is per row.
// B, as two kernels that each own their outputs (no atomics anywhere):
//   dq: per 64 query rows (as F: 2 warps of two m-tiles), K/V tiles streamed as in F,
//       16 keys at a time: S and P recomputed from lse, dP = dO V^T, dS = P (dP - D),
//       dQ += dS K in registers; also D = rowsum(dO ∘ O).
//   dkv: per 64 key rows of one K/V head (FA_KV_WARPS = 4 warps of 16 key rows: two
//       m-tiles a warp would double dK's and dV's accumulators, 64 registers each, where
//       the kernel holds 253 already), K and V held as A fragments, Q, dO, lse and D
//       tiles of 64 query rows streamed (from the diagonal down, for every query head of
//       the group in turn): S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
//       dS^T = P^T (dP^T - D), dK += dS^T Q — dK and dV summed over the group's query
//       heads in registers, in a fixed order.
//   dQ's second pass costs FLOPs, not memory: S and dP are computed in both kernels,
//   14·HS FLOPs per causal (query, key) pair against FlashAttention-2's 10·HS (which sums
//   dQ across key blocks with float atomics, in an order that changes from run to run).
//
// Reading tiles: each thread copies whole 16-byte pieces of rows (cp.async, zeros past
// T), always a piece and its partner half a row away, so that after its own wait it can
// fix its own pieces in place before the block's barrier: c_attn's bias added (x + b
// rounded to bfloat16, as a separate `qkv += bias` rounds it) and the rotary embedding
// applied (Hugging Face's half rotation: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for
// channel d < HS/2 and its partner d + HS/2, in float, rounded once), both skipped when
// absent. B un-rotates dq and dk in registers (the transpose of the rotation).
// Shared rows are padded by 16 bytes (FA_PAD) so the 8 rows an ldmatrix phase reads start
// in 8 different 4-bank groups: no bank conflicts.
//
// Rounding (tests/harness/flashmodel.py models it in float64, step for step): every
// product on the tensor cores adds its 16 products exactly to the accumulator, rounded
// once; S stays unscaled, p = exp2(s·c - m·c) with c = log2(e)/sqrt(HS) (one fused
// multiply-add), P and dS rounded to bfloat16 before their products, the scale applied to
// dq and dk at the end. Sums run in an order fixed by the code: bitwise repeatable.
//
// Layouts: head h of row (b, t) of q lies at q + (b·T + t)·q_stride + h·HS (likewise k, v
// with kv_stride and head h / (NH / NKV); y, dy with y_stride; dq with q_stride and dk,
// dv with kv_stride) — c_attn's fused (B, T, 3C) output is q = qkv, k = qkv + C,
// v = qkv + 2C with strides 3C. Strides multiples of 8, pointers of 16-byte alignment.
// bq (NH·HS), bk, bv (NKV·HS) or null; cos, sin (T, HS/2) float or null; lse, dd (B, NH, T)
// float; bias_sums (B·ceil(T/64), (NH + 2·NKV)·HS) float or null: each block's column sums
// of dq, dk, dv as stored, for flash_bias_finish.
// Launch: F and dq grid (ceil(T/64), NH, B), block 64 (FA_Q_WARPS warps); dkv grid
// (ceil(T/64), NKV, B), block 128 (FA_KV_WARPS); dkv after dq (it reads dd).
#include "common.cuh"
#include "ptx.cuh"

#define FA_ROWS 64     // a block's own rows; also the rows of a streamed tile
#define FA_Q_TILES 2   // F and dq: 16-row m-tiles a warp holds (32 query rows)
#define FA_Q_WARPS 2   // F and dq: warps a block (FA_ROWS / (16 · FA_Q_TILES))
#define FA_KV_WARPS 4  // dkv: warps a block, 16 key rows each
#define FA_FINISH_THREADS 128
#define FA_MAX_HS 64
#define FA_PAD 8    // bf16 elements (16 bytes) past each shared row
#define FA_LOG2E 1.4426950408889634

struct alignas(16) Piece {  // 16 bytes: one vector load or store
    u32 w[4];
};

template <int HS> struct Shape {
    static constexpr int stride = HS + FA_PAD;   // a shared row, in elements
    static constexpr int tile = FA_ROWS * stride;
    static constexpr int chunks = HS / 16;       // k16 steps over a head's channels
    static constexpr int ntiles = HS / 8;        // n8 tiles of a head's channels
    static constexpr int half = HS / 16;         // 16-byte pieces in half a row
};

// What the kernels read of q, k, v besides the arrays: one struct, passed by value.
struct Heads {
    const bf16 *q, *k, *v;
    const bf16 *bq, *bk, *bv;
    const float *cos, *sin;
    int T, NH, NKV, q_stride, kv_stride;
};

// Rows [t0, t0 + 64) of a head whose row t starts at base + t·stride into `tile`, zeros
// past T: this thread's share, pieces p = tid, tid + THREADS, ... of the tile's 64·HS/16
// pairs (a piece and its partner half a row away: fix_tile's unit).
template <int HS, int THREADS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* base, int stride, int t0,
                                          int T) {
    typedef Shape<HS> S;
    for (int p = threadIdx.x; p < FA_ROWS * S::half; p += THREADS) {
        const int r = p / S::half, c = p % S::half, t = t0 + r;
        const int bytes = t < T ? 16 : 0;
        const bf16* src = base + (long long)(t < T ? t : 0) * stride + 8 * c;
        bf16* dst = tile + r * S::stride + 8 * c;
        cp_async16(dst, src, bytes);
        cp_async16(dst + HS / 2, src + HS / 2, bytes);
    }
}

// This thread's pieces of a landed tile (load_tile's share) fixed in place, 16 bytes at
// a time: the bias added (rounded to bf16), then the rotation at positions t0 + r (in
// float, rounded once). Nothing to do without either.
template <int HS, int THREADS>
__device__ __forceinline__ void fix_tile(bf16* tile, int t0, int T, const bf16* bias,
                                         const float* cos, const float* sin) {
    typedef Shape<HS> S;
    if (bias == nullptr && cos == nullptr) return;
    for (int p = threadIdx.x; p < FA_ROWS * S::half; p += THREADS) {
        const int r = p / S::half, c = p % S::half, t = t0 + r;
        if (t >= T) continue;
        Piece* lo = (Piece*)(tile + r * S::stride + 8 * c);
        Piece* hi = (Piece*)(tile + r * S::stride + 8 * c + HS / 2);
        Piece a = *lo, b = *hi;
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            float x1[2] = {low_bf16(a.w[w]), high_bf16(a.w[w])};
            float x2[2] = {low_bf16(b.w[w]), high_bf16(b.w[w])};
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = 8 * c + 2 * w + e;
                if (bias != nullptr) {
                    x1[e] = __bfloat162float(__float2bfloat16(x1[e] + to_acc(bias[d])));
                    x2[e] = __bfloat162float(__float2bfloat16(x2[e] + to_acc(bias[d + HS / 2])));
                }
                if (cos != nullptr) {
                    const float cs = cos[t * (HS / 2) + d], sn = sin[t * (HS / 2) + d];
                    const float r1 = x1[e] * cs - x2[e] * sn, r2 = x2[e] * cs + x1[e] * sn;
                    x1[e] = r1, x2[e] = r2;
                }
            }
            a.w[w] = pack_bf16(x1[0], x1[1]);
            b.w[w] = pack_bf16(x2[0], x2[1]);
        }
        *lo = a;
        *hi = b;
    }
}

// Test-only: a planted lane-mapping error (tests/devtools/test_lanes.py builds with it and
// expects the kernels to fail their checks): lanes 0 and 1 swap their A fragments.
__device__ __forceinline__ void planted(u32 (&a)[4]) {
#ifdef FA_PLANTED_LANE_SWAP
    const int lane = threadIdx.x % WARP;
    const int other = lane == 0 ? 1 : lane == 1 ? 0 : lane;
    #pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = __shfl_sync(0xffffffffu, a[i], other);
#else
    (void)a;
#endif
}

// The A fragment of rows [row0, row0 + 16), channels [k0, k0 + 16) of a shared tile.
template <int HS>
__device__ __forceinline__ void a_fragment(u32 (&a)[4], const bf16* tile, int row0, int k0) {
    const int lane = threadIdx.x % WARP, i = lane / 8, r = lane % 8;
    ldmatrix_x4(a, tile + (row0 + r + 8 * (i & 1)) * Shape<HS>::stride + k0 + 8 * (i >> 1));
    planted(a);
}

// B fragments of tile^T for two n8 tiles: the tile's rows [n0, n0 + 16) as columns,
// channels [k0, k0 + 16) as k: b[0], b[1] for rows n0 .. n0 + 7, b[2], b[3] for the next 8.
template <int HS>
__device__ __forceinline__ void b_rows(u32 (&b)[4], const bf16* tile, int n0, int k0) {
    const int lane = threadIdx.x % WARP, i = lane / 8, r = lane % 8;
    ldmatrix_x4(b, tile + (n0 + 8 * (i >> 1) + r) * Shape<HS>::stride + k0 + 8 * (i & 1));
}

// B fragments of the tile itself for two n8 tiles: rows [k0, k0 + 16) as k, channels
// [n0, n0 + 16) as columns: b[0], b[1] for channels n0 .. n0 + 7, b[2], b[3] the next 8.
template <int HS>
__device__ __forceinline__ void b_cols(u32 (&b)[4], const bf16* tile, int k0, int n0) {
    const int lane = threadIdx.x % WARP, i = lane / 8, r = lane % 8;
    ldmatrix_x4_t(b, tile + (k0 + 8 * (i & 1) + r) * Shape<HS>::stride + n0 + 8 * (i >> 1));
}

__device__ __forceinline__ void mma_pair(float (&d0)[4], float (&d1)[4], const u32 (&a)[4],
                                         const u32 (&b)[4]) {
    const u32 b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_bf16(d0, a, b0);
    mma_bf16(d1, a, b1);
}

// The A fragment of keys (or queries) [16kc, 16kc + 16) from two 16×8 accumulator tiles
// of probabilities: their layout is A's, rounded to bfloat16.
__device__ __forceinline__ void repack(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
    planted(a);
}

// acc (16 × HS of one warp, accumulator layout) times `scale`, plus `add` (HS values per
// row, F's value bias) — un-rotated at the rows' positions when cos is given — rounded to
// bfloat16, into rows [first, first + 16) of `out` (row t at out + t·stride) below T,
// through the warp's 16 rows of shared `stage`, 16 bytes a store; `kept` receives the
// values as stored (zeros past T).
template <int HS>
__device__ __forceinline__ void store_rows(bf16* out, int stride, int first, int T,
                                           const float (&acc)[HS / 8][4], float scale,
                                           const float* cos, const float* sin, bf16* stage,
                                           float (&kept)[HS / 8][4],
                                           const bf16* add = nullptr) {
    typedef Shape<HS> S;
    const int lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
    float v[HS / 8][4];
    #pragma unroll
    for (int nd = 0; nd < S::ntiles; ++nd)
        #pragma unroll
        for (int c = 0; c < 4; ++c)
            v[nd][c] = acc[nd][c] * scale +
                       (add != nullptr ? to_acc(add[8 * nd + 2 * t + (c & 1)]) : 0.0f);
    if (cos != nullptr) {  // dx = R^T dx': channel d and its partner d + HS/2 in one lane
        #pragma unroll
        for (int nd = 0; nd < S::ntiles / 2; ++nd)
            #pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = first + g + 8 * (c >> 1), d = 8 * nd + 2 * t + (c & 1);
                const int at = (row < T ? row : 0) * (HS / 2) + d;
                const float x1 = v[nd][c], x2 = v[nd + S::ntiles / 2][c];
                v[nd][c] = x1 * cos[at] + x2 * sin[at];
                v[nd + S::ntiles / 2][c] = x2 * cos[at] - x1 * sin[at];
            }
    }
    #pragma unroll
    for (int nd = 0; nd < S::ntiles; ++nd)
        #pragma unroll
        for (int c = 0; c < 4; c += 2) {
            const u32 pair = pack_bf16(v[nd][c], v[nd][c + 1]);
            const bool in = first + g + 8 * (c >> 1) < T;
            kept[nd][c] = in ? low_bf16(pair) : 0.0f;
            kept[nd][c + 1] = in ? high_bf16(pair) : 0.0f;
            *(u32*)(stage + (g + 8 * (c >> 1)) * S::stride + 8 * nd + 2 * t) = pair;
        }
    __syncwarp();
    for (int e = lane; e < 16 * S::ntiles; e += WARP) {
        const int r = e / S::ntiles, c = e % S::ntiles;
        if (first + r < T)
            *(Piece*)(out + (long long)(first + r) * stride + 8 * c) =
                *(const Piece*)(stage + r * S::stride + 8 * c);
    }
    __syncwarp();
}

// The column sums of the block's rows of one output (each warp's `kept` of its MT
// m-tiles, as stored) into `out` (HS floats): down the warp by shuffles, then the WARPS
// warps in order through `scratch` (WARPS·HS floats of shared memory). Every thread of
// the block calls it; the block has at least HS threads.
template <int HS, int MT, int WARPS>
__device__ __forceinline__ void column_sums(float* out, const float (&kept)[MT][HS / 8][4],
                                            float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    #pragma unroll
    for (int nd = 0; nd < HS / 8; ++nd)
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            float v = kept[0][nd][c] + kept[0][nd][c + 2];  // rows g, g + 8
            #pragma unroll
            for (int mt = 1; mt < MT; ++mt) v += kept[mt][nd][c] + kept[mt][nd][c + 2];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if (lane < 4) scratch[warp * HS + 8 * nd + 2 * lane + c] = v;
        }
    __syncthreads();
    if (threadIdx.x < HS) {
        float total = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) total += scratch[w * HS + threadIdx.x];
        out[threadIdx.x] = total;
    }
    __syncthreads();
}

// Whether accumulator element c of 8-key tile nt is a query row at or after its key,
// both below T: `row` and `key` the element's first row and column (c = 0).
__device__ __forceinline__ bool causal(int row, int key, int c, int T) {
    const int i = row + 8 * (c >> 1), j = key + (c & 1);
    return j <= i && i < T;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {  // (a + b) + (c + d) in every lane
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int HS>
__device__ void flash_forward(bf16* y, float* lse, Heads x, int y_stride) {
    typedef Shape<HS> S;
    constexpr int MT = FA_Q_TILES, THREADS = FA_Q_WARPS * WARP;
    alignas(16) __shared__ bf16 smem[4 * FA_ROWS * (FA_MAX_HS + FA_PAD)];
    // Key tile j in buffer j & 1: K at smem + buffer·tile, V two tiles further. Q's tile
    // waits in K's buffer 1 until its fragments are in registers (tile 1 lands after).
    auto kt_of = [&](int j) { return smem + (j & 1) * S::tile; };
    auto vt_of = [&](int j) { return smem + (2 + (j & 1)) * S::tile; };
    bf16* const qs = kt_of(1);
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (x.NH / x.NKV), T = x.T;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
    // The warp's rows: m-tile mt holds rows row0 + 16·mt + [0, 16), its 16-row group
    // within the block mt0 + mt; a lane's rows me[mt] and me[mt] + 8.
    const int q0 = blockIdx.x * FA_ROWS, row0 = warp * 16 * MT, mt0 = warp * MT;
    int me[MT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) me[mt] = q0 + row0 + 16 * mt + g;
    const float c = (float)(FA_LOG2E / sqrt((double)HS));
    const bf16* qb = x.q + (long long)b * T * x.q_stride + h * HS;
    const bf16* kb = x.k + (long long)b * T * x.kv_stride + hk * HS;
    const bf16* vb = x.v + (long long)b * T * x.kv_stride + hk * HS;
    // Without the rotation the key bias shifts each row's scores by one constant, which
    // the softmax ignores: only a rotated tile (whose shift varies with the key) takes it.
    const bf16* bk = x.bk && x.cos ? x.bk + hk * HS : nullptr;
    const bf16* bv = x.bv ? x.bv + hk * HS : nullptr;  // added to y: P's rows sum to 1
    load_tile<HS, THREADS>(qs, qb, x.q_stride, q0, T);
    load_tile<HS, THREADS>(kt_of(0), kb, x.kv_stride, 0, T);
    load_tile<HS, THREADS>(vt_of(0), vb, x.kv_stride, 0, T);
    cp_async_commit();
    cp_async_wait<0>();
    fix_tile<HS, THREADS>(qs, q0, T, x.bq ? x.bq + h * HS : nullptr, x.cos, x.sin);
    fix_tile<HS, THREADS>(kt_of(0), 0, T, bk, x.cos, x.sin);
    __syncthreads();
    u32 qf[MT][S::chunks][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int kk = 0; kk < S::chunks; ++kk)
            a_fragment<HS>(qf[mt][kk], qs, row0 + 16 * mt, 16 * kk);
    __syncthreads();  // Q's fragments are in registers before tile 1 lands on them
    const bool busy = q0 + row0 < T;  // the warp has a row below T (the same in all lanes)
    float o[MT][S::ntiles][4] = {}, m[MT][2], l[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        m[mt][0] = m[mt][1] = -HP_INFINITY, l[mt][0] = l[mt][1] = 0.0f;
    const int last = blockIdx.x;  // key tiles 0 .. last: the diagonal is the last
    for (int j = 0; j <= last; ++j) {
        if (j < last) {
            load_tile<HS, THREADS>(kt_of(j + 1), kb, x.kv_stride, (j + 1) * FA_ROWS, T);
            load_tile<HS, THREADS>(vt_of(j + 1), vb, x.kv_stride, (j + 1) * FA_ROWS, T);
        }
        cp_async_commit();  // (empty at the last tile: the count stays uniform)
        if (j > 0) {  // (tile 0 landed and was fixed with Q's)
            cp_async_wait<1>();
            fix_tile<HS, THREADS>(kt_of(j), j * FA_ROWS, T, bk, x.cos, x.sin);
            __syncthreads();
        }
        // In the diagonal tile m-tile mt's rows see keys up to 16·(mt0 + mt) + 15: 8-key
        // tiles 0 .. 2·(mt0 + mt) + 1; the warp loads what its last m-tile sees.
        int tiles[MT];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) tiles[mt] = j < last ? 8 : 2 * (mt0 + mt) + 2;
        if (busy) {
            const bf16* kt = kt_of(j);
            float s[MT][8][4] = {};
            #pragma unroll
            for (int kk = 0; kk < S::chunks; ++kk)
                #pragma unroll
                for (int np = 0; np < 4; ++np)
                    if (2 * np < tiles[MT - 1]) {
                        u32 bf[4];
                        b_rows<HS>(bf, kt, 16 * np, 16 * kk);
                        #pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            if (2 * np < tiles[mt])
                                mma_pair(s[mt][2 * np], s[mt][2 * np + 1], qf[mt][kk], bf);
                    }
            u32 pa[MT][4][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float top[2] = {m[mt][0], m[mt][1]};
                #pragma unroll
                for (int nt = 0; nt < 8; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool seen = nt < tiles[mt] &&
                            (j < last || causal(me[mt], j * FA_ROWS + 8 * nt + 2 * t, e, T));
                        if (!seen) s[mt][nt][e] = -HP_INFINITY;
                        top[e >> 1] = fmaxf(top[e >> 1], s[mt][nt][e]);
                    }
                float mc[2], alpha[2];
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    top[r] = quad_max(top[r]);
                    const bool none = top[r] == -HP_INFINITY;  // a row past T: nothing seen
                    alpha[r] = none ? 1.0f : exp2f((m[mt][r] - top[r]) * c);
                    mc[r] = none ? 0.0f : top[r] * c;
                    m[mt][r] = top[r];
                    l[mt][r] *= alpha[r];
                }
                #pragma unroll
                for (int nd = 0; nd < S::ntiles; ++nd)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) o[mt][nd][e] *= alpha[e >> 1];
                #pragma unroll
                for (int nt = 0; nt < 8; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mt][nt][e] =
                            nt < tiles[mt] ? exp2f(fmaf(s[mt][nt][e], c, -mc[e >> 1])) : 0.0f;
                        l[mt][e >> 1] += s[mt][nt][e];
                    }
                #pragma unroll
                for (int kc = 0; kc < 4; ++kc) repack(pa[mt][kc], s[mt][2 * kc], s[mt][2 * kc + 1]);
            }
            const bf16* vt = vt_of(j);
            #pragma unroll
            for (int kc = 0; kc < 4; ++kc)
                if (2 * kc < tiles[MT - 1]) {
                    #pragma unroll
                    for (int np = 0; np < S::ntiles / 2; ++np) {
                        u32 bf[4];
                        b_cols<HS>(bf, vt, 16 * kc, 16 * np);
                        #pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            if (2 * kc < tiles[mt])
                                mma_pair(o[mt][2 * np], o[mt][2 * np + 1], pa[mt][kc], bf);
                    }
                }
        }
        __syncthreads();  // the buffers are read before the next copies overwrite them
    }
    cp_async_wait<0>();  // (the last, empty group)
    const float scale = (float)(1.0 / sqrt((double)HS));
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2], kept[S::ntiles][4];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mt][r] = quad_sum(l[mt][r]);
            inv[r] = l[mt][r] > 0.0f ? 1.0f / l[mt][r] : 0.0f;
        }
        #pragma unroll
        for (int nd = 0; nd < S::ntiles; ++nd)
            #pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nd][e] *= inv[e >> 1];
        store_rows<HS>(y + (long long)b * T * y_stride + h * HS, y_stride, q0 + row0 + 16 * mt,
                       T, o[mt], 1.0f, nullptr, nullptr, kt_of(0) + (row0 + 16 * mt) * S::stride,
                       kept, bv);
        #pragma unroll
        for (int r = 0; r < 2; ++r)
            if (t == 0 && me[mt] + 8 * r < T)
                lse[((long long)b * x.NH + h) * T + me[mt] + 8 * r] =
                    m[mt][r] * scale + logf(l[mt][r]);
    }
}

// D = dy · y - dy · bv for one row of one head (bv, F's value bias added to y, or null):
// lane t of the quad sums its 16-byte pieces t, t + 4, ... element by element in order
// (a bf16 product is exact in float), each sum then the quad's (a + b) + (c + d). The
// value bias is out of dP = dy (V + bv)^T and so out of D: dS = P (dP - D) is the same.
template <int HS>
__device__ __forceinline__ float row_dot(const bf16* dy, const bf16* y, const bf16* bv,
                                         int stride, int row, int T) {
    float sum = 0.0f, shift = 0.0f;
    if (row < T) {
        for (int p = threadIdx.x % 4; p < HS / 8; p += 4) {
            const Piece a = *(const Piece*)(dy + (long long)row * stride + 8 * p);
            const Piece o = *(const Piece*)(y + (long long)row * stride + 8 * p);
            #pragma unroll
            for (int w = 0; w < 4; ++w) {
                sum += low_bf16(a.w[w]) * low_bf16(o.w[w]);
                sum += high_bf16(a.w[w]) * high_bf16(o.w[w]);
                if (bv != nullptr) {
                    shift += low_bf16(a.w[w]) * to_acc(bv[8 * p + 2 * w]);
                    shift += high_bf16(a.w[w]) * to_acc(bv[8 * p + 2 * w + 1]);
                }
            }
        }
    }
    return quad_sum(sum) - quad_sum(shift);
}

template <int HS>
__device__ void flash_backward_dq(bf16* dq, float* dd, float* bias_sums, const bf16* dy,
                                  const bf16* y, Heads x, const float* lse, int y_stride) {
    typedef Shape<HS> S;
    constexpr int MT = FA_Q_TILES, THREADS = FA_Q_WARPS * WARP;
    alignas(16) __shared__ bf16 smem[4 * FA_ROWS * (FA_MAX_HS + FA_PAD)];
    // Key tile j in buffer j & 1, as in F; Q waits in V's buffer 1 and dO in K's until
    // their fragments are in registers.
    auto kt_of = [&](int j) { return smem + (j & 1) * S::tile; };
    auto vt_of = [&](int j) { return smem + (2 + (j & 1)) * S::tile; };
    bf16* const qs = vt_of(1);
    bf16* const ds = kt_of(1);
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (x.NH / x.NKV), T = x.T;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
    const int q0 = blockIdx.x * FA_ROWS, row0 = warp * 16 * MT, mt0 = warp * MT;
    int me[MT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) me[mt] = q0 + row0 + 16 * mt + g;
    const float c = (float)(FA_LOG2E / sqrt((double)HS));
    const bf16* qb = x.q + (long long)b * T * x.q_stride + h * HS;
    const bf16* kb = x.k + (long long)b * T * x.kv_stride + hk * HS;
    const bf16* vb = x.v + (long long)b * T * x.kv_stride + hk * HS;
    const bf16* dyb = dy + (long long)b * T * y_stride + h * HS;
    const bf16* yb = y + (long long)b * T * y_stride + h * HS;
    const bf16* bk = x.bk && x.cos ? x.bk + hk * HS : nullptr;  // as in F
    const bf16* bv = x.bv ? x.bv + hk * HS : nullptr;
    load_tile<HS, THREADS>(qs, qb, x.q_stride, q0, T);
    load_tile<HS, THREADS>(ds, dyb, y_stride, q0, T);
    load_tile<HS, THREADS>(kt_of(0), kb, x.kv_stride, 0, T);
    load_tile<HS, THREADS>(vt_of(0), vb, x.kv_stride, 0, T);
    cp_async_commit();
    float D[MT][2], lse2[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = me[mt] + 8 * r;
            D[mt][r] = row_dot<HS>(dyb, yb, bv, y_stride, row, T);
            lse2[mt][r] =
                row < T ? lse[((long long)b * x.NH + h) * T + row] * (float)FA_LOG2E : 0.0f;
        }
    cp_async_wait<0>();
    fix_tile<HS, THREADS>(qs, q0, T, x.bq ? x.bq + h * HS : nullptr, x.cos, x.sin);
    fix_tile<HS, THREADS>(kt_of(0), 0, T, bk, x.cos, x.sin);
    __syncthreads();
    u32 qf[MT][S::chunks][4], df[MT][S::chunks][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int kk = 0; kk < S::chunks; ++kk) {
            a_fragment<HS>(qf[mt][kk], qs, row0 + 16 * mt, 16 * kk);
            a_fragment<HS>(df[mt][kk], ds, row0 + 16 * mt, 16 * kk);
        }
    __syncthreads();  // Q and dO are in registers before tile 1 lands on them
    const bool busy = q0 + row0 < T;
    float acc[MT][S::ntiles][4] = {};
    const int last = blockIdx.x;
    for (int j = 0; j <= last; ++j) {
        if (j < last) {
            load_tile<HS, THREADS>(kt_of(j + 1), kb, x.kv_stride, (j + 1) * FA_ROWS, T);
            load_tile<HS, THREADS>(vt_of(j + 1), vb, x.kv_stride, (j + 1) * FA_ROWS, T);
        }
        cp_async_commit();
        if (j > 0) {
            cp_async_wait<1>();
            fix_tile<HS, THREADS>(kt_of(j), j * FA_ROWS, T, bk, x.cos, x.sin);
            __syncthreads();
        }
        int tiles[MT];  // 8-key tiles each m-tile sees (as in F)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) tiles[mt] = j < last ? 8 : 2 * (mt0 + mt) + 2;
        if (busy) {
            const bf16 *kt = kt_of(j), *vt = vt_of(j);
            // 16 keys at a time (kc): S and dP of those keys, dS, then dQ += dS K — each
            // element's products in the order of a whole tile at once, in fewer registers.
            #pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                if (2 * kc >= tiles[MT - 1]) continue;
                float s[MT][2][4] = {}, dp[MT][2][4] = {};
                #pragma unroll
                for (int kk = 0; kk < S::chunks; ++kk) {
                    u32 bf[4];
                    b_rows<HS>(bf, kt, 16 * kc, 16 * kk);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        if (2 * kc < tiles[mt]) mma_pair(s[mt][0], s[mt][1], qf[mt][kk], bf);
                    b_rows<HS>(bf, vt, 16 * kc, 16 * kk);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        if (2 * kc < tiles[mt]) mma_pair(dp[mt][0], dp[mt][1], df[mt][kk], bf);
                }
                u32 da[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    #pragma unroll
                    for (int n = 0; n < 2; ++n)
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int nt = 2 * kc + n;
                            const bool seen = nt < tiles[mt] && (me[mt] + 8 * (e >> 1) < T) &&
                                (j < last ||
                                 causal(me[mt], j * FA_ROWS + 8 * nt + 2 * t, e, T));
                            const float p =
                                seen ? exp2f(fmaf(s[mt][n][e], c, -lse2[mt][e >> 1])) : 0.0f;
                            s[mt][n][e] = p * (dp[mt][n][e] - D[mt][e >> 1]);  // dS
                        }
                    repack(da[mt], s[mt][0], s[mt][1]);
                }
                #pragma unroll
                for (int np = 0; np < S::ntiles / 2; ++np) {
                    u32 bf[4];
                    b_cols<HS>(bf, kt, 16 * kc, 16 * np);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        if (2 * kc < tiles[mt])
                            mma_pair(acc[mt][2 * np], acc[mt][2 * np + 1], da[mt], bf);
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    float kept[MT][S::ntiles][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        store_rows<HS>(dq + (long long)b * T * x.q_stride + h * HS, x.q_stride,
                       q0 + row0 + 16 * mt, T, acc[mt], (float)(1.0 / sqrt((double)HS)),
                       x.cos, x.sin, kt_of(0) + (row0 + 16 * mt) * S::stride, kept[mt]);
        #pragma unroll
        for (int r = 0; r < 2; ++r)
            if (t == 0 && me[mt] + 8 * r < T)
                dd[((long long)b * x.NH + h) * T + me[mt] + 8 * r] = D[mt][r];
    }
    if (bias_sums != nullptr) {  // the same branch in every thread
        const int width = (x.NH + 2 * x.NKV) * HS;
        column_sums<HS, MT, FA_Q_WARPS>(
            bias_sums + ((long long)b * gridDim.x + blockIdx.x) * width + h * HS, kept,
            (float*)vt_of(0));
    }
}

// Without the rotation dkv takes the query bias bq as terms of its own, not into every
// query tile it streams: S^T = K (Q + bq)^T adds c_j = k_j · bq to key row j's scores, and
// dK = dS^T (Q + bq) adds (Σ_i dS^T_ji) bq. `query_bias` makes c for the lane's rows g,
// g + 8 from its K fragments (each lane its columns, then the quad); `fold_bias` adds
// r_j bq to dK once per query head (r the lane's sums of dS^T as rounded, then the quad's).
template <int HS>
__device__ __forceinline__ void query_bias(float (&cj)[2], const u32 (&kf)[HS / 16][4],
                                           const bf16* bq) {
    const int t = threadIdx.x % 4;
    float part[2] = {0.0f, 0.0f};
    #pragma unroll
    for (int kk = 0; kk < HS / 16; ++kk)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {  // a[r] columns 2t, 2t+1; a[r + 2] columns 2t+8, 2t+9
            const int d = 16 * kk + 2 * t;
            part[r] += low_bf16(kf[kk][r]) * to_acc(bq[d]);
            part[r] += high_bf16(kf[kk][r]) * to_acc(bq[d + 1]);
            part[r] += low_bf16(kf[kk][r + 2]) * to_acc(bq[d + 8]);
            part[r] += high_bf16(kf[kk][r + 2]) * to_acc(bq[d + 9]);
        }
    cj[0] = quad_sum(part[0]);
    cj[1] = quad_sum(part[1]);
}

template <int HS>
__device__ __forceinline__ void fold_bias(float (&acc)[HS / 8][4], float (&rj)[2],
                                          const bf16* bq) {
    const int t = threadIdx.x % 4;
    const float r[2] = {quad_sum(rj[0]), quad_sum(rj[1])};
    #pragma unroll
    for (int nd = 0; nd < HS / 8; ++nd)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[nd][e] += r[e >> 1] * to_acc(bq[8 * nd + 2 * t + (e & 1)]);
    rj[0] = rj[1] = 0.0f;
}

template <int HS>
__device__ void flash_backward_dkv(bf16* dk, bf16* dv, float* bias_sums, const bf16* dy,
                                   Heads x, const float* lse, const float* dd,
                                   int y_stride) {
    typedef Shape<HS> S;
    constexpr int THREADS = FA_KV_WARPS * WARP;
    alignas(16) __shared__ bf16 smem[5 * FA_ROWS * (FA_MAX_HS + FA_PAD)];
    alignas(16) __shared__ float stats[2][2][FA_ROWS];  // per buffer: lse, D of 64 queries
    bf16* const own = smem;  // K, then dk and dv on their way out
    // Item n's Q and dO tiles in buffer n & 1 (V first in dO's buffer 1).
    auto qt_of = [&](int buf) { return smem + (1 + buf) * S::tile; };
    auto dt_of = [&](int buf) { return smem + (3 + buf) * S::tile; };
    const int b = blockIdx.z, hk = blockIdx.y, T = x.T, group = x.NH / x.NKV;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, t = lane % 4;
    const int k0 = blockIdx.x * FA_ROWS, row0 = warp * 16, me = k0 + row0 + g;
    const float c = (float)(FA_LOG2E / sqrt((double)HS));
    const bool rope = x.cos != nullptr;
    const int tiles_q = (T + FA_ROWS - 1) / FA_ROWS - blockIdx.x;  // query tiles from here
    // Item n: query head hk·group + n / tiles_q, its query tile blockIdx.x + n % tiles_q.
    auto load_item = [&](int n, int buf) {
        const int h = hk * group + n / tiles_q, q0 = (blockIdx.x + n % tiles_q) * FA_ROWS;
        load_tile<HS, THREADS>(qt_of(buf), x.q + (long long)b * T * x.q_stride + h * HS, x.q_stride,
                      q0, T);
        load_tile<HS, THREADS>(dt_of(buf), dy + (long long)b * T * y_stride + h * HS, y_stride, q0, T);
        for (int p = threadIdx.x; p < 2 * FA_ROWS; p += THREADS) {  // 4 bytes each:
            const int which = p / FA_ROWS, r = p % FA_ROWS;  // a head's T floats start
            const bool in = q0 + r < T;                      // anywhere
            const float* from = (which ? dd : lse) + ((long long)b * x.NH + h) * T;
            cp_async4(&stats[buf][which][r], from + (in ? q0 + r : 0), in ? 4 : 0);
        }
    };
    load_tile<HS, THREADS>(own, x.k + (long long)b * T * x.kv_stride + hk * HS, x.kv_stride, k0, T);
    load_tile<HS, THREADS>(dt_of(1), x.v + (long long)b * T * x.kv_stride + hk * HS, x.kv_stride, k0,
                  T);
    cp_async_commit();
    load_item(0, 0);
    cp_async_commit();
    cp_async_wait<1>();
    // The key bias only with the rotation (see F); the value bias is out of dV = P^T dY
    // and of dP^T - D alike (dd holds D less dy · bv).
    fix_tile<HS, THREADS>(own, k0, T, x.bk && rope ? x.bk + hk * HS : nullptr, x.cos, x.sin);
    __syncthreads();
    u32 kf[S::chunks][4], vf[S::chunks][4];
    #pragma unroll
    for (int kk = 0; kk < S::chunks; ++kk) {
        a_fragment<HS>(kf[kk], own, row0, 16 * kk);
        a_fragment<HS>(vf[kk], dt_of(1), row0, 16 * kk);
    }
    __syncthreads();
    const bool busy = k0 + row0 < T;
    const bool terms = x.bq != nullptr && !rope;  // the query bias as c_j and r_j bq
    float dka[S::ntiles][4] = {}, dva[S::ntiles][4] = {}, cj[2] = {0.0f, 0.0f};
    float rj[2] = {0.0f, 0.0f};
    const int items = group * tiles_q;
    for (int n = 0; n < items; ++n) {
        const int buf = n & 1, h = hk * group + n / tiles_q;
        const int qt = blockIdx.x + n % tiles_q, q0 = qt * FA_ROWS;
        if (n + 1 < items) load_item(n + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fix_tile<HS, THREADS>(qt_of(buf), q0, T, x.bq && rope ? x.bq + h * HS : nullptr, x.cos, x.sin);
        __syncthreads();
        if (terms && n % tiles_q == 0) query_bias<HS>(cj, kf, x.bq + h * HS);
        // On the diagonal the warp's keys see queries from row0 on: 8-query tiles from
        // 2·warp, 16-query chunks from warp.
        const int from = qt == (int)blockIdx.x ? warp : 0;
        if (busy) {
            const bf16 *qt_s = qt_of(buf), *dt = dt_of(buf);
            const float *lq = stats[buf][0], *dstat = stats[buf][1];
            float s[8][4] = {}, dp[8][4] = {};
            #pragma unroll
            for (int kk = 0; kk < S::chunks; ++kk)
                #pragma unroll
                for (int np = 0; np < 4; ++np) {
                    if (np < from) continue;
                    u32 bf[4];
                    b_rows<HS>(bf, qt_s, 16 * np, 16 * kk);
                    mma_pair(s[2 * np], s[2 * np + 1], kf[kk], bf);
                    b_rows<HS>(bf, dt, 16 * np, 16 * kk);
                    mma_pair(dp[2 * np], dp[2 * np + 1], vf[kk], bf);
                }
            #pragma unroll
            for (int nt = 0; nt < 8; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = me + 8 * (e >> 1), qi = 8 * nt + 2 * t + (e & 1);
                    const bool seen = nt >= 2 * from && key < T && q0 + qi < T && q0 + qi >= key;
                    const float sc = s[nt][e] + cj[e >> 1];
                    const float p =
                        seen ? exp2f(fmaf(sc, c, -(lq[qi] * (float)FA_LOG2E))) : 0.0f;
                    s[nt][e] = p;                              // P^T
                    dp[nt][e] = p * (dp[nt][e] - dstat[qi]);  // dS^T
                    if (terms) rj[e >> 1] += __bfloat162float(__float2bfloat16(dp[nt][e]));
                }
            #pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                if (kc < from) continue;
                u32 pa[4], da[4];
                repack(pa, s[2 * kc], s[2 * kc + 1]);
                repack(da, dp[2 * kc], dp[2 * kc + 1]);
                #pragma unroll
                for (int np = 0; np < S::ntiles / 2; ++np) {
                    u32 bf[4];
                    b_cols<HS>(bf, dt, 16 * kc, 16 * np);
                    mma_pair(dva[2 * np], dva[2 * np + 1], pa, bf);
                    b_cols<HS>(bf, qt_s, 16 * kc, 16 * np);
                    mma_pair(dka[2 * np], dka[2 * np + 1], da, bf);
                }
            }
        }
        if (terms && n % tiles_q == tiles_q - 1) fold_bias<HS>(dka, rj, x.bq + h * HS);
        __syncthreads();
    }
    cp_async_wait<0>();
    float kept_k[1][S::ntiles][4], kept_v[1][S::ntiles][4];
    bf16* stage = own + row0 * S::stride;
    store_rows<HS>(dk + (long long)b * T * x.kv_stride + hk * HS, x.kv_stride, k0 + row0, T,
                   dka, (float)(1.0 / sqrt((double)HS)), x.cos, x.sin, stage, kept_k[0]);
    store_rows<HS>(dv + (long long)b * T * x.kv_stride + hk * HS, x.kv_stride, k0 + row0, T,
                   dva, 1.0f, nullptr, nullptr, stage, kept_v[0]);
    if (bias_sums != nullptr) {
        const int width = (x.NH + 2 * x.NKV) * HS;
        float* row = bias_sums + ((long long)b * gridDim.x + blockIdx.x) * width;
        column_sums<HS, 1, FA_KV_WARPS>(row + (x.NH + hk) * HS, kept_k, (float*)qt_of(0));
        column_sums<HS, 1, FA_KV_WARPS>(row + (x.NH + x.NKV + hk) * HS, kept_v, (float*)qt_of(0));
    }
}

// dbias (D,) += partials (P, D) summed over P in order: the biases' gradient.
__device__ void fa_bias_finish(float* dbias, const float* partials, int P, int D) {
    const int col = blockIdx.x * FA_FINISH_THREADS + threadIdx.x;
    if (col >= D) return;
    dbias[col] += chunks_sum(partials, P, D, col);
}

#define FA_HEADS                                                                              \
    Heads x = {q, k, v, bq, bk, bv, cos, sin, T, NH, NKV, q_stride, kv_stride};

#define FLASH_KERNELS(HS)                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_Q_WARPS * WARP)                          \
        flash_forward_hs##HS(bf16* y, float* lse, const bf16* q, const bf16* k,               \
                             const bf16* v, const bf16* bq, const bf16* bk, const bf16* bv,   \
                             const float* cos, const float* sin, int T, int NH, int NKV,      \
                             int q_stride, int kv_stride, int y_stride) {                     \
        FA_HEADS flash_forward<HS>(y, lse, x, y_stride);                                      \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_Q_WARPS * WARP)                          \
        flash_backward_dq_hs##HS(bf16* dq, float* dd, float* bias_sums, const bf16* dy,       \
                                 const bf16* y, const bf16* q, const bf16* k, const bf16* v,  \
                                 const bf16* bq, const bf16* bk, const bf16* bv,              \
                                 const float* cos, const float* sin, const float* lse, int T, \
                                 int NH, int NKV, int q_stride, int kv_stride,                \
                                 int y_stride) {                                              \
        FA_HEADS flash_backward_dq<HS>(dq, dd, bias_sums, dy, y, x, lse, y_stride);           \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_KV_WARPS * WARP)                         \
        flash_backward_dkv_hs##HS(bf16* dk, bf16* dv, float* bias_sums, const bf16* dy,       \
                                  const bf16* q, const bf16* k, const bf16* v,                \
                                  const bf16* bq, const bf16* bk, const bf16* bv,             \
                                  const float* cos, const float* sin, const float* lse,       \
                                  const float* dd, int T, int NH, int NKV, int q_stride,      \
                                  int kv_stride, int y_stride) {                              \
        FA_HEADS flash_backward_dkv<HS>(dk, dv, bias_sums, dy, x, lse, dd, y_stride);         \
    }

FLASH_KERNELS(16)
FLASH_KERNELS(32)
FLASH_KERNELS(48)
FLASH_KERNELS(64)

extern "C" __global__ void __launch_bounds__(FA_FINISH_THREADS)
    flash_bias_finish(float* dbias, const float* partials, int P, int D) {
    fa_bias_finish(dbias, partials, P, D);
}
