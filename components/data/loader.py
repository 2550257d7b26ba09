"""build_dataloader: the resumable, per-rank sharded StatefulDataLoader.

Batches are {"input": LongTensor[B, seq_len], "target": LongTensor[B, seq_len],
"document_starts": BoolTensor[B, seq_len]} for every batch size including 1. document_starts marks
the input tokens that open a document: each row's first token, and every token after an EOS of the
stream (a document cut by a row end goes on as a document of its own in the next row). The stream is
endless (but for a fixed set, below): iterate it once and keep the iterator.

Resuming:
  - same source, tokenizer, seed, logical_shards, split, world size and num_workers:
    loader.load_state_dict(saved) on a freshly built loader gives exactly the batches that would
    have followed;
  - another world size or num_workers: build with shard_states=merge_shard_states(...) of the
    per-shard states of every old rank (loader_state_by_logical_shard). Each shard's stream goes on
    exactly where it stopped; the interleave rule of components.data.sharding orders them.
seq_len may change on resume: positions are kept in tokens, not windows.

Validation: the validation stream is as endless as the training one; a fixed held-out set is a loader
built with `quotas` (each shard's first windows), which ends once every shard gave its share.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from components.errors import UserError
from components.data.dataset import PackedShardsDataset, no_documents_error
from components.data.sharding import loader_state_by_logical_shard, shards_of_rank, validate_layout
from components.data.sources.base import SPLITS, order_fingerprint


class ShardedStatefulDataLoader(StatefulDataLoader):
    """A StatefulDataLoader that checks a saved state fits this rank before accepting it."""

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            with_workers = "_snapshot" in state_dict
            if with_workers != (self.num_workers > 0):
                raise UserError(
                    f"the saved loader state was taken with {'some' if with_workers else 'no'} worker processes "
                    f"but this loader has num_workers={self.num_workers}; keep num_workers, or resume through "
                    "loader_state_by_logical_shard(...) and build_dataloader(shard_states=...)"
                )
            dataset = self.dataset
            for shard, state in loader_state_by_logical_shard(state_dict).items():
                if shard not in dataset.rank_shards:
                    raise UserError(
                        f"the saved loader state holds logical shard {shard}, which rank {dataset.dp_rank} does not "
                        "own; load each rank's own state, or reshard through loader_state_by_logical_shard(...) "
                        "and build_dataloader(shard_states=...)"
                    )
                dataset.check_stream(state["stream"])
        super().load_state_dict(state_dict)

    def __iter__(self):
        return _PlainErrors(super().__iter__(), self.dataset)


# torch re-raises an exception from a worker process as the same type, built from "Caught TYPE in
# DataLoader worker process N" and the worker's whole traceback, whose last entry starts with the
# type's qualified name and holds the message the user should see.
_WORKER_HEADER = "Caught {} in DataLoader worker process"


class _PlainErrors:
    """The loader's iterator, whose errors read as the user's problem wherever the data was read: a worker
    process's UserError loses torch's traceback wrapper, and an ended stream (the stream is endless, so
    it ends only when none of the rank's shards holds a document) is a UserError, not a StopIteration;
    a fixed set's stream (quotas) ends with StopIteration, as an iterator does."""

    def __init__(self, batches, dataset: PackedShardsDataset):
        self._batches, self._dataset = batches, dataset

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._batches)
        except StopIteration:
            data = self._dataset
            if data.quotas is not None:
                raise  # a fixed set: its end is the end
            raise no_documents_error(data.split, data.rank_shards, data.dp_rank, data.logical_shards,
                                     data.min_document_tokens) from None
        except UserError as exc:
            kind = type(exc)
            text = str(exc)
            last = list(re.finditer(rf"^{re.escape(f'{kind.__module__}.{kind.__qualname__}')}: ", text, re.M))
            if not text.startswith(_WORKER_HEADER.format(kind.__name__)) or not last:
                raise
            message = text[last[-1].end():].strip()
            try:
                plain = kind(message)  # the same kind of error (a subclass the caller may catch), if it builds so
            except TypeError:  # a subclass whose constructor takes other arguments
                plain = UserError(message)
            raise plain from None


