"""Bad recipes and overrides: each gives exit code 2 and a message naming source, field, value and fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from nsa_titan import cli
from nsa_titan.config import resolve
from tests.conftest import REPO_ROOT
from tests.launch import DEBUG

BASE = """
[job]
dump_folder = "{dump}"

[model]
dim = 64
n_layers = 1
n_heads = 4
n_kv_heads = 2
max_seq_len = 128

[model.nsa]
block_size = 16
block_stride = 8
sel_block_size = 32
num_selected = 2
window_size = 32

[training]
steps = 2
seq_len = 64
local_batch_size = 2
"""


def write(tmp_path, text: str, name: str = "recipe.toml", base: bool = True) -> str:
    path = tmp_path / name
    body = (BASE.format(dump=tmp_path / "out") if base else "") + textwrap.dedent(text)
    path.write_text(body)
    return str(path)


def run_cli(capsys, args: list[str]) -> tuple[int, str]:
    code = cli.main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.err


# (name, recipe text appended to BASE (None: BASE alone), overrides, expected fragments of the message)
CASES = [
    ("unknown section", "[trainig]\nsteps = 3\n", [], ["trainig", "is not a recipe field", "did you mean 'training'",
                                                      "Fix: remove it, or correct the section's name"]),
    # It said 'see `nsa-titan train --help` for the fields of [top level]', which has none.
    ("a field without its section", "", ["--steps=3", "--lr=0.01"],
     ["steps: is not a recipe field. Fix: name it with its section: profiling.steps or training.steps or "
      "validation.steps.", "lr: is not a recipe field. Fix: name it with its section: optimizer.lr."]),
    ("unknown key", "[metrics]\nlog_frq = 3\n", [], ["metrics.log_frq", "did you mean 'log_freq'"]),
    ("string for int", "[checkpoint]\ninterval = \"ten\"\n", [], ["checkpoint.interval", "expected a whole number", "'ten'"]),
    ("float for int", "[metrics]\nlog_freq = 1.5\n", [], ["metrics.log_freq", "expected a whole number"]),
    ("bool for int", "[validation]\nsteps = true\n", [], ["validation.steps", "expected a whole number", "True"]),
    ("out of range", "[validation]\nfreq = 0\n", [], ["validation.freq", "must be at least 1"]),
    ("choice", "[compile]\nbackend = \"tvm\"\n", [], ["compile.backend", "must be one of", "inductor"]),
    ("bad dtype choice", "", ["--training.dtype=fp8"], ["training.dtype", "must be one of", "bfloat16", "flag"]),
    ("unknown model", "", ["--model.name=gpt"], ["model.name", "is not a registered model", "transformer"]),
    ("unknown source", "[data]\nsource = \"s3\"\n", [], ["data.source", "is not a registered data_source", "python_stdlib"]),
    ("table for another source", "[data.text_files]\npaths = [\"a.txt\"]\n", [],
     ["data.text_files", "would be ignored", "data.source = 'text_files'"]),
    ("unknown tokenizer", "", ["--data.tokenizer=sentencepiece"], ["data.tokenizer", "registered tokenizer", "byte"]),
    ("stride does not divide block", "", ["--model.nsa.block_stride=5"],
     ["model.nsa.block_stride", "must divide block_size"]),
    ("sel block smaller than block", "", ["--model.nsa.sel_block_size=8"], ["model.nsa.sel_block_size", "block_size"]),
    ("heads do not divide dim", "", ["--model.n_heads=5"], ["model.n_heads", "must divide dim"]),
    ("a prime dim no heads divide", "", ["--model.dim=65"], ["model.n_heads", "must divide dim (65)",
                                                             "a multiple of 2 x n_heads (an even head dim), e.g. 64 "
                                                             "or 72"]),
    ("kv heads do not divide heads", "", ["--model.n_kv_heads=3"], ["model.n_kv_heads", "must divide n_heads"]),
    ("global batch not divisible", "", ["--training.global_batch_size=5"],
     ["training.global_batch_size", "not a multiple of", "local_batch_size"]),
    ("validation fraction beside a validation split", "", ["--data.source=huggingface",
                                                           "--data.huggingface.validation_split=test",
                                                           "--data.huggingface.validation_fraction=0.001"],
     ["data.huggingface.validation_fraction", "is not used: validation_split = 'test'"]),
    ("override without dashes", "", ["training.steps=5"],
     ["argument 'training.steps=5'", "without its leading --", "--training.steps=5"]),
    ("empty dump folder", "", ["--job.dump_folder="], ["job.dump_folder", "is empty", "./outputs/<job.name>"]),
    ("checkpoints outside the run", "", ["--checkpoint.folder=/elsewhere/ckpt"],
     ["checkpoint.folder", "must be a folder inside job.dump_folder", "such as 'checkpoint'"]),
    ("checkpoints in the run folder itself", "", ["--checkpoint.folder=./"],
     ["checkpoint.folder = './'", "not '.'", "such as 'checkpoint'"]),
    ("profile above the run", "", ["--profiling.enable=true", "--profiling.folder=../profile"],
     ["profiling.folder", "must be a folder inside job.dump_folder", "such as 'profile'"]),
    ("events inside the checkpoints", "", ["--metrics.enable_tensorboard=true",
                                           "--metrics.save_tb_folder=checkpoint/step-3"],
     ["metrics.save_tb_folder = 'checkpoint/step-3'", "lies inside checkpoint.folder = 'checkpoint'",
      "checkpoint steps are moved aside and pruned", "e.g. 'tb'"]),
    ("checkpoints holding the events", "", ["--metrics.enable_tensorboard=true", "--checkpoint.folder=runs",
                                            "--metrics.save_tb_folder=runs/tb"],
     ["metrics.save_tb_folder = 'runs/tb'", "lies inside checkpoint.folder = 'runs'"]),
    ("profile in the stack dumps", "", ["--profiling.enable=true", "--profiling.folder=stacks"],
     ["profiling.folder = 'stacks'", "lies in the run's stacks/ folder, which the trainer writes itself",
      "e.g. 'profile'"]),
    ("global batch of no samples", "", ["--training.global_batch_size=0"],
     ["training.global_batch_size", "would train on no samples", "use -1 or a multiple of"]),
    ("bos token without add_bos", "[data]\ntokenizer = \"hf_tokenizer\"\n[data.hf_tokenizer]\npath = \"t.json\"\n"
     "bos_token = \"<s>\"\n", [], ["data.hf_tokenizer.bos_token", "data.add_bos is false", "set data.add_bos = true"]),
    ("seq_len beyond model", "", ["--training.seq_len=256"], ["training.seq_len", "max_seq_len = 128"]),
    ("dense with nsa settings", "", ["--model.attention=dense", "--model.nsa.num_selected=3"],
     ["flag '--model.nsa.num_selected=3'", "model.nsa", "would be ignored", "remove that flag", "attention = 'nsa'"]),
    ("unknown override", "", ["--training.step=5"], ["training.step", "did you mean 'steps'"]),
    ("bad int override", "", ["--training.steps=abc"], ["training.steps", "expected a whole number", "'abc'"]),
    ("bad bool override", "", ["--compile.enable=yes"], ["compile.enable", "expected true or false"]),
    # A folder named '~' was made where the run started; the weights' path was "does not exist" though it did.
    ("dump folder under a tilde", "", ["--job.dump_folder=~/runs/x"],
     ["job.dump_folder = '~/runs/x': starts with '~', which is not read as the home folder",
      "--job.dump_folder=$HOME/runs/x"]),
    ("initial weights under a tilde", "", ["--checkpoint.initial_load_path=~/ck/step-8"],
     ["checkpoint.initial_load_path = '~/ck/step-8': starts with '~'", "=$HOME/ck/step-8"]),
    ("override without value", "", ["--training.steps"], ["training.steps", "has no value",
                                                          "write --training.steps=VALUE"]),
    ("boolean override without value", "", ["--compile.enable"], ["compile.enable", "has no value",
                                                                  "--compile.enable=true or --compile.enable=false"]),
    # a word alone is never a field: named for what it is, not told to take =VALUE
    ("a word alone", "", ["--version"], ["flag '--version'", "version: is not a recipe field",
                                         "name a field with its section"]),
    ("a field's name alone", "", ["--steps"], ["flag '--steps'", "steps: is not a recipe field",
                                               "training.steps"]),
    ("a section alone", "", ["--compile"], ["flag '--compile'", "compile: is a table, not a value",
                                            "--compile.FIELD=VALUE"]),
    ("a section given a value", "", ["--compile=true"], ["compile: is a table, not a value", "--compile.FIELD=VALUE"]),
    ("override of a table", "", ["--training=5"], ["training", "is a table"]),
    ("override below a value", "", ["--training.steps.x=5"], ["training.steps", "is a value, not a table"]),
    ("not an override", "", ["-x"], ["'-x'", "is not an override"]),
    ("an empty argument", "", [""], ["is an empty recipe path", "name the recipe file"]),
    ("print-config misspelled", "", ["--print_config"], ["is not an option (did you mean --print-config?)"]),
    ("print-config with a value", "", ["--print-config=true"], ["takes no value", "write --print-config alone"]),
    ("two recipes", "", ["other.toml"], ["a second recipe path"]),
    ("betas wrong length", "[optimizer]\nbetas = [0.9]\n", [], ["optimizer.betas", "two numbers"]),
    ("betas not a list", "[optimizer]\nbetas = 0.9\n", [], ["optimizer.betas", "expected a list"]),
    ("keep one checkpoint", "[checkpoint]\nkeep_latest_k = 1\n", [], ["checkpoint.keep_latest_k", "use 2 or more"]),
    ("infinite lr in a file", "[optimizer]\nlr = inf\n", [], ["optimizer.lr = inf", "finite number"]),
    ("nan in a file", "[fault]\nstep_timeout_seconds = nan\n", [], ["fault.step_timeout_seconds = nan", "finite"]),
    ("infinite lr flag", "", ["--optimizer.lr=inf"], ["flag '--optimizer.lr=inf'", "finite number, got inf"]),
    ("negative infinity flag", "", ["--training.max_norm=-inf"], ["training.max_norm", "finite number, got -inf"]),
    ("nan in a list", "", ["--optimizer.betas=0.9,nan"], ["optimizer.betas", "finite number, got nan"]),
    ("no betas", "", ["--optimizer.betas="], ["optimizer.betas", "must be two numbers"]),
    ("no betas in a file", "[optimizer]\nbetas = []\n", [], ["optimizer.betas", "must be two numbers"]),
    ("min lr factor above one", "[lr_scheduler]\nmin_lr_factor = 1.5\n", [], ["lr_scheduler.min_lr_factor", "at most 1.0"]),
    ("min lr with constant", "[lr_scheduler]\ndecay_type = \"constant\"\nmin_lr_factor = 0.2\n", [],
     ["lr_scheduler.min_lr_factor", "no effect"]),
    ("decay steps with constant", "", ["--lr_scheduler.decay_type=constant", "--lr_scheduler.decay_steps=10"],
     ["lr_scheduler.decay_steps", "no effect with decay_type = 'constant'"]),
    ("min lr at its default value with constant", "", ["--lr_scheduler.decay_type=constant",
                                                       "--lr_scheduler.min_lr_factor=0.1"],
     ["flag '--lr_scheduler.min_lr_factor=0.1'", "no effect with decay_type = 'constant'"]),
    ("decay of no steps", "", ["--lr_scheduler.decay_steps=0"], ["lr_scheduler.decay_steps", "a decay of no steps",
                                                                 "or, for no decay, decay_type = 'constant' without "
                                                                 "decay_steps"]),
    ("unknown schedule", "[lr_scheduler]\ndecay_type = \"cosin\"\n", [], ["lr_scheduler.decay_type", "did you mean 'cosine'"]),
    ("prefetch without workers", "[data]\nprefetch_factor = 4\n", [], ["data.prefetch_factor", "without worker processes"]),
    ("selective_every without selective", "[activation_checkpoint]\nselective_every = 3\n", [],
     ["activation_checkpoint.selective_every", "mode = 'selective'"]),
    ("negative workers", "[data]\nnum_workers = -1\n", [], ["data.num_workers", "at least 0"]),
    ("seed beyond 64 bits", "", ["--job.seed=99999999999999999999999"], ["job.seed", "beyond a 64-bit integer"]),
    ("model size beyond 64 bits", "", ["--model.dim=-99999999999999999999999"],
     ["model.dim", "beyond a 64-bit integer"]),
    ("too many logical shards", "", ["--data.logical_shards=1000000"], ["data.logical_shards", "at most 65536"]),
    ("plugin missing", "", ["--job.plugins=no_such_module_xyz"], ["job.plugins", "could not be imported"]),
    ("empty run name", "", ["--job.name="], ["job.name = ''", "is empty: a run needs a name"]),
    ("full-width digits", "", ["--training.steps=１２"], ["training.steps", "expected a whole number, got '１２'"]),
    ("unknown optimizer", "", ["--optimizer.name=lion"], ["optimizer.name", "adamw"]),
    ("byte tokenizer takes no arguments", "[data.byte]\nx = 1\n", [], ["data.byte", "takes no arguments"]),
    ("compile mode of another backend", "[compile]\nbackend = \"aot_eager\"\nmode = \"max-autotune-no-cudagraphs\"\n",
     [], ["compile.mode", "a mode of the inductor backend", "aot_eager"]),
    ("cuda graphs on the cpu", "", ["--compile.enable=true", "--compile.mode=reduce-overhead", "--training.device=cpu"],
     ["compile.mode", "replays CUDA graphs", "training.device is 'cpu'"]),
    ("cuda graphs with fsdp", "", ["--compile.enable=true", "--compile.mode=max-autotune",
                                   "--parallelism.fsdp_single_process=true"],
     ["compile.mode", "FSDP2 gathers them", "max-autotune-no-cudagraphs"]),
    ("checkpoint flag with checkpoints off", "[checkpoint]\nenable = false\n", ["--checkpoint.interval=7"],
     ["checkpoint.interval", "checkpoint.enable is false", "--checkpoint.enable=true"]),
    ("validation flag with validation off", "[validation]\nenable = false\n", ["--validation.freq=5"],
     ["validation.freq", "validation.enable is false", "--validation.enable=true"]),
    # Training ignores them with the switch off, though inspect compiles and eval validates whatever it says.
    ("compile flags with compile off", "", ["--compile.backend=aot_eager", "--compile.fullgraph=false"],
     ["compile.backend", "compile.fullgraph", "compile.enable is false", "--compile.enable=true"]),
    ("a CUDA-graph mode with compile off", "", ["--compile.mode=max-autotune", "--compile.backend=aot_eager"],
     ["the recipe has 2 problems", "compile.mode = 'max-autotune': is set on the command line but compile.enable is "
      "false"]),  # one problem per flag: not also the mode's checks against a backend that never compiles
    ("a glob starting with [", "", ["--data.source=text_files", "--data.text_files.paths=[ab]*.txt"],
     ["the recipe has 1 problem", "starts with '[', so it is read as a TOML list", '\'["[ab]*.txt", "c.txt"]\'']),
    ("validation steps with validation off", "[validation]\nenable = false\n", ["--validation.steps=3"],
     ["validation.steps", "validation.enable is false", "--validation.enable=true"]),
    ("profiling flag with profiling off", "", ["--profiling.steps=2"],
     ["profiling.steps", "profiling.enable is false", "--profiling.enable=true"]),
    ("tensorboard folder with tensorboard off", "[metrics]\nenable_tensorboard = false\n",
     ["--metrics.save_tb_folder=boards"], ["metrics.save_tb_folder", "metrics.enable_tensorboard is false"]),
    ("wandb project with wandb off", "", ["--metrics.wandb_project=mine"],
     ["metrics.wandb_project", "metrics.enable_wandb is false", "--metrics.enable_wandb=true"]),
    ("checkpoint flag at its default with checkpoints off", "[checkpoint]\nenable = false\n",
     ["--checkpoint.interval=500"], ["checkpoint.interval", "checkpoint.enable is false"]),
    ("prefetch flag at its default without workers", "", ["--data.prefetch_factor=2"],
     ["data.prefetch_factor", "without worker processes"]),
    ("selective_every flag at its default", "", ["--activation_checkpoint.selective_every=2"],
     ["activation_checkpoint.selective_every", "mode = 'selective'"]),
    ("reshard choice at its default without sharding", "", ["--parallelism.fsdp_reshard_after_forward=default"],
     ["parallelism.fsdp_reshard_after_forward", "shards nothing"]),
    ("reshard choice without sharding", "", ["--parallelism.fsdp_reshard_after_forward=never"],
     ["parallelism.fsdp_reshard_after_forward", "shards nothing", "--parallelism.fsdp_single_process=true"]),
    ("zero replicate degree", "", ["--parallelism.data_parallel_replicate_degree=0"],
     ["parallelism.data_parallel_replicate_degree = 0: a degree", "-1 (to fill what the others leave) or at least 1"]),
    ("start-up timeout in one process", "", ["--parallelism.init_timeout_seconds=10"],
     ["parallelism.init_timeout_seconds", "starts no process group"]),
    ("impossible degrees", "[parallelism]\ndata_parallel_shard_degree = 2\ndata_parallel_replicate_degree = 2\n", [],
     ["parallelism.data_parallel_shard_degree", "world size is 1"]),
    ("a float for a whole number", "[validation]\nenable = true\nsteps = 64.0\n", ["--model.nsa.block_size=16.0"],
     ["got '16.0'. Fix: write an integer such as 16.", "such as 64, without quotes"]),
    # Found before the model is built (the kernels refused it at their first call; compiled, as a graph break).
    ("a head too wide for the Triton kernels", "", ["--model.nsa.backend=triton", "--model.dim=512",
                                                    "--model.n_heads=1", "--model.n_kv_heads=1"],
     ["model.n_heads = 1: gives head dim dim/n_heads = 512, above the 256 NSA backend 'triton' supports",
      "use at least 2 heads (or a smaller dim), or backend 'reference'"]),
]


@pytest.mark.parametrize("name,text,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_recipe_is_reported(tmp_path, capsys, name, text, overrides, expected):
    path = write(tmp_path, text)
    code, err = run_cli(capsys, [path, *overrides])
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("error: the recipe has")
    for fragment in expected:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"
    assert "Fix:" in err


@pytest.mark.parametrize("text, flags, fix, not_said", [
    # a recipe file cannot say $HOME, nor take a flag's form
    ("[checkpoint]\ninitial_load_path = \"~/ck/step-8\"\n", [],
     f"Fix: write the path in full, e.g. checkpoint.initial_load_path = '{os.path.expanduser('~/ck/step-8')}', or",
     ["--checkpoint", "$HOME", "shell"]),
    # another user's home is not $HOME
    ("", ["--job.dump_folder=~root/runs/x"],
     f"Fix: write the path in full, e.g. --job.dump_folder={os.path.expanduser('~root/runs/x')}, or", ["$HOME"]),
    ("", ["--job.dump_folder=~no_such_user_here/x"],
     "Fix: write the path in full ('~no_such_user_here' names no user known here), or", ["$HOME"]),
])
def test_a_tilde_path_is_refused_with_the_fix_for_where_it_was_written(tmp_path, capsys, text, flags, fix, not_said):
    """The fix was --FIELD=$HOME/... for every '~' path: a flag's form for a value written in a recipe file, and
    the user's own home for '~bob/x', bob's."""
    code, err = run_cli(capsys, [write(tmp_path, text), *flags])
    problem = next(line for line in err.splitlines() if "starts with '~'" in line)
    assert code == 2 and fix in problem, err
    assert not any(word in problem for word in not_said), problem


@pytest.mark.parametrize("recipe_tables, named", [(True, "(its tables: 'web', 'code')"),
                                                  (False, "(NAME: a name of your choice)")])
def test_a_flag_naming_the_named_tables_field_shows_their_fields_form(tmp_path, capsys, recipe_tables, named):
    """--data.mixture.sources alone was told to write --data.mixture.sources.FIELD=VALUE (or, with no tables in the
    recipe, [data.mixture.sources.NAME] as in a file): its fields sit one name further down."""
    text = "[data]\nsource = \"mixture\"\n" + ("".join(
        f"[data.mixture.sources.{name}]\nsource = \"python_stdlib\"\nweight = 1.0\n" for name in ("web", "code"))
        if recipe_tables else "")
    code, err = run_cli(capsys, [write(tmp_path, text), "--data.mixture.sources"])
    assert code == 2, err
    assert ("flag '--data.mixture.sources': data.mixture.sources: is a table, not a value. Fix: override a field of "
            f"one of its tables, e.g. --data.mixture.sources.NAME.FIELD=VALUE {named}.") in err, err


@pytest.mark.parametrize("flags, note", [
    (["--model.nsa.block_size=512", "--model.nsa.sel_block_size=512"],
     "model.nsa.block_size = 512 is more than max_seq_len = 256: no row holds a compressed block"),
    (["--model.nsa.num_selected=3"], "model.nsa.num_selected = 3: the blocks always selected"),
    (["--model.nsa.num_selected=100"], "model.nsa.num_selected = 100: a row of max_seq_len = 256 tokens holds at "
                                       "most 8 selection blocks of 32"),
    (["--model.nsa.window_size=256"], "model.nsa.window_size = 256 is at least max_seq_len = 256: the "
                                      "sliding-window branch is full causal attention"),
])
def test_an_nsa_shape_in_which_a_branch_never_acts_is_a_note(flags, note):
    """Legal by the spec, so no error; but a designer wants to know the branch (or the choice by score) is idle."""
    resolved = resolve([DEBUG, *flags])
    assert [n for n in resolved.notes if n.startswith("model.nsa")] == [next(n for n in resolved.notes if note in n)]


def test_training_rows_shorter_than_the_model_can_idle_a_branch_too():
    """A 32k recipe scaled down with training.seq_len alone: the model's own notes (max_seq_len) say nothing, but
    every training row is 512 tokens, as long as the window, and holds 8 selection blocks of the 16 asked for."""
    resolved = resolve([f"{REPO_ROOT}/recipes/nsa_125m_32k.toml", "--model.nsa.backend=reference",
                        "--training.seq_len=512"], world_size=8)
    assert [n for n in resolved.notes if n.startswith("model.")] == [
        "model.nsa.num_selected = 16: a row of training.seq_len = 512 tokens holds at most 8 selection blocks of 64, "
        "so the selected branch attends to all of a row's past and the slots beyond those stay unused",
        "model.nsa.window_size = 512 is at least training.seq_len = 512: the sliding-window branch is full causal "
        "attention"]
    # said once, as the model's, where max_seq_len is as short
    both = resolve([DEBUG, "--model.nsa.window_size=256"]).notes
    assert len([n for n in both if "window_size" in n]) == 1, both


def test_the_shipped_recipes_have_no_idle_nsa_branch():
    for name in sorted(os.listdir(os.path.join(REPO_ROOT, "recipes"))):
        if name.endswith(".toml"):
            notes = resolve([os.path.join(REPO_ROOT, "recipes", name)], world_size=None).notes
            assert not [n for n in notes if n.startswith("model.")], (name, notes)


def test_warmup_longer_than_the_run_is_a_note_not_an_error(tmp_path):
    """A run shortened to try something still runs: it ends in warmup, and says so."""
    path = write(tmp_path, "[lr_scheduler]\nwarmup_steps = 10\n[checkpoint]\nenable = false\n")
    proc = subprocess.run([sys.executable, "-m", "nsa_titan.cli", "train", path, "--model.dim=32", "--model.n_heads=2",
                           "--model.n_kv_heads=1", "--training.seq_len=32", "--data.logical_shards=4"],
                          capture_output=True, text=True, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    note = next(line for line in proc.stdout.splitlines() if line.startswith("note: lr_scheduler.warmup_steps"))
    assert "= 10 from" in note and "longer than the run (training.steps = 2)" in note and "20% of optimizer.lr" in note
    assert "decay_steps" not in proc.stdout  # the default decay needs no note
    assert "step 2/2" in proc.stdout


@pytest.mark.parametrize("warmup, steps, peak", [(700, 1, "0.143"), (2000, 1999, "99.9"), (10, 5, "50"),
                                                 (30, 20, "66.7"), (700, 2, "0.286"), (3000, 2999, "99.9")])
def test_a_warmup_longer_than_the_run_names_its_peak_to_three_figures(tmp_path, warmup, steps, peak):
    """nsa_125m shortened to one step said the learning rate 'peaks at 0% of optimizer.lr' (1/700 is 0.1428...%);
    2 of 3 is 66.7%, not 66.6% (it was rounded down throughout); one step short of the warmup is not 100%."""
    notes = resolve([write(tmp_path, f"[lr_scheduler]\nwarmup_steps = {warmup}\n"), f"--training.steps={steps}"]).notes
    note = next(n for n in notes if n.startswith(f"lr_scheduler.warmup_steps = {warmup}"))
    assert note.endswith(f"peaks at {peak}% of optimizer.lr"), note


def test_warmup_as_long_as_the_run_says_there_is_no_decay():
    """Not that a shorter decay_steps still ends at min_lr_factor: no step is left after warmup to decay in."""
    notes = resolve([DEBUG, "--training.steps=4", "--lr_scheduler.warmup_steps=4", "--lr_scheduler.decay_steps=2"],
                    world_size=1).notes
    assert [n for n in notes if "lr_scheduler" in n] == [
        "lr_scheduler.warmup_steps = 4 from flag '--lr_scheduler.warmup_steps=4' is the whole run (training.steps = "
        "4): the learning rate reaches optimizer.lr at the last step, and there is no decay"], notes


@pytest.mark.parametrize("flag", ["--compile.enable=true", "--activation_checkpoint.mode=full"])
def test_compiling_a_model_without_blocks_is_an_error_not_a_no_op(tmp_path, capsys, flag):
    plugin = os.path.join(REPO_ROOT, "tests", "plugins", "breaking_model.py")
    code, err = run_cli(capsys, [write(tmp_path, ""), f"--job.plugins={plugin}", "--model.name=blockless_transformer",
                                 flag])
    assert code == 2, err
    assert "names no blocks" in err and flag.split("=")[0].lstrip("-") in err and "Fix:" in err
    assert "Traceback" not in err


def test_a_plugin_string_in_a_recipe_is_a_type_error_not_an_import(tmp_path, capsys):
    """A flag's text is a list (comma-separated); a recipe's string is not, and the module it names is not
    imported either (it would register parts for a recipe that is refused)."""
    marker = tmp_path / "imported"
    (tmp_path / "marking_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    plugin = str(tmp_path / "marking_plugin.py")
    recipe = write(tmp_path, "")
    text = open(recipe).read().replace("[job]\n", f'[job]\nplugins = "{plugin}"\n')
    open(recipe, "w").write(text)
    code, err = run_cli(capsys, [recipe])
    assert code == 2, err
    assert "job.plugins" in err and "list" in err and not marker.exists()
    code, err = run_cli(capsys, [write(tmp_path, ""), f"--job.plugins={plugin}", "--training.steps=abc"])
    assert code == 2 and marker.exists()  # the flag's text is read as a list of one


def test_every_problem_is_reported_at_once(tmp_path, capsys):
    path = write(tmp_path, "[trainig]\nsteps = 3\n[metrics]\nlog_freq = 0\n")
    code, err = run_cli(capsys, [path, "--training.steps=abc"])
    assert code == 2
    assert "3 problems" in err
    assert "trainig" in err and "metrics.log_freq" in err and "training.steps" in err


@pytest.mark.parametrize("flag, expected", [
    ("--version", "version: is not a recipe field"),
    ("--dry-run", "dry-run: is not a recipe field"),
    ("--training.stepz", "training.stepz: is not a recipe field (did you mean 'steps'?)"),
])
def test_a_flag_without_a_value_that_names_no_field_is_refused_as_unknown(tmp_path, capsys, flag, expected):
    # It was told "has no value. Fix: write --version=VALUE": a value for a field that does not exist.
    code, err = run_cli(capsys, [write(tmp_path, ""), flag])
    assert code == 2
    assert expected in err, err
    assert "has no value" not in err and "=VALUE" not in err, err


def test_problem_names_the_file_it_came_from(tmp_path, capsys):
    base = write(tmp_path, "[metrics]\nlog_freq = -3\n", name="base.toml", base=False)
    top = tmp_path / "top.toml"
    top.write_text(f'extends = ["{os.path.basename(base)}"]\n' + BASE.format(dump=tmp_path / "out"))
    code, err = run_cli(capsys, [str(top)])
    assert code == 2
    assert "base.toml: metrics.log_freq = -3" in err


def test_a_switched_off_table_names_the_file_that_wrote_it_beside_the_switch(tmp_path, capsys, monkeypatch):
    """A child recipe that chooses dense attention and writes its own [model.nsa] is told so at its own path, not
    at the extended recipe's, whose table the choice overrides (that one alone is only a note)."""
    write(tmp_path, "", name="base.toml")
    child = tmp_path / "child.toml"
    child.write_text('extends = "base.toml"\n[model]\nattention = "dense"\n[model.nsa]\nblock_size = 16\n')
    code, err = run_cli(capsys, [str(child)])
    assert code == 2
    assert f"{child}: model.nsa: is set but model.attention = 'dense'" in err, err
    child.write_text('extends = "base.toml"\n[model]\nattention = "dense"\n')
    monkeypatch.chdir(tmp_path)  # the child is a run of its own, in ./outputs/child
    assert run_cli(capsys, [str(child)])[0] == 0


