"""MPI worker body: a state file from another step or rank, deleted state and non-finite
PowerSGD state are refused by name (issue 61), for every part kept per rank.

`check(comm)` (contract: tests/harness/mpibody.py) needs 2 ranks; tests/checkpoint/
test_state_protocol.py runs it. Three runs save at steps 2 and 3: local SGD (dp 2,
Nesterov, mid-round), PowerSGD (dp 2) and the asynchronous pipeline (pp 2, PipeDream-2BW
with the secant correction). Each edit below is made to a copy of the step-3 checkpoint by
an editor that knows the format — the manifest re-signed to match — and must be refused,
on every rank, with a message naming what is wrong; `ckpt verify` names it too where the
file's own records show it; and the unedited checkpoint loads (so the edit is what is
refused):
- two ranks' files swapped (local-r00000 ↔ local-r00001);
- one file copied in from the step-2 checkpoint (local, PowerSGD, the optimizer shard,
  the parameters, the weight version — which used to train on, or end in "weight version
  8 is not held");
- PowerSGD's or the weight versions' files deleted and dropped from the manifest (they
  used to restart silently);
- a NaN in PowerSGD's error feedback (every later step was skipped, exit 0);
- an integer record edited: PowerSGD's `rank` of text, a weight version's `newest` NaN
  (int() on them was a traceback).
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (
    devices,  # noqa: E402  (tests/harness/devices.py: the test device)
    mpibody,  # noqa: E402  (tests/harness/mpibody.py: the body's contract)
)

from hpcpipe import checkpoint as ckpt
from hpcpipe import config
from hpcpipe.checkpoint import manifest as manifests
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.schedules import flushes
from hpcpipe.train import checkpoints
from hpcpipe.train.rank import Rank

B, MICROBATCHES = 2, 4


def make_cfg(kind: str):
    parallel = {"dp": 2, "pp": 1, "microbatches": MICROBATCHES // 2, "schedule": "1f1b"}
    train = {"dtype": "float64", "micro_batch_size": B, "lr": 3e-2, "grad_clip": 0.5,
             "seed": 3}
    if kind == "local":
        train.update(local_steps=4, outer_optimizer="nesterov")
    elif kind == "powersgd":
        parallel.update(grad_compression="powersgd", powersgd_rank=0)  # the default
    else:  # the asynchronous pipeline
        parallel.update(dp=1, pp=2, microbatches=MICROBATCHES, schedule="pipedream-2bw")
        train.update(delay_correction="secant")
    return config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 19},
        "train": train, "parallel": parallel}, source=f"state files: {kind}")


def build(comm, cfg) -> Rank:
    p = cfg.parallel
    grid = gridlib.build(comm, p.dp, p.pp, asynchronous=not flushes(p.schedule))
    return Rank.build(cfg, grid, devices.select(), build_plan(cfg))


def inputs_of(be, step, grid, cfg):
    """inputs(mb) of this replica's microbatches of `step` (random tokens, whole blocks)."""
    microbatches, model = cfg.parallel.microbatches, cfg.model
    rng = np.random.default_rng(700 + step)
    tokens = rng.integers(0, model.vocab_size, (MICROBATCHES * B, model.block_size + 1))
    start = grid.dp_rank * microbatches

    def inputs(mb):
        rows = slice((start + mb) * B, (start + mb + 1) * B)
        return be.from_host(tokens[rows, :-1]), be.from_host(tokens[rows, 1:])
    return inputs


def train(comm, cfg, run_dir) -> str:
    """Three steps, saved after the second and the third; the run's checkpoints folder."""
    rank = build(comm, cfg)
    be = rank.model.backend
    for step in (1, 2, 3):
        rank.train_step(step, inputs_of(be, step, rank.grid, cfg), cfg.optim.lr,
                        cfg.optim.grad_clip)
        if step >= 2:
            rank.flush()
            checkpoints.save(rank, cfg, step, run_dir, {**rank.step.state(), "lr_step": step},
                             keep=5)
    return ckpt.root_of(run_dir)


