"""MkDocs hooks of hpcpipe's documentation site (mkdocs.yml).

1. The reference cannot drift from the code: a page holds a marker `<!-- generated: NAME -->`
   and the site is built with what the code says there and then — every config key from the
   config dataclasses (`hpcpipe.cli.config_reference`), every command's `--help` from the
   parser itself, the file formats from the docstrings of the modules that read and write
   them, the Python API from its docstrings, the architecture from the subpackages' own
   docstrings and import-linter's contract in pyproject.toml. A config key, a command or a
   module that another branch adds shows up without anyone editing a page.
2. Pages link into the repository as they would on GitHub (`../../bench/results/x.json`
   from docs/measurements/): each such file is copied into the site under `repo/` and the
   link pointed there, so that the site and the repository read alike; a link to a file
   the repository does not hold fails the strict build, as a broken page link does.

Nothing here is imported by hpcpipe; tests/docs/ imports it to check what it generates.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import logging
import os
import posixpath
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # this checkout's hpcpipe, whatever the venv installed
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("mkdocs.plugins.hpcpipe")
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)
# A Markdown link or image target: ](target) or ](target "title"), not a URL or an anchor.
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\))")
REPO = "repo"  # where the repository's files go in the site


# -- generated sections ---------------------------------------------------------------------

def config_keys() -> str:
    """Every config key, per section: type, default and meaning, from the dataclasses."""
    from hpcpipe.cli import config_reference as reference

    out, section = [], None
    for key in reference.keys():
        name = key.name.split(".")[0]
        if name != section:
            section = name
            out += ["", f"## `[{section}]`", "", "| key | type | default | meaning |",
                    "|---|---|---|---|"]
        meaning = key.meaning.replace("|", "\\|")
        out.append(f"| `{key.name}` | {key.type} | `{key.default}` | {meaning} |")
    return "\n".join(out).strip() + "\n"


def _parsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def commands() -> str:
    """Every command's and subcommand's `--help`, as the terminal prints it (100 wide)."""
    from hpcpipe.cli.main import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width
    try:
        out = []
        for path, parser in _parsers(build_parser()):
            words = " ".join(("python -m hpcpipe",) + path)
            level = "#" * min(2 + len(path), 4) if path else "##"
            out += [f"{level} `{words}`", "", "```text", parser.format_help().rstrip(), "```",
                    ""]
        return "\n".join(out)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def docstring_markdown(text: str) -> str:
    """A module docstring as Markdown: its prose as it is, its indented blocks (layouts,
    examples) as code."""
    out, block = [], []

    def flush():
        if block:
            while block and not block[-1].strip():
                block.pop()
            out.extend(["```text", *block, "```"])
            block.clear()
    for line in text.splitlines():
        if line.startswith("    ") or (block and not line.strip()):
            block.append(line[4:])
            continue
        flush()
        out.append(line)
    flush()
    return "\n".join(out)


def module_doc(name: str) -> str:
    """The docstring of hpcpipe's module `name`, read from its source (not imported)."""
    path = ROOT / "hpcpipe" / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / "hpcpipe" / name.replace(".", "/") / "__init__.py"
    return ast.get_docstring(ast.parse(path.read_text())) or ""


# The file formats hpcpipe reads and writes, each described by the module that owns it.
FORMATS = [
    ("The run directory", "runs.rundir"),
    ("metrics.jsonl", None),
    ("summary.json: a run in pieces", "runs.pieces"),
    ("trace.json and the timeline pictures", "runs.trace"),
    ("Checkpoints", "checkpoint"),
    ("manifest.json", "checkpoint.manifest"),
    ("The state files and their records", "checkpoint.parts"),
    ("Local SGD's files", "parallel.outer_state"),
    ("PowerSGD's files", "parallel.powersgd_state"),
    ("PipeDream-2BW's second weight version", "train.stream_state"),
    ("Asynchronous data parallelism's files", "train.async_state"),
    ("Synchronous elastic averaging's files", "parallel.asyncdp.elastic_state"),
    ("The record of an asynchronous run", "parallel.asyncdp.record"),
    ("Token files: HDF5, llm.c, nanoGPT", "data.tokens"),
    ("Preparing token files", "data.corpora"),
    ("safetensors", "checkpoint.safetensors"),
    ("Hugging Face GPT-2 folders", "checkpoint.huggingface"),
    ("Schedule CSVs (PyTorch's pipelining format)", "schedules.torch_csv"),
]


def metrics_fields() -> str:
    from hpcpipe.runs import rundir

    return ("One JSON object per line; every line has an integer `step`. Read back "
            "(on resume, by `plot`) only as these types, checked line by line "
            "(`hpcpipe/runs/rundir.py`):\n\n"
            "| kind | fields |\n|---|---|\n"
            f"| numbers | {', '.join(f'`{f}`' for f in rundir._NUMBERS)} |\n"
            f"| one number per rank | {', '.join(f'`{f}`' for f in rundir._PER_RANK)} |\n"
            f"| flags | {', '.join(f'`{f}`' for f in rundir._FLAGS)} |\n"
            f"\nA line is at most {rundir.MAX_LINE // 2**20} MiB. Other fields a run writes "
            "(the root's `memory_bytes`, `memory_peak_bytes`, ...) are kept as written.")


def file_formats() -> str:
    from hpcpipe.checkpoint import manifest

    out = []
    for title, module in FORMATS:
        out += [f"## {title}", ""]
        if module is None:
            out.append(metrics_fields())
        else:
            out += [f"*From `hpcpipe/{module.replace('.', '/')}`:*", "",
                    docstring_markdown(module_doc(module))]
        if module == "checkpoint.manifest":
            schema = manifest.SCHEMA
            fields = ", ".join(f"`{k}`" for k in schema.required)
            optional = ", ".join(f"`{k}`" for k in schema.optional) or "none"
            out += ["", f"Its fields (format version {manifest.FORMAT_VERSION}): {fields}; "
                        f"optional: {optional}."]
        out.append("")
    return "\n".join(out)


