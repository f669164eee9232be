"""CUDA graphs in training (`train.cuda_graphs`, hpcpipe/train/graphed.py): on the device
stand-in (a capture runs with the host's syncs forbidden, a replay re-runs the call) a run
with graphs is bit for bit the run without — every step's loss and norm, the evaluations
between (which release the graphs: the next step captures again), the final weights and
the memory the run reports — and every layout where capture cannot work is refused up
front, naming why. CuPy's own capture and the host time it saves: make gpu-check."""

import json

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.config import ConfigError
from hpcpipe.device import backend
from hpcpipe.devtools import hostbuild, standin
from hpcpipe.plan.schedule import build_schedule
from hpcpipe.schedules.recompute import Mode, StageRecompute
from hpcpipe.train import graphed
from hpcpipe.train.trainer import train

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=1", "model.block_size=16",
        "train.micro_batch_size=1", "parallel.microbatches=2", "train.steps=3",
        "optim.warmup_steps=1", "train.eval_every=2", "train.eval_batches=1",
        "train.log_every=1", "train.trace_steps=0", 'train.dtype="bfloat16"',
        'parallel.schedule="zb-h1"']


def _fused_standin():
    return backend.Backend(xp=standin.device(), name="simgpu", device_id=0, fused=True)


@pytest.mark.parametrize("sets,why", [
    (["parallel.pp=2"], "single stage"),
    (["parallel.pp=1", "parallel.tp=2", "model.n_head=2"], "collectives run inside F and B"),
    (["parallel.dp=2", "parallel.zero=2"], "re-make the gradient"),
    (["train.device_memory=0.5"], "pool of its own"),
    (['parallel.schedule="gpipe"'], "back to back"),
    (['parallel.schedule="auto"'], "measured time"),
    (['parallel.schedule="pipedream-2bw"'], "streams ops across steps"),
    (["parallel.chunks=2", 'parallel.schedule="zb-v"', "model.n_layer=2"], "single stage"),
    (["parallel.dp=2", 'parallel.async_dp="ssp"'], "asynchronous data parallelism"),
])
def test_every_layout_where_capture_cannot_work_is_refused_naming_why(sets, why):
    cfg = config.load("inputs/tiny.toml", TINY + ["train.cuda_graphs=true", *sets])
    with pytest.raises(ConfigError, match=why) as refused:
        graphed.check(cfg, _fused_standin(), build_schedule(cfg))
    assert "train.cuda_graphs" in str(refused.value)


def test_the_cpu_and_the_unfused_path_are_refused_and_the_rest_accepted():
    cfg = config.load("inputs/tiny.toml", TINY + ["train.cuda_graphs=true"])
    schedule = build_schedule(cfg)
    with pytest.raises(ConfigError, match="need a GPU"):
        graphed.check(cfg, backend.cpu(), schedule)
    unfused = backend.Backend(xp=standin.device(), name="simgpu", device_id=0, fused=False)
    with pytest.raises(ConfigError, match="unfused device path"):
        graphed.check(cfg, unfused, schedule)
    for kind in ("1f1b", "zb-h1", "zb-h2"):
        ok = config.load("inputs/tiny.toml", TINY + ["train.cuda_graphs=true",
                                                     f'parallel.schedule="{kind}"'])
        assert graphed.refusal(ok, _fused_standin(), build_schedule(ok)) is None, kind
    graphed.check(config.load("inputs/tiny.toml", TINY), backend.cpu(), schedule)  # off


def _run(tmp_path, tokens, name, *sets):
    cfg = config.load("inputs/tiny.toml", TINY + ['train.device="gpu"',
                                                  f'data.path="{tokens}"', *sets])
    folder = tmp_path / name
    summary = train(cfg, str(folder), MPI.COMM_SELF, out=lambda *_: None)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "grad_norm", "val_loss")
    return summary, [{k: r[k] for k in keys if k in r} for r in records]


@pytest.mark.needs("cuda", hostbuild.missing())
def test_a_run_with_graphs_is_the_run_without_bit_for_bit(tmp_path, stdlib_tokens,
                                                          monkeypatch):
    """bfloat16 on the fused kernels with selective recomputation (the rebuild inside the
    graph), two microbatches a step — step 1: the first call of the F/B/W graph eager,
    the second captured; step 2: both replayed, AdamW's graph captured; the evaluation
    after it releases the F/B/W graph; step 3: captured again, AdamW replayed —: the same
    numbers and the same reported activation memory as the eager run."""
    monkeypatch.setenv(backend.FAKE_GPU_ENV, "1")
    monkeypatch.setenv(backend.FUSED_ENV, "1")
    captured = []
    forget = graphed.Graphs.forget
    monkeypatch.setattr(graphed.Graphs, "forget",
                        lambda self, key: (captured.append(key in self._graphs),
                                           forget(self, key))[1])
    selective = 'train.recompute="selective"'
    eager, eager_rows = _run(tmp_path, stdlib_tokens, "eager", selective)
    graphs, graph_rows = _run(tmp_path, stdlib_tokens, "graphs", selective,
                              "train.cuda_graphs=true")
    assert graph_rows == eager_rows and len(eager_rows) == 3 + 3  # steps, evaluations
    assert graphs.final_loss == eager.final_loss
    assert graphs.peak_activation_bytes == eager.peak_activation_bytes
    assert max(eager.peak_activation_bytes) > 0
    assert True in captured  # an evaluation released a captured graph
    assert np.dtype(ml_dtypes.bfloat16).itemsize == 2


