"""The asynchronous pipeline (PipeDream-2BW) over MPI: every layout of 2 and 4 ranks
trains like the delayed update written out in one process (a worker body,
tests/mpi/pipedream.py, on the `world`'s ranks)."""

import pytest
from harness import devices
from harness.mpiworld import sizes

pytestmark = pytest.mark.device


@pytest.mark.parametrize("ranks", sizes(4, 2))
def test_pipedream_layouts_equal_the_delayed_update_in_one_process(world, ranks):
    """dp × pp ∈ {1 × 2 (and full recomputation), 2 × 1} (2 ranks), {1 × 4 (and selective
    recomputation), 2 × 2 (and full), 4 × 1} (4 ranks), float64, 7 steps at a learning rate
    that changes every step and a norm that clips: each step's loss and gradient norm and
    the weights after the last update equal the reference (step s's gradient on the weights
    after s − 1 updates, applied to the newest) to 1e-12; bitwise across pp and
    recomputation; drained at steps 2 and 5 (as evaluations and checkpoints drain) bitwise
    the same; every outcome once, in step order; the newest weights in use after a flush;
    bfloat16 at pp = world, cut at blocks' seams, bitwise equal to one process;
    pipedream.delay_correction = "secant" at pp = world and dp 2 equal to the corrected update
    written out (weights to 1e-10);
    optim.optimizer = "muon" with pipedream.delay_correction = "extrapolate" (at pp = world and
    at dp 2 with full recomputation, drained at step 3; bfloat16 bitwise one process), and
    AdamW with "extrapolate" at dp 2, equal to the update on the extrapolated versions."""
    report = world.run("pipedream")
    assert not report.failures, report
    assert any(line.startswith(f"world {ranks}: pipedream-2bw")
               and ("cut at seams" in line or devices.fused())
               for line in report.summary), report
