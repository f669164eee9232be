"""Every picture in docs/images/ is drawn by `make pictures` (or, for pictures of
measurements, a target of its own) from the code that draws it, so that a change to the
drawing (or to a schedule) is one command away from the documentation."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe(makefile: str, target: str) -> str:
    return makefile.split(f"\n{target}: install-docs\n" if target == "pictures"
                          else f"\n{target}: install\n")[1].split("\n\n")[0]


def test_make_pictures_draws_every_picture_in_docs():
    makefile = (ROOT / "Makefile").read_text()
    images = re.search(r"^IMAGES := (.+)$", makefile, re.M).group(1)
    drawn_by = recipe(makefile, "pictures").replace("$(IMAGES)", images)
    kinds = re.search(r"^DOCS_SCHEDULES := (.+)$", makefile, re.M).group(1).split()
    assert f"--png {images}/$$kind-p4-m8.png" in drawn_by
    drawn = {f"{images}/{kind}-p4-m8.png" for kind in kinds}
    drawn |= set(re.findall(rf"{images}/[\w.-]+\.png", drawn_by))  # named outright
    # Pictures of measurements have targets of their own (minutes of training each).
    measured = recipe(makefile, "powersgd-curves").replace("$(IMAGES)", images)
    drawn |= set(re.findall(rf"{images}/[\w.-]+\.png", measured))
    pictures = {f"{images}/{p.name}" for p in (ROOT / images).glob("*.png")}
    assert pictures == drawn
    assert not list((ROOT / "docs").glob("*.png")), "pictures live in docs/images/"
