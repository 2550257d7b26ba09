"""manifest.json: everything needed to tell later what produced a run folder.

The resolved recipe and its hash, the code (git commit, and whether the checkout had changes),
package, CUDA and NCCL versions, devices, world size, command line, host and start time.
Collecting it never fails a run: what cannot be found is recorded as "unknown" or null.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata

import torch

# nsa_titan's own: an installed copy has no git commit to name the code by.
PACKAGES = ("nsa_titan", "torch", "triton", "torchdata", "tiktoken", "datasets", "numpy")
MANIFEST_FILE = "manifest.json"


def _git(folder: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git executable, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(folder: str) -> dict[str, str | bool | None]:
    """{"commit": full hash or "unknown", "dirty": uncommitted changes to tracked files (None if unknown)}.

    Only a checkout whose top level is `folder` counts: an installed copy inside some other
    repository (a virtual environment within a project) must not report that project's commit.
    """
    top = _git(folder, "rev-parse", "--show-toplevel")
    commit = _git(folder, "rev-parse", "HEAD") if top else None
    if not commit or os.path.realpath(top) != os.path.realpath(folder):
        return {"commit": "unknown", "dirty": None}
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    # The installed metadata drops the build tag (+cpu, +cu130) that tells two torch builds apart.
    versions["torch"] = torch.__version__
    versions["python"] = platform.python_version()
    return versions


def accelerator_info() -> dict:
    """CUDA and NCCL versions and every visible GPU's name and memory (empty lists on a CPU machine)."""
    info: dict = {"cuda": torch.version.cuda, "nccl": None, "gpus": []}
    if torch.cuda.is_available():
        if torch.distributed.is_nccl_available():
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": props.name, "memory_bytes": int(props.total_memory),
                                 "capability": f"{props.major}.{props.minor}"})
    return info


def _keep_previous(path: str) -> None:
    """A resumed run's manifest replaces the one before it: keep that one in manifests/, named by its start."""
    if not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as fh:
            started = float(json.load(fh)["start_unix_time"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable: name it by its file's time
        started = os.path.getmtime(path)
    folder = os.path.join(os.path.dirname(path), "manifests")
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    os.replace(path, os.path.join(folder, f"manifest-{stamp}-{int(started * 1000) % 1000:03d}.json"))


def write_manifest(folder: str, *, recipe_toml: str, recipe_hash: str, argv: list[str], world_size: int,
                   device: torch.device) -> str:
    """Write {folder}/manifest.json (atomically) and return its path; an earlier one moves into
    {folder}/manifests/. Call on rank 0 once the run is known to start.

    argv: the full command line (sys.argv); device: this process's training device.
    """
    package_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    manifest = {
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "start_unix_time": time.time(),
        "hostname": socket.gethostname(),
        "command_line": list(argv),
        "python_executable": sys.executable,
        "world_size": world_size,
        "device": str(device),
        "recipe_hash": recipe_hash,
        "git": git_state(package_dir),
        "versions": package_versions(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **accelerator_info(),
        "recipe_toml": recipe_toml,
    }
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, MANIFEST_FILE)
    _keep_previous(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return path
