"""A transformer whose training forward runs out of device memory at a chosen step: for the trainer's
out-of-memory message.

    --job.plugins=tests.plugins.oom_at_step --model.name=oom_at_step --model.oom_at_step=3

Training forwards are counted (one per step without gradient accumulation); the forward of step
oom_at_step raises torch.OutOfMemoryError with the text CUDA's caching allocator gives. The count
restarts with the model. With --model.oom_above_rows=N (N > 0), every training forward of more than N
rows runs out of memory instead, whatever the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from components.models import TransformerArgs
from tests.plugins.faulty_model import FaultyTransformer, register_faulty_model

ALLOCATOR_TEXT = ("CUDA out of memory. Tried to allocate 12.27 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
                  "6.40 GiB is free. Including non-PyTorch memory, this process has 72.77 GiB memory in use. Of the "
                  "allocated memory 60.88 GiB is allocated by PyTorch, and 11.17 GiB is reserved by PyTorch but "
                  "unallocated. If reserved but unallocated memory is large try setting "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


@dataclass
class OomAtStepArgs(TransformerArgs):
    oom_at_step: int = field(default=3, metadata={"doc": "the step (1-based) whose forward runs out of memory",
                                                  "ge": 1, "keeps_weights": True})
    oom_above_rows: int = field(default=0, metadata={"doc": "> 0: every training forward of more rows runs out "
                                                            "of memory instead", "ge": 0, "keeps_weights": True})


class OomAtStepTransformer(FaultyTransformer):
    def before_forward(self, number: int, tokens: torch.Tensor) -> None:
        too_many_rows = 0 < self.args.oom_above_rows < tokens.shape[0]
        if too_many_rows or (not self.args.oom_above_rows and number == self.args.oom_at_step):
            raise torch.OutOfMemoryError(ALLOCATOR_TEXT)


register_faulty_model("oom_at_step", OomAtStepTransformer, OomAtStepArgs,
                      "the transformer that runs out of device memory at a chosen training step")
