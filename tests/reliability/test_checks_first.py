"""Checks that come before the work (issue 28): every value from outside is validated
once, up front, with the rules the code that wrote it follows — so a run that can be
resumed stays resumable whatever a hand or a tool did to its records."""

import json

from harness.hostile import ends_with_one_error
from harness.hostile import train_args as _train

from hpcpipe.__main__ import main
from hpcpipe.runs.rundir import line_fits, read_metrics


def test_a_metrics_line_with_a_field_of_the_wrong_type_never_blocks_a_resume(
        capsys, finished, stdlib_tokens):
    run_dir = finished
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    step1 = json.loads(lines[1])
    assert step1["step"] == 1 and line_fits(step1)
    # Well-formed JSON, each with one field a run never writes that way.
    for field, value in (("dp_wait_s", 5), ("p2p_wait_s", "ab"), ("loss", "low"),
                         ("skipped", 1), ("step", True), ("compute_s", [None])):
        assert not line_fits({**step1, field: value}), field
    lines[1] = json.dumps({**step1, "dp_wait_s": 5, "p2p_wait_s": [0.1]})
    metrics.write_text("\n".join(lines) + "\n" + "x" * (2 << 20) + "\n")  # and a huge line
    kept, dropped = read_metrics(str(metrics), 2)
    assert dropped == 2 and [json.loads(k)["step"] for k in kept] == [0, 2, 2]
    capsys.readouterr()
    assert main(_train(run_dir, stdlib_tokens, "train.steps=3") + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "dropped 2 unreadable line(s)" in out and "resumed from" in out


def test_a_byte_memory_limit_below_one_microbatch_is_refused_before_any_step(
        capsys, tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    line = ends_with_one_error(capsys, _train(run_dir, stdlib_tokens, "train.steps=4",
                                              'parallel.schedule="auto"',
                                              'parallel.memory_limit="1KiB"'))
    assert 'parallel.memory_limit = \'1KiB\': below one microbatch\'s activations' in line
    assert not (run_dir / "metrics.jsonl").exists()  # not one step, profiled or not


def test_doctor_refuses_layouts_of_zero(capsys):
    for flag in ("--tp", "--pp"):
        line = ends_with_one_error(capsys, ["doctor", flag, "0"])
        assert f"{flag}: " in line and "expected an integer from 1" in line


def test_generate_refuses_what_would_fail_mid_output(capsys, tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    assert main(_train(run_dir, stdlib_tokens, "train.steps=1", "model.vocab_size=512")) == 0
    capsys.readouterr()
    line = ends_with_one_error(capsys, ["generate", str(run_dir), "--tokenizer", "bytes",
                                        "--prompt", "hi", "--tokens", "50"])
    assert "vocabulary has 512 tokens; the bytes tokenizer writes only 256" in line
    assert capsys.readouterr().out == ""  # refused before a token was written
    line = ends_with_one_error(capsys, ["generate", str(run_dir), "--tokenizer", "ids",
                                        "--prompt-ids", "1,2", "--temperature", "1e-310"])
    assert "--temperature: expected 0 (greedy) or at least 1e-06" in line
    assert main(["generate", str(run_dir), "--tokenizer", "ids", "--prompt-ids", "1,2",
                 "--temperature", "1e-6", "--tokens", "3"]) == 0


def test_a_resume_from_nowhere_is_refused_before_the_corpus_is_prepared(capsys, tmp_path):
    # (a mistyped --resume on a first run: a corpus of books was tokenized before it was
    # said; the run would have been refused either way)
    corpus, tokens = tmp_path / "corpus.txt", tmp_path / "t.h5"
    corpus.write_text("text\n" * 400)
    argv = _train(tmp_path / "run", tokens, f'data.corpus="{corpus}"')
    line = ends_with_one_error(capsys, argv + ["--resume", str(tmp_path / "nowhere")])
    assert "no checkpoint there" in line
    assert not tokens.exists()
