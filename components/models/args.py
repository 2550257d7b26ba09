"""Recipe arguments for the transformer language model and its NSA attention.

Plain dataclasses: every field carries a one-line doc and optional bounds/choices in its metadata,
and `check()` returns the cross-field problems as records (components.problems.Problem).
`find_problems` applies both, so the model can be built safely without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from components.errors import UserError
from components.nsa import available_backends, get_backend
from components.nsa.hyperparams import divisors, hyperparameter_problems
from components.problems import Problem, find_problems, problem

__all__ = ["NSAArgs", "TransformerArgs", "find_problems"]


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
        metadata={"doc": "selected blocks n per query group, counting block 0 and the local ones", "ge": 1,
                  "keeps_weights": True},
    )
    window_size: int = field(
        default=512, metadata={"doc": "sliding-window length w (keys t-w+1 .. t)", "ge": 1, "keeps_weights": True}
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
        metadata={"doc": "NSA kernel backend; all compute the same result", "choices": available_backends,
                  "keeps_weights": True},
    )

    def check(self) -> list[Problem]:
        """NSA_SPEC's valid configurations (components/nsa/hyperparams.py states the rules)."""
        return hyperparameter_problems(self.block_size, self.block_stride, self.sel_block_size, self.num_selected,
                                       self.window_size)


