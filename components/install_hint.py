"""How to install an optional extra, worded for how this copy of the package was installed: a source checkout
(run from it, or installed editable) takes `pip install -e '.[x]'` there; an installed copy has no checkout."""

from __future__ import annotations

import os

# The folder holding the packages: a checkout's root (with its pyproject.toml), or site-packages.
PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def from_checkout() -> bool:
    """Whether the packages run from the source checkout (its pyproject.toml and run_train.sh beside them), not
    from an installed copy, whose folder may hold anything else (a --target folder inside a project)."""
    return all(os.path.isfile(os.path.join(PACKAGES_ROOT, name)) for name in ("pyproject.toml", "run_train.sh"))


def install_extra(extra: str) -> str:
    """The command that installs the package's `extra` (hf, plots, lm_eval, ...) into this environment."""
    if from_checkout():
        return f"pip install -e '.[{extra}]' in the nsa_titan checkout"
    return f"pip install 'nsa_titan[{extra}]'"
