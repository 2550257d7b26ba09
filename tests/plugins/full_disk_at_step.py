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

from components.models import TransformerArgs
from tests.plugins.faulty_model import FaultyTransformer, register_faulty_model

SPILL_FILE = "/scratch/spill.bin"


@dataclass
class FullDiskAtStepArgs(TransformerArgs):
    full_disk_step: int = field(default=2, metadata={"doc": "the step (1-based) whose forward meets a full disk",
                                                     "ge": 1, "keeps_weights": True})
    full_disk_rank: int = field(default=0, metadata={"doc": "the rank that meets it", "ge": 0,
                                                     "keeps_weights": True})


class FullDiskAtStepTransformer(FaultyTransformer):
    def before_forward(self, number: int, tokens: torch.Tensor) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == self.args.full_disk_rank and number == self.args.full_disk_step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), SPILL_FILE)


register_faulty_model("full_disk_at_step", FullDiskAtStepTransformer, FullDiskAtStepArgs,
                      "the transformer whose forward meets a full disk at a chosen step on a chosen rank")
