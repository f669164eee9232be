"""The memory check before a run: a lower bound (it must never refuse a run that fits),
and a refusal that says how much is needed and how much there is."""

from types import SimpleNamespace

import pytest
from harness.hostile import small_config
from mpi4py import MPI

from hpcpipe.device import budget
from hpcpipe.train.trainer import train


def fake_gpu(free: int):
    runtime = SimpleNamespace(memGetInfo=lambda: (free, 2 * free))
    return SimpleNamespace(is_gpu=True, xp=SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))


def check_run(cfg, be, ranks_on_node=1):
    """budget.check_run with the config's model, batch and dtype (its pp 1, dp 1)."""
    budget.check_run(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype, be, ranks_on_node,
                     source=cfg.source)


def test_the_estimate_stays_below_what_a_run_really_holds(tmp_path, stdlib_tokens):
    for extra in ([], ["parallel.microbatches=1", "train.micro_batch_size=4"]):
        cfg = small_config("train.steps=2", f'data.path="{stdlib_tokens}"', *extra)
        summary = train(cfg, str(tmp_path / "run"), MPI.COMM_SELF, out=lambda *_: None)
        need = budget.run_need(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype)
        per_microbatch = summary.peak_activation_bytes[0] / summary.peak_activations[0]
        assert 0 < need.activations <= per_microbatch


def test_a_model_that_cannot_fit_on_the_gpu():
    cfg = small_config("model.n_layer=1000", "model.n_embd=2048", "model.n_head=8")
    need = budget.run_need(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype)
    with pytest.raises(budget.BudgetError) as info:
        check_run(cfg, fake_gpu(need.total - 1))
    message = str(info.value)
    assert "does not fit in memory" in message and "free on its GPU" in message
    assert f"at least {budget.gib(need.total)}" in message
    check_run(cfg, fake_gpu(need.total))  # exactly enough: accepted


def test_ranks_on_one_node_share_its_memory(monkeypatch):
    real = budget.host_available()
    assert real is None or real > 0
    cfg = small_config()
    need = budget.run_need(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype).total
    monkeypatch.setattr(budget, "host_available", lambda: 3 * need)
    cpu = SimpleNamespace(is_gpu=False)
    check_run(cfg, cpu, ranks_on_node=3)
    with pytest.raises(budget.BudgetError, match="for its 4 ranks"):
        check_run(cfg, cpu, ranks_on_node=4)


def test_a_model_over_the_memory_pools_cap_is_refused_up_front():
    """train.device_memory caps the rank's memory pool below the GPU's free memory: the
    check used the free memory alone, so a run over the cap started and met CuPy's
    OutOfMemoryError at the cap, mid-run."""
    cfg = small_config("model.n_layer=1000", "model.n_embd=2048", "model.n_head=8")
    need = budget.run_need(cfg.model, cfg.train.micro_batch_size, cfg.train.dtype)
    be = fake_gpu(10 * need.total)
    be.xp.get_default_memory_pool = lambda: SimpleNamespace(get_limit=lambda: need.total - 1)
    with pytest.raises(budget.BudgetError, match="train.device_memory"):
        check_run(cfg, be)
    be.xp.get_default_memory_pool = lambda: SimpleNamespace(get_limit=lambda: 0)  # no cap
    check_run(cfg, be)
