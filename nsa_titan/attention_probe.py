"""Attention telemetry and TensorBoard's attention pictures, taken on a fixed probe of the training stream."""

from __future__ import annotations

import dataclasses

from nsa_titan import assemble
from nsa_titan.observe.telemetry_log import telemetry_records
from nsa_titan.validation_set import Batch, next_batch


class AttentionProbe:
    """The run's model walked on two fixed rows (see _fixed_probe) for its telemetry hook and its attention maps.
    `autocast`, `documents` and `context` are the run's: its compute type, and what its forward is given of a
    batch's documents or, under context parallelism, of this rank's share of the rows."""

    def __init__(self, recipe, runtime, source, tokenizer, model_part, model, shard, autocast, documents, context):
        self.recipe, self.runtime, self.source, self.tokenizer = recipe, runtime, source, tokenizer
        self.model_part, self.model, self.shard = model_part, model, shard
        self._autocast, self._documents, self._context = autocast, documents, context
        self._probe: Batch | None = None  # two fixed rows for attention telemetry

    def _fixed_probe(self) -> Batch:
        """The first two rows of the training stream as one data rank without loader workers reads it, from a
        loader of its own: the same rows on every rank, at every world size, worker count and batch size,
        resumed or not, so telemetry and its pictures follow one document through training (a rank's own
        stream starts with other rows at each layout)."""
        if self._probe is None:
            loader = assemble.build_loader(self.recipe, self.runtime, self.source, self.tokenizer, dp_rank=0,
                                           dp_size=1, split="train", batch_size=2, num_workers=0)
            self._probe = next_batch(iter(loader), self.runtime.device)
        return self._probe

    def telemetry(self) -> dict[str, float]:
        """Attention telemetry on a fixed batch; runs on every rank (sharded models gather for it; under
        context parallelism each rank takes its share of the rows and the model combines them)."""
        self.model.eval()
        probe = self._fixed_probe()
        with self._autocast():
            if self.shard is not None:
                context = self._context(probe)
                stats = self.model_part.telemetry(self.model, self.shard.split(probe.inputs), context=context)
            else:
                documents = self._documents(probe)
                stats = self.model_part.telemetry(self.model, probe.inputs,
                                                  *(() if documents is None else (documents,)))
        return telemetry_records(stats)

    def attention_figures(self) -> dict:
        """The plot command's pictures of the probe's first document (row 0), for TensorBoard. Every rank
        runs the walk (a sharded model gathers for it); rank 0 draws ({} elsewhere)."""
        from nsa_titan.observe.plots import attention_figures

        probe = self._fixed_probe()
        end = probe.inputs.shape[1]
        if self._documents(probe) is not None:  # the model sees documents apart: picture the first
            later = probe.document_starts[0, 1:].nonzero()
            end = int(later[0]) + 1 if len(later) else end
        with self._autocast():
            if self.shard is not None:  # every rank walks its share; the maps come back whole
                context = self._context(probe)
                maps = self.model_part.attention_maps(self.model, self.shard.split(probe.inputs), context=context)
                maps = {i: dataclasses.replace(m, gates=m.gates[:1, :end], selected=m.selected[:1, :end])
                        for i, m in maps.items()}
            else:
                maps = self.model_part.attention_maps(self.model, probe.inputs[:1, :end])
        return attention_figures(maps, end) if self.runtime.is_main and maps else {}
