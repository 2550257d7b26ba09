"""The shape the fault-injection test models share: a transformer that counts its training forwards
(eval-mode forwards, e.g. validation, are not counted) and may misbehave in each.

A subclass overrides `before_forward(number, tokens)` (raise to fail the forward) and/or
`after_forward(number, logits)` (return altered logits); `number` is 1 for the first training
forward of the process. `register_faulty_model` registers it as a model with the transformer's hooks.
"""

from __future__ import annotations

import torch

from components.models import Transformer, transformer_hooks
from nsa_titan.registry import register


class FaultyTransformer(Transformer):
    def __init__(self, args, vocab_size: int):
        super().__init__(args, vocab_size)
        self.training_forwards = 0

    def before_forward(self, number: int, tokens: torch.Tensor) -> None:
        pass

    def after_forward(self, number: int, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def forward(self, tokens: torch.Tensor, documents=None) -> torch.Tensor:
        if not self.training:
            return super().forward(tokens, documents)
        self.training_forwards += 1
        self.before_forward(self.training_forwards, tokens)
        return self.after_forward(self.training_forwards, super().forward(tokens, documents))


def register_faulty_model(name: str, model_class: type[FaultyTransformer], args: type, doc: str) -> None:
    def build(model_args, vocab_size: int) -> FaultyTransformer:
        return model_class(model_args, vocab_size)

    register("model", name, build, args=args, replace=True, doc=f"test only: {doc}", **transformer_hooks())
