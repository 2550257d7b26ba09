"""AdamW with weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn


def linear_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weight matrices of linear layers, except a weight tied to an embedding table."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    found = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return [p for key, p in found.items() if key not in embedding_params and p.requires_grad]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay the weight matrices of linear layers; never norms, biases, embedding tables or other
    learned tables (e.g. position embeddings).

    Embeddings are excluded because decay pulls rarely seen tokens' rows to zero. A weight tied to
    an embedding is not decayed either.
    """
    matrices = {id(p) for p in linear_matrices(model)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if id(param) in matrices:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                weight_decay: float) -> torch.optim.Optimizer:
    # foreach is the fast path on every device and works with DTensor parameters.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps,
                             foreach=True)
