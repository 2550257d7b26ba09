"""Per-rank heartbeat files: {folder}/heartbeat/rank-R.json says which step each rank last finished.

An outside monitor (or a person on a hung job) reads them to see which rank stopped advancing,
on which host and process. Writing one is cheap: no device synchronisation (the CUDA memory
figure is the allocator's host-side counter) and an atomic replace of a small file.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import sys
import time

import torch


_TEMPORARY = re.compile(r"^rank-\d+\.json\.\d+\.tmp$")  # beat()'s temporary file


def process_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc), else its peak from getrusage."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            resident_pages = int(fh.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def memory_record(device: torch.device | None) -> dict[str, int | str]:
    """The memory figure of a heartbeat: CUDA peak allocated on a CUDA device, else process RSS."""
    if device is not None and device.type == "cuda":
        return {"memory_kind": "cuda_max_allocated", "memory_bytes": int(torch.cuda.max_memory_allocated(device))}
    return {"memory_kind": "process_rss", "memory_bytes": process_rss_bytes()}


class Heartbeat:
    """`beat(step)` rewrites this rank's heartbeat file; at most once per `min_interval_s` seconds."""

    def __init__(self, folder: str, rank: int, device: torch.device | None = None, min_interval_s: float = 0.0,
                 world_size: int = 1):
        self.folder = os.path.join(folder, "heartbeat")
        os.makedirs(self.folder, exist_ok=True)
        if rank == 0:  # files of ranks this launch has not (an earlier, larger one) would read as stuck ranks
            for name in os.listdir(self.folder):
                number = name[len("rank-"):-len(".json")] if name.startswith("rank-") and name.endswith(".json") else ""
                # and a beat's temporary file cut short by a kill: no rank of this launch has beaten yet, and the
                # run folder's lock keeps other runs out, so each is dead (one a preemption, under another pid)
                if (number.isdigit() and int(number) >= world_size) or _TEMPORARY.match(name):
                    os.remove(os.path.join(self.folder, name))
        self.path = os.path.join(self.folder, f"rank-{rank}.json")
        self.rank = rank
        self.device = device
        self.min_interval_s = min_interval_s
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._last_write = float("-inf")

    def beat(self, step: int, *, force: bool = False) -> bool:
        """Record that `step` completed; returns whether the file was written."""
        now = time.monotonic()
        if not force and now - self._last_write < self.min_interval_s:
            return False
        self._last_write = now
        record = {"rank": self.rank, "step": step, "time": time.time(), "host": self._host, "pid": self._pid,
                  **memory_record(self.device)}
        tmp = f"{self.path}.{self._pid}.tmp"  # as _TEMPORARY matches
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(tmp, self.path)
        return True
