"""The package installed from a wheel, used from a project folder of its own: what it tells the user to run
exists there."""

from __future__ import annotations

import pytest

from tests.installed import install_copy, run_console_script, run_installed
from tests.launch import DEBUG


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_copy(tmp_path_factory.mktemp("site"))


def test_a_checkout_names_its_editable_install():
    from components.install_hint import install_extra

    assert install_extra("plots") == "pip install -e '.[plots]' in the nsa_titan checkout"


def test_an_installed_copy_without_matplotlib_says_how_to_install_the_plots_extra(site, tmp_path):
    code = ("import builtins, sys\n"
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
