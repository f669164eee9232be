"""Checks that come before the work (issue 28): every value from outside is validated
once, up front, with the rules the code that wrote it follows — so a run that can be
resumed stays resumable whatever a hand or a tool did to its records."""

import json

from reliability.test_no_hang import _train

from hpcpipe.__main__ import main
from hpcpipe.runs.rundir import line_fits, read_metrics


def test_a_metrics_line_with_a_field_of_the_wrong_type_never_blocks_a_resume(
        capsys, tmp_path, stdlib_tokens):
    run_dir = tmp_path / "run"
    assert main(_train(run_dir, stdlib_tokens, "train.steps=2", "checkpoint.every=1")) == 0
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
