"""The LR schedule's values at warmup, peak, mid and end, as the optimizer really sees them."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_titan.assemble import build_lr_scheduler
from nsa_titan.config import resolve

PEAK = 1e-3


def lrs_seen(steps: int, warmup: int, decay: str, min_factor: float) -> list[float]:
    """The learning rate used by each of the run's optimizer steps, 1..steps."""
    argv = [f"--training.steps={steps}", f"--lr_scheduler.warmup_steps={warmup}",
            f"--lr_scheduler.decay_type={decay}", f"--optimizer.lr={PEAK}"]
    if decay != "constant":
        argv.append(f"--lr_scheduler.min_lr_factor={min_factor}")
    recipe = resolve(argv).recipe
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=recipe.optimizer.lr)
    sched = build_lr_scheduler(recipe, opt)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_cosine_warmup_peak_mid_end():
    lrs = lrs_seen(steps=110, warmup=10, decay="cosine", min_factor=0.1)
    assert lrs[0] == pytest.approx(PEAK * 1 / 10)  # first warmup step
    assert lrs[4] == pytest.approx(PEAK * 5 / 10)
    assert lrs[9] == pytest.approx(PEAK)  # warmup ends at the peak
    assert max(lrs) == pytest.approx(PEAK)
    # Halfway through the decay (step 60 of 10..110) cosine is at the midpoint between peak and floor.
    assert lrs[59] == pytest.approx(PEAK * (0.1 + 0.9 * 0.5))
    assert lrs[-1] == pytest.approx(PEAK * 0.1)  # the last step ends exactly at the floor
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone decay


def test_cosine_quarter_point():
    lrs = lrs_seen(steps=100, warmup=0, decay="cosine", min_factor=0.0)
    assert lrs[24] == pytest.approx(PEAK * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_linear_decay():
    lrs = lrs_seen(steps=20, warmup=4, decay="linear", min_factor=0.2)
    assert lrs[3] == pytest.approx(PEAK)
    assert lrs[11] == pytest.approx(PEAK * (0.2 + 0.8 * 0.5))  # step 12: halfway through 4..20
    assert lrs[-1] == pytest.approx(PEAK * 0.2)


def test_constant_after_warmup():
    lrs = lrs_seen(steps=10, warmup=2, decay="constant", min_factor=0.0)
    assert lrs[0] == pytest.approx(PEAK / 2)
    assert lrs[1:] == pytest.approx([PEAK] * 9)
