"""A trained model back on one device: from a run's checkpoint, or from saved weights and arguments."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

import torch
from torch import nn

from components.errors import UserError, read_from
from nsa_titan import assemble, registry
from nsa_titan.checkpoint import COMPLETE, complete_steps, incomplete_steps, read_model_weights
from nsa_titan.config import Recipe, ResolvedRecipe
from nsa_titan.config.build import RecipeBuilder
from nsa_titan.config.errors import RecipeError
from nsa_titan.config.resolve import TOKENIZER_ARGS, run_identity_notes, unread_flags_note
from nsa_titan.config.toml_io import origins
from nsa_titan.step_folders import step_name, step_path


def say_on_stderr(text: str) -> None:
    """Where the commands that read a trained model say their notes (stdout holds their results)."""
    print(text, file=sys.stderr, flush=True)


def runnable_args(part, args, device, say: Callable[[str], None] | None = None):
    """The model's arguments as `device` can run them (the part's args_for_device hook: the same weights
    computed another way, e.g. another attention backend on the CPU); `say` gets the note."""
    if part.args_for_device is None:
        return args
    runnable, note = part.args_for_device(args, torch.device(device))
    if note and say is not None:
        say(f"note: {note}")
    return runnable


# What load_checkpoint_model reads of a recipe (unread_flags_note's `reads`): the run, its model and tokenizer.
CHECKPOINT_MODEL_READS = ("job.name", "job.dump_folder", "job.plugins", "model", "data.tokenizer", "data.add_bos",
                          TOKENIZER_ARGS, "checkpoint.folder", "checkpoint.load_step")
# What eval reads beside (of a run's recipe, or of the one an export records): the held-out data and its cut.
HELD_OUT_READS = ("job.seed", "data", "training.seq_len", "training.local_batch_size", "training.global_batch_size",
                  "validation.steps")


def say_unread_flags(resolved: ResolvedRecipe, command: str, also_reads: tuple[str, ...] = (),
                     effect: str = "nothing here") -> None:
    """The note naming the flags a command reading a run's checkpoint does not read (on stderr; the commands
    say it after their work, beside their other notes)."""
    note = unread_flags_note(resolved, command, CHECKPOINT_MODEL_READS + also_reads, effect)
    if note:
        say_on_stderr(f"note: {note}")


def load_checkpoint_model(resolved: ResolvedRecipe, say: Callable[[str], None] | None = None,
                          before_model: Callable[[Recipe, object], None] | None = None):
    """The run's newest complete checkpoint (or checkpoint.load_step) as a full model on the CPU, computing as
    the CPU can (runnable_args; `say` gets the note). before_model(recipe, tokenizer): a check of the caller's,
    before the model is built.

    Returns (model in eval mode, tokenizer, step). Needs no process group: DCP reads the shards of
    any layout into the unsharded model.
    """
    recipe = resolved.recipe
    for note in run_identity_notes(resolved):  # which run folder is read, when the recipe's [job] was not its own
        say_on_stderr(f"note: {note}")
    args = runnable_args(registry.get("model", recipe.model.name), recipe.model.args, "cpu", say)
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, args=args))
    folder = os.path.join(recipe.job.dump_folder, recipe.checkpoint.folder)
    steps = complete_steps(folder)
    step = recipe.checkpoint.load_step if recipe.checkpoint.load_step >= 0 else (steps[-1] if steps else None)
    if not steps:
        saved_in = _run_folder_of_recipe(resolved)
        if saved_in is not None:  # a run's own recipe.toml, given from another folder than the run started in
            raise UserError(f"no complete checkpoint in {folder}{read_from(folder)}; the recipe is the one the run "
                            f"in {saved_in} saved, whose job.dump_folder = {recipe.job.dump_folder!r} is read from "
                            f"the current folder. Fix: add --job.dump_folder={saved_in}, or run this from the folder "
                            f"the run started in.")
        raise UserError(f"no complete checkpoint in {folder}{read_from(folder)}. Fix: train with checkpoint.enable = "
                        f"true first (or name the run's folder with --job.dump_folder).")
    if step not in steps:
        raise UserError(f"no complete checkpoint at step {step} in {folder}. Fix: choose one of the complete steps "
                        f"({', '.join(map(str, steps))}) with --checkpoint.load_step, or -1 for the newest.")
    cut = [s for s in incomplete_steps(folder) if s > steps[-1]] if recipe.checkpoint.load_step < 0 else []
    if cut:  # read the newest complete step, as a resume would, but not in silence
        say_on_stderr(f"note: reading step {step}, the newest complete one: {', '.join(map(step_name, cut))} in "
                      f"{folder} {'has' if len(cut) == 1 else 'have'} no {COMPLETE} marker (a save under way, or "
                      f"one cut short)")
    _check_model_fields(resolved, step_path(folder, step))
    tokenizer = assemble.build_tokenizer(recipe)
    if before_model is not None:
        before_model(recipe, tokenizer)
    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    model.to_empty(device="cpu")
    model.init_weights()  # buffers; every parameter is then overwritten from the checkpoint
    state = {"model": model.state_dict()}
    while True:
        try:
            read_model_weights(folder, step, state)  # a damaged or mismatched checkpoint gets resume's message
            break
        except UserError:
            # The newest step, pruned while it was read by the run that goes on saving (its marker goes first):
            # the run's newer step is read instead. A step named by load_step, or one still complete, failed.
            newer = [s for s in complete_steps(folder) if s > step]
            if recipe.checkpoint.load_step >= 0 or os.path.exists(os.path.join(step_path(folder, step), COMPLETE)) \
                    or not newer:
                raise
            say_on_stderr(f"note: step {step} was removed while it was read (the run is still saving and pruning); "
                          f"reading its newest step, {newer[-1]}")
            step = newer[-1]
            _check_model_fields(resolved, step_path(folder, step))
    model.load_state_dict(state["model"], strict=True)
    return model.eval(), tokenizer, step


def _run_folder_of_recipe(resolved: ResolvedRecipe) -> str | None:
    """The folder the given recipe file lies in, where it is a run's folder holding complete checkpoints that the
    recipe's job.dump_folder, read from here, does not name; None otherwise."""
    if resolved.path is None or any(key == "job.dump_folder" for _, key, _ in resolved.command_line.overrides):
        return None  # a folder given on the command line is the one meant, read as typed
    folder = os.path.dirname(os.path.abspath(resolved.path))
    if os.path.realpath(folder) == os.path.realpath(resolved.recipe.job.dump_folder):
        return None
    return folder if complete_steps(os.path.join(folder, resolved.recipe.checkpoint.folder)) else None


