"""Recipes load, compose and take overrides with the documented precedence."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

import pytest

from nsa_titan import cli, registry
from nsa_titan.config import resolve
from nsa_titan.config.resolve import read_saved_recipe, resolve_text
from nsa_titan.config.errors import RecipeError
from nsa_titan.config.help import help_text
from nsa_titan.config.toml_io import dumps, tomllib
from tests.conftest import REPO_ROOT


def _write(path, text: str):
    path.write_text(text)
    return path


def test_defaults_without_a_recipe_file():
    """The defaults `nsa-titan train --help` documents, not a second reading of the same dataclasses."""
    resolved = resolve([])
    assert resolved.path is None
    r = resolved.recipe
    assert (r.training.steps, r.training.seq_len, r.training.dtype, r.training.device) == (100, 256, "auto", "auto")
    assert (r.model.name, r.model.args.attention, r.model.args.nsa.backend) == ("transformer", "nsa", "reference")
    assert (r.optimizer.name, r.optimizer.lr, r.data.source) == ("adamw", 3e-4, "python_stdlib")


def test_a_recipe_that_names_no_run_is_named_after_its_file(tmp_path):
    """Not the defaults' debug run, whose folder (and checkpoints) it would take over."""
    (tmp_path / "base.toml").write_text('[job]\nname = "base"\n')
    (tmp_path / "my_run.toml").write_text("[optimizer]\nlr = 0.001\n")
    (tmp_path / "named.toml").write_text('extends = "base.toml"\n')
    (tmp_path / "placed.toml").write_text('[job]\ndump_folder = "runs/here"\n')
    (tmp_path / "renamed.toml").write_text('extends = "base.toml"\n[job]\nname = "mine"\n')
    (tmp_path / "moved.toml").write_text('extends = "placed.toml"\n[job]\nname = "mine"\n')
    runs = {name: resolve([str(tmp_path / f"{name}.toml")])
            for name in ("my_run", "named", "placed", "renamed", "moved")}
    jobs = {name: run.recipe.job for name, run in runs.items()}
    assert (jobs["my_run"].name, jobs["my_run"].dump_folder) == ("my_run", "./outputs/my_run")
    assert (jobs["placed"].name, jobs["placed"].dump_folder) == ("placed", "runs/here")
    assert (jobs["renamed"].name, jobs["renamed"].dump_folder) == ("mine", "./outputs/mine")
    # A run's name and folder are the recipe's own: extending a recipe does not train in (and resume) its run.
    assert (jobs["named"].name, jobs["named"].dump_folder) == ("named", "./outputs/named")
    assert (jobs["moved"].name, jobs["moved"].dump_folder) == ("mine", "./outputs/mine")
    assert any("job.name = 'base' in" in note and "not inherited" in note for note in runs["named"].notes)
    assert any("job.dump_folder = 'runs/here' in" in note for note in runs["moved"].notes)
    assert not any("inherited" in note for note in runs["renamed"].notes + runs["my_run"].notes)
    (tmp_path / "misnamed.toml").write_text('extends = "placed.toml"\n[job]\nname = 5\n')
    with pytest.raises(RecipeError, match="job.name"):  # the schema's message, not a crash in the note
        resolve([str(tmp_path / "misnamed.toml")])
    kept = resolve([str(tmp_path / "named.toml"), "--job.dump_folder=./outputs/base", "--job.name=base"])
    assert (kept.recipe.job.name, kept.recipe.job.dump_folder) == ("base", "./outputs/base")
    assert not any("inherited" in note for note in kept.notes)
    flagged = resolve([str(tmp_path / "my_run.toml"), "--job.name=trial"]).recipe.job
    assert (flagged.name, flagged.dump_folder) == ("trial", "./outputs/trial")
    assert resolve([]).recipe.job.dump_folder == "./outputs/debug"  # no recipe: the defaults


