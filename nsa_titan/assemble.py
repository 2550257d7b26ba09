"""Turn a checked recipe into objects through the registry: tokenizer, model, optimizer, data."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from components.errors import UserError
from nsa_titan import registry
from nsa_titan.config.schema import CUDA_GRAPH_MODES, Recipe
from nsa_titan.runtime import Runtime
from components.model_hooks import ParallelPlan
from components.optim import lr_factor


def build_tokenizer(recipe: Recipe):
    return registry.build("tokenizer", recipe.data.tokenizer, recipe.data.tokenizer_args)


def build_source(recipe: Recipe):
    """The data source, checked once here (the loaders built from it do not check it again)."""
    source = registry.build("data_source", recipe.data.source, recipe.data.source_args)
    check = getattr(source, "check", None)
    if callable(check):
        check()
    return source


def refuse_what_cannot_run_here(recipe: Recipe, device: torch.device, compiling: bool) -> None:
    """What the recipe asks that this device cannot do, found before anything is built, read or written (the
    trainer and inspect alike): CUDA-graph compile modes off CUDA, and what the model part says it cannot run."""
    if compiling and recipe.compile.mode in CUDA_GRAPH_MODES and device.type != "cuda":
        raise UserError(f"compile.mode = {recipe.compile.mode!r} replays CUDA graphs, but this run is on "
                        f"{device.type}. Fix: set --compile.mode=default, or run on CUDA.")
    problem = device_problem(recipe, device)
    if problem:
        raise UserError(problem)


def device_problem(recipe: Recipe, device: torch.device) -> str | None:
    """Why the model part says it cannot run on `device` (with the fix), or None."""
    part = registry.get("model", recipe.model.name)
    return part.device_problem(recipe.model.args, device) if part.device_problem is not None else None


def source_notes(recipe: Recipe, source) -> list[str]:
    """What the source says a run over the recipe's logical shards should be told (once, not per worker)."""
    notes = getattr(source, "shard_notes", None)
    return list(notes(recipe.data.logical_shards)) if callable(notes) else []


def reader_balance_note(recipe: Recipe, source, dp_size: int) -> str | None:
    """A warning when the data's readers (each data-parallel rank's loader workers, or the rank itself without
    workers) hold shares of the corpus more than 2x apart: a reader's logical shards keep in step, but readers
    go at one pace each, so the smallest share repeats while the largest still holds unread documents."""
    from components.data import shards_of_rank, shards_of_worker

    sizes = getattr(source, "shard_sizes", None)
    if not callable(sizes):
        return None
    shards, workers = recipe.data.logical_shards, max(recipe.data.num_workers, 1)
    per_shard = sizes(shards)
    readers = {(r, w): sum(per_shard[s] for s in shards_of_worker(shards_of_rank(r, dp_size, shards), w, workers))
               for r in range(dp_size) for w in range(workers)}
    held = {reader: size for reader, size in readers.items() if size > 0}  # an empty worker stops; others go on
    if len(held) < 2:
        return None
    small, large = min(held, key=held.get), max(held, key=held.get)
    if held[small] * 2 > held[large]:
        return None

    def named(reader):
        rank, worker = reader
        who = f"data-parallel rank {rank}" if dp_size > 1 else "the rank"
        return f"{who}'s loader worker {worker}" if recipe.data.num_workers else who

    def size(n: float) -> str:
        return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    return (f"the data's readers hold uneven shares: {named(small)} reads {size(held[small])} of the corpus, "
            f"{named(large)} {size(held[large])}. Readers go at one pace, so the smaller share is read "
            f"{held[large] / held[small]:.1f}x as often over a run (a reader's own logical shards keep in step). Fix: "
            f"more, smaller files (a .jsonl or .parquet file is cut into pieces; one document per file is not), "
            f"fewer data.num_workers, or another data.logical_shards")


def tokenizer_notes(tokenizer) -> list[str]:
    """What the tokenizer decided that no setting said (a guessed end-of-document token), to be told once."""
    return list(getattr(tokenizer, "notes", ()))


def lost_text_note(recipe: Recipe, source, tokenizer) -> str | None:
    """A note when the tokenizer loses a sizeable share of the first training documents' text (lost_text.py)."""
    from components.data import first_texts, lost_text_note as note_of

    if getattr(tokenizer, "keeps_all_text", False):
        return None
    return note_of(tokenizer, first_texts(source, recipe.data.logical_shards, recipe.job.seed))


def build_model_on_meta(recipe: Recipe, vocab_size: int) -> nn.Module:
    """The model's structure without memory; parallelism is applied before weights exist."""
    part = registry.get("model", recipe.model.name)
    with torch.device("meta"):
        return registry.call(part, recipe.model.args, vocab_size)


def parallel_plan(part: registry.Part, model: nn.Module) -> ParallelPlan:
    """The model part's plan (its blocks and separately sharded groups); a part without the hook
    has no blocks: nothing is checkpointed or compiled, and data parallelism wraps the root alone."""
    return part.parallel_plan(model) if part.parallel_plan is not None else ParallelPlan(())


