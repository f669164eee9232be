"""CUDA graphs (hpcpipe/device/graphs.py) as far as the device stand-in can take them: the
first call eager, the second captured, later ones replayed with their inputs copied in and
the same output arrays; a host sync or transfer inside refused naming it; NumPy refused;
the fused AdamW step replayed with each step's scalars read from the device, and a whole
bench step (F, B and W as one graph, AdamW) replayed, bit for bit the eager step; a
graph forgotten is eager again, then captured again (training: tests/train/). CuPy's own
capture runs only on a GPU: `make gpu-check` times the step with and without."""

import numpy as np
import pytest

from hpcpipe.device import backend
from hpcpipe.device.graphs import GraphError, Graphs
from hpcpipe.devtools import hostbuild, standin


@pytest.fixture
def be():
    return backend.Backend(xp=standin.device(), name="simgpu", device_id=0)


def test_the_cpu_has_no_graphs():
    with pytest.raises(GraphError, match="need a GPU"):
        Graphs(backend.cpu())


def test_eager_then_captured_then_replayed_into_the_same_outputs(be):
    xp, graphs = be.xp, Graphs(be)
    scale = xp.asarray(np.array([3.0], np.float32))  # closed over: read in place
    calls = []

    def fn(x):
        calls.append(1)
        return x * scale, x + 1

    outs = [graphs.run("f", fn, xp.asarray(np.full(4, float(i), np.float32)))
            for i in range(4)]
    assert graphs.captured == 1 and len(calls) == 4  # the stand-in re-runs fn to replay
    assert outs[2][0] is outs[1][0] and outs[3][1] is outs[1][1]  # a graph's own arrays
    np.testing.assert_array_equal(outs[3][0].get(), np.full(4, 9.0, np.float32))
    scale.set(np.array([5.0], np.float32))
    graphs.run("f", fn, xp.asarray(np.full(4, 2.0, np.float32)))
    np.testing.assert_array_equal(outs[1][0].get(), np.full(4, 10.0, np.float32))


@pytest.mark.parametrize("inside", ["get", "float", "sync", "set"])
def test_a_host_sync_or_transfer_inside_is_refused_naming_it(be, inside):
    xp, graphs = be.xp, Graphs(be)
    x = xp.asarray(np.ones(3, np.float32))

    def fn():
        y = x * 2
        if inside == "get":
            y.get()
        elif inside == "float":
            float(y.sum())
        elif inside == "sync":
            xp.cuda.get_current_stream().synchronize()
        else:
            y.set(np.zeros(3, np.float32))
        return y

    graphs.run("f", fn)  # eager: allowed
    with pytest.raises(GraphError, match="synchronises with the host or moves data"):
        graphs.run("f", fn)


@pytest.mark.needs("cuda", hostbuild.missing())
def test_adamw_replayed_reads_each_steps_scalars(be):
    """Three steps with changing learning rates: the graphed fused AdamW (its scalars
    written to the device before each replay) bit for bit the eager one."""
    from types import SimpleNamespace

    from hpcpipe.optim.adamw import AdamW, ParamShard

    n, xp = 300, be.xp
    start = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    results = []
    for graphed in (False, True):
        buffer = SimpleNamespace(layout=[("w", (n,))], offsets={"w": (0, n)}, size=n,
                                 data=xp.asarray(start))
        opt = AdamW(ParamShard(buffer), be, weight_decay=0.1)
        grad, graphs = xp.empty(n, np.float32), Graphs(be)
        for step, lr in enumerate((1e-3, 3e-3, 2e-3, 5e-4)):
            grad.set(np.random.default_rng(step).standard_normal(n).astype(np.float32))
            if graphed:
                opt.step_graphed(grad, lr, graphs)
            else:
                opt.step(grad, lr)
        results.append(opt.shard.master.get())
    assert graphs.captured == 1 and np.array_equal(results[0], results[1])


@pytest.mark.needs("cuda", hostbuild.missing())
def test_a_whole_bench_step_replayed_is_the_eager_step(monkeypatch):
    """bench step --graphs, as training runs with train.cuda_graphs (train/graphed.py):
    the microbatch's F, B and W as one graph, AdamW as another (the zeroing and the tied
    head's fold eager); four steps' losses and weights bit for bit the eager step's."""
    from hpcpipe.bench import step
    from hpcpipe.model import GPTConfig

    monkeypatch.setenv(backend.FUSED_ENV, "1")
    monkeypatch.setenv(backend.FAKE_GPU_ENV, "1")
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=32)
    idx, targets = step.make_batch(cfg, 1)
    runs = []
    for graphs in (False, True):
        be = backend.select("gpu")
        s = step.HpcpipeStep(cfg, be, "bfloat16", idx, targets, graphs)
        losses = [s() for _ in range(4)]
        runs.append((losses, s.stage.param_buffer.data.get(), s.graphs))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])
    assert runs[1][2].captured == 2  # the step and AdamW


def test_a_forgotten_graph_is_eager_again_then_captured_again(be):
    xp, graphs, calls = be.xp, Graphs(be), []

    def fn(x):
        calls.append(1)
        return x + 1

    x = xp.asarray(np.zeros(3, np.float32))
    for _ in range(3):
        graphs.run("f", fn, x)
    assert graphs.captured == 1
    graphs.forget("f")
    assert graphs.captured == 0
    graphs.run("f", fn, x)  # eager
    assert graphs.captured == 0
    graphs.run("f", fn, x)  # captured
    assert graphs.captured == 1 and len(calls) == 5
