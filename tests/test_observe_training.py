"""Observability wired into real training runs: metrics, MFU, TensorBoard, telemetry, faults."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import time
import warnings

import pytest
import torch

from components.data import TOKENIZERS
from components.models import flops_per_token
from nsa_titan import cli
from nsa_titan.checkpoint import complete_steps
from nsa_titan.config import resolve
from nsa_titan.observe.watchdog import HANG_EXIT_CODE
from nsa_titan.trainer import NUMERICAL_FAULT_EXIT
from nsa_titan.training_faults import OUT_OF_MEMORY_EXIT
from tests.launch import DEBUG, TINY, assert_resumed_at, finish, metrics, start_training, train

BASE = [DEBUG, *TINY, "--training.local_batch_size=2"]


def test_metrics_schema_mfu_tensorboard_telemetry_and_manifest(tmp_path):
    out = tmp_path / "run"
    argv = [*BASE, "--training.steps=4", "--metrics.peak_tflops=0.001", "--metrics.enable_tensorboard=true",
            "--metrics.telemetry_freq=2", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    records = metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    recipe = resolve(argv).recipe
    fpt = flops_per_token(recipe.model.args, TOKENIZERS["byte"][1]().vocab_size, recipe.training.seq_len)
    from components.optim import SCHEDULES, lr_factor

    sched = recipe.lr_scheduler
    for r in steps:
        assert r["lr"] == pytest.approx(recipe.optimizer.lr * lr_factor(
            r["step"], warmup_steps=sched.warmup_steps, total_steps=recipe.training.steps,
            shape=SCHEDULES[sched.decay_type],
            min_lr_factor=sched.min_lr_factor), rel=1e-12)
        assert r["tokens_per_second"] > 0 and r["step_time_s"] > 0 and r["data_wait_s"] >= 0
        expected_mfu = 100 * r["tokens_per_second_per_device"] * fpt / 1e9
        assert r["mfu_percent"] == pytest.approx(expected_mfu, rel=1e-9)
    telemetry = [r for r in records if any(k.startswith("telemetry/") for k in r)]
    assert [r["step"] for r in telemetry] == [2, 4]
    gate_means = [v for k, v in telemetry[0].items() if k.endswith("gate_mean")]
    assert gate_means and all(0 < v < 1 for v in gate_means)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]
    assert losses == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    # The plot command's pictures at each telemetry step: gates and every NSA layer's selection.
    layers = recipe.model.args.n_layers
    assert sorted(events.Tags()["images"]) == sorted(["attention/gates", *(f"attention/selection_layer{i}" for i in range(layers))])
    for tag in events.Tags()["images"]:
        images = events.Images(tag)
        assert [e.step for e in images] == [2, 4] and all(e.width > 100 and e.height > 100 for e in images)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe_hash"] == resolve(argv).hash
    assert manifest["world_size"] == 1 and "torch" in manifest["versions"]
    assert os.path.exists(out / "heartbeat" / "rank-0.json")


class JumpingClock:
    """The trainer's `time`, with `offset` seconds added to perf_counter (a test jumps it inside a phase)."""
    offset = 0.0

    def perf_counter(self):
        return time.perf_counter() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


def test_throughput_counts_training_only_and_the_eta_skips_the_first_step(tmp_path, monkeypatch):
    """A clock that jumps 1000 s in the first step (compilation) and 100 s in each validation: tokens/s of
    the window after a validation is not diluted by it, and the ETA's pace leaves the first step out."""
    from nsa_titan import trainer as trainer_module

    clock = JumpingClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    step, validate = trainer_module.Trainer.train_step, trainer_module.Trainer.validate
    calls = []

    def first_step_compiles(self, iterator):
        calls.append(1)
        clock.offset += 1000.0 if len(calls) == 1 else 0.0
        return step(self, iterator)

    def slow_validation(self):
        clock.offset += 100.0
        return validate(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", first_step_compiles)
    monkeypatch.setattr(trainer_module.Trainer, "validate", slow_validation)
    out = tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=6", "--metrics.log_freq=2", "--validation.enable=true",
                     "--validation.freq=2", "--validation.steps=1", f"--job.dump_folder={out}"]) == 0
    records = {r["step"]: r for r in metrics(out) if "loss" in r}
    window_tokens = 2 * 2 * 64  # two steps of 2 rows of 64 tokens
    assert records[4]["tokens_per_second"] > window_tokens / 10  # the 100 s validation after step 2 set aside
    assert records[4]["eta_s"] < 200  # pace from steps 2-4 (with one validation), not the 1000 s first step
    # One step done, and it held the compile: no pace yet, so no ETA (1000 s x 5 steps would be 20x too long).
    assert "eta_s" not in records[1] and records[2]["eta_s"] < 200 and records[6]["eta_s"] == 0


