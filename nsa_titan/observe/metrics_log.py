"""Where logged records go: metrics.jsonl (one JSON object per logged step, flushed as written), and
optionally TensorBoard and Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from components.errors import UserError
from nsa_titan.observe.event_files import event_files, started_second
from nsa_titan.run_folder import create_new


METRICS_FILE = "metrics.jsonl"  # in the dump folder


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    return value


class MetricsLog:
    """Appends to `path`. A run that starts at `start_step` (a resume) logs steps start_step + 1 on again:
    records of later steps already in the file (written before a crash, or by a run abandoned for an
    older checkpoint), and a last line a crash cut short, move to
    metrics.after-step-<start_step>-<time>.jsonl beside it, so every step appears once, every line is a
    whole record, and nothing is lost."""

    def __init__(self, path: str, start_step: int = 0, last_logged: dict | None = None):
        """last_logged: the resumed checkpoint's last logged training record ({"step", "loss"}); where the file
        lacks it, its history is looked for among the set-aside files (`history`)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.set_aside = set_aside_records_after(path, start_step)  # where they went, or None
        self.history: History | None = None
        if last_logged is not None and not _holds(path, last_logged):
            self.history = recover_history(path, start_step, last_logged)
        self._fh = open(path, "a", encoding="utf-8")

    def records(self) -> list[dict[str, Any]]:
        """The records in the file now, as written (a NaN is the string "nan")."""
        with open(self.path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if _step_of(line) is not None]

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._fh.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
            self._fh.flush()
        except OSError as exc:  # a full disk: name the file (the flush's error names none)
            raise OSError(exc.errno, exc.strerror, self.path) from None

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError:  # a record whose write already failed (and was reported) cannot be flushed either
            pass


def _step_of(line: str) -> int | None:
    """The record's step; None for a line that is not a whole record (cut short by a crash)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def has_record(path: str, step: int, key: str, prefix: bool = False) -> bool:
    """Whether the JSON-lines file `path` holds a whole record of `step` with `key` (prefix: with a key that begins
    with it) (False without the file)."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if _step_of(line) == step and any(k == key or prefix and k.startswith(key) for k in json.loads(line)):
                return True
    return False


@dataclass
class History:
    """What a resume whose metrics file lacked its own last record found: the set-aside file its records came
    back from and where the file's foreign records went (both None: found nowhere, nothing moved)."""
    restored_from: str | None = None
    foreign: str | None = None