def test_precedence_cli_over_recipe_over_extends_over_defaults(tmp_path):
    (tmp_path / "base.toml").write_text("[training]\nsteps = 7\nseq_len = 32\nlocal_batch_size = 3\n")
    (tmp_path / "top.toml").write_text('extends = "base.toml"\n[training]\nseq_len = 48\n')
    recipe = resolve([str(tmp_path / "top.toml"), "--training.local_batch_size", "5"]).recipe
    assert recipe.training.steps == 7  # from the extended file
    assert recipe.training.seq_len == 48  # the recipe beats the file it extends
    assert recipe.training.local_batch_size == 5  # the command line beats both
    assert recipe.training.max_norm == 1.0  # the default


def test_later_extends_override_earlier(tmp_path):
    (tmp_path / "a.toml").write_text("[training]\nsteps = 1\nseq_len = 16\n")
    (tmp_path / "b.toml").write_text("[training]\nsteps = 2\n")
    (tmp_path / "top.toml").write_text('extends = ["a.toml", "b.toml"]\n')
    recipe = resolve([str(tmp_path / "top.toml")]).recipe
    assert (recipe.training.steps, recipe.training.seq_len) == (2, 16)


def test_a_later_layer_choosing_another_part_overrides_the_earlier_parts_table(tmp_path, capsys):
    (tmp_path / "preset.toml").write_text('[data]\nsource = "text_files"\n[data.text_files]\npaths = ["a.txt"]\n')
    (tmp_path / "top.toml").write_text('extends = "preset.toml"\n[data]\nsource = "synthetic"\n')
    resolved = resolve([str(tmp_path / "top.toml")])
    assert resolved.recipe.data.source == "synthetic"
    (note,) = [n for n in resolved.notes if not n.startswith("model.nsa.")]  # (the defaults' rows idle NSA branches)
    assert "[data.text_files] from" in note and "preset.toml is not used" in note and "top.toml" in note
    # The same from the command line, and the note reaches the user.
    (tmp_path / "plain.toml").write_text('[data]\nsource = "text_files"\n[data.text_files]\npaths = ["a.txt"]\n')
    assert cli.main(["train", str(tmp_path / "plain.toml"), "--data.source=synthetic", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "# note: [data.text_files] from" in out and "flag '--data.source=synthetic'" in out
    assert "text_files" not in out.split("\n", 3)[3]  # the resolved recipe holds only what is used


def test_dense_attention_from_the_command_line_overrides_the_recipes_nsa_settings():
    resolved = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--model.attention=dense"])
    assert resolved.recipe.model.args.attention == "dense"
    assert resolved.recipe.model.args.nsa == type(resolved.recipe.model.args.nsa)()  # not used, left at defaults
    (note,) = resolved.notes
    assert note.startswith("model.nsa from ") and "nsa_debug.toml is not used" in note
    # The saved recipe (every field written out, model.nsa at its defaults) resolves again, silently.
    assert resolve_text(resolved.toml).recipe == resolved.recipe and resolve_text(resolved.toml).notes == ()


def test_a_saved_recipe_that_a_newer_rule_refuses_still_reads(tmp_path, capsys):
    """An export's or a run's recipe was valid when written: sample, eval and plot must still read it when a
    later version refuses one of its settings (a TensorBoard folder outside the run, say); its fields and
    types must still read."""
    text = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml")]).toml.replace(
        'save_tb_folder = "tb"', 'save_tb_folder = "/shared/tb"')
    with pytest.raises(RecipeError, match="must be a folder inside job.dump_folder"):
        resolve([str(_write(tmp_path / "r.toml", text))])
    saved = resolve_text(text)
    assert saved.recipe.metrics.save_tb_folder == "/shared/tb"
    assert [n for n in saved.notes if "no longer passes a check" in n and "metrics.save_tb_folder" in n]
    with pytest.raises(RecipeError, match="training.steps"):
        resolve_text(text.replace("steps = 500", 'steps = "many"'))
    # Sample, eval and plot read it through read_saved_recipe, which says so.
    capsys.readouterr()
    assert read_saved_recipe(text, "model.pt").metrics.save_tb_folder == "/shared/tb"
    assert "note: model.pt: the saved recipe no longer passes a check: " in capsys.readouterr().err


def test_a_saved_recipes_problems_name_where_it_was_saved_not_the_defaults():
    """A field of a saved recipe (an export's, a run's) or of saved model arguments that no longer reads is
    named as theirs: it was put down to 'defaults', which no one wrote."""
    from nsa_titan.rebuild import model_arguments

    text = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml")]).toml
    with pytest.raises(RecipeError) as saved:
        resolve_text(text.replace('backend = "reference"', 'backend = "mine"'))
    with pytest.raises(RecipeError) as arguments:
        model_arguments(registry.get("model", "transformer"), {"nsa": {"backend": "mine"}}, "out/hf/config.json")
    for caught, where in ((saved, "saved recipe"), (arguments, "out/hf/config.json")):
        assert f"  - {where}: model.nsa.backend = 'mine': must be one of" in caught.value.render()


def test_a_parts_table_in_the_same_layer_as_another_choice_is_an_error(tmp_path):
    (tmp_path / "r.toml").write_text('[data]\nsource = "synthetic"\n[data.text_files]\npaths = ["a.txt"]\n')
    with pytest.raises(RecipeError, match="would be ignored"):
        resolve([str(tmp_path / "r.toml")])
    # Flags are one layer, whatever their order; a table with the default choice is an error too.
    for flags in (["--data.text_files.paths=a.txt", "--data.source=synthetic"],
                  ["--data.source=synthetic", "--data.text_files.paths=a.txt"],
                  ["--data.text_files.paths=a.txt"]):
        with pytest.raises(RecipeError, match="data.text_files.*would be ignored"):
            resolve(flags)


def test_override_types():
    recipe = resolve(["--optimizer.lr=3e-4", "--compile.enable=true", "--optimizer.betas=0.8,0.99",
                      "--job.plugins=", "--training.dtype=bfloat16", "--model.nsa.num_selected=3",
                      "--checkpoint.enable=false"]).recipe
    assert recipe.optimizer.lr == pytest.approx(3e-4)
    assert recipe.compile.enable is True
    assert recipe.optimizer.betas == [0.8, 0.99]
    assert recipe.job.plugins == []
    assert recipe.training.dtype == "bfloat16"
    assert recipe.model.args.nsa.num_selected == 3
    assert recipe.checkpoint.enable is False


def test_print_config_round_trips(tmp_path, capsys):
    argv = [os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--training.steps=31"]
    assert cli.main(["train", *argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    first = resolve(argv)
    assert printed.startswith(f"# resolved recipe, hash {first.hash}")
    (tmp_path / "again.toml").write_text(printed)
    again = resolve([str(tmp_path / "again.toml")])
    assert again.recipe == first.recipe and again.hash == first.hash


# A valid non-default value for every scalar field of the fixed sections: field -> (value, the flags it needs
# to be valid, the world size to resolve for). The hash is compared with that of the same context without the
# field's flag, so a needed companion flag cannot be what changed it.
_CHANGED_FIELDS = {
    "job.name": ("other", (), 1),
    "job.description": ("a run", (), 1),
    "job.dump_folder": ("./outputs/elsewhere", (), 1),
    "job.seed": ("7", (), 1),
    "job.plugins": ("json", (), 1),  # any importable module
    # The only model registered by default is the transformer: a test plugin registers another.
    "model.name": ("eager_transformer", ("--job.plugins=tests.plugins.breaking_model",), 1),
    "parallelism.data_parallel_shard_degree": ("1", (), 1),
    # With shard -1 and one process, replicate can only be 1 or -1, and -1 needs a fixed shard degree.
    "parallelism.data_parallel_replicate_degree": ("-1", ("--parallelism.data_parallel_shard_degree=1",), 1),
    # Needs a world size it divides (with one process it is refused).
    "parallelism.context_parallel_degree": ("2", (), 2),
    "parallelism.fsdp_single_process": ("true", (), 1),
    # A flag for these in one process without fsdp_single_process is refused as ignored.
    "parallelism.fsdp_reshard_after_forward": ("always", ("--parallelism.fsdp_single_process=true",), 1),
    "parallelism.init_timeout_seconds": ("60", ("--parallelism.fsdp_single_process=true",), 1),
    "data.source": ("synthetic", (), 1),
    "data.tokenizer": ("tiktoken", (), 1),
    "data.logical_shards": ("32", (), 1),
    "data.num_workers": ("2", (), 1),
    "data.prefetch_factor": ("4", ("--data.num_workers=1",), 1),  # no effect (refused) without workers
    "data.pin_memory": ("false", (), 1),
    "data.add_bos": ("true", (), 1),
    "data.min_document_tokens": ("5", (), 1),
    "training.steps": ("99", (), 1),
    "training.seq_len": ("128", (), 1),
    "training.local_batch_size": ("4", (), 1),
    "training.global_batch_size": ("16", (), 1),  # a multiple of local_batch_size x 1
    "training.max_norm": ("0.5", (), 1),
    "training.device": ("cpu", (), 1),
    "training.dtype": ("float32", (), 1),
    "training.gc_freq": ("0", (), 1),
    "optimizer.name": ("muon", (), 1),
    "optimizer.lr": ("0.001", (), 1),
    "optimizer.betas": ("0.8,0.99", (), 1),
    "optimizer.eps": ("1e-6", (), 1),
    "optimizer.weight_decay": ("0.0", (), 1),
    "lr_scheduler.warmup_steps": ("10", (), 1),
    "lr_scheduler.decay_type": ("linear", (), 1),
    "lr_scheduler.decay_steps": ("50", (), 1),
    "lr_scheduler.min_lr_factor": ("0.2", (), 1),
    "checkpoint.enable": ("true", (), 1),
    "checkpoint.folder": ("ckpt", (), 1),
    # Flags for these are refused while checkpoint.enable is false.
    "checkpoint.interval": ("50", ("--checkpoint.enable=true",), 1),
    "checkpoint.keep_latest_k": ("5", ("--checkpoint.enable=true",), 1),
    "checkpoint.load_step": ("20", ("--checkpoint.enable=true",), 1),
    "checkpoint.async_mode": ("async", ("--checkpoint.enable=true",), 1),
    "checkpoint.data_mismatch": ("restart", ("--checkpoint.enable=true",), 1),
    "checkpoint.initial_load_path": ("weights/step-10", (), 1),
    "metrics.log_freq": ("5", (), 1),
    "metrics.enable_tensorboard": ("true", (), 1),
    "metrics.save_tb_folder": ("board", ("--metrics.enable_tensorboard=true",), 1),
    "metrics.enable_wandb": ("true", (), 1),
    "metrics.wandb_project": ("other", ("--metrics.enable_wandb=true",), 1),
    "metrics.wandb_mode": ("offline", ("--metrics.enable_wandb=true",), 1),
    "metrics.telemetry_freq": ("5", (), 1),  # the default model (nsa) has telemetry
    "metrics.peak_tflops": ("100.0", (), 1),
    "validation.enable": ("true", (), 1),
    "validation.freq": ("20", ("--validation.enable=true",), 1),
    "validation.steps": ("3", ("--validation.enable=true",), 1),
    "compile.enable": ("true", (), 1),
    "compile.fullgraph": ("false", ("--compile.enable=true",), 1),
    "compile.backend": ("eager", ("--compile.enable=true",), 1),
    "compile.mode": ("max-autotune-no-cudagraphs", ("--compile.enable=true",), 1),
    "activation_checkpoint.mode": ("full", (), 1),
    "activation_checkpoint.selective_every": ("3", ("--activation_checkpoint.mode=selective",), 1),
    "fault.step_timeout_seconds": ("60.0", (), 1),
    "fault.first_step_timeout_seconds": ("600.0", (), 1),
    "fault.max_bad_steps": ("2", (), 1),
    "profiling.enable": ("true", (), 1),
    "profiling.start_step": ("5", ("--profiling.enable=true",), 1),
    "profiling.steps": ("2", ("--profiling.enable=true",), 1),
    "profiling.folder": ("traces", ("--profiling.enable=true",), 1),
    # Records the CUDA allocator over the profiled steps: needs profiling on and a device other than cpu.
    "profiling.memory_snapshot": ("true", ("--profiling.enable=true",), 1),
}
# The arguments of the parts the defaults choose (the transformer, python_stdlib; the byte tokenizer and adamw
# take none), in the tables the recipe writes them in.
_CHANGED_PART_ARGS = {
    "model.dim": ("512", (), 1),
    "model.n_layers": ("2", (), 1),
    "model.n_heads": ("8", (), 1),  # still divides dim 256 into an even head dim
    "model.n_kv_heads": ("1", (), 1),
    "model.mlp_ratio": ("3.0", (), 1),
    "model.multiple_of": ("32", (), 1),
    "model.norm_eps": ("1e-6", (), 1),
    "model.rope_theta": ("500000.0", (), 1),
    "model.max_seq_len": ("1024", (), 1),  # still >= training.seq_len
    "model.attention": ("dense", (), 1),
    "model.document_masking": ("true", (), 1),
    "model.tie_embeddings": ("true", (), 1),
    "model.init_std": ("0.01", (), 1),
    "model.nsa.block_size": ("64", (), 1),  # still <= sel_block_size, a multiple of block_stride
    "model.nsa.block_stride": ("32", (), 1),  # still divides block_size and sel_block_size
    "model.nsa.sel_block_size": ("128", (), 1),
    "model.nsa.num_selected": ("8", (), 1),
    "model.nsa.window_size": ("256", (), 1),
    "model.nsa.compress": ("mean", (), 1),
    "model.nsa.kv_per_branch": ("false", (), 1),
    "model.nsa.gate": ("linear", (), 1),
    "model.nsa.backend": ("triton", (), 1),
    "data.python_stdlib.validation_fraction": ("0.1", (), 1),
}
# Fields left out, and why (none at present).
_UNCHANGED_FIELDS: dict[str, str] = {}


def _scalar_fields_of_fixed_sections():
    from nsa_titan.config.schema import Recipe

    found = []
    for section in dataclasses.fields(Recipe):
        for fld in dataclasses.fields(section.default_factory):
            if "args_for" not in fld.metadata:  # a part's arguments, not a scalar of the section
                found.append(f"{section.name}.{fld.name}")
    return found


def _fields_of_default_parts(recipe):
    """Dotted keys of every leaf argument of the parts `recipe` chose, as the recipe and its flags spell them."""
    found = []

    def walk(prefix, args):
        for fld in dataclasses.fields(args):
            value = getattr(args, fld.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}.{fld.name}", value)
            else:
                found.append(f"{prefix}.{fld.name}")

    for section in dataclasses.fields(recipe):
        table = getattr(recipe, section.name)
        for fld in dataclasses.fields(table):
            args = getattr(table, fld.name)
            if "args_for" in fld.metadata and args is not None:
                inline = fld.metadata["placement"] == "inline"
                walk(section.name if inline else f"{section.name}.{getattr(table, fld.metadata['args_for'])}", args)
    return found


def _value_at(recipe, key):
    """The value of a dotted recipe key, reading a part's arguments where the key names them."""
    obj = recipe
    for name in key.split("."):
        if any(fld.name == name and "args_for" not in fld.metadata for fld in dataclasses.fields(obj)):
            obj = getattr(obj, name)
            continue
        for fld in dataclasses.fields(obj):  # a part's arguments: inline here, or the table named after the part
            args = getattr(obj, fld.name)
            if "args_for" not in fld.metadata or args is None:
                continue
            if fld.metadata["placement"] == "inline" and hasattr(args, name):
                obj = getattr(args, name)
                break
            if fld.metadata["placement"] == "table" and getattr(obj, fld.metadata["args_for"]) == name:
                obj = args
                break
        else:
            raise KeyError(key)
    return obj


def test_hash_changes_with_any_field():
    changes = {**_CHANGED_FIELDS, **_CHANGED_PART_ARGS}
    assert len(changes) == len(_CHANGED_FIELDS) + len(_CHANGED_PART_ARGS)
    default = resolve([])
    fields = _scalar_fields_of_fixed_sections() + _fields_of_default_parts(default.recipe)
    assert len(fields) > 90 and len(set(fields)) == len(fields)
    assert set(changes).isdisjoint(_UNCHANGED_FIELDS)
    assert set(changes) | set(_UNCHANGED_FIELDS) == set(fields)  # a new field is given a value or a reason
    assert default.hash == resolve([]).hash
    assert len(default.hash) == 12
    hashes = {}
    for key, (value, context, world_size) in changes.items():
        base = resolve(list(context), world_size=world_size)
        changed = resolve([*context, f"--{key}={value}"], world_size=world_size)
        before, after = _value_at(base.recipe, key), _value_at(changed.recipe, key)
        assert after != before, (key, before)  # the value given is not the one already there
        assert changed.hash != base.hash, key
        assert changed.hash != default.hash, key
        if not context:
            assert base.hash == default.hash, key  # the world size is not part of the hash
        hashes[key] = changed.hash
    assert len(set(hashes.values())) == len(hashes)  # and no two changes collide


def test_dumps_parses_back():
    table = {"a": {"x": 1, "y": 2.5, "z": "q\"uote ü", "b": [1, 2], "t": True, "n": {"k": 1e-8}}}
    assert tomllib.loads(dumps(table)) == table


def test_help_lists_every_field(capsys):
    text = help_text()
    for section in ("job", "model", "parallelism", "data", "training", "optimizer", "lr_scheduler", "checkpoint",
                    "metrics", "validation", "compile", "activation_checkpoint"):
        assert f"[{section}]" in text
    for flag in ("--training.steps: int = 100", "--model.nsa.block_size: int", "--optimizer.betas: list[float]",
                 "--checkpoint.async_mode: str", "--model.attention: str"):
        assert flag in text
    assert cli.main(["train", "--help"]) == 0
    assert "--training.global_batch_size" in capsys.readouterr().out


def test_help_lists_the_fields_of_a_plugins_parts():
    """A fresh process (this one may have imported the plugin already): --help imports the plugins the
    recipe and flags name before it lists the fields, and names one it cannot import."""
    import subprocess
    import sys

    from tests.launch import env

    argv = [sys.executable, "-m", "nsa_titan.cli", "train", "recipes/debug.toml", "--help"]
    done = subprocess.run([*argv, "--job.plugins=tests.plugins.oom_at_step"], capture_output=True, text=True,
                          env=env(), cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0 and "--model.oom_at_step: int = 3" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([*argv, "--job.plugins=no_such_plugin"], capture_output=True, text=True, env=env(),
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0 and "--training.steps: int" in done.stdout
    assert "'no_such_plugin': could not be imported" in done.stderr and "Its parts are not listed" in done.stderr


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO_ROOT, "recipes", "*.toml"))))
def test_shipped_recipes_validate(path):
    # Every layout rule too, at the smallest world the recipe's context parallelism needs.
    cp = resolve([path], world_size=None).recipe.parallelism.context_parallel_degree
    resolved = resolve([path], world_size=cp)
    assert resolved.recipe.model.name == "transformer"
    assert resolved.recipe.model.args.document_masking  # every shipped recipe attends within documents


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO_ROOT, "recipes", "**", "*.toml"), recursive=True)))
def test_shipped_recipes_that_name_run_train_sh_name_the_installed_command_too(path):
    """An installed copy (the nsa-titan console script) has no ./run_train.sh: a recipe comment telling how to launch
    it says both ways, as the README does."""
    comments, block = [], []
    with open(path, encoding="utf-8") as fh:
        for line in [*fh, ""]:
            if line.startswith("#"):
                block.append(line)
            elif block:
                comments, block = [*comments, "".join(block)], []
    for comment in comments:
        if "run_train.sh" in comment:
            assert "nsa-titan" in comment or "nsa_titan.launch" in comment, comment


