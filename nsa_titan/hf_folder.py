"""A trained model as a Hugging Face transformers folder, and back.

    nsa-titan export RECIPE [overrides] --format hf --output DIR [--dtype float32|bfloat16|float16]

writes model.safetensors (its floating-point weights in --dtype, default float32), config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, the model's self-contained modeling file and the
resolved recipe
(nsa_titan_recipe.toml). `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads
it. The way back: `checkpoint.initial_load_path = DIR` starts a run from its weights, and
`nsa-titan eval/sample/plot DIR` read it like an exported .pt file. What the model looks like in
that form is the model part's answer (its hf_format hook); this module only writes and reads files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import torch

from components.data import document_prefix_id
from components.errors import UserError
from components.install_hint import install_extra
from nsa_titan import registry
from nsa_titan.command_options import check_output, new_name_beside, with_umask_permissions
from nsa_titan.config import ResolvedRecipe
from nsa_titan.config.errors import RecipeError
from nsa_titan.document_start import documents_of, leading_eos_apart
from nsa_titan.export_paths import RUN_DIR, made_in, plugins_read_from, reads_run_dir
from nsa_titan.observe.progress import progress
from nsa_titan.run_folder import flat_fields
from nsa_titan.weight_source import model_field_changes

FORMAT = "nsa_titan.hf.v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS, CONFIG, RECIPE = "model.safetensors", "config.json", "nsa_titan_recipe.toml"
WEIGHTS_INDEX = "model.safetensors.index.json"  # and the files it names, where save_pretrained sharded the weights


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise UserError(f"the Hugging Face format needs the {module} package. Fix: {install_extra('hf')}.") from None


def _hf_format(part, args, vocab_size: int):
    if part.hf_format is None:
        raise UserError(f"model {part.name!r} has no Hugging Face form (its part registers no hf_format hook). "
                        f"Fix: export it with --format pt.")
    return part.hf_format(args, vocab_size)


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG)) and (
        os.path.isfile(os.path.join(path, WEIGHTS)) or os.path.isfile(os.path.join(path, WEIGHTS_INDEX)))


def _read_weights(path: str, fix: str) -> dict:
    """The folder's tensors: model.safetensors, or the files model.safetensors.index.json names (save_pretrained
    shards a model larger than its max_shard_size)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(path, WEIGHTS_INDEX)
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        files = [WEIGHTS]
    else:
        try:
            with open(index, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index} cannot be read ({type(exc).__name__}: {exc}). {fix}") from None
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(os.path.join(path, name), device="cpu"))
        except (OSError, SafetensorError) as exc:
            raise UserError(f"{os.path.join(path, name)} cannot be read ({exc}). {fix}") from None
    return tensors


def is_exported_folder(path: str) -> bool:
    """Whether `path` is a folder this command wrote (its config names this format)."""
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("nsa_titan"), dict) and \
        config["nsa_titan"].get("format") == FORMAT


