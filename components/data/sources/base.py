"""What a document source is, and the rules every source shares.

A source is a picklable object with:
  - `check()`: raises UserError early (before training) when the data cannot be read; cheap.
  - `fingerprint()`: a short string naming the corpus, stored with loader state so that a state
    is never applied to another corpus.
  - optionally `files_fingerprint()`: a short string naming what the recipe's fields do not say of the stream (the
    files a pattern or folder holds, samples of their bytes, the version of a library whose positions are saved),
    stored beside the fingerprint; None when there is nothing to name. A saved state without one (older
    checkpoints) is not asked it;
  - optionally `has_split(split)`: False when the split is empty by construction (e.g. no
    validation held out), so the loader can refuse it before training;
  - optionally `check_tokenizer(tokenizer)`: raises UserError when the source cannot feed it;
  - optionally `table`: the recipe table of its arguments ("data.<name>"), which its fixes name; a mixture sets
    it to the source's own table, [data.mixture.sources.NAME];
  - optionally `shard_notes(num_shards)`: what a run over that many logical shards should be told once (say,
    shards that each read the whole stream), as sentences; the engine says them on the first rank, not in
    every loader worker;
  - optionally `shard_sizes(num_shards)`: each logical shard's share of the training split (bytes, from
    metadata, without reading), so the engine can warn when loader workers' shares are far apart;
  - optionally `scan()`: reads the whole corpus once for what check() only samples (doctor calls it),
    raising UserError, else returning what it found in a few words;
  - `documents(shard, num_shards, split, seed, epoch, cursor)`: the documents of one logical shard
    for one epoch, in that epoch's order, as (document, cursor_after) pairs. A document is a str
    (tokenized by the loader) or an int64 array of token ids. `cursor` is None at the start of the
    epoch, or a cursor_after returned earlier: iteration then continues right after that document.
    Cursors are small (ints, strings, None and lists of them) and go into checkpoints.
  - optionally `prepares_documents = True`: documents() then also takes `prepare`, the loader's
    document -> token array (None: skip it), and yields only prepared, kept documents (a mixture
    does, to weigh the documents kept).

Logical shards partition the corpus: each document belongs to exactly one shard, and the set of
documents of a shard is the same in every epoch (only their order changes, seeded by seed, shard
and epoch). Train and validation partition it too, so the two splits never share a document.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Protocol, Union

import numpy as np

Document = Union[str, np.ndarray]
SPLITS = ("train", "validation")

# What a fix that changes a corpus's files (which, or their sizes) means for a run that saved checkpoints: its data
# position belongs to the corpus that was, so a resume is refused until told to start the data afresh.
ANOTHER_STREAM = ("the corpus is then another data stream: a run that saved checkpoints resumes only with "
                  "--checkpoint.data_mismatch=restart, its data read from the beginning")


class DocumentSource(Protocol):
    def check(self) -> None: ...

    def fingerprint(self) -> str: ...

    def documents(
        self, shard: int, num_shards: int, split: str, seed: int, epoch: int, cursor: Any
    ) -> Iterator[tuple[Document, Any]]: ...


_HASHED_PIECE = 1 << 20  # characters of a key encoded at a time


def unit_hash(key: str) -> float:
    """A stable hash of `key` in [0, 1): the same on every machine, process and Python run. A long key (a document's
    text) is encoded a piece at a time, which gives the same bytes (UTF-8 encodes each character alone) without a
    copy of the whole: encoding a 100 MB text took twice its size beside it."""
    hasher = hashlib.blake2b(digest_size=8)
    for at in range(0, len(key), _HASHED_PIECE):
        hasher.update(key[at:at + _HASHED_PIECE].encode("utf-8", errors="surrogatepass"))
    return int.from_bytes(hasher.digest(), "little") / 2.0**64


def digest(text: str) -> str:
    """A short stable hex digest, for fingerprints."""
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).hexdigest()


def split_of(key: str, validation_fraction: float) -> str:
    """The split a document with this key belongs to: validation iff its hash < the fraction."""
    return "validation" if unit_hash(key) < validation_fraction else "train"


def order_rng(seed: int, *stream: int) -> np.random.Generator:
    """The generator that orders one stream (e.g. shard, epoch); independent across streams."""
    return np.random.default_rng([seed, *stream])


def order_fingerprint() -> str:
    """What order_rng gives on this machine, digested: numpy does not promise its generators' streams across
    versions, and a saved place in a stream that another numpy orders is another place."""
    rng = order_rng(1, 2, 3)
    drawn = [*rng.permutation(97).tolist(), *rng.integers(0, 1 << 40, size=8).tolist(), int(rng.integers(7, 300))]
    return digest(",".join(map(str, drawn)))
