"""torch.compile's structured trace, captured twice: a TORCH_TRACE file for tlparse, and in memory.

Dynamo, AOTAutograd and Inductor report what they do through `trace_structured` events on one
logger (`torch._logging._internal.trace_log`): graphs, guard failures, shape specializations,
graph-break reasons, generated code and compile metrics. Setting the TORCH_TRACE variable only
makes torch attach a file handler to that logger at import; attaching the same handler here
writes the same file (tlparse reads it) for this inspection alone, and a second handler keeps
each event as a Python object so the report needs no log parsing.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

_CONTEXT_KEYS = ("rank", "compiled_autograd_id", "frame_id", "frame_compile_id", "attempt", "has_payload",
                 "subgraph_name", "stack")


@dataclass
class TraceEvent:
    kind: str  # e.g. "dynamo_output_graph", "artifact", "compilation_metrics"
    data: Any  # the kind's metadata (a dict for most kinds)
    compile_id: str | None  # "frame/compile", as tlparse and the compile metrics write it
    payload: str | None
    tags: dict = field(default_factory=dict)  # what was running when it was emitted (block, step)

    @property
    def name(self) -> str | None:
        """The artifact name for kind "artifact" events."""
        return self.data.get("name") if self.kind == "artifact" and isinstance(self.data, dict) else None


class _MemoryHandler(logging.Handler):
    def __init__(self, sink: "StructuredTrace"):
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if isinstance(metadata, dict):
            self.sink._add(metadata, getattr(record, "payload", None))


class StructuredTrace:
    """Context manager: while active, every structured compile event is kept and written to `folder`.

    `tags()` is called for each event and its dict is stored with it, so events can be tied to the
    block and the step that were running when they were emitted.
    """

    def __init__(self, folder: str, tags: Callable[[], dict]):
        self.folder = folder
        self._tags = tags
        self.events: list[TraceEvent] = []
        self.strings: dict[int, str] = {}  # torch interns file names in stacks as {"str": [name, id]}
        self.file_error: str | None = None
        self._handlers: list[logging.Handler] = []
        self._saved_level: int | None = None

    def _add(self, metadata: dict, payload: str | None) -> None:
        kinds = [key for key in metadata if key not in _CONTEXT_KEYS]
        if not kinds:
            return
        kind = kinds[0]
        data = metadata[kind]
        if kind == "str" and isinstance(data, (list, tuple)) and len(data) == 2:
            self.strings[data[1]] = data[0]
            return
        compile_id = None
        if metadata.get("frame_id") is not None:
            compile_id = f"{metadata['frame_id']}/{metadata.get('frame_compile_id')}"
        self.events.append(TraceEvent(kind, data, compile_id, payload, dict(self._tags())))

    def __enter__(self) -> "StructuredTrace":
        from torch._logging._internal import trace_log

        os.makedirs(self.folder, exist_ok=True)
        self._saved_level = trace_log.level
        trace_log.setLevel(logging.DEBUG)
        self._handlers = [_MemoryHandler(self)]
        try:
            from torch._logging._internal import LazyTraceHandler, TorchLogsFormatter

            file_handler = LazyTraceHandler(self.folder)
            file_handler.setFormatter(TorchLogsFormatter(trace=True))
            self._handlers.append(file_handler)
        except (ImportError, TypeError) as exc:  # the private handler moved: keep the in-memory capture
            self.file_error = f"{type(exc).__name__}: {exc}"
        for handler in self._handlers:
            trace_log.addHandler(handler)
        return self

    def __exit__(self, *exc_info) -> None:
        from torch._logging._internal import trace_log

        for handler in self._handlers:
            trace_log.removeHandler(handler)
            handler.close()
        if self._saved_level is not None:
            trace_log.setLevel(self._saved_level)

    def log_files(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.folder, "*.log")))

    # ---- queries ---------------------------------------------------------------------------------
    def of_kind(self, kind: str) -> list[TraceEvent]:
        return [e for e in self.events if e.kind == kind]

    def artifacts(self, name: str) -> list[TraceEvent]:
        return [e for e in self.events if e.name == name]

    def frames(self, stack: list | None) -> list[tuple[str, int, str]]:
        """A trace stack as (file, line, source text) with interned file names resolved."""
        frames = []
        for frame in stack or []:
            if not isinstance(frame, dict):
                continue
            filename = frame.get("filename")
            filename = self.strings.get(filename, str(filename)) if isinstance(filename, int) else str(filename)
            frames.append((filename, int(frame.get("line") or 0), str(frame.get("loc") or "").strip()))
        return frames