def resign(folder: str, edit=None):
    """What an editor who knows the format does: the manifest edited, every file's size
    and SHA-256 made to match again, the digest rewritten."""
    with open(os.path.join(folder, manifests.MANIFEST)) as f:
        manifest = json.load(f)
    if edit:
        edit(manifest)
    for name, info in manifest["files"].items():
        path = os.path.join(folder, name)
        info.update(size=os.path.getsize(path), sha256=ckpt.sha256(path))
    manifests.write(folder, json.dumps(manifest))


def swap(a, b):
    def edit(folder, root):
        pa, pb = os.path.join(folder, a), os.path.join(folder, b)
        os.replace(pa, pa + ".x")
        os.replace(pb, pa)
        os.replace(pa + ".x", pb)
    return edit


def older(name):
    def edit(folder, root):
        shutil.copy(os.path.join(root, ckpt.step_name(2), name), os.path.join(folder, name))
    return edit


def deleted(part):
    def edit(folder, root):
        with open(os.path.join(folder, manifests.MANIFEST)) as f:
            names = json.load(f)["parts"][part]

        def drop(manifest):
            for name in names:
                manifest["files"].pop(name)
            manifest["parts"].pop(part)
        for name in names:
            os.remove(os.path.join(folder, name))
        return drop
    return edit


def nan_in(name, key):
    def edit(folder, root):
        import h5py

        with h5py.File(os.path.join(folder, name), "a") as f:
            data, attrs = f[key][()], dict(f[key].attrs)
            data.reshape(-1)[1] = np.nan
            del f[key]
            ds = f.create_dataset(key, data=data, fletcher32=True, chunks=data.shape)
            ds.attrs.update(attrs)
    return edit


def record(name, key, value, of=None):
    """An integer record of file `name` (or of each dataset in its group `of`) set to
    `value`."""
    def edit(folder, root):
        import h5py

        with h5py.File(os.path.join(folder, name), "a") as f:
            for node in [f] if of is None else f[of].values():
                node.attrs[key] = value
    return edit


# kind → [(what is edited, the edit, what the refusal says, whether `ckpt verify` sees it)]
CASES = {
    "local": [("two ranks' files swapped", swap("local-r00000.h5", "local-r00001.h5"),
               "local-r00000.h5: holds 'local-r00001.h5', written for another rank", True),
              ("a file of step 2", older("local-r00001.h5"),
               "local-r00001.h5: written at step 2, but this checkpoint is of step 3", True)],
    "powersgd": [("a file of step 2", older("powersgd-r00001.h5"),
                  "powersgd-r00001.h5: written at step 2", True),
                 ("the optimizer shard of step 2", older("optim-r00000.h5"),
                  "optim-r00000.h5: written at step 2", True),
                 ("its files deleted", deleted("powersgd"),
                  "layout.grad_compression = powersgd says the run had PowerSGD state", False),
                 ("a NaN in the error feedback", nan_in("powersgd-r00001.h5", "error/wpe"),
                  "powersgd-r00001.h5: error/wpe holds 1 NaN or infinite value(s)", False),
                 ("its rank record of text", record("powersgd-r00001.h5", "rank",
                                                    ["1", "0", "0"]),
                  "powersgd-r00001.h5: attribute rank = ", False)],
    "2bw": [("a weight version of step 2", older("versions-pp001.h5"),
             "versions-pp001.h5: written at step 2", True),
            ("the parameters of step 2", older("model-pp001.h5"),
             "model-pp001.h5: written at step 2", True),
            ("its files deleted", deleted("versions"),
             "state.stream_newest = 3 says the run had the asynchronous pipeline's", False),
            ("a weight version's record NaN", record("versions-pp001.h5", "newest", np.nan,
                                                     of="previous"),
             "attribute newest = nan, not an integer", False)],
}


def refusal(comm, cfg, path) -> str | None:
    """The CheckpointError loading `path` ends in (the same on every rank), or None."""
    rank = build(comm, cfg)
    try:
        checkpoints.load(rank, cfg, path, ckpt.read_manifest(path))
    except ckpt.CheckpointError as e:
        return str(e)
    return None


