"""What a DataLoader worker process's death looks like from the training process."""

from __future__ import annotations


def worker_died(exc: BaseException) -> bool:
    """Whether `exc` is torch's word that a loader worker process died: its SIGCHLD handler raises it in the
    main thread wherever that thread is (a step, a save, a validation, a source's own read), so code that
    catches broad errors passes it on."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker (pid")
