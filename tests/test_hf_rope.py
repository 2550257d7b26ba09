"""The --format hf folder's RoPE: the trainer's tables (fp64 angles, fp32 tables), computed once per device and head
size rather than at every call."""

from __future__ import annotations

import pytest
import torch

from components.models.rope import RotaryEmbedding, apply_rope
from tests.test_hf_modeling_shapes import load_modeling_file

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")


@pytest.fixture(scope="module")
def modeling():
    return load_modeling_file("modeling_nsa_titan_rope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_hf_rope_rotates_as_the_trainer_bit_for_bit(modeling, dtype):
    D, theta, length = 16, 5000.0, 3000
    trainer = RotaryEmbedding(D, length, theta)
    x = torch.randn(2, 7, 3, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = torch.tensor([0, 1, 17, 999, 1000, 2047, 2999])
    got = modeling.rope(x, positions, theta, length)
    assert torch.equal(got, apply_rope(x, trainer.cos, trainer.sin, positions))


def test_hf_rope_tables_are_made_once_and_grown_only_past_their_end(modeling):
    D, theta = 8, 12345.0
    x = torch.randn(1, 3, 1, D)
    modeling.rope(x, torch.arange(3), theta, 3)
    modeling.rope(x[:, :1], torch.tensor([3]), theta, 4)  # past the end: twice as long
    first = modeling._ROPE_TABLES[("cpu", D, theta)]
    assert first[0].shape[0] == 6
    for end in (5, 6):  # decode steps within the table's length
        modeling.rope(x[:, :1], torch.tensor([end - 1]), theta, end)
    assert modeling._ROPE_TABLES[("cpu", D, theta)] is first
    modeling.rope(x[:, :1], torch.tensor([40]), theta, 41)
    grown = modeling._ROPE_TABLES[("cpu", D, theta)]
    assert grown[0].shape[0] == 41 and torch.equal(grown[0][:6], first[0]) and torch.equal(grown[1][:6], first[1])
