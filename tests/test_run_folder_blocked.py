"""A dump folder whose path a file holds is named as such, with the file in the way."""

from __future__ import annotations

import pytest

from components.errors import UserError
from nsa_titan.run_folder import create_run_folder


@pytest.mark.parametrize("below", ["", "run/step"])
def test_a_file_where_the_dump_folder_goes_is_named(tmp_path, below):
    # It said "cannot create job.dump_folder '.../notes': File exists", which reads as a folder already there.
    blocking = tmp_path / "notes"
    blocking.write_text("not a folder")
    folder = blocking / below if below else blocking
    with pytest.raises(UserError) as refused:
        create_run_folder(str(folder))
    message = str(refused.value)
    assert f"{str(blocking)!r} is a file, not a folder" in message, message
    assert "move that file away" in message and "File exists" not in message
