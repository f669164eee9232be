"""The documentation site builds strictly (mkdocs.yml: a broken link, a missing anchor, a
page left out of the navigation fail it), its reference is what the code says, and the
README stays a front door."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib

import pytest

from blocks import ROOT, pages


def hooks():
    """docs/hooks/site.py, the MkDocs hooks that generate the reference."""
    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs" / "hooks" / "site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("MkDocs is not installed: pip install -e '.[docs]' (make test adds it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ,
                                            "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    site = tmp_path / "site"
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "parallel.schedule" in config and "generated: config-keys" not in config
    # the repository's files the pages link to are in the site, and the links lead there
    assert (site / "repo" / "bench" / "results" / "h100-2026-12-05-gpu-check" /
            "step-bfloat16.json").is_file()


def test_the_reference_names_every_config_key_and_every_command():
    from hpcpipe.cli import config_reference
    from hpcpipe.cli.main import build_parser

    site = hooks()
    keys = site.config_keys()
    assert all(f"`{key.name}`" in keys for key in config_reference.keys())
    commands = site.commands()
    for path, _ in site._parsers(build_parser()):
        assert f"`{' '.join(('python -m hpcpipe',) + path)}`" in commands, path
    assert "usage: python -m hpcpipe train" in commands


def test_the_architecture_page_draws_every_subpackage_from_its_docstring():
    site = hooks()
    page = site.architecture()
    for package in sorted(p.name for p in (ROOT / "hpcpipe").iterdir()
                          if (p / "__init__.py").exists()):
        assert f"## `hpcpipe.{package}`" in page
    assert "hpcpipe.cli" in page.split("```text")[1]  # the layers, from pyproject.toml
    formats = site.file_formats()
    assert "model-pp000.h5" in formats and "`grad_norm`" in formats
    assert "class GPT" not in site.python_api() and "### `hpcpipe.GPT`" in site.python_api()


def test_links_into_the_repository_are_checked_and_pointed_at_the_copies():
    site = hooks()
    assert site.repo_target("measurements/x.md", "../../bench/results/a.json", False) == \
        "bench/results/a.json"
    assert site.repo_target("guides/x.md", "../images/a.png", False) is None  # the site's
    assert site.repo_target("guides/x.md", "https://example.org/a", False) is None
    assert site.repo_target("repo/jobs/README.md", "../inputs/tiny.toml", True) == \
        "inputs/tiny.toml"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    prose = [line for line in lines if not line.startswith(("|", "RUN_DIR=", "<!--"))]
    assert max(map(len, prose)) <= 100


def test_the_install_page_names_every_extra():
    """Each optional extra of pyproject.toml has a row in install.md's table (`hf`, the
    Llama imports' extra, was once missing while llama.md told users to install it)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    page = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    rows = set(re.findall(r"^\| `([\w-]+)`(?:, `([\w-]+)`)? \|", page, re.M))
    listed = {name for row in rows for name in row if name}
    assert set(extras) <= listed, sorted(set(extras) - listed)


def table_faults(text: str) -> list[int]:
    """The lines (1-based) where a Markdown table starts without its `|---|` row under the
    header, outside code blocks: such a table shows as raw pipes."""
    faults, fenced, previous = [], False, ""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        starts = line.startswith("|") and not previous.startswith("|")
        if not fenced and starts and not re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$",
                                                  lines[n + 1] if n + 1 < len(lines) else ""):
            faults.append(n + 1)
        previous = line
    return faults


def test_every_table_has_its_separator_row():
    """formats.md once held a table's header alone, its rows never written, shown to
    readers as `| | whole command | the sampling loop |`."""
    found = {str(p.relative_to(ROOT)): table_faults(p.read_text()) for p in pages()}
    assert not {page: lines for page, lines in found.items() if lines}
    assert table_faults("text\n\n| a | b |\n\nmore\n") == [3]


def test_the_readme_links_every_page_a_reader_follows():
    """The README's Documentation list is the front door on GitHub, where the site's
    navigation is not: every getting-started page, guide, reference page and design page
    (research notes aside) is linked from it (the search guide once was not)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    wanted = [path for part in nav if isinstance(part, dict)
              for title, entries in part.items()
              if title in ("Getting started", "Guides", "Reference", "Design")
              for entry in entries for name, path in entry.items()
              if not name.startswith("Research notes")]
    readme = (ROOT / "README.md").read_text()
    assert len(wanted) > 20 and not [p for p in wanted if f"(docs/{p})" not in readme]


def test_the_first_run_lists_every_config_in_inputs():
    """first-run.md's table of configs names each file of inputs/ (the SmolLM2 fine-tune
    was once left out)."""
    page = (ROOT / "docs" / "getting-started" / "first-run.md").read_text()
    listed = set(re.findall(r"^\| `(inputs/[\w.-]+\.toml)` \|", page, re.M))
    assert listed == {f"inputs/{p.name}" for p in (ROOT / "inputs").glob("*.toml")}


def test_make_help_shows_the_makefile_header_whole():
    """`make help` is the Makefile's header comment; a fixed line range cut it short each
    time the header grew (it last stopped at `NP (...: the cores, at most 4),`)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    header = [line for line in lines[2:lines.index("", 2)] if line.startswith("#")]
    proc = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [re.sub(r"^# ?", "", line) for line in header]


def test_the_site_home_says_what_the_readme_says():
    """docs/index.md repeats the README's opening and Status table (its links one folder
    up): a figure updated in one and not the other would give the site and GitHub two."""
    def front(text: str) -> str:
        return text[text.index("\n") + 1:text.index("\n## ", text.index("## Status"))]

    readme = front((ROOT / "README.md").read_text())
    readme = readme.replace("](docs/", "](").replace("](bench/", "](../bench/")
    assert front((ROOT / "docs" / "index.md").read_text()) == readme
