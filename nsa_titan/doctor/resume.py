"""The doctor's resume check: what the recipe's run would resume from, and whether that checkpoint reads.

Training finds a damaged checkpoint only when it starts; a preflight that passed a run folder whose newest
checkpoint a resume then refuses would be no preflight. The same finding and the same reads as a resume
(marker, recorded checksums, train state, rank files, the model fields that trained the weights), no tensors.
"""

from __future__ import annotations

import os

from nsa_titan import registry
from nsa_titan.checkpoint import Checkpointer, weights_step_dir
from nsa_titan.doctor.checks import OK, Check
from nsa_titan.weight_source import changes_note, step_field_changes


def check_resume(resolved) -> Check:
    recipe = resolved.recipe
    ckpt = recipe.checkpoint
    if not ckpt.enable:
        return Check("resume", OK, "checkpoint.enable is false: the run starts at step 0 and saves nothing")
    folder = os.path.join(recipe.job.dump_folder, ckpt.folder)
    notes: list[str] = []
    reader = Checkpointer(folder, keep_latest_k=0, async_mode="disabled", rank=0, world_size=1, say=notes.append)
    branch = {"from_step": ckpt.load_step, "recipe": resolved.hash} if ckpt.load_step >= 0 else None
    step = reader.find_resume_step(ckpt.load_step, branch, quiet=True)
    if step is None:
        start = (f"from the weights of {ckpt.initial_load_path}" if ckpt.initial_load_path else "from scratch")
        return Check("resume", OK, f"no complete checkpoint in {folder}: the run starts at step 0 {start}")
    path = reader.step_dir(step)
    record = reader.check_step(step)
    changes = step_field_changes(weights_step_dir(path), recipe.job.dump_folder, resolved.toml,
                                 registry.get("model", recipe.model.name).args, path, notes.append, "resume")
    detail = (f"a resume loads {path} (step {record['step']}, {record['tokens_seen']:,} tokens seen, saved by "
              f"{record['world_size']} process(es)): complete, its files as written")
    said = [note for note in [changes_note(changes), *notes] if note]  # allowed changes: said, not refused
    return Check("resume", OK, "; ".join([detail, *said]))
