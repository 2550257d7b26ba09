"""Distributed checkpoints: exact resume, resharding, crashes, retention, graceful stop and export."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from nsa_titan import cli
from nsa_titan.checkpoint import COMPLETE, complete_steps
from nsa_titan.config import resolve
from tests.conftest import REPO_ROOT
from tests.launch import DEBUG, TINY, assert_resumed_at, env, forget_model_fields, losses, losses_and_norms, train

STEPS = 6
BASE = [DEBUG, *TINY, "--training.local_batch_size=2", "--training.global_batch_size=4", "--checkpoint.enable=true",
        "--checkpoint.keep_latest_k=0", "--lr_scheduler.warmup_steps=2"]
LAYOUTS = {
    "single": (1, []),
    "ddp": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2"]),
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree=2"]),
    # Muon's momentum is sharded like its matrices; its update is gathered whole
    "fsdp_muon": (2, ["--parallelism.data_parallel_shard_degree=2", "--optimizer.name=muon"]),
    # Saves written in the background (DCP's async save on a gloo group of its own) while training steps on
    "fsdp_async": (2, ["--parallelism.data_parallel_shard_degree=2", "--checkpoint.async_mode=async"]),
    # Each batch one worker's rows: the workers' shard states and their turn resume with the run
    "ddp_workers": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2",
                        "--data.num_workers=2"]),
}


def run(folder, *extra, nproc=1, steps=STEPS, check=True):
    proc = train([*BASE, f"--training.steps={steps}", f"--job.dump_folder={folder}", *extra], nproc=nproc)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def ckpt_dir(folder):
    return os.path.join(folder, "checkpoint")


def rewind_to(folder, step):
    """Forget everything after `step`'s checkpoint, as if the run had died right after saving it."""
    for later in complete_steps(ckpt_dir(folder)):
        if later > step:
            shutil.rmtree(os.path.join(ckpt_dir(folder), f"step-{later}"))
    open(os.path.join(folder, "metrics.jsonl"), "w").close()


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_continues_the_loss_curve_to_the_bit(tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    straight, resumed_run = tmp_path / "straight", tmp_path / "resumed"
    run(straight, *flags, "--checkpoint.interval=100", nproc=nproc)
    run(resumed_run, *flags, "--checkpoint.interval=3", nproc=nproc)
    expected = losses(straight)
    assert losses(resumed_run) == expected  # saving does not change the run
    rewind_to(resumed_run, 3)
    proc = run(resumed_run, *flags, "--checkpoint.interval=3", nproc=nproc)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed = losses(resumed_run)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == expected[step], (step, resumed, expected)  # bitwise equal


def test_a_resume_from_a_data_state_saved_before_its_files_were_checked_says_so(tmp_path, capsys, monkeypatch):
    """A checkpoint whose data state holds no files part (an older release's) resumes, its files unknown: said once."""
    from components.data import loader

    argv = [*BASE, f"--job.dump_folder={tmp_path}", "--checkpoint.interval=1"]
    current = loader.stream_id
    with monkeypatch.context() as older:
        older.setattr(loader, "stream_id", lambda *a, **k: re.sub(r"\|(files|order)=[^|]*", "", current(*a, **k)))
        assert cli.main(["train", *argv, "--training.steps=1"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=2"]) == 0
    said = capsys.readouterr().out
    assert ("note: step 1 saved its data position before resumes checked the data files (names, sizes, first and "
            "last bytes; huggingface: the datasets version) and numpy's document order: this one takes them as "
            "unchanged") in said, said
    assert cli.main(["train", *argv, "--training.steps=3"]) == 0
    assert "saved its data position before" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(tmp_path, before, after):
    straight = tmp_path / "straight"
    run(straight, "--checkpoint.interval=100")
    folder = tmp_path / "run"
    run(folder, "--checkpoint.interval=3", nproc=before)
    rewind_to(folder, 3)
    proc = run(folder, "--checkpoint.interval=3", nproc=after)
    assert "resumed from" in proc.stdout
    resumed, expected = losses_and_norms(folder), losses_and_norms(straight)
    assert sorted(resumed) == [4, 5, 6]
    # The global batch holds the same samples in every layout, so only float reduction order differs (~1e-7);
    # the gradient norms show optimizer state resharded wrongly, which AdamW's losses hardly show.
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (step, resumed, expected)


def test_a_resume_whose_held_out_set_has_another_size_says_so(tmp_path, capsys):
    """With global_batch_size = -1 the held-out set is validation.steps x local_batch_size rows: a resume with
    another local batch (as when 1 x 8 sequences become 4 x 2) validates on other rows, which the run says,
    with the validation.steps that keeps the saved set."""
    derived = [a for a in BASE if not a.startswith("--training.global_batch_size")]
    argv = [*derived, f"--job.dump_folder={tmp_path}", "--validation.enable=true", "--validation.freq=2",
            "--validation.steps=2", "--checkpoint.interval=2"]
    assert cli.main(["train", *argv, "--training.steps=2"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=4", "--training.local_batch_size=1",
                     "--validation.steps=4"]) == 0
    assert "held-out set is" not in capsys.readouterr().out  # the same 4 rows as the step-2 save: nothing to say
    assert cli.main(["train", *argv, "--training.steps=6", "--training.local_batch_size=1"]) == 0
    said = capsys.readouterr().out
    assert ("the held-out set is 2 rows of 64 tokens here (validation.steps x training.local_batch_size, as "
            "training.global_batch_size = -1) and was 4 of 64 in the run that saved step 4") in said, said
    assert "resume with --validation.steps=4" in said, said
    # a longer context changes every row: said, and no validation.steps keeps it
    longer = [a for a in argv if not a.startswith(("--training.seq_len", "--model.max_seq_len"))]
    assert cli.main(["train", *longer, "--training.steps=8", "--training.local_batch_size=1", "--validation.steps=4",
                     "--training.seq_len=128", "--model.max_seq_len=128"]) == 0
    said = capsys.readouterr().out
    assert "the held-out set is 4 rows of 128 tokens here" in said and "was 2 of 64 in the run that saved step 6" \
        in said and "Its rows follow training.seq_len, so the set cannot be kept at this length." in said, said
    # a run without validation in between keeps the record for the next one that validates
    longer += ["--training.seq_len=128", "--model.max_seq_len=128", "--training.local_batch_size=1"]
    quiet = [a for a in longer if not a.startswith("--validation.")]
    assert cli.main(["train", *quiet, "--training.steps=10", "--validation.enable=false"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *longer, "--training.steps=12", "--validation.steps=2"]) == 0
    assert "the held-out set is 2 rows of 128 tokens here" in capsys.readouterr().out


def test_a_resume_with_another_worker_count_says_the_batches_come_in_another_order(tmp_path, capsys):
    """Two loader workers take each batch from one worker's shards, so a resume with one worker continues every shard
    but draws other rows into each step; it was named only as a recipe change. Zero and one worker give the same
    batches: nothing to say between them."""
    argv = [*BASE, f"--job.dump_folder={tmp_path}", "--checkpoint.interval=1"]
    assert cli.main(["train", *argv, "--training.steps=1", "--data.num_workers=2"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=2", "--data.num_workers=1"]) == 0
    said = capsys.readouterr().out
    assert ("note: the batches come in another order from here than the run that saved step 1 would have drawn them: "
            "it read with data.num_workers = 2 on 1 data-parallel rank(s), 2 sequences a batch, this run with 1 on 1 "
            "(with 2 or more") in said, said
    assert "To continue exactly, resume with --data.num_workers=2." in said, said
    assert cli.main(["train", *argv, "--training.steps=3", "--data.num_workers=0"]) == 0
    assert "another order" not in capsys.readouterr().out


def test_a_resume_with_workers_and_another_local_batch_size_says_the_batches_come_in_another_order(tmp_path, capsys):
    """With two or more workers each batch is one worker's rows, so a fixed global batch split into micro-batches of
    another size draws other rows into each step; without workers the batches are the same."""
    argv = [*BASE, f"--job.dump_folder={tmp_path}", "--checkpoint.interval=1"]  # a global batch of 4

    def layout(workers, local_batch):
        return [f"--data.num_workers={workers}", f"--training.local_batch_size={local_batch}"]

    assert cli.main(["train", *argv, "--training.steps=1", *layout(2, 2)]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=2", *layout(2, 4)]) == 0
    said = capsys.readouterr().out
    assert ("it read with data.num_workers = 2 on 1 data-parallel rank(s), 2 sequences a batch, this run with 2 on 1, "
            "4 sequences a batch") in said, said
    assert "To continue exactly, resume with --data.num_workers=2 --training.local_batch_size=2." in said, said
    assert cli.main(["train", *argv, "--training.steps=3", *layout(0, 4)]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=4", *layout(0, 2)]) == 0
    assert "another order" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_resume_on_fewer_processes_names_the_smaller_derived_batch(tmp_path, capsys):
    """global_batch_size = -1 means local x data-parallel size: two processes saved batches of 4, one resumes
    with 2, which no recipe field shows, so the run says it and how to keep the saved size (which takes
    smaller local batches when the world grows)."""
    derived = [a for a in BASE if not a.startswith("--training.global_batch_size")]
    folder = tmp_path / "run"
    argv = [*derived, f"--job.dump_folder={folder}", "--parallelism.data_parallel_shard_degree=2"]
    proc = train([*argv, "--training.steps=2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert cli.main(["train", *derived, f"--job.dump_folder={folder}", "--training.steps=3"]) == 0
    said = capsys.readouterr().out
    assert "the global batch is 2 sequences a step here and was 4 in the run that saved step 2 (2 process(es))" in said
    assert "resume with --training.global_batch_size=4" in said
    assert cli.main(["train", *derived, f"--job.dump_folder={folder}", "--training.steps=4"]) == 0
    assert "the global batch is" not in capsys.readouterr().out  # saved at the same size: nothing to say
    proc = train([*argv, "--training.steps=5"], nproc=2)  # back on two: 2 does not split into local batches of 2
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "was 2 in the run that saved step 4 (1 process(es))" in proc.stdout, proc.stdout
    assert "resume with --training.global_batch_size=2 --training.local_batch_size=1" in proc.stdout


def test_a_resume_whose_data_parallel_size_does_not_divide_the_logical_shards_names_the_checkpoints_layout(tmp_path):
    """The fix offered was 'use a multiple of 2' logical shards, which the checkpoint's data then refuses: a resume
    names the checkpoint's layout and the data-parallel sizes that continue it."""
    from nsa_titan.config import RecipeError

    argv = [*BASE, "--training.global_batch_size=-1", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv, "--training.steps=1", "--data.logical_shards=3"]) == 0
    for shards, resume in ((3, "resume on"), (5, "resume with data.logical_shards = 3 on")):
        with pytest.raises(RecipeError) as info:
            resolve([*argv, "--training.steps=2", f"--data.logical_shards={shards}"], world_size=2, training=True)
        said = info.value.render()
        assert (f"is not divisible by the data-parallel size 2, so ranks cannot own equal shards; the checkpoint this "
                f"run resumes (step 1 in {tmp_path}/checkpoint) was saved over 3 logical shards by 1 data-parallel "
                f"rank(s), and its data continues only over those 3") in said, said
        assert (f"Fix: {resume} a data-parallel size (processes / context_parallel_degree) that divides 3 (1 or 3), "
                f"or start the data afresh over a multiple of 2 logical shards with --checkpoint.data_mismatch=restart"
                ) in said, said


def test_the_layout_a_requeued_branch_resumes_is_the_one_named(tmp_path, capsys):
    """A run from checkpoint.load_step that goes on (a requeue) resumes its own newest step, not load_step: the
    refusal of a data-parallel size that does not divide the logical shards named load_step's layout (3 shards),
    and told to resume with data.logical_shards = 3, though the step resumed was saved over 4."""
    from nsa_titan.config import RecipeError

    argv = [*BASE, "--training.global_batch_size=-1", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv, "--training.steps=2", "--data.logical_shards=3"]) == 0
    branch = [*argv, "--checkpoint.load_step=1", "--data.logical_shards=4", "--checkpoint.data_mismatch=restart"]
    assert cli.main(["train", *branch, "--training.steps=3"]) == 0
    with pytest.raises(RecipeError) as info:
        resolve([*branch, "--training.steps=4"], world_size=3, training=True)
    said = info.value.render()
    assert (f"the checkpoint this run resumes (step 3 in {tmp_path}/checkpoint) was saved over 4 logical shards by 1 "
            f"data-parallel rank(s)") in said, said
    assert "Fix: resume on a data-parallel size (processes / context_parallel_degree) that divides 4 (1, 2 or 4), " \
           "or set data.logical_shards to a multiple of 3, e.g. 3 (checkpoint.data_mismatch = 'restart' starts the " \
           "data afresh over them" in said, said
    assert "--checkpoint.data_mismatch=restart" not in said, said  # the branch sets it already
    with pytest.raises(RecipeError) as info:
        resolve([*branch, "--training.steps=4", "--data.logical_shards=5"], world_size=3, training=True)
    said = info.value.render()
    # Another recipe: the branch of steps 1 and 2, saved over 3 shards, which suit 3 ranks.
    assert "Fix: resume on a data-parallel size (processes / context_parallel_degree) that divides 5 (1 or 5), or " \
           "set data.logical_shards = 3, the checkpoint's, whose data continues on this size." in said, said
    capsys.readouterr()
    assert cli.main(["train", *branch, "--training.steps=4"]) == 0
    assert f"resumed from {tmp_path}/checkpoint/step-3 at step 3" in capsys.readouterr().out  # as it said


def test_partial_checkpoint_is_skipped_and_corrupt_one_refused(tmp_path, capsys):
    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=2", "--checkpoint.interval=1", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    assert complete_steps(ckpt_dir(folder)) == [1, 2]
    # A save killed half way: the folder exists, its COMPLETE marker does not.
    partial = os.path.join(ckpt_dir(folder), "step-3")
    shutil.copytree(os.path.join(ckpt_dir(folder), "step-2"), partial)
    os.remove(os.path.join(partial, COMPLETE))
    capsys.readouterr()
    assert cli.main(["train", *argv[:-2], "--training.steps=3", "--checkpoint.interval=1",
                     f"--job.dump_folder={folder}"]) == 0
    out = capsys.readouterr().out
    assert "skipping incomplete checkpoint" in out and "step-3" in out
    assert "resumed from" in out and "at step 2" in out
    # A complete-looking checkpoint whose files are damaged is refused with a clear message.
    with open(os.path.join(ckpt_dir(folder), "step-3", "train_state.json"), "w") as fh:
        fh.write("{not json")
    code = cli.main(["train", *argv[:-2], "--training.steps=4", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint step 3 cannot be read" in err and "train_state.json" in err
    assert "older complete step (1, 2)" in err and "--checkpoint.load_step=N" in err


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A run with complete checkpoints at steps 1, 2 and 3 (copied by each test that damages one)."""
    folder = tmp_path_factory.mktemp("three") / "run"
    proc = run(folder, "--checkpoint.interval=1", steps=3)
    assert complete_steps(ckpt_dir(folder)) == [1, 2, 3], proc.stderr
    return folder


def _damage_shard(step_dir):
    shard = next(f for f in os.listdir(os.path.join(step_dir, "model")) if f.endswith(".distcp"))
    path = os.path.join(step_dir, "model", shard)
    os.truncate(path, os.path.getsize(path) // 2)
    return shard


def _damage_rank_file(step_dir):
    path = os.path.join(step_dir, "ranks", "rank-0.pt")
    os.truncate(path, os.path.getsize(path) // 2)
    return "rank-0.pt"


def _damage_metadata(step_dir):
    with open(os.path.join(step_dir, "model", ".metadata"), "wb") as fh:
        fh.write(b"\x80garbage")
    return ".metadata"


def forget_checksums(step_dir):
    """The step as saved before COMPLETE recorded its files' checksums: the checks of what each file
    holds must find the damage themselves."""
    marker = os.path.join(step_dir, COMPLETE)
    with open(marker, encoding="utf-8") as fh:
        record = json.load(fh)
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump({k: v for k, v in record.items() if k != "files"}, fh)


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no checksums"])
@pytest.mark.parametrize("damage", [_damage_shard, _damage_rank_file, _damage_metadata],
                         ids=["truncated shard", "truncated rank file", "corrupt metadata"])
def test_a_damaged_checkpoint_names_its_file_and_the_older_steps(tmp_path, capsys, three_checkpoints, damage,
                                                                 checksums):
    folder = tmp_path / "run"
    shutil.copytree(three_checkpoints, folder)
    if not checksums:
        forget_checksums(os.path.join(ckpt_dir(folder), "step-3"))
    name = damage(os.path.join(ckpt_dir(folder), "step-3"))
    before = sorted(os.listdir(ckpt_dir(folder)))
    capsys.readouterr()
    code = cli.main(["train", *BASE, "--training.steps=4", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: checkpoint step 3 cannot be read: ") and name in err, err
    assert ("but the save wrote" in err) == checksums, err  # with checksums, they find it first
    assert "Traceback" not in err and err.count("error:") == 1
    assert "older complete step (1, 2)" in err and "--checkpoint.load_step=N" in err
    assert sorted(os.listdir(ckpt_dir(folder))) == before  # nothing deleted or moved
    # The way out the message names works.
    assert cli.main(["train", *BASE, "--training.steps=4", "--checkpoint.load_step=2",
                     f"--job.dump_folder={folder}"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_resume_into_another_model_is_refused_by_field(tmp_path, capsys, three_checkpoints):
    """Same shapes, another meaning: a resume may change only the model fields marked keeps_weights, like
    checkpoint.initial_load_path (a changed norm_eps trained on with a note, and its loss jumped)."""
    folder = tmp_path / "run"
    shutil.copytree(three_checkpoints, folder)
    capsys.readouterr()
    code = cli.main(["train", *BASE, "--training.steps=4", "--model.norm_eps=0.001", "--model.nsa.window_size=8",
                     f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert f"the checkpoint this run resumes, '{folder / 'checkpoint' / 'step-3'}', was trained with other model " \
           "fields: model.norm_eps = 1e-05 there, 0.001 here. The weights would be read as another model. Fix: set " \
           f"those fields to the values in {folder / 'checkpoint' / 'step-3' / 'train_state.json'}" in err, err
    assert complete_steps(ckpt_dir(folder)) == [1, 2, 3]
    # A step of an older release, without its model fields, is judged by the run's recipe.toml; a field that
    # recipe predates had its default there.
    forget_model_fields(folder / "checkpoint" / "step-3")
    code = cli.main(["train", *BASE, "--training.steps=4", "--model.norm_eps=0.001", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2 and f"Fix: set those fields to the values in {folder / 'recipe.toml'}" in err, err
    recipe = (folder / "recipe.toml").read_text()
    (folder / "recipe.toml").write_text(recipe.replace("norm_eps = 1e-05\n", "", 1))
    assert "norm_eps" not in (folder / "recipe.toml").read_text()
    # A field that keeps the weights' meaning (the window) may change: the run goes on and says so.
    code = cli.main(["train", *BASE, "--training.steps=4", "--model.nsa.window_size=8", f"--job.dump_folder={folder}"])
    out = capsys.readouterr().out
    assert code == 0 and "resumed from" in out and "model.nsa.window_size: 16 -> 8" in out, out


def test_a_nested_checkpoint_folder_is_judged_by_its_runs_recipe_too(tmp_path, capsys):
    folder = tmp_path / "run"
    nested = ["--checkpoint.folder=ckpt/nested", "--checkpoint.interval=1"]
    assert cli.main(["train", *BASE, *nested, "--training.steps=1", f"--job.dump_folder={folder}"]) == 0
    forget_model_fields(folder / "ckpt" / "nested" / "step-1")  # an older release's step: the run's recipe judges
    capsys.readouterr()
    code = cli.main(["train", *BASE, *nested, "--training.steps=2", "--model.norm_eps=0.001",
                     f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.norm_eps = 1e-05 there, 0.001 here" in err and str(folder / "recipe.toml") in err, err


def test_resume_into_another_model_names_the_first_mismatches(tmp_path, capsys, three_checkpoints):
    """Where neither the step (an older release's) nor a recipe tells the fields the step was trained with, the
    tensors' shapes still judge it."""
    folder = tmp_path / "run"
    shutil.copytree(three_checkpoints, folder)
    os.remove(folder / "recipe.toml")
    forget_model_fields(folder / "checkpoint" / "step-3")
    capsys.readouterr()
    code = cli.main(["train", *BASE, "--training.steps=4", "--model.dim=64", f"--job.dump_folder={folder}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert "step-3 does not fit this run's model: model.tok_embeddings.weight is [258, 32] in the checkpoint " \
           "but [258, 64] here" in err, err
    assert "another --job.dump_folder" in err and "recipe.toml" in err
    assert complete_steps(ckpt_dir(folder)) == [1, 2, 3]


def test_resume_refused_for_another_vocabulary_names_the_recipe_change_behind_it(tmp_path, capsys, three_checkpoints):
    """Another tokenizer changes no [model] field, only the embedding's rows: the refusal names the tensors, and
    the note before it the recipe field that changed them."""
    import base64

    folder = tmp_path / "run"
    shutil.copytree(three_checkpoints, folder)
    bpe = tmp_path / "bytes.tiktoken"
    bpe.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    capsys.readouterr()
    code = cli.main(["train", *BASE, "--training.steps=4", "--data.tokenizer=tiktoken",
                     f"--data.tiktoken.encoding={bpe}", f"--job.dump_folder={folder}"])
    out, err = capsys.readouterr()
    assert code == 2 and "model.tok_embeddings.weight is [258, 32] in the checkpoint but [257, 32] here" in err, err
    assert "note: the recipe differs from the one this run folder's last run kept (recipe.toml): " in out, out
    assert "data.tokenizer: 'byte' -> 'tiktoken'" in out, out


def test_load_step_missing_is_an_error(tmp_path, capsys):
    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=2", "--checkpoint.interval=1", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    code = cli.main(["train", *argv, "--checkpoint.load_step=7"])
    err = capsys.readouterr().err
    assert code == 2 and "load_step = 7" in err and "does not exist" in err and "complete steps (1, 2)" in err
    code = cli.main(["train", *argv[:-1], f"--job.dump_folder={tmp_path / 'empty'}", "--checkpoint.load_step=3"])
    err = capsys.readouterr().err
    assert code == 2 and "holds no complete checkpoint: set -1 to start the run afresh" in err
    code = cli.main(["export", *argv[:-1], f"--job.dump_folder={tmp_path / 'empty'}", "--output", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and "no complete checkpoint in" in err and "train with checkpoint.enable = true first" in err


def test_keep_latest_k(tmp_path):
    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=5", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2",
            f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    assert complete_steps(ckpt_dir(folder)) == [4, 5]
    assert sorted(os.listdir(ckpt_dir(folder))) == ["step-4", "step-5"]


def test_an_older_save_cut_short_is_removed_with_a_line(tmp_path, capsys):
    """A step folder left without its marker by a kill while retention removed it (or while it was saved) was
    removed by the next save's pruning without a word."""
    folder = tmp_path / "run"
    argv = [*BASE, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv, "--training.steps=2"]) == 0
    os.remove(os.path.join(ckpt_dir(folder), "step-1", COMPLETE))
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "removed the saves of steps [1], which were cut short before they completed" in out, out
    assert sorted(os.listdir(ckpt_dir(folder))) == ["step-2", "step-3"]


def test_pruning_keeps_what_a_save_did_not_write_and_follows_no_link(tmp_path, capsys):
    """keep_latest_k deleted a user's notes and folders inside a pruned step (the README says only what a save
    writes goes), and through a step that is a link to another run's, that run's COMPLETE marker (so its next
    resume removed the step as cut short)."""
    other = tmp_path / "other"
    assert cli.main(["train", *BASE, "--training.steps=1", "--checkpoint.interval=1", f"--job.dump_folder={other}"]) == 0
    folder = tmp_path / "run"
    saves, theirs = folder / "checkpoint", other / "checkpoint"
    argv = [*BASE, "--checkpoint.interval=1", "--checkpoint.keep_latest_k=2", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv, "--training.steps=2"]) == 0
    (saves / "step-2" / "notes.txt").write_text("my notes")
    (saves / "step-2" / "evals").mkdir()
    (saves / "step-2" / "model" / "README").write_text("mine too")
    shutil.rmtree(saves / "step-1")
    os.symlink(theirs / "step-1", saves / "step-1")  # another run's step, linked in
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=4"]) == 0
    assert complete_steps(saves) == [3, 4]
    assert complete_steps(theirs) == [1]  # the link went, not what it named
    aside = [d for d in os.listdir(saves) if d.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(os.listdir(saves)) == sorted(["step-3", "step-4", *aside])
    kept = saves / aside[0] / "step-2"
    assert sorted(os.listdir(kept)) == ["evals", "model", "notes.txt"] and os.listdir(kept / "model") == ["README"]
    assert "keeping what its save did not write (evals, model/README, notes.txt)" in capsys.readouterr().out


def test_a_changed_checkpoint_folder_says_the_run_starts_over(tmp_path, capsys):
    """checkpoint.folder changed beside a run's checkpoints: the run started at step 0 without a word."""
    argv = [*BASE, "--training.steps=2", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--checkpoint.folder=ckpt2"]) == 0
    out = capsys.readouterr().out
    assert (f"note: this run starts at step 0: {tmp_path / 'ckpt2'} holds no checkpoint, while "
            f"{tmp_path / 'checkpoint'} holds this run folder's checkpoints (the newest: step 2). To go on from them, "
            f"add --checkpoint.folder=checkpoint") in out, out


def test_a_first_start_beside_a_folder_it_cannot_read_trains(tmp_path, capsys, monkeypatch):
    """A run folder holding a folder this user cannot list (a volume's lost+found, the run folder being the volume's
    root): the first start's look for other checkpoint folders was a PermissionError traceback."""
    (tmp_path / "lost+found").mkdir()
    listdir = os.listdir

    def refusing(path="."):  # as a user's listing of root's folder is (root itself may read it)
        if str(path).endswith("lost+found"):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refusing)
    assert cli.main(["train", *BASE, "--training.steps=1", f"--job.dump_folder={tmp_path}"]) == 0
    assert complete_steps(tmp_path / "checkpoint") == [1]


def test_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys):
    argv = [*BASE, "--training.steps=2", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "nothing to do: the run already reached training.steps = 2. Fix:" in out, out
    assert cli.main(["train", *argv[:-2], "--training.steps=1", f"--job.dump_folder={tmp_path}"]) == 0
    # a run past the steps asked for says where it is, and how to go back
    assert ("nothing to do: the run already reached training.steps = 1 (it is at step 2; --checkpoint.load_step=N "
            "resumes an earlier checkpoint)") in capsys.readouterr().out


def test_async_save_resumes_exactly(tmp_path):
    straight, folder = tmp_path / "straight", tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=4", "--metrics.log_freq=1", f"--job.dump_folder={straight}"]) == 0
    argv = [*BASE, "--checkpoint.interval=2", "--checkpoint.async_mode=async", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv, "--training.steps=4"]) == 0
    assert complete_steps(ckpt_dir(folder)) == [2, 4]
    rewind_to(folder, 2)
    assert cli.main(["train", *argv, "--training.steps=4"]) == 0
    assert losses(folder) == {k: v for k, v in losses(straight).items() if k > 2}


def test_initial_load_path_takes_weights_only(tmp_path, capsys):
    source = tmp_path / "source"
    assert cli.main(["train", *BASE, "--training.steps=2", f"--job.dump_folder={source}"]) == 0
    target = tmp_path / "target"
    argv = [*BASE, "--training.steps=2", f"--job.dump_folder={target}",
            f"--checkpoint.initial_load_path={source}/checkpoint/step-2"]
    assert cli.main(["train", *argv]) == 0
    assert "initial weights from" in capsys.readouterr().out
    assert sorted(losses(target)) == [1, 2]  # a fresh run from step 1, not a resume
    longer = [a for a in argv if not a.startswith("--training.steps=")] + ["--training.steps=3"]
    assert cli.main(["train", *longer]) == 0  # the run's own checkpoint now: the path is not used, and it says so
    out = capsys.readouterr().out
    assert "resumed from" in out and "is not used: this run resumes its own checkpoint" in out
    code = cli.main(["train", *BASE, "--training.steps=2", f"--job.dump_folder={tmp_path / 'other'}",
                     f"--checkpoint.initial_load_path={tmp_path / 'nowhere'}"])
    assert code == 2 and "holds no checkpoint" in capsys.readouterr().err
    # A field that keeps the weights' meaning may differ, and is named (the path may name step-N/model too) ...
    longer = [*BASE, "--training.steps=1", "--model.max_seq_len=128", f"--job.dump_folder={tmp_path / 'longer'}",
              f"--checkpoint.initial_load_path={source}/checkpoint/step-2/model"]
    assert cli.main(["train", *longer]) == 0
    assert "note: the model differs from the one that trained these weights: model.max_seq_len: 64 -> 128" \
        in capsys.readouterr().out
    # ... but not one that would read the same tensors as another model (every shape fits a tied head).
    tied = [*BASE, "--training.steps=1", "--model.tie_embeddings=true", f"--job.dump_folder={tmp_path / 'tied'}",
            f"--checkpoint.initial_load_path={source}/checkpoint/step-2"]
    assert cli.main(["train", *tied]) == 2
    err = capsys.readouterr().err
    assert "holds weights trained with other model fields: model.tie_embeddings = false there, true here" in err
    assert f"Fix: set those fields to the values in {source / 'checkpoint' / 'step-2' / 'train_state.json'}" in err
    # A dense model from NSA weights: the attention choice is the change, not the [model.nsa] fields it switches
    # off (which a dense recipe may not set, so naming them would ask for the impossible).
    dense = [a for a in BASE if not a.startswith("--model.nsa.")] + [
        "--training.steps=1", "--model.attention=dense", f"--job.dump_folder={tmp_path / 'dense'}",
             f"--checkpoint.initial_load_path={source}/checkpoint/step-2"]
    assert cli.main(["train", *dense]) == 2
    err = capsys.readouterr().err
    assert 'other model fields: model.attention = "nsa" there, "dense" here. The weights' in err, err
    assert "model.nsa." not in err, err
    # The source run went on with another window: step 2 is still judged by the fields that trained it, step 3
    # by the new ones; by the fields the step records, and for steps of an older release that records none, by
    # the recipe that wrote it (kept as recipe.<hash>.toml when a later run replaced recipe.toml).
    assert cli.main(["train", *BASE, "--training.steps=3", "--model.nsa.window_size=8",
                     f"--job.dump_folder={source}"]) == 0
    capsys.readouterr()
    older = tmp_path / "older"
    shutil.copytree(source, older)
    for step in (2, 3):
        forget_model_fields(older / "checkpoint" / f"step-{step}")
    for (step, note), root in itertools.product(((2, None), (3, "model.nsa.window_size: 8 -> 16")), (source, older)):
        assert cli.main(["train", *BASE, "--training.steps=1", f"--job.dump_folder={tmp_path / f'{root.name}{step}'}",
                         f"--checkpoint.initial_load_path={root}/checkpoint/step-{step}"]) == 0
        said = capsys.readouterr().out
        assert ("the model differs" in said) == (note is not None) and (note is None or note in said), said


@pytest.mark.slow
def test_sigterm_and_kill_lose_nothing_beyond_the_last_checkpoint(tmp_path):
    folder = tmp_path / "run"
    straight = tmp_path / "straight"
    run(straight, "--checkpoint.interval=100", steps=30)
    # Slow steps (same numbers) keep each interrupted run going well past the moment the test acts.
    cmd = [sys.executable, "-m", "nsa_titan.cli", "train", *BASE, "--training.steps=30", "--checkpoint.interval=4",
           f"--job.dump_folder={folder}", "--job.plugins=tests.plugins.slow_steps", "--optimizer.name=slow_adamw"]
    # SIGTERM: finish the step, save, exit 0.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    _wait_for(lambda: complete_steps(ckpt_dir(folder)), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopping after step" in out and "SIGTERM" in out
    assert "SIGTERM: stopping after the current step, with a checkpoint.\n" in err  # said at once
    stopped_at = max(complete_steps(ckpt_dir(folder)))
    # kill -9: whatever was running is lost, the last complete checkpoint is not.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    _wait_for(lambda: max(complete_steps(ckpt_dir(folder))) > stopped_at, proc)
    proc.kill()
    proc.communicate(timeout=60)
    killed_at = max(complete_steps(ckpt_dir(folder)))
    # Halt file: a third run stops cleanly when it appears.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    _wait_for(lambda: max(complete_steps(ckpt_dir(folder))) > killed_at, proc)
    open(os.path.join(folder, "HALT"), "w").close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "halt file" in out, err
    assert os.path.exists(os.path.join(folder, "HALT.handled"))
    final = run(folder, "--checkpoint.interval=4", steps=30)
    assert "resumed from" in final.stdout
    # Every logged step's loss equals the uninterrupted run's; steps re-run after the kill repeat it exactly.
    expected = losses(straight)
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as fh:
        for record in map(json.loads, fh):
            if "loss" in record:
                assert record["loss"] == expected[record["step"]], record
    assert max(losses(folder)) == 30


def _signal_after(monkeypatch, during: str, step: int, signum: int) -> None:
    """Send this process `signum` right after step `step`'s save (or validation)."""
    from nsa_titan.checkpoint import Checkpointer
    from nsa_titan.trainer import Trainer

    owner, name = (Checkpointer, "save") if during == "save" else (Trainer, "validate")
    real = getattr(owner, name)

    def signalled(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if (args[0].step if during == "save" else self.state.step) == step:
            os.kill(os.getpid(), signum)  # the run's graceful stop answers it at once: it sets a flag
        return result

    monkeypatch.setattr(owner, name, signalled)


@pytest.mark.parametrize("during, signum", [("save", signal.SIGTERM), ("validation", signal.SIGTERM),
                                            ("save", signal.SIGHUP)])
def test_a_stop_asked_during_a_save_or_validation_ends_at_that_step(tmp_path, capsys, monkeypatch, during, signum):
    """A SIGTERM that lands in step 4's save (or its validation, a step that does not save) stops the run at
    step 4, saved, instead of after one more step and one more save. A hang-up (the terminal closed) is a stop
    request too. Step 4, the run's last, is logged although log_freq skips it (the file ended at step 1), and
    once: the resume goes on from step 5."""
    _signal_after(monkeypatch, during, 4, signum)
    folder = tmp_path / "run"
    interval = "2" if during == "save" else "3"
    argv = ["train", *BASE, f"--checkpoint.interval={interval}", "--validation.enable=true", "--validation.freq=2",
            "--validation.steps=1", "--metrics.log_freq=5", f"--job.dump_folder={folder}"]
    previous = signal.signal(signum, signal.SIG_DFL)  # as a terminal's program has it (pytest run under nohup not)
    try:
        assert cli.main([*argv, "--training.steps=10"]) == 0
    finally:
        signal.signal(signum, previous)
    out = capsys.readouterr().out
    assert f"stopping after step 4 ({signal.Signals(signum).name}); the checkpoint above resumes it" in out, out
    assert complete_steps(ckpt_dir(folder)) == ([2, 4] if during == "save" else [3, 4])
    assert sorted(losses(folder)) == [1, 4] and "step  4/10 | loss" in out, out
    monkeypatch.undo()
    assert cli.main([*argv, "--training.steps=5"]) == 0
    steps = [r["step"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 4, 5]


def test_the_step_a_halt_file_stops_at_is_logged(tmp_path, capsys, monkeypatch):
    """The last step of a halted run is in metrics.jsonl although it is not a multiple of log_freq: a run's
    final record must not be missing."""
    from nsa_titan.trainer import Trainer

    folder = tmp_path / "run"
    real = Trainer.train_step

    def halting(self, *args, **kwargs):
        if self.state.step == 6:  # seen by step 7's agreement
            open(os.path.join(folder, "HALT"), "w").close()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", halting)
    assert cli.main(["train", *BASE, "--training.steps=20", "--checkpoint.interval=5", "--metrics.log_freq=5",
                     f"--job.dump_folder={folder}"]) == 0
    assert "stopping after step 7 (halt file" in capsys.readouterr().out
    assert sorted(losses(folder)) == [1, 5, 7]


def test_a_closed_terminal_stops_the_run_with_a_save(tmp_path):
    """The terminal a run prints to goes away (an ssh session closed): the kernel sends SIGHUP and every later
    write to it fails with EIO. The run stops after its step with a checkpoint and exits 0; its last lines,
    with nobody to read them, must not crash it before or after the save."""
    import pty

    folder = tmp_path / "run"
    argv = [sys.executable, "-m", "nsa_titan.cli", "train", *BASE, "--training.steps=100000",
            "--checkpoint.interval=100000", "--metrics.log_freq=1", f"--job.dump_folder={folder}",
            "--job.plugins=tests.plugins.slow_steps", "--optimizer.name=slow_adamw"]
    pid, terminal = pty.fork()  # the child's controlling terminal, as a login shell's programs have
    if pid == 0:
        os.chdir(REPO_ROOT)
        os.execve(sys.executable, argv, env())
    try:
        seen, deadline = b"", time.time() + 300
        while not re.search(rb"step +2/", seen) and time.time() < deadline:
            try:
                seen += os.read(terminal, 4096)
            except OSError:
                break
        assert re.search(rb"step +2/", seen), seen[-2000:]
        os.close(terminal)  # hang up
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert os.waitstatus_to_exitcode(status) == 0
    (stopped,) = complete_steps(ckpt_dir(folder))
    assert stopped >= 2 and max(losses(folder)) == stopped


def test_a_hang_up_under_nohup_leaves_the_run_going(tmp_path, capsys, monkeypatch):
    """nohup starts a program with SIGHUP ignored so that it outlives the terminal: the run keeps that."""
    _signal_after(monkeypatch, "save", 2, signal.SIGHUP)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert cli.main(["train", *BASE, "--training.steps=4", "--checkpoint.interval=2",
                         f"--job.dump_folder={tmp_path}"]) == 0
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert "stopping" not in capsys.readouterr().out
    assert max(losses(tmp_path)) == 4 and complete_steps(ckpt_dir(tmp_path)) == [2, 4]


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    """The first Ctrl-C is answered at once (a long step would leave the user guessing); a second one ends
    the run without saving, in one line and exit 130, not a KeyboardInterrupt traceback."""
    from tests.plugins.slow_steps import HOLD_ENV

    folder, hold = tmp_path / "run", str(tmp_path / "hold")
    cmd = [sys.executable, "-m", "nsa_titan.cli", "train", *BASE, "--training.steps=100", "--checkpoint.interval=2",
           f"--job.dump_folder={folder}", "--job.plugins=tests.plugins.slow_steps", "--optimizer.name=slow_adamw"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), HOLD_ENV: hold})
    try:
        _wait_for(lambda: complete_steps(ckpt_dir(folder)), proc)
        # The run waits inside its next step, so both Ctrl-Cs land there however slowly this test is scheduled:
        # the first would otherwise let the run save and end before the second.
        open(hold, "w").close()
        _wait_for(lambda: os.path.exists(hold + ".held"), proc)
        saved = complete_steps(ckpt_dir(folder))
        proc.send_signal(signal.SIGINT)
        said = []
        for line in proc.stderr:  # the answer to the first, then the second (two at once may arrive as one)
            said.append(line)
            if line.startswith("SIGINT: "):
                break
        assert said[-1] == "SIGINT: stopping after the current step, with a checkpoint; Ctrl-C again stops at once " \
                           "without saving.\n", "".join(said)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        err = "".join(said) + err
        assert proc.returncode == 130, err
        assert "error: train interrupted at once: nothing was saved since the last complete checkpoint: a rerun " \
               "resumes from it, or starts afresh where there is none." in err
        assert "Traceback" not in err and err.count("error:") == 1 and err.count("SIGINT: ") == 1, err
        assert complete_steps(ckpt_dir(folder)) == saved
    finally:
        if proc.poll() is None:  # failed while held: a run left sleeping would outlive the test
            proc.kill()


def _wait_for(condition, proc, timeout=240):
    deadline = time.time() + timeout
    while True:
        try:
            if condition():
                return
        except ValueError:  # max() of no checkpoints yet
            pass
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.2)


def test_export_reads_the_newer_step_when_a_running_run_prunes_the_one_it_reads(tmp_path, capsys, monkeypatch):
    """export beside a run that saves and prunes: the step it chose went while it read it, and it said the step's
    COMPLETE was missing, 'no older complete step exists', though a newer one did."""
    from nsa_titan import rebuild

    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=3", "--checkpoint.interval=1", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    shutil.move(os.path.join(ckpt_dir(folder), "step-3"), tmp_path / "later")  # not yet saved when export looks
    read = rebuild.read_model_weights

    def saved_and_pruned_meanwhile(where, step, state):
        if step == 2:  # the run saves step 3 and prunes step 2, marker first
            shutil.move(tmp_path / "later", os.path.join(ckpt_dir(folder), "step-3"))
            os.remove(os.path.join(ckpt_dir(folder), "step-2", COMPLETE))
        return read(where, step, state)

    monkeypatch.setattr(rebuild, "read_model_weights", saved_and_pruned_meanwhile)
    capsys.readouterr()
    assert cli.main(["export", *argv, "--output", str(tmp_path / "model.pt")]) == 0
    said = capsys.readouterr()
    assert "note: step 2 was removed while it was read" in said.err and "exported step 3" in said.out, said


def test_export_beside_a_save_under_way_names_the_step_it_reads_instead(tmp_path, capsys):
    """A newer step without its COMPLETE marker (a save under way, or one cut short): export reads the newest
    complete step, as a resume would, and says so (it did so in silence); a step named by load_step is read as
    it is, without the note."""
    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=2", "--checkpoint.interval=1", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    os.remove(os.path.join(ckpt_dir(folder), "step-2", COMPLETE))
    capsys.readouterr()
    assert cli.main(["export", *argv, "--output", str(tmp_path / "model.pt")]) == 0
    said = capsys.readouterr()
    assert "exported step 1" in said.out, said
    assert (f"note: reading step 1, the newest complete one: step-2 in {ckpt_dir(folder)} has no COMPLETE marker "
            f"(a save under way, or one cut short)") in said.err, said.err
    assert cli.main(["export", *argv, "--checkpoint.load_step=1", "--output", str(tmp_path / "one.pt")]) == 0
    assert "newest complete one" not in capsys.readouterr().err


def test_export_round_trip_gives_the_same_logits(tmp_path, capsys):
    from nsa_titan.export import load_exported
    from nsa_titan.config import resolve
    from nsa_titan import assemble
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "run"
    argv = [*BASE, "--training.steps=2", f"--job.dump_folder={folder}"]
    assert cli.main(["train", *argv]) == 0
    out_file = tmp_path / "model.pt"
    assert cli.main(["export", *argv, "--output", str(out_file)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    model, meta = load_exported(str(out_file))
    assert meta["step"] == 2 and meta["recipe_hash"] == resolve(argv).hash
    # The checkpoint's weights, loaded independently through DCP, give the same logits.
    recipe = resolve(argv).recipe
    reference = assemble.build_model_on_meta(recipe, meta["vocab_size"])
    reference.to_empty(device="cpu")
    reference.init_weights()
    state = {"model": reference.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(ckpt_dir(folder), "step-2", "model"), no_dist=True)
    reference.load_state_dict(state["model"])
    tokens = torch.randint(0, meta["vocab_size"], (2, 40))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference.eval()(tokens))
    # The file samples, and the checkpoint plots straight from the recipe.
    assert cli.main(["sample", str(out_file), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    plots = tmp_path / "plots"
    assert cli.main(["plot", *argv, "--text", "def f(x):\n    return x", "--out", str(plots)]) == 0
    assert (plots / "selection_layer0.png").read_bytes().startswith(b"\x89PNG")


def test_resume_takes_optimizer_settings_from_the_recipe(tmp_path, capsys):
    from components.optim import SCHEDULES, lr_factor

    argv = [*BASE, "--training.steps=4", "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    rewind_to(tmp_path, 2)
    capsys.readouterr()
    assert cli.main(["train", *argv, "--optimizer.lr=1e-5", "--metrics.log_freq=1"]) == 0
    assert_resumed_at(capsys.readouterr().out, tmp_path, 2)
    logged = {r["step"]: r["lr"] for r in json_records(tmp_path) if "lr" in r}
    assert sorted(logged) == [3, 4]  # rewind_to emptied metrics.jsonl: only the resumed steps
    for step in (3, 4):
        expected = 1e-5 * lr_factor(step, warmup_steps=2, total_steps=4, shape=SCHEDULES["cosine"], min_lr_factor=0.1)
        assert logged[step] == pytest.approx(expected, rel=1e-12)


def test_resume_takes_an_optimizers_own_arguments_from_the_recipe(tmp_path):
    """Muon's settings live in its param group, which a loaded state replaces: the recipe's win."""
    argv = [*BASE, "--optimizer.name=muon", "--training.steps=4", "--checkpoint.interval=2",
            f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    straight = losses(tmp_path)
    rewind_to(tmp_path, 2)
    assert cli.main(["train", *argv, "--optimizer.muon.ns_steps=1", "--optimizer.muon.momentum=0.5"]) == 0
    resumed = losses(tmp_path)
    assert resumed[3] == straight[3]  # the weights after step 2 are the checkpoint's
    assert resumed[4] != straight[4]  # step 3's update used the new settings


def test_resume_keeps_running_state_an_optimizer_holds_in_its_groups(tmp_path):
    """Only the settings a recipe owns are set back on resume: a count the optimizer keeps in its param groups
    (as schedule-free optimizers do) resumes with the rest of its state, and a group's own base rate stays its
    own, so the run continues to the bit."""
    argv = [*BASE, "--job.plugins=tests.plugins.group_counter", "--optimizer.name=group_counter",
            "--training.steps=4", "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    straight = losses(tmp_path)
    rewind_to(tmp_path, 2)
    assert cli.main(["train", *argv]) == 0
    assert losses(tmp_path) == {3: straight[3], 4: straight[4]}


def test_a_resume_at_another_peak_rate_of_an_optimizer_with_group_rates_notes_no_schedule_jump(tmp_path, capsys):
    """A schedule's share of the peak is read against the group's own base rate (a tenth of optimizer.lr in the
    first group here): a changed optimizer.lr alone is the recipe note's, not a jump of the schedule."""
    argv = [*BASE, "--job.plugins=tests.plugins.group_counter", "--optimizer.name=group_counter",
            "--training.steps=4", "--checkpoint.interval=2", "--lr_scheduler.warmup_steps=1",
            f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    rewind_to(tmp_path, 2)
    capsys.readouterr()
    assert cli.main(["train", *argv, "--optimizer.lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "optimizer.lr" in out, out  # the recipe note names the change
    assert "note: the learning rate" not in out, out


def test_a_warmup_stable_decay_run_extended_on_resume_decays_at_its_new_end(tmp_path, capsys):
    argv = [*BASE, "--checkpoint.interval=2", "--lr_scheduler.decay_steps=1", "--lr_scheduler.decay_type=linear",
            "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv, "--training.steps=4"]) == 0
    rewind_to(tmp_path, 2)  # back into the stable stretch, then train longer
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=6"]) == 0
    assert_resumed_at(capsys.readouterr().out, tmp_path, 2)
    logged = {r["step"]: r["lr"] for r in json_records(tmp_path) if "lr" in r}
    assert sorted(logged) == [3, 4, 5, 6]
    peak = resolve([*argv, "--training.steps=6"]).recipe.optimizer.lr
    assert [logged[s] for s in (3, 4, 5, 6)] == pytest.approx([peak, peak, peak, peak * 0.1], rel=1e-12)


def test_a_finished_run_extended_on_resume_says_its_learning_rate_jumps(tmp_path, capsys):
    """Cosine over 4 steps, then the same run extended to 8: the schedule stretched, so step 5 runs far above
    where step 4 left the rate. The run goes on as its recipe says, but a note gives both rates and the way
    to extend without the jump; the stable stretch of the test above needs none."""
    argv = [*BASE, "--checkpoint.interval=2", "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=1",
            f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv, "--training.steps=4"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=8"]) == 0
    out = capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in json_records(tmp_path) if "lr" in r}
    recipe = resolve([*argv, "--training.steps=8"]).recipe
    # Step 4 ran at the 4-step schedule's floor, where it would have stayed; the 8-step one has step 5 far above.
    floor = recipe.optimizer.lr * recipe.lr_scheduler.min_lr_factor
    assert lrs[4] == pytest.approx(floor) and lrs[5] > 2 * floor
    (note,) = [line for line in out.splitlines() if "the learning rate rises at step 5" in line]
    assert f"to {lrs[5]:.3g} ({100 * lrs[5] / recipe.optimizer.lr:.3g}% of optimizer.lr" in note, note
    assert f"stepped at {floor:.3g} at step 4 and would have gone on at {floor:.3g}" in note, note
    assert "checkpoint.load_step" in note, note
    # The same command again (the run at its new end) and a peak changed alone move no share of it: no note.
    rewind_to(tmp_path, 6)
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=8", "--optimizer.lr=1e-3"]) == 0
    assert "the learning rate" not in capsys.readouterr().out


def test_a_resume_says_which_way_its_learning_rate_jumps_in_absolute_terms(tmp_path, capsys):
    """A lower peak with a longer warmup: the schedule's share of the peak rises at the resumed step, but the
    rate falls, and the note says falls (with the rates), without the advice for a rising rate. A
    warmup-stable-decay run resumed at the end of its stable stretch and extended goes on at its peak: no note."""
    argv = [*BASE, "--checkpoint.interval=6", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path / 'cos'}"]
    assert cli.main(["train", *argv, "--training.steps=12", "--lr_scheduler.warmup_steps=3",
                     "--optimizer.lr=3e-3"]) == 0
    rewind_to(tmp_path / "cos", 6)
    capsys.readouterr()
    # Step 6 ran at 78% of 3e-3 and step 7 would have run at 63%; the new schedule has step 7 at 83% of 1e-3:
    # a larger share of a smaller peak.
    assert cli.main(["train", *argv, "--training.steps=12", "--lr_scheduler.warmup_steps=5",
                     "--optimizer.lr=1e-3"]) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "the learning rate" in line]
    assert note.startswith("note: the learning rate falls at step 7 to 0.000831 (83.1% of optimizer.lr = 0.001)"), note
    assert "stepped at 0.00233 at step 6 and would have gone on at 0.00188" in note, note
    assert "checkpoint.load_step" not in note, note
    wsd = [*BASE, "--checkpoint.interval=3", "--lr_scheduler.decay_steps=2", "--lr_scheduler.decay_type=linear",
           "--lr_scheduler.warmup_steps=1", f"--job.dump_folder={tmp_path / 'wsd'}"]
    assert cli.main(["train", *wsd, "--training.steps=5"]) == 0  # decays over steps 4 and 5
    rewind_to(tmp_path / "wsd", 3)
    capsys.readouterr()
    assert cli.main(["train", *wsd, "--training.steps=7"]) == 0
    assert "the learning rate" not in capsys.readouterr().out


def test_a_validation_lost_between_a_save_and_its_logging_is_made_up_on_resume(tmp_path, capsys, monkeypatch):
    """The run stops right after step 4's save, before the validation due there (a kill, a second Ctrl-C):
    the resume validates step 4's weights before its first step and logs it, so the curve has the point an
    uninterrupted run has, with its value."""
    from nsa_titan.trainer import Trainer

    argv = [*BASE, "--training.steps=6", "--checkpoint.interval=2", "--validation.enable=true",
            "--validation.freq=2", "--validation.steps=2"]
    assert cli.main(["train", *argv, f"--job.dump_folder={tmp_path / 'straight'}"]) == 0
    validate = Trainer.validate

    def killed_at(step):
        def validate_or_stop(self):
            if self.state.step == step:
                raise KeyboardInterrupt  # after the step's save, as a kill there would be
            return validate(self)
        return validate_or_stop

    def validated(folder):
        return [(r["step"], r["val_loss"]) for r in json_records(folder) if "val_loss" in r]

    monkeypatch.setattr(Trainer, "validate", killed_at(4))
    cut = tmp_path / "cut"
    assert cli.main(["train", *argv, f"--job.dump_folder={cut}"]) == 130
    assert complete_steps(ckpt_dir(cut)) == [2, 4]
    monkeypatch.setattr(Trainer, "validate", validate)
    capsys.readouterr()
    assert cli.main(["train", *argv, f"--job.dump_folder={cut}"]) == 0
    assert validated(cut) == validated(tmp_path / "straight") and [s for s, _ in validated(cut)] == [2, 4, 6]
    # Stopped after the last step's save: the same command has no step to take, but logs the validation.
    monkeypatch.setattr(Trainer, "validate", killed_at(6))
    end = tmp_path / "end"
    assert cli.main(["train", *argv, f"--job.dump_folder={end}"]) == 130
    monkeypatch.setattr(Trainer, "validate", validate)
    capsys.readouterr()
    assert cli.main(["train", *argv, f"--job.dump_folder={end}"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert validated(end) == validated(tmp_path / "straight")
    # Logged once: a resume from a step whose validation was logged does not validate it again.
    rewind = [r for r in json_records(cut) if r["step"] <= 4]
    shutil.rmtree(os.path.join(ckpt_dir(cut), "step-6"))
    with open(os.path.join(cut, "metrics.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rewind)
    assert cli.main(["train", *argv, f"--job.dump_folder={cut}"]) == 0
    assert [s for s, _ in validated(cut)] == [2, 4, 6]


def test_a_model_drawing_random_numbers_trains_the_same_curve_straight_and_resumed(tmp_path, capsys, monkeypatch):
    """A forward that draws from torch's global generator (a plugin model's dropout) repeats its run and resumes
    it to the bit: the run seeds the generator from job.seed, a checkpoint restores it, and loading data draws
    nothing from it (a loader's iterator took its seed from it, so a resume drew once more than the straight run)."""
    from nsa_titan import trainer

    cross_entropy = trainer.token_cross_entropy_sum
    monkeypatch.setattr(trainer, "token_cross_entropy_sum", lambda logits, targets: cross_entropy(
        torch.nn.functional.dropout(logits, 0.5, training=torch.is_grad_enabled()), targets))
    argv = [*BASE, "--checkpoint.interval=2", "--data.num_workers=1", "--metrics.telemetry_freq=2",
            "--validation.enable=true", "--validation.freq=2", "--validation.steps=1"]
    for name in ("straight", "again"):
        assert cli.main(["train", *argv, "--training.steps=4", f"--job.dump_folder={tmp_path / name}"]) == 0
    assert cli.main(["train", *argv, "--training.steps=2", f"--job.dump_folder={tmp_path / 'resumed'}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *argv, "--training.steps=4", f"--job.dump_folder={tmp_path / 'resumed'}"]) == 0
    assert_resumed_at(capsys.readouterr().out, tmp_path / "resumed", 2)
    assert losses(tmp_path / "again") == losses(tmp_path / "straight")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


def test_telemetry_lost_between_a_save_and_its_logging_is_made_up_on_resume(tmp_path, monkeypatch):
    """A kill in a save or in the validation after it also costs the telemetry due at that step (taken after the
    validation): the resume takes it on the saved weights and logs it once, with the uninterrupted run's values;
    after the last step's save too, where the same command has no step to take."""
    from nsa_titan.trainer import Trainer

    argv = [*BASE, "--training.steps=6", "--checkpoint.interval=2", "--validation.enable=true",
            "--validation.freq=2", "--validation.steps=2", "--metrics.telemetry_freq=2"]
    assert cli.main(["train", *argv, f"--job.dump_folder={tmp_path / 'straight'}"]) == 0
    validate = Trainer.validate

    def telemetry(folder):
        return [r for r in json_records(folder) if any(key.startswith("telemetry/") for key in r)]

    for step in (4, 6):
        def validate_or_stop(self):
            if self.state.step == step:
                raise KeyboardInterrupt  # after the step's save, as a kill there would be
            return validate(self)

        cut = tmp_path / f"cut-{step}"
        monkeypatch.setattr(Trainer, "validate", validate_or_stop)
        assert cli.main(["train", *argv, f"--job.dump_folder={cut}"]) == 130
        monkeypatch.setattr(Trainer, "validate", validate)
        assert cli.main(["train", *argv, f"--job.dump_folder={cut}"]) == 0
        assert telemetry(cut) == telemetry(tmp_path / "straight")
        assert [r["step"] for r in telemetry(cut)] == [2, 4, 6]


def test_resuming_an_older_step_sets_the_newer_ones_aside(tmp_path, capsys):
    """Newer complete checkpoints are kept aside; a newer save cut short (a kill in a save) holds nothing to
    go back to and is removed, unless something else lies in its folder."""
    argv = [*BASE, "--training.steps=4", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *argv]) == 0
    for cut, extra in ((6, None), (7, "notes.txt"), (8, COMPLETE + ".tmp4242")):  # 8: cut in its marker's rename
        shutil.copytree(os.path.join(ckpt_dir(tmp_path), "step-4"), os.path.join(ckpt_dir(tmp_path), f"step-{cut}"))
        os.remove(os.path.join(ckpt_dir(tmp_path), f"step-{cut}", COMPLETE))
        if extra:
            open(os.path.join(ckpt_dir(tmp_path), f"step-{cut}", extra), "w").close()
    capsys.readouterr()
    assert cli.main(["train", *argv, "--checkpoint.load_step=2"]) == 0
    out = capsys.readouterr().out
    assert "moved the newer checkpoints [3, 4, 7, 8]" in out
    assert "removed the saves of steps [6], which were cut short" in out
    assert complete_steps(ckpt_dir(tmp_path)) == [1, 2, 3, 4]  # 3 and 4 written again by the new branch
    (aside,) = [d for d in os.listdir(ckpt_dir(tmp_path)) if d.startswith("abandoned-")]
    assert sorted(os.listdir(os.path.join(ckpt_dir(tmp_path), aside))) == ["step-3", "step-4", "step-7", "step-8"]
    assert not os.path.exists(os.path.join(ckpt_dir(tmp_path), "step-6"))


@pytest.mark.slow
def test_async_saves_on_two_ranks_complete(tmp_path):
    run(tmp_path, "--checkpoint.interval=1", "--checkpoint.async_mode=async",
        "--parallelism.data_parallel_shard_degree=2", nproc=2, steps=4)
    assert complete_steps(ckpt_dir(tmp_path)) == [1, 2, 3, 4]
    # Each marker records every file of its step, both ranks' (checksummed in the background).
    for step in (1, 4):
        folder = os.path.join(ckpt_dir(tmp_path), f"step-{step}")
        with open(os.path.join(folder, COMPLETE), encoding="utf-8") as fh:
            recorded = json.load(fh)["files"]
        on_disk = {os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files}
        assert set(recorded) == on_disk - {COMPLETE}
        assert {"model/__0_0.distcp", "model/__1_0.distcp", "ranks/rank-1.pt"} <= set(recorded)


def json_records(folder):
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_branches_set_aside_within_one_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """Two resumes from older steps in the same second: the second set-aside must not land in (and fail
    on) the first one's folder."""
    from nsa_titan import checkpoint

    monkeypatch.setattr(checkpoint.time, "strftime", lambda fmt: "20260101-000000")
    folder = tmp_path / "checkpoint"
    ckpt = checkpoint.Checkpointer(str(folder), keep_latest_k=0, async_mode="disabled", rank=0, world_size=1,
                                   say=lambda message: None)

    def complete(step):
        os.makedirs(ckpt.step_dir(step))
        open(os.path.join(ckpt.step_dir(step), checkpoint.COMPLETE), "w").close()

    for step in (2, 4):
        complete(step)
    ckpt.abandon_after(2)
    complete(4)  # the new branch's own step 4
    ckpt.abandon_after(2)
    assert sorted(os.listdir(folder)) == ["abandoned-20260101-000000", "abandoned-20260101-000000-2", "step-2"]
    assert all(os.listdir(folder / name) == ["step-4"] for name in sorted(os.listdir(folder))[:2])


def test_a_run_with_checkpointing_off_says_it_leaves_the_folders_checkpoints_alone(tmp_path, capsys):
    folder = tmp_path / "run"
    assert cli.main(["train", *BASE, "--training.steps=2", "--checkpoint.interval=1",
                     f"--job.dump_folder={folder}"]) == 0
    capsys.readouterr()
    off = [a for a in BASE if not a.startswith("--checkpoint.")] + ["--checkpoint.enable=false"]
    assert cli.main(["train", *off, "--training.steps=1", f"--job.dump_folder={folder}"]) == 0
    out = capsys.readouterr().out
    assert f"note: checkpoint.enable is false, so this run starts at step 0: it neither resumes nor replaces the " \
           f"checkpoints in {ckpt_dir(folder)} (the newest: step 2). To go on from them, add " \
           f"--checkpoint.enable=true" in out, out
    assert "resumed from" not in out and complete_steps(ckpt_dir(folder)) == [1, 2]
