"""[profiling]: torch.profiler over a window of global steps, a trace and an op table per rank."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from nsa_titan import cli
from nsa_titan.observe.step_profiler import StepProfiler
from tests.launch import DEBUG, TINY


def _profiled_steps(trace_path) -> list[int]:
    with gzip.open(trace_path, "rt", encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    return sorted({int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_training_writes_the_profiled_steps(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--training.steps=5", "--profiling.enable=true", "--profiling.start_step=3",
            "--profiling.steps=2", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    assert f"profiling: steps 3..4 written to {out / 'profile'}" in capsys.readouterr().out
    assert _profiled_steps(out / "profile" / "trace_rank0.json.gz") == [3, 4]  # the warmup step 2 is not kept
    table = (out / "profile" / "ops_rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table


def _config(**changes):
    values = dict(enable=True, start_step=3, steps=2, folder="profile", memory_snapshot=False)
    return SimpleNamespace(**{**values, **changes})


def _work():
    torch.randn(64, 64) @ torch.randn(64, 64)


def test_a_run_resumed_past_the_window_says_nothing_is_profiled(tmp_path):
    said = []
    profiler = StepProfiler(_config(), str(tmp_path), 0, torch.device("cpu"), said.append)
    for step in (5, 6):
        profiler.before_step(step)
        _work()
        profiler.after_step(step)
    profiler.close()
    assert len(said) == 1 and "starts at step 5, after profiling.start_step = 3" in said[0]
    assert not (tmp_path / "profile").exists()


def test_a_run_ending_inside_the_window_writes_what_it_recorded(tmp_path):
    said = []
    profiler = StepProfiler(_config(steps=5), str(tmp_path), 1, torch.device("cpu"), said.append)
    for step in (1, 2, 3, 4):  # the run stops after step 4 of the window 3..7
        profiler.before_step(step)
        _work()
        profiler.after_step(step)
    profiler.close()
    assert said == [f"profiling: steps 3..4 written to {tmp_path / 'profile'}"]
    # Steps 3 and 4, and what ran after step 4 until the end (a checkpoint, say) under the next step's name.
    assert _profiled_steps(tmp_path / "profile" / "trace_rank1.json.gz") == [3, 4, 5]


def test_disabled_profiling_records_nothing(tmp_path):
    profiler = StepProfiler(_config(enable=False), str(tmp_path), 0, torch.device("cpu"), print)
    for step in (1, 2, 3, 4):
        profiler.before_step(step)
        profiler.after_step(step)
    profiler.close()
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("overrides, message", [
    (["--profiling.enable=true", "--profiling.start_step=4", "--profiling.steps=3", "--training.steps=5"],
     "start_step at most 3"),
    (["--profiling.memory_snapshot=true"], "profiling.enable is false"),
    (["--profiling.enable=true", "--profiling.memory_snapshot=true", "--training.device=cpu"],
     "training.device is 'cpu'"),
])
def test_profiling_settings_that_cannot_work_are_errors(tmp_path, capsys, overrides, message):
    assert cli.main(["train", DEBUG, *TINY, *overrides, f"--job.dump_folder={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_memory_snapshot_off_cuda_is_an_error(tmp_path, capsys):
    """training.device = auto on a machine without CUDA: known only once the run starts."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where the snapshot works")
    argv = [DEBUG, *TINY, "--profiling.enable=true", "--profiling.memory_snapshot=true", "--training.device=auto",
            f"--job.dump_folder={tmp_path / 'run'}"]
    assert cli.main(["train", *argv]) == 2
    assert "this run trains on cpu. Fix: set --profiling.memory_snapshot=false" in capsys.readouterr().err
