"""Fixes that name a launcher or the shipped recipes, worded for how the package was installed: a source checkout
has run_train.sh and recipes/ beside the packages; an installed copy (a wheel) has neither."""

from __future__ import annotations

import os

from components.install_hint import PACKAGES_ROOT, from_checkout


def _shown(path: str) -> str:
    """Relative to the working directory when inside it, else absolute: a path the user can paste as it is."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def shipped_recipes() -> str:
    """Where the shipped recipes are, for a fix that names a recipe path that is not there."""
    if from_checkout():
        folder = os.path.join(PACKAGES_ROOT, "recipes")
        example = _shown(os.path.join(folder, "debug.toml"))
        return f"the shipped recipes are in {_shown(folder)}{os.sep} (e.g. {example})"
    return ("`nsa-titan recipes copy` writes the shipped recipes into ./recipes (e.g. recipes/debug.toml; "
            "`nsa-titan recipes` lists them)")


def launch_several(count: str = "N") -> str:
    """The command that starts `count` training processes on this node."""
    if from_checkout():
        script = _shown(os.path.join(PACKAGES_ROOT, "run_train.sh"))
        return f"NGPU={count} {script if os.path.isabs(script) else os.path.join('.', script)} RECIPE.toml"
    return f"python -m nsa_titan.launch --standalone --nproc_per_node={count} -m nsa_titan.cli train RECIPE.toml"


def no_recipe(command: str) -> str:
    return f"no recipe given. Fix: name one, `nsa-titan {command} RECIPE.toml`; {shipped_recipes()}."


def launch_size() -> str:
    """How a launch sets its process count, for layout fixes."""
    return "(NGPU x NNODES)" if from_checkout() else "(--nproc_per_node x --nnodes)"


def per_node() -> str:
    """How a launch sets its processes per node."""
    return "NGPU" if from_checkout() else "--nproc_per_node"


def node_meeting() -> str:
    """What every node of a multi-node launch must be started with."""
    if from_checkout():
        return "start every node (NNODES of them) with the same RDZV_ENDPOINT"
    return "start every node (--nnodes of them) with the same --rdzv_endpoint"
