"""Every command block of README.md and docs/ runs, as written or as its `docs-test`
comment says (blocks.py): in order, page by page, each page in a working folder of its own
— copies of the Makefile, pyproject.toml, inputs/, jobs/ and bench/'s scripts, the tests
reachable, the session's prepared corpus as data/stdlib.tokens.h5 — so that a block never
writes into the repository.

A page is one test: its blocks share the folder (a later block reads what an earlier one
trained), so they must run in order in one process, which pytest-xdist's distribution of
tests would not keep. A page whose blocks start MPI jobs or other processes across the cores
(Block.launches) is `serial`; the others run in the pass of one-process tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from itertools import groupby

import pytest

from blocks import ROOT, Block, DirectiveError, all_blocks, pages, parse, unshown

TIMEOUT = 300  # a block's; they take seconds (importing transformers: up to half a minute)
COPIED = ("Makefile", "pyproject.toml", "README.md", "inputs", "jobs")
# What a block may leave at the top of the folder: the copies, and the folders git ignores
# the contents of (runs/, data/) — a user who follows the docs in a clone keeps a clean
# `git status`.
LEFT = {*COPIED, "bench", "tests", "data", "runs"}

BLOCKS = all_blocks()
PAGES = {page: list(blocks) for page, blocks in groupby(BLOCKS, key=lambda b: b.page)}


def _page_param(page: str, blocks: list[Block]):
    serial = any(block.launches() for block in blocks)
    return pytest.param(blocks, id=page, marks=[pytest.mark.serial] if serial else [])


def _workdir(root, stdlib_tokens):
    os.makedirs(root / "data")
    os.makedirs(root / "runs")  # in every clone (runs/.gitignore)
    for name in COPIED:
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, root / name)
    os.makedirs(root / "bench")
    for script in (ROOT / "bench").glob("*.sh"):
        shutil.copy(script, root / "bench" / script.name)
    os.symlink(ROOT / "tests", root / "tests")  # read: the harness, pytest's collection
    os.symlink(stdlib_tokens, root / "data" / "stdlib.tokens.h5")
    return root


def environment(block: Block) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_COMM_",
                                                                     "HYDRA_", "MPI_LOCAL"))}
    bin_dir = os.path.dirname(sys.executable)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
               VENV=sys.prefix, MPLBACKEND="Agg", COLUMNS="100",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env.update(block.env())
    return env


def run_block(block: Block, cwd) -> subprocess.CompletedProcess:
    if block.lang == "python" and block.kind != "check":
        script = cwd / f"_block_{block.line}.py"
        script.write_text(block.code + "\n")
        args = [sys.executable, str(script)]
    else:
        args = ["bash", "-e", "-o", "pipefail", "-c", block.command()]
    proc = subprocess.Popen(args, cwd=cwd, env=environment(block), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{block.id}: still running after {TIMEOUT} s\n{out[-4000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out)


@pytest.mark.parametrize("blocks", [_page_param(page, blocks)
                                    for page, blocks in PAGES.items()])
def test_page(blocks, tmp_path, stdlib_tokens):
    if all(block.kind == "skip" for block in blocks):
        pytest.skip("docs-test: skip: " + "; ".join(sorted({b.argument for b in blocks})))
    cwd = _workdir(tmp_path, stdlib_tokens)
    for block in blocks:
        if block.kind != "skip":
            check_block(block, cwd)


def check_block(block: Block, cwd):
    proc = run_block(block, cwd)
    what = f"docs-test: check {block.argument}" if block.kind == "check" else block.code
    assert proc.returncode == 0, f"{block.id} failed ({proc.returncode}):\n{what}\n" \
                                 f"--- output ---\n{proc.stdout[-4000:]}"
    strays = sorted(p.name for p in cwd.iterdir()
                    if p.name not in LEFT and not p.name.startswith("_block_"))
    assert not strays, f"{block.id} wrote outside runs/ and data/: {strays}"
    if block.lang == "console" and block.kind != "check":
        missing = unshown(block.code, proc.stdout)
        assert not missing, f"{block.id} shows lines its commands no longer print:\n" + \
            "\n".join(missing) + f"\n--- output ---\n{proc.stdout[-4000:]}"


def test_the_directives_are_well_formed_and_every_page_has_blocks_run():
    for path in pages():
        parse(path)  # raises DirectiveError naming the page and line
    pages_run = {b.page for b in BLOCKS if b.kind != "skip"}
    assert "README.md" in pages_run and "docs/getting-started/first-run.md" in pages_run
    skipped = [b for b in BLOCKS if b.kind == "skip"]
    assert len(skipped) <= len(BLOCKS) // 5, [b.id for b in skipped]  # the exception


def test_a_malformed_directive_is_refused(tmp_path):
    bad = {"<!-- docs-test: skip -->\n```bash\nls\n```\n": "needs a reason",
           "<!-- docs-test: maybe x -->\n```bash\nls\n```\n": "one of skip, check, env",
           "<!-- docs-test: env FAST -->\n```bash\nls\n```\n": "KEY=VALUE",
           "<!-- docs-test: check ls -->\n\n```bash\nls\n```\n": "just before",
           "<!-- docs-test: skip why -->\n```toml\na = 1\n```\n": "never runs"}
    for text, message in bad.items():
        (tmp_path / "probe.md").write_text(text)
        with pytest.raises(DirectiveError, match=message):
            parse(tmp_path / "probe.md", root=tmp_path)


def test_a_console_block_is_held_to_what_it_shows():
    block = "$ run \\\n    --flag\nstep 1 | loss 5.3497 | 12.5 ms ...\n…\ndone: 2 steps\n"
    printed = "header\nstep 1 | loss 5.1234 | 9.0 ms | bubble 3.0%\nmore\ndone: 2 steps\n"
    assert unshown(block, printed) == []
    assert unshown(block, printed.replace("done: 2", "done: 3")) == ["done: 2 steps"]
    assert unshown(block, "done: 2 steps\nstep 1 | loss 5.1 | 1.0 ms\n") == []  # any order
    assert unshown("$ run\nstep 1 | loss 5\n", "step 10 | loss 5\n") == ["step 1 | loss 5"]


def test_a_page_is_serial_when_a_block_starts_processes_across_the_cores():
    launching = ["mpiexec -n 2 python -m mpi4py -m hpcpipe train inputs/tiny.toml",
                 "/usr/bin/mpirun -n 2 x", "srun x", "sbatch jobs/train.sbatch",
                 "make -o install run NP=2", "python -m pytest tests/parallel -q",
                 "ROUNDS=5 bench/watchdog-overhead.sh", "bash jobs/train.sbatch",
                 "python -m hpcpipe train inputs/tiny.toml & wait", "echo 'never closed"]
    one_process = ["python -m hpcpipe plan inputs/tiny.toml 2>&1 | tee runs/plan.txt",
                   "python -m hpcpipe plot runs/tb  # after mpiexec -n 2 ... trained it",
                   "python -c \"print('mpiexec')\" && true || false",
                   "bash -n jobs/train.sbatch", "python -m hpcpipe doctor &> runs/log",
                   "for s in jobs/*.sbatch; do bash -n $s || exit 1; done",
                   "python -m pytest --collect-only -q tests/cli"]
    for code in launching:
        assert Block("p.md", 1, "bash", code).launches(), code
    for code in one_process:
        assert not Block("p.md", 1, "bash", code).launches(), code
    assert not Block("p.md", 1, "bash", "srun x", "skip", "a cluster's").launches()
    assert Block("p.md", 1, "bash", "ls", "check", "make -n test").launches()
    shown = "$ python -m hpcpipe schedule\nmpiexec, as printed"
    assert not Block("p.md", 1, "console", shown).launches()
    mixed = [Block("p.md", 1, "bash", "ls"), Block("p.md", 5, "bash", "mpiexec -n 2 ls")]
    assert [mark.name for mark in _page_param("p.md", mixed).marks] == ["serial"]
    assert not _page_param("p.md", mixed[:1]).marks
