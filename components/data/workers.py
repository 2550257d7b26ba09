"""What a DataLoader worker process's death looks like from the training process."""

from __future__ import annotations

import re
import signal

_DIED = re.compile(r"^DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)")


def worker_died(exc: BaseException) -> bool:
    """Whether `exc` is torch's word that a loader worker process died: its SIGCHLD handler raises it in the
    main thread wherever that thread is (a step, a save, a validation, a source's own read), so code that
    catches broad errors passes it on."""
    return isinstance(exc, RuntimeError) and _DIED.match(str(exc)) is not None


def signal_that_ended(exc: BaseException, loader: object = None) -> str | None:
    """The signal ('SIGKILL') that ended a dead worker `exc` names, or None if it exited by itself or is not
    known. torch words the same death two ways, by whichever of its checks sees it first: its SIGCHLD handler
    says 'is killed by signal: Killed.', its check after a queue timeout says only 'exited unexpectedly'. The
    worker's exit code says it either way, while a loader's iterator still holds the worker: `loader`'s, or
    the one whose check raised `exc` (a validation's loader, say), found in the traceback."""
    match = _DIED.match(str(exc))
    if match is None:
        return None
    pids = {int(p) for p in match.group(1).replace(",", " ").split()}
    for worker in _workers_near(exc, loader):
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
