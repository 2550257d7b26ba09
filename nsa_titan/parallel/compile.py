"""torch.compile each block (the model part's plan names them) in place.

`module.compile()` keeps the module object and its parameter names, so state dicts carry no
`_orig_mod` prefix and checkpoints load whether or not compile was on.
"""

from __future__ import annotations

import sys
from typing import Sequence

from torch import nn


def compile_blocks(blocks: Sequence[nn.Module], *, fullgraph: bool, backend, mode: str = "default") -> None:
    """backend: a name, or a callable (inspect's recorder, which applies the mode itself)."""
    options = {} if mode == "default" or callable(backend) else {"mode": mode}
    for block in blocks:
        block.compile(fullgraph=fullgraph, backend=backend, **options)


def compile_counters() -> dict[str, int]:
    """Graphs Dynamo has captured in this process so far, and the graph breaks it met. Logged with
    each step: a count that grows after the first step is a recompile (a new shape, a failed guard).
    Dynamo files some breaks (a branch on a tensor's value) under "unimplemented" rather than
    "graph_break": both count, as does a frame it could not trace at all. An upper bound: Dynamo also
    files there a few refusals it recovers from without a break."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(breaks)}


def graph_break_message(exc: BaseException) -> str | None:
    """One message for Dynamo's refusal of a graph break under compile.fullgraph = true (it raises
    `Unsupported` from the first call of the block), naming the reason and the innermost user line;
    None for any other error."""
    if isinstance(exc, RuntimeError) and "found no compiled frames" in str(exc):  # Dynamo skipped the block's code
        return ("torch.compile compiled nothing in a block: Dynamo skipped every frame of its forward (code under "
                "torch.compiler.disable, say). compile.fullgraph = true requires one graph per block. Fix: set "
                "compile.enable = false for this model, or compile.fullgraph = false to let the skipped code run "
                "eagerly (`nsa-titan inspect RECIPE` shows what was compiled)")
    dynamo_errors = sys.modules.get("torch._dynamo.exc")
    if dynamo_errors is None or not isinstance(exc, dynamo_errors.Unsupported):
        return None
    if isinstance(exc.__cause__, dynamo_errors.ObservedException):  # the traced code raises: not a break
        return (f"torch.compile met an error that a compiled block's own code raises ({exc.__cause__}). Fix: run "
                f"with --compile.enable=false (without other --compile.* flags, which compile off refuses) once to "
                f"see it raised where it is, and mend what it names")
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    reason = lines[0] if lines else type(exc).__name__
    hint = next((line for line in lines if line.startswith("Hint:")), "").rstrip(".")
    stack = getattr(exc, "real_stack", None) or []
    where = ""
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}" + (f" `{frame.line.strip()}`" if frame.line else "")
    return (f"a compiled block has a graph break{where}: {reason}" + (f" ({hint})" if hint else "")
            + ". compile.fullgraph = true requires one graph per block. Fix: remove the break (`nsa-titan inspect "
              "RECIPE` lists every one with its line), or set compile.fullgraph = false to train with it (each break "
              "splits the block's graph), or compile.enable = false")
