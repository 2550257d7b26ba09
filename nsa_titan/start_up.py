"""What a command-line process does first, before its slow imports (torch alone takes seconds).

- Under torchrun, note the launcher (the parent now) and ask Linux for a SIGTERM when it dies: during
  start-up its default action ends the rank; once training runs, GracefulStop answers it with a stop after
  the step and a save (a launcher killed with SIGKILL cannot end its ranks itself).
- `kill -USR1` writes every thread's stack to stderr from the start (its default would end the process; the
  trainer then sends the dumps to its stacks file as well), so a rank stuck in start-up can be asked too.
- A Ctrl-C during the imports ends in one line, not the import's traceback.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys

INTERRUPTED = 130  # as a shell reports a process ended by SIGINT
INTERRUPTED_WHILE_STARTING = "error: interrupted while starting (nothing ran)."
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_launcher: int | None = None


def prepare_process() -> None:
    global _launcher
    if _launcher is None and "TORCHELASTIC_RUN_ID" in os.environ and _signal_on_parent_death(signal.SIGTERM):
        _launcher = os.getppid()  # may be pid 1: a container whose command is torchrun
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def launcher_pid() -> int | None:
    """The launcher noted by prepare_process (None: not under torchrun, or not on Linux)."""
    return _launcher


def say_interrupted_while_starting() -> int:
    """The one line for a Ctrl-C during the imports; returns the exit code."""
    try:
        os.write(2, (INTERRUPTED_WHILE_STARTING + "\n").encode())
    except OSError:
        pass
    return INTERRUPTED


def _signal_on_parent_death(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent ends; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
