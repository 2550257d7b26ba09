"""`kill -USR1 PID` writes every thread's stack to a file and stderr; the run goes on.

For a run that is slow or looks stuck but has not hit the watchdog yet. faulthandler writes the
stacks from its C signal handler, so the file is written even while the main thread is stuck in
a C call (a collective, a CUDA synchronisation). faulthandler holds one file per signal, so the
copy to stderr comes from a Python handler chained after it; that one runs when the main thread
next executes Python code, which a truly stuck thread never does, hence the file comes first.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

_installed: dict = {}


def install_sigusr1(dump_path: str) -> None:
    """Append all threads' stacks to dump_path (then copy them to stderr) on every SIGUSR1.

    Call from the main thread. Calling again moves the dump to the new path.
    """
    uninstall_sigusr1()
    # An earlier registration (start_up's, to stderr) would keep its own C handler in place: drop it first.
    faulthandler.unregister(signal.SIGUSR1)
    os.makedirs(os.path.dirname(os.path.abspath(dump_path)), exist_ok=True)
    fh = open(dump_path, "ab", buffering=0)  # unbuffered: faulthandler writes to the descriptor itself
    state = {"file": fh, "path": dump_path, "echoed": fh.tell()}

    def echo_to_stderr(signum, frame) -> None:
        with open(state["path"], "rb") as reader:
            reader.seek(state["echoed"])
            text = reader.read()
        # The C handler cannot write a header; a footer with the time separates successive dumps.
        footer = f"--- end of SIGUSR1 stack dump, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
        state["file"].write(footer.encode("utf-8"))
        state["echoed"] += len(text) + len(footer.encode("utf-8"))
        stream = sys.stderr or sys.__stderr__
        stream.write(f"\nstacks of every thread (SIGUSR1), also in {state['path']}:\n"
                     + text.decode("utf-8", errors="replace"))
        stream.flush()

    state["previous"] = signal.signal(signal.SIGUSR1, echo_to_stderr)
    # chain=True: after writing the file, faulthandler hands the signal to the Python handler above.
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=True)
    _installed.update(state)


STACKS_FOLDER = "stacks"  # in the run's folder: one file per rank


def dump_file(dump_folder: str, rank: int) -> str:
    """Where rank `rank` of the run in `dump_folder` writes its stacks."""
    return os.path.join(dump_folder, STACKS_FOLDER, f"rank-{rank}.txt")


def remove_empty_dump_files(dump_folder: str) -> None:
    """Remove the stack dump files no dump was written to (and the folder, if left empty): those of ranks killed
    before they could remove their own (a second stop request, kill -9, the out-of-memory killer). Only while no
    rank of the run is alive: a live rank's file is empty until its first dump."""
    folder = os.path.join(dump_folder, STACKS_FOLDER)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith("rank-"):
            _remove_if_empty(os.path.join(folder, name))


def _remove_if_empty(path: str) -> None:
    """Remove a dump file no dump was written to, and its folder if that is left empty (an empty file would read
    as a dump that failed)."""
    try:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
            os.rmdir(os.path.dirname(os.path.abspath(path)))  # refused while another rank's file is there
    except OSError:
        pass


def uninstall_sigusr1() -> None:
    """Restore the SIGUSR1 handling from before install_sigusr1 and close the dump file; a file no dump
    was written to is removed (with its folder, if that is left empty), so an empty one never reads as a
    dump that failed."""
    if not _installed:
        return
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, _installed["previous"])
    _installed["file"].close()
    path = _installed["path"]
    _installed.clear()
    _remove_if_empty(path)
