"""What a benchmark result was measured on: device, library versions and the commit."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CHECKOUT = os.path.dirname(os.path.dirname(RESULTS_DIR))


def shipped_recipe(name: str) -> str:
    """The checkout's recipes/NAME, a benchmark's default wherever it runs (as its results go to the checkout's
    bench/results): relative to the working directory inside the checkout, as results have recorded it, else
    absolute."""
    path = os.path.join(CHECKOUT, "recipes", name)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def git_commit() -> tuple[str, list[str]]:
    """HEAD ("-dirty" when tracked files differ from it) and the tracked files that differ: the code
    measured is the commit plus those."""
    root = os.path.dirname(RESULTS_DIR)
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.splitlines()
        files = sorted(line[3:] for line in changed if line.strip())
        return out.stdout.strip() + ("-dirty" if files else ""), files
    except (OSError, subprocess.CalledProcessError):
        return "unknown", []


def describe_environment() -> dict:
    commit, changed = git_commit()
    info = {
        "time": dt.datetime.now(dt.timezone.utc).isoformat(),
        "commit": commit,
        "changed_files": changed,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    # Triton's interpreter runs the kernels on the CPU: what is timed is not the kernels a GPU runs.
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    gpu_count=torch.cuda.device_count())
    return info


def results_path(name: str) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    device = torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "cpu"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(RESULTS_DIR, f"{name}-{device}-{stamp}.json")


def write_report(report: dict, name: str, out: str | None = None, quiet: bool = False) -> str:
    """Write a benchmark's JSON to `out` (default bench/results/<name>-<device>-<time>.json); say where
    unless `quiet` (a benchmark that writes after every row says it once)."""
    path = out or results_path(name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:  # a run killed mid-write keeps the last whole one
        json.dump(report, fh, indent=1, default=str)
        fh.write("\n")
    os.replace(path + ".tmp", path)
    if not quiet:
        print(f"wrote {path}")
    return path