def export_hf(resolved: ResolvedRecipe, output: str, dtype: str = "float32",
              overwrite: bool = False) -> tuple[str, int]:
    """Write the run's newest complete checkpoint (or checkpoint.load_step) as a Hugging Face folder,
    floating-point weights in `dtype` (one of DTYPES). With `overwrite`, an earlier export there is replaced
    once the new one is written, if it holds only files an export writes."""
    from components.data.hf_files import write_tokenizer_files
    from nsa_titan.rebuild import load_checkpoint_model

    _require("safetensors")
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}. Fix: e.g. --dtype bfloat16 (half "
                        f"the size; the trained weights are float32).")
    check_output("--output", output, folder=True, fresh=True, replaceable=is_exported_folder if overwrite else None)
    recipe = resolved.recipe
    model, tokenizer, step = load_checkpoint_model(resolved)
    part = registry.get("model", recipe.model.name)
    fmt = _hf_format(part, recipe.model.args, tokenizer.vocab_size)
    target = os.path.abspath(output)
    tmp = new_name_beside(target)
    os.makedirs(tmp)
    # bos_token_id: what a document follows (as the tokenizer's bos_token says)
    tokens = {"bos_token_id": document_prefix_id(tokenizer, recipe.data.add_bos), "eos_token_id": tokenizer.eos_id}
    apart = leading_eos_apart(documents_of(part, model), recipe.data.add_bos)
    config = {**fmt.config, **tokens, "leading_eos_apart": apart, "model_type": fmt.model_type,
              "architectures": list(fmt.architectures),
              "auto_map": fmt.auto_map, "torch_dtype": dtype,
              "nsa_titan": {"format": FORMAT, "model": recipe.model.name,
                            "model_args": dataclasses.asdict(recipe.model.args), "step": step,
                            "recipe_hash": resolved.hash,
                            **({RUN_DIR: made_in()} if reads_run_dir(recipe) else {})}}
    def write_weights() -> None:
        path = os.path.join(tmp, WEIGHTS)
        save_file({name: x.to(DTYPES[dtype]) if x.is_floating_point() else x
                   for name, x in fmt.to_hf(model.state_dict()).items()}, path, metadata={"format": "pt"})
        with_umask_permissions(path)

    stages = {
        "weights": write_weights,
        "modeling file": lambda: shutil.copyfile(fmt.modeling_file,
                                                 os.path.join(tmp, os.path.basename(fmt.modeling_file))),
        "tokenizer": lambda: write_tokenizer_files(tokenizer, tmp, fmt.max_length, recipe.data.add_bos),
        "config": lambda: (_write_json(os.path.join(tmp, CONFIG), config),
                           _write_json(os.path.join(tmp, "generation_config.json"),
                                       {**tokens, "pad_token_id": tokenizer.eos_id})),
        "recipe": lambda: _write_text(os.path.join(tmp, RECIPE), resolved.toml),
    }
    try:
        for stage in progress("export")(stages):
            try:
                stages[stage]()
            except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk, a quota
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
                raise UserError(f"cannot write the {stage} of --output {output!r} ({why}); nothing was written. "
                                f"Fix: free some space, or choose another folder.") from None
        _replace_folder(tmp, target, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output, step


def _replace_folder(new: str, output: str, overwrite: bool) -> None:
    """Move the written folder to `output`. An empty folder there is removed first (one that filled while
    exporting stops the export). With `overwrite`, an earlier export there, checked again now and holding
    nothing the new one does not, is swapped out and removed only once the new one is in place."""
    if not os.path.isdir(output):
        os.replace(new, output)
        return
    if not overwrite or not os.listdir(output):
        try:
            os.rmdir(output)
        except OSError:
            raise UserError(f"--output {output!r} was empty when the export began and is not now; it is left as "
                            "it is and nothing was written. Fix: choose a new folder.") from None
        os.replace(new, output)
        return
    if not is_exported_folder(output):
        raise UserError(f"--output {output!r} is no longer an earlier export; it is left as it is and nothing was "
                        "written. Fix: choose a new folder.")
    extra = sorted(set(os.listdir(output)) - set(os.listdir(new)))
    if extra:
        raise UserError(f"--output {output!r} holds {', '.join(map(repr, extra[:3]))}, which an export does not "
                        "write, so --overwrite leaves the folder as it is; nothing was replaced. Fix: move those "
                        "files out, or choose a new folder.")
    old = tempfile.mkdtemp(dir=os.path.dirname(output), prefix=os.path.basename(output) + ".old-")
    os.replace(output, old)  # onto the empty folder just made
    try:
        os.replace(new, output)
    except BaseException:
        try:
            os.replace(old, output)  # put the earlier export back
        except OSError:
            raise UserError(f"replacing --output {output!r} failed midway; the earlier export is kept in {old!r}. "
                            f"Fix: move it back to {output!r}.") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, payload: dict) -> None:
    _write_text(path, json.dumps(payload, indent=2) + "\n")


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


@dataclasses.dataclass
class HFFolder:
    model_name: str
    model_args: dict  # the recipe's [model.args] as written
    vocab_size: int
    state_dict: dict  # the model's own names, full tensors on the CPU
    step: int | None
    recipe_toml: str | None
    run_dir: str | None  # where its recipe's relative paths are read from, when it reads any (export_paths.py)


