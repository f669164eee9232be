"""Tokenizers: bytes (the default: vocab 256, nothing to download), GPT-2's BPE, a Hugging
Face `tokenizer.json` (the Llama family's: SmolLM2's, Llama 3's, ...), and text decoded
from tokens as they come.

A `tokenizer.json` runs through Hugging Face's `tokenizers` package (`pip install
'hpcpipe[hf]'`): `load("hf", FILE)`. The file is read bounded (MAX_FILE_BYTES) and parsed
by the package's own reader (Rust: a malformed file is an error, never code run); a
checkpoint imported from Hugging Face or GGUF carries its own (`ckpt import-hf`,
`ckpt import-gguf`), which `generate` uses by itself.

GPT-2's BPE runs through tiktoken, an optional extra (`pip install 'hpcpipe[gpt2]'`).
Its 50,256 merge ranks are a 1.6 MB file, `r50k_base.tiktoken` — GPT-2's vocabulary in
tiktoken's format (base64 token and rank per line), which tiktoken also uses for its
"gpt2" encoding. Where it comes from:

    --tokenizer-file FILE, or HPCPIPE_TOKENIZER_FILE=FILE   a local copy (offline nodes):
        curl -O https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken
        (sha256 306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930)
    neither                  tiktoken's own "gpt2" encoding: its cache (TIKTOKEN_CACHE_DIR),
                             downloaded on first use where there is a network

A local file is read by `read_tiktoken_file`, which checks every line before tiktoken
sees it (the file comes from outside). Any file of that format works — GPT-2's
pre-tokenizing pattern and `<|endoftext|>` after the last rank — which is how the tests
build a small BPE without a network.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import json
import os

import numpy as np

from hpcpipe.util.errors import HpcpipeError
from hpcpipe.util.files import TooLarge, read_bounded

TOKENIZERS = ("bytes", "gpt2", "hf")
FILE_ENV = "HPCPIPE_TOKENIZER_FILE"
GPT2_FILE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
GPT2_FILE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer (tiktoken's r50k pattern: the original, written to run faster).
GPT2_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|"""
                r"""\s+(?!\S)|\s""")
ENDOFTEXT = "<|endoftext|>"
MAX_FILE_BYTES = 64 * 2**20  # GPT-4's ranks (cl100k) are 1.7 MB; anything this big is not ranks
MAX_RANKS = 2**31 - 2
INSTALL = "pip install 'hpcpipe[gpt2]' (or: pip install tiktoken)"
HF_INSTALL = "pip install 'hpcpipe[hf]' (or: pip install tokenizers)"
# Tokens that separate documents, as their vocabularies name them (GPT-2, SmolLM2 and
# most byte-level BPEs; Llama 3; SentencePiece models): the first one a tokenizer.json
# has is its `eot`.
DOCUMENT_ENDS = ("<|endoftext|>", "<|end_of_text|>", "</s>")
_REPLACEMENT = "\ufffd".encode()


class TokenizerError(HpcpipeError):
    """A tokenizer that cannot be loaded; the message says how to get it."""


class Tokenizer:
    """Text ↔ token ids. `eot`: the id that separates documents (None: a newline does)."""

    name: str
    vocab_size: int
    eot: int | None = None
    source: str = ""

    def encode(self, data: bytes) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        raise NotImplementedError

    def prompt(self, data: bytes) -> list[int]:
        """A prompt's tokens: its text's, with what the tokenizer puts in front of a
        sequence (a tokenizer.json's BOS token, where it adds one)."""
        return self.encode(data)

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", "replace")

    @property
    def tag(self) -> str:
        """A short name that tells this vocabulary from others (default token paths)."""
        return self.name


class ByteTokenizer(Tokenizer):
    """One token per byte: any input, UTF-8 or not, is its bytes."""

    name, vocab_size, source = "bytes", 256, "bytes"

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def encode_array(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])


class BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE through a tiktoken Encoding."""

    name = "gpt2"

    def __init__(self, encoding, source: str):
        self.encoding, self.source = encoding, source
        self.vocab_size = encoding.n_vocab
        self.eot = encoding.eot_token

    def encode(self, data: bytes) -> list[int]:
        return self.encoding.encode_ordinary(data.decode("utf-8", "replace"))

    def encode_many(self, texts: list[bytes]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(
            [t.decode("utf-8", "replace") for t in texts], num_threads=os.cpu_count() or 1)

    def token_bytes(self, token: int) -> bytes:
        try:
            return self.encoding.decode_single_token_bytes(token)
        except KeyError:  # an id of a padded vocabulary that no text maps to
            return _REPLACEMENT


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json through the `tokenizers` package. Text is encoded
    without added special tokens (no BOS: a document's own text); ids become bytes
    through the vocabulary — byte-level BPE's alphabet read back to bytes (GPT-2's
    byte-to-unicode map), SentencePiece's ▁ as a space and <0xNN> as the byte — so that
    `TextStream` can join a character split over several tokens."""

    name = "hf"
    digest = ""  # the tokenizer.json's SHA-256

    @property
    def tag(self) -> str:
        return f"hf-{self.digest[:8]}"

    def __init__(self, tokenizer, source: str, config: dict):
        self.tokenizer, self.source = tokenizer, source
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # The ids' span, not the count of tokens: the package takes a vocabulary with gaps
        # in its ids, and every id must fit the token file's dtype and the model's rows.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.eot = next((vocab[t] for t in DOCUMENT_ENDS if t in vocab), None)
        self._pieces = {i: t for t, i in vocab.items()}
        added = config.get("added_tokens") or []
        self._literal = {t.get("id") for t in added if isinstance(t, dict)}
        self._byte_level = "ByteLevel" in json.dumps(config.get("decoder"))
        self._bytes = {c: b for b, c in _byte_alphabet().items()}

    def encode(self, data: bytes) -> list[int]:
        return self._run(self.tokenizer.encode, data.decode("utf-8", "replace"),
                         add_special_tokens=False).ids

    def prompt(self, data: bytes) -> list[int]:
        return self._run(self.tokenizer.encode, data.decode("utf-8", "replace")).ids

    def encode_many(self, texts: list[bytes]) -> list[list[int]]:
        return [e.ids for e in self._run(self.tokenizer.encode_batch, [
            t.decode("utf-8", "replace") for t in texts], add_special_tokens=False)]

    def _run(self, call, *args, **kwargs):
        """`call` of the tokenizers package, whose Rust panics — a tokenizer.json's regex
        past Oniguruma's retry limit — reach Python as pyo3's PanicException, a
        BaseException: one TokenizerError instead."""
        try:
            return call(*args, **kwargs)
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise TokenizerError(f"tokenizer {self.source} gave up on the text (the "
                                 f"tokenizers package: {str(e)[:200]})") from None

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            return _REPLACEMENT
        if token in self._literal:  # an added token (<|im_start|>, ...): its own text
            return piece.encode("utf-8")
        if self._byte_level:
            if all(c in self._bytes for c in piece):
                return bytes(self._bytes[c] for c in piece)
            return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
        return piece.replace("\u2581", " ").encode("utf-8")


