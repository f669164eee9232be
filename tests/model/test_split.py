"""Stage layouts as strings (model/split.py): what they spell, what they refuse, and the
printed form that reads back as itself."""

import re

import pytest

from hpcpipe.model.split import LayoutError, from_counts, parse, text


def shape(specs):
    """Per stage: (MLP half of, whole blocks, attention half of, embedding, head)."""
    return [(s.mlp_of, s.layers, s.attention_of, s.embedding_part, s.head_part) for s in specs]


def test_whole_blocks_and_a_seam():
    assert shape(parse("E t t t | t t t t | t t t t L", 11)) == [
        (None, (0, 1, 2), None, True, False), (None, (3, 4, 5, 6), None, False, False),
        (None, (7, 8, 9, 10), None, False, True)]
    # block 2 cut at its seam: its attention half ends stage 0, its MLP half starts stage 1
    assert shape(parse("E t t t.attn | .mlp t L", 4)) == [
        (None, (0, 1), 2, True, False), (2, (3,), None, False, True)]
    # a stage of one block's MLP half and the next one's attention half
    assert shape(parse("E t.attn | .mlp t.attn | .mlp L", 2)) == [
        (None, (), 0, True, False), (0, (), 1, False, False), (1, (), None, False, True)]


@pytest.mark.parametrize("written, printed", [
    ("Ettt|tttt|ttttL", "E t t t | t t t t | t t t t L"),  # Megatron's compact spelling
    ("E t*3 | (t t |)*2 t t L", "E t t t | t t | t t | t t L"),  # repeats
    ("E, t, t.attn | .mlp, t L", "E t t.attn | .mlp t L"),  # commas are cosmetic
])
def test_spellings_print_as_one_form_that_reads_back(written, printed):
    blocks = printed.split().count("t") + printed.split().count("t.attn")
    specs = parse(written, blocks)
    assert text(specs) == printed and parse(printed, blocks) == specs


@pytest.mark.parametrize("layout, blocks, message", [
    ("t t | t L", 3, "E (the embedding) opens the first stage"),
    ("E t | t", 2, "L (ln_f, the head and the loss) closes the last stage"),
    ("E t L | t", 2, "L (ln_f, the head and the loss) closes the last stage"),
    ("E t | | t L", 2, "stage 1 holds no block"),
    ("E | t t L", 2, "stage 0 holds no block"),
    ("E t.attn | t L", 2, "t.attn ends a stage exactly where .mlp starts"),
    ("E t | .mlp t L", 2, "t.attn ends a stage exactly where .mlp starts"),
    ("E t t.attn t | .mlp L", 3, "a block is cut only between stages"),
    ("E t x | t L", 2, "'x' is no item of a layout"),
    ("E t t | t L", 4, "holds 3 blocks, and model.n_layer = 4"),
    ("E t*99999999 L", 4, "repeats"),
])
def test_what_is_no_split_of_the_model_is_refused_by_name(layout, blocks, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        parse(layout, blocks)


def test_the_old_counts_as_a_layout():
    """parallel.layers_per_stage's counts (whole blocks; halves at seams), for the message
    that maps or refuses them (config.py)."""
    assert from_counts([2, 2]) == "E t t | t t L"
    assert from_counts([4.0]) == "E t t t t L"
    assert from_counts([1.5, 0.5, 2]) == "E t t.attn | .mlp | t t L"
    for bad in ([1.25, 2.75], [0, 4], [1.5], [], [float("inf"), 2], [float("nan"), 2]):
        with pytest.raises(LayoutError):
            from_counts(bad)
