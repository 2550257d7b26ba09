"""`nsa-titan eval`: loss by context position and the passkey probe, on a tiny checkpoint, offline."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from components.data import ByteTokenizer
from components.errors import UserError
from nsa_titan import cli
from nsa_titan.evaluate.passkey import NEEDLE, passkey_accuracy, prompt, shortest_length
from nsa_titan.evaluate.position_loss import context_positions, loss_by_position
from tests.launch import DEBUG, TINY


def test_context_positions_restart_at_documents_only_when_masked():
    """The tokens of context each input position's prediction has: the input token and those before it in
    its document (masked), or in the row."""
    starts = torch.tensor([[True, False, False, True, False], [False, False, True, False, False]])
    assert context_positions(starts, (2, 5), masked=True).tolist() == [[1, 2, 3, 1, 2], [1, 2, 1, 2, 3]]
    assert context_positions(starts, (2, 5), masked=False).tolist() == [[1, 2, 3, 4, 5]] * 2


def test_loss_by_position_is_the_mean_of_each_positions_losses():
    """Each prediction counts at its context length; one made at an end of text (its target is the next
    document's first token) counts nowhere."""
    torch.manual_seed(0)
    vocab, T, eos = 11, 6, 10
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))
    batches = [{"input": torch.randint(0, eos, (2, T)), "target": torch.randint(0, vocab, (2, T)),
                "document_starts": torch.zeros(2, T, dtype=torch.bool)} for _ in range(3)]
    batches[0]["input"][1, 4] = eos  # that row's prediction at position 4 crosses into another document
    got = loss_by_position(model, lambda starts: None, batches, T, lambda items: items, eos)
    losses = torch.stack([F.cross_entropy(model(b["input"]).flatten(0, 1), b["target"].flatten(), reduction="none")
                          .view(2, T) for b in batches])
    assert got["positions"] == list(range(1, T + 1)) and got["tokens"] == [6, 6, 6, 6, 5, 6]
    kept = torch.ones(3, 2, T, dtype=torch.bool)
    kept[0, 1, 4] = False
    expected = (losses * kept).sum(dim=(0, 1)) / kept.sum(dim=(0, 1))
    torch.testing.assert_close(torch.tensor(got["mean_loss"], dtype=torch.float32), expected)
    # A BOS that is the end-of-text token (tiktoken with data.add_bos) opens a document: its prediction stays.
    batches[0]["document_starts"][1, 4] = True
    assert loss_by_position(model, lambda starts: None, batches, T, lambda items: items, eos)["tokens"][4] == 5
    assert loss_by_position(model, lambda starts: None, batches, T, lambda items: items, eos,
                            bos_id=eos)["tokens"] == [6] * T


