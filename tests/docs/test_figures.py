"""Figures a guide shows that a repository command prints are what it prints today (the
house rule: every number in the docs comes from a repo command; dated pages under
docs/measurements/ keep theirs). Each check reads the page's table and recomputes it."""

from __future__ import annotations

import re

from blocks import ROOT
from hpcpipe.schedules import Costs
from hpcpipe.schedules.table import rows

ROW = re.compile(r"^\| (\d+), (\d+), 1:1:([\d.]+) \|(.*)$", re.M)
CELL = re.compile(r"^([\d.]+)% \(([\d.]+)\)$")


def test_the_schedules_guide_table_is_what_the_simulator_gives():
    """schedules.md's closed-form table (`python -m hpcpipe.schedules.table`): ZB-V's
    bubble at F:B:W = 1:1:0.5 once stayed at 7.0 % and 5.5 % after its order changed."""
    page = (ROOT / "docs" / "guides" / "schedules.md").read_text()
    header = next(line for line in page.splitlines() if line.startswith("| p, m, F:B:W"))
    kinds = [cell.strip() for cell in header.strip("|").split("|")[1:-1]]
    found = ROW.findall(page)
    assert len(found) == 4, found
    wrong = []
    for p, m, w, cells in found:
        p, m = int(p), int(m)
        got = {name: (rate, peak) for name, _, rate, _, _, peak, _ in
               rows(p, m, Costs(1, 1, float(w)))}
        for kind, cell in zip(kinds, cells.strip().strip("|").split("|")):
            name = f"auto (limit {2 * p})" if kind.startswith("auto") else kind
            rate, peak = got[name]
            shown = f"{100 * rate:.1f}% ({peak:g})"
            if cell.strip() != shown:
                wrong.append(f"p {p}, m {m}, W {w}, {kind}: page {cell.strip()}, now {shown}")
    assert not wrong, wrong
