"""The held-out set (nsa_titan/held_out.py): the same rows at every layout, every rank running as many
batches, filler rows counting nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

from components.data import NoDocuments
from nsa_titan import held_out
from nsa_titan.loss import IGNORE_INDEX

T = 4


def fake_shards(empty: set[int] = frozenset()):
    """Shard s's held-out stream: rows whose tokens say (shard, index), endless; an empty shard raises
    NoDocuments at its first row, as the loader does."""
    def rows_of(shard: int):
        if shard in empty:
            raise NoDocuments(f"shard {shard} holds no documents")
        for i in itertools.count():
            starts = torch.zeros((1, T), dtype=torch.bool)
            starts[0, 0] = True
            yield {"input": torch.full((1, T), 1000 * shard + i), "target": torch.full((1, T), 1000 * shard + i),
                   "document_starts": starts}

    return rows_of


def real_rows(batches) -> list[int]:
    return sorted(int(row[0]) for batch in batches for row, target in zip(batch["input"], batch["target"])
                  if target[0] != IGNORE_INDEX)


def test_rows_per_shard_are_an_equal_share():
    assert held_out.rows_per_shard(10, 4) == [3, 3, 2, 2]
    assert held_out.rows_per_shard(3, 4) == [1, 1, 1, 0]
    assert sum(held_out.rows_per_shard(1234, 64)) == 1234


@pytest.mark.parametrize("rows", [12, 10, 3])
def test_every_layout_reads_the_same_rows_and_as_many_batches_on_every_rank(rows):
    S = 4
    expected = sorted(1000 * s + i for s, k in enumerate(held_out.rows_per_shard(rows, S)) for i in range(k))
    for dp, batch in [(1, 2), (1, 3), (2, 2), (2, 1), (4, 1), (4, 4)]:
        per_rank = [list(held_out.held_out_batches(fake_shards(), rows, S, r, dp, batch, T)) for r in range(dp)]
        assert real_rows(b for rank in per_rank for b in rank) == expected, (dp, batch)
        counts = {len(rank) for rank in per_rank}
        assert counts == {held_out.batches_per_rank(rows, S, dp, batch)}, (dp, batch, counts)
        assert all(b["input"].shape == (batch, T) for rank in per_rank for b in rank)


def test_filler_rows_count_nothing_and_are_one_document():
    # 3 rows over 4 shards, 2 ranks of batch 2: rank 0 holds shards 0 and 2 (2 rows), rank 1 shard 1 (1 row).
    (rank1,) = held_out.held_out_batches(fake_shards(), 3, 4, 1, 2, 2, T)
    assert rank1["target"][0].tolist() == [1000] * T and (rank1["target"][1] == IGNORE_INDEX).all()
    assert rank1["document_starts"][1].tolist() == [True] + [False] * (T - 1)


def test_a_shard_without_documents_gives_no_rows_and_moves_no_other():
    rows = held_out.rows_per_shard(8, 4)
    got = real_rows(held_out.held_out_batches(fake_shards(empty={1}), 8, 4, 0, 1, 2, T))
    assert got == sorted(1000 * s + i for s in (0, 2, 3) for i in range(rows[s]))
    assert held_out.has_rows(fake_shards(empty={1}), 8, 4, 1, 2) is True  # rank 1 also owns shard 3
    assert held_out.has_rows(fake_shards(empty={1, 3}), 8, 4, 1, 2) is False


def test_unpadded_batches_end_with_the_last_row():
    batches = list(held_out.held_out_batches(fake_shards(), 5, 4, 0, 1, 2, T, pad=False))
    assert [b["input"].shape[0] for b in batches] == [2, 2, 1]
    assert (torch.cat([b["target"] for b in batches]) != IGNORE_INDEX).all()


def test_the_set_follows_the_global_batch_or_with_minus_one_the_local_batch():
    """global_batch_size = -1 follows the world size: the set takes one process's local batch instead, so it
    stays the same at every world size."""
    from types import SimpleNamespace

    def recipe(global_batch, local_batch):
        return SimpleNamespace(validation=SimpleNamespace(steps=3),
                               training=SimpleNamespace(global_batch_size=global_batch, local_batch_size=local_batch))

    assert held_out.held_out_rows(recipe(64, 8)) == held_out.held_out_rows(recipe(64, 2)) == 192
    assert held_out.held_out_rows(recipe(-1, 8)) == 24
    assert held_out.shards_read(3, 4) == [0, 1, 2] and held_out.shards_read(8, 4) == [0, 1, 2, 3]
