"""V-Half and V-Min from building blocks (vblocks.py): every order valid and within the
family's memory, the table current, and never slower than the family's own squeezed
order."""

import pytest

from hpcpipe.schedules import Costs, check, generate, peak_activations, simulate
from hpcpipe.schedules.controllable import family_limit, squeezed
from hpcpipe.schedules.vblock_table import SHORTLIST
from hpcpipe.schedules.vblocks import Block, build, shortlist

COSTS = [Costs(1, 1, 1), Costs(18.522, 18.086, 9.337, comm=0.601), Costs(1, 2, 0.5, comm=0.3),
         Costs(2, 1, 1, comm=0.05, memw=0.4)]


@pytest.mark.parametrize("kind", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
def test_shortlisted_blocks_build_valid_orders_within_the_limit(kind, p):
    limit, blocks = SHORTLIST[kind][p]
    assert blocks and limit == family_limit(kind, p)
    for spec in blocks:
        for m in (2 * p, 3 * p + 1):
            grid = build(Block(spec[:3], *spec[3:]), p, m, limit)
            schedule = grid.schedule(kind)
            check(schedule)
            assert 2 * max(peak_activations(schedule)) <= limit


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_table_is_what_the_generator_writes(p):
    # (The whole table: python -m hpcpipe.schedules.write_vblock_table --table ..., minutes at p 32.)
    for kind in ("v-half", "v-min"):
        limit = family_limit(kind, p)
        assert SHORTLIST[kind][p] == (limit, tuple((*b.first, b.k0, b.k1, b.switch)
                                                   for b in shortlist(p, limit)))


@pytest.mark.parametrize("costs", COSTS, ids=range(len(COSTS)))
@pytest.mark.parametrize("kind", ["v-half", "v-min"])
def test_never_slower_nor_fuller_than_the_squeezed_order(kind, costs):
    for p, m in [(1, 4), (2, 1), (2, 4), (3, 4), (3, 8), (4, 5), (4, 12), (5, 10)]:
        chosen, own = generate(kind, p, m, costs=costs), squeezed(kind, p, m)
        check(chosen)
        assert max(peak_activations(chosen)) <= max(peak_activations(own))
        assert simulate(chosen, costs).longest_span <= simulate(own, costs).longest_span + 1e-9
