"""eval of an export read elsewhere than where its run started: the recipe's relative data paths (text_files paths, a
parquet builder's data_files, a local dataset folder, each a mixture member here) are read from the folder the export
was made in, data that is gone is named with where it was and the data flag that reads it where it is now, and such a
flag (--data.text_files.paths=..., a mixture member's) is read from the current folder; flags that would change what
the model reads are refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from nsa_titan import cli
from tests.launch import DEBUG, TINY
from tests.test_data_helpers import unique_texts, write_jsonl, write_parquet

MIXTURE = f"""extends = [{json.dumps(DEBUG)}]

[data]
source = "mixture"

[data.mixture.sources.code]
weight = 1.0
source = "text_files"
paths = ["corpus/*.jsonl"]
validation_fraction = 0.2

[data.mixture.sources.web]
weight = 1.0
source = "huggingface"
path = "parquet"
name = ""
data_files = ["web/b.parquet"]
validation_fraction = 0.2

[data.mixture.sources.books]
weight = 1.0
source = "huggingface"
path = "books"
name = ""
validation_fraction = 0.2
"""
EVAL = ["--batches", "1", "--trials", "0"]
RUN = ["mix.toml", *TINY, "--training.steps=1", "--checkpoint.enable=true", "--job.dump_folder=run"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A run over local data named by relative paths, exported as model.pt and evaluated in its own folder."""
    project = tmp_path_factory.mktemp("project")
    for folder in ("corpus", "web", "books"):
        (project / folder).mkdir()
    write_jsonl(str(project / "corpus" / "a.jsonl"), unique_texts(60, seed=1))
    write_parquet(str(project / "web" / "b.parquet"), unique_texts(60, seed=2))
    write_parquet(str(project / "books" / "train.parquet"), unique_texts(60, seed=3))
    (project / "mix.toml").write_text(MIXTURE)
    return _trained_and_evaluated(project, RUN, "model.pt", "eval")


def _trained_and_evaluated(project, run: list[str], export: str, out: str):
    """`project` after training `run` there, exporting it as `export` and evaluating that into `out`."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(project)
        assert cli.main(["train", *run]) == 0
        assert cli.main(["export", *run, "--output", export]) == 0
        assert cli.main(["eval", export, "--out", out, *EVAL]) == 0
    return project


def _exported(project, run: list[str], name: str, hf: str):
    """project / name: the run's .pt export, or (name == hf) its --format hf folder, made there."""
    if name == hf:
        pytest.importorskip("safetensors", reason="the hf extra (pip install -e '.[hf]')")
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(project)
            assert cli.main(["export", *run, "--format", "hf", "--output", hf]) == 0
    return project / name


@pytest.fixture(scope="module", params=["model.pt", "hf"])
def export(request, project):
    """The run's export: a file, or a --format hf folder (which carries its tokenizer but not its data)."""
    return _exported(project, RUN, request.param, "hf")


def _position_loss(folder) -> dict:
    return json.loads((folder / "eval.json").read_text())["position_loss"]