def test_the_eta_leaves_out_the_profiler_traces_export(tmp_path, monkeypatch):
    """Writing the profiler's trace happens once: a clock that jumps 1000 s in it left tokens/s alone but the ETA's
    pace held it, so the steps after the window read an ETA of 1000 s for two steps of a fraction of a second."""
    from nsa_titan import trainer as trainer_module
    from nsa_titan.observe.step_profiler import StepProfiler

    clock = JumpingClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    write = StepProfiler._write

    def slow_export(self, profiler):
        write(self, profiler)
        clock.offset += 1000.0

    monkeypatch.setattr(StepProfiler, "_write", slow_export)
    out = tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=5", "--profiling.enable=true", "--profiling.start_step=2",
                     "--profiling.steps=1", f"--job.dump_folder={out}"]) == 0
    assert os.path.exists(out / "profile" / "trace_rank0.json.gz")
    records = {r["step"]: r for r in metrics(out) if "loss" in r}
    assert records[3]["eta_s"] < 100 and records[4]["eta_s"] < 100, records  # 2 and 1 steps left


def test_the_eta_leaves_out_a_first_validations_compile_and_keeps_what_validations_cost(tmp_path, monkeypatch):
    """Under compile the first validation compiles each block once more: a clock that jumps 1000 s in it, and 10 s
    in each later one, read an ETA of hundreds of seconds for steps of a fraction of one. The first validation is
    left out of the pace and the second counts for it: at step 6, 20 s of validations over the 5 steps after the
    first, 2 steps left."""
    from nsa_titan import trainer as trainer_module

    clock = JumpingClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    validate, calls = trainer_module.Trainer.validate, []

    def first_validation_compiles(self):
        calls.append(1)
        clock.offset += 1000.0 if len(calls) == 1 else 10.0
        return validate(self)

    monkeypatch.setattr(trainer_module.Trainer, "validate", first_validation_compiles)
    out = tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=8", "--metrics.log_freq=2", "--validation.enable=true",
                     "--validation.freq=2", "--validation.steps=1", "--compile.enable=true",
                     "--compile.backend=eager", f"--job.dump_folder={out}"]) == 0
    records = {r["step"]: r for r in metrics(out) if "loss" in r}
    assert records[4]["eta_s"] < 100, records  # 4 steps left: the 1000 s compile is not in the pace
    assert 8 <= records[6]["eta_s"] < 100, records  # 20 s / 5 steps x 2 (without the stand-in, 10 s: 4 s)


def test_throughput_leaves_out_the_writing_of_each_record(tmp_path, monkeypatch):
    """Writing a record (console, metrics file, TensorBoard) fell in the next window: at log_freq = 1 every
    step's tokens/s held one, a few percent lower than at a larger log_freq. A write that takes 100 s leaves
    the tokens/s of the steps after it as they are."""
    from nsa_titan import trainer as trainer_module

    clock = JumpingClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    log = trainer_module.Trainer._log

    def slow_log(self, record, console=True):
        log(self, record, console)
        clock.offset += 100.0

    monkeypatch.setattr(trainer_module.Trainer, "_log", slow_log)
    out = tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=3", f"--job.dump_folder={out}"]) == 0
    records = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records[1:]:  # the steps after a record's write
        assert r["tokens_per_second"] > 2 * 64 / 10, r  # one step of 2 rows of 64 tokens, in under 10 s


