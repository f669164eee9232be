"""[data]: where a run's tokens come from — the section of the config that `checks`
opens, with its own checks (hpcpipe/config.py composes the sections)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.util.sections import require


@dataclass(frozen=True)
class DataSection:
    """[data]: where tokens come from."""

    corpus: str = "stdlib"  # "stdlib", a text file, or a folder of text files
    # the token file: hpcpipe's HDF5, llm.c .bin shards (a glob) or a nanoGPT train.bin;
    # "" means data/stdlib.tokens.h5, or data/<name>-<hash of its path>.tokens.h5 for a
    # file or folder (corpora.default_token_path)
    path: str = ""
    val_fraction: float = 0.05  # share of a prepared corpus held out for validation
    # -- reliability (issue 28) --
    # resume this run onto training data other than its checkpoint's (their fingerprints,
    # recorded in every manifest, differ); false: such a resume is refused
    allow_changed: bool = False

    def validate(self, source: str):
        require(source, "data.val_fraction", self.val_fraction, 0 < self.val_fraction < 1,
                "must be between 0 and 1 (exclusive)")
        require(source, "data.corpus", self.corpus, self.corpus != "",
                'must be "stdlib", a file or a folder')
