"""The run folder: created first, and the resolved recipe with its hash (the trainer says when: in a folder
of an earlier run, once this one is known to start)."""

from __future__ import annotations

import os
from typing import Callable

from components.errors import UserError

RECIPE_FILE = "recipe.toml"


def create_new(path: str, make: Callable[[str], None]) -> str:
    """make(path), or make(stem-2.ext), make(stem-3.ext), ... while the name is taken (make must raise
    FileExistsError then); returns the name made. For what is set aside within one second of another."""
    stem, ext = os.path.splitext(path)
    candidate, n = path, 1
    while True:
        try:
            make(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{stem}-{n}{ext}"


def create_run_folder(folder: str, outputs: dict[str, str] | None = None) -> None:
    """The dump folder, and the output folders the run will write inside it ({recipe field: its value},
    e.g. checkpoint.folder when checkpoints are on): found unwritable now, not at the first save after
    hours of training."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create job.dump_folder {folder!r}: {exc.strerror}. Fix: choose a writable folder "
                        f"with --job.dump_folder=PATH.") from None
    for field, name in (outputs or {}).items():
        path = os.path.join(folder, name)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the folder {path!r} ({field} = {name!r}): {exc.strerror}. Fix: choose a "
                            f"writable folder with --{field}=NAME (inside job.dump_folder, or an absolute "
                            f"path).") from None


def write_run_recipe(folder: str, resolved) -> str:
    """Write the resolved recipe; an earlier run's different recipe is kept aside."""
    path = os.path.join(folder, RECIPE_FILE)
    header = f"# resolved recipe, hash {resolved.hash}\n"
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
        if first != header and first.startswith("# resolved recipe, hash "):
            old_hash = first.strip().rsplit(" ", 1)[-1]
            os.replace(path, os.path.join(folder, f"recipe.{old_hash}.toml"))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(header + resolved.toml)
    os.replace(tmp, path)
    return path
