"""The training data of a run: its token file opened (prepared first where hpcpipe makes
it) and checked against the config — its corpus, its vocabulary, its length — and against
the tokenizer its starting weights carry, and its fingerprint."""

from __future__ import annotations

import difflib
import errno
import glob
import os
from dataclasses import dataclass

from hpcpipe.data.corpora import (
    corpus_identity,
    default_token_path,
    prepare,
    token_file_identity,
    val_tokens,
)
from hpcpipe.data.fingerprint import fingerprint
from hpcpipe.data.tokens import (
    DataError,
    TokenFile,
    is_prepared_by_hpcpipe,
    open_token_file,
    reader_by_name,
)
from hpcpipe.util.errors import ConfigError, every_rank_does, root_does


@dataclass(frozen=True)
class WeightsTokenizer:
    """The tokenizer.json the weights a run starts from carry (an imported Llama's, or a
    checkpoint of a run that started from one): where it lies, and its SHA-256."""
    file: str
    sha256: str
    gpt2: bool = False  # a GPT-2's: its tokenizer.json is GPT-2's BPE, as `--tokenizer gpt2`

    def made(self, tokens: TokenFile) -> bool:
        """Whether `prepare` made `tokens` with this tokenizer.json (any copy of it): the
        file records the tokenizer's name and, for a tokenizer.json, "PATH (sha256 HEX)"
        with the first 12 hex digits of its SHA-256 (tokenizer.load_tokenizer_json). A
        GPT-2 also takes GPT-2's BPE through tiktoken (prepare --tokenizer gpt2, llm.c's
        GPT-2 shards): the same ids (docs/guides/formats.md fine-tunes an import on them)."""
        source = str(tokens.attrs.get("tokenizer_source", ""))
        return (tokens.tokenizer == "hf" and source.endswith(f"(sha256 {self.sha256[:12]})")
                or self.gpt2 and tokens.tokenizer == "gpt2")

    def prepare_command(self, corpus: str, val_fraction: float, out: str) -> str:
        return (f"`python -m hpcpipe prepare --corpus {corpus} --tokenizer hf "
                f"--tokenizer-file {self.file} --val-fraction {val_fraction} --out {out}`")


def asks_to_prepare(data) -> bool:
    """Whether a [data] section asks `train` to prepare its token file when it is missing.

    It does when the file is the one hpcpipe names after the corpus (data.path unset, or
    set to that very name: data/stdlib.tokens.h5 for the default corpus), or when it names
    a corpus of its own (not the default) to tokenize into data.path. Any other named path
    is a file the user means to read, and one that is not there is an error: a typo must
    never become a freshly prepared standard library."""
    derived = default_token_path(data.corpus)
    return (not data.path or os.path.normpath(data.path) == os.path.normpath(derived)
            or data.corpus != "stdlib")


def missing_path_error(source: str, path: str) -> DataError:
    """data.path names nothing: say so, with the closest name that exists beside it."""
    folder, name = os.path.split(path)
    where = f"{source}: data.path = {path!r}"
    if folder and not os.path.isdir(folder):
        return DataError(f"{where}: no such folder {folder}")
    names = [n for n in os.listdir(folder or ".") if not n.startswith(".")]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = (f"did you mean {os.path.join(folder, close[0])}?" if close else
            f"prepare it with `python -m hpcpipe prepare --corpus ... --out {path}`"
            if is_prepared_by_hpcpipe(path) else _never_prepared(path))
    return DataError(f"{where}: no such file; {hint}")


def _never_prepared(path: str) -> str:
    # `prepare --out` refuses such a name (tokens.check_hdf5_name): point at one it takes.
    root, suffix = os.path.splitext(path)
    return (f"a {suffix} file is read as {reader_by_name(path).kind}, never prepared: check "
            f"the path, or prepare tokens with `python -m hpcpipe prepare --corpus ... --out "
            f"{root}.h5` and set data.path to that")


