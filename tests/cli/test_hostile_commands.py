"""Hostile and careless command lines for plan, train --dry-run, schedule, bench, doctor and
generate: each ends in one `error:` line and status 2 before any work, and never replaces a
file the user did not ask to replace (--force)."""

import argparse
import json
import os
import shutil

import pytest
from harness.hostile import TINY, ends_with_one_error, snapshot

from hpcpipe.__main__ import main
from hpcpipe.cli.generate import prompt_ids
from hpcpipe.device import budget
from hpcpipe.util.errors import HpcpipeError

SMALL_PIPE = ["--schedules", "1f1b", "--layers", "1", "--embd", "16", "--heads", "1",
              "--block", "8", "--steps", "1", "--rounds", "1"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny.toml"
    shutil.copy(TINY, path)
    return path


# -- plan --json, train --dry-run --json ----------------------------------------------------

@pytest.mark.parametrize("command", [["plan"], ["train", "--dry-run"]])
def test_the_plan_never_replaces_a_file_without_force(capsys, config, tmp_path, command):
    mine = tmp_path / "mine.json"
    mine.write_text("mine")
    before = config.read_bytes()
    for target in (mine, config):  # the config itself too
        line = ends_with_one_error(capsys, [command[0], str(config), *command[1:],
                                            "--json", str(target)])
        assert "exists already; pass --force" in line
    assert mine.read_text() == "mine" and config.read_bytes() == before
    assert main([command[0], str(config), *command[1:], "--json", str(mine), "--force"]) == 0
    assert json.loads(mine.read_text())["ranks"]
    assert sorted(os.listdir(tmp_path)) == ["mine.json", "tiny.toml"]  # no temporary left


def test_the_plan_refuses_an_empty_json_path(capsys, config):
    line = ends_with_one_error(capsys, ["plan", str(config), "--json", ""])
    assert "--json: an empty path" in line


def test_dry_run_options_without_dry_run_are_refused(capsys, tmp_path):
    # (a config that does not exist: without the check, the refusal would be about it)
    for extra in (["--json", str(tmp_path / "plan.json")], ["--ranks-per-node", "2"],
                  ["--force"], ["--gpu-memory", "80"]):
        line = ends_with_one_error(capsys, ["train", str(tmp_path / "none.toml"), *extra])
        assert f"{extra[0]} is an option of --dry-run" in line
    assert not (tmp_path / "plan.json").exists()


# -- schedule's outputs ------------------------------------------------------------------------

SCHEDULE = ["schedule", "--kind", "1f1b", "-p", "2", "-m", "4"]


def test_schedule_outputs_never_share_a_file(capsys, tmp_path):
    both = str(tmp_path / "out")
    line = ends_with_one_error(capsys, [*SCHEDULE, "--svg", both, "--save-csv", both])
    assert "--svg and --save-csv name the same file" in line
    assert not os.path.exists(both)


@pytest.mark.parametrize("flag", ["--svg", "--png", "--save-csv"])
def test_schedule_refuses_an_empty_output_path(capsys, flag):
    assert "an empty path" in ends_with_one_error(capsys, [*SCHEDULE, flag, ""])


def test_a_picture_in_a_format_matplotlib_cannot_write_is_refused_first(capsys, tmp_path):
    line = ends_with_one_error(capsys, [*SCHEDULE, "--png", str(tmp_path / "out.txt")])
    assert ".txt is not a picture format" in line
    assert os.listdir(tmp_path) == []
    assert main([*SCHEDULE, "--png", str(tmp_path / "out.PDF")]) == 0  # any case


# -- bench ---------------------------------------------------------------------------------------

def test_bench_pipeline_pareto_is_checked_before_any_work(capsys, tmp_path):
    png = tmp_path / "front.png"
    line = ends_with_one_error(capsys, ["bench", "pipeline", *SMALL_PIPE, "--pareto", str(png)])
    assert "--pareto draws the --memory suite's front" in line  # never silently skipped
    line = ends_with_one_error(capsys, ["bench", "pipeline", *SMALL_PIPE, "--memory",
                                        "--pareto", str(tmp_path / "front.txt")])
    assert ".txt is not a picture format" in line
    png.write_text("mine")
    line = ends_with_one_error(capsys, ["bench", "pipeline", *SMALL_PIPE, "--memory",
                                        "--pareto", str(png)])
    assert "exists already" in line and png.read_text() == "mine"


@pytest.mark.parametrize("argv", [
    ["bench", "pipeline", "--schedules", "1f1b", "--layers", "1", "--embd", "1", "--heads",
     "1", "--block", "256", "--micro-batch-size", "4096", "--microbatches", "65536"],
    ["bench", "tp", "--config", "tiny", "--micro-batch-size", "4096", "--microbatches",
     "65536"]])
def test_a_batch_of_terabytes_is_refused_before_it_is_drawn(capsys, argv):
    line = ends_with_one_error(capsys, argv)
    assert "268,435,456 sequences of" in line and "tokens a step needs at least" in line


def test_bench_step_and_generate_check_the_model_memory_first(capsys, monkeypatch):
    monkeypatch.setattr(budget, "host_available", lambda: 1 << 20)
    line = ends_with_one_error(capsys, ["bench", "step", "--configs", "tiny", "--no-torch",
                                        "--warmup", "0", "--repeats", "1"])
    assert "bench step: tiny with --batch 16" in line and "needs at least" in line
    line = ends_with_one_error(capsys, ["bench", "generate", "--tokens", "1", "--repeats", "1"])
    assert "bench generate: inputs/tiny.toml" in line and "needs at least" in line


def test_bench_refuses_an_empty_json_path(capsys):
    line = ends_with_one_error(capsys, ["bench", "generate", "--set", "model.n_layer=1",
                                        "--tokens", "1", "--repeats", "1", "--json", ""])
    assert "--json: an empty path" in line


def test_bench_ckpt_never_writes_into_a_folder_with_files(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    before = snapshot(run)
    line = ends_with_one_error(capsys, ["bench", "ckpt", TINY, "--set", "model.n_layer=1",
                                        "--dir", str(run)])
    assert "--dir" in line and "name a new folder" in line
    assert snapshot(run) == before


# -- doctor, generate ------------------------------------------------------------------------------

def test_doctor_refuses_an_empty_run_directory(capsys):
    line = ends_with_one_error(capsys, ["doctor", ""])
    assert "argument RUN_DIR: an empty path" in line


def test_a_text_prompt_with_the_ids_tokenizer_says_so():
    args = argparse.Namespace(prompt="x", prompt_ids=None, tokenizer="ids")
    with pytest.raises(HpcpipeError, match="--tokenizer ids takes token ids"):
        prompt_ids(args, 256, None, ord("\n"))  # a byte vocabulary: never "is not bytes"


# -- empty paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["prepare", "--corpus", ""], ["prepare", "--out", ""], ["prepare", "--from", ""],
    ["prepare", "--tokenizer", "hf", "--tokenizer-file", ""], ["plot", "runs/x", "--out", ""],
    ["generate", "runs/x", "--tokenizer-file", ""], ["schedule", "--load-csv", ""],
    ["ckpt", "import-hf", "x", "--out", "y", "--config", ""],
    ["ckpt", "import-gguf", "x.gguf", "--out", "y", "--config", ""],
    ["bench", "gpu-model", "--calibration", ""], ["bench", "stragglers", "--config", ""]])
