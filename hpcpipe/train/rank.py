"""Everything one rank trains with, wired together once.

    plan ── transport ─┬─ p2p (PipeComm) ── runtime (Runtime: the schedule's op list)
                       └─ model (RankModel: stages, tied embedding) ── step (TrainStep)

`Rank.build` is the one place that assembles these parts from a plan (hpcpipe/plan); the
training loop, the pipeline benchmark and the tests all start from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.model.stagespec import seams
from hpcpipe.parallel.pipeline.p2p import PipeComm
from hpcpipe.parallel.pipeline.runtime import Runtime
from hpcpipe.parallel.pipeline.stream import StreamRuntime
from hpcpipe.schedules import asynchronous
from hpcpipe.parallel.pipeline.stages import RankModel
from hpcpipe.plan import Plan
from hpcpipe.parallel.transport import Transport
from hpcpipe.train import asyncstep
from hpcpipe.train.evaluate import Evaluator
from hpcpipe.train.delayed import DelayedStep
from hpcpipe.train.graphed import Graphed
from hpcpipe.train.step import TrainStep
from hpcpipe.util.timeline import Trace


@dataclass
class Rank:
    model: RankModel
    transport: Transport
    p2p: PipeComm
    runtime: Runtime
    step: TrainStep
    grid: object
    plan: Plan
    graphed: Graphed | None = None  # train.cuda_graphs: the stage's and AdamW's graphs

    @classmethod
    def build(cls, cfg, grid, be, plan: Plan, trace=None, gpu_aware: bool = False,
              beacon=None) -> "Rank":
        """The rank of `grid` under `plan` (its schedule, its stages as its layout and
        recomputation say), computing on backend `be`; `trace` (a trace.Trace) records its
        events and step statistics; gpu_aware: hand device buffers to MPI directly (see
        transport.py); beacon: where the rank says it is (beacon.py: the hang watchdog
        reads it; default one of its own)."""
        schedule = plan.schedule
        transport = Transport(be, gpu_aware, beacon)
        model = RankModel(cfg.model, grid, be, plan, transport, cfg.train.dtype, cfg.train.seed,
                          cfg.parallel.sequence_parallel)
        # Activations between stages: (B, T, C), or T/tp of each sequence per shard under
        # sequence parallelism.
        T = cfg.model.block_size // (grid.tp if model.tp is not None and model.tp.sequence
                                     else 1)
        shape = (cfg.train.micro_batch_size, T, cfg.model.n_embd)
        p2p = PipeComm(grid.pipe, transport, shape, model.dtype, schedule.num_microbatches,
                       schedule.num_stages)
        events = trace if trace is not None else Trace(rank=grid.rank, enabled=False)
        if not plan.flushes:  # the stream, one step late
            step = DelayedStep.build(cfg, model, grid, transport, trace)
            stream = asynchronous.Stream(schedule, cfg.parallel.microbatches,
                                         schedule.num_microbatches // cfg.parallel.microbatches)
            runtime = StreamRuntime(stream, grid.pp_rank, model.stages, step.versions, p2p,
                                    events)
            return cls(model, transport, p2p, runtime, step, grid, plan)
        graphed = Graphed(be) if cfg.train.cuda_graphs else None  # (checked: graphed.check)
        stages = model.stages if graphed is None else {
            chunk: graphed.stage(stage) for chunk, stage in model.stages.items()}
        runtime = Runtime(schedule, grid.pp_rank, stages, p2p, events)
        if cfg.parallel.replicas_apart:  # (parallel.async_dp)
            step = asyncstep.build(cfg, model, grid, transport, trace)
        else:
            step = TrainStep.build(cfg, model, grid, transport, trace)
            # AdamW's graph over the stages' own gradient buffers (ZeRO-1's are fresh shards)
            step.graphs = graphed.graphs if graphed is not None and not step.zero else None
        return cls(model, transport, p2p, runtime, step, grid, plan, graphed)

    @property
    def schedule(self):
        return self.runtime.schedule

    def use_plan(self, plan: Plan):
        """Run `plan` (the same stages rebuilt with another order, maybe other
        recomputation: Plan.rebuilt) from the next step on."""
        self.plan = plan
        self.model.use_recompute(plan.recompute)
        self.runtime = Runtime(plan.schedule, self.grid.pp_rank, self.model.stages, self.p2p,
                               self.runtime.trace)

    def train_step(self, step: int, inputs, lr: float, max_norm: float):
        """One optimizer step (see TrainStep.run): the StepOutcomes that became final."""
        return self.step.run(self.runtime, step, inputs, lr, max_norm)

    def flush(self):
        """The pending post-validated step, settled (see TrainStep.flush)."""
        return self.step.flush()

    def checkpoint_layout(self, cfg) -> dict:
        """The layout a checkpoint of this rank records (the manifest's "layout"), which
        the parts kept per rank are checked against when they load."""
        grid, model, compressor = self.grid, self.model, self.step.gradsync.compressor
        layout = {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "chunks": len(model.stages),
                  "schedule": cfg.parallel.schedule, "zero": cfg.parallel.zero,
                  "rank_order": grid.rank_order,
                  "partition": [list(spec.layers) for spec in model.specs],
                  "local_steps": cfg.outer.local_steps,
                  "powersgd_rank": compressor.rank if compressor is not None else 0}
        if compressor is not None:  # (its rank may be 0: each matrix's own, by its bytes)
            layout["grad_compression"] = "powersgd"
        if seams(model.specs):  # (absent where every stage edge falls between blocks)
            layout["seams"] = seams(model.specs)
        if cfg.parallel.async_dp != "none":  # (absent for the synchronous modes)
            layout["async_dp"] = cfg.parallel.async_dp
            layout["easgd_sync"] = int(cfg.parallel.easgd_sync)
            if cfg.parallel.async_dp == "ssp":  # (the ring of sums holds 2s + 2 steps)
                layout["staleness"] = cfg.parallel.staleness
        return layout

    def evaluator(self, alone: bool = False) -> Evaluator:
        """The validation loss's forward passes, on the whole weights (ZeRO-3 gathers
        them: call it on every rank). alone: this replica evaluates every batch itself,
        the others not at all (the asynchronous modes: no replica waits for another). The
        step's graphs go first: nothing of them is held beside the evaluation's
        activations."""
        if self.graphed is not None:
            self.graphed.release()
        self.step.materialize()
        return Evaluator(self.model, self.grid, self.p2p, alone)
