"""The held-out set (nsa_titan/held_out.py): the same rows at every layout and worker count, every rank
running as many batches, filler rows counting nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from components.data import ByteTokenizer, build_dataloader
from components.data.sources import SyntheticArgs, SyntheticSource
from nsa_titan import held_out
from nsa_titan.loss import IGNORE_INDEX

T = 8
S = 4


def set_rows(source, rows: int, dp_rank: int, dp_size: int, num_workers: int = 0) -> list[tuple[int, ...]]:
    """This rank's rows of the set, as token tuples, read as the trainer reads them (one loader, quotas)."""
    loader = build_dataloader(source, ByteTokenizer(), seq_len=T, batch_size=1, dp_rank=dp_rank,
                              dp_world_size=dp_size, logical_shards=S, split="validation", num_workers=num_workers,
                              quotas=held_out.quotas_of_rank(rows, S, dp_rank, dp_size))
    return [tuple(row["input"][0].tolist()) for row in loader]


def first_windows(source, shard: int, count: int) -> list[tuple[int, ...]]:
    """A shard's first windows, read from the endless stream of a loader that owns that shard alone."""
    loader = iter(build_dataloader(source, ByteTokenizer(), seq_len=T, batch_size=1, dp_rank=shard, dp_world_size=S,
                                   logical_shards=S, split="validation"))
    return [tuple(next(loader)["input"][0].tolist()) for _ in range(count)]