def test_section_that_is_not_a_table(tmp_path, capsys):
    path = write(tmp_path, "model = 3\n", base=False)
    code, err = run_cli(capsys, [path])
    assert code == 2 and "model = 3: must be a table" in err


def test_invalid_toml(tmp_path, capsys):
    path = tmp_path / "broken.toml"
    path.write_text("[training\nsteps = 3\n")
    code, err = run_cli(capsys, [str(path)])
    assert code == 2 and "is not valid TOML" in err and "broken.toml" in err


def test_a_flag_given_twice_takes_the_last_and_says_so():
    resolved = resolve(["--training.steps=3", "--training.steps", "5"])
    assert resolved.recipe.training.steps == 5
    # (the built-in defaults' 256-token rows also idle NSA branches of the model's 2048: notes of their own)
    assert [n for n in resolved.notes if not n.startswith("model.nsa.")] == [
        "training.steps is set twice on the command line: '--training.steps 5' replaces '--training.steps=3'"]


def test_a_flag_a_switch_flag_turns_off_is_told_to_go_not_to_turn_the_switch_back_on():
    """Told 'add --metrics.enable_wandb=true' after a fix's --metrics.enable_wandb=false, the user went round in a
    loop; the fix now follows the switch the command line chose."""
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError) as raised:
        resolve(["--metrics.enable_wandb=true", "--metrics.wandb_mode=offline", "--metrics.enable_wandb=false"])
    assert "Fix: remove this flag (flag '--metrics.enable_wandb=false' turns it off)" in str(raised.value)
    assert "add --metrics.enable_wandb=true" not in str(raised.value)
    followed = resolve(["--metrics.enable_wandb=true", "--metrics.enable_wandb=false"])
    assert followed.recipe.metrics.enable_wandb is False