@pytest.mark.parametrize("name, row, millions", [("dense_125m", "dense_125m", 153), ("nsa_125m", "nsa_125m", 177),
                                                ("nsa_125m_32k", "nsa_125m", 177), ("nsa_125m_128k", "nsa_125m", 177)])
def test_shipped_125m_models_build_with_the_parameters_the_readme_states(name, row, millions):
    """Built on the meta device with the GPT-2 vocabulary their tokenizer has (50257): the counts README.md and
    presets/model_125m.toml give, 77M of them in the untied embedding and output tables."""
    from nsa_titan import assemble

    recipe = resolve([os.path.join(REPO_ROOT, "recipes", f"{name}.toml")], world_size=None).recipe
    assert (recipe.data.tokenizer, recipe.data.tokenizer_args.encoding) == ("tiktoken", "gpt2")
    model = assemble.build_model_on_meta(recipe, 50257)
    assert round(assemble.count_parameters(model) / 1e6) == millions
    tables = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in ("tok_embeddings", "output"))
    assert round(tables / 1e6) == 77
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as fh:
        said = next(line for line in fh if line.startswith(f"| `recipes/{row}.toml`"))
    assert f"{millions}M parameters" in said


def test_document_masking_is_off_unless_a_recipe_says_so():
    from components.models import TransformerArgs

    assert TransformerArgs().document_masking is False  # older recipes and checkpoints keep their meaning
    off = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--model.document_masking=false"])
    assert off.recipe.model.args.document_masking is False


