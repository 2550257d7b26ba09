"""What a start says of the checkpoints it resumes or leaves alone, of what a resume changes that no recipe field
shows (the learning rate's jump, the derived global batch, the data order, the held-out set), and the way on
for a run that stops on a fault. Each note goes through `say`, the main process's console."""

from __future__ import annotations

import os

from components.errors import UserError
from nsa_titan import held_out, registry
from nsa_titan.checkpoint import complete_steps, run_branches, weights_step_dir
from nsa_titan.weight_source import changes_note, step_field_changes


def say_checkpoints_left_alone(recipe, say) -> None:
    """checkpoint.enable = false in a folder holding a run's checkpoints: this run starts at step 0 and does
    not resume them, which a rerun of a run with its checkpointing switched off might not expect."""
    folder = os.path.join(recipe.job.dump_folder, recipe.checkpoint.folder)
    steps = complete_steps(folder)
    if steps:
        say(f"note: checkpoint.enable is false, so this run starts at step 0: it neither resumes nor "
            f"replaces the checkpoints in {folder} (the newest: step {steps[-1]}). To go on from them, "
            f"add --checkpoint.enable=true")


def say_other_checkpoint_folders(recipe, say) -> None:
    """A first start beside another folder of the run folder holding complete checkpoints (checkpoint.folder
    changed since they were saved): they are not resumed, which the same command with the earlier name would."""
    dump, own = recipe.job.dump_folder, os.path.normpath(recipe.checkpoint.folder)
    for name in sorted(os.listdir(dump)) if os.path.isdir(dump) else ():
        try:
            steps = complete_steps(os.path.join(dump, name)) if name != own else []
        except (OSError, UserError):  # a folder this user cannot read (a volume's lost+found): no run's
            continue
        if steps:
            say(f"note: this run starts at step 0: {os.path.join(dump, own)} holds no checkpoint, while "
                f"{os.path.join(dump, name)} holds this run folder's checkpoints (the newest: step "
                f"{steps[-1]}). To go on from them, add --checkpoint.folder={name}")


def way_on(recipe, resolved, checkpointer, consecutive_bad: int) -> str:
    """What a rerun of the same command starts from, for a run that stops on a fault: the step its
    resume would pick (checkpoint.load_step and branches included), found without a word said."""
    if not recipe.checkpoint.enable:
        return "checkpoint.enable is false, so the same command starts the run over"
    try:
        step = checkpointer.find_resume_step(recipe.checkpoint.load_step, run_branches(resolved),
                                             quiet=True)
    except UserError as exc:
        return f"the same command would not resume: {exc}"
    if step is None:
        return "no checkpoint was saved yet, so the same command starts the run over"
    way = f"the same command then resumes from {checkpointer.step_dir(step)}"
    good = checkpointer.newest_good_step() if consecutive_bad else None
    if good is not None and good < step:  # the resumed step ends skipped steps
        way += (f" (past the skipped steps' batches; its weights are those of the last good step); "
                f"--checkpoint.load_step={good} goes back to step {good}, the newest checkpoint of a good step")
    return way


def weight_source_changes(recipe, resolved, say, path: str, resumed: bool = False) -> list[str]:
    """The model fields in which this run differs from the one that trained the step folder at `path` (a
    resumed step's run folder is this run's); UserError for one that would change the weights' meaning."""
    run = recipe.job.dump_folder if resumed else None
    return step_field_changes(weights_step_dir(path), run, resolved.toml,
                              registry.get("model", recipe.model.name).args, path, say,
                              "resume" if resumed else "initial")


def say_weight_source_changes(say, changes: list[str]) -> None:
    note = changes_note(changes)
    if note:
        say(note)


def say_schedule_jump(recipe, say, optimizer, saved_next: float, applied: float | None, saved_peak: float,
                      step: int) -> None:
    """A resume whose schedule changed (training.steps extended, say) goes on at the new schedule's rate,
    which the recipe-change note alone does not show. Said when the schedule's shape jumps (its share of the
    peak leaves the span between the share the saved run stepped at, `applied`, and the one it would have
    gone on at) and the rate does too: a run extended in its stable stretch (warmup-stable-decay) goes on
    without a word, as does one whose peak (optimizer.lr) alone changed, which the recipe note names."""
    group = optimizer.param_groups[0]  # its peak: the recipe's rate as the optimizer builder gave it to this group
    now, peak = group["lr"], group.get("initial_lr", recipe.optimizer.lr)
    rates = [saved_next] + ([applied] if applied is not None else [])  # None: saved before it was recorded
    shares = [rate / saved_peak for rate in rates]

    def within(value: float, span: list[float]) -> bool:
        return min(span) * (1 - 1e-3) <= value <= max(span) * (1 + 1e-3)

    if within(now / peak, shares) or within(now, rates) or step >= recipe.training.steps:
        return  # no jump, or no step to take at it
    rises = now > max(rates)
    before = (f"stepped at {applied:.3g} at step {step} and would have gone on at {saved_next:.3g}"
              if applied is not None else f"would have gone on at {saved_next:.3g}")
    advice = (". To extend a run without raising its learning rate again, resume from a checkpoint before "
              "its decay began (checkpoint.load_step; lr_scheduler.decay_steps keeps the rate at its peak until "
              "the last decay_steps steps)") if rises else ""
    of = f"optimizer.lr = {peak:g}" if peak == recipe.optimizer.lr else f"the first param group's peak, {peak:g}"
    say(f"note: the learning rate {'rises' if rises else 'falls'} at step {step + 1} to {now:.3g} "
        f"({100 * now / peak:.3g}% of {of}), where this recipe's schedule has it "
        f"(lr_scheduler and training.steps); the run that saved step {step} {before}{advice}")


