"""The small shapes the layer tests share (the finite-difference tests on the CPU and the
device tests against NumPy): batch, time, channels, heads, vocabulary, and each layer's
parameter shapes under its GPT-2 names."""

B, T, C, NH, V = 2, 5, 8, 2, 11

LINEAR = {"weight": (C, 3 * C), "bias": (3 * C,)}
LAYERNORM = {"weight": (C,), "bias": (C,)}
ATTENTION = {"c_attn.weight": (C, 3 * C), "c_attn.bias": (3 * C,),
             "c_proj.weight": (C, C), "c_proj.bias": (C,)}
MLP = {"c_fc.weight": (C, 4 * C), "c_fc.bias": (4 * C,),
       "c_proj.weight": (4 * C, C), "c_proj.bias": (C,)}
BLOCK = {**{"ln_1." + k: v for k, v in LAYERNORM.items()},
         **{"attn." + k: v for k, v in ATTENTION.items()},
         **{"ln_2." + k: v for k, v in LAYERNORM.items()},
         **{"mlp." + k: v for k, v in MLP.items()}}
