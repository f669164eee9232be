"""The reference GPT in PyTorch eager, for `bench step`: hpcpipe's model in `torch.nn`.

The same architecture as hpcpipe.model.layers — pre-LayerNorm blocks (eps 1e-5), GPT-2's fused
qkv projection, causal attention scaled by 1/sqrt(HS), tanh-GELU, the head tied to `wte`,
mean cross-entropy — written the way a PyTorch user would (nanoGPT's shape), with
`scaled_dot_product_attention` for the attention core. Modules are named so that every
parameter is hpcpipe's GPT-2 name plus ".weight"/".bias" where PyTorch adds it.

Imported only when torch is installed (the optional `bench` extra); hpcpipe never needs
it to train or to test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LN_EPS = 1e-5


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        NH = self.n_head
        # (B, T, 3C) -> three (B, NH, T, HS): q, k, v side by side, heads within each.
        q, k, v = self.c_attn(x).view(B, T, 3, NH, C // NH).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(HS)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=LN_EPS)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=LN_EPS)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """GPT-2 in torch.nn; `load_hpcpipe(params)` copies an hpcpipe model's weights in."""

    def __init__(self, cfg):
        super().__init__()
        # the padded rows too, unmasked (nanoGPT's 50304): PyTorch at its fastest
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)

    def forward(self, idx, targets):
        """Mean cross-entropy of idx → targets, both (B, T) int64."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head, (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    @torch.no_grad()
    def load_hpcpipe(self, params: dict):
        """Copy hpcpipe parameters (GPT-2 names, host arrays) into this model.

        GPT-2 stores linear weights (in, out) for y = x @ W; nn.Linear stores (out, in) for
        y = x @ W^T, so those are transposed. Every parameter must be matched.
        """
        def torch_layout(name, value):
            source = torch.as_tensor(value)
            return source.T if source.ndim == 2 and name not in ("wte", "wpe") else source

        copy_checked(dict(self.named_parameters()), "TorchGPT",
                     ((name, name if name.endswith((".weight", ".bias")) else name + ".weight",
                       torch_layout(name, value)) for name, value in params.items()))


@torch.no_grad()
def copy_checked(mine: dict, model: str, sources) -> None:
    """Copy each (hpcpipe name, torch name, tensor in torch's layout) of `sources` into the
    parameter of that torch name in `mine` (name → parameter, emptied as it goes): every
    name must be there and every shape fit, and no parameter of `model` may be left over."""
    for name, key, source in sources:
        target = mine.pop(key, None)
        if target is None:
            raise ValueError(f"{name}: no such parameter in {model}")
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"{name}: hpcpipe shape {tuple(source.shape)} does not fit "
                             f"torch's {tuple(target.shape)}")
        target.copy_(source)
    if mine:
        raise ValueError(f"torch parameters with no hpcpipe counterpart: {sorted(mine)}")


def adamw(model: TorchGPT, lr, beta1, beta2, eps, weight_decay):
    """torch's AdamW over the model, weight decay on matrices only (as hpcpipe.optim.adamw),
    fused where this torch and device support it, else the foreach implementation."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (RuntimeError, ValueError):  # fused not built for this device or dtype
        return torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