def _unfollowable(path: str) -> str:
    """Why the symbolic link `path` leads nowhere: a loop of links, or a missing target."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "leads back to itself (a loop of symbolic links)"
    return "does not exist (a dataset not mounted?)"


def open_tokens(data, model, source: str, comm, log,
                tokenizer: WeightsTokenizer | None = None) -> TokenFile:
    """The token file of the [data] section `data`, prepared by rank 0 first if it does not
    exist yet and the section asks for that (`asks_to_prepare`), and checked against it and
    the [model] `model`: its corpus, its vocabulary, its length (`source`: the config's
    name, in the messages). With `tokenizer` (the starting weights'), the file must have
    been made with it, and none is prepared: `train` prepares byte tokens only."""
    path = data.path or default_token_path(data.corpus)

    def ensure():
        if os.path.islink(path) and not os.path.exists(path):
            raise DataError(f"data.path {path} is a symbolic link to "
                            f"{os.readlink(path)}, which {_unfollowable(path)}; hpcpipe "
                            f"never prepares a token file over a link")
        if os.path.exists(path) or glob.has_magic(path):
            return  # a glob's reader says what it matched
        if not (is_prepared_by_hpcpipe(path) and asks_to_prepare(data)):
            raise missing_path_error(source, path)  # another project's .bin is never prepared
        if tokenizer is not None:
            raise DataError(f"{path} does not exist, and the weights the run starts from "
                            f"carry their own tokenizer, which `train` does not prepare "
                            f"with: prepare it with "
                            f"{tokenizer.prepare_command(data.corpus, data.val_fraction, path)}")
        log(f"preparing {path} from corpus {data.corpus!r} (once; later runs reuse it)")
        prepare(data.corpus, path, data.val_fraction, log=log)

    root_does(comm, ensure)
    tokens = every_rank_does(comm, lambda: open_token_file(path))
    try:
        _check_tokens(data, model, source, tokens)
        if tokenizer is not None and not tokenizer.made(tokens):
            raise _other_tokenizer(data, tokens, tokenizer)
    except DataError:
        tokens.close()
        raise
    return tokens


def _other_tokenizer(data, tokens: TokenFile, tokenizer: WeightsTokenizer) -> DataError:
    """The token file was made with another tokenizer than the starting weights': its ids
    would mean other text to the model (a fine-tune on them trains nothing it can use)."""
    made = tokens.attrs.get("tokenizer_source") or tokens.tokenizer
    path, corpus = tokens.path, tokens.attrs.get("corpus", data.corpus)
    if reader_by_name(corpus) is not None or glob.has_magic(corpus):
        corpus = "..."  # the text is not known: `prepare --from` copied other token files
    in_place = is_prepared_by_hpcpipe(path) and not glob.has_magic(path)
    out = f"{path} --force" if in_place else f"{os.path.splitext(path)[0]}.tokens.h5"
    return DataError(f"{path} was not made with the tokenizer of the weights the run starts "
                     f"from ({tokenizer.file}) but with {made}: its ids would mean other text "
                     f"to the model; prepare the corpus with it: "
                     f"{tokenizer.prepare_command(corpus, data.val_fraction, out)}"
                     + ("" if in_place else ", and set data.path to that file"))


def _check_tokens(data, model, source: str, tokens: TokenFile):
    path = tokens.path
    # The corpus decides which file a run trains on when the path is derived from it, or
    # when the config names a corpus of its own (not the default) beside a path.
    if not data.path or data.corpus != "stdlib":
        recorded, wanted = token_file_identity(tokens.attrs), corpus_identity(data.corpus)
        if recorded is not None and recorded != wanted:
            raise DataError(f"{path} was prepared from corpus {recorded}, but data.corpus is "
                            f"{wanted}: prepare the new corpus into another file (`python -m "
                            f"hpcpipe prepare --corpus ... --out ...`) and set data.path, or "
                            f"remove {path} to prepare it again")
        if recorded is not None:
            _check_val_fraction(data, tokens)
    if model.vocab_size < tokens.vocab_size:
        raise ConfigError(source, "model.vocab_size", model.vocab_size,
                          f"must be at least {tokens.vocab_size}, the vocabulary of {path}")
    # A window is block_size inputs and the token after the last: block_size + 1 tokens
    # (every reader refuses a split of fewer than 2, so block_size 1 always fits).
    shortest = min(tokens.length("train"), tokens.length("val"))
    if model.block_size + 1 > shortest:
        val = (", or, prepared by hpcpipe, a larger data.val_fraction"
               if tokens.length("val") < tokens.length("train") else "")
        raise ConfigError(source, "model.block_size", model.block_size,
                          f"larger than the data: the smaller split of {path} has {shortest} "
                          f"tokens; use a block_size of at most {shortest - 1}, or a bigger "
                          f"corpus{val}")


def _check_val_fraction(data, tokens: TokenFile):
    """A file prepared with another validation share is refused, never reused: the split
    is decided when the file is written, so data.val_fraction would do nothing."""
    val, total = tokens.length("val"), tokens.length("train") + tokens.length("val")
    if val != val_tokens(total, data.val_fraction):
        # (Not "remove it": `train` would prepare bytes, whatever tokenizer made it.)
        raise DataError(f"{tokens.path} holds {val:,} of its {total:,} tokens for validation "
                        f"(prepared with val_fraction {val / total:.2g}), but "
                        f"data.val_fraction is {data.val_fraction}: set data.val_fraction to "
                        f"the file's, or prepare it again (`python -m hpcpipe prepare --corpus "
                        f"{data.corpus} --val-fraction {data.val_fraction} --out {tokens.path} "
                        f"--force`, with the --tokenizer it was prepared with: "
                        f"{tokens.tokenizer})")


def fingerprint_of(tokens: TokenFile, comm) -> dict:
    """The training data's fingerprint (fingerprint.py), taken by the root, on every rank."""
    return comm.bcast(root_does(comm, lambda: fingerprint(tokens.path, tokens.files())),
                      root=0)
