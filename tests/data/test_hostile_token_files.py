"""Token and tokenizer files made to mislead: HDF5 splits whose ids live elsewhere or were
never written, chunks that cost gigabytes a read, ids past 2**63, an HDF5 file under a
`.bin` name, a loop of symbolic links, a rank file with a byte-order mark. Each is one
DataError (or TokenizerError) naming the file before any window is read, never a hang,
another file's bytes or fill values trained on as tokens."""

import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.data import tokenizer as tk
from hpcpipe.data.checks import open_tokens
from hpcpipe.data.tokens import DataError, open_token_file

from harness import devices
from harness.tokenfiles import write_nanogpt, write_tiktoken

TOKENS = (np.arange(5000) % 251).astype(np.uint8)


def write_h5(path, train=TOKENS):
    """A byte-level token file whose `train` split is `train`: ids, or a function that
    makes the split in the file."""
    with h5py.File(path, "w") as f:
        if callable(train):
            train(f)
        else:
            f["train"] = train
        f["val"] = TOKENS[:500]
        f.attrs.update({"vocab_size": 256, "tokenizer": "bytes"})
    return path


def virtual(f, source):
    layout = h5py.VirtualLayout(shape=(5000,), dtype="u1")
    layout[:] = h5py.VirtualSource(str(source), "train", shape=(5000,))
    f.create_virtual_dataset("train", layout, fillvalue=0)


@pytest.mark.parametrize("make, message", [
    # Another file's ids, through a link HDF5 follows by name (a FIFO there: a hang).
    (lambda f, d: f.__setitem__("train", h5py.ExternalLink(str(d / "other.h5"), "/train")),
     (r"the train split is a link to '.*other.h5:/train'; token ids must be stored in the "
      r"file itself")),
    (lambda f, d: (f.__setitem__("data", TOKENS), f.__setitem__("train", h5py.SoftLink("/data"))),
     "the train split is a link to '/data'"),
    # Raw bytes of any file the maker names (/etc/passwd), read as token ids.
    (lambda f, d: f.create_dataset("train", shape=(5000,), dtype="u1",
                                   external=[(str(d / "raw.bin"), 0, 5000)]),
     r"the train split is stored in the external file '.*raw.bin'"),
    # A missing source file of a virtual dataset reads as its fill value, silently.
    (lambda f, d: virtual(f, d / "missing.h5"), "the train split is a virtual dataset"),
    # Declared, never written: HDF5 reads the fill value without complaint.
    (lambda f, d: f.create_dataset("train", shape=(10**9,), dtype="u1", chunks=(65536,)),
     "declares 1,000,000,000 tokens, but only 0 of its 15,259 chunks are stored"),
    (lambda f, d: f.create_dataset("train", shape=(5000,), dtype="u1", fillvalue=7),
     "declares 5,000 tokens, but only 0 of its 5,000 bytes are stored"),
    (lambda f, d: f.create_dataset("train", data=TOKENS[:1000], chunks=(2**20,),
                                   maxshape=(None,), compression="gzip",
                                   dtype="u8"),  # 8 MiB a chunk, written
     None),
    # A few hundred bytes on disk that decompress to 72 MiB on every window read.
    (lambda f, d: f.create_dataset("train", data=TOKENS[:1000], chunks=(9 * 2**23,),
                                   maxshape=(None,), compression="gzip"),
     "chunks hold 75,497,472 bytes, at most 67,108,864"),
])
def test_hdf5_splits_stored_elsewhere_or_nowhere(tmp_path, make, message):
    write_h5(tmp_path / "other.h5")
    (tmp_path / "raw.bin").write_bytes(TOKENS.tobytes())
    path = write_h5(tmp_path / "t.h5", train=lambda f: make(f, tmp_path))
    if message is None:  # a big but sane chunk still reads
        assert open_token_file(str(path)).read("train", 0, 1000).tolist() == \
            TOKENS[:1000].tolist()
        return
    with pytest.raises(DataError, match=f"token file {path}: .*{message}"):
        open_token_file(str(path))


def test_ids_past_2_63_are_reported_as_stored(tmp_path):
    path = write_h5(tmp_path / "t.h5", train=np.full(5000, 2**64 - 1, dtype=np.uint64))
    tokens = open_token_file(str(path))
    with pytest.raises(DataError, match="token id 18446744073709551615, outside its "
                                        "vocabulary of 256"):
        tokens.batch("train", 16, 0, 1, range(2))


def test_an_hdf5_file_named_bin_is_not_read_as_nanogpt_tokens(tmp_path):
    # A byte-level token file's text reads as uint16 ids below 50257: it would train.
    text = np.frombuffer(b"def main():\n    return 0\n" * 400, dtype=np.uint8)
    for split in ("train", "val"):
        write_h5(tmp_path / f"{split}.bin", train=text)
    with pytest.raises(DataError, match=r"train.bin is an HDF5 file \(as `prepare` writes\), "
                                        r"not llm.c or nanoGPT tokens; name it .h5"):
        open_token_file(str(tmp_path / "train.bin"))
    write_nanogpt(tmp_path / "train.bin", [1, 2, 3, 4])  # its val.bin sibling is HDF5 too
    with pytest.raises(DataError, match=r"val.bin is an HDF5 file"):
        open_token_file(str(tmp_path / "train.bin"))


def test_a_loop_of_symbolic_links_is_named_as_one(tmp_path):
    os.symlink("b.h5", tmp_path / "a.h5")
    os.symlink("a.h5", tmp_path / "b.h5")
    cfg = config.from_dict({"data": {"path": str(tmp_path / "a.h5")}}, "run.toml")
    with pytest.raises(DataError, match=r"a.h5 is a symbolic link to b.h5, which leads back "
                                        r"to itself \(a loop of symbolic links\)"):
        open_tokens(cfg.data, cfg.model, cfg.source, MPI.COMM_SELF, log=lambda *_: None)


def test_a_rank_file_with_a_byte_order_mark(tmp_path):
    path = write_tiktoken(tmp_path / "bom.tiktoken")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    with pytest.raises(tk.TokenizerError, match="starts with a UTF-8 byte-order mark"):
        tk.read_tiktoken_file(str(path))


def test_train_on_a_split_linked_to_a_fifo_is_one_line_not_a_hang(tmp_path):
    # one `train` process, no launcher: it runs two at a time with the module's in-process
    # reads of token files (conftest.py's `serial`)
    from harness.mpirun import run_python

    os.mkfifo(tmp_path / "fifo.h5")
    path = write_h5(tmp_path / "t.h5", train=lambda f: f.__setitem__(
        "train", h5py.ExternalLink(str(tmp_path / "fifo.h5"), "/train")))
    sets = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=32",
            "train.steps=1", "train.eval_every=0", "train.trace_steps=0",
            f'data.path="{path}"']
    proc = run_python(["-m", "hpcpipe", "train", "inputs/tiny.toml", "--run-dir",
                       str(tmp_path / "run"), *devices.train_sets(),
                       *[a for s in sets for a in ("--set", s)]], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        (f"error: token file {path}: the train split is a link to '{tmp_path}/fifo.h5:/train'; "
         f"token ids must be stored in the file itself")]
