"""Which part of the model a pipeline stage holds (StageSpec), as a layout string spells
it (model/split.py), and the stage of either family it builds: stage.Stage for GPT-2,
llama_stage.LlamaStage for a Llama (model/family.py decides)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcpipe.model import family
from hpcpipe.model.layout import GPTConfig
from hpcpipe.schedules.recompute import StageRecompute


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model one pipeline stage holds: the embedding, block `mlp_of`'s
    MLP half, the whole `layers`, block `attention_of`'s attention half, the head (each
    optional; model/units.py)."""

    index: int
    layers: tuple[int, ...]
    embedding_part: bool
    head_part: bool
    mlp_of: int | None = None
    attention_of: int | None = None

    @property
    def blocks(self) -> float:
        """How many blocks it holds, a half counting 0.5."""
        halves = (self.mlp_of is not None) + (self.attention_of is not None)
        return len(self.layers) + 0.5 * halves

    def param_layout(self, cfg: GPTConfig):
        """(name, shape) of the tensors the stage holds, in its family's names
        (layout.param_layout, llama_layout.param_layout)."""
        return family.stage_layout(cfg, self.layers, self.embedding_part, self.head_part,
                                   self.mlp_of, self.attention_of)

    def build(self, cfg: GPTConfig, dtype="float32", seed=0, be=None, tp=None,
              recompute: StageRecompute = StageRecompute()):
        """The stage of `cfg`'s family (a Stage, or a LlamaStage) this spec describes."""
        return family.stage_class(cfg)(
            cfg, layers=self.layers, embedding_part=self.embedding_part,
            head_part=self.head_part, dtype=dtype, seed=seed, be=be, tp=tp,
            recompute=recompute, mlp_of=self.mlp_of, attention_of=self.attention_of)

    def describe(self) -> str:
        parts = (["embedding"] if self.embedding_part else []) + (
            [f"block {self.mlp_of}'s MLP"] if self.mlp_of is not None else []) + (
            [f"blocks {self.layers[0]}–{self.layers[-1]}" if len(self.layers) > 1
             else f"block {self.layers[0]}"] if self.layers else []) + (
            [f"block {self.attention_of}'s attention"] if self.attention_of is not None
            else []) + (["head"] if self.head_part else [])
        return " + ".join(parts)


def seams(specs) -> list[int] | None:
    """The blocks a stage edge cuts at their seam (a checkpoint's layout records them beside
    the whole blocks per stage), or None: none."""
    return sorted(s.attention_of for s in specs if s.attention_of is not None) or None
