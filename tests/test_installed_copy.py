"""The package installed from a wheel, used from a project folder of its own: what it tells the user to run
exists there."""

from __future__ import annotations

import os

import pytest

from components.install_hint import install_extra
from nsa_titan import cli
from tests.conftest import REPO_ROOT
from tests.installed import PROJECT, install_copy, run_console_script, run_installed
from tests.launch import DEBUG


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_copy(tmp_path_factory.mktemp("site"))


def test_a_checkout_names_its_editable_install():
    assert install_extra("plots") == "pip install -e '.[plots]' in the nsa_titan checkout"


def test_an_installed_copy_without_matplotlib_says_how_to_install_the_plots_extra(site, tmp_path):
    code = ("import builtins\n"
            "real = builtins.__import__\n"
            "def hidden(name, *a, **k):\n"
            "    if name.split('.')[0] == 'matplotlib':\n"
            "        raise ImportError(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = hidden\n"
            "from components.errors import UserError\n"
            "from nsa_titan.observe.plots import pyplot\n"
            "try:\n"
            "    pyplot()\n"
            "except UserError as exc:\n"
            "    print(exc)\n")
    done = run_installed(site, tmp_path, code)
    assert done.returncode == 0, done.stderr
    assert "Fix: pip install 'nsa_titan[plots]' (or pip install matplotlib)." in done.stdout, done.stdout


def test_the_console_script_imports_a_plugin_module_from_the_working_directory(site, tmp_path):
    """As `python -m nsa_titan` and run_train.sh do: the module was not found, the recipe refused."""
    (tmp_path / "half_schedule.py").write_text("from nsa_titan.registry import register\n"
                                                "register('lr_schedule', 'half', lambda progress: 1 - progress)\n")
    done = run_console_script(site, tmp_path, ["train", DEBUG, "--job.plugins=half_schedule",
                                                "--lr_scheduler.decay_type=half", "--print-config"])
    assert done.returncode == 0, done.stderr
    assert 'plugins = ["half_schedule"]' in done.stdout and 'decay_type = "half"' in done.stdout, done.stdout


