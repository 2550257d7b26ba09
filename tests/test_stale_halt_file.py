"""A halt file from an earlier launch (run_train.sh turned a stop into it, then the launch died before a rank read
it) is set aside as HALT.handled with a note, not obeyed after the next run's first step; one written while the run
starts still stops it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest

from nsa_titan import cli, launch_check
from tests.conftest import REPO_ROOT
from tests.launch import DEBUG, TINY, metrics


def _train(folder, capsys) -> tuple[int, str]:
    code = cli.main(["train", DEBUG, *TINY, "--training.steps=3", f"--job.dump_folder={folder}"])
    return code, capsys.readouterr().out


def _halt(folder, age_s: float = 0.0) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "HALT")
    open(path, "w").close()
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def test_a_halt_file_older_than_the_run_is_set_aside_and_the_run_trains_on(tmp_path, capsys):
    folder = tmp_path / "run"
    halt = _halt(folder, age_s=3600)
    code, out = _train(folder, capsys)
    assert code == 0, out
    assert f"note: {halt} (written " in out and "is from an earlier launch" in out, out
    assert "stopping after step" not in out, out
    assert [r["step"] for r in metrics(str(folder)) if "loss" in r][-1] == 3
    assert not os.path.exists(halt) and os.path.exists(halt + ".handled")


def test_a_halt_file_written_while_the_run_starts_still_stops_it(tmp_path, capsys):
    folder = tmp_path / "run"
    halt = _halt(folder)  # newer than this process: a stop asked of the run now starting
    code, out = _train(folder, capsys)
    assert code == 0 and f"stopping after step 1 (halt file {halt}" in out, out
    assert "earlier launch" not in out, out


def _check(capsys, monkeypatch, folder) -> tuple[int, str, str]:
    recipe = f'[training]\ndevice = "cpu"\n[job]\ndump_folder = "{folder}"\n'
    monkeypatch.setattr(sys, "stdin", io.StringIO(recipe))
    code = launch_check.main(["2"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_launch_check_sets_aside_any_halt_file_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    """No rank of this launch has started, so run_train.sh has written no halt file for it yet: however new, one
    there is an earlier launch's."""
    halt = _halt(tmp_path)
    code, out, err = _check(capsys, monkeypatch, tmp_path)
    assert code == 0 and out == f"{tmp_path}\n", err
    assert err.startswith(f"note: {halt} (written ") and "set aside as HALT.handled" in err, err
    assert not os.path.exists(halt) and os.path.exists(halt + ".handled")


def test_the_launch_check_leaves_the_halt_file_of_a_run_that_holds_the_folder(tmp_path, capsys, monkeypatch):
    """A second launch in a folder another run trains in is refused by that run's lock: the halt file asking that
    run to stop stays its own."""
    halt = _halt(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from nsa_titan.run_folder import RunFolderLock; "
                               "lock = RunFolderLock(sys.argv[1], print); print('held', flush=True); "
                               "sys.stdin.read()", str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT})
    try:
        assert holder.stdout.readline() == "held\n"
        code, out, err = _check(capsys, monkeypatch, tmp_path)
    finally:
        holder.communicate("")
    assert code == 0 and out == f"{tmp_path}\n" and err == "", err
    assert os.path.exists(halt)


@pytest.mark.slow
def test_run_train_sh_trains_on_past_an_earlier_launchs_halt_file(tmp_path):
    """Two processes: run_train.sh's launch check sets the file aside and says so; both ranks train every step."""
    halt = _halt(tmp_path)
    done = subprocess.run([os.path.join(REPO_ROOT, "run_train.sh"), DEBUG, *TINY, "--training.steps=2",
                           "--parallelism.data_parallel_shard_degree=2", f"--job.dump_folder={tmp_path}"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.startswith(f"note: {halt} (written "), done.stderr[-3000:]
    assert "stopping after step" not in done.stdout, done.stdout
    assert [r["step"] for r in metrics(str(tmp_path)) if "loss" in r][-1] == 2
    assert os.path.exists(halt + ".handled")


def test_a_halt_file_written_while_the_launch_script_sets_up_still_stops_the_run(tmp_path):
    """run_train.sh sets up (its environment check, the GPU count: seconds) and then execs the run in its own
    process: a halt file the user wrote in those seconds was taken for an earlier launch's and set aside, the stop
    ignored. The process's start is the script's."""
    folder = tmp_path / "run"
    folder.mkdir()
    script = (f"touch {folder}/HALT; sleep 4; exec {sys.executable} -c \"from nsa_titan.graceful_stop import "
              f"set_aside_stale_halt_file; from nsa_titan.start_up import process_started_at; "
              f"print(set_aside_stale_halt_file('{folder}', process_started_at()))\"")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stdout + done.stderr
    assert (folder / "HALT").exists() and not (folder / "HALT.handled").exists()


@pytest.mark.parametrize("in_the_way", ["empty folder", "folder with a file"])
def test_a_halt_file_read_where_a_handled_folder_stands_still_saves_and_is_set_aside(tmp_path, capsys, in_the_way):
    """A HALT.handled folder (a stop once asked with `mkdir HALT`) made the rename after a halt a traceback, exit 1,
    and the stop's save was lost."""
    from nsa_titan.checkpoint import complete_steps

    folder = tmp_path / "run"
    (folder / "HALT.handled").mkdir(parents=True)
    if in_the_way == "folder with a file":
        (folder / "HALT.handled" / "note.txt").write_text("kept")
    halt = _halt(folder)  # a stop asked of the run now starting: obeyed after its first step, with a save
    code = cli.main(["train", DEBUG, *TINY, "--training.steps=3", f"--job.dump_folder={folder}",
                     "--checkpoint.enable=true"])
    out = capsys.readouterr().out
    assert code == 0 and f"stopping after step 1 (halt file {halt}" in out, out
    assert complete_steps(str(folder / "checkpoint")) == [1], os.listdir(folder)
    aside = [name for name in os.listdir(folder) if name.startswith("HALT.handled-")]
    assert not os.path.exists(halt) and len(aside) == 1 and os.path.isfile(folder / aside[0]), os.listdir(folder)
    assert (folder / "HALT.handled").is_dir()


def test_the_launch_check_sets_a_halt_file_aside_where_a_handled_folder_stands(tmp_path, capsys, monkeypatch):
    (tmp_path / "HALT.handled" / "inside").mkdir(parents=True)
    halt = _halt(tmp_path)
    code, out, err = _check(capsys, monkeypatch, tmp_path)
    assert code == 0 and out == f"{tmp_path}\n", err
    aside = [name for name in os.listdir(tmp_path) if name.startswith("HALT.handled-")]
    assert len(aside) == 1 and f"set aside as {aside[0]}, and this run trains on" in err, err
    assert not os.path.exists(halt)
