"""A damaged or hand-edited checkpoint, met by every command that reads one (train's resume and
checkpoint.initial_load_path, export, eval): one message naming the file and the way on, exit 2, nothing lost."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from nsa_titan import cli
from nsa_titan.run_folder import LOCK_FILE
from tests.launch import DEBUG, TINY, forget_model_fields
from tests.launch import metrics as read_metrics
from tests.test_checkpoint import _damage_metadata, _damage_shard, forget_checksums

# One layer and checkpoints on, over TINY's values (a field may be given once).
BASE = [DEBUG, *(f for f in TINY if not f.startswith(("--model.n_layers=", "--checkpoint.enable="))),
        "--model.n_layers=1", "--checkpoint.enable=true", "--training.local_batch_size=2",
        "--training.global_batch_size=4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run with complete checkpoints at steps 2 and 4 (each test damages a copy)."""
    folder = tmp_path_factory.mktemp("damage") / "run"
    assert cli.main(["train", *BASE, "--training.steps=4", "--checkpoint.interval=2",
                     f"--job.dump_folder={folder}"]) == 0
    return folder


@pytest.fixture
def run(saved, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(saved, folder)
    capsys.readouterr()
    return folder


def step_dir(folder, step):
    return os.path.join(folder, "checkpoint", f"step-{step}")


def edit_json(path, name, **changes):
    file = os.path.join(path, name)
    with open(file) as fh:
        record = json.load(fh)
    with open(file, "w") as fh:
        json.dump({**record, **changes}, fh)


def refused(capsys, code, *words):
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    for word in words:
        assert word in err, (word, err)
    return err


def listing(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)


def train(folder, *extra):
    return cli.main(["train", *BASE, "--training.steps=6", f"--job.dump_folder={folder}", *extra])


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no checksums"])
@pytest.mark.parametrize("damage", [_damage_shard, _damage_metadata], ids=["cut shard", "garbage metadata"])
def test_initial_load_path_of_a_damaged_step_names_the_file(run, tmp_path, capsys, damage, checksums):
    if not checksums:
        forget_checksums(step_dir(run, 4))
    name = damage(step_dir(run, 4))
    code = train(tmp_path / "new", f"--checkpoint.initial_load_path={step_dir(run, 4)}")
    refused(capsys, code, "checkpoint.initial_load_path", "cannot be read", name, "step-2", "Fix:")


def test_initial_load_path_into_another_shape_names_the_tensors(run, tmp_path, capsys):
    """The step's train_state.json names the fields that trained it, wherever the folder is; a step of an
    older release without them, moved away from its run's recipe.toml, gets the tensors named."""
    (tmp_path / "kept").mkdir()  # a folder made before the run (a scheduler's, say) is not this run's to remove
    code = train(tmp_path / "kept", "--model.dim=64", f"--checkpoint.initial_load_path={step_dir(run, 4)}")
    refused(capsys, code, "holds weights trained with other model fields: model.dim = 32 there, 64 here",
            os.path.join(step_dir(run, 4), "train_state.json"), "Fix:")
    assert (tmp_path / "kept").is_dir()
    (tmp_path / "kept" / "mine.txt").write_text("a file of the user's")  # nor one reached through a new '..'
    code = train(f"{tmp_path}/missing/../kept", "--model.dim=64", f"--checkpoint.initial_load_path={step_dir(run, 4)}")
    refused(capsys, code, "holds weights trained with other model fields")
    assert (tmp_path / "kept" / "mine.txt").read_text() == "a file of the user's"
    moved = tmp_path / "moved" / "step-4"
    shutil.copytree(step_dir(run, 4), moved)
    code = train(tmp_path / "new", "--model.dim=64", f"--checkpoint.initial_load_path={moved}")
    refused(capsys, code, "holds weights trained with other model fields: model.dim = 32 there, 64 here",
            os.path.join(moved, "train_state.json"))
    forget_model_fields(moved)
    code = train(tmp_path / "new", "--model.dim=64", f"--checkpoint.initial_load_path={moved}")
    said = capsys.readouterr()
    assert code == 2 and said.err.count("error:") == 1 and "Traceback" not in said.err, said.err
    assert ("does not fit this model" in said.err and "model.tok_embeddings.weight is [258, 32] in the checkpoint but "
            "[258, 64] here" in said.err), said.err
    assert f"note: the model fields that trained the weights in {moved} are not recorded" in said.out, said.out
    assert "(its recipe.toml, in its run folder)" in said.err, said.err  # none lies above the moved step
    nested = tmp_path / "nested" / "ckpt" / "deep" / "step-4"  # a checkpoint.folder of several levels
    shutil.copytree(moved, nested)
    shutil.copy(os.path.join(run, "recipe.toml"), tmp_path / "nested" / "recipe.toml")
    code = train(tmp_path / "new", "--model.dim=64", f"--checkpoint.initial_load_path={nested}")
    said = capsys.readouterr()
    assert code == 2 and f"({tmp_path / 'nested' / 'recipe.toml'})" in said.err, said.err


def test_initial_load_path_that_is_not_a_step_folder_names_what_it_takes(run, tmp_path, capsys):
    exported = tmp_path / "model.pt"
    exported.write_bytes(b"an export")
    code = train(tmp_path / "new", f"--checkpoint.initial_load_path={exported}")
    refused(capsys, code, "is a file; it takes a folder (an exported .pt file is for sample, eval and plot)",
            "`nsa-titan export --format hf`")
    for folder in (run, run / "checkpoint"):  # a run, or its checkpoints: which step?
        code = train(tmp_path / "new", f"--checkpoint.initial_load_path={folder}")
        refused(capsys, code, "holds the checkpoints of a run, not one of them",
                f"Fix: name the step to start from, e.g. '{step_dir(run, 4)}'")
    # Each refused start made the run folder and removed it again: the next run finds no refused session's records.
    assert not (tmp_path / "new").exists()


def test_initial_load_path_missing_or_interrupted(run, tmp_path, capsys):
    code = train(tmp_path / "new", f"--checkpoint.initial_load_path={tmp_path / 'nowhere'}")
    refused(capsys, code, "does not exist", "Fix:")
    os.remove(os.path.join(step_dir(run, 4), "COMPLETE"))
    code = train(tmp_path / "new", f"--checkpoint.initial_load_path={step_dir(run, 4)}")
    refused(capsys, code, "COMPLETE", "interrupted", "step-2", "Fix:")


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no checksums"])
@pytest.mark.parametrize("damage", [_damage_shard, _damage_metadata], ids=["cut shard", "garbage metadata"])
@pytest.mark.parametrize("command", ["export", "eval"])
def test_export_and_eval_of_a_damaged_newest_step_name_the_older_one(run, tmp_path, capsys, damage, command,
                                                                     checksums):
    if not checksums:
        forget_checksums(step_dir(run, 4))
    name = damage(step_dir(run, 4))
    before = listing(run)
    # --trials 0: the passkey probe does not fit this max_seq_len, which eval says before it reads any weights
    out = ["--output", str(tmp_path / "x.pt")] if command == "export" else ["--out", str(tmp_path / "eval"),
                                                                            "--trials", "0"]
    code = cli.main([command, *BASE, f"--job.dump_folder={run}", *out])
    refused(capsys, code, "checkpoint step 4 cannot be read", name, "older complete step (2)", "--checkpoint.load_step")
    assert listing(run) == before and not os.path.exists(tmp_path / "x.pt")


@pytest.mark.parametrize("command", ["export", "eval", "plot"])
def test_reading_a_checkpoint_as_another_model_is_refused(run, tmp_path, capsys, command):
    """A model field that changes what the weights mean (block_stride keeps every shape) is refused as a
    resume refuses it: the export, evaluation or plot would describe a model these weights are not."""
    out = {"export": ["--output", str(tmp_path / "x.pt")], "eval": ["--out", str(tmp_path / "eval")],
           "plot": ["--text", "def f(x): return x", "--out", str(tmp_path / "plots")]}[command]
    code = cli.main([command, *BASE, "--model.nsa.block_stride=4", f"--job.dump_folder={run}", *out])
    refused(capsys, code, f"the checkpoint '{step_dir(run, 4)}' was trained with other model fields: "
            "model.nsa.block_stride = 8 there, 4 here. The weights would be read as another model",
            os.path.join(step_dir(run, 4), "train_state.json"), "model.max_seq_len")
    assert not os.path.exists(tmp_path / "x.pt") and not os.path.exists(tmp_path / "eval")


def test_export_into_another_shape_names_the_tensors(run, tmp_path, capsys):
    """Of a step whose model fields are recorded nowhere (an older release's, its run's recipe.toml gone), the
    tensors that do not fit are named, after a note that the fields could not be compared."""
    forget_model_fields(step_dir(run, 4))
    os.remove(run / "recipe.toml")
    code = cli.main(["export", *BASE, "--model.dim=64", f"--job.dump_folder={run}", "--output", str(tmp_path / "x.pt")])
    err = refused(capsys, code, "does not fit this run's model", "model.tok_embeddings.weight is [258, 32]")
    assert err.startswith(f"note: the model fields that trained the weights in {step_dir(run, 4)} are not recorded"), err


def garble_marker(path):
    with open(os.path.join(path, "COMPLETE"), "w") as fh:
        fh.write("garbage")
    return "COMPLETE"


def unrelated_rank_file(path):
    torch.save({"weights": torch.zeros(2)}, os.path.join(path, "ranks", "rank-0.pt"))
    return "rank-0.pt"


@pytest.mark.parametrize("edit", [
    lambda path: edit_json(path, "train_state.json", step="four") or "train_state.json",
    lambda path: edit_json(path, "train_state.json", step=40) or "train_state.json",
    unrelated_rank_file,
    garble_marker,
    lambda path: edit_json(path, "COMPLETE", step=40) or "COMPLETE",
    lambda path: edit_json(path, "train_state.json", nan_guard=None) or "train_state.json",
    lambda path: edit_json(path, "train_state.json", held_out_set="all") or "train_state.json",
    lambda path: edit_json(path, "train_state.json", applied_lr="fast") or "train_state.json",
    lambda path: edit_json(path, "train_state.json", tensorboard_folder=1) or "train_state.json",
], ids=["step not a number", "step of another folder", "unrelated rank file", "garbage marker",
        "marker of another step", "NaN guard counts garbled", "held-out set garbled", "applied lr garbled",
        "tensorboard folder garbled"])
def test_a_hand_edited_step_is_refused_for_the_older_one(run, capsys, edit):
    # As saved before COMPLETE recorded checksums (which would find any of these edits first, see below):
    # what each file holds is checked too.
    forget_checksums(step_dir(run, 4))
    name = edit(step_dir(run, 4))
    before = listing(run)
    code = train(run)
    refused(capsys, code, "checkpoint step 4 cannot be read", name, "does not hold what a checkpoint writes",
            "older complete step (2)", "--checkpoint.load_step")
    assert listing(run) == before  # nothing moved aside or deleted
    code = cli.main(["export", *BASE, f"--job.dump_folder={run}", "--output", str(run / "x.pt")])
    if name == "COMPLETE":  # export reads the marker and the model only
        refused(capsys, code, "checkpoint step 4 cannot be read", name)
    else:
        assert code == 0


def test_another_data_stream_names_the_weights_only_start(run, tmp_path, capsys):
    code = train(run, "--job.seed=7")  # the seed orders the data: the saved positions belong to another stream
    refused(capsys, code, "another data stream", f"--checkpoint.initial_load_path={step_dir(run, 4)}",
            "--job.dump_folder", "--checkpoint.data_mismatch=restart")
    # The ways the message names work.
    assert train(tmp_path / "new", "--job.seed=7", f"--checkpoint.initial_load_path={step_dir(run, 4)}") == 0


def test_a_requeued_branch_from_load_step_resumes_its_own_progress(run, capsys):
    """A run from an older step, preempted and started again with the same command, resumes where the
    branch stopped (not from load_step once more, which would set its progress aside), even once
    retention has pruned load_step; another command with that load_step starts a new branch."""
    def branch(*extra):
        return cli.main(["train", *BASE, "--training.steps=8", "--checkpoint.interval=2", "--checkpoint.load_step=2",
                         "--checkpoint.keep_latest_k=0", f"--job.dump_folder={run}", *extra])

    def resumed_at(step):
        out = capsys.readouterr().out
        assert f"resumed from {step_dir(run, step)} at step {step}" in out, out[-2000:]
        return out

    def abandoned():
        return [name for name in os.listdir(run / "checkpoint") if name.startswith("abandoned-")]

    assert branch() == 0
    resumed_at(2)
    assert len(abandoned()) == 1  # step 4 of the first run, set aside
    shutil.rmtree(step_dir(run, 8))  # preempted after its step-6 save
    assert branch() == 0
    assert "this command's run from step 2 already reached step 6; resuming there" in resumed_at(6)
    assert len(abandoned()) == 1  # nothing of the branch set aside
    # Requeued for longer, logging otherwise, its folder named by another path: the branch goes on (these change
    # nothing it computes; each set its 6 steps aside and trained them again).
    relative = os.path.relpath(run)
    assert branch("--training.steps=10", "--metrics.log_freq=3", f"--job.dump_folder={relative}") == 0
    assert "this command's run from step 2 already reached step 8; resuming there" in capsys.readouterr().out
    assert len(abandoned()) == 1
    shutil.rmtree(step_dir(run, 10))

    assert branch("--optimizer.lr=0.0005") == 0  # another recipe: a new branch from step 2
    resumed_at(2)
    assert len(abandoned()) == 2
    shutil.rmtree(step_dir(run, 8))
    shutil.rmtree(step_dir(run, 2))  # as retention would have pruned it
    assert branch("--optimizer.lr=0.0005") == 0
    resumed_at(6)


def test_a_branch_recorded_with_the_whole_recipe_hash_goes_on_when_requeued_for_longer(run, capsys):
    """A branch whose checkpoints name it by the whole recipe's hash (as saved before the hash left out the fields
    that change nothing it computes) went on when requeued unchanged, but its next saves kept that hash: requeued
    for longer after that, its progress was set aside and trained again from load_step."""
    from nsa_titan.checkpoint import run_branches
    from nsa_titan.config import resolve

    argv = [*BASE, "--training.steps=8", "--checkpoint.interval=2", "--checkpoint.load_step=2",
            "--checkpoint.keep_latest_k=0", f"--job.dump_folder={run}"]
    assert cli.main(["train", *argv]) == 0
    whole = run_branches(resolve(argv, world_size=1, training=True))[-1]
    for step in (4, 6, 8):  # the branch as an earlier release recorded it
        edit_json(step_dir(run, step), "train_state.json", branch=whole)
        forget_checksums(step_dir(run, step))
    shutil.rmtree(step_dir(run, 8))  # preempted after its step-6 save
    assert cli.main(["train", *argv]) == 0
    assert "already reached step 6; resuming there" in capsys.readouterr().out
    assert cli.main(["train", *argv, "--training.steps=10"]) == 0
    out = capsys.readouterr().out
    assert "this command's run from step 2 already reached step 8; resuming there" in out, out[-2000:]
    assert len([name for name in os.listdir(run / "checkpoint") if name.startswith("abandoned-")]) == 1


def test_a_branch_requeued_at_another_layout_resumes_its_own_progress(run, capsys):
    """A requeue of a branch on another machine changes how its steps run, not what they compute: with the global
    batch fixed, another micro-batch size (as another number of processes needs), activation checkpointing switched
    on and another collector period continue the branch rather than set its progress aside and train it again from
    load_step."""
    def branch(*extra):
        return cli.main(["train", *BASE, "--training.steps=8", "--checkpoint.interval=2", "--checkpoint.load_step=2",
                         "--checkpoint.keep_latest_k=0", f"--job.dump_folder={run}", *extra])

    assert branch("--training.steps=6") == 0
    capsys.readouterr()
    assert branch("--training.local_batch_size=1", "--activation_checkpoint.mode=full", "--training.gc_freq=7") == 0
    out = capsys.readouterr().out
    assert "this command's run from step 2 already reached step 6; resuming there" in out, out[-2000:]
    assert len([name for name in os.listdir(run / "checkpoint") if name.startswith("abandoned-")]) == 1  # step 4


@pytest.mark.parametrize("model, failure, code, message", [
    (["--job.plugins=tests.plugins.oom_at_step", "--model.name=oom_at_step", "--model.oom_at_step=1000"],
     ["--model.oom_at_step=1"], 4, "out of device memory in step 3"),
    (["--job.plugins=tests.plugins.nan_at_step", "--model.name=nan_at_step", "--model.nan_at_step=1000"],
     ["--model.nan_at_step=1", "--model.nan_steps=0"], 3, "stopping at step 3"),
], ids=["out of memory", "NaN stop"])
def test_a_start_that_fails_in_its_first_step_leaves_the_folder_as_it_was(tmp_path, capsys, model, failure, code,
                                                                           message):
    """A resume from an older step whose first step fails has set nothing aside and rewritten no record:
    a plain rerun resumes the newest step as before. (The run trains the failing model from its start,
    the failure off: a resume may change only the model fields that keep the weights' meaning.)"""
    run = tmp_path / "run"
    assert cli.main(["train", *BASE, *model, "--training.steps=4", "--checkpoint.interval=2",
                     f"--job.dump_folder={run}"]) == 0
    capsys.readouterr()
    def contents():
        files = {}
        for root, _, names in os.walk(run):
            for name in names:
                if name == LOCK_FILE:  # names whichever run holds the folder now, not a record of the run
                    continue
                path = os.path.join(root, name)
                with open(path, "rb") as fh:
                    files[os.path.relpath(path, run)] = fh.read()
        return files

    before = contents()
    assert train(run, *model, "--checkpoint.load_step=2", *failure) == code
    err = capsys.readouterr().err
    assert message in err
    if code == 3:  # the NaN stop names what the same command resumes: load_step's step, not the newest
        assert f"the same command then resumes from {step_dir(run, 2)}." in err, err
    assert contents() == before
    assert train(run, *model) == 0
    assert f"resumed from {step_dir(run, 4)} at step 4" in capsys.readouterr().out


def test_other_logical_shards_are_another_data_stream(run, capsys):
    """More logical shards than the checkpoint's: its states lack the new shards, but the way on is the
    data mismatch (restart the data), not a merge of rank states."""
    shards = [f for f in BASE if not f.startswith("--data.logical_shards=")] + ["--data.logical_shards=8"]

    def train_with(*extra):
        return cli.main(["train", *shards, "--training.steps=6", f"--job.dump_folder={run}", *extra])

    err = refused(capsys, train_with(), "another data stream", "data.logical_shards 4 there, 8 here",
                  "--checkpoint.data_mismatch=restart")
    assert "lacks logical shards" not in err
    assert train_with("--checkpoint.data_mismatch=restart") == 0
    assert "the new data starts from its beginning" in capsys.readouterr().out


def test_new_data_on_resume_restarts_the_data_and_resumes_the_rest(run, tmp_path, capsys):
    """checkpoint.data_mismatch = restart: another data stream (here other data altogether) starts from its
    beginning while model, optimizer and step resume; the checkpoints after it carry the new stream, so a
    preempted run resumes it exactly with the same command (the flag restarts nothing then)."""
    new_data = ["--data.source=synthetic", "--data.synthetic.max_length=100", "--checkpoint.data_mismatch=restart",
                "--checkpoint.interval=1", "--metrics.log_freq=1"]
    assert train(run, *new_data) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 4" in out and "the new data starts from its beginning" in out
    straight = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] > 4}
    assert sorted(straight) == [5, 6]
    preempted = tmp_path / "preempted"
    shutil.copytree(run, preempted)
    shutil.rmtree(step_dir(preempted, 6))
    open(os.path.join(preempted, "metrics.jsonl"), "w").close()
    assert train(preempted, *new_data) == 0
    assert "the new data starts" not in capsys.readouterr().out
    assert {r["step"]: r["loss"] for r in read_metrics(preempted) if "loss" in r} == {6: straight[6]}


