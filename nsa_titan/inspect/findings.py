"""From recorded graphs and trace events to findings: breaks, recompiles, specializations, failures.

Every finding carries the user source line it points at (file, line, the line's text), so the
report reads like a list of places to fix.
"""

from __future__ import annotations

import json
import linecache
import os
import re
from dataclasses import dataclass, field

import torch

from nsa_titan.inspect.recorder import GraphRecord
from nsa_titan.inspect.trace_capture import StructuredTrace, TraceEvent

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_BREAK_AT = re.compile(r"Graph break in user code at (.+?):(\d+)")
_TRACEBACK_FRAME = re.compile(r'File "(.+?)", line (\d+)')
_PREAMBLE = re.compile(r"^Encountered graph break when attempting to trace")


@dataclass(frozen=True)
class SourceLine:
    file: str
    line: int

    @property
    def text(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{_short_path(self.file)}:{self.line}"


def _short_path(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if relative.startswith("..") else relative


def _is_user_file(path: str) -> bool:
    return not os.path.abspath(path).startswith(_TORCH_DIR + os.sep) and not path.startswith("<")


@dataclass
class GraphBreak:
    where: SourceLine | None
    reason: str  # one line
    hints: list[str] = field(default_factory=list)
    blocks: set = field(default_factory=set)


@dataclass
class Recompile:
    compile_id: str
    block: int | None
    step: int | None
    guards: list[str]  # one failed guard per earlier cache entry, e.g. "0/0: tensor 'x' size mismatch ..."


@dataclass
class Specialization:
    symbol: str
    sources: list[str]
    value: str
    reason: str
    where: SourceLine | None
    compile_id: str | None


@dataclass
class CompileFailure:
    compile_id: str | None
    block: int | None
    step: int | None
    kind: str
    message: str
    where: SourceLine | None


@dataclass
class CompileTime:
    frames: int
    dynamo_s: float  # whole-frame compile time, backend included
    backend_s: float
    inductor_s: float


def summarize_reason(text: str) -> tuple[str, list[str]]:
    """The first meaningful line of a Dynamo graph-break reason, and its hint lines."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not _PREAMBLE.match(line)]
    head = lines[0] if lines else text.strip()
    hints = [line[len("Hint:"):].strip() for line in lines if line.startswith("Hint:")]
    return head, hints


def _last_user_frame(frames) -> SourceLine | None:
    for frame in reversed(frames):
        filename, lineno = frame[0], frame[1]
        if _is_user_file(filename):
            return SourceLine(filename, lineno)
    return None


def graph_breaks(graphs: list[GraphRecord], trace: StructuredTrace) -> list[GraphBreak]:
    """Each distinct break once, with the blocks it happened in.

    A graph that ends in a break names it (and every block that ran that graph hit it); breaks that
    left no graph behind (nothing to compile before them) come from Dynamo's break-reason events.
    """
    found: dict[tuple, GraphBreak] = {}

    def add(where: SourceLine | None, reason_text: str, blocks) -> None:
        reason, hints = summarize_reason(reason_text)
        key = (where, None) if where is not None else (None, reason)  # one break per source line
        entry = found.setdefault(key, GraphBreak(where, reason, hints))
        entry.blocks.update(b for b in blocks if b is not None)

    for graph in graphs:
        if graph.ends_with_break:
            frames = [(f.filename, f.lineno) for f in graph.end_stack]
            add(_last_user_frame(frames), graph.end_reason, list(graph.runs_by_block) + [graph.block])
    for event in trace.artifacts("dynamo_graph_break_reason"):
        payload = event.payload or ""
        traceback_part = payload.split("User code traceback:", 1)[-1].split("Traceback (most recent call last)")[0]
        where = _last_user_frame([(f, int(n)) for f, n in _TRACEBACK_FRAME.findall(traceback_part)])
        match = _BREAK_AT.search(payload)
        if where is None and match:
            where = SourceLine(match.group(1), int(match.group(2)))
        reason_text = payload.split("Graph Break Reason:", 1)[-1]
        reason_text = re.split(r"\n(?:Stack variable source attribution:|User code traceback:)", reason_text)[0]
        add(where, reason_text, [event.tags.get("block")])
    return list(found.values())


def _metrics(trace: StructuredTrace) -> list[TraceEvent]:
    return [e for e in trace.of_kind("compilation_metrics") if isinstance(e.data, dict)]


def recompiles(trace: StructuredTrace) -> list[Recompile]:
    """Compiles of a frame that already had compiled code whose guards failed."""
    by_id: dict[str, Recompile] = {}
    for event in trace.artifacts("recompile_reasons"):
        guards = _guard_lines(event.payload)
        if guards and event.compile_id:
            by_id[event.compile_id] = Recompile(event.compile_id, event.tags.get("block"), event.tags.get("step"),
                                                guards)
    for event in _metrics(trace):  # older torch has only the metrics field
        reason = event.data.get("recompile_reason")
        compile_id = event.data.get("compile_id") or event.compile_id
        if reason and compile_id and compile_id not in by_id:
            by_id[compile_id] = Recompile(compile_id, event.tags.get("block"), event.tags.get("step"),
                                          _guard_lines(reason))
    return sorted(by_id.values(), key=lambda r: _id_order(r.compile_id))


def _guard_lines(payload) -> list[str]:
    if payload is None:
        return []
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            pass
    items = payload if isinstance(payload, list) else [payload]
    lines = []
    for item in items:
        # Keep the failed guard and drop the echoed user stack that newer torch appends.
        text = str(item).split("\nUser stack trace:")[0]
        lines.append(" ".join(text.split()))
    return [line for line in lines if line]


def _id_order(compile_id: str) -> tuple:
    return tuple(int(part) if part.isdigit() else 0 for part in re.split(r"[/_]", compile_id))


def specializations(trace: StructuredTrace) -> list[Specialization]:
    """Sizes Dynamo made symbolic and then fixed to one value, with the user line that forced it."""
    found = []
    for event in trace.of_kind("symbolic_shape_specialization"):
        data = event.data if isinstance(event.data, dict) else {}
        frames = trace.frames(data.get("user_stack")) or trace.frames(data.get("stack"))
        found.append(Specialization(str(data.get("symbol", "?")), [str(s) for s in data.get("sources") or []],
                                    str(data.get("value", "?")), str(data.get("reason", "")),
                                    _last_user_frame(frames), event.compile_id))
    return found


def symbols_created(trace: StructuredTrace) -> list[tuple[str, str, str]]:
    """(symbol, source, example value) for every size Dynamo compiled symbolically."""
    out = []
    for event in trace.of_kind("create_symbol"):
        data = event.data if isinstance(event.data, dict) else {}
        out.append((str(data.get("symbol", "?")), str(data.get("source", "?")), str(data.get("val", "?"))))
    return out


def failures(trace: StructuredTrace) -> list[CompileFailure]:
    """Frames whose compilation failed (they then run eagerly, or the error reaches the caller)."""
    out = []
    for event in _metrics(trace):
        data = event.data
        if not data.get("fail_type"):
            continue
        where = None
        if data.get("fail_user_frame_filename") and data.get("fail_user_frame_lineno"):
            where = SourceLine(data["fail_user_frame_filename"], int(data["fail_user_frame_lineno"]))
        message = " ".join(str(data.get("fail_reason") or "").split())
        out.append(CompileFailure(data.get("compile_id") or event.compile_id, event.tags.get("block"),
                                  event.tags.get("step"), str(data["fail_type"]), message, where))
    return out


def compile_time(trace: StructuredTrace) -> CompileTime:
    frames, dynamo_s, backend_s, inductor_s = 0, 0.0, 0.0, 0.0
    for event in _metrics(trace):
        frames += 1
        dynamo_s += float(event.data.get("entire_frame_compile_time_s") or 0.0)
        backend_s += float(event.data.get("backend_compile_time_s") or 0.0)
        inductor_s += float(event.data.get("inductor_compile_time_s") or 0.0)
    for event in trace.of_kind("bwd_compilation_metrics"):
        if isinstance(event.data, dict):
            inductor_s += float(event.data.get("inductor_compile_time_s") or 0.0)
    return CompileTime(frames, dynamo_s, backend_s, inductor_s)
