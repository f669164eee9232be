"""The command blocks of the README and of docs/, and how each is run by the tests.

A fenced block whose language is bash, sh, shell, console (its `$ ` lines) or python runs
as written, unless the line just before its fence is one of

    <!-- docs-test: skip REASON -->        never runs; the reason is required
    <!-- docs-test: check COMMAND -->      COMMAND (a bash line) runs instead: the block
                                           checked as far as a CPU can (--help, --dry-run,
                                           plan, bash -n on a job script)
    <!-- docs-test: env KEY=VALUE ... -->  runs with these variables set (to scale it down)

A console block's other lines are what it shows its commands printing: each must match a
printed line (`...` or `…` for any text, a decimal for any decimal). Other blocks
(text, toml, a block without a language) are shown, never run.

A page's blocks run in order in one working folder (a later block reads what an earlier one
trained), so a page is the unit that runs: in `make test`'s pass of one-process tests,
unless one of its blocks starts processes across the cores (`launches`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash", "sh", "shell", "console", "python"}
DIRECTIVE = re.compile(r"^<!-- docs-test: (\S+)(?: (.*?))? -->$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
KINDS = ("skip", "check", "env")
# What starts processes across the cores (conftest.py's `serial`): an MPI launcher, Slurm,
# make (its targets run mpiexec and compilers), the test suite (its MPI tests), a script of
# bench/ or jobs/ run rather than checked (`bash -n`), a command sent to the background.
LAUNCHERS = {"mpiexec", "mpirun", "srun", "sbatch", "salloc", "make", "pytest"}
SCRIPT = re.compile(r"(\./)?(bench|jobs)/\S+")


class DirectiveError(ValueError):
    """A `docs-test` comment that is not one of the three, or lacks what it needs."""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: "docs/guides/schedules.md"
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    kind: str | None = None  # "skip", "check", "env" or None (runs as written)
    argument: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def command(self) -> str:
        """The bash this block runs (a python block's is given separately)."""
        if self.kind == "check":
            return self.argument
        if self.lang == "console":
            return console_commands(self.code)
        return self.code

    def launches(self) -> bool:
        """Whether what this block runs starts processes across the cores (LAUNCHERS), read
        from its words: in a comment or a string (`python -c "..."`) a word starts nothing."""
        if self.kind == "skip":
            return False
        code = self.code if self.lang == "python" and self.kind != "check" else self.command()
        lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True  # a path is one word, `&&` and `|` words of their own
        try:
            words = list(lexer)
        except ValueError:  # quotes that do not close: judged to launch, the safe side
            return True
        return any(_launches(word, before, words) for before, word in zip([""] + words, words))

    def env(self) -> dict[str, str]:
        if self.kind != "env":
            return {}
        pairs = [word.split("=", 1) for word in shlex.split(self.argument)]
        return dict(pairs)


def _launches(word: str, before: str, words: list[str]) -> bool:
    if word == "&":  # `&&`, `2>&1` and `&>` are words of their own
        return True
    if word == "pytest":  # a collection starts no test
        return "--collect-only" not in words
    if SCRIPT.fullmatch(word):  # `bash -n jobs/train.sbatch`, `for s in jobs/*.sbatch` read it
        return before not in ("-n", "in")
    return word.rsplit("/", 1)[-1] in LAUNCHERS


def console_lines(code: str) -> tuple[list[str], list[str]]:
    """A console block split into its commands (the `$ ` lines and their continuations)
    and the lines it shows them printing (the rest)."""
    commands, shown, going_on = [], [], False
    for line in code.splitlines():
        if line.startswith("$ ") or going_on:
            command = line[2:] if line.startswith("$ ") and not going_on else line
            commands.append(command)
            going_on = command.rstrip().endswith("\\")
        elif line.strip():
            shown.append(line)
    return commands, shown


def console_commands(code: str) -> str:
    """The commands of a console block: its `$ ` lines and their continuations."""
    return "\n".join(console_lines(code)[0])


def shown_pattern(line: str) -> re.Pattern:
    """A line a console block shows as printed, as a pattern for the line printed: `...` or
    `…` stands for any text (a line shortened), a decimal for any decimal (times, rates)."""
    parts = re.split(r"(\s*(?:\.\.\.|…)\s*|\d+\.\d+)", line.strip())
    return re.compile("".join(".*" if part.strip() in ("...", "…") else
                              r"\d+\.\d+" if re.fullmatch(r"\d+\.\d+", part) else
                              re.escape(part) for part in parts))


def unshown(code: str, printed: str) -> list[str]:
    """The lines a console block shows that its commands did not print: each shown line
    must match a printed line (in any order: ranks' lines interleave as they will; a line
    of only `...` or `…` stands for lines left out)."""
    lines = [line.strip() for line in printed.splitlines()]
    return [line for line in console_lines(code)[1] if line.strip() not in ("...", "…") and
            not any(shown_pattern(line).fullmatch(out) for out in lines)]


def pages() -> list[Path]:
    """The README and every page of the site's sources (docs/hooks/ is code)."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(p for p in docs.rglob("*.md")
                                        if "hooks" not in p.relative_to(docs).parts)]


def parse(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of a page with a runnable language, and its directive; raises
    DirectiveError for a directive that is malformed or does not stand before a block."""
    page = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    blocks, n = [], 0
    while n < len(lines):
        match = DIRECTIVE.match(lines[n].strip())
        if match and not (n + 1 < len(lines) and FENCE.match(lines[n + 1])):
            raise DirectiveError(f"{page}:{n + 1}: a docs-test comment must stand on the line "
                                 f"just before a block's opening fence")
        fence = FENCE.match(lines[n])
        if not fence:
            n += 1
            continue
        marker, lang, start = fence.group(1), fence.group(2).lower(), n
        end = next((i for i in range(n + 1, len(lines))
                    if lines[i].strip().startswith(marker) and
                    lines[i].strip() == marker[0] * len(lines[i].strip())), None)
        if end is None:
            raise DirectiveError(f"{page}:{n + 1}: a block that never closes")
        kind, argument = directive(lines[start - 1] if start else "", page, start)
        if lang in RUNNABLE:
            blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]),
                                kind, argument))
        elif kind is not None:
            raise DirectiveError(f"{page}:{start + 1}: a docs-test comment before a "
                                 f"```{lang or '(no language)'} block, which never runs")
        n = end + 1
    return blocks


def directive(line: str, page: str, at: int) -> tuple[str | None, str]:
    match = DIRECTIVE.match(line.strip())
    if match is None:
        return None, ""
    kind, argument = match.group(1), (match.group(2) or "").strip()
    if kind not in KINDS:
        raise DirectiveError(f"{page}:{at}: docs-test {kind}: one of {', '.join(KINDS)}")
    if not argument:
        what = {"skip": "a reason", "check": "a command", "env": "KEY=VALUE pairs"}[kind]
        raise DirectiveError(f"{page}:{at}: docs-test {kind} needs {what}")
    if kind == "env" and not all("=" in w for w in shlex.split(argument)):
        raise DirectiveError(f"{page}:{at}: docs-test env takes KEY=VALUE pairs")
    return kind, argument


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in parse(path)]
