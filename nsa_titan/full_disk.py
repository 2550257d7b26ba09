"""A file system that filled up (or a quota that ran out) while a command wrote: one message naming the file
and what a rerun does, where any write (metrics, a lock file, a plot, a log) would otherwise end in a
traceback. The writers that can clean up after themselves (checkpoints, exports, eval) say so themselves."""

from __future__ import annotations

import errno

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def space_error(exc: BaseException | None) -> OSError | None:
    """The OSError of a full file system behind `exc`: it, or an exception it was raised from or while
    handling (a file's close after a failed write raises again, chained), else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
            return exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def full_disk_message(command: str, err: OSError) -> str:
    where = f" while writing {err.filename!r}" if err.filename else ""
    after = (" Nothing after the newest complete checkpoint was kept; a rerun of the same command resumes from "
             "it (with checkpoint.enable)." if command == "train" else "")
    return (f"{command} stopped: the file system is full{where} ({err.strerror or 'no space left'}).{after} Fix: "
            f"free space there, or give the command a folder on another file system.")
