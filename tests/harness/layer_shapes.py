"""The small shapes the layer tests share (the finite-difference tests on the CPU, the
device tests against NumPy, the fused kernels' tests): batch, time, channels, heads,
vocabulary, and each layer's parameter shapes under its GPT-2 names (`shapes(C)` for
another width: the flash kernel needs a head size of 32 at least)."""

B, T, C, NH, V = 2, 5, 8, 2, 11


def shapes(c: int) -> dict:
    """name -> parameter shapes of each layer at width `c`."""
    layernorm = {"weight": (c,), "bias": (c,)}
    attention = {"c_attn.weight": (c, 3 * c), "c_attn.bias": (3 * c,),
                 "c_proj.weight": (c, c), "c_proj.bias": (c,)}
    mlp = {"c_fc.weight": (c, 4 * c), "c_fc.bias": (4 * c,),
           "c_proj.weight": (4 * c, c), "c_proj.bias": (c,)}
    block = {**{"ln_1." + k: v for k, v in layernorm.items()},
             **{"attn." + k: v for k, v in attention.items()},
             **{"ln_2." + k: v for k, v in layernorm.items()},
             **{"mlp." + k: v for k, v in mlp.items()}}
    return {"linear": {"weight": (c, 3 * c), "bias": (3 * c,)}, "layernorm": layernorm,
            "attention": attention, "mlp": mlp, "block": block}


_AT_C = shapes(C)
LINEAR, LAYERNORM = _AT_C["linear"], _AT_C["layernorm"]
ATTENTION, MLP, BLOCK = _AT_C["attention"], _AT_C["mlp"], _AT_C["block"]
