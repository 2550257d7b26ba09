"""The NaN guard: ok/skip/stop decisions, counting, and agreement across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nsa_titan.observe.nan_guard import NanGuard, nonfinite_flag
from tests.conftest import REPO_ROOT

GOOD, NAN, INF = 1.5, float("nan"), float("inf")


def _check(guard, loss, grad_norm, step=None):
    return guard.check(torch.tensor(loss), torch.tensor(grad_norm), step)


@pytest.mark.parametrize("loss, grad_norm, bad", [(GOOD, 0.3, False), (NAN, 0.3, True), (GOOD, NAN, True),
                                                  (INF, 0.3, True), (GOOD, -INF, True), (-2.0, 0.0, False)])
def test_flag(loss, grad_norm, bad):
    assert nonfinite_flag(torch.tensor(loss), torch.tensor(grad_norm)).tolist() == [1.0 if bad else 0.0]


def test_zero_tolerance_stops_at_the_first_bad_step():
    guard = NanGuard(0)
    assert _check(guard, GOOD, 1.0) == "ok"
    assert _check(guard, NAN, NAN, step=2) == "stop"
    assert guard.total_bad == 1 and guard.last_bad_step == 2


def test_skips_then_stops_after_too_many_in_a_row():
    guard = NanGuard(2)
    decisions = [_check(guard, loss, gn) for loss, gn in
                 [(GOOD, 1.0), (NAN, 1.0), (GOOD, INF), (GOOD, 1.0), (NAN, NAN), (NAN, NAN), (NAN, NAN)]]
    assert decisions == ["ok", "skip", "skip", "ok", "skip", "skip", "stop"]
    assert guard.consecutive_bad == 3 and guard.total_bad == 5


def test_messages_name_the_field():
    guard = NanGuard(1)
    _check(guard, NAN, 1.0, step=8)
    assert "step 8" in guard.skip_message(8) and "fault.max_bad_steps = 1" in guard.skip_message(8)
    _check(guard, NAN, 1.0, step=9)
    message = guard.stop_message(9)
    assert "step 9" in message and "2 step(s) in a row" in message and "fault.max_bad_steps" in message
    assert "Fix:" in message


def test_negative_limit_is_rejected():
    with pytest.raises(ValueError):
        NanGuard(-1)


RANK = """
import json, os, sys, torch, torch.distributed as dist
from nsa_titan.observe.nan_guard import NanGuard
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=int(os.environ["RANK"]), world_size=2)
rank = dist.get_rank()
guard = NanGuard(1)
nan = float("nan")
# rank 1 alone sees a NaN loss at the second step, rank 0 alone an infinite one at the fourth
losses = {0: [1.0, 1.0, 1.0, float("inf"), 1.0], 1: [1.0, nan, 1.0, 1.0, 1.0]}[rank]
print(json.dumps([guard.check(torch.tensor(l), torch.tensor(0.5)) for l in losses]), flush=True)
# gloo's threads free the last collective's tensors before the interpreter shuts down (see
# sharded_orthogonalize_worker.py)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_agree(tmp_path):
    procs = []
    for rank in range(2):  # they meet through a file, not a port that could be taken between picking and binding
        env = dict(os.environ, RANK=str(rank), INIT=f"file://{tmp_path / 'rendezvous'}", PYTHONPATH=REPO_ROOT,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, cwd=REPO_ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1] == ["ok", "skip", "ok", "skip", "ok"]
