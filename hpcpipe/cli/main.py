"""The command line: `python -m hpcpipe train|prepare|schedule|bench ...`.

Runs as a single process or as every rank of an MPI job (`mpiexec -n N python -m mpi4py
-m hpcpipe ...`). Every command ends through guard.run: errors that are the user's to fix
(a bad argument, config or file, a path it must not write) print one `error:` line from
one rank and exit with status 2; anything else is a bug, which keeps its traceback and,
under MPI, aborts every rank of the job whatever the launch line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hpcpipe import __version__
from hpcpipe.cli.guard import Job, alone, launch_rank, run
from hpcpipe.runs.lock import writing_into
from hpcpipe.util.arguments import Parser, number, path

EPILOG = """\
examples:
  python -m hpcpipe train inputs/tiny.toml
  python -m hpcpipe train inputs/tiny.toml --set train.steps=50 --set optim.lr=1e-3
  mpiexec -n 1 python -m mpi4py -m hpcpipe train inputs/tiny.toml --run-dir runs/try1
  python -m hpcpipe prepare --corpus stdlib --out data/stdlib.tokens.h5
  python -m hpcpipe schedule --kind zb-h1 --stages 4 --microbatches 8
  python -m hpcpipe train inputs/tiny.toml --resume       # continue from the latest checkpoint
  python -m hpcpipe ckpt ls runs/tiny
  python -m hpcpipe generate runs/tiny --prompt "def " --tokens 200
  python -m hpcpipe plot runs/tiny                 # loss, tokens/s, bubble: runs/tiny/plot.png
  srun python -m mpi4py -m hpcpipe doctor runs/   # MPI, GPUs, threads, run dir: before a job
  python -m hpcpipe config --list                  # every config key: type, default, meaning
  python -m hpcpipe bench step                     # speed: also bench pipeline|tp|comm|ckpt|generate

Each command has its own --help. Runs write to runs/<config name>/ (config.toml,
metrics.jsonl, summary.json)."""

TRAIN_EPILOG = """\
The config is a TOML file with sections [model], [train], [data], [parallel] and
[checkpoint]; every key has a default (see hpcpipe/config.py and inputs/tiny.toml).
Unknown keys, wrong types and impossible values stop the run before it starts, naming
the key.

