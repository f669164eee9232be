"""bench stragglers (hpcpipe/bench/stragglers.py) end to end on 2 ranks at a tiny size:
the modes take turns, each replica's steps are recorded on the mode's clock, the slowed
replica takes a smaller share of SSP's and asynchronous EASGD's budgets, which go on past
--steps under --overtime, SSP's staleness (delay-compensated) stays within its bound, the
report and the picture are written; under --straggler chip the slowed replica's time is
spent inside its steps. Times are measured, never asserted (only that they exist, and
that a step lasts at least the sleep it contains). The jobs of two ranks import `run`
inside their tests: they alone are `serial` (conftest.py)."""

import json

import pytest

from hpcpipe.bench.stragglers import mode_settings
from hpcpipe.util.errors import HpcpipeError


def test_the_straggler_benchmark_runs_its_modes_in_turns(tmp_path, stdlib_tokens):
    from harness.mpirun import run

    out, png = tmp_path / "stragglers.json", tmp_path / "stragglers.png"
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "stragglers", "--steps", "6",
                "--segment", "3", "--modes", "sync,local-sgd,ssp-1-dc,easgd", "--local-steps",
                "2", "--delay", "0.1", "--overtime", "1.5", "--eval-batches", "1", "--json",
                str(out), "--png",
                str(png), "--set", "model.n_layer=2", "--set", "model.n_embd=32",
                "--set", "model.block_size=32", "--set", "parallel.easgd_tau=2",
                "--set", f'data.path="{stdlib_tokens}"'], n=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| ssp-1-dc |" in proc.stdout and "replica 1 slowed by 100.0 ms a step, asleep after each step" in proc.stdout
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert list(modes) == ["sync", "local-sgd", "ssp-1-dc", "easgd"]
    for name, mode in modes.items():  # before, after each turn; the asynchronous modes
        overtime = [9] if name in ("ssp-1-dc", "easgd") else []  # go on to 1.5 × 6 steps
        assert [e[0] for e in mode["evals"]] == [0, 3, 6, *overtime], name
        assert mode["clock_s"] > 0, name
    for name in ("sync", "local-sgd"):  # every replica runs every step
        assert [len(r) for r in modes[name]["replicas"]] == [6, 6], name
    assert all(s["staleness"] <= 1 for r in modes["ssp-1-dc"]["replicas"] for s in r)
    for name in ("ssp-1-dc", "easgd"):  # the budget's shares (tickets), shared by speed
        fast, slow = (len(r) for r in modes[name]["replicas"])
        assert fast + slow == 18 and fast > slow, name
    assert {row["mode"] for row in result["summary"]} == set(modes)
    assert png.stat().st_size > 0


def test_a_slow_chip_is_late_inside_its_steps(tmp_path, stdlib_tokens):
    """--straggler chip: replica 1's delay is spent between its step's operations, so
    synchronous dp's every step waits for it (its clock at least steps × delay), and under
    SSP the fast replica still takes more of the shares; the weight prediction and the
    patience run."""
    from harness.mpirun import run

    out, delay, steps = tmp_path / "chip.json", 0.05, 4
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "stragglers", "--steps", str(steps),
                "--segment", "2", "--modes", "sync,ssp-2-extrapolate-p0.5", "--delay", str(delay),
                "--straggler", "chip", "--eval-batches", "1", "--json", str(out),
                "--set", "model.n_layer=2", "--set", "model.n_embd=32",
                "--set", "model.block_size=32", "--set", f'data.path="{stdlib_tokens}"'],
               n=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spread over its operations" in proc.stdout
    result = json.loads(out.read_text())
    assert result["straggler"] == "chip"
    sync, ssp = result["modes"]["sync"], result["modes"]["ssp-2-extrapolate-p0.5"]
    assert sync["clock_s"] >= steps * delay
    fast, slow = (len(r) for r in ssp["replicas"])
    assert fast + slow == 2 * steps and fast >= slow


def test_mode_names_say_their_keys():
    """ssp-S[-C][-pF]: the bound, the correction, the patience; a name that is none of
    the modes is refused with the list of forms."""
    assert mode_settings("ssp-2-p1", 5)["parallel"] == {
        "async_dp": "ssp", "staleness": 2, "ssp_correction": "none", "ssp_patience": 1.0}
    assert mode_settings("ssp-3-extrapolate-p0.5", 5)["parallel"] == {
        "async_dp": "ssp", "staleness": 3, "ssp_correction": "extrapolate",
        "ssp_patience": 0.5}
    assert mode_settings("ssp-0", 5)["parallel"]["ssp_patience"] == 0.0
    for bad in ("ssp-2-px", "ssp-2-p", "ssp-x", "ssp-2-wobble", "ssp-2-p1-dc"):
        with pytest.raises(HpcpipeError, match="-pF"):
            mode_settings(bad, 5)
