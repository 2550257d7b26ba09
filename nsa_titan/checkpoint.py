"""Distributed checkpoints: save everything a run needs to continue, and find the newest complete one.

A checkpoint is the folder {dump_folder}/{checkpoint.folder}/step-N holding
- model/: DCP shards of the model and optimizer (they reshard to any world size or layout on load);
- train_state.json: step, tokens seen, LR schedule, the world size and degrees that wrote it;
- ranks/rank-R.pt: rank R's dataloader state and RNG states;
- COMPLETE: written last and atomically, once every other file is on disk, with each file's size and
  CRC-32 (checked before a load reads them). Only folders with it count.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from components.data import DataStreamMismatch, worker_died
from components.errors import UserError, read_from
from nsa_titan.checkpoint_checks import (changed_files, file_checksum, shape_mismatches, tensor_shapes,
                                         truncated_shards)
from nsa_titan.config.toml_io import tomllib
from nsa_titan.parallel.distributed import new_group_for_background_work
from nsa_titan.run_folder import create_new
from nsa_titan.run_recipe import recipe_above
from nsa_titan.step_folders import STEP_DIR, TRAIN_STATE, step_name, step_path, train_state_file

COMPLETE = "COMPLETE"
# What a save writes into a step folder: a leftover with anything else is not removed as a partial save.
STEP_ENTRIES = {"ranks", "model", TRAIN_STATE, COMPLETE}
# The files a save writes in a step's subfolders (DCP's shards and metadata, each rank's state), temporaries too.
SAVE_SUBFOLDERS = {"model": re.compile(r"^(\.metadata|__\d+_\d+\.distcp)(\.tmp\w*)?$"),
                   "ranks": re.compile(r"^rank-\d+\.pt(\.tmp\d+)?$")}
SAVE_FILES = STEP_ENTRIES - set(SAVE_SUBFOLDERS)  # a file named 'model' or 'ranks' is none of the save's
PARTIAL_WRITE = re.compile(rf"^({re.escape(TRAIN_STATE)}|{COMPLETE})\.tmp\d+$")  # _write_atomically's, cut short


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class RunState:
    """What the trainer hands over to be saved, and gets back restored."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    dataloader: Any  # a StatefulDataLoader
    step: int = 0
    tokens_seen: int = 0
    extra: dict = field(default_factory=dict)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_DIR.match(name)
        if match and _marker_exists(os.path.join(folder, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def saved_data_layout(folder: str, load_step: int = -1, branches: list[dict] = ()) -> tuple[int, dict] | None:
    """(step, data layout) of the checkpoint a resume from `folder` reads (as the resume finds it: load_step, the
    newest complete step, or the newest of a run from load_step the same command made, by `branches`): the layout
    it was saved with ({"world_size": its data-parallel size, "num_workers", "logical_shards"}), for a message on a
    layout that cannot continue it. None without one, or where it cannot be read (the resume itself names that)."""
    reader = Checkpointer(folder, keep_latest_k=0, async_mode="disabled", rank=0, world_size=1, say=lambda _: None)
    try:
        step = reader.find_resume_step(load_step, branches, quiet=True)
        layout = None if step is None else reader._read_train_state(step).get("data_layout")
    except UserError:
        return None
    wanted = ("world_size", "logical_shards")
    return (step, layout) if isinstance(layout, dict) and all(isinstance(layout.get(k), int) for k in wanted) else None


def _marker_exists(step_dir: str) -> bool:
    """Whether the folder holds a COMPLETE marker. One that cannot be looked at (no permission) is an
    error, not a missing marker: that would silently resume an older step, or start afresh."""
    try:
        return stat.S_ISREG(os.stat(os.path.join(step_dir, COMPLETE)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise UserError(f"cannot look into the checkpoint folder {step_dir} ({exc.strerror}). Fix: give this user "
                        f"read and search permission on it (chmod u+rx), or move it out of the checkpoint "
                        f"folder.") from None


def incomplete_steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    done = set(complete_steps(folder))
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(folder)) if m and int(m.group(1)) not in done)


def _weights_model_dir(path: str) -> str:
    """The model folder of checkpoint.initial_load_path, given as step-N or as step-N/model."""
    return os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path


def weights_step_dir(path: str) -> str:
    """The step folder of checkpoint.initial_load_path (given as step-N or step-N/model), links resolved."""
    return os.path.dirname(os.path.realpath(_weights_model_dir(path)))


# Fields that do not change what a branch computes: where it runs, how long, what it logs, checks and saves, and how
# its steps are executed. A requeue of the branch's command with them changed (a longer run, the folder given by
# another path, compile or activation checkpointing switched on another machine) goes on with it. Earlier releases
# left out only the first six: the branches they recorded are continued too.
_EARLIER_BRANCH_FREE_FIELDS = (("job", "dump_folder"), ("job", "name"), ("training", "steps"), ("metrics", None),
                               ("profiling", None), ("checkpoint", None))
_BRANCH_FREE_FIELDS = _EARLIER_BRANCH_FREE_FIELDS + (
    ("validation", None), ("compile", None), ("activation_checkpoint", None), ("training", "gc_freq"),
    ("data", "prefetch_factor"), ("data", "pin_memory"), ("fault", "step_timeout_seconds"),
    ("fault", "first_step_timeout_seconds"), ("parallelism", "init_timeout_seconds"),
    ("parallelism", "fsdp_reshard_after_forward"), ("parallelism", "fsdp_single_process"))
# The layout, free as well where training.global_batch_size fixes the batch (a requeue on another number of
# processes); with -1 the local batch and the data-parallel degrees set the global batch, so they stay.
_LAYOUT_FIELDS = (("parallelism", None), ("training", "local_batch_size"))


def _recipe_digest(toml: str, free: tuple) -> str:
    table = tomllib.loads(toml)
    for section, key in free:
        if key is None:
            table.pop(section, None)
        else:
            table.get(section, {}).pop(key, None)
    return hashlib.sha256(json.dumps(table, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_branches(resolved) -> list[dict]:
    """The branch a run from checkpoint.load_step records (the step and its recipe's hash, less the fields that
    change nothing it computes), then those earlier releases recorded for the same command (by fewer free fields,
    and by the whole recipe's hash), which a requeue also continues; [] for a run that does not branch."""
    return recipe_branches(resolved.recipe, resolved.toml, resolved.hash)


def recipe_branches(recipe, toml: str, recipe_hash: str) -> list[dict]:
    """run_branches of a recipe, its TOML and hash (config.render.recipe_text), before it is resolved."""
    load_step = recipe.checkpoint.load_step
    if load_step < 0:
        return []
    free = _BRANCH_FREE_FIELDS + (_LAYOUT_FIELDS if recipe.training.global_batch_size != -1 else ())
    digests = [_recipe_digest(toml, free), _recipe_digest(toml, _EARLIER_BRANCH_FREE_FIELDS), recipe_hash]
    return [{"from_step": load_step, "recipe": digest} for digest in dict.fromkeys(digests)]


def initial_weights_mismatch(path: str, found: list[str]) -> UserError:
    """checkpoint.initial_load_path's weights of another shape than this model's (shape_mismatches' `found`)."""
    recipe = recipe_above(weights_step_dir(path))
    return UserError(f"checkpoint.initial_load_path = {path!r} does not fit this model: {_first(found)}. Fix: set the "
                     f"model fields and data.tokenizer (which sizes the vocabulary) to those of the run that wrote it "
                     f"({recipe or 'its recipe.toml, in its run folder'}), or start from a checkpoint of this model.")


def check_weights_path(path: str) -> None:
    """Refuse a checkpoint.initial_load_path that names no checkpoint step (before its model fields are compared:
    a path that is no step has none recorded)."""
    takes = ("Fix: point it at a step-N folder of an earlier run (its checkpoint/step-N), or at a folder "
             "written by `nsa-titan export --format hf`")
    if not os.path.exists(path):
        raise UserError(f"checkpoint.initial_load_path = {path!r} does not exist{read_from(path)}, so it holds no "
                        f"checkpoint. {takes}.")
    if os.path.isfile(path):
        raise UserError(f"checkpoint.initial_load_path = {path!r} is a file; it takes a folder (an exported .pt "
                        f"file is for sample, eval and plot). {takes}.")
    steps = complete_steps(os.path.join(path, "checkpoint")) or complete_steps(path)
    if steps:  # a run folder, or its checkpoint folder
        newest = step_path(os.path.join(path, *([] if complete_steps(path) else ["checkpoint"])), steps[-1])
        raise UserError(f"checkpoint.initial_load_path = {path!r} holds the checkpoints of a run, not one of them. "
                        f"Fix: name the step to start from, e.g. {newest!r}.")
    if not os.path.isfile(os.path.join(_weights_model_dir(path), ".metadata")):
        raise UserError(f"checkpoint.initial_load_path = {path!r} holds no checkpoint (no .metadata found). {takes}.")


def check_weights_files(path: str) -> None:
    """Refuse checkpoint.initial_load_path's step folder when a save of this package wrote it but it is not as
    saved: no COMPLETE marker (an interrupted save, as on resume), or a model file that differs from its record."""
    model_dir, step_dir = _weights_model_dir(path), weights_step_dir(path)
    if model_dir != path or os.path.isfile(train_state_file(step_dir)):
        step = STEP_DIR.match(os.path.basename(step_dir))
        found = _step_folder_finding(step_dir, int(step.group(1)) if step else None, "model")
        if found:
            raise _unreadable_weights(path, *found)


def _unreadable_weights(path: str, file: str, why: str) -> UserError:
    """checkpoint.initial_load_path's `file` that cannot be read as saved, with the run's other steps to use."""
    folder, name = os.path.split(weights_step_dir(path))
    others = [step_name(s) for s in complete_steps(folder) if step_name(s) != name]
    where = f"another complete one of that run ({', '.join(others)})" if others else "a complete step-N folder"
    return UserError(f"checkpoint.initial_load_path = {path!r} cannot be read: {file} {why}. Fix: point it at "
                     f"{where}, or restore the file.")


def data_mismatch_message(mismatch: DataStreamMismatch, path: str) -> str:
    """A resume refused because the checkpoint's data stream is not the recipe's, with both ways on."""
    return (f"{mismatch} (--checkpoint.data_mismatch=restart, resuming the model, optimizer and step), or take this "
            f"checkpoint's weights only into a new --job.dump_folder with --checkpoint.initial_load_path={path}")


class Checkpointer:
    def __init__(self, folder: str, *, keep_latest_k: int, async_mode: str, rank: int, world_size: int,
                 say: Callable[[str], None], context_parallel: int = 1):
        self.folder = folder
        # The ranks of one context-parallel group share a data rank: rank r reads data rank r // cp's
        # stream, and every checkpoint keeps that stream in each of their rank files.
        self.context_parallel = context_parallel
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.rank = rank
        self.world_size = world_size
        self.say = say
        self._pending: tuple[int, Future] | None = None  # (step, its files' checksums once written)
        self._checksummer = ThreadPoolExecutor(max_workers=1) if async_mode == "async" else None
        self._async_group = None
        if async_mode == "async" and dist.is_initialized():
            # Background saves must not share a communicator with training's collectives.
            self._async_group = new_group_for_background_work("gloo")

    # -- paths -----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return step_path(self.folder, step)

    # -- saving ----------------------------------------------------------------------------------
    def save(self, state: RunState, *, data_layout: dict, wait: bool = False, good: bool = True) -> None:
        """Save the run at state.step; with async_mode the model/optimizer write overlaps training. good=False:
        the step ends a run of skipped (NaN/Inf) steps; retention keeps the newest good checkpoint beside it."""
        self.finish_pending()  # one save in flight at a time; also completes the previous one
        path = self.step_dir(state.step)
        if self.rank == 0 and os.path.lexists(path):
            self._clear_leftover(path)
        _barrier()
        stepped = _has_stepped(state.optimizer)
        with self._writing(state.step):
            os.makedirs(os.path.join(path, "ranks"), exist_ok=True)
            self._save_rank_state(state, path)
            if self.rank == 0:
                self._save_train_state(state, path, data_layout, stepped, good)
        tensors = {"model": get_model_state_dict(state.model),
                   "optimizer": get_optimizer_state_dict(state.model, state.optimizer)}
        if not stepped:
            # torch makes an unstepped optimizer's state by stepping it at lr 0, which leaves AdamW's step
            # count at 1 (its bias correction would then shrink the first real update): put it back
            state.optimizer.state.clear()
        checkpoint_id = os.path.join(path, "model")
        no_dist = not dist.is_initialized()
        with self._writing(state.step):
            if self.async_mode == "async" and not wait:
                future = dcp.async_save(tensors, checkpoint_id=checkpoint_id, process_group=self._async_group,
                                        no_dist=no_dist)
                future = getattr(future, "upload_completion", future)
                # The checksums read the files back: in the background too, once DCP has written them.
                self._pending = (state.step, self._checksummer.submit(self._checksums_when_written, future,
                                                                      state.step))
            else:
                dcp.save(tensors, checkpoint_id=checkpoint_id, no_dist=no_dist)
                # Every rank's files are on disk before the checkpoint is declared complete.
                self._mark_complete(state.step, _gather(self._own_checksums(state.step)))

    @contextlib.contextmanager
    def _writing(self, step: int):
        """A save that cannot be written (a full disk, a quota, an I/O error) ends the run with one message:
        the partial folder is removed, the last complete checkpoint is kept and named."""
        try:
            yield
        except (torch.OutOfMemoryError, dist.DistError):
            raise  # not a write that failed: their own handlers say what happened
        except (OSError, RuntimeError, CheckpointException) as exc:  # torch's zip writer raises RuntimeError
            path = self.step_dir(step)
            if os.path.exists(os.path.join(path, COMPLETE)):
                raise  # written and marked complete: a later error (pruning, say) must not cost the checkpoint
            full = _nearly_full(self.folder)  # looked at before the partial save is removed (and frees space)
            if self.rank == 0:
                _remove_step(path)
            cause = exc
            if isinstance(exc, CheckpointException):  # this rank's own failure first, else a peer's
                cause = exc.failures.get(self.rank, next(iter(exc.failures.values()), (exc,)))[0]
            if not isinstance(cause, Exception):  # a second Ctrl-C that DCP's writer caught: a stop, not a write
                raise cause.with_traceback(None) from None
            if worker_died(cause):  # a loader worker's death, raised wherever this process was: not a write
                raise cause
            if isinstance(cause, OSError) and cause.strerror:
                why = cause.strerror
            elif full:  # torch's zip writer says a full disk in its own terms ('unexpected pos 704 vs 598')
                why = "the file system is full"
            else:
                why = " ".join(str(cause).split())[:200] or type(cause).__name__
            try:
                free = f"; {shutil.disk_usage(self.folder).free / 2**30:.1f} GiB free there"
            except OSError:
                free = ""
            done = [s for s in complete_steps(self.folder) if s != step]
            kept = (f"the last complete checkpoint (step {done[-1]}) is kept" if done else
                    "no checkpoint is complete yet")
            errno_of = getattr(cause, "errno", None)
            # checkpoint.folder lies inside job.dump_folder (on its file system), and another folder of either
            # holds no checkpoint to resume: the way on is the same folder, mended.
            remedy = ("make that folder writable by this user" if errno_of in (errno.EACCES, errno.EPERM, errno.EROFS)
                      else "free space on that file system")
            raise UserError(f"cannot save the checkpoint of step {step} in {path} ({why}{free}). The partial save "
                            f"is removed and {kept}. Fix: {remedy}, then run the same command again to resume (another "
                            f"--job.dump_folder would start the run afresh).") from None

    def _clear_leftover(self, path: str) -> None:
        """What is already at this step's path: a partial save (a crash at this very step) is removed;
        anything else (a file, a folder with other contents) is not this package's to delete, and is
        moved into abandoned-<time>/."""
        if _holds_only_a_save(path):
            _remove_step(path)
            return
        aside = self._new_aside_folder()
        os.replace(path, os.path.join(aside, os.path.basename(path)))
        self.say(f"{path} is not a partial save of this run: moved it to {aside} to save step "
                 f"{os.path.basename(path)[5:]} there")

    def _new_aside_folder(self) -> str:
        """A fresh abandoned-<time>/ folder for what is set aside, never deleted."""
        return create_new(os.path.join(self.folder, f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"), os.makedirs)

    def save_in_flight(self) -> bool:
        """Whether this rank's background save is still writing (False when none is pending)."""
        return self._pending is not None and not self._pending[1].done()

    def complete_if_written(self, still_writing_anywhere: bool) -> None:
        """Complete a pending background save once no rank is still writing it.

        Every rank must take the same decision at the same step (completion waits at a barrier), so
        the caller passes the all-ranks answer of save_in_flight(), agreed by a collective.
        """
        if self._pending is not None and not still_writing_anywhere:
            self.finish_pending()

    def finish_pending(self) -> None:
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        death = None
        with self._writing(step):
            try:
                checksums = future.result()
            except RuntimeError as exc:
                if not worker_died(exc):
                    raise
                # A loader worker's death heard while waiting: the save itself writes on. It completes (a checkpoint
                # the rerun resumes from) before the death ends the run.
                death, checksums = exc, future.result()
            self._mark_complete(step, _gather(checksums, self._async_group))
        if death is not None:
            raise death

    def _save_rank_state(self, state: RunState, path: str) -> None:
        payload = {"dataloader": state.dataloader.state_dict(), "rng": _rng_state(), "rank": self.rank,
                   "world_size": self.world_size}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        _write_atomically(os.path.join(path, "ranks", f"rank-{self.rank}.pt"), buffer.getvalue())

    def _save_train_state(self, state: RunState, path: str, data_layout: dict, optimizer_stepped: bool,
                          good: bool = True) -> None:
        record = {"step": state.step, "tokens_seen": state.tokens_seen, "world_size": self.world_size,
                  "context_parallel_degree": self.context_parallel, "data_layout": data_layout,
                  "lr_scheduler": state.lr_scheduler.state_dict(), "optimizer_stepped": optimizer_stepped,
                  "good": good, "saved_at": time.time(), **state.extra}
        _write_atomically(train_state_file(path), json.dumps(record, indent=1).encode())

    def _checksums_when_written(self, written: Future, step: int) -> dict[str, list[int]]:
        written.result()
        return self._own_checksums(step)

    def _own_checksums(self, step: int) -> dict[str, list[int]]:
        """Size and CRC-32 of the files this rank wrote for `step` (read back while the page cache holds
        them), so a later load finds a file damaged in place instead of training from it."""
        path = self.step_dir(step)
        own = [os.path.join("ranks", f"rank-{self.rank}.pt")]
        own += [os.path.join("model", name) for name in sorted(os.listdir(os.path.join(path, "model")))
                if name.startswith(f"__{self.rank}_") and name.endswith(".distcp")]
        if self.rank == 0:
            own += [TRAIN_STATE, os.path.join("model", ".metadata")]
        return {name: file_checksum(os.path.join(path, name)) for name in own}

    def _mark_complete(self, step: int, checksums: list[dict[str, list[int]]]) -> None:
        if self.rank == 0:
            path = self.step_dir(step)
            files = {name: value for rank_sums in checksums for name, value in rank_sums.items()}
            _write_atomically(os.path.join(path, COMPLETE),
                              json.dumps({"step": step, "time": time.time(), "files": files}).encode())
            _fsync_dir(path)
            self.say(f"checkpoint saved: {path}")
            self._retain()

    def _retain(self) -> None:
        if self.keep_latest_k <= 0:
            return
        done = complete_steps(self.folder)
        drop = done[: -self.keep_latest_k]
        if drop and not any(self._is_good(step) for step in done[-self.keep_latest_k:]):
            # Every kept step ends a run of skipped steps: the newest good one stays too, for a run that stops
            # on them (its data and schedule stand before the bad batches).
            good = next((step for step in reversed(drop) if self._is_good(step)), None)
            if good is not None:
                drop.remove(good)
                if good == done[-self.keep_latest_k - 1]:  # said once, as it leaves the newest k
                    self.say(f"keeping {self.step_dir(good)} beside the newest {self.keep_latest_k} "
                             f"(checkpoint.keep_latest_k): the steps saved since ended runs of steps skipped as "
                             f"NaN/Inf, and it is the newest checkpoint of a good step")
        for step in drop:
            _remove_step(self.step_dir(step), self._new_aside_folder, self.say)
        newest = done[-1] if done else None
        cut_short = []  # older saves without their marker (a kill in a save, or in an earlier pruning): dead
        for step in incomplete_steps(self.folder):
            if newest is not None and step < newest:
                if _holds_only_a_save(self.step_dir(step)):  # else _remove_step says what it keeps
                    cut_short.append(step)
                _remove_step(self.step_dir(step), self._new_aside_folder, self.say)
        if cut_short:
            self.say(f"removed the saves of steps {cut_short}, which were cut short before they completed")

    def _is_good(self, step: int) -> bool:
        """Whether `step` was saved after a good step (checkpoints that predate the record count as good; one
        whose train state cannot be read does not)."""
        try:
            return self._read_train_state(step).get("good", True)
        except UserError:
            return False

    def newest_good_step(self) -> int | None:
        """The newest complete checkpoint saved after a good step (not at the end of a run of skipped ones)."""
        return next((step for step in reversed(complete_steps(self.folder)) if self._is_good(step)), None)

    # -- loading ---------------------------------------------------------------------------------
    def agree_resume_step(self, load_step: int, branches: list[dict] = ()) -> int | None:
        """find_resume_step on rank 0, broadcast: every rank loads the same step (or none)."""
        choice = [self.find_resume_step(load_step, branches) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _branch_of(self, step: int) -> dict | None:
        """The branch recorded in a step's train_state.json (None when absent or unreadable: a damaged
        step is then not taken for the branch's progress, and its own checks name the damage later)."""
        try:
            return self._read_train_state(step).get("branch")
        except UserError:
            return None

    def abandon_after(self, step: int) -> None:
        """Resuming from an older step starts a new branch of the run: the newer checkpoints move into
        abandoned-<time>/ (kept, never deleted), so no later resume returns to them. A newer save that was
        cut short (no COMPLETE marker, nothing in it but what a save writes) is removed instead: it holds
        nothing to go back to, and a run preempted in its saves would pile them up."""
        if self.rank == 0:
            partial = set(incomplete_steps(self.folder))
            newer = sorted(s for s in partial.union(complete_steps(self.folder)) if s > step)
            cut_short = [s for s in newer if s in partial and _holds_only_a_save(self.step_dir(s))
                         and not _marker_being_written(self.step_dir(s))]
            for later in cut_short:
                _remove_step(self.step_dir(later))
            kept = [s for s in newer if s not in cut_short]
            if kept:
                aside = self._new_aside_folder()
                for later in kept:
                    os.replace(self.step_dir(later), step_path(aside, later))
                self.say(f"resuming from step {step}: moved the newer checkpoints {kept} to {aside}")
            if cut_short:
                self.say(f"removed the saves of steps {cut_short}, which were cut short before they completed")
        _barrier()

    def find_resume_step(self, load_step: int, branches: list[dict] = (), quiet: bool = False) -> int | None:
        """The step to resume from: load_step when given (it must exist), else the newest complete one.

        A run started from load_step records its branch (run_branches) in its checkpoints. When the newest
        complete checkpoint carries one of `branches` (the same command run again: a requeued job), the
        branch's own progress is resumed rather than set aside for load_step once more. quiet: say nothing (a
        question about what a resume would pick, not a resume)."""
        say = (lambda _: None) if quiet else self.say
        done = complete_steps(self.folder)
        partial = incomplete_steps(self.folder)
        if load_step >= 0:
            # Before load_step's own existence: retention (keep_latest_k) may have pruned it since.
            if branches and done and done[-1] > load_step and self._branch_of(done[-1]) in branches:
                say(f"checkpoint.load_step = {load_step}: this command's run from step {load_step} already "
                    f"reached step {done[-1]}; resuming there")
                return done[-1]
            if load_step not in done:
                why = ("is incomplete (no COMPLETE marker: the save was interrupted)" if load_step in partial
                       else "does not exist")
                fix = (f"choose one of the complete steps ({', '.join(map(str, done))}), or -1 for the newest" if done
                       else "the folder holds no complete checkpoint: set -1 to start the run afresh")
                raise UserError(f"checkpoint.load_step = {load_step}: {self.step_dir(load_step)} {why}. Fix: {fix}.")
            return load_step
        newer_partial = [s for s in partial if not done or s > done[-1]]
        for step in newer_partial:
            say(f"skipping incomplete checkpoint {self.step_dir(step)} (interrupted save)")
        return done[-1] if done else None

    def load(self, state: RunState, step: int, *, data_layout: dict,
             reshard_data: Callable[[list[dict]], Any] | None,
             restart_data: Callable[[], Any] | None = None) -> dict:
        """Restore everything saved at `step` into `state`.

        The data continues exactly when the data layout (world size, workers) is unchanged; otherwise
        `reshard_data(old rank states)` must return a loader that continues every old rank's stream.
        When the saved data is another stream (the recipe's data changed), `restart_data()` gives the
        loader that starts the new one; without it, that is an error.
        """
        path = self.step_dir(step)
        self._check_marker(step)
        record = self._read_train_state(step)
        tensors = {"model": get_model_state_dict(state.model),
                   "optimizer": get_optimizer_state_dict(state.model, state.optimizer)}
        _read_tensors(os.path.join(path, "model"), tensors, mismatch=lambda found: self._mismatch(step, found),
                      unreadable=lambda file, why: self._unreadable(step, file, why))
        set_model_state_dict(state.model, tensors["model"])
        set_optimizer_state_dict(state.model, state.optimizer, tensors["optimizer"])
        if not record.get("optimizer_stepped", True):  # saved before any update (all skipped): none here either
            state.optimizer.state.clear()
        state.lr_scheduler.load_state_dict(record["lr_scheduler"])
        old_world = int(record["world_size"])
        same_layout = record.get("data_layout") == data_layout
        if not same_layout and reshard_data is None:
            raise UserError(f"checkpoint {path} was written with data layout {record.get('data_layout')} "
                            f"and this run has {data_layout}; the data cannot continue exactly. Fix: resume "
                            f"with the original world size and data.num_workers.")
        saved = self.saved_data_states(step, record, [self.rank // self.context_parallel] if same_layout else None)
        try:
            if same_layout:
                state.dataloader.load_state_dict(saved[0])
            else:
                state.dataloader = reshard_data(saved)
        except DataStreamMismatch as exc:  # the loader says what differs; the engine knows the ways on
            if restart_data is None:
                raise UserError(data_mismatch_message(exc, path)) from None
            state.dataloader = restart_data()
        if self.rank < old_world:
            _set_rng_state(self._read_rank_file(step, self.rank)["rng"])
        state.step = record["step"]
        state.tokens_seen = record["tokens_seen"]
        return record

    def saved_data_states(self, step: int, record: dict, data_ranks: list[int] | None = None) -> list[dict]:
        """The loader states `step` saved: one per data-parallel rank of the run that wrote it, or those of the
        given data-parallel ranks (a context-parallel group's first rank holds its group's)."""
        old_cp = int(record.get("context_parallel_degree", 1))  # data rank d was saved by rank d * old_cp
        if data_ranks is None:
            data_ranks = list(range(int(record["world_size"]) // old_cp))
        return [self._read_rank_file(step, d * old_cp)["dataloader"] for d in data_ranks]

    def check_step(self, step: int) -> dict:
        """What a resume of `step` reads before its tensors: the COMPLETE marker and the files it records (their
        checksums), train_state.json and every rank file. Returns the train state; UserError names the damage."""
        self._check_marker(step)
        record = self._read_train_state(step)
        for rank in range(int(record["world_size"])):
            self._read_rank_file(step, rank)
        return record

    def _check_marker(self, step: int, resuming: bool = True, under: str = "") -> None:
        """The step's COMPLETE marker, then the files it records (those `under` a subfolder, if given)."""
        found = _step_folder_finding(self.step_dir(step), step, under)
        if found:
            raise self._unreadable(step, *found, resuming)

    def _read_train_state(self, step: int) -> dict:
        file = train_state_file(self.step_dir(step))
        try:
            with open(file, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError) as exc:
            raise self._unreadable(step, file, _reason(exc)) from None
        # A hand-edited file: wrong types fail deep in the resume, another step resumes the wrong count.
        problem = _not_ours(record, {"step": int, "tokens_seen": int, "world_size": int, "lr_scheduler": dict})
        if problem is None and "nan_guard" in record:  # written by runs that keep the NaN guard's counts
            found = _not_ours(record["nan_guard"], {"consecutive_bad": int, "total_bad": int})
            problem = found and f"its nan_guard entry is {found}"
        if problem is None and not isinstance(record.get("optimizer_stepped", True), bool):
            problem = f"its optimizer_stepped is {record['optimizer_stepped']!r}, not true or false"
        if problem is None and not isinstance(record.get("good", True), bool):
            problem = f"its good is {record['good']!r}, not true or false"
        if problem is None and "held_out_set" in record:  # written by runs that keep the held-out set's size
            found = _not_ours(record["held_out_set"], {"rows": int, "seq_len": int})
            problem = found and f"its held_out_set entry is {found}"
        if problem is None and not isinstance(record.get("wandb_run_id", ""), str):
            problem = f"its wandb_run_id is {record['wandb_run_id']!r}, not text"
        if problem is None and not isinstance(record.get("tensorboard_folder", ""), str):
            problem = f"its tensorboard_folder is {record['tensorboard_folder']!r}, not text"
        applied = record.get("applied_lr", 0.0)
        if problem is None and applied is not None and (isinstance(applied, bool) or
                                                        not isinstance(applied, (int, float))):
            problem = f"its applied_lr is {applied!r}, not a number"
        if problem is None and record["step"] != step:
            problem = f"its step is {record['step']}, not the folder's {step}"
        if problem:
            raise self._unreadable(step, file, f"does not hold what a checkpoint writes ({problem})")
        return record

    def _read_rank_file(self, step: int, rank: int) -> dict:
        file = os.path.join(self.step_dir(step), "ranks", f"rank-{rank}.pt")
        try:
            payload = torch.load(file, map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            raise self._unreadable(step, file, _reason(exc)) from None
        problem = _not_ours(payload, {"dataloader": dict, "rng": dict})
        if problem:
            raise self._unreadable(step, file, f"does not hold what a checkpoint writes ({problem})")
        return payload

    def _unreadable(self, step: int, file: str, why: str, resuming: bool = True) -> UserError:
        """A damaged checkpoint: name the file, and the older complete steps one can use instead
        (resuming: train's resume; else export or eval, which move nothing)."""
        older = [s for s in complete_steps(self.folder) if s < step]
        if older and resuming:
            fix = (f"resume from an older complete step ({', '.join(map(str, older))}) with "
                   f"--checkpoint.load_step=N (newer checkpoints are moved aside, not deleted), or restore the file")
        elif older:
            fix = (f"use an older complete step ({', '.join(map(str, older))}) with --checkpoint.load_step=N, or "
                   f"restore the file")
        elif resuming:
            fix = ("restore the file, or start afresh with another --job.dump_folder (no older complete step "
                   "exists to resume from)")
        else:
            fix = "restore the file (no older complete step exists)"
        return UserError(f"checkpoint step {step} cannot be read: {file} {why}. Fix: {fix}.")

    def _mismatch(self, step: int, mismatches: list[str], resuming: bool = True) -> UserError:
        """A checkpoint of another model or optimizer: name the first differences and the ways on."""
        run_folder = os.path.dirname(os.path.abspath(self.folder))
        model_fits = not any(m.startswith("model.") for m in mismatches)
        weights = (f" To keep its weights with a new optimizer, start in another --job.dump_folder with "
                   f"--checkpoint.initial_load_path={self.step_dir(step)}." if model_fits else "")
        recipe = (f"the recipe that wrote it (kept in {run_folder} as recipe.toml, or recipe.<hash>.toml when a "
                  f"later run changed it)")
        fix = (f"resume with {recipe}, or start afresh with another --job.dump_folder.{weights}" if resuming
               else f"use {recipe}.")
        return UserError(f"checkpoint {self.step_dir(step)} does not fit this run's "
                         f"{'optimizer' if model_fits else 'model'}: {_first(mismatches)}. Fix: {fix}")

    def load_weights_only(self, model: nn.Module, path: str) -> None:
        """checkpoint.initial_load_path: the model weights of a checkpoint folder, nothing else."""
        check_weights_path(path)
        check_weights_files(path)
        state = {"model": get_model_state_dict(model)}
        _read_tensors(_weights_model_dir(path), state, unreadable=lambda *found: _unreadable_weights(path, *found),
                      mismatch=lambda found: initial_weights_mismatch(path, found))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def read_model_weights(folder: str, step: int, state: dict) -> None:
    """export and eval, on one process: the model tensors of the complete checkpoint `step` in `folder` into
    state ({"model": model.state_dict()}), with the checks and messages of a resume."""
    reader = Checkpointer(folder, keep_latest_k=0, async_mode="disabled", rank=0, world_size=1, say=print)
    reader._check_marker(step, resuming=False, under="model")
    _read_tensors(os.path.join(reader.step_dir(step), "model"), state,
                  unreadable=lambda file, why: reader._unreadable(step, file, why, resuming=False),
                  mismatch=lambda found: reader._mismatch(step, found, resuming=False), no_dist=True)


def _read_tensors(model_dir: str, tensors: dict, *, unreadable: Callable[[str, str], UserError],
                  mismatch: Callable[[list[str]], UserError], no_dist: bool | None = None) -> None:
    """dcp.load into `tensors`, after the checks that turn a damaged checkpoint (unreadable(file, why)) or
    one of another shape (mismatch(differences)) into a message instead of torch's traceback."""
    try:
        metadata = dcp.FileSystemReader(model_dir).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to read it means the same to the user
        raise unreadable(os.path.join(model_dir, ".metadata"), _reason(exc)) from None
    truncated = truncated_shards(model_dir, metadata)
    if truncated:
        raise unreadable(*truncated[0])
    mismatches = shape_mismatches(tensor_shapes(tensors), metadata)
    if mismatches:
        raise mismatch(mismatches)
    try:
        no_dist = not dist.is_initialized() if no_dist is None else no_dist
        dcp.load(tensors, checkpoint_id=model_dir, no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise unreadable(model_dir, _reason(exc)) from None


def _step_folder_finding(step_dir: str, step: int | None, under: str = "") -> tuple[str, str] | None:
    """(file, what is wrong with it) for a step folder's COMPLETE marker, else for the first file that differs
    from the checksums the marker records (those `under` a subfolder, if given); None when all is as saved."""
    marker, problem = _read_marker(step_dir, step)
    # Every rank hears what any rank found (one rank's storage may differ), so all stop, or all go on to the
    # checksums' collective together: a rank that stopped alone would leave the others waiting there.
    found = next((f[0] for f in _gather([(os.path.join(step_dir, COMPLETE), problem)] if problem else []) if f), None)
    if found:
        return tuple(found)
    return _first_changed_file(step_dir, marker.get("files", {}), under)


def _read_marker(step_dir: str, step: int | None) -> tuple[dict, str | None]:
    """A step folder's COMPLETE marker, and what is wrong with it (None: it is the one a save of `step` writes)."""
    try:
        with open(os.path.join(step_dir, COMPLETE), encoding="utf-8") as fh:
            marker = json.load(fh)
    except FileNotFoundError:
        return {}, "is missing (the save was interrupted, so the other files may be partial)"
    except OSError as exc:
        return {}, _reason(exc)
    except ValueError:
        return {}, "does not hold what a checkpoint writes (not JSON)"
    problem = _not_ours(marker, {"step": int})
    if problem is None and step is not None and marker["step"] != step:
        problem = f"its step is {marker['step']}, not the folder's {step}"
    files = marker.get("files", {}) if isinstance(marker, dict) else {}  # checksums (older saves have none)
    if problem is None and not (isinstance(files, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) for v in files.values())):
        problem = "its files entry is not the sizes and checksums a save records"
    return marker, (f"does not hold what a checkpoint writes ({problem})" if problem else None)


def _first_changed_file(step_dir: str, files: dict, under: str = "") -> tuple[str, str] | None:
    """The first of the marker's `files` (and what is wrong with it) that differs from its recorded size and
    checksum, looking at those `under` a subfolder if given; each rank reads its share of the files."""
    names = sorted(n for n in files if not under or n.startswith(under + os.sep))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = changed_files(step_dir, {n: files[n] for n in names[rank::world]})
    return next((f[0] for f in _gather(found[:1]) if f), None)


def _not_ours(record: Any, fields: dict[str, type]) -> str | None:
    """Why a loaded file is not what a save wrote: not a dict, or a field missing or of another type."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a dict"
    for key, kind in fields.items():
        if key not in record:
            return f"no {key!r} entry"
        if not isinstance(record[key], kind) or isinstance(record[key], bool):
            return f"its {key} is {record[key]!r}, not {'a whole number' if kind is int else 'a ' + kind.__name__}"
    return None


def _first(found: list[str]) -> str:
    return "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")


def _reason(exc: BaseException) -> str:
    """An exception as the end of a sentence about a file; DCP wraps each rank's error in its own."""
    if isinstance(exc, CheckpointException):
        wrapped = next(iter(exc.failures.values()), None)  # (exception, stack)
        if wrapped is not None:
            exc = wrapped[0]
    if isinstance(exc, FileNotFoundError):
        return "is missing"
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return f"cannot be read ({type(exc).__name__}{': ' + text if text else ''})"


def _gather(value: Any, group=None) -> list[Any]:
    """Every rank's `value`, in rank order (also a barrier: no rank goes on before all have sent)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state, i.e. has made an update (every step so far may have been skipped)."""
    return any(len(entry) for entry in optimizer.state.values())


def _holds_only_a_save(path: str) -> bool:
    """A step folder holding nothing but what a save writes (its files, or their temporaries cut short)."""
    return os.path.isdir(path) and not os.path.islink(path) and not _foreign_entries(path)


def _foreign_entries(step_dir: str) -> list[str]:
    """What a step folder holds that no save of this package wrote, as paths within it (a user's notes, an
    evaluation's folder): never deleted with the step. A complete step's marker lists the files its save wrote;
    a step without one (or saved before markers listed files) is judged by the names saves give their files."""
    marker, problem = _read_marker(step_dir, None)
    listed = (set(marker.get("files", {})) if problem is None and isinstance(marker, dict) else None) or None
    foreign = []
    for name in sorted(os.listdir(step_dir)):
        full = os.path.join(step_dir, name)
        if name in SAVE_SUBFOLDERS and os.path.isdir(full) and not os.path.islink(full):
            for inner in sorted(os.listdir(full)):
                written = (f"{name}/{inner}" in listed if listed is not None else SAVE_SUBFOLDERS[name].match(inner))
                if not written or os.path.islink(os.path.join(full, inner)) or os.path.isdir(os.path.join(full, inner)):
                    foreign.append(f"{name}/{inner}")
        elif not ((name in SAVE_FILES or PARTIAL_WRITE.match(name)) and os.path.isfile(full)
                  and not os.path.islink(full)):
            foreign.append(name)
    return foreign


def _marker_being_written(path: str) -> bool:
    """A save cut while its COMPLETE marker was being put in place: every file whole, only the rename
    missing. Not removed with the other cut-short saves (it is kept aside: the checksums are there)."""
    return any(name.startswith(COMPLETE + ".tmp") for name in os.listdir(path))


# With less than this left for this user, a save that failed without an OSError (torch's zip writer raises a
# RuntimeError whose text is its own: 'unexpected pos 704 vs 598') is said as a full disk: that is the cause.
NEARLY_FULL_BYTES = 64 * 2**20


def _nearly_full(folder: str) -> bool:
    try:
        return shutil.disk_usage(folder).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _remove_step(step_dir: str, set_aside: Callable[[], str] | None = None,
                 say: Callable[[str], None] | None = None) -> None:
    """Delete a step folder, its COMPLETE marker first: one cut short half-way is an incomplete save,
    never a complete-looking checkpoint with files missing. A link in its place is removed, not followed
    (the folder it names may be another run's). With set_aside, what no save wrote is kept: the save's files
    go and the folder, with the rest, moves into set_aside()'s folder."""
    if os.path.islink(step_dir):
        os.remove(step_dir)
        return
    if not os.path.isdir(step_dir):
        return
    foreign = _foreign_entries(step_dir) if set_aside is not None else []
    try:
        os.remove(os.path.join(step_dir, COMPLETE))
    except OSError:
        pass
    if not foreign:
        shutil.rmtree(step_dir, ignore_errors=True)
        return
    for name in os.listdir(step_dir):  # the save's own files; the folders keep what is foreign within them
        full = os.path.join(step_dir, name)
        if name in foreign:
            continue
        if name in SAVE_SUBFOLDERS and os.path.isdir(full):
            for inner in os.listdir(full):
                if f"{name}/{inner}" not in foreign:
                    os.remove(os.path.join(full, inner))
            if not os.listdir(full):
                os.rmdir(full)
        else:
            os.remove(full)
    aside = set_aside()
    os.replace(step_dir, os.path.join(aside, os.path.basename(step_dir)))
    if say is not None:
        say(f"removed checkpoint {step_dir}, keeping what its save did not write ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}) in {aside}")
