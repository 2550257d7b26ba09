"""AdamW that takes at least a set time per step: room for a test to act between two steps.

Load it and name it as the optimizer; the numbers it computes are AdamW's, to the bit:

    --job.plugins=tests.plugins.slow_steps --optimizer.name=slow_adamw

Tests that signal, kill or halt a run once it reaches a step need the run to still be going when
the signal lands; a tiny model on a fast machine can otherwise finish in the polling interval. A test
that must act inside one step, whatever the machine's load, holds the run there: with HOLD_ENV naming a
file, a step that begins while the file exists writes `<file>.held` and waits until the file is gone.
"""

from __future__ import annotations

import os
import time

import torch

from components.optim.adamw import build_adamw
from nsa_titan.registry import register

SECONDS_PER_STEP = 0.2
HOLD_ENV = "NSA_TITAN_TEST_HOLD"
HOLD_LIMIT_S = 120  # a test that never lets go fails on its own timeout; the run then goes on


def _hold_while_asked() -> None:
    hold = os.environ.get(HOLD_ENV)
    if not hold or not os.path.exists(hold):
        return
    with open(hold + ".held", "w"):
        pass
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(hold):
        if time.monotonic() > deadline:
            os.remove(hold)  # once: later steps are not held again
            break
        time.sleep(0.01)


class SlowAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        time.sleep(SECONDS_PER_STEP)
        _hold_while_asked()
        return super().step(closure)


def build_slow_adamw(model, **kwargs):
    optimizer = build_adamw(model, **kwargs)
    optimizer.__class__ = SlowAdamW  # the same object and state, only slower
    return optimizer


register("optimizer", "slow_adamw", build_slow_adamw, replace=True,
         doc=f"test only: AdamW that sleeps {SECONDS_PER_STEP} s before every step")
