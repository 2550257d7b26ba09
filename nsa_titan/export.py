"""Consolidated weights for sampling and evaluation on one device, without torch.distributed.

`nsa-titan export RECIPE [--checkpoint.load_step=N] --output FILE` reads a (sharded) DCP checkpoint
of the run and writes one torch file: the full state dict, the model's registry name and
arguments, the vocabulary size and the resolved recipe. `load_exported(FILE)` rebuilds the model.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from components.errors import UserError
from nsa_titan import assemble, registry
from nsa_titan.checkpoint import complete_steps
from nsa_titan.config import ResolvedRecipe
from nsa_titan.config.build import RecipeBuilder
from nsa_titan.config.errors import RecipeError

FORMAT = "nsa_titan.export.v1"


def load_checkpoint_model(resolved: ResolvedRecipe):
    """The run's newest complete checkpoint (or checkpoint.load_step) as a full model on the CPU.

    Returns (model in eval mode, tokenizer, step). Needs no process group: DCP reads the shards of
    any layout into the unsharded model.
    """
    recipe = resolved.recipe
    folder = os.path.join(recipe.job.dump_folder, recipe.checkpoint.folder)
    steps = complete_steps(folder)
    step = recipe.checkpoint.load_step if recipe.checkpoint.load_step >= 0 else (steps[-1] if steps else None)
    if step is None or step not in steps:
        raise UserError(f"no complete checkpoint {'at step ' + str(step) + ' ' if step is not None else ''}in {folder}."
                        f" Fix: train with checkpoint.enable = true first, or pick one of: "
                        f"{', '.join(map(str, steps)) or 'none'}.")
    tokenizer = assemble.build_tokenizer(recipe)
    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    model.to_empty(device="cpu")
    model.init_weights()  # buffers; every parameter is then overwritten from the checkpoint
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, f"step-{step}", "model"), no_dist=True)
    model.load_state_dict(state["model"], strict=True)
    return model.eval(), tokenizer, step


def export_checkpoint(resolved: ResolvedRecipe, output: str) -> tuple[str, int]:
    recipe = resolved.recipe
    model, tokenizer, step = load_checkpoint_model(resolved)
    payload = {
        "format": FORMAT,
        "model_name": recipe.model.name,
        "model_args": dataclasses.asdict(recipe.model.args),
        "vocab_size": tokenizer.vocab_size,
        "step": step,
        "state_dict": model.state_dict(),
        "recipe_toml": resolved.toml,
        "recipe_hash": resolved.hash,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, output)
    return output, step


def load_exported(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild an exported model on one device; returns (model in eval mode, the file's metadata)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UserError(f"cannot read exported model {path!r} ({exc}). Fix: export it again with "
                        f"`nsa-titan export RECIPE --output FILE`.") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path!r} is not an nsa_titan export (format {FORMAT}). Fix: export it with nsa-titan export.")
    part = registry.get("model", payload["model_name"])
    problems = []
    args = RecipeBuilder({}, problems).build(part.args, payload["model_args"], "model")
    if problems:
        raise RecipeError(problems)
    with torch.device("meta"):
        model = part.build(args, payload["vocab_size"])
    model.to_empty(device=device)
    model.init_weights()
    model.load_state_dict(payload["state_dict"], strict=True)
    model.eval()
    meta = {k: v for k, v in payload.items() if k != "state_dict"}
    return model, meta
