"""An optimizer that keeps running state in its param groups (as schedule-free and D-Adaptation do).

Load it and name it as the optimizer:

    --job.plugins=tests.plugins.group_counter --optimizer.name=group_counter

AdamW whose step size shrinks with a count of steps kept in each param group ("k"): a resume that
reset the count would move the weights differently from the run it continues. Its first group (weight decay) has
a base rate of its own, a tenth of the recipe's, as builders with per-group rates give theirs: a resume that took
the recipe's rate for every group would step it ten times too far.
"""

from __future__ import annotations

import torch

from components.optim.adamw import build_adamw
from nsa_titan.registry import register


class GroupCounter(torch.optim.AdamW):
    @torch.no_grad()
    def step(self, closure=None):
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["k"] += 1
            group["lr"] = group["lr"] / group["k"]
        loss = super().step(closure)
        for group, lr in zip(self.param_groups, lrs):
            group["lr"] = lr
        return loss


def build_group_counter(model, **kwargs):
    optimizer = build_adamw(model, **kwargs)
    optimizer.__class__ = GroupCounter
    for group in optimizer.param_groups:
        group["k"] = 0  # in every group from the start, as such optimizers keep theirs
    optimizer.param_groups[0]["lr"] *= 0.1
    return optimizer


register("optimizer", "group_counter", build_group_counter, replace=True,
         doc="test only: AdamW with a step count kept in its param groups")