@pytest.mark.needs("cuda", hostbuild.missing())
def test_data_parallel_with_graphs_reduces_what_the_eager_run_reduces(tmp_path, stdlib_tokens):
    """dp 2 with ZeRO-1 (two ranks sharing the stand-in, host staging), two steps — the
    second replays both microbatches' graph —: the buckets go out after the last
    microbatch's graph in the order its W finished them, the shards step eagerly (fresh
    arrays each step) and come back into the weights the graph reads; every step's loss
    and norm and the evaluations bit for bit the eager run's."""
    from harness.mpirun import run

    env = {backend.FAKE_GPU_ENV: "1", backend.FUSED_ENV: "1"}
    rows = []
    for name, extra in (("eager", []), ("graphs", ["train.cuda_graphs=true"])):
        sets = TINY + ['train.device="gpu"', "train.gpu_sharing=true", "parallel.dp=2",
                       "parallel.zero=1", "train.steps=2", "train.eval_every=0", f'data.path="{stdlib_tokens}"',
                       *extra]
        proc = run(["-m", "mpi4py", "-m", "hpcpipe", "train", "inputs/tiny.toml",
                    "--run-dir", str(tmp_path / name), *sum((["--set", s] for s in sets), [])],
                   n=2, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows.append([{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r}
                     for r in map(json.loads, lines)])
    assert rows[0] == rows[1] and len(rows[0]) == 2 + 2


class _Stage:
    """A stand-in stage of one weight: F y = w·x (the loss y's sum), B and W into grads;
    its stash bytes, a rebuild where it recomputes, and the W hook's names per layer."""

    embedding_part = head_part = True

    def __init__(self, xp, recompute=False):
        self.xp, self.full = xp, recompute
        self.recompute = StageRecompute(Mode.FULL if recompute else Mode.NONE)
        self.w = xp.asarray(np.full(3, 2.0, np.float32))
        self.grad = xp.zeros(3, np.float32)
        self._stash = {}

    @property
    def in_flight(self):
        return sorted(self._stash)

    def forward(self, mb, x, targets=None, loss_scale=1.0, keep=True):
        self._stash[mb] = {"x": x * 1.0, "scale": loss_scale, "rebuilt": not self.full}
        return (self.w * x).sum()

    def stash_bytes(self, mb=None):
        return sum(12 * (2 if e["rebuilt"] and self.full else 1)
                   for m, e in self._stash.items() if mb is None or m == mb)

    def needs_rebuild(self, mb):
        return not self._stash[mb]["rebuilt"]

    def rebuild(self, mb):
        if not self.needs_rebuild(mb):
            return False
        self._stash[mb]["rebuilt"] = True
        return True

    def backward_input(self, mb, dy=None):
        self._stash[mb]["d"] = self._stash[mb]["x"] * self._stash[mb]["scale"]

    def backward_weight(self, mb, after_layer=None):
        self.grad += self._stash.pop(mb)["d"]
        if after_layer is not None:
            after_layer(("h.0.w",))
            after_layer(("wte",))


@pytest.mark.parametrize("recompute", [False, True])
def test_a_graphed_stage_hands_the_runtime_what_the_eager_stage_would(recompute):
    """The runtime's view of a graphed stage, op by op, against the stage itself: the loss
    (a fresh array each microbatch, not the graph's), the rebuild, the stash's bytes after
    each op, the W hook's names in order; a new loss scale drops the old graph; `release`
    drops them all."""
    be = _fused_standin()
    xp = be.xp
    runs = {}
    for wrapped in (False, True):
        stage = _Stage(xp, recompute)
        graphs = graphed.Graphed(be)
        runner = graphs.stage(stage) if wrapped else stage
        seen = []
        for mb, scale in enumerate((1.0, 1.0, 1.0, 0.5, 0.5)):
            x = xp.asarray(np.arange(3, dtype=np.float32) + mb)
            losses = [runner.forward(mb, x, loss_scale=scale)]
            seen.append(("F", runner.stash_bytes(mb), runner.in_flight))
            if runner.needs_rebuild(mb):
                assert runner.rebuild(mb)
            seen.append(("R", runner.stash_bytes(), runner.needs_rebuild(mb)))
            runner.backward_input(mb, None)
            seen.append(("B", runner.stash_bytes(mb)))
            names = []
            runner.backward_weight(mb, names.append)
            seen.append(("W", runner.stash_bytes(), runner.in_flight, names))
            seen.append(("loss", float(losses[0])))
        runs[wrapped] = (seen, stage.grad.get(), graphs)
    assert runs[True][0] == runs[False][0]
    assert np.array_equal(runs[True][1], runs[False][1])
    graphs = runs[True][2].graphs
    assert graphs.captured == 1  # scale 0.5's graph (1.0's was dropped when it came)
    runs[True][2].release()
    assert graphs.captured == 0