def test_eval_of_an_export_reads_its_relative_data_from_where_it_was_made(project, export, tmp_path, monkeypatch,
                                                                         capsys):
    """Refused from another folder: 'the path 'corpus/*.jsonl' matches no file (relative to the directory the run
    starts in, ...)', a fix a reader of an export cannot follow (a --format hf folder recorded where it was made only
    for its plugins)."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["eval", str(export), "--out", "eval", *EVAL]) == 0, capsys.readouterr().err
    assert _position_loss(tmp_path / "eval") == _position_loss(project / "eval")  # the same held-out rows


def test_eval_of_an_export_whose_data_is_gone_names_it_where_it_was_and_the_flag_for_where_it_is(
        project, export, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for folder in ("corpus", "web"):
        shutil.move(project / folder, tmp_path / folder)  # here now, where the paths do not lead
    try:
        code = cli.main(["eval", str(export), "--out", "eval", *EVAL])
    finally:
        for folder in ("corpus", "web"):
            shutil.move(tmp_path / folder, project / folder)
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert (f"the recipe saved in {str(export)!r} (exported in {project}, which its relative paths are read from) "
            f"reads its data from data.mixture.sources.code.paths 'corpus/*.jsonl' ({project / 'corpus' / '*.jsonl'}), "
            f"data.mixture.sources.web.data_files 'web/b.parquet' ({project / 'web' / 'b.parquet'}), which are not "
            f"there now. Fix: put the data back there, or name where it is now: `nsa-titan eval {export} "
            "--data.mixture.sources.code.paths=... --data.mixture.sources.web.data_files=... --out DIR` (a relative "
            "path given there is read from the current folder).") in err, err
    assert not (tmp_path / "eval").exists()


def test_eval_of_an_export_whose_member_data_is_gone_where_it_was_made_names_a_flag_that_exists(project, tmp_path,
                                                                                                monkeypatch, capsys):
    """Read where it was made, an export whose mixture member's file was gone suggested --data.mixture.FIELD=..., which
    no recipe takes, then a flag of the run's recipe, which a holder of the export alone may not have; it names the
    member's field, which the export takes."""
    monkeypatch.chdir(project)
    capsys.readouterr()
    shutil.move(project / "corpus", tmp_path / "corpus")
    try:
        code = cli.main(["eval", "model.pt", "--out", str(tmp_path / "eval"), *EVAL])
        err = capsys.readouterr().err
        assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
        assert ("the recipe saved in 'model.pt' reads its data from data.mixture.sources.code.paths 'corpus/*.jsonl', "
                "which is not there now. Fix: put the data back there, or name where it is now: `nsa-titan eval "
                "model.pt --data.mixture.sources.code.paths=... --out DIR`") in err, err
        flag = f"--data.mixture.sources.code.paths={tmp_path / 'corpus' / 'a.jsonl'}"
        assert cli.main(["eval", "model.pt", flag, "--out", str(tmp_path / "eval"), *EVAL]) == 0, \
            capsys.readouterr().err
    finally:
        shutil.move(tmp_path / "corpus", project / "corpus")
    assert _position_loss(tmp_path / "eval") == _position_loss(project / "eval")


PLAIN = [DEBUG, *TINY, "--training.steps=1", "--checkpoint.enable=true", "--job.dump_folder=plain_run",
         "--data.source=text_files", "--data.text_files.paths=corpus/*.jsonl",
         "--data.text_files.validation_fraction=0.2"]


@pytest.fixture(scope="module")
def plain_run(project):
    """A text_files run over the project's corpus by a relative path, exported as plain.pt and evaluated there."""
    return _trained_and_evaluated(project, PLAIN, "plain.pt", "plain_eval")


@pytest.fixture(scope="module", params=["plain.pt", "plain_hf"])
def plain(request, plain_run):
    return _exported(plain_run, PLAIN, request.param, "plain_hf")


def test_an_export_whose_data_is_gone_reads_it_where_a_data_flag_says(plain, tmp_path, monkeypatch, capsys):
    """An export copied without its data (an hf folder is meant to travel) could not be evaluated by whoever held it:
    eval had no option --data.text_files.paths ('recipe overrides go with a recipe, not an exported file'), and the
    fix for the data said to put it back or evaluate the run's checkpoint from its recipe."""
    project = plain.parent
    monkeypatch.chdir(tmp_path)
    shutil.copytree(project / "corpus", tmp_path / "copy")
    shutil.move(project / "corpus", tmp_path / "moved")
    capsys.readouterr()
    try:
        assert cli.main(["eval", str(plain), "--out", "refused", *EVAL]) == 2
        assert f"name where it is now: `nsa-titan eval {plain} --data.text_files.paths=... --out DIR`" in \
            capsys.readouterr().err
        code = cli.main(["eval", str(plain), "--data.text_files.paths=copy/*.jsonl", "--out", "eval", *EVAL])
    finally:
        shutil.move(tmp_path / "moved", project / "corpus")
    assert code == 0, capsys.readouterr().err
    assert _position_loss(tmp_path / "eval") == _position_loss(project / "plain_eval")  # the same held-out rows
    # eval.json says which data was read: its numbers are not taken for the held-out loss of the run's own data.
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert results["overrides"] == ["--data.text_files.paths=copy/*.jsonl"]
    assert results["data"]["source"] == "text_files" and results["data"]["text_files"]["paths"] == ["copy/*.jsonl"]
    assert {key: results["data"][key] for key in ("min_document_tokens", "logical_shards")} == \
        {"min_document_tokens": 0, "logical_shards": 4}
    assert json.loads((project / "plain_eval" / "eval.json").read_text())["overrides"] == []


