"""Optimizers and learning-rate schedules."""

from components.optim.adamw import build_adamw, param_groups
from components.optim.schedules import SCHEDULES, lr_factor

__all__ = ["SCHEDULES", "build_adamw", "lr_factor", "param_groups"]
