"""A run's token file: prepared only where the config asks for it, and a named data.path
that is not there is one error naming the closest name that is."""

import os

import pytest
from mpi4py import MPI

from hpcpipe import config
from hpcpipe.data import checks
from hpcpipe.data.checks import asks_to_prepare
from hpcpipe.data.tokens import DataError


def open_tokens(cfg, comm, log):
    """checks.open_tokens of the config's [data] and [model]."""
    return checks.open_tokens(cfg.data, cfg.model, cfg.source, comm, log)


def cfg_with(**data):
    return config.from_dict({"data": data}, "run.toml")


@pytest.mark.parametrize("data, asks", [
    ({}, True),                                            # the corpus's own file
    ({"path": "data/stdlib.tokens.h5"}, True),             # the same, named
    ({"path": "./data/stdlib.tokens.h5"}, True),
    ({"path": "data/fineweb_trian.tokens.h5"}, False),     # a file to read: a typo
    ({"corpus": "texts/", "path": "data/texts.h5"}, True),  # a corpus to tokenize there
])
def test_which_configs_prepare(data, asks):
    assert asks_to_prepare(cfg_with(**data).data) is asks


def test_a_mistyped_path_names_the_closest_file_and_prepares_nothing(tmp_path):
    (tmp_path / "fineweb_train.tokens.h5").write_bytes(b"")
    (tmp_path / "other.txt").write_bytes(b"")
    typo = tmp_path / "fineweb_trian.tokens.h5"
    with pytest.raises(DataError) as info:
        open_tokens(cfg_with(path=str(typo)), MPI.COMM_SELF, log=lambda *_: None)
    message = str(info.value)
    assert f"data.path = '{typo}'" in message
    assert f"did you mean {tmp_path / 'fineweb_train.tokens.h5'}?" in message
    assert not typo.exists()


def test_a_missing_bin_and_a_missing_folder(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match=r"no such file; did you mean .*train\.bin\?"):
        open_tokens(cfg_with(path=str(tmp_path / "trian.bin")), MPI.COMM_SELF, print)
    with pytest.raises(DataError, match=r"no such folder .*nowhere"):
        open_tokens(cfg_with(path=os.path.join(tmp_path, "nowhere", "t.h5")), MPI.COMM_SELF,
                    print)


def test_a_split_of_two_tokens_says_what_fits(tmp_path):
    """A val split of 2 tokens (a data.val_fraction of 1e-9) used to be told to use "a
    block_size below 1", which no config can; it holds one window of block_size 1."""
    from harness.tokenfiles import write_nanogpt

    write_nanogpt(tmp_path / "train.bin", range(1000))
    write_nanogpt(tmp_path / "val.bin", [1, 2])
    cfg = config.from_dict({"data": {"path": str(tmp_path / "train.bin")},
                            "model": {"vocab_size": 50257}}, "run.toml")
    with pytest.raises(config.ConfigError) as info:
        open_tokens(cfg, MPI.COMM_SELF, log=lambda *_: None)
    message = str(info.value)
    assert "has 2 tokens" in message and "below 1" not in message
    assert "a block_size of at most 1" in message and "a larger data.val_fraction" in message


def test_a_token_file_of_another_val_fraction_is_refused_not_reused(tmp_path, monkeypatch):
    """`--set data.val_fraction=0.2` over a token file prepared with 0.05 trained on the
    old 5 % split without a word: the config's value did nothing. Now it is refused, like
    a token file of another corpus; the same value reuses the file."""
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text of the user's own, " * 400)
    monkeypatch.chdir(tmp_path)
    quiet = lambda *_: None  # noqa: E731
    model = {"block_size": 16}
    first = config.from_dict({"data": {"corpus": "texts"}, "model": model}, "run.toml")
    open_tokens(first, MPI.COMM_SELF, quiet).close()  # prepared with 0.05
    again = open_tokens(first, MPI.COMM_SELF, quiet)
    assert again.length("val") == round(0.05 * (again.length("train") + again.length("val")))
    again.close()
    other = config.from_dict({"data": {"corpus": "texts", "val_fraction": 0.2},
                              "model": model}, "run.toml")
    with pytest.raises(DataError, match=r"val_fraction 0\.05.*data\.val_fraction is 0\.2"):
        open_tokens(other, MPI.COMM_SELF, quiet)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_of_block_size_plus_one_tokens_holds_one_window(tmp_path, split):
    """block_size + 1 tokens are one training window (block_size inputs, each one's next
    token the target), but were refused as "larger than the data" (the check asked for
    one token more), and the window sampler found no start for them."""
    from harness.tokenfiles import write_nanogpt

    short = list(range(100, 117))  # block_size 16 + 1
    write_nanogpt(tmp_path / "train.bin", short if split == "train" else range(1000))
    write_nanogpt(tmp_path / "val.bin", short if split == "val" else range(500, 700))
    cfg = config.from_dict({"data": {"path": str(tmp_path / "train.bin")},
                            "model": {"vocab_size": 50257, "block_size": 16}}, "run.toml")
    tokens = open_tokens(cfg, MPI.COMM_SELF, log=lambda *_: None)
    try:
        batch = tokens.batch(split, 16, seed=3, step=7, indices=range(4))
    finally:
        tokens.close()
    assert batch.idx.shape == batch.targets.shape == (4, 16)
    for row, target in zip(batch.idx, batch.targets):  # the one window, four times
        assert row.tolist() == short[:-1] and target.tolist() == short[1:]
    longer = config.from_dict({"data": {"path": str(tmp_path / "train.bin")},
                               "model": {"vocab_size": 50257, "block_size": 17}}, "run.toml")
    with pytest.raises(config.ConfigError, match="larger than the data.*block_size of at "
                                                 "most 16"):
        open_tokens(longer, MPI.COMM_SELF, log=lambda *_: None)
