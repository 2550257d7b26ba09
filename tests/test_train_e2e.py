"""The trainer end to end in one process: it trains, logs, and reports what it built."""

from __future__ import annotations

import os
import re

import pytest
import torch

from nsa_titan import cli
from nsa_titan.config import resolve
from tests.launch import DEBUG
from tests.launch import TINY as _TINY
from tests.launch import metrics as read_metrics

TINY = [*_TINY, "--training.local_batch_size=2"]


def test_debug_recipe_trains_and_logs(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--training.steps=4", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    stdout = capsys.readouterr().out

    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_second", "elapsed_s"):
            assert key in record
        assert record["tokens_per_second"] > 0
        assert 0 < record["loss"] < 20
    assert records[0]["lr"] == pytest.approx(3e-3 / 2)  # the first of two warmup steps

    # The start line names the model, its parameter count and the recipe hash.
    resolved = resolve(argv)
    match = re.search(r"run debug \| model transformer: ([\d,]+) parameters \| recipe ([0-9a-f]{12})", stdout)
    assert match, stdout
    from components.models import build_transformer
    from components.data import TOKENIZERS

    vocab = TOKENIZERS["byte"][1]().vocab_size
    model = build_transformer(resolved.recipe.model.args, vocab)
    assert int(match.group(1).replace(",", "")) == sum(p.numel() for p in model.parameters())
    assert match.group(2) == resolved.hash
    saved = (out / "recipe.toml").read_text()
    assert saved.startswith(f"# resolved recipe, hash {resolved.hash}")


def test_changed_recipe_keeps_the_earlier_one(tmp_path):
    out = tmp_path / "run"
    base = [DEBUG, *TINY, "--training.steps=2", f"--job.dump_folder={out}"]
    assert cli.main(["train", *base]) == 0
    first_hash = resolve(base).hash
    assert cli.main(["train", *base, "--optimizer.lr=1e-3"]) == 0
    assert (out / f"recipe.{first_hash}.toml").exists()


def test_loss_falls_on_real_text(tmp_path):
    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2", "--training.steps=40",
            "--lr_scheduler.warmup_steps=5", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    losses = [r["loss"] for r in read_metrics(out)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses


@pytest.mark.parametrize("workers", [0, 2])
def test_validation_is_logged(tmp_path, workers):
    import torch.nn.functional as F

    from nsa_titan.rebuild import load_checkpoint_model
    from tests.test_evaluate import held_out_batches

    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--training.steps=2", "--validation.enable=true", "--validation.freq=2",
            "--validation.steps=2", "--checkpoint.enable=true", f"--data.num_workers={workers}",
            f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    val = [r for r in read_metrics(out) if "val_loss" in r]
    assert len(val) == 1 and val[0]["step"] == 2
    assert val[0]["val_perplexity"] == pytest.approx(2.718281828 ** val[0]["val_loss"], rel=1e-6)

    # The logged loss, computed again apart from the trainer: the weights of the validated step read back
    # from its checkpoint, the first validation.steps held-out batches, each row's documents masked as the
    # recipe says, and the mean over every target token of F.cross_entropy.
    recipe = resolve(argv).recipe
    assert recipe.model.args.document_masking and recipe.validation.steps == 2
    model, _, step = load_checkpoint_model(resolve(argv))
    assert step == 2
    logits, targets = [], []
    with torch.no_grad():
        for batch in held_out_batches(argv, count=recipe.validation.steps):
            assert batch["input"].shape == (recipe.training.local_batch_size, recipe.training.seq_len)
            logits.append(model(batch["input"], documents=batch["document_starts"]))
            targets.append(batch["target"])
    logits, targets = torch.cat(logits), torch.cat(targets)
    assert logits.dtype == torch.float32 and (targets >= 0).all()  # every target counts, as in the trainer
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean").item()
    # fp32 logits of the same weights and tokens; only the order of the sums differs (chunked rows, fp64
    # accumulation in the trainer): measured 1.8e-7 apart, two fp32 ulps of a loss near 5.4. One batch
    # fewer, the training split, or one token fewer a row in the count each move it by more than 0.03.
    assert val[0]["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_validation_reads_its_batches_once_and_evaluates_the_same_ones(tmp_path, monkeypatch):
    from nsa_titan import assemble, validation_set

    built, seen = [], []
    build_loader = assemble.build_loader

    def counting_build_loader(*args, split="train", **kwargs):
        built.append(split)
        return build_loader(*args, split=split, **kwargs)

    monkeypatch.setattr(assemble, "build_loader", counting_build_loader)
    original = validation_set.ValidationSet.batches

    def recording(self):
        for batch in original(self):
            seen.append(batch)
            yield batch

    monkeypatch.setattr(validation_set.ValidationSet, "batches", recording)
    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--training.steps=3", "--validation.enable=true", "--validation.freq=1",
            "--validation.steps=2", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [1, 2, 3]
    # Built for the start-up check and the first evaluation only, yet every evaluation saw the same batches.
    assert built.count("validation") == 2, built
    assert len(seen) == 6
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(seen[:2], seen[2:4])), "another held-out set"
    for i in (2, 4):
        for a, b in zip(seen[i:i + 2], seen[:2]):
            assert a.inputs.dtype == b.inputs.dtype == torch.int64
            assert a.document_starts.dtype == torch.bool and a.document_starts[:, 0].all()
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_missing_cuda_is_a_clear_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = cli.main(["train", DEBUG, *TINY, "--training.device=cuda", f"--job.dump_folder={tmp_path}"])
    assert code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_document_masking_reaches_the_model_in_training_and_validation(tmp_path, monkeypatch):
    """With model.document_masking every forward (training and validation) gets the batch's documents,
    and the run computes something else than without them; off, no forward gets any."""
    from components.models.transformer import Transformer

    seen = []
    forward = Transformer.forward

    def recording(self, tokens, documents=None):
        seen.append((self.training, None if documents is None else documents.cu_seqlens.tolist()))
        return forward(self, tokens, documents)

    monkeypatch.setattr(Transformer, "forward", recording)
    runs = {}
    for masking in ("true", "false"):
        seen.clear()
        out = tmp_path / masking
        argv = [DEBUG, *TINY, "--training.steps=2", "--validation.enable=true", "--validation.freq=2",
                "--validation.steps=1", f"--model.document_masking={masking}", f"--job.dump_folder={out}",
                "--data.source=synthetic", "--data.synthetic.min_length=5", "--data.synthetic.max_length=40"]
        assert cli.main(["train", *argv]) == 0
        runs[masking] = (list(seen), [r["loss"] for r in read_metrics(out) if "loss" in r])
    with_mask, _ = runs["true"]
    assert {training for training, _ in with_mask} == {True, False}  # training and validation forwards
    for _, cu_seqlens in with_mask:
        assert cu_seqlens is not None and cu_seqlens[-1] == 2 * 64 and len(cu_seqlens) > 4  # short documents
    assert all(cu_seqlens is None for _, cu_seqlens in runs["false"][0])
    assert runs["true"][1] != runs["false"][1]


@pytest.mark.parametrize("compile_args, backend", [([], None), (["--compile.enable=true"], "inductor"),
                                                    (["--compile.enable=true", "--compile.backend=aot_eager"],
                                                     "aot_eager")])
def test_the_trainer_tells_the_model_its_compile_backend(tmp_path, compile_args, backend):
    """The `compiled` hook: dense attention takes FlexAttention only in blocks inductor compiles."""
    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    dense_recipe = DEBUG.replace("debug.toml", "debug_dense.toml")
    tiny = [a for a in TINY if "nsa." not in a]
    resolved = resolve([dense_recipe, *tiny, *compile_args, f"--job.dump_folder={tmp_path}"])
    trainer = Trainer(resolved, make_runtime("cpu", "float32"))
    try:
        assert trainer.model.compile_backend == backend
    finally:
        trainer.close()


def test_the_recipe_filter_reaches_the_loader(tmp_path):
    """data.min_document_tokens from the recipe: the debug recipe's stream holds long documents only."""
    from nsa_titan import assemble
    from nsa_titan.runtime import make_runtime

    def document_lengths(minimum):
        recipe = resolve([DEBUG, *TINY, f"--data.min_document_tokens={minimum}", "--data.logical_shards=1",
                          "--training.seq_len=1024", "--model.max_seq_len=1024",
                          f"--job.dump_folder={tmp_path}"]).recipe
        source, tokenizer = assemble.build_source(recipe), assemble.build_tokenizer(recipe)
        loader = assemble.build_loader(recipe, make_runtime("cpu", "float32"), source, tokenizer, dp_rank=0,
                                       dp_size=1, split="train", batch_size=2)
        it = iter(loader)  # one shard: the rows' inputs, one after another, are the stream
        stream = torch.cat([next(it)["input"].flatten() for _ in range(40)])
        edges = (stream == tokenizer.eos_id).nonzero().flatten().tolist()  # document ends
        return [b - a for a, b in zip(edges[1:], edges[2:])]  # documents wholly inside the span

    assert min(document_lengths(0)) < 3000
    assert document_lengths(3000) and min(document_lengths(3000)) >= 3000


@pytest.mark.parametrize("freq", [0, 2])
def test_garbage_is_collected_on_the_step_schedule(tmp_path, monkeypatch, freq):
    """training.gc_freq: automatic collection is off during the run and the young generations are
    collected every freq steps; 0 leaves Python's automatic collector alone. Either way it is on after."""
    import gc

    from nsa_titan.trainer import Trainer

    enabled, collections = [], []
    train_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, it: enabled.append(gc.isenabled()) or train_step(self, it))
    def record(phase, info):  # collections while automatic collection is off: the scheduled ones
        if phase == "start" and not gc.isenabled():
            collections.append(info["generation"])

    gc.callbacks.append(record)
    try:
        assert cli.main(["train", DEBUG, *TINY, "--training.steps=4", f"--training.gc_freq={freq}",
                         f"--job.dump_folder={tmp_path}"]) == 0
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()
    if freq:
        assert enabled == [False] * 4 and collections == [1] * (1 + 4 // freq)  # the clean start, then steps 2 and 4
    else:
        assert enabled == [True] * 4 and collections == []


def test_a_model_the_host_cannot_hold_is_one_message(tmp_path, capsys, monkeypatch):
    """The host allocator's refusal (a plain RuntimeError, as for --model.dim=1000000) names the model's size
    and the fix. Raised by a stand-in: really asking for terabytes could wake the OOM killer instead."""
    from nsa_titan import assemble

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 640000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(assemble, "materialize", refuse)
    code = cli.main(["train", DEBUG, *TINY, f"--job.dump_folder={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 4 and err.count("error:") == 1 and "Traceback" not in err, err  # out of memory's exit code
    assert "the model does not fit in cpu memory:" in err and "parameters and buffers" in err
    assert "model.dim, model.n_layers, model.max_seq_len" in err

    monkeypatch.setattr(assemble, "materialize", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other error is not taken for a lack of memory
        cli.main(["train", DEBUG, *TINY, f"--job.dump_folder={tmp_path / 'run2'}"])


def test_a_users_own_recipe_in_the_dump_folder_is_never_replaced(tmp_path, capsys):
    """A recipe kept beside its outputs (dump_folder = its own folder) is the user's file: the run, which
    keeps its resolved recipe as recipe.toml there, refuses before writing anything; a run's own
    resolved recipe is still replaced (an earlier one kept aside) as before."""
    folder = tmp_path / "exp"
    folder.mkdir()
    mine = f'# my experiment\nextends = "{DEBUG}"\n[job]\ndump_folder = "{folder}"\n'
    (folder / "recipe.toml").write_text(mine)
    assert cli.main(["train", str(folder / "recipe.toml"), *TINY, "--training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "was not written by a run" in err and "move your file out" in err, err
    assert (folder / "recipe.toml").read_text() == mine and sorted(os.listdir(folder)) == ["recipe.toml"]
    run = tmp_path / "run"
    assert cli.main(["train", DEBUG, *TINY, "--training.steps=1", f"--job.dump_folder={run}"]) == 0
    assert (run / "recipe.toml").read_text().startswith("# resolved recipe, hash ")


def test_elapsed_time_counts_on_across_a_resume(tmp_path):
    """elapsed_s is the training time that led to a step, summed over the launches that reached it: a resume
    goes on from its checkpoint's, not from 0."""
    import json

    run = [DEBUG, *TINY, "--checkpoint.enable=true", "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *run, "--training.steps=2"]) == 0
    saved = json.loads((tmp_path / "checkpoint" / "step-2" / "train_state.json").read_text())["elapsed_s"]
    assert saved >= read_metrics(tmp_path)[-1]["elapsed_s"] > 0  # saved after step 2 was logged
    assert cli.main(["train", *run, "--training.steps=4"]) == 0
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # This launch's own time to step 3 is at least that step's time; the launch before it adds its own.
    assert records[2]["elapsed_s"] >= saved + records[2]["step_time_s"], records
    assert records[3]["elapsed_s"] > records[2]["elapsed_s"]


def test_a_resume_with_a_changed_recipe_names_each_change(tmp_path, capsys):
    """Fields changed on resume are applied (a new window, more steps): the run names each one, old and new,
    so that no change passes unseen; the same recipe resumes without the note."""
    run = [DEBUG, *TINY, "--checkpoint.enable=true", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *run, "--training.steps=1"]) == 0
    capsys.readouterr()
    assert cli.main(["train", *run, "--training.steps=2", "--model.nsa.window_size=32"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "note: the recipe differs from the one this run folder's last run kept" in out
    assert "model.nsa.window_size: 16 -> 32" in out and "training.steps: 1 -> 2" in out, out
    assert cli.main(["train", *run, "--training.steps=3", "--model.nsa.window_size=32"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "training.steps: 2 -> 3" in out and "window_size: " not in out, out
    assert cli.main(["train", *run, "--training.steps=3", "--model.nsa.window_size=32"]) == 0  # nothing to train
    assert "the recipe differs" not in capsys.readouterr().out


def test_folders_that_cannot_be_written_stop_the_run_before_it_trains(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    assert cli.main(["train", DEBUG, *TINY, f"--job.dump_folder={a_file / 'run'}"]) == 2
    assert "cannot create job.dump_folder" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "a_file").write_text("not a folder")  # the run's own folders go inside job.dump_folder
    for field, switch in (("checkpoint.folder", "checkpoint.enable"), ("metrics.save_tb_folder",
                                                                       "metrics.enable_tensorboard"),
                          ("profiling.folder", "profiling.enable")):
        code = cli.main(["train", DEBUG, *TINY, f"--job.dump_folder={run}", f"--{switch}=true",
                         f"--{field}=a_file/out"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
        assert f"cannot create the folder {str(run / 'a_file' / 'out')!r} ({field} = " in err, err
        # It offered 'or an absolute path', which the recipe refuses for the run's own folders.
        assert f"--{field}=NAME (a relative path inside job.dump_folder), or move away the file in its way." in err
        assert not (run / "metrics.jsonl").exists()  # nothing trained: no step to lose


def test_no_micro_batchs_logits_outlive_its_backward(tmp_path, monkeypatch):
    """The logits (B x T x V, the largest activation) of one micro-batch are gone before the next
    micro-batch's forward and before the optimizer step; validation holds one batch's at a time too."""
    import weakref

    from nsa_titan import trainer as trainer_module
    from nsa_titan.runtime import make_runtime
    from nsa_titan.trainer import Trainer

    resolved = resolve([DEBUG, *TINY, "--training.global_batch_size=6", "--validation.steps=3",
                        f"--job.dump_folder={tmp_path}"])
    trainer = Trainer(resolved, make_runtime("cpu", "float32"))
    made, alive_at = [], []
    forward = trainer._forward

    def watched_forward(batch):
        alive_at.append(sum(ref() is not None for ref in made))
        logits, targets = forward(batch)
        made.append(weakref.ref(logits))
        return logits, targets

    clip = trainer_module.clip_grad_norm

    def watched_clip(params, max_norm):
        alive_at.append(sum(ref() is not None for ref in made))
        return clip(params, max_norm)

    monkeypatch.setattr(trainer, "_forward", watched_forward)
    monkeypatch.setattr(trainer_module, "clip_grad_norm", watched_clip)
    try:
        trainer.train_step(iter(trainer.train_loader))
        assert trainer.grad_accum == 3 and len(made) == 3
        trainer.validate()
        assert len(made) == 3 + 9  # the held-out set: 3 global batches of 6 rows, in batches of 2
    finally:
        trainer.close()
    assert alive_at == [0] * (3 + 1 + 9), alive_at  # 3 forwards, the step, 9 validation forwards


def test_the_debug_recipes_held_out_set_is_whole_on_a_standard_library_without_its_tests(monkeypatch):
    """Python images often ship the standard library without its test folders (about 730 of 1,790 files on 3.11):
    the default recipe's held-out set is still whole there, so its validation covers every row it asks for and no
    note tells a first run to change the shipped recipe."""
    from components.data.sources import python_stdlib
    from nsa_titan import assemble, held_out
    from nsa_titan.runtime import make_runtime

    every_file = python_stdlib.stdlib_files
    monkeypatch.setattr(python_stdlib, "stdlib_files", lambda root: [
        f for f in every_file(root) if not {"test", "tests", "idle_test"} & set(f.key.split("/")[:-1])])
    recipe = resolve([DEBUG]).recipe
    rows = held_out.held_out_rows(recipe)
    found = held_out.rank_rows(recipe, make_runtime("cpu", "float32"), assemble.build_source(recipe),
                               assemble.build_tokenizer(recipe), 0, 1, rows, workers=False)
    assert sum(1 for _ in found) == rows