def test_a_plugin_module_named_like_an_installed_one_is_not_passed_over_silently(site, tmp_path):
    """The console script puts the working directory last: `job.plugins = ["tqdm"]` imported the installed tqdm, the
    user's tqdm.py registered nothing, and the recipe was refused for an unknown schedule 'half' alone."""
    (tmp_path / "tqdm.py").write_text("from nsa_titan.registry import register\n"
                                      "register('lr_schedule', 'half', lambda progress: 1 - progress)\n")
    done = run_console_script(site, tmp_path, ["train", DEBUG, "--job.plugins=tqdm", "--lr_scheduler.decay_type=half",
                                                "--print-config"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "job.plugins = 'tqdm': imported " in done.stderr and ", not tqdm.py in the directory the run starts in: " \
           "an installed module named 'tqdm' comes first on the import path, so tqdm.py registered nothing. Fix: " \
           "rename tqdm.py (e.g. to tqdm_plugin.py) and set job.plugins = [\"tqdm_plugin\"]" in done.stderr, done.stderr


def test_an_installed_copy_names_no_checkout_file_in_its_fixes(site, tmp_path):
    """A missing recipe, a stray WORLD_SIZE and `train --help`: it pointed at recipes/ and ./run_train.sh, which a
    wheel does not install."""
    code = ("import os\n"
            "from nsa_titan import cli\n"
            "cli.main(['train', 'missing.toml'])\n"
            "os.environ['WORLD_SIZE'] = '2'\n"
            "cli.main(['train', 'missing.toml'])\n"
            "cli.main(['train', '--help'])\n")
    done = run_installed(site, tmp_path, code)
    assert done.returncode == 0, done.stderr
    assert "`nsa-titan recipes copy` writes the shipped recipes into ./recipes (e.g. recipes/debug.toml; " \
           "`nsa-titan recipes` lists them)" in done.stderr, done.stderr
    assert "launch several with python -m nsa_titan.launch --standalone --nproc_per_node=N -m nsa_titan.cli train " \
           "RECIPE.toml." in done.stderr, done.stderr
    assert "usage: nsa-titan train RECIPE.toml" in done.stdout and "run_train.sh" not in done.stdout, done.stdout


def test_an_installed_copy_ships_the_recipes_the_readme_trains_from(site, tmp_path):
    """The wheel held no recipe files, though the README and the fixes name recipes/debug.toml: `recipes copy` writes
    them (presets included, so `extends` resolves) into the user's folder, and refuses to overwrite them."""
    listed = run_console_script(site, tmp_path, ["recipes"])
    assert listed.returncode == 0, listed.stderr
    assert "debug.toml          The default recipe: a tiny NSA model" in listed.stdout, listed.stdout
    copied = run_console_script(site, tmp_path, ["recipes", "copy"])
    assert copied.returncode == 0, copied.stderr
    assert sorted(os.listdir(tmp_path / "recipes" / "presets")) == sorted(os.listdir(os.path.join(REPO_ROOT, "recipes",
                                                                                                 "presets")))
    (tmp_path / "recipes" / "debug.toml").write_text((tmp_path / "recipes" / "debug.toml").read_text() + "# mine\n")
    again = run_console_script(site, tmp_path, ["recipes", "copy"])
    recipes = os.walk(os.path.join(REPO_ROOT, "recipes"))
    shipped = sum(name.endswith(".toml") for _, _, names in recipes for name in names)
    assert again.returncode == 2 and f"{shipped} of the shipped recipe files are already in 'recipes'" in again.stderr
    assert (tmp_path / "recipes" / "debug.toml").read_text().endswith("# mine\n")
    done = run_console_script(site, tmp_path, ["train", "recipes/debug.toml", "--print-config"])
    assert done.returncode == 0, done.stderr
    assert 'source = "python_stdlib"' in done.stdout and 'attention = "nsa"' in done.stdout, done.stdout


def test_a_checkout_run_from_elsewhere_names_its_recipes_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "missing.toml"]) == 2
    err = capsys.readouterr().err
    assert f"the shipped recipes are in {os.path.join(REPO_ROOT, 'recipes')}{os.sep} (e.g. " \
           f"{os.path.join(REPO_ROOT, 'recipes', 'debug.toml')})" in err, err


def test_an_installed_copys_runs_record_its_version(site, tmp_path):
    """Its manifest names no git commit (there is no checkout): the version is what names the code."""
    done = run_installed(site, tmp_path, "from nsa_titan.observe.manifest import git_state, package_versions\n"
                                         "import nsa_titan, os\n"
                                         "print(git_state(os.path.dirname(os.path.dirname(nsa_titan.__file__))))\n"
                                         "print(package_versions()['nsa_titan'])\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["{'commit': 'unknown', 'dirty': None}", PROJECT["version"]], done.stdout


def test_an_installed_copys_layout_fixes_name_the_launchers_own_options(site, tmp_path):
    """NGPU, NNODES and RDZV_ENDPOINT are run_train.sh's variables; python -m nsa_titan.launch takes torchrun's."""
    code = ("import os, sys\n"
            "from nsa_titan.checkout_hints import node_meeting\n"
            "from nsa_titan import cli\n"
            "os.environ['WORLD_SIZE'] = '3'\n"
            f"cli.main(['train', {DEBUG!r}, '--parallelism.data_parallel_shard_degree=2', '--print-config'])\n"
            "print(node_meeting())\n")
    done = run_installed(site, tmp_path, code)
    assert done.returncode == 0, done.stderr
    assert "equal the number of processes (--nproc_per_node x --nnodes), or set one" in done.stderr, done.stderr
    assert done.stdout == "start every node (--nnodes of them) with the same --rdzv_endpoint\n"


def test_a_copy_installed_into_a_project_folder_is_not_taken_for_the_checkout(tmp_path):
    """pip install --target into a folder that holds the user's own pyproject.toml: still an installed copy."""
    project = install_copy(tmp_path / "project")
    (tmp_path / "project" / "pyproject.toml").write_text('[project]\nname = "my_project"\n')
    done = run_installed(project, tmp_path, "from components.install_hint import install_extra\n"
                                            "print(install_extra('hf'))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "pip install 'nsa_titan[hf]'\n"
