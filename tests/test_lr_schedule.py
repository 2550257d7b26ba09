"""The LR schedule's values at warmup, peak, mid and end, as the optimizer really sees them."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from nsa_titan import registry
from nsa_titan.assemble import build_lr_scheduler
from nsa_titan.config import resolve

PEAK = 1e-3


def lrs_seen(steps: int, warmup: int, decay: str, min_factor: float, decay_steps: int = -1,
             plugins: str = "") -> list[float]:
    """The learning rate used by each of the run's optimizer steps, 1..steps."""
    argv = [f"--training.steps={steps}", f"--lr_scheduler.warmup_steps={warmup}",
            f"--lr_scheduler.decay_type={decay}", f"--optimizer.lr={PEAK}"]
    if decay != "constant":  # flags for a decay, which a constant schedule refuses at any value
        argv += [f"--lr_scheduler.min_lr_factor={min_factor}", f"--lr_scheduler.decay_steps={decay_steps}"]
    if plugins:
        argv.append(f"--job.plugins={plugins}")
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


def test_sqrt_cool_down():
    lrs = lrs_seen(steps=20, warmup=4, decay="sqrt", min_factor=0.0)
    assert lrs[3] == pytest.approx(PEAK)
    assert lrs[7] == pytest.approx(PEAK * (1 - math.sqrt(0.25)))  # step 8: a quarter of 4..20
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_warmup_stable_decay():
    """Peak from the end of warmup until the last decay_steps steps, which decay to the floor."""
    lrs = lrs_seen(steps=100, warmup=10, decay="linear", min_factor=0.1, decay_steps=20)
    assert lrs[9:80] == pytest.approx([PEAK] * 71)  # steps 10..80: warmup's end, then stable
    assert lrs[89] == pytest.approx(PEAK * (0.1 + 0.9 * 0.5))  # step 90: halfway through 80..100
    assert lrs[-1] == pytest.approx(PEAK * 0.1)
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))


def test_decay_longer_than_the_run_after_warmup_still_ends_at_the_floor():
    lrs = lrs_seen(steps=20, warmup=4, decay="linear", min_factor=0.2, decay_steps=1000)
    assert lrs == pytest.approx(lrs_seen(steps=20, warmup=4, decay="linear", min_factor=0.2))
    notes = resolve(["--training.steps=20", "--lr_scheduler.warmup_steps=4", "--lr_scheduler.decay_steps=1000"]).notes
    assert any("lr_scheduler.decay_steps = 1000 from flag" in n and "steps after warmup (16)" in n for n in notes), notes


def test_a_longer_resumed_run_moves_the_decay_to_its_new_end():
    """Warmup-stable-decay's point: a run resumed with more steps is still at the peak, and cools
    down over the last decay_steps of the longer run."""
    first = lrs_seen(steps=100, warmup=10, decay="cosine", min_factor=0.1, decay_steps=20)[:50]
    recipe = resolve(["--training.steps=200", "--lr_scheduler.warmup_steps=10", "--lr_scheduler.decay_steps=20",
                      f"--optimizer.lr={PEAK}"]).recipe
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=PEAK)
    for group in opt.param_groups:
        group["initial_lr"] = PEAK
    sched = build_lr_scheduler(recipe, opt, completed_steps=50)
    resumed = []
    for _ in range(150):
        resumed.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert first[10:] == pytest.approx([PEAK] * 40)
    assert resumed[:130] == pytest.approx([PEAK] * 130)  # steps 51..180
    assert resumed[-1] == pytest.approx(PEAK * 0.1) and resumed[-2] > resumed[-1]


def test_a_plugin_schedule_is_used(tmp_path, monkeypatch):
    """A shape registered by a plugin is the one the optimizer sees (not only accepted by the recipe)."""
    (tmp_path / "my_schedule.py").write_text(
        "from nsa_titan.registry import register\n"
        "register('lr_schedule', 'step_half', lambda p: 1.0 if p < 0.5 else 0.0, replace=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        lrs = lrs_seen(steps=10, warmup=0, decay="step_half", min_factor=0.5, plugins="my_schedule")
        assert lrs[:4] == pytest.approx([PEAK] * 4) and lrs[5:] == pytest.approx([PEAK * 0.5] * 5)
    finally:
        registry._PARTS["lr_schedule"].pop("step_half", None)
        sys.modules.pop("my_schedule", None)