def say_derived_batch_change(recipe, say, record: dict, step: int, global_batch: int, dp_size: int) -> None:
    """training.global_batch_size = -1 follows the world size: a resume on another number of processes
    changes the batch the optimizer steps on, which no recipe field shows (an explicit size is kept, and
    a changed one is in the recipe-change note)."""
    saved = record.get("global_batch_size")  # absent from checkpoints written before it was kept
    if recipe.training.global_batch_size != -1 or saved is None or saved == global_batch:
        return
    local = recipe.training.local_batch_size
    if saved % (local * dp_size) == 0:
        keep = f"To keep {saved}, resume with --training.global_batch_size={saved}."
    elif saved % dp_size == 0:
        keep = (f"To keep {saved}, resume with --training.global_batch_size={saved} "
                f"--training.local_batch_size={saved // dp_size}.")
    else:
        keep = f"{saved} sequences do not divide among {dp_size} data-parallel ranks, so it cannot be kept here."
    say(f"the global batch is {global_batch} sequences a step here and was {saved} in the run that "
        f"saved step {step} ({record['world_size']} process(es)): training.global_batch_size = -1 follows "
        f"the world size. {keep}")


def say_data_order_change(say, record: dict, step: int, here: dict, local_batch_size: int,
                          data_restarted: bool) -> None:
    """A resume at another data layout continues every logical shard where it stopped, but a loader with two or
    more workers takes each batch from one worker's shards: another worker count (or, with workers, another
    data-parallel size or local batch size) draws other rows into each step than the saved run would have. Fewer
    than two workers give the same batches at every data-parallel size and local batch size (a fixed global
    batch), so nothing is said there."""
    saved = record.get("data_layout")
    if not isinstance(saved, dict) or data_restarted:
        return
    saved_batch = record.get("local_batch_size", local_batch_size)  # absent from older checkpoints: as here

    def order(layout: dict, batch: int):
        workers = layout.get("num_workers", 0)
        return None if workers < 2 else (layout.get("world_size"), workers, batch)

    def batches(layout: dict, batch: int) -> str:
        return f", {batch} sequences a batch" if layout.get("num_workers", 0) >= 2 else ""

    if order(saved, saved_batch) == order(here, local_batch_size):
        return
    keep = f"--data.num_workers={saved.get('num_workers')}"
    if order(saved, saved_batch) is not None:
        if saved_batch != local_batch_size:
            keep += f" --training.local_batch_size={saved_batch}"
        if saved.get("world_size") != here["world_size"]:
            keep += f" on {saved.get('world_size')} data-parallel rank(s)"
    say(f"note: the batches come in another order from here than the run that saved step {step} would have "
        f"drawn them: it read with data.num_workers = {saved.get('num_workers')} on "
        f"{saved.get('world_size')} data-parallel rank(s){batches(saved, saved_batch)}, this run with "
        f"{here['num_workers']} on {here['world_size']}{batches(here, local_batch_size)} (with 2 or more loader "
        f"workers each batch comes from one worker's logical shards). Every shard continues where it stopped, no "
        f"document repeated or skipped. To continue exactly, resume with {keep}.")


def say_unchecked_data(say, loader, step: int, data_restarted: bool) -> None:
    """A data state saved before a part of the stream's id was kept (an older release) resumes, as it did, without
    that part checked: said, so that a changed corpus behind it is not taken for a checked one."""
    unchecked = getattr(loader.dataset, "unchecked", [])
    if unchecked and not data_restarted:
        say(f"note: step {step} saved its data position before resumes checked {' and '.join(unchecked)}: "
            f"this one takes them as unchanged")


def say_held_out_change(recipe, say, record: dict, step: int) -> None:
    """A resume whose held-out set has another size validates on other rows: its losses do not continue the
    curve. With training.global_batch_size = -1 the set follows local_batch_size, which a scale-out (1 x 8 to
    4 x 2 sequences) changes without a validation field changing; a new training.seq_len (a context
    extension) changes every row."""
    saved = record.get("held_out_set")  # absent where the saving run did not validate, or kept no record
    if not recipe.validation.enable or saved is None:
        return
    t = recipe.training
    rows = held_out.held_out_rows(recipe)
    if (rows, t.seq_len) == (saved["rows"], saved["seq_len"]):
        return
    per_step = held_out.rows_per_batch(recipe)
    why = ("validation.steps x training.local_batch_size, as training.global_batch_size = -1"
           if t.global_batch_size == -1 else "validation.steps x training.global_batch_size")
    if t.seq_len != saved["seq_len"]:
        keep = "Its rows follow training.seq_len, so the set cannot be kept at this length."
    elif saved["rows"] % per_step == 0:
        keep = f"To validate on the same rows, resume with --validation.steps={saved['rows'] // per_step}."
    else:
        keep = (f"{saved['rows']} rows are no whole number of validation batches of {per_step} rows here, so the "
                f"set cannot be kept.")
    say(f"note: the held-out set is {rows} rows of {t.seq_len} tokens here ({why}) and was {saved['rows']} "
        f"of {saved['seq_len']} in the run that saved step {step}: validation losses from here are over "
        f"another set than the earlier ones. {keep}")
