"""files.write_atomic's exclusive create (replace=False): the file that takes a new
output's name is never replaced by a later writer's, and is never seen half-written."""

import errno
import os

import pytest

from hpcpipe.util.files import OutputError, write_atomic


def writing(data: bytes, meanwhile=lambda: None):
    """A `write(tmp)` of `data` during which another command (`meanwhile`) finishes its
    file. (Another process's temporary name is its own: `meanwhile` writes the file.)"""
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
        meanwhile()
    return write


def test_a_file_written_meanwhile_is_kept_and_the_later_writer_refused(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(OutputError, match=f"^{out}: another command wrote it while this one "
                                          f"ran; it is left as it is"):
        write_atomic(str(out), writing(b"ours", lambda: out.write_bytes(b"theirs")),
                     replace=False)
    assert out.read_bytes() == b"theirs"
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary file left
    write_atomic(str(out), writing(b"ours"))  # replace (--force): over it
    assert out.read_bytes() == b"ours"


def test_without_hard_links_the_name_is_still_taken_exclusively(tmp_path, monkeypatch):
    def no_links(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "out.bin"
    write_atomic(str(out), writing(b"first"), replace=False)
    assert out.read_bytes() == b"first"
    with pytest.raises(OutputError, match="another command wrote it"):
        write_atomic(str(out), writing(b"second"), replace=False)
    assert out.read_bytes() == b"first" and os.listdir(tmp_path) == ["out.bin"]


def test_a_set_of_files_is_published_whole_or_not_at_all(tmp_path):
    """OutputSet(replace=False), an export's files: where another command wrote one of the
    names meanwhile, that file is kept and none of the set's others is left."""
    from hpcpipe.util.files import OutputSet

    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    with pytest.raises(OutputError, match=f"^{second}: another command wrote it"):
        with OutputSet(replace=False) as outputs:
            outputs.write_bytes(str(first), b"ours")
            outputs.write_bytes(str(second), b"ours")
            second.write_bytes(b"theirs")
    assert os.listdir(tmp_path) == ["b.bin"] and second.read_bytes() == b"theirs"
    with OutputSet() as outputs:  # replace (--force): over it
        outputs.write_bytes(str(first), b"ours")
        outputs.write_bytes(str(second), b"ours")
    assert first.read_bytes() == second.read_bytes() == b"ours"


@pytest.mark.parametrize("how", ["text", "figure"])
def test_text_and_pictures_take_a_new_name_only(tmp_path, how):
    from hpcpipe.util import files

    out = tmp_path / ("out.txt" if how == "text" else "out.png")
    if how == "figure":
        pytest.importorskip("matplotlib")
        plt = files.pyplot()
        fig = plt.figure()
        fig.savefig = lambda tmp, **_: (open(tmp, "w").write("ours"),
                                        out.write_text("theirs"))
        write = lambda: files.save_figure(fig, str(out), replace=False)  # noqa: E731
    else:
        write = lambda: files.write_text_atomic(  # noqa: E731
            str(out), "ours" if out.write_text("theirs") else "", replace=False)
    with pytest.raises(OutputError, match="another command wrote it"):
        write()
    assert out.read_text() == "theirs" and os.listdir(tmp_path) == [out.name]
