"""Learning-rate schedules: linear warmup, then cosine, linear or constant decay.

`lr_factor(step, ...)` is the multiplier of the peak learning rate used for optimizer step
`step` (1-based: the first update uses step 1). Warmup reaches the peak at step warmup_steps;
decay ends exactly at min_lr_factor on the last step, whatever the number of steps.
"""

from __future__ import annotations

import math


def _decay_progress(step: int, warmup_steps: int, total_steps: int) -> float:
    span = total_steps - warmup_steps
    if span <= 0:
        return 1.0
    return min(max((step - warmup_steps) / span, 0.0), 1.0)


def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def linear(progress: float) -> float:
    return 1.0 - progress


def constant(progress: float) -> float:
    return 1.0


SCHEDULES = {"cosine": cosine, "linear": linear, "constant": constant}


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_factor: float) -> float:
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    shape = SCHEDULES[decay](_decay_progress(step, warmup_steps, total_steps))
    if decay == "constant":
        return 1.0
    return min_lr_factor + (1.0 - min_lr_factor) * shape