def _flip_bytes(step):
    """4 KiB of other bytes inside a shard, its size kept: only the checksums can tell."""
    model = os.path.join(step, "model")
    shard = os.path.join(model, next(f for f in sorted(os.listdir(model)) if f.endswith(".distcp")))
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) // 2)
        block = fh.read(4096)
        fh.seek(-len(block), os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in block))
    return os.path.basename(shard)


def test_bytes_changed_in_place_are_found_by_the_checksums(run, tmp_path, capsys):
    """A shard damaged without changing its size loaded before and trained on garbage (the NaN guard then
    blamed the learning rate); the sizes and CRC-32s the save recorded in COMPLETE find it first."""
    name = _flip_bytes(step_dir(run, 4))
    for command in (["train", *BASE, "--training.steps=6", f"--job.dump_folder={run}"],
                    ["export", *BASE, f"--job.dump_folder={run}", "--output", str(tmp_path / "m.pt")],
                    ["train", *BASE, "--training.steps=6", f"--job.dump_folder={tmp_path / 'new'}",
                     f"--checkpoint.initial_load_path={step_dir(run, 4)}"]):
        err = refused(capsys, cli.main(command), name, "checksum differs", "Fix:")
        assert "(2)" in err or "(step-2)" in err, err  # the older, whole step
    with open(os.path.join(step_dir(run, 2), "COMPLETE")) as fh:
        recorded = json.load(fh)["files"]
    assert {"train_state.json", "ranks/rank-0.pt", "model/.metadata"} <= set(recorded)
    assert any(n.startswith("model/__0_") and n.endswith(".distcp") for n in recorded)
    assert cli.main(["train", *BASE, "--training.steps=6", f"--job.dump_folder={run}",
                     "--checkpoint.load_step=2"]) == 0  # the older step is whole and resumes