def test_a_mixture_members_flag_is_read_from_here_and_the_recipes_paths_from_where_it_was_made(project, export,
                                                                                              tmp_path, monkeypatch,
                                                                                              capsys):
    monkeypatch.chdir(tmp_path)
    shutil.move(project / "corpus", tmp_path / "corpus")  # here now; the web member's file is still in the project
    capsys.readouterr()
    try:
        code = cli.main(["eval", str(export), "--data.mixture.sources.code.paths", "corpus/*.jsonl", "--out", "eval",
                         *EVAL])
    finally:
        shutil.move(tmp_path / "corpus", project / "corpus")
    assert code == 0, capsys.readouterr().err
    assert _position_loss(tmp_path / "eval") == _position_loss(project / "eval")


def test_a_mixture_member_switched_to_another_source_leaves_the_saved_arguments_of_its_old_one(project, tmp_path,
                                                                                                 monkeypatch, capsys):
    """The saved recipe's arguments of the member's old source (huggingface's path, name...) were refused with 'remove
    it from saved recipe', which no one can: a flag switching the source replaces them, as said in a note."""
    monkeypatch.chdir(project)
    capsys.readouterr()
    flags = ["--data.mixture.sources.web.source=text_files", "--data.mixture.sources.web.paths=corpus/*.jsonl"]
    assert cli.main(["eval", "model.pt", *flags, "--out", str(tmp_path / "eval"), *EVAL]) == 0, capsys.readouterr().err
    assert ("note: data.mixture.sources.web.path, data.mixture.sources.web.name, data.mixture.sources.web.split, "
            "data.mixture.sources.web.validation_split, data.mixture.sources.web.data_files, "
            "data.mixture.sources.web.shuffle_buffer, data.mixture.sources.web.read_retries from saved recipe are not "
            "used: flag '--data.mixture.sources.web.source=text_files' chose data.mixture.sources.web.source = "
            "'text_files'\n") in capsys.readouterr().err


@pytest.mark.parametrize("export, flags, note", [
    ("plain.pt", ["--data.text_files.validation_fraction=0.4"], "data.text_files.validation_fraction = 0.4 holds out "
     "documents the run trained on (it held out 0.2), so the held-out loss read is partly over documents the model "
     "trained on"),
    ("model.pt", ["--data.mixture.sources.code.validation_fraction=0.4"], "data.mixture.sources.code.validation_"
     "fraction = 0.4 holds out documents the run trained on (it held out 0.2)"),
    ("plain.pt", ["--data.text_files.validation_fraction=0.1"], None),  # a part of the run's held-out set
    ("plain.pt", ["--data.text_files.validation_fraction=0.4", "--data.text_files.paths=other.jsonl"], None),
])
def test_a_flag_that_holds_out_documents_the_run_trained_on_is_said(plain_run, tmp_path, monkeypatch, capsys, export,
                                                                    flags, note):
    """A larger validation_fraction over the run's own corpus was taken silently, and eval.json gave a loss partly
    over training documents as held-out loss; over another corpus no document was trained on."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(str(tmp_path / "other.jsonl"), unique_texts(60, seed=9))
    capsys.readouterr()
    assert cli.main(["eval", str(plain_run / export), *flags, "--out", "eval", *EVAL]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    data = json.loads((tmp_path / "eval" / "eval.json").read_text())["data"]
    if note is None:
        assert "trained on" not in err and data["note"] is None, err
    else:
        assert f"note: {note}" in err and data["note"].startswith(note), err


@pytest.mark.parametrize("flag, fix", [
    ("--data.min_document_tokens=100000", "Fix: drop --data.min_document_tokens=100000 (the recipe saved with the "
                                          "model keeps documents of every length), or give a lower value."),
    ("--data.text_files.validation_fraction=0.0001", "Fix: drop --data.text_files.validation_fraction=0.0001 (the run "
                                                     "held out 0.2), or give a share up to the run's."),
    # no share at all: the source holds out nothing ('Fix: set the source's validation_fraction above 0' inside)
    ("--data.text_files.validation_fraction=0", "Fix: drop --data.text_files.validation_fraction=0.0 (the run held out "
                                                "0.2), or give a share up to the run's"),
])
def test_an_empty_held_out_set_of_an_export_names_the_flag_that_emptied_it(plain_run, tmp_path, capsys, flag, fix):
    """The data's own fix ('raise the data source's validation_fraction ..., or evaluate with the data settings of
    the run's own recipe.toml') was wrapped in a second one naming --data.text_files.FIELD, neither naming the flag
    that emptied the set."""
    capsys.readouterr()
    code = cli.main(["eval", str(plain_run / "plain.pt"), flag, "--out", str(tmp_path / "eval"), *EVAL])
    err = capsys.readouterr().err
    assert code == 2 and err.count("Fix:") == 1 and "Traceback" not in err, err
    assert err.startswith(("error: data split 'validation': all 4 logical shards hold no documents",
                           "error: the data source (TextFilesSource) holds out no validation documents")), err
    assert fix in err, err
    assert not (tmp_path / "eval").exists()


def test_an_empty_held_out_set_read_as_the_run_read_it_names_flags_that_fill_it():
    """No flag emptied it: fewer logical shards where the set reads only some, other data; not a larger share of the
    run's own data, which would hold out documents the model trained on."""
    from types import SimpleNamespace

    from components.data.sources import TextFilesArgs
    from nsa_titan.evaluate.export_flags import empty_set_fix

    data = SimpleNamespace(source="text_files", source_args=TextFilesArgs(paths=["a.jsonl"]), min_document_tokens=5,
                           logical_shards=4)
    assert empty_set_fix(data, data, 2, "`X`") == ("lower --data.min_document_tokens (now 5), or give fewer "
                                                   "--data.logical_shards (now 4; each then holds more documents), or "
                                                   "read other held-out data, e.g. `X`")


