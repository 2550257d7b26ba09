"""Recipe arguments for the transformer language model and its NSA attention.

Plain dataclasses: every field carries a one-line doc and optional bounds/choices in its metadata,
and `check()` returns the cross-field problems as (field path, message with the fix).
`find_problems` applies both, so the model can be built safely without the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from components.nsa import available_backends




def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class NSAArgs:
    """Native Sparse Attention hyperparameters (NSA_SPEC.md names them l, d, l', n, w)."""

    block_size: int = field(
        default=32, metadata={"doc": "compression block length l (tokens per compressed key)", "ge": 1}
    )
    block_stride: int = field(
        default=16, metadata={"doc": "compression stride d between compression blocks", "ge": 1}
    )
    sel_block_size: int = field(
        default=64, metadata={"doc": "selection block length l' (tokens per selected block)", "ge": 1}
    )
    num_selected: int = field(
        default=16,
        metadata={"doc": "selected blocks n per query group, counting block 0 and the local ones", "ge": 1},
    )
    window_size: int = field(
        default=512, metadata={"doc": "sliding-window length w (keys t-w+1 .. t)", "ge": 1}
    )
    compress: str = field(
        default="mlp",
        metadata={
            "doc": "compression phi: 'mlp' (learned, with intra-block positions) or 'mean'",
            "choices": ("mlp", "mean"),
        },
    )
    kv_per_branch: bool = field(
        default=True,
        metadata={
            "doc": "own K/V projections per branch (cmp, sel, win); false shares one K/V by all three"
        },
    )
    gate: str = field(
        default="mlp",
        metadata={
            "doc": "branch gates: 'mlp' (dim -> dim/4 -> SiLU -> 3*heads) or 'linear', then sigmoid",
            "choices": ("mlp", "linear"),
        },
    )
    backend: str = field(
        default="reference",
        metadata={"doc": "NSA kernel backend; all compute the same result", "choices": available_backends},
    )

    def check(self) -> list[tuple[str, str]]:
        """NSA_SPEC's valid configs: d divides l, d divides l', l <= l'."""
        l, d, ls = self.block_size, self.block_stride, self.sel_block_size
        if min(l, d, ls) < 1:
            return []  # the per-field bounds report these
        problems = []
        if l % d:
            problems.append((
                "block_stride",
                f"block_stride ({d}) must divide block_size ({l}); "
                f"use one of {_divisors(l)} or change block_size to a multiple of {d}",
            ))
        if ls % d:
            problems.append((
                "block_stride",
                f"block_stride ({d}) must divide sel_block_size ({ls}); "
                f"use one of {_divisors(ls)} or change sel_block_size to a multiple of {d}",
            ))
        if l > ls:
            problems.append((
                "sel_block_size",
                f"sel_block_size ({ls}) must be >= block_size ({l}); "
                f"raise sel_block_size to {l} or more, or lower block_size",
            ))
        return problems


@dataclass
class TransformerArgs:
    """A pre-norm decoder-only transformer; `attention` is the only switch between NSA and dense."""

    dim: int = field(default=256, metadata={"doc": "model width (residual stream size)", "ge": 2})
    n_layers: int = field(default=4, metadata={"doc": "number of transformer blocks", "ge": 1})
    n_heads: int = field(default=4, metadata={"doc": "query heads per attention layer", "ge": 1})
    n_kv_heads: int = field(
        default=2, metadata={"doc": "key/value heads (GQA groups); must divide n_heads", "ge": 1}
    )
    mlp_ratio: float = field(
        default=4.0,
        metadata={
            "doc": "SwiGLU hidden = round_up(2/3 * mlp_ratio * dim, multiple_of) (LLaMA convention)",
            "gt": 0,
        },
    )
    multiple_of: int = field(
        default=64, metadata={"doc": "round the SwiGLU hidden size up to a multiple of this", "ge": 1}
    )
    norm_eps: float = field(default=1e-5, metadata={"doc": "RMSNorm epsilon", "gt": 0})
    rope_theta: float = field(default=10000.0, metadata={"doc": "RoPE base frequency", "gt": 0})
    max_seq_len: int = field(
        default=2048,
        metadata={"doc": "longest sequence (RoPE table and KV-cache capacity)", "ge": 1},
    )
    attention: str = field(
        default="nsa",
        metadata={"doc": "attention kind: 'nsa' (sparse) or 'dense' (causal SDPA)", "choices": ("nsa", "dense")},
    )
    nsa: NSAArgs = field(
        default_factory=NSAArgs,
        metadata={"doc": "NSA hyperparameters (used when attention = 'nsa')", "used_when": ("attention", "nsa")},
    )
    tie_embeddings: bool = field(
        default=False, metadata={"doc": "share the token embedding with the output projection"}
    )
    init_std: float = field(
        default=0.02,
        metadata={"doc": "std of the normal init; output projections use init_std/sqrt(2*n_layers)", "gt": 0},
    )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def mlp_hidden_dim(self) -> int:
        hidden = int(2 * self.mlp_ratio * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.n_heads >= 1 and self.dim % self.n_heads:
            ok = [h for h in _divisors(self.dim) if h <= 64 and (self.dim // h) % 2 == 0]
            problems.append((
                "n_heads",
                f"n_heads ({self.n_heads}) must divide dim ({self.dim}); use one of {ok} or change dim",
            ))
        elif self.n_heads >= 1 and self.head_dim % 2:
            problems.append((
                "n_heads",
                f"head dim dim/n_heads = {self.head_dim} must be even for RoPE; "
                f"pick n_heads so that dim/n_heads is even",
            ))
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            problems.append((
                "n_kv_heads",
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}); "
                f"use one of {_divisors(max(self.n_heads, 1))}",
            ))
        # nsa.check() runs on its own (find_problems and the engine visit every nested dataclass)
        if self.attention == "dense" and self.nsa != NSAArgs():
            problems.append((
                "nsa",
                "nsa settings are given but attention = 'dense' ignores them; "
                "remove the nsa section or set attention = 'nsa'",
            ))
        return problems


def find_problems(args, prefix: str = "") -> list[tuple[str, str]]:
    """Every bound/choice violation and every `check()` problem of a (nested) args dataclass."""
    problems, nested = [], []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        path = prefix + f.name
        if dataclasses.is_dataclass(value):
            nested += find_problems(value, path + ".")
            continue
        meta = f.metadata
        choices = meta.get("choices")
        choices = choices() if callable(choices) else choices
        if choices is not None and value not in choices:
            problems.append((path, f"{value!r} is not one of {list(choices)}; pick one of those"))
        if "ge" in meta and value < meta["ge"]:
            problems.append((path, f"{value!r} must be >= {meta['ge']}; raise it"))
        if "gt" in meta and value <= meta["gt"]:
            problems.append((path, f"{value!r} must be > {meta['gt']}; raise it"))
        if "le" in meta and value > meta["le"]:
            problems.append((path, f"{value!r} must be <= {meta['le']}; lower it"))
    if not problems and hasattr(args, "check"):  # cross-field rules assume in-bounds fields
        problems += [(prefix + path, msg) for path, msg in args.check()]
    return problems + nested