def test_a_refused_command_line_says_which_of_a_flag_given_twice_counted(capsys):
    """The note on a flag given twice was said only when the recipe resolved: refused for the flag the later one
    switched off, the user saw the refusal without being told the earlier --metrics.enable_wandb=true was replaced."""
    code, err = run_cli(capsys, [DEBUG, "--print-config", "--metrics.enable_wandb=true", "--metrics.wandb_mode=offline",
                                 "--metrics.enable_wandb=false"])
    note = ("note: metrics.enable_wandb is set twice on the command line: '--metrics.enable_wandb=false' replaces "
            "'--metrics.enable_wandb=true'")
    assert code == 2 and err.count(note) == 1, err
    assert err.index("--metrics.wandb_mode=offline': metrics.wandb_mode") < err.index(note), err


@pytest.mark.parametrize("name, refused", [("../elsewhere", True), (".", True), ("/abs", True),
                                           ("ablations/w64", False)])
def test_a_run_name_that_names_a_folder_outside_outputs_is_refused(tmp_path, name, refused):
    """Where the recipe names no dump folder, job.name names ./outputs/<job.name>: it must stay inside."""
    from nsa_titan.config import RecipeError

    path = tmp_path / "unnamed.toml"
    path.write_text('extends = ["%s"]\n' % os.path.join(REPO_ROOT, "recipes", "presets", "model_debug.toml"))
    if refused:
        with pytest.raises(RecipeError, match=f"job.name = '{re.escape(name)}': names the run's folder "):
            resolve([str(path), f"--job.name={name}"])
    else:
        assert resolve([str(path), f"--job.name={name}"]).recipe.job.dump_folder == f"./outputs/{name}"
    # beside a dump folder of its own, a name is only a name
    assert resolve([str(path), f"--job.name={name}", "--job.dump_folder=./outputs/x"]).recipe.job.name == name


