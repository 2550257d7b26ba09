"""An export read elsewhere than where its run started: the recipe's relative plugin and tokenizer files are read
from the folder the export was made in, and one that is gone is named with where it was."""

from __future__ import annotations

import base64
import re
import shutil
import sys

import pytest

from nsa_titan import cli
from tests.launch import DEBUG, TINY
from tests.registry_state import registry_restored

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

PLUGIN = "from nsa_titan.registry import register\nregister('lr_schedule', 'halving', lambda progress: 1 - progress)\n"


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """A run with a plugin file and a tiktoken file named by relative paths, exported as a file and a folder."""
    project = tmp_path / "project"
    (project / "plug").mkdir(parents=True)
    (project / "plug" / "halving_schedule.py").write_text(PLUGIN)
    (project / "tok").mkdir()
    (project / "tok" / "bytes.tiktoken").write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b
                                                              for b in range(256)))
    module = "parts_" + re.sub(r"\W", "_", tmp_path.name)  # a plugin module in the run's folder, of its own name
    (project / f"{module}.py").write_text("ANSWER = 42\n")
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    argv = [DEBUG, *TINY, "--training.steps=1", "--checkpoint.enable=true", "--job.dump_folder=run",
            f"--job.plugins=plug/halving_schedule.py,{module}", "--lr_scheduler.decay_type=halving",
            "--data.tokenizer=tiktoken", "--data.tiktoken.encoding=tok/bytes.tiktoken"]
    with registry_restored():
        assert cli.main(["train", *argv]) == 0
        assert cli.main(["export", *argv, "--output", "model.pt"]) == 0
        assert cli.main(["export", *argv, "--format", "hf", "--output", "hf"]) == 0
        # As a new process elsewhere finds it: not imported yet, the run's folder not on the import path.
        del sys.modules[module]
        sys.path[:] = [p for p in sys.path if p not in ("", str(project))]
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        yield project


def _sample(capsys, export) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["sample", str(export), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_export_reads_its_relative_files_from_where_it_was_made(exports, capsys):
    """Both were refused from another folder: the plugin 'could not be imported', the tokenizer file 'does not
    exist (relative to the directory the run starts in, ...)', fixes a reader of an export cannot follow."""
    file_code, file_out, file_err = _sample(capsys, exports / "model.pt")
    folder_code, folder_out, folder_err = _sample(capsys, exports / "hf")
    assert (file_code, folder_code) == (0, 0), file_err + folder_err
    assert file_out.startswith("def ") and file_out == folder_out


def test_an_export_whose_files_are_gone_names_them_and_where_they_were(exports, capsys):
    shutil.move(exports / "tok", exports / "tok.moved")
    code, _, err = _sample(capsys, exports / "model.pt")
    assert code == 2 and err.count("error:") == 1, err
    assert f"was exported in {exports}, and its tokenizer reads 'tok/bytes.tiktoken' from there " \
           f"({exports / 'tok' / 'bytes.tiktoken'}), which is not there now. Fix: put the file back there, or export " \
           "the run with --format hf, whose folder carries its tokenizer." in err, err
    shutil.move(exports / "plug", exports / "plug.moved")
    for export in ("model.pt", "hf"):
        code, _, err = _sample(capsys, exports / export)
        assert code == 2 and err.count("error:") == 1, err
        assert f"its recipe's plugin file '{exports / 'plug' / 'halving_schedule.py'}' (job.plugins, which registers " \
               "parts it needs) is not there now. Fix: put the plugin file back there." in err, err


def test_a_folder_reads_its_own_tokenizer_not_a_file_of_the_same_relative_name_elsewhere(exports, capsys):
    """The recipe's relative tokenizer file, looked up in another project's folder, found that project's file of the
    same name: the folder sampled through another vocabulary's ids without a word."""
    (exports.parent / "elsewhere" / "tok").mkdir()
    (exports.parent / "elsewhere" / "tok" / "bytes.tiktoken").write_bytes(
        b"".join(base64.b64encode(bytes([b])) + b" %d\n" % (255 - b) for b in range(256)))
    file_code, file_out, _ = _sample(capsys, exports / "model.pt")
    folder_code, folder_out, err = _sample(capsys, exports / "hf")
    assert (file_code, folder_code) == (0, 0), err
    assert folder_out == file_out
