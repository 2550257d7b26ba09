"""A batch on the device, and the held-out set a run validates on, read once and then kept in host memory."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nsa_titan import held_out
from nsa_titan.parallel.distributed import any_rank

# Validation batches kept in host memory between evaluations when they fit (2 int32 tensors and a bool
# one per batch).
VALIDATION_CACHE_BYTES = 1 << 30


class Batch(NamedTuple):
    inputs: torch.Tensor  # [B, T] on the device
    targets: torch.Tensor  # [B, T] on the device
    document_starts: torch.Tensor | None  # [B, T] bool on the host, when the loader gives them


def next_batch(iterator, device: torch.device) -> Batch:
    """The loader's next batch, its tokens on `device`."""
    batch = next(iterator)  # the loader names a rank whose shards hold no documents
    return Batch(batch["input"].to(device, non_blocking=True), batch["target"].to(device, non_blocking=True),
                 batch.get("document_starts"))


class ValidationSet:
    """This rank's share of the held-out set (held_out.py), in batches of the run's local batch size."""

    def __init__(self, recipe, runtime, source, tokenizer, dp_rank: int, dp_size: int):
        self.recipe, self.runtime, self.source, self.tokenizer = recipe, runtime, source, tokenizer
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._cache: list | None = None  # the validation batches once read (see batches)

    def _rows(self):
        """This rank's share of the held-out set, a row at a time (held_out.py)."""
        return held_out.rank_rows(self.recipe, self.runtime, self.source, self.tokenizer, self.dp_rank, self.dp_size,
                                  held_out.held_out_rows(self.recipe))

    def check_not_empty(self) -> None:
        """Fail at start-up, not after validation.freq steps, when the held-out set is empty (every rank
        hears it: one rank's shards may hold no held-out document while another's do)."""
        mine = held_out.rank_has_rows(self.recipe, self.runtime, self.source, self.tokenizer, self.dp_rank,
                                      self.dp_size)
        if not any_rank(mine, self.runtime.device):
            raise held_out.empty_set_error(self.recipe)

    def batches(self):
        """The held-out batches, read once and then kept in host memory (int32) when they fit in
        VALIDATION_CACHE_BYTES: a source that holds out a small share of a stream (the huggingface
        hash split) would otherwise stream a thousand training documents per held-out one again at
        every evaluation."""
        recipe, device = self.recipe, self.runtime.device
        if self._cache is not None:
            for inputs, targets, starts in self._cache:
                yield Batch(inputs.to(device, non_blocking=True).long(), targets.to(device, non_blocking=True).long(),
                            starts)
            return
        S, B, T = recipe.data.logical_shards, recipe.training.local_batch_size, recipe.training.seq_len
        rows = held_out.held_out_rows(self.recipe)
        count = held_out.batches_per_rank(rows, S, self.dp_size, B)
        keep = (2 * 4 + 1) * count * B * T <= VALIDATION_CACHE_BYTES and self.tokenizer.vocab_size < 2**31
        kept = []
        iterator = held_out.held_out_batches(self._rows(), B, T, count)
        for _ in range(count):
            batch = next_batch(iterator, device)
            if keep:
                kept.append((batch.inputs.to("cpu", torch.int32), batch.targets.to("cpu", torch.int32),
                             batch.document_starts))
            yield batch
        if keep:
            self._cache = kept
