"""Nothing opened blocks forever (issue 28): a FIFO (or a device) where a file hpcpipe
reads should be — a run's metrics.jsonl, config.toml, summary.json, trace.json,
`latest`, a checkpoint's file, a token file, a safetensors file — is refused with one
line (or passed over where the file is optional), never waited on. Each case runs under
an alarm: a reader that blocked would fail it instead of hanging the suite."""

import os

import pytest
from harness.hostile import ends_with_one_error
from harness.hostile import train_args as _train
from reliability.test_fuzz import no_hang

from hpcpipe.__main__ import main
from hpcpipe.checkpoint import step_name
from hpcpipe.util.files import NotAFile, check_regular, open_regular, read_bounded


def _as_fifo(path):
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)


def test_the_readers_refuse_fifos_and_devices(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with no_hang(10):
        for reader in (lambda p: read_bounded(p, 10), open_regular, check_regular):
            for path in (str(fifo), "/dev/zero"):
                with pytest.raises(NotAFile, match="not a regular file"):
                    reader(path)


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "trace.json"])
def test_a_fifo_among_a_runs_files_never_blocks_a_resume(capsys, finished, stdlib_tokens,
                                                         name):
    _as_fifo(finished / name)
    with no_hang():
        code = main(_train(finished, stdlib_tokens, "train.steps=3") + ["--resume"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if name == "metrics.jsonl":  # the run's own record: refused, not replaced
        assert code == 2 and f"{name}: not a regular file" in err
    else:  # summary.json and trace.json: read back if they can be, said once, never fatal
        assert code == 0


def test_a_fifo_as_config_latest_or_checkpoint_file(capsys, finished, stdlib_tokens, tmp_path):
    with no_hang():
        _as_fifo(finished / "config.toml")  # a fresh run: not a config hpcpipe wrote
        line = ends_with_one_error(capsys, _train(finished, stdlib_tokens, "train.steps=1"))
        assert "which hpcpipe did not write" in line
        assert main(["plot", str(finished), "--out", str(tmp_path / "p.png")]) == 0
        step = finished / "checkpoints" / step_name(1)
        model = next(p for p in step.iterdir() if p.suffix == ".h5")
        _as_fifo(model)
        assert main(["ckpt", "verify", str(step)]) != 0
        ends_with_one_error(capsys, ["ckpt", "export", str(step), "--out",
                                     str(tmp_path / "w.h5")])
        _as_fifo(finished / "checkpoints" / "latest")  # passed over for the newest good one
        code = main(["ckpt", "export", str(finished), "--out", str(tmp_path / "w.h5")])
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err and err.count("error:") <= 1


@pytest.mark.parametrize("name", ["tokens.h5", "shard_train.bin", "model.safetensors"])
def test_a_fifo_as_an_input_file(capsys, tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    with no_hang():
        if name.endswith(".safetensors"):
            argv = ["ckpt", "import-gpt2", str(fifo), "--out", str(tmp_path / "out")]
        else:
            argv = _train(tmp_path / "run", fifo, "train.steps=1")
        ends_with_one_error(capsys, argv)
    assert not (tmp_path / "out").exists()
