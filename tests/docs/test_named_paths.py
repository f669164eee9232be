"""Nothing points nowhere (issue 58 item 6): every repository path and every `hpcpipe.…`
module named in the package's docstrings and comments, the `.cu` headers, the tests, the
docs, the configs, the job scripts and the Makefile resolves — a file that exists, or for
a module an attribute its file defines.

A path is read as the repository sees it, then relative to `hpcpipe/` (the package's own
docstrings say `model/costs.py`), then relative to the file naming it (the docs' links).
What does not exist by design is passed over, each kind for a reason: an option's argument
(`--json bench/results/x.json`: what a command writes), a placeholder in capitals
(`tests/mpi/NAME.py`), a run directory's contents (`runs/...`: what training makes), a
user's file in a quoted error message, and the made-up links of the docs hook and of the
tests.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUFFIXES = (".py", ".cu", ".cuh", ".h", ".md", ".toml", ".sbatch", ".sh", ".yml")
NAMES = {"Makefile"}
SKIP_DIRS = {".venv", ".git", "site", "build", "__pycache__", ".pytest_cache"}
PATH = re.compile(r"(?<![\w./-])((?:\.\./)*(?:[\w.-]+/)+[\w.-]+\."
                  r"(?:py|md|cu|cuh|h|toml|sbatch|sh|json|yml|png))\b")
MODULE = re.compile(r"(?<![\w.])hpcpipe(?:\.[a-z_][a-z0-9_]*)+")
OPTION_ARGUMENT = re.compile(r"--[\w-]+[ =]$")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")
# Made-up names: the docs hook's example links and its test's, this test's stale cases.
EXAMPLES = {"tests/docs/test_site.py", "docs/hooks/site.py", "tests/docs/test_named_paths.py"}
QUOTED_ERROR = re.compile(r"error: $")  # a message quoted in the docs names a user's file


def _tops():
    subpackages = {d for d in os.listdir(os.path.join(ROOT, "hpcpipe"))
                   if os.path.isdir(os.path.join(ROOT, "hpcpipe", d))}
    folders = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))}
    return (subpackages | folders | {".."}) - SKIP_DIRS - {"runs"}


def _files():
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in names:
            if name.endswith(SUFFIXES) or name in NAMES:
                yield os.path.relpath(os.path.join(folder, name), ROOT)


def _path_resolves(path: str, source: str) -> bool:
    beside = os.path.normpath(os.path.join(os.path.dirname(source), path))
    tries = [beside] if path.startswith("../") else [path, os.path.join("hpcpipe", path),
                                                     beside, os.path.join("docs", path)]
    return any(os.path.exists(os.path.join(ROOT, t)) for t in tries)


def _module_resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:k])
        source = base + ".py" if os.path.isfile(base + ".py") else \
            os.path.join(base, "__init__.py") if os.path.isdir(base) else None
        if source:
            rest = parts[k:]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b",
                                         open(source).read()) is not None
    return False


def stale(source: str, text: str, tops: set) -> list[str]:
    """What `text` (of the file `source`) names that does not resolve."""
    bad = []
    for match in PATH.finditer(text):
        path = match.group(1)
        before = text[max(0, match.start() - 40):match.start()]
        if path.split("/")[0] not in tops or "://" in before[-12:] \
                or OPTION_ARGUMENT.search(before) or QUOTED_ERROR.search(before) \
                or PLACEHOLDER.search(path) \
                or source in EXAMPLES:
            continue
        if not _path_resolves(path, source):
            bad.append(path)
    if source not in EXAMPLES:
        bad += [m.group(0) for m in MODULE.finditer(text) if not _module_resolves(m.group(0))]
    return bad


def test_every_named_path_and_module_resolves():
    tops, found = _tops(), {}
    for source in _files():
        bad = stale(source, open(os.path.join(ROOT, source), errors="replace").read(), tops)
        if bad:
            found[source] = sorted(set(bad))
    assert not found, found


@pytest.mark.parametrize("text", [
    "see hpcpipe/layers/attention.py",  # a folder that moved
    "the rates of ../shared/docs/gpu-kernels.md",  # outside the repository
    "hpcpipe.optim.adamw.nowhere_at_all",  # a name its module never mentions
    "model/memplan.py's budget"])  # the package-relative form
def test_a_stale_name_is_found(text):
    assert stale("hpcpipe/model/x.py", text, _tops())
