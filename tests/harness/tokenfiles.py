"""Token files of other projects, written as those projects write them: llm.c shards
(a 256 × int32 header: magic, version, token count; then the tokens) and nanoGPT's raw
uint16 train.bin / val.bin."""

import numpy as np

LLMC_GPT2 = 20240520


def llmc_bytes(tokens, magic=LLMC_GPT2, version=1, count=None, dtype="<u2") -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def write_llmc(path, tokens, **fields):
    path.write_bytes(llmc_bytes(tokens, **fields))
    return path


def write_nanogpt(path, tokens):
    path.write_bytes(np.asarray(tokens, dtype="<u2").tobytes())
    return path


def gpt2_tokens(n: int, seed: int) -> np.ndarray:
    """n token ids of GPT-2's vocabulary, each document starting with <|endoftext|> (50256)
    as llm.c's shards do."""
    tokens = np.random.default_rng(seed).integers(0, 50256, size=n)
    tokens[::97] = 50256
    return tokens.astype(np.uint16)


def write_tiktoken(path, merges=(b"de", b"def", b" m", b"ai", b"ain", b"\n\n")):
    """A small byte-level BPE in tiktoken's file format: the 256 bytes, then `merges`
    (each the concatenation of two earlier tokens) ranked in order."""
    import base64

    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                            for rank, t in enumerate(tokens)))
    return path


def write_llmc_evalfile(path, examples):
    """An llm.c evaluation file as dev/data/data_common.py's write_evalfile writes one: the
    256-word header (magic 20240522, version 1, examples, longest example in bytes), then
    each example as uint16 words opened by 2**16 - 1."""
    stream = []
    for words in examples:
        stream += [2**16 - 1, 2 * (len(words) + 2), *words]
    header = np.zeros(256, dtype="<i4")
    header[:4] = 20240522, 1, len(examples), max(2 * (len(w) + 2) for w in examples)
    path.write_bytes(header.tobytes() + np.asarray(stream, dtype="<u2").tobytes())
    return path


def write_tokenizer_json(path, vocab: int = 259):
    """A Hugging Face tokenizer.json of a byte-level BPE of `vocab` tokens (the tokenizers
    package's format, as a Llama's model folder carries one): <|endoftext|> (id 0, a
    special token), the 256 bytes, a few merges."""
    import json

    from harness.ggufmodel import byte_vocabulary

    tokens, merges, _ = byte_vocabulary(vocab)
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}
    data = {"version": "1.0", "added_tokens": [
        {"id": 0, "content": tokens[0], "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": level, "post_processor": None,
        "decoder": {**level, "add_prefix_space": True},
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": merges}}
    path.write_text(json.dumps(data))
    return path
