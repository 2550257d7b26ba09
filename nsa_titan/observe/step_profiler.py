"""torch.profiler over a window of training steps ([profiling] in the recipe).

Steps start_step .. start_step + steps - 1 (global step numbers, so a resumed run profiles the same
steps) are recorded after one warmup step, and every rank writes into job.dump_folder/<folder>:
    trace_rank{r}.json.gz      Chrome / Perfetto trace (open at ui.perfetto.dev or chrome://tracing)
    ops_rank{r}.txt            the ops' summed times, most expensive first
    memory_rank{r}.pickle      with memory_snapshot (CUDA): the allocator's history over the window,
                               for pytorch.org/memory_viz
A file an earlier run wrote there (a resumed run profiling the same steps) is kept, renamed with its
time: trace_rank0.20261126-091500.json.gz.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule

# Allocations the CUDA allocator remembers for the memory snapshot.
MEMORY_HISTORY_ENTRIES = 200_000


class StepProfiler:
    """Call before_step(n) before training step n and after_step(n) after it; close() at the end."""

    def __init__(self, config, dump_folder: str, rank: int, device: torch.device, say: Callable[[str], None]):
        self.config, self.rank, self.device, self.say = config, rank, device, say
        self.folder = os.path.join(dump_folder, config.folder)
        self.last = config.start_step + config.steps - 1
        self._profile: profile | None = None
        self._done = False
        self._recorded: list[int] = []  # profiled steps (warmup excluded)

    def before_step(self, step: int) -> None:
        if not self.config.enable or self._done or self._profile is not None:
            return
        warmup = 1 if step < self.config.start_step else 0
        if step > self.config.start_step:
            self._done = True
            trace = os.path.join(self.folder, f"trace_rank{self.rank}.json.gz")
            if os.path.exists(trace):  # a resumed run whose window an earlier launch profiled
                self.say(f"profiling: the run resumes at step {step}, after the window from profiling.start_step = "
                         f"{self.config.start_step}, which an earlier launch profiled ({trace}); nothing more is "
                         f"profiled (a later --profiling.start_step profiles other steps)")
            else:
                self.say(f"profiling: the run starts at step {step}, after profiling.start_step = "
                         f"{self.config.start_step}; nothing is profiled. Fix: set --profiling.start_step to a later "
                         f"step.")
            return
        if step < self.config.start_step - warmup:
            return
        os.makedirs(self.folder, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # The profiler counts from step_num: starting it at the run's step number names the trace's
        # ProfilerStep#N after the run's steps, and skip_first keeps the schedule's window where it is.
        with warnings.catch_warnings():  # no warmup only where the run starts inside the window: nothing to warm
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self._profile = profile(activities=activities,
                                    schedule=schedule(skip_first=step, wait=0, warmup=warmup, active=self.config.steps,
                                                      repeat=1),
                                    on_trace_ready=self._write, record_shapes=True, profile_memory=True)
        self._profile.step_num = step
        self._profile.current_action = self._profile.schedule(step)  # the profiler read schedule(0) when built
        if self.config.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profile.__enter__()

    def after_step(self, step: int) -> None:
        if self._profile is None:
            return
        if step >= self.config.start_step:
            self._recorded.append(step)
        self._profile.step()
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop (a run that ends or stops early inside the window writes what it recorded)."""
        if self._profile is None:
            return
        profiler, self._profile = self._profile, None
        profiler.__exit__(None, None, None)
        self._done = True
        if self.config.memory_snapshot:
            torch.cuda.memory._dump_snapshot(_keep_earlier(os.path.join(self.folder, f"memory_rank{self.rank}.pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
        steps = f"steps {self._recorded[0]}..{self._recorded[-1]}" if self._recorded else "no step (only warmup)"
        self.say(f"profiling: {steps} written to {self.folder}")

    def _write(self, profiler: profile) -> None:
        trace = _keep_earlier(os.path.join(self.folder, f"trace_rank{self.rank}.json.gz"))
        profiler.export_chrome_trace(trace)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=60)
        with open(_keep_earlier(os.path.join(self.folder, f"ops_rank{self.rank}.txt")), "w", encoding="utf-8") as fh:
            fh.write(table + "\n")


def _keep_earlier(path: str) -> str:
    """`path`, after moving aside what an earlier run wrote there (a resumed run profiling the same steps
    again): trace_rank0.json.gz becomes trace_rank0.<its time>.json.gz."""
    if os.path.exists(path):
        folder, name = os.path.split(path)
        stem, rest = name.split(".", 1)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
        kept, count = os.path.join(folder, f"{stem}.{stamp}.{rest}"), 1
        while os.path.exists(kept):  # profiles within one second
            count += 1
            kept = os.path.join(folder, f"{stem}.{stamp}-{count}.{rest}")
        os.replace(path, kept)
    return path