def test_telemetry_on_dense_model_is_a_recipe_error(tmp_path, capsys):
    dense = DEBUG.replace("debug.toml", "debug_dense.toml")
    code = cli.main(["train", dense, *TINY[:4], "--training.seq_len=64",
                     "--metrics.telemetry_freq=5", f"--job.dump_folder={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "metrics.telemetry_freq" in err and "no attention telemetry" in err


def test_planted_hang_dumps_stacks_and_exits(tmp_path):
    out = tmp_path / "run"
    proc = train([*BASE, "--training.steps=50", "--job.plugins=tests.plugins.hang", "--data.source=hang_after",
                  "--data.hang_after.after_batches=2", "--data.hang_after.batch_size=2",
                  "--data.hang_after.seq_len=64", "--fault.step_timeout_seconds=20",
                  f"--job.dump_folder={out}"], timeout=240)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    assert "fault.step_timeout_seconds" in proc.stderr and "after step 2" in proc.stderr
    assert "error: rank 0: the run looks hung" in proc.stderr and "error: error:" not in proc.stderr
    dump = (out / "stacks" / "rank-0.txt").read_text()
    assert "_blocked_forever" in dump  # the stuck frame is in the dump


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, async_mode):
    """With async saves, step 2's checkpoint may still be writing when step 4 stops the run: it completes."""
    out = tmp_path / "run"
    proc = train([*BASE, "--training.steps=10", "--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step",
                  "--model.nan_at_step=4", "--model.nan_steps=0", "--checkpoint.enable=true",
                  "--checkpoint.interval=2", f"--checkpoint.async_mode={async_mode}", f"--job.dump_folder={out}"])
    assert proc.returncode == NUMERICAL_FAULT_EXIT, proc.stderr[-3000:]
    assert "NaN" in proc.stderr and "step 4" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "error: stopping at step 4" in proc.stderr, proc.stderr[-3000:]
    assert f"the same command then resumes from {out / 'checkpoint' / 'step-2'}." in proc.stderr
    assert complete_steps(str(out / "checkpoint")) == [2]
    assert all(r["step"] < 4 for r in metrics(out) if "loss" in r)


def test_a_nan_stop_on_two_ranks_ends_both_cleanly(tmp_path):
    """Every rank agrees on the stop, so each ends with the numerical fault's exit code (the node says the message
    once) after meeting the others (no rank torn down mid-collective, none killed by a signal); step 2's
    checkpoint is complete."""
    out = tmp_path / "run"
    proc = train([*BASE, "--training.steps=6", "--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step",
                  "--model.nan_at_step=4", "--model.nan_steps=0", "--checkpoint.enable=true",
                  "--checkpoint.interval=2", f"--job.dump_folder={out}"], nproc=2)
    assert proc.returncode != 0
    assert proc.stderr.count("error: stopping at step 4") == 1, proc.stderr[-3000:]  # said once, by the node
    # The launcher says the ranks stopped together and exits with their code (it may stop one with SIGTERM
    # once the other is out); no rank aborted on the way out.
    assert proc.returncode == NUMERICAL_FAULT_EXIT, proc.stderr[-3000:]
    assert (f"error: the run stopped: every rank stopped together (exit code {NUMERICAL_FAULT_EXIT}); the message "
            f"is above.") in proc.stderr, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "SIGSEGV" not in proc.stderr
    assert "nsa_titan/trainer.py" not in proc.stderr  # one message, no traceback of the trainer
    assert complete_steps(str(out / "checkpoint")) == [2]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_out_of_memory_is_one_message_naming_the_fix_and_keeps_the_checkpoint(tmp_path, async_mode):
    """Step 4's checkpoint is complete after the fault at step 5, even when it was still being
    written in the background (completed at the next step's agreement, which never comes)."""
    out = tmp_path / "run"
    proc = train([*BASE, "--training.steps=10", "--job.plugins=tests.plugins.oom_at_step", "--model.name=oom_at_step",
                  "--model.oom_at_step=5", "--checkpoint.enable=true", "--checkpoint.interval=2",
                  f"--checkpoint.async_mode={async_mode}", f"--job.dump_folder={out}"])
    assert proc.returncode == OUT_OF_MEMORY_EXIT, proc.stderr[-3000:]
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.index("error:"):]
    assert "out of device memory in step 5" in error and "Tried to allocate 12.27 GiB" in error
    assert "PYTORCH_CUDA_ALLOC_CONF" not in error  # no environment variable is the fix
    assert "last complete checkpoint (step 4) is kept" in error
    assert "lower training.local_batch_size (now 2), e.g. --training.local_batch_size=1 --training.global_batch_size=2" \
        in error
    assert complete_steps(str(out / "checkpoint"))[-1] == 4


@pytest.mark.parametrize("local, global_batch, dp", [(6, 12, 2), (8, 8, 1), (5, 20, 2)])
def test_out_of_memory_suggests_a_local_batch_size_the_global_batch_takes(local, global_batch, dp):
    """'lower training.local_batch_size; keep --training.global_batch_size=G' let a user pick a size G is no
    multiple of (times the data-parallel size), which the recipe then refused: the fix names one that fits."""
    from types import SimpleNamespace

    from nsa_titan.training_faults import out_of_memory_message

    argv = [DEBUG, f"--training.local_batch_size={local}", f"--training.global_batch_size={global_batch}"]
    message = out_of_memory_message("step", 3, RuntimeError("CUDA out of memory."), resolve(argv, world_size=dp).recipe,
                                    SimpleNamespace(rank=0, world_size=dp), None, global_batch, dp)
    fix = message[message.index("lower training.local_batch_size"):].split("; or ")[0]
    flags = re.findall(r"--training\.\w+=\d+", fix)
    suggested = resolve([DEBUG, *flags], world_size=dp).recipe.training  # the values together pass the checks
    assert suggested.local_batch_size < local and suggested.global_batch_size == global_batch, fix


