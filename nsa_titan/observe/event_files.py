"""Which files of a folder are TensorBoard event files: the files TensorBoard itself reads, so a redraw's check for
events, its search for pictures and a writer's wait for older files all count the same ones."""

from __future__ import annotations

import os
import re

# The seconds in the name TensorBoard's writers give a file: events.out.tfevents.<whole seconds>.<host>.<process id>.
# <counter of the process's writers>.
_WRITER_NAME = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def is_event_file(name: str) -> bool:
    """TensorBoard's own rule for files it reads scalars from (io_wrapper.IsSummaryEventsFile): a name holding
    "tfevents", whatever comes around it, except the profiler's empty marker files (*.profile-empty); an
    events.out.* file without "tfevents" is not read."""
    return "tfevents" in name and not name.endswith(".profile-empty")


def event_files(folder: str) -> list[str]:
    """The names of the event files in `folder` (OSError when there is no such folder)."""
    return [name for name in os.listdir(folder) if is_event_file(name) and os.path.isfile(os.path.join(folder, name))]


def started_second(name: str) -> int | None:
    """The whole second a writer started the event file `name` in, read from its name (None for a name a writer did
    not give)."""
    found = _WRITER_NAME.match(name)
    return int(found.group(1)) if found else None
