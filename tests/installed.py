"""An installed copy of the package, as a wheel lays it out: the packages pyproject.toml names, without the
checkout around them (no pyproject.toml, recipes/, run_train.sh), in a folder of their own."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys

from nsa_titan.config.toml_io import tomllib
from tests.conftest import REPO_ROOT

PACKAGES = ("nsa_titan", "components")  # pyproject.toml's [tool.setuptools.packages.find] include
with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as _fh:
    _PYPROJECT = tomllib.load(_fh)
PROJECT = _PYPROJECT["project"]  # the distribution's name and version
PACKAGE_DATA = _PYPROJECT["tool"]["setuptools"].get("package-data", {})  # the files a wheel holds beside modules


def _wheel_leaves_out(package: str):
    """copytree's ignore: what a wheel does not hold (compiled files, and files other than modules that the
    package's package-data does not name)."""
    top = os.path.join(REPO_ROOT, package)

    def ignored(folder: str, names: list[str]) -> set[str]:
        left_out = set()
        for name in names:
            path = os.path.join(folder, name)
            if name == "__pycache__":
                left_out.add(name)
            if os.path.isdir(path):
                continue
            inside = os.path.relpath(path, top).replace(os.sep, "/")
            if not name.endswith(".py") and not any(fnmatch.fnmatch(inside, p) for p in PACKAGE_DATA.get(package, [])):
                left_out.add(name)
        return left_out

    return ignored


def install_copy(site) -> str:
    """Copy the packages' modules and package data, and the distribution's name and version, into the folder `site`
    (as site-packages); return its path."""
    for package in PACKAGES:
        shutil.copytree(os.path.join(REPO_ROOT, package), os.path.join(site, package),
                        ignore=_wheel_leaves_out(package))
    info = os.path.join(site, f"{PROJECT['name']}-{PROJECT['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: {PROJECT['name']}\nVersion: {PROJECT['version']}\n")
    return str(site)


def _run(site: str, cwd, command: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=site, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def run_installed(site: str, cwd, code: str) -> subprocess.CompletedProcess:
    """`python -c code` in `cwd`, importing the package from `site` alone."""
    return _run(site, cwd, ["-c", code])


def run_console_script(site: str, cwd, args: list[str]) -> subprocess.CompletedProcess:
    """`nsa-titan ARGS` in `cwd` as pip's console script runs it: a script in a bin folder, which Python puts
    first on the import path (not the working directory, as `python -c` and `python -m` do)."""
    script = os.path.join(site, "bin", "nsa-titan")
    if not os.path.isfile(script):
        os.makedirs(os.path.dirname(script), exist_ok=True)
        with open(script, "w", encoding="utf-8") as fh:
            fh.write("import sys\nfrom nsa_titan.__main__ import main\nsys.exit(main())\n")
    return _run(site, cwd, [script, *args])
