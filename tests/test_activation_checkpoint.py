"""Activation checkpointing in the eager model: which blocks are wrapped, that the wrapped blocks save only
their input for backward, and that the loss and every gradient are those of the unwrapped model, bit for bit
(the recomputed forward is the same computation). Compiled training with it: tests/test_compile_training.py."""

from __future__ import annotations

import copy

import pytest
import torch

from components.models import Transformer
from nsa_titan.parallel.activation_checkpoint import apply_activation_checkpointing
from tests.saved_tensors import saved_bytes
from tests.test_models_helpers import VOCAB, tiny_args

B, T = 2, 48


def _model(n_layers: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(tiny_args(n_layers=n_layers), VOCAB)
    model.init_weights()
    return model


@pytest.mark.parametrize("mode, every, wrapped", [("none", 1, []), ("full", 1, [0, 1, 2, 3]),
                                                  ("selective", 2, [0, 2]), ("selective", 3, [0, 3])])
def test_the_chosen_blocks_are_wrapped_and_keep_their_names(mode, every, wrapped):
    model = _model(4)
    keys = list(model.state_dict())
    originals = [block.forward for block in model.layers]
    assert apply_activation_checkpointing(list(model.layers), mode, every) == len(wrapped)
    assert [i for i, block in enumerate(model.layers) if block.forward != originals[i]] == wrapped
    assert list(model.state_dict()) == keys  # checkpoints load whatever the setting


def test_checkpointed_blocks_save_less_and_compute_the_same_gradients():
    plain = _model(2)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(list(wrapped.layers), "full", 1)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))

    def loss_of(model):
        return model(tokens).float().logsumexp(-1).mean()

    # What forward keeps for backward: a checkpointed block keeps its input, not its activations (measured:
    # 86 kB against 838 kB).
    kept_plain, kept_wrapped = saved_bytes(plain, lambda: loss_of(plain)), saved_bytes(wrapped, lambda: loss_of(wrapped))
    assert kept_wrapped < kept_plain / 2, (kept_wrapped, kept_plain)

    losses = []
    for model in (plain, wrapped):
        loss = loss_of(model)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    grads = dict(wrapped.named_parameters())
    for name, param in plain.named_parameters():
        assert param.grad is not None and torch.count_nonzero(param.grad) > 0, name
        assert torch.equal(param.grad, grads[name].grad), name