@pytest.mark.parametrize("text", ["", "# a comment only\n", "[training]\n[model.nsa]\n"])
def test_a_recipe_that_sets_nothing_is_refused_as_no_recipe_is(tmp_path, capsys, text):
    """An empty (or truncated) file trained the built-in defaults' model without a word, where naming no recipe
    is refused: an extended file that sets nothing is refused the same way."""
    path = tmp_path / "empty.toml"
    path.write_text(text)
    code, err = run_cli(capsys, [str(path), f"--job.dump_folder={tmp_path / 'out'}"])
    assert code == 2 and "empty.toml: recipe: sets nothing (it is empty, or holds only comments and empty tables)" \
        ": a run of it would train the built-in defaults. Fix: write the recipe's fields in it" in err, err
    assert not (tmp_path / "out").exists()
    code, err = run_cli(capsys, [write(tmp_path, 'extends = ["empty.toml"]\n[training]\nsteps = 1\n', name="outer.toml",
                                       base=False)])
    assert code == 2 and "empty.toml: recipe: sets nothing" in err, err


def test_a_binary_file_named_as_the_recipe_is_told_apart(tmp_path, capsys):
    """An exported model was told to check its permissions and encoding (UTF-8)."""
    import torch

    exported = tmp_path / "model.pt"
    torch.save({"weights": torch.zeros(2)}, exported)
    code, err = run_cli(capsys, [str(exported)])
    assert code == 2 and "model.pt: recipe: is a zip archive (an exported model, as `export` writes one?), not a " \
        "recipe. Fix: name the run's recipe (TOML); `sample`, `eval` and `plot` read an exported model" in err, err
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(bytes([0x83, 0xFF, 0x00]))
    code, err = run_cli(capsys, [str(garbage)])
    assert code == 2 and "garbage.toml: recipe: cannot be read as text: 'utf-8' codec can't decode byte 0x83" in err
    assert "Fix: a recipe is TOML text in UTF-8" in err and "permissions" not in err, err


