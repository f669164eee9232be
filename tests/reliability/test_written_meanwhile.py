"""An output a user names without --force is never replaced by this command when another
wrote it after this one's claim (two runs told to write one new file both find the name
free): the later to finish is one error line, the earlier's file kept whole, no temporary
left. As prepare's test, the other run is played in this process between the claim and
the write, by wrapping a step of the command's work: no timing."""

import json
import os

import numpy as np
import pytest
from harness.hostile import TINY, ends_with_one_error, small_config

from hpcpipe import GPT
from hpcpipe import checkpoint as ckpt
from hpcpipe.__main__ import main


def meanwhile(monkeypatch, module, name, *paths):
    """`module.name` (a step of the work, after the claim) first writes each of `paths`
    as another command would: "theirs"."""
    original = getattr(module, name)

    def the_other_command_finishes_first(*args, **kwargs):
        monkeypatch.setattr(module, name, original)  # once
        for path in paths:
            with open(path, "w") as f:
                f.write("theirs")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, the_other_command_finishes_first)


def refused_and_kept(capsys, argv, path, folder):
    line = ends_with_one_error(capsys, argv)
    assert line.endswith(f" {path}: another command wrote it while this one ran; it is "
                         f"left as it is (pass --force to replace it)"), line
    assert open(path).read() == "theirs"
    assert not [name for name in os.listdir(folder) if name.startswith(".")]


@pytest.mark.parametrize("command", [["plan"], ["train", "--dry-run"]])
def test_the_plan_json(capsys, monkeypatch, tmp_path, command):
    from hpcpipe.cli import plan

    out = tmp_path / "plan.json"
    meanwhile(monkeypatch, plan, "wrapped", out)
    refused_and_kept(capsys, [command[0], TINY, *command[1:], "--json", str(out)], out,
                     tmp_path)


@pytest.mark.parametrize("flag, name", [("--svg", "s.svg"), ("--png", "s.png"),
                                        ("--save-csv", "s.csv")])
def test_the_schedule_files(capsys, monkeypatch, tmp_path, flag, name):
    if flag == "--png":
        pytest.importorskip("matplotlib")
    from hpcpipe.schedules import cli

    out = tmp_path / name
    meanwhile(monkeypatch, cli, "simulate", out)
    refused_and_kept(capsys, ["schedule", "--kind", "1f1b", "-p", "2", "-m", "4", flag,
                              str(out)], out, tmp_path)


def test_a_bench_json(capsys, monkeypatch, tmp_path):
    from hpcpipe.bench import generate

    out = tmp_path / "bench.json"
    meanwhile(monkeypatch, generate, "tokens_per_second", out)
    refused_and_kept(capsys, ["bench", "generate", "--set", "model.n_layer=1", "--tokens",
                              "2", "--repeats", "1", "--json", str(out)], out, tmp_path)


def test_the_plot(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from hpcpipe.runs import plot

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[parallel]\nschedule = "1f1b"\n')
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 5.0, "tokens_per_s": 1e3, "step_s": 0.1}) + "\n" for s in (1, 2)))
    out = tmp_path / "p.png"
    meanwhile(monkeypatch, plot, "pyplot", out)
    refused_and_kept(capsys, ["plot", str(run), "--out", str(out)], out, tmp_path)


def _checkpoint(tmp_path) -> str:
    cfg = small_config("model.n_layer=1", "model.vocab_size=16")
    path = str(tmp_path / "ckpt")
    ckpt.write_weights(path, ckpt.Origin(cfg.to_toml(), cfg.model, "float32"),
                       {n: np.asarray(v) for n, v in GPT(cfg.model).params.items()})
    return path


@pytest.mark.parametrize("kind", ["h5", "safetensors", "shards", "hf"])
def test_an_export_is_all_there_or_none_of_it(capsys, monkeypatch, tmp_path, kind):
    """Of an export's files (the shards, their index, config.json), the one another
    command wrote meanwhile is kept, and none of this export's is left beside it."""
    from hpcpipe.cli import ckpt as cli

    source = _checkpoint(tmp_path)
    folder = tmp_path / "out"
    name = {"h5": "m.h5", "hf": "model.safetensors"}.get(kind, "model.safetensors")
    out = folder / name
    argv = ["ckpt", "export", source, "--out", str(folder if kind == "hf" else out)]
    argv += {"shards": ["--max-shard-size", "2KB"], "hf": ["--format", "hf"]}.get(kind, [])
    theirs = folder / ("config.json" if kind != "h5" else name)  # (written last, or alone)
    folder.mkdir()
    meanwhile(monkeypatch, cli.ckpt, "read_weights", theirs)
    refused_and_kept(capsys, argv, theirs, folder)
    assert os.listdir(folder) == [theirs.name]


@pytest.mark.parametrize("kind", ["a file", "a checkpoint"])
def test_an_imported_checkpoint(capsys, monkeypatch, tmp_path, kind):
    """`ckpt import-hf --out` claims a new folder, writes a temporary one beside it and
    renames that onto it: where another command filled the folder meanwhile (with
    anything, or its own import), that folder is kept and this temporary one removed."""
    from hpcpipe.checkpoint import weights

    hf = tmp_path / "hf"
    assert main(["ckpt", "export", _checkpoint(tmp_path), "--format", "hf", "--out",
                 str(hf)]) in (0, None)
    folder = tmp_path / "imports"
    folder.mkdir()
    out = folder / "gpt"
    original = weights._write_weights_into

    def the_other_command_finishes_first(*args, **kwargs):
        monkeypatch.setattr(weights, "_write_weights_into", original)  # once
        if kind == "a file":
            out.mkdir()
            (out / "theirs").write_text("theirs")
        else:
            main(["ckpt", "import-hf", str(hf), "--out", str(out)])
        return original(*args, **kwargs)

    monkeypatch.setattr(weights, "_write_weights_into", the_other_command_finishes_first)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["ckpt", "import-hf", str(hf), "--out", str(out)])
    assert line.endswith(f" {out}: another command wrote it while this one ran; it is left "
                         f"as it is (pass --force to replace it)"), line
    assert before is None
    assert os.listdir(folder) == ["gpt"]
    assert (kind == "a file") == ((out / "theirs").exists())
    if kind == "a checkpoint":
        assert not ckpt.verify(str(out))
