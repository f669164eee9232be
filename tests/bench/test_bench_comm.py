"""bench comm's local-SGD table (hpcpipe/bench/comm.py: measure_local) on 2 ranks: the
synchronous step and local SGD's, alternated, on the same model — their bytes exactly
what a ring all-reduce sends (the gradient every step; the parameter deltas, as many
bytes, once every H steps), their times measured, not asserted."""

import json

from harness.mpirun import run

SCRIPT = """
import json
from mpi4py import MPI
from hpcpipe.bench import comm
from hpcpipe.device import backend
from hpcpipe.parallel.transport import Transport

# One core per rank, as `bench comm` itself sets it: BLAS threads of two ranks on two
# cores spin against each other (a step 2.2 s instead of 0.13 s).
be = backend.select("cpu", 0, threads=backend.limit_threads(MPI.COMM_WORLD.size))
modes = comm.measure_local(MPI.COMM_WORLD, be, Transport(be, False), local_steps=2, rounds=1)
if MPI.COMM_WORLD.rank == 0:
    print("RESULT " + json.dumps(modes))
"""


def test_local_sgd_sends_the_gradients_bytes_once_every_h_steps():
    proc = run(["-m", "mpi4py", "-c", SCRIPT], n=2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    sync, local = json.loads(line[len("RESULT "):])
    assert sync["mode"] == "synchronous" and local["mode"] == "local SGD, H 2"
    # A ring all-reduce sends 2(d-1)/d of its buffer: the gradient's every step, the
    # deltas' (float32 parameters, as many bytes) every second step.
    assert sync["sent_bytes"] > 0 and local["sent_bytes"] * 2 == sync["sent_bytes"]
    assert sync["steps"] == local["steps"] == 2
    for mode in (sync, local):
        assert mode["step_ms"] > 0 and mode["tokens_per_s"] > 0


def test_the_bandwidth_table_runs_end_to_end(tmp_path):
    """`bench comm` itself on 2 ranks at small sizes: every size's p2p and all-reduce
    bandwidth through hpcpipe and raw (GradSync's buckets over a stand-in stage, which
    must carry what BucketPlan reads of a real one)."""
    out = tmp_path / "comm.json"
    proc = run(["-m", "mpi4py", "-m", "hpcpipe", "bench", "comm", "--max-mb", "0.0625",
                "--skip-overlap", "--json", str(out)], n=2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4096, 16384, 65536]
    for row in rows:
        for key in ("p2p_hpcpipe_gbs", "p2p_raw_gbs", "allreduce_hpcpipe_gbs",
                    "allreduce_raw_gbs"):
            assert row[key] > 0, (key, row)
