"""A model's family — GPT-2 or Llama (model.arch) — and what depends on it alone: the
whole model's parameter layout, its tensor count, and the one-process model class.
Callers that take either family (checkpoints, generation, `hpcpipe.load_model`) ask
here rather than test the arch themselves."""

from __future__ import annotations

from hpcpipe.model import layout, llama_layout


def is_llama(cfg) -> bool:
    return cfg.arch == "llama"


def param_layout(cfg) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of the whole model, in its family's order and
    names (GPT-2's; Hugging Face's for a Llama)."""
    return llama_layout.param_layout(cfg) if is_llama(cfg) else layout.param_layout(cfg)


def tensor_count(cfg) -> int:
    """How many tensors the whole model has, from its shape alone (before a layout is
    built: a hostile manifest's n_layer must not make one huge)."""
    return llama_layout.tensor_count(cfg) if is_llama(cfg) else 12 * cfg.n_layer + 4


def model_class(cfg):
    """The one-process model of `cfg`'s family: GPT or Llama."""
    from hpcpipe.model.gpt import GPT
    from hpcpipe.model.llama import Llama

    return Llama if is_llama(cfg) else GPT


def embedding_name(cfg) -> str:
    """The token embedding's tensor: "wte", or Hugging Face's embed_tokens."""
    return llama_layout.EMBED if is_llama(cfg) else "wte"


def stage_layout(cfg, layers, embedding_part, head_part, mlp_of=None, attention_of=None):
    """(name, shape) of the tensors a stage holds: blocks `layers`, block `mlp_of`'s MLP
    half and `attention_of`'s attention half (model/units.py), the embedding and head."""
    if is_llama(cfg):
        seam = lambda block: None if block is None else (block, llama_layout.SEAM)
        return llama_layout.param_layout(cfg, layers, embedding_part, head_part,
                                         seam(mlp_of), seam(attention_of))
    return layout.param_layout(cfg, layers, embedding_part, head_part, mlp_of, attention_of)


def stage_class(cfg):
    """The stage of `cfg`'s family: stage.Stage or llama_stage.LlamaStage (the same
    constructor arguments)."""
    from hpcpipe.model.llama_stage import LlamaStage
    from hpcpipe.model.stage import Stage

    return LlamaStage if is_llama(cfg) else Stage


def tied_name(cfg) -> str | None:
    """The tensor both the first and the last stage hold, whose gradient the pipeline
    sums across them: the tied embedding's — None where the head is untied."""
    if not is_llama(cfg):
        return "wte"
    return llama_layout.EMBED if cfg.tie_word_embeddings else None
