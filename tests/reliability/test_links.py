"""Nothing written through a link (issue 28): every output — pictures, schedules, a run's
files — is written by one atomic path (files.write_atomic) that replaces a symbolic link
at the output's name with the new file and never follows it: with --force, the link's
target (as root: any file) stays untouched."""

import os

import pytest
from harness.hostile import ends_with_one_error

from hpcpipe.__main__ import main
from hpcpipe.util.files import write_figure, write_text_atomic


def _link_to_precious(tmp_path, name):
    precious = tmp_path / "precious"
    precious.write_bytes(b"not yours")
    link = tmp_path / name
    os.symlink(precious, link)
    return precious, link


def _replaced(precious, link):
    assert precious.read_bytes() == b"not yours"
    assert not os.path.islink(link) and os.path.getsize(link) > 0


@pytest.mark.parametrize("flag, name", [("--svg", "t.svg"), ("--png", "t.png"),
                                        ("--save-csv", "t.csv")])
def test_schedule_outputs_replace_a_link_never_its_target(capsys, tmp_path, flag, name):
    precious, link = _link_to_precious(tmp_path, name)
    argv = ["schedule", "--kind", "1f1b", "-p", "2", "-m", "4", flag, str(link)]
    ends_with_one_error(capsys, argv)  # without --force: it exists
    assert os.path.islink(link)
    assert main(argv + ["--force"]) == 0
    _replaced(precious, link)


def test_plot_force_replaces_a_link_never_its_target(capsys, finished, tmp_path):
    precious, link = _link_to_precious(tmp_path, "plot.png")
    assert main(["plot", str(finished), "--out", str(link), "--force"]) == 0
    _replaced(precious, link)
    os.symlink(precious, finished / "plot.png")  # the default output, inside the run
    assert main(["plot", str(finished), "--force"]) == 0
    _replaced(precious, finished / "plot.png")


def test_the_atomic_writer_never_follows_a_link(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precious, link = _link_to_precious(tmp_path, "x.txt")
    write_text_atomic(str(link), "new")
    _replaced(precious, link)
    # Nor a link planted under the temporary name it writes first.
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / f".fig.pdf.tmp.{os.getpid()}")
    fig = plt.figure()
    write_figure(str(tmp_path / "fig.pdf"), fig)
    plt.close(fig)
    assert target.read_bytes() == b"keep"
    assert (tmp_path / "fig.pdf").read_bytes().startswith(b"%PDF")
