"""Gradient clipping: the norm it returns is the one before clipping, above max_norm the gradients are scaled
to it, below it they are left alone (the sharded runs of test_distributed.py clip too: the debug runs' norms
exceed the default 1.0)."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_titan.parallel.grad_clip import clip_grad_norm


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for values in grads:
        p = torch.nn.Parameter(torch.zeros(len(values)))
        p.grad = torch.tensor(values)
        params.append(p)
    return params


def _norm(params) -> float:
    return math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))


@pytest.mark.parametrize("max_norm, scaled", [(1.0, True), (20.0, False), (0.0, False)])
def test_clipping_scales_to_max_norm_and_returns_the_norm_before(max_norm, scaled):
    """0 turns clipping off (torch's clip would scale every gradient to zero)."""
    params = _params([3.0, 4.0], [12.0])  # norm 13
    before = [p.grad.clone() for p in params]
    no_grad = torch.nn.Parameter(torch.ones(2))  # a parameter without a gradient takes no part
    total = clip_grad_norm([*params, no_grad], max_norm)
    assert float(total) == pytest.approx(13.0, rel=1e-6)
    assert no_grad.grad is None
    for p, g in zip(params, before):
        if scaled:
            torch.testing.assert_close(p.grad, g * (max_norm / 13.0), rtol=1e-5, atol=0)
        else:
            assert torch.equal(p.grad, g)  # left alone, not multiplied by a factor near 1
    assert _norm(params) == pytest.approx(max_norm if scaled else 13.0, rel=1e-5)
