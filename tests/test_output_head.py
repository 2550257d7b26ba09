"""The output layer's padded logits rows (components/models/output_head.py): the same function and
gradients as a plain linear layer, logits laid out in rows padded to ROW_MULTIPLE, and a backward that
reads the training loss's gradient in that layout without a copy."""

import pytest
import torch
import torch.nn.functional as F

from components.models.output_head import ROW_MULTIPLE, OutputHead, aligned_rows, padded_rows_linear, padded_width
from nsa_titan.loss import token_cross_entropy_sum

VOCAB, DIM = 2 * ROW_MULTIPLE + 13, 24


def _case(dtype=torch.float64, device="cpu", vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, DIM, generator=g, dtype=dtype).to(device).requires_grad_()
    weight = torch.randn(vocab, DIM, generator=g, dtype=dtype).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (3, 5), generator=g).to(device)
    return x, weight, targets


def _loss_and_grads(logits_of, x, weight, targets):
    loss = token_cross_entropy_sum(logits_of(x, weight), targets)
    return [loss.detach(), *torch.autograd.grad(loss, (x, weight))]


def test_padded_width_rounds_up_to_the_multiple():
    assert [padded_width(n) for n in (1, ROW_MULTIPLE, ROW_MULTIPLE + 1, 50257)] == \
        [ROW_MULTIPLE, ROW_MULTIPLE, 2 * ROW_MULTIPLE, 50304]


def test_logits_are_a_view_of_padded_rows_with_the_plain_layers_values():
    x, weight, _ = _case()
    logits = padded_rows_linear(x, weight)
    assert logits.shape == (3, 5, VOCAB)
    assert logits.stride() == (5 * padded_width(VOCAB), padded_width(VOCAB), 1)
    torch.testing.assert_close(logits, F.linear(x, weight), rtol=0, atol=1e-12)


@pytest.mark.parametrize("vocab", [VOCAB, 2 * ROW_MULTIPLE + 8], ids=["odd", "multiple-of-8"])
def test_loss_and_gradients_equal_the_plain_layers(vocab):
    x, weight, targets = _case(vocab=vocab)
    torch.testing.assert_close(_loss_and_grads(padded_rows_linear, x, weight, targets),
                               _loss_and_grads(F.linear, x, weight, targets), rtol=1e-12, atol=1e-12)


def test_the_losss_gradient_keeps_the_padded_rows_and_a_plain_gradient_is_padded():
    """The loss returns its gradient in the logits' own layout, which the backward reads as it is; a
    gradient without it (any other use of the logits) is padded first, with the same result."""
    x, weight, targets = _case()
    logits = padded_rows_linear(x, weight)
    seen = []
    logits.register_hook(lambda grad: seen.append(grad))
    token_cross_entropy_sum(logits, targets).backward()
    assert seen[0].stride() == logits.stride() and aligned_rows(seen[0].reshape(-1, VOCAB))
    by_loss = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    grad_out = seen[0].contiguous()
    assert not aligned_rows(grad_out.reshape(-1, VOCAB))  # VOCAB is odd: rows of an odd length
    padded_rows_linear(x, weight).backward(grad_out)
    torch.testing.assert_close((x.grad, weight.grad), by_loss, rtol=0, atol=1e-12)


def test_the_head_is_a_plain_linear_layer_on_the_cpu():
    head = OutputHead(DIM, VOCAB)
    assert head.bias is None and head.weight.shape == (VOCAB, DIM)
    x = torch.randn(2, DIM)
    logits = head(x)
    assert logits.is_contiguous()
    torch.testing.assert_close(logits, F.linear(x, head.weight), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the padded rows are a GPU layout)")
def test_on_a_gpu_the_head_pads_an_unaligned_vocabulary_in_bf16_under_autocast():
    """What the 125M recipes run: GPT-2's vocabulary, bf16 autocast, the trainer's loss, a training step's
    rows; against the plain layer under the same autocast (the same bf16 products, so at most a rounding
    of the sum's order apart)."""
    vocab, dim = 50257, 256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1024, dim, generator=g).cuda().requires_grad_()
    targets = torch.randint(0, vocab, (2, 1024), generator=g).cuda()
    head = OutputHead(dim, vocab).cuda()
    weight = head.weight.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = head(x)
        mine = [token_cross_entropy_sum(logits, targets)]
        mine += torch.autograd.grad(mine[0], (x, head.weight))
        plain = _loss_and_grads(F.linear, x, weight, targets)
    assert logits.dtype == torch.bfloat16 and logits.stride(-2) == padded_width(vocab)
    assert aligned_rows(logits.reshape(-1, vocab))
    assert [g.dtype for g in mine[1:]] == [torch.float32, torch.float32]
    for a, b in zip(mine, plain, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=2**-7, atol=1e-3 * b.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the padded rows are a GPU layout)")
def test_on_a_gpu_an_aligned_vocabulary_or_a_decoding_step_takes_the_plain_layer():
    aligned, odd = OutputHead(64, 50304).cuda(), OutputHead(64, 50257).cuda()
    assert aligned(torch.randn(4096, 64, device="cuda")).is_contiguous()
    assert odd(torch.randn(8, 1, 64, device="cuda")).is_contiguous()  # eight rows, one token each
    assert not odd(torch.randn(4096, 64, device="cuda")).is_contiguous()
