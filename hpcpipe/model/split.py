"""A split of the model into pipeline stages, written as a string (parallel.layout), the way
Megatron's pipeline_parallel_layer_layout writes one:

    "E t t t | t t t t | t t t t L"     12 blocks on 3 stages: the embedding on the first,
                                        ln_f, the tied head and the loss on the last
    "E t t.attn | .mlp t t L"           a stage edge at block 2's seam, between its
                                        attention (ln_1, attn, residual) and its MLP

E is the embedding, L the final LayerNorm with the head and the loss, t a whole block;
`|` separates stages, listed in model order (model stage 0 first, whichever rank a
schedule places each on). A block may be cut at its seam only: `t.attn` ends a stage
with its attention half, and the next stage starts with `.mlp`, its MLP half. `t*4`
repeats a block and `(t t |)*3` a group; spaces and commas are cosmetic, so Megatron's
"Ettt|tttt|ttttL" reads the same. E opens the first stage, L closes the last, and every
stage holds at least half a block.
"""

from __future__ import annotations

import math
import re

from hpcpipe.model.stagespec import StageSpec

# The items, longest first (t.attn before t); one group (...)*N level is unrolled at a time.
_ITEM = re.compile(r"t\.attn|\.mlp|[ELt|()]|\*\d+|[\s,]+|.")
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT = re.compile(r"(t\.attn|\.mlp|[ELt])\*(\d+)")
MAX_TEXT = 4096  # (a config string's own bound)


class LayoutError(ValueError):
    """A layout string that is no split of this model."""


def parse(text: str, n_layer: int) -> list[StageSpec]:
    """The stages `text` spells, checked against a model of `n_layer` blocks."""
    stages = [_stage_items(s) for s in _unrolled(text).split("|")]
    _check(stages, n_layer)
    specs, block = [], 0
    for index, items in enumerate(stages):
        mlp_of = block - 1 if ".mlp" in items[:2] else None  # (the last stage's cut block)
        whole = items.count("t")
        attention_of = block + whole if items[-1] == "t.attn" else None
        specs.append(StageSpec(index=index, layers=tuple(range(block, block + whole)),
                               embedding_part=index == 0, head_part=index == len(stages) - 1,
                               mlp_of=mlp_of, attention_of=attention_of))
        block += whole + (attention_of is not None)
    return specs


def text(specs) -> str:
    """The layout string of `specs` (consecutive StageSpecs, model order): the inverse of
    `parse`, with every item spelt out ("E t t | t t L")."""
    return " | ".join(" ".join((["E"] if s.embedding_part else [])
                               + ([".mlp"] if s.mlp_of is not None else [])
                               + ["t"] * len(s.layers)
                               + (["t.attn"] if s.attention_of is not None else [])
                               + (["L"] if s.head_part else [])) for s in specs)


def from_counts(counts) -> str:
    """The layout string of blocks per stage as the retired parallel.layers_per_stage gave
    them (halves at seams: [1.5, 2.5]); LayoutError where one is no multiple of a half,
    below half a block, or leaves no stage (what that key allowed)."""
    halves = [2 * float(c) for c in counts]
    if not halves or any(not math.isfinite(h) or h < 1 or h != int(h) for h in halves):
        raise LayoutError(f"{list(counts)} is no list of whole or half blocks per stage")
    stages, position = [], 0
    for count in map(int, halves):
        end = position + count
        stages.append(" ".join(([".mlp"] if position % 2 else []) + ["t"] * (
            (end // 2) - (position + 1) // 2) + (["t.attn"] if end % 2 else [])))
        position = end
    if position % 2:
        raise LayoutError(f"{list(counts)} ends inside a block")
    stages[0] = f"E {stages[0]}"
    stages[-1] = f"{stages[-1]} L"
    return " | ".join(stages)


def _unrolled(text: str) -> str:
    """`text` with its repeats written out: (…)*N groups, innermost first, then X*N."""
    if len(text) > MAX_TEXT:
        raise LayoutError(f"is over {MAX_TEXT} characters")
    for pattern in (_GROUP, _REPEAT):
        while (match := pattern.search(text)) is not None:
            times = int(match.group(2))
            if times > 4 * MAX_TEXT:  # (more blocks than any config can hold)
                raise LayoutError(f"repeats {match.group(0)!r} {times} times")
            text = text[:match.start()] + " ".join([match.group(1)] * times) \
                + text[match.end():]
            if len(text) > 64 * MAX_TEXT:
                raise LayoutError("unrolls to more blocks than any model has")
    return text


def _stage_items(stage: str) -> list[str]:
    """The items of one stage's text, spaces and commas dropped."""
    items = []
    for token in _ITEM.findall(stage):
        if token.strip(" \t\n,") == "":
            continue
        if token not in ("E", "L", "t", "t.attn", ".mlp"):
            raise LayoutError(f"{token!r} is no item of a layout (E, t, t.attn, .mlp, L, "
                              f"| between stages, t*N or (…)*N to repeat)")
        items.append(token)
    return items


def _check(stages, n_layer: int):
    """The rules of the module's docstring, one message each."""
    items = [x for stage in stages for x in stage]
    if items.count("E") != 1 or stages[0][:1] != ["E"]:
        raise LayoutError("E (the embedding) opens the first stage, once")
    if items.count("L") != 1 or stages[-1][-1:] != ["L"]:
        raise LayoutError("L (ln_f, the head and the loss) closes the last stage, once")
    cut = []  # per stage: (starts with an MLP half, ends with an attention half)
    for s, stage in enumerate(stages):
        inner = [x for x in stage if x not in ("E", "L")]
        if not inner:
            raise LayoutError(f"stage {s} holds no block: every stage holds at least half "
                              f"of one (t, t.attn or .mlp)")
        if "t.attn" in inner[:-1] or ".mlp" in inner[1:] or stage[0] == "L" \
                or stage[-1] == "E":
            raise LayoutError(f"stage {s}: a block is cut only between stages, t.attn "
                              f"ending one and .mlp starting the next")
        cut.append((inner[0] == ".mlp", inner[-1] == "t.attn"))
    for s, ((starts, _), (_, ended)) in enumerate(zip(cut, [(False, False)] + cut[:-1])):
        if starts != ended or (s == len(cut) - 1 and cut[s][1]):
            raise LayoutError(f"at stage {s}: t.attn ends a stage exactly where .mlp starts "
                              f"the next (one block cut at its seam)")
    blocks = items.count("t") + items.count("t.attn")
    if blocks != n_layer:
        raise LayoutError(f"holds {blocks} blocks, and model.n_layer = {n_layer}")
