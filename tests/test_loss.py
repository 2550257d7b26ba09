"""The trainer's loss: F.cross_entropy in fp32, summed, computed in chunks of rows without fp32 copies."""

import pytest
import torch
import torch.nn.functional as F

from nsa_titan import loss as loss_module
from nsa_titan.loss import IGNORE_INDEX, token_cross_entropy, token_cross_entropy_sum


def _case(dtype, rows=3 * 37, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, rows // 3, vocab, generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (3, rows // 3), generator=g)
    targets[0, ::5] = IGNORE_INDEX
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 16, 10_000], ids=["row-chunks", "uneven-chunks", "one-chunk"])
def test_matches_fp32_cross_entropy_and_its_gradient(dtype, chunk_rows, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk_rows * 101)
    logits, targets = _case(dtype)
    grad_out = torch.tensor(0.37)
    mine = token_cross_entropy_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits, grad_out)
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits, grad_out)
    assert mine.dtype == torch.float32 and mine.shape == ()
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-4)
    assert mine_grad.dtype == dtype
    # The same fp32 gradient, rounded to the logits' dtype once (bf16: at most one rounding apart).
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(mine_grad.float(), ref_grad.float(), **tol)
    assert (mine_grad[0, ::5] == 0).all()  # ignored targets give no gradient


@pytest.mark.parametrize("width", [128, 101 + loss_module.PADDING_LIMIT + 99], ids=["padded-rows", "slice-of-wider"])
def test_rows_wider_than_the_vocabulary_match_fp32_cross_entropy(width, monkeypatch):
    """The chunked form on a view of wider rows: an output layer's padded rows keep their layout in the gradient,
    a slice of some wider tensor gets a dense gradient."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 16 * 101)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 37, width, generator=g) * 4)[..., :101].detach().requires_grad_()
    targets = torch.randint(0, 101, (3, 37), generator=g)
    mine = token_cross_entropy_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits)
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(mine_grad, ref_grad, rtol=0, atol=1e-6)
    assert mine_grad.stride() == (logits.stride() if width == 128 else (37 * 101, 101, 1))


def test_saves_the_logits_and_one_float_per_row_only():
    logits, targets = _case(torch.bfloat16, rows=3 * 200, vocab=1000)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_cross_entropy_sum(logits, targets)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    rows = targets.numel()
    assert saved_bytes <= logits.numel() * logits.element_size() + rows * (8 + 4)
    assert all(t.dtype != torch.float32 or t.numel() == rows for t in saved)  # no fp32 [rows, V] tensor


def test_no_rows_is_zero():
    logits = torch.zeros(0, 7, requires_grad=True)
    total = token_cross_entropy_sum(logits, torch.zeros(0, dtype=torch.long))
    total.backward()
    assert total.item() == 0.0 and logits.grad.shape == (0, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_losses_match_fp32_cross_entropy(dtype, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 16 * 101)  # several chunks, the last one short
    logits, targets = _case(dtype)
    mine = token_cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten(), reduction="none")
    assert mine.shape == targets.shape and mine.dtype == torch.float32 and not mine.requires_grad
    torch.testing.assert_close(mine.flatten(), ref, rtol=1e-6, atol=1e-5)
