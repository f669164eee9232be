"""The kernel-level cost model (hpcpipe/devtools/kernelmodel.py): it reproduces the
kernels the H100 measured (step-bfloat16.json) within 30 % before anything it predicts is
used; the combination it predicts with is the one that does (the other misses the WMMA
attention); occupancy from registers and shared memory as CUDA computes it."""

import pytest

from hpcpipe.devtools import kernelmodel as km


def test_the_model_reproduces_the_h100s_measured_kernels_within_30_percent():
    rows = km.validation()
    assert {r["kernel"] for r in rows} >= {"attention F (WMMA)", "attention B (WMMA)",
                                           "head F (GEMM)", "AdamW step"}
    off = [r for r in rows if abs(r["serial_error"]) > 0.30]
    assert not off, off


def test_the_overlap_combination_would_not_have_earned_trust():
    """A kernel whose phases wait on each other: the slowest pipe alone underestimates the
    WMMA attention by more than 30 %, which is why predictions take the serial sum."""
    wmma = {r["kernel"]: r for r in km.validation() if "WMMA" in r["kernel"]}
    assert all(r["overlap_error"] < -0.30 for r in wmma.values())
    assert all(r["overlap_ms"] <= r["serial_ms"] for r in wmma.values())


@pytest.mark.parametrize("threads,registers,shared,blocks", [
    (128, 116, 28 * 1024, 4),      # WMMA F: registers bind (120 a thread allocated)
    (128, 142, 46080, 3),          # flash F with one m-tile a warp
    (64, 217, 36864, 4),           # flash F: registers bind (224 allocated, 2 warps)
    (128, 253, 47104, 2),          # flash dkv
    (128, 32, 100 * 1024, 2),      # shared memory binds
    (128, 32, 0, 16),              # warps bind (64 a SM, 4 a block)
])
def test_occupancy_is_cudas(threads, registers, shared, blocks):
    k = km.Kernel("k", threads, registers, shared, 1, (), 0)
    assert km.blocks_per_sm(k) == blocks


def test_two_m_tiles_a_warp_lift_the_shared_memory_bound_past_the_goals():
    """What flash.cu's restructuring is for, by this model: with one 16-row m-tile a warp
    F was shared-memory bound at 132 TFLOP/s (the goal is 150); two m-tiles a warp load
    each K and V fragment once for twice the products, and the model predicts F past 150
    and B further above 100 — predictions, labelled so everywhere they are printed."""
    before, after, llama = km.designs()
    assert before["bound"] == "shared" and before["F"] < 150
    assert after["F"] >= 150 and after["B"] > before["B"] > 100
    # The rotation on read redoes a key tile's turn for every block of queries: at
    # SmolLM2's shape the model prices it (F back under the goal, shared-memory bound).
    assert llama["F"] < after["F"] and llama["bound"] == "shared"


def test_predictions_are_the_serial_sums_and_bounded_by_the_overlap():
    for p in km.predictions():
        assert p["serial_ms"] >= p["overlap_ms"] > 0
        assert p["bound"] in {"tensor", "shared", "issue", "sfu"}
    rates = km.flash_rates()
    assert set(rates) == {"flash_forward", "flash_backward_dq", "flash_backward_dkv"}
    assert all(50e12 < r < 400e12 for r in rates.values())


def test_a_trip_adds_its_pipes_and_the_uncovered_latency():
    t = km.Trip(mma=8, wavefronts=100, instructions=400, sfu=4, trips=2, barriers=1)
    c = km.trip_cycles(t, resident=2)
    assert c["tensor"] == 8 * 4096 / km.H100.mma_flops_per_clk and c["issue"] == 100
    assert c["latency"] == (2 * km.H100.l2_latency_clk + km.H100.barrier_clk) / 2
    assert c["serial"] == pytest.approx(c["tensor"] + 100 + 100 + c["sfu"] + c["latency"])
    assert c["overlap"] == max(c["tensor"], 100, 100, c["sfu"], c["latency"])
