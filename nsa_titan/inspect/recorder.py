"""A compile backend that records every graph Dynamo hands it, then compiles it with the real one.

Passed to `compile_blocks` in place of the backend's name, it sees exactly what training would
compile: each FX graph, why Dynamo ended it (a graph break or the frame's return), its ops and
whether its inputs have symbolic sizes. The compiled function it returns counts its runs, so the
report can tell which block ran which graph (blocks share one code object, so block 1 normally
reuses the graph compiled while block 0 ran).
"""

from __future__ import annotations

import collections
import re
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn

# torch.ops namespaces that are torch's own; anything else in a graph is a custom op.
BUILTIN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "inductor"})
_OP_PATTERN = re.compile(r"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


def ops_in_text(text: str) -> set[str]:
    """`namespace::name` of every torch.ops call written in a graph's code."""
    return {f"{ns}::{name}" for ns, name in _OP_PATTERN.findall(text)}


@dataclass
class GraphRecord:
    index: int
    compile_id: str | None
    block: int | None  # the block running when Dynamo compiled it
    step: int | None
    code: str  # readable FX graph
    op_count: int
    ops: set[str]  # torch.ops calls, as namespace::name
    ends_with_break: bool
    end_reason: str
    end_stack: list[traceback.FrameSummary]
    symbolic_inputs: list[str]  # placeholders with symbolic sizes (dynamic shapes)
    runs_by_block: collections.Counter = field(default_factory=collections.Counter)


class BlockTracker:
    """Knows which block and which inspection step are running, for attribution.

    Wraps each block's compiled call (`nn.Module.compile` stores it on the module) outside the
    compiled region, so Dynamo never traces the bookkeeping.
    """

    def __init__(self):
        self.block: int | None = None
        self.step: int | None = None
        self.attached = 0

    def tags(self) -> dict:
        return {"block": self.block, "step": self.step}

    def attach(self, blocks: nn.ModuleList) -> None:
        for index, block in enumerate(blocks):
            compiled = getattr(block, "_compiled_call_impl", None)
            if compiled is None:
                continue
            block._compiled_call_impl = self._tracked(compiled, index)
            self.attached += 1

    def _tracked(self, compiled, index: int):
        def call(*args, **kwargs):
            outer, self.block = self.block, index
            try:
                return compiled(*args, **kwargs)
            finally:
                self.block = outer

        return call


def _is_symbolic(size) -> bool:
    """A size still symbolic after Dynamo's replacements (a specialized symbol reads as a constant)."""
    if not isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    expr = getattr(size.node, "expr", None)
    return bool(getattr(expr, "free_symbols", True))


def _symbolic_inputs(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        sizes = ([value] if isinstance(value, (torch.SymInt, torch.SymFloat)) else
                 list(value.shape) if isinstance(value, torch.Tensor) else [])
        if any(_is_symbolic(size) for size in sizes):
            names.append(node.name)
    return names


class RecordingBackend:
    """Record, then delegate to the named backend (looked up as torch.compile would)."""

    def __init__(self, backend: str, tracker: BlockTracker, mode: str = "default"):
        from torch._dynamo import lookup_backend

        self.name = backend
        self.inner = lookup_backend(backend)
        if mode != "default":  # inductor's mode, as torch.compile(mode=...) would apply it
            import functools

            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            self.inner = functools.partial(compile_fx, config_patches=list_mode_options(mode))
        self.tracker = tracker
        self.graphs: list[GraphRecord] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        reason = getattr(gm, "compile_subgraph_reason", None)
        code = gm.print_readable(print_output=False)
        record = GraphRecord(
            index=len(self.graphs),
            compile_id=None if compile_id is None else str(compile_id),
            block=self.tracker.block,
            step=self.tracker.step,
            code=code,
            op_count=sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")),
            ops=ops_in_text(code),
            ends_with_break=bool(getattr(reason, "graph_break", False)),
            end_reason=str(getattr(reason, "reason", "")),
            end_stack=list(getattr(reason, "user_stack", None) or []),
            symbolic_inputs=_symbolic_inputs(gm),
        )
        self.graphs.append(record)
        compiled = self.inner(gm, example_inputs)
        tracker = self.tracker

        def run(*args, **kwargs):
            record.runs_by_block[tracker.block] += 1
            return compiled(*args, **kwargs)

        return run