def _api_entry(owner: str, name: str, obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    try:
        signature = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        signature = name
    out = [f"### `{owner}.{name}`", "", "```python", signature, "```", "", doc, ""]
    if inspect.isclass(obj) and not dataclasses.is_dataclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not callable(member) or not inspect.getdoc(member):
                continue
            try:
                sig = f"{attr}{inspect.signature(member)}"
            except (TypeError, ValueError):
                sig = attr
            out += [f"- `{sig}`: {inspect.getdoc(member).splitlines()[0]}"]
        out.append("")
    return out


def python_api() -> str:
    """The public names of `hpcpipe` (the model) and `hpcpipe.schedules` (schedules as
    data), each with its signature and docstring."""
    out = []
    for package in ("hpcpipe", "hpcpipe.schedules"):
        module = importlib.import_module(package)
        out += [f"## `{package}`", "", docstring_markdown(inspect.getdoc(module) or ""), ""]
        for name in module.__all__:
            obj = getattr(module, name)
            if name.startswith("__") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            out += _api_entry(package, name, obj)
    return "\n".join(out)


def architecture() -> str:
    """The layers as import-linter holds them, then each subpackage's docstring and its
    modules' first lines."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    out = ["## The layers", "",
           "Each layer imports only the layers below it (`|`: neither imports the other); "
           "`tests/test_architecture.py` holds the package to it with import-linter:", "",
           "```text"]
    for contract in contracts["contracts"]:
        if contract["type"] == "layers":
            out += [f"  {layer}" for layer in contract["layers"]]
    out += ["```", ""]
    for contract in contracts["contracts"]:
        if contract["type"] == "forbidden":
            out.append(f"- {contract['name']}: no import of "
                       f"{', '.join(contract['forbidden_modules'])} from "
                       f"{', '.join(contract['source_modules'])}.")
    out.append("")
    package = ROOT / "hpcpipe"
    for folder in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
        out += [f"## `hpcpipe.{folder.name}`", "",
                docstring_markdown(module_doc(folder.name)), "", "| module | what it is |",
                "|---|---|"]
        for path in sorted(folder.rglob("*.py")):
            if path.name == "__init__.py" and path.parent == folder:
                continue
            rel = path.relative_to(package).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            first = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
            first = " ".join(first.split()).replace("|", "\\|")
            out.append(f"| `{name}` | {first} |")
        out.append("")
    return "\n".join(out)


GENERATORS = {"config-keys": config_keys, "commands": commands, "file-formats": file_formats,
              "python-api": python_api, "architecture": architecture}


def expand(markdown: str) -> str:
    """A page with each `<!-- generated: NAME -->` marker replaced by what the code says."""
    def one(match):
        name = match.group(1)
        if name not in GENERATORS:
            log.warning(f"unknown generated section '{name}' (known: {', '.join(GENERATORS)})")
            return match.group(0)
        return GENERATORS[name]()
    return MARKER.sub(one, markdown)


# -- links into the repository ----------------------------------------------------------------

def repo_target(page_uri: str, link: str, in_repo: bool) -> str | None:
    """The repository path a page's relative link points to when it leaves docs/ (or, for a
    page copied from the repository, any link), else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("/"):
        return None
    if in_repo:  # repo/<path>: links are relative to <path>'s folder in the repository
        base = posixpath.dirname(page_uri[len(REPO) + 1:])
    else:
        base = posixpath.join("docs", posixpath.dirname(page_uri))
    target = posixpath.normpath(posixpath.join(base, link))
    if not in_repo and target.startswith("docs/"):
        return None  # a page or picture of the site: MkDocs checks it
    return target


def _links(text: str):
    for match in LINK.finditer(text):
        yield match.group(2)


def on_files(files, config):
    """Copy the repository files the pages link to into the site, under repo/ (and what the
    copied Markdown files link to in turn)."""
    from mkdocs.structure.files import File, InclusionLevel

    pending = [(f.src_uri, Path(f.abs_src_path).read_text(), False)
               for f in files.documentation_pages() if f.abs_src_path]
    seen = set()
    while pending:
        uri, text, in_repo = pending.pop()
        for link in _links(text):
            target = repo_target(uri, link, in_repo)
            if target is None or target in seen:
                continue
            seen.add(target)
            source = ROOT / target
            if target.startswith("..") or not source.is_file():
                continue  # reported by on_page_markdown, with the page that links it
            copied = File.generated(config, f"{REPO}/{target}", abs_src_path=str(source))
            if target.endswith(".md"):
                copied.inclusion = InclusionLevel.NOT_IN_NAV  # a page, reached by its link
                pending.append((copied.src_uri, source.read_text(), True))
            files.append(copied)
    return files


def on_page_markdown(markdown, page, config, files):
    """Expand the generated sections; point links into the repository at the copies."""
    uri = page.file.src_uri
    in_repo = uri.startswith(REPO + "/")
    if not in_repo:
        markdown = expand(markdown)

    def point(match):
        link = match.group(2)
        target = repo_target(uri, link, in_repo)
        if target is None:
            return match.group(0)
        if target.startswith("..") or not (ROOT / target).is_file():
            log.warning(f"Doc file '{uri}' links to '{link}', which is not a file of the "
                        f"repository ({target})")
            return match.group(0)
        copy = f"{REPO}/{target}"
        relative = posixpath.relpath(copy, posixpath.dirname(uri) or ".")
        return match.group(1) + relative + match.group(3)
    return LINK.sub(point, markdown)
