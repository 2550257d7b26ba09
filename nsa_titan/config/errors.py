"""Recipe problems: each names where it came from, the field, the bad value and the fix.

The record is the one every layer reports (components.problems.Problem); `where` is the recipe
file, the command-line flag or "defaults".
"""

from __future__ import annotations

from components.problems import Problem

__all__ = ["Problem", "RecipeError"]


class RecipeError(Exception):
    """All the problems found in a recipe and its overrides, reported at once."""

    exit_code = 2

    def __init__(self, problems: list[Problem], notes: tuple[str, ...] | list[str] = ()):
        self.problems = list(problems)
        self.notes = list(notes)  # what the command line meant (a flag given twice), said with its refusal
        super().__init__(self.render())

    def render(self) -> str:
        count = len(self.problems)
        head = f"error: the recipe has {count} problem{'s' if count != 1 else ''}:"
        return "\n".join([head] + [f"  - {p.render()}" for p in self.problems] + [f"note: {n}" for n in self.notes])


# How a note on a saved recipe (resolve_text) begins when a check added since it was written refuses it.
NO_LONGER_PASSES = "the saved recipe no longer passes a check: "
