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

from components.models import Transformer, TransformerArgs, transformer_hooks
from nsa_titan.registry import register


@dataclass
class NanAtStepArgs(TransformerArgs):
    # keeps_weights: switches of the test, not of what the weights mean (a resume may change them)
    nan_at_step: int = field(default=3, metadata={"doc": "first step (1-based) whose loss is NaN", "ge": 1,
                                                  "keeps_weights": True})
    nan_steps: int = field(default=1, metadata={"doc": "steps in a row with a NaN loss; 0 = all from then on",
                                                "ge": 0, "keeps_weights": True})
    micro_batches: int = field(default=1, metadata={"doc": "training forwards per optimizer step", "ge": 1,
                                                    "keeps_weights": True})


class NanAtStepTransformer(Transformer):
    def __init__(self, args: NanAtStepArgs, vocab_size: int):
        super().__init__(args, vocab_size)
        self.training_forwards = 0

    def forward(self, tokens: torch.Tensor, documents=None) -> torch.Tensor:
        logits = super().forward(tokens, documents)
        if not self.training:
            return logits
        step = self.training_forwards // self.args.micro_batches + 1
        self.training_forwards += 1
        first, count = self.args.nan_at_step, self.args.nan_steps
        if step >= first and (count == 0 or step < first + count):
            logits = logits + float("nan")
        return logits


def build_nan_at_step(args: NanAtStepArgs, vocab_size: int) -> NanAtStepTransformer:
    return NanAtStepTransformer(args, vocab_size)


register("model", "nan_at_step", build_nan_at_step, args=NanAtStepArgs, replace=True,
         doc="test only: the transformer with NaN logits at chosen training steps", **transformer_hooks())
