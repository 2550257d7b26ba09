"""Compression blocks, their positions, and KVCompressor against per-block loops."""

from __future__ import annotations

import math

import pytest
import torch

from components.errors import UserError
from components.nsa import KVCompressor, compressed_block_positions, num_compressed_blocks
from components.nsa.compression import unfold_blocks
from tests.test_nsa_bruteforce import count_compressed_blocks


@pytest.mark.parametrize("l,d", [(32, 16), (8, 4), (6, 3), (4, 4), (8, 2)])
def test_num_compressed_blocks_counts_complete_blocks(l, d):
    for T in range(0, 3 * l + 5):
        assert num_compressed_blocks(T, l, d) == count_compressed_blocks(T, l, d), T


def test_compressed_block_positions_are_last_tokens():
    pos = compressed_block_positions(5, 32, 16, device="cpu")
    assert pos.dtype == torch.long
    assert pos.tolist() == [31, 47, 63, 79, 95]
    assert compressed_block_positions(0, 32, 16).shape == (0,)


def test_unfold_blocks_is_a_view_of_the_input():
    x = torch.randn(2, 37, 3, 4)
    blocks = unfold_blocks(x, 8, 4)
    assert blocks.shape == (2, 8, 3, 8, 4)
    assert blocks.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    for i in range(8):
        torch.testing.assert_close(blocks[:, i], x[:, i * 4 : i * 4 + 8].transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("T", [37, 32, 8, 9, 41])
def test_mean_mode_is_block_mean(T):
    x = torch.randn(2, T, 3, 5, dtype=torch.float64)
    out = KVCompressor("mean", 8, 4, 5)(x)
    Tc = count_compressed_blocks(T, 8, 4)
    assert out.shape == (2, Tc, 3, 5)
    for i in range(Tc):
        torch.testing.assert_close(out[:, i], x[:, i * 4 : i * 4 + 8].mean(dim=1), rtol=1e-14, atol=1e-14)


def test_mlp_mode_matches_per_block_loop():
    comp = KVCompressor("mlp", 8, 4, 5, hidden_dim=7).double()
    with torch.no_grad():
        comp.pos_embed.normal_()  # non-zero so the test sees where it is added
    x = torch.randn(2, 30, 3, 5, dtype=torch.float64)
    out = comp(x)
    Tc = count_compressed_blocks(30, 8, 4)
    assert out.shape == (2, Tc, 3, 5)
    for b in range(2):
        for i in range(Tc):
            for h in range(3):
                block = x[b, i * 4 : i * 4 + 8, h] + comp.pos_embed  # [l, D], token-major
                hidden = torch.nn.functional.gelu(comp.fc1.weight @ block.reshape(-1) + comp.fc1.bias)
                want = comp.fc2.weight @ hidden + comp.fc2.bias
                torch.testing.assert_close(out[b, i, h], want, rtol=1e-12, atol=1e-12)


def test_mlp_weights_are_shared_across_heads():
    comp = KVCompressor("mlp", 4, 2, 6)
    x = torch.randn(1, 20, 4, 6)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(comp(x[:, :, perm]), comp(x)[:, :, perm])


@pytest.mark.parametrize("mode", ["mean", "mlp"])
def test_too_short_gives_empty_output(mode):
    comp = KVCompressor(mode, 8, 4, 5)
    x = torch.randn(3, 7, 2, 5, requires_grad=True)
    out = comp(x)
    assert out.shape == (3, 0, 2, 5)
    out.sum().backward()  # an empty output still backpropagates (zeros)
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_mlp_gradients_reach_every_parameter_and_the_input():
    comp = KVCompressor("mlp", 8, 4, 5)
    x = torch.randn(2, 30, 3, 5, requires_grad=True)
    (comp(x) ** 2).sum().backward()
    for name, p in comp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_mlp_init_keeps_unit_scale_and_reset_is_reproducible():
    torch.manual_seed(1)
    comp = KVCompressor("mlp", 32, 16, 64)
    x = torch.randn(4, 512, 2, 64)
    rms = comp(x).pow(2).mean().sqrt().item()
    assert 0.5 < rms < 2.0, rms  # unit-scale tokens -> unit-scale compressed vectors
    torch.manual_seed(7)
    comp.reset_parameters()
    first = [p.detach().clone() for p in comp.parameters()]
    torch.manual_seed(7)
    comp.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(first, comp.parameters(), strict=True))
    assert torch.equal(comp.pos_embed, torch.zeros_like(comp.pos_embed))


def test_reset_parameters_works_after_meta_init():
    # Sizes big enough that the sample std of each weight is close to the intended std.
    with torch.device("meta"):
        comp = KVCompressor("mlp", 8, 4, 16, hidden_dim=64)
    comp = comp.to_empty(device="cpu")
    with torch.no_grad():  # whatever to_empty left behind, reset must overwrite all of it
        for p in comp.parameters():
            p.fill_(float("nan"))
    reference = KVCompressor("mlp", 8, 4, 16, hidden_dim=64)  # built normally on CPU
    torch.manual_seed(3)
    comp.reset_parameters()
    torch.manual_seed(3)
    reference.reset_parameters()
    named = dict(comp.named_parameters())
    ref_named = dict(reference.named_parameters())
    assert sorted(named) == sorted(ref_named) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "pos_embed"]
    for name, p in named.items():
        assert p.device.type == "cpu", name
        assert torch.equal(p, ref_named[name]), name
    for name in ("pos_embed", "fc1.bias", "fc2.bias"):
        assert torch.equal(named[name], torch.zeros_like(named[name])), name
    # fc1: N(0, 1/fan_in) with fan_in = l*D = 128; fc2: N(0, 1/(0.425*hidden)) with hidden = 64.
    for name, std in (("fc1.weight", 1.0 / math.sqrt(8 * 16)), ("fc2.weight", 1.0 / math.sqrt(0.425 * 64))):
        w = named[name]
        assert abs(w.mean().item()) < 0.1 * std, name
        assert abs(w.std().item() / std - 1.0) < 0.1, (name, w.std().item(), std)


def test_invalid_arguments_raise_user_error():
    with pytest.raises(UserError, match="mode"):
        KVCompressor("max", 8, 4, 5)
    with pytest.raises(UserError, match="divide"):
        KVCompressor("mean", 8, 3, 5)
    with pytest.raises(UserError):
        KVCompressor("mlp", 0, 4, 5)


def test_wrong_input_shape_raises():
    with pytest.raises(ValueError):
        KVCompressor("mean", 8, 4, 5)(torch.randn(2, 30, 6))
    with pytest.raises(ValueError):
        KVCompressor("mean", 8, 4, 5)(torch.randn(2, 30, 3, 4))
