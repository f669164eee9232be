"""CUDA graphs in training (`train.cuda_graphs = true`): each microbatch's F, B and W as one
graph, the AdamW update as another (device/graphs.py: the first call eager, the second
captured, later ones replayed), so a step costs the host a few launches instead of
hundreds — the same kernels on the same arrays in the same order: the same bits.

Where it can run, and why only there (`refusal`, checked before anything big is made):
- a GPU (the CPU's NumPy has no stream capture), on the fused kernels (the unfused
  device path waits for the host inside a step);
- one pipeline stage on the rank (pp = 1, one chunk), whose schedule runs each
  microbatch's F, B and W back to back (1F1B, ZB-H1, ZB-H2, interleaved at one chunk):
  the stash of one microbatch is then made and freed inside its own graph — its memory
  pool holds one microbatch's working set, what the eager step reuses, and no Python
  state outlives the replay. Between pipeline ranks, or with GPipe's order, several
  microbatches are in flight: each would need a graph whose pool keeps its stash (memory
  the plan does not count), and a replay's outputs are rewritten by the next;
- no tensor parallelism (its collectives run inside F and B: MPI inside a capture never
  runs again at a replay), no ZeRO-2 or 3 (they free and re-make the gradient and weight
  buffers each step: a graph's addresses would go stale), no `train.device_memory` cap
  (it bounds the rank's memory pool; a graph allocates from a pool of its own), not the
  asynchronous pipeline (a stream of ops across steps) nor the auto schedule (built from
  each op's measured time, where a graph times a microbatch's three ops as one).
Data parallelism works: the gradient's buckets go out after the graph of the last
microbatch, in the order its W finished them (the reductions then start after the whole
W rather than layer by layer: the same sums, less overlap). The AdamW graph runs where
the update is the fused kernel over the stage's own gradient buffer (no ZeRO-1: its
shards are fresh arrays each step); Muon, ZeRO-1's shards and post-validation's
speculative updates step eagerly.

What a replay does not redo is kept from the eager call and replayed to the runtime:
the W hooks' layer names (the data-parallel buckets), the stash's bytes after F and B
(the memory accounting the run reports). An evaluation first releases the step's graphs
(`Graphed.release`): nothing of them is held beside its activations; the next step
captures again.
"""

from __future__ import annotations

from hpcpipe.device.graphs import Graphs
from hpcpipe.device.graphs import refusal as device_refusal
from hpcpipe.schedules import flushes, from_costs, messages
from hpcpipe.schedules.ops import Kind
from hpcpipe.util.errors import ConfigError


def refusal(cfg, be, schedule) -> str | None:
    """Why this run's steps cannot be CUDA graphs, or None (see the module)."""
    parallel, train = cfg.parallel, cfg.train
    why = device_refusal(be)
    if why:
        return why
    if not getattr(be, "fused", True):
        return ("the layers' unfused device path waits for the host inside a step; "
                "graphs need the fused kernels (HPCPIPE_FUSED is 0)")
    if parallel.pp > 1 or schedule.chunks > 1:
        return ("a pipeline rank runs other microbatches' ops and messages between one "
                "microbatch's F, B and W, so each microbatch in flight would need a graph "
                "whose memory pool keeps its stash — memory the plan does not count; "
                "graphs run a single stage (pp = 1, one chunk)")
    if parallel.tp > 1:
        return ("tensor parallelism's collectives run inside F and B, and MPI inside a "
                "captured call never runs again when it is replayed")
    if parallel.zero >= 2 and parallel.dp != 1:
        return ("ZeRO-2 and 3 free and re-make the gradient (and weight) buffers every "
                "step, so a graph's addresses would go stale")
    if train.device_memory:
        return ("train.device_memory caps the rank's memory pool, and a graph allocates "
                "from a pool of its own that the cap would not bound")
    if not flushes(parallel.schedule):
        return "the asynchronous pipeline streams ops across steps"
    if getattr(parallel, "async_dp", "none") != "none":
        return ("asynchronous data parallelism (parallel.async_dp) is not yet run with "
                "graphs: its records replay every update's order, and no test has checked "
                "that promise with the steps replayed as graphs")
    if from_costs(parallel.schedule):
        return ("the auto schedule is built from each op's measured time, and a graph runs "
                "a microbatch's F, B and W as one launch")
    if not back_to_back(schedule):
        return (f"{parallel.schedule} does not run each microbatch's F, B and W back to back "
                f"(GPipe runs every F first): choose 1f1b, zb-h1 or zb-h2")
    return None


def back_to_back(schedule) -> bool:
    """Whether rank 0's ops run each microbatch's F then its B and W (or BW) before the
    next microbatch's F."""
    ops = [item.op for item in messages(schedule, 0)]
    expected = []
    for op in ops:
        if op.kind == Kind.F:
            expected.append([Kind.B, Kind.W])
            if len(expected) > 1:
                return False
            continue
        if not expected:
            return False
        wanted = expected[-1]
        if op.kind == Kind.BW and wanted == [Kind.B, Kind.W]:
            expected.pop()
        elif op.kind == wanted[0]:
            wanted.pop(0)
            if not wanted:
                expected.pop()
        else:
            return False
    return not expected


