"""Command-line overrides: `--section.field=value` or `--section.field value`, nested fields included.

Values stay text here; the schema gives them their type when the recipe is built, so one parser
serves ints, floats (3e-4), booleans (true / false), comma-separated lists and choices alike.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

from nsa_titan.config.errors import Problem

ACTIONS = {"--help": "help", "-h": "help", "--print-config": "print_config"}


class CliText(str):
    """A value typed on the command line: text to parse into the field's type."""


class NoValue(CliText):
    """A flag given without a value (--training.steps at the end of the line). Kept as an override so that the
    schema judges the name first: a flag that names no field (--version) is refused as that, not told to take a
    value it could not have."""


@dataclass
class CommandLine:
    recipe: str | None
    overrides: list[tuple[str, str, CliText]]  # (flag as typed, dotted key, value)
    actions: set[str]
    notes: list[str] = field(default_factory=list)  # worth telling the user (a field set twice)


def _spilled_words(argv: list[str], i: int, value: str) -> list[str]:
    """The words from argv[i] on, up to the next flag or option, that a space-form flag's `value` left behind: files
    beside it with its extension (a pattern the shell expanded: corpus/*.txt), never a recipe (a .toml file, or a
    folder: a run's)."""
    spilled = []
    while i < len(argv) and not argv[i].startswith("-") and argv[i] not in ACTIONS:
        word = argv[i]
        if (word.lower().endswith(".toml") or os.path.isdir(word) or os.path.dirname(word) != os.path.dirname(value)
                or os.path.splitext(word)[1] != os.path.splitext(value)[1]):
            break
        spilled.append(word)
        i += 1
    return spilled


def _pattern_like(path: str) -> str:
    """A pattern of the files beside `path` with its extension: corpus/a.txt -> corpus/*.txt."""
    folder, name = os.path.split(path)
    extension = os.path.splitext(name)[1]
    return os.path.join(folder, f"*{extension}")


def parse_args(argv: list[str], problems: list[Problem]) -> CommandLine:
    recipe: str | None = None
    overrides: list[tuple[str, str, CliText]] = []
    actions: set[str] = set()
    flag_of: dict[str, str] = {}  # field -> the flag that set it
    notes: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ACTIONS:
            actions.add(ACTIONS[arg])
            continue
        if not arg.strip():  # an unset shell variable, say: not "no recipe"
            problems.append(Problem("argument ''", "recipe", None, "is an empty recipe path",
                                    "name the recipe file, e.g. recipes/debug.toml"))
            continue
        if not arg.startswith("-"):
            key = arg.split("=", 1)[0]
            if "=" in arg and "." in key and "/" not in key and not key.endswith(".toml"):  # training.steps=5
                problems.append(Problem(f"argument {arg!r}", "override", None, "looks like an override without its "
                                        "leading --", f"write it as --{arg}"))
            elif recipe is None:
                recipe = arg
            else:
                problems.append(Problem(f"argument {arg!r}", "recipe", None,
                                        f"a second recipe path after {recipe!r}",
                                        "give one recipe; compose others with extends = [...] inside it"))
            continue
        if not arg.startswith("--") or len(arg) == 2:
            problems.append(Problem(f"flag {arg!r}", "override", None, "is not an override",
                                    "write overrides as --section.field=value, e.g. --training.steps=20"))
            continue
        key, sep, value = arg[2:].partition("=")
        flag = arg
        if f"--{key}" in ACTIONS:  # --print-config=true
            problems.append(Problem(f"flag {arg!r}", key, None, "takes no value", f"write --{key} alone"))
            continue
        if "." not in key:  # not a field path: perhaps an option misspelled (--print_config)
            close = difflib.get_close_matches(f"--{key}", [a for a in ACTIONS if a.startswith("--")], n=1, cutoff=0.7)
            if close:
                problems.append(Problem(f"flag {arg!r}", key, None, f"is not an option (did you mean {close[0]}?)",
                                        f"write {close[0]}"))
                continue
        if not sep:
            if i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                flag = f"{arg} {value}"
                i += 1
                spilled = _spilled_words(argv, i, value)
                if spilled:  # '--paths corpus/*.txt' unquoted: the shell made one word per file
                    i += len(spilled)
                    problems.append(Problem(
                        f"flag {flag!r}", key, None,
                        f"is followed by {len(spilled)} more word(s) that are neither flags nor a recipe "
                        f"({', '.join(map(repr, spilled[:3]))}{', ...' if len(spilled) > 3 else ''}): the shell "
                        f"expanded a pattern into one word per file",
                        f"quote the pattern so that the shell passes it on, e.g. '--{key}={_pattern_like(value)}', "
                        f"or name the folder"))
            else:
                value = NoValue("")
        if not key or any(not part for part in key.split(".")):
            problems.append(Problem(f"flag {arg!r}", key, None, "is not a field path",
                                    "name a field as section.field, e.g. --training.steps=20"))
            continue
        if key in flag_of:  # the last one wins, as a wrapper script appending flags expects; say so
            notes.append(f"{key} is set twice on the command line: {flag!r} replaces {flag_of[key]!r}")
        flag_of[key] = flag
        overrides.append((flag, key, value if isinstance(value, CliText) else CliText(value)))
    return CommandLine(recipe, overrides, actions, notes)


def apply_overrides(table: dict, origin: dict[str, str], overrides: list[tuple[str, str, CliText]],
                    problems: list[Problem]) -> None:
    """Write each override into the merged recipe table; the schema check comes later."""
    for flag, key, value in overrides:
        parts = key.split(".")
        node = table
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(f"flag {flag!r}", ".".join(parts[: depth + 1]), child,
                                        "is a value, not a table", "override the value itself"))
                break
            node = child
        else:
            if isinstance(node.get(parts[-1]), dict):
                problems.append(Problem(f"flag {flag!r}", key, None, "is a table, not a value",
                                        f"override one of its fields, e.g. --{key}.FIELD=VALUE"))
                continue
            node[parts[-1]] = value
            origin.pop(key, None)  # re-inserted last: origin's order is the order of the last writes
            origin[key] = f"flag {flag!r}"
