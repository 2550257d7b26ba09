"""Learning-rate schedules: linear warmup, an optional constant stretch, then a decay shape.

`lr_factor(step, ...)` is the multiplier of the peak learning rate used for optimizer step
`step` (1-based: the first update uses step 1). Warmup reaches the peak at step warmup_steps.
The decay runs over the last `decay_steps` steps (all steps after warmup when None; fewer gives
warmup-stable-decay, whose constant stretch lets a run be extended before it cools down) and ends
exactly at min_lr_factor on the last step, whatever the number of steps.

A shape maps decay progress p in [0, 1] to a fraction of the way from the floor to the peak:
1 at p = 0, 0 at p = 1 (constant stays at 1).
"""

from __future__ import annotations

import math
from typing import Callable

Shape = Callable[[float], float]


def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def linear(progress: float) -> float:
    return 1.0 - progress


def sqrt(progress: float) -> float:
    """The "1 - sqrt" cool-down: steep at first, then gentle."""
    return 1.0 - math.sqrt(progress)


def constant(progress: float) -> float:
    return 1.0


SCHEDULES: dict[str, Shape] = {"cosine": cosine, "linear": linear, "sqrt": sqrt, "constant": constant}


def decay_start(*, warmup_steps: int, total_steps: int, decay_steps: int | None) -> int:
    """The last step before the decay: the end of warmup, or later when the decay is shorter."""
    if decay_steps is None:
        return warmup_steps
    return max(warmup_steps, total_steps - decay_steps)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, shape: Shape, min_lr_factor: float,
              decay_steps: int | None = None) -> float:
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    start = decay_start(warmup_steps=warmup_steps, total_steps=total_steps, decay_steps=decay_steps)
    span = total_steps - start
    progress = 1.0 if span <= 0 else min(max((step - start) / span, 0.0), 1.0)
    return min_lr_factor + (1.0 - min_lr_factor) * shape(progress)