def test_a_data_flags_path_that_matches_nothing_is_named_relative_to_the_current_folder(plain_run, tmp_path,
                                                                                       monkeypatch, capsys):
    """It said 'relative to the directory the run starts in', which names a training run's start (still its words)."""
    from components.errors import read_from

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["eval", str(plain_run / "plain.pt"), "--data.text_files.paths=gone/*.jsonl", "--out", "eval",
                     *EVAL]) == 2
    err = capsys.readouterr().err
    assert f"the pattern 'gone/*.jsonl' matches no file (relative to the current folder, {tmp_path})" in err, err
    assert "the run starts in" not in err and read_from("x").startswith(" (relative to the directory the run starts")


@pytest.mark.parametrize("flags, fix", [
    (["--data.text_files.validation_fraction=0.1"], "Fix: drop --data.text_files.validation_fraction=0.1 (the run held "
                                                    "out 0.2), or give a share up to the run's."),
    (["--data.text_files.paths=other.jsonl", "--data.text_files.validation_fraction=0.05"],
     "Fix: hold out more documents of the data read, e.g. `nsa-titan eval "),
])
def test_a_short_held_out_set_of_an_export_names_a_way_to_more_held_out_documents(plain_run, tmp_path, monkeypatch,
                                                                                  capsys, flags, fix):
    """It said 'hold out more documents (the source's validation_fraction or split)', which over the run's own data
    holds out documents the model trained on, and named no flag."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(str(tmp_path / "other.jsonl"), unique_texts(60, seed=9))
    capsys.readouterr()
    assert cli.main(["eval", str(plain_run / "plain.pt"), *flags, "--out", "eval", *EVAL]) == 0
    err = capsys.readouterr().err
    assert "note: the held-out set holds " in err and fix in err, err


HUB = dict(path="parquet", name="", data_files=["web/b.parquet"])


@pytest.mark.parametrize("source, saved, given, way", [
    ("synthetic", {}, {}, "hold out more documents of the data read"),  # validation_documents: none trained on
    ("huggingface", dict(HUB, validation_split="validation"),
     dict(HUB, validation_split="validation", validation_fraction=0.0), "read other held-out data"),
    ("huggingface", dict(HUB), dict(HUB, validation_fraction=0.0), "drop --data.huggingface.validation_fraction=0.0"),
])
def test_the_way_to_more_held_out_documents_follows_what_the_source_holds_out(source, saved, given, way):
    from types import SimpleNamespace

    from components.data.sources import SOURCES
    from nsa_titan.evaluate.export_flags import more_held_out

    args = SOURCES[source][0]
    said = more_held_out(SimpleNamespace(source=source, source_args=args(**saved)),
                         SimpleNamespace(source=source, source_args=args(**given)), "`X`")
    assert said.startswith(way), said


@pytest.mark.parametrize("source, saved, given, note", [
    ("huggingface", dict(HUB, validation_split="validation"), dict(HUB, validation_fraction=0.5), "data.huggingface."
     "validation_split = '' holds out a share of the split the run trained on whole (it held out split 'validation'), "
     "so"),
    ("huggingface", dict(HUB), dict(HUB, validation_split="test"), None),  # a split no run trained on
    ("huggingface", dict(HUB, validation_split="validation"), dict(HUB, validation_split="validation",
                                                                   validation_fraction=0.5), None),  # the share unused
    ("huggingface", dict(HUB), dict(HUB, data_files=["web/c.parquet"], validation_fraction=0.5), None),
    ("python_stdlib", {}, dict(validation_fraction=0.5), "data.python_stdlib.validation_fraction = 0.5 holds out"),
    ("synthetic", {}, dict(seed=3, validation_documents=4096), None),  # held-out documents have their own seed stream
])
def test_each_sources_held_out_fields_decide_the_note(source, saved, given, note):
    from types import SimpleNamespace

    from components.data.sources import SOURCES
    from nsa_titan.evaluate.export_flags import held_out_note

    args = SOURCES[source][0]
    said = held_out_note(SimpleNamespace(source=source, source_args=args(**saved)),
                         SimpleNamespace(source=source, source_args=args(**given)))
    assert said == note if note is None else said.startswith(note), said


@pytest.mark.parametrize("flags, refused", [
    (["--data.tokenizer=tiktoken"], "--data.tokenizer=tiktoken would read the text as other token ids than the model "
                                    "was trained on"),
    (["--data.tiktoken.encoding=cl100k_base"], "--data.tiktoken.encoding=cl100k_base sets an argument of the "
                                               "tokenizer"),
    (["--data.add_bos=true"], "--data.add_bos=true would start each document otherwise than the model was trained"),
    (["--data.pin_memory=false"], "--data.pin_memory=false does nothing here: eval reads on the CPU"),
    (["--model.dim", "64"], "--model.dim 64 is not a data field"),
    (["--training.seq_len=32", "--data.source=python_stdlib"], "--training.seq_len=32 is not a data field"),
    (["--validation.steps=3"], "--validation.steps=3 is not a data field: eval's --batches N sets how many"),
])
def test_a_flag_that_would_change_what_the_model_reads_is_refused(project, tmp_path, capsys, flags, refused):
    capsys.readouterr()
    code = cli.main(["eval", str(project / "model.pt"), *flags, "--out", str(tmp_path / "eval"), *EVAL])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: eval of an exported model takes recipe flags only for the text it reads: {refused}")
    assert "Fix: drop it" in err and "--data.mixture.sources.NAME.FIELD" in err, err
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("flag", ["--data.mixture.sources.code.pathz=x", "--data.min_document_tokens=many",
                                  "--data.mixture.sources.code.paths="])
def test_a_data_flag_is_read_and_checked_as_a_recipe_flag_is(project, tmp_path, monkeypatch, capsys, flag):
    """An unknown field, a wrong type and a value a part's own check refuses: the recipe's messages, word for word
    (a saved recipe's own settings that a newer check refuses are notes, but not a flag given now)."""
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert cli.main(["eval", "model.pt", flag, "--out", str(tmp_path / "a"), *EVAL]) == 2
    theirs = capsys.readouterr().err
    assert cli.main(["eval", *RUN, flag, "--out", str(tmp_path / "a"), *EVAL]) == 2
    ours = capsys.readouterr().err.splitlines()[:2]  # (RUN's note on a flag it gives twice follows)
    assert theirs.splitlines() == ours and theirs.startswith("error: the recipe has 1 problem:\n  - flag "), theirs
    assert "Traceback" not in theirs and not (tmp_path / "a").exists()


def test_eval_of_an_export_decides_every_data_field():
    """A [data] field added later is taken or refused by decision, not by default."""
    from nsa_titan.config.schema import DataConfig
    from nsa_titan.evaluate.export_flags import DATA_FIELDS

    assert set(DATA_FIELDS) == {fld.name for fld in dataclasses.fields(DataConfig) if "args_for" not in fld.metadata}


def test_eval_help_names_the_data_flags_an_export_takes(capsys):
    assert cli.main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--data.text_files.paths=corpus/*.jsonl where the data is now" in out
    assert "--data.mixture.sources.NAME.FIELD" in out and "--data.tokenizer" not in out