def test_missing_recipe_file(tmp_path, capsys):
    code, err = run_cli(capsys, [str(tmp_path / "nope.toml")])
    assert code == 2 and "file not found" in err and "nope.toml" in err
    code, err = run_cli(capsys, [str(tmp_path)])
    assert code == 2 and "is a folder, not a recipe file" in err


def test_extends_missing_file(tmp_path, capsys):
    path = write(tmp_path, 'extends = ["presets/absent.toml"]\n', base=False)
    code, err = run_cli(capsys, [path])
    assert code == 2 and "absent.toml" in err and "file not found" in err
    # named as the extends entry of that file, read relative to its folder (not 'recipes live in recipes/')
    assert f"extends = '{tmp_path / 'presets' / 'absent.toml'}': file not found. Fix: an extends entry is a path " \
           f"relative to " in err and "recipes/" not in err, err


def test_extends_cycle(tmp_path, capsys):
    (tmp_path / "a.toml").write_text('extends = ["b.toml"]\n')
    (tmp_path / "b.toml").write_text('extends = ["a.toml"]\n')
    code, err = run_cli(capsys, [str(tmp_path / "a.toml")])
    assert code == 2 and "cycle" in err


def test_workers_must_have_shards_to_read(tmp_path):
    from nsa_titan.config import RecipeError, resolve

    path = write(tmp_path, "[data]\nlogical_shards = 8\nnum_workers = 4\n")
    with pytest.raises(RecipeError) as info:
        resolve([path], world_size=4)
    assert "data.num_workers" in info.value.render() and "2 logical shards" in info.value.render()