def test_a_marker_only_another_rank_finds_wrong_stops_every_rank(run, monkeypatch):
    """Ranks may see a step folder differently (node-local storage, a passing NFS error): what any rank finds
    wrong with the COMPLETE marker reaches every rank, so none goes on alone into the checksums' collective,
    where it would wait for the ranks that stopped."""
    from nsa_titan import checkpoint

    marker = os.path.join(step_dir(run, 4), checkpoint.COMPLETE)
    assert checkpoint._step_folder_finding(step_dir(run, 4), 4) is None  # this rank finds it sound
    calls = []

    def another_rank_found(value, group=None):
        calls.append(value)
        return [value, [(marker, "cannot be read (OSError: stale file handle)")]] if len(calls) == 1 else [value]

    monkeypatch.setattr(checkpoint, "_gather", another_rank_found)
    found = checkpoint._step_folder_finding(step_dir(run, 4), 4)
    assert found == (marker, "cannot be read (OSError: stale file handle)")
    assert calls == [[]]  # it said it found nothing, and stopped before the checksums' gather


@pytest.mark.parametrize("kind", ["file", "foreign folder"])
def test_something_else_at_a_save_path_is_moved_aside_not_deleted(tmp_path, capsys, kind):
    """A fresh run whose checkpoint folder already holds step-2 that is not a partial save (a file, a
    folder with other contents): the save moves it into abandoned-*/ and goes on; nothing is deleted."""
    folder = tmp_path / "run"
    stray = folder / "checkpoint" / "step-2"
    stray.parent.mkdir(parents=True)
    if kind == "file":
        stray.write_text("my notes")
    else:
        stray.mkdir()
        (stray / "notes.txt").write_text("my notes")
    assert cli.main(["train", *BASE, "--training.steps=2", f"--job.dump_folder={folder}"]) == 0
    assert "is not a partial save of this run: moved it to" in capsys.readouterr().out
    (aside,) = [p for p in (folder / "checkpoint").iterdir() if p.name.startswith("abandoned-")]
    kept = aside / "step-2"
    assert (kept.read_text() if kind == "file" else (kept / "notes.txt").read_text()) == "my notes"
    assert (folder / "checkpoint" / "step-2" / "COMPLETE").is_file()


