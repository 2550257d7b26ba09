"""run_train.sh: every nsa-titan command reaches the CLI through it (a command it does not know would be
read as a recipe and end in a confusing recipe error)."""

from __future__ import annotations

import os
import re
import subprocess

from nsa_titan.cli import COMMANDS
from tests.conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "run_train.sh")


def test_the_script_passes_every_command_through():
    text = open(SCRIPT, encoding="utf-8").read()
    passed = re.search(r"^\s*([a-z|]+)\) command=\$1; shift ;;$", text, re.M).group(1).split("|")
    assert sorted(passed) == sorted(COMMANDS)


def test_a_command_runs_through_the_script():
    done = subprocess.run([SCRIPT, "eval", "--help"], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nsa-titan eval" in done.stdout + done.stderr
