"""SIGUSR1 writes every thread's stack to the dump file and stderr, and the run goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO_ROOT

CHILD = """
import os, sys, threading, time
from nsa_titan.observe.stack_dump import install_sigusr1
install_sigusr1(sys.argv[1])

def side_worker():
    time.sleep(60)

threading.Thread(target=side_worker, name="side", daemon=True).start()

def waiting_for_signal(sentinel):
    print("ready", flush=True)  # from inside, so that every dump finds the main thread here
    end = time.monotonic() + 30
    while not os.path.exists(sentinel) and time.monotonic() < end:
        time.sleep(0.02)

waiting_for_signal(sys.argv[2])
print("finished normally", flush=True)
"""


def _wait_for(predicate, seconds=15.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_sigusr1_dumps_and_continues(tmp_path):
    dump, sentinel = tmp_path / "stacks" / "rank-0.txt", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(dump), str(sentinel)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for n in (1, 2):
            os.kill(proc.pid, signal.SIGUSR1)
            assert _wait_for(lambda: dump.exists() and dump.read_text().count("end of SIGUSR1 stack dump") == n)
        sentinel.touch()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "finished normally" in out
    text = dump.read_text()
    assert text.count("waiting_for_signal") == 2 and text.count("side_worker") == 2  # all threads, both times
    assert err.count("waiting_for_signal") == 2 and "(SIGUSR1)" in err


def test_a_dump_file_nothing_was_written_to_is_removed(tmp_path):
    """A run that never got SIGUSR1 leaves no empty stacks file (it read as a dump that failed); a file
    holding a dump, and a folder holding another rank's file, stay."""
    from nsa_titan.observe.stack_dump import install_sigusr1, uninstall_sigusr1

    before = signal.getsignal(signal.SIGUSR1)
    folder = tmp_path / "stacks"
    install_sigusr1(str(folder / "rank-0.txt"))
    uninstall_sigusr1()
    assert not folder.exists() and signal.getsignal(signal.SIGUSR1) == before
    folder.mkdir()
    (folder / "rank-1.txt").write_text("Thread 0x1 (most recent call first):\n")
    install_sigusr1(str(folder / "rank-0.txt"))
    uninstall_sigusr1()
    assert sorted(p.name for p in folder.iterdir()) == ["rank-1.txt"]
    install_sigusr1(str(folder / "rank-1.txt"))  # its earlier dump is appended to, and kept
    uninstall_sigusr1()
    assert (folder / "rank-1.txt").read_text().startswith("Thread 0x1")


def test_sigusr1_during_start_up_writes_the_stacks_and_the_process_goes_on():
    """Before the trainer installs its handler (a rank still importing, or waiting in rendezvous), SIGUSR1's
    default would end the process: the command line dumps the stacks to stderr from its first line on."""
    from tests.launch import DEBUG, signal_once_imported

    # components.errors is imported right after the start-up preparation
    # (a recipe error then ends it: nothing is made or trained)
    code, err = signal_once_imported(["-m", "nsa_titan.cli", "train", DEBUG, "--training.steps=0"],
                                     "components.errors", signal.SIGUSR1)
    assert code == 2 and "training.steps = 0: must be at least 1" in err, err[-3000:]
    assert "most recent call first" in err, err[-3000:]


def test_a_killed_runs_empty_dump_files_are_removed_before_the_next_run_starts(tmp_path, capsys, monkeypatch):
    """A rank killed (a second stop request, kill -9, the out-of-memory killer) cannot remove its empty dump file:
    the next launch's check (several ranks) or the next single-process run removes them; dumps stay."""
    import io
    import sys

    from nsa_titan import cli, launch_check
    from nsa_titan.observe.stack_dump import remove_empty_dump_files
    from tests.launch import DEBUG, TINY

    folder = tmp_path / "stacks"
    folder.mkdir()
    for rank in (0, 1):
        (folder / f"rank-{rank}.txt").write_text("")
    remove_empty_dump_files(str(tmp_path))
    assert not folder.exists()
    folder.mkdir()
    (folder / "rank-0.txt").write_text("")
    (folder / "rank-1.txt").write_text("Thread 0x1 (most recent call first):\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f'[training]\ndevice = "cpu"\n[job]\ndump_folder = "{tmp_path}"\n'))
    assert launch_check.main(["2"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["rank-1.txt"]
    (folder / "rank-1.txt").write_text("")
    (folder / "rank-3.txt").write_text("")
    assert cli.main(["train", DEBUG, *TINY, "--training.steps=1", f"--job.dump_folder={tmp_path}"]) == 0
    capsys.readouterr()
    assert not folder.exists()
