"""A checkpoint step's place on disk, named once: its folder in the checkpoint folder and its train state file."""

from __future__ import annotations

import os
import re

TRAIN_STATE = "train_state.json"
STEP_DIR = re.compile(r"^step-(0|[1-9]\d*)$")  # as step_name names them: step-08 is no step folder


def step_name(step: int) -> str:
    """The name of step `step`'s folder."""
    return f"step-{step}"


def step_path(folder: str, step: int) -> str:
    """Step `step`'s folder in the checkpoint folder `folder`."""
    return os.path.join(folder, step_name(step))


def train_state_file(step_folder: str) -> str:
    """The train state a step folder holds (step, tokens seen, schedule, the layout that wrote it)."""
    return os.path.join(step_folder, TRAIN_STATE)