def test_logical_shards_must_split_over_ranks(tmp_path):
    from nsa_titan.config import RecipeError, resolve

    path = write(tmp_path, "[data]\nlogical_shards = 3\n")
    with pytest.raises(RecipeError) as info:
        resolve([path], world_size=2)
    assert "data.logical_shards" in info.value.render() and "data-parallel size 2" in info.value.render()
    assert "or a data-parallel size that divides 3 (1 or 3)" in info.value.render()


@pytest.mark.parametrize("world,flags,expected", [
    (4, ["--parallelism.data_parallel_replicate_degree=3"],
     "flag '--parallelism.data_parallel_replicate_degree=3': parallelism.data_parallel_replicate_degree = 3: the world "
     "size 4 is not divisible by the fixed degree 3"),
    (2, ["--parallelism.data_parallel_replicate_degree=-1"],
     "flag '--parallelism.data_parallel_replicate_degree=-1': parallelism.data_parallel_replicate_degree = -1: only "
     "one of the two degrees"),
    (4, ["--parallelism.data_parallel_replicate_degree=-1", "--parallelism.data_parallel_shard_degree=3"],
     "flag '--parallelism.data_parallel_shard_degree=3': parallelism.data_parallel_shard_degree = 3: the world size 4"),
])
def test_a_layout_problem_names_the_degree_that_was_set(world, flags, expected):
    """Not the shard degree left at its default when the replicate degree is the one given."""
    from nsa_titan.config import RecipeError, resolve

    with pytest.raises(RecipeError) as info:
        resolve([DEBUG, *flags], world_size=world)
    assert expected in info.value.render(), info.value.render()