def _read(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return [line if line.endswith("\n") else line + "\n" for line in fh]


def _matches(line: str, record: dict) -> bool:
    try:
        found = json.loads(line)
    except ValueError:
        return False
    # As written: a NaN loss is the string "nan" in the file.
    return (isinstance(found, dict) and found.get("step") == record["step"]
            and found.get("loss") == _plain(record["loss"]))


def _holds(path: str, record: dict) -> bool:
    return os.path.isfile(path) and any(_matches(line, record) for line in _read(path))


def recover_history(path: str, start_step: int, last_logged: dict) -> History:
    """A run that started afresh in this folder without checkpoints set the resumed run's records aside and
    wrote its own: bring back the resumed run's records up to `start_step` from the newest set-aside file that
    holds `last_logged` (a file set aside after step K holds steps after K; those up to K stay), and move the
    file's other records into a set-aside file of their own. Nothing is deleted."""
    stem, ext = os.path.splitext(path)
    pattern = re.compile(re.escape(os.path.basename(stem)) + r"\.after-step-(\d+)-.*" + re.escape(ext) + "$")
    folder = os.path.dirname(os.path.abspath(path))
    candidates = [os.path.join(folder, name) for name in os.listdir(folder) if pattern.match(name)]
    for aside in sorted(candidates, key=os.path.getmtime, reverse=True):
        lines = _read(aside)
        if not any(_matches(line, last_logged) for line in lines):
            continue
        after = int(pattern.match(os.path.basename(aside)).group(1))
        restored = [line for line in lines if _step_of(line) is not None and after < _step_of(line) <= start_step]
        moved = _keep_records_up_to(path, _read(path) if os.path.isfile(path) else [], after, then=restored)
        return History(restored_from=aside, foreign=moved)
    return History()


def _new_empty_file(path: str) -> None:
    with open(path, "x", encoding="utf-8"):
        pass


def set_aside_records_after(path: str, step: int) -> str | None:
    """Move the records of steps after `step`, and any line that is not a whole record (the last one,
    cut short by a crash), out of the JSON-lines file `path` into a new file beside it; returns that
    file's path, or None when every line stays."""
    if not os.path.isfile(path):
        return None
    return _keep_records_up_to(path, _read(path), step)


def _keep_records_up_to(path: str, lines: list[str], step: int, then: list[str] = ()) -> str | None:
    """Rewrite `path` as the whole records of `lines` up to `step`, followed by `then`; the other lines (later
    steps, a line cut short) go into a new metrics.after-step-<step>-<time> file beside it, whose path is
    returned (None when every line stays and nothing is appended)."""
    keep = [_step_of(line) is not None and _step_of(line) <= step for line in lines]
    later = [line for line, k in zip(lines, keep) if not k]
    if not later and not then:
        return None
    aside = None
    if later:
        stem, ext = os.path.splitext(path)
        aside = create_new(f"{stem}.after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}{ext}", _new_empty_file)
        with open(aside, "w", encoding="utf-8") as fh:
            fh.writelines(later)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines([line for line, k in zip(lines, keep) if k] + list(then))
    os.replace(tmp, path)
    return aside


def _after_every_event_file(folder: str) -> None:
    """Wait until the clock's second is past the newest event file's in `folder`. TensorBoard reads a folder's files
    in name order, and names of one second sort by process id and an unpadded counter: a writer started then (a
    resume, a redraw) could be read before an older file, whose events would then hide its own."""
    try:
        seconds = [second for second in map(started_second, event_files(folder)) if second is not None]
    except OSError:  # no folder yet: the writer makes it
        return
    newest = max(seconds, default=-1)
    if newest > time.time() + 1:  # another clock's file, further ahead than a start-up should wait
        return
    while int(time.time()) <= newest:
        time.sleep(max(0.0, newest + 1 - time.time()))


class TensorBoardLog:
    """Scalars and figures in `folder`. A run that starts at `start_step` hides the events of later steps
    already there (TensorBoard's purge_step), so a resumed run's steps are drawn once: its file is named to
    sort after every one there."""

    def __init__(self, folder: str, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        _after_every_event_file(folder)
        self._writer = SummaryWriter(log_dir=folder, purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in _numbers(record).items():
            self._writer.add_scalar(key.replace(".", "/"), value, step)
        self._writer.flush()

    def write_figures(self, step: int, figures: dict[str, Any]) -> None:
        """matplotlib figures as images (closed once written)."""
        for tag, figure in figures.items():
            self._writer.add_figure(tag, figure, step, close=True)
        self._writer.flush()

    def write_pictures(self, pictures) -> None:
        """Pictures an earlier writer drew, as (step, wall time, summary value), written again as they were."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self._writer._get_file_writer()  # the SummaryWriter's own file (add_image would encode anew)
        for step, wall_time, value in pictures:
            writer.add_summary(Summary(value=[value]), step, wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


# W&B's own fields given as flags are refused once W&B is off (they would do nothing): a fix turning it off says so.
_WITHOUT_WANDB_FLAGS = (" (in place of any --metrics.enable_wandb=true, and without --metrics.wandb_project or "
                        "--metrics.wandb_mode)")


class WandbLog:
    """A W&B run in dump_folder/wandb, with the id `run_id` (the trainer's choice: a resumed run's own, recorded
    in its checkpoint, or a new one for a run from step 0); the id is also written to dump_folder/wandb_run_id."""

    def __init__(self, dump_folder: str, *, run_id: str, project: str, name: str, mode: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("metrics.enable_wandb needs the wandb package. Fix: pip install wandb, or set "
                            f"--metrics.enable_wandb=false{_WITHOUT_WANDB_FLAGS}.") from None
        try:
            self._run = wandb.init(project=project, name=name, id=run_id, resume="allow", mode=mode,
                                   dir=dump_folder, config=config)
        except wandb.Error as exc:  # no API key, no network, a refused project: wandb says which
            raise UserError(f"W&B could not start the run ({type(exc).__name__}: {str(exc).strip().splitlines()[0]}). "
                            f"Fix: `wandb login` (or set WANDB_API_KEY), or --metrics.wandb_mode=offline to log in "
                            f"the dump folder and `wandb sync` it later, or --metrics.enable_wandb=false"
                            f"{_WITHOUT_WANDB_FLAGS}.") from None
        with open(os.path.join(dump_folder, "wandb_run_id"), "w", encoding="utf-8") as fh:
            fh.write(run_id + "\n")

    @staticmethod
    def folder_run_id(dump_folder: str) -> str | None:
        """The id the folder's last W&B run wrote (what a checkpoint saved before checkpoints kept it resumes)."""
        try:
            with open(os.path.join(dump_folder, "wandb_run_id"), encoding="utf-8") as fh:
                return fh.read().strip() or None
        except OSError:
            return None

    @staticmethod
    def new_run_id() -> str:
        return uuid.uuid4().hex[:12]

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(_numbers(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()
