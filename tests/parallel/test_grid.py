"""The Grid owns every communicator (parallel/grid.py): no module of the package but
grid.py constructs one — an AST scan that finds a planted call —, and the communicators a
grid is asked for are made, named and freed by it."""

import ast
import os

import pytest
from harness import devices
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.parallel import grid as gridlib
from hpcpipe.plan import build as build_plan
from hpcpipe.train.rank import Rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "hpcpipe")
OWNER = os.path.join("hpcpipe", "parallel", "grid.py")
# mpi4py's methods that return a new communicator (MPI-4.1's, intercommunicators too).
CONSTRUCTORS = {"Dup", "Idup", "Dup_with_info", "Idup_with_info", "Split", "Split_type",
                "Create", "Create_group", "Create_from_group", "Create_from_groups",
                "Create_cart", "Create_graph", "Create_dist_graph",
                "Create_dist_graph_adjacent", "Create_intercomm", "Sub", "Merge", "Clone",
                "Spawn", "Spawn_multiple", "Accept", "Connect", "Join"}
# Objects whose Create makes something else: MPI.Op.Create (transport.py's sums), a
# window (the asynchronous data-parallel mode's), an info, a datatype.
NOT_COMMUNICATORS = {"Op", "Win", "Info", "Datatype", "Errhandler", "File"}


def constructor_calls(source: str) -> list[str]:
    """'line: call' for each communicator constructor called in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name in CONSTRUCTORS and not (name == "Create" and owner_name in NOT_COMMUNICATORS):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
    return found


def test_no_module_but_grid_py_constructs_a_communicator():
    calls = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if name.endswith(".py") and rel != OWNER:
                calls[rel] = constructor_calls(open(path).read())
    assert not {rel: found for rel, found in calls.items() if found}
    assert constructor_calls(open(os.path.join(ROOT, OWNER)).read())  # (the scan sees)


@pytest.mark.parametrize("planted", [
    "self.comm = self.grid.world.Dup()",
    "pair = grid.pipe.Split(0 if grid.pipe.rank < 2 else MPI.UNDEFINED, key=0)",
    "node = comm.Split_type(MPI.COMM_TYPE_SHARED)",
    "cart = world.Create_cart(dims=[2, 2])",
    "group_comm = MPI.Intracomm.Create_from_group(group)",
    "comm = world.Create(group)",
])
def test_the_scan_finds_a_planted_constructor(planted):
    module = f'"""A module."""\n\n\ndef f(grid, world, comm, group):\n    {planted}\n'
    assert constructor_calls(module) == [f"5: {planted.split(' = ')[1].split('(')[0]}()"]


def test_the_scan_passes_what_makes_no_communicator():
    module = ("op = MPI.Op.Create(add, commute=True)\n"
              "win = MPI.Win.Create(buffer, comm=grid.data)\n"
              "words = text.split(',')\n")
    assert constructor_calls(module) == []


def test_a_grid_makes_the_communicators_it_is_asked_for_and_frees_them():
    plain = gridlib.build(MPI.COMM_SELF, 1, 1)
    assert plain.reductions is None and plain.alarms is None
    grid = gridlib.build(MPI.COMM_SELF, 1, 1, asynchronous=True, watchdog=True)
    assert grid.alarms is None  # (one rank: no other watchdog to tell)
    made = [grid.pipe, grid.data, grid.tensor, grid.replica, grid.local, grid.reductions]
    assert all(c.size == 1 and c != MPI.COMM_SELF for c in made)
    assert MPI.Comm.Compare(grid.reductions, MPI.COMM_SELF) == MPI.CONGRUENT
    grid.free()
    grid.free()  # (twice: nothing left to free)
    assert all(c == MPI.COMM_NULL for c in made)
    assert MPI.COMM_SELF != MPI.COMM_NULL  # the world is the caller's
    plain.free()


def test_the_asynchronous_pipeline_refuses_a_grid_without_its_reductions():
    cfg = config.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 6, "vocab_size": 20},
        "train": {"dtype": "float64", "micro_batch_size": 2},
        "parallel": {"schedule": "pipedream-2bw", "microbatches": 2}}, source="grid test")
    grid = gridlib.build(MPI.COMM_SELF, 1, 1)
    with pytest.raises(RuntimeError, match=r"asynchronous=True"):
        Rank.build(cfg, grid, devices.select(), build_plan(cfg))
    grid.free()
    grid = gridlib.build(MPI.COMM_SELF, 1, 1, asynchronous=True)
    assert Rank.build(cfg, grid, devices.select(), build_plan(cfg)).step.comm is grid.reductions
    grid.free()