The data file ([data] path, default data/stdlib.tokens.h5, for a file or folder
data/<name>-<hash of its path>.tokens.h5) is prepared from [data] corpus on first use:
"stdlib" (this Python's standard library sources, no download), a text file, or a
folder of text files. [data] path may also name llm.c .bin shards (a quoted glob) or a
nanoGPT train.bin, read as they are (GPT-2 tokens: set model.vocab_size = 50257 or
more).

Progress lines start with the wall-clock time, average loss, tokens/s, ms/step and
bubble over the steps since the last line, and end with the root's memory (GPU pool or
RSS, now and peak); MFU counts 6N + 12·L·C·T FLOPs per token against each GPU's nominal
peak (the CPU's: the matmul peak measured at start-up, said so). `python -m hpcpipe plot
RUN_DIR` draws the curves; train.tensorboard = true writes TensorBoard event files too.
Every key: `python -m hpcpipe config --list`.

Under MPI, start it as `mpiexec -n N python -m mpi4py -m hpcpipe train ...` with
N = dp × pp × tp (parallel.dp = "auto" takes N / (pp × tp)): `-m mpi4py` makes an
exception on one rank abort the whole job instead of leaving the others waiting.

Checkpoints go to RUN_DIR/checkpoints/ every [checkpoint] every steps, every
checkpoint.every_minutes (default 30) and at the end. SIGTERM or SIGUSR1 makes every rank
save one at the next step boundary and exit with status 75; the first Ctrl-C (SIGINT)
does the same and exits with 130, a second one stops at once. `--resume` (or
checkpoint.resume = "auto") continues, bitwise as if never stopped."""


def register_commands(sub, train, command: str | None = None):
    """Every command that is another subsystem's own registers its parser — or only the
    one `command` names, when it names one (plan's always: it gives train its --dry-run).
    Each is imported here, when its parser is built, so that a command line imports its
    own command's subsystem alone: `python -m hpcpipe schedule ...` never loads the
    numerical stack, and no rank of a training run loads bench's suites, the checkpoint
    converters or the plotting commands."""
    def wanted(name: str) -> bool:
        return command is None or command == name

    if wanted("schedule"):
        from hpcpipe.schedules.cli import register as register_schedule
        register_schedule(sub)
    if wanted("bench"):
        from hpcpipe.bench import register as register_bench
        register_bench(sub)
    if wanted("ckpt"):
        from hpcpipe.cli.ckpt import register as register_ckpt
        register_ckpt(sub)
    if wanted("generate"):
        from hpcpipe.cli.generate import register as register_generate
        register_generate(sub)
    if wanted("plot"):
        from hpcpipe.runs.plot import register as register_plot
        register_plot(sub)
    if wanted("doctor"):
        from hpcpipe.cli.doctor import register as register_doctor
        register_doctor(sub)
    if wanted("config"):
        from hpcpipe.cli.config_reference import register as register_config
        register_config(sub)
    from hpcpipe.cli.plan import register as register_plan
    register_plan(sub, train)  # also train's --dry-run


# Every command, in --help's order: a command line that names one of them first is
# parsed by that command's parser alone (build_parser).
COMMANDS = ("train", "prepare", "schedule", "bench", "ckpt", "generate", "plot", "doctor",
            "config", "plan")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or — `command` being one of COMMANDS,
    the one the command line names — that command's alone (register_commands)."""
    parser = Parser(
        prog="python -m hpcpipe",
        description="hpcpipe: pipeline-parallel GPT training over MPI, with hand-written "
                    "layers and zero-bubble schedules.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpcpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train", help="train a GPT from a TOML config",
        description="Train a GPT from a TOML config, printing progress, validation loss and "
                    "a summary; writes the run directory.",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", metavar="CONFIG", help="TOML config, e.g. inputs/tiny.toml")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set train.steps=50")
    train.add_argument("--run-dir", metavar="DIR",
                       type=path("name a folder, or leave --run-dir out for runs/<config "
                                 "file name>"),
                       help="where to write config.toml, metrics.jsonl and checkpoints/ "
                            "(default: runs/<config file name without .toml>)")
    train.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                       help="continue from the run directory's latest checkpoint, or from "
                            "the checkpoint folder given (which may belong to another run "
                            "and another dp × pp layout)")
    train.set_defaults(func=cmd_train)

    add_prepare(sub)

    register_commands(sub, train, command if command in COMMANDS else None)
    return parser


def add_prepare(sub):
    """The `prepare` command's parser."""
    prep = sub.add_parser(
        "prepare", help="tokenize a corpus, or convert llm.c / nanoGPT tokens, into an HDF5 "
                        "token file",
        description="Tokenize a corpus into an HDF5 file with train and val splits: bytes "
                    "(vocab 256, the default) or GPT-2's BPE (--tokenizer gpt2, vocab 50257; "
                    "needs tiktoken). `train` prepares byte tokens by itself on first use; run "
                    "this by hand to prepare once on a login node, for your own text, or to "
                    "convert llm.c shards or nanoGPT .bin files (--from; `train` also reads "
                    "those directly as data.path).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m hpcpipe prepare\n"
               "  python -m hpcpipe prepare --corpus ~/books/ --out data/books.tokens.h5\n"
               "  python -m hpcpipe prepare --tokenizer gpt2 --tokenizer-file "
               "r50k_base.tiktoken\n"
               "  python -m hpcpipe prepare --corpus notes/ --tokenizer hf --tokenizer-file "
               "runs/smollm2/tokenizer.json\n"
               "  python -m hpcpipe prepare --from 'fineweb10B/fineweb_train_*.bin' "
               "--out data/fineweb.tokens.h5\n\n"
               "GPT-2's BPE ranks: --tokenizer-file FILE, or $HPCPIPE_TOKENIZER_FILE, else "
               "tiktoken's cache or download;\nthe file is "
               "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken")
    prep.add_argument("--corpus", default=None,
                      type=path('name a file or folder, or leave --corpus out for "stdlib"'),
                      help='"stdlib" (default: the Python standard library sources), a text '
                           "file, or a folder of text files")
    prep.add_argument("--from", dest="source", metavar="TOKENS",
                      type=path("name the token files to convert"),
                      help="convert token files instead: an llm.c shard or a glob of them "
                           "(quoted), or a nanoGPT train.bin (val files found by name)")
    prep.add_argument("--tokenizer", choices=("bytes", "gpt2", "hf"), default=None,
                      help="bytes (default), gpt2 (GPT-2's BPE through tiktoken) or hf (a "
                           "Hugging Face tokenizer.json through tokenizers, e.g. an "
                           "imported Llama's: --tokenizer-file CHECKPOINT/tokenizer.json)")
    prep.add_argument("--tokenizer-file", metavar="FILE", type=path("name the file"),
                      help="gpt2: GPT-2's BPE ranks in tiktoken's format "
                           "(r50k_base.tiktoken), for machines without a network; hf: the "
                           "tokenizer.json")
    prep.add_argument("--out", type=path("name a file, or leave --out out for the "
                                         "default"),
                      help="output HDF5 file (default: data/stdlib.tokens.h5, for a file "
                           "or folder data/<name>-<hash of its path>.tokens.h5; another "
                           "tokenizer than bytes adds its name, data/stdlib-gpt2.tokens.h5; "
                           "never .bin, which hpcpipe reads as llm.c / nanoGPT tokens)")
    prep.add_argument("--val-fraction", type=number(0, 1), default=0.05,
                      help="share of tokens held out for validation (default 0.05)")
    prep.add_argument("--force", action="store_true", help="overwrite an existing file")
    prep.set_defaults(func=cmd_prepare)


def cmd_train(args) -> int:
    from hpcpipe import config
    from hpcpipe.train.preemption import PreemptionWatch, release_held_signals
    from hpcpipe.train.trainer import Preempted, train

    if not args.dry_run:
        _refuse_plan_options(args)
    comm = args.job.world()
    if args.dry_run:  # every rank plans (the same numbers); one prints and writes
        release_held_signals()  # (no handlers: a signal ends the plan as it would any command)
        from hpcpipe.cli.plan import claim_on_root
        from hpcpipe.cli.plan import run as run_plan

        claim_on_root(comm, args.json, args.force)
        return run_plan(args.config, args.overrides, args.json if comm.rank == 0 else None,
                        args.ranks_per_node or comm.size,
                        out=print if comm.rank == 0 else (lambda text: None), force=args.force,
                        world=comm.size, gpu_memory=args.gpu_memory)
    # Signals are honoured from here on: one that arrives while the config loads, the data
    # is prepared or the model is built stops the run at its first agreement point.
    watch = PreemptionWatch(comm)
    try:
        cfg = config.load(args.config, args.overrides)
        name = os.path.splitext(os.path.basename(args.config))[0] or "run"
        run_dir = args.run_dir or os.path.join("runs", name)
        train(cfg, run_dir, comm, out=lambda msg: print(msg, flush=True), resume=args.resume,
              watch=watch, releases=args.job.agreed_releases)
    except Preempted as stopped:
        # Every rank arrives here together and ends MPI (as after an agreed user error,
        # within the same bound): under `python -m mpi4py` a non-zero exit calls
        # MPI_Abort, which the launcher reports as an aborted job rather than status 75,
        # and the job script could not tell a preemption from a crash.
        watch.close()
        args.job.finish()
        return stopped.status
    finally:
        watch.close()
    return 0


def _refuse_plan_options(args):
    """--dry-run's options do nothing in a real run: refused, never silently ignored (a
    plan.json the user expects would not be written)."""
    from hpcpipe.util.errors import HpcpipeError

    for flag, given in (("--json", args.json is not None), ("--force", args.force),
                        ("--ranks-per-node", args.ranks_per_node != 0),
                        ("--gpu-memory", args.gpu_memory is not None)):
        if given:
            raise HpcpipeError(f"{flag} is an option of --dry-run (the memory plan); give "
                               f"--dry-run too, or leave {flag} out")


def cmd_prepare(args) -> int:
    from hpcpipe.data.corpora import (
        convert,
        converted_path,
        default_token_path,
        prepare,
    )
    from hpcpipe.data.tokenizer import load
    from hpcpipe.data.tokens import check_hdf5_name
    from hpcpipe.util.errors import HpcpipeError
    from hpcpipe.util.files import claim_file

    if args.source is not None:
        if args.corpus is not None or args.tokenizer is not None:
            raise HpcpipeError("--from converts tokens as they are: give it without --corpus "
                               "and --tokenizer")
        out = args.out or converted_path(args.source)
        check_hdf5_name(out)  # before claiming, which may create its folder
        claim_file(out, args.force, "--out", make_folder=True)
        convert(args.source, out, replace=args.force)
        return 0
    corpus, name = args.corpus or "stdlib", args.tokenizer or "bytes"
    tokenizer = load(name, args.tokenizer_file)  # before claiming: a missing library
    out = args.out or default_token_path(corpus, tokenizer.tag)
    check_hdf5_name(out)
    claim_file(out, args.force, "--out", make_folder=True)
    prepare(corpus, out, args.val_fraction, tokenizer=tokenizer, replace=args.force)
    return 0


def main(argv=None) -> int:
    # A file-size limit (ulimit -f) must end a write with EFBIG, one error line, like a full
    # disk — not kill the process with SIGXFSZ halfway through a checkpoint.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    job = Job()

    def command() -> int:
        words = sys.argv[1:] if argv is None else argv
        parser = build_parser(words[0] if words else None)
        args = parser.parse_args(words)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        args.job = job
        if args.command in ONE_PROCESS:  # before anything is claimed or written
            alone(" ".join(filter(None, (args.command, getattr(args, "ckpt_command", None)))))
        with writing_into(outputs_of(args) if launch_rank() == 0 else [],
                          f"`{args.command}`"):
            return args.func(args)

    return run(command, job)


# The commands that work in one process (bench's suites say so each: some run on many).
ONE_PROCESS = ("prepare", "schedule", "ckpt", "generate", "plot", "config", "plan")

# The options through which a command names a file or folder it writes (train's own run
# directory is the run's: train locks it itself, for as long as it runs).
OUTPUT_OPTIONS = ("out", "json", "png", "svg", "save_csv", "pareto", "dir")


def outputs_of(args) -> list[str]:
    """Every path the parsed command will write: its output options' values, and what it
    writes by default (a command's `implied_outputs`, e.g. plot's RUN_DIR/plot.png)."""
    named = [value for option in OUTPUT_OPTIONS
             if isinstance(value := getattr(args, option, None), str)]
    implied = getattr(args, "implied_outputs", None)
    return named + (list(implied(args)) if implied else [])

