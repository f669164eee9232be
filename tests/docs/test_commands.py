"""Every command block of README.md and docs/ runs, as written or as its `docs-test`
comment says (blocks.py): in order, page by page, each page in a working folder of its own
— copies of the Makefile, pyproject.toml, inputs/, jobs/ and bench/'s scripts, the tests
reachable, the session's prepared corpus as data/stdlib.tokens.h5 — so that a block never
writes into the repository. The blocks start MPI jobs and processes: `serial`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from blocks import ROOT, Block, DirectiveError, all_blocks, pages, parse, unshown

pytestmark = pytest.mark.serial
TIMEOUT = 300  # a block's; they take seconds (importing transformers: up to half a minute)
COPIED = ("Makefile", "pyproject.toml", "README.md", "inputs", "jobs")
# What a block may leave at the top of the folder: the copies, and the folders git ignores
# the contents of (runs/, data/) — a user who follows the docs in a clone keeps a clean
# `git status`.
LEFT = {*COPIED, "bench", "tests", "data", "runs"}

BLOCKS = all_blocks()


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


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory, stdlib_tokens):
    """page → its working folder, made on first use (blocks of a page share it, in order:
    a later block reads what an earlier one trained)."""
    made = {}

    def of(page: str):
        if page not in made:
            made[page] = _workdir(tmp_path_factory.mktemp(page.replace("/", "-")), stdlib_tokens)
        return made[page]
    return of


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


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block, workdirs):
    if block.kind == "skip":
        pytest.skip(f"docs-test: skip {block.argument}")
    proc = run_block(block, workdirs(block.page))
    what = f"docs-test: check {block.argument}" if block.kind == "check" else block.code
    assert proc.returncode == 0, f"{block.id} failed ({proc.returncode}):\n{what}\n" \
                                 f"--- output ---\n{proc.stdout[-4000:]}"
    strays = sorted(p.name for p in workdirs(block.page).iterdir()
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
