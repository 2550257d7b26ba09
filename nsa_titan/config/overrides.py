"""Command-line overrides: `--section.field=value` or `--section.field value`, nested fields included.

Values stay text here; the schema gives them their type when the recipe is built, so one parser
serves ints, floats (3e-4), booleans (true / false), comma-separated lists and choices alike.
"""

from __future__ import annotations

import difflib
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
