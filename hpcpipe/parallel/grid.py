"""The process grid: MPI ranks arranged as dp data-parallel replicas × pp pipeline stages
× tp tensor-parallel shards (3D parallelism).

Built once from the world communicator and passed around as a frozen value: the Grid is
the one owner of every communicator training uses (pipe, data, tensor, replica, local, and
`ends` for the tied embedding); no module holds a communicator of its own. The one
exception is the failure communicator of cli/guard.py — a duplicate of COMM_WORLD made
before any Grid exists, so that an error on one rank can end every rank at any moment,
the Grid's own construction included. (The diagnostic commands, `doctor` and `bench
comm`, split what they measure for themselves.)

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

from dataclasses import dataclass

from hpcpipe.util.errors import LayoutError

RANK_ORDERS = ("pp-inner", "dp-inner")


@dataclass(frozen=True)
class Grid:
    world: object  # MPI.Comm: every rank of the job
    pipe: object  # MPI.Comm: the pp stages of this rank's replica and shard, ranked by stage
    data: object  # MPI.Comm: the dp replicas of this rank's stage and shard, by replica
    local: object  # MPI.Comm: the ranks on this node
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    rank_order: str = "pp-inner"
    tensor: object = None  # MPI.Comm: the tp shards of this rank's stage, by shard
    tp: int = 1
    tp_rank: int = 0
    replica: object = None  # MPI.Comm: every rank of this replica (its pp × tp)
    # MPI.Comm: the first and the last stage of this rank's pipeline, where the tied
    # embedding's two copies live (every placement puts the embedding on pipeline rank 0
    # and the head on rank 0 or pp - 1); None on the other ranks and at pp = 1.
    ends: object = None

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def is_root(self) -> bool:
        """The one rank that prints and writes shared files."""
        return self.world.rank == 0

    @property
    def local_rank(self) -> int:
        return self.local.rank

    @property
    def local_size(self) -> int:
        return self.local.size

    def describe(self) -> str:
        shards = f" × tp {self.tp}" if self.tp > 1 else ""
        return (f"{self.size} ranks = dp {self.dp} × pp {self.pp}{shards} ({self.rank_order}); "
                f"{self.local_size} on this node")


def node_size(world) -> int:
    """How many ranks of `world` share this node (as `build`'s `local` counts them), for
    what must be known before a grid is built: threads per rank, host memory per rank."""
    from mpi4py import MPI

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    try:
        return node.size
    finally:
        node.Free()


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
          tp: int = 1) -> Grid:
    """Arrange `world` into the dp × pp × tp grid; a world of the wrong size is a
    LayoutError (raised on every rank alike, so the caller can print it from one)."""
    from mpi4py import MPI

    if rank_order not in RANK_ORDERS:
        raise LayoutError(f"rank order {rank_order!r} unknown; allowed: {', '.join(RANK_ORDERS)}")
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
                ends=None if ends == MPI.COMM_NULL else ends)