def test_passkey_prompts_hide_the_key_at_the_depth_and_score_the_answer():
    tok = ByteTokenizer()
    shortest = shortest_length(tok)
    for depth in (0.0, 0.5, 1.0):
        ids = prompt(tok, 300, depth, "12345")
        text = tok.decode(ids)
        assert len(ids) == 300 and text.endswith("The pass key is")
        where = text.index(NEEDLE.format(key="12345")) / (300 - shortest)
        assert where == pytest.approx(depth, abs=0.01)
    with pytest.raises(ValueError, match="too short"):
        prompt(tok, shortest - 1, 0.5, "12345")
    # A run trained with data.add_bos gets the BOS its documents began with, within the length.
    with_bos = prompt(tok, 300, 0.5, "12345", add_bos=True)
    assert len(with_bos) == 300 and with_bos[0] == tok.bos_id and tok.bos_id not in with_bos[1:]
    assert shortest_length(tok, add_bos=True) == shortest + 1

    def oracle(right: bool):
        """A 'model' that answers with the key read from the prompt (or a wrong one)."""
        def generate(model, tokens, new_tokens, temperature):
            key = tok.decode(tokens[0].tolist()).split("The pass key is ")[1][:5]
            answer = tok.encode(" " + (key if right else "00000"))[:new_tokens]
            return torch.cat([tokens, torch.tensor([answer])], dim=1)
        return generate

    model = torch.nn.Linear(1, 1)
    for right, accuracy in ((True, 1.0), (False, 0.0)):
        result = passkey_accuracy(model, tok, oracle(right), [150, 200], [0.0, 1.0], 2, 0, lambda items: items)
        assert result["accuracy"] == [[accuracy, accuracy], [accuracy, accuracy]]


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    # short documents: the held-out rows hold ends of text and document starts
    argv = [DEBUG, *TINY, "--training.steps=2", "--checkpoint.enable=true", "--model.max_seq_len=128",
            "--data.source=synthetic", "--data.synthetic.min_length=5", "--data.synthetic.max_length=40",
            f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    return argv


def held_out_batches(argv, count=2):
    """The first held-out batches of the run's endless held-out stream, read in this process: round robin over
    the logical shards, so the first validation.steps x local_batch_size rows take an equal share of each
    shard's first windows (the held-out set of a run whose global batch is its local batch)."""
    from nsa_titan import assemble
    from nsa_titan.config import resolve
    from nsa_titan.runtime import make_runtime

    recipe = resolve(argv, world_size=None).recipe
    loader = assemble.build_loader(recipe, make_runtime("cpu", "float32"), assemble.build_source(recipe),
                                   assemble.build_tokenizer(recipe), dp_rank=0, dp_size=1, split="validation",
                                   batch_size=recipe.training.local_batch_size, num_workers=0)
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


def test_eval_writes_results_and_plots(checkpointed_run, tmp_path, capsys):
    out = tmp_path / "eval"
    code = cli.main(["eval", *checkpointed_run, "--out", str(out), "--batches", "2", "--trials", "1",
                     "--depths", "0,1"])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert "evaluated checkpoint step 2" in said.out and "differs" not in said.out
    # The training command line given again: the flags eval does not read are named, not refused.
    assert ("note: eval does not read --training.device, --lr_scheduler.warmup_steps, --metrics.log_freq, "
            "--checkpoint.enable, --validation.enable, --training.steps: they change nothing here\n") in said.err
    results = json.loads((out / "eval.json").read_text())
    positions = results["position_loss"]
    # 2 batches of 8 rows of 64 tokens, less the predictions made at an end of text
    ends = sum(int((batch["input"] == 257).sum()) for batch in held_out_batches(checkpointed_run))
    assert ends > 20 and positions["positions"][0] == 1 and sum(positions["tokens"]) == 2 * 8 * 64 - ends
    assert max(positions["positions"]) <= 41  # a document's context: at most its 40 tokens and its end
    assert all(0 < loss < 20 for loss in positions["mean_loss"])
    passkey = results["passkey"]
    assert passkey["depths"] == [0.0, 1.0] and max(passkey["lengths"]) <= 128
    assert all(0 <= a <= 1 for row in passkey["accuracy"] for a in row)
    for name in ("position_loss.png", "passkey.png"):
        assert (out / name).stat().st_size > 1000

    # A second eval into the folder is refused before any work and leaves the results alone ...
    earlier = (out / "eval.json").read_text()
    again = ["eval", *checkpointed_run, "--out", str(out), "--batches", "1", "--trials", "1", "--depths", "0"]
    assert cli.main(again) == 2
    assert "holds an earlier eval's results (eval.json, position_loss.png, passkey.png)" in capsys.readouterr().err
    assert (out / "eval.json").read_text() == earlier
    assert cli.main([*again, "--overwrit"]) == 2  # a misspelled option is named before the folder is judged
    assert "eval has no option '--overwrit' (did you mean '--overwrite'?)" in capsys.readouterr().err
    # ... unless --overwrite, which replaces every earlier result (an lm_eval.json of another model too).
    (out / "lm_eval.json").write_text("{}")
    assert cli.main([*again, "--overwrite"]) == 0, capsys.readouterr().err
    assert json.loads((out / "eval.json").read_text())["passkey"]["depths"] == [0.0]
    assert not (out / "lm_eval.json").exists()


def test_trials_0_skips_the_passkey_probe(checkpointed_run, tmp_path, capsys):
    """--trials 0 measures the loss by position alone: no passkey result or picture (an earlier passkey.png goes
    with --overwrite), and a model too short for the prompt is evaluated rather than refused."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "passkey.png").write_text("an earlier eval's picture")
    short = [*checkpointed_run, "--model.max_seq_len=64"]  # the prompt takes more than 64 byte tokens
    assert cli.main(["eval", *short, "--out", str(out), "--batches", "1", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "the passkey prompt needs" in err and "Fix: add --trials 0 to skip the passkey probe" in err, err
    assert cli.main(["eval", *short, "--out", str(out), "--batches", "1", "--trials", "0", "--overwrite"]) == 0
    said = capsys.readouterr().out
    assert "no passkey probe (--trials 0)" in said and "passkey.png" not in said, said
    results = json.loads((out / "eval.json").read_text())
    assert results["passkey"] is None and sum(results["position_loss"]["tokens"]) > 0
    assert sorted(os.listdir(out)) == ["eval.json", "position_loss.png"]


def test_a_tokenizer_without_digits_is_refused_the_passkey_probe(checkpointed_run, tmp_path, capsys, monkeypatch):
    """No continuation it decodes can spell a key: the probe reported 0% as if it measured the model."""
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: [b for b in text.encode() if not 48 <= b <= 57])
    out = tmp_path / "eval"
    assert cli.main(["eval", *checkpointed_run, "--out", str(out), "--batches", "1", "--trials", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: tokenizer 'byte' cannot write a passkey: it reads the digits ' 0123456789' as ' ', so every " \
           "trial would fail whatever the model reads of its context. Fix: add --trials 0" in err, err
    assert not out.exists()
    assert cli.main(["eval", *checkpointed_run, "--out", str(out), "--batches", "1", "--trials", "0"]) == 0


def test_a_failed_write_leaves_the_earlier_results(checkpointed_run, tmp_path, capsys, monkeypatch):
    """--overwrite removes the earlier results only once the new ones are written: a full disk midway
    leaves them as they were, in one message."""
    out = tmp_path / "eval"
    out.mkdir()
    for name in ("eval.json", "position_loss.png", "passkey.png"):
        (out / name).write_text(f"earlier {name}")
    from matplotlib.figure import Figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    code = cli.main(["eval", *checkpointed_run, "--out", str(out), "--batches", "1", "--trials", "1", "--depths", "0",
                     "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the eval results into --out" in err and "No space left on device" in err, err
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == ["eval.json", "passkey.png", "position_loss.png"]  # no temporary file left
    assert all((out / name).read_text() == f"earlier {name}" for name in os.listdir(out))


def test_eval_says_where_its_recipe_differs_from_the_runs(checkpointed_run, tmp_path, capsys):
    code = cli.main(["eval", *checkpointed_run, "--training.steps=9", "--out", str(tmp_path / "eval"), "--batches",
                     "1", "--trials", "1", "--depths", "0"])
    said = capsys.readouterr().out
    assert code == 0 and "note: the recipe differs from the run's recipe.toml" in said
    assert "training.steps: 2 -> 9" in said, said


def test_a_held_out_set_short_of_the_rows_asked_for_is_said(checkpointed_run, tmp_path, capsys):
    """--batches beyond what the shards hold out measures the tokens there are, each document once, and says how
    many of those asked for, as training says it of validation.steps (it was silent); a set that fills its rows
    says nothing."""
    from tests.test_held_out import synthetic_held_out_tokens

    for documents, short in ((256, False), (2, True)):  # two held-out documents: two of the four shards hold none
        out = tmp_path / str(documents)
        assert cli.main(["eval", *checkpointed_run, f"--data.synthetic.validation_documents={documents}", "--out",
                         str(out), "--batches", "4", "--trials", "0"]) == 0
        err = capsys.readouterr().err
        found = re.search(r"note: the held-out set holds (\d+) of the 2,048 tokens \(32 rows of 64\) --batches asks "
                          r"for", err)
        assert (found is not None) == short, err
    tokens = synthetic_held_out_tokens(2, 32, min_length=5, max_length=40)
    assert int(found.group(1)) == tokens < 64  # the two documents, once
    measured = sum(json.loads((out / "eval.json").read_text())["position_loss"]["tokens"])
    assert measured == tokens  # each shard's one document ends its stream: its end of text is a target only
    assert "ask for fewer" not in err and "Fix: hold out more documents (the source's validation_fraction" in err, err
    # A batch's worth held out: fewer batches fill the set.
    many = synthetic_held_out_tokens(40, 32, min_length=5, max_length=40)
    assert 512 <= many < 2048
    assert cli.main(["eval", *checkpointed_run, "--data.synthetic.validation_documents=40", "--out",
                     str(tmp_path / "40"), "--batches", "4", "--trials", "0"]) == 0
    err = capsys.readouterr().err
    assert f"holds {many:,} of the 2,048 tokens (32 rows of 64) --batches asks for" in err, err
    assert f"Fix: ask for fewer (--batches {many // 512} at most), or hold out more documents" in err, err


def test_a_held_out_set_of_no_rows_names_fixes_that_eval_can_use(checkpointed_run, tmp_path, capsys):
    """It said 'or train without validation (validation.enable = false)', which eval does not read."""
    assert cli.main(["eval", *checkpointed_run, "--data.min_document_tokens=100000000", "--out", str(tmp_path),
                     "--trials", "0"]) == 2
    err = capsys.readouterr().err
    assert "so there is no held-out data to validate on. Fix: raise the data source's validation_fraction" in err, err
    assert ("or evaluate with the data settings of the run's own recipe.toml (the set its validation loss was logged "
            "on), or lower data.min_document_tokens.") in err and "validation.enable" not in err, err


def test_a_held_out_set_of_no_rows_from_the_runs_own_data_names_no_circular_fix(tmp_path, capsys):
    """Read with the run's own data settings (its recipe.toml as it is), an empty held-out set was told to 'evaluate
    with the data settings of the run's own recipe.toml': those very settings."""
    corpus = tmp_path / "a.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 5}) + "\n"
                              for i in range(60)))
    run = tmp_path / "run"
    assert cli.main(["train", DEBUG, *TINY, "--training.steps=1", "--checkpoint.enable=true",
                     "--data.logical_shards=64", "--data.source=text_files", f"--data.text_files.paths={corpus}",
                     f"--job.dump_folder={run}"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(run / "recipe.toml"), "--out", str(tmp_path / "eval"), "--batches", "1",
                     "--trials", "0"]) == 2
    err = capsys.readouterr().err
    assert "so there is no held-out data to validate on. Fix: these are the run's own data settings, which hold " \
           "out no document for these rows (a larger validation_fraction would score documents the model trained " \
           "on): give data flags that read text it did not train on, e.g. another --data.source or other files in " \
           "its table (--data.text_files.FIELD=...)." in err, err
    assert "recipe.toml (the set its validation loss was logged on)" not in err, err


def test_eval_reads_checkpoint_load_step_whatever_checkpoint_enable_says(checkpointed_run, tmp_path, capsys):
    """A run folder keeps its checkpoints when a later run there turned checkpoints off, and its recipe.toml then
    says checkpoint.enable = false: --checkpoint.load_step, which export's own refusal of a step folder names, was
    refused as ignored ('add --checkpoint.enable=true', a flag eval then said it did not read). Training, which does
    ignore it, still refuses it."""
    argv = [*checkpointed_run, "--checkpoint.enable=false", "--checkpoint.load_step=2"]
    assert cli.main(["eval", *argv, "--out", str(tmp_path), "--batches", "1", "--trials", "0"]) == 0
    assert "evaluated checkpoint step 2 of" in capsys.readouterr().out
    assert cli.main(["train", *argv, "--print-config"]) == 2
    assert "checkpoint.load_step = 2: is set on the command line but checkpoint.enable is false" in \
        capsys.readouterr().err


def test_a_source_holding_out_nothing_names_a_fix_eval_can_use(checkpointed_run, tmp_path, capsys):
    """It said 'or turn validation off (validation.enable = false)': eval reads the held-out set whatever that says."""
    argv = [arg for arg in checkpointed_run if not arg.startswith("--data.synthetic.")]
    argv.append("--data.source=python_stdlib")
    assert cli.main(["eval", *argv, "--data.python_stdlib.validation_fraction=0", "--out", str(tmp_path / "none"),
                     "--trials", "0"]) == 2
    err = capsys.readouterr().err
    assert "holds out no validation documents" in err and "Fix: set the source's validation_fraction above 0" in err
    assert "validation.enable" not in err, err
    assert cli.main(["eval", *argv, "--data.python_stdlib.validation_fraction=0.01", "--out", str(tmp_path / "some"),
                     "--batches", "1", "--trials", "0"]) == 0  # the fix it names


@pytest.mark.parametrize("extra, message", [
    # It gave `nsa-titan eval recipes/debug.toml --out outputs/debug/eval` whatever was evaluated.
    ([], "eval needs --out DIR for its results. Fix: add --out DIR (e.g. --out eval) to the command."),
    (["--out", "X", "--depths", "0,2"], "--depths must lie in"),
    (["--out", "X", "--lengths", "abc"], "is not a comma-separated list of whole numbers"),
    (["--out", "X", "--depths", "0.5,,"], "--depths = '0.5,,' is not a comma-separated list of numbers"),
    (["--out", "X", "--lengths", "500"], "--lengths must lie in"),
    (["--out", "X", "--batchs", "2"], "eval has no option '--batchs' (did you mean '--batches'?)"),
    (["--out", "X", "--trials", "-1"], "--trials must be at least 0 (0 skips the passkey probe), got -1"),
    (["--out", "X", "--trials", "0", "--depths=0.5"], "--lengths and --depths shape the passkey probe"),
    (["--out", "X", "--trials", "0", "--lengths", "100"], "--lengths and --depths shape the passkey probe"),
])
def test_eval_bad_options(checkpointed_run, tmp_path, capsys, extra, message):
    extra = [str(tmp_path) if x == "X" else x for x in extra]
    assert cli.main(["eval", *checkpointed_run, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, default, one", [("--batches", None, True), ("--limit", None, True),
                                                ("--trials", "5", True), ("--depths", "0,0.25,0.5,0.75,1", False)])
def test_an_unreadable_number_names_an_example_the_option_takes(name, default, one):
    """--batches x said 'Fix: e.g. --batches=64,128', which --batches (one value) refuses in turn."""
    from nsa_titan.evaluate.command import _numbers

    kind = float if name == "--depths" else int
    with pytest.raises(UserError) as refused:
        _numbers([name, "x"], name, kind, default, one)
    example = re.search(r"Fix: e\.g\. (\S+)\.$", str(refused.value)).group(1)
    assert example.startswith(f"{name}=")
    assert _numbers([example], name, kind, default, one)  # the example is taken as it is written


def test_unreadable_lengths_are_given_no_example_the_model_may_refuse(checkpointed_run, tmp_path, capsys):
    """--lengths abc said 'Fix: e.g. --lengths=64,128', which the debug model then refuses (its lengths lie in
    74..120): which lengths fit is the model's to say, and leaving --lengths out always fits."""
    def refused(*extra: str) -> str:
        assert cli.main(["eval", *checkpointed_run, *extra]) == 2
        return capsys.readouterr().err

    err = refused("--out", str(tmp_path / "a"), "--lengths", "abc")
    assert err == ("error: --lengths = 'abc' is not a comma-separated list of whole numbers. Fix: give passkey prompt "
                   "lengths in tokens that fit the model (eval names its range when one does not), or leave --lengths "
                   "out for up to four that do, the longest what max_seq_len leaves the answer.\n")
    err = refused("--out", str(tmp_path / "b"), "--lengths", "64,128")
    assert "--lengths must lie in 74..120" in err and "Fix: e.g. --lengths 74,120." in err


def test_the_help_gives_passkey_lengths_the_shipped_debug_model_takes():
    """eval's help showed --lengths 64,128, shorter than the debug model's passkey prompt (its lengths lie in
    74..248)."""
    from nsa_titan import assemble
    from nsa_titan.config import resolve
    from nsa_titan.evaluate import command

    recipe = resolve([DEBUG], world_size=None).recipe
    shown = {re.search(r"--lengths (\S+) \(", command.__doc__).group(1),
             re.search(r"\[--lengths (\S+)\]", cli.COMMANDS["eval"]).group(1)}
    assert len(shown) == 1
    lengths = [int(n) for n in shown.pop().split(",")]
    assert command._passkey_lengths(assemble.build_tokenizer(recipe), recipe, lengths) == lengths


def test_a_triton_trained_model_is_read_on_the_cpu_with_the_reference_backend(monkeypatch):
    """eval, plot and the harness read a model on the CPU: one trained with the Triton backend (the 125M
    recipes') computes there with the reference backend, the same function of the same weights, and says
    so (its forward stopped at 'needs CUDA tensors')."""
    import dataclasses

    from components.models.args import NSAArgs, TransformerArgs
    from nsa_titan import registry
    from nsa_titan.rebuild import rebuild_model

    monkeypatch.setattr("components.nsa.triton.launch.interpreting", lambda: False)  # as on a machine without CUDA
    args = TransformerArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64,
                           nsa=NSAArgs(block_size=8, block_stride=4, sel_block_size=8, num_selected=2, window_size=16,
                                       backend="triton"))
    trained = registry.get("model", "transformer").build(args, 61)
    said = []
    model = rebuild_model("transformer", dataclasses.asdict(args), 61, trained.state_dict(), "cpu", say=said.append)
    assert said == ["note: model.nsa.backend = 'triton' runs CUDA kernels; on cpu the model computes with the "
                    "'reference' backend (the same function of the same weights)"]
    tokens = torch.randint(0, 61, (1, 40))
    reference = dataclasses.replace(args, nsa=dataclasses.replace(args.nsa, backend="reference"))
    same = registry.get("model", "transformer").build(reference, 61)
    same.load_state_dict(trained.state_dict())
    torch.testing.assert_close(model(tokens), same.eval()(tokens), rtol=0, atol=0)


def test_the_summary_line_weighs_a_band_of_positions_at_each_end():
    """The far end of a held-out set may hold one token per position: the summary gives the token-weighted loss
    over the first and the last tenth of positions, with their token counts, not one position's loss each."""
    from nsa_titan.evaluate.command import context_bands

    positions = {"positions": [1, 2, 3, 500, 1022, 1023, 1024], "mean_loss": [1.5, 1.6, 1.7, 3.0, 4.0, 5.0, 9.0],
                 "tokens": [30, 30, 30, 10, 1, 1, 2]}
    assert context_bands(positions) == ("loss 1.600 with 1-3 tokens of context (90 tokens), 6.750 with 1022-1024 "
                                        "tokens of context (4 tokens)")
    assert context_bands({"positions": [], "mean_loss": [], "tokens": []}) == "no held-out token was scored"
