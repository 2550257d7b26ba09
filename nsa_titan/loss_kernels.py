"""Triton kernels for the token cross-entropy on a GPU: one pass over each row of logits forward, one
backward, in fp32 registers.

The chunked torch form (nsa_titan/loss.py) runs some ten kernels per chunk, each over the whole chunk
(upcast, log-sum-exp, gather; exp, subtract, scatter, multiply, downcast): on an H200 they took some
80 ms of a 470 ms nsa_125m step at 65,536 tokens and GPT-2's vocabulary. These read the logits once
forward and once backward and write the gradient once. One program per row; rows may be longer than
their vocabulary (a padded layout, see components/models/output_head.py), so each takes a row stride.
A NaN logit gives its row a NaN loss, as F.cross_entropy does; a target outside the vocabulary (which
F.cross_entropy refuses, and a GPU could only refuse by waiting for the host) gives a NaN loss and gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns a program holds at a time: 16 KiB of fp32 values
NUM_WARPS = 8


@triton.jit
def _row_losses_kernel(logits_ptr, row_stride, targets_ptr, lse_ptr, losses_ptr, vocab, ignore_index,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows * row_stride passes 2**31 at 65,536 rows of 50k
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    # Running maximum and sum of exp(x - maximum), kept per lane and combined at the end.
    peak = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new_peak = tl.maximum(peak, x, propagate_nan=tl.PropagateNan.ALL)  # a NaN logit makes the loss NaN
        # A lane that has seen only -inf keeps a zero sum (and no NaN from -inf - -inf).
        keep = tl.where(new_peak == float("-inf"), 0.0, tl.exp(peak - new_peak))
        add = tl.where(new_peak == float("-inf"), 0.0, tl.exp(x - new_peak))
        total = total * keep + add
        peak = new_peak
    row_peak = tl.max(peak, axis=0)
    row_total = tl.sum(total * tl.where(peak == float("-inf"), 0.0, tl.exp(peak - row_peak)), axis=0)
    lse = row_peak + tl.log(row_total)
    target = tl.load(targets_ptr + row)
    counted = target != ignore_index
    valid = (target >= 0) & (target < vocab)
    picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    # A target outside the vocabulary has no logit to read: its loss is NaN (the training's NaN guard names it).
    loss = tl.where(valid, lse - picked, float("nan"))
    tl.store(lse_ptr + row, lse)
    tl.store(losses_ptr + row, tl.where(counted, loss, 0.0))


@triton.jit
def _row_gradients_kernel(logits_ptr, row_stride, grad_ptr, grad_row_stride, targets_ptr, lse_ptr, scale_ptr,
                          vocab, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * grad_row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    counted = target != ignore_index
    valid = (target >= 0) & (target < vocab)
    scale = tl.where(counted, tl.where(valid, tl.load(scale_ptr).to(tl.float32), float("nan")), 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        # d(lse - x[target]) / dx = softmax(x) - onehot(target)
        g = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
        tl.store(out + start + cols, (g * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def _block(vocab: int) -> int:
    return min(BLOCK, triton.next_power_of_2(max(vocab, 1)))


def row_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss) per row of logits [N, V] (unit column stride), in fp32; an ignored target's loss is 0."""
    rows, vocab = logits.shape
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    losses = torch.empty_like(lse)
    if rows:
        _row_losses_kernel[(rows,)](logits, logits.stride(0), targets, lse, losses, vocab, ignore_index,
                                    BLOCK=_block(vocab), num_warps=NUM_WARPS)
    return lse, losses


def row_gradients(grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                  scale: torch.Tensor, ignore_index: int) -> None:
    """Write (softmax(logits) - onehot(target)) * scale into grad [N, V] (0 on an ignored row); scale is a
    0-d tensor on the logits' device (read there: no wait for the host)."""
    rows, vocab = logits.shape
    if rows:
        _row_gradients_kernel[(rows,)](logits, logits.stride(0), grad, grad.stride(0), targets, lse, scale, vocab,
                                       ignore_index, BLOCK=_block(vocab), num_warps=NUM_WARPS)
