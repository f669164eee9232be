"""Where stage edges fall, as positions in the model counted in blocks, and back: what
parallel.layers_per_stage's counts spell (a stage's count is the distance between its
edges; model/units.position):

    (l, op)          after operation op of block l (layers/ops.py): l + op/6, a sixth
                     each, op 3 the seam (l + 1/2)
    (l, 0, g, H)     across block l's attention, after g of its H heads: l + g/(2H)
    (l, 3, g, 4H)    across block l's MLP, after g of its 4H groups of a head's width of
                     columns: l + 1/2 + g/(8H)
    (l, 1, g, H)     across block l's ln_1 + c_attn alone, after g of its H heads' q, k
                     and v: l + g/(6H)

Read back, a position on a sixth is an operation's edge; so a split across a width whose
position would be one (g a third of the groups) is never made (`width_groups` leaves it
out: the operation's edge there costs the same), and one across ln_1 + c_attn after a
multiple of three heads, whose position is an attention head's edge, neither. Exact
fractions inside; printed to six places, and a count given by hand is matched to the
nearest edge it is close to.
"""

from __future__ import annotations

from fractions import Fraction

from hpcpipe.model.layers import ops
from hpcpipe.model.units import position

# How far from a sixth a position given by hand may be (7/6 written 1.16667 or 1.167).
SIXTH_SLACK = 0.01


class EdgeError(ValueError):
    """Counts whose positions are no stage edge."""


def width_groups(op: int, n_head: int) -> list[int]:
    """The groups g (0 < g < count) of the run `ops.split_run(op)` (op 0 or 3 a
    sublayer, QKV ln_1 + c_attn) after which an edge may fall across its width: all but
    those whose position another edge has — a sixth, an operation's; across ln_1 +
    c_attn, every third, an attention head's."""
    count = ops.groups(ops.split_run(op)[0], n_head)
    if op == ops.QKV:
        return [g for g in range(1, count) if g % 3]
    return [g for g in range(1, count) if (3 * g) % count]


def edge_at(x: Fraction, n_head: int):
    """The stage edge at position x (exact): None at a block boundary, (l, op) on a sixth,
    (l, op, g, groups) across a sublayer's width."""
    block, frac = divmod(Fraction(x), 1)
    block = int(block)
    if frac == 0:
        return None
    if (frac * ops.COUNT).denominator == 1:
        return (block, int(frac * ops.COUNT))
    for op in ((0, ops.QKV) if frac < Fraction(1, 2) else (ops.SEAM,)):
        first, stop = ops.split_run(op)
        count = ops.groups(first, n_head)
        g = (frac - Fraction(first, ops.COUNT)) * ops.COUNT * count / (stop - first)
        if g.denominator == 1 and int(g) in width_groups(op, n_head):
            return (block, op, int(g), count)
    raise EdgeError(f"position {float(x):g} is no stage edge")


def inside(n_head: int, widths: bool = True) -> list[Fraction]:
    """Every edge position inside one block (0 < x < 1), in order: the operations' and,
    with `widths`, those across the sublayers' widths."""
    out = {Fraction(k, ops.COUNT) for k in range(1, ops.COUNT)}
    if widths:
        out |= {position((0, op, g, ops.groups(ops.split_run(op)[0], n_head)))
                for op in (0, ops.QKV, ops.SEAM) for g in width_groups(op, n_head)}
    return sorted(out)


def grid(n_layer: int, n_head: int) -> list[Fraction]:
    """Every position a stage edge may have in a model of n_layer blocks, in order, 0 and
    n_layer included."""
    return [Fraction(b) + c for b in range(n_layer)
            for c in [Fraction(0)] + inside(n_head)] + [Fraction(n_layer)]


def decode(counts, n_layer: int, n_head: int) -> list[Fraction]:
    """The edge positions (exact, 0 to n_layer) of counts per stage given by hand, each
    running sum matched to the nearest edge: a sixth within SIXTH_SLACK, a split across a
    width within a fifth of the finest spacing. EdgeError where one is no edge or leaves
    a stage empty."""
    positions = grid(n_layer, n_head)
    out, total = [Fraction(0)], 0.0
    for count in counts:
        total += float(count)
        nearest = min(positions, key=lambda x: abs(float(x) - total))
        slack = SIXTH_SLACK if (nearest * ops.COUNT).denominator == 1 else 1 / (40 * n_head)
        if abs(float(nearest) - total) > slack or nearest <= out[-1]:
            raise EdgeError(f"a stage edge at {total:g} blocks")
        out.append(nearest)
    if out[-1] != n_layer:
        raise EdgeError(f"the counts sum to {total:g}")
    return out


def text(counts) -> str:
    """Counts per stage (exact) as parallel.layers_per_stage spells them: "[1.5, 2,
    1.1667]" — to six places where an edge falls across a width (finer than sixths)."""
    counts = [Fraction(c) for c in counts]
    places = 4 if all((c * ops.COUNT).denominator == 1 for c in counts) else 6
    return "[" + ", ".join(f"{round(float(c), places):g}" for c in counts) + "]"
