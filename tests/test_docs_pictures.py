"""Every picture in docs/ is drawn by `make docs` from the code that draws it, so that a
change to the drawing (or to a schedule) is one command away from the README."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_docs_draws_every_picture_in_docs():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndocs: install\n")[1].split("\n\n")[0]
    kinds = re.search(r"^DOCS_SCHEDULES := (.+)$", makefile, re.M).group(1).split()
    assert "--png docs/$$kind-p4-m8.png" in recipe
    drawn = {f"docs/{kind}-p4-m8.png" for kind in kinds}
    drawn |= set(re.findall(r"docs/[\w.-]+\.png", recipe))  # named outright
    # Pictures of measurements have targets of their own (minutes of training each).
    measured = makefile.split("\npowersgd-curves: install\n")[1].split("\n\n")[0]
    drawn |= set(re.findall(r"docs/[\w.-]+\.png", measured))
    pictures = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.png")}
    assert pictures == drawn
