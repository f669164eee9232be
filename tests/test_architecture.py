"""The package's architecture, held by tests: the import contract (import-linter's, in
pyproject.toml: each layer imports only those below it; the model, the device layer, the
schedules and the utilities never touch MPI), a top level of a few modules, a purpose
docstring on every module, functions and classes that fit on a screen, and tests that
mirror the subpackages, no whole run Config below train/ (each subsystem takes its own
section, the plan or plain values), config.py within 300 lines, schedule kinds and
recomputation compared by name only where they are owned, and checkpoint/ never walking a
rank's step or model."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hpcpipe")
TESTS = os.path.join(ROOT, "tests")
# Folders of tests/ that are not a subpackage's: the harness, the MPI worker bodies, the
# job scripts' tests (jobs/ is not Python) and the hostile-input suites that cross all.
NOT_SUBPACKAGES = {"harness", "mpi", "jobs", "reliability", "docs", "__pycache__"}
# The subsystems below train/ and plan/: each takes its own config section (or the plan, or
# plain values), never the whole Config, so that what a module reads is in its signature.
OWN_SECTIONS_ONLY = ("device", "parallel", "checkpoint", "data", "runs")
CONFIG_SECTIONS = {"parallel", "train", "optim", "outer", "pipedream", "checkpoint", "data",
                   "model"}
CONFIG_NAMES = {"cfg", "config", "conf"}  # what a whole Config is called in this package


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


def test_the_import_contract_holds():
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    assert lint, "import-linter is part of the test extra: pip install -e '.[test]'"
    proc = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _imported(name: str, tree, known: set) -> set:
    """The package's modules (not packages' __init__) that module `name` imports anywhere,
    lazily inside a function too: a lazy import is a cycle postponed, not removed."""
    out = set()
    package = name if name + ".__init__" in known else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_module_imports_itself_round_about():
    """No import cycle among the package's modules, lazy imports counted (issue 58: adamw ⇄
    muon and recompute ⇄ simulator were two): a depth-first walk finds no back edge."""
    trees = {path[:-3].replace(os.sep, "."): tree for path, tree in modules()}
    known = set(trees)
    graph = {name: {t for t in _imported(name, tree, known) if not t.endswith("__init__")}
             for name, tree in trees.items() if not name.endswith("__init__")}
    state, cycles = {}, []

    def walk(node, trail):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" → ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, cycles


def test_a_top_level_of_few_modules():
    top = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "config.py"]


def test_the_config_module_only_composes():
    """config.py composes the sections and checks the exclusions' table; a key's checks
    live in its section (issue 58: at most 300 lines, where it had grown to 953)."""
    lines = len(open(os.path.join(PACKAGE, "config.py")).read().splitlines())
    assert lines <= 300, f"hpcpipe/config.py has {lines} lines: move checks into sections"


@pytest.mark.parametrize("path,tree", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_module_says_what_it_is_for(path, tree):
    assert ast.get_docstring(tree), f"{path} has no docstring"


def test_functions_and_classes_fit_on_a_screen():
    too_long = []
    for path, tree in modules():
        for node in ast.walk(tree):
            limit = {ast.FunctionDef: 80, ast.AsyncFunctionDef: 80, ast.ClassDef: 250}.get(
                type(node))
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines, limit {limit})")
    assert not too_long, too_long


def test_tests_mirror_the_subpackages():
    subpackages = {name for name in os.listdir(PACKAGE)
                   if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
    folders = {name for name in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, name))}
    assert folders - NOT_SUBPACKAGES <= subpackages, folders - NOT_SUBPACKAGES - subpackages
    untested = subpackages - folders
    assert not untested, f"subpackages without a tests/ folder: {sorted(untested)}"


def test_test_files_have_unique_names():
    """pytest imports test files by their base name (no __init__.py in tests/ folders):
    two of one name would stop the collection."""
    seen = {}
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                seen.setdefault(name, []).append(os.path.relpath(folder, TESTS))
    assert not {n: w for n, w in seen.items() if len(w) > 1}


def whole_config_uses(tree, package: str) -> list[str]:
    """Where module `tree` (of `package`) imports hpcpipe.config or its Config, annotates a
    parameter as Config, or reads a section (`cfg.train`, `self.config.parallel`) off what
    the package calls a Config: line and what."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name == "hpcpipe.config"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = {f"{base}.{a.name}" for a in node.names} | {base}
            if "hpcpipe.config" in names or any(a.name == "Config" for a in node.names):
                found.append((node.lineno, f"from {base} import ..."))
        elif isinstance(node, ast.arg) and node.annotation is not None:
            if "Config" in {getattr(node.annotation, "id", None),
                            getattr(node.annotation, "value", None)}:
                found.append((node.lineno, f"{node.arg}: Config"))
        elif isinstance(node, ast.Attribute) and node.attr in CONFIG_SECTIONS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else \
                owner.attr if isinstance(owner, ast.Attribute) else None
            if name in CONFIG_NAMES:
                found.append((node.lineno, f"{name}.{node.attr}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_whole_config_below_train():
    """device/, parallel/, checkpoint/, data/ and runs/ never see the whole Config."""
    found, checked = [], 0
    for below in OWN_SECTIONS_ONLY:
        for folder, _, files in os.walk(os.path.join(PACKAGE, below)):
            package = os.path.relpath(folder, ROOT).replace(os.sep, ".")  # (an __init__'s too)
            for name in (n for n in files if n.endswith(".py")):
                path = os.path.join(folder, name)
                found += [f"{os.path.relpath(path, ROOT)}: {use}"
                          for use in whole_config_uses(ast.parse(open(path).read()), package)]
                checked += 1
    assert checked > 50 and not found, found


def test_the_whole_config_check_finds_each_kind_of_use():
    planted = ("from hpcpipe.config import Config\n"
               "from ..config import load\n"
               "from hpcpipe import config\n"
               "import hpcpipe.config\n"
               "def f(run: Config, x: 'Config'):\n"
               "    return cfg.optim.lr, self.config.parallel, config.model\n"
               "def g(grid, section):\n"
               "    return section.model, stage.cfg.n_head, rank.model\n")
    found = whole_config_uses(ast.parse(planted), "hpcpipe.data")
    assert found == ["line 1: from hpcpipe.config import ...",
                     "line 2: from hpcpipe.config import ...",
                     "line 3: from hpcpipe import ...", "line 4: hpcpipe.config",
                     "line 5: run: Config", "line 5: x: Config", "line 6: cfg.optim",
                     "line 6: config.model", "line 6: config.parallel"]  # (not line 8)


# Where a schedule's kind or a recomputation choice may be compared by name (issue 58):
# the two packages that own them. bench/ picks its table's baseline row by its label.
BY_NAME_ONLY_IN = ("schedules", "plan", "bench")


def names_compared(tree, names) -> list[str]:
    """Comparisons in `tree` against one of `names` (a string, or one in a tuple/list/set),
    and `<x>.schedule` against "auto"."""
    def strings(node) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(strings(e) for e in node.elts)) if node.elts else set()
        return set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            words = set().union(*(strings(s) for s in sides))
            on_schedule = any(isinstance(s, ast.Attribute) and s.attr == "schedule"
                              for s in sides)
            if words & names or (on_schedule and "auto" in words):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def kind_and_recompute_names() -> set:
    from hpcpipe.schedules import KINDS
    from hpcpipe.schedules.recompute import Mode

    return (set(KINDS) - {"auto"}) | {Mode.SELECTIVE.value, Mode.FULL.value}


def test_schedule_kinds_and_recomputation_are_compared_by_name_in_their_owners_only():
    """Outside schedules/ and plan/, code asks the schedule or the plan what a kind does
    (flushes, chunks, ...) instead of testing its name."""
    names, found, checked = kind_and_recompute_names(), [], 0
    for path, tree in modules():
        if path.split(os.sep)[1] in BY_NAME_ONLY_IN:
            continue
        found += [f"{path}: {use}" for use in names_compared(tree, names)]
        checked += 1
    assert checked > 100 and not found, found


def test_the_by_name_check_finds_each_kind_of_comparison():
    planted = ("if cfg.parallel.schedule == 'zb-v': pass\n"
               "if kind in ('gpipe', '1f1b'): pass\n"
               "if recompute != 'selective': pass\n"
               "if p.schedule == 'auto': pass\n"
               "if mode == 'auto' or dtype == 'float16': pass\n")
    found = names_compared(ast.parse(planted), kind_and_recompute_names())
    assert [f.split(":")[0] for f in found] == ["line 1", "line 2", "line 3", "line 4"]


def test_checkpoint_never_walks_the_trainer():
    """checkpoint/ receives named state parts (util/state.py) and never reaches into a
    rank's step or model itself (issue 58)."""
    found, checked = [], 0
    for path, tree in modules():
        if path.split(os.sep)[1] != "checkpoint":
            continue
        checked += 1
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("step", "model") and \
                    isinstance(node.value, ast.Name) and node.value.id == "rank":
                found.append(f"{path}: line {node.lineno}: rank.{node.attr}")
    assert checked > 10 and not found, found