def test_an_empty_path_is_refused_never_taken_for_the_default(capsys, argv):
    # `--out "$OUT"` with OUT unset: prepare tokenized the whole standard library into
    # data/stdlib.tokens.h5, plot wrote RUN_DIR/plot.png, gpu-model predicted at the
    # stated rates uncalibrated, import-hf used the default config — each said nothing
    line = ends_with_one_error(capsys, argv)
    assert "an empty path" in line


# -- options the command would ignore -----------------------------------------------------------

def test_a_tokenizer_file_for_the_byte_tokenizer_is_refused(capsys, tmp_path):
    # `prepare --tokenizer-file r50k_base.tiktoken` (without --tokenizer gpt2) wrote bytes
    out = tmp_path / "x.h5"
    for argv in (["prepare", "--tokenizer-file", "r50k_base.tiktoken", "--out", str(out)],
                 ["prepare", "--tokenizer", "bytes", "--tokenizer-file", "t.json", "--out",
                  str(out)]):
        line = ends_with_one_error(capsys, argv)
        assert "--tokenizer-file" in line and "bytes" in line
    assert not out.exists()


def test_a_shard_size_for_an_export_that_is_not_sharded_is_refused(capsys, tmp_path):
    # (checked before the checkpoint is read: none is needed here)
    out = tmp_path / "x.h5"
    line = ends_with_one_error(capsys, ["ckpt", "export", str(tmp_path / "run"), "--out",
                                        str(out), "--max-shard-size", "1MB"])
    assert "--max-shard-size" in line and not out.exists()
