"""Reading recipes (with `extends` composition) and writing the resolved recipe back as TOML."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from nsa_titan.checkout_hints import shipped_recipes
from nsa_titan.config.errors import Problem
from nsa_titan.run_recipe import run_of_folder

EXTENDS_KEY = "extends"


def load_composed(path: str, problems: list[Problem]) -> tuple[dict, dict[str, str]]:
    """Load a recipe and the files it extends, merged in order; later files and tables win.

    Returns the merged table and, for every leaf key path, the file that set it last.
    """
    merged: dict = {}
    origin: dict[str, str] = {}
    _load_into(os.path.abspath(path), merged, origin, problems, chain=())
    return merged, origin


def _load_into(path: str, merged: dict, origin: dict[str, str], problems: list[Problem],
               chain: tuple[str, ...]) -> None:
    shown = shown_path(path)
    if path in chain:
        cycle = " -> ".join(shown_path(p) for p in chain + (path,))
        problems.append(Problem(shown, EXTENDS_KEY, None, f"extends itself in a cycle ({cycle})",
                                "remove one of the extends entries"))
        return
    table = read_toml(path, problems, where=(shown_path(chain[-1]) if chain else "command line"),
                      extended_by=chain[-1] if chain else None)
    if table is None:
        return
    bases = table.pop(EXTENDS_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        problems.append(Problem(shown, EXTENDS_KEY, bases, "must be a file path or a list of file paths",
                                'write extends = ["presets/model.toml"]'))
        bases = []
    for base in bases:
        _load_into(os.path.normpath(os.path.join(os.path.dirname(path), base)), merged, origin,
                   problems, chain + (path,))
    _merge(merged, table, origin, shown, prefix="")


def shown_path(path: str) -> str:
    """A path as the user would type it: relative to here when inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def run_folder_flag(recipe: str) -> str:
    """' --job.dump_folder=FOLDER' where the recipe a run saved in FOLDER names another folder read from here (its
    job.dump_folder is relative to where the run started, and this is elsewhere); '' where it names FOLDER. FOLDER
    is written as `recipe` is (relative or absolute)."""
    folder = os.path.dirname(recipe) or "."
    try:
        with open(recipe, "rb") as fh:
            job = tomllib.load(fh).get("job")
        named = job.get("dump_folder") if isinstance(job, dict) else None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        named = None
    if isinstance(named, str) and os.path.realpath(named) == os.path.realpath(folder):
        return ""
    return f" --job.dump_folder={folder}"


def read_toml(path: str, problems: list[Problem], where: str, extended_by: str | None = None) -> dict | None:
    """extended_by: the recipe whose extends names `path` (None: the command line named it)."""
    if not os.path.isfile(path):
        if os.path.isdir(path):
            why = "is a folder, not a recipe file"
        elif os.path.islink(path):
            why = "is a symbolic link that leads to no file (a broken link, or a loop)"
        else:
            why = "file not found"
        run = run_of_folder(path) if extended_by is None and os.path.isdir(path) else None
        if run is not None:  # a run's folder (or its checkpoints'): its recipe is the one meant
            recipe, step = run
            if step is not None:
                what = f"checkpoint step {step} of a training run"
            elif os.path.dirname(recipe) == os.path.abspath(path):
                what = "a training run's folder"
            else:
                what = "the checkpoint folder of a training run"
            flags = run_folder_flag(shown_path(recipe)) + ("" if step is None else f" --checkpoint.load_step={step}")
            fix = f"name the run's recipe, {shown_path(recipe)}" + (f" with{flags}" if flags else "")
            problems.append(Problem(where, "recipe", path, f"is {what}, not a recipe file", fix))
        elif extended_by is None:
            problems.append(Problem(where, "recipe", path, why, f"check the path; {shipped_recipes()}"))
        else:  # an extends entry is read relative to the file that names it
            problems.append(Problem(where, EXTENDS_KEY, path, why,
                                    f"an extends entry is a path relative to {shown_path(extended_by)}'s folder "
                                    f"({shown_path(os.path.dirname(extended_by)) or '.'}); correct it there"))
        return None
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        problems.append(Problem(shown_path(path), "recipe", None, f"is not valid TOML: {exc}",
                                "fix the syntax at the line and column given"))
    except UnicodeDecodeError as exc:
        if _starts_with(path, b"PK\x03\x04"):  # a zip archive: what `export` writes (torch.save's format)
            problems.append(Problem(shown_path(path), "recipe", None, "is a zip archive (an exported model, as "
                                    "`export` writes one?), not a recipe", "name the run's recipe (TOML); `sample`, "
                                    "`eval` and `plot` read an exported model"))
        else:
            problems.append(Problem(shown_path(path), "recipe", None, f"cannot be read as text: {exc}",
                                    "a recipe is TOML text in UTF-8: name the recipe, or convert the file"))
    except OSError as exc:
        problems.append(Problem(shown_path(path), "recipe", None, f"cannot be read: {exc}",
                                "check the file's permissions"))
    else:
        if _sets_something(table):
            return table
        # The command refuses to train the built-in defaults with no recipe named: an empty file is no recipe either.
        problems.append(Problem(shown_path(path), "recipe", None, "sets nothing (it is empty, or holds only comments "
                                "and empty tables): a run of it would train the built-in defaults",
                                f"write the recipe's fields in it, or name the recipe meant; {shipped_recipes()}"))
    return None


def _sets_something(table: dict) -> bool:
    return any(not isinstance(value, dict) or _sets_something(value) for value in table.values())


def _starts_with(path: str, magic: bytes) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(magic)) == magic
    except OSError:
        return False


def _merge(into: dict, table: dict, origin: dict[str, str], source: str, prefix: str) -> None:
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, origin, source, prefix=f"{path}.")
        else:
            into[key] = _copy(value)
            _record(origin, path, value, source)


def origins(table: dict, source: str, prefix: str = "") -> dict[str, str]:
    """Every field of a table read whole from one `source` (a saved recipe, say), by its dotted path under
    `prefix`: what a problem names as where the field was set."""
    origin: dict[str, str] = {}
    for key, value in table.items():
        _record(origin, f"{prefix}{key}", value, source)
    return origin


def _record(origin: dict[str, str], path: str, value: Any, source: str) -> None:
    for stale in [k for k in origin if k == path or k.startswith(path + ".")]:
        del origin[stale]
    if isinstance(value, dict):
        for key, inner in value.items():
            _record(origin, f"{path}.{key}", inner, source)
        if not value:
            origin[path] = source
    else:
        origin[path] = source


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def dumps(table: dict) -> str:
    """Render nested dicts of TOML scalars and scalar lists as TOML, tables after plain keys."""
    lines: list[str] = []
    _dump_table(table, [], lines)
    return "\n".join(lines).strip() + "\n"


def _dump_table(table: dict, path: list[str], lines: list[str]) -> None:
    plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
    nested = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (plain or not nested):
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in plain.items():
        lines.append(f"{_key(key)} = {toml_value(value)}")
    for key, value in nested.items():
        _dump_table(value, path + [key], lines)


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        # JSON string escapes are TOML's, once raw non-ASCII is kept (no surrogate pairs) and DEL escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
