"""The model: GPT-2's and the Llama family's parameters and layers, and the slices of
them that stages hold.

Owns: the parameter layout under GPT-2's names and its flat buffers (`layout`), the
hand-written layers with their F, B and W (`layers/`), a stage — a contiguous slice of
the model — and its per-microbatch stash (`stage`, `stash`), which part of the model a
pipeline stage holds, built for either family (`stagespec`), the whole model on one process
(`gpt`, the public API), which part of a tensor a tensor-parallel shard holds
(`sharding`), incremental decoding (`kvcache`) and sampling with it (`sampler`), the
FLOPs of a step (`flops`) and the activation bytes a stage holds per microbatch, with
recomputation (`memory`). The Llama family (model.arch = "llama"): its parameters under
Hugging Face's names (`llama_layout`), its stage (`llama_stage`, a `stage.Stage` with the
Llama's layers) and the whole model
(`llama`, the public `Llama`).

May import: `device`, `util`. Never MPI or `parallel`: a layer that needs a collective
(tensor parallelism's sums, the sharded loss's max) calls the object it is given.
"""

from hpcpipe.model.gpt import GPT
from hpcpipe.model.layout import FlatBuffer, GPTConfig, block_layout, param_layout
from hpcpipe.model.llama import Llama
from hpcpipe.model.llama_layout import LlamaConfig
from hpcpipe.model.stage import Stage

__all__ = ["GPT", "GPTConfig", "FlatBuffer", "Llama", "LlamaConfig", "Stage", "block_layout",
           "param_layout"]
