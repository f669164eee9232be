"""Figures a guide shows that a repository command prints are what it prints today (the
house rule: every number in the docs comes from a repo command; dated pages under
docs/measurements/ keep theirs). Each check reads the page's table and recomputes it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

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


PLANNED = re.compile(r"\(`(python -m hpcpipe\s+plan[^`]*)`\): ([\d.]+) GiB of activations on "
                     r"rank 0, where the NumPy passes' count\s+\(`HPCPIPE_FUSED=0`\) says "
                     r"([\d.]+) GiB")


def _rank0_activations(command: list[str], out, **env) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpcpipe", *command, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return f"{json.loads(out.read_text())['ranks'][0]['peak_activation_bytes'] / 2**30:.2f}"


def test_the_memory_guide_planned_activations_are_what_plan_says(tmp_path):
    """memory.md's GPT-2 124M bfloat16 figures, fused kernels and NumPy passes: the fused
    one stayed at 3.16 GiB after the balanced layout moved a seam (plan: 2.96)."""
    page = (ROOT / "docs" / "guides" / "memory.md").read_text()
    match = PLANNED.search(page)
    assert match, "memory.md no longer names its plan command and figures"
    command = shlex.split(" ".join(match.group(1).split()))[3:]  # after python -m hpcpipe
    fused = _rank0_activations(command, tmp_path / "fused.json")
    passes = _rank0_activations(command, tmp_path / "passes.json", HPCPIPE_FUSED="0")
    assert (match.group(2), match.group(3)) == (fused, passes)
