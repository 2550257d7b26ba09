"""[profiling]: torch.profiler over a window of global steps, a trace and an op table per rank."""

from __future__ import annotations

import gzip
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerAction

from nsa_titan import cli
from nsa_titan.observe.step_profiler import StepProfiler
from tests.launch import DEBUG, TINY, assert_cuda_only_refused_at_start


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
    assert _profiled_steps(out / "profile" / "trace_rank0.json.gz") == [3, 4]  # step 2 warms up, not kept
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
    # resumed past a window an earlier launch profiled: that trace is named, with no fix to make
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "trace_rank0.json.gz").write_bytes(b"")
    said.clear()
    profiler = StepProfiler(_config(), str(tmp_path), 0, torch.device("cpu"), said.append)
    profiler.before_step(5)
    profiler.close()
    assert len(said) == 1 and "which an earlier launch profiled" in said[0] and "Fix" not in said[0], said


@pytest.mark.parametrize("start, steps, run, recorded", [
    (3, 2, range(1, 7), [3, 4]),  # step 2 warms up
    (1, 3, range(1, 6), [1, 2, 3]),  # nothing before step 1 to warm up with
    (3, 2, range(3, 7), [3, 4]),  # resumed at the window's first step
    (1, 1, range(1, 3), [1]),
    (3, 5, range(1, 5), [3, 4, 5]),  # the run stops after step 4 inside the window 3..7: what ran after
                                     # step 4 until the end (a checkpoint, say) shows under the next name
])
def test_the_window_is_recorded_whole(tmp_path, start, steps, run, recorded):
    said, actions = [], {}
    profiler = StepProfiler(_config(start_step=start, steps=steps), str(tmp_path), 1, torch.device("cpu"),
                            said.append)
    for step in run:
        profiler.before_step(step)
        if profiler._profile is not None:
            actions[step] = profiler._profile.current_action
        _work()
        profiler.after_step(step)
    profiler.close()
    last = min(start + steps - 1, run[-1])
    assert said == [f"profiling: steps {start}..{last} written to {tmp_path / 'profile'}"]
    assert _profiled_steps(tmp_path / "profile" / "trace_rank1.json.gz") == recorded
    assert (tmp_path / "profile" / "ops_rank1.txt").exists()
    if start > run[0]:
        assert actions[start - 1] == ProfilerAction.WARMUP
    assert all(actions[s] in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE) for s in range(start, last + 1))


def test_a_second_profile_of_the_same_steps_keeps_the_first(tmp_path):
    """A resumed run profiles the same global steps again: the earlier files are kept, renamed with their time."""
    for _ in range(2):
        profiler = StepProfiler(_config(start_step=1, steps=1), str(tmp_path), 0, torch.device("cpu"), print)
        profiler.before_step(1)
        _work()
        profiler.after_step(1)
        profiler.close()
    names = sorted(os.listdir(tmp_path / "profile"))
    assert len(names) == 4 and {"trace_rank0.json.gz", "ops_rank0.txt"} <= set(names), names
    earlier = [n for n in names if n not in ("trace_rank0.json.gz", "ops_rank0.txt")]
    assert all(re.fullmatch(r"(trace_rank0\.\d{8}-\d{6}\.json\.gz|ops_rank0\.\d{8}-\d{6}\.txt)", n) for n in earlier)
    assert _profiled_steps(tmp_path / "profile" / next(n for n in earlier if n.startswith("trace"))) == [1]


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
    (["--profiling.enable=true", "--profiling.steps=9", "--training.steps=5"], "lower profiling.steps to at most 5"),
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
    assert_cuda_only_refused_at_start(tmp_path, capsys, ["--profiling.enable=true", "--profiling.memory_snapshot=true"],
                                      "this run trains on cpu. Fix: set --profiling.memory_snapshot=false")
