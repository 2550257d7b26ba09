"""Consolidated weights for sampling and evaluation on one device, without torch.distributed.

`nsa-titan export RECIPE [--checkpoint.load_step=N] --output FILE` reads a (sharded) DCP checkpoint
of the run and writes one torch file: the full state dict, the model's registry name and
arguments, the vocabulary size and the resolved recipe. `--format hf` writes a Hugging Face folder
instead (nsa_titan/hf_folder.py). `load_exported(FILE or FOLDER)` rebuilds the model from either.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Callable

import torch
from torch import nn

from components.errors import UserError
from nsa_titan.command_options import check_output, new_name_beside
from nsa_titan import registry
from nsa_titan.config import Recipe, ResolvedRecipe
from nsa_titan.config.resolve import import_plugins_of, read_saved_recipe, resolve_text
from nsa_titan.config.toml_io import run_folder_flag
from nsa_titan.export_paths import RUN_DIR, data_read_from, made_in, plugins_read_from, tokenizer_read_from
from nsa_titan.checkpoint import COMPLETE, complete_steps
from nsa_titan.rebuild import load_checkpoint_model, rebuild_model
from nsa_titan.run_recipe import run_of_folder, unsaved_step_of
from nsa_titan.step_folders import TRAIN_STATE

__all__ = ["FORMAT", "ExportedRun", "export_checkpoint", "load_checkpoint_model", "load_exported", "load_exported_run"]

FORMAT = "nsa_titan.export.v1"


def is_export_file(path: str) -> bool:
    """Whether `path` is a file this command wrote (its format tag is in the torch archive's pickle; the
    tensors are not read)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            return len(pickles) == 1 and FORMAT.encode() in archive.read(pickles[0])
    except Exception:  # zipfile raises many kinds on files that are not archives
        return False


def export_checkpoint(resolved: ResolvedRecipe, output: str, overwrite: bool = False) -> tuple[str, int]:
    check_output("--output", output, folder=False, fresh=True, replaceable=is_export_file if overwrite else None)
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
        RUN_DIR: made_in(),  # where the recipe's relative paths (plugin, tokenizer and data files) are read from
    }
    target = os.path.abspath(output)
    tmp = new_name_beside(target)
    try:
        torch.save(payload, tmp)
        if os.path.lexists(target) and not (overwrite and is_export_file(target)):  # it appeared, or changed
            raise UserError(f"--output {output!r} appeared or changed while exporting and is not an earlier export; it "
                            "is left as it is and nothing was written. Fix: choose a new file.")
        os.replace(tmp, target)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"cannot write --output {output!r} ({why}); nothing was written. Fix: free some space, or "
                        f"choose another path.") from None
    finally:
        if os.path.exists(tmp):  # a partial file
            os.remove(tmp)
    return output, step


def load_exported(path: str, device: str | torch.device = "cpu",
                  say: Callable[[str], None] | None = None) -> tuple[nn.Module, dict]:
    """Rebuild an exported model (a .pt file, or a folder of --format hf) on one device, computing as it can
    there (`say` gets the note when that differs from training); returns (model in eval mode, its
    metadata: model_name, model_args, vocab_size, step, recipe_toml)."""
    return _rebuilt(path, _read_exported(path), device, say)


def recipe_is_not_an_export(path: str, flags: list[str] = ()) -> UserError:
    """The refusal of a recipe given where an exported model belongs; `flags`, the recipe's overrides given with it,
    go to export."""
    import shlex

    given = " ".join(map(shlex.quote, [path, *flags]))
    return UserError(f"{path!r} is a recipe, not an exported model. Fix: run `nsa-titan export {given} --output "
                     f"FILE` first and give FILE here.")


def _read_exported(path: str) -> dict:
    """What an export holds, its weights as a state dict under 'state_dict' (no model is built yet)."""
    if os.path.isdir(path):
        from nsa_titan.hf_folder import is_hf_folder

        refusal = None if is_hf_folder(path) else _run_folder_refusal(path)
        if refusal is not None:
            raise refusal
        return _read_hf_folder(path)
    if path.endswith(".toml"):
        raise recipe_is_not_an_export(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickler fails on other files with any error (IndexError, UnpicklingError...)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a file torch can load"
        raise UserError(f"cannot read exported model {path!r} ({reason}). Fix: give a file written by "
                        f"`nsa-titan export RECIPE --output FILE` (or a folder of --format hf).") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path!r} is not an nsa_titan export (format {FORMAT}). Fix: export it with nsa-titan export.")
    wrong = [key for key, kind in _PAYLOAD.items() if not isinstance(payload.get(key), kind)]
    if wrong:
        raise UserError(f"{path!r} is an incomplete nsa_titan export ({', '.join(wrong)} missing or of the wrong "
                        f"type). Fix: export the run again with `nsa-titan export RECIPE --output FILE`.")
    payload["recipe_toml"] = plugins_read_from(payload["recipe_toml"], payload.get(RUN_DIR), repr(path))
    import_plugins_of(payload["recipe_toml"])  # a plugin may register the model
    return payload


def _rebuilt(path: str, saved: dict, device, say) -> tuple[nn.Module, dict]:
    """(the model, the metadata) of what _read_exported read."""
    model = rebuild_model(saved["model_name"], saved["model_args"], saved["vocab_size"], saved["state_dict"], device,
                          path, say)
    return model, {k: v for k, v in saved.items() if k != "state_dict"}


@dataclasses.dataclass
class ExportedRun:
    model: nn.Module  # in eval mode
    meta: dict  # as load_exported returns it
    recipe: Recipe  # the recipe saved with it, its data paths as they read here
    tokenizer: object
    missing_data: UserError | None = None  # the data files the recipe reads that are gone, for a reader of the data
    saved_data: object = None  # the saved recipe's data settings without the data flags, its paths as read here


