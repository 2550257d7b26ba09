"""Graceful stop: SIGTERM, SIGINT or a halt file ends the run after the current step, with a checkpoint.

Preemption is normal on clusters: the scheduler's SIGTERM should cost nothing but a short save.
A second SIGINT stops at once, for a user who really means it.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

HALT_FILE = "HALT"


class GracefulStop:
    def __init__(self, dump_folder: str):
        self.halt_path = os.path.join(dump_folder, HALT_FILE)
        self.reason: str | None = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: no handlers to install
                pass

    def _on_signal(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def requested(self, device: torch.device, *, agree_now: bool) -> bool:
        """Whether to stop after this step, the same answer on every rank.

        With several ranks the answer needs an all-reduce; it is asked only on steps where
        `agree_now` is true (the logging steps, which synchronise anyway), so a stop waits at most
        metrics.log_freq steps.
        """
        if self.reason is None and os.path.exists(self.halt_path):
            self.reason = f"halt file {self.halt_path}"
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.reason is not None
        if not agree_now:
            return False
        flag = torch.tensor([1 if self.reason else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.reason is None:
            self.reason = "another rank was asked to stop"
        return bool(flag.item())

    def consume_halt_file(self) -> None:
        """Keep the halt file from stopping the resumed run, without deleting what the user wrote."""
        if os.path.exists(self.halt_path):
            os.replace(self.halt_path, self.halt_path + ".handled")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
