"""A kernel-level cost model: a kernel's time on one GPU from its code's parameters, checked
first against the kernels measured on an H100, only then predicting the ones never run.

    python -m hpcpipe.devtools.kernelmodel      # the validation table, then the predictions

What a kernel is here (`Kernel`): its launch (blocks, threads), its registers (ptxas -v)
and static shared memory, and per loop trip of a block (`Trip`: a key or query tile) what
it demands of one streaming multiprocessor — tensor-core instructions (m16n8k16), shared-
memory wavefronts (128 bytes a cycle; bank conflicts counted as the extra wavefronts an
access takes, ldmatrix 4 per x4), warp instructions issued, special-function instructions
(exp2, log, reciprocal), global round trips the block waits for (loads not prefetched),
barriers — and its DRAM bytes. Each kernel's counts are derived in its `_*` function from
its source (the comments say how), at head size 64.

Time of a trip on one SM: each pipe's cycles (tensor: mma × 4096 FLOP / the SM's mma.sync
rate; shared: wavefronts; issue: instructions / 4; SFU: 2 cycles a warp instruction), plus
the latency the resident blocks cannot cover: (round trips × L2 latency + barriers × barrier
latency) / blocks per SM (occupancy from registers, shared memory, warps). Two ways to
combine the pipes bracket the truth: `overlap` (the slowest pipe: every pipe busy at once)
and `serial` (their sum: a warp's phases depend on each other and the pipes take turns).
The launch's trips spread over the SMs, with a tail of half a block's trips per block slot
(the last wave), then DRAM bytes / the measured bandwidth bound it from below.

Validated against step-bfloat16.json (H100, 2026-12-05): the WMMA attention (the measured
kernel this repository no longer has; its code at commit a90f780) and the other kernels
whose profiled time is their device time (the head's GEMMs, AdamW). The serial combination
reproduces the WMMA attention within 30 % (F, B); the overlap one does not (it has no
phases that wait). So predictions use `serial`, with `overlap` beside them as the bound a
perfectly overlapped kernel would reach. The SM's parameters are public specifications,
each with its source and uncertainty in `H100`; rates come from calibration.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field, replace

# the measured step and rates, in the repository
MEASURED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "results", "h100-2026-12-05-gpu-check")


@dataclass(frozen=True)
class Sm:
    """A GPU's streaming multiprocessors (public specifications, stated where given)."""

    name: str
    sms: int
    clock_hz: float
    registers: int = 65536
    shared_bytes: int = 228 * 1024
    shared_reserved: int = 1024  # per block (sm_80 and later)
    max_warps: int = 64
    max_blocks: int = 32
    issue_per_clk: float = 4.0  # warp instructions (four schedulers)
    mma_flops_per_clk: float = 2048.0  # mma.sync m16n8k16 bf16 per SM
    sfu_lanes_per_clk: float = 16.0
    l2_latency_clk: float = 270.0
    barrier_clk: float = 30.0
    dram_bytes_per_s: float = 2.5e12
    sources: dict = field(default_factory=dict)


H100 = Sm(
    name="NVIDIA H100 SXM5", sms=132, clock_hz=1.83e9, dram_bytes_per_s=2.507818749015476e12,
    sources={
        "sms, registers, shared_bytes, warps, blocks": "NVIDIA H100 whitepaper / CUDA "
        "occupancy tables (compute capability 9.0)",
        "clock_hz": "the clock at which NVIDIA's 989.4 TFLOP/s dense bf16 is 132 SMs × 4096 "
                    "FLOP/clk (±10 %: the clock under load is not measured)",
        "mma_flops_per_clk": "mma.sync (not wgmma) at half of wgmma's 4096 FLOP/clk/SM, as "
                             "public reports put it (±30 %)",
        "l2_latency_clk": "public microbenchmarks of Hopper's L2 hit latency (~260-270)",
        "dram_bytes_per_s": "measured: calibration.json's elementwise bandwidth",
    })