def materialize(model: nn.Module, device: torch.device, seed: int, *, build_reference, distributed: bool) -> None:
    """Allocate the weights on the device and initialise them from the run's seed.

    The weights are always drawn on the CPU from a full, unsharded model, so a run starts from the
    same weights whatever its device count or data-parallel layout; rank 0 draws them and the
    others receive their shards from it.
    """
    model.to_empty(device=device)
    _mark_unset(model.buffers())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()  # buffers (e.g. RoPE tables) on every rank; parameters follow below
    unset = _unset(model.named_buffers())
    full_state = {}
    if not distributed or torch.distributed.get_rank() == 0:
        reference = build_reference()
        reference.to_empty(device="cpu")
        _mark_unset(reference.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reference.init_weights()
        unset += _unset(reference.named_parameters())
        full_state = reference.state_dict()
    if distributed:  # every rank stops, with rank 0's list of parameters, rather than wait in the broadcast
        said = [unset]
        torch.distributed.broadcast_object_list(said, src=0)
        unset = sorted(set(unset) | set(said[0]))
    if unset:
        raise UserError(f"the model's init_weights() ({type(model).__name__}) leaves {len(unset)} weight(s) unset: "
                        f"{_first_names(unset, 5)}; they would start as whatever memory held. Fix: set every "
                        f"parameter and buffer in init_weights() (the model is built on the meta device, so values "
                        f"given in __init__ are not kept).")
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full_state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model.load_state_dict(full_state)


def _first_names(names: list[str], shown: int) -> str:
    """'a, b, c and 4 more': a message's list of parameters, kept to a line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _mark_unset(tensors) -> None:
    """NaN in every floating-point tensor, so that one init_weights() leaves unwritten is seen (to_empty's memory
    is whatever it held, and may look like weights)."""
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))


def _unset(named_tensors) -> list[str]:
    """The names of the floating-point tensors still holding a NaN of _mark_unset."""
    return [name for name, tensor in named_tensors if tensor.is_floating_point() and bool(torch.isnan(tensor).any())]


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once), whatever their sharding."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def build_optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    opt = recipe.optimizer
    part = registry.get("optimizer", opt.name)
    own = {} if part.args is None else {"args": opt.args}  # an optimizer registered with arguments gets them
    optimizer = registry.call(part, model, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                              weight_decay=opt.weight_decay, **own)
    fix = registry.contract_of(part)
    who = f"optimizer {opt.name!r}" + (" (a plugin's)" if part.plugin else "")
    if not isinstance(optimizer, torch.optim.Optimizer):  # else a traceback in the LR scheduler
        raise UserError(f"{who} built {type(optimizer).__qualname__!r}, not a torch.optim.Optimizer. Fix: {fix}")
    # A trainable parameter in no param group would never move, and the run would end as if it had trained.
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    left = [name for name, p in trainable if id(p) not in held]
    if left:
        raise UserError(f"{who} holds {len(trainable) - len(left)} of the model's {len(trainable)} parameters that "
                        f"require grad: {_first_names(left, 3)} are in none of its param groups, so training "
                        f"would never update them. Fix: give it model.parameters() (or groups holding all of "
                        f"them): {fix}")
    return optimizer


def build_lr_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer,
                       completed_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step; the factor for 1-based step s is used by update s.

    completed_steps > 0 continues a schedule at that point from the param groups' initial_lr (the
    optimizer's lr is set to initial_lr x the factor there), as a resumed run with new settings needs.
    """
    sched = recipe.lr_scheduler
    shape = registry.get("lr_schedule", sched.decay_type).build  # a plugin's tried when the recipe was checked
    decay_steps = None if sched.decay_steps == -1 else sched.decay_steps

    def factor(completed: int) -> float:
        return lr_factor(completed + 1, warmup_steps=sched.warmup_steps, total_steps=recipe.training.steps,
                         shape=shape, min_lr_factor=sched.min_lr_factor, decay_steps=decay_steps)

    # A scheduler steps once when built: last_epoch = completed_steps - 1 lands it on completed_steps.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=completed_steps - 1)


def apply_recipe_optimizer_settings(recipe: Recipe, model: nn.Module, optimizer: torch.optim.Optimizer,
                                    lr_scheduler) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipe, not the checkpoint, says the optimizer's settings (lr, betas, eps, weight decay, an
    optimizer's own arguments such as Muon's momentum): a resumed run may change them.

    Loading an optimizer state restores its param_groups' settings, and the LR schedule its
    base_lrs; both are set back from the recipe (unchanged values leave the run bit-identical): every
    group takes those settings from a fresh optimizer built from the recipe, and the schedule is built
    again from the recipe at the step it had reached.
    """
    opt = recipe.optimizer
    fresh = build_optimizer(recipe, model).param_groups
    # Only what the recipe sets: a group may also hold an optimizer's running state, which must resume.
    owned = {"betas", "eps", "weight_decay"}
    if opt.args is not None:
        owned |= {f.name for f in dataclasses.fields(opt.args)}
    for group, wanted in zip(optimizer.param_groups, fresh, strict=True):
        # A group's own base rate (a builder may give groups rates of their own), as a fresh run's schedule takes it.
        group.update({k: wanted[k] for k in owned if k in wanted}, initial_lr=wanted["lr"])
    return build_lr_scheduler(recipe, optimizer, completed_steps=lr_scheduler.last_epoch)


def build_loader(recipe: Recipe, runtime: Runtime, source, tokenizer, *, dp_rank: int, dp_size: int,
                 split: str, batch_size: int, shard_states: dict | None = None, quotas: dict[int, int] | None = None,
                 num_workers: int | None = None):
    """A loader over a source from build_source (already checked); quotas: a fixed set's windows per shard;
    num_workers: data.num_workers unless given."""
    from components.data import build_dataloader

    data = recipe.data
    return build_dataloader(source, tokenizer, seq_len=recipe.training.seq_len, batch_size=batch_size,
                            dp_rank=dp_rank, dp_world_size=dp_size, logical_shards=data.logical_shards,
                            split=split, seed=recipe.job.seed,
                            num_workers=data.num_workers if num_workers is None else num_workers,
                            prefetch_factor=data.prefetch_factor,
                            pin_memory=data.pin_memory and runtime.device.type == "cuda", add_bos=data.add_bos,
                            min_document_tokens=data.min_document_tokens, shard_states=shard_states,
                            check_source=False, quotas=quotas)
