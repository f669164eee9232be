"""[model]: the checks of a model's shape as a config gives it (the section is the model's
own shape type, GPTConfig: hpcpipe/model/layout.py), before a GPTConfig is made of it —
each a ConfigError naming the file and the key."""

from __future__ import annotations

import types

from hpcpipe.model.layout import GPT2_VOCAB, GPT2_VOCAB_MULTIPLE, family_problem
from hpcpipe.util.sections import at_least, require

# Ten times the deepest GPTs trained: the balanced split of blocks over stages (and its
# re-planning for the smallest change that fits) takes time that grows as n_layer² or more.
MAX_LAYERS = 1024


def prepared(values: dict) -> dict:
    """A [model] table's values as the section takes them: GPT-2's vocabulary padded to
    its multiple unless the table says otherwise."""
    if (values.get("vocab_size") == GPT2_VOCAB and "vocab_multiple" not in values
            and values.get("arch", "gpt2") == "gpt2"):
        return {**values, "vocab_multiple": GPT2_VOCAB_MULTIPLE}  # aligned unless it says
    return values


def validate(source: str, model: dict):
    """`model`: every field of the section (defaults filled in), by name."""
    at_least(source, "model", model, ("n_layer", "n_head", "n_embd", "block_size",
                                      "vocab_size", "vocab_multiple"), 1)
    require(source, "model.n_layer", model["n_layer"], model["n_layer"] <= MAX_LAYERS,
            f"must be at most {MAX_LAYERS} transformer blocks (ten times the deepest GPTs; "
            f"planning the stages' split takes time that grows as n_layer²)")
    n_embd, n_head = model["n_embd"], model["n_head"]
    require(source, "model.n_embd", n_embd, n_embd % n_head == 0,
            f"must be divisible by model.n_head = {n_head} (each head gets n_embd/n_head "
            f"channels); e.g. {n_head * max(1, round(n_embd / n_head))}")
    problem = family_problem(types.SimpleNamespace(**model))
    if problem is not None:
        require(source, f"model.{problem[0]}", problem[1], False, problem[2])
