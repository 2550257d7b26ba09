"""The rank-0 console: one line per logged step, with progress and ETA."""

from __future__ import annotations

import errno
import sys
from datetime import timedelta


def _line(text: str, stream) -> None:
    try:
        print(text, file=stream, flush=True)
    except OSError as exc:
        # The terminal hung up (EIO: a closed ssh session, whose hang-up run_train.sh turned into a stop) or the
        # reader went away (EPIPE): the run goes on to its save without a console rather than crash.
        if exc.errno not in (errno.EIO, errno.EPIPE):
            raise


def say(message: str) -> None:
    _line(message, sys.stdout)


def warn(message: str) -> None:
    _line(f"warning: {message}", sys.stderr)


_ETA_CAP_S = 100 * 365 * 86400  # beyond this (a run of absurdly many steps) no date arithmetic is meaningful


def _eta(seconds: float) -> str:
    if not seconds < _ETA_CAP_S:
        return "> 100 years"
    return str(timedelta(seconds=int(max(seconds, 0))))


def step_line(record: dict, total_steps: int) -> str:
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {record['loss']:.4f}",
             f"lr {record['lr']:.2e}",
             f"gnorm {record['grad_norm']:.3f}",
             f"{record['tokens_per_second']:,.0f} tok/s",
             f"step {record['step_time_s'] * 1000:.0f} ms",
             f"data {record['data_wait_s'] * 1000:.0f} ms"]
    if "mfu_percent" in record:
        parts.append(f"mfu {record['mfu_percent']:.1f}%")
    if "max_memory_gib" in record:
        parts.append(f"mem {record['max_memory_gib']:.1f} GiB")
    # A run's (or resume's) first step has no ETA: its time holds compilation and warm-up, not the pace.
    parts.append(f"eta {_eta(record['eta_s'])}" if "eta_s" in record else "eta not yet (first step)")
    return " | ".join(parts)
