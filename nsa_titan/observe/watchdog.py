"""Hang watchdog: when no step completes in time, dump every thread's stack and end the process.

A hung rank (a collective waiting for a dead peer, a stuck data read, a deadlock) otherwise sits
silently until the job's wall-clock limit. A daemon thread watches the time since the last
`beat(step)`; past the limit it writes all threads' stacks with faulthandler to stderr and to a
file, prints one message naming the step and the recipe field that sets the limit, and calls
os._exit, because the main thread is stuck and would never reach a normal exit.

Deliberately free of torch and of Python-level locks on the firing path: it writes to file
descriptors directly, so a main thread stuck while holding sys.stderr's lock cannot block it.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

# The exit status of timeout(1): a run ended by the watchdog is told apart from a crash (1) or bad input (2).
HANG_EXIT_CODE = 124
STEP_FIELD = "fault.step_timeout_seconds"
FIRST_STEP_FIELD = "fault.first_step_timeout_seconds"


@dataclass(frozen=True)
class Stall:
    """What the watchdog saw: the last completed step (None: none yet in this run) and the limit hit."""

    step: int | None
    start_step: int
    waited_s: float
    limit_s: float
    field: str
    dump_path: str


def describe_stall(stall: Stall) -> str:
    if stall.step is None:
        what = (f"the first step of this run (after step {stall.start_step}) did not complete within "
                f"{stall.limit_s:g} s ({stall.field} = {stall.limit_s:g}); it includes compilation and warm-up")
    else:
        waited = f"{stall.waited_s:.{0 if stall.waited_s >= 10 else 1}f}"  # a 0.2 s limit's wait is not "0 s"
        what = (f"no training step completed for {waited} s after step {stall.step} "
                f"({stall.field} = {stall.limit_s:g})")
    return (f"the run looks hung: {what}. Every thread's stack is above and in {stall.dump_path}; the "
            f"main thread's stack shows the stuck call (a data read, a collective waiting for another rank, I/O). "
            f"Fix: remove the cause, or if steps are legitimately this slow raise {stall.field} (0 disables it). "
            f"Exiting with code {HANG_EXIT_CODE}.")


def dump_all_stacks(fd: int, header: str) -> None:
    """Write a header line and every thread's stack to an open file descriptor."""
    os.write(fd, header.encode("utf-8", errors="replace"))
    faulthandler.dump_traceback(file=fd, all_threads=True)


class Watchdog:
    """Call `beat(step)` after every completed step (and after long pauses such as a checkpoint save).

    timeout_s limits the time between beats; first_timeout_s the time from construction to the
    first beat. A limit of 0 disables that check; with both 0 no thread starts.
    """

    def __init__(self, timeout_s: float, first_timeout_s: float, dump_path: str,
                 on_timeout_message: Callable[[Stall], str] | None = None, *, start_step: int = 0,
                 poll_s: float | None = None):
        self.timeout_s, self.first_timeout_s = float(timeout_s), float(first_timeout_s)
        self.dump_path = dump_path
        self.start_step = start_step
        self._message = on_timeout_message or describe_stall
        self._state: tuple[int | None, float] = (None, time.monotonic())  # replaced whole: atomic under the GIL
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        limits = [t for t in (self.timeout_s, self.first_timeout_s) if t > 0]
        if limits:
            self._poll_s = poll_s if poll_s is not None else min(max(min(limits) / 20, 0.02), 5.0)
            self._thread = threading.Thread(target=self._watch, name="nsa_titan-watchdog", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def beat(self, step: int) -> None:
        """Step `step` completed: restart the clock. Cheap (no locks, no I/O)."""
        self._state = (step, time.monotonic())

    def stop(self) -> None:
        """End the watch (e.g. before a long final save the run should not be killed during)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s):
            step, since = self._state
            limit, field = (self.first_timeout_s, FIRST_STEP_FIELD) if step is None else (self.timeout_s, STEP_FIELD)
            waited = time.monotonic() - since
            if limit > 0 and waited > limit and not self._stopped.is_set():
                self._fire(Stall(step, self.start_step, waited, limit, field, self.dump_path))

    def _fire(self, stall: Stall) -> None:
        header = (f"\n=== nsa_titan watchdog: stacks of every thread of pid {os.getpid()} at "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')} (last completed step: {stall.step}) ===\n")
        dump_all_stacks(2, header)
        message = "error: " + self._message(stall)
        try:
            folder = os.path.dirname(os.path.abspath(self.dump_path))
            os.makedirs(folder, exist_ok=True)
            fd = os.open(self.dump_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                dump_all_stacks(fd, header)
                os.write(fd, (message + "\n").encode("utf-8", errors="replace"))
            finally:
                os.close(fd)
        except OSError as exc:
            message += f"\n(the stack dump file {self.dump_path} could not be written: {exc})"
        os.write(2, ("\n" + message + "\n").encode("utf-8", errors="replace"))
        os._exit(HANG_EXIT_CODE)
