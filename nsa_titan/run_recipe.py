"""Where a run's recipe file lies, found from the run's folder or from a folder inside it (its checkpoints)."""

from __future__ import annotations

import os

from nsa_titan.step_folders import STEP_DIR, train_state_file

RECIPE_FILE = "recipe.toml"
RESOLVED_HEADER = "# resolved recipe, hash "  # a run's recipe.toml opens with it; a user's own recipe.toml does not


def written_by_a_run(path: str) -> bool:
    """Whether `path` is a recipe file a run wrote (its resolved recipe), not a user's recipe of that name."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().startswith(RESOLVED_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def recipe_above(path: str) -> str | None:
    """The recipe file of the run a folder inside it (a checkpoint step, say) belongs to: in the nearest folder above
    `path` that holds one (a checkpoint.folder may lie several levels below the run's folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(8):
        if written_by_a_run(os.path.join(folder, RECIPE_FILE)):
            return os.path.join(folder, RECIPE_FILE)
        folder, below = os.path.dirname(folder), folder
        if folder == below:
            break
    return None


def run_of_folder(path: str) -> tuple[str, int | None] | None:
    """(the run's recipe file, the step or None) where `path` is a training run's folder, its checkpoint folder or one
    of its step folders (a folder holding a train state); None for any other folder. For a fix that names the way
    from such a folder to what a command wants of it."""
    given = os.path.abspath(path)
    named = STEP_DIR.match(os.path.basename(given))
    if named and os.path.isfile(train_state_file(given)):
        recipe = recipe_above(given)
        return (recipe, int(named.group(1))) if recipe else None
    if written_by_a_run(os.path.join(given, RECIPE_FILE)):
        return os.path.join(given, RECIPE_FILE), None
    try:
        names = os.listdir(given)
    except OSError:
        return None
    if any(STEP_DIR.match(name) and os.path.isfile(train_state_file(os.path.join(given, name))) for name in names):
        recipe = recipe_above(given)
        return (recipe, None) if recipe else None
    return None


def unsaved_step_of(path: str) -> tuple[str | None, int] | None:
    """(the recipe file of the run above it or None, the step) where `path` is a folder named as a checkpoint step
    (step-N) that holds no train state: a save cut short before it wrote one, or another folder named so; None for
    any other path."""
    given = os.path.abspath(path)
    named = STEP_DIR.match(os.path.basename(given))
    if not named or not os.path.isdir(given) or os.path.isfile(train_state_file(given)):
        return None
    return recipe_above(given), int(named.group(1))