def test_bad_steps_can_be_skipped(tmp_path):
    """Step 3's loss is NaN: its update is skipped (the weights saved after step 3 are those after step 2) and
    the run trains on with finite losses."""
    from nsa_titan.rebuild import load_checkpoint_model

    argv = [*BASE, "--training.steps=6", "--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step",
            "--model.nan_at_step=3", "--model.nan_steps=1", "--fault.max_bad_steps=1", "--checkpoint.enable=true",
            "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0", f"--job.dump_folder={tmp_path / 'run'}"]
    proc = train(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("update was skipped") == 1, proc.stderr[-3000:]
    records = {r["step"]: r for r in metrics(tmp_path / "run") if "loss" in r}
    assert [records[step]["skipped_steps"] for step in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert all(math.isfinite(records[step]["loss"]) for step in (1, 2, 4, 5, 6))

    def weights_after(step: int) -> dict:
        model, _, _ = load_checkpoint_model(resolve([*argv, f"--checkpoint.load_step={step}"], world_size=None))
        return model.state_dict()

    after = {step: weights_after(step) for step in (2, 3, 4)}
    assert all(torch.equal(after[3][name], value) for name, value in after[2].items())
    assert not all(torch.equal(after[4][name], value) for name, value in after[3].items())


def test_a_checkpoint_before_any_update_leaves_the_first_update_whole(tmp_path):
    """Step 1 is bad and skipped, and saved: the optimizer has made no update yet. Saving it must not
    leave AdamW's step count at 1 (torch builds an unstepped optimizer's state by stepping it at lr 0),
    nor may resuming: step 2's update, and so step 3's loss, equal those of the run that saved nothing."""
    nan = ["--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step", "--model.nan_steps=1",
           "--fault.max_bad_steps=1"]
    plain = tmp_path / "plain"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert cli.main(["train", *BASE, *nan, "--model.nan_at_step=1", "--training.steps=3",
                         f"--job.dump_folder={plain}"]) == 0
    # The schedule's factor comes from the step count: torch's "stepped before the optimizer" is noise here.
    assert not [w for w in said if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in said]
    saved = ["--checkpoint.enable=true", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path / 'saved'}"]
    assert cli.main(["train", *BASE, *nan, *saved, "--model.nan_at_step=1", "--training.steps=3"]) == 0
    cut = ["--checkpoint.enable=true", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path / 'cut'}"]
    assert cli.main(["train", *BASE, *nan, *cut, "--model.nan_at_step=1", "--training.steps=1"]) == 0
    record = json.loads((tmp_path / "cut" / "checkpoint" / "step-1" / "train_state.json").read_text())
    assert record["optimizer_stepped"] is False
    # The resumed process counts its own forwards: no bad step in it.
    assert cli.main(["train", *BASE, *nan, *cut, "--model.nan_at_step=99", "--training.steps=3"]) == 0
    want = {r["step"]: r["loss"] for r in metrics(plain) if "loss" in r}
    assert {r["step"]: r["loss"] for r in metrics(tmp_path / "saved") if "loss" in r}[3] == want[3]
    assert {r["step"]: r["loss"] for r in metrics(tmp_path / "cut") if "loss" in r}[3] == want[3]


def test_the_run_of_bad_steps_is_counted_across_a_resume(tmp_path):
    """Steps 3 and 4 are bad and skipped (fault.max_bad_steps = 2), step 4 is saved; the resumed run's
    first step is bad too: three in a row, so it stops there, as the run would have without the resume."""
    out = tmp_path / "run"
    nan = ["--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step", "--model.nan_steps=0",
           "--fault.max_bad_steps=2", "--checkpoint.enable=true", "--checkpoint.interval=4", f"--job.dump_folder={out}"]
    first = train([*BASE, *nan, "--training.steps=4", "--model.nan_at_step=3"])
    assert first.returncode == 0 and first.stderr.count("update was skipped") == 2, first.stderr[-3000:]
    # The plugin counts the forwards of this process: its first step (step 5) is bad.
    resumed = train([*BASE, *nan, "--training.steps=6", "--model.nan_at_step=1"])
    assert resumed.returncode == NUMERICAL_FAULT_EXIT, resumed.stderr[-3000:]
    assert "error: stopping at step 5" in resumed.stderr and "3 step(s) in a row (3 in total)" in resumed.stderr


def test_a_stop_on_bad_steps_keeps_the_newest_good_checkpoint(tmp_path):
    """Every step from 3 on is NaN; steps are saved (each ends a run of skipped ones) with keep_latest_k = 2, and
    step 6 stops the run: step 2's checkpoint, the newest of a good step, is kept beside 4 and 5, and the stop
    names it. The fixes are those the run's settings leave (it clips, and computes in float32)."""
    out = tmp_path / "run"
    proc = train([*BASE, "--training.steps=10", "--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step",
                  "--model.nan_at_step=3", "--model.nan_steps=0", "--fault.max_bad_steps=3",
                  "--checkpoint.enable=true", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2",
                  f"--job.dump_folder={out}"])
    assert proc.returncode == NUMERICAL_FAULT_EXIT, proc.stderr[-3000:]
    assert complete_steps(str(out / "checkpoint")) == [2, 4, 5]
    assert proc.stdout.count(f"keeping {out / 'checkpoint' / 'step-2'} beside the newest 2") == 1, proc.stdout
    error = proc.stderr[proc.stderr.index("error: stopping at step 6"):]
    assert f"resumes from {out / 'checkpoint' / 'step-5'} (past the skipped steps' batches" in error, error
    assert "--checkpoint.load_step=2 goes back to step 2, the newest checkpoint of a good step" in error, error
    assert "lower optimizer.lr" in error and "max_norm" not in error and "float32" not in error, error
    assert "warning: warning:" not in proc.stderr and proc.stderr.count("warning: step") == 3, proc.stderr[-3000:]


def test_a_bad_first_step_blames_the_weights_or_data_not_the_learning_rate(tmp_path):
    proc = train([*BASE, "--training.steps=3", "--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step",
                  "--model.nan_at_step=1", "--model.nan_steps=0", "--training.max_norm=0",
                  f"--job.dump_folder={tmp_path / 'run'}"])
    assert proc.returncode == NUMERICAL_FAULT_EXIT, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.index("error: stopping at step 1"):]
    assert "look at the weights it started from (model.init_std)" in error and "lower optimizer.lr" not in error, error
    assert "set training.max_norm > 0" in error, error


def test_a_resume_logs_each_step_once(tmp_path, capsys):
    """A crash after step 6 with the last checkpoint at 4: the resumed run logs 5 and 6 again. metrics.jsonl
    and TensorBoard then hold each step once, the new values; the old records of 5 and 6 are set aside."""
    out = tmp_path / "run"
    argv = ["train", *[f for f in BASE if f != "--checkpoint.enable=false"], "--training.steps=6",
            "--checkpoint.enable=true", "--checkpoint.interval=4", "--metrics.enable_tensorboard=true",
            f"--job.dump_folder={out}"]
    assert cli.main(argv) == 0
    first = {r["step"]: r for r in metrics(out) if "loss" in r}
    shutil.rmtree(out / "checkpoint" / "step-6")  # as if the run died before its last save
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "metrics.jsonl held steps after 4" in capsys.readouterr().out
    records = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records[:4]] == [first[s]["loss"] for s in (1, 2, 3, 4)]
    assert "eta_s" not in records[4] and records[5]["eta_s"] == 0  # the resume's first step shows no pace
    (aside,) = [name for name in os.listdir(out) if name.startswith("metrics.after-step-4-")]
    with open(out / aside, encoding="utf-8") as fh:
        assert [json.loads(line)["step"] for line in fh] == [5, 6]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]