def read_hf_folder(path: str) -> HFFolder:
    """The model a Hugging Face folder holds, in the package's terms; UserError if it is not one of ours."""
    fix = "Fix: give a folder written by `nsa-titan export RECIPE --format hf --output DIR` (or saved from it)."
    model_name, model_args, vocab_size, ours = _read_config(path, fix)
    _require("safetensors")
    tensors = _read_weights(path, fix)
    from nsa_titan.config.resolve import import_plugins_of
    from nsa_titan.rebuild import model_arguments

    recipe_file = os.path.join(path, RECIPE)
    recipe_toml = open(recipe_file, encoding="utf-8").read() if os.path.isfile(recipe_file) else None
    if recipe_toml is not None:  # its plugin files, read from where it was exported
        recipe_toml = plugins_read_from(recipe_toml, ours.get(RUN_DIR), repr(path))
    if recipe_toml is not None and model_name not in registry.available("model"):
        import_plugins_of(recipe_toml)  # a plugin registers the model
    part = registry.get("model", model_name)
    where = os.path.join(path, CONFIG)
    try:
        args = model_arguments(part, model_args, where)
    except RecipeError:
        if recipe_toml is None:
            raise
        # A built-in model whose arguments name a plugin's part (an attention backend): the folder's plugins
        # are imported only when needed, so a folder of a run with, say, a plugin data source reads without it.
        import_plugins_of(recipe_toml)
        args = model_arguments(part, model_args, where)
    # The package's models hold float32 weights, whatever the folder stores.
    tensors = {name: x.float() if x.is_floating_point() else x for name, x in tensors.items()}
    try:
        state = _hf_format(part, args, vocab_size).from_hf(tensors)
    except (KeyError, ValueError, RuntimeError) as exc:  # tensors missing, or of other shapes than config.json says
        raise UserError(f"the weights in {path} do not fit the model {CONFIG} describes "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}). Fix: export "
                        f"the run again rather than editing {CONFIG}.") from None
    return HFFolder(model_name, model_args, vocab_size, state, ours.get("step"), recipe_toml, ours.get(RUN_DIR))


def _read_config(path: str, fix: str) -> tuple[str, dict, int, dict]:
    """(model name, model arguments, vocabulary size, the package's own entry) from a folder's config.json."""
    if not is_hf_folder(path):
        raise UserError(f"{path!r} is not a Hugging Face model folder (it needs {CONFIG} and {WEIGHTS}, or "
                        f"{WEIGHTS_INDEX} and its files). {fix}")
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as fh:
            config = json.load(fh)
        ours = config["nsa_titan"]
        return ours["model"], ours["model_args"], int(config["vocab_size"]), ours
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{os.path.join(path, CONFIG)} does not describe an nsa_titan model ({type(exc).__name__}: "
                        f"{exc}). {fix}") from None


def hf_weight_changes(path: str, model_name: str, model_args, vocab_size: int,
                      theirs: tuple[str, dict, int] | None = None) -> list[str]:
    """checkpoint.initial_load_path = a Hugging Face folder, judged by its config.json (`theirs`: its model name,
    arguments and vocabulary size, read here when not given; no weight is read): UserError for another model, else
    the fields that may differ and do ('model.FIELD: theirs -> ours')."""
    if theirs is None:
        theirs = _read_config(path, "Fix: give a folder written by `nsa-titan export RECIPE --format hf --output "
                                    "DIR` (or saved from it).")[:3]
    their_name, their_args, their_vocab = theirs
    if (their_name, their_vocab) != (model_name, vocab_size):
        raise UserError(f"checkpoint.initial_load_path = {path!r} holds another model: model {their_name!r} "
                        f"over {their_vocab} tokens there, {model_name!r} over {vocab_size} here. Fix: set "
                        f"model.name and the tokenizer to the folder's (its {RECIPE} has them), or start from a "
                        f"folder of this model.")
    ours = flat_fields({"model": dataclasses.asdict(model_args)})
    return model_field_changes(flat_fields({"model": their_args}), ours, registry.get("model", model_name).args, path,
                               os.path.join(path, CONFIG))


def load_hf_weights(model: torch.nn.Module, path: str, model_name: str, model_args, vocab_size: int) -> list[str]:
    """checkpoint.initial_load_path = a Hugging Face folder: its weights into this run's model (sharded
    or not), after checking that the folder holds this model. Fields that keep the weights' meaning
    (weight_source.py: max_seq_len to extend the context, the NSA backend, ...) may differ: returns them
    as 'model.FIELD: theirs -> ours' for the run to say."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    folder = read_hf_folder(path)
    changes = hf_weight_changes(path, model_name, model_args, vocab_size,
                                (folder.model_name, folder.model_args, folder.vocab_size))
    set_model_state_dict(model, folder.state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    return changes
