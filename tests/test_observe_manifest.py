"""manifest.json: contents, and git information that never raises."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess

import pytest
import torch

from nsa_titan.observe.manifest import git_state, write_manifest
from tests.conftest import REPO_ROOT

RECIPE = '[job]\nname = "m"\n'


def _independent_commit() -> str:
    if shutil.which("git") is None:
        return "unknown"
    done = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return "unknown"
    top, commit = done.stdout.split()
    return commit if os.path.realpath(top) == os.path.realpath(REPO_ROOT) else "unknown"


def test_manifest_contents(tmp_path):
    argv = ["nsa_titan/cli.py", "train", "recipes/debug.toml", "--training.steps=5"]
    path = write_manifest(str(tmp_path / "run"), recipe_toml=RECIPE, recipe_hash="abc123", argv=argv, world_size=4,
                          device=torch.device("cpu"))
    assert path == str(tmp_path / "run" / "manifest.json")
    with open(path, encoding="utf-8") as fh:
        manifest = json.load(fh)
    assert manifest["recipe_toml"] == RECIPE and manifest["recipe_hash"] == "abc123"
    assert manifest["command_line"] == argv and manifest["world_size"] == 4 and manifest["device"] == "cpu"
    assert manifest["git"]["commit"] == _independent_commit()
    versions = manifest["versions"]
    assert versions["torch"] == torch.__version__ and versions["python"] == platform.python_version()
    assert set(versions) == {"nsa_titan", "torch", "triton", "torchdata", "tiktoken", "datasets", "numpy", "python"}
    assert manifest["cuda"] == torch.version.cuda
    assert len(manifest["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert manifest["hostname"] and manifest["start_time"]
    assert os.listdir(tmp_path / "run") == ["manifest.json"]


def test_git_unknown_outside_a_checkout(tmp_path):
    assert git_state(str(tmp_path)) == {"commit": "unknown", "dirty": None}


def test_git_unknown_for_a_folder_inside_another_checkout():
    # a package installed somewhere inside a repository must not report that repository's commit
    assert git_state(os.path.join(REPO_ROOT, "nsa_titan"))["commit"] == "unknown"


def test_git_missing_is_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert git_state(REPO_ROOT) == {"commit": "unknown", "dirty": None}
    path = write_manifest(str(tmp_path), recipe_toml=RECIPE, recipe_hash="h", argv=[], world_size=1,
                          device=torch.device("cpu"))
    with open(path, encoding="utf-8") as fh:
        assert json.load(fh)["git"]["commit"] == "unknown"


def test_a_refused_resume_leaves_the_runs_records_and_a_resume_keeps_the_old_manifest(tmp_path):
    """The recipe and manifest are written once the run starts: a resume refused at start-up (another
    model) changes neither; a resume that starts keeps the manifest before it in manifests/."""
    from nsa_titan import cli
    from tests.launch import DEBUG, TINY

    argv = ["train", DEBUG, *TINY, "--training.steps=2", "--checkpoint.enable=true", f"--job.dump_folder={tmp_path}"]
    assert cli.main(argv) == 0
    records = {name: (tmp_path / name).read_text() for name in ("manifest.json", "recipe.toml")}
    assert cli.main([*argv, "--training.steps=3", "--model.dim=64"]) == 2
    assert {name: (tmp_path / name).read_text() for name in records} == records
    assert not (tmp_path / "manifests").exists()

    assert cli.main([*argv, "--training.steps=3"]) == 0
    kept = list((tmp_path / "manifests").iterdir())
    assert [p.read_text() for p in kept] == [records["manifest.json"]]
    started = [json.loads(text)["start_unix_time"] for text in (records["manifest.json"],
                                                                 (tmp_path / "manifest.json").read_text())]
    assert started[1] > started[0]


def test_a_new_run_that_crashes_at_start_up_still_says_what_it_was(tmp_path, capsys, monkeypatch):
    """A crash (not a refusal of bad input, which removes the folder it made: test_checkpoint_damage.py) leaves the
    new run folder's records of what crashed."""
    from nsa_titan import assemble, cli
    from tests.launch import DEBUG, TINY

    def crash(recipe):
        raise RuntimeError("the data source crashed")

    monkeypatch.setattr(assemble, "build_source", crash)
    with pytest.raises(RuntimeError, match="the data source crashed"):
        cli.main(["train", DEBUG, *TINY, "--job.seed=7", f"--job.dump_folder={tmp_path / 'run'}"])
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert "seed = 7" in manifest["recipe_toml"] and (tmp_path / "run" / "recipe.toml").exists()
