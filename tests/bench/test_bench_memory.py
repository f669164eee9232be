"""python -m hpcpipe.bench.memory: the README's Pareto picture is drawn from the analytic
front without MPI, one line per model, and the file is a real PNG."""

import subprocess
import sys

import pytest

from hpcpipe.bench import memory
from hpcpipe.bench.memory import README_MODELS, front_config, pareto_front


def test_the_readme_picture_is_drawn(tmp_path):
    out = tmp_path / "front.png"
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.bench.memory", "--pareto", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bigger_model_holds_more_at_every_limit():
    fronts = {name: pareto_front(front_config(*shape, 2, 4), 2, 4)
              for name, shape in README_MODELS.items()}
    tiny = {p["limit_vs_1f1b"]: p["peak_activation_bytes"] for p in fronts["tiny"]}
    medium = {p["limit_vs_1f1b"]: p["peak_activation_bytes"] for p in fronts["medium"]}
    assert tiny.keys() & medium.keys()
    assert all(medium[k] > tiny[k] for k in tiny.keys() & medium.keys())


@pytest.mark.parametrize("flag", ["--pp", "--microbatches"])
def test_a_count_below_one_is_a_usage_error(tmp_path, capsys, flag):
    # (it was the config loader's ConfigError, as a traceback)
    with pytest.raises(SystemExit) as stop:
        memory.main(["--pareto", str(tmp_path / "front.png"), flag, "0"])
    assert stop.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
