"""The suite's own order (tests/conftest.py): the slowest files first, each file's tests in their own order."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import REPO_ROOT, SLOWEST_FILES_FIRST, pytest_collection_modifyitems


def test_every_file_named_slowest_exists():
    """A renamed file would drop out of the order in silence, and run last again."""
    missing = [name for name in SLOWEST_FILES_FIRST if not os.path.exists(os.path.join(REPO_ROOT, "tests", name))]
    assert not missing, missing


def test_the_slowest_files_come_first_and_keep_their_tests_order():
    items = [SimpleNamespace(path=Path("tests") / name, name=test) for name, test in
             [("test_a.py", "1"), ("test_a.py", "2"), ("test_distributed.py", "2"), ("test_distributed.py", "1"),
              ("test_checkpoint.py", "1")]]
    pytest_collection_modifyitems(items)
    assert [(item.path.name, item.name) for item in items] == [
        ("test_distributed.py", "2"), ("test_distributed.py", "1"), ("test_checkpoint.py", "1"), ("test_a.py", "1"),
        ("test_a.py", "2")]
