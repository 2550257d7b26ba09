"""The record of each training step logged: its loss and learning rate, tokens/s over the window since the
last record, the ETA, MFU, compile counters and peak device memory. The caller reads every clock and
passes its times in."""

from __future__ import annotations

import torch

from nsa_titan.observe.mfu import mfu_percent
from nsa_titan.parallel.compile import compile_counters


class StepRecorder:
    """Throughput counts training only: the seconds spent saving, validating, probing telemetry, writing
    a profiler trace or a logged record in a window are set aside (`aside_s`). The ETA's pace starts
    after the first step, which holds compilation and warm-up (it counts saves and validations: they come again, but
    not work done once, such as writing the profiler's trace or compiling at a first validation); the first step's
    record has no ETA, as no step has shown the pace yet (its own time, times the steps left, would say hours for a
    compile of seconds)."""

    def __init__(self, run_start: float, first_step: int, steps: int, elapsed_before: float, world_size: int,
                 device: torch.device, peak_flops: float | None, flops_per_token: float | None, compiled: bool):
        self.run_start, self.first_step, self.steps = run_start, first_step, steps
        self.elapsed_before, self.world_size, self.device = elapsed_before, world_size, device
        self.peak_flops, self.flops_per_token, self.compiled = peak_flops, flops_per_token, compiled
        self.window_start, self.window_tokens, self.aside_s = run_start, 0, 0.0
        self.first_step_end: float | None = None
        self.once_s = 0.0  # one-off work since the first step's end, left out of the ETA's pace
        self._warmed_up: set[str] = set()  # recurring work whose first run warmed up, awaiting a plain run

    def step_taken(self, tokens: int, end: float) -> None:
        """A step's tokens join the window; the first step's `end` starts the ETA's pace."""
        if self.first_step_end is None:
            self.first_step_end = end
        self.window_tokens += tokens

    def set_aside(self, seconds: float, once: bool = False) -> None:
        """`seconds` of no training; `once`: work that does not come again (a profiler trace's export)."""
        self.aside_s += seconds
        if once and self.first_step_end is not None:
            self.once_s += seconds

    def recurring(self, kind: str, seconds: float, warm_up: bool) -> None:
        """`seconds` of work of `kind` (already set aside) that comes again; `warm_up`: this run also did one-off work
        (a first validation under compile compiles each block once more). That run leaves the ETA's pace and the
        next run of `kind`, a plain one, stands in for it, so the pace keeps what every run of `kind` costs."""
        if warm_up:
            self.once_s += seconds
            self._warmed_up.add(kind)
        elif kind in self._warmed_up:
            self.once_s -= seconds
            self._warmed_up.discard(kind)

    def new_window(self, start: float, aside_s: float) -> None:
        """After a record is logged: the next window starts at `start` with `aside_s` already set aside."""
        self.window_start, self.window_tokens, self.aside_s = start, 0, aside_s

    def record(self, now: float, step: int, loss: float, lr: float, grad_norm: float, tokens_seen: int,
               step_time_s: float, data_wait_s: float, skipped_steps: int) -> dict:
        rate = self.window_tokens / max(now - self.window_start - self.aside_s, 1e-9)
        done, left = step - self.first_step, self.steps - step
        pace = (now - self.first_step_end - self.once_s) / (done - 1) if done > 1 else None
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_second": rate,
            "tokens_per_second_per_device": rate / self.world_size,
            "tokens_seen": tokens_seen,
            "step_time_s": step_time_s,
            "data_wait_s": data_wait_s,
            "elapsed_s": self.elapsed_before + now - self.run_start,
            **({"eta_s": pace * left if left else 0.0} if pace is not None or not left else {}),
            "skipped_steps": skipped_steps,
        }
        if self.peak_flops and self.flops_per_token:
            record["mfu_percent"] = mfu_percent(record["tokens_per_second_per_device"],
                                                self.flops_per_token, self.peak_flops)
        if self.compiled:
            record.update(compile_counters())
        if self.device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return record
