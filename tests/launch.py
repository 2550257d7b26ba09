"""Run nsa-titan in fresh processes (one, or several through torchrun on loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.conftest import REPO_ROOT

DEBUG = os.path.join(REPO_ROOT, "recipes", "debug.toml")
TINY = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--training.seq_len=64", "--model.max_seq_len=64", "--model.nsa.window_size=16",
        "--lr_scheduler.warmup_steps=2", "--data.logical_shards=4", "--metrics.log_freq=1",
        "--checkpoint.enable=false", "--validation.enable=false"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def train(args: list[str], nproc: int = 1, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "nsa_titan.cli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "nsa_titan.cli", "train",
               *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=timeout, **popen)


def metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def losses(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(folder) if "loss" in r}
