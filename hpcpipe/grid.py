"""The process grid: MPI ranks arranged as dp data-parallel replicas × pp pipeline stages.

Built once from the world communicator and passed around as a frozen value: no module
holds a communicator of its own.

Rank order (parallel.rank_order):
  "pp-inner" (default): world rank = dp_rank · pp + pp_rank — the stages of one pipeline
      sit on consecutive ranks, hence usually on one node, where the frequent stage-to-stage
      messages are cheapest; replicas spread across nodes.
  "dp-inner": world rank = pp_rank · dp + dp_rank — the replicas of one stage sit together,
      which favours the gradient all-reduce instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import LayoutError

RANK_ORDERS = ("pp-inner", "dp-inner")
# The MPI launchers' own variables come before Slurm's: an `mpirun` inside a Slurm job
# starts its ranks through one srun task per node, so every rank there inherits that
# task's SLURM_LOCALID (0) while OMPI_COMM_WORLD_LOCAL_RANK / MPI_LOCALRANKID are right.
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                    "PMI_LOCAL_RANK", "SLURM_LOCALID")


@dataclass(frozen=True)
class Grid:
    world: object  # MPI.Comm: every rank of the job
    pipe: object  # MPI.Comm: the pp stages of this rank's replica, ranked by stage
    data: object  # MPI.Comm: the dp replicas of this rank's stage, ranked by replica
    local: object  # MPI.Comm: the ranks on this node
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    rank_order: str = "pp-inner"

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

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def world_rank_of(self, dp_rank: int, pp_rank: int) -> int:
        if self.rank_order == "pp-inner":
            return dp_rank * self.pp + pp_rank
        return pp_rank * self.dp + dp_rank

    def describe(self) -> str:
        return (f"{self.size} ranks = dp {self.dp} × pp {self.pp} ({self.rank_order}); "
                f"{self.local_size} on this node")


def local_rank_from_env() -> int | None:
    """The node-local rank the launcher announces (Slurm, Open MPI, MPICH, MVAPICH)."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def build(world, dp: int, pp: int, rank_order: str = "pp-inner", source: str = "config") -> Grid:
    """Arrange `world` into the dp × pp grid; a world of the wrong size is a LayoutError
    (raised on every rank alike, so the caller can print it from one)."""
    from mpi4py import MPI

    if rank_order not in RANK_ORDERS:
        raise LayoutError(f"rank order {rank_order!r} unknown; allowed: {', '.join(RANK_ORDERS)}")
    if world.size != dp * pp:
        raise LayoutError(
            f"launched with {world.size} MPI ranks, but {source} asks for dp × pp = "
            f"{dp} × {pp} = {dp * pp}; launch with `mpiexec -n {dp * pp}` (or set "
            f"parallel.dp and parallel.pp so that their product is {world.size})")
    dims = [dp, pp] if rank_order == "pp-inner" else [pp, dp]
    cart = world.Create_cart(dims=dims, periods=[False, False], reorder=False)
    coords = cart.Get_coords(world.rank)
    dp_rank, pp_rank = coords if rank_order == "pp-inner" else coords[::-1]
    keep_pp = [False, True] if rank_order == "pp-inner" else [True, False]
    pipe = cart.Sub(keep_pp)
    data = cart.Sub([not k for k in keep_pp])
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    cart.Free()
    assert pipe.rank == pp_rank and data.rank == dp_rank
    return Grid(world=world, pipe=pipe, data=data, local=local, dp=dp, pp=pp,
                dp_rank=dp_rank, pp_rank=pp_rank, rank_order=rank_order)
