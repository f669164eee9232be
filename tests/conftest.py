"""Test-wide setup: the helpers in tests/ are importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import pytest


@pytest.fixture(scope="session")
def stdlib_tokens(tmp_path_factory):
    """The real default corpus (this Python's stdlib sources), prepared once per session."""
    from hpcpipe import data

    path = str(tmp_path_factory.mktemp("data") / "stdlib.tokens.h5")
    data.prepare("stdlib", path, 0.05, log=lambda *_: None)
    return path
