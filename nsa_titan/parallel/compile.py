"""torch.compile each block (the model part's plan names them) in place.

`module.compile()` keeps the module object and its parameter names, so state dicts carry no
`_orig_mod` prefix and checkpoints load whether or not compile was on.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn


def compile_blocks(blocks: Sequence[nn.Module], *, fullgraph: bool, backend, mode: str = "default") -> None:
    """backend: a name, or a callable (inspect's recorder, which applies the mode itself)."""
    options = {} if mode == "default" or callable(backend) else {"mode": mode}
    for block in blocks:
        block.compile(fullgraph=fullgraph, backend=backend, **options)


def compile_counters() -> dict[str, int]:
    """Graphs Dynamo has captured in this process so far, and the graph breaks it met. Logged with
    each step: a count that grows after the first step is a recompile (a new shape, a failed guard)."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
