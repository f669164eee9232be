"""The process grid: MPI ranks arranged as dp data-parallel replicas × pp pipeline stages
× tp tensor-parallel shards (3D parallelism).

Built once from the world communicator and passed around as a frozen value: the Grid
creates, names and frees every communicator training uses — pipe, data, tensor, replica,
local, `ends` for the tied embedding, and the duplicates of the world that carry traffic
which must never match the job's own collectives (`reductions`, the asynchronous
pipeline's; `alarms`, the hang watchdogs'). No other module constructs a communicator
(tests/parallel/test_grid.py holds the package to it): what a module needs, the Grid
hands it. The communicators made before any Grid exists, or for a measurement only, come
from this module too: the failure communicator of cli/guard.py (`failures`: an error on
one rank must end every rank at any moment, the Grid's own construction included), this
node's ranks (`node_place`, for `doctor` and the threads per rank) and the first ranks of
one (`first_ranks`, for `bench comm`).

The tp shards of a stage are always the innermost, consecutive ranks: their all-reduces
run inside every F and B, so they belong on one node's fastest links. Rank order
(parallel.rank_order) arranges the other two:
  "pp-inner" (default): world rank = (dp_rank · pp + pp_rank) · tp + tp_rank — the stages
      of one pipeline sit together, hence usually on one node, where the frequent
      stage-to-stage messages are cheapest; replicas spread across nodes.
  "dp-inner": world rank = (pp_rank · dp + dp_rank) · tp + tp_rank — the replicas of one
      stage sit together, which favours the gradient all-reduce instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from hpcpipe.util.errors import LayoutError

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm

RANK_ORDERS = ("pp-inner", "dp-inner")


@dataclass(frozen=True)
class Grid:
    world: Intracomm  # every rank of the job (the caller's: never freed here)
    pipe: Intracomm  # the pp stages of this rank's replica and shard, ranked by stage
    data: Intracomm  # the dp replicas of this rank's stage and shard, by replica
    local: Intracomm  # the ranks on this node
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    rank_order: str = "pp-inner"
    tensor: Intracomm | None = None  # the tp shards of this rank's stage, by shard
    tp: int = 1
    tp_rank: int = 0
    replica: Intracomm | None = None  # every rank of this replica (its pp × tp)
    # The first and the last stage of this rank's pipeline, where the tied embedding's two
    # copies live (every placement puts the embedding on pipeline rank 0 and the head on
    # rank 0 or pp - 1); None on the other ranks and at pp = 1.
    ends: Intracomm | None = None
    # A duplicate of the world for the asynchronous pipeline's end-of-step reductions
    # (train/delayed.py): its ranks start them at different points relative to the world's
    # other collectives, and collectives on one communicator must come in one order
    # everywhere. None unless built with asynchronous=True.
    reductions: Intracomm | None = None
    # A duplicate of the world for the hang watchdogs' alarms and answers
    # (parallel/watchdog.py), which nothing else uses, so its messages can never match the
    # job's. None unless built with watchdog=True on 2 ranks or more.
    alarms: Intracomm | None = None

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.local.rank

    @property
    def local_size(self) -> int:
        return self.local.size

    def free(self):
        """Free every communicator `build` made (not `world`, the caller's), once every
        operation on them has completed: at the end of the run (idempotent)."""
        from mpi4py import MPI

        for f in fields(self):
            comm = getattr(self, f.name)
            if f.name != "world" and isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL:
                comm.Free()

    def describe(self) -> str:
        shards = f" × tp {self.tp}" if self.tp > 1 else ""
        ranks = "1 rank" if self.size == 1 else f"{self.size} ranks"
        return (f"{ranks} = dp {self.dp} × pp {self.pp}{shards} ({self.rank_order}); "
                f"{self.local_size} on this node")


def node_place(world) -> tuple[int, int]:
    """This rank's (rank, size) among the ranks of `world` on its node, as `build`'s
    `local` counts them, for what must be known before a grid is built (threads per rank,
    host memory per rank, `doctor`'s facts)."""
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    try:
        return node.rank, node.size
    finally:
        node.Free()


def node_size(world) -> int:
    """How many ranks of `world` share this node (`node_place`'s size)."""
    return node_place(world)[1]


def failures(world) -> Intracomm:
    """The failure communicator of cli/guard.py: a duplicate of `world` made before any
    Grid exists, which only the failure handlers use (the guard frees it)."""
    return world.Dup()


def first_ranks(comm, n: int) -> Intracomm | None:
    """The first `n` ranks of `comm` as a communicator of their own, by rank; None on the
    others. Collective over `comm`; the caller frees it (`bench comm`'s pair)."""
    from mpi4py import MPI

    part = comm.Split(0 if comm.rank < n else MPI.UNDEFINED, key=comm.rank)
    return None if part == MPI.COMM_NULL else part


def world_rank(dp_rank: int, pp_rank: int, tp_rank: int, dp: int, pp: int, tp: int,
               rank_order: str = "pp-inner") -> int:
    """The world rank at grid coordinates (dp_rank, pp_rank, tp_rank): the arrangement
    `build` makes, computed without MPI (for `doctor`, which checks a layout before it
    runs)."""
    if rank_order == "pp-inner":
        return (dp_rank * pp + pp_rank) * tp + tp_rank
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def check_launch(ranks: int, dp: int, pp: int, tp: int = 1, source: str = "config"):
    """A launch of `ranks` ranks for the grid dp × pp × tp, or the LayoutError that names
    the launch line to use — what `build` says, and what `plan --world` says before it."""
    if ranks != dp * pp * tp:
        asked = f"dp × pp = {dp} × {pp} = {dp * pp}" if tp == 1 else \
            f"dp × pp × tp = {dp} × {pp} × {tp} = {dp * pp * tp}"
        raise LayoutError(
            f"launched with {ranks} MPI ranks, but {source} asks for {asked}; launch "
            f"with `mpiexec -n {dp * pp * tp}` (or set parallel.dp, parallel.pp and "
            f"parallel.tp so that their product is {ranks})")


def build(world, dp: int, pp: int, rank_order: str = "pp-inner", source: str = "config",
          tp: int = 1, asynchronous: bool = False, watchdog: bool = False) -> Grid:
    """Arrange `world` into the dp × pp × tp grid; a world of the wrong size is a
    LayoutError (raised on every rank alike, so the caller can print it from one).
    asynchronous: the grid will run the asynchronous pipeline (PipeDream-2BW), which
    needs `reductions`; watchdog: a hang watchdog will watch it (`alarms`)."""
    from mpi4py import MPI

    check_launch(world.size, dp, pp, tp, source)
    outer = [dp, pp] if rank_order == "pp-inner" else [pp, dp]
    cart = world.Create_cart(dims=[*outer, tp], periods=[False] * 3, reorder=False)
    a, b, tp_rank = cart.Get_coords(world.rank)
    dp_rank, pp_rank = (a, b) if rank_order == "pp-inner" else (b, a)
    pp_axis = 1 if rank_order == "pp-inner" else 0
    pipe = cart.Sub([axis == pp_axis for axis in range(3)])
    data = cart.Sub([axis == 1 - pp_axis for axis in range(3)])
    tensor = cart.Sub([False, False, True])
    replica = cart.Sub([axis != 1 - pp_axis for axis in range(3)])
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    at_end = pp > 1 and pp_rank in (0, pp - 1)
    ends = pipe.Split(0 if at_end else MPI.UNDEFINED, key=pp_rank)
    cart.Free()
    assert pipe.rank == pp_rank and data.rank == dp_rank and tensor.rank == tp_rank
    return Grid(world=world, pipe=pipe, data=data, local=local, dp=dp, pp=pp,
                dp_rank=dp_rank, pp_rank=pp_rank, rank_order=rank_order, tensor=tensor,
                tp=tp, tp_rank=tp_rank, replica=replica,
                ends=None if ends == MPI.COMM_NULL else ends,
                reductions=world.Dup() if asynchronous else None,
                alarms=world.Dup() if watchdog and world.size > 1 else None)
