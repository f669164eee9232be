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
