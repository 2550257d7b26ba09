"""The launcher's last line after its ranks fail: whom to blame, from torchrun's failures (exit code or minus
the signal, and a timestamp in whole seconds, by rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from nsa_titan.launch import failure_summary
from nsa_titan.parallel.distributed import NUMERICAL_FAULT_EXIT, PEER_LOST_EXIT_CODE
from tests.conftest import REPO_ROOT


def failures(*codes: int, at: int = 100) -> dict:
    return {rank: SimpleNamespace(exitcode=code, timestamp=at) for rank, code in enumerate(codes)}


@pytest.mark.parametrize("codes, nproc, said, code", [
    # an agreed stop: every rank of the node ended with the NaN guard's code
    ((3, 3), "2", "every rank stopped together (exit code 3); the message is above", 3),
    # one still shutting down was ended by torchrun: the stop is still every rank's
    ((3, -signal.SIGTERM), "2", "every rank stopped together (exit code 3); the message is above", 3),
    # every rank lost a peer on another node: that node failed, not this one's ranks together
    ((PEER_LOST_EXIT_CODE, PEER_LOST_EXIT_CODE), "2",
     "rank 0 lost contact with a rank that failed on another node; that node's output says why", PEER_LOST_EXIT_CODE),
    ((PEER_LOST_EXIT_CODE, 2), "2", "rank 1 failed first (exit code 2); its own message is above", 2),
    ((-signal.SIGTERM, -signal.SIGKILL), "2", "rank 1 failed first (signal SIGKILL); a signal leaves no message", -9),
    # not every rank of the node (or nproc_per_node not a count) failed
    ((3, 3), "4", "rank 0 failed first (exit code 3); its own message is above", 3),
    ((3, 3), "gpu", "rank 0 failed first (exit code 3); its own message is above", 3),
    # one rank's own failure (bad input, a traceback), the other stopped by torchrun: no stop together
    ((2, -signal.SIGTERM), "2", "rank 0 failed first (exit code 2); its own message is above", 2),
    ((-signal.SIGTERM, 1), "2", "rank 1 failed first (exit code 1); its own message is above", 1),
])
def test_the_launcher_blames_the_right_rank(codes, nproc, said, code):
    how, returned = failure_summary(failures(*codes), nproc, PEER_LOST_EXIT_CODE, NUMERICAL_FAULT_EXIT)
    assert how.startswith(said) and returned == code, how


def test_a_cpu_launch_without_omp_num_threads_opens_without_torchrun_banner():
    """torchrun's four warning lines on the threads it gives each rank opened every several-process launch; the
    ranks still get its one thread each."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = REPO_ROOT
    # One write(2) each, which a pipe keeps whole: the two ranks' prints could interleave ("threadsthreads  11").
    probe = "import os; os.write(1, f\"threads {os.environ.get('OMP_NUM_THREADS')}\\n\".encode())"
    done = subprocess.run([sys.executable, "-m", "nsa_titan.launch", "--standalone", "--nproc_per_node=2",
                           "--no-python", sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["threads 1", "threads 1"], done.stdout
    assert "OMP_NUM_THREADS" not in done.stderr and "*****" not in done.stderr, done.stderr
