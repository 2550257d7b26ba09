"""The hang watchdog, in child processes that really get stuck (it ends its process with os._exit)."""

from __future__ import annotations

import subprocess
import sys
import time

from nsa_titan.observe.watchdog import HANG_EXIT_CODE, Stall, Watchdog, describe_stall
from tests.conftest import REPO_ROOT

CHILD = """
import sys, time
from nsa_titan.observe.watchdog import Watchdog
step_timeout, first_timeout, dump = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
steps, stop = int(sys.argv[4]), sys.argv[5] == "stop"
watchdog = Watchdog(step_timeout, first_timeout, dump, start_step=10)

def train_steps(n):
    for step in range(11, 11 + n):
        time.sleep(0.05)
        watchdog.beat(step)

def stuck_in_data_loader(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)

train_steps(steps)
if stop:
    watchdog.stop()
print("stuck now", flush=True)
stuck_in_data_loader(float(sys.argv[6]) if len(sys.argv) > 6 else 30.0)
print("finished", flush=True)
"""


def _child(tmp_path, step_timeout, first_timeout, steps, stop=False, stuck_for=30.0):
    dump = tmp_path / "stacks" / "rank-0.txt"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(step_timeout), str(first_timeout), str(dump), str(steps),
                           "stop" if stop else "run", str(stuck_for)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    return proc, dump, time.monotonic() - start


def test_stuck_step_dumps_stacks_and_exits(tmp_path):
    # 6 s between beats 0.05 s apart: only the planted stall outlasts it, even on a loaded machine
    proc, dump, elapsed = _child(tmp_path, step_timeout=6.0, first_timeout=10.0, steps=3)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert "stuck now" in proc.stdout and "finished" not in proc.stdout
    assert 6.0 < elapsed < 30
    text = dump.read_text()
    assert "stuck_in_data_loader" in text  # the main thread's stack, where it is stuck
    assert "nsa_titan/observe/watchdog.py" in text  # and the watchdog thread's own
    assert "stuck_in_data_loader" in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert "after step 13" in message and "fault.step_timeout_seconds = 6)" in message
    assert str(dump) in message and f"code {HANG_EXIT_CODE}" in message


def test_first_step_has_its_own_limit(tmp_path):
    # the step limit (0.3 s) must not apply before the first beat; the first-step limit (1.5 s) does
    proc, dump, elapsed = _child(tmp_path, step_timeout=0.3, first_timeout=1.5, steps=0)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert elapsed > 1.5
    message = proc.stderr.strip().splitlines()[-1]
    assert "first step of this run (after step 10)" in message
    assert "fault.first_step_timeout_seconds = 1.5" in message
    assert "stuck_in_data_loader" in dump.read_text()


def test_zero_disables_and_stop_ends_the_watch(tmp_path):
    proc, dump, _ = _child(tmp_path, step_timeout=0.0, first_timeout=0.0, steps=2, stuck_for=1.0)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    proc, dump, _ = _child(tmp_path, step_timeout=6.0, first_timeout=6.0, steps=2, stop=True, stuck_for=7.0)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    assert not dump.exists()


def test_steady_beats_never_fire(tmp_path, monkeypatch):
    fired = []  # in this process firing would end the test run: record it instead
    monkeypatch.setattr(Watchdog, "_fire", lambda self, stall: fired.append(stall))
    watchdog = Watchdog(10.0, 10.0, str(tmp_path / "never.txt"), poll_s=0.02)
    assert watchdog.enabled
    for step in range(1, 15):  # 0.7 s in all, each gap far below the limit
        time.sleep(0.05)
        watchdog.beat(step)
    watchdog.stop()
    assert not fired and not (tmp_path / "never.txt").exists()
    assert not Watchdog(0, 0, str(tmp_path / "x")).enabled


def test_message_names_step_and_field():
    text = describe_stall(Stall(step=41, start_step=0, waited_s=905.2, limit_s=900.0,
                                field="fault.step_timeout_seconds", dump_path="/run/stacks/rank-2.txt"))
    assert "after step 41" in text and "905 s" in text and "raise fault.step_timeout_seconds" in text
    assert "/run/stacks/rank-2.txt" in text


def test_a_short_limits_wait_is_not_rounded_to_zero():
    text = describe_stall(Stall(step=3, start_step=0, waited_s=0.23, limit_s=0.2,
                                field="fault.step_timeout_seconds", dump_path="/run/stacks/rank-0.txt"))
    assert "no training step completed for 0.2 s after step 3 (fault.step_timeout_seconds = 0.2)" in text
