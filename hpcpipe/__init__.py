"""hpcpipe: pipeline-parallel GPT training over MPI, with hand-written layers.

The public API is small and stable:

    from hpcpipe import GPTConfig, GPT
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32),
                dtype="float64", seed=0)
    loss, grads = model.loss_and_grads(idx, targets)

    from hpcpipe import Llama, LlamaConfig          # the Llama family, Hugging Face's names
    model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    model = hpcpipe.load_model("runs/smollm2")      # a checkpoint's model, either family

Names are resolved lazily so that `python -m hpcpipe schedule ...` and the schedule
tools never import the numerical stack.
"""

__version__ = "0.1.0"
__all__ = ["GPTConfig", "GPT", "Llama", "LlamaConfig", "load_model", "__version__"]


def __getattr__(name):
    if name in ("GPTConfig", "GPT", "Llama", "LlamaConfig"):
        from hpcpipe import model

        return getattr(model, name)
    if name == "load_model":
        from hpcpipe.checkpoint.weights import load_model

        return load_model
    raise AttributeError(f"module 'hpcpipe' has no attribute {name!r}")
