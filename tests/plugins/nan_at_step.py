"""A transformer whose training loss is NaN (so are its gradients) at chosen steps: for the NaN guard.

Load it and name it as the model (all transformer fields still apply):

    --job.plugins=tests.plugins.nan_at_step --model.name=nan_at_step
    --model.nan_at_step=3 --model.nan_steps=1

Training forwards are counted (eval-mode forwards, e.g. validation, are not); with gradient
accumulation set model.micro_batches to the micro-batches per step. The logits of every forward of
steps nan_at_step .. nan_at_step + nan_steps - 1 become NaN; nan_steps = 0 makes every step from
nan_at_step on NaN (a run that cannot recover). The count restarts with the process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from components.models import TransformerArgs
from tests.plugins.faulty_model import FaultyTransformer, register_faulty_model


@dataclass
class NanAtStepArgs(TransformerArgs):
    # keeps_weights: switches of the test, not of what the weights mean (a resume may change them)
    nan_at_step: int = field(default=3, metadata={"doc": "first step (1-based) whose loss is NaN", "ge": 1,
                                                  "keeps_weights": True})
    nan_steps: int = field(default=1, metadata={"doc": "steps in a row with a NaN loss; 0 = all from then on",
                                                "ge": 0, "keeps_weights": True})
    micro_batches: int = field(default=1, metadata={"doc": "training forwards per optimizer step", "ge": 1,
                                                    "keeps_weights": True})


class NanAtStepTransformer(FaultyTransformer):
    def after_forward(self, number: int, logits: torch.Tensor) -> torch.Tensor:
        step = (number - 1) // self.args.micro_batches + 1
        first, count = self.args.nan_at_step, self.args.nan_steps
        if step >= first and (count == 0 or step < first + count):
            return logits + float("nan")
        return logits


register_faulty_model("nan_at_step", NanAtStepTransformer, NanAtStepArgs,
                      "the transformer with NaN logits at chosen training steps")