def test_tensorboard_switched_on_at_a_resume_draws_the_runs_own_curve(tmp_path):
    """TensorBoard on for steps 1-4 (checkpoints 2 and 4), off for a branch from step 2 with another learning rate,
    then on again to step 6: TensorBoard draws metrics.jsonl's curve, not the abandoned steps 3 and 4 its events
    still held from the first session; a run whose TensorBoard starts at a resume draws the steps before it too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = ["train", *[f for f in BASE if f != "--checkpoint.enable=false"], "--checkpoint.enable=true",
            "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"]
    tb = "--metrics.enable_tensorboard=true"

    def assert_tensorboard_draws_the_records():
        records = [r for r in metrics(tmp_path) if "loss" in r]
        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("loss")] == \
            [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]

    assert cli.main([*argv, "--training.steps=4", tb]) == 0
    assert cli.main([*argv, "--training.steps=4", "--checkpoint.load_step=2", "--optimizer.lr=1e-2"]) == 0
    assert cli.main([*argv, "--training.steps=6", "--optimizer.lr=1e-2", tb]) == 0
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_tensorboard_draws_the_records()

    shutil.rmtree(tmp_path)  # never on before the resume
    assert cli.main([*argv, "--training.steps=2"]) == 0
    assert cli.main([*argv, "--training.steps=4", tb]) == 0
    assert_tensorboard_draws_the_records()


def test_a_writer_started_in_the_second_of_an_older_event_file_is_read_after_it(tmp_path):
    """TensorBoard reads a folder's event files in name order. A writer started in the second of an older file (a
    resume or a redraw soon after a run) took a name that sorts by process id, so it could be read first and the
    older file's steps hid the ones drawn again."""
    import socket

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nsa_titan.observe.metrics_log import TensorBoardLog

    older = TensorBoardLog(str(tmp_path / "before"))
    older.write({"step": 1, "loss": 5.0})
    older.close()
    (tmp_path / "tb").mkdir()
    time.sleep(1 - time.time() % 1)  # a second's start: the redraw below starts within it
    # Named as another process's file of this second, whose process id sorts after this one's.
    (file,) = (tmp_path / "before").iterdir()
    file.rename(tmp_path / "tb" / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.99999999.0")
    redraw = TensorBoardLog(str(tmp_path / "tb"), 0)
    redraw.write({"step": 1, "loss": 3.0})
    redraw.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0)]


