"""`nsa-titan recipes`: the recipes the package ships (package data, so an installed copy has them too), listed,
or copied with their presets into a folder of the user's, where they are read and edited like any recipe."""

from __future__ import annotations

import os
import shutil

from components.errors import UserError

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
DEFAULT_DESTINATION = "recipes"


def shipped_files() -> list[str]:
    """The shipped recipe files, relative to their folder (the presets they extend included), sorted."""
    found = []
    for root, _, files in os.walk(FOLDER, followlinks=True):  # the checkout's nsa_titan/recipes is a link
        found += [os.path.relpath(os.path.join(root, name), FOLDER) for name in files if name.endswith(".toml")]
    if not found:  # a copy of the package that lost its package data
        raise UserError(f"this nsa_titan holds no shipped recipes ({FOLDER} is missing or empty). Fix: reinstall "
                        "nsa_titan (pip install --force-reinstall nsa_titan).")
    return sorted(found)


def _summary(path: str) -> str:
    """A recipe's first sentence, from the comment it opens with: what it is."""
    lines = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def listing() -> str:
    """The recipes one trains from (not the presets they extend), each with its first comment line."""
    names = [name for name in shipped_files() if os.sep not in name]
    width = max(map(len, names))
    lines = [f"{name:<{width}}  {_summary(os.path.join(FOLDER, name))}" for name in names]
    return "\n".join(["shipped recipes (`nsa-titan recipes copy [DIR]` writes them, presets included, into DIR, "
                      f"default ./{DEFAULT_DESTINATION}):", *lines])


def copy_to(destination: str) -> list[str]:
    """Copy every shipped file into `destination` (made if missing), keeping presets/ beside the recipes that
    extend it; a file already there is refused before anything is written, so no edit of the user's is lost.
    Returns the paths written."""
    files = shipped_files()
    if not destination.strip():
        raise UserError(f"recipes copy was given an empty folder name. Fix: name a folder, e.g. `nsa-titan recipes copy "
                        f"{DEFAULT_DESTINATION}`.")
    if os.path.exists(destination) and not os.path.isdir(destination):
        raise UserError(f"{destination!r} is a file, not a folder. Fix: name a new or existing folder, e.g. "
                        f"`nsa-titan recipes copy my_recipes`.")
    there = [name for name in files if os.path.lexists(os.path.join(destination, name))]
    if there:
        shown = ", ".join(os.path.join(destination, name) for name in there[:3]) + (" ..." if len(there) > 3 else "")
        raise UserError(f"{len(there)} of the shipped recipe files are already in {destination!r} ({shown}); nothing "
                        f"was copied, so no edit there is lost. Fix: copy into another folder, e.g. `nsa-titan "
                        f"recipes copy {destination.rstrip(os.sep)}_shipped`, or move those files away first.")
    written = []
    for name in files:
        target = os.path.join(destination, name)
        try:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            shutil.copyfile(os.path.join(FOLDER, name), target)
        except OSError as exc:
            done = f"; {len(written)} file(s) were copied before it" if written else ""
            raise UserError(f"cannot write {target!r} ({exc.strerror or exc}){done}. Fix: copy into a folder you can "
                            f"write, e.g. `nsa-titan recipes copy ~/my_recipes`.") from None
        written.append(target)
    return written