def _check_model_fields(resolved: ResolvedRecipe, step_dir: str) -> None:
    """The recipe's model fields against those that trained the step's weights, as a resume checks them: a
    field that changes what a weight means is refused (the export or evaluation would describe another
    model); those marked keeps_weights may differ, and are named."""
    from nsa_titan.weight_source import changes_note, step_field_changes

    changes = step_field_changes(step_dir, resolved.recipe.job.dump_folder, resolved.toml,
                                 registry.get("model", resolved.recipe.model.name).args, step_dir, say_on_stderr,
                                 "read")
    note = changes_note(changes)
    if note:
        say_on_stderr(note)


def rebuild_model(model_name: str, model_args: dict, vocab_size: int, state_dict: dict, device,
                  source: str = "the saved weights", say: Callable[[str], None] | None = None) -> nn.Module:
    """The model `model_name` with arguments `model_args` (a recipe's [model.args] as a dict) and these
    weights, in eval mode on `device`, computing as it can there (runnable_args; `say` gets the note).
    `source` names where they came from in a mismatch's message."""
    part = registry.get("model", model_name)
    args = runnable_args(part, model_arguments(part, model_args, source), device, say)
    with torch.device("meta"):
        model = registry.call(part, args, vocab_size)
    model.to_empty(device=device)
    model.init_weights()
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:  # names missing, unexpected or of other shapes than the arguments make
        detail = " ".join(str(exc).split("\n\t")[1:2]) or str(exc).splitlines()[0]
        raise UserError(f"the weights in {source} do not fit the model its arguments describe ({model_name}, "
                        f"vocab_size {vocab_size}): {detail.strip()} Fix: export the run again rather than editing "
                        f"the saved model arguments.") from None
    return model.eval()


def model_arguments(part, model_args: dict, where: str = "the saved model arguments"):
    """A model part's argument dataclass from saved values, validated as a recipe's would be; a problem names
    `where` they were saved."""
    problems = []
    args = RecipeBuilder(origins(model_args, where, "model."), problems).build(part.args, model_args, "model")
    if problems:
        raise RecipeError(problems)
    return args