def stream_id(source, tokenizer, *, split: str, seed: int, logical_shards: int, add_bos: bool,
              min_document_tokens: int = 0) -> str:
    """Everything that fixes a shard's token stream; a saved state only continues an equal stream
    (dataset.stream_differences: parts added since are not asked of older states)."""
    file = getattr(tokenizer, "file_digest", None)  # a tokenizer read from a file whose name holds no digest
    files = source.files_fingerprint() if callable(getattr(source, "files_fingerprint", None)) else None
    name = getattr(tokenizer, "stream_name", tokenizer.name)  # what its tokens are, where it says so
    return (
        f"{source.fingerprint()}|tokenizer={name}:{tokenizer.vocab_size}|add_bos={add_bos}"
        f"|seed={seed}|logical_shards={logical_shards}|split={split}"
        + (f"|min_document_tokens={min_document_tokens}" if min_document_tokens else "")  # older states stay valid
        + f"|eos={tokenizer.eos_id}" + (f"|bos={tokenizer.bos_id}" if add_bos else "")
        + (f"|tokenizer_file={file}" if file else "")
        + (f"|files={files}" if files else "") + f"|order={order_fingerprint()}"
    )


def holds_split(source, split: str) -> bool:
    """False when the source says the split is empty by construction (its optional has_split)."""
    has_split = getattr(source, "has_split", None)
    return has_split is None or bool(has_split(split))


def no_split_error(source, split: str, without: str | None = "turn validation off (validation.enable = false)",
                   instead: str | None = None):
    """The refusal of a split the source holds out nothing for; without: the way on that needs no such data, when
    the caller has one (eval reads the held-out set whatever validation.enable says: None); instead: the whole fix,
    from a caller that takes its settings otherwise."""
    other = f", or {without}" if without else ""
    fix = f"set the source's validation_fraction above 0 (or its validation_split){other}" if instead is None else \
        instead
    return UserError(f"the data source ({type(source).__name__}) holds out no {split} documents (a built-in source "
                     f"with validation_fraction = 0; a plugin's whose has_split({split!r}) is False). Fix: {fix}")


def build_dataloader(
    source,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    logical_shards: int = 64,
    split: str = "train",
    seed: int = 0,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    add_bos: bool = False,
    min_document_tokens: int = 0,
    shard_states: dict[int, dict] | None = None,
    check_source: bool = True,
    quotas: dict[int, int] | None = None,
) -> StatefulDataLoader:
    """The loader of data-parallel rank dp_rank; `shard_states` restarts from per-shard states. quotas
    (shard -> windows): each of the rank's shards gives at most that many windows from its stream's start
    (none for a shard not named), then the loader ends; a shard without documents gives none.

    dp_rank / dp_world_size are data-parallel coordinates: ranks that share a model replica's
    batch (tensor or pipeline peers) pass the same dp_rank.
    """
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
    if split not in SPLITS:
        raise UserError(f"data split {split!r} is unknown; use one of {SPLITS}")
    if seed < 0:
        raise UserError(f"data seed must be >= 0 (got {seed})")
    validate_layout(dp_rank, dp_world_size, logical_shards, num_workers)
    if not holds_split(source, split):
        raise no_split_error(source, split)
    if check_source:
        source.check()
    check_tokenizer = getattr(source, "check_tokenizer", None)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    dataset = PackedShardsDataset(
        source,
        tokenizer,
        seq_len=seq_len,
        rank_shards=shards_of_rank(dp_rank, dp_world_size, logical_shards),
        logical_shards=logical_shards,
        split=split,
        seed=seed,
        add_bos=add_bos,
        min_document_tokens=min_document_tokens,
        stream_id=stream_id(source, tokenizer, split=split, seed=seed, logical_shards=logical_shards, add_bos=add_bos,
                            min_document_tokens=min_document_tokens),
        dp_rank=dp_rank,
        shard_states=shard_states,
        quotas=quotas,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a deprecated torch telemetry hook in its constructor; nothing to act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
        return ShardedStatefulDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=bool(pin_memory and torch.cuda.is_available()),
            # A fixed set is read once: its workers end with it (they would sit idle in forks of this process).
            persistent_workers=num_workers > 0 and quotas is None,
            snapshot_every_n_steps=1,
            worker_init_fn=_leave_process_group if num_workers > 0 else None,
            # Each iterator's seed for its workers comes from here, not from torch's global generator, which a
            # model's own randomness (dropout) draws from and a checkpoint restores: reading data draws none of it.
            generator=torch.Generator().manual_seed(seed),
        )


def _leave_process_group(worker_id: int) -> None:
    """Workers leave the training process's process group, so a stop signal reaches only the trainer.

    Launchers (torchrun) and terminals (Ctrl-C) signal the whole group; a worker killed that way
    would take the loader down before the training process could finish its step and save. The
    loader still ends its workers itself, and they exit when the training process dies.
    """
    os.setsid()
