"""The attention pictures a run already drew into TensorBoard event files, found again for a redraw of its curves.

A redraw hides every earlier event (the folder may hold another run's steps) and writes the records of
metrics.jsonl again; the pictures are in no record, so they are copied from the event files. A picture of step S
belongs to the run when the file that holds it drew the telemetry of step S with the values metrics.jsonl holds:
the pictures are drawn right after that record, by the same writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from nsa_titan.observe.event_files import event_files
from nsa_titan.observe.telemetry_log import PREFIX as TELEMETRY_PREFIX


def _event_files(folders: list[str]) -> list[str]:
    """Every event file in `folders`, oldest first (a later file's events replace an earlier one's)."""
    paths = []
    for folder in folders:
        if os.path.isdir(folder):
            paths += [os.path.join(folder, name) for name in event_files(folder)]
    return sorted(paths, key=lambda path: (os.path.getmtime(path), path))


def holds_events(folder: str) -> bool:
    """Whether `folder` holds any TensorBoard event file."""
    return bool(_event_files([folder]))


def _events(path: str):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    for record in RawEventFileLoader(path).Load():
        yield Event.FromString(record)


def _telemetry_by_step(records: list[dict]) -> dict[int, dict[str, float]]:
    """{step: {TensorBoard tag: value as float32}} of the records' telemetry, as TensorBoardLog wrote it."""
    out: dict[int, dict[str, float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(TELEMETRY_PREFIX) and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(record["step"], {})[key.replace(".", "/")] = float(np.float32(value))
    return out


def _drawn_telemetry(path: str, steps: set[int]) -> dict[int, dict[str, float]]:
    found: dict[int, dict[str, float]] = {}
    for event in _events(path):
        if event.step in steps:
            for value in event.summary.value:
                if value.tag.startswith(TELEMETRY_PREFIX) and value.WhichOneof("value") == "simple_value":
                    found.setdefault(event.step, {})[value.tag] = value.simple_value
    return found


def picture_sources(folders: list[str], records: list[dict]) -> dict[int, str]:
    """{step: the newest event file in `folders` that drew the telemetry of `records` (metrics.jsonl's) at that
    step}: where the run's pictures of each step are. Read before a writer adds its own file to the folder."""
    wanted = _telemetry_by_step(records)
    sources: dict[int, str] = {}
    for path in _event_files(folders):
        for step, drawn in _drawn_telemetry(path, set(wanted)).items():
            if all(drawn.get(tag) == value for tag, value in wanted[step].items()):
                sources[step] = path
    return sources


def pictures(sources: dict[int, str]) -> Iterator[tuple[int, float, object]]:
    """(step, wall time, summary value) of every picture `sources` names, read one file at a time."""
    for path in sorted(set(sources.values())):
        for event in _events(path):
            if sources.get(event.step) == path:
                for value in event.summary.value:
                    if value.WhichOneof("value") == "image":
                        yield event.step, event.wall_time, value
