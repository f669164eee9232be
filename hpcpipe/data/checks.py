"""The training data of a run: its token file opened (prepared first where hpcpipe makes
it) and checked against the config — its corpus, its vocabulary, its length."""

from __future__ import annotations

import os

from hpcpipe.data.corpora import corpus_identity, default_token_path, prepare, token_file_identity
from hpcpipe.data.tokens import DataError, TokenFile, is_prepared_by_hpcpipe, open_token_file
from hpcpipe.util.errors import ConfigError, every_rank_does, root_does


def open_tokens(cfg: Config, comm, log) -> TokenFile:
    """The token file of the config, prepared by rank 0 first if it does not exist yet,
    and checked against the config: its corpus, its vocabulary, its length."""
    path = cfg.data.path or default_token_path(cfg.data.corpus)

    def ensure():
        if not os.path.exists(path) and is_prepared_by_hpcpipe(path):
            log(f"preparing {path} from corpus {cfg.data.corpus!r} (once; later runs reuse it)")
            prepare(cfg.data.corpus, path, cfg.data.val_fraction, log=log)

    root_does(comm, ensure)
    tokens = every_rank_does(comm, lambda: open_token_file(path))
    try:
        _check_tokens(cfg, tokens)
    except DataError:
        tokens.close()
        raise
    return tokens


def _check_tokens(cfg: Config, tokens: TokenFile):
    path, model = tokens.path, cfg.model
    # The corpus decides which file a run trains on when the path is derived from it, or
    # when the config names a corpus of its own (not the default) beside a path.
    if not cfg.data.path or cfg.data.corpus != "stdlib":
        recorded, wanted = token_file_identity(tokens.attrs), corpus_identity(cfg.data.corpus)
        if recorded is not None and recorded != wanted:
            raise DataError(f"{path} was prepared from corpus {recorded}, but data.corpus is "
                            f"{wanted}: prepare the new corpus into another file (`python -m "
                            f"hpcpipe prepare --corpus ... --out ...`) and set data.path, or "
                            f"remove {path} to prepare it again")
    if model.vocab_size < tokens.vocab_size:
        raise ConfigError(cfg.source, "model.vocab_size", model.vocab_size,
                          f"must be at least {tokens.vocab_size}, the vocabulary of {path}")
    shortest = min(tokens.length("train"), tokens.length("val"))
    if model.block_size + 1 >= shortest:
        raise ConfigError(cfg.source, "model.block_size", model.block_size,
                          f"larger than the data: the smaller split of {path} has {shortest} "
                          f"tokens; use a block_size below {shortest - 1} or a bigger corpus")
