"""The doctor's resume check: what the recipe's run would resume from, and whether that checkpoint reads.

Training finds a damaged checkpoint only when it starts; a preflight that passed a run folder whose newest
checkpoint a resume then refuses would be no preflight. The same finding and the same reads as a resume
(marker, recorded checksums, train state, rank files, the model fields that trained the weights), no tensors;
then whether the saved data stream is this recipe's (the loader a resume builds takes the saved states).
"""

from __future__ import annotations

import os

from components.data import DataStreamMismatch, loader_state_by_logical_shard, merge_shard_states
from nsa_titan import assemble, registry
from nsa_titan.checkpoint import (Checkpointer, check_weights_files, check_weights_path, data_mismatch_message,
                                  initial_weights_mismatch, run_branches, weights_step_dir)
from nsa_titan.checkpoint_checks import shape_mismatches, tensor_shapes
from nsa_titan.doctor.checks import FAIL, OK, WARN, Check
from nsa_titan.hf_folder import hf_weight_changes, is_hf_folder
from nsa_titan.resume_notes import say_checkpoints_left_alone, say_other_checkpoint_folders
from nsa_titan.weight_source import changes_note, step_field_changes


def check_resume(resolved, runtime, tokenizer, source) -> Check:
    """tokenizer, source: the data check's (None when that check failed: the data stream then goes unchecked)."""
    recipe = resolved.recipe
    ckpt = recipe.checkpoint
    notes: list[str] = []
    if not ckpt.enable:
        say_checkpoints_left_alone(recipe, notes.append)  # as training says it
        start = _initial_weights(resolved, tokenizer, notes) if ckpt.initial_load_path else "from scratch"
        return Check("resume", OK, "; ".join([f"checkpoint.enable is false: the run starts at step 0 {start} and saves "
                                              f"nothing", *notes]))
    folder = os.path.join(recipe.job.dump_folder, ckpt.folder)
    reader = Checkpointer(folder, keep_latest_k=0, async_mode="disabled", rank=0, world_size=1, say=notes.append)
    step = reader.find_resume_step(ckpt.load_step, run_branches(resolved), quiet=True)
    if step is None:
        say_other_checkpoint_folders(recipe, notes.append)  # as training says it
        start = _initial_weights(resolved, tokenizer, notes) if ckpt.initial_load_path else "from scratch"
        return Check("resume", OK, "; ".join([f"no complete checkpoint in {folder}: the run starts at step 0 {start}",
                                              *notes]))
    path = reader.step_dir(step)
    record = reader.check_step(step)
    changes = step_field_changes(weights_step_dir(path), recipe.job.dump_folder, resolved.toml,
                                 registry.get("model", recipe.model.name).args, path, notes.append, "resume")
    found = _model_shape_mismatches(recipe, tokenizer, os.path.join(path, "model"))
    if found:  # before the data: a resume with the data restarted would fail on these too
        return Check("resume", FAIL, str(reader._mismatch(step, found)))
    detail = (f"a resume loads {path} (step {record['step']}, {record['tokens_seen']:,} tokens seen, saved by "
              f"{record['world_size']} process(es)): complete, its files as written")
    stream = _data_stream_note(resolved.recipe, runtime, tokenizer, source, reader, step, record)
    if isinstance(stream, Check):
        return stream
    said = [note for note in [changes_note(changes), *notes, stream] if note]  # allowed changes: said, not refused
    steps = recipe.training.steps
    if record["step"] >= steps:  # training would load it and stop at once, having nothing to do
        return Check("resume", WARN, "; ".join([detail, *said, (
            f"the run already reached training.steps = {steps}, so training would do nothing. Fix: raise "
            f"--training.steps to train on, or use another --job.dump_folder to start afresh")]))
    return Check("resume", OK, "; ".join([detail, *said]))


def _initial_weights(resolved, tokenizer, notes: list[str]) -> str:
    """Where a run's first start takes its weights from (checkpoint.initial_load_path), read as training reads it
    before loading: a path that names no step, or model fields that would read the weights as another model, are
    refused (UserError); allowed field changes are said."""
    recipe = resolved.recipe
    path = recipe.checkpoint.initial_load_path
    if is_hf_folder(path):  # judged by its config.json, as training does before it reads the weights
        if tokenizer is not None:  # (the vocabulary unknown: the data check failed, and says why)
            changes = hf_weight_changes(path, recipe.model.name, recipe.model.args, tokenizer.vocab_size)
            notes[:0] = [note for note in [changes_note(changes)] if note]
        return f"from the weights of the Hugging Face folder {path}"
    check_weights_path(path)
    step_dir = weights_step_dir(path)
    changes = step_field_changes(step_dir, None, resolved.toml, registry.get("model", recipe.model.name).args, path,
                                 notes.append, "initial")
    check_weights_files(path)  # an interrupted save, a damaged file: refused by training before it loads
    notes[:0] = [note for note in [changes_note(changes)] if note]
    found = _model_shape_mismatches(recipe, tokenizer, os.path.join(step_dir, "model"))
    if found:  # the message training gives as it loads them
        raise initial_weights_mismatch(path, found)
    return f"from the weights of {path}"


def _model_shape_mismatches(recipe, tokenizer, model_dir: str) -> list[str]:
    """The model tensors whose saved shapes (from the checkpoint's metadata, nothing loaded) differ from this
    recipe's model: a tokenizer of another vocabulary, say, which the recorded model fields do not show.
    Unchecked without a tokenizer (the data check failed)."""
    if tokenizer is None:
        return []
    import torch.distributed.checkpoint as dcp

    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    metadata = dcp.FileSystemReader(model_dir).read_metadata()
    return shape_mismatches(tensor_shapes({"model": model.state_dict()}), metadata)


def _data_stream_note(recipe, runtime, tokenizer, source, reader: Checkpointer, step: int,
                      record: dict) -> str | Check:
    """Whether the loader states `step` saved continue this recipe's data: "" when they do, a note when the recipe
    restarts the data instead (checkpoint.data_mismatch = 'restart'), a failing check when a resume is refused.
    Every data rank's states are merged into one loader, as a resume on another world size does."""
    if source is None:
        return "the data stream is not compared (the data check did not pass)"
    merged = merge_shard_states(*(loader_state_by_logical_shard(saved)
                                  for saved in reader.saved_data_states(step, record)))
    try:
        loader = assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=0,
                                       dp_size=1, split="train", batch_size=recipe.training.local_batch_size,
                                       shard_states=merged, num_workers=0)
    except DataStreamMismatch as mismatch:
        if recipe.checkpoint.data_mismatch == "restart":
            return ("its data stream is not this recipe's: the data starts from its beginning "
                    "(checkpoint.data_mismatch = 'restart')")
        return Check("resume", FAIL, data_mismatch_message(mismatch, reader.step_dir(step)))
    unchecked = getattr(loader.dataset, "unchecked", [])  # saved by an older release: as training says
    return (f"its data position was saved before resumes checked {' and '.join(unchecked)}: a resume takes them as "
            f"unchanged") if unchecked else ""
