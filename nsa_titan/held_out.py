"""The held-out set: the same rows of the validation split at every layout.

A validation reads `rows` windows (held_out_rows: validation.steps global batches), drawn evenly from
the logical shards: shard s gives the first rows // S of its held-out stream, one more for the first rows % S
shards. A shard's stream does not depend on the layout, so neither does the set: each data-parallel
rank reads the rows of its own shards (shard by shard, in order), and the loss is the mean over every
token of the set. A resumed run at another world size, local batch size or worker count therefore
continues the same validation curve. A shard without held-out documents gives no rows.

Every rank runs the same number of batches of the run's local batch size (sharded models gather
parameters in each forward, so no rank may stop early): a rank whose share is smaller, or whose shards
hold fewer documents, fills its last batches with rows whose targets count nothing (IGNORE_INDEX).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from components.data import NoDocuments, shards_of_rank
from nsa_titan.loss import IGNORE_INDEX

ShardRows = Callable[[int], Iterable[dict]]  # shard -> its held-out windows, one row per item ([1, seq_len])


def shard_reader(recipe, runtime, source, tokenizer) -> ShardRows:
    """Each logical shard's held-out windows as its own stream: the loader of a shard as a rank of
    logical_shards ranks would own it, a row at a time, in this process."""
    from nsa_titan import assemble

    def rows_of(shard: int):
        return assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=shard,
                                     dp_size=recipe.data.logical_shards, split="validation", batch_size=1,
                                     num_workers=0)

    return rows_of


def held_out_rows(recipe) -> int:
    """validation.steps batches of training.global_batch_size rows; with global_batch_size = -1 (which
    follows the world size) of one process's local batch, so the set does not follow the world size."""
    t = recipe.training
    return recipe.validation.steps * (t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size)


def rows_per_shard(rows: int, logical_shards: int) -> list[int]:
    base, extra = divmod(rows, logical_shards)
    return [base + (s < extra) for s in range(logical_shards)]


def shards_read(rows: int, logical_shards: int) -> list[int]:
    """The logical shards the set takes rows from (all of them unless rows < logical_shards)."""
    return [s for s, k in enumerate(rows_per_shard(rows, logical_shards)) if k]


def batches_per_rank(rows: int, logical_shards: int, dp_size: int, batch_size: int) -> int:
    """Batches every rank runs: the most any rank's share of the rows needs."""
    per_shard = rows_per_shard(rows, logical_shards)
    largest = max(sum(per_shard[s] for s in shards_of_rank(r, dp_size, logical_shards)) for r in range(dp_size))
    return -(-largest // batch_size)


def _rows_of(shard_rows: ShardRows, shards: list[int], per_shard: list[int]) -> Iterator[dict]:
    for s in shards:
        if per_shard[s] == 0:
            continue
        windows = iter(shard_rows(s))
        for _ in range(per_shard[s]):
            try:
                yield next(windows)
            except NoDocuments:  # its stream is endless unless it holds no document at all
                break


def has_rows(shard_rows: ShardRows, rows: int, logical_shards: int, dp_rank: int, dp_size: int) -> bool:
    """Whether this rank's share of the set holds a row (reads one at most)."""
    per_shard = rows_per_shard(rows, logical_shards)
    return next(_rows_of(shard_rows, shards_of_rank(dp_rank, dp_size, logical_shards), per_shard), None) is not None


def held_out_batches(shard_rows: ShardRows, rows: int, logical_shards: int, dp_rank: int, dp_size: int,
                     batch_size: int, seq_len: int, pad: bool = True) -> Iterator[dict]:
    """This rank's share of the set in batches of `batch_size` rows ({"input", "target",
    "document_starts"} on the host, as the loader gives them). pad: as many batches as every rank runs, the
    last ones filled with rows that count nothing; else only the rows read, the last batch maybe short."""
    per_shard = rows_per_shard(rows, logical_shards)
    pending: list[dict] = []
    made = 0
    for row in _rows_of(shard_rows, shards_of_rank(dp_rank, dp_size, logical_shards), per_shard):
        pending.append(row)
        if len(pending) == batch_size:
            yield _stack(pending)
            pending, made = [], made + 1
    if not pad:
        if pending:
            yield _stack(pending)
        return
    for _ in range(made, batches_per_rank(rows, logical_shards, dp_size, batch_size)):
        pending += [_blank_row(seq_len) for _ in range(batch_size - len(pending))]
        yield _stack(pending)
        pending = []


def _blank_row(seq_len: int) -> dict:
    """A row that counts nothing: token 0 throughout, one document, every target ignored."""
    starts = torch.zeros((1, seq_len), dtype=torch.bool)
    starts[0, 0] = True
    return {"input": torch.zeros((1, seq_len), dtype=torch.int64),
            "target": torch.full((1, seq_len), IGNORE_INDEX, dtype=torch.int64), "document_starts": starts}


def _stack(rows: list[dict]) -> dict:
    return {key: torch.cat([row[key] for row in rows]) for key in ("input", "target", "document_starts")}
