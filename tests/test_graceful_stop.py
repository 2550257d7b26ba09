"""The reason a rank gives for a stop the ranks agreed on."""

import os

from nsa_titan.graceful_stop import GracefulStop


def _stop(folder) -> GracefulStop:
    stop = GracefulStop(str(folder))
    stop.restore()  # the test process keeps its own signal handlers
    return stop


def test_a_halt_file_seen_first_by_another_rank_is_still_named(tmp_path):
    stop = _stop(tmp_path)
    assert not stop.local_request()
    open(os.path.join(tmp_path, "HALT"), "w").close()  # appears after this rank looked; another rank saw it
    assert stop.agree(True)
    assert stop.reason == f"halt file {tmp_path / 'HALT'}"


def test_a_stop_asked_of_another_rank_alone_says_so(tmp_path):
    stop = _stop(tmp_path)
    assert not stop.local_request()
    assert stop.agree(True) and stop.reason == "another rank was asked to stop"
    assert not _stop(tmp_path).agree(False)


def test_the_launcher_is_judged_by_the_pid_noted_at_start_up(tmp_path, monkeypatch):
    """A rank whose parent is still the launcher noted at start-up goes on, even when that launcher is pid 1 (a
    container whose command is torchrun); one whose parent changed since (its launcher died) stops."""
    from nsa_titan import graceful_stop, start_up

    monkeypatch.setattr(graceful_stop.os, "getppid", lambda: 1)
    monkeypatch.setattr(start_up, "_launcher", 1)
    assert not _stop(tmp_path).local_request()
    monkeypatch.setattr(start_up, "_launcher", 4242)
    stop = _stop(tmp_path)
    assert stop.local_request() and stop.reason == graceful_stop.LAUNCHER_ENDED


def test_a_stop_after_the_run_has_ended_exits_0_saying_so(tmp_path):
    """A SIGTERM in the second or so a finished run takes to exit (the handlers put back, the process group and
    loader torn down) ended it with 143 and no word: a scheduler counted the finished job killed. Sent here from
    an exit handler a plugin registers, once the command has returned."""
    import signal
    import subprocess
    import sys

    from tests.launch import DEBUG, REPO_ROOT, TINY, env

    plugin = tmp_path / "late_stop.py"
    plugin.write_text("import atexit, os, signal, time\n"
                      "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))\n")
    proc = subprocess.run([sys.executable, "-m", "nsa_titan.cli", "train", DEBUG, *TINY, "--training.steps=1",
                           f"--job.plugins={plugin}", f"--job.dump_folder={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM: the run had already ended (its checkpoint and records are written); exiting." in proc.stderr
    assert "step 1/1" in proc.stdout
