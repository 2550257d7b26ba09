"""The held-out set: the same rows of the validation split at every layout.

A validation reads `rows` windows (held_out_rows: validation.steps global batches), drawn evenly from
the logical shards: shard s gives the first rows // S of its held-out stream, one more for the first
rows % S shards, and at most one pass over its held-out documents (a shard with fewer gives fewer rows, its
last one short: never a document twice). A shard's stream does not depend on the layout, so neither does the set: each
data-parallel rank reads its own shards' share through one loader that ends there (its workers reading
shards side by side), and the loss is the mean over every token of the set. A resumed run at another
world size, micro-batch size or worker count therefore continues the same validation curve. A shard
without held-out documents gives no rows.

Every rank runs the same number of batches of the run's local batch size (sharded models gather
parameters in each forward, so no rank may stop early): a rank whose shards hold fewer rows fills its
last batches with rows whose targets count nothing (IGNORE_INDEX).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from components.data import NoDocuments, no_documents_error, shards_of_rank
from nsa_titan.loss import IGNORE_INDEX


MORE_HELD_OUT = "hold out more documents (the source's validation_fraction or split)"


def rows_per_batch(recipe) -> int:
    """The rows of one validation batch: training.global_batch_size; with global_batch_size = -1 (which
    follows the world size) one process's local batch, so the set does not follow the world size."""
    t = recipe.training
    return t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size


def held_out_rows(recipe) -> int:
    """validation.steps batches of rows_per_batch rows."""
    return recipe.validation.steps * rows_per_batch(recipe)


def rows_per_shard(rows: int, logical_shards: int) -> list[int]:
    base, extra = divmod(rows, logical_shards)
    return [base + (s < extra) for s in range(logical_shards)]


def shards_read(rows: int, logical_shards: int) -> list[int]:
    """The logical shards the set takes rows from (all of them unless rows < logical_shards)."""
    return [s for s, k in enumerate(rows_per_shard(rows, logical_shards)) if k]


def quotas_of_rank(rows: int, logical_shards: int, dp_rank: int, dp_size: int) -> dict[int, int]:
    """The windows each of this rank's shards gives to the set."""
    per_shard = rows_per_shard(rows, logical_shards)
    return {s: per_shard[s] for s in shards_of_rank(dp_rank, dp_size, logical_shards)}


def rank_rows(recipe, runtime, source, tokenizer, dp_rank: int, dp_size: int, rows: int,
              workers: bool = True) -> Iterable[dict]:
    """This rank's share of the set, a row at a time ({"input", "target", "document_starts"} of one row),
    from a loader that ends with it: of the run's workers, or (workers=False: a probe for one row) none."""
    from nsa_titan import assemble

    quotas = quotas_of_rank(rows, recipe.data.logical_shards, dp_rank, dp_size)
    return assemble.build_loader(recipe, runtime, source, tokenizer, dp_rank=dp_rank, dp_size=dp_size,
                                 split="validation", batch_size=1, quotas=quotas,
                                 num_workers=None if workers else 0)


def rank_has_rows(recipe, runtime, source, tokenizer, dp_rank: int, dp_size: int) -> bool:
    """Whether this rank's share of the set holds a row (one row read in this process)."""
    rows = rank_rows(recipe, runtime, source, tokenizer, dp_rank, dp_size, held_out_rows(recipe), workers=False)
    return next(iter(rows), None) is not None


def empty_set_error(recipe, rows: int | None = None, without: str | None = None, fix: str | None = None
                    ) -> NoDocuments:
    """The refusal of a held-out set of `rows` rows (the run's, by default) that no rank holds a row of;
    without: the fix that needs no held-out data, when it is not training's (validation.enable = false); fix: the
    whole fix instead (eval of an export, whose settings are flags)."""
    data = recipe.data
    rows = held_out_rows(recipe) if rows is None else rows
    fields = f"data.{data.source}" if hasattr(data.source_args, "validation_fraction") else None
    return no_documents_error("validation", shards_read(rows, data.logical_shards), None, data.logical_shards,
                              data.min_document_tokens, without, fix, source_fields=fields)


def short_set_note(recipe, found: int, batches: int | None = None, asked: str = "validation.steps",
                   fewer: str = "validation.steps", more: str = MORE_HELD_OUT) -> str | None:
    """What a held-out set of `found` counted tokens that its shards cannot fill (few held-out documents, most
    shards holding none; a shard's set is one pass over its documents) means for its loss; None when it holds
    the tokens asked for: `batches` batches of rows (validation.steps by default), which `asked` names, `fewer` is
    the setting that asks for fewer and `more` the way to more held-out documents."""
    per_batch, seq_len = rows_per_batch(recipe), recipe.training.seq_len
    rows = per_batch * (recipe.validation.steps if batches is None else batches)
    if found >= rows * seq_len:
        return None
    fits = found // (per_batch * seq_len)  # 0: not one batch is filled, so asking for fewer cannot fill the set
    ask_fewer = f"ask for fewer ({fewer} {fits} at most), or " if fits else ""
    return (f"the held-out set holds {found:,} of the {rows * seq_len:,} tokens ({rows} rows of {seq_len}) {asked} "
            f"asks for: the logical shards' held-out documents do not fill their share (each is read once), so "
            f"the loss covers those {found:,} tokens. Fix: {ask_fewer}{more}.")


def batches_per_rank(rows: int, logical_shards: int, dp_size: int, batch_size: int) -> int:
    """Batches every rank runs: the most any rank's share of the rows needs."""
    largest = max(sum(quotas_of_rank(rows, logical_shards, r, dp_size).values()) for r in range(dp_size))
    return -(-largest // batch_size)


def held_out_batches(rows: Iterable[dict], batch_size: int, seq_len: int, count: int | None) -> Iterator[dict]:
    """`rows` in batches of `batch_size` ({"input", "target", "document_starts"} on the host, as the
    loader gives them). count: exactly that many batches, the last ones filled with rows that count
    nothing; None: only the rows there are, the last batch maybe short."""
    pending: list[dict] = []
    made = 0
    for row in rows:
        pending.append(row)
        if len(pending) == batch_size:
            yield _stack(pending)
            pending, made = [], made + 1
    if count is None:
        if pending:
            yield _stack(pending)
        return
    for _ in range(made, count):
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
