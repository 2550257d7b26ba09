"""How long ranks wait for each other: parallelism.init_timeout_seconds at start-up, then a minute past the
watchdog's limits (fault.*) in every group the job uses, so a hang is diagnosed before the communicator gives up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nsa_titan.parallel.distributed import UNWATCHED_COLLECTIVE_SECONDS, collective_seconds
from tests.launch import REPO_ROOT, env


@pytest.mark.parametrize("step, first, expected", [
    (900, 3600, 3660), (900, 60, 960), (0, 3600, UNWATCHED_COLLECTIVE_SECONDS), (900, 0, UNWATCHED_COLLECTIVE_SECONDS),
    (0, 0, UNWATCHED_COLLECTIVE_SECONDS)])
def test_collectives_outlast_the_watchdog_and_wait_a_day_where_it_is_off(step, first, expected):
    """Switching a watchdog limit off (0) must not shorten the wait between ranks: it once left 300 s."""
    assert collective_seconds(step, first) == expected


def test_every_group_of_the_job_gets_the_collective_timeout_after_the_start_up_one():
    """A mesh dimension spanning less than the job is a group of its own, made with torch's default timeout (30 min
    on gloo, 10 on NCCL) unless set: HSDP's and context parallelism's groups would have waited that long."""
    worker = os.path.join(REPO_ROOT, "tests", "collective_timeout_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes=1", "--standalone",
               worker]
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank ") and ": start-up" in line)
    assert said == [f"rank {r}: start-up 60, world 2, dp_replicate 2, dp_shard 2, new 1800" for r in range(4)], \
        proc.stdout
    waited = [line for line in proc.stdout.splitlines() if line.startswith("rank 0 waited")]
    assert len(waited) == 1 and "completed" not in waited[0], proc.stdout
    seconds = float(waited[0].split()[3])
    assert 1.5 <= seconds < 10, waited[0]


def test_a_rank_that_never_starts_fails_the_others_start_naming_it():
    """NCCL's communicator set-up waits for a missing rank without a bound: the ranks meet on the launch's store
    first, within parallelism.init_timeout_seconds, and the start ends with the missing rank named."""
    worker = os.path.join(REPO_ROOT, "tests", "collective_timeout_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--nnodes=1", "--standalone",
               worker, "late"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=180)
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(said) == 2, proc.stdout + proc.stderr[-3000:]
    for rank, line in zip((0, 2), said):
        assert line.startswith(f"rank {rank} after ") and (
            f"rank(s) 1 of 3 did not start within parallelism.init_timeout_seconds = 3 s (this is rank {rank}). "
            f"Fix: look at the missing ranks' own output") in line, line
        assert 2.5 <= float(line.split()[3]) < 10, line