@pytest.mark.parametrize("name, read", [("events.out.notes.txt", False), ("run.tfevents.1.host", True),
                                        ("events.out.tfevents.1.host.profile-empty", False)])
def test_event_files_are_the_files_tensorboard_reads(tmp_path, name, read):
    """A resume's check for events took any events.out.* file, which TensorBoard does not read without "tfevents" in
    its name (a folder holding only that got no earlier steps drawn again), and passed over a <run>.tfevents.* file,
    which TensorBoard reads; the profiler's *.profile-empty marker holds no scalars TensorBoard shows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nsa_titan.observe.metrics_log import TensorBoardLog
    from nsa_titan.observe.tensorboard_pictures import holds_events

    writer = TensorBoardLog(str(tmp_path / "written"))
    writer.write({"step": 1, "loss": 5.0})
    writer.close()
    (written,) = (tmp_path / "written").iterdir()
    (tmp_path / "tb").mkdir()
    shutil.copy(written, tmp_path / "tb" / name)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert ("loss" in events.Tags()["scalars"]) is read  # TensorBoard's own verdict
    assert holds_events(str(tmp_path / "tb")) is read


@pytest.mark.parametrize("emptied", [False, True])
def test_a_resume_draws_the_steps_before_it_into_a_deleted_or_emptied_tensorboard_folder(tmp_path, emptied):
    """rm -r <dump>/tb (or its files) before a resume: TensorBoard showed only the steps after the resume, though
    metrics.jsonl holds the ones before it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = ["train", *[f for f in BASE if f != "--checkpoint.enable=false"], "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--metrics.enable_tensorboard=true", f"--job.dump_folder={tmp_path}"]
    assert cli.main([*argv, "--training.steps=2"]) == 0
    shutil.rmtree(tmp_path / "tb")
    if emptied:
        (tmp_path / "tb").mkdir()
    assert cli.main([*argv, "--training.steps=4"]) == 0
    records = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]