@dataclass
class TransformerArgs:
    """A pre-norm decoder-only transformer; `attention` is the only switch between NSA and dense.

    keeps_weights (metadata): a run may start from weights trained with another value of the field
    (checkpoint.initial_load_path) or resume a checkpoint trained with one, whose weights would still
    mean what they meant; any other model field must equal the weights' own."""

    dim: int = field(default=256, metadata={"doc": "model width (residual stream size)", "ge": 2})
    n_layers: int = field(default=4, metadata={"doc": "number of transformer blocks", "ge": 1})
    n_heads: int = field(default=4, metadata={"doc": "query heads per attention layer; the head dim is dim / n_heads, "
                                                     "a whole even number (RoPE rotates pairs)", "ge": 1})
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
    rope_theta: float = field(default=10000.0, metadata={"doc": "RoPE base frequency", "gt": 0, "keeps_weights": True})
    max_seq_len: int = field(
        default=2048,
        metadata={"doc": "longest sequence (RoPE table and KV-cache capacity)", "ge": 1, "keeps_weights": True},
    )
    attention: str = field(
        default="nsa",
        metadata={"doc": "attention kind: 'nsa' (sparse) or 'dense' (causal SDPA)", "choices": ("nsa", "dense")},
    )
    nsa: NSAArgs = field(
        default_factory=NSAArgs,
        metadata={"doc": "NSA hyperparameters (used when attention = 'nsa')", "used_when": ("attention", "nsa")},
    )
    document_masking: bool = field(
        default=False,
        metadata={"doc": "attend within documents only: each packed document is computed as if alone, its "
                         "positions from its start (NSA_SPEC.md section 4); false lets attention cross document "
                         "boundaries inside a row", "keeps_weights": True},
    )
    tie_embeddings: bool = field(
        default=False, metadata={"doc": "share the token embedding with the output projection"}
    )
    init_std: float = field(
        default=0.02,
        metadata={"doc": "std of the normal init; output projections use init_std/sqrt(2*n_layers)", "gt": 0,
                  "keeps_weights": True},
    )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def slots_used(self) -> int:
        """The selection slots a row can fill: nsa.num_selected, at most ceil(max_seq_len / sel_block_size)
        (more slots stay unused, -1, so the op is not asked for them: the same function for less work)."""
        return self._slots_in(self.max_seq_len)

    def _slots_in(self, T: int) -> int:
        """The selection slots a row of T tokens can fill."""
        return min(self.nsa.num_selected, -(-T // self.nsa.sel_block_size))

    def mlp_hidden_dim(self) -> int:
        hidden = int(2 * self.mlp_ratio * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)

    def notes(self) -> list[str]:
        """Legal NSA shapes in which a branch, or the choice by score, can never act (each text starts with the
        field it is about, relative to this table)."""
        return self._shape_notes(self.max_seq_len, "max_seq_len")

    def row_notes(self, seq_len: int) -> list[str]:
        """What training rows of seq_len tokens, shorter than max_seq_len, add to notes(): a branch that cannot
        act within such a row (a long-context model's recipe scaled down with training.seq_len alone)."""
        if seq_len >= self.max_seq_len:
            return []
        said = {note.split(" ", 1)[0] for note in self.notes()}
        return [note for note in self._shape_notes(seq_len, "training.seq_len") if note.split(" ", 1)[0] not in said]

    def _shape_notes(self, T: int, length: str) -> list[str]:
        """notes() for rows of T tokens, named `length` in the texts."""
        if self.attention != "nsa" or find_problems(self.nsa):
            return []
        nsa, said = self.nsa, []
        slots = self._slots_in(T)
        if nsa.block_size > T:
            said.append(f"nsa.block_size = {nsa.block_size} is more than {length} = {T}: no row holds a compressed "
                        f"block, so the compressed branch and its compression weights never act, and selection "
                        f"keeps only its forced blocks")
        elif nsa.num_selected <= 3:
            said.append(f"nsa.num_selected = {nsa.num_selected}: the blocks always selected (the current one, block 0, "
                        f"the previous one) fill every slot, so no block is ever chosen by its score")
        elif nsa.num_selected > slots:
            said.append(f"nsa.num_selected = {nsa.num_selected}: a row of {length} = {T} tokens holds at most "
                        f"{slots} selection blocks of {nsa.sel_block_size}, so the selected branch attends "
                        f"to all of a row's past and the slots beyond those stay unused")
        if nsa.window_size >= T:
            said.append(f"nsa.window_size = {nsa.window_size} is at least {length} = {T}: the sliding-window branch "
                        f"is full causal attention")
        return said

    def check(self) -> list[Problem]:
        problems = []
        if self.n_heads >= 1 and self.dim % self.n_heads:
            ok = [h for h in divisors(self.dim) if h <= 64 and (self.dim // h) % 2 == 0]
            step = 2 * self.n_heads  # an even head dim: RoPE rotates pairs
            near = sorted({max(step, self.dim // step * step), -(-self.dim // step) * step})
            fix = f"use one of {ok} or change dim" if ok else \
                f"change dim to a multiple of 2 x n_heads (an even head dim), e.g. {' or '.join(map(str, near))}"
            problems.append(problem("n_heads", self.n_heads, f"must divide dim ({self.dim})", fix))
        elif self.n_heads >= 1 and self.head_dim % 2:
            problems.append(problem("n_heads", self.n_heads, f"gives head dim dim/n_heads = {self.head_dim}, "
                                    "which must be even for RoPE", "pick n_heads so that dim/n_heads is even"))
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            problems.append(problem("n_kv_heads", self.n_kv_heads, f"must divide n_heads ({self.n_heads})",
                                    f"use one of {divisors(max(self.n_heads, 1))}"))
        limit = _max_head_dim(self.nsa.backend) if self.attention == "nsa" else None
        if limit is not None and self.n_heads >= 1 and self.head_dim > limit:
            fewest = -(-self.dim // limit)
            problems.append(problem("n_heads", self.n_heads, f"gives head dim dim/n_heads = {self.head_dim}, above "
                                    f"the {limit} NSA backend {self.nsa.backend!r} supports",
                                    f"use at least {fewest} heads (or a smaller dim), or backend 'reference'"))
        # nsa.check() runs on its own (find_problems and the engine visit every nested dataclass)
        if self.attention == "dense" and self.nsa != NSAArgs():
            problems.append(problem("nsa", None, "nsa settings are given but attention = 'dense' ignores them",
                                    "remove the nsa section or set attention = 'nsa'"))
        return problems


def _max_head_dim(backend: str) -> int | None:
    try:
        return get_backend(backend).max_head_dim
    except UserError:  # an unknown name is refused on its own field
        return None