def test_nsa_and_dense_125m_differ_only_in_attention():
    nsa = resolve([os.path.join(REPO_ROOT, "recipes", "nsa_125m.toml")]).recipe
    dense = resolve([os.path.join(REPO_ROOT, "recipes", "dense_125m.toml")]).recipe
    assert nsa.model.args.attention == "nsa" and dense.model.args.attention == "dense"
    assert (nsa.model.args.dim, nsa.model.args.n_layers, nsa.model.args.n_heads) == (768, 12, 12)
    assert nsa.training == dense.training and nsa.optimizer == dense.optimizer
    nsa_args = nsa.model.args.nsa
    assert (nsa_args.block_size, nsa_args.block_stride, nsa_args.sel_block_size, nsa_args.num_selected,
            nsa_args.window_size) == (32, 16, 64, 16, 512)


def test_plugin_registers_a_part(tmp_path, monkeypatch):
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(
        "from nsa_titan.registry import register\n"
        "from components.optim import build_adamw\n"
        "register('optimizer', 'my_adamw', build_adamw, replace=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        recipe = resolve(["--job.plugins=my_parts", "--optimizer.name=my_adamw"]).recipe
        assert recipe.optimizer.name == "my_adamw"
        assert "my_adamw" in registry.available("optimizer")
    finally:
        registry._PARTS["optimizer"].pop("my_adamw", None)
        sys.modules.pop("my_parts", None)


def test_plugin_registers_an_attention_backend(tmp_path, monkeypatch, capsys):
    plugin = tmp_path / "my_backend.py"
    plugin.write_text(
        "from components.nsa import nsa_attention\n"
        "from nsa_titan.registry import register\n"
        "CALLS = []\n"
        "def attention(*args, **hyper):\n"
        "    CALLS.append(1)\n"
        "    return nsa_attention(*args, backend='reference', **hyper)\n"
        "register('attention_backend', 'counting', attention, replace=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from components.nsa import unregister_backend
    from tests.launch import DEBUG, TINY

    try:
        argv = [DEBUG, *TINY, "--training.steps=2", "--job.plugins=my_backend", "--model.nsa.backend=counting",
                f"--job.dump_folder={tmp_path / 'run'}"]
        assert cli.main(["train", *argv]) == 0
        assert len(sys.modules["my_backend"].CALLS) >= 2 * 2  # two layers, two steps
        code = cli.main(["train", DEBUG, "--model.nsa.backend=countin", "--job.plugins=my_backend"])
        err = capsys.readouterr().err
        assert code == 2 and "did you mean 'counting'" in err
    finally:
        unregister_backend("counting")
        sys.modules.pop("my_backend", None)


def test_a_built_in_backend_cannot_be_replaced():
    with pytest.raises(ValueError, match="built in"):
        registry.register("attention_backend", "reference", lambda *a, **k: None, replace=True)
    assert registry.get("attention_backend", "reference").doc.startswith("built-in")


def test_a_list_flag_takes_commas_or_a_toml_list(tmp_path):
    """--data.text_files.paths=["a", "b"], as a recipe writes it, is the list [a, b], not the patterns '["a"' and
    '"b"]'; [] is the empty list."""
    def paths(value: str) -> list[str]:
        argv = [str(tmp_path / "r.toml"), "--data.source=text_files", f"--data.text_files.paths={value}"]
        (tmp_path / "r.toml").write_text("[training]\nsteps = 1\n")
        return resolve(argv).recipe.data.source_args.paths

    assert paths("a.txt,b.txt") == paths('["a.txt", "b.txt"]') == paths("[ 'a.txt' , 'b.txt' ]") == ["a.txt", "b.txt"]
    with pytest.raises(RecipeError, match="no files given"):  # [] is read as the empty list, which the source refuses
        paths("[]")
    assert resolve([str(tmp_path / "r.toml"), "--optimizer.betas=[0.8, 0.9]"]).recipe.optimizer.betas == [0.8, 0.9]
    with pytest.raises(RecipeError, match="is read as a TOML list, and it is not one"):
        paths('["a.txt", "b.txt"')
    with pytest.raises(RecipeError, match="optimizer.betas"):  # a list of the wrong item type is the field's problem
        resolve([str(tmp_path / "r.toml"), '--optimizer.betas=["x", "y"]'])
    assert paths('["[ab]*.txt"]') == ["[ab]*.txt"]  # a pattern of its own that starts with [, in a TOML list
    # job.plugins, imported before the recipe is read, takes the same forms
    assert resolve([str(tmp_path / "r.toml"), '--job.plugins=["json", "csv"]']).recipe.job.plugins == ["json", "csv"]


def test_a_run_folder_spelled_another_way_is_no_recipe_change(tmp_path, monkeypatch):
    """Trained with --job.dump_folder=$PWD/outputs/debug, exported with the recipe's ./outputs/debug: the same
    folder was named a change of job.dump_folder. Another folder, or another setting, still is one."""
    from nsa_titan.run_folder import recipe_changes, write_run_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "debug").mkdir(parents=True)
    absolute = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"),
                        f"--job.dump_folder={tmp_path}/outputs/debug"])
    write_run_recipe("outputs/debug", absolute)
    relative = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--job.dump_folder=./outputs/debug"])
    assert recipe_changes("outputs/debug", relative) == []
    changed = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--job.dump_folder=./outputs/debug",
                       "--training.steps=7"])
    assert recipe_changes("outputs/debug", changed) == ["training.steps: 500 -> 7"]
    (tmp_path / "moved").mkdir()
    (tmp_path / "outputs" / "debug" / "recipe.toml").rename(tmp_path / "moved" / "recipe.toml")
    moved = resolve([os.path.join(REPO_ROOT, "recipes", "debug.toml"), "--job.dump_folder=moved"])
    [change] = recipe_changes("moved", moved)  # a long path is cut short
    assert change.startswith(f"job.dump_folder: '{str(tmp_path)[:20]}") and change.endswith(" -> 'moved'"), change


def test_a_recipe_files_settings_of_a_switched_off_feature_are_said_to_wait(tmp_path, capsys):
    """A file may keep a feature's settings for when a flag turns it on; a training run says they are not used (a
    flag for them is refused, tests/test_config_errors.py), and says nothing once the feature is on."""
    debug = os.path.join(REPO_ROOT, "recipes", "debug.toml")
    recipe = _write(tmp_path / "off.toml", f'extends = "{debug}"\n[checkpoint]\nenable = false\ninterval = 100\n'
                                           f'keep_latest_k = 5\n[profiling]\nstart_step = 2\n')
    assert cli.main(["train", str(recipe), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert (f"# note: checkpoint.interval = 100 from {recipe}, checkpoint.keep_latest_k = 5 from {recipe} wait for "
            f"checkpoint.enable, which is false ({recipe}): not used in this run") in out, out
    assert (f"# note: profiling.start_step = 2 from {recipe} waits for profiling.enable, which is false (defaults): "
            f"not used in this run") in out, out
    assert cli.main(["train", str(recipe), "--print-config", "--profiling.enable=true",
                     "--checkpoint.enable=true"]) == 0
    out = capsys.readouterr().out
    assert "not used in this run" not in out and "start_step = 2" in out and "interval = 100" in out
