"""Where a run starts: the newest complete checkpoint (or checkpoint.load_step) loaded into the run state, with what
the resume changes said, or else the initial weights the recipe names."""

from __future__ import annotations

from typing import NamedTuple

from components.errors import UserError
from nsa_titan import assemble
from nsa_titan.checkpoint import check_weights_path, run_branches
from nsa_titan.hf_folder import is_hf_folder, load_hf_weights
from nsa_titan.resume_notes import (say_checkpoints_left_alone, say_data_order_change, say_derived_batch_change,
                                    say_held_out_change, say_other_checkpoint_folders, say_schedule_jump,
                                    say_unchecked_data, say_weight_source_changes, weight_source_changes)
from nsa_titan.run_folder import recipe_change_note


class Resumed(NamedTuple):
    """What the resumed checkpoint says of the run that saved it, beyond the state it loads (FRESH: no resume)."""
    step: int | None  # the step resumed: a resume from an older step sets the newer ones aside
    # The seconds the launches before this one took to reach `step`: a run's elapsed_s counts on across resumes,
    # not from 0 at each.
    elapsed_s: float
    last_logged: dict | None  # the last training record logged before the save: the metrics file must hold it
    # Where that run's TensorBoard events went ("": none; None: not recorded, an older checkpoint or no resume).
    # Each checkpoint records its run's, so a resume knows whether the events there hold the steps up to it.
    tensorboard_folder: str | None


FRESH = Resumed(None, 0.0, None, None)  # a run that resumes no checkpoint


def data_layout(dp_size: int, data) -> dict:
    """What must match for a saved loader state to continue exactly as it is."""
    return {"world_size": dp_size, "num_workers": data.num_workers, "logical_shards": data.logical_shards}


def restore(recipe, resolved, checkpointer, state, nan_guard, vocab_size: int, global_batch: int, dp_size: int,
            loader, say) -> Resumed:
    """Resume from the newest complete checkpoint (or checkpoint.load_step), else initial weights; FRESH where no
    checkpoint is resumed. `loader(split, shard_states=None)`: this rank's loader of a split; the resumed one is
    state.dataloader."""
    ckpt = recipe.checkpoint
    if not ckpt.enable:
        say_checkpoints_left_alone(recipe, say)
    if checkpointer is None:
        return FRESH
    data_restarted = False  # whether the resume starts the recipe's data afresh (data_mismatch = restart)

    def restart_data():
        """checkpoint.data_mismatch = restart: the recipe's data from its beginning."""
        nonlocal data_restarted
        say("note: the checkpoint's data stream is not this recipe's (checkpoint.data_mismatch = 'restart'): "
            "the new data starts from its beginning; model, optimizer, LR schedule and step resume")
        data_restarted = True
        return loader("train")

    def reshard_data(old_rank_states: list[dict]):
        """A loader for this rank that continues every old rank's logical shards where they stopped."""
        from components.data import loader_state_by_logical_shard, merge_shard_states

        merged = merge_shard_states(*(loader_state_by_logical_shard(s) for s in old_rank_states))
        return loader("train", shard_states=merged)

    branches = run_branches(resolved)
    step = checkpointer.agree_resume_step(ckpt.load_step, branches) if ckpt.enable else None
    if ckpt.enable and step is None:
        say_other_checkpoint_folders(recipe, say)
    if step is not None:
        # Refused before anything loads; the changes allowed are named by the recipe-change note below.
        weight_source_changes(recipe, resolved, say, checkpointer.step_dir(step), resumed=True)
        restart = restart_data if ckpt.data_mismatch == "restart" else None
        try:
            record = checkpointer.load(state, step, data_layout=data_layout(dp_size, recipe.data),
                                       reshard_data=reshard_data, restart_data=restart)
        except UserError:  # a refusal (say, tensors of another shape) names tensors; the recipe's change is why
            note = recipe_change_note(resolved, "the recipe differs from the one this run folder's last run "
                                                "kept (recipe.toml)")
            if note:
                say(note)
            raise
        # This command's branch, begun here or resumed (named as an earlier release did, it takes today's name,
        # which a requeue that changes only what the branch's name leaves out still continues).
        own = step == ckpt.load_step or record.get("branch") in branches
        state.extra["branch"] = branches[0] if own else record.get("branch")
        if "nan_guard" in record:  # absent from checkpoints written before the guard's counts were kept
            nan_guard.load_state_dict(record["nan_guard"])
        # elapsed_s, last_logged and tensorboard_folder are absent from older checkpoints
        resumed = Resumed(step, float(record.get("elapsed_s", 0.0)), record.get("last_logged"),
                          record.get("tensorboard_folder"))
        if "wandb_run_id" in record:  # the W&B run it logged into ("": none); absent from older checkpoints
            state.extra["wandb_run_id"] = record["wandb_run_id"]
        if not recipe.validation.enable and "held_out_set" in record:  # kept for a later run that validates
            state.extra["held_out_set"] = record["held_out_set"]
        group = state.optimizer.param_groups[0]  # the saved run's: its rate for the step after its save, its peak
        saved_rates = (group["lr"], record.get("applied_lr"), group.get("initial_lr") or group["lr"])
        state.lr_scheduler = assemble.apply_recipe_optimizer_settings(recipe, state.model, state.optimizer,
                                                                      state.lr_scheduler)
        say(f"resumed from {checkpointer.step_dir(step)} at step {step}")
        note = recipe_change_note(resolved, "the recipe differs from the one this run folder's last run "
                                            "kept (recipe.toml); the new values apply from here")
        if note:
            say(note)
        say_derived_batch_change(recipe, say, record, step, global_batch, dp_size)
        say_data_order_change(say, record, step, data_layout(dp_size, recipe.data), recipe.training.local_batch_size,
                              data_restarted)
        say_unchecked_data(say, state.dataloader, step, data_restarted)
        say_held_out_change(recipe, say, record, step)
        say_schedule_jump(recipe, say, state.optimizer, *saved_rates, step)
        if ckpt.initial_load_path:  # the weights to start from apply to a run's first start only
            say(f"checkpoint.initial_load_path = {ckpt.initial_load_path!r} is not used: this run resumes "
                f"its own checkpoint (a new --job.dump_folder starts from those weights)")
        return resumed
    elif ckpt.initial_load_path and is_hf_folder(ckpt.initial_load_path):
        changes = load_hf_weights(state.model, ckpt.initial_load_path, recipe.model.name,
                                  recipe.model.args, vocab_size)
        say(f"initial weights from the Hugging Face folder {ckpt.initial_load_path}")
        say_weight_source_changes(say, changes)
    elif ckpt.initial_load_path:
        check_weights_path(ckpt.initial_load_path)  # a path that names no step has no model fields to compare
        # refused before anything loads
        changes = weight_source_changes(recipe, resolved, say, ckpt.initial_load_path)
        checkpointer.load_weights_only(state.model, ckpt.initial_load_path)
        say(f"initial weights from {ckpt.initial_load_path}")
        say_weight_source_changes(say, changes)
    return FRESH
