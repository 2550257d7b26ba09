"""Problems with what was asked for, as records, and the one validator of argument dataclasses.

Every layer reports the same record, `Problem(where, field, value, why, fix)`: a part checking its
own arguments leaves `where` empty and names the field relative to its arguments; the engine
re-homes the record under the recipe path and names the file or flag that set it.

`find_problems` validates an argument dataclass: each field's bounds and choices from its metadata
("ge", "gt", "le", "choices"), nested dataclasses included, then the dataclass's own cross-field
`check()` (which returns Problems) once its fields are in bounds. The engine's recipe builder
applies the same `bound_problem` to every recipe field.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from components.errors import UserError


@dataclass(frozen=True)
class Problem:
    where: str  # a recipe file, a command-line flag, "defaults"; "" where the caller knows it
    field: str  # dotted path, e.g. training.steps or nsa.block_stride
    value: Any  # the offending value (None when there is nothing to show)
    why: str  # what is wrong, without a trailing period
    fix: str  # what to do instead, without a trailing period

    def render(self) -> str:
        plain = self.value is None or dataclasses.is_dataclass(self.value)
        value = str(self.value).lower() if isinstance(self.value, bool) else repr(self.value)  # as TOML writes it
        shown = "" if plain else f" = {value}"
        head = f"{self.where}: " if self.where else ""
        return f"{head}{self.field}{shown}: {self.why}. Fix: {self.fix}."

    def under(self, prefix: str, where: str = "") -> Problem:
        """The same problem with its field under `prefix` ("a.b." or "") and `where` said."""
        return dataclasses.replace(self, field=prefix + self.field, where=where or self.where)


def problem(field: str, value: Any, why: str, fix: str) -> Problem:
    """A problem whose `where` the caller fills in."""
    return Problem("", field, value, why, fix)


def raise_problems(what: str, problems: list[Problem]) -> None:
    """UserError naming every problem, e.g. 'invalid NSA hyperparameters: ...'; nothing when there is none."""
    if problems:
        raise UserError(f"{what}: " + " ".join(p.render() for p in problems))


def suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(str(word), candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choices_of(meta: Mapping[str, Any]) -> tuple | None:
    """A field's allowed values; a callable gives those known when checked (e.g. plugins' backends)."""
    choices = meta.get("choices")
    return tuple(choices()) if callable(choices) else choices


# What a field's metadata may say; anything else would be ignored, so tests refuse it.
FIELD_METADATA = frozenset({"doc", "choices", "ge", "gt", "le", "lt", "component", "args_for", "placement", "exclude",
                            "used_when", "keeps_weights", "path", "held_out"})

# "path": the field's text (or each text of its list) names files, folders or globs on this machine, relative to the
# directory the run starts in; True always, or a callable (args, folder) -> bool saying whether it does in `args` with
# relative paths read from `folder` (a field that may name either a file or something else, such as a Hub dataset).
# An export read elsewhere reads those paths from the directory it was made in.
# "held_out": the field decides which of the source's documents are held out for validation: "share" (the share held
# out by a stable hash: a larger one holds out documents a run with a smaller one trained on) or "split" (a split held
# out by name; '' holds out a share of the split trained on). eval of an export says when a data flag's value would
# score documents the model trained on.


def bound_problem(value: Any, meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """(why, fix) when value breaks the field's choices or bounds, else None."""
    choices = choices_of(meta)
    if choices is not None and value not in choices:
        return (f"must be one of {', '.join(map(repr, choices))}" + suggest(str(value), list(map(str, choices))),
                f"choose one of {', '.join(map(str, choices))}")
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        return "is beyond a 64-bit integer", "use a smaller number"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok, words in (("ge", lambda v, b: v >= b, "at least"), ("gt", lambda v, b: v > b, "greater than"),
                               ("le", lambda v, b: v <= b, "at most"), ("lt", lambda v, b: v < b, "less than")):
            if key in meta and not ok(value, meta[key]):
                return f"must be {words} {meta[key]}", f"use a value {words} {meta[key]}"
    return None


def find_problems(args: Any, prefix: str = "") -> list[Problem]:
    """Every bound/choice violation and every `check()` problem of a (nested) argument dataclass."""
    problems, nested = [], []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        path = prefix + f.name
        if dataclasses.is_dataclass(value):
            nested += find_problems(value, path + ".")
            continue
        bad = bound_problem(value, f.metadata)
        if bad:
            problems.append(problem(path, value, *bad))
    check = getattr(args, "check", None)
    if not problems and callable(check):  # cross-field rules assume in-bounds fields
        problems += [p.under(prefix) for p in check() or []]
    return problems + nested
