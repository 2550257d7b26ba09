"""A file system that fills up while a command writes: one message naming the file, exit 2, no traceback, no
partial output left behind, and what was saved before still there (a rerun resumes, a retry writes)."""

from __future__ import annotations

import errno
import os

import pytest

from nsa_titan import cli
from tests.launch import DEBUG, TINY, metrics
from tests.test_cli_bad_inputs import refused, run  # noqa: F401 (run: a fixture, a one-step run and its export)

FULL = "/dev/full"  # every write to it fails with ENOSPC, as on a full file system

pytestmark = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full (Linux)")


def test_a_disk_that_fills_during_training(tmp_path, capsys, monkeypatch):
    from nsa_titan.observe.metrics_log import MetricsLog

    argv = [DEBUG, *TINY, "--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
            "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}/run"]
    write = MetricsLog.write
    written = []

    def write_until_full(self, record):
        if "loss" in record and len(written) == 3:  # the disk fills after step 3's record
            self._fh = open(FULL, "w", encoding="utf-8")
        written.append(record)
        write(self, record)

    monkeypatch.setattr(MetricsLog, "write", write_until_full)
    refused(capsys, ["train", *argv], "train stopped: the file system is full while writing",
             "metrics.jsonl", "No space left on device", "resumes from it")
    monkeypatch.setattr(MetricsLog, "write", write)
    assert cli.main(["train", *argv]) == 0  # the checkpoint of step 2 was kept: the rerun resumes there
    assert "resum" in capsys.readouterr().out
    assert [r["step"] for r in metrics(f"{tmp_path}/run") if "loss" in r][-2:] == [3, 4]


def test_a_full_disk_at_start_up(tmp_path, capsys, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    refused(capsys, ["train", DEBUG, *TINY, f"--job.dump_folder={tmp_path}/run"],
             "the file system is full while writing", ".run.lock")


TORCH_ZIP_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("free_bytes, said", [(0, "(the file system is full; 0.0 GiB free there)"),
                                              (50 * 2**30, f"({TORCH_ZIP_ERROR}; 50.0 GiB free there)")])
def test_a_save_that_fails_without_an_os_error_on_a_full_disk_says_the_disk_is_full(tmp_path, capsys, monkeypatch,
                                                                                    free_bytes, said):
    """torch's zip writer meets a full disk as a RuntimeError in its own words: said as the full file system it
    is (with the free space), while the same error with space to spare keeps its text (the cause is elsewhere)."""
    import shutil

    from nsa_titan import checkpoint

    real_save = checkpoint.dcp.save

    def save(tensors, checkpoint_id, **kw):
        if "step-2" in checkpoint_id:
            raise RuntimeError(TORCH_ZIP_ERROR)
        return real_save(tensors, checkpoint_id=checkpoint_id, **kw)

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.dcp, "save", save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage._replace(free=free_bytes))
    refused(capsys, ["train", DEBUG, *TINY, "--training.steps=2", "--checkpoint.enable=true",
                     "--checkpoint.interval=1", "--checkpoint.async_mode=disabled", f"--job.dump_folder={tmp_path}/run"],
            f"cannot save the checkpoint of step 2 in {tmp_path}/run/checkpoint/step-2 {said}",
            "the last complete checkpoint (step 1) is kept", "Fix: free space on that file system")


def test_a_plot_that_fills_the_disk_leaves_nothing_and_can_be_retried(run, tmp_path, capsys,  # noqa: F811
                                                                      monkeypatch):
    from nsa_titan.observe import plots

    figure = plots.gate_figure

    def full_on_save(*args, **kwargs):
        class Full:
            def savefig(self, path, **_):
                with open(path, "wb") as fh:
                    fh.write(b"\x89PNG partial")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        return Full()

    out = tmp_path / "plots"
    command = ["plot", run[1], "--text", "def f(x):", "--out", str(out)]
    monkeypatch.setattr(plots, "gate_figure", full_on_save)
    monkeypatch.setattr(plots.pyplot(), "close", lambda fig: None)
    refused(capsys, command, "cannot write the plot results into --out", "No space left on device")
    assert not out.exists() or os.listdir(out) == []  # no partial picture, nothing that blocks a retry
    monkeypatch.setattr(plots, "gate_figure", figure)
    assert cli.main(command) == 0
    assert sorted(os.listdir(out)) == ["gates.png", "plots.json", "selection_layer0.png"]


@pytest.mark.slow
def test_one_rank_of_two_meeting_a_full_disk_ends_the_run_in_one_message(tmp_path):
    """Rank 1 alone meets it (rank 0 waits in a collective): rank 1 says so and ends, the launcher names it."""
    from tests.launch import train

    proc = train([DEBUG, *TINY, "--training.steps=3", "--job.plugins=tests.plugins.full_disk_at_step",
                  "--model.name=full_disk_at_step", "--model.full_disk_step=2", "--model.full_disk_rank=1",
                  "--parallelism.data_parallel_shard_degree=2", f"--job.dump_folder={tmp_path / 'run'}"],
                 nproc=2, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "error: rank 1: train stopped: the file system is full while writing '/scratch/spill.bin' (No space " \
           "left on device)." in " ".join(said), proc.stderr[-3000:]
    assert said[-1] == "error: the run stopped: rank 1 failed first (exit code 2); its own message is above."
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