def test_step_folders_are_named_as_the_save_names_them(tmp_path):
    from nsa_titan.checkpoint import complete_steps, incomplete_steps

    for name in ("step-8", "step-08", "step-0"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-8" / "COMPLETE").write_text("{}")
    (tmp_path / "step-08" / "COMPLETE").write_text("{}")
    assert complete_steps(str(tmp_path)) == [8] and incomplete_steps(str(tmp_path)) == [0]


def test_a_marker_that_cannot_be_looked_at_is_an_error_not_a_missing_one(tmp_path, monkeypatch):
    """Without permission to look into a step folder its marker is not 'missing': that would resume an
    older step, or start afresh, in silence."""
    from components.errors import UserError
    from nsa_titan import checkpoint

    (tmp_path / "step-4").mkdir()
    real_stat = os.stat

    def denied(path, *args, **kwargs):
        if str(path).endswith(os.path.join("step-4", "COMPLETE")):
            raise PermissionError(13, "Permission denied")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "stat", denied)
    with pytest.raises(UserError, match=r"cannot look into the checkpoint folder .*step-4 \(Permission denied\)"):
        checkpoint.complete_steps(str(tmp_path))


def test_pruning_removes_the_marker_first(tmp_path, monkeypatch):
    """A prune cut short leaves an incomplete folder, never a complete-looking one with files missing."""
    from nsa_titan import checkpoint

    step = tmp_path / "step-2"
    (step / "model").mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    seen = []
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, **kw: seen.append(os.path.exists(
        os.path.join(path, "COMPLETE"))))
    checkpoint._remove_step(str(step))
    assert seen == [False]


