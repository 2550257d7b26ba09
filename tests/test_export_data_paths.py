"""eval of an export read elsewhere than where its run started: the recipe's relative data paths (text_files paths, a
parquet builder's data_files, a local dataset folder, each a mixture member here) are read from the folder the export
was made in, and data that is gone is named with where it was (and with a recipe flag that would read it elsewhere)."""

from __future__ import annotations

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
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(project)
        assert cli.main(["train", *RUN]) == 0
        assert cli.main(["export", *RUN, "--output", "model.pt"]) == 0
        assert cli.main(["eval", "model.pt", "--out", "eval", *EVAL]) == 0
    return project


@pytest.fixture(scope="module", params=["model.pt", "hf"])
def export(request, project):
    """The run's export: a file, or a --format hf folder (which carries its tokenizer but not its data)."""
    if request.param == "hf":
        pytest.importorskip("safetensors", reason="the hf extra (pip install -e '.[hf]')")
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.chdir(project)
            assert cli.main(["export", *RUN, "--format", "hf", "--output", "hf"]) == 0
    return project / request.param


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


def test_eval_of_an_export_whose_data_is_gone_names_it_and_where_it_was(project, export, tmp_path, monkeypatch,
                                                                        capsys):
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
    assert (f"was exported in {project}, and its recipe's data reads data.mixture.sources.code.paths 'corpus/*.jsonl' "
            f"({project / 'corpus' / '*.jsonl'}), data.mixture.sources.web.data_files 'web/b.parquet' "
            f"({project / 'web' / 'b.parquet'}) from there, which are not there now. Fix: put the data back there, or "
            "evaluate the run's checkpoint from its recipe with the data paths changed (`nsa-titan eval RECIPE.toml "
            "--data.mixture.sources.code.paths=... --out DIR`).") in err, err
    assert not (tmp_path / "eval").exists()


def test_eval_of_an_export_whose_member_data_is_gone_where_it_was_made_names_a_flag_that_exists(project, tmp_path,
                                                                                                monkeypatch, capsys):
    """Read where it was made, an export whose mixture member's file was gone suggested --data.mixture.FIELD=..., which
    no recipe takes: a mixture's data settings are in its members' tables."""
    monkeypatch.chdir(project)
    capsys.readouterr()
    shutil.move(project / "corpus", tmp_path / "corpus")
    try:
        code = cli.main(["eval", "model.pt", "--out", str(tmp_path / "eval"), *EVAL])
        err = capsys.readouterr().err
        assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
        assert (f"e.g. `nsa-titan eval RECIPE.toml --data.mixture.sources.NAME.FIELD=... --out {tmp_path / 'eval'}`, "
                "NAME the member to change (code, web, books).") in err, err
        # The flag it names is one the run's recipe takes.
        argv = [*RUN, f"--data.mixture.sources.code.paths={tmp_path / 'corpus' / 'a.jsonl'}"]
        assert cli.main(["eval", *argv, "--out", str(tmp_path / "eval"), *EVAL]) == 0, capsys.readouterr().err
    finally:
        shutil.move(tmp_path / "corpus", project / "corpus")