def check(cfg, be, schedule):
    """Refuse the run, naming why, where `train.cuda_graphs` cannot work with `schedule`
    (the same answer on every rank: the config and the kind of device)."""
    why = refusal(cfg, be, schedule) if cfg.train.cuda_graphs else None
    if why:
        raise ConfigError(cfg.source, "train.cuda_graphs", True, why)


def optimizer_step(optimizer, grads, lr: float, coefficient: float, graphs=None):
    """The update: AdamW over the stages' own gradient buffers (the same arrays every
    step) replayed as a graph where `graphs` is given, else the optimizer's own step."""
    if graphs is None or optimizer.kind != "adamw":
        optimizer.step(grads, lr, coefficient)
        return
    for adam, grad in zip(optimizer.adams, grads):
        adam.step_graphed(grad, lr, graphs, coefficient)


class Graphed:
    """The graphs of one rank's training: its stage's (`stage`) and the optimizer's."""

    def __init__(self, be):
        self.graphs = Graphs(be)
        self.stages: list[GraphedStage] = []

    def stage(self, stage) -> "GraphedStage":
        wrapped = GraphedStage(stage, self.graphs)
        self.stages.append(wrapped)
        return wrapped

    def release(self):
        """Drop the F/B/W graphs and their memory (before an evaluation): the next step
        runs eagerly once, then captures again."""
        for stage in self.stages:
            stage.release()


class GraphedStage:
    """A stage (stage.Stage or LlamaStage) as the runtime sees it, whose F op runs the
    microbatch's F, B (with its rebuild) and W as one graph, and whose B and W ops then
    only hand the runtime what those did: the W hooks' layer names and the stash's bytes,
    as the eager call recorded them. Everything else is the stage's own."""

    def __init__(self, stage, graphs: Graphs):
        self.stage, self.graphs = stage, graphs
        self._phase: dict[int, str] = {}  # microbatch → the op the runtime last ran: F, R, B
        self._record: dict = {}  # graph key → {"names", "bytes": {phase: bytes}, "rebuilds"}
        self._keys: set = set()

    def __getattr__(self, name):
        return getattr(self.stage, name)

    # -- F: the whole microbatch --------------------------------------------------------
    def forward(self, mb: int, inp, targets=None, loss_scale: float = 1.0, keep=True):
        if not keep:
            return self.stage.forward(mb, inp, targets, loss_scale, keep)
        if not (self.stage.embedding_part and self.stage.head_part):
            raise RuntimeError("a graphed stage holds the whole model (pp = 1)")
        mode = self.stage.recompute.at(mb)
        key = ("fbw", id(self), float(loss_scale), mode, tuple(inp.shape))
        for old in [k for k in self._keys if k != key and k[2] != key[2]]:
            self.graphs.forget(old)  # (a new loss scale: the old graphs go)
            self._keys.discard(old)
            self._record.pop(old, None)
        self._keys.add(key)
        first = key not in self._record
        if first:
            self._record[key] = {"names": [], "bytes": {}}

        def fbw(idx, tokens):
            return self._fbw(key, mb, idx, tokens, loss_scale, first)

        value = self.graphs.run(key, fbw, inp, targets)
        self._phase[mb] = ("F", key)
        return value.copy()  # the graph rewrites its loss at the next replay

    def _fbw(self, key, mb, idx, targets, loss_scale, record: bool):
        """The eager stage's F, rebuild, B and W of microbatch mb; on the eager call the
        hooks' names and the stash's bytes after each are written down."""
        stage, seen = self.stage, self._record[key]
        names = seen["names"] if record else []
        value = stage.forward(mb, idx, targets, loss_scale=loss_scale)
        if record:
            seen["bytes"]["F"] = stage.stash_bytes(mb)
            seen["rebuilds"] = stage.needs_rebuild(mb)
        if stage.rebuild(mb) and record:
            seen["bytes"]["R"] = stage.stash_bytes(mb)
        stage.backward_input(mb, None)
        if record:
            seen["bytes"]["B"] = stage.stash_bytes(mb)
        stage.backward_weight(mb, names.append)
        return value

    # -- B and W: what the graph did, handed to the runtime -------------------------------
    def needs_rebuild(self, mb: int) -> bool:
        phase, key = self._phase[mb]
        return phase == "F" and self._record[key]["rebuilds"]

    def rebuild(self, mb: int) -> bool:
        if not self.needs_rebuild(mb):
            return False
        self._phase[mb] = ("R", self._phase[mb][1])
        return True

    def backward_input(self, mb: int, dy=None):
        if dy is not None:
            raise RuntimeError("a graphed stage receives no gradient (pp = 1)")
        self._phase[mb] = ("B", self._phase[mb][1])

    def backward_weight(self, mb: int, after_layer=None):
        _, key = self._phase.pop(mb)
        if after_layer is not None:
            for names in self._record[key]["names"]:
                after_layer(names)

    def backward(self, mb: int, dy=None, after_layer=None):
        self.backward_input(mb, dy)
        self.backward_weight(mb, after_layer)

    @property
    def in_flight(self) -> list[int]:
        return sorted(self._phase)

    def stash_bytes(self, mb: int | None = None) -> int:
        """The bytes the eager stage held at this point of each microbatch in flight."""
        held = [m for m in self._phase if mb is None or m == mb]
        return sum(self._record[self._phase[m][1]]["bytes"][self._phase[m][0]] for m in held)

    def release(self):
        for key in self._keys:
            self.graphs.forget(key)
        self._keys.clear()
        self._record.clear()
