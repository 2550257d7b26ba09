"""The run folder: the resolved recipe and its hash, written before anything trains."""

from __future__ import annotations

import os

from components.errors import UserError

RECIPE_FILE = "recipe.toml"


def prepare_run_folder(folder: str, resolved) -> str:
    """Create the folder and write the resolved recipe; an earlier run's different recipe is kept aside."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create job.dump_folder {folder!r}: {exc.strerror}. Fix: choose a writable folder "
                        f"with --job.dump_folder=PATH.") from None
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