def test_a_layout_that_does_not_resolve_adds_no_problems_computed_from_a_guessed_data_parallel_size():
    """cp = 2 on 3 processes: one problem; not also a global batch and logical shards judged against a
    data-parallel size of 3, which ignores the context parallelism and would send the user after wrong fixes."""
    from nsa_titan.config import RecipeError, resolve

    with pytest.raises(RecipeError) as info:
        resolve([DEBUG, "--parallelism.context_parallel_degree=2", "--training.global_batch_size=2"], world_size=3)
    assert [p.field for p in info.value.problems] == ["parallelism.context_parallel_degree"], info.value.render()


@pytest.mark.parametrize("flags,expected", [
    (["--parallelism.fsdp_single_process=true"],
     "parallelism.fsdp_single_process = true: is set on the command line, but it only applies to a job of one process"),
    (["--parallelism.data_parallel_replicate_degree=2", "--parallelism.fsdp_reshard_after_forward=never"],
     "parallelism.fsdp_reshard_after_forward = 'never': is set on the command line, but data_parallel_shard_degree "
     "is 1 (DDP"),
])
def test_parallelism_flags_that_would_do_nothing_on_several_processes_are_refused(flags, expected):
    from nsa_titan.config import RecipeError, resolve

    with pytest.raises(RecipeError) as info:
        resolve([DEBUG, *flags], world_size=2)
    assert expected in info.value.render(), info.value.render()
    # 'always' frees DDP's gathered low-precision copies: it does something
    resolve([DEBUG, "--parallelism.data_parallel_replicate_degree=2",
             "--parallelism.fsdp_reshard_after_forward=always"], world_size=2)


def test_process_exit_code_and_no_traceback(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 0\n", base=False)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-m", "nsa_titan.cli", "train", path], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "training.steps = 0: must be at least 1" in proc.stderr