def check_kind(comm, kind: str, folder: str) -> list[str]:
    cfg, failures = make_cfg(kind), []
    root = train(comm, cfg, os.path.join(folder, kind))
    good = os.path.join(root, ckpt.step_name(3))
    if (why := refusal(comm, cfg, good)) is not None:
        return [f"{kind}: the unedited checkpoint is refused: {why}"]
    for i, (what, edit, says, verified) in enumerate(CASES[kind]):
        path = os.path.join(folder, f"{kind}-{i}", ckpt.step_name(3))
        if comm.rank == 0:
            shutil.copytree(good, path)
            resign(path, edit(path, root))
        comm.Barrier()
        got = comm.allgather(refusal(comm, cfg, path))
        if len(set(got)) != 1 or got[0] is None or says not in got[0]:
            failures.append(f"{kind}, {what}: refused with {got}, expected {says!r}")
        if comm.rank == 0 and verified and not any(says in p for p in ckpt.verify(path)):
            failures.append(f"{kind}, {what}: ckpt verify says {ckpt.verify(path)}")
    return failures


OLD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "checkpoint", "data", "format2-a90f780.tar.xz")


def old_cfg(kind: str):
    """The configs the checkpoints of hpcpipe a90f780 were written with (data/README.md):
    float32, vocabulary 256, one block (two for the asynchronous pipeline)."""
    parallel = {"dp": 2, "pp": 1, "microbatches": 2, "schedule": "1f1b"}
    train = {"micro_batch_size": 2, "lr": 3e-3}
    if kind == "local":
        train.update(local_steps=3, outer_optimizer="nesterov")
    elif kind == "powersgd":
        parallel.update(grad_compression="powersgd", powersgd_rank=0)  # the default
    elif kind == "2bw":
        parallel.update(dp=1, pp=2, schedule="pipedream-2bw", layout="E t | t L")
        train.update(delay_correction="secant")
    return config.from_dict({
        "model": {"n_layer": 2 if kind == "2bw" else 1, "n_head": 2, "n_embd": 8,
                  "block_size": 8, "vocab_size": 256},
        "train": train, "parallel": parallel}, source=f"format 2: {kind}")


def old_checkpoints(comm, folder) -> list[str]:
    """Every checkpoint of hpcpipe a90f780 (no records) verifies, loads under its layout
    and trains on — the plain one under another (dp 2: the parameters and optimizer
    shards load under any layout)."""
    failures = []
    if comm.rank == 0:
        import tarfile

        with tarfile.open(OLD) as archive:
            archive.extractall(os.path.join(folder, "old"), filter="data")
    comm.Barrier()
    for kind in ("plain", "local", "powersgd", "2bw"):
        path, cfg = os.path.join(folder, "old", kind), old_cfg(kind)
        if comm.rank == 0 and ckpt.verify(path):
            failures.append(f"format 2 {kind}: ckpt verify says {ckpt.verify(path)}")
        rank = build(comm, cfg)
        try:
            state = checkpoints.load(rank, cfg, path, ckpt.read_manifest(path))
        except ckpt.CheckpointError as e:
            failures.append(f"format 2 {kind}: refused: {e}")
            continue
        rank.step.restore(state)
        step = state["step"] + 1
        outcomes = rank.train_step(step, inputs_of(rank.model.backend, step, rank.grid, cfg),
                                   cfg.optim.lr, cfg.optim.grad_clip) + rank.flush()
        if not outcomes or not all(np.isfinite(o.loss) for o in outcomes):
            failures.append(f"format 2 {kind}: the step after it: {outcomes}")
    return failures


def check(comm) -> mpibody.Report:
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcpipe-state-") if comm.rank == 0
                        else None)
    failures = []
    try:
        failures += old_checkpoints(comm, folder)
        for kind in CASES:
            failures += check_kind(comm, kind, folder)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    summary = [f"{sum(map(len, CASES.values()))} edited checkpoints of "
               f"{', '.join(CASES)} refused by name; 4 of format 2 loaded"]
    return mpibody.Report.agreed(comm, summary, failures)


if __name__ == "__main__":
    sys.exit(mpibody.main(check))