def test_a_resume_brings_back_its_records_after_a_run_without_checkpoints_in_its_folder(tmp_path, capsys):
    """A run with checkpoint.enable = false started afresh in a run's folder sets the run's records aside and
    writes its own; the run resumed later gets its own records back in metrics.jsonl (the other run's go to a
    set-aside file), not the other run's steps followed by its own."""
    tb = "--metrics.enable_tensorboard=true"
    validate = ["--validation.enable=true", "--validation.freq=3", "--validation.steps=1"]
    argv = ["train", *[f for f in BASE if f not in ("--checkpoint.enable=false", "--validation.enable=false")],
            "--checkpoint.enable=true", "--checkpoint.interval=3", *validate, tb, f"--job.dump_folder={tmp_path}"]
    assert cli.main([*argv, "--training.steps=6"]) == 0
    first = [r for r in metrics(tmp_path) if "loss" in r]
    first_validations = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in first_validations] == [3, 6]
    assert cli.main(["train", *BASE, "--training.steps=2", "--optimizer.lr=1e-2", tb,
                     f"--job.dump_folder={tmp_path}"]) == 0
    scratch = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in scratch] == [1, 2] and scratch[1]["loss"] != first[1]["loss"]
    capsys.readouterr()
    assert cli.main([*argv, "--training.steps=8"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "lacked the resumed run's records up to step 6: they came back from" in out
    records = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[:6] == first
    # The validation of step 6 came back with the records: the resume does not log it a second time.
    validations = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert validations[:2] == first_validations and [r["step"] for r in validations] == [3, 6, 8]
    moved = re.search(r"held another run's records \(.*\), moved to (\S+), and", out).group(1)
    with open(moved, encoding="utf-8") as fh:
        assert [json.loads(line) for line in fh if '"loss"' in line] == scratch
    # TensorBoard draws the same curve: the other run's events are hidden, the restored records drawn again.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [e.step for e in events.Scalars("val_loss")] == [3, 6, 8]


def _pictures(folder) -> dict[tuple[str, int], bytes]:
    """{(tag, step): PNG} of the attention pictures TensorBoard shows for `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"images": 0})
    events.Reload()
    shown = [((tag, e.step), e.encoded_image_string) for tag in events.Tags()["images"] for e in events.Images(tag)]
    assert len(dict(shown)) == len(shown), [key for key, _ in shown]  # each picture once
    return dict(shown)


@pytest.mark.parametrize("between", ["a run without checkpoints", "tensorboard off", "another tensorboard folder"])
def test_a_redrawn_tensorboard_keeps_the_attention_pictures_before_the_resume(tmp_path, between):
    """A resume that draws TensorBoard's curves again from metrics.jsonl (after a run without checkpoints in the
    folder, after a resumed stretch with TensorBoard off, or from a checkpoint whose run logged elsewhere) hid
    every earlier event: the scalars came back, the attention pictures of the steps before the resume were lost.
    They are copied from the events they were drawn into."""
    tb = "--metrics.enable_tensorboard=true"
    argv = ["train", *[f for f in BASE if f != "--checkpoint.enable=false"], "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--metrics.telemetry_freq=2", f"--job.dump_folder={tmp_path}"]
    first_folder = "tb_first" if between == "another tensorboard folder" else "tb"
    assert cli.main([*argv, "--training.steps=4", tb, f"--metrics.save_tb_folder={first_folder}"]) == 0
    first = _pictures(tmp_path / first_folder)
    assert sorted({step for _, step in first}) == [2, 4]
    if between == "tensorboard off":
        assert cli.main([*argv, "--training.steps=6"]) == 0
    elif between == "a run without checkpoints":
        assert cli.main(["train", *BASE, "--training.steps=2", "--optimizer.lr=1e-2", "--metrics.telemetry_freq=2",
                         tb, f"--job.dump_folder={tmp_path}"]) == 0
        assert _pictures(tmp_path / "tb").keys() == {(tag, 2) for tag, _ in first}  # the other run's, alone
    assert cli.main([*argv, "--training.steps=8", tb]) == 0
    shown = _pictures(tmp_path / "tb")
    drawn = [2, 4, 8] if between == "tensorboard off" else [2, 4, 6, 8]
    assert sorted({step for _, step in shown}) == drawn and len(shown) == len(first) // 2 * len(drawn)
    assert {key: shown[key] for key in first} == first  # as the first launch drew them


def test_telemetry_follows_the_same_rows_across_a_resume(tmp_path, capsys):
    """The telemetry probe is the stream's first rows in every run: 4 steps straight and 2 + 2 resumed
    report the same telemetry at step 4."""
    base = [*[f for f in BASE if f != "--checkpoint.enable=false"], "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--metrics.telemetry_freq=2"]

    def telemetry_at(out, step):
        (record,) = [r for r in metrics(out) if r["step"] == step and any(k.startswith("telemetry/") for k in r)]
        return record

    assert cli.main(["train", *base, "--training.steps=4", f"--job.dump_folder={tmp_path / 'straight'}"]) == 0
    resumed = tmp_path / "resumed"
    assert cli.main(["train", *base, "--training.steps=2", f"--job.dump_folder={resumed}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *base, "--training.steps=4", f"--job.dump_folder={resumed}"]) == 0
    assert_resumed_at(capsys.readouterr().out, resumed, 2)
    assert telemetry_at(resumed, 4) == telemetry_at(tmp_path / "straight", 4)


def test_a_second_run_in_a_folder_in_use_is_refused(tmp_path, capsys):
    """A requeued job started while the first still runs: refused at start-up with the holder named,
    before it moves or prunes anything of the running one; once that run ends the folder is free."""
    out = tmp_path / "run"
    slow = ["--job.plugins=tests.plugins.slow_steps", "--optimizer.name=slow_adamw"]
    argv = [*BASE, "--training.steps=400", *slow, "--checkpoint.enable=true", "--checkpoint.interval=2",
            f"--job.dump_folder={out}"]
    proc = start_training(argv, out)
    try:
        assert cli.main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {proc.pid} on " in err and "choose another --job.dump_folder" in err
        assert proc.poll() is None  # the first run goes on
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc, timeout=120)
    assert proc.returncode == 0
    from nsa_titan.run_folder import RunFolderLock

    RunFolderLock(str(out), pytest.fail).release()  # free again: no error, no warning


def test_sigusr1_writes_stacks_without_stopping(tmp_path):
    out = tmp_path / "run"
    slow = ["--job.plugins=tests.plugins.slow_steps", "--optimizer.name=slow_adamw"]  # still running when polled
    proc = start_training([*BASE, "--training.steps=400", *slow, f"--job.dump_folder={out}"], out)
    try:
        deadline = time.time() + 180
        proc.send_signal(signal.SIGUSR1)
        stacks = out / "stacks" / "rank-0.txt"
        while not (stacks.exists() and "File" in stacks.read_text()):
            assert proc.poll() is None, "SIGUSR1 stopped the run"
            assert time.time() < deadline
            time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc, timeout=120)
    assert proc.returncode == 0


def _wandb_history(path) -> dict[int, dict[str, str]]:
    """The history rows of an offline .wandb file: a 7-byte header, then LevelDB-log records (32 KiB
    blocks; each chunk a 7-byte header of crc, length and kind) holding wandb's protobuf Records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # the padding at a block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.nested_key[0] if item.nested_key else item.key: item.value_json
                       for item in record.history.item}
                rows[int(row["_step"])] = row
    return rows


