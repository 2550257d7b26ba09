"""Write what the compiler produced as readable files, and read Inductor's output code for fallbacks."""

from __future__ import annotations

import collections
import os
import re

from nsa_titan.inspect.recorder import BUILTIN_NAMESPACES, GraphRecord, ops_in_text
from nsa_titan.inspect.trace_capture import StructuredTrace

# trace event -> file label; the payload of each is readable text (FX graphs) or Python (output code)
_GRAPH_EVENTS = {
    "aot_forward_graph": "aot_forward.txt",
    "aot_backward_graph": "aot_backward.txt",
    "aot_inference_graph": "aot_inference.txt",
}
_GRAPH_ARTIFACTS = {"inductor_post_grad_graph": "inductor_post_grad.txt"}
OUTPUT_CODE_EVENT = "inductor_output_code"

# In Inductor's wrapper code an op it could not lower is called through torch.ops (an eager
# kernel); `extern_kernels.*` are library calls it chose (mm, bmm, convolution).
_EAGER_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.\w+\(")
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")


def _compile_tag(compile_id: str | None) -> str:
    return "compile_" + (compile_id or "none").replace("/", "_")


def _unique(path: str) -> str:
    base, ext = os.path.splitext(path)
    n = 2
    while os.path.exists(path):
        path = f"{base}.{n}{ext}"
        n += 1
    return path


def _write(path: str, text: str) -> str:
    path = _unique(path)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def write_graphs(folder: str, graphs: list[GraphRecord], trace: StructuredTrace) -> dict[str, list[str]]:
    """Dynamo graphs, AOTAutograd forward/backward graphs and Inductor code; returns paths by kind."""
    os.makedirs(folder, exist_ok=True)
    written: dict[str, list[str]] = collections.defaultdict(list)
    for graph in graphs:
        header = (f"# graph {graph.index}: {_compile_tag(graph.compile_id)}, compiled while block {graph.block} ran; "
                  f"{graph.op_count} ops; ends: {'graph break' if graph.ends_with_break else graph.end_reason}\n")
        name = f"graph_{graph.index:02d}.{_compile_tag(graph.compile_id)}.dynamo.txt"
        written["dynamo"].append(_write(os.path.join(folder, name), header + graph.code))
    for event in trace.events:
        label = _GRAPH_EVENTS.get(event.kind) or _GRAPH_ARTIFACTS.get(event.name or "")
        if event.kind == OUTPUT_CODE_EVENT:
            label = "inductor_output_code.py"
        if label is None or not event.payload:
            continue
        path = _write(os.path.join(folder, f"{_compile_tag(event.compile_id)}.{label}"), event.payload)
        written[label.split(".")[0]].append(path)
    return dict(written)


def graph_texts(graphs: list[GraphRecord], trace: StructuredTrace) -> list[str]:
    """Every FX graph's code: Dynamo's, and AOTAutograd's forward and backward (where the backward ops are)."""
    texts = [g.code for g in graphs]
    texts += [e.payload for e in trace.events if e.kind in _GRAPH_EVENTS and e.payload]
    return texts


def custom_ops(texts: list[str]) -> list[str]:
    """torch.ops namespace::name in any graph whose namespace is not torch's own."""
    found = set()
    for text in texts:
        found |= {op for op in ops_in_text(text) if op.split("::")[0] not in BUILTIN_NAMESPACES}
    return sorted(found)


def higher_order_ops(texts: list[str]) -> list[str]:
    found = set()
    for text in texts:
        found |= {op for op in ops_in_text(text) if op.startswith("higher_order::")}
    return sorted(found)


def inductor_calls(trace: StructuredTrace) -> tuple[collections.Counter, collections.Counter]:
    """(eager kernels called from Inductor's code by op, extern library kernels by name)."""
    eager: collections.Counter = collections.Counter()
    extern: collections.Counter = collections.Counter()
    for event in trace.of_kind(OUTPUT_CODE_EVENT):
        for line in (event.payload or "").splitlines():
            code = line.split("#", 1)[0]
            for ns, name in _EAGER_CALL.findall(code):
                if ns != "inductor":  # Inductor's own helpers (buffer pools), not fallbacks
                    eager[f"{ns}::{name}"] += 1
            extern.update(_EXTERN_CALL.findall(code))
    return eager, extern
