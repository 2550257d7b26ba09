"""Recipe problems: each names where it came from, the field, the bad value and the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_UNSET = object()


@dataclass
class Problem:
    source: str  # a recipe file, a command-line flag, or "defaults"
    field: str  # dotted path, e.g. training.steps
    value: Any
    why: str
    fix: str

    def render(self) -> str:
        plain = self.value is None or dataclasses.is_dataclass(self.value)
        shown = "" if plain else f" = {self.value!r}"
        return f"{self.source}: {self.field}{shown}: {self.why}. Fix: {self.fix}."


class RecipeError(Exception):
    """All the problems found in a recipe and its overrides, reported at once."""

    exit_code = 2

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.problems)
        head = f"error: the recipe has {count} problem{'s' if count != 1 else ''}:"
        return "\n".join([head] + [f"  - {p.render()}" for p in self.problems])