@pytest.mark.parametrize("name, other", [("ranks", "model"), ("model", "ranks")])
def test_a_file_named_as_a_save_folder_is_the_users_and_kept_when_the_step_goes(tmp_path, name, other):
    """A file (not folder) named 'model' or 'ranks' in a step folder counted as the save's and was deleted."""
    from nsa_titan import checkpoint

    step = tmp_path / "step-2"
    (step / other).mkdir(parents=True)
    (step / other / ("__0_0.distcp" if other == "model" else "rank-0.pt")).write_bytes(b"saved")
    (step / "train_state.json").write_text("{}")
    (step / name).write_text("my notes")
    assert checkpoint._foreign_entries(str(step)) == [name] and not checkpoint._holds_only_a_save(str(step))
    aside = tmp_path / "aside"
    aside.mkdir()
    checkpoint._remove_step(str(step), set_aside=lambda: str(aside))
    assert not step.exists() and os.listdir(aside / "step-2") == [name]
    assert (aside / "step-2" / name).read_text() == "my notes"


@pytest.mark.parametrize("async_mode, errno_of, reason, remedy", [
    ("disabled", 28, "No space left on device", "Fix: free space on that file system"),
    ("async", 28, "No space left on device", "Fix: free space on that file system"),
    ("disabled", 13, "Permission denied", "Fix: make that folder writable by this user"),
])
def test_a_save_that_cannot_be_written_is_one_message_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                    async_mode, errno_of, reason,
                                                                                    remedy):
    """A full disk (or a folder this user may not write) at step 4's save, in the background too: exit 2
    naming the step, the reason, the remedy that fits it and the complete checkpoint kept; the partial folder
    is gone, not left to fill the disk further."""
    from concurrent.futures import Future

    from nsa_titan import checkpoint

    real_save, real_async = checkpoint.dcp.save, checkpoint.dcp.async_save
    full = OSError(errno_of, reason)

    def save(tensors, checkpoint_id, **kw):
        if "step-4" in checkpoint_id:
            raise full
        return real_save(tensors, checkpoint_id=checkpoint_id, **kw)

    def async_save(tensors, checkpoint_id, **kw):
        if "step-4" not in checkpoint_id:
            return real_async(tensors, checkpoint_id=checkpoint_id, **kw)
        failed = Future()
        failed.set_exception(full)
        return failed

    monkeypatch.setattr(checkpoint.dcp, "save", save)
    monkeypatch.setattr(checkpoint.dcp, "async_save", async_save)
    folder = tmp_path / "run"
    code = cli.main(["train", *BASE, "--training.steps=6", "--checkpoint.interval=2",
                     f"--checkpoint.async_mode={async_mode}", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "cannot save the checkpoint of step 4" in err and reason in err and "GiB free" in err and remedy in err
    assert "the last complete checkpoint (step 2) is kept" in err and "run the same command again" in err
    # checkpoint.folder lies in the dump folder, on its file system: it was named as a way elsewhere
    assert "checkpoint.folder" not in err, err
    assert sorted(os.listdir(folder / "checkpoint")) == ["step-2"]


def test_a_second_ctrl_c_inside_a_save_is_an_interruption_not_a_full_disk(tmp_path, capsys, monkeypatch):
    """DCP's writer catches the KeyboardInterrupt of a second Ctrl-C and wraps it as a failed write: the run
    must still end as interrupted (exit 130, the interruption's message), not as a disk to free (exit 2, which
    a requeue wrapper reads as bad input), with the partial save removed and the last checkpoint kept."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from nsa_titan import checkpoint
    from nsa_titan.cli import INTERRUPTED

    real_save = checkpoint.dcp.save

    def save(tensors, checkpoint_id, **kw):
        if "step-4" in checkpoint_id:
            raise CheckpointException("save failed", {0: (KeyboardInterrupt(), traceback.StackSummary())})
        return real_save(tensors, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(checkpoint.dcp, "save", save)
    folder = tmp_path / "run"
    code = cli.main(["train", *BASE, "--training.steps=6", "--checkpoint.interval=2", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == INTERRUPTED == 130, err
    assert "error: train interrupted at once" in err and "free space" not in err and "Traceback" not in err, err
    assert sorted(os.listdir(folder / "checkpoint")) == ["step-2"]


def test_a_partial_save_cut_short_in_an_atomic_write_is_removed(tmp_path, capsys):
    """A crash while train_state.json was being written leaves its temporary: still this run's partial save,
    removed at that step's save rather than kept aside as somebody else's."""
    folder = tmp_path / "run"
    partial = folder / "checkpoint" / "step-2"
    (partial / "ranks").mkdir(parents=True)
    (partial / "train_state.json.tmp4242").write_text("{")
    assert cli.main(["train", *BASE, "--training.steps=2", f"--job.dump_folder={folder}"]) == 0
    assert "not a partial save" not in capsys.readouterr().out
    assert sorted(os.listdir(folder / "checkpoint")) == ["step-2"]


def test_a_dump_folder_whose_lock_cannot_be_opened_is_one_message(tmp_path, capsys, monkeypatch):
    from nsa_titan import run_folder

    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(run_folder.LOCK_FILE):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(run_folder.os, "open", read_only)
    assert cli.main(["train", *BASE, "--training.steps=1", f"--job.dump_folder={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Permission denied" in err and "make job.dump_folder writable" in err, err