def test_wandb_offline_logs_the_run_and_a_resume_continues_it(tmp_path):
    """metrics.enable_wandb in offline mode: the W&B run lies in the dump folder with the logged losses; a
    resumed run logs into the same W&B run."""
    out = tmp_path / "run"
    flags = [*BASE, "--metrics.enable_wandb=true", "--metrics.wandb_mode=offline", "--checkpoint.enable=true",
             f"--job.dump_folder={out}"]
    for steps in (2, 3):
        proc = train([*flags, f"--training.steps={steps}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = (out / "wandb_run_id").read_text().strip()
    files = sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # one per process, the same run id
    logged = {step: row for path in files for step, row in _wandb_history(path).items() if "loss" in row}
    expected = {r["step"]: r["loss"] for r in metrics(out) if "loss" in r}
    assert sorted(logged) == [1, 2, 3]
    for step in (1, 2, 3):
        assert float(logged[step]["loss"]) == pytest.approx(expected[step])
    assert json.loads((out / "checkpoint" / "step-3" / "train_state.json").read_text())["wandb_run_id"] == run_id

    # A run from step 0 in the folder (checkpoints off) is another W&B run: W&B drops steps a run already has.
    proc = train([*flags, "--training.steps=2", "--checkpoint.enable=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = (out / "wandb_run_id").read_text().strip()
    assert fresh != run_id and sorted(out.glob(f"wandb/offline-run-*-{fresh}/run-{fresh}.wandb"))
    # The first run resumed later goes on in its own W&B run, which its checkpoint names.
    proc = train([*flags, "--training.steps=4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert len(sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))) == 3

    # A run from step 0 with W&B off, resumed with it on, starts its own W&B run (not the folder's last one).
    other = tmp_path / "other"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("checkpoint", "metrics*", "tb"))
    off = [a for a in flags if "wandb" not in a and "dump_folder" not in a] + [f"--job.dump_folder={other}"]
    assert train([*off, "--training.steps=2"]).returncode == 0
    assert json.loads((other / "checkpoint" / "step-2" / "train_state.json").read_text())["wandb_run_id"] == ""
    proc = train([*off, "--training.steps=3", "--metrics.enable_wandb=true", "--metrics.wandb_mode=offline"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (other / "wandb_run_id").read_text().strip() not in (run_id, fresh, "")


def test_a_wandb_run_that_cannot_start_is_one_clear_error(tmp_path, monkeypatch):
    """Online without an API key (or without network), wandb.init raises its own errors."""
    import wandb

    from components.errors import UserError
    from nsa_titan.observe.metrics_log import WandbLog

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(UserError, match=r"W&B could not start the run \(UsageError: No API key configured. Use "
                                        r"`wandb login` to log in.\). Fix: `wandb login` \(or set WANDB_API_KEY\), "
                                        r"or --metrics.wandb_mode=offline"):
        WandbLog(str(tmp_path), run_id="abc", project="p", name="n", mode="online", config={})
    assert not (tmp_path / "wandb_run_id").exists()


def test_tensorboard_pictures_without_matplotlib_are_one_clear_error(tmp_path, capsys, hide_package):
    hide_package("matplotlib")
    argv = [*BASE, "--training.steps=1", "--metrics.enable_tensorboard=true", "--metrics.telemetry_freq=1",
            f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 2
    assert "pip install -e '.[plots]' in the nsa_titan checkout, or set --metrics.telemetry_freq=0" in \
        capsys.readouterr().err


def test_wandb_missing_is_one_clear_error(tmp_path, hide_package):
    from components.errors import UserError
    from nsa_titan.observe.metrics_log import WandbLog

    hide_package("wandb")
    with pytest.raises(UserError, match="pip install wandb, or set --metrics.enable_wandb=false \\(in place of any "
                                        "--metrics.enable_wandb=true, and without --metrics.wandb_project or "
                                        "--metrics.wandb_mode\\)"):
        WandbLog(str(tmp_path), run_id="abc", project="p", name="n", mode="offline", config={})
    assert not (tmp_path / "wandb_run_id").exists()
    # Why the fix says so: W&B's fields as flags beside it are refused.
    from nsa_titan.config import resolve
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError, match="metrics.wandb_mode = 'offline': is set on the command line but "
                                          "metrics.enable_wandb is false"):
        resolve(["--metrics.enable_wandb=false", "--metrics.wandb_mode=offline"])
