"""Optimizers and learning-rate schedules."""

from components.optim.adamw import build_adamw, param_groups
from components.optim.muon import MuonArgs, build_muon
from components.optim.schedules import SCHEDULES, lr_factor

__all__ = ["SCHEDULES", "MuonArgs", "build_adamw", "build_muon", "lr_factor", "param_groups"]
