"""An installed copy of the package, as a wheel lays it out: the packages pyproject.toml names, without the
checkout around them (no pyproject.toml, recipes/, run_train.sh), in a folder of their own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import REPO_ROOT

PACKAGES = ("nsa_titan", "components")  # pyproject.toml's [tool.setuptools.packages.find] include


def install_copy(site) -> str:
    """Copy the packages' modules into the folder `site` (as site-packages); return its path."""
    for package in PACKAGES:
        shutil.copytree(os.path.join(REPO_ROOT, package), os.path.join(site, package),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return str(site)


def run_installed(site: str, cwd, code: str) -> subprocess.CompletedProcess:
    """`python -c code` in `cwd`, importing the package from `site` alone."""
    env = dict(os.environ, PYTHONPATH=site, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