def test_rows_per_shard_are_an_equal_share():
    assert held_out.rows_per_shard(10, 4) == [3, 3, 2, 2]
    assert held_out.rows_per_shard(3, 4) == [1, 1, 1, 0]
    assert sum(held_out.rows_per_shard(1234, 64)) == 1234
    assert held_out.shards_read(3, 4) == [0, 1, 2] and held_out.shards_read(8, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("rows", [12, 10, 3])
def test_every_layout_and_worker_count_reads_the_same_rows(rows):
    source = SyntheticSource(SyntheticArgs(num_documents=40, validation_documents=40, min_length=3, max_length=30,
                                           vocab_size=200))
    expected = sorted(w for s, k in enumerate(held_out.rows_per_shard(rows, S)) for w in first_windows(source, s, k))
    assert len(expected) == rows
    for dp, workers in [(1, 0), (1, 2), (2, 0), (2, 2), (4, 0), (4, 1)]:
        got = sorted(w for r in range(dp) for w in set_rows(source, rows, r, dp, workers))
        assert got == expected, (dp, workers)


def test_a_shard_without_held_out_documents_gives_no_rows_and_moves_no_other():
    # 2 held-out documents: shards 0 and 1 hold one each, shards 2 and 3 none.
    source = SyntheticSource(SyntheticArgs(num_documents=40, validation_documents=2, min_length=3, max_length=30,
                                           vocab_size=200))
    per_shard = held_out.rows_per_shard(8, S)
    expected = sorted(w for s in (0, 1) for w in first_windows(source, s, per_shard[s]))
    assert sorted(set_rows(source, 8, 0, 1)) == expected == sorted(set_rows(source, 8, 0, 1, num_workers=2))
    assert sorted(set_rows(source, 8, 0, 2) + set_rows(source, 8, 1, 2, num_workers=2)) == expected
    assert set_rows(source, 8, 2, 4) == [] and set_rows(source, 8, 3, 4, num_workers=1) == []  # the set just ends


def rows_of(values: list[int]) -> list[dict]:
    starts = torch.zeros((1, T), dtype=torch.bool)
    starts[0, 0] = True
    return [{"input": torch.full((1, T), v), "target": torch.full((1, T), v), "document_starts": starts}
            for v in values]


def test_every_rank_runs_as_many_batches_and_filler_rows_count_nothing():
    # 3 rows over 4 shards and 2 ranks of batch 2: rank 0 holds shards 0 and 2 (2 rows), rank 1 shard 1 (1 row).
    assert held_out.batches_per_rank(3, S, 2, 2) == 1 and held_out.batches_per_rank(12, S, 4, 2) == 2
    (batch,) = held_out.held_out_batches(rows_of([7]), 2, T, count=1)
    assert batch["target"][0].tolist() == [7] * T and (batch["target"][1] == IGNORE_INDEX).all()
    assert batch["document_starts"][1].tolist() == [True] + [False] * (T - 1)
    empty = list(held_out.held_out_batches([], 2, T, count=2))  # a rank whose shards hold nothing
    assert len(empty) == 2 and all((b["target"] == IGNORE_INDEX).all() for b in empty)


def test_unpadded_batches_end_with_the_last_row():
    batches = list(held_out.held_out_batches(rows_of([1, 2, 3, 4, 5]), 2, T, count=None))
    assert [b["input"].shape[0] for b in batches] == [2, 2, 1]
    assert (torch.cat([b["target"] for b in batches]) != IGNORE_INDEX).all()


def test_the_set_follows_the_global_batch_or_with_minus_one_the_local_batch():
    """global_batch_size = -1 follows the world size: the set takes one process's local batch instead, so it
    stays the same at every world size."""
    def recipe(global_batch, local_batch):
        return SimpleNamespace(validation=SimpleNamespace(steps=3),
                               training=SimpleNamespace(global_batch_size=global_batch, local_batch_size=local_batch))

    assert held_out.held_out_rows(recipe(64, 8)) == held_out.held_out_rows(recipe(64, 2)) == 192
    assert held_out.held_out_rows(recipe(-1, 8)) == 24


def synthetic_held_out_tokens(documents: int, rows: int, seq_len: int = 64, min_length: int = 3,
                               max_length: int = 30) -> int:
    """The targets a set of `rows` rows holds over the synthetic source's held-out documents, counted from their
    lengths: shard s (documents i = s mod S) gives one pass over its stream (each document and its EOS), i.e.
    all but the stream's first token as targets, up to its share of the rows."""
    source = SyntheticSource(SyntheticArgs(num_documents=40, validation_documents=documents, min_length=min_length,
                                           max_length=max_length))
    total = 0
    for shard, quota in enumerate(held_out.rows_per_shard(rows, S)):
        stream = sum(len(source.document("validation", i)) + 1 for i in range(shard, documents, S))
        total += min(quota * seq_len, max(stream - 1, 0))
    return total


@pytest.mark.parametrize("held_out_documents, steps", [(2, 2), (2, 1), (24, 2), (200, 2)])
def test_a_held_out_set_its_shards_cannot_fill_is_told_once(tmp_path, capsys, held_out_documents, steps):
    """Few held-out documents over four logical shards fill part of the rows asked for, each read once (they were
    read again and again to fill the rows, and the note's fix of fewer steps never filled them): the note says how
    many tokens the loss covers, and asks for fewer steps only where a batch's worth is there. A full set says
    nothing."""
    from nsa_titan import cli
    from tests.launch import DEBUG, TINY

    argv = ["train", DEBUG, *TINY, "--training.steps=2", "--validation.enable=true", "--validation.freq=1",
            f"--validation.steps={steps}", "--training.local_batch_size=4", "--training.global_batch_size=4",
            "--data.source=synthetic", f"--data.synthetic.validation_documents={held_out_documents}",
            "--data.synthetic.min_length=3", "--data.synthetic.max_length=30", f"--job.dump_folder={tmp_path}"]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    asked = steps * 4 * 64
    tokens = synthetic_held_out_tokens(held_out_documents, steps * 4)
    if tokens == asked:
        assert "the held-out set holds" not in said, said
        return
    assert 0 < tokens < asked
    more = "hold out more documents (the source's validation_fraction or split)."
    fix = f"ask for fewer (validation.steps {tokens // 256} at most), or {more}" if tokens >= 256 else more
    note = f"note: the held-out set holds {tokens:,} of the {asked:,} tokens ({steps * 4} rows of 64) validation.steps"
    assert said.count(note) == 1 and f"so the loss covers those {tokens:,} tokens. Fix: {fix}" in said, said


def test_a_shard_gives_its_held_out_documents_once_its_last_row_short():
    """A shard whose held-out documents fill fewer rows than its share gives them once: the last row holds the
    rest of the stream, its remaining targets counting nothing (never the documents again from the start)."""
    source = SyntheticSource(SyntheticArgs(num_documents=40, validation_documents=5, min_length=9, max_length=9,
                                           vocab_size=200))
    tokenizer = ByteTokenizer()
    # Shard 0 holds documents 0 and 4: a stream of 2 x (9 tokens + EOS) = 20 tokens, 19 targets; its share is 5
    # rows of 8 (40 targets).
    stream = [t for i in (0, 4) for t in [*source.document("validation", i).tolist(), tokenizer.eos_id]]
    loader = build_dataloader(source, tokenizer, seq_len=T, batch_size=1, dp_rank=0, dp_world_size=S,
                              logical_shards=S, split="validation", quotas=held_out.quotas_of_rank(20, S, 0, S))
    rows = list(loader)
    assert len(rows) == 3
    targets = torch.cat([row["target"][0] for row in rows])
    counted = targets[targets != IGNORE_INDEX]
    assert len(counted) == 19 and (targets[19:] == IGNORE_INDEX).all()
    inputs = torch.cat([row["input"][0] for row in rows])
    # Each document's tokens once (in the shard's order of its two documents): the stream's first token is the
    # first input, the rest are the targets, each target the next row position's input.
    assert sorted([int(inputs[0]), *counted.tolist()]) == sorted(stream)
    assert inputs[1:19].tolist() == counted[:18].tolist()


def test_an_empty_held_out_set_names_the_sources_own_held_out_field():
    """'raise the data source's validation_fraction' left the user to find where it sits: the source's fields are
    named where it has them, and no field is made up for a source that has none (synthetic's are counts)."""
    import os

    from nsa_titan.config import resolve
    from tests.conftest import REPO_ROOT

    debug = os.path.join(REPO_ROOT, "recipes", "debug.toml")
    files = resolve([debug, "--data.source=text_files", "--data.text_files.paths=a.txt"]).recipe
    assert ("Fix: raise data.text_files.validation_fraction (or its validation_split), add data"
            in str(held_out.empty_set_error(files)))
    synthetic = resolve([debug, "--data.source=synthetic"]).recipe
    assert "data.synthetic.validation_fraction" not in str(held_out.empty_set_error(synthetic))
