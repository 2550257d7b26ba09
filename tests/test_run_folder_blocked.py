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


@pytest.mark.parametrize("below", ["", "run"])
def test_a_link_to_nothing_where_the_dump_folder_goes_is_named_as_a_link(tmp_path, below):
    # An outputs link to an unmounted scratch disk was called "a file, not a folder", with the fix to move it away.
    link = tmp_path / "outputs"
    link.symlink_to(tmp_path / "scratch" / "gone")
    folder = link / below if below else link
    with pytest.raises(UserError) as refused:
        create_run_folder(str(folder))
    message = str(refused.value)
    assert f"{str(link)!r} is a symbolic link to {str(tmp_path / 'scratch' / 'gone')!r}, which does not exist" \
        in message, message
    assert "is a file" not in message and not (tmp_path / "scratch").exists()
