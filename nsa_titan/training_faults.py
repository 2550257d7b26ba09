"""What ends a training run on a fault (out of memory, a lost loader worker, NaN losses), and the messages that
say what happened, what is kept and what to change."""

from __future__ import annotations

import torch

from nsa_titan.checkpoint import complete_steps

OUT_OF_MEMORY_EXIT = 4


def is_allocation_failure(exc: BaseException) -> bool:
    """An allocator that could not give the memory asked for: CUDA's (OutOfMemoryError) or the host's,
    which raises a plain RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


class TrainingFault(Exception):
    """The run cannot go on (e.g. NaN losses); the message says why, the last checkpoint is kept.
    `every_rank`: every rank raised it at the same point (an agreed decision), so they can still meet;
    otherwise this rank alone failed (out of memory) and the others wait in a collective."""

    def __init__(self, message: str, exit_code: int, every_rank: bool):
        super().__init__(message)
        self.exit_code = exit_code
        self.every_rank = every_rank


def model_too_large_message(model, num_params: int, mesh, device: torch.device) -> str:
    """The model's parameters and buffers did not fit where they were made: their size, and the fixes."""
    tensors = [*model.parameters(), *model.buffers()]
    gib = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    shards = "" if mesh is None else f" (before sharding over {mesh.size()} ranks)"
    return (f"the model does not fit in {device.type} memory: {num_params:,} parameters, {gib:,.1f} GiB of "
            f"parameters and buffers{shards}, before any activation or optimizer state. Fix: check the model's "
            f"sizes in the recipe (model.dim, model.n_layers, model.max_seq_len, ...), or shard over more devices. "
            f"`nsa-titan doctor RECIPE` estimates the memory per device.")


def out_of_memory_message(what: str, step: int, exc: BaseException, recipe, runtime, checkpointer,
                          global_batch: int, dp_size: int) -> str:
    allocator = " ".join(str(exc).split()).split(" If reserved but unallocated")[0].split(" See documentation")[0]
    if checkpointer is None or not recipe.checkpoint.enable:
        kept = "Checkpointing is off: there is nothing to resume from."
    else:
        if runtime.world_size == 1:  # a background save written before the fault completes
            checkpointer.finish_pending()  # (with more ranks, the others may be stuck in a collective)
        done = complete_steps(checkpointer.folder)
        kept = f"The last complete checkpoint (step {done[-1]}) is kept." if done else "No checkpoint was written yet."
    t, ac = recipe.training, recipe.activation_checkpoint
    fixes = []
    if t.local_batch_size > 1:
        # The global batch must stay a multiple of local x data-parallel size: offer the largest such local size.
        rows = global_batch // dp_size
        lower = max(d for d in range(1, t.local_batch_size) if rows % d == 0)
        fixes.append(f"lower training.local_batch_size (now {t.local_batch_size}), e.g. "
                     f"--training.local_batch_size={lower} --training.global_batch_size={global_batch} to "
                     f"keep the tokens per step, in {rows // lower} micro-batches (a local batch size must divide "
                     f"the {rows} rows a data-parallel rank takes per step)")
    if ac.mode != "full":
        fixes.append(f"set activation_checkpoint.mode = 'full' (now '{ac.mode}')")
    if what.startswith("validation"):
        fixes.append("set validation.enable = false (validation runs the training batch shape)")
    fixes += ["shard over more GPUs", f"shorten training.seq_len (now {t.seq_len})"]
    return (f"rank {runtime.rank}: out of device memory in {what} {step} ({allocator.rstrip('.')}). {kept} "
            f"Fix: {'; or '.join(fixes)}. `nsa-titan doctor RECIPE` estimates the memory per device.")


def worker_lost_message(text: str, ended_by: str | None, rank: int, step: int, way_on: str) -> str:
    """A data loader worker process that died (`ended_by`: the signal that ended it, if one did): what it
    cost and the way on, not the loader's traceback. The loader's place may be past the step the model
    reached, so nothing is saved: the last checkpoint is this run's way on."""
    how = " ".join(text.split()).rstrip(".")
    killed = ended_by == "SIGKILL"
    if ended_by is not None:
        how += f"; ended by {ended_by}" + (", most often the host's out-of-memory killer" if killed else "")
    fix = ("lower data.num_workers or data.prefetch_factor (each worker holds its own read-ahead), or give "
           "the job more host memory" if killed else
           "the worker's own error, if it printed one, is above; data.num_workers = 0 reads in the training "
           "process")
    return (f"rank {rank}: a data loader worker died after step {step} ({how}); "
            f"{way_on}. Fix: {fix}.")


def nan_fixes(recipe, runtime, step: int, total_bad: int) -> list[str]:
    """What the run's settings leave to change after a NaN/Inf stop: no learning-rate advice before any
    update was applied (the weights and data gave it), no clipping advice when clipping is on, no
    float32 advice when the run computes in float32."""
    applied = step - total_bad  # updates made, resumed steps included
    start = recipe.checkpoint.initial_load_path
    origin = f"checkpoint.initial_load_path = {start!r}" if start else "model.init_std"
    fixes = (["lower optimizer.lr or raise lr_scheduler.warmup_steps"] if applied > 0 else
             [f"look at the weights it started from ({origin}) and the first batches' data: no update was applied "
              f"before it, so the learning rate is not the cause"])
    if recipe.training.max_norm == 0:
        fixes.append("set training.max_norm > 0 to clip gradients")
    if runtime.autocast_dtype is not None:
        fixes.append("train in float32 (training.dtype = 'float32') to rule out overflow in "
                     f"{str(runtime.autocast_dtype).removeprefix('torch.')}")
    return fixes + ["raise fault.max_bad_steps to ride out isolated spikes"]
