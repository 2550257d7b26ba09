"""A transformer whose training forward on one rank meets a full disk at a chosen step: for the message of a
rank that ends alone on ENOSPC.

    --job.plugins=tests.plugins.full_disk_at_step --model.name=full_disk_at_step --model.full_disk_step=2
    --model.full_disk_rank=1

The forward of that step on that rank raises OSError(ENOSPC) for a file it names, as a write the step made
(a spill, a log) would.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from components.models import Transformer, TransformerArgs, transformer_hooks
from nsa_titan.registry import register

SPILL_FILE = "/scratch/spill.bin"


@dataclass
class FullDiskAtStepArgs(TransformerArgs):
    full_disk_step: int = field(default=2, metadata={"doc": "the step (1-based) whose forward meets a full disk",
                                                     "ge": 1, "keeps_weights": True})
    full_disk_rank: int = field(default=0, metadata={"doc": "the rank that meets it", "ge": 0,
                                                     "keeps_weights": True})


class FullDiskAtStepTransformer(Transformer):
    def __init__(self, args: FullDiskAtStepArgs, vocab_size: int):
        super().__init__(args, vocab_size)
        self.training_forwards = 0

    def forward(self, tokens: torch.Tensor, documents=None) -> torch.Tensor:
        if self.training:
            self.training_forwards += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == self.args.full_disk_rank and self.training_forwards == self.args.full_disk_step:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), SPILL_FILE)
        return super().forward(tokens, documents)


def build_full_disk_at_step(args: FullDiskAtStepArgs, vocab_size: int) -> FullDiskAtStepTransformer:
    return FullDiskAtStepTransformer(args, vocab_size)


register("model", "full_disk_at_step", build_full_disk_at_step, args=FullDiskAtStepArgs, replace=True,
         doc="test only: the transformer whose forward meets a full disk at a chosen step on a chosen rank",
         **transformer_hooks())