def _is_panic(error: BaseException) -> bool:
    """Whether `error` is a Rust panic of the tokenizers package: pyo3's PanicException,
    a BaseException (not an Exception) that pyo3 does not export by name."""
    return type(error).__name__ == "PanicException"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map, which byte-level BPE vocabularies are
    written in (the printable bytes themselves, the others shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _read_file(path: str, kind: str, advice: str = "") -> bytes:
    """The bytes of the tokenizer file at `path` (`kind`: what it should be), at most
    MAX_FILE_BYTES; a TokenizerError naming it when it is bigger or cannot be read."""
    try:
        return read_bounded(path, MAX_FILE_BYTES)
    except TooLarge as e:
        raise TokenizerError(f"tokenizer file {path}: {e.size:,} bytes is too large for "
                             f"{kind} (at most {MAX_FILE_BYTES:,})") from None
    except OSError as e:
        raise TokenizerError(f"tokenizer file {path} cannot be read ({e.strerror or e})"
                             f"{advice}") from None


def load_tokenizer_json(file: str) -> HFTokenizer:
    """A tokenizer.json as an HFTokenizer, the file bounded and checked to be one."""
    try:
        from tokenizers import Tokenizer as Reader
    except ImportError:
        raise TokenizerError(f"a tokenizer.json needs Hugging Face's tokenizers: "
                             f"{HF_INSTALL}") from None
    data = _read_file(file, "a tokenizer.json")
    try:
        text = data.decode("utf-8")
        config = json.loads(text)
        tokenizer = Reader.from_str(text)
    except BaseException as e:  # JSON, UTF-8, the package's refusal or panic: one message
        if not isinstance(e, Exception) and not _is_panic(e):
            raise
        raise TokenizerError(f"tokenizer file {file} is not a tokenizer.json the tokenizers "
                             f"package reads ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer file {file}: not a JSON object")
    digest = hashlib.sha256(data).hexdigest()
    hf = HFTokenizer(tokenizer, f"{file} (sha256 {digest[:12]})", config)
    hf.digest = digest
    return hf


def load(name: str, file: str | None = None) -> Tokenizer:
    """The tokenizer called `name` ("bytes", "gpt2" or "hf"); `file`: GPT-2's ranks in
    tiktoken's format (else HPCPIPE_TOKENIZER_FILE, else tiktoken's own "gpt2" encoding),
    or for "hf" the tokenizer.json (required)."""
    if name == "bytes":
        if file:  # (it would be ignored, the text tokenized as bytes all the same)
            raise TokenizerError(f"--tokenizer-file {file}: the bytes tokenizer reads no "
                                 f"file; give --tokenizer gpt2 or hf with it")
        return ByteTokenizer()
    if name == "hf":
        if not file:
            raise TokenizerError("--tokenizer hf reads a Hugging Face tokenizer.json: give "
                                 "--tokenizer-file FILE")
        return load_tokenizer_json(file)
    if name != "gpt2":
        raise TokenizerError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")
    tiktoken = _import_tiktoken()
    file = file or os.environ.get(FILE_ENV) or None
    if file:
        ranks, digest = read_tiktoken_file(file)
        encoding = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={ENDOFTEXT: len(ranks)})
        kind = "GPT-2's ranks" if digest == GPT2_FILE_SHA256 else f"{len(ranks):,} ranks"
        return BPETokenizer(encoding, f"{file} ({kind}, sha256 {digest[:12]})")
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network, a proxy, a damaged cache: all say the same here
        raise TokenizerError(
            f"GPT-2's BPE ranks could not be loaded through tiktoken ({type(e).__name__}: "
            f"{str(e)[:200]}); offline, download {GPT2_FILE_URL} elsewhere and pass "
            f"--tokenizer-file FILE or set {FILE_ENV}=FILE") from None
    return BPETokenizer(encoding, "tiktoken's gpt2 encoding")


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise TokenizerError(f"the GPT-2 tokenizer needs tiktoken: {INSTALL}") from None
    return tiktoken


def read_tiktoken_file(path: str) -> tuple[dict[bytes, int], str]:
    """(token bytes → rank, the file's SHA-256) of a `.tiktoken` file: one `base64 rank`
    per line, the ranks 0 to n − 1 each once, every single byte among the tokens (BPE
    starts from bytes). Every line is checked; any fault is one TokenizerError naming the
    file and the line."""
    data = _read_file(path, "a BPE rank file", f"; GPT-2's is {GPT2_FILE_URL}")
    if data.startswith(codecs.BOM_UTF8):  # an editor's mark, which no base64 token holds
        raise TokenizerError(f"tokenizer file {path} starts with a UTF-8 byte-order mark; "
                             f"a rank file is plain ASCII: save it without one")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip():
            token, rank = _rank_line(path, number, line)
            if token in ranks:
                raise TokenizerError(f"tokenizer file {path}, line {number}: token {token!r} "
                                     f"has a rank already")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"tokenizer file {path}: the ranks are not 0 to {len(ranks) - 1} "
                             f"each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"tokenizer file {path}: byte {missing[0]} has no token (a "
                             f"byte-level BPE ranks all 256 bytes)")
    return ranks, hashlib.sha256(data).hexdigest()


def _rank_line(path: str, number: int, line: bytes) -> tuple[bytes, int]:
    fields = line.split()
    problem = None
    if len(fields) != 2:
        problem = "expected `base64-token rank`"
    elif not fields[1].isdigit() or len(fields[1]) > 10 or int(fields[1]) > MAX_RANKS:
        text = fields[1][:20].decode("ascii", "replace")
        problem = f"rank {text!r} is not an integer from 0 to {MAX_RANKS}"
    else:
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            token = b""
        if token:
            return token, int(fields[1])
        problem = "the token is not (non-empty) base64"
    raise TokenizerError(f"tokenizer file {path}, line {number}: {problem}")


class TextStream:
    """Text of tokens as they come: the bytes of a character split over several tokens
    are held back until it is complete (bytes that never form one print as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids) -> str:
        return self.decoder.decode(b"".join(self.tokenizer.token_bytes(int(i)) for i in ids))

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)