def test_every_field_says_only_what_the_checks_read():
    """A metadata key no check reads (say a bound spelled 'max') would be ignored without a word: every field
    of the recipe schema and of every registered part's arguments carries known keys only."""
    import dataclasses
    import typing

    from components.problems import FIELD_METADATA
    from nsa_titan import registry
    from nsa_titan.config.schema import Recipe

    seen, stack = set(), [Recipe]
    stack += [registry.get(kind, name).args for kind in registry.KINDS for name in registry.available(kind)
              if kind != "attention_backend"]
    checked = 0
    while stack:
        cls = stack.pop()
        if cls is None or cls in seen or not dataclasses.is_dataclass(cls):
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for fld in dataclasses.fields(cls):
            assert set(fld.metadata) <= FIELD_METADATA, (cls.__name__, fld.name, set(fld.metadata) - FIELD_METADATA)
            checked += 1
            stack += [t for t in (hints[fld.name], *typing.get_args(hints[fld.name])) if isinstance(t, type)]
    assert checked > 100


@pytest.mark.parametrize("flag,expected", [("--optimizer.muon.momentum=1", "must be less than 1.0"),
                                           ("--optimizer.muon.ns_steps=0", "must be at least 1"),
                                           ("--optimizer.muon.adjust_lr=spectral", "must be one of")])
def test_muon_arguments_are_checked(flag, expected):
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError, match=f"optimizer.muon.*{expected}"):
        resolve(["recipes/debug.toml", "--optimizer.name=muon", flag])


def test_muon_arguments_without_muon_are_refused():
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError, match=r"optimizer.muon") as error:
        resolve(["recipes/debug.toml", "--optimizer.muon.ns_steps=3"])
    assert "adamw" in str(error.value)


def test_an_nsa_flag_at_its_default_on_a_dense_recipe_is_refused(capsys):
    """The dense recipe holds no [model.nsa]: a flag for it is refused at the default value too."""
    dense = os.path.join(REPO_ROOT, "recipes", "debug_dense.toml")
    assert cli.main(["train", dense, "--model.nsa.num_selected=16", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "flag '--model.nsa.num_selected=16'" in err and "would be ignored" in err, err


def test_an_action_another_command_ignores_is_refused(tmp_path, capsys):
    """--print-config is train's: doctor (or export, eval, inspect) would ignore it, so it is a problem."""
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError, match="is not an option of this command"):
        resolve([write(tmp_path, ""), "--print-config"])
    assert resolve([write(tmp_path, ""), "--print-config"], actions=("print_config",)).command_line.actions == \
        {"print_config"}


def test_a_recipe_path_through_a_broken_link_says_so(tmp_path, capsys):
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    code, err = run_cli(capsys, [str(loop)])
    assert code == 2 and "is a symbolic link that leads to no file" in err, err


@pytest.mark.parametrize("flag,shown", [("--model.nsa.sel_block_size=0", "model.nsa.sel_block_size = 0: must be at least 1"),
                                        ("--optimizer.lr=-1", "optimizer.lr = -1.0: must be greater than 0.0"),
                                        ("--training.steps=x", "training.steps = 'x': expected a whole number"),
                                        ("--training.max_norm=inf", "finite number, got inf. Fix: write a finite "
                                                                    "number such as 1.0.")])
def test_a_flag_out_of_range_shows_the_number_it_was_read_as(flag, shown):
    """A flag's text that reads as a number but breaks a bound is shown as that number (0, not '0'); text that
    does not read as the field's type is shown as typed."""
    from nsa_titan.config.errors import RecipeError

    with pytest.raises(RecipeError) as error:
        resolve(["recipes/debug.toml", flag])
    assert shown in str(error.value), str(error.value)


@pytest.mark.parametrize("text,flag,note,default", [
    ("[data]\nnum_workers = 2\nprefetch_factor = 4\n", "--data.num_workers=0",
     "data.prefetch_factor = 4 from {path} is not used: flag '--data.num_workers=0' set data.num_workers = 0",
     "prefetch_factor = 2"),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_every = 3\n", "--activation_checkpoint.mode=full",
     "activation_checkpoint.selective_every = 3 from {path} is not used: flag '--activation_checkpoint.mode=full' set "
     "activation_checkpoint.mode = \"full\"", "selective_every = 2"),
    ("[lr_scheduler]\nmin_lr_factor = 0.2\n", "--lr_scheduler.decay_type=constant",
     "lr_scheduler.min_lr_factor = 0.2 from {path} is not used: flag '--lr_scheduler.decay_type=constant' set "
     "lr_scheduler.decay_type = \"constant\"", "min_lr_factor = 0.1"),
])
def test_a_flag_that_turns_a_feature_off_notes_the_files_setting_for_it(tmp_path, text, flag, note, default):
    """A recipe file's prefetch_factor under a flag's num_workers = 0 (a shipped 125M recipe scaled down on a CPU)
    is a later layer's choice: a note, not a refusal no flag could mend; the recipe the run writes holds the
    field's default, so it reads back."""
    from nsa_titan.config.resolve import resolve_text

    path = write(tmp_path, text)
    resolved = resolve([path, flag])
    assert note.format(path=path) in resolved.notes, resolved.notes
    assert default in resolved.toml.splitlines()
    assert resolve_text(resolved.toml).notes == ()


def test_profiling_the_first_step_of_a_compiled_run_is_said_to_profile_compilation():
    notes = resolve([DEBUG, "--compile.enable=true", "--profiling.enable=true", "--profiling.start_step=1",
                     "--profiling.steps=1"]).notes
    assert any(n.startswith("profiling.start_step = 1 from flag") and "mostly compilation" in n for n in notes), notes
    notes = resolve([DEBUG, "--compile.enable=true", "--profiling.enable=true", "--profiling.start_step=2",
                     "--profiling.steps=1"]).notes
    assert not any("mostly compilation" in n for n in notes), notes
