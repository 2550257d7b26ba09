"""Python's cyclic garbage collector on a schedule instead of whenever allocations trigger it.

An automatic collection pauses one rank at a moment of its own; with many ranks, every step waits
for whichever rank collected last. Collecting every `freq` steps on every rank keeps the pauses in
step and out of the timed path's randomness.
"""

from __future__ import annotations

import gc


class ScheduledGC:
    def __init__(self, freq: int):
        self.freq = freq
        self._was_enabled = gc.isenabled()
        if freq:
            gc.disable()
            gc.collect(1)  # start from a clean young generation

    def after_step(self, step: int) -> None:
        if self.freq and step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.freq and self._was_enabled:
            gc.enable()
