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


def signal_that_ended(exc: BaseException, loader: object) -> str | None:
    """The signal ('SIGKILL') that ended a dead worker `exc` names, or None if it exited by itself or is not
    known. torch words the same death two ways, by whichever of its checks sees it first: its SIGCHLD handler
    says 'is killed by signal: Killed.', its check after a queue timeout says only 'exited unexpectedly'. The
    worker's exit code says it either way, while the loader's iterator still holds the worker."""
    match = _DIED.match(str(exc))
    if match is None:
        return None
    pids = {int(p) for p in match.group(1).replace(",", " ").split()}
    for worker in getattr(getattr(loader, "_iterator", None), "_workers", None) or ():
        code = worker.exitcode if getattr(worker, "pid", None) in pids else None
        if code is not None and code < 0:
            return signal.Signals(-code).name
    return "SIGKILL" if "killed by signal: Killed" in str(exc) else None
