"""What a DataLoader worker process's death looks like from the training process."""

from __future__ import annotations

import re
import signal
import sys
import threading
import time

_DIED = re.compile(r"^DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")
_EXIT_SEEN_WITHIN_S = 2.0  # after its socket broke, a killed worker's exit is seen within this


def worker_died(exc: BaseException, loader: object = None) -> bool:
    """Whether `exc` is torch's word that a loader worker process died: its SIGCHLD handler raises it in the
    main thread wherever that thread is (a step, a save, a validation, a source's own read), so code that
    catches broad errors passes it on. A worker killed while it handed over a batch (through a socket, for a
    tensor in shared memory) breaks that socket first: a ConnectionError or EOFError, with a worker of
    `loader` (or of a loader iterator the error passed) dead."""
    if isinstance(exc, RuntimeError):
        return _DIED.match(str(exc)) is not None
    if not isinstance(exc, (ConnectionError, EOFError)):
        return False
    # The socket closes as the worker exits, a moment before the exit can be seen (on a busy machine, longer)
    deadline = time.monotonic() + _EXIT_SEEN_WITHIN_S
    while not _dead_workers(exc, loader):
        if time.monotonic() > deadline or not any(True for _ in _workers_near(exc, loader)):
            return False
        time.sleep(0.01)
    return True


def death_hidden_in(exc: BaseException, loader: object) -> RuntimeError | None:
    """torch's word of a dead worker of `loader`, where `exc` is what a call made of it: its SIGCHLD handler raised
    the death inside a save's writer, which reported a failed write instead (a zip writer's 'unexpected pos').
    None when no worker of `loader` is dead (the error is its own)."""
    dead = _dead_workers(exc, loader)
    if not dead:
        return None
    pids = ", ".join(str(worker.pid) for worker in dead)
    return RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly")


def _dead_workers(exc: BaseException, loader: object) -> list:
    return [worker for worker in _workers_near(exc, loader) if getattr(worker, "exitcode", None) is not None]


def stop_hearing_worker_deaths() -> object:
    """Set SIGCHLD to its default action and return the handler it had (for restore_worker_deaths): a run that
    ends, on a worker's death or otherwise, must not meet torch's handler raising that death again inside its
    clean-up, where it would escape as a traceback."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGCHLD, signal.SIG_DFL)


class DeathsInFinalizers:
    """While entered, a worker's death that torch's SIGCHLD handler raised inside a finalizer (a shared tensor's
    __del__, a weakref callback) is kept for raise_heard: Python would print it as 'Exception ignored' with its
    traceback and go on, until the loader's own check sees the dead worker seconds later."""

    def __init__(self) -> None:
        self.heard: list[BaseException] = []
        self._previous = None

    def __enter__(self) -> DeathsInFinalizers:
        self._previous, sys.unraisablehook = sys.unraisablehook, self._hook
        return self

    def __exit__(self, *exc) -> None:
        sys.unraisablehook = self._previous

    def _hook(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and worker_died(unraisable.exc_value):
            self.heard.append(unraisable.exc_value)
        else:
            self._previous(unraisable)

    def raise_heard(self) -> None:
        if self.heard:
            raise self.heard[0]


def restore_worker_deaths(previous: object) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, previous)


def signal_that_ended(exc: BaseException, loader: object = None) -> str | None:
    """The signal ('SIGKILL') that ended a dead worker `exc` names, or None if it exited by itself or is not
    known. torch words the same death two ways, by whichever of its checks sees it first: its SIGCHLD handler
    says 'is killed by signal: Killed.', its check after a queue timeout says only 'exited unexpectedly'. The
    worker's exit code says it either way, while a loader's iterator still holds the worker: `loader`'s, or
    the one whose check raised `exc` (a validation's loader, say), found in the traceback."""
    match = _DIED.match(str(exc))
    if match is None and not isinstance(exc, (ConnectionError, EOFError)):
        return None
    dead = _dead_workers(exc, loader)
    pids = {int(p) for p in match.group(1).replace(",", " ").split()} if match else {w.pid for w in dead}
    for worker in dead:
        code = worker.exitcode if getattr(worker, "pid", None) in pids else None
        if code is not None and code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:  # a real-time signal has no name
                return f"signal {-code}"
    return "SIGKILL" if "killed by signal: Killed" in str(exc) else None


def _workers_near(exc: BaseException, loader: object):
    """The worker processes of `loader`'s iterator and of any loader iterator among the frames `exc` passed."""
    iterators = [getattr(loader, "_iterator", None)]
    tb = exc.__traceback__
    while tb is not None:
        iterators.append(tb.tb_frame.f_locals.get("self"))
        tb = tb.tb_next
    for it in iterators:
        yield from getattr(it, "_workers", None) or ()