def load_exported_run(path: str, device: str | torch.device = "cpu",
                      say: Callable[[str], None] | None = None, data_flags: list[str] | tuple[str, ...] = (),
                      before_model: Callable[[Recipe, object], None] | None = None) -> ExportedRun:
    """load_exported, with the recipe saved beside the weights and the tokenizer the model was trained with.
    A Hugging Face folder's tokenizer is read from the folder's own files, so a folder copied to another
    machine needs nothing else (hf_files.tokenizer_in_folder). data_flags: overrides of the saved recipe's data
    fields (--data.text_files.paths=...: where the data is now), checked as a recipe's; the caller chooses which
    fields it lets change. before_model(recipe, tokenizer): a check of the caller's, before the model is built."""
    from components.data.hf_files import tokenizer_in_folder
    from nsa_titan.config.overrides import parse_args

    exported = _read_exported(path)
    recipe_toml, run_dir = exported["recipe_toml"], exported.get(RUN_DIR)
    recipe = read_saved_recipe(recipe_toml, path, data_flags)
    name, args = recipe.data.tokenizer, recipe.data.tokenizer_args
    if exported.get("format") == "hf":
        name, args = tokenizer_in_folder(name, args, path)
    else:
        args = tokenizer_read_from(args, run_dir, repr(path))
    given = frozenset(key for _, key, _ in parse_args(list(data_flags), []).overrides)
    data, gone = data_read_from(recipe.data, run_dir, path, given)
    saved = data_read_from(resolve_text(recipe_toml).recipe.data, run_dir, path)[0] if given else data
    recipe, tokenizer = dataclasses.replace(recipe, data=data), registry.build("tokenizer", name, args)
    if before_model is not None:
        before_model(recipe, tokenizer)
    model, meta = _rebuilt(path, exported, device, say)
    return ExportedRun(model, meta, recipe, tokenizer, gone, saved)


def _run_folder_refusal(path: str) -> UserError | None:
    """A training run's folder, its checkpoint folder or one of its step folders where an exported model goes:
    the way from it to one (they were told only that the folder is no Hugging Face folder)."""
    run = run_of_folder(path)
    if run is None:
        return _unsaved_step_refusal(path)
    recipe, step = run
    given = os.path.abspath(path)
    if step is not None and step not in complete_steps(os.path.dirname(given)):  # export would refuse that step
        return _incomplete_step_refusal(path, recipe, step, f"{COMPLETE} marker")
    folder = os.path.dirname(recipe)
    if step is not None:
        what = f"checkpoint step {step} of the run in {folder!r}"
    else:
        what = "a training run's folder" if folder == given else f"the checkpoint folder of {folder!r}"
    load_step = run_folder_flag(recipe) + (f" --checkpoint.load_step={step}" if step is not None else "")
    return UserError(f"{path!r} is {what}, not an exported model. Fix: export it first, `nsa-titan export {recipe}"
                     f"{load_step} --output model.pt`, and give model.pt here (eval and plot also read it through "
                     f"the run's recipe: `nsa-titan eval {recipe}{load_step} --out DIR`).")


def _unsaved_step_refusal(path: str) -> UserError | None:
    """A folder named as a checkpoint step that holds no train state, where an exported model goes: what it is, and
    the way to an export of the run's complete checkpoint (they were told it is no Hugging Face folder)."""
    from nsa_titan.hf_folder import CONFIG

    unsaved = unsaved_step_of(path)
    if unsaved is None or os.path.exists(os.path.join(path, CONFIG)):  # an hf export's file: a folder meant as one
        return None
    recipe, step = unsaved
    if recipe is None:
        return UserError(f"{path!r} is named as a checkpoint step but holds no {TRAIN_STATE}, and no training run's "
                         f"recipe.toml lies above it: a checkpoint step whose save was cut short, or no step folder; "
                         f"not an exported model. Fix: export a complete checkpoint of the run it belongs to, "
                         f"`nsa-titan export RECIPE --output model.pt`, and give model.pt here (or a folder of "
                         f"--format hf).")
    return _incomplete_step_refusal(path, recipe, step, TRAIN_STATE)


def _incomplete_step_refusal(path: str, recipe: str, step: int, missing: str) -> UserError:
    """A step folder of the run of `recipe` that lacks `missing`, which every complete save writes."""
    return UserError(f"{path!r} is named as checkpoint step {step} of the run in {os.path.dirname(recipe)!r} but "
                     f"holds no {missing}: an incomplete checkpoint (a save under way, or one cut short), or no step "
                     f"folder; not an exported model. Fix: export the run's newest complete checkpoint, `nsa-titan "
                     f"export {recipe}{run_folder_flag(recipe)} --output model.pt`, and give model.pt here.")


# What an export file must hold, by type (step is an int, or None for weights of no checkpoint step).
_PAYLOAD = {"model_name": str, "model_args": dict, "vocab_size": int, "state_dict": dict, "recipe_toml": str}


def _read_hf_folder(path: str) -> dict:
    from nsa_titan.hf_folder import RECIPE, read_hf_folder

    folder = read_hf_folder(path)
    if folder.recipe_toml is None:
        raise UserError(f"{path!r} has no {RECIPE}, which names the tokenizer and data (transformers' "
                        f"save_pretrained does not copy it). Fix: copy it there from the exported folder, or the "
                        f"run's recipe as {RECIPE}, or export the run again with `nsa-titan export RECIPE --format hf "
                        f"--output DIR`.")
    return {"format": "hf", "model_name": folder.model_name, "model_args": folder.model_args,
            "vocab_size": folder.vocab_size, "step": folder.step, "recipe_toml": folder.recipe_toml,
            RUN_DIR: folder.run_dir, "state_dict": folder.state_dict}
