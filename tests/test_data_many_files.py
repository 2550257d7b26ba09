"""A corpus of many small files (hundreds of thousands) starts in about a second: each file is listed, sized and
sampled once, with no more system calls and path work than that needs; the corpus's identity is as it was."""

from __future__ import annotations

import hashlib
import os

import pytest

from components.data.sources import TextFilesArgs, TextFilesSource
from components.data.sources.file_corpus import corpus_files, expand_paths

SIZES = [0, 1, 100, 4095, 4096, 4097, 8191, 8192, 9000]


@pytest.fixture
def folder(tmp_path):
    for i, size in enumerate(SIZES):
        (tmp_path / "corpus" / f"part{i % 3}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / f"part{i % 3}" / f"f{i}.txt").write_bytes(bytes(range(32, 127)) * (size // 95 + 1))
        os.truncate(tmp_path / "corpus" / f"part{i % 3}" / f"f{i}.txt", size)
    return tmp_path / "corpus"


def _counted(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_a_folders_files_are_keyed_by_their_path_in_it_without_relpath_per_file(folder, monkeypatch):
    """relpath normalized both paths again for every file: 2 s of a 200,000-file corpus's start."""
    paths = expand_paths([str(folder)], "test")
    relpaths = _counted(monkeypatch, os.path, "relpath")
    keys = [f.key for f in corpus_files(paths)]
    assert not relpaths
    assert keys == [os.path.relpath(p, str(folder)) for p in paths]
    assert keys[0] == os.path.join("part0", "f0.txt")


@pytest.mark.parametrize("paths", [["/r/a/../b.txt", "/r/c.txt"], ["/r//a/b.txt", "/r/c.txt"], ["/x.txt"],
                                   ["./d/a.txt", "./d/e/b.txt"], ["../d/x.txt", "../d/y/z.txt"],
                                   ["/r/a/./b.txt", "/r/a/c.txt"], ["/r/.h/a.txt", "/r/b.txt"]])
def test_paths_of_other_forms_are_keyed_as_relpath_keys_them(paths):
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    assert [f.key for f in corpus_files(paths)] == [os.path.relpath(p, root) for p in paths]


def test_a_small_files_sample_is_its_head_read_once_and_the_digest_is_as_before(folder, monkeypatch):
    """Every start samples each file's first and last 4 KiB; a file object and a size per file doubled what 200,000
    small files cost. The digest is the one saved runs hold."""
    source = TextFilesSource(TextFilesArgs(paths=[str(folder)]))
    paths = [f.path for f in source.corpus().files]
    expected = hashlib.blake2b(digest_size=8)
    for path in paths:
        with open(path, "rb") as fh:
            head = fh.read(4096)
            fh.seek(max(len(head), os.path.getsize(path) - 4096))
            tail = fh.read(4096)
        expected.update(b"%d %d\n" % (len(head), len(tail)) + head + tail)
    sized = _counted(monkeypatch, os, "fstat")
    assert source.files_fingerprint() == expected.hexdigest()
    assert len(sized) == sum(size >= 4096 for size in SIZES)
