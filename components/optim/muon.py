"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer.

Muon (momentum, then orthogonalized by a Newton-Schulz iteration) updates the weights of the linear
layers inside the model. AdamW updates the rest: embedding tables, the output head (the layer the model's
get_output_embeddings() names; see muon_params), norms and biases. Muon's matrices and AdamW's
matrices take weight decay; tables, norms and biases do not.

Parameters sharded by FSDP2 (DTensor): orthogonalizing needs the whole matrix. The matrices are dealt
out over the ranks of the shard group: each is put together whole on one rank, orthogonalized there,
and its rows sent back (components/optim/sharded_orthogonalize.py). A single process, DDP and FSDP
therefore compute the same update, and each rank runs only its share of the iterations.

`adjust_lr = "match_rms_adamw"` scales each matrix's update to the RMS AdamW's would have
(0.2 * sqrt(max(rows, cols))), so one learning rate and weight decay serve both groups; "original"
scales by sqrt(max(1, rows / cols)), Muon's own convention, whose learning rates are tens of times
AdamW's: with it the one optimizer.lr suits one group or the other, not both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from components.optim.adamw import linear_matrices, param_groups as adamw_groups
from components.optim.sharded_orthogonalize import orthogonalize_each

# The quintic Newton-Schulz coefficients Muon is published with (steep at zero: few steps suffice).
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NORM_EPS = 1e-7


@dataclass
class MuonArgs:
    """Muon's own settings (lr, weight_decay, betas and eps are [optimizer]'s)."""

    momentum: float = field(default=0.95, metadata={"doc": "momentum of the Muon matrices' gradient average",
                                                    "gt": 0.0, "lt": 1.0})
    nesterov: bool = field(default=True, metadata={"doc": "use the Nesterov form of the momentum"})
    ns_steps: int = field(default=5, metadata={"doc": "Newton-Schulz iterations per update", "ge": 1, "le": 20})
    adjust_lr: str = field(
        default="match_rms_adamw",
        metadata={"doc": "scale of a matrix's update: match_rms_adamw (AdamW's RMS, so one lr serves both groups) "
                         "or original (sqrt(max(1, rows/cols)))", "choices": ("match_rms_adamw", "original")},
    )


def orthogonalized(update: torch.Tensor, steps: int) -> torch.Tensor:
    """An approximately orthogonal matrix with update's singular vectors, by a quintic Newton-Schulz
    iteration in bf16 (its singular values land near 1, not exactly on it, which training does not mind;
    bf16 keeps it within about 1.5% of the exact iteration)."""
    a, b, c = _NS_COEFFICIENTS
    x = update.to(torch.bfloat16)
    wide = x.shape[0] <= x.shape[1]
    if not wide:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=_NORM_EPS)
    for _ in range(steps):
        gram = x @ x.T
        # x <- a x + (b G + c G^2) x, each line one fused multiply-add (one bf16 rounding, not three)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x if wide else x.T


def _scale(adjust_lr: str, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon updates: linear layers' matrices (AdamW's decayed ones), except the output head.

    The head is the layer the model names with get_output_embeddings() (as transformers models do): a
    size cannot tell it apart, since a hidden layer may be as wide as the vocabulary. A model without that
    method has its head found by shape: a linear layer of exactly an embedding table's shape (V, dim)
    or its transpose."""
    named = getattr(model, "get_output_embeddings", None)
    if callable(named):
        head = named()
        heads = set() if head is None else {id(p) for p in head.parameters()}
        return [p for p in linear_matrices(model) if id(p) not in heads]
    tables = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)}
    tables |= {shape[::-1] for shape in tables}
    return [p for p in linear_matrices(model) if tuple(p.shape) not in tables]


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (one state dict, one LR schedule) over Muon's groups and AdamW's groups.

    AdamW's groups are stepped by torch's AdamW, pointed at this optimizer's groups and state each step
    (so a loaded state dict is the one it uses)."""

    def __init__(self, model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 args: MuonArgs):
        matrices = muon_params(model)
        taken = {id(p) for p in matrices}
        rest = [{**g, "params": [p for p in g["params"] if id(p) not in taken]}
                for g in adamw_groups(model, weight_decay)]
        rest = [g for g in rest if g["params"]]
        self._adamw = torch.optim.AdamW(rest, lr=lr, betas=tuple(betas), eps=eps, foreach=True) if rest else None
        groups = [{"params": matrices, "muon": True, "lr": lr, "weight_decay": weight_decay, "momentum": args.momentum,
                   "nesterov": args.nesterov, "ns_steps": args.ns_steps, "adjust_lr": args.adjust_lr}
                  ] if matrices else []
        groups += [{**g, "muon": False} for g in (self._adamw.param_groups if rest else [])]
        super().__init__(groups, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        adamw = [g for g in self.param_groups if not g["muon"]]
        if adamw:
            if getattr(self, "_adamw", None) is None:  # a copy (pickling keeps only groups and state)
                self._adamw = torch.optim.AdamW([{"params": g["params"]} for g in adamw], foreach=True)
            self._adamw.param_groups, self._adamw.state = adamw, self.state
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        momentum, lr = group["momentum"], group["lr"]
        params = [p for p in group["params"] if p.grad is not None]

        def update_of(i: int) -> torch.Tensor:  # called once per matrix, when its turn comes
            p = params[i]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            return p.grad.lerp(buf, momentum) if group["nesterov"] else buf

        def apply(i: int, step: torch.Tensor) -> None:
            p = params[i]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(step.to(p.dtype), alpha=-lr * _scale(group["adjust_lr"], p.shape))

        # Sharded matrices are dealt out over the ranks, each orthogonalized whole by one of them.
        orthogonalize_each([p.grad for p in params], update_of, lambda whole: orthogonalized(whole, group["ns_steps"]),
                           apply)


def build_muon(model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               args: MuonArgs) -> torch.optim.Optimizer:
    return MuonWithAdamW(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, args=args)