@dataclass(frozen=True)
class Trip:
    """What one loop trip of a block demands of its SM."""

    mma: float = 0.0           # m16n8k16 tensor-core instructions (4096 FLOP each)
    wavefronts: float = 0.0    # shared memory (and L1 data) wavefronts, conflicts included
    instructions: float = 0.0  # warp instructions issued
    sfu: float = 0.0           # warp special-function instructions
    trips: float = 0.0         # global round trips the block waits for
    barriers: float = 0.0

    def __add__(self, other):
        return Trip(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    def __mul__(self, k: float):
        return Trip(*(a * k for a in vars(self).values()))


@dataclass(frozen=True)
class Kernel:
    """One launch: its code's parameters."""

    name: str
    threads: int
    registers: int
    shared: int                 # static shared memory per block, bytes
    blocks: int
    work: tuple                 # ((Trip, how many trips of it in the launch), ...)
    dram_bytes: float
    flops: float = 0.0          # nominal (FlashAttention's count for attention)
    source: str = ""


def blocks_per_sm(k: Kernel, sm: Sm = H100) -> int:
    """Resident blocks: the least of what registers (allocated per warp in units of 256),
    shared memory and warps allow."""
    warps = k.threads // 32
    regs = math.ceil(k.registers * 32 / 256) * 256 * warps
    by_regs = sm.registers // regs
    by_shared = sm.shared_bytes // (k.shared + sm.shared_reserved)
    return max(0, min(by_regs, by_shared, sm.max_warps // warps, sm.max_blocks))


def trip_cycles(t: Trip, resident: int, sm: Sm = H100) -> dict:
    """One trip's SM cycles per pipe, the latency left uncovered, and both combinations."""
    pipes = {"tensor": t.mma * 4096 / sm.mma_flops_per_clk, "shared": t.wavefronts,
             "issue": t.instructions / sm.issue_per_clk, "sfu": t.sfu * 32 / sm.sfu_lanes_per_clk}
    latency = (t.trips * sm.l2_latency_clk + t.barriers * sm.barrier_clk) / max(1, resident)
    return {**pipes, "latency": latency, "overlap": max(max(pipes.values()), latency),
            "serial": sum(pipes.values()) + latency}


def predict(k: Kernel, sm: Sm = H100) -> dict:
    """Seconds under both combinations, the binding pipe, occupancy and TFLOP/s."""
    resident = blocks_per_sm(k, sm)
    if resident == 0:
        raise ValueError(f"{k.name}: no block fits an SM ({k.registers} registers, "
                         f"{k.shared} bytes of shared memory)")
    out = {"kernel": k.name, "blocks_per_sm": resident}
    trips = sum(n for _, n in k.work)
    per_block = trips / k.blocks
    for combine in ("overlap", "serial"):
        cycles = sum(trip_cycles(t, resident, sm)[combine] * n for t, n in k.work)
        mean = cycles / trips
        tail = per_block / 2 * mean * min(1.0, k.blocks / (sm.sms * resident))
        seconds = (cycles / sm.sms + tail) / sm.clock_hz
        out[combine] = max(seconds, k.dram_bytes / sm.dram_bytes_per_s)
    main = max(((t, n) for t, n in k.work), key=lambda w: w[1])[0]
    pipes = trip_cycles(main, resident, sm)
    out["bound"] = max(("tensor", "shared", "issue", "sfu"), key=lambda p: pipes[p])
    if k.flops:
        out["tflops"] = {c: k.flops / out[c] / 1e12 for c in ("overlap", "serial")}
    return out


# -- GPT-2 124M's attention: B 16, T 1024, 12 heads of 64 --------------------------------------

B, T, NH, HS = 16, 1024, 12, 64
HEADS = B * NH
CAUSAL_FLOPS = 4 * HS * HEADS * T * T // 2  # FlashAttention's count for F (B: 2.5×)


def _wmma_common(tile: int = 32) -> Trip:
    """Per 32-row tile of the other side, per block of 4 warps (attention_tc.cu at a90f780):
    the tile's K and V (or Q and dO) read a 2-byte element at a time, with c_attn's bias,
    4 elements a round trip (the loop unrolled 4 times: 16 elements per thread per array,
    4 round trips each), each element an LDG of value and bias and an STS.U16 (one
    wavefront per warp instruction: 32 consecutive elements) with ~11 instructions in all;
    two block barriers."""
    per_thread = tile * HS // 128  # elements per thread per array
    return Trip(wavefronts=2 * per_thread * 4 * 2, instructions=2 * per_thread * 11 * 4,
                trips=2 * per_thread / 4, barriers=2)


# A WMMA 16×16 bf16 operand from shared memory (ldm 64 elements: 128-byte rows) is 4 LD.E
# of 32 bits per lane (SASS: `LD.E`), each 8 rows of 16 bytes in the same 4 banks: 8-way
# conflicts, 32 wavefronts; with ldm 32 (64-byte rows, the probabilities) 4-way, 16.
FRAG, FRAG_HALF = 32, 16
# Storing a 16×16 float accumulator with ldm 32 (128-byte rows): 4 STS.64 of 8 wavefronts.
STORE = 32


def _wmma_scores() -> Trip:
    """scores_of per warp: 2 × 4 (A, B) operand loads, 16 HMMA, 2 accumulator stores."""
    return Trip(mma=16, wavefronts=16 * FRAG + 2 * STORE, instructions=64 + 16 + 8 + 40)


def _wmma_accumulate() -> Trip:
    """accumulate per warp: 2 A loads (ldm 32) and 8 B loads (ldm 64) with their 32 MOVM
    transposes (one wavefront each, as a shuffle), 16 HMMA."""
    return Trip(mma=16, wavefronts=2 * FRAG_HALF + 8 * FRAG + 32,
                instructions=40 + 32 + 16 + 30)


def _wmma_softmax(passes: int = 1) -> Trip:
    """A lane's 16 scores read from shared (row lane/2, columns 16 apart: 2 banks for 32
    lanes, 16-way, 16 wavefronts each), `passes` times; 16 exps; 16 bf16 stores of P or dS
    (rows 64 bytes apart: 8-way)."""
    return Trip(wavefronts=16 * 16 * passes + 16 * 8,
                instructions=16 * passes + 16 * 8 + 16 * 2, sfu=16)


def _rescale_share(tile: int = 32) -> float:
    """The share of (warp, tile) pairs whose row maximum moved (F rescales its accumulator
    through shared memory then): a new maximum among 16 rows of scores as random, mean over
    a head's tiles."""
    tiles = T // tile
    share, count = 0.0, 0
    for last in range(1, tiles // 2 + 1):  # block qb sees key tiles 0 .. 2·qb + 1
        for j in range(2 * last):
            share += 1.0 - (j / (j + 1)) ** 16 if j else 0.0
            count += 1
    return share / count


def _wmma_tiles() -> float:
    """Block trips of one launch: 2·(qb + 1) tiles for query block qb, every head."""
    return HEADS * sum(2 * (qb + 1) for qb in range(T // 64))


def wmma_forward() -> Kernel:
    """attention_tc_forward_hs64 (a90f780): per warp and tile scores_of, the softmax
    through shared memory (its scores read twice: the max, then the exps), accumulate,
    and in the tiles where a row's maximum moved tc_scale_rows (4 fragments stored,
    scaled, loaded: ~224 wavefronts)."""
    warp = _wmma_scores() + _wmma_softmax(2) + _wmma_accumulate() + \
        Trip(wavefronts=16 + 224 * _rescale_share(), instructions=60 + 150 * _rescale_share())
    trip = _wmma_common() + warp * 4
    return Kernel("WMMA F", 128, 116, 28 * 1024 + 256, 16 * HEADS,
                  ((trip, _wmma_tiles()),), 3 * B * T * NH * HS * 2 * 8, CAUSAL_FLOPS,
                  "attention_tc.cu at a90f780")


def wmma_dq() -> Kernel:
    """attention_tc_backward_dq_hs64: two scores_of (S, dP), P and dS through shared
    memory, accumulate dS K."""
    warp = _wmma_scores() * 2 + _wmma_softmax(1) + \
        Trip(wavefronts=16 * 16 + 16 * 8, instructions=16 * 6) + _wmma_accumulate()
    trip = _wmma_common() + warp * 4
    return Kernel("WMMA dq", 128, 128, 36 * 1024, 16 * HEADS, ((trip, _wmma_tiles()),),
                  4 * B * T * NH * HS * 2 * 8, CAUSAL_FLOPS * 6 // 4, "attention_tc.cu")


def wmma_dkv() -> Kernel:
    """attention_tc_backward_dkv_hs64 (208 registers): two scores_of (S^T, dP^T), P^T and
    dS^T through shared memory with the tile's lse and dd, two accumulates (dV, dK)."""
    warp = _wmma_scores() * 2 + _wmma_softmax(1) + \
        Trip(wavefronts=16 * 16 + 16 * 8 + 2 * 16 * 2, instructions=16 * 8) + \
        _wmma_accumulate() * 2
    trip = _wmma_common() + warp * 4
    return Kernel("WMMA dkv", 128, 208, 36 * 1024, 16 * HEADS, ((trip, _wmma_tiles()),),
                  5 * B * T * NH * HS * 2 * 8, CAUSAL_FLOPS * 8 // 4, "attention_tc.cu")


# -- flash.cu (mma.sync, ldmatrix, cp.async): per block trip of 64 rows × 64 ------------------

LDM = 4  # wavefronts of an ldmatrix.x4 on padded rows (no conflicts)
COPY = 64 * HS * 2 // 128  # cp.async of a 64-row tile: its bytes / 128 a cycle


@dataclass(frozen=True)
class Attention:
    """The attention a flash.cu launch computes: B sequences of T, NH query heads over NKV
    key/value heads of 64 channels, the rotary embedding applied as the tiles are read
    (`rope`) or not."""

    name: str
    B: int
    T: int
    NH: int
    NKV: int
    rope: bool = False

    @property
    def heads(self) -> int:
        return self.B * self.NH

    @property
    def flops(self) -> int:  # FlashAttention's count for F (B: 2.5×)
        return 4 * HS * self.heads * self.T * self.T // 2

    def bytes(self, query_sized: int, kv_sized: int) -> int:
        """DRAM bytes of `query_sized` arrays shaped like q and `kv_sized` like k (bf16)."""
        return 2 * HS * self.B * self.T * (query_sized * self.NH + kv_sized * self.NKV)


GPT2 = Attention("GPT-2 124M, 16 × 1024", B, T, NH, NH)
SMOLLM2 = Attention("SmolLM2-135M, 8 × 2048, rope", 8, 2048, 9, 3, rope=True)

# The rotation of one 64-row tile as fix_tile does it, per block (every thread its 16-byte
# pieces and their partners): per 16 elements two shared loads and stores, 16 unpacks and
# 8 packs, 16 cos/sin loads (L1: 64 bytes a row a tile), ~48 multiply-adds, addresses —
# ~100 instructions, so 64·64/16 · 100 / 32 lanes = 800 warp instructions; wavefronts:
# the tile read and written (64 + 64) and its tables read (2 · 64 rows · 128 bytes / 128).
ROPE = Trip(wavefronts=64 + 64 + 128, instructions=800)


def _flash_trip(loads: int, transposed: int, mma: int, exps: int, alu: int, copies: int,
                warps: int = 4, share: float = 1.0, load_share: float | None = None,
                rotated: int = 0) -> Trip:
    """A block trip of `warps` warps: each warp `loads` + `transposed` ldmatrix.x4 (times
    `load_share`: the diagonal tile's fraction of them), `mma` m16n8k16 (times `share`:
    the diagonal tile's fraction of the products), `exps` exp2 and `alu` other
    instructions; the block copies `copies` tiles by cp.async (one instruction a thread a
    16-byte piece, with its address: 32 warp instructions a tile, whatever the warps) and
    rotates `rotated` of them (ROPE); two barriers."""
    ls = share if load_share is None else load_share
    warp = Trip(mma=mma * share, wavefronts=(loads + transposed) * LDM * ls,
                instructions=(loads + transposed) * ls + (mma + exps + alu) * share,
                sfu=exps * share)
    return warp * warps + Trip(wavefronts=copies * COPY, instructions=copies * 8 * 4,
                               barriers=2) + ROPE * rotated


def _flash_launch(name, trip: Trip, diagonal: Trip, registers: int, shared: int,
                  threads: int, blocks: int, dram: float, flops: float,
                  shape: Attention) -> Kernel:
    tiles = shape.T // 64
    full = shape.heads * tiles * (tiles - 1) // 2
    return Kernel(name, threads, registers, shared, blocks,
                  ((trip, full), (diagonal, shape.heads * tiles)), dram, flops, "flash.cu")


# The diagonal tile: m-tile i (16 rows) of a block multiplies i + 1 of its 4 key chunks
# (F, dq; dkv mirrors it): 10 of 16 chunks, 62.5 % of a full tile's products. Its loads:
# a warp loads the chunks its last m-tile sees — 62.5 % with one m-tile a warp, 75 % with
# two (warp 0 loads 2 of 4 chunks, warp 1 all 4).
DIAGONAL = 20 / 32


def _diagonal_loads(m_tiles: int) -> float:
    warps = 4 // m_tiles
    return sum(m_tiles * (w + 1) for w in range(warps)) / (4 * warps)


def _suffix(shape: Attention) -> str:
    return "" if shape == GPT2 else f" ({shape.name})"


def flash_forward(registers: int = 217, m_tiles: int = 2, shape: Attention = GPT2) -> Kernel:
    """flash_forward_hs64 (FA_Q_TILES = m_tiles 16-row m-tiles a warp, 64 // (16·m_tiles)
    warps a block of 64 rows): per warp and 64-key tile 16 b_rows (S) and 16 b_cols (P V)
    ldmatrix.x4 — each feeding m_tiles mma —, 64 mma, 34 exp2 (32 + 2 for alpha) and
    ~154 other instructions per m-tile (32 max, 32 fma, 32 sums, 32 rescales, 16 packs,
    shuffles and masks), ~96 a warp besides (fragment addresses, the loop); the block
    copies K and V (and with the rotary embedding rotates K). Shared memory: 4 tiles (Q
    waits in K's buffer 1) — 5 before the m-tiles, 46,080 bytes."""
    warps = 4 // m_tiles
    args = dict(loads=16, transposed=16, mma=64 * m_tiles, exps=34 * m_tiles,
                alu=96 + 154 * m_tiles, copies=2, warps=warps, rotated=int(shape.rope))
    smem = 36864 if m_tiles > 1 else 46080
    return _flash_launch("flash F" + _suffix(shape), _flash_trip(**args),
                         _flash_trip(**args, share=DIAGONAL,
                                     load_share=_diagonal_loads(m_tiles)),
                         registers, smem, 32 * warps, shape.heads * shape.T // 64,
                         shape.bytes(2, 2), shape.flops, shape)


def flash_dq(registers: int = 223, m_tiles: int = 2, shape: Attention = GPT2) -> Kernel:
    """flash_backward_dq_hs64 (m_tiles as F's): per warp and key tile 32 b_rows (S, dP) and
    16 b_cols (dS K) ldmatrix.x4, 96 mma, 32 exp2 and ~150 other instructions per m-tile
    (exp arguments, dP - D, products, masks, packs), ~150 a warp besides; the block
    copies K and V (rotating K with the rotary embedding)."""
    warps = 4 // m_tiles
    args = dict(loads=32, transposed=16, mma=96 * m_tiles, exps=32 * m_tiles,
                alu=150 + 150 * m_tiles, copies=2, warps=warps, rotated=int(shape.rope))
    smem = 36864 if m_tiles > 1 else 46080
    return _flash_launch("flash dq" + _suffix(shape), _flash_trip(**args),
                         _flash_trip(**args, share=DIAGONAL,
                                     load_share=_diagonal_loads(m_tiles)),
                         registers, smem, 32 * warps, shape.heads * shape.T // 64,
                         shape.bytes(4, 2), shape.flops * 6 // 4, shape)


def flash_dkv(registers: int = 253, shape: Attention = GPT2) -> Kernel:
    """flash_backward_dkv_hs64 (one m-tile a warp, 4 warps: two would double dK's and dV's
    accumulators, 64 registers each, past the 255 a thread has): per 64-query item 32
    b_rows (S^T, dP^T) and 32 b_cols (dV, dK) ldmatrix.x4, 128 mma, 32 exp2, ~350 other
    instructions; the block copies Q, dO (and lse, dd), rotating Q with the rotary
    embedding. A block of a key/value head walks every query head of its group."""
    args = dict(loads=32, transposed=32, mma=128, exps=32, alu=350, copies=2,
                rotated=int(shape.rope))
    return _flash_launch("flash dkv" + _suffix(shape), _flash_trip(**args),
                         _flash_trip(**args, share=DIAGONAL), registers, 47104, 128,
                         shape.B * shape.NKV * shape.T // 64, shape.bytes(2, 4),
                         shape.flops * 8 // 4, shape)


def flash_one_tile() -> tuple[Kernel, Kernel]:
    """F and dq as they were before the m-tiles (one 16-row m-tile a warp, 4 warps, 5
    shared tiles; ptxas: 142 and 153 registers): the design the model found shared-memory
    bound, kept for the comparison the docs print."""
    return replace(flash_forward(142, 1), name="flash F (16 rows a warp)"), \
        replace(flash_dq(153, 1), name="flash dq (16 rows a warp)")


# -- validation against the H100's measured step ------------------------------------------------

def measured(folder: str = MEASURED) -> dict:
    """Per-layer device times (ms per step) of step-bfloat16.json's profile and the rates
    of calibration.json."""
    with open(f"{folder}/step-bfloat16.json") as f:
        row = json.load(f)["rows"][0]
    with open(f"{folder}/calibration.json") as f:
        rates = json.load(f)
    return {"profile": {r["layer"]: r for r in row["profile_ms"]}, "rates": rates,
            "step_ms": row["hpcpipe_step_ms"]}


def validation(folder: str = MEASURED, sm: Sm = H100) -> list[dict]:
    """Model against measurement where the profiled time is the kernels' device time:
    the WMMA attention (12 layers), the head's three GEMMs (cuBLAS at the unaligned
    vocabulary, at the rate the smoke measured at that shape) and AdamW (bandwidth)."""
    m = measured(folder)
    prof, rates = m["profile"], m["rates"]
    sm = replace(sm, dram_bytes_per_s=rates["elementwise_bytes_per_s"])
    layers = 12
    f = predict(wmma_forward(), sm)
    dq, dkv = predict(wmma_dq(), sm), predict(wmma_dkv(), sm)
    rows = [("attention F (WMMA)", {c: layers * f[c] for c in ("overlap", "serial")},
             prof["attention"]["F"]),
            ("attention B (WMMA)", {c: layers * (dq[c] + dkv[c]) for c in ("overlap", "serial")},
             prof["attention"]["B"])]
    head = 2 * 16384 * 768 * 50257 / rates["gemm_flops_per_s"]["bf16_unaligned"]
    for phase in ("F", "B", "W"):
        rows.append((f"head {phase} (GEMM)", {"overlap": head, "serial": head},
                     prof["head"][phase]))
    adamw = 4230953472 / rates["elementwise_bytes_per_s"] + rates["kernel_s"]
    rows.append(("AdamW step", {"overlap": adamw, "serial": adamw}, prof["adamw"]["step"]))
    out = []
    for name, model, got in rows:
        ms = {c: 1e3 * s for c, s in model.items()}
        out.append({"kernel": name, "measured_ms": got, "overlap_ms": ms["overlap"],
                    "serial_ms": ms["serial"], "serial_error": ms["serial"] / got - 1,
                    "overlap_error": ms["overlap"] / got - 1})
    return out


def predictions(sm: Sm = H100, shape: Attention = GPT2) -> list[dict]:
    """The new kernels at `shape` (GPT-2's), one layer: PREDICTED, never run."""
    return [_prediction(k, sm) for k in (flash_forward(shape=shape), flash_dq(shape=shape),
                                         flash_dkv(shape=shape))]


def _prediction(k: Kernel, sm: Sm = H100) -> dict:
    p = predict(k, sm)
    return {"kernel": k.name, "serial_ms": 1e3 * p["serial"], "overlap_ms": 1e3 * p["overlap"],
            "bound": p["bound"], "blocks_per_sm": p["blocks_per_sm"],
            "serial_tflops": p["tflops"]["serial"], "overlap_tflops": p["tflops"]["overlap"]}


def attention_tflops(forward: Kernel, dq: Kernel, dkv: Kernel, sm: Sm = H100) -> dict:
    """F's and B's TFLOP/s by FlashAttention's count (B is 2.5 × F's FLOPs in dq + dkv),
    PREDICTED by the serial combination."""
    f, q, kv = (predict(k, sm)["serial"] for k in (forward, dq, dkv))
    return {"F": forward.flops / f / 1e12, "B": 2.5 * forward.flops / (q + kv) / 1e12}


def designs(sm: Sm = H100) -> list[dict]:
    """flash.cu's F and B as they are (two m-tiles a warp in F and dq) and as they were
    (one), PREDICTED: what the restructuring buys by this model."""
    def design(name, forward, dq, dkv):
        f = predict(forward, sm)
        return {"design": name, "blocks_per_sm": f["blocks_per_sm"], "bound": f["bound"],
                **attention_tflops(forward, dq, dkv, sm)}

    return [design("16 rows a warp (before)", *flash_one_tile(), flash_dkv()),
            design("32 rows a warp (F, dq)", flash_forward(), flash_dq(), flash_dkv()),
            design(f"32 rows a warp, {SMOLLM2.name}", flash_forward(shape=SMOLLM2),
                   flash_dq(shape=SMOLLM2), flash_dkv(shape=SMOLLM2))]


# The elementwise kernels at GPT-2's size (N = 16 384 rows, C = 768, the padded vocabulary):
# (name, DRAM bytes, elements, instructions per element as counted in their source: the
# GELU's tanh through one exp and one reciprocal, ~30 with its bias; its B ~45 with the
# derivative and the chunk sum; cross-entropy ~12 per logit and pass over three passes).
N_ROWS, VOCAB = B * T, 50304
# SmolLM2-135M's (8 × 2048 tokens, C 576, I 1536): RMSNorm F ~10 instructions an element
# (square-sum, the row's shuffles shared, the scale, the residual add), its row-block B ~16
# (xhat, dxhat, the dot, dx, the weight sums); SwiGLU F ~20 (exp, reciprocal, two
# products), B ~30 (σ again, silu, its slope, three products).
LLAMA_ROWS, LLAMA_C, LLAMA_I = 8 * 2048, 576, 1536
ELEMENTWISE = (
    ("gelu bias F", 2 * N_ROWS * 4 * 768 * 2, N_ROWS * 4 * 768, 30),
    ("gelu bias B", 3 * N_ROWS * 4 * 768 * 2, N_ROWS * 4 * 768, 45),
    ("bias + residual", 3 * N_ROWS * 768 * 2, N_ROWS * 768, 8),
    ("layernorm F", 2 * N_ROWS * 768 * 2, N_ROWS * 768, 12),
    ("cross-entropy", 3 * N_ROWS * VOCAB * 2, N_ROWS * VOCAB, 36),
    ("rmsnorm + residual F (SmolLM2)", 4 * LLAMA_ROWS * LLAMA_C * 2, LLAMA_ROWS * LLAMA_C, 10),
    ("rmsnorm + residual B (SmolLM2)", 4 * LLAMA_ROWS * LLAMA_C * 2, LLAMA_ROWS * LLAMA_C, 16),
    ("swiglu F (SmolLM2)", 3 * LLAMA_ROWS * LLAMA_I * 2, LLAMA_ROWS * LLAMA_I, 20),
    ("swiglu B (SmolLM2)", 5 * LLAMA_ROWS * LLAMA_I * 2, LLAMA_ROWS * LLAMA_I, 30),
)


def elementwise_predictions(sm: Sm = H100) -> list[dict]:
    """PREDICTED device ms of the elementwise kernels at GPT-2's size: the longer of their
    DRAM bytes at the measured bandwidth and their instructions at the SMs' issue rate."""
    lanes_per_s = sm.sms * sm.issue_per_clk * 32 * sm.clock_hz
    out = []
    for name, nbytes, elements, per_element in ELEMENTWISE:
        memory, issue = nbytes / sm.dram_bytes_per_s, elements * per_element / lanes_per_s
        out.append({"kernel": name, "ms": 1e3 * max(memory, issue),
                    "bound": "DRAM" if memory >= issue else "issue", "gb": nbytes / 1e9})
    return out


def flash_rates(sm: Sm = H100) -> dict:
    """FLOP/s of flash.cu's kernels by stem, PREDICTED (serial combination) at GPT-2's
    shape: what the step's cost model prices their declared FLOPs at."""
    stems = {"flash F": "flash_forward", "flash dq": "flash_backward_dq",
             "flash dkv": "flash_backward_dkv"}
    return {stems[r["kernel"]]: r["serial_tflops"] * 1e12 for r in predictions(sm)}


FLASH_SOURCE = ("flash.cu's FLOP/s predicted by hpcpipe/devtools/kernelmodel.py (serial "
                "combination, GPT-2 124M's shape on an H100; never measured)")


def _print_predictions(rows):
    print("| kernel (one layer) | serial ms | TFLOP/s | overlap ms | TFLOP/s | bound | blocks/SM |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['serial_ms']:.3f} | {r['serial_tflops']:.0f} | "
              f"{r['overlap_ms']:.3f} | {r['overlap_tflops']:.0f} | {r['bound']} | "
              f"{r['blocks_per_sm']} |")


def main() -> int:
    print(f"kernel model on {H100.name} ({H100.sms} SMs at {H100.clock_hz / 1e9:.2f} GHz, "
          f"mma.sync {H100.mma_flops_per_clk:.0f} FLOP/clk/SM)\n")
    print("| kernel (12 layers) | measured ms | model serial ms | error | model overlap ms | error |")
    print("|---|---|---|---|---|---|")
    for r in validation():
        print(f"| {r['kernel']} | {r['measured_ms']:.2f} | {r['serial_ms']:.2f} | "
              f"{r['serial_error']:+.0%} | {r['overlap_ms']:.2f} | {r['overlap_error']:+.0%} |")
    print("\nPREDICTED (never run; serial is the validated combination, overlap the bound of a "
          "perfectly overlapped kernel):\n")
    _print_predictions(predictions())
    print("\nPREDICTED attention by design (serial; B = dq + dkv, 2.5 × F's FLOPs):\n")
    print("| design | F TFLOP/s | B TFLOP/s | F bound | F blocks/SM |")
    print("|---|---|---|---|---|")
    for r in designs():
        print(f"| {r['design']} | {r['F']:.0f} | {r['B']:.0f} | {r['bound']} | "
              f"{r['blocks_per_sm']} |")
    print(f"\nPREDICTED flash.cu at {SMOLLM2.name} (grouped heads, the rotation on read):\n")
    _print_predictions(predictions(shape=SMOLLM2))
    print("\nPREDICTED elementwise kernels (one launch, GPT-2's size; SmolLM2's marked):\n")
    print("| kernel | GB | ms | bound |")
    print("|---|---|---|---|")
    for r in elementwise_predictions():
        print(f"| {r['kernel']} | {r['gb']:.2f} | {r['ms']:.3f} | {r['bound']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
