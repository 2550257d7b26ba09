"""The model a run trains: built on the meta device, its blocks activation-checkpointed, compiled and sharded,
then made on the run's device; and the checks that its hooks can take split sequences (context parallelism)
and that its forward keeps the model contract."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from components.errors import UserError
from nsa_titan import assemble
from nsa_titan.parallel.activation_checkpoint import apply_activation_checkpointing
from nsa_titan.parallel.compile import compile_blocks
from nsa_titan.parallel.data_parallel import apply_data_parallel
from nsa_titan.training_faults import OUT_OF_MEMORY_EXIT, TrainingFault, is_allocation_failure, model_too_large_message


def build_training_model(recipe, runtime, model_part, vocab_size: int, mesh) -> tuple[nn.Module, int, int, int]:
    """(model, parameter count, blocks activation-checkpointed, blocks). torchtitan's order: activation
    checkpointing, then per-block compile, then data parallelism."""

    def build_on_meta():
        return assemble.build_model_on_meta(recipe, vocab_size)

    model = build_on_meta()
    num_params = assemble.count_parameters(model)
    plan = assemble.parallel_plan(model_part, model)
    wanted = [name for name, on in (("compile.enable", recipe.compile.enable),
                                    ("activation_checkpoint.mode", recipe.activation_checkpoint.mode != "none"))
              if on]
    if wanted and not plan.blocks:
        raise UserError(f"model {recipe.model.name!r} names no blocks (its part has no parallel_plan hook), so "
                        f"{' and '.join(wanted)} would be ignored. Fix: register the model with parallel_plan= "
                        f"(components.models.transformer_hooks() gives the transformer's), or turn "
                        f"{' and '.join(wanted)} off.")
    checkpointed_blocks = apply_activation_checkpointing(plan.blocks, recipe.activation_checkpoint.mode,
                                                         recipe.activation_checkpoint.selective_every)
    num_blocks = len(plan.blocks)
    if recipe.compile.enable:
        compile_blocks(plan.blocks, fullgraph=recipe.compile.fullgraph, backend=recipe.compile.backend,
                       mode=recipe.compile.mode)
        if model_part.compiled is not None:
            model_part.compiled(model, recipe.compile.backend)
    if mesh is not None:
        apply_data_parallel(model, plan, mesh, param_dtype=runtime.autocast_dtype,
                            reshard_after_forward=recipe.parallelism.fsdp_reshard_after_forward)
    try:
        assemble.materialize(model, runtime.device, recipe.job.seed, build_reference=build_on_meta,
                             distributed=mesh is not None)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_allocation_failure(exc):
            raise
        raise TrainingFault(model_too_large_message(model, num_params, mesh, runtime.device),
                            OUT_OF_MEMORY_EXIT, every_rank=False) from None
    return model, num_params, checkpointed_blocks, num_blocks


def check_split_sequence_hooks(recipe, model_part, model: nn.Module, shard, draw_attention: bool) -> None:
    """Under context parallelism the model says at start-up, not at step 1, when it cannot split its sequences,
    or when a hook the run calls cannot take a rank's share of the rows."""
    model_part.context_shard(model, None, 1, shard, torch.device("cpu"))
    uses = {"telemetry": (recipe.metrics.telemetry_freq > 0, "take attention telemetry",
                          "--metrics.telemetry_freq=0, or parallelism.context_parallel_degree = 1"),
            "attention_maps": (draw_attention, "draw attention maps",
                               "--metrics.enable_tensorboard=false or --metrics.telemetry_freq=0")}
    for hook, (used, what, fix) in uses.items():  # the hooks the run calls take a rank's share
        if used and "context" not in inspect.signature(getattr(model_part, hook)).parameters:
            raise UserError(f"model {recipe.model.name!r} cannot {what} of split sequences (its {hook} hook "
                            f"has no context= parameter). Fix: set {fix}.")


def check_logits(logits, vocab: int, training: bool) -> None:
    """The first forward's result keeps the model contract (a plugin's may not): a logits tensor over (at
    least) the tokenizer's vocabulary that gradients reach. Each mistake was a traceback of its own, in the
    loss, the backward or a CUDA index assertion."""
    if not isinstance(logits, torch.Tensor):
        raise UserError(f"the model's forward returned a {type(logits).__name__}, not a logits tensor. Fix: a "
                        f"model's forward returns the logits [batch, tokens, vocab] alone")
    if logits.dim() < 1 or logits.shape[-1] < vocab:  # wider is a vocabulary padded for speed: never a target
        raise UserError(f"the model returned logits of shape {list(logits.shape)}, over "
                        f"{logits.shape[-1] if logits.dim() else 0} tokens, fewer than the tokenizer's {vocab}. "
                        f"Fix: size the model's output by the vocab_size its builder is called with")
    if training and torch.is_grad_enabled() and not logits.requires_grad:
        raise UserError("the model returned logits no parameter's gradient reaches (computed under no_grad, "
                        "detached, or from no parameter). Fix: compute the logits from the model's parameters "
                        "with autograd on")
