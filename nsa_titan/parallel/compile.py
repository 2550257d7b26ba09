"""torch.compile each transformer block in place.

`module.compile()` keeps the module object and its parameter names, so state dicts carry no
`_orig_mod` prefix and checkpoints load whether or not compile was on.
"""

from __future__ import annotations

from torch import nn


def compile_blocks(blocks: nn.ModuleList, *, fullgraph: bool, backend: str) -> None:
    for block in blocks:
        block.compile(fullgraph=fullgraph, backend=backend)
