"""Run nsa-titan in fresh processes (one, or several through torchrun on loopback)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from tests.conftest import REPO_ROOT

DEBUG = os.path.join(REPO_ROOT, "recipes", "debug.toml")
# The tiny model on the CPU wherever the suite runs: two gloo ranks need no GPU each, and bitwise
# comparisons between layouts hold on the CPU. GPU behaviour has its own tests (test_nsa_triton_gpu).
TINY = ["--training.device=cpu", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--training.seq_len=64", "--model.max_seq_len=64", "--model.nsa.window_size=16",
        "--lr_scheduler.warmup_steps=2", "--data.logical_shards=4", "--metrics.log_freq=1",
        "--checkpoint.enable=false", "--validation.enable=false"]


@contextmanager
def rendezvous_endpoint() -> Iterator[str]:
    """127.0.0.1:PORT for a launch of several nodes to meet at, its TCP store hosted by this process on a port
    it binds itself, from before the launch until after it. Each node's agent tries to host the store there,
    finds the port taken and joins as a client (torch's c10d rendezvous backend does so), so no other launch can
    take the port between its choice and the launch (a port picked free and bound later could be). One node's
    launches use --standalone, which binds its own port."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield f"127.0.0.1:{store.port}"
    finally:
        del store


def env() -> dict:
    return dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def train_command(args: list[str], nproc: int = 1) -> list[str]:
    """`nsa-titan train ARGS` in one process, or through torchrun (as run_train.sh launches it, by
    nsa_titan.launch, --standalone) with nproc ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "nsa_titan.cli", "train", *args]
    return [sys.executable, "-m", "nsa_titan.launch", f"--nproc_per_node={nproc}", "--standalone", "-m",
            "nsa_titan.cli", "train", *args]


def rendezvous_id() -> str:
    """A rendezvous id of one launch of several nodes, its own in any store."""
    return uuid.uuid4().hex


def train(args: list[str], nproc: int = 1, timeout: float | None = None, **popen) -> subprocess.CompletedProcess:
    """The run's result; it must end within `timeout` s (by default 300, 600 for several ranks sharing the
    cores)."""
    timeout = timeout if timeout is not None else (300 if nproc == 1 else 600)
    popen.setdefault("start_new_session", True)
    proc = subprocess.Popen(train_command(args, nproc), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=REPO_ROOT, **popen)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def train_each(runs: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`train(args)` for each one-process run in `runs`, as many at once as this process has cores: each run
    computes on one thread (OMP_NUM_THREADS=1) and alone, so they take about the longest one's time, not
    the sum, and compute what they compute one after another. An interrupt (Ctrl-C) stops every run."""
    from concurrent.futures import ThreadPoolExecutor

    started: list[subprocess.Popen] = []

    def one(args: list[str]) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(train_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env(), cwd=REPO_ROOT, start_new_session=True)
        started.append(proc)
        out, err = finish(proc, timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    pool = ThreadPoolExecutor(max(1, min(len(runs), len(os.sched_getaffinity(0)))))
    try:
        return list(pool.map(one, runs))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in started:  # their threads then return: nothing is left computing
            stop_all(proc)
        raise
    finally:
        pool.shutdown(wait=True)


def start_training(args: list[str], folder, nproc: int = 1, timeout: float | None = None,
                   command: list[str] | None = None, extra_env: dict | None = None, **popen) -> subprocess.Popen:
    """Launch a run in the background and return once its first step is logged in folder/metrics.jsonl
    (within `timeout` s: by default 300, 600 for several ranks or a `command` such as run_train.sh, which
    checks the environment and starts several processes before the first step).
    `command` replaces the usual `python -m nsa_titan.cli train` (or torchrun) prefix of args."""
    timeout = timeout if timeout is not None else (300 if nproc == 1 and command is None else 600)
    argv = [*command, *args] if command else train_command(args, nproc)
    popen.setdefault("start_new_session", True)  # so that finish() can stop every process it starts
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), **(extra_env or {})}, cwd=REPO_ROOT, **popen)
    path = os.path.join(folder, "metrics.jsonl")
    deadline = time.time() + timeout
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
        if proc.poll() is not None or time.time() > deadline:
            stop_all(proc)
            raise AssertionError(f"training never started:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a run started by train or start_training once it exits. One still running after
    `timeout` s is killed with every process it started, and the test fails: a leftover run would take
    the machine's cores from every test after it."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_all(proc)
        raise AssertionError(f"the run was still going after {timeout} s; stopped:\n"
                             f"{proc.communicate()[1][-3000:]}") from None


def stop_all(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session and every process it started (none left: nothing)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: torchrun, the ranks and their loader workers
    except ProcessLookupError:
        pass


def metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def losses(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(folder) if "loss" in r}


def assert_resumed_at(output: str, folder, step: int) -> None:
    """The run that printed `output` resumed from its checkpoint of `step` (a fresh start would repeat a
    deterministic run's curve just as well, so equal losses alone prove no resume) and metrics.jsonl
    holds each step once."""
    assert re.search(rf"resumed from \S*step-{step} at step {step}\b", output), output[-3000:]
    logged = [r["step"] for r in metrics(folder) if "loss" in r]
    assert len(logged) == len(set(logged)), logged


def losses_and_norms(folder) -> dict[int, tuple[float, ...]]:
    """step -> (loss, gradient norm[, validation loss at a step that validated]): a gradient scaled wrongly
    barely moves AdamW's losses, but its norm."""
    records = metrics(folder)
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}
    for r in records:
        if "val_loss" in r:
            got[r["step"]] += (r["val_loss"],)
    return got


def assert_cuda_only_refused_at_start(tmp_path, capsys, flags: list[str], message: str) -> None:
    """A CUDA-only setting with training.device = auto on a machine without CUDA, known only once the
    run starts: exit 2 with `message`, before the run folder is made."""
    from nsa_titan import cli

    argv = [DEBUG, *TINY, *flags, "--training.device=auto", f"--job.dump_folder={tmp_path / 'run'}"]
    assert cli.main(["train", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def forget_model_fields(step_dir) -> None:
    """A checkpoint step as an older release saved it: its train_state.json without the model fields, which
    are then judged by the run folder's recipe (or, that gone, by the tensors' shapes)."""
    import json

    from nsa_titan.checkpoint_checks import file_checksum

    file = os.path.join(step_dir, "train_state.json")
    with open(file) as fh:
        record = json.load(fh)
    del record["model"]
    with open(file, "w") as fh:
        json.dump(record, fh)
    marker = os.path.join(step_dir, "COMPLETE")  # whose checksums that release wrote for the file as it is
    with open(marker) as fh:
        complete = json.load(fh)
    complete["files"]["train_state.json"] = file_checksum(file)
    with open(marker, "w") as fh:
        json.dump(complete, fh)


def signal_once_imported(argv: list[str], module: str, signum: int, timeout: float = 300) -> tuple[int, str]:
    """Run `python -X importtime ARGV`, send it `signum` as soon as Python reports `module` imported (the start of
    a command line, before its slow imports), and return (exit code, stderr) once it exits.

    The process starts with the signal's default action, as a command typed in a terminal does: a suite run in
    the background of a script (as CI may run it) has SIGINT ignored, which its children would inherit."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO_ROOT,
                            preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
    try:
        said = []
        for line in proc.stderr:
            said.append(line)
            if line.rstrip().endswith(f" {module}"):
                proc.send_signal(signum)
                break
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, "".join(said) + err
